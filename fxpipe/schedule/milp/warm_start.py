"""Warm starts for the schedule MILP (OptPipe Section 4.1.3): the best heuristic schedule,
memory feasibility, and the variable values of a schedule in a built model."""

from __future__ import annotations

from typing import Any

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import Schedule, ScheduledOp, ScheduleProblem, schedule_to_orders, sort_ops
import fxpipe.schedule.registry as registry
from fxpipe.schedule.milp.builder import MilpVars, durations

__all__ = ["check_memory_feasible", "sequential_schedule", "warm_start_schedule", "warm_start_values", "objective_value"]

_COMPUTE = ("F", "B", "W")
#: Heuristics tried for the warm start, in order of preference on ties.
WARM_METHODS = registry.warm_start_order()


def objective_value(problem: ScheduleProblem, ops) -> float:
    """The problem's objective of a list of timed ops (per-device span or makespan)."""
    from fxpipe.schedule.validate import objective_values

    ms, span = objective_values(problem, ops)
    return float(span if problem.objective == "stage_span" else ms)


def check_memory_feasible(problem: ScheduleProblem) -> None:
    """Raise unless some schedule the MILP models fits every device's memory limit.

    A device holding one stage s: the exact condition is ``mem_f[s] <= mem_limit``.
    Necessary: at the start of any F the op's own ``mem_f`` is counted, and every other
    micro-batch contributes ``>= 0`` (``mem_f - offload_bytes >= 0`` while offloaded,
    ``mem_f + mem_b = -mem_w >= 0`` after B, 0 after W), so offloading cannot help the first
    F. Sufficient: running one micro-batch at a time (OptPipe Section 4.1.3's trivial
    schedule) peaks at exactly ``mem_f``. A device holding several stages must hold one
    micro-batch's stashes on all of them at once (its first stage's B waits for the last
    stage's): ``sum mem_f`` without offload, which the MILP does not model there.

    Raises
    ------
    InfeasibleError
        Naming the first device where no schedule fits, even with offloading.
    InputError
        If a device with several stages fits only with offloading (not modelled).
    """
    from fxpipe.schedule.device_greedy import min_device_memory

    need_off = min_device_memory(problem, offload=True)
    need = min_device_memory(problem, offload=False)
    for d, stages in enumerate(problem.device_stages):
        lim = float(problem.mem_limit[d])
        if need_off[d] > lim * (1 + 1e-12):
            if len(stages) == 1:
                s = stages[0]
                raise InfeasibleError(
                    f"stage {s}: one micro-batch needs {problem.stash_footprint[s]:g} bytes (its stash mem_f="
                    f"{float(problem.mem_f[s]):g}, plus the replayed forward if it recomputes) but mem_limit is {lim:g}; no schedule fits even with "
                    "offloading (the stash of the running op is on the device). Raise the limit, use more stages "
                    "or smaller micro-batches."
                )
            raise InfeasibleError(
                f"device {d} (stages {list(stages)}): one micro-batch needs {need_off[d]:g} bytes on it even with "
                f"offloading, over its mem_limit {lim:g}; no schedule fits. Raise the limit or place fewer stages on it."
            )
        if len(stages) > 1 and need[d] > lim * (1 + 1e-12):
            raise InputError(
                f"device {d} (stages {list(stages)}): one micro-batch's stashes on all its stages need {need[d]:g} "
                f"bytes, over its mem_limit {lim:g}; only offloading could fit it, which fxpipe does not schedule "
                "on devices with several stages yet. Raise the limit or use one stage per device."
            )


def sequential_schedule(problem: ScheduleProblem) -> Schedule:
    """One micro-batch in flight at a time: the trivial feasible schedule (OptPipe 4.1.3).

    Forward through every stage, then backward back with each W right after its B; comm only
    between devices.
    Any placement; its peak memory is :func:`fxpipe.schedule.device_greedy.min_device_memory`
    without offload.
    """
    S, M = problem.num_stages, problem.num_microbatches
    ops: list[ScheduledOp] = []
    t = 0.0
    for j in range(M):
        for s in range(S):
            if s > 0:
                t += problem.comm(s - 1)
            d = problem.duration(s, "F")
            ops.append(ScheduledOp(s, j, "F", t, t + d))
            t += d
        for s in reversed(range(S)):
            if s < S - 1:
                t += problem.comm(s)
            d = problem.duration(s, "B")
            ops.append(ScheduledOp(s, j, "B", t, t + d))
            t += d
            # W right after its B: what a recomputing B keeps for W is freed before the next
            # B's replay, so the peak is min_device_memory (without offload)
            d = problem.duration(s, "W")
            ops.append(ScheduledOp(s, j, "W", t, t + d))
            t += d
    ops = sort_ops(ops)
    from fxpipe.schedule.validate import objective_values

    ms, span = objective_values(problem, ops)
    return Schedule(ops=tuple(ops), makespan=ms, stage_span=span, method="sequential", objective=problem.objective)


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
    from fxpipe.schedule import heuristics
    from fxpipe.schedule.validate import check_schedule

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
