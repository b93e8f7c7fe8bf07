"""The Contract-3 validator catches every kind of violation (each built deliberately)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxpipe.errors import InputError
from fxpipe.ir import Schedule, ScheduledOp, ScheduleProblem
from fxpipe.ir import schedule_to_orders
from fxpipe.schedule.simulate import simulate
from fxpipe.schedule.heuristics import orders_1f1b
from fxpipe.schedule.validate import (
    InvalidScheduleError,
    check_schedule,
    memory_profile,
    objective_values,
    peak_memory,
    validate_schedule,
)


def _problem(**kw):
    base = dict(num_stages=2, num_microbatches=2, t_f=2.0, t_b=3.0, t_w=1.0, t_comm=0.5, t_offload=1.0,
                mem_f=4.0, mem_b=-3.0, mem_w=-1.0)
    base.update(kw)
    return ScheduleProblem.create(**base)


def _valid_ops(problem, offload=()):
    s = simulate(problem, orders_1f1b(problem.num_stages, problem.num_microbatches), offload=offload)
    return list(s.ops)


def _find(ops, stage, mb, t):
    return next(i for i, o in enumerate(ops) if (o.stage, o.microbatch, o.type) == (stage, mb, t))


def _op(ops, stage, mb, t):
    return ops[_find(ops, stage, mb, t)]


def _move(ops, stage, mb, t, start_s):
    """Move the op ``t`` of (stage, mb) in ``ops`` (in place) to start at ``start_s``, its duration kept."""
    i = _find(ops, stage, mb, t)
    ops[i] = replace(ops[i], start_s=start_s, end_s=start_s + ops[i].end_s - ops[i].start_s)


def _has(errs, rule, *words):
    return any(e.startswith(rule) and all(w in e for w in words) for e in errs)


def test_valid_schedule_has_no_violations():
    p = _problem()
    ops = _valid_ops(p)
    assert check_schedule(p, ops) == []
    validate_schedule(p, ops)  # no raise
    sched = simulate(p, orders_1f1b(2, 2))
    validate_schedule(p, sched)


def test_valid_with_offload():
    p = _problem(num_microbatches=3)
    ops = _valid_ops(p, offload=[(0, 0), (0, 1)])
    assert sum(o.type == "O" for o in ops) == 2
    assert check_schedule(p, ops) == []


def test_missing_op():
    p = _problem()
    ops = _valid_ops(p)
    del ops[_find(ops, 1, 1, "W")]
    errs = check_schedule(p, ops)
    assert _has(errs, "rule 1", "W(stage 1, mb 1) is missing")
    with pytest.raises(InvalidScheduleError) as info:
        validate_schedule(p, ops)
    assert isinstance(info.value, AssertionError)
    assert info.value.violations == errs


def test_duplicate_and_out_of_range_ops():
    p = _problem()
    ops = _valid_ops(p)
    ops.append(ops[0])
    ops.append(ScheduledOp(5, 0, "F", 100.0, 102.0))
    ops.append(ScheduledOp(0, 9, "F", 100.0, 102.0))
    ops.append(ScheduledOp(0, 0, "X", 100.0, 102.0))
    errs = check_schedule(p, ops)
    assert _has(errs, "rule 1", "more than once")
    assert _has(errs, "rule 1", "stage 5")
    assert _has(errs, "rule 1", "micro-batch 9")
    assert _has(errs, "rule 1", "unknown type")


def test_wrong_duration():
    p = _problem()
    ops = _valid_ops(p)
    i = _find(ops, 0, 1, "B")
    ops[i] = replace(ops[i], end_s=ops[i].end_s - 0.5)
    errs = check_schedule(p, ops)
    assert _has(errs, "rule 1", "B(stage 0, mb 1)", "expected duration 3")


def test_forward_dependency_and_comm():
    p = _problem()
    ops = _valid_ops(p)
    # starts after F(0,0) ends but before the comm has arrived
    _move(ops, 1, 0, "F", _op(ops, 0, 0, "F").end_s + 0.25)
    errs = check_schedule(p, ops)
    assert _has(errs, "rule 2", "F(stage 1, mb 0)", "comm")


def test_backward_dependencies():
    p = _problem()
    ops = _valid_ops(p)
    # B on the last stage before its F ends
    _move(ops, 1, 1, "B", _op(ops, 1, 1, "F").end_s - 1.0)
    errs = check_schedule(p, ops)
    assert _has(errs, "rule 2", "B(stage 1, mb 1)", "F(stage 1, mb 1)")
    # B(0, j) before B(1, j) + comm; W before B
    ops = _valid_ops(p)
    _move(ops, 0, 0, "B", _op(ops, 0, 0, "B").start_s - 0.3)
    _move(ops, 0, 1, "W", _op(ops, 0, 1, "B").end_s - 0.5)
    errs = check_schedule(p, ops)
    assert _has(errs, "rule 2", "B(stage 0, mb 0)", "B(stage 1, mb 0)")
    assert _has(errs, "rule 2", "W(stage 0, mb 1)", "B(stage 0, mb 1)")


def test_compute_overlap():
    p = _problem(num_stages=1, num_microbatches=2)
    ops = [
        ScheduledOp(0, 0, "F", 0, 2), ScheduledOp(0, 1, "F", 1, 3),  # overlap
        ScheduledOp(0, 0, "B", 3, 6), ScheduledOp(0, 0, "W", 6, 7),
        ScheduledOp(0, 1, "B", 7, 10), ScheduledOp(0, 1, "W", 10, 11),
    ]
    errs = check_schedule(p, ops)
    assert _has(errs, "rule 3", "compute stream of stage 0", "F(stage 0, mb 1)")
    ops[1] = ScheduledOp(0, 1, "F", 2, 4)
    ops[2:] = [ScheduledOp(0, 0, "B", 4, 7), ScheduledOp(0, 0, "W", 7, 8),
               ScheduledOp(0, 1, "B", 8, 11), ScheduledOp(0, 1, "W", 11, 12)]
    assert check_schedule(p, ops) == []  # touching intervals are fine


def test_offload_without_reload_and_reverse():
    p = _problem()
    ops = _valid_ops(p)
    f = _op(ops, 0, 0, "F")
    ops.append(ScheduledOp(0, 0, "O", f.end_s, f.end_s + 1.0))
    errs = check_schedule(p, ops)
    assert _has(errs, "rule 1", "stage 0, mb 0", "O without R")
    ops = _valid_ops(p)
    b = _op(ops, 0, 1, "B")
    ops.append(ScheduledOp(0, 1, "R", b.start_s - 1.0, b.start_s))
    errs = check_schedule(p, ops)
    assert _has(errs, "rule 1", "stage 0, mb 1", "R without O")


def test_offload_placement_rules():
    p = _problem(num_microbatches=3)
    ops = _valid_ops(p, offload=[(0, 0)])
    _move(ops, 0, 0, "O", _op(ops, 0, 0, "F").end_s - 0.5)
    assert _has(check_schedule(p, ops), "rule 4", "O(stage 0, mb 0)", "before F(stage 0, mb 0)")
    ops = _valid_ops(p, offload=[(0, 0)])
    _move(ops, 0, 0, "R", _op(ops, 0, 0, "B").start_s - 0.5)
    assert _has(check_schedule(p, ops), "rule 4", "R(stage 0, mb 0)", "after B(stage 0, mb 0)")


def test_copy_stream_overlap_same_stage():
    p = _problem(num_microbatches=3)
    ops = _valid_ops(p, offload=[(0, 0), (0, 1)])
    _move(ops, 0, 1, "O", _op(ops, 0, 0, "O").start_s + 0.5)
    errs = check_schedule(p, ops)
    assert _has(errs, "rule 3", "copy stream of stage 0")


def test_pcie_group_overlap():
    kw = dict(num_stages=2, num_microbatches=1, t_f=1.0, t_b=1.0, t_w=1.0, t_offload=1.0, mem_f=1.0)
    ops = [
        ScheduledOp(0, 0, "F", 0, 1), ScheduledOp(1, 0, "F", 1, 2),
        ScheduledOp(1, 0, "B", 5, 6), ScheduledOp(1, 0, "W", 6, 7),
        ScheduledOp(0, 0, "B", 6, 7), ScheduledOp(0, 0, "W", 7, 8),
        ScheduledOp(0, 0, "O", 2, 3), ScheduledOp(0, 0, "R", 4, 5),
        ScheduledOp(1, 0, "O", 2, 3), ScheduledOp(1, 0, "R", 3, 4),
    ]
    free = ScheduleProblem.create(**kw)
    assert check_schedule(free, ops) == []
    grouped = ScheduleProblem.create(**kw, pcie_groups=[[0, 1]])
    errs = check_schedule(grouped, ops)
    assert _has(errs, "rule 3", "pcie group [0, 1]")


def test_memory_overflow_and_offload_relief():
    p = _problem(num_microbatches=3, mem_limit=8.0)  # 1F1B stage 0 holds 2 stashes = 8
    ops = _valid_ops(p)
    assert check_schedule(p, ops) == []
    tight = _problem(num_microbatches=3, mem_limit=7.0)
    errs = check_schedule(tight, ops)
    assert _has(errs, "rule 5", "stage 0", "over its limit 7")
    # offloading micro-batches 0 and 1 on stage 0 (instantly) relieves it
    p2 = _problem(num_microbatches=3, mem_limit=7.0, t_offload=0.0)
    ops2 = _valid_ops(p2, offload=[(0, 0), (0, 1)])
    assert check_schedule(p2, ops2) == []


def test_memory_profile_by_hand():
    p = _problem(num_stages=1, num_microbatches=2, offload_bytes=3.0)
    ops = [
        ScheduledOp(0, 0, "F", 0, 2), ScheduledOp(0, 0, "O", 2, 3),
        ScheduledOp(0, 1, "F", 2, 4), ScheduledOp(0, 0, "R", 4, 5),
        ScheduledOp(0, 1, "B", 4, 7), ScheduledOp(0, 1, "W", 7, 8),
        ScheduledOp(0, 0, "B", 8, 11), ScheduledOp(0, 0, "W", 11, 12),
    ]
    assert check_schedule(p, ops) == []
    t, m = memory_profile(p, ops, 0)
    # 0: +4 ; 2: +4 (F1) ; 3: -3 (O0 end) ; 4: +3 (R0) -3 (B1) ; 7: -1 ; 8: -3 ; 11: -1
    assert t.tolist() == [0, 2, 3, 4, 7, 8, 11]
    assert m.tolist() == [4, 8, 5, 5, 4, 1, 0]
    assert peak_memory(p, ops).tolist() == [8]
    lim = ScheduleProblem.create(**{**p._create_kwargs(), "mem_limit": 7.5})
    assert _has(check_schedule(lim, ops), "rule 5", "holds 8")


def test_objective_values():
    p = _problem()
    ops = [
        ScheduledOp(0, 0, "F", 1, 3), ScheduledOp(1, 0, "F", 3.5, 5.5),
        ScheduledOp(1, 0, "B", 5.5, 8.5), ScheduledOp(1, 0, "W", 8.5, 9.5),
        ScheduledOp(0, 0, "B", 9, 12), ScheduledOp(0, 0, "W", 12, 13),
    ]
    makespan, span = objective_values(p, ops)
    assert makespan == 12.0  # 13 - 1
    assert span == 12.0  # stage 0: 1 -> 13; stage 1: 3.5 -> 9.5
    sched = Schedule(tuple(ops), makespan, span)
    assert objective_values(p, sched) == (12.0, 12.0)


def test_tolerance_is_relative():
    p = _problem(t_f=1e5, t_b=1e5, t_w=1e5, t_comm=0.0)
    ops = _valid_ops(p)
    i = _find(ops, 0, 1, "W")
    ops[i] = replace(ops[i], end_s=ops[i].end_s + 1e-7)  # rounding noise of a solver
    assert check_schedule(p, ops) == []
    ops[i] = replace(ops[i], end_s=ops[i].end_s + 1.0)
    assert check_schedule(p, ops)


def test_orders_round_trip():
    p = _problem(num_stages=3, num_microbatches=4)
    orders = orders_1f1b(3, 4)
    sched = simulate(p, orders)
    assert schedule_to_orders(sched, p).stage_orders() == orders


def test_simulate_rejects_bad_orders():
    p = _problem()
    orders = orders_1f1b(2, 2)
    with pytest.raises(InputError, match="lacks"):
        simulate(p, {0: orders[0][:-1], 1: orders[1]})
    with pytest.raises(InputError, match="no entry for stage 1"):
        simulate(p, {0: orders[0]})
    bad = {0: [("W", 0), ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 1)], 1: orders[1]}
    with pytest.raises(InputError, match="deadlock"):
        simulate(p, bad)
    # cross-stage deadlock: B1 before B0 on stage 0, B0 before B1 on stage 1 is fine;
    # F1 before F0 on stage 1 while stage 0 runs F0 first is fine too; a real cycle:
    cyc = {0: [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("W", 1)],
           1: [("F", 1), ("B", 1), ("F", 0), ("B", 0), ("W", 0), ("W", 1)]}
    with pytest.raises(InputError, match="deadlock"):
        simulate(p, cyc)
    with pytest.raises(InputError, match="outside"):
        simulate(p, orders, offload=[(7, 0)])
