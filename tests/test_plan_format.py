"""The plan file (fxpipe.plan.file): /2 round-trips, keeps every /1 field, and /1 files of the oldest layout load;
the shared planning options (fxpipe.options). Torch-free plans of a hand-made chain graph: fast."""

import dataclasses
import inspect
import json

import numpy as np
import pytest

import fxpipe
from fxpipe.api import compile as fx_compile
from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.options import DEFAULTS, PlanOptions
from fxpipe.plan import Plan
from fxpipe.plan.file import graph_signature
from fxpipe.plan.tables import device_stats, stage_stats
from fxpipe.planner import plan_graph

#: Every top-level field a fxpipe.plan/1 file had (fxpipe 0.1.0): /2 may add fields, never drop or rename one.
V1_FIELDS = ("format", "name", "devices", "mesh", "dp_sync_s", "num_stages", "stages_per_device", "placement",
             "device_of_stage", "microbatches", "hardware", "objective", "comm", "graph_signature", "options",
             "bottleneck_s", "makespan_s", "bubble_ratio", "optimality", "timings_s", "stages", "device_table",
             "memory", "stage_of", "partition", "problem", "schedule", "graph")
V1_STAGE_FIELDS = ("stage", "device", "num_ops", "param_bytes", "t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s",
                   "cost_s", "activation_peak_bytes", "memory_bytes", "params_bytes", "grads_bytes", "optimizer_bytes",
                   "comm_buffer_bytes", "reserved_bytes", "offloaded_peak_bytes", "capacity_bytes", "recompute")
V1_DEVICE_FIELDS = ("device", "stages", "num_ops", "param_bytes", "t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s",
                    "cost_s", "busy_s", "span_s", "activation_peak_bytes", "memory_bytes", "params_bytes",
                    "grads_bytes", "optimizer_bytes", "comm_buffer_bytes", "reserved_bytes", "offloaded_peak_bytes",
                    "capacity_bytes")


def _chain_plan(stages_per_device=1) -> Plan:
    """A plan of a 6-op chain on 2 devices, made without torch (plan_graph + the tables)."""
    n = 6
    g = OpGraph.from_arrays(
        t_fwd_s=[0.0, 1.0, 2.0, 1.0, 2.0, 0.0], t_bwd_input_s=[0.0, 1.0, 2.0, 1.0, 2.0, 0.0], size_out_bytes=[1.0] * n,
        act_bytes=[1.0] * n, size_param_bytes=[0.0, 4.0, 4.0, 4.0, 4.0, 0.0], edges=[[i, i + 1] for i in range(n - 1)],
        ops=["placeholder"] + ["call_function"] * (n - 2) + ["output"], bandwidth_bytes_per_s=1.0,
    )
    part, problem, sched, timings = plan_graph(g, devices=2, microbatches=4, schedule="1f1b" if stages_per_device == 1
                                               else None, stages_per_device=stages_per_device, time_limit_s=0.2)
    tables = (g, part, problem, sched, "training", None)
    return Plan(name="chain", devices=2, microbatches=4, hardware="h100-sxm", objective="training", comm="relay",
                graph=g, partition=part, stage_of={g.names[i]: int(part.assignment[i]) for i in range(n)},
                problem=problem, schedule=sched, stages=stage_stats(*tables), device_table=device_stats(*tables),
                timings_s=timings, graph_signature=graph_signature(g), options={"seed": 0})


def _json(doc):
    return json.loads(json.dumps(doc))


def test_v2_round_trips_and_keeps_every_v1_field():
    plan = _chain_plan()
    doc = _json(plan.to_dict())
    assert doc["format"] == "fxpipe.plan/2" and doc["fxpipe_version"] == fxpipe.__version__
    assert set(V1_FIELDS) <= set(doc)
    assert all(set(V1_STAGE_FIELDS) <= set(s) for s in doc["stages"])
    assert all(set(V1_DEVICE_FIELDS) <= set(d) for d in doc["device_table"])
    loaded = Plan.from_dict(doc)
    assert _json(loaded.to_dict()) == doc
    assert loaded.orders() == plan.orders() and loaded.mesh == plan.mesh
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.options = {}
    with pytest.raises(InputError, match="not an fxpipe.plan/2"):
        Plan.from_dict({**doc, "format": "fxpipe.plan/3"})


