"""MILP schedules (fxpipe.schedule.milp): optimal on tiny problems, always valid, time-outs
return the incumbent with a bound, incumbent callbacks fire, bad input is rejected.

Oracle: ``tests/naive_schedule.exhaustive_optimum`` (enumeration + LP timing, no MILP).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import Schedule, ScheduleProblem
from fxpipe.schedule import milp
from fxpipe.schedule.validate import check_schedule, memory_profile
from naive_schedule import exhaustive_optimum

TINY = [
    dict(t_f=1, t_b=1, t_w=1),
    dict(t_f=[1, 2], t_b=[2, 1.5], t_w=[0.5, 1], t_comm=0.3),
    dict(t_f=1, t_b=1, t_w=1, mem_b=-0.5, mem_w=-0.5, mem_limit=1.5, t_offload=0.5),
    dict(t_f=1, t_b=1, t_w=1, mem_b=-0.5, mem_w=-0.5, mem_limit=1.0, t_offload=0.5),
    dict(t_f=1, t_b=1, t_w=1, mem_b=-0.5, mem_w=-0.5, mem_limit=1.2, t_offload=0.3, offload_bytes=0.5),
    dict(t_f=1, t_b=1, t_w=1, mem_b=-0.5, mem_w=-0.5, mem_limit=1.5, t_offload=0.5, objective="makespan"),
    dict(t_f=[2, 1.5], t_b=[2, 1], t_w=[0, 0], t_offload=[0.2, 2], mem_b=-0.75, mem_w=-0.25, mem_limit=[1.25, 1]),
    dict(t_f=[1, 0.5], t_b=0.5, t_w=[0.5, 1], t_comm=0.5, t_offload=[0.2, 1], mem_limit=[1.25, 1],
         pcie_groups=[[0, 1]], objective="makespan"),
]


def _problem(**kw) -> ScheduleProblem:
    base = dict(num_stages=2, num_microbatches=2, mem_f=1.0)
    base.update(kw)
    return ScheduleProblem.create(**base)


@pytest.mark.parametrize("kw", TINY)
def test_milp_matches_exhaustive_optimum(kw):
    p = _problem(**kw)
    res = milp.solve(p, time_limit_s=20)
    want, _ = exhaustive_optimum(p)
    assert check_schedule(p, res.ops) == []
    assert res.status == "optimal"
    assert res.method == "milp"
    assert res.value == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert res.lower_bound_s <= res.value + 1e-9
    assert res.lower_bound_s == pytest.approx(want, rel=1e-5)
    for key in ("gap", "nodes", "status", "primal", "dual", "scip_version", "params"):
        assert key in res.meta


_times = st.sampled_from([0.5, 1.0, 1.5, 2.0])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    S=st.integers(2, 3), M=st.integers(2, 3),
    tf=st.lists(_times, min_size=3, max_size=3), tb=st.lists(_times, min_size=3, max_size=3),
    tw=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=3, max_size=3),
    comm=st.sampled_from([0.0, 0.25]), toff=st.sampled_from([0.25, 0.5, 1.0]),
    mb=st.sampled_from([-0.25, -0.5, -0.75]), lim=st.sampled_from([1.0, 1.5, 2.0, 2.5, math.inf]),
    off=st.sampled_from([1.0, 0.5]), objective=st.sampled_from(["stage_span", "makespan"]),
)
def test_milp_results_pass_the_validator(S, M, tf, tb, tw, comm, toff, mb, lim, off, objective):
    p = ScheduleProblem.create(num_stages=S, num_microbatches=M, t_f=tf[:S], t_b=tb[:S], t_w=tw[:S], t_comm=comm,
                               t_offload=toff, mem_f=1.0, mem_b=mb, mem_w=-1 - mb, offload_bytes=off,
                               mem_limit=lim, objective=objective)
    res = milp.solve(p, time_limit_s=3)
    assert check_schedule(p, res.ops) == []
    assert 0 <= res.lower_bound_s <= res.value + 1e-9
    warm = milp.warm_start_schedule(p)
    assert res.value <= warm.value + 1e-9
    assert res.status in ("optimal", "timelimit", "feasible")


def test_offload_is_used_when_memory_is_tight():
    p = _problem(t_f=1, t_b=1, t_w=1, mem_b=-0.5, mem_w=-0.5, mem_limit=1.0, t_offload=0.25,
                 num_microbatches=3)
    res = milp.solve(p, time_limit_s=20)
    assert check_schedule(p, res.ops) == []
    for s in range(p.num_stages):
        _, mem = memory_profile(p, res.ops, s)
        assert mem.max() <= 1.0 + 1e-9
    # without offloading the best is one micro-batch in flight per stage; offloading beats it
    kw = p.to_dict()
    kw.pop("format")
    kw["offload_bytes"] = 0.0
    no_off = milp.solve(ScheduleProblem.create(**kw), time_limit_s=20)
    assert res.value < no_off.value - 1e-9
    assert any(o.type == "O" for o in res.ops)


def test_timeout_returns_incumbent_with_bound_and_callback_fires():
    p = ScheduleProblem.create(num_stages=4, num_microbatches=10, t_f=1, t_b=1, t_w=1, t_offload=0.5,
                               mem_f=1, mem_b=-0.5, mem_w=-0.5, mem_limit=2.0)
    seen = []
    res = milp.solve(p, time_limit_s=1.0, on_incumbent=seen.append)
    assert res.status == "timelimit"
    assert check_schedule(p, res.ops) == []
    assert 0 < res.lower_bound_s <= res.value
    assert res.meta["gap"] >= 0
    assert seen, "the incumbent callback never fired"
    inc = seen[0]
    assert isinstance(inc, milp.Incumbent) and isinstance(inc.schedule, Schedule)
    assert check_schedule(p, inc.schedule.ops) == []
    assert inc.value_s == pytest.approx(inc.schedule.value)


def test_incumbent_callback_errors_do_not_stop_the_solve():
    p = _problem(t_f=1, t_b=2, t_w=1)

    def boom(_inc):
        raise RuntimeError("callback failed")

    res = milp.solve(p, time_limit_s=10, on_incumbent=boom, warm_start=milp._sequential_schedule(p))
    assert res.status == "optimal"
    assert res.meta.get("callback_errors")


def test_memory_infeasible_is_reported_before_building():
    p = _problem(t_f=1, t_b=1, t_w=1, mem_f=3.0, mem_b=-1.5, mem_w=-1.5, mem_limit=2.0, t_offload=0.1)
    with pytest.raises(InfeasibleError, match="mem_f"):
        milp.solve(p, time_limit_s=1)
    with pytest.raises(InfeasibleError):
        milp.build_model(p)


@pytest.mark.parametrize("kw", [dict(time_limit_s=0), dict(time_limit_s=-1), dict(threads=0), dict(gap_limit=2.0)])
def test_bad_arguments(kw):
    p = _problem(t_f=1, t_b=1, t_w=1)
    with pytest.raises(InputError):
        milp.solve(p, **kw)


def test_bad_problem_type():
    with pytest.raises(InputError):
        milp.solve({"num_stages": 2})
    with pytest.raises(InputError):
        milp.build_model(_problem(t_f=1, t_b=1, t_w=1), big_m=-1.0)


def test_build_model_is_pure_and_counts_variables():
    p = _problem(t_f=1, t_b=1, t_w=1, num_microbatches=3)
    m1, v1 = milp.build_model(p, triangle_cuts=False)
    m2, v2 = milp.build_model(p, triangle_cuts=True)
    # one binary per undetermined unordered pair: B_j|F_k, W_j|F_k, W_j|B_k for j < k
    assert len(v1.pair) == p.num_stages * 3 * 3
    assert v2.counts["triangle_cuts"] > 0 and v1.counts["triangle_cuts"] == 0
    assert v1.counts["variables"] == v2.counts["variables"]


def test_memory_implied_orders_are_valid_and_prune():
    # toy1 of Zero Bubble: 5 forwards fill the limit, so B_0 must precede F_5
    p = ScheduleProblem.create(num_stages=4, num_microbatches=12, t_f=5, t_b=6, t_w=4, mem_f=2, mem_b=-1,
                               mem_w=-1, mem_limit=10, offload_bytes=0)
    rB, rW = milp.memory_implied_orders(p)
    assert rB[(0, 5)] == 1 and (0, 4) not in rB
    res = milp.solve(p, time_limit_s=30)
    assert check_schedule(p, res.ops) == []
    assert res.value == pytest.approx(193.0)
    assert res.status == "optimal"
