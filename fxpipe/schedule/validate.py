"""Independent validator of timed pipeline schedules (DESIGN.md Contract 3).

Every schedule fxpipe produces (heuristics, the MILP, cached files) is checked here before
it is used or written. The checker knows nothing about how a schedule was made: it reads
the problem and the list of timed ops and re-derives every rule of Contract 3 from scratch.

Rules (numbers as in Contract 3):

1. each (stage s, micro-batch j) has exactly one F, B and W; O and R come together or not at
   all; ``end - start`` equals the op's duration;
2. ``F(s,j).start >= F(s-1,j).end + t_comm[s-1]``; ``B(s,j).start >= B(s+1,j).end + t_comm[s]``;
   ``B(S-1,j).start >= F(S-1,j).end``; ``W(s,j).start >= B(s,j).end``;
3. F/B/W ops of one device (all the stages it holds) never overlap; O/R ops of one device
   never overlap; O/R ops of stages in one pcie group never overlap; ``t_comm`` applies only
   between stages on different devices (rule 2 uses :meth:`ScheduleProblem.comm`, which is 0
   between stages on one device);
4. ``O(s,j).start >= F(s,j).end``, ``R(s,j).start >= O(s,j).end`` and ``R(s,j).end <= B(s,j).start``;
5. memory of stage s at time t is the sum of the deltas of its F/B/W ops that have started by
   t, plus ``mem_b_transient[s]`` for every B of s running at t (``B.start <= t < B.end``;
   the replayed forward of a recomputing stage), minus ``offload_bytes[s]`` for every
   (s, j) with ``O.end <= t < R.start``; memory of a device is the sum over its stages and
   never exceeds the device's ``mem_limit[d]`` (checked at every op start, which is where it
   can rise).

Tolerances: times are compared with an absolute tolerance ``tol * max(1, T)`` where ``T`` is
the largest absolute time in the schedule (so the check is scale-free for times in seconds or
in abstract units), memory with ``tol * max(1, M)`` where ``M`` is the largest of the device's
limit (when finite) and the per-micro-batch stashes of its stages.

References
----------
.. [1] OptPipe (Li et al. 2025), "OptPipe: memory- and scheduling-optimized pipeline
   parallelism for LLM training", Section 3 (constraints (1)-(13), objectives Eq. 3/4).
.. [2] Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Section 2-3 (F/B/W split).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import defaultdict
from typing import Callable, Iterable, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OP_TYPES, Schedule, ScheduledOp, ScheduleProblem, sort_ops

__all__ = [
    "InvalidScheduleError",
    "check_schedule",
    "check_op_arrays",
    "validate_schedule",
    "objective_values",
    "objective_values_of_arrays",
    "memory_profile",
    "device_memory_profile",
    "device_busy_s",
    "device_spans",
    "place_fused_w",
    "peak_memory",
    "offloaded_peak",
    "stage_peaks",
    "require_one_stage_per_device",
]

_MAX_REPORTED = 50


class InvalidScheduleError(AssertionError):
    """A schedule violates Contract 3; ``violations`` lists every broken rule.

    Subclass of :class:`AssertionError` (a broken schedule from one of our own generators is
    a bug, not a user error).
    """

    def __init__(self, violations: Sequence[str], method: str = ""):
        self.violations = list(violations)
        head = f"invalid schedule{f' from {method!r}' if method else ''}: {len(self.violations)} violation(s)"
        shown = self.violations[:_MAX_REPORTED]
        more = len(self.violations) - len(shown)
        body = "\n  ".join(shown) + (f"\n  ... and {more} more" if more > 0 else "")
        super().__init__(f"{head}\n  {body}")


def require_one_stage_per_device(problem: ScheduleProblem, method: str) -> None:
    """Raise :class:`InputError` unless every device holds exactly one stage.

    The classic generators (GPipe, 1F1B, ZB-H1/H2, the Zero Bubble greedy, PipeOffload,
    AdaOffload) schedule one stage per device; placements with several stages per device
    have their own generators.
    """
    if not problem.one_stage_per_device:
        d = next(d for d, st in enumerate(problem.device_stages) if len(st) > 1)
        raise InputError(
            f"{method} schedules one stage per device, but device {d} holds stages "
            f"{list(problem.stages_of_device(d))}: use interleaved-1f1b (looped placement), zb-v or "
            "dualpipe-v (V placement), greedy or milp (any placement)"
        )


def _ops_of(schedule_or_ops: Schedule | Iterable[ScheduledOp]) -> list[ScheduledOp]:
    if isinstance(schedule_or_ops, Schedule):
        return list(schedule_or_ops.ops)
    return list(schedule_or_ops)


def _label(op: ScheduledOp) -> str:
    return f"{op.type}(stage {op.stage}, mb {op.microbatch}) [{op.start_s:.9g}, {op.end_s:.9g}]"


def _time_tol(ops: Sequence[ScheduledOp], tol: float) -> float:
    scale = 1.0
    for o in ops:
        for x in (o.start_s, o.end_s):
            if math.isfinite(x):
                scale = max(scale, abs(x))
    return tol * scale


def _time_tol_arrays(t0: np.ndarray, t1: np.ndarray, tol: float) -> float:
    """:func:`_time_tol` from the start and end arrays (the same value: a maximum is exact)."""
    scale = 1.0
    for x in (t0, t1):
        fin = x[np.isfinite(x)]
        if fin.size:
            scale = max(scale, float(np.abs(fin).max()))
    return tol * scale


def _mem_tol(problem: ScheduleProblem, d: int, tol: float) -> float:
    scale = max([1.0] + [float(problem.stash_footprint[s]) for s in problem.stages_of_device(d)])
    lim = float(problem.mem_limit[d])
    if math.isfinite(lim):
        scale = max(scale, abs(lim))
    return tol * scale


def check_schedule(
    problem: ScheduleProblem,
    schedule_or_ops: Schedule | Iterable[ScheduledOp],
    *,
    tol: float = 1e-9,
) -> list[str]:
    """Every rule of Contract 3 that a schedule breaks, as human-readable messages.

    Parameters
    ----------
    problem : ScheduleProblem
        The problem the schedule claims to solve.
    schedule_or_ops : Schedule or iterable of ScheduledOp
        The timed ops (start/end in the problem's time unit).
    tol : float, optional
        Relative tolerance (see the module docstring), default 1e-9.

    Returns
    -------
    list of str
        One message per violation, naming the rule, stage, micro-batch and op; empty if the
        schedule is valid.

    References
    ----------
    DESIGN.md Contract 3; OptPipe Section 3 constraints.
    """
    ops_key = schedule_or_ops.ops if isinstance(schedule_or_ops, Schedule) else schedule_or_ops
    if isinstance(ops_key, tuple):  # immutable ops: the same check of the same objects is remembered
        for prob_seen, ops_seen, tol_seen, errs_seen in _CHECKED:
            if prob_seen is problem and ops_seen is ops_key and tol_seen == tol:
                return list(errs_seen)
    ops = _ops_of(schedule_or_ops)
    errs = _fast_check(problem, ops, tol, _arrays_of(ops_key, ops))
    if errs is None:  # something the vectorised pass does not settle: the rule-by-rule check
        errs = _check_schedule(problem, ops, tol)
    if isinstance(ops_key, tuple):
        _CHECKED.append((problem, ops_key, tol, tuple(errs)))
        del _CHECKED[:-_CHECKED_KEEP]
    return errs


#: The last checks of :func:`check_schedule` on immutable ops (the generators, their callers
#: and ``schedule="auto"`` check one schedule several times); holds the objects themselves.
_CHECKED: list[tuple[ScheduleProblem, tuple, float, tuple[str, ...]]] = []
_CHECKED_KEEP = 16


_CODE = {t: i for i, t in enumerate(OP_TYPES)}  # F 0, B 1, W 2, O 3, R 4


def _op_arrays(ops: Sequence[ScheduledOp]) -> tuple[np.ndarray, ...] | None:
    """stage, micro-batch, type code, start, end of every op (None if a field is not plain)."""
    if not ops:
        return None
    st, mb, ty, t0, t1 = zip(*map(_FIELDS, ops))
    if set(map(type, st)) != {int} or set(map(type, mb)) != {int} or not set(ty) <= _CODE.keys():
        return None
    try:
        return (np.array(st, dtype=np.int64), np.array(mb, dtype=np.int64),
                np.array([_CODE[t] for t in ty], dtype=np.int64), np.array(t0, dtype=np.float64),
                np.array(t1, dtype=np.float64))
    except (TypeError, ValueError, OverflowError):
        return None


_FIELDS = operator.attrgetter("stage", "microbatch", "type", "start_s", "end_s")

#: (ops tuple, its _op_arrays) of the last schedules the simulator made (identity-matched).
_ARRAYS: list[tuple[tuple, tuple[np.ndarray, ...]]] = []


def remember_op_arrays(ops: tuple, arrays: tuple[np.ndarray, ...]) -> None:
    """Record the field arrays (stage, micro-batch, type code F0 B1 W2 O3 R4, start, end) of an
    immutable ops tuple, so the checks of that very tuple need not read them op by op."""
    _ARRAYS.append((ops, arrays))
    del _ARRAYS[:-32]


def _arrays_of(ops_obj, ops: Sequence[ScheduledOp]) -> tuple[np.ndarray, ...] | None:
    if isinstance(ops_obj, Schedule):
        ops_obj = ops_obj.ops
    if isinstance(ops_obj, tuple):
        for seen, arrays in reversed(_ARRAYS):
            if seen is ops_obj:
                return arrays
    return _op_arrays(ops)


def _events(problem: ScheduleProblem, st: np.ndarray, mb: np.ndarray, ty: np.ndarray, t0: np.ndarray,
            t1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The memory events of :func:`_profile` (times, deltas), sorted as it sorts them.

    Needs at most one op per (stage, micro-batch, type).
    """
    mem_b = problem.mem_b + problem.mem_b_transient
    tr = problem.mem_b_transient
    f, b, w = ty == 0, ty == 1, ty == 2
    times = [t0[f], t0[b], t0[w]]
    deltas = [problem.mem_f[st[f]], mem_b[st[b]], problem.mem_w[st[w]]]
    bt = b & (tr[st] != 0)
    times.append(t1[bt])
    deltas.append(-tr[st[bt]])
    o, r = ty == 3, ty == 4
    if o.any() and r.any():
        M = problem.num_microbatches
        ko, kr = st[o] * M + mb[o], st[r] * M + mb[r]
        common, io, ir = np.intersect1d(ko, kr, assume_unique=True, return_indices=True)
        oe, rs = t1[o][io], t0[r][ir]
        keep = oe < rs
        off = problem.offload_bytes[common[keep] // M]
        times += [oe[keep], rs[keep]]
        deltas += [-off, off]
    t = np.concatenate(times)
    x = np.concatenate(deltas).astype(np.float64)
    order = np.lexsort((x, t))
    return t[order], x[order]


def stage_peaks(problem: ScheduleProblem, ops: Schedule | Iterable[ScheduledOp]) -> list[float | None]:
    """Peak of :func:`memory_profile` of every stage, all stages at once (None: no events).

    The same numbers as ``memory_profile(problem, ops, s)[1].max()`` for each s (the same
    events summed in the same order, events within Contract 3's time tolerance one instant), for
    schedules with at most one op per (stage, micro-batch, type); otherwise computed stage by stage.
    """
    given, ops = ops, _ops_of(ops)
    S = problem.num_stages
    arrs = _arrays_of(given, ops)
    ok = arrs is not None
    if ok:
        st, mb, ty, t0, t1 = arrs
        inside = (st >= 0) & (st < S) & (mb >= 0) & (mb < problem.num_microbatches)
        key = (st * problem.num_microbatches + mb) * len(OP_TYPES) + ty
        ok = bool(inside.all()) and np.unique(key).size == key.size
    # Contract 3's time tolerance: closer events are one instant
    ttol = _time_tol(ops, 1e-9) if arrs is None else _time_tol_arrays(arrs[3], arrs[4], 1e-9)
    if not ok:
        out = []
        for s in range(S):
            _, mem = memory_profile(problem, ops, s, _tol=ttol)
            out.append(float(mem.max()) if mem.size else None)
        return out
    order = np.argsort(st, kind="stable")
    bounds = np.searchsorted(st[order], np.arange(S + 1))
    out: list[float | None] = []
    for s in range(S):
        idx = order[bounds[s]:bounds[s + 1]]
        t, x = _events(problem, st[idx], mb[idx], ty[idx], t0[idx], t1[idx])
        if t.size == 0:
            out.append(None)
            continue
        cur = np.cumsum(x)
        last = np.ones(t.size, dtype=bool)  # the curve's value at an instant: after all its events
        last[:-1] = (t[1:] - t[:-1]) > ttol
        out.append(float(cur[last].max()))
    return out


def check_op_arrays(problem: ScheduleProblem, arrays: tuple[np.ndarray, ...], make_ops: Callable[[], list[ScheduledOp]],
                    *, tol: float = 1e-9) -> list[str]:
    """:func:`check_schedule` of ops given by their field arrays, built (``make_ops()``) only when a message
    must be worded from them.

    Parameters
    ----------
    problem : ScheduleProblem
    arrays : tuple of 5 arrays, each (n,)
        Stage (int64), micro-batch (int64), type code (int64: F 0, B 1, W 2, O 3, R 4), start and end
        (float64, the problem's time unit) of every op.
    make_ops : callable
        Returns the same ops as :class:`~fxpipe.ir.ScheduledOp` (called at most twice).
    tol : float
        As for :func:`check_schedule`.

    Returns
    -------
    list of str
        :func:`check_schedule`'s messages for those ops.
    """
    errs = _fast_check(problem, make_ops, tol, arrays)
    return _check_schedule(problem, make_ops(), tol) if errs is None else errs


def _fast_check(problem: ScheduleProblem, ops: list[ScheduledOp] | Callable[[], list[ScheduledOp]], tol: float,
                arrs: tuple[np.ndarray, ...] | None = None) -> list[str] | None:
    """:func:`check_schedule` vectorised for well-formed schedules: [] when every rule holds,
    only rule-5 messages when only memory is over (exactly those of the full check), None
    when anything else may be wrong (then the full check runs and words the messages).
    ``ops`` may be a callable that builds them (with ``arrs``, read only to word rule 5).

    Every comparison is the full check's, on the same float64 values; the memory curve is
    tested first without merging events closer than the time tolerance (its peak is at least
    the merged one), and devices over their limit are re-profiled exactly.
    """
    S, M = problem.num_stages, problem.num_microbatches
    if arrs is None:
        arrs = _op_arrays(ops)
    if arrs is None or len(arrs[0]) == 0:
        return None
    st, mb, ty, t0, t1 = arrs
    if not (np.isfinite(t0).all() and np.isfinite(t1).all()):
        return None
    if not (((st >= 0) & (st < S) & (mb >= 0) & (mb < M)).all()):
        return None
    key = (st * M + mb) * 5 + ty
    if np.unique(key).size != key.size:
        return None
    ttol = tol * max(1.0, float(np.abs(t0).max()), float(np.abs(t1).max()))
    cnt = np.bincount(ty, minlength=5)
    if cnt[0] != S * M or cnt[1] != S * M or cnt[2] != S * M or cnt[3] != cnt[4]:
        return None
    # rule 1: durations
    durs = np.stack([problem.t_f, problem.t_b, problem.t_w, problem.t_offload, problem.t_offload]).astype(np.float64)
    if (np.abs((t1 - t0) - durs[ty, st]) > ttol).any():
        return None
    grid = np.full((5, S, M, 2), np.nan)
    grid[ty, st, mb, 0] = t0
    grid[ty, st, mb, 1] = t1
    if cnt[3]:
        if (np.isnan(grid[3, :, :, 0]) != np.isnan(grid[4, :, :, 0])).any():
            return None
    F, B, W = grid[0], grid[1], grid[2]
    comm = np.array([problem.comm(s) for s in range(S - 1)], dtype=np.float64)
    # rule 2
    if S > 1:
        if (F[1:, :, 0] < F[:-1, :, 1] + comm[:, None] - ttol).any():
            return None
        if (B[:-1, :, 0] < B[1:, :, 1] + comm[:, None] - ttol).any():
            return None
    if (B[S - 1, :, 0] < F[S - 1, :, 1] - ttol).any() or (W[:, :, 0] < B[:, :, 1] - ttol).any():
        return None
    # rule 4
    if cnt[3]:
        O, R = grid[3], grid[4]
        has = ~np.isnan(O[:, :, 0])
        if ((O[:, :, 0] < F[:, :, 1] - ttol) & has).any() or ((R[:, :, 0] < O[:, :, 1] - ttol) & has).any():
            return None
        if ((R[:, :, 1] > B[:, :, 0] + ttol) & has).any():
            return None
    # rule 3: no overlap on a compute stream, a copy stream or a pcie group
    dev = np.asarray(problem.device_of_stage, dtype=np.int64)[st]
    compute = ty <= 2

    def overlap(sel: np.ndarray, group: np.ndarray) -> bool:
        sel = sel & ((t1 - t0) > ttol)
        g, a, e = group[sel], t0[sel], t1[sel]
        order = np.lexsort((e, a, g))
        g, a, e = g[order], a[order], e[order]
        cuts = np.flatnonzero(g[1:] != g[:-1]) + 1
        for lo, hi in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [g.size]))):
            if hi - lo > 1 and (a[lo + 1:hi] < np.maximum.accumulate(e[lo:hi - 1]) - ttol).any():
                return True
        return False

    if overlap(compute, dev) or (cnt[3] and overlap(~compute, dev)):
        return None
    for grp in problem.pcie_groups:
        members = sorted(set(grp))
        if len(members) >= 2 and cnt[3] and overlap(~compute & np.isin(st, members), np.zeros_like(st)):
            return None
    # rule 5: memory
    errs: list[str] = []
    lims = np.asarray(problem.mem_limit, dtype=np.float64)
    for d, stages in enumerate(problem.device_stages):
        lim = float(lims[d])
        if not math.isfinite(lim):
            continue
        sel = np.isin(st, stages) if len(stages) > 1 else st == stages[0]
        t, x = _events(problem, st[sel], mb[sel], ty[sel], t0[sel], t1[sel])
        if t.size == 0 or float(np.cumsum(x).max()) <= lim + _mem_tol(problem, d, tol):
            continue
        # possibly over: the full check's curve (events closer than the tolerance merged), its words
        ops = ops() if callable(ops) else ops
        dev_ops = [o for s in stages for o in ops if o.stage == s]
        _rule5(problem, d, stages, dev_ops, ttol, tol, errs)
    return errs


