"""Time a pipeline schedule from per-stage op orders (ASAP list scheduling).

A pipeline schedule is usually described by *orders*: for every stage the sequence of its
compute ops, e.g. ``[("F", 0), ("F", 1), ("B", 0), ("W", 0), ...]`` (torch's
``Schedule1F1B`` action lists, Zero Bubble's per-stage orders). :func:`simulate` turns such
orders into a timed :class:`~fxpipe.ir.Schedule` (DESIGN.md Contract 3): every compute op
starts as soon as its stage has finished the previous op of its order and its data
dependencies (rule 2 of Contract 3) are met.

Offload / reload (PipeOffload, Wan et al. 2025, Section 4.2; OptPipe Section 3): for every
``(stage, microbatch)`` in ``offload``

* the offload ``O`` is placed in the earliest free slot of the stage's copy stream that
  starts at or after the end of ``F(stage, microbatch)``;
* the reload ``R`` is placed *as late as possible*: in the latest free slot of the copy stream
  that ends by the time ``B(stage, microbatch)`` could start without it (the later of the
  previous op of the stage and the upstream gradient) and starts after ``O`` ended. When no
  such slot exists, ``R`` goes into the earliest free slot after ``O`` and ``B`` waits for it.

The copy stream of a stage is shared by offloads and reloads (one stream, as in PipeOffload
Section 4.2); stages named together in a pcie group share one copy resource (OptPipe
Eq. 18-19). Copy ops go into *gaps* of these calendars, so a reload may be placed before an
offload that was decided earlier but lies later in time.

Memory limits are *not* enforced here (the simulator times a given order); callers check
the result with :func:`fxpipe.schedule.validate.check_schedule`.
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Mapping, Sequence

from fxpipe.errors import InputError
from fxpipe.ir import Schedule, ScheduledOp, ScheduleProblem, sort_ops
from fxpipe.schedule.validate import objective_values

__all__ = ["simulate", "CopyCalendar", "orders_from_schedule"]

Order = Sequence[tuple[str, int]]


class CopyCalendar:
    """Busy intervals of the host-transfer (copy) resources of every stage.

    A copy op of stage s must not overlap any copy op of s itself or of a stage that shares a
    pcie group with s (Contract 3 rule 3).

    Parameters
    ----------
    num_stages : int
    pcie_groups : sequence of sequence of int
    """

    def __init__(self, num_stages: int, pcie_groups: Sequence[Sequence[int]] = ()):
        self.busy: list[list[tuple[float, float]]] = [[] for _ in range(num_stages)]
        self.peers: list[set[int]] = [{s} for s in range(num_stages)]
        for g in pcie_groups:
            for a in g:
                self.peers[a].update(g)

    def _merged(self, stage: int) -> list[tuple[float, float]]:
        ivs = sorted(iv for p in self.peers[stage] for iv in self.busy[p] if iv[1] > iv[0])
        out: list[tuple[float, float]] = []
        for a, b in ivs:
            if out and a <= out[-1][1]:
                if b > out[-1][1]:
                    out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out

    def earliest(self, stage: int, ready: float, dur: float) -> float:
        """Earliest start ``>= ready`` of a free slot of length ``dur`` for ``stage``."""
        cur = ready
        if dur <= 0:
            return cur
        for a, b in self._merged(stage):
            if b <= cur:
                continue
            if a >= cur + dur:
                break
            cur = max(cur, b)
        return cur

    def latest(self, stage: int, lo: float, deadline: float, dur: float) -> float | None:
        """Latest start ``x >= lo`` with ``[x, x + dur]`` free and ``x + dur <= deadline``."""
        x = deadline - dur
        if x < lo:
            return None
        if dur <= 0:
            return x
        for a, b in reversed(self._merged(stage)):
            if a >= x + dur:
                continue
            if b <= x:
                break
            x = a - dur
            if x < lo:
                return None
        return x if x >= lo else None

    def book(self, stage: int, start: float, end: float) -> None:
        """Mark ``[start, end)`` busy on ``stage``'s copy stream."""
        self.busy[stage].append((start, end))


