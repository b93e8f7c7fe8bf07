"""Times for people come from the one formatter, fxpipe.io (issue 30, item 11): positional notation in the mesh
search table, the plan summary (and the HTML / Markdown reports that embed it), never ``1.363e+04 ms`` nor a
300-digit number."""

from __future__ import annotations

import re

from fxpipe.io import fixed, format_ms, ms_column
from fxpipe.ir import OpGraph
from fxpipe.plan.core import _mesh_search_table


def test_the_formatter_writes_positional_notation_and_stays_short():
    assert format_ms(13.63) == "13 630.000 ms" and format_ms(5.7e-4) == "0.5700 ms" and format_ms(None) == "-"
    assert fixed(1e-5) == "0.00001000" and fixed(float("inf")) == "unlimited"
    assert ms_column([13.63, 0.002, 1.5]) == ["13630.000", "2.000", "1500.000"]
    assert ms_column([2e-8, 1e-7]) == ["0.0000200", "0.0001000"]  # one number of decimals for the column
    for huge in (1e300, -1e300):  # no validated input gets here; still no 300 digits
        assert len(fixed(huge)) < 12 and len(ms_column([huge])[0]) < 12


def test_mesh_search_table_prints_milliseconds_in_positional_notation():
    rows = [{"mesh_text": "pp=4", "lower_bound_s": 12.9, "step_time_s": 13.63, "dp_sync_s": 0.0,
             "predicted_step_s": 13.63, "chosen": True},
            {"mesh_text": "pp=2 x dp_shard=2", "lower_bound_s": 14.1, "step_time_s": 14.5, "exposed_sync_s": 0.25,
             "predicted_step_s": 14.75},
            {"mesh_text": "dp_shard=4", "lower_bound_s": 20.0, "skipped": "pruned: its lower bound is no better"}]
    text = "\n".join(_mesh_search_table(rows))
    assert "e+" not in text and "e-" not in text, text
    assert re.search(r"pp=4\s+12900\.000\s+13630\.000\s+0\.000\s+13630\.000 \(chosen\)", text), text
    assert re.search(r"pp=2 x dp_shard=2\s+14100\.000\s+14500\.000\s+250\.000\s+14750\.000", text), text
    assert re.search(r"dp_shard=4\s+20000\.000\s+-\s+-\s+-\s+skipped", text), text


def test_plan_summary_of_slow_stages_has_no_scientific_notation():
    """A plan whose stages take seconds (and whose mesh search tried several meshes): every time in its
    summary, the text the HTML and Markdown reports embed, in positional notation."""
    from fxpipe.api import plan_graph
    from fxpipe.plan import Plan
    from fxpipe.plan.file import graph_signature
    from fxpipe.plan.tables import device_stats, stage_stats

    n = 6
    g = OpGraph.from_arrays(t_fwd_s=[0.0, 7.0, 6.5, 7.0, 6.9, 0.0], t_bwd_input_s=[0.0, 7.0, 6.0, 7.0, 6.0, 0.0],
                            size_out_bytes=[1e6] * n, act_bytes=[1e6] * n, edges=[[i, i + 1] for i in range(n - 1)],
                            ops=["placeholder"] + ["call_function"] * (n - 2) + ["output"], bandwidth_bytes_per_s=1e9)
    part, problem, sched, timings = plan_graph(g, devices=2, microbatches=4, schedule="1f1b", time_limit_s=0.2)
    tables = (g, part, problem, sched, "training", None)
    rows = [{"mesh_text": "pp=2", "lower_bound_s": 50.0, "step_time_s": sched.value, "dp_sync_s": 0.0,
             "predicted_step_s": sched.value, "chosen": True}]
    plan = Plan(name="slow", devices=2, microbatches=4, hardware="h100-sxm", objective="training", comm="relay",
                graph=g, partition=part, stage_of={g.names[i]: int(part.assignment[i]) for i in range(n)},
                problem=problem, schedule=sched, stages=stage_stats(*tables), device_table=device_stats(*tables),
                timings_s=timings, graph_signature=graph_signature(g), options={"seed": 0, "mesh_search": rows})
    text = plan.summary()
    assert sched.value > 10 and not re.search(r"\de[+-]\d", text), text
    assert format_ms(sched.value) in text and f"{sched.value * 1e3:.3f}" in text  # the figure, twice
