"""Time a pipeline schedule from per-stage op orders (ASAP list scheduling).

A pipeline schedule is usually described by *orders*: for every device the sequence of the
compute actions of the stages it holds (:class:`~fxpipe.ir.Orders`, e.g. ``0F0 0F1 3F0 3B0
...``; torch's ``pipeline_order``, Zero Bubble's per-stage orders). With one stage per device
the older per-stage form ``{stage: [("F", 0), ("F", 1), ("B", 0), ...]}`` is accepted too.
:func:`simulate` turns such orders into a timed :class:`~fxpipe.ir.Schedule` (DESIGN.md
Contract 3): every compute op starts as soon as its device has finished the previous op of
its order and its data dependencies (rule 2 of Contract 3, comm only between devices) are met.

Offload / reload (PipeOffload, Wan et al. 2025, Section 4.2; OptPipe Section 3): for every
``(stage, microbatch)`` in ``offload``

* the offload ``O`` is placed in the earliest free slot of the stage's copy stream that
  starts at or after the end of ``F(stage, microbatch)``;
* the reload ``R`` is placed *as late as possible*: in the latest free slot of the copy stream
  that ends by the time ``B(stage, microbatch)`` could start without it (the later of the
  previous op of the stage and the upstream gradient) and starts after ``O`` ended. When no
  such slot exists, ``R`` goes into the earliest free slot after ``O`` and ``B`` waits for it.

The copy stream of a device is shared by the offloads and reloads of all its stages (one
stream, as in PipeOffload Section 4.2); stages named together in a pcie group share one copy
resource (OptPipe Eq. 18-19). Copy ops go into *gaps* of these calendars, so a reload may be placed before an
offload that was decided earlier but lies later in time.

Memory limits are *not* enforced here (the simulator times a given order); callers check
the result with :func:`fxpipe.schedule.validate.check_schedule`.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import time
from typing import Iterable, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import Orders, Schedule, ScheduledOp, ScheduleProblem
from fxpipe.schedule.validate import objective_values_of_arrays, remember_op_arrays

__all__ = ["simulate", "as_orders", "CopyCalendar"]

Order = Sequence[tuple[str, int]]


class CopyCalendar:
    """Busy intervals of the host-transfer (copy) resources of every stage.

    A copy op of stage s must not overlap any copy op of a stage on the same device (one
    copy stream per device) or of a stage that shares a pcie group with s (Contract 3
    rule 3).

    Every stage keeps the union of the busy intervals of its peers as sorted, disjoint
    closed components, updated on each :meth:`book` (bisection), so :meth:`earliest` and
    :meth:`latest` start at the first component that can matter instead of re-merging every
    interval on each query; the answers are those of merging from scratch (the components of
    a union of closed intervals do not depend on the order they were added in).

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
            by_dev: dict[int, list[int]] = {}
            for b in range(num_stages):
                by_dev.setdefault(device_of_stage[b], []).append(b)
            for a in range(num_stages):
                self.peers[a].update(by_dev[device_of_stage[a]])
        # watchers[p]: stages whose calendar holds p's bookings (p is one of their peers)
        self._watchers: list[list[int]] = [[] for _ in range(num_stages)]
        for a in range(num_stages):
            for p in self.peers[a]:
                self._watchers[p].append(a)
        self._starts: list[list[float]] = [[] for _ in range(num_stages)]
        self._ends: list[list[float]] = [[] for _ in range(num_stages)]

    def _merged(self, stage: int) -> list[tuple[float, float]]:
        """Disjoint busy components of ``stage`` and its peers, sorted (touching ones merged)."""
        return list(zip(self._starts[stage], self._ends[stage]))

    def earliest(self, stage: int, ready: float, dur: float) -> float:
        """Earliest start ``>= ready`` of a free slot of length ``dur`` for ``stage``."""
        cur = ready
        if dur <= 0:
            return cur
        st, en = self._starts[stage], self._ends[stage]
        for k in range(bisect.bisect_right(en, cur), len(st)):  # components ending by `ready` never matter
            a, b = st[k], en[k]
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
        st, en = self._starts[stage], self._ends[stage]
        for k in range(bisect.bisect_left(st, x + dur) - 1, -1, -1):  # those starting after the slot never matter
            a, b = st[k], en[k]
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
        if not end > start:  # zero-length ops never block anything
            return
        for w in self._watchers[stage]:
            st, en = self._starts[w], self._ends[w]
            i = bisect.bisect_left(en, start)  # first component ending at or after `start`
            k = bisect.bisect_right(st, end) - 1  # last component starting at or before `end`
            if i <= k:
                a, b = min(start, st[i]), max(end, en[k])
                st[i:k + 1] = [a]
                en[i:k + 1] = [b]
            else:
                st.insert(i, start)
                en.insert(i, end)


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
    S, M = problem.num_stages, problem.num_microbatches
    seqs, off = _compute_programs(problem, orders)
    for s, j in offload or ():
        s, j = int(s), int(j)
        if not (0 <= s < S and 0 <= j < M):
            raise InputError(f"offload names (stage {s}, micro-batch {j}) outside the problem")
        off.add((s, j))
    # the generators time the same orders of the same problem several times (1F1B's in 1f1b,
    # zb-h1, 1f1b-limited, plain_peak; zb-h1 again inside zb-h2): remember the last timings
    key = (tuple(tuple(row) for row in seqs), frozenset(off), bool(respect_memory))
    for prob_seen, key_seen, ops_seen, values in _TIMED:
        if (prob_seen is problem or _same_timing(prob_seen, problem, respect_memory)) and key_seen == key:
            return Schedule(ops=ops_seen, makespan=values[0], stage_span=values[1], lower_bound_s=0.0,
                            status="heuristic", solver_time_s=time.perf_counter() - t0, method=method,
                            objective=problem.objective, meta=dict(meta or {}))
    sched = _simulate(problem, seqs, off, respect_memory, method, meta, t0)
    _TIMED.append((problem, key, sched.ops, (sched.makespan, sched.stage_span)))
    del _TIMED[:-_TIMED_KEEP]
    return sched


