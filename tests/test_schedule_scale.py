"""Issue 19 item 4: the fast simulator and the plan-time shortcuts of ``schedule="auto"``.

Oracle: a plain, slow timing of the orders written from the rules alone
(``tests/_ref_simulate.py``, no code shared with the fast simulator). On random problems (several
stages per device, pcie groups, offload, recomputation, memory limits, memory-aware timing,
deadlocking orders) the fast :func:`fxpipe.schedule.simulate.simulate` must return the very same
ops (bit-identical start and end times, same order) and objective values, or raise the same error.
"""

from __future__ import annotations

import math

import _ref_simulate
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.errors import InputError
from fxpipe.ir import Action, Orders, ScheduleProblem
from fxpipe.schedule.simulate import as_orders, simulate


@st.composite
def sim_cases(draw):
    D = draw(st.integers(1, 4))
    v = draw(st.sampled_from([1, 1, 2]))
    S = D * v
    if v == 1:
        dev = list(range(S))
    elif draw(st.booleans()):
        dev = [s % D for s in range(S)]  # looped
    else:
        dev = [s if s < D else 2 * D - 1 - s for s in range(S)]  # V
    M = draw(st.integers(1, 5))
    # small integers make ties (the tie-break order matters for the copy stream and memory)
    ints = lambda lo, hi: [float(draw(st.integers(lo, hi))) for _ in range(S)]  # noqa: E731
    t_b = ints(0, 3)
    mem_f = [float(draw(st.sampled_from([1, 2, 3]))) for _ in range(S)]
    rec = [draw(st.booleans()) if draw(st.booleans()) else False for _ in range(S)]
    lim = [draw(st.sampled_from([math.inf, 2.0, 3.0, 4.0, 6.0])) for _ in range(D)]
    groups = ((0, S - 1),) if S > 2 and draw(st.booleans()) else ()
    problem = ScheduleProblem.create(
        num_stages=S, num_microbatches=M, t_f=ints(1, 3), t_b=t_b, t_w=ints(0, 2),
        t_comm=[float(draw(st.sampled_from([0.0, 0.5, 1.0]))) for _ in range(S - 1)],
        t_offload=[float(draw(st.sampled_from([0.0, 0.5, 1.0, 2.5]))) for _ in range(S)],
        mem_f=mem_f, mem_b=[-x / 2 for x in mem_f], mem_w=[-x / 2 for x in mem_f], mem_limit=lim,
        device_of_stage=dev, pcie_groups=groups, recompute_mem_f=[x / 2 for x in mem_f],
    )
    if any(rec):
        problem = problem.with_recompute([s for s in range(S) if rec[s]])
    rows: list[list[tuple[int, str, int]]] = [[] for _ in range(D)]
    if draw(st.integers(0, 4)):
        # a random topological order of all ops (data dependencies respected): never deadlocks
        done: set = set()

        def ready(s, t, j):
            if t == "F":
                return s == 0 or (s - 1, "F", j) in done
            if t == "B":
                return (s, "F", j) in done and (s == S - 1 or (s + 1, "B", j) in done)
            return (s, "B", j) in done

        todo = [(s, t, j) for s in range(S) for j in range(M) for t in "FBW"]
        while todo:
            op = draw(st.sampled_from([o for o in todo if ready(*o)]))
            todo.remove(op)
            done.add(op)
            rows[dev[op[0]]].append(op)
    else:
        # per device a random interleaving keeping F_j before B_j before W_j per stage, micro-batches
        # in any order (these often deadlock: both simulators must say so alike)
        for d in range(D):
            todo = {}
            for s in (s for s in range(S) if dev[s] == d):
                ops = [("F", j) for j in draw(st.permutations(range(M)))]
                for j in [j for _, j in ops]:
                    at = draw(st.integers(ops.index(("F", j)) + 1, len(ops)))
                    ops.insert(at, ("B", j))
                    ops.insert(draw(st.integers(at + 1, len(ops))), ("W", j))
                todo[s] = ops
            while any(todo.values()):
                s = draw(st.sampled_from([s for s in todo if todo[s]]))
                t, j = todo[s].pop(0)
                rows[d].append((s, t, j))
    offload = sorted({(draw(st.integers(0, S - 1)), draw(st.integers(0, M - 1))) for _ in range(draw(st.integers(0, 4)))})
    respect = draw(st.booleans())
    return problem, rows, offload, respect


def _run(mod, problem, orders, offload, respect):
    try:
        return mod.simulate(problem, orders, offload=offload, respect_memory=respect, method="m")
    except InputError as exc:
        return str(exc)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sim_cases())
