"""Warm starts for the schedule MILP (OptPipe Section 4.1.3): the best heuristic schedule and
the variable values of a schedule in a built model. Memory feasibility and the trivial
schedule live in :mod:`~fxpipe.schedule.milp.feasibility` (re-exported here)."""

from __future__ import annotations

from typing import Any

from fxpipe.errors import InputError
from fxpipe.ir import Schedule, ScheduleProblem, schedule_to_orders
import fxpipe.schedule.heuristics as heuristics
import fxpipe.schedule.registry as registry
from fxpipe.schedule.milp.builder import MilpVars, durations
from fxpipe.schedule.milp.feasibility import check_memory_feasible, objective_value, sequential_schedule
from fxpipe.schedule.validate import check_schedule

__all__ = ["check_memory_feasible", "sequential_schedule", "warm_start_schedule", "warm_start_values", "objective_value"]

_COMPUTE = ("F", "B", "W")
#: Heuristics tried for the warm start, in order of preference on ties.
WARM_METHODS = registry.warm_start_order()


def warm_start_schedule(problem: ScheduleProblem) -> Schedule:
    """The best valid heuristic schedule (OptPipe Section 4.1.3), used as the MILP's start.

    Tries every heuristic of :mod:`fxpipe.schedule.heuristics` (those that do not fit the
    memory limit or the placement raise and are skipped), keeps the valid ones and returns
    the shortest; the one-micro-batch-at-a-time schedule is always a candidate.

    Raises
    ------
    InfeasibleError
        If no schedule fits the memory limits (see :func:`check_memory_feasible`).
    """
    check_memory_feasible(problem)
    best = sequential_schedule(problem)
    best_val = objective_value(problem, best.ops)
    tried: dict[str, Any] = {"sequential": best_val}
    for method in WARM_METHODS:
        try:
            sched = heuristics.generate(problem, method)
        except Exception as exc:  # noqa: BLE001 - a failing heuristic must not stop the MILP
            tried[method] = f"{type(exc).__name__}"
            continue
        if check_schedule(problem, sched.ops):
            tried[method] = "invalid"
            continue
        val = objective_value(problem, sched.ops)
        tried[method] = val
        if val < best_val - 1e-12 * max(1.0, abs(best_val)):
            best, best_val = sched, val
    return Schedule(
        ops=best.ops, makespan=best.makespan, stage_span=best.stage_span, lower_bound_s=best.lower_bound_s,
        status=best.status, solver_time_s=best.solver_time_s, method=best.method, objective=problem.objective,
        meta={**best.meta, "warm_candidates": tried},
    )


def _canonical_times(problem: ScheduleProblem, schedule: Schedule) -> tuple[dict, dict, dict, set]:
    """Start times of a schedule keyed (s, j, c), with offloads renumbered in mb order.

    Offloaded stashes' O slots (and R slots) are reassigned in micro-batch order; by an
    exchange argument this keeps the schedule valid (Section 4.1.1 symmetry breaking).
    """
    f0 = min(o.start_s for o in schedule.ops if o.stage == 0 and o.type == "F" and o.microbatch == 0)
    st = {}
    for o in schedule.ops:
        st[(o.stage, o.microbatch, o.type)] = o.start_s - f0
    O, R, off = {}, {}, set()
    for s in range(problem.num_stages):
        js = sorted(j for j in range(problem.num_microbatches) if (s, j, "O") in st)
        os_ = sorted(st[(s, j, "O")] for j in js)
        rs_ = sorted(st[(s, j, "R")] for j in js)
        for j, a, b in zip(js, os_, rs_):
            O[(s, j)], R[(s, j)] = a, b
            off.add((s, j))
    return st, O, R, off


def warm_start_values(problem: ScheduleProblem, V: MilpVars, schedule: Schedule) -> dict[str, float]:
    """Every variable's value (by name) for a valid ``schedule`` in the model of ``V``.

    Order binaries follow the schedule's program order on each device
    (:func:`fxpipe.ir.schedule_to_orders`), times are shifted so F(0, 0) starts at 0. Hand
    the result to :func:`fxpipe.mip.solve_model` with ``warm_start_complete=True`` (SCIP
    checks it and uses it if feasible).

    Raises
    ------
    InputError
        If ``schedule`` is not a :class:`~fxpipe.ir.Schedule`.
    """
    if not isinstance(schedule, Schedule):
        raise InputError(f"warm start must be a Schedule, got {type(schedule).__name__}")
    S, M = problem.num_stages, problem.num_microbatches
    u = V.unit_s
    st, Os, Rs, off = _canonical_times(problem, schedule)
    durs = durations(problem)
    val: dict[str, float] = {}

    def setv(var, x):
        val[var.name] = float(x)

    for (s, j, c), var in V.E.items():
        setv(var, (st[(s, j, c)] + float(durs[c][s])) / u)
    orders = schedule_to_orders(schedule, problem)
    pos = {}
    for row in orders.actions:
        k = 0
        for a in row:
            if a.is_compute:
                pos[(a.stage, a.microbatch, a.type)] = k
                k += 1
    for (a, b), var in V.pair.items():
        setv(var, 1.0 if pos[a] < pos[b] else 0.0)
    start = {k: st[k] / u for k in st if k[2] in _COMPUTE}
    to = {s: float(problem.t_offload[s]) / u for s in range(S)}
    Ov, Rv, xv = {}, {}, {}
    for s in range(S):
        if (s, 0) not in V.x:
            continue
        prevO = prevR = None
        gap = to[s] if to[s] > 0 else V.eps
        for j in range(M):
            xj = 1.0 if (s, j) in off else 0.0
            fend = start[(s, j, "F")] + float(problem.t_f[s]) / u
            if xj:
                o, r = Os[(s, j)] / u, Rs[(s, j)] / u
            else:
                o = max(fend, prevO if prevO is not None else 0.0)
                r = max(o, prevR if prevR is not None else 0.0)
            Ov[(s, j)], Rv[(s, j)], xv[(s, j)] = o, r, xj
            prevO, prevR = o + gap * xj, r + gap * xj
            setv(V.x[(s, j)], xj)
            setv(V.O[(s, j)], o)
            setv(V.R[(s, j)], r)
    for (s, k, l), var in V.yor.items():
        setv(var, 1.0 if Ov[(s, l)] + to[s] <= Rv[(s, k)] + 1e-12 else 0.0)
    for (s, k, l), var in V.g.items():
        fk = start[(s, k, "F")]
        ok = xv[(s, l)] and Ov[(s, l)] + to[s] <= fk + 1e-12 and Rv[(s, l)] >= fk + V.eps
        setv(var, 1.0 if ok else 0.0)
    for (s, k, c, j), var in V.q.items():
        sj = start[(s, j, c)]
        setv(var, 1.0 if sj <= Rv[(s, k)] + (V.eps / 2 if c == "F" else 0.0) else 0.0)
    for (s, k, l), var in V.w.items():
        ok = xv[(s, l)] and val[V.yor[(s, k, l)].name] > 0.5 and start[(s, l, "F")] < start[(s, k, "B")]
        setv(var, 1.0 if ok else 0.0)
    for key, var in V.pcie.items():
        s1, t1, j, s2, t2, k = key
        a = (Ov if t1 == "O" else Rv)[(s1, j)]
        b = (Ov if t2 == "O" else Rv)[(s2, k)]
        setv(var, 1.0 if a <= b else 0.0)
    setv(V.C, objective_value(problem, schedule.ops) / u)
    return val
