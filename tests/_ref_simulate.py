"""The pure-Python simulator as it was before issue 19 (scan every device at every step, re-merge the
copy calendar on every query, re-sort memory events on every forward): the oracle the fast
:func:`fxpipe.schedule.simulate.simulate` is compared against in tests/test_schedule_scale.py.
Kept verbatim apart from this docstring; not used by fxpipe.
"""
from __future__ import annotations

import math
import time
from typing import Iterable, Mapping, Sequence

from fxpipe.errors import InputError
from fxpipe.ir import Orders, Schedule, ScheduledOp, ScheduleProblem, sort_ops
from fxpipe.schedule.validate import objective_values

__all__ = ["simulate", "as_orders", "CopyCalendar"]

Order = Sequence[tuple[str, int]]


class CopyCalendar:
    """Busy intervals of the host-transfer (copy) resources of every stage.

    A copy op of stage s must not overlap any copy op of a stage on the same device (one
    copy stream per device) or of a stage that shares a pcie group with s (Contract 3
    rule 3).

    Parameters
    ----------
    num_stages : int
    pcie_groups : sequence of sequence of int
    device_of_stage : sequence of int, optional
        Placement; default one stage per device.
    """

    def __init__(self, num_stages: int, pcie_groups: Sequence[Sequence[int]] = (),
                 device_of_stage: Sequence[int] | None = None):
        self.busy: list[list[tuple[float, float]]] = [[] for _ in range(num_stages)]
        self.peers: list[set[int]] = [{s} for s in range(num_stages)]
        for g in pcie_groups:
            for a in g:
                self.peers[a].update(g)
        if device_of_stage is not None:
            for a in range(num_stages):
                self.peers[a].update(b for b in range(num_stages) if device_of_stage[b] == device_of_stage[a])

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


def as_orders(problem: ScheduleProblem, orders: Orders | Mapping[int, Order]) -> Orders:
    """Per-device :class:`~fxpipe.ir.Orders` for ``problem``, checked to be complete.

    Accepts :class:`~fxpipe.ir.Orders` (its placement must be the problem's) or the older
    per-stage form ``{stage: [(type, microbatch), ...]}`` (only with one stage per device).

    Raises
    ------
    InputError
        If a stage's order misses or repeats an op, names a micro-batch or stage outside the
        problem, or the placement differs from the problem's.
    """
    S, M = problem.num_stages, problem.num_microbatches
    if isinstance(orders, Orders):
        if tuple(orders.device_of_stage) != tuple(problem.device_of_stage):
            raise InputError(
                f"the orders place stages on devices {list(orders.device_of_stage)}, the problem on "
                f"{list(problem.device_of_stage)}"
            )
        out = orders
    else:
        if not isinstance(orders, Mapping):
            raise InputError(f"orders must be Orders or a mapping stage -> [(type, microbatch)], got {type(orders).__name__}")
        extra = set(orders) - set(range(S))
        if extra:
            raise InputError(f"orders names stages {sorted(extra)} outside 0..{S - 1}")
        for s in range(S):
            if s not in orders:
                raise InputError(f"orders has no entry for stage {s}: give the op order of every stage 0..{S - 1}")
        out = Orders.from_stage_orders(orders, problem.device_of_stage)
    for s in range(S):
        seen = set()
        for a in out.of_stage(s):
            if not a.is_compute:
                continue
            if not 0 <= a.microbatch < M:
                raise InputError(f"stage {s}: order names micro-batch {a.microbatch} outside 0..{M - 1}")
            seen.add((a.type, a.microbatch))
        if len(seen) != 3 * M:
            missing = [f"{t}{j}" for j in range(M) for t in "FBW" if (t, j) not in seen]
            raise InputError(f"stage {s}: the order lacks {', '.join(missing[:10])}")
    return out