def test_fast_simulator_matches_the_reference(case):
    problem, rows, offload, respect = case
    forms = [Orders(problem.device_of_stage, tuple(tuple(Action(s, t, j) for s, t, j in row) for row in rows))]
    if problem.one_stage_per_device:  # the per-stage form the generators pass (the fast-read path)
        forms.append({s: [(t, j) for row in rows for s2, t, j in row if s2 == s] for s in range(problem.num_stages)})
    for orders in forms:
        want = _run(_ref_simulate, problem, orders, offload, respect)
        got = _run(__import__("fxpipe.schedule.simulate", fromlist=["simulate"]), problem, orders, offload, respect)
        if isinstance(want, str):
            assert got == want
            continue
        assert not isinstance(got, str), got
        assert got.ops == want.ops  # bit-identical times, same canonical order
        assert (got.makespan, got.stage_span) == (want.makespan, want.stage_span)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sim_cases(), st.sampled_from(["mem_limit", "half_limit", "t_f", "t_comm"]))
def test_timings_remembered_across_problem_copies_only_when_they_time_alike(case, field):
    # simulate remembers its last timings and reuses them for a copy of the problem that times alike (the same
    # durations; the same memory fields too when memory-aware): a copy that differs must be timed afresh
    import importlib

    fast = importlib.import_module("fxpipe.schedule.simulate")
    problem, rows, offload, respect = case
    orders = Orders(problem.device_of_stage, tuple(tuple(Action(s, t, j) for s, t, j in row) for row in rows))
    first = _run(fast, problem, orders, offload, respect)
    change = {"mem_limit": {"mem_limit": math.inf}, "t_f": {"t_f": problem.t_f * 1.5 + 0.25},
              "half_limit": {"mem_limit": problem.mem_limit * 0.5}, "t_comm": {"t_comm": problem.t_comm + 0.5}}[field]
    copy = problem.replace(**change)
    want = _run(_ref_simulate, copy, orders, offload, respect)
    got = _run(fast, copy, orders, offload, respect)
    if isinstance(want, str):
        assert got == want
        return
    assert not isinstance(got, str) and got.ops == want.ops and (got.makespan, got.stage_span) == (want.makespan,
                                                                                                   want.stage_span)
    if not isinstance(first, str) and field.endswith("limit") and not respect:
        assert got.ops is first.ops  # timed alike: the remembered ops