def _rule5(problem: ScheduleProblem, d: int, stages: Sequence[int], dev_ops: list[ScheduledOp], ttol: float,
           tol: float, errs: list[str]) -> None:
    """Contract 3 rule 5 on device ``d`` (its ops ``dev_ops``): append the violation, if any."""
    lim = float(problem.mem_limit[d])
    times, mem = _profile(problem, dev_ops, stages, ttol)
    if len(mem) == 0:
        return
    mtol = _mem_tol(problem, d, tol)
    over = np.flatnonzero(mem > lim + mtol)
    if over.size:
        i = int(over[np.argmax(mem[over])])
        who = f"stage {stages[0]}" if len(stages) == 1 else f"device {d} (stages {list(stages)})"
        errs.append(
            f"rule 5: {who} holds {mem[i]:.9g} bytes of activations at t={times[i]:.9g}, "
            f"over its limit {lim:.9g} ({over.size} event time(s) over the limit)"
        )


def _check_schedule(problem: ScheduleProblem, ops: list[ScheduledOp], tol: float) -> list[str]:
    S, M = problem.num_stages, problem.num_microbatches
    errs: list[str] = []
    ttol = _time_tol(ops, tol)

    # ---------------------------------------------------------------- rule 0/1: well-formed
    table: dict[tuple[int, int, str], ScheduledOp] = {}
    good: list[ScheduledOp] = []
    for o in ops:
        if o.type not in OP_TYPES:
            errs.append(f"rule 1: op {_label(o)} has unknown type {o.type!r} (expected one of {OP_TYPES})")
            continue
        if not (isinstance(o.stage, (int, np.integer)) and 0 <= o.stage < S):
            errs.append(f"rule 1: op {_label(o)} names stage {o.stage!r} outside 0..{S - 1}")
            continue
        if not (isinstance(o.microbatch, (int, np.integer)) and 0 <= o.microbatch < M):
            errs.append(f"rule 1: op {_label(o)} names micro-batch {o.microbatch!r} outside 0..{M - 1}")
            continue
        if not (math.isfinite(o.start_s) and math.isfinite(o.end_s)):
            errs.append(f"rule 1: op {_label(o)} has a non-finite start or end")
            continue
        key = (int(o.stage), int(o.microbatch), o.type)
        if key in table:
            errs.append(f"rule 1: {o.type}(stage {o.stage}, mb {o.microbatch}) appears more than once")
            continue
        table[key] = o
        good.append(o)
        dur = problem.duration(int(o.stage), o.type)
        if abs((o.end_s - o.start_s) - dur) > ttol:
            errs.append(
                f"rule 1: {_label(o)} lasts {o.end_s - o.start_s:.9g}, expected duration {dur:.9g}"
            )
    for s in range(S):
        for j in range(M):
            for t in ("F", "B", "W"):
                if (s, j, t) not in table:
                    errs.append(f"rule 1: {t}(stage {s}, mb {j}) is missing")
            has_o, has_r = (s, j, "O") in table, (s, j, "R") in table
            if has_o != has_r:
                what = "O without R" if has_o else "R without O"
                errs.append(f"rule 1: stage {s}, mb {j} has {what} (offload and reload come together)")

    def get(s: int, j: int, t: str) -> ScheduledOp | None:
        return table.get((s, j, t))

    # ---------------------------------------------------------------- rule 2: dependencies
    for j in range(M):
        for s in range(S):
            f, b, w = get(s, j, "F"), get(s, j, "B"), get(s, j, "W")
            if s > 0 and f is not None:
                fp = get(s - 1, j, "F")
                if fp is not None and f.start_s < fp.end_s + problem.comm(s - 1) - ttol:
                    errs.append(
                        f"rule 2: {_label(f)} starts before F(stage {s - 1}, mb {j}) ends at "
                        f"{fp.end_s:.9g} + comm {problem.comm(s - 1):.9g}"
                    )
            if s < S - 1 and b is not None:
                bn = get(s + 1, j, "B")
                if bn is not None and b.start_s < bn.end_s + problem.comm(s) - ttol:
                    errs.append(
                        f"rule 2: {_label(b)} starts before B(stage {s + 1}, mb {j}) ends at "
                        f"{bn.end_s:.9g} + comm {problem.comm(s):.9g}"
                    )
            if s == S - 1 and b is not None and f is not None and b.start_s < f.end_s - ttol:
                errs.append(f"rule 2: {_label(b)} starts before F(stage {s}, mb {j}) ends at {f.end_s:.9g}")
            if w is not None and b is not None and w.start_s < b.end_s - ttol:
                errs.append(f"rule 2: {_label(w)} starts before B(stage {s}, mb {j}) ends at {b.end_s:.9g}")

    # ---------------------------------------------------------------- rule 3: no overlap
    def overlaps(group: list[ScheduledOp], what: str) -> None:
        # zero-length ops never overlap anything
        busy = sorted((o for o in group if o.end_s - o.start_s > ttol), key=lambda o: (o.start_s, o.end_s))
        last: ScheduledOp | None = None
        for o in busy:
            if last is not None and o.start_s < last.end_s - ttol:
                errs.append(f"rule 3: {what}: {_label(o)} overlaps {_label(last)}")
            if last is None or o.end_s > last.end_s:
                last = o

    by_stage: dict[int, list[ScheduledOp]] = defaultdict(list)
    for o in good:
        by_stage[int(o.stage)].append(o)
    for d, stages in enumerate(problem.device_stages):
        where = f"stage {stages[0]}" if len(stages) == 1 else f"device {d} (stages {list(stages)})"
        dev_ops = [o for s in stages for o in by_stage[s]]
        overlaps([o for o in dev_ops if o.type in ("F", "B", "W")], f"compute stream of {where}")
        overlaps([o for o in dev_ops if o.type in ("O", "R")], f"copy stream of {where}")
    for g in problem.pcie_groups:
        members = sorted(set(g))
        if len(members) < 2:
            continue
        overlaps(
            [o for s in members for o in by_stage[s] if o.type in ("O", "R")],
            f"pcie group {members}",
        )

    # ---------------------------------------------------------------- rule 4: O/R placement
    for (s, j, t), o in table.items():
        if t == "O":
            f = get(s, j, "F")
            if f is not None and o.start_s < f.end_s - ttol:
                errs.append(f"rule 4: {_label(o)} starts before F(stage {s}, mb {j}) ends at {f.end_s:.9g}")
            r = get(s, j, "R")
            if r is not None and r.start_s < o.end_s - ttol:
                errs.append(f"rule 4: {_label(r)} starts before its offload {_label(o)} ends")
        elif t == "R":
            b = get(s, j, "B")
            if b is not None and o.end_s > b.start_s + ttol:
                errs.append(f"rule 4: {_label(o)} ends after B(stage {s}, mb {j}) starts at {b.start_s:.9g}")

    # ---------------------------------------------------------------- rule 5: memory
    for d, stages in enumerate(problem.device_stages):
        lim = float(problem.mem_limit[d])
        if not math.isfinite(lim):
            continue
        _rule5(problem, d, stages, [o for s in stages for o in by_stage[s]], ttol, tol, errs)
    return errs