def _check_orders(problem: ScheduleProblem, orders: Mapping[int, Order]) -> dict[int, list[tuple[str, int]]]:
    S, M = problem.num_stages, problem.num_microbatches
    out: dict[int, list[tuple[str, int]]] = {}
    for s in range(S):
        if s not in orders:
            raise InputError(f"orders has no entry for stage {s}: give the op order of every stage 0..{S - 1}")
        seq = [(str(t), int(j)) for t, j in orders[s]]
        seen = set()
        for t, j in seq:
            if t not in ("F", "B", "W"):
                raise InputError(f"stage {s}: order contains op type {t!r}; orders list F, B and W only")
            if not 0 <= j < M:
                raise InputError(f"stage {s}: order names micro-batch {j} outside 0..{M - 1}")
            if (t, j) in seen:
                raise InputError(f"stage {s}: {t}{j} appears twice in the order")
            seen.add((t, j))
        if len(seen) != 3 * M:
            missing = [f"{t}{j}" for j in range(M) for t in "FBW" if (t, j) not in seen]
            raise InputError(f"stage {s}: the order lacks {', '.join(missing[:10])}")
        out[s] = seq
    extra = set(orders) - set(range(S))
    if extra:
        raise InputError(f"orders names stages {sorted(extra)} outside 0..{S - 1}")
    return out