def test_bad_per_stage_orders_raise_as_the_full_check():
    # simulate reads the generators' per-stage form directly; bad orders must still be refused as as_orders refuses them
    p = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=1, t_w=1)
    for bad in ({0: [("F", 0)], 1: []}, {0: [("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)]},
                {0: [("F", 5)] * 6, 1: [("F", 0)] * 6}):
        with pytest.raises(InputError) as new:
            simulate(p, bad)
        with pytest.raises(InputError) as full:
            as_orders(p, bad)
        assert str(new.value) == str(full.value)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sim_cases(), st.data())
def test_vectorised_check_matches_the_full_check(case, data):
    from fxpipe.ir import ScheduledOp
    from fxpipe.schedule.validate import _check_schedule, check_schedule, memory_profile, stage_peaks

    problem, rows, offload, respect = case
    orders = Orders(problem.device_of_stage, tuple(tuple(Action(s, t, j) for s, t, j in row) for row in rows))
    try:
        sched = simulate(problem, orders, offload=offload, respect_memory=respect)
    except InputError:
        return
    assert check_schedule(problem, sched) == _check_schedule(problem, list(sched.ops), 1e-9)
    ops = list(sched.ops)
    # perturb: shift an op, stretch one, drop one, duplicate one (each may break a rule)
    for _ in range(data.draw(st.integers(0, 2))):
        k = data.draw(st.integers(0, len(ops) - 1))
        o = ops[k]
        what = data.draw(st.sampled_from(["shift", "stretch", "drop", "dup"]))
        dt = data.draw(st.sampled_from([-1.0, -0.5, 0.5, 1.0]))
        if what == "shift":
            ops[k] = ScheduledOp(o.stage, o.microbatch, o.type, o.start_s + dt, o.end_s + dt)
        elif what == "stretch":
            ops[k] = ScheduledOp(o.stage, o.microbatch, o.type, o.start_s, o.end_s + abs(dt))
        elif what == "drop":
            ops.pop(k)
        else:
            ops.append(o)
    assert check_schedule(problem, ops) == _check_schedule(problem, ops, 1e-9)
    # the same check on the ops' field arrays, the ops built only to word a message
    from fxpipe.schedule.validate import _op_arrays, check_op_arrays, objective_values, objective_values_of_arrays

    arrays = _op_arrays(ops)
    if arrays is not None:
        assert check_op_arrays(problem, arrays, lambda: list(ops)) == _check_schedule(problem, ops, 1e-9)
        assert objective_values_of_arrays(problem, arrays) == objective_values(problem, ops)  # bit for bit
    want = []
    for s in range(problem.num_stages):
        _, mem = memory_profile(problem, ops, s)
        want.append(float(mem.max()) if mem.size else None)
    assert stage_peaks(problem, ops) == want


@st.composite
def tight_problems(draw):
    S, M = draw(st.integers(2, 5)), draw(st.integers(1, 8))
    mf = [float(draw(st.sampled_from([1, 2]))) for _ in range(S)]
    return ScheduleProblem.create(
        num_stages=S, num_microbatches=M,
        t_f=[float(draw(st.integers(1, 3))) for _ in range(S)], t_b=[float(draw(st.integers(0, 4))) for _ in range(S)],
        t_w=[float(draw(st.integers(0, 2))) for _ in range(S)],
        t_comm=[float(draw(st.sampled_from([0.0, 0.5]))) for _ in range(S - 1)],
        t_offload=float(draw(st.sampled_from([0.5, 1.0, 3.0]))), mem_f=mf, mem_b=[-x / 2 for x in mf],
        mem_w=[-x / 2 for x in mf], mem_limit=[draw(st.sampled_from([2.0, 3.0, 4.0, 6.0, math.inf])) for _ in range(S)],
        recompute_mem_f=[x / 2 for x in mf], objective=draw(st.sampled_from(["stage_span", "makespan"])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_problems())
def test_limited_1f1b_bound_below_every_smaller_warmup(problem):
    from fxpipe.schedule.auto import limited_1f1b_bound
    from fxpipe.schedule.heuristics import orders_1f1b

    p, M = problem.num_stages, problem.num_microbatches
    free = problem.replace(mem_limit=math.inf)
    vals = [simulate(free, orders_1f1b(p, M, [min(w, p - s - 1, M) for s in range(p)])).value for w in range(p)]
    for w in range(p):
        assert limited_1f1b_bound(problem, w) <= min(vals[: w + 1]) + 1e-9


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_problems())
def test_auto_choice_unchanged_by_the_early_exit(problem):
    import fxpipe.schedule.auto as auto
    from fxpipe.errors import InfeasibleError

    def run():
        try:
            r = auto.auto_schedule(problem, time_limit_s=0.0)
        except InfeasibleError as exc:
            return str(exc).split(" (tried")[0]
        return r.schedule.method, r.schedule.ops, r.recompute_stages

    from fxpipe.schedule import heuristics

    saved = heuristics.OFFLOAD_SEARCH_TIME_S, heuristics.OFFLOAD_SEARCH_EVALS
    # the offload search stops at a wall-clock limit: bound it by evaluations only, so it is repeatable
    heuristics.OFFLOAD_SEARCH_TIME_S, heuristics.OFFLOAD_SEARCH_EVALS = 1e9, 8
    try:
        fast = run()
    finally:
        heuristics.OFFLOAD_SEARCH_TIME_S, heuristics.OFFLOAD_SEARCH_EVALS = saved
    real = auto.limited_1f1b_bound
    auto.limited_1f1b_bound = lambda problem, w: 0.0  # never prunes: the search as it was
    heuristics.OFFLOAD_SEARCH_TIME_S, heuristics.OFFLOAD_SEARCH_EVALS = 1e9, 8
    try:
        slow = run()
    finally:
        auto.limited_1f1b_bound = real
        heuristics.OFFLOAD_SEARCH_TIME_S, heuristics.OFFLOAD_SEARCH_EVALS = saved
    assert fast == slow


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_problems())
def test_auto_never_worse_than_1f1b_with_full_recomputation(problem):
    # issue 19 item 5: when 1F1B with every stage recomputing fits, auto is at least as fast
    import fxpipe.schedule.auto as auto
    from fxpipe.errors import InfeasibleError
    from fxpipe.schedule import heuristics

    full = problem.with_recompute([s for s in range(problem.num_stages) if problem.recompute_mem_f[s] < problem.mem_f[s]])
    try:
        ref = heuristics.generate(full, "1f1b")
    except InfeasibleError:
        return
    saved = heuristics.OFFLOAD_SEARCH_TIME_S, heuristics.OFFLOAD_SEARCH_EVALS
    heuristics.OFFLOAD_SEARCH_TIME_S, heuristics.OFFLOAD_SEARCH_EVALS = 1e9, 8
    try:
        got = auto.auto_schedule(problem, time_limit_s=0.0)
    finally:
        heuristics.OFFLOAD_SEARCH_TIME_S, heuristics.OFFLOAD_SEARCH_EVALS = saved
    assert got.schedule.value <= ref.value * (1 + 1e-9)