def validate_schedule(
    problem: ScheduleProblem,
    schedule_or_ops: Schedule | Iterable[ScheduledOp],
    *,
    tol: float = 1e-9,
) -> None:
    """Raise :class:`InvalidScheduleError` listing every violation of Contract 3.

    Parameters
    ----------
    problem : ScheduleProblem
    schedule_or_ops : Schedule or iterable of ScheduledOp
    tol : float, optional
        Relative tolerance, see :func:`check_schedule`.

    Raises
    ------
    InvalidScheduleError
        If :func:`check_schedule` finds at least one violation.
    """
    errs = check_schedule(problem, schedule_or_ops, tol=tol)
    if errs:
        method = schedule_or_ops.method if isinstance(schedule_or_ops, Schedule) else ""
        raise InvalidScheduleError(errs, method)


def device_spans(problem: ScheduleProblem, ops: Schedule | Iterable[ScheduledOp]) -> np.ndarray:
    """Per-device span: end of the device's last W minus start of its first F (float64 (D,)).

    The device's first compute op is always an F and its last always a W, so this is the
    time from the device's first to its last compute op (Contract 3's ``stage_span`` per
    device). A device without F or W ops gets 0.
    """
    first_f = np.full(problem.num_devices, math.inf)
    last_w = np.full(problem.num_devices, -math.inf)
    dev = problem.device_of_stage
    for o in _ops_of(ops):
        if not 0 <= o.stage < problem.num_stages:
            continue
        d = dev[o.stage]
        if o.type == "F":
            first_f[d] = min(first_f[d], o.start_s)
        elif o.type == "W":
            last_w[d] = max(last_w[d], o.end_s)
    ok = np.isfinite(first_f) & np.isfinite(last_w)
    return np.where(ok, last_w - np.where(ok, first_f, 0.0), 0.0)


