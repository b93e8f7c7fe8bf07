"""Optimal pipeline schedules with a SCIP MILP (OptPipe Section 3 and Appendix C).

The model decides, for every stage ``s`` (one per device) and micro-batch ``j``, the end
times of the Forward (F), Backward-input (B) and Backward-weight (W) ops, whether the
forward stash of ``(s, j)`` is offloaded to the host, and the start times of that offload
(O) and reload (R). It follows Contract 3 of DESIGN.md exactly:

* memory of stage ``s`` at time ``t`` is the sum of the deltas of the F/B/W ops that have
  started by ``t``, minus ``offload_bytes[s]`` for every offloaded ``(s, j)`` with
  ``O.end <= t < R.start``; it is checked at every F start and every R start (memory only
  rises at those events, so these checks cover every op start);
* objective ``stage_span`` (OptPipe Eq. 3) or ``makespan`` (OptPipe Eq. 4);
* optional pcie groups: O/R ops of stages in one group never overlap (OptPipe Eq. 18-19).

Solver-level techniques of OptPipe Section 4.1:

* fixed micro-batch order per op type (F(s,j) before F(s,j+1), same for B, W, and for the
  O and R of offloaded stashes), OptPipe Eq. 1 / Section 4.1.1; an exchange argument
  shows this loses no optimal schedule because micro-batches are identical;
* one binary per *unordered* pair of ops of a stage whose order is not already implied by
  dependencies or the fixed order (only ``B_j|F_k``, ``W_j|F_k``, ``W_j|B_k`` with
  ``j < k`` remain); no variables for implied orders (Section 4.1.1, Figure 3);
* monotonicity cuts (triangle inequalities with one fixed leg) always, full triangle
  inequality cuts (Section 4.1.2) when ``triangle_cuts=True`` and the model is small;
* memory-implied orders (:func:`memory_implied_orders`): orders every schedule within the
  limit must follow (e.g. B_0 before F_5 when five stashes fill the limit) become fixed
  orders, without variables;
* energetic head/tail inequalities: the ops fixed before (after) an op fit between the
  stage's first F and that op (that op and the stage's last W); with the memory-implied
  orders they prove the Zero Bubble toy instances optimal at the root;
* objective cut ``C >= combinatorial bound`` (:func:`fxpipe.schedule.bounds.combinatorial_lower_bound`:
  memory-aware warm-up and drain bubbles); SCIP stops as soon as an incumbent reaches it;
* big-M from the warm start's value: every op of a stage lies in a window of length at
  most the objective value ``C <= H`` (``H`` = warm start value), so ``H`` bounds every
  same-stage time difference;
* the best valid heuristic schedule is given to SCIP as the initial solution (Section 4.1.3);
* an event handler on ``BESTSOLFOUND`` reports each new incumbent (Section 4.3).

Building (:func:`build_model`), solving (:func:`solve`) and extracting
(:func:`extract_schedule`) are separate steps. The module never imports torch.

References
----------
OptPipe: Memory- and Scheduling-Optimized Pipeline Parallelism for LLM Training
(``shared/papers/optpipe-milp-pipeline-scheduling.txt``), Sections 3, 4.1-4.3, Appendix C.
PipeOffload (``shared/papers/pipeoffload-selective-activation-offload.txt``), Section 2.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fxpipe.errors import InfeasibleError, InputError, SolverError
from fxpipe.ir import Schedule, ScheduledOp, ScheduleProblem, sort_ops

__all__ = [
    "MilpVars",
    "Incumbent",
    "build_model",
    "check_memory_feasible",
    "extract_schedule",
    "memory_implied_orders",
    "warm_start_schedule",
    "solve",
]

_RANK = {"F": 0, "B": 1, "W": 2}
_COMPUTE = ("F", "B", "W")
#: Full triangle cuts are added only while their count stays below this (Section 4.1.2).
_MAX_FULL_TRIANGLE_CUTS = 20000
#: Heuristics tried for the warm start, in order of preference on ties.
_WARM_METHODS = ("adaoffload", "zb-h2", "zb-h1", "1f1b", "greedy", "pipeoffload", "gpipe")


# --------------------------------------------------------------------------------------
# data of a built model
# --------------------------------------------------------------------------------------


@dataclass
class MilpVars:
    """The variables of a built schedule MILP, keyed by index tuples.

    Times are in units of ``unit_s`` seconds, memory in units of each stage's limit.

    Attributes
    ----------
    E : dict[(s, j, c), Variable]
        End time of compute op ``c`` in F/B/W of micro-batch ``j`` on stage ``s``.
    O, R : dict[(s, j), Variable]
        Start time of the offload / reload of the stash of ``(s, j)`` (phantom, zero-length
        when not offloaded).
    x : dict[(s, j), Variable]
        Offload decision (1 = offloaded); absent where offloading can never help.
    pair : dict[(s, ca, ja, cb, jb), Variable]
        1 if op ``(ca, ja)`` runs before ``(cb, jb)`` on stage ``s`` (``ja < jb``, ``ca`` later type).
    g : dict[(s, k, l), Variable]
        1 if stash ``l`` is off the device when F_k starts.
    q : dict[(s, k, c, j), Variable]
        1 if op ``(c, j)`` has started when R_k starts (counted in the memory at R_k start).
    w : dict[(s, k, l), Variable]
        Continuous, 1 if stash ``l`` (``l > k``) is off the device when R_k starts.
    yor : dict[(s, k, l), Variable]
        1 if O_l ends before R_k starts (``k < l``).
    pcie : dict
        Order binaries between copy ops of different stages in one pcie group.
    C : Variable
        The objective (stage span or makespan).
    unit_s : float
        Seconds per model time unit.
    horizon : float
        Big-M horizon ``H`` in model units (an upper bound on ``C``).
    eps : float
        Strictness margin (model units) for ``t < R.start``.
    mem_stages : tuple[int, ...]
        Stages whose memory limit can bind (memory constraints present).
    counts : dict
        Model size statistics (variables, binaries, constraints, cuts).
    """

    E: dict = field(default_factory=dict)
    O: dict = field(default_factory=dict)
    R: dict = field(default_factory=dict)
    x: dict = field(default_factory=dict)
    pair: dict = field(default_factory=dict)
    g: dict = field(default_factory=dict)
    q: dict = field(default_factory=dict)
    w: dict = field(default_factory=dict)
    yor: dict = field(default_factory=dict)
    pcie: dict = field(default_factory=dict)
    C: Any = None
    unit_s: float = 1.0
    horizon: float = 0.0
    eps: float = 0.0
    mem_stages: tuple = ()
    counts: dict = field(default_factory=dict)
    warm_start_accepted: bool | None = None
    #: memory-implied orders: B_j (resp. W_j) precedes F_k on stage s for j < rB[(s, k)] (rW)
    rB: dict = field(default_factory=dict)
    rW: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Incumbent:
    """A new best schedule found while SCIP searches (OptPipe Section 4.3).

    Attributes
    ----------
    value_s : float
        Objective value of ``schedule`` (seconds).
    dual_bound_s : float
        SCIP's dual bound at that moment (seconds).
    time_s : float
        Solver wall time when it was found.
    schedule : Schedule
        The extracted, validated schedule.
    """

    value_s: float
    dual_bound_s: float
    time_s: float
    schedule: Schedule


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _validate_mod():
    try:
        from fxpipe.schedule import validate  # noqa: WPS433 (written in parallel)
    except ImportError:  # pragma: no cover - only while the module is being written
        return None
    return validate


def _check_ops(problem: ScheduleProblem, ops) -> list[str]:
    v = _validate_mod()
    if v is None:  # pragma: no cover
        return []
    return list(v.check_schedule(problem, ops))


def _objective_values(problem: ScheduleProblem, ops) -> tuple[float, float]:
    v = _validate_mod()
    if v is not None and hasattr(v, "objective_values"):
        ms, span = v.objective_values(problem, ops)
        return float(ms), float(span)
    # pragma: no cover - fallback while validate.py is not there yet
    starts = [o.start_s for o in ops]
    ends = [o.end_s for o in ops]
    ms = max(ends) - min(starts)
    span = 0.0
    for s in range(problem.num_stages):
        f0 = min(o.start_s for o in ops if o.stage == s and o.type == "F")
        wl = max(o.end_s for o in ops if o.stage == s and o.type == "W")
        span = max(span, wl - f0)
    return ms, span


def _value(problem: ScheduleProblem, ops) -> float:
    ms, span = _objective_values(problem, ops)
    return span if problem.objective == "stage_span" else ms


def _durations(problem: ScheduleProblem) -> dict[str, np.ndarray]:
    return {"F": problem.t_f, "B": problem.t_b, "W": problem.t_w, "O": problem.t_offload, "R": problem.t_offload}


def check_memory_feasible(problem: ScheduleProblem) -> None:
    """Raise :class:`InfeasibleError` unless some schedule fits every memory limit.

    The exact condition is ``mem_f[s] <= mem_limit[s]`` on every stage. Necessary: at the
    start of any F the op's own ``mem_f`` is counted, and every other micro-batch
    contributes ``>= 0`` (``mem_f - offload_bytes >= 0`` while offloaded,
    ``mem_f + mem_b = -mem_w >= 0`` after B, 0 after W), so offloading cannot help the
    first F. Sufficient: running one micro-batch at a time (OptPipe Section 4.1.3's
    trivial schedule) peaks at exactly ``mem_f``.

    Raises
    ------
    InfeasibleError
        Naming the first stage where one micro-batch's forward stash exceeds the limit.
    """
    bad = np.nonzero(problem.mem_f > problem.mem_limit * (1 + 1e-12))[0]
    if bad.size:
        s = int(bad[0])
        raise InfeasibleError(
            f"stage {s}: one forward needs mem_f = {problem.mem_f[s]:g} but mem_limit is "
            f"{problem.mem_limit[s]:g}; no schedule fits even with offloading (the stash of the "
            "running forward is on the device). Raise the limit, use more stages or smaller micro-batches."
        )


def _sequential_schedule(problem: ScheduleProblem) -> Schedule:
    """One micro-batch in flight at a time: the trivial feasible schedule (OptPipe 4.1.3)."""
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
        for s in range(S):
            d = problem.duration(s, "W")
            ops.append(ScheduledOp(s, j, "W", t, t + d))
            t += d
    ops = sort_ops(ops)
    ms, span = _objective_values(problem, ops)
    return Schedule(ops=tuple(ops), makespan=ms, stage_span=span, method="sequential", objective=problem.objective)


def warm_start_schedule(problem: ScheduleProblem) -> Schedule:
    """The best valid heuristic schedule (OptPipe Section 4.1.3), used as the MILP's start.

    Tries every heuristic of :mod:`fxpipe.schedule.heuristics` (those that do not fit the
    memory limit raise and are skipped), keeps the valid ones and returns the shortest;
    the one-micro-batch-at-a-time schedule is always a candidate.

    Raises
    ------
    InfeasibleError
        If no schedule fits the memory limits (see :func:`check_memory_feasible`).
    """
    check_memory_feasible(problem)
    best = _sequential_schedule(problem)
    best_val = _value(problem, best.ops)
    tried: dict[str, Any] = {"sequential": best_val}
    try:
        from fxpipe.schedule import heuristics
    except ImportError:  # pragma: no cover
        heuristics = None
    if heuristics is not None:
        for method in _WARM_METHODS:
            try:
                sched = heuristics.generate(problem, method)
            except Exception as exc:  # noqa: BLE001 - a failing heuristic must not stop the MILP
                tried[method] = f"{type(exc).__name__}"
                continue
            errs = _check_ops(problem, sched.ops)
            if errs:
                tried[method] = "invalid"
                continue
            val = _value(problem, sched.ops)
            tried[method] = val
            if val < best_val - 1e-12 * max(1.0, abs(best_val)):
                best, best_val = sched, val
    return Schedule(
        ops=best.ops, makespan=best.makespan, stage_span=best.stage_span, lower_bound_s=best.lower_bound_s,
        status=best.status, solver_time_s=best.solver_time_s, method=best.method, objective=problem.objective,
        meta={**best.meta, "warm_candidates": tried},
    )


def _order_lit(V: MilpVars, s: int, a: tuple[str, int], b: tuple[str, int]):
    """Literal 'a before b' on stage s: 1, 0, (var, +1) or (var, -1) meaning 1 - var."""
    (ca, ja), (cb, jb) = a, b
    if a == b:
        raise ValueError("same op")
    if ja <= jb and _RANK[ca] <= _RANK[cb]:
        return 1
    if jb <= ja and _RANK[cb] <= _RANK[ca]:
        return 0
    if _forced(V, s, a, b):
        return 1
    if _forced(V, s, b, a):
        return 0
    if ja < jb:  # ca is the later type: a variable exists with this orientation
        return (V.pair[(s, ca, ja, cb, jb)], 1)
    return (V.pair[(s, cb, jb, ca, ja)], -1)


def _forced(V: MilpVars, s: int, a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Is 'a before b' implied by memory (an order no schedule within the limit can avoid)?"""
    (ca, ja), (cb, jb) = a, b
    if ja >= jb:
        return False
    if cb == "F":
        if ca == "B":
            return ja < V.rB.get((s, jb), 0)
        if ca == "W":
            return ja < V.rW.get((s, jb), 0)
    if ca == "W" and cb == "B":  # W_j before F_k before B_k
        return ja < V.rW.get((s, jb), 0)
    return False