def simulate(
    problem: ScheduleProblem,
    orders: Mapping[int, Order],
    *,
    offload: Iterable[tuple[int, int]] | None = None,
    method: str = "",
    meta: Mapping | None = None,
    respect_memory: bool = False,
) -> Schedule:
    """Time per-stage op orders as early as possible (ASAP list scheduling).

    Parameters
    ----------
    problem : ScheduleProblem
    orders : mapping stage -> sequence of (type, microbatch)
        For every stage 0..S-1 the order of its 3m compute ops (type in F, B, W).
    offload : iterable of (stage, microbatch), optional
        Stashes to offload after F and reload before B (see the module docstring for the
        placement rule).
    method : str
        Stored in the result.
    meta : mapping, optional
        Stored in the result (copied).
    respect_memory : bool, optional
        If True, a forward that would push its stage over ``mem_limit`` waits until enough
        offloads placed so far have ended (memory-aware list scheduling; reloads placed
        later are not foreseen, so the result must still be validated). Default False:
        pure ASAP timing of the orders.

    Returns
    -------
    Schedule
        Timed ops (the first op starts at 0), both objective values, ``status="heuristic"``.
        Memory limits are not checked: use :func:`~fxpipe.schedule.validate.check_schedule`.

    Raises
    ------
    InputError
        If an order misses or repeats an op, or the orders deadlock (an op waits for an op
        that its own stage only runs later, e.g. ``W0`` before ``B0`` or ``B1`` before ``B0``
        on one stage and the reverse on another).

    References
    ----------
    PipeOffload (Wan et al. 2025) Section 4.2 (single copy stream, offload right after F,
    reload as late as possible); OptPipe Section 3 / Eq. 18-19 (pcie groups).
    """
    t0 = time.perf_counter()
    S = problem.num_stages
    seqs = _check_orders(problem, orders)
    off = set()
    for s, j in offload or ():
        s, j = int(s), int(j)
        if not (0 <= s < S and 0 <= j < problem.num_microbatches):
            raise InputError(f"offload names (stage {s}, micro-batch {j}) outside the problem")
        off.add((s, j))

    end: dict[tuple[int, int, str], float] = {}
    start: dict[tuple[int, int, str], float] = {}
    ops: list[ScheduledOp] = []
    pos = [0] * S
    free = [0.0] * S
    cal = CopyCalendar(S, problem.pcie_groups)
    off_end: dict[tuple[int, int], float] = {}
    mem_events: list[list[tuple[float, float]]] = [[] for _ in range(S)]  # (time, delta)
    delta = {"F": problem.mem_f, "B": problem.mem_b, "W": problem.mem_w}

    def fit_time(s: int, est: float, need: float) -> float:
        lim = float(problem.mem_limit[s])
        if not math.isfinite(lim):
            return est
        tol = 1e-9 * max(1.0, abs(lim))
        evs = sorted(mem_events[s])
        cands = [est] + sorted({t for t, _ in evs if t > est})
        for t in cands:
            cur = sum(d for te, d in evs if te <= t)
            if cur + need <= lim + tol:
                return t
        return est

    def dep_ready(s: int, t: str, j: int) -> float | None:
        """Earliest start allowed by data dependencies, None if a predecessor is unscheduled."""
        if t == "F":
            if s == 0:
                return 0.0
            e = end.get((s - 1, j, "F"))
            return None if e is None else e + problem.comm(s - 1)
        if t == "B":
            if s == S - 1:
                return end.get((s, j, "F"))
            e = end.get((s + 1, j, "B"))
            if e is None or (s, j, "F") not in end:
                return None
            return e + problem.comm(s)
        e = end.get((s, j, "B"))
        return e

    total = sum(len(v) for v in seqs.values())
    done = 0
    while done < total:
        best = None
        for s in range(S):
            if pos[s] >= len(seqs[s]):
                continue
            t, j = seqs[s][pos[s]]
            r = dep_ready(s, t, j)
            if r is None:
                continue
            est = max(free[s], r)
            if best is None or est < best[0]:
                best = (est, s)
        if best is None:
            blocked = [f"stage {s}: {seqs[s][pos[s]][0]}{seqs[s][pos[s]][1]}" for s in range(S) if pos[s] < len(seqs[s])]
            raise InputError(
                "the orders deadlock: every stage waits for an op another stage runs later "
                f"(next ops: {', '.join(blocked[:8])}); fix the per-stage orders"
            )
        est, s = best
        t, j = seqs[s][pos[s]]
        if t == "B" and (s, j) in off:
            d = problem.duration(s, "R")
            lo = off_end[(s, j)]
            x = cal.latest(s, lo, est, d)
            if x is None:
                x = cal.earliest(s, lo, d)
            cal.book(s, x, x + d)
            mem_events[s].append((x, float(problem.offload_bytes[s])))
            start[(s, j, "R")], end[(s, j, "R")] = x, x + d
            ops.append(ScheduledOp(s, j, "R", x, x + d))
            est = max(est, x + d)
        if respect_memory and t == "F":
            est = fit_time(s, est, float(problem.mem_f[s]))
        d = problem.duration(s, t)
        mem_events[s].append((est, float(delta[t][s])))
        start[(s, j, t)], end[(s, j, t)] = est, est + d
        ops.append(ScheduledOp(s, j, t, est, est + d))
        free[s] = est + d
        pos[s] += 1
        done += 1
        if t == "F" and (s, j) in off:
            dd = problem.duration(s, "O")
            x = cal.earliest(s, est + d, dd)
            cal.book(s, x, x + dd)
            mem_events[s].append((x + dd, -float(problem.offload_bytes[s])))
            off_end[(s, j)] = x + dd
            ops.append(ScheduledOp(s, j, "O", x, x + dd))

    t_min = min((o.start_s for o in ops), default=0.0)
    if t_min != 0.0 and math.isfinite(t_min):
        ops = [ScheduledOp(o.stage, o.microbatch, o.type, o.start_s - t_min, o.end_s - t_min) for o in ops]
    makespan, stage_span = objective_values(problem, ops)
    return Schedule(
        ops=tuple(sort_ops(ops)),
        makespan=makespan,
        stage_span=stage_span,
        lower_bound_s=0.0,
        status="heuristic",
        solver_time_s=time.perf_counter() - t0,
        method=method,
        objective=problem.objective,
        meta=dict(meta or {}),
    )


def orders_from_schedule(schedule: Schedule | Iterable[ScheduledOp], num_stages: int) -> dict[int, list[tuple[str, int]]]:
    """Per-stage compute order (F/B/W by start time) of a timed schedule.

    Parameters
    ----------
    schedule : Schedule or iterable of ScheduledOp
    num_stages : int

    Returns
    -------
    dict stage -> list of (type, microbatch)
        The input format of :func:`simulate`; O/R ops are dropped.
    """
    ops = schedule.ops if isinstance(schedule, Schedule) else list(schedule)
    out: dict[int, list[tuple[str, int]]] = {s: [] for s in range(num_stages)}
    rank = {"F": 0, "B": 1, "W": 2}
    for o in sorted((o for o in ops if o.type in rank), key=lambda o: (o.start_s, o.end_s, rank[o.type], o.microbatch)):
        out[o.stage].append((o.type, o.microbatch))
    return out