def device_busy_s(problem: ScheduleProblem) -> np.ndarray:
    """Compute time every device must spend: ``m * sum (t_f + t_b + t_w)`` over its stages (D,)."""
    per_stage = problem.num_microbatches * (problem.t_f + problem.t_b + problem.t_w)
    return np.bincount(np.asarray(problem.device_of_stage), weights=per_stage, minlength=problem.num_devices)


def objective_values(problem: ScheduleProblem, ops: Schedule | Iterable[ScheduledOp]) -> tuple[float, float]:
    """Both objectives of Contract 3 for a list of timed ops.

    Parameters
    ----------
    problem : ScheduleProblem
    ops : Schedule or iterable of ScheduledOp

    Returns
    -------
    (makespan, stage_span) : tuple of float
        ``makespan`` = latest end minus earliest start over all ops (OptPipe Eq. 4);
        ``stage_span`` = max over devices of the per-device span (:func:`device_spans`: end
        of the device's last W minus start of its first F), which with one stage per device
        is OptPipe Eq. 3's per-stage span.
    """
    ops = _ops_of(ops)
    if not ops:
        return 0.0, 0.0
    makespan = max(o.end_s for o in ops) - min(o.start_s for o in ops)
    spans = device_spans(problem, ops)
    return float(makespan), float(max(spans.max(initial=0.0), 0.0))