def memory_implied_orders(problem: ScheduleProblem) -> tuple[dict, dict]:
    """Orders that every schedule within the memory limits must follow.

    At the start of F_k on stage s the stash of F_k is on the device; a micro-batch j < k
    whose B has started holds at least 0 (after its W), one whose B has not started holds at
    least ``mem_f - offload_bytes`` (offloaded), one whose B but not W has started holds
    ``-mem_w``. With r earlier B's and w W's started the memory is at least
    ``mem_f + (k - r)(mem_f - offload_bytes) + (r - w)(-mem_w)``, so at least
    ``r_k = k - floor((limit - mem_f) / (mem_f - offload_bytes))`` B's (the first ones, by
    the fixed order) precede F_k, and at least the smallest w that fits for some
    ``r in [r_k, k]`` W's.

    Returns
    -------
    (rB, rW) : dict[(s, k), int]
        B_j (resp. W_j) must precede F_k on stage s for every ``j < rB[(s, k)]`` (``rW``).
    """
    rB, rW = {}, {}
    for s in range(problem.num_stages):
        lim = float(problem.mem_limit[s])
        if not math.isfinite(lim):
            continue
        mf, mb, mw = float(problem.mem_f[s]), float(problem.mem_b[s]), float(problem.mem_w[s])
        keep = mf - float(problem.offload_bytes[s])
        tol = 1e-9 * max(1.0, lim)
        for k in range(problem.num_microbatches):
            r = 0
            if keep > tol:
                r = max(0, k - int(math.floor((lim - mf + tol) / keep)))
            w = 0
            if mw < -tol:
                # memory with r B's and w W's started: mf + (k - r) keep + (r - w)(-mw); the
                # required w is linear in r, so its minimum over r in [r, k] is at an end.
                def w_req(rr: int) -> int:
                    need = rr - (lim - mf - (k - rr) * max(keep, 0.0)) / -mw
                    return max(0, int(math.ceil(need - 1e-9)))

                w = min(w_req(r), w_req(k))
            w = min(w, k)
            r = min(max(r, w), k)
            if r:
                rB[(s, k)] = r
            if w:
                rW[(s, k)] = w
    return rB, rW