def test_v1_file_of_the_oldest_layout_loads(tmp_path):
    """A /1 file from before placements, meshes, the device table and the memory model: the loader fills them in."""
    plan = _chain_plan()
    new = _json(plan.to_dict())
    old = {k: new[k] for k in ("name", "devices", "microbatches", "hardware", "objective", "comm", "graph_signature",
                               "options", "bottleneck_s", "makespan_s", "bubble_ratio", "timings_s", "stage_of",
                               "partition", "problem", "schedule", "graph")}
    old["format"] = "fxpipe.plan/1"
    keep = ("stage", "num_ops", "param_bytes", "t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s", "cost_s",
            "activation_peak_bytes", "memory_bytes")
    old["stages"] = [{k: s[k] for k in keep} for s in new["stages"]]
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = fxpipe.load_plan(tmp_path / "old.json")
    assert loaded.mesh == {"pp": 2, "dp_shard": 1, "dp_replicate": 1} and loaded.placement == "looped"
    assert [s.device for s in loaded.stages] == [0, 1] and len(loaded.device_table) == 2
    assert _json(loaded.to_dict())["device_table"] == new["device_table"]
    assert loaded.orders() == plan.orders()
    old["stage_of"] = {k: 1 - v for k, v in old["stage_of"].items()}
    (tmp_path / "bad.json").write_text(json.dumps(old))
    with pytest.raises(InputError, match="stage_of disagrees"):
        fxpipe.load_plan(tmp_path / "bad.json")


def test_reschedule_returns_a_new_frozen_plan_sharing_the_capture():
    plan = _chain_plan()
    other = plan.reschedule("gpipe")
    assert other is not plan and other.schedule.method == "gpipe" and plan.schedule.method == "1f1b"
    assert other.capture is plan.capture and other.partition is plan.partition
    assert other.options["schedule"] == "gpipe" and "schedule" not in plan.options


def test_compile_and_plan_graph_take_the_options_of_plan_options():
    """One declaration: both public signatures carry every option with PlanOptions' default."""
    for fn, skip in ((fx_compile, {"host_bandwidth_bytes_per_s"}), (plan_graph, set())):
        params = inspect.signature(fn).parameters
        for f in dataclasses.fields(PlanOptions):
            if f.name not in skip:
                assert params[f.name].default == getattr(DEFAULTS, f.name), (fn.__name__, f.name)
    opts = PlanOptions.from_keywords({"seed": 3, "placement": "auto", "unrelated": 1})
    assert opts.seed == 3 and opts.placement_candidates() == [(1, "looped")]
    assert PlanOptions(stages_per_device="auto", placement="auto").placement_candidates() == [
        (1, "looped"), (2, "looped"), (2, "v")]
    for bad, message in ((dict(objective="speed"), "objective must be"), (dict(schedule="fast"), "schedule must be"),
                         (dict(placement="zigzag"), "placement must be"), (dict(stages_per_device=0), ">= 1")):
        with pytest.raises(InputError, match=message):
            PlanOptions(**bad)


def test_plan_tables_share_the_memory_columns():
    plan = _chain_plan(stages_per_device=2)
    assert plan.num_stages == 4 and plan.stages_per_device == 2
    for row in (*plan.stages, *plan.device_table):
        assert row.fits and row.memory_bytes >= row.params_bytes
    assert sum(d.num_ops for d in plan.device_table) == sum(s.num_ops for s in plan.stages) == 6
    assert np.isclose(sum(d.param_bytes for d in plan.device_table), 16.0)


def test_plan_of_an_older_memory_model_keeps_its_tables_with_a_warning():
    """Plans saved before the receive buffers were counted as the runtime holds them carry tables the
    current model cannot recompute from their schedule problem: they load with a PlanWarning and their
    (conservative) tables as saved; a current plan's edited table is still refused."""
    from fxpipe.errors import PlanWarning
    from fxpipe.plan.file import MEMORY_MODEL_VERSION

    doc = _json(_chain_plan().to_dict())
    assert doc["memory_model"] == MEMORY_MODEL_VERSION
    old = {k: v for k, v in doc.items() if k != "memory_model"}
    old["device_table"] = [{**d, "comm_buffer_bytes": d["comm_buffer_bytes"] + 1.0} for d in old["device_table"]]
    with pytest.warns(PlanWarning, match="memory model 1"):
        loaded = Plan.from_dict(old)
    assert [d.comm_buffer_bytes for d in loaded.device_table] == [d["comm_buffer_bytes"] for d in old["device_table"]]
    with pytest.raises(InputError, match="the device table was edited"):
        Plan.from_dict({**old, "memory_model": MEMORY_MODEL_VERSION})