def objective_values_of_arrays(problem: ScheduleProblem, arrays: tuple[np.ndarray, ...]) -> tuple[float, float]:
    """:func:`objective_values` of ops given by their field arrays (as :func:`check_op_arrays` takes them).

    Parameters
    ----------
    problem : ScheduleProblem
    arrays : tuple of 5 arrays, each (n,)
        Stage (int64), micro-batch (int64), type code (int64: F 0, B 1, W 2, O 3, R 4), start and end
        (float64) of every op.

    Returns
    -------
    (makespan, stage_span) : tuple of float
        The same comparisons and subtractions on the same float64 values as :func:`objective_values`, so
        the same values bit for bit.
    """
    st, _, ty, t0, t1 = arrays
    if not len(ty):
        return 0.0, 0.0
    makespan = float(t1.max()) - float(t0.min())
    inside = (st >= 0) & (st < problem.num_stages)
    dev = np.asarray(problem.device_of_stage, dtype=np.int64)[np.where(inside, st, 0)]
    first_f = np.full(problem.num_devices, math.inf)
    last_w = np.full(problem.num_devices, -math.inf)
    f, w = inside & (ty == 0), inside & (ty == 2)
    np.minimum.at(first_f, dev[f], t0[f])
    np.maximum.at(last_w, dev[w], t1[w])
    ok = np.isfinite(first_f) & np.isfinite(last_w)
    spans = np.where(ok, last_w - np.where(ok, first_f, 0.0), 0.0)
    return makespan, float(max(spans.max(initial=0.0), 0.0))