def _lit_expr(lit):
    if isinstance(lit, int):
        return lit
    var, sign = lit
    return var if sign > 0 else 1 - var


# --------------------------------------------------------------------------------------
# builder
# --------------------------------------------------------------------------------------


def build_model(
    problem: ScheduleProblem,
    *,
    warm_start: Schedule | None = None,
    big_m: float | None = None,
    triangle_cuts: bool = True,
):
    """Build the schedule MILP of OptPipe Appendix C for Contract 3 (pure function).

    Parameters
    ----------
    problem : ScheduleProblem
        S stages x m micro-batches (times in s, memory in bytes).
    warm_start : Schedule, optional
        A valid schedule; its objective value becomes the horizon ``H`` (big-M and the
        upper bound of ``C``) and it is handed to SCIP with ``addSol`` (OptPipe 4.1.3).
    big_m : float, optional
        Horizon ``H`` in seconds; overrides the warm start's value. Without either, the
        one-micro-batch-at-a-time schedule's value is used (always valid).
    triangle_cuts : bool
        Add the full triangle-inequality cuts of OptPipe Section 4.1.2 (when fewer than
        20000); monotonicity cuts (one fixed leg) are always added.

    Returns
    -------
    (pyscipopt.Model, MilpVars)
        The model (objective: minimise ``C``) and its variables.

    Raises
    ------
    InputError
        If ``problem`` is not a :class:`ScheduleProblem` or ``big_m`` is not positive.
    InfeasibleError
        If one forward's stash exceeds a stage's memory limit.

    References
    ----------
    OptPipe Appendix C, Eq. 2-19; Sections 4.1.1-4.1.3.
    """
    import pyscipopt as scip

    if not isinstance(problem, ScheduleProblem):
        raise InputError(f"expected a ScheduleProblem, got {type(problem).__name__}")
    check_memory_feasible(problem)
    S, M = problem.num_stages, problem.num_microbatches
    durs = _durations(problem)
    all_times = np.concatenate([problem.t_f, problem.t_b, problem.t_w, problem.t_comm, problem.t_offload])
    unit = float(np.max(all_times)) if all_times.size and np.max(all_times) > 0 else 1.0

    if big_m is not None:
        if not (isinstance(big_m, (int, float)) and math.isfinite(big_m) and big_m > 0):
            raise InputError(f"big_m must be a positive number of seconds, got {big_m!r}")
        H_s = float(big_m)
    elif warm_start is not None:
        H_s = _value(problem, warm_start.ops)
    else:
        H_s = _value(problem, _sequential_schedule(problem).ops)
    H = H_s / unit * (1 + 1e-9) + 1e-9
    T = {c: durs[c] / unit for c in durs}
    comm = problem.t_comm / unit
    eps = 1e-5

    V = MilpVars(unit_s=unit, horizon=H, eps=eps)
    V.rB, V.rW = memory_implied_orders(problem)
    model = scip.Model(f"fxpipe-schedule-{problem.name}")
    model.hideOutput()
    n_cons = 0

    def add(expr, name):
        nonlocal n_cons
        n_cons += 1
        return model.addCons(expr, name=name)

    # absolute bound on every time: stage windows are <= H long and each next stage's
    # window starts at most H after the previous (B(s,0) waits on B(s+1,0)).
    tmax = H if problem.objective == "makespan" else S * H
    for s in range(S):
        for j in range(M):
            for c in _COMPUTE:
                V.E[(s, j, c)] = model.addVar(f"E_{s}_{j}_{c}", lb=T[c][s], ub=tmax)
    V.C = model.addVar("C", lb=0.0, ub=H)

    # fix the time origin: F(0,0) starts at 0 (translation invariance)
    add(V.E[(0, 0, "F")] == T["F"][0], "origin")

    # ---- pipeline data dependencies (Eq. 5, 6, 8) and fixed micro-batch order (Eq. 1)
    for s in range(S):
        for j in range(M):
            E = V.E
            if s > 0:
                add(E[(s, j, "F")] >= E[(s - 1, j, "F")] + comm[s - 1] + T["F"][s], f"depF_{s}_{j}")
            if s < S - 1:
                add(E[(s, j, "B")] >= E[(s + 1, j, "B")] + comm[s] + T["B"][s], f"depB_{s}_{j}")
            add(E[(s, j, "B")] >= E[(s, j, "F")] + T["B"][s], f"FB_{s}_{j}")
            add(E[(s, j, "W")] >= E[(s, j, "B")] + T["W"][s], f"BW_{s}_{j}")
            if j + 1 < M:
                for c in _COMPUTE:
                    add(E[(s, j + 1, c)] >= E[(s, j, c)] + T[c][s], f"ord{c}_{s}_{j}")

    # ---- one binary per unordered undetermined pair (Section 4.1.1), big-M = H (Eq. 7)
    pair_list = []
    for s in range(S):
        for j in range(M):
            for k in range(j + 1, M):
                for ca, cb in (("B", "F"), ("W", "F"), ("W", "B")):
                    if _forced(V, s, (ca, j), (cb, k)):  # implied by memory: a fixed order
                        add(V.E[(s, k, cb)] - T[cb][s] >= V.E[(s, j, ca)], f"mem_ord_{s}_{ca}{j}_{cb}{k}")
                        continue
                    y = model.addVar(f"P_{s}_{ca}{j}_{cb}{k}", vtype="B")
                    V.pair[(s, ca, j, cb, k)] = y
                    pair_list.append((s, ca, j, cb, k))
                    Ea, Eb = V.E[(s, j, ca)], V.E[(s, k, cb)]
                    # y = 1: a before b; y = 0: b before a
                    add(Eb - T[cb][s] >= Ea - H * (1 - y), f"seq1_{s}_{ca}{j}_{cb}{k}")
                    add(Ea - T[ca][s] >= Eb - H * y, f"seq0_{s}_{ca}{j}_{cb}{k}")

    # ---- energetic head/tail inequalities from the fixed (incl. memory-implied) orders:
    # every op fixed before a runs between F_0's start and a's start; every op fixed after a
    # runs between a's start and the stage's last W end.
    n_ht = 0
    for s in range(S):
        ops_s = [(c, j) for j in range(M) for c in _COMPUTE]
        f0_start = V.E[(s, 0, "F")] - T["F"][s]
        for a in ops_s:
            head = tail = 0.0
            for b in ops_s:
                if b == a:
                    continue
                lit = _order_lit(V, s, b, a)
                if lit == 1:
                    head += T[b[0]][s]
                elif lit == 0:
                    tail += T[b[0]][s]
            a_start = V.E[(s, a[1], a[0])] - T[a[0]][s]
            if head > 0:
                add(a_start >= f0_start + head, f"head_{s}_{a[0]}{a[1]}")
            if problem.objective == "stage_span":
                add(V.C >= a_start - f0_start + T[a[0]][s] + tail, f"tail_{s}_{a[0]}{a[1]}")
            else:
                add(V.C >= a_start + T[a[0]][s] + tail, f"tail_{s}_{a[0]}{a[1]}")
            n_ht += 2

    # ---- cuts: monotone (one fixed leg) always, full triangles optionally (Section 4.1.2)
    n_mono = n_tri = 0
    for (s, ca, j, cb, k) in pair_list:
        y = V.pair[(s, ca, j, cb, k)]
        # a=(ca,j) before b=(cb,k). If a before b then a before every fixed successor of b
        # and every fixed predecessor of a is before b. Immediate neighbours suffice.
        succ_b = [(cb, k + 1)] if k + 1 < M else []
        if cb == "F":
            succ_b.append(("B", k))
        elif cb == "B":
            succ_b.append(("W", k))
        for nb in succ_b:
            lit = _order_lit(V, s, (ca, j), nb)
            if not isinstance(lit, int):
                add(_lit_expr(lit) >= y, f"mono_s_{s}_{ca}{j}_{cb}{k}_{nb[0]}{nb[1]}")
                n_mono += 1
        pred_a = [(ca, j - 1)] if j > 0 else []
        if ca == "W":
            pred_a.append(("B", j))
        elif ca == "B":
            pred_a.append(("F", j))
        for pa in pred_a:
            lit = _order_lit(V, s, pa, (cb, k))
            if not isinstance(lit, int):
                add(_lit_expr(lit) >= y, f"mono_p_{s}_{ca}{j}_{cb}{k}_{pa[0]}{pa[1]}")
                n_mono += 1
    if triangle_cuts:
        cuts = []
        for s in range(S):
            ops = [(c, j) for j in range(M) for c in _COMPUTE]
            n = len(ops)
            for ia in range(n):
                for ib in range(n):
                    if ib == ia:
                        continue
                    lab = _order_lit(V, s, ops[ia], ops[ib])
                    if isinstance(lab, int):
                        continue
                    for ic in range(n):
                        if ic == ia or ic == ib:
                            continue
                        lbc = _order_lit(V, s, ops[ib], ops[ic])
                        if isinstance(lbc, int):
                            continue
                        lac = _order_lit(V, s, ops[ia], ops[ic])
                        if lac == 1:
                            continue
                        cuts.append((lab, lbc, lac))
                        if len(cuts) > _MAX_FULL_TRIANGLE_CUTS:
                            break
                    if len(cuts) > _MAX_FULL_TRIANGLE_CUTS:
                        break
                if len(cuts) > _MAX_FULL_TRIANGLE_CUTS:
                    break
        if len(cuts) <= _MAX_FULL_TRIANGLE_CUTS:
            for i, (lab, lbc, lac) in enumerate(cuts):
                add(_lit_expr(lac) >= _lit_expr(lab) + _lit_expr(lbc) - 1, f"tri_{i}")
            n_tri = len(cuts)

    # ---- memory (Contract 3 rule 5; OptPipe Eq. 9, 14-17 restated for start-time semantics)
    mem_stages = []
    for s in range(S):
        lim = float(problem.mem_limit[s])
        if not math.isfinite(lim) or M * float(problem.mem_f[s]) <= lim:
            continue  # limit can never bind on this stage
        mem_stages.append(s)
        mf = float(problem.mem_f[s]) / lim
        mb = float(problem.mem_b[s]) / lim
        mw = float(problem.mem_w[s]) / lim
        off = float(problem.offload_bytes[s]) / lim
        to = float(T["O"][s])
        can_offload = off > 0
        E = V.E
        tf, tb = T["F"][s], T["B"][s]
        if can_offload:
            chain_gap = to if to > 0 else eps
            for j in range(M):
                V.x[(s, j)] = model.addVar(f"x_{s}_{j}", vtype="B")
                V.O[(s, j)] = model.addVar(f"O_{s}_{j}", lb=0.0, ub=tmax)
                V.R[(s, j)] = model.addVar(f"R_{s}_{j}", lb=0.0, ub=tmax)
            for j in range(M):
                x, O, R = V.x[(s, j)], V.O[(s, j)], V.R[(s, j)]
                add(O >= E[(s, j, "F")], f"OF_{s}_{j}")  # rule 4
                add(R >= O + to * x, f"OR_{s}_{j}")
                add(R + to * x <= E[(s, j, "B")] - tb, f"RB_{s}_{j}")  # rule 4
                if j + 1 < M:  # fixed order of offloads and reloads (Section 4.1.1)
                    add(V.O[(s, j + 1)] >= O + chain_gap * x, f"ordO_{s}_{j}")
                    add(V.R[(s, j + 1)] >= R + chain_gap * x, f"ordR_{s}_{j}")
            # O_l against R_k for k < l: the only undetermined copy-stream pairs
            for k in range(M):
                for l in range(k + 1, M):
                    y = model.addVar(f"Y_{s}_{k}_{l}", vtype="B")  # 1: O_l ends before R_k starts
                    V.yor[(s, k, l)] = y
                    both = 2 - V.x[(s, k)] - V.x[(s, l)]
                    add(V.R[(s, k)] >= V.O[(s, l)] + to - H * (1 - y) - H * both, f"OR1_{s}_{k}_{l}")
                    add(V.O[(s, l)] >= V.R[(s, k)] + to - H * y - H * both, f"OR0_{s}_{k}_{l}")
            for k in range(M):
                for l in range(k + 1, M):
                    if l - 1 > k:
                        add(V.yor[(s, k, l)] <= V.yor[(s, k, l - 1)], f"monoY1_{s}_{k}_{l}")
                    if k + 1 < l:
                        add(V.yor[(s, k, l)] <= V.yor[(s, k + 1, l)], f"monoY2_{s}_{k}_{l}")
        # memory at every F start
        for k in range(M):
            expr = (k + 1) * mf
            for j in range(k):
                expr = expr + mb * _lit_expr(_order_lit(V, s, ("B", j), ("F", k)))
                expr = expr + mw * _lit_expr(_order_lit(V, s, ("W", j), ("F", k)))
            if can_offload:
                Fk_start = E[(s, k, "F")] - tf
                for l in range(k):
                    lit = _order_lit(V, s, ("B", l), ("F", k))
                    if lit == 1:  # B_l (hence R_l) precedes F_k: stash l is back on the device
                        continue
                    g = model.addVar(f"g_{s}_{k}_{l}", vtype="B")
                    V.g[(s, k, l)] = g
                    add(g <= V.x[(s, l)], f"gx_{s}_{k}_{l}")
                    add(g <= 1 - _lit_expr(lit), f"gB_{s}_{k}_{l}")
                    add(V.O[(s, l)] + to <= Fk_start + (H + to) * (1 - g), f"gO_{s}_{k}_{l}")
                    add(V.R[(s, l)] >= Fk_start + eps - (H + eps) * (1 - g), f"gR_{s}_{k}_{l}")
                    expr = expr - off * g
            if not isinstance(expr, (int, float)):
                add(expr <= 1.0, f"memF_{s}_{k}")
        # memory at every R start of an offloaded stash
        if can_offload:
            bigmem = M * mf
            for k in range(M):
                Rk = V.R[(s, k)]
                expr = (k + 1) * mf
                for j in range(k + 1, M):
                    qf = model.addVar(f"qF_{s}_{k}_{j}", vtype="B")
                    V.q[(s, k, "F", j)] = qf
                    # qf = 0 -> F_j starts strictly after R_k starts
                    add(E[(s, j, "F")] - tf >= Rk + eps - (H + eps) * qf, f"qF_{s}_{k}_{j}")
                    if j > k + 1:
                        add(qf <= V.q[(s, k, "F", j - 1)], f"monoqF_{s}_{k}_{j}")
                    expr = expr + mf * qf
                for j in range(k):
                    qb = model.addVar(f"qB_{s}_{k}_{j}", vtype="B")
                    qw = model.addVar(f"qW_{s}_{k}_{j}", vtype="B")
                    V.q[(s, k, "B", j)] = qb
                    V.q[(s, k, "W", j)] = qw
                    # q = 1 -> the op started by the time R_k starts
                    add(E[(s, j, "B")] - tb <= Rk + H * (1 - qb), f"qB_{s}_{k}_{j}")
                    add(E[(s, j, "W")] - T["W"][s] <= Rk + H * (1 - qw), f"qW_{s}_{k}_{j}")
                    add(qw <= qb, f"qWB_{s}_{k}_{j}")
                    if j > 0:
                        add(qb <= V.q[(s, k, "B", j - 1)], f"monoqB_{s}_{k}_{j}")
                        add(qw <= V.q[(s, k, "W", j - 1)], f"monoqW_{s}_{k}_{j}")
                    expr = expr + mb * qb + mw * qw
                for l in range(k + 1, M):
                    lit = _order_lit(V, s, ("B", k), ("F", l))
                    if lit == 1:  # O_l after F_l after B_k after R_k: l cannot be off
                        continue
                    wv = model.addVar(f"w_{s}_{k}_{l}", lb=0.0, ub=1.0)
                    V.w[(s, k, l)] = wv
                    add(wv <= V.x[(s, l)], f"wx_{s}_{k}_{l}")
                    add(wv <= V.yor[(s, k, l)], f"wy_{s}_{k}_{l}")
                    add(wv <= 1 - _lit_expr(lit), f"wB_{s}_{k}_{l}")
                    expr = expr - off * wv
                add(expr <= 1.0 + bigmem * (1 - V.x[(s, k)]), f"memR_{s}_{k}")
    V.mem_stages = tuple(mem_stages)

    # ---- pcie groups (Eq. 18-19): copy ops of stages in one group never overlap
    for gi, grp in enumerate(problem.pcie_groups):
        stages = sorted(set(s for s in grp if any((s, j) in V.x for j in range(M))))
        for a_i, s1 in enumerate(stages):
            for s2 in stages[a_i + 1:]:
                Mx = (abs(s2 - s1) + 1) * H + 2 * float(max(T["O"][s1], T["O"][s2])) + 1.0
                if problem.objective == "makespan":
                    Mx = H + 2 * float(max(T["O"][s1], T["O"][s2])) + 1.0
                for j in range(M):
                    for k in range(M):
                        for t1, v1 in (("O", V.O[(s1, j)]), ("R", V.R[(s1, j)])):
                            for t2, v2 in (("O", V.O[(s2, k)]), ("R", V.R[(s2, k)])):
                                z = model.addVar(f"Z_{gi}_{s1}{t1}{j}_{s2}{t2}{k}", vtype="B")
                                V.pcie[(s1, t1, j, s2, t2, k)] = z
                                both = 2 - V.x[(s1, j)] - V.x[(s2, k)]
                                add(v2 >= v1 + T["O"][s1] - Mx * (1 - z) - Mx * both, f"pc1_{gi}_{s1}{t1}{j}_{s2}{t2}{k}")
                                add(v1 >= v2 + T["O"][s2] - Mx * z - Mx * both, f"pc0_{gi}_{s1}{t1}{j}_{s2}{t2}{k}")

    # ---- objective (Eq. 3 or Eq. 4) and a valid lower bound (busy time of a stage)
    for s in range(S):
        if problem.objective == "stage_span":
            add(V.C >= V.E[(s, M - 1, "W")] - (V.E[(s, 0, "F")] - T["F"][s]), f"span_{s}")
        else:
            add(V.C >= V.E[(s, M - 1, "W")], f"makespan_{s}")
    busy = float(np.max(M * (T["F"] + T["B"] + T["W"])))
    add(V.C >= busy, "busy")
    # objective cut from the combinatorial bound (memory-aware warm-up/drain bubbles,
    # fxpipe.schedule.bounds); slightly relaxed so rounding never cuts off the optimum,
    # and capped at the horizon so a warm start at the bound stays feasible
    comb = min(_combinatorial_bound(problem) / unit * (1 - 1e-9), H)
    if comb > busy:
        add(V.C >= comb, "comb_lb")
    model.setObjective(V.C, "minimize")

    V.counts = {
        "variables": model.getNVars(),
        "binaries": sum(1 for v in model.getVars() if v.vtype() == "BINARY"),
        "constraints": n_cons,
        "monotone_cuts": n_mono,
        "triangle_cuts": n_tri,
        "head_tail": n_ht,
        "memory_implied_orders": int(sum(V.rB.values()) + sum(V.rW.values())),
    }
    if warm_start is not None:
        V.warm_start_accepted = _add_warm_start(model, V, problem, warm_start)
    return model, V