#: The last timings of :func:`simulate`: (problem, (programs, offloaded, respect_memory), ops, values).
_TIMED: list = []
_TIMED_KEEP = 32

#: What :func:`_simulate` reads of a problem to time its ops (with its ``pcie_groups``; with ``respect_memory``,
#: :data:`_MEMORY_FIELDS` too).
_TIMING_FIELDS = ("t_f", "t_b", "t_w", "t_offload", "t_comm", "device_of_stage")
_MEMORY_FIELDS = ("mem_f", "mem_b", "mem_w", "mem_b_transient", "offload_bytes", "mem_limit")


def _same_timing(a: ScheduleProblem, b: ScheduleProblem, respect_memory: bool) -> bool:
    """Whether :func:`_simulate` times every program of ``a`` as of ``b`` (the generators time one problem's
    orders again on its copy without memory limits, e.g. ``auto``'s unlimited round and ``plain_peak``)."""
    if (a.num_stages, a.num_devices, a.num_microbatches) != (b.num_stages, b.num_devices, b.num_microbatches):
        return False
    fields = _TIMING_FIELDS + (_MEMORY_FIELDS if respect_memory else ())
    return a.pcie_groups == b.pcie_groups and all(np.array_equal(getattr(a, f), getattr(b, f)) for f in fields)


