"""What a new user meets (issue 21): honest summaries, one params figure, readable CLI and report
output, progress, warnings for plans that waste devices, and the package surface."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import shutil
import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.errors import PlanWarning  # noqa: E402
from fxpipe.mesh import format_mesh  # noqa: E402
from fxpipe.models import build_hf_model  # noqa: E402

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32, "seq_len": 8}
CLI_TINY = ["--hf", "gpt2", "--config", "n_layer=2", "n_embd=32", "n_head=2", "vocab_size=64", "n_positions=32",
            "--seq-len", "8"]
#: a number in scientific notation (1e-05, 2.69426e-06, 4.5e+11)
SCI = re.compile(r"(?<![\w.])\d+(?:\.\d+)?[eE][+-]?\d+(?![\w])")


@pytest.fixture(scope="module")
def auto_plan():
    """2 devices, v in {1, 2} tried (placement search), 4 micro-batches; quick MILP."""
    model, args, kwargs = build_hf_model("gpt2", TINY, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanWarning)  # a balanced plan wastes nothing
        return fxpipe.compile(model, args, kwargs, devices=2, microbatches=4, stages_per_device="auto",
                              time_limit_s=0.5, schedule_time_limit_s=0.5, mesh="pipeline")


def visible_text(page: str) -> str:
    """The text a reader sees: no embedded images (base64), no tags, entities decoded."""
    import html

    page = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
    page = re.sub(r"<style>.*?</style>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def _figure_line(text: str, label: str) -> tuple[float, float, str]:
    m = re.search(rf"^  {re.escape(label)}\s+([\d.]+) ms \| lower bound\s+([\d.]+) ms \| (.*)$", text, re.M)
    assert m, f"no {label!r} line in\n{text}"
    return float(m.group(1)), float(m.group(2)), m.group(3)


# ------------------------------------------------------------------------- 1. what is optimal


def test_summary_names_the_objective_and_puts_each_status_beside_its_own_figure(auto_plan):
    plan = auto_plan
    text = plan.summary()
    assert "minimises the largest per-device span" in text
    opt = plan.optimality()
    assert opt["schedule_objective"] == plan.schedule.objective == "stage_span"
    span, span_lb, span_verdict = _figure_line(text, "per-device span")
    mk, mk_lb, mk_verdict = _figure_line(text, "makespan")
    assert span == pytest.approx(plan.schedule.stage_span * 1e3, abs=1e-3)
    assert mk == pytest.approx(plan.makespan_s * 1e3, abs=1e-3)
    for value, bound, verdict, fig in ((span, span_lb, span_verdict, opt["stage_span"]),
                                       (mk, mk_lb, mk_verdict, opt["makespan"])):
        assert fig["lower_bound_s"] <= fig["value_s"] * (1 + 1e-9)
        if verdict.startswith("optimal"):  # "optimal" only where the figure meets its own bound or the MILP proved it
            assert fig["status"] == "optimal"
            assert value <= bound * (1 + 1e-6) + 1e-3 or plan.schedule.status == "optimal"
        else:
            assert "above its optimum" in verdict or "no lower bound" in verdict
    # the makespan's bound is its own, never below the span's (every device span lies inside the makespan)
    assert opt["makespan"]["lower_bound_s"] >= opt["stage_span"]["lower_bound_s"] * (1 - 1e-12)
    assert [d["device"] for d in opt["devices"]] == list(range(plan.devices))
    assert all(d["span_lower_bound_s"] <= d["span_s"] * (1 + 1e-9) for d in opt["devices"])
    # the same in JSON
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["optimality"]["makespan"]["value_s"] == pytest.approx(plan.makespan_s)


def test_makespan_bound_holds_for_other_schedules(auto_plan):
    from fxpipe.schedule.dispatch import make_schedule, methods_for_placement

    plan = auto_plan
    bound = plan.optimality()["makespan"]["lower_bound_s"]
    for method in methods_for_placement(plan.device_of_stage, plan.devices):
        if method in ("milp", "auto"):
            continue
        try:
            sched = make_schedule(plan.problem, method)
        except Exception:  # noqa: BLE001 - a method that does not fit this problem proves nothing here
            continue
        assert sched.makespan >= bound * (1 - 1e-9), method


def test_status_lines_do_not_lend_optimal_to_another_figure():
    from fxpipe.plan.core import _objective_lines

    opt = {"schedule_objective": "stage_span", "schedule_method": "zb-h1",
           "stage_span": {"value_s": 5.422e-3, "lower_bound_s": 5.422e-3, "status": "optimal", "above_bound": 0.0},
           "makespan": {"value_s": 6.232e-3, "lower_bound_s": 5.9e-3, "status": "not minimised",
                        "above_bound": 6.232 / 5.9 - 1}}
    lines = _objective_lines(opt)
    assert "per-device span" in lines[0]
    mk = next(line for line in lines if line.strip().startswith("makespan"))
    assert "6.232 ms" in mk and "5.900 ms" in mk and "optimal" not in mk and "not minimised" in mk


def test_placement_search_chosen_figure_is_labelled_and_matches_the_plan(auto_plan):
    plan = auto_plan
    text = plan.summary()
    line = next(x for x in text.splitlines() if x.startswith("placement search"))
    assert "per-device span" in line
    chosen = next(part for part in line.split(": ", 1)[1].split("; ") if "(chosen)" in part)
    m = re.search(r"span ([\d.]+) ms, makespan ([\d.]+) ms", chosen)
    assert m, chosen
    assert float(m.group(1)) == pytest.approx(plan.schedule.stage_span * 1e3, abs=1e-3)
    assert float(m.group(2)) == pytest.approx(plan.makespan_s * 1e3, abs=1e-3)


def test_summary_says_why_the_mesh_search_planned_no_pipeline():
    """Issue 32 item 4: when ``mesh="auto"`` picks pure data parallelism, one summary line gives the best pipeline's
    predicted step beside the chosen mesh's and how to force a pipeline; forcing it predicts what the line said."""
    model, args, kwargs = build_hf_model("gpt2", TINY, device="meta")
    opts = dict(devices=2, microbatches=4, time_limit_s=0.5, schedule="zb-h1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        plan = fxpipe.compile(model, args, kwargs, **opts)  # mesh="auto": this tiny model fits one device
        forced = fxpipe.compile(model, args, kwargs, mesh="pipeline", **opts)
    assert plan.devices == 1 and plan.dp == 2, plan.mesh  # no pipeline: the case this line explains
    rows = plan.options["mesh_search"]
    lines = [x for x in plan.summary().splitlines() if x.startswith("no pipeline:")]
    assert len(lines) == 1 and lines[0] == plan.no_pipeline_reason()
    line = lines[0]
    assert f"{format_mesh(plan.mesh)} predicts {plan.predicted_step_s * 1e3:.3f} ms per step" in line
    assert "--mesh pipeline" in line and 'mesh="pipeline"' in line
    assert forced.mesh["pp"] == 2 and forced.no_pipeline_reason() is None and "no pipeline:" not in forced.summary()
    assert forced.predicted_step_s >= plan.predicted_step_s  # the search kept the faster one
    planned = [r for r in rows if r["mesh"]["pp"] > 1 and "predicted_step_s" in r]
    if planned:  # a pipeline was planned: the line gives its prediction, which forcing it reproduces
        best = min(planned, key=lambda r: r["predicted_step_s"])
        assert f"the best pipeline, {best['mesh_text']}, predicts {best['predicted_step_s'] * 1e3:.3f} ms per step" in line
        assert forced.mesh == best["mesh"]
        assert forced.predicted_step_s == pytest.approx(best["predicted_step_s"], rel=1e-9)
    else:  # every pipeline pruned by a bound: the line names the best by its bound and why, and the bound holds
        best = min((r for r in rows if r["mesh"]["pp"] > 1), key=lambda r: r["lower_bound_s"])
        assert line.startswith("no pipeline: no pipeline was planned") and best["mesh_text"] in line
        assert best["skipped"] in line
        same = [r for r in rows if r["mesh"] == forced.mesh]
        assert same and forced.predicted_step_s >= same[0]["lower_bound_s"] * (1 - 1e-9)  # the prune was sound
    # every pipeline skipped (pruned or not fitting): the line gives the best one's reason instead of a prediction
    skipped = [{k: v for k, v in r.items() if k not in ("step_time_s", "predicted_step_s")} |
               ({"skipped": "cannot fit: the static state alone needs 9 GiB"} if r["mesh"]["pp"] > 1 else {})
               for r in rows]
    text = plan.replace(options={**plan.options, "mesh_search": skipped}).no_pipeline_reason()
    assert text.startswith("no pipeline: no pipeline was planned") and "cannot fit: the static state alone" in text
    assert f"{format_mesh(plan.mesh)} predicts {plan.predicted_step_s * 1e3:.3f} ms" in text and "--mesh pipeline" in text


# ------------------------------------------------------------------------- 2. one params figure


def test_one_params_figure_in_the_plans_precision(auto_plan):
    from fxpipe.io import format_bytes as _fmt_bytes

    plan = auto_plan
    text = plan.summary()
    rows = [x for x in text.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d+\s", x)][: plan.num_stages]
    for s, row in zip(plan.stages, rows):
        assert s.params_bytes != s.param_bytes  # mixed-adam: bf16 weights, graph in fp32
        assert _fmt_bytes(s.params_bytes) in row and _fmt_bytes(s.param_bytes) not in row, row
    mem = plan.memory_summary()
    assert isinstance(mem, str) and mem in text


# ------------------------------------------------------------------------- 3 + 4. CLI, report, trace


def test_cli_plan_report_trace_readable(tmp_path, capsys):
    from fxpipe.cli import main

    html_path, trace_path = tmp_path / "r.html", tmp_path / "t.json"
    code = main(["plan", *CLI_TINY, "--devices", "2", "--mesh", "pipeline", "--microbatches", "4", "--time-limit", "0.5",
                 "--report", str(html_path), "--bounds-time-limit", "5", "--trace", str(trace_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "{'" not in out and "lower_bounds" not in out  # a table, not a Python dict
    table = out[out.index("partition lower bounds"):]
    assert re.search(r"^\s+simple\s+[\d.]+\s+[\d.]+\s+closed_form", table, re.M), table
    assert "fxpipe: capture" not in err  # stderr is not a terminal: no progress
    # the trace: F/B/W per stage and device, Trace Event Format
    doc = json.loads(trace_path.read_text())
    ops = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["type"] for e in ops} == {"F", "B", "W"} and {e["pid"] for e in ops} == {0, 1}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in ops)
    page = html_path.read_text()
    assert 'href="t.json"' in page
    text = visible_text(page)
    assert not SCI.findall(text), SCI.findall(text)[:5]
    assert "GB/s" in text and "ms" in text
    assert "Lemma 3.3" in text and "skipped" in text  # the chain proves this partition: MIPs skipped, marked
    assert "79.18 GiB" in text or "79.2 GiB" in text  # the plan's capacity is shown (h100-sxm: 85.02e9 bytes, CUDA's total_memory)


def test_cli_shows_the_warning_of_a_mesh_search_stopped_by_ctrl_c(monkeypatch, capsys):
    """A press during the mesh search returns the best mesh so far; the CLI prints the search's PlanWarning (it
    used to drop every PlanWarning the summary did not carry, so the documented warning never appeared)."""
    import signal

    import fxpipe.mesh.search as search_mod
    from fxpipe.cli import main

    real = search_mod._plan_or_reuse

    def plan_then_press(*a, **kw):  # Ctrl-C right after the first candidate is planned
        out = real(*a, **kw)
        signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(search_mod, "_plan_or_reuse", plan_then_press)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # the search installs its handler over the default
    try:
        code = main(["plan", *CLI_TINY, "--devices", "2", "--microbatches", "4", "--time-limit", "0.5",
                     "--schedule", "zb-h1"])
    finally:
        signal.signal(signal.SIGINT, old)
    out = capsys.readouterr().out
    assert code == 130  # an interrupted result says so in its exit code (issue 30 item 10)
    assert "not planned: the search was stopped (Ctrl-C) before it" in out  # the table's rows
    assert re.search(r"^warning: the mesh search was stopped \(Ctrl-C\) with [1-9]\d* candidate\(s\) not planned",
                     out, re.M), out


def test_report_text_has_no_scientific_notation(tmp_path):
    from fxpipe.ir import OpGraph
    from fxpipe.partition.bounds import compute_bounds
    from fxpipe.report import write_report

    rng = np.random.default_rng(1)
    n = 9
    g = OpGraph.from_arrays(t_fwd_s=rng.uniform(1e-6, 3e-6, n), size_out_bytes=rng.uniform(1e3, 1e7, n),
                            edges=[(i, i + 1) for i in range(n - 1)], name="g",
                            ops=["placeholder"] + ["call_function"] * (n - 2) + ["output"])
    rep = compute_bounds(g, 3, methods=("simple", "chain", "exact"), time_limit_s=5, search_time_limit_s=0.2,
                         progress=False)
    out = write_report(g, rep.partition, rep, tmp_path / "r.html", tmp_path / "r.md", charts=False)
    for path in out.values():
        text = visible_text(path.read_text())
        assert not SCI.findall(text), SCI.findall(text)[:5]


def test_gantt_rows_carry_data_only(auto_plan):
    from fxpipe.ir import Schedule, ScheduledOp
    from fxpipe.report.gantt import gantt_rows

    plan = auto_plan
    assert not any(o.type in ("O", "R") for o in plan.schedule.ops)
    _, labels = gantt_rows(plan.problem, plan.schedule)
    assert len(labels) == plan.devices and not any("copy" in x for x in labels)
    f = next(o for o in plan.schedule.ops if o.type == "F" and plan.device_of_stage[o.stage] == 0)
    extra = ScheduledOp(stage=f.stage, type="O", microbatch=f.microbatch, start_s=f.end_s, end_s=f.end_s + 1e-6)
    sched = dataclasses.replace(plan.schedule, ops=plan.schedule.ops + (extra,))
    assert isinstance(sched, Schedule)
    _, labels = gantt_rows(plan.problem, sched)
    assert len(labels) == plan.devices + 1 and sum("copy" in x for x in labels) == 1


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="needs /usr/bin/chromium")
def test_report_renders_in_headless_chromium(tmp_path):  # pragma: no cover - only where Chromium is installed
    import subprocess

    from fxpipe.report import write_plan_report

    model, args, kwargs = build_hf_model("gpt2", TINY, device="meta")
    plan = fxpipe.compile(model, args, kwargs, devices=2, microbatches=4, time_limit_s=0.5, schedule_time_limit_s=0, mesh="pipeline")
    out = write_plan_report(plan, tmp_path / "r.html", bounds_time_limit_s=5)
    shot = tmp_path / "shot.png"
    run = subprocess.run([shutil.which("chromium") or "/usr/bin/chromium", "--headless", "--disable-gpu", "--no-sandbox",
                          f"--screenshot={shot}", "--window-size=1200,2400", "--enable-logging=stderr", "--v=0",
                          f"file://{out['html']}"], capture_output=True, text=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000, run.stderr[-2000:]
    assert "Uncaught" not in run.stderr and "CONSOLE(" not in run.stderr, run.stderr[-2000:]


# ------------------------------------------------------------------------- progress


def test_phase_progress_shows_long_phases_only_when_enabled():
    from fxpipe.progress import phase

    buf = io.StringIO()
    with phase("long phase", delay_s=0.05, file=buf, on=True):
        time.sleep(0.4)
    assert "fxpipe: long phase" in buf.getvalue()
    quick = io.StringIO()
    with phase("quick phase", delay_s=1.0, file=quick, on=True):
        pass
    assert quick.getvalue() == ""
    off = io.StringIO()
    with phase("off phase", delay_s=0.0, file=off, on=False):
        time.sleep(0.1)
    assert off.getvalue() == ""


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_phase_progress_reaches_a_terminal_without_a_size():
    """A pty that reports 0 x 0 (as under `script`, CI runners): tqdm hid the line there."""
    import select
    import subprocess
    import sys

    master, slave = os.openpty()
    code = "import time\nfrom fxpipe.progress import phase\nwith phase('long phase', on=True, delay_s=0.1):\n    time.sleep(0.6)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=30) == 0
    assert b"fxpipe: long phase" in out, out


def test_cli_progress_only_for_a_terminal_without_json(monkeypatch):
    import argparse

    import fxpipe.cli.plan_cmd as plan_cmd

    seen = {}

    def fake_compile(*a, **kw):
        seen["progress"] = kw.get("progress")
        raise KeyboardInterrupt  # stop after the call

    monkeypatch.setattr(fxpipe, "compile", fake_compile, raising=False)
    monkeypatch.setattr(plan_cmd, "stderr_is_terminal", lambda: True)
    base = ["plan", *CLI_TINY, "--devices", "2", "--mesh", "pipeline"]
    parser = argparse.ArgumentParser()
    plan_cmd.register(parser.add_subparsers())
    for extra, want in (([], True), (["--json"], False)):
        args = parser.parse_args(base + extra)
        with pytest.raises(KeyboardInterrupt):
            plan_cmd.run(args)
        assert seen.pop("progress") is want, extra


# ------------------------------------------------------------------------- 6. waste, budget, capacity


def test_plans_that_waste_devices_warn_with_the_better_choice():
    model, args, kwargs = build_hf_model("gpt2", {"n_layer": 1, "seq_len": 8}, device="meta")  # lm_head dominates
    with pytest.warns(PlanWarning) as rec:
        plan = fxpipe.compile(model, args, kwargs, devices=12, microbatches=2, schedule="1f1b", time_limit_s=0.3, mesh="pipeline")
    msgs = [str(w.message) for w in rec if issubclass(w.category, PlanWarning)]
    assert any("2 micro-batches for 12 devices" in m and "at least 12 micro-batches" in m for m in msgs), msgs
    idle = [m for m in msgs if "the work would fill about" in m]
    assert idle, msgs
    k = int(re.search(r"plan for (\d+) devices instead of 12", idle[0]).group(1))
    assert 1 <= k < 12
    assert "warning: " in plan.summary()


def test_auto_milp_budget_scales_with_the_problem():
    from fxpipe.api import DEFAULT_AUTO_MILP_TIME_LIMIT_S, auto_milp_budget_s
    from fxpipe.ir import ScheduleProblem
    from fxpipe.schedule.auto import AUTO_MILP_MAX_OPS

    def prob(S, m):
        one = np.ones(S)
        return ScheduleProblem.create(num_stages=S, num_microbatches=m, t_f=one, t_b=one, t_w=one, t_comm=np.zeros(S - 1))

    toy, big = auto_milp_budget_s(prob(2, 4)), auto_milp_budget_s(prob(4, AUTO_MILP_MAX_OPS // 12))
    assert 0 < toy < big == pytest.approx(DEFAULT_AUTO_MILP_TIME_LIMIT_S)


def test_measured_hardware_capacity_is_the_machines(monkeypatch, tmp_path):
    import fxpipe.cost.profile as prof
    from fxpipe.cost.hardware import HARDWARE

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mem = prof.device_memory_bytes("cpu")
    assert 0 < mem <= physical

    class _Profile:
        def hardware(self):
            return dataclasses.replace(HARDWARE["cpu"], memory_bytes=10 * physical)  # a datasheet figure > the machine

    monkeypatch.setattr("fxpipe.cost.suite.measured_profile", lambda *a, **k: _Profile())
    monkeypatch.setattr("fxpipe.cost.suite.run_suite", lambda *a, **k: None)
    spec = prof.measured_hardware(tmp_path / "db.json", device="cpu", threads=1, min_measurements=0)
    assert spec.memory_bytes == pytest.approx(mem) and spec.memory_bytes <= physical


# ------------------------------------------------------------------------- 5. package surface


def test_submodules_are_attributes_of_the_package():
    assert fxpipe.__getattr__("models").build_hf_model is build_hf_model
    with pytest.raises(AttributeError):
        fxpipe.__getattr__("no_such_thing")


# ------------------------------------------------------------------------- 7. common API mistakes


@pytest.mark.parametrize("args, kwargs, needle", [
    ("tensor", None, "args=(x,)"),
    ("dict", None, "kwargs={...}"),
    ((), "tensor", "kwargs must be a dict"),
])
def test_compile_says_what_to_pass_for_common_mistakes(args, kwargs, needle):
    from fxpipe.errors import InputError

    x = torch.randn(2, 4)
    model = torch.nn.Linear(4, 4)
    args = {"tensor": x, "dict": {"input": x}}.get(args, args) if isinstance(args, str) else args
    kwargs = x if kwargs == "tensor" else kwargs
    with pytest.raises(InputError, match=re.escape(needle)):
        fxpipe.compile(model, args, kwargs, devices=2, microbatches=2, mesh="pipeline")