# --------------------------------------------------------------------------------------
# warm start
# --------------------------------------------------------------------------------------


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


def _add_warm_start(model, V: MilpVars, problem: ScheduleProblem, schedule: Schedule) -> bool:
    S, M = problem.num_stages, problem.num_microbatches
    u = V.unit_s
    st, Os, Rs, off = _canonical_times(problem, schedule)
    durs = _durations(problem)
    sol = model.createSol()
    val: dict = {}

    def setv(var, x):
        val[var.name] = x
        model.setSolVal(sol, var, x)

    for (s, j, c), var in V.E.items():
        setv(var, (st[(s, j, c)] + float(durs[c][s])) / u)
    start = {k: st[k] / u for k in st if k[2] in _COMPUTE}
    for (s, ca, j, cb, k), var in V.pair.items():
        setv(var, 1.0 if start[(s, j, ca)] < start[(s, k, cb)] else 0.0)
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
    ms, span = _objective_values(problem, schedule.ops)
    setv(V.C, (span if problem.objective == "stage_span" else ms) / u)
    try:
        ok = model.checkSol(sol, printreason=False)
    except Exception:  # noqa: BLE001
        ok = False
    if ok:
        model.addSol(sol, free=True)
    else:
        model.freeSol(sol)
    return bool(ok)


