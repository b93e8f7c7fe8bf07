"""Schedule pictures (fxpipe.report.gantt, fxpipe.report.trace): Gantt PNG/SVG and a Chrome/Perfetto trace."""

from __future__ import annotations

import json

import pytest

from fxpipe.errors import InputError
from fxpipe.ir import ScheduleProblem
from fxpipe.schedule import heuristics
from fxpipe.report import chrome_trace, gantt


@pytest.fixture(scope="module")
def case():
    p = ScheduleProblem.create(num_stages=3, num_microbatches=4, t_f=1e-3, t_b=1.2e-3, t_w=0.8e-3, t_comm=1e-4,
                               t_offload=4e-4, mem_f=1.0, mem_limit=2.0)
    return p, heuristics.generate(p, "pipeoffload")


def test_gantt_writes_png_and_svg(tmp_path, case):
    p, sched = case
    out = gantt(p, sched, tmp_path / "g.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = gantt(p, sched, tmp_path / "sub" / "g.svg")
    assert b"<svg" in svg.read_bytes()[:2000]
    with pytest.raises(InputError):
        gantt(p, sched, tmp_path / "g.txt")


def test_chrome_trace_is_valid_json_with_real_durations(tmp_path, case):
    p, sched = case
    out = chrome_trace(sched, tmp_path / "trace.json")
    doc = json.loads(out.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(sched.ops)
    by_key = {(o.stage, o.microbatch, o.type): o for o in sched.ops}
    for e in events:
        o = by_key[(e["args"]["stage"], e["args"]["microbatch"], e["args"]["type"])]
        assert e["pid"] == o.stage
        assert e["tid"] == (1 if o.type in ("O", "R") else 0)
        assert e["ts"] == pytest.approx(o.start_s * 1e6)
        assert e["dur"] == pytest.approx((o.end_s - o.start_s) * 1e6)
    assert any(e["tid"] == 1 for e in events)  # offloads are on the copy stream
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert {e["args"]["name"] for e in meta if e["name"] == "thread_name"} == {"compute", "copy"}