def _simulate(problem: ScheduleProblem, seqs: list[list[tuple[int, str, int]]], off: set[tuple[int, int]],
              respect_memory: bool, method: str, meta: Mapping | None, t0: float) -> Schedule:
    """:func:`simulate` on checked programs (the module docstring's rules)."""
    S, D, M = problem.num_stages, problem.num_devices, problem.num_microbatches
    dev = problem.device_of_stage

    # ASAP list scheduling. The next op timed is always the device head with the earliest
    # start (ties: the lowest device): a head's start max(device free, data ready) is fixed
    # once its inputs have ended, so the ready heads wait in a heap keyed (start, device) and
    # only the heads of the devices next to a finished op are re-examined. This is the order
    # (and so the copy-stream and memory decisions) of scanning every device at every step.
    dur_of = {"F": [float(x) for x in problem.t_f], "B": [float(x) for x in problem.t_b],
              "W": [float(x) for x in problem.t_w]}
    t_copy = [float(x) for x in problem.t_offload]
    comm = [problem.comm(s) for s in range(S - 1)]
    end_f: list[list[float | None]] = [[None] * M for _ in range(S)]
    end_b: list[list[float | None]] = [[None] * M for _ in range(S)]
    pos = [0] * D
    free = [0.0] * D
    cal = CopyCalendar(S, problem.pcie_groups, dev)
    off_end: dict[tuple[int, int], float] = {}
    mem_f = [float(x) for x in problem.mem_f]
    delta = {"F": mem_f, "B": [float(x) for x in problem.mem_b], "W": [float(x) for x in problem.mem_w]}
    lims = [float(x) for x in problem.mem_limit]
    watch_any = respect_memory and any(math.isfinite(x) for x in lims)
    memory = _MemoryEvents(lims)

    heap: list[tuple[float, int]] = []
    queued = [False] * D
    lens = [len(v) for v in seqs]
    push = heapq.heappush
    last = S - 1

    def offer(d: int) -> None:
        """Queue device d's next op once its data dependencies have ended (rule 2)."""
        if queued[d] or pos[d] >= lens[d]:
            return
        s, t, j = seqs[d][pos[d]]
        if t == "F":
            if s == 0:
                r = 0.0
            else:
                r = end_f[s - 1][j]
                if r is None:
                    return
                r = r + comm[s - 1]
        elif t == "B":
            if s == last:
                r = end_f[s][j]
                if r is None:
                    return
            else:
                r = end_b[s + 1][j]
                if r is None or end_f[s][j] is None:
                    return
                r = r + comm[s]
        else:
            r = end_b[s][j]
            if r is None:
                return
        queued[d] = True
        push(heap, (max(free[d], r), d))

    for d in range(D):
        offer(d)
    total = sum(lens)
    done = 0
    rank = {"F": 0, "B": 1, "W": 2, "O": 3, "R": 4}  # sort_ops' type order
    recs: list[tuple[float, int, int, int, str, float]] = []  # (start, stage, rank, mb, type, end)
    mem_b_tr = [float(x) for x in problem.mem_b_transient]
    off_bytes = [float(x) for x in problem.offload_bytes]
    while done < total:
        if not heap:
            raise _deadlock(problem, seqs, pos)
        est, d = heapq.heappop(heap)
        queued[d] = False
        s, t, j = seqs[d][pos[d]]
        if off and t == "B" and (s, j) in off:
            dur = t_copy[s]
            lo = off_end[(s, j)]
            x = cal.latest(s, lo, est, dur)
            if x is None:
                x = cal.earliest(s, lo, dur)
            cal.book(s, x, x + dur)
            if watch_any:
                memory.add(d, x, off_bytes[s])
            recs.append((x, s, 4, j, "R", x + dur))
            est = max(est, x + dur)
        if watch_any and t == "F":
            est = memory.fit_time(d, est, mem_f[s])
        dur = dur_of[t][s]
        fin = est + dur
        if watch_any:
            memory.add(d, est, delta[t][s])
            if t == "B" and mem_b_tr[s]:  # the replayed forward of a recomputing stage
                memory.add(d, est, mem_b_tr[s])
                memory.add(d, fin, -mem_b_tr[s])
        if t == "F":
            end_f[s][j] = fin
        elif t == "B":
            end_b[s][j] = fin
        recs.append((est, s, rank[t], j, t, fin))
        free[d] = fin
        pos[d] += 1
        done += 1
        if off and t == "F" and (s, j) in off:
            dd = t_copy[s]
            x = cal.earliest(s, fin, dd)
            cal.book(s, x, x + dd)
            if watch_any:
                memory.add(d, x + dd, -off_bytes[s])
            off_end[(s, j)] = x + dd
            recs.append((x, s, 3, j, "O", x + dd))
        offer(d)  # its next op; then the ops that waited for this one: a forward feeds the next
        # stage's forward, a backward the previous stage's backward (the rest waits on device d)
        if t == "F":
            if s + 1 < S:
                d2 = dev[s + 1]
                if not queued[d2] and pos[d2] < lens[d2]:
                    offer(d2)
        elif t == "B" and s > 0:
            d2 = dev[s - 1]
            if not queued[d2] and pos[d2] < lens[d2]:
                offer(d2)

    return _timed_schedule(problem, recs, method, meta, t0)


def _deadlock(problem: ScheduleProblem, seqs: list[list[tuple[int, str, int]]], pos: list[int]) -> InputError:
    """The error when no device's next op (``seqs[d][pos[d]]``) can ever start."""
    blocked = [
        f"{'stage ' + str(seqs[d][pos[d]][0]) if len(problem.stages_of_device(d)) == 1 else 'device ' + str(d)}: "
        f"{seqs[d][pos[d]][0]}{seqs[d][pos[d]][1]}{seqs[d][pos[d]][2]}"
        for d in range(problem.num_devices) if pos[d] < len(seqs[d])
    ]
    return InputError(
        "the orders deadlock: every device waits for an op another device runs later "
        f"(next ops: {', '.join(blocked[:8])}); fix the per-device orders"
    )


class _MemoryEvents:
    """Per device, the memory events ``(time, delta)`` placed so far, kept sorted by (time,
    delta) (times and deltas apart), for memory-aware timing (``respect_memory``). Devices
    without a limit keep nothing (:meth:`fit_time` never reads them)."""

    __slots__ = ("lims", "times", "deltas", "watch")

    def __init__(self, lims: list[float]) -> None:
        self.lims = lims
        self.watch = [math.isfinite(x) for x in lims]
        self.times: list[list[float]] = [[] for _ in lims]
        self.deltas: list[list[float]] = [[] for _ in lims]

    def add(self, d: int, te: float, x: float) -> None:
        """Device ``d`` changes by ``x`` bytes at ``te`` (kept sorted by (time, delta), after equal ones)."""
        if not self.watch[d]:
            return
        times, deltas = self.times[d], self.deltas[d]
        hi = bisect.bisect_right(times, te)
        if hi and times[hi - 1] == te:  # events at the same time: ordered by delta
            i = bisect.bisect_right(deltas, x, bisect.bisect_left(times, te, 0, hi), hi)
        else:
            i = hi
        times.insert(i, te)
        deltas.insert(i, x)

    def fit_time(self, d: int, est: float, need: float) -> float:
        """Earliest event time >= est at which `need` more bytes fit (sums as the events sorted)."""
        lim = self.lims[d]
        if not math.isfinite(lim):
            return est
        tol = 1e-9 * max(1.0, abs(lim))
        times, xs = self.times[d], self.deltas[d]
        k = bisect.bisect_right(times, est)
        if sum(xs[:k]) + need <= lim + tol:
            return est
        n = len(times)
        while k < n:
            t = times[k]
            k = bisect.bisect_right(times, t, k)
            if sum(xs[:k]) + need <= lim + tol:
                return t
        return est


