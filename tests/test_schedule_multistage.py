"""Schedules with several stages per device: interleaved 1F1B, ZB-V, DualPipe-V, the device
greedy and the MILP on placements.

Oracles: torch's own order generators (``_calculate_single_rank_operations`` of
ScheduleInterleaved1F1B / ScheduleZBVZeroBubble / ScheduleDualPipeV, test-only use of
torch's private API); the Contract-3 validator on random problems (hypothesis); the
exhaustive per-device enumeration of ``tests/naive_schedule.py``; published properties
(ZB-V's zero bubble at 1F1B's memory, DualPipe-V's PP + 1 activations).
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
from _torch_actions import torch_action_names
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from naive_schedule import exhaustive_device_optimum

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import ScheduleProblem, looped_placement, v_placement
from fxpipe.schedule import (
    combinatorial_lower_bound,
    device_busy_s,
    device_spans,
    dualpipe_v,
    generate,
    interleaved_1f1b,
    milp,
    one_f_one_b,
    orders_dualpipe_v,
    orders_interleaved_1f1b,
    orders_zbv,
    peak_memory,
    zb_v,
)
from fxpipe.schedule.validate import check_schedule

MULTI = ("greedy", "interleaved-1f1b", "zb-v", "dualpipe-v")


def _torch_rows(cls, **attrs):
    """Per-rank actions of a torch schedule class in fxpipe's vocabulary (test-only private API)."""
    obj = object.__new__(cls)
    for k, v in attrs.items():
        setattr(obj, k, v)

    return [torch_action_names(obj._calculate_single_rank_operations(r)) for r in range(attrs["pp_group_size"])]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_orders_are_torchs(p):
    from torch.distributed.pipelining.schedules import (
        ScheduleDualPipeV,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    for m in sorted({1, 2, p, 2 * p - 1, 2 * p, 3 * p + 1}):
        mine = [[str(a) for a in row] for row in orders_zbv(p, m).actions]
        assert mine == _torch_rows(ScheduleZBVZeroBubble, pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
        if m >= 2 * p:
            mine = [[str(a) for a in row] for row in orders_dualpipe_v(p, m).actions]
            assert mine == _torch_rows(ScheduleDualPipeV, pp_group_size=p, _num_stages=2 * p, num_stages=2 * p,
                                       _n_microbatches=m)
        for v in (2, 3):
            rounds = max(1, m // p)
            if m % rounds:
                continue  # torch refuses these; fxpipe uses rounds of unequal size
            mine = [[str(a) for a in row] for row in orders_interleaved_1f1b(p, v, m).actions]
            assert mine == _torch_rows(ScheduleInterleaved1F1B, pp_group_size=p, n_local_stages=v, _n_microbatches=m,
                                       number_of_rounds=rounds, microbatches_per_round=m // rounds)


@st.composite
def placed_problems(draw):
    p = draw(st.integers(1, 4))
    v = draw(st.sampled_from([1, 2, 2, 3]))
    kind = draw(st.sampled_from(["looped", "v"]))
    S = p * v
    m = draw(st.integers(1, 9))
    t = st.sampled_from([0.5, 1.0, 1.5, 2.0])
    frac = [draw(st.sampled_from([0.0, 0.5, 1.0])) for _ in range(S)]
    mem_f = [draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in range(S)]
    dev = looped_placement(p, v) if kind == "looped" else v_placement(p, v)
    per_dev = [sum(mem_f[s] for s in range(S) if dev[s] == d) for d in range(p)]
    factor = draw(st.sampled_from([0.8, 1.0, 1.5, 3.0, math.inf]))
    return ScheduleProblem.create(
        num_stages=S, num_microbatches=m, num_devices=p, device_of_stage=dev,
        t_f=[draw(t) for _ in range(S)], t_b=[draw(t) for _ in range(S)],
        t_w=[draw(st.sampled_from([0.0, 0.5, 1.0])) for _ in range(S)],
        t_comm=[draw(st.sampled_from([0.0, 0.25, 1.0])) for _ in range(S - 1)],
        mem_f=mem_f, mem_b=[-f * a for f, a in zip(frac, mem_f)], mem_w=[-(1 - f) * a for f, a in zip(frac, mem_f)],
        offload_bytes=0.0, mem_limit=[x * factor for x in per_dev],
        objective=draw(st.sampled_from(["stage_span", "makespan"])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placed_problems())
def test_every_generator_is_valid_on_random_placed_problems(problem):
    lb = combinatorial_lower_bound(problem)
    produced = 0
    for method in MULTI:
        try:
            sched = generate(problem, method)
        except InputError as exc:  # a placement the method does not schedule
            assert "placement" in str(exc) or "micro-batches" in str(exc) or "stages per device" in str(exc)
            continue
        except InfeasibleError as exc:
            assert "limit" in str(exc) or "budget" in str(exc)
            continue
        produced += 1
        assert check_schedule(problem, sched) == [], method
        assert sched.value >= lb - 1e-9
        assert (peak_memory(problem, sched) <= problem.mem_limit * (1 + 1e-9)).all()
    fits = all(sum(problem.mem_f[s] for s in problem.stages_of_device(d)) <= problem.mem_limit[d]
               for d in range(problem.num_devices))
    if fits:
        assert produced >= 1  # the device greedy fits whenever one micro-batch per device does


def test_interleaved_is_1f1b_for_one_stage_per_device_and_shortens_the_pipeline():
    for p, m in ((2, 4), (4, 8), (3, 7)):
        ident = ScheduleProblem.create(num_stages=p, num_microbatches=m, t_f=2, t_b=2, t_w=2, objective="makespan")
        assert interleaved_1f1b(ident).ops == one_f_one_b(ident).ops
        # the same work cut into 2 chunks per device (looped): the warm-up bubble shrinks
        two = ScheduleProblem.create(num_stages=2 * p, num_microbatches=m, t_f=1, t_b=1, t_w=1, objective="makespan",
                                     device_of_stage=looped_placement(p, 2))
        assert interleaved_1f1b(two).makespan < one_f_one_b(ident).makespan


def test_interleaved_lowers_its_warmup_to_fit_memory():
    prob = ScheduleProblem.create(num_stages=8, num_microbatches=8, t_f=1, t_b=1, t_w=1,
                                  device_of_stage=looped_placement(4, 2))
    free = interleaved_1f1b(prob)
    peak = peak_memory(prob, free)
    tight = prob.replace(mem_limit=float(peak.max()) - 2)
    s = interleaved_1f1b(tight)
    assert check_schedule(tight, s) == [] and s.meta["warmup_cap"] is not None
    assert s.value >= free.value
    with pytest.raises(InfeasibleError, match="device 0"):
        interleaved_1f1b(prob.replace(mem_limit=2.0))


def test_zbv_has_zero_bubble_at_1f1b_memory():
    # Qi et al. 2024 (controllable memory): ZB-V, F = B = W, peak 2p chunk stashes = 1F1B's
    for p in (2, 4, 8):
        for m in (2 * p, 3 * p):
            prob = ScheduleProblem.create(num_stages=2 * p, num_microbatches=m, t_f=1, t_b=1, t_w=1,
                                          device_of_stage=v_placement(p), offload_bytes=0.0)
            s = zb_v(prob)
            assert check_schedule(prob, s) == []
            assert np.allclose(device_spans(prob, s), device_busy_s(prob))  # zero bubble on every device
            assert peak_memory(prob, s).max() == 2 * p


def test_zbv_under_tight_memory_falls_back_to_the_greedy():
    prob = ScheduleProblem.create(num_stages=8, num_microbatches=8, t_f=1, t_b=1, t_w=1, mem_b=-0.5, mem_w=-0.5,
                                  device_of_stage=v_placement(4), mem_limit=5.0, offload_bytes=0.0)
    s = zb_v(prob)
    assert check_schedule(prob, s) == [] and s.meta["source"] == "greedy"
    with pytest.raises(InfeasibleError, match="device 0"):
        zb_v(prob.replace(mem_limit=1.5))  # one micro-batch needs both stashes of a device


def test_dualpipe_v_memory_is_pp_plus_one_activations():
    # DeepSeek-V3 Table 2 / DualPipe README: DualPipeV holds PP + 1 chunk activations (PP = 2p stages)
    for p in (2, 4, 8):
        prob = ScheduleProblem.create(num_stages=2 * p, num_microbatches=2 * p, t_f=1, t_b=1, t_w=1,
                                      device_of_stage=v_placement(p), offload_bytes=0.0)
        s = dualpipe_v(prob)
        assert check_schedule(prob, s) == []
        assert peak_memory(prob, s).max() == 2 * p + 1
        with pytest.raises(InfeasibleError, match="over its limit"):
            dualpipe_v(prob.replace(mem_limit=2 * p))
    with pytest.raises(InputError, match="at least 2p"):
        dualpipe_v(ScheduleProblem.create(num_stages=4, num_microbatches=3, t_f=1, t_b=1, t_w=1,
                                          device_of_stage=v_placement(2)))


def test_placement_mismatch_is_refused():
    looped = ScheduleProblem.create(num_stages=4, num_microbatches=4, t_f=1, t_b=1, t_w=1,
                                    device_of_stage=looped_placement(2, 2))
    vshape = looped.replace(device_of_stage=v_placement(2))
    for method in ("zb-v", "dualpipe-v"):
        with pytest.raises(InputError, match="V-shape"):
            generate(looped, method)
    with pytest.raises(InputError, match="looped"):
        generate(vshape, "interleaved-1f1b")
    odd = ScheduleProblem.create(num_stages=3, num_microbatches=2, t_f=1, t_b=1, t_w=1, device_of_stage=[0, 1, 0])
    assert check_schedule(odd, generate(odd, "greedy")) == []


# ------------------------------------------------------------------------------ MILP on placements
ORACLE = [
    dict(device_of_stage=(0, 1, 1, 0), num_microbatches=1),
    dict(device_of_stage=(0, 1, 1, 0), num_microbatches=1, t_comm=1.0, objective="makespan"),
    dict(device_of_stage=(0, 1, 1, 0), num_microbatches=1, mem_limit=[2.0, 2.0], t_w=[1, 0.5, 2, 1]),
    dict(device_of_stage=(0, 1, 0), num_microbatches=2, t_comm=0.5, mem_limit=[3.0, 1.5]),
    dict(device_of_stage=(0, 0, 1), num_microbatches=2, mem_limit=[3.0, 2.0], objective="makespan"),
    dict(device_of_stage=(0, 1, 0), num_microbatches=2, mem_limit=[2.0, 1.0], t_comm=0.5),
]


@pytest.mark.parametrize("kw", ORACLE)
def test_milp_matches_exhaustive_optimum_on_placements(kw):
    dev = kw["device_of_stage"]
    base = dict(num_stages=len(dev), t_f=[1, 2, 1, 1][: len(dev)], t_b=1.5, t_w=0.5, mem_f=1.0, mem_b=-0.5,
                mem_w=-0.5, offload_bytes=0.0)
    base.update({k: (v[: len(dev)] if k in ("t_w",) else v) for k, v in kw.items()})
    prob = ScheduleProblem.create(**base)
    want, _ = exhaustive_device_optimum(prob, fixed_microbatch_order=prob.num_microbatches > 1)
    res = milp.solve(prob, time_limit_s=30)
    assert check_schedule(prob, res) == []
    assert res.value == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert res.status == "optimal" and res.lower_bound_s == pytest.approx(want, rel=1e-5)
    assert combinatorial_lower_bound(prob) <= want + 1e-9


def test_milp_with_offload_on_a_multistage_device_is_restricted():
    # offload is not modelled on devices with several stages: the bound is the combinatorial one
    prob = ScheduleProblem.create(num_stages=4, num_microbatches=3, t_f=1, t_b=1, t_w=1, t_offload=0.25,
                                  device_of_stage=v_placement(2), mem_limit=3.0)
    res = milp.solve(prob, time_limit_s=5)
    assert check_schedule(prob, res) == []
    if res.status != "optimal":
        assert "restricted" in res.meta
        assert res.lower_bound_s == pytest.approx(combinatorial_lower_bound(prob))
    with pytest.raises(InputError, match="offloading"):
        milp.solve(prob.replace(mem_limit=1.5), time_limit_s=5)


@pytest.mark.parametrize("pp", [4, 8])
def test_dualpipe_case_from_the_paper(pp):
    """Operator-level MIP paper Sec. V-A: PP devices, 2 PP V-placed stages, F = B = W = 1, no
    comm, m = 2 PP, per device PP + 1 full-device activations (one full-device activation =
    one micro-batch's stash on both stages of a device = 2 stage stashes): the MILP's largest
    per-device bubble is at most PP / 2 - 1 (DualPipe's own: 2 (PP / 2 - 1))."""
    prob = ScheduleProblem.create(num_stages=2 * pp, num_microbatches=2 * pp, t_f=1, t_b=1, t_w=1, t_comm=0,
                                  mem_f=1.0, mem_b=-0.5, mem_w=-0.5, offload_bytes=0.0,
                                  device_of_stage=v_placement(pp), mem_limit=2.0 * (pp + 1))
    res = milp.solve(prob, time_limit_s=60)
    assert check_schedule(prob, res) == []
    bubble = device_spans(prob, res) - device_busy_s(prob)
    assert bubble.max() <= pp / 2 - 1 + 1e-9
    busy = float(device_busy_s(prob).max())
    assert busy - 1e-9 <= res.lower_bound_s <= res.value + 1e-9
    dp = dualpipe_v(prob)  # DualPipe-V itself leaves a bubble
    assert (device_spans(prob, dp) - device_busy_s(prob)).max() > bubble.max()


def test_schedule_ir_mip_and_schedule_packages_do_not_import_torch():
    code = ("import sys, fxpipe.ir, fxpipe.ir.torch_csv, fxpipe.mip, fxpipe.schedule, fxpipe.schedule.milp, "
            "fxpipe.schedule.dispatch, fxpipe.schedule.cache, fxpipe.report; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    subprocess.run([sys.executable, "-c", code], check=True)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placed_problems())
def test_milp_results_on_placements_pass_the_validator(problem):
    fits = all(sum(problem.mem_f[s] for s in problem.stages_of_device(d)) <= problem.mem_limit[d]
               for d in range(problem.num_devices))
    if not fits:
        with pytest.raises((InfeasibleError, InputError)):
            milp.solve(problem, time_limit_s=2)
        return
    res = milp.solve(problem, time_limit_s=2)
    assert check_schedule(problem, res) == []
    assert combinatorial_lower_bound(problem) - 1e-9 <= res.lower_bound_s <= res.value + 1e-9
    assert res.value <= milp.warm_start_schedule(problem).value + 1e-9


def test_cli_schedules_placed_problems_and_writes_torch_csv(tmp_path, capsys):
    import json

    from fxpipe.cli import main
    from fxpipe.ir import Schedule, orders_from_torch_csv, schedule_to_orders

    doc = {"format": "fxpipe.schedproblem/1", "num_stages": 4, "num_microbatches": 4, "num_devices": 2,
           "device_of_stage": [0, 1, 1, 0], "t_f": 1, "t_b": 1, "t_w": 1, "t_comm": 0.1, "mem_limit": [6, 6],
           "offload_bytes": 0}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    for method in ("zb-v", "dualpipe-v", "greedy", "milp"):
        out, csv = tmp_path / f"{method}.json", tmp_path / f"{method}.csv"
        assert main(["schedule", str(path), "--method", method, "--time-limit", "3", "--out", str(out),
                     "--csv", str(csv)]) == 0
        text = capsys.readouterr().out
        assert "device 0 (stages 0,3):" in text
        prob = ScheduleProblem.load(path)
        sched = Schedule.load(out)
        assert check_schedule(prob, sched) == []
        assert orders_from_torch_csv(csv.read_text()) == schedule_to_orders(sched, prob).compute_only()
    assert main(["schedule", str(path), "--method", "1f1b"]) == 2
    assert "one stage per device" in capsys.readouterr().err
    assert main(["schedule", str(path), "--method", "zb-v", "--csv", str(tmp_path / "s.csv"),
                 "--csv-split-backward"]) == 0
    import re

    text = (tmp_path / "s.csv").read_text()
    assert re.search(r"\dI\d", text) and not re.search(r"\dB\d", text)  # torch I/W only, no full backward


def test_gantt_and_trace_have_one_row_per_device(tmp_path):
    import json

    from fxpipe.report import chrome_trace, gantt

    prob = ScheduleProblem.create(num_stages=4, num_microbatches=4, t_f=1, t_b=1, t_w=1, mem_limit=6.0,
                                  device_of_stage=v_placement(2), offload_bytes=0.0)
    sched = zb_v(prob)
    assert gantt(prob, sched, tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(chrome_trace(sched, tmp_path / "t.json", prob).read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    assert all(e["pid"] == prob.device_of_stage[e["args"]["stage"]] for e in events)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"device 0", "device 1"}


def test_cache_replays_placed_problems(tmp_path):
    from fxpipe.schedule.cache import ScheduleCache

    prob = ScheduleProblem.create(num_stages=4, num_microbatches=4, t_f=1, t_b=1, t_w=1, mem_limit=6.0,
                                  device_of_stage=v_placement(2), offload_bytes=0.0)
    cache = ScheduleCache(tmp_path)
    cache.put(prob, zb_v(prob))
    near = prob.replace(t_f=1.01)
    hit = cache.get(near)
    assert hit is not None and check_schedule(near, hit) == []
    assert cache.signature(prob)["device_of_stage"] == [0, 1, 1, 0]
    other = prob.replace(device_of_stage=looped_placement(2, 2))
    assert cache.key(other) != cache.key(prob)