def simulate(
    problem: ScheduleProblem,
    orders: Orders | Mapping[int, Order],
    *,
    offload: Iterable[tuple[int, int]] | None = None,
    method: str = "",
    meta: Mapping | None = None,
    respect_memory: bool = False,
) -> Schedule:
    """Time per-device op orders as early as possible (ASAP list scheduling).

    Parameters
    ----------
    problem : ScheduleProblem
    orders : Orders or mapping stage -> sequence of (type, microbatch)
        Per-device programs (:class:`~fxpipe.ir.Orders`, any placement; their O/R actions
        add to ``offload``), or, with one stage per device, for every stage 0..S-1 the order
        of its 3m compute ops (type in F, B, W).
    offload : iterable of (stage, microbatch), optional
        Stashes to offload after F and reload before B (see the module docstring for the
        placement rule).
    method : str
        Stored in the result.
    meta : mapping, optional
        Stored in the result (copied).
    respect_memory : bool, optional
        If True, a forward that would push its device over ``mem_limit`` waits until enough
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
        that its own device only runs later, e.g. ``W0`` before ``B0`` or ``B1`` before
        ``B0`` on one device and the reverse on another).

    References
    ----------
    PipeOffload (Wan et al. 2025) Section 4.2 (single copy stream, offload right after F,
    reload as late as possible); OptPipe Section 3 / Eq. 18-19 (pcie groups).
    """
    t0 = time.perf_counter()
    S, D = problem.num_stages, problem.num_devices
    dev = problem.device_of_stage
    checked = as_orders(problem, orders)
    seqs = [[a for a in row if a.is_compute] for row in checked.actions]
    off = set(checked.offloaded())
    for s, j in offload or ():
        s, j = int(s), int(j)
        if not (0 <= s < S and 0 <= j < problem.num_microbatches):
            raise InputError(f"offload names (stage {s}, micro-batch {j}) outside the problem")
        off.add((s, j))

    end: dict[tuple[int, int, str], float] = {}
    ops: list[ScheduledOp] = []
    pos = [0] * D
    free = [0.0] * D
    cal = CopyCalendar(S, problem.pcie_groups, dev)
    off_end: dict[tuple[int, int], float] = {}
    mem_events: list[list[tuple[float, float]]] = [[] for _ in range(D)]  # per device: (time, delta)
    delta = {"F": problem.mem_f, "B": problem.mem_b, "W": problem.mem_w}

    def fit_time(d: int, est: float, need: float) -> float:
        lim = float(problem.mem_limit[d])
        if not math.isfinite(lim):
            return est
        tol = 1e-9 * max(1.0, abs(lim))
        evs = sorted(mem_events[d])
        cands = [est] + sorted({t for t, _ in evs if t > est})
        for t in cands:
            cur = sum(x for te, x in evs if te <= t)
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
        return end.get((s, j, "B"))

    total = sum(len(v) for v in seqs)
    done = 0
    while done < total:
        best = None
        for d in range(D):
            if pos[d] >= len(seqs[d]):
                continue
            a = seqs[d][pos[d]]
            r = dep_ready(a.stage, a.type, a.microbatch)
            if r is None:
                continue
            est = max(free[d], r)
            if best is None or est < best[0]:
                best = (est, d)
        if best is None:
            blocked = [
                f"{'stage ' + str(seqs[d][pos[d]].stage) if len(problem.stages_of_device(d)) == 1 else 'device ' + str(d)}: "
                f"{seqs[d][pos[d]]}"
                for d in range(D) if pos[d] < len(seqs[d])
            ]
            raise InputError(
                "the orders deadlock: every device waits for an op another device runs later "
                f"(next ops: {', '.join(blocked[:8])}); fix the per-device orders"
            )
        est, d = best
        a = seqs[d][pos[d]]
        s, t, j = a.stage, a.type, a.microbatch
        if t == "B" and (s, j) in off:
            dur = problem.duration(s, "R")
            lo = off_end[(s, j)]
            x = cal.latest(s, lo, est, dur)
            if x is None:
                x = cal.earliest(s, lo, dur)
            cal.book(s, x, x + dur)
            mem_events[d].append((x, float(problem.offload_bytes[s])))
            end[(s, j, "R")] = x + dur
            ops.append(ScheduledOp(s, j, "R", x, x + dur))
            est = max(est, x + dur)
        if respect_memory and t == "F":
            est = fit_time(d, est, float(problem.mem_f[s]))
        dur = problem.duration(s, t)
        mem_events[d].append((est, float(delta[t][s])))
        if t == "B" and problem.mem_b_transient[s]:  # the replayed forward of a recomputing stage
            mem_events[d].append((est, float(problem.mem_b_transient[s])))
            mem_events[d].append((est + dur, -float(problem.mem_b_transient[s])))
        end[(s, j, t)] = est + dur
        ops.append(ScheduledOp(s, j, t, est, est + dur))
        free[d] = est + dur
        pos[d] += 1
        done += 1
        if t == "F" and (s, j) in off:
            dd = problem.duration(s, "O")
            x = cal.earliest(s, est + dur, dd)
            cal.book(s, x, x + dd)
            mem_events[d].append((x + dd, -float(problem.offload_bytes[s])))
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