def _timed_schedule(problem: ScheduleProblem, recs: list, method: str, meta: Mapping | None, t0: float) -> Schedule:
    """The Schedule of the op records ``(start, stage, rank, mb, type, end)``: shifted to start
    at 0, in :func:`~fxpipe.ir.sort_ops`' canonical order, with both objective values."""
    t_min = min((r[0] for r in recs), default=0.0)
    if t_min != 0.0 and math.isfinite(t_min):
        recs = [(r[0] - t_min, r[1], r[2], r[3], r[4], r[5] - t_min) for r in recs]
    recs.sort()  # sort_ops' canonical order (start, stage, type, micro-batch): (stage, type, mb) are unique
    ops = tuple(_make_ops(recs))
    makespan = stage_span = 0.0
    if recs:
        a, s, rk, j, _, e = zip(*recs)
        arrays = (np.array(s, dtype=np.int64), np.array(j, dtype=np.int64), np.array(rk, dtype=np.int64),
                  np.array(a, dtype=np.float64), np.array(e, dtype=np.float64))
        remember_op_arrays(ops, arrays)
        makespan, stage_span = objective_values_of_arrays(problem, arrays)
    return Schedule(
        ops=ops,
        makespan=makespan,
        stage_span=stage_span,
        lower_bound_s=0.0,
        status="heuristic",
        solver_time_s=time.perf_counter() - t0,
        method=method,
        objective=problem.objective,
        meta=dict(meta or {}),
    )




_FIELDS = ("stage", "microbatch", "type", "start_s", "end_s")
_PLAIN_OP = (not hasattr(ScheduledOp, "__slots__") and not hasattr(ScheduledOp, "__post_init__")
             and tuple(f.name for f in dataclasses.fields(ScheduledOp)) == _FIELDS)


def _make_ops(recs) -> list[ScheduledOp]:
    """The ScheduledOp of every record, built without the frozen dataclass's per-field setattr."""
    if not _PLAIN_OP:
        return [ScheduledOp(s, j, t, a, e) for a, s, _, j, t, e in recs]
    new, put = object.__new__, object.__setattr__
    out = []
    for a, s, _, j, t, e in recs:
        o = new(ScheduledOp)
        put(o, "__dict__", {"stage": s, "microbatch": j, "type": t, "start_s": a, "end_s": e})
        out.append(o)
    return out


def _compute_programs(problem: ScheduleProblem, orders) -> tuple[list[list[tuple[int, str, int]]], set[tuple[int, int]]]:
    """The compute ops ``(stage, type, microbatch)`` of every device in program order, and the
    stashes the orders offload; checked as :func:`as_orders` checks them.

    The per-stage form with one stage per device, plain ``(str, int)`` pairs and every stage
    complete (what the generators pass) is read directly; anything else goes through
    :func:`as_orders`, which raises its errors.
    """
    S, M = problem.num_stages, problem.num_microbatches
    dev = problem.device_of_stage
    if (isinstance(orders, Mapping) and not isinstance(orders, Orders) and problem.one_stage_per_device
            and len(orders) == S and all(type(k) is int and 0 <= k < S for k in orders)):
        seqs: list[list[tuple[int, str, int]]] = [[] for _ in range(problem.num_devices)]
        ok = True
        for s, seq in orders.items():
            row = []
            for item in seq:
                if type(item) is not tuple or len(item) != 2:
                    ok = False
                    break
                t, j = item
                if type(j) is not int or not 0 <= j < M or t not in ("F", "B", "W") or type(t) is not str:
                    ok = False
                    break
                row.append((s, t, j))
            if not ok or len(row) != 3 * M or len({(t, j) for _, t, j in row}) != 3 * M:
                ok = False
                break
            seqs[dev[s]] = row
        if ok:
            return seqs, set()
    checked = as_orders(problem, orders)
    seqs = [[(a.stage, a.type, a.microbatch) for a in row if a.is_compute] for row in checked.actions]
    return seqs, set(checked.offloaded())