def _profile(problem: ScheduleProblem, ops: Iterable[ScheduledOp], stages: Sequence[int],
             _tol: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Memory step curve of the ops of ``stages`` (summed), see :func:`memory_profile`."""
    keep = set(int(s) for s in stages)
    ops = [o for o in ops if o.stage in keep]
    pairs: dict[tuple[int, int], dict[str, ScheduledOp]] = defaultdict(dict)
    for o in ops:
        if o.type in ("O", "R"):
            pairs[(o.stage, o.microbatch)][o.type] = o
    events: list[tuple[float, float]] = []
    for o in ops:
        if o.type == "F":
            events.append((o.start_s, float(problem.mem_f[o.stage])))
        elif o.type == "B":
            tr = float(problem.mem_b_transient[o.stage])
            events.append((o.start_s, float(problem.mem_b[o.stage]) + tr))
            if tr:
                events.append((o.end_s, -tr))
        elif o.type == "W":
            events.append((o.start_s, float(problem.mem_w[o.stage])))
    for (s, j), pr in pairs.items():
        if "O" in pr and "R" in pr and pr["O"].end_s < pr["R"].start_s:
            off = float(problem.offload_bytes[s])
            events.append((pr["O"].end_s, -off))
            events.append((pr["R"].start_s, off))
    if not events:
        return np.zeros(0), np.zeros(0)
    events.sort()
    times: list[float] = []
    mem: list[float] = []
    cur = 0.0
    for t, d in events:
        cur += d
        if times and t - times[-1] <= _tol:
            mem[-1] = cur
        else:
            times.append(t)
            mem.append(cur)
    return np.asarray(times, dtype=np.float64), np.asarray(mem, dtype=np.float64)


def memory_profile(
    problem: ScheduleProblem,
    ops: Schedule | Iterable[ScheduledOp],
    stage: int,
    *,
    _tol: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Activation memory of one stage over time, as a right-continuous step curve.

    Events (Contract 3 rule 5): F start ``+mem_f``, B start ``+mem_b + mem_b_transient``,
    B end ``-mem_b_transient`` (only where it is non-zero: recomputing stages), W start
    ``+mem_w``, and for every micro-batch that has both O and R: O end ``-offload_bytes``,
    R start ``+offload_bytes``. All events at one instant apply together; events closer than
    Contract 3's time tolerance (``1e-9 * max(1, T)``) are one instant, as :func:`check_schedule`
    reads them.

    Parameters
    ----------
    problem : ScheduleProblem
    ops : Schedule or iterable of ScheduledOp
        Ops of any stages; only those of ``stage`` are used.
    stage : int

    Returns
    -------
    times : float64 array (k,)
        Sorted distinct event times.
    mem : float64 array (k,)
        ``mem[i]`` is the memory held on ``[times[i], times[i+1])`` (bytes); the curve is 0
        before ``times[0]``.
    """
    ops = _ops_of(ops)
    return _profile(problem, ops, (stage,), _time_tol(ops, 1e-9) if _tol is None else _tol)


def device_memory_profile(
    problem: ScheduleProblem, ops: Schedule | Iterable[ScheduledOp], device: int
) -> tuple[np.ndarray, np.ndarray]:
    """Activation memory of one device (the sum over its stages) over time.

    Same events and format as :func:`memory_profile`; this is the curve Contract 3 rule 5
    limits by ``mem_limit[device]``.
    """
    ops = _ops_of(ops)
    return _profile(problem, ops, problem.stages_of_device(device), _time_tol(ops, 1e-9))


def peak_memory(problem: ScheduleProblem, ops: Schedule | Iterable[ScheduledOp]) -> np.ndarray:
    """Peak activation memory of every device (with one stage per device: of every stage).

    Parameters
    ----------
    problem : ScheduleProblem
    ops : Schedule or iterable of ScheduledOp

    Returns
    -------
    float64 array (D,)
        Bytes; the maximum of :func:`device_memory_profile` of each device (0 for a device
        without ops), comparable with ``mem_limit``; events within Contract 3's time
        tolerance (``1e-9 * max(1, T)``) count as one instant, as :func:`check_schedule` reads them.
    """
    ops = _ops_of(ops)
    # events closer than Contract 3's time tolerance are one instant (as check_schedule reads them):
    # an F that starts when an O ends, up to rounding, does not count both stashes
    ttol = _time_tol(ops, 1e-9)
    out = np.zeros(problem.num_devices)
    for d in range(problem.num_devices):
        _, mem = _profile(problem, ops, problem.stages_of_device(d), ttol)
        out[d] = float(mem.max()) if mem.size else 0.0
    return out


def offloaded_peak(problem: ScheduleProblem, ops: Schedule | Iterable[ScheduledOp]) -> np.ndarray:
    """Most activation bytes each device has in host memory at once (float64 (D,), bytes).

    A stash of (s, j) is off the device from the end of its O to the start of its R (Contract
    3 rule 5); this is the host memory the device's offloads need (0 without offload).

    Parameters
    ----------
    problem : ScheduleProblem
    ops : Schedule or iterable of ScheduledOp
    """
    pairs: dict[tuple[int, int], dict[str, ScheduledOp]] = defaultdict(dict)
    for o in _ops_of(ops):
        if o.type in ("O", "R") and 0 <= o.stage < problem.num_stages:
            pairs[(o.stage, o.microbatch)][o.type] = o
    events: list[list[tuple[float, float]]] = [[] for _ in range(problem.num_devices)]
    for (s, _j), pr in pairs.items():
        if "O" in pr and "R" in pr and pr["O"].end_s < pr["R"].start_s:
            b = float(problem.offload_bytes[s])
            d = problem.device_of_stage[s]
            events[d] += [(pr["O"].end_s, b), (pr["R"].start_s, -b)]
    out = np.zeros(problem.num_devices)
    for d, evs in enumerate(events):
        cur = 0.0
        for _t, x in sorted(evs):
            cur += x
            out[d] = max(out[d], cur)
    return out


def place_fused_w(problem: ScheduleProblem, schedule: Schedule) -> Schedule:
    """``schedule`` with every W of a stage whose checkpoint option is *fused* moved to the end of its B.

    A fused option (:attr:`fxpipe.ir.CheckpointOption.fused_w_s`) runs B and W of a micro-batch as
    one full backward: its W has no length and frees only the pooled buffers, so starting it at
    its B's end keeps every rule of Contract 3 (no device op overlaps an instant at which another
    ends, memory only falls earlier) and puts it right after its B in the device's program, which
    the runtime fuses (:func:`fxpipe.ir.lowering.merge_backward`). The objective values are
    recomputed (:func:`objective_values`); a schedule without fused stages is returned as is.
    """
    fused = {s for s in range(problem.num_stages) if problem.checkpoint_option(s).fused}
    if not fused:
        return schedule
    b_end = {(o.stage, o.microbatch): o.end_s for o in schedule.ops if o.type == "B" and o.stage in fused}
    ops = []
    moved = False
    for o in schedule.ops:
        if o.type == "W" and o.stage in fused:
            t = b_end[(o.stage, o.microbatch)]
            if o.start_s != t or o.end_s != t:
                o = ScheduledOp(o.stage, o.microbatch, "W", t, t)
                moved = True
        ops.append(o)
    if not moved:
        return schedule
    ops = tuple(sort_ops(ops))
    makespan, span = objective_values(problem, ops)
    return dataclasses.replace(schedule, ops=ops, makespan=makespan, stage_span=span)