# --------------------------------------------------------------------------------------
# extraction
# --------------------------------------------------------------------------------------


def extract_schedule(problem: ScheduleProblem, V: MilpVars, values: Callable[[Any], float]) -> list[ScheduledOp]:
    """Turn a MILP solution into Contract-3 ops with exact durations.

    Start times are read from the solution (``end - start == duration`` by construction),
    then a push-right repair re-imposes, in exact floating point, every precedence the
    solution relies on: dependencies with ``t_comm``, the per-stage compute order, the
    per-stage and per-pcie-group copy order, and the memory relations the model assumed
    (``O.end <= F.start < R.start`` where a stash was counted as off the device, ops
    counted as started before an R start). Shifts are of the order of the solver tolerance.

    Parameters
    ----------
    problem : ScheduleProblem
    V : MilpVars
        From :func:`build_model`.
    values : callable
        Maps a variable to its value in the solution (e.g. ``lambda v: model.getSolVal(sol, v)``).

    Returns
    -------
    list[ScheduledOp]
        Sorted in the canonical order.
    """
    S, M = problem.num_stages, problem.num_microbatches
    u = V.unit_s
    durs = _durations(problem)
    start: dict = {}
    for (s, j, c), var in V.E.items():
        start[(s, j, c)] = max(0.0, (values(var) * u) - float(durs[c][s]))
    offl = {key for key, var in V.x.items() if values(var) > 0.5}
    for (s, j) in offl:
        start[(s, j, "O")] = max(0.0, values(V.O[(s, j)]) * u)
        start[(s, j, "R")] = max(0.0, values(V.R[(s, j)]) * u)

    def dur(key):
        return float(durs[key[2]][key[0]])

    # constraints (b, a, kind, gap): start[b] >= (end[a] if kind == "end" else start[a]) + gap
    cons: list[tuple] = []
    for s in range(S):
        for j in range(M):
            if s > 0:
                cons.append(((s, j, "F"), (s - 1, j, "F"), "end", problem.comm(s - 1)))
            if s < S - 1:
                cons.append(((s, j, "B"), (s + 1, j, "B"), "end", problem.comm(s)))
            cons.append(((s, j, "B"), (s, j, "F"), "end", 0.0))
            cons.append(((s, j, "W"), (s, j, "B"), "end", 0.0))
            if (s, j) in offl:
                cons.append(((s, j, "O"), (s, j, "F"), "end", 0.0))
                cons.append(((s, j, "R"), (s, j, "O"), "end", 0.0))
                cons.append(((s, j, "B"), (s, j, "R"), "end", 0.0))
        comp = _solution_order(V, s, M, values)
        for a, b in zip(comp, comp[1:]):
            cons.append((b, a, "end", 0.0))
        copy = sorted(((s, j, t) for (s2, j) in offl if s2 == s for t in ("O", "R")), key=lambda k: (start[k], 0 if k[2] == "O" else 1, k[1]))
        for a, b in zip(copy, copy[1:]):
            cons.append((b, a, "end", 0.0))
    for grp in problem.pcie_groups:
        gs = set(grp)
        copy = sorted(((s, j, t) for (s, j) in offl if s in gs for t in ("O", "R")), key=lambda k: (start[k], k[0], k[1]))
        for a, b in zip(copy, copy[1:]):
            cons.append((b, a, "end", 0.0))
    tiny = "strict"
    for (s, k, l), var in V.g.items():
        if values(var) > 0.5 and (s, l) in offl:
            cons.append(((s, k, "F"), (s, l, "O"), "end", 0.0))
            cons.append(((s, l, "R"), (s, k, "F"), "start", tiny))
    for (s, k, c, j), var in V.q.items():
        if (s, k) not in offl:
            continue
        if c == "F" and values(var) < 0.5:
            cons.append(((s, j, "F"), (s, k, "R"), "start", tiny))
        elif c in ("B", "W") and values(var) > 0.5:
            cons.append(((s, k, "R"), (s, j, c), "start", 0.0))
    for (s, k, l), var in V.w.items():
        if values(var) > 1e-6 and (s, k) in offl and (s, l) in offl:
            cons.append(((s, k, "R"), (s, l, "O"), "end", 0.0))
            cons.append(((s, l, "R"), (s, k, "R"), "start", tiny))
    _push_right(start, cons, dur)

    ops = []
    for key, t0 in start.items():
        s, j, c = key
        ops.append(ScheduledOp(s, j, c, float(t0), float(t0) + dur(key)))
    return sort_ops(ops)


