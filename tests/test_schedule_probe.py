"""Time-indexed probe bounds (fxpipe.schedule.milp.time_indexed) are sound.

Oracle: ``tests/naive_schedule.exhaustive_optimum`` (every order class timed by an LP) on
tiny problems with memory limits, offload, several stages per device and both objectives.
For every problem: the whole-pipeline probe at the optimum rounded up to the grid is
feasible (the rounding argument of ``probe_lower_bound``), no per-device probe or window
check refutes it, and the bisected bound never exceeds the optimum.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from naive_schedule import exhaustive_device_optimum, exhaustive_optimum
from test_schedule_bounds import tiny_memory_problems

from fxpipe.errors import InfeasibleError
from fxpipe.ir import ScheduleProblem
from fxpipe.mip import solve_model
from fxpipe.schedule import milp
from fxpipe.schedule.milp.time_indexed import build_probe, exact_grid, probe_lower_bound, temporal_windows


def _status(problem, T, grid, devices=None) -> str:
    model, _ = build_probe(problem, T, grid, devices=devices)
    if model is None:
        return "infeasible"
    res = solve_model(model, time_limit_s=60.0)
    return "feasible" if res.n_solutions > 0 else res.raw_status


def _check_sound(problem: ScheduleProblem, oracle=exhaustive_optimum) -> None:
    try:
        opt, _ = oracle(problem)
    except InfeasibleError:
        return
    grid = exact_grid(problem)
    assert grid is not None
    T = int(math.ceil(opt / grid - 1e-9))
    assert temporal_windows(problem, T, grid).feasible
    assert _status(problem, T, grid) == "feasible"
    for d in range(problem.num_devices):
        assert _status(problem, T, grid, devices=[d]) == "feasible"
    pb = probe_lower_bound(problem, upper_bound_s=opt + 4 * grid, lower_bound_s=0.0, time_limit_s=60.0)
    assert pb.bound_s <= opt + 1e-9


def test_exact_grid():
    p = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=1.5, t_w=0.5, t_comm=0.25, t_offload=3)
    assert exact_grid(p) == pytest.approx(0.25)
    p = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=math.pi, t_w=1)
    assert exact_grid(p) is None
    assert probe_lower_bound(p, upper_bound_s=100.0, lower_bound_s=1.0).infeasible_T is None


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_memory_problems())
def test_probe_sound_against_exhaustive(problem):
    _check_sound(problem)


@pytest.mark.parametrize("objective", ["stage_span", "makespan"])
@pytest.mark.parametrize("kw", [
    # fast offload under a tight limit (the p = 8, m = 16 instances in miniature)
    {"t_offload": 0.5, "mem_limit": 1.0},
    {"t_offload": 0.5, "mem_limit": 1.5, "t_comm": [1]},
    # slow offload: the second forward waits for the first stash's offload or for B
    {"t_offload": 2.0, "mem_limit": 1.0},
])
def test_probe_sound_cases(objective, kw):
    p = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=1, t_w=1, mem_f=1.0, mem_b=-0.5,
                               mem_w=-0.5, objective=objective, **kw)
    _check_sound(p)


@pytest.mark.parametrize("objective", ["stage_span", "makespan"])
@pytest.mark.parametrize("kw", [
    # two stages on one device: one compute stream, summed memory (the oracle has no offload
    # with several stages per device)
    {"num_microbatches": 2, "device_of_stage": [0, 0], "mem_limit": [1.5]},
    # V placement on two devices, one micro-batch
    {"num_microbatches": 1, "device_of_stage": [0, 1, 1, 0], "mem_limit": [1.0, 2.0], "t_comm": 1},
])
def test_probe_sound_on_placements(objective, kw):
    S = len(kw["device_of_stage"])
    p = ScheduleProblem.create(num_stages=S, t_f=[1, 2, 1, 1][:S], t_b=1.5, t_w=0.5, mem_f=1.0, mem_b=-0.5,
                               mem_w=-0.5, offload_bytes=0.0, num_devices=max(kw["device_of_stage"]) + 1,
                               objective=objective, **kw)
    _check_sound(p, lambda q: exhaustive_device_optimum(q, fixed_microbatch_order=q.num_microbatches > 1))


def test_probe_is_tight_where_the_optimum_is_on_the_grid():
    # makespan: a common shift puts the earliest start on the grid, so the grid optimum equals
    # the optimum and the probe one grid step below it must be infeasible (a model that is
    # too loose fails here)
    p = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=1, t_w=1, mem_f=1.0, mem_b=-0.5,
                               mem_w=-0.5, t_offload=2.0, mem_limit=1.0, objective="makespan")
    opt, _ = exhaustive_optimum(p)
    grid = exact_grid(p)
    T = int(round(opt / grid))
    assert _status(p, T, grid) == "feasible"
    assert _status(p, T - 1, grid) in ("infeasible",)
    pb = probe_lower_bound(p, upper_bound_s=opt, lower_bound_s=0.0, time_limit_s=60.0)
    assert pb.bound_s == pytest.approx((T - 1) * grid)


def test_milp_reports_probe_bound():
    # p = 4, m = 8, limit 2: the combinatorial bound is the busy time 24, probes prove more
    p = ScheduleProblem.create(num_stages=4, num_microbatches=8, t_f=1, t_b=1, t_w=1, t_offload=0.5, mem_f=1,
                               mem_b=-0.5, mem_w=-0.5, mem_limit=2.0)
    res = milp.solve(p, time_limit_s=10.0, probe_time_s=7.0)
    probe = res.meta["probe"]
    assert probe["bound_s"] > res.meta["combinatorial_bound_s"]
    assert res.lower_bound_s >= probe["bound_s"] - 1e-9
    assert res.lower_bound_s <= res.value + 1e-9


def test_ctrl_c_in_a_probe_stops_probing_and_the_milp(monkeypatch):
    # a probe solve stopped by Ctrl-C (status "userinterrupt") ends the bisection at once, and
    # milp.solve returns the warm start with the bound proven so far instead of starting SCIP
    import types

    import fxpipe.mip

    calls = []

    def interrupted_solve(model, **kw):
        calls.append(kw)
        return types.SimpleNamespace(status="userinterrupt", raw_status="userinterrupt", n_solutions=0)

    p = ScheduleProblem.create(num_stages=4, num_microbatches=8, t_f=1, t_b=1, t_w=1, t_offload=0.5, mem_f=1,
                               mem_b=-0.5, mem_w=-0.5, mem_limit=2.0)
    monkeypatch.setattr(fxpipe.mip, "solve_model", interrupted_solve)
    pb = probe_lower_bound(p, upper_bound_s=40.0, lower_bound_s=24.0, time_limit_s=30.0)
    assert pb.interrupted and len(calls) == 1
    assert pb.bound_s >= 24.0 and pb.to_dict()["interrupted"] is True
    calls.clear()
    res = milp.solve(p, time_limit_s=60.0, probe_time_s=10.0, search_time_s=1.0)
    assert len(calls) == 1  # the one interrupted probe; no SCIP solve of the MILP after it
    assert res.status == "userinterrupt" and res.meta["probe"]["interrupted"]
    assert 24.0 - 1e-9 <= res.lower_bound_s <= res.value + 1e-9
