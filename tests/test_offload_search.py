"""The offload-aware list-scheduling search (fxpipe.schedule.offload_search).

Oracles: the Contract-3 validator on every result, the exhaustive optimum on tiny problems
(the search never claims a value below it), the time-indexed probe bound on p = 4, m = 8
(never above the search's value), and the order-first heuristics it must beat on the tight
offload instances it exists for. Random problems of every kind go through
``tests/test_schedule_heuristics.py``'s generator test too (``offload-search`` is in METHODS).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from naive_schedule import exhaustive_optimum
from test_schedule_bounds import tiny_memory_problems

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import ScheduleProblem, sort_ops, v_placement
from fxpipe.schedule import heuristics, milp
from fxpipe.schedule.bounds import combinatorial_lower_bound
from fxpipe.schedule.milp.time_indexed import probe_lower_bound
from fxpipe.schedule.offload_search import default_params, offload_list_schedule, offload_search
from fxpipe.schedule.validate import check_schedule, objective_values


def _offload_problem(p: int, m: int, limit: float, **kw) -> ScheduleProblem:
    return ScheduleProblem.create(num_stages=p, num_microbatches=m, t_f=1, t_b=1, t_w=1, t_offload=0.5, mem_f=1,
                                  mem_b=-0.5, mem_w=-0.5, mem_limit=limit, **kw)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_memory_problems())
def test_never_below_the_exhaustive_optimum(problem):
    try:
        opt, _ = exhaustive_optimum(problem)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            heuristics.generate(problem, "offload-search")
        return
    try:
        s = offload_search(problem, max_evals=60, time_limit_s=30)
    except InfeasibleError:
        return  # a heuristic may fail to fit; it must not claim a value below the optimum
    assert check_schedule(problem, s.ops) == []
    assert s.value >= opt - 1e-9


@pytest.mark.parametrize("limit", [4.0, 2.0, 1.5])
def test_beats_the_order_first_heuristics_under_tight_memory(limit):
    # p = 4, m = 8, F = B = W = 1, offload 0.5: ZB-H1/H2, the ZB greedy, PipeOffload and
    # AdaOffload end at 27-65 (limit 4: 27, 2: 30, 1.5: 44 at best); the search decides
    # offloads with the compute order and ends within 1 to 6.5 of the busy time 24
    p = _offload_problem(4, 8, limit)
    others = []
    for method in ("zb-h1", "zb-h2", "greedy", "pipeoffload", "adaoffload", "1f1b"):
        try:
            others.append(heuristics.generate(p, method).value)
        except InfeasibleError:
            pass
    s = heuristics.generate(p, "offload-search")
    assert check_schedule(p, s.ops) == []
    assert s.method == "offload-search" and s.status == "heuristic"
    assert s.value < min(others) - 0.5
    assert s.value >= combinatorial_lower_bound(p) - 1e-9
    assert any(o.type == "O" for o in s.ops)  # the limit binds: something is offloaded


def test_value_above_the_probe_bound():
    # the probe bisects up to PipeOffload's 30, independently of the search: its proven bound
    # must not exceed the search's value (a search claiming less than the optimum fails here)
    p = _offload_problem(4, 8, 2.0)
    s = heuristics.generate(p, "offload-search")
    upper = heuristics.generate(p, "pipeoffload").value
    assert upper > s.value
    pb = probe_lower_bound(p, upper_bound_s=upper, lower_bound_s=combinatorial_lower_bound(p), time_limit_s=30.0)
    assert pb.bound_s > combinatorial_lower_bound(p)  # the probe proves something here ...
    assert pb.bound_s <= s.value + 1e-9  # ... and never more than a valid schedule's value


def test_deterministic_for_a_seed_and_budget():
    p = _offload_problem(4, 8, 2.0)
    a = offload_search(p, max_evals=40, time_limit_s=60, seed=3)
    b = offload_search(p, max_evals=40, time_limit_s=60, seed=3)
    assert a.ops == b.ops and a.meta["params"] == b.meta["params"] and a.meta["evals"] == 40


def test_pcie_group_shares_one_copy_stream():
    # all four stages' host copies go through one pcie link: their O/R never overlap
    p = _offload_problem(4, 8, 2.0, pcie_groups=[[0, 1, 2, 3]])
    s = offload_search(p, max_evals=80, time_limit_s=60)
    assert check_schedule(p, s.ops) == []
    copies = sorted((o.start_s, o.end_s) for o in s.ops if o.type in ("O", "R"))
    assert copies and all(b[0] >= a[1] - 1e-9 for a, b in zip(copies, copies[1:]))


def test_one_policy_run_covers_every_op_and_unlimited_memory_needs_no_offload():
    p = _offload_problem(3, 5, math.inf)
    ops = offload_list_schedule(p, default_params(p))
    assert ops is not None and check_schedule(p, ops) == []
    assert not any(o.type in ("O", "R") for o in ops)
    assert sorted((o.stage, o.microbatch, o.type) for o in ops) == sorted(
        (s, j, t) for s in range(3) for j in range(5) for t in "FBW")


def test_ctrl_c_returns_the_best_so_far():
    p = _offload_problem(4, 8, 2.0)
    seen = []

    def stop(value, evals):
        seen.append(value)
        raise KeyboardInterrupt

    s = offload_search(p, time_limit_s=60, on_improve=stop)
    assert s.meta["interrupted"] is True and seen and s.value == seen[-1]
    assert check_schedule(p, s.ops) == []


def test_errors():
    with pytest.raises(InputError, match="one stage per device"):
        offload_search(ScheduleProblem.create(num_stages=4, num_microbatches=4, t_f=1, t_b=1, t_w=1,
                                              device_of_stage=v_placement(2, 2)))
    # one stash larger than the limit: no schedule at all, and the message says by how much
    p = _offload_problem(2, 2, 0.5)
    with pytest.raises(InfeasibleError, match="over by"):
        heuristics.generate(p, "offload-search")


def test_no_policy_fits_and_ctrl_c_before_any_schedule(monkeypatch):
    import fxpipe.schedule.offload_search as mod

    p = _offload_problem(3, 4, 2.0)
    monkeypatch.setattr(mod, "_columns", lambda problem, params: None)  # every policy deadlocks
    with pytest.raises(InfeasibleError, match="cannot fit mem_limit with any of the 5"):
        offload_search(p, max_evals=5, time_limit_s=60)
    calls = []

    def deadlock_then_press(problem, params):
        calls.append(params)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return None

    monkeypatch.setattr(mod, "_columns", deadlock_then_press)
    with pytest.raises(KeyboardInterrupt):  # nothing to return: the press goes on to the caller
        offload_search(p, max_evals=5, time_limit_s=60)


def _value_on_ops(problem, params):
    """The search's value of one policy the slow way: its ops, idle O / R pairs dropped, the validator's objective."""
    ops = offload_list_schedule(problem, params)
    if ops is None:
        return math.inf, None
    o_end = {(o.stage, o.microbatch): o.end_s for o in ops if o.type == "O"}
    idle = {(o.stage, o.microbatch) for o in ops if o.type == "R" and o.start_s <= o_end[(o.stage, o.microbatch)] + 1e-9}
    ops = [o for o in ops if not (o.type in "OR" and (o.stage, o.microbatch) in idle)]
    ms, span = objective_values(problem, ops)
    return (span if problem.objective == "stage_span" else ms), ops


@pytest.mark.parametrize("objective", ["makespan", "stage_span"])
@pytest.mark.parametrize("limit", [math.inf, 4.0, 2.0, 1.5])
def test_value_taken_on_columns_equals_the_validators_on_ops(objective, limit):
    # the search values a policy on the kernel's columns and builds ops only for a keeper: the value must be
    # the validator's, bit for bit, and the kept ops those of the policy less its idle offloads, in sort_ops' order
    import random

    import fxpipe.schedule.offload_search as mod

    p = _offload_problem(4, 8, limit, objective=objective)
    rng = random.Random(7)
    kept = cut = 0
    for k in range(60):
        params = default_params(p) if k == 0 else mod._random_params(p, rng)
        want, ops = _value_on_ops(p, params)
        valid = ops is not None and not check_schedule(p, ops)
        got, got_cols = mod._evaluate(p, params)
        got_ops = None if got_cols is None else tuple(mod._ops_of_columns(got_cols))
        assert (got, got_ops) == ((want, tuple(sort_ops(ops))) if valid else (math.inf, None))
        if valid:
            kept += 1
            assert mod._evaluate(p, params, accept_at_most=want - 1e-3) == (math.inf, None)
            cut += 1
    assert kept >= 5 and cut == kept


def test_milp_starts_from_the_longer_search():
    p = _offload_problem(4, 8, 2.0)
    res = milp.solve(p, time_limit_s=8.0, search_time_s=2.0)
    assert res.meta["search"]["evals"] > 1
    assert res.value <= res.meta["search"]["value_s"] + 1e-9
    assert check_schedule(p, res.ops) == []
    with pytest.raises(InputError, match="search_time_s"):
        milp.solve(p, time_limit_s=8.0, search_time_s=8.0)


def test_ctrl_c_in_the_milp_search_returns_the_warm_start(monkeypatch):
    # Ctrl-C while milp.solve searches: no probing, no SCIP; the warm start comes back,
    # labelled userinterrupt, with the combinatorial bound
    import fxpipe.schedule.offload_search as mod

    original = mod.offload_search

    def interrupted(problem, **kw):
        if kw.get("seed", 0) == 1:  # the long search of milp.solve (the warm start's runs with seed 0)
            raise KeyboardInterrupt
        return original(problem, **kw)

    p = _offload_problem(4, 8, 2.0)
    monkeypatch.setattr(mod, "offload_search", interrupted)
    res = milp.solve(p, time_limit_s=60.0, probe_time_s=10.0, search_time_s=5.0)
    assert res.status == "userinterrupt" and res.meta["probe"] is None and res.meta["nodes"] == 0
    assert check_schedule(p, res.ops) == []
    assert res.lower_bound_s == pytest.approx(combinatorial_lower_bound(p))