def _solution_order(V: MilpVars, s: int, M: int, values: Callable) -> list[tuple[int, int, str]]:
    """Compute ops of stage s in the order the solution's binaries (and fixed orders) say.

    Using the decisions rather than the start times keeps zero-duration ops on the side of
    a tie that the memory accounting assumed.
    """
    import functools

    def cmp(a, b):
        lit = _order_lit(V, s, (a[2], a[1]), (b[2], b[1]))
        if isinstance(lit, int):
            return -1 if lit == 1 else 1
        var, sign = lit
        before = (values(var) > 0.5) == (sign > 0)
        return -1 if before else 1

    ops = [(s, j, c) for j in range(M) for c in _COMPUTE]
    return sorted(ops, key=functools.cmp_to_key(cmp))


def _push_right(start: dict, cons: list, dur: Callable) -> None:
    """Raise start times until every constraint holds exactly (Bellman-Ford style sweeps)."""
    scale = max([1.0] + [abs(t) + dur(k) for k, t in start.items()])
    strict_gap = 1e-8 * scale
    for _ in range(200):
        changed = False
        for b, a, kind, gap in cons:
            if b not in start or a not in start:
                continue
            base = start[a] + dur(a) if kind == "end" else start[a]
            if gap == "strict":  # start[b] > base, by more than the validator's event tolerance
                need = base + strict_gap
                if start[b] < need:
                    start[b] = need
                    changed = True
                continue
            need = base + gap
            if start[b] < need:
                start[b] = need
                changed = True
        if not changed:
            return


# --------------------------------------------------------------------------------------
# solve
# --------------------------------------------------------------------------------------


_STATUS = {
    "optimal": "optimal",
    "timelimit": "timelimit",
    "gaplimit": "gaplimit",
    "userinterrupt": "interrupted",
    "infeasible": "infeasible",
    "nodelimit": "nodelimit",
    "sollimit": "sollimit",
    "memlimit": "memlimit",
    "stallnodelimit": "nodelimit",
    "bestsollimit": "sollimit",
    "totalnodelimit": "nodelimit",
}


def _combinatorial_bound(problem: ScheduleProblem) -> float:
    try:
        from fxpipe.schedule.bounds import combinatorial_lower_bound
    except ImportError:  # pragma: no cover
        M = problem.num_microbatches
        return float(np.max(M * (problem.t_f + problem.t_b + problem.t_w)))
    return float(combinatorial_lower_bound(problem))


def solve(
    problem: ScheduleProblem,
    *,
    time_limit_s: float = 60.0,
    warm_start: Schedule | None = None,
    on_incumbent: Callable[[Incumbent], Any] | None = None,
    progress: bool = False,
    threads: int = 1,
    gap_limit: float = 0.0,
    triangle_cuts: bool = True,
) -> Schedule:
    """Solve the schedule MILP with SCIP and return the best valid schedule.

    Parameters
    ----------
    problem : ScheduleProblem
        Contract 3 problem (one stage per device).
    time_limit_s : float
        Wall-clock limit for SCIP (s), > 0.
    warm_start : Schedule, optional
        A valid schedule for ``problem``; default: the best valid heuristic
        (:func:`warm_start_schedule`). An invalid one is ignored.
    on_incumbent : callable, optional
        Called with an :class:`Incumbent` each time SCIP finds a better schedule
        (OptPipe Section 4.3: training can switch schedules while SCIP keeps searching).
        Exceptions it raises are recorded in ``meta["callback_errors"]`` and ignored.
    progress : bool
        Show a tqdm bar with incumbent, dual bound and gap.
    threads : int
        LP threads (``lp/threads``).
    gap_limit : float
        Stop at this relative gap (SCIP ``limits/gap``), e.g. 0.01.
    triangle_cuts : bool
        See :func:`build_model`.

    Returns
    -------
    Schedule
        ``method="milp"``; ``lower_bound_s = max(SCIP dual bound, combinatorial bound)``;
        ``status`` in optimal / timelimit / gaplimit / interrupted / ...; ``meta`` has gap,
        nodes, status, primal, dual, scip_version, params, model counts and incumbents.
        The schedule always passes the Contract-3 validator (if no MILP solution does, the
        warm start is returned with its own method recorded in ``meta["source"]``).

    Raises
    ------
    InputError
        Bad ``problem``, ``time_limit_s``, ``threads`` or ``gap_limit``.
    InfeasibleError
        If no schedule fits the memory limits.
    SolverError
        If SCIP fails (not on a time-out).

    References
    ----------
    OptPipe Sections 3, 4.1, 4.3 and Appendix C.
    """
    import pyscipopt as scip

    if not isinstance(problem, ScheduleProblem):
        raise InputError(f"expected a ScheduleProblem, got {type(problem).__name__}")
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0 and not math.isnan(time_limit_s)):
        raise InputError(f"time_limit_s must be > 0, got {time_limit_s!r}")
    if not (isinstance(threads, int) and threads >= 1):
        raise InputError(f"threads must be an integer >= 1, got {threads!r}")
    if not (isinstance(gap_limit, (int, float)) and 0 <= gap_limit < 1):
        raise InputError(f"gap_limit must lie in [0, 1), got {gap_limit!r}")
    t_start = time.perf_counter()
    check_memory_feasible(problem)

    if warm_start is not None:
        if not isinstance(warm_start, Schedule):
            raise InputError(f"warm_start must be a Schedule, got {type(warm_start).__name__}")
        if _check_ops(problem, warm_start.ops):
            warm_start = None
    if warm_start is None:
        warm_start = warm_start_schedule(problem)
    warm_val = _value(problem, warm_start.ops)

    model, V = build_model(problem, warm_start=warm_start, triangle_cuts=triangle_cuts)
    comb_lb = _combinatorial_bound(problem)
    params = {"limits/time": float(time_limit_s), "limits/gap": float(gap_limit), "lp/threads": int(threads),
              "randomization/randomseedshift": 0}
    for k, v in params.items():
        model.setParam(k, v)
    # measured on the Zero Bubble / offload instances (benchmarks/bench_schedule.py): SCIP's
    # default probing spends tens of seconds in presolve on these big-M models, and on larger
    # models the LNS heuristics (RINS, trust region) around the warm start are what improves
    # the incumbent (p=4, m=8, limit 2: 28.5 with default separation, 28 without, in 30 s).
    model.setPresolve(scip.SCIP_PARAMSETTING.FAST)
    params["presolving"] = "fast"
    if V.counts["binaries"] > 500:
        # root cutting planes barely move the big-M LP bound here but cost most of the
        # time limit; the bound comes from the head/tail inequalities instead
        model.setHeuristics(scip.SCIP_PARAMSETTING.AGGRESSIVE)
        model.setSeparating(scip.SCIP_PARAMSETTING.OFF)
        params["heuristics"] = "aggressive"
        params["separating"] = "off"
    build_s = time.perf_counter() - t_start

    state = {"best": warm_start, "best_val": warm_val, "incumbents": [], "callback_errors": [],
             "extract_failures": 0}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=float(time_limit_s), desc=f"milp {problem.name}", unit="s", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s{postfix}")

    def consider(values: Callable, when: float, dual: float) -> None:
        try:
            ops = extract_schedule(problem, V, values)
        except Exception as exc:  # noqa: BLE001
            state["extract_failures"] += 1
            state.setdefault("extract_errors", []).append(repr(exc)[:200])
            return
        errs = _check_ops(problem, ops)
        if errs:
            state["extract_failures"] += 1
            state.setdefault("extract_errors", []).append(errs[0][:200])
            return
        val = _value(problem, ops)
        tol = 1e-12 * max(1.0, abs(val))
        if state["best"] is warm_start:
            if val > state["best_val"] + tol:
                return
        elif val >= state["best_val"] - tol:
            return
        ms, span = _objective_values(problem, ops)
        sched = Schedule(ops=tuple(ops), makespan=ms, stage_span=span, lower_bound_s=max(dual, comb_lb),
                         status="feasible", solver_time_s=when, method="milp", objective=problem.objective)
        state["best"], state["best_val"] = sched, val
        state["incumbents"].append({"value_s": val, "dual_bound_s": dual, "time_s": when})
        if on_incumbent is not None:
            try:
                on_incumbent(Incumbent(value_s=val, dual_bound_s=dual, time_s=when, schedule=sched))
            except Exception as exc:  # noqa: BLE001
                state["callback_errors"].append(repr(exc)[:200])

    class _Handler(scip.Eventhdlr):
        last_update = 0.0

        def eventinit(self):
            self.model.catchEvent(scip.SCIP_EVENTTYPE.BESTSOLFOUND, self)
            if bar is not None:
                self.model.catchEvent(scip.SCIP_EVENTTYPE.NODESOLVED, self)
                self.model.catchEvent(scip.SCIP_EVENTTYPE.LPSOLVED, self)

        def eventexit(self):
            self.model.dropEvent(scip.SCIP_EVENTTYPE.BESTSOLFOUND, self)
            if bar is not None:
                self.model.dropEvent(scip.SCIP_EVENTTYPE.NODESOLVED, self)
                self.model.dropEvent(scip.SCIP_EVENTTYPE.LPSOLVED, self)

        def eventexec(self, event):
            m = self.model
            now = m.getSolvingTime()
            try:
                dual = max(m.getDualbound() * V.unit_s, 0.0)
            except Exception:  # noqa: BLE001
                dual = 0.0
            if event.getType() == scip.SCIP_EVENTTYPE.BESTSOLFOUND:
                sol = m.getBestSol()
                consider(lambda var: m.getSolVal(sol, var), now, dual)
            if bar is not None and (now - self.last_update > 0.5 or event.getType() == scip.SCIP_EVENTTYPE.BESTSOLFOUND):
                self.last_update = now
                best = state["best_val"]
                gap = (best - dual) / best if best > 0 else 0.0
                bar.n = min(now, float(time_limit_s))
                bar.set_postfix_str(f"incumbent={best:.6g} bound={dual:.6g} gap={100 * gap:.2f}%", refresh=True)

    model.includeEventhdlr(_Handler(), "fxpipe_incumbent", "reports new incumbents")
    interrupted = False
    try:
        model.optimize()
    except KeyboardInterrupt:
        interrupted = True
    except Exception as exc:  # noqa: BLE001
        raise SolverError(f"SCIP failed on problem {problem.name!r}: {exc}") from exc
    finally:
        if bar is not None:
            try:
                best_v, dual_v = state["best_val"], max(model.getDualbound() * V.unit_s, 0.0)
                bar.n = min(model.getSolvingTime(), float(time_limit_s))
                gap_v = (best_v - dual_v) / best_v if best_v > 0 else 0.0
                bar.set_postfix_str(f"incumbent={best_v:.6g} bound={dual_v:.6g} gap={100 * gap_v:.2f}%", refresh=True)
            except Exception:  # noqa: BLE001
                pass
            bar.close()

    raw_status = model.getStatus()
    status = "interrupted" if interrupted else _STATUS.get(raw_status, raw_status)
    try:
        dual_s = max(model.getDualbound() * V.unit_s, 0.0)
    except Exception:  # noqa: BLE001
        dual_s = 0.0
    note = None
    if raw_status == "infeasible" or not math.isfinite(dual_s):
        # the model's conservative memory accounting (strict margins) holds no schedule of
        # value <= the warm start's: nothing is proven, the warm start is still valid
        dual_s = 0.0
        status = "feasible"
        note = "the MILP found no schedule at most as long as the warm start; returning the warm start"
    # the final best solution (the handler saw it already unless it came from presolve)
    if model.getNSols() > 0 and raw_status != "infeasible":
        sol = model.getBestSol()
        consider(lambda var: model.getSolVal(sol, var), model.getSolvingTime(), dual_s)
    best: Schedule = state["best"]
    value = state["best_val"]
    primal_s = model.getPrimalbound() * V.unit_s if model.getNSols() > 0 else float("inf")
    lb = max(dual_s, comb_lb)
    lb = min(lb, value)  # the returned schedule's value may exceed the model optimum by repair noise
    if status == "optimal" and value > primal_s * (1 + 1e-6) + 1e-12:
        status = "feasible"  # SCIP's optimum could not be reproduced exactly (see meta)
    gap = (value - lb) / value if value > 0 else 0.0
    if status == "optimal":
        gap = max(gap, 0.0)
    ms, span = _objective_values(problem, best.ops)
    meta = {
        "gap": gap,
        "nodes": int(model.getNNodes()),
        "status": raw_status,
        "primal": primal_s,
        "dual": dual_s,
        "combinatorial_bound_s": comb_lb,
        "scip_version": str(model.version()) if hasattr(model, "version") else scip.__version__,
        "pyscipopt_version": scip.__version__,
        "params": params,
        "model": V.counts,
        "horizon_s": V.horizon * V.unit_s,
        "warm_start": {"method": warm_start.method, "value_s": warm_val, "accepted": V.warm_start_accepted,
                       "candidates": warm_start.meta.get("warm_candidates", {})},
        "incumbents": state["incumbents"],
        "source": best.method if best is not warm_start else f"warm_start:{warm_start.method}",
        "build_s": build_s,
    }
    if note:
        meta["note"] = note
    if state["callback_errors"]:
        meta["callback_errors"] = state["callback_errors"]
    if state["extract_failures"]:
        meta["extract_failures"] = state["extract_failures"]
        meta["extract_errors"] = state.get("extract_errors", [])[:5]
    return Schedule(
        ops=best.ops, makespan=ms, stage_span=span, lower_bound_s=lb, status=status,
        solver_time_s=time.perf_counter() - t_start, method="milp", objective=problem.objective, meta=meta,
    )
