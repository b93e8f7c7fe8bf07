"""Heuristic pipeline schedules: baselines and MILP warm starts (DESIGN.md Contract 3).

Every generator builds per-stage op orders (and, for the offload schedules, a set of
stashes to offload), times them with :func:`fxpipe.schedule.simulate.simulate` and checks
the result with the independent validator. A generator returns a valid schedule that
respects ``mem_limit`` or raises :class:`~fxpipe.errors.InfeasibleError` saying which stage
does not fit and by how many bytes.

Methods
-------
``gpipe``
    All forwards, then every backward with its W right after its B (Huang et al. 2019).
``1f1b``
    Stage s runs ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one
    backward, then drains; W right after its B (a fused backward, as torch's
    ``Schedule1F1B``). Peak stash of stage s: ``min(p - s, m)`` micro-batches.
``zb-h1``
    Zero Bubble (Qi et al. 2024, Section 2.1) with the *memory of 1F1B*: W passes are
    deferred to fill bubbles. Built with the Zero Bubble greedy (Section 3) under the
    budget "no device holds more than 1F1B's worst device", ``max_s min(p - s, m) mem_f[s]``
    bytes on every stage (capped by ``mem_limit``), as in the paper, where later stages hold
    more stashes than in 1F1B; ``per_stage=True`` bounds every stage by its own 1F1B peak
    ``min(p - s, m)`` stashes instead. The 1F1B order is kept as a candidate, so ZB-H1 is
    never longer than 1F1B. With F = B = W it reproduces the paper's bubble
    ``(p - 1)(F + B - W)``.
``zb-h2``
    Zero Bubble Section 2.2: more warm-up forwards, budget ``min(2(p - s) - 1, m)`` stashes
    (worst device, or per stage), W passes fill the rest; zero bubble when F = B = W.
    ZB-H1 is kept as a candidate.
``greedy``
    The Zero Bubble automatic-scheduling heuristic (Qi et al. 2024 Section 3.1, the
    ``initial_solution`` of ``auto_schedule.py``) under ``mem_limit``: eight flag
    combinations, best kept. Generalised to per-stage times, memory and limits.
``pipeoffload``
    1F1B orders (from ``p - s - 1`` warm-up forwards down to 0) with selective activation
    offload (Wan et al. 2025): on stages with a finite limit, micro-batches whose F-to-B gap
    exceeds the offload round trip ``2 t_offload`` are offloaded (or, with ``minimal=True``,
    only as many as memory needs, longest lifespan first, PipeOffload Section 2), on one copy
    stream per stage (Section 4.2; see :mod:`fxpipe.schedule.simulate` for the slot rule).
    Forwards wait for offloads to end when memory is short (memory-aware list scheduling).
``interleaved-1f1b``, ``zb-v``, ``dualpipe-v``
    Several stages per device (looped / V placement): :mod:`fxpipe.schedule.multistage`.
    ``greedy`` on such placements is :mod:`fxpipe.schedule.device_greedy`.
``offload-search``
    Compute and offload / reload decided together by an offload-aware list scheduler
    (:mod:`fxpipe.schedule.offload_search`), the best of a seeded parameter search of
    :data:`OFFLOAD_SEARCH_EVALS` policies (at most :data:`OFFLOAD_SEARCH_TIME_S`): near zero
    bubble under limits where the order-first offload heuristics fall back to 1F1B.
``adaoffload``
    OptPipe Appendix D, Algorithm 1: per stage, as many forwards as fit before the earliest
    start of the stage's first backward (plus a tolerance), every warm-up stash offloaded,
    then PipeOffload's steady state (B, W, F) and drain; stages whose memory overflows fall
    back to fewer warm-up forwards (PipeOffload rules).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import Schedule, ScheduleProblem
import fxpipe.schedule.registry as _registry
from fxpipe.schedule.bounds import limited_1f1b_bound
from fxpipe.schedule.device_greedy import device_greedy
from fxpipe.schedule.simulate import simulate
import fxpipe.schedule.offload_search as offload_search_mod
from fxpipe.schedule.validate import InvalidScheduleError, check_schedule, require_one_stage_per_device, stage_peaks

__all__ = [
    "METHODS",
    "V_METHODS",
    "ALL_METHODS",
    "generate",
    "gpipe",
    "one_f_one_b",
    "zb_h1",
    "zb_h2",
    "zb_greedy",
    "greedy",
    "pipeoffload",
    "adaoffload",
    "offload_search_schedule",
    "orders_1f1b",
    "orders_gpipe",
    "warmup_overflow_bytes",
    "greedy_orders",
    "require_one_stage_per_device",
]

#: Generators for the V placement (two stages per device: d and 2p-1-d); from the registry.
V_METHODS = _registry.heuristic_names("v")
#: Generators that schedule one stage per device (``interleaved-1f1b`` with v = 1 is 1F1B;
#: ``greedy`` and ``interleaved-1f1b`` also take several stages per device); from the registry.
METHODS = tuple(m for m in _registry.heuristic_names() if m not in V_METHODS)
#: Every heuristic :func:`generate` knows (:data:`fxpipe.schedule.registry.REGISTRY`).
ALL_METHODS = METHODS + V_METHODS

#: The per-stage order form ``{stage: [(type, microbatch), ...]}`` (one stage per device).
StageOrders = dict[int, list[tuple[str, int]]]


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _stage_limits(problem: ScheduleProblem) -> np.ndarray:
    """Memory limit of every stage's device (S,): the per-stage limit with one stage per device."""
    return np.asarray(problem.mem_limit)[np.asarray(problem.device_of_stage, dtype=np.int64)]


def _overflow(problem: ScheduleProblem, sched: Schedule) -> tuple[float, int]:
    """Largest excess of peak memory over the limit (bytes, <= 0 if it fits) and its stage."""
    worst, where = -math.inf, 0
    lims = _stage_limits(problem)
    for s, peak in enumerate(stage_peaks(problem, sched.ops)):
        ex = (0.0 if peak is None else peak) - float(lims[s])
        if ex > worst:
            worst, where = ex, s
    return worst, where


def _finish(problem: ScheduleProblem, sched: Schedule, t0: float) -> Schedule:
    """Check a generated schedule: memory violations -> InfeasibleError, others -> bug."""
    errs = check_schedule(problem, sched)
    if errs:
        other = [e for e in errs if not e.startswith("rule 5")]
        if other:
            raise InvalidScheduleError(errs, sched.method)
        ex, s = _overflow(problem, sched)
        raise InfeasibleError(
            f"{sched.method}: stage {s} needs {ex + float(_stage_limits(problem)[s]):.6g} bytes of activation memory, "
            f"over its limit {float(_stage_limits(problem)[s]):.6g} by {ex:.6g}; raise mem_limit, use more micro-batch "
            "offload (pipeoffload/adaoffload) or the MILP"
        )
    return Schedule(
        ops=sched.ops,
        makespan=sched.makespan,
        stage_span=sched.stage_span,
        lower_bound_s=sched.lower_bound_s,
        status="heuristic",
        solver_time_s=time.perf_counter() - t0,
        method=sched.method,
        objective=problem.objective,
        meta=sched.meta,
    )


def _fits(problem: ScheduleProblem, sched: Schedule) -> bool:
    return not check_schedule(problem, sched)


def _best(problem: ScheduleProblem, cands: Iterable[Schedule]) -> Schedule | None:
    best = None
    for c in cands:
        if c is None:
            continue
        if best is None or c.value < best.value - 1e-12 * max(1.0, abs(best.value)):
            best = c
    return best


def _stash_budget(problem: ScheduleProblem, count: Sequence[int], per_stage: bool) -> np.ndarray:
    """Memory budget of every stage, capped by the limit.

    ``per_stage``: stage s may hold ``count[s]`` of its stashes. Otherwise every stage may
    hold the largest of these over all stages (in bytes), i.e. the peak of the *worst*
    device is what is bounded (Qi et al. 2024 Section 2: "the maximum peak memory usage
    over all workers").
    """
    # count stashes plus the rise of a B (the replayed forward of a recomputing stage)
    own = np.asarray(count, dtype=float) * problem.mem_f + np.maximum(0.0, problem.mem_b_start)
    if not per_stage:
        own = np.full(problem.num_stages, float(own.max()))
    return np.minimum(own, _stage_limits(problem))


def _min_stash_check(problem: ScheduleProblem, method: str) -> None:
    need = problem.stash_footprint  # mem_f, or the stash plus a recomputing B's replay
    bad = np.flatnonzero(need > _stage_limits(problem) * (1 + 1e-12))
    if bad.size:
        s = int(bad[0])
        raise InfeasibleError(
            f"{method}: stage {s} cannot hold even one micro-batch's stash "
            f"({need[s]:.6g} bytes > mem_limit {_stage_limits(problem)[s]:.6g}, over by "
            f"{need[s] - _stage_limits(problem)[s]:.6g}); no schedule fits: raise the memory, recompute "
            "(a smaller stash) or use more stages"
        )


# --------------------------------------------------------------------------------------
# GPipe and 1F1B
# --------------------------------------------------------------------------------------


def orders_gpipe(num_stages: int, num_microbatches: int) -> StageOrders:
    """GPipe orders: F0..F(m-1), then B0 W0 B1 W1 ... on every stage."""
    M = num_microbatches
    seq = [("F", j) for j in range(M)]
    for j in range(M):
        seq += [("B", j), ("W", j)]
    return {s: list(seq) for s in range(num_stages)}


def orders_1f1b(num_stages: int, num_microbatches: int, warmup: Sequence[int] | None = None) -> StageOrders:
    """1F1B orders with W right after B (fused backward).

    Parameters
    ----------
    num_stages, num_microbatches : int
    warmup : sequence of int, optional
        Warm-up forwards per stage; default ``min(p - s - 1, m)`` (Narayanan et al. 2021).
        Any value in ``0..m`` gives a valid order; the peak stash is ``warmup[s] + 1``.
    """
    p, M = num_stages, num_microbatches
    out: StageOrders = {}
    for s in range(p):
        w = min(p - s - 1, M) if warmup is None else max(0, min(int(warmup[s]), M))
        seq = [("F", j) for j in range(w)]
        nf = w
        for j in range(M):
            if nf < M:
                seq.append(("F", nf))
                nf += 1
            seq += [("B", j), ("W", j)]
        out[s] = seq
    return out


def warmup_overflow_bytes(problem: ScheduleProblem, warm: Sequence[int], *, offload: bool = False) -> float:
    """Bytes by which 1F1B orders with these warm-ups (:func:`orders_1f1b`, one stage per
    device) certainly exceed some stage's limit however they are timed (-inf when not
    certain); > 0 means :func:`~fxpipe.schedule.validate.check_schedule` refuses every timing.

    On stage s the first ``k = min(warm[s] + 1, m)`` ops are forwards, then ``B(s, 0)``. When
    the k-th forward starts the stage holds ``k mem_f[s]``, less at most ``k - 1`` offloaded
    stashes (``offload=True``; the k-th one's offload has not started); when ``B(s, 0)`` starts
    it holds that plus ``mem_b + mem_b_transient`` (its own stash is back, rule 4). Each is one
    instant of the validator's curve, apart from the ops before and after it, when ``t_f[s]``
    (and ``t_b[s]`` for the second) exceeds the validator's time tolerance times the number of
    events that could chain into it (the tolerance is bounded with every op, transfer and
    copy run back to back). The excess counted is beyond twice the validator's memory
    tolerance.
    """
    S, M = problem.num_stages, problem.num_microbatches
    t_max = M * (float(np.sum(problem.t_f + problem.t_b + problem.t_w)) + 2 * float(np.sum(problem.t_comm))
                 + 2 * float(np.sum(problem.t_offload)))
    chain_tol = (2 * M + 4) * 1e-9 * max(1.0, t_max)
    foot, lims = problem.stash_footprint, _stage_limits(problem)
    worst = -math.inf
    for s in range(S):
        a, lim = float(problem.mem_f[s]), float(lims[s])
        off = max(0.0, float(problem.offload_bytes[s])) if offload else 0.0
        if a < 0 or not math.isfinite(lim) or float(problem.t_f[s]) <= chain_tol:
            continue
        k = min(int(warm[s]) + 1, M)
        mtol = 1e-9 * max(1.0, float(foot[s]), abs(lim))
        held = k * a - (k - 1) * off
        worst = max(worst, held - lim - 2 * mtol)
        if float(problem.t_b[s]) > chain_tol:
            rise = float(problem.mem_b[s]) + float(problem.mem_b_transient[s])
            worst = max(worst, held + rise - lim - 2 * mtol)
    return worst if worst > 0 else -math.inf


def gpipe(problem: ScheduleProblem) -> Schedule:
    """GPipe: all forwards, then every backward (B then W) in micro-batch order.

    Raises
    ------
    InfeasibleError
        If ``m`` stashes do not fit on some stage.

    References
    ----------
    Huang et al. 2019, "GPipe"; Contract 3.
    """
    t0 = time.perf_counter()
    require_one_stage_per_device(problem, "gpipe")
    _min_stash_check(problem, "gpipe")
    M = problem.num_microbatches
    if warmup_overflow_bytes(problem, [M - 1] * problem.num_stages) > 0:
        # GPipe's orders are 1F1B's with every forward in the warm-up: refused however they are timed
        need = M * problem.mem_f + np.maximum(problem.mem_b + problem.mem_b_transient, 0.0)
        lims = _stage_limits(problem)
        s = int(np.argmax(need - lims))
        raise InfeasibleError(
            f"gpipe: stage {s} needs {need[s]:.6g} bytes of activation memory (the stashes of all {M} micro-batches) "
            f"however it is timed, over its limit {lims[s]:.6g} by {need[s] - lims[s]:.6g}; raise mem_limit, use "
            "1f1b (fewer micro-batches in flight) or micro-batch offload (pipeoffload/adaoffload)")
    sched = simulate(problem, orders_gpipe(problem.num_stages, problem.num_microbatches), method="gpipe")
    return _finish(problem, sched, t0)


def one_f_one_b(problem: ScheduleProblem) -> Schedule:
    """1F1B (PipeDream-flush / DAPPLE) with a fused backward (W right after B).

    Stage s runs ``min(p - s - 1, m)`` warm-up forwards, then one forward and one backward
    alternately, then the remaining backwards. With uniform stages, zero comm:
    makespan = ``(m + p - 1)(F + B + W)``.

    Raises
    ------
    InfeasibleError
        If ``min(p - s, m)`` stashes do not fit on stage s.

    References
    ----------
    Narayanan et al. 2021 (PipeDream-2BW / 1F1B); Qi et al. 2024 Figure 2.
    """
    t0 = time.perf_counter()
    require_one_stage_per_device(problem, "1f1b")
    _min_stash_check(problem, "1f1b")
    sched = simulate(problem, orders_1f1b(problem.num_stages, problem.num_microbatches), method="1f1b")
    return _finish(problem, sched, t0)


# --------------------------------------------------------------------------------------
# Zero Bubble greedy (Qi et al. 2024 Section 3.1, auto_schedule.py initial_solution)
# --------------------------------------------------------------------------------------


class _GreedyFail(Exception):
    pass


def greedy_orders(
    problem: ScheduleProblem,
    mem_budget: Sequence[float] | np.ndarray,
    *,
    allow_bubble_before_first_b: bool,
    prioritize_b: bool,
    no_bubble_greedy: bool,
) -> StageOrders:
    """One run of the Zero Bubble greedy: per-stage orders under a per-stage memory budget.

    The greedy walks micro-batch by micro-batch. Micro-batch 0: one forward on every stage,
    then (from the last stage up) as many extra warm-up forwards as fit in memory and before
    the first backward can arrive (or end before it, with ``allow_bubble_before_first_b``),
    trimmed so that no stage warms up more than the one before it, then the first backward.
    Micro-batch i > 0: a forward on every stage that still has forwards (a stage may skip
    when ``prioritize_b`` and it is two forwards ahead of the next stage and its own backward
    would otherwise wait), then the backward of i on every stage from the last up. Before
    each forward/backward, pending W passes are inserted while memory is short and while
    they fit in the idle time before the op's input arrives; one more W is inserted into a
    bubble that is not longer than the largest bubble so far (or always, with
    ``no_bubble_greedy``). Remaining W passes run at the end.

    Parameters
    ----------
    problem : ScheduleProblem
    mem_budget : float array (S,)
        Bytes each stage may hold (``inf`` = unlimited).
    allow_bubble_before_first_b, prioritize_b, no_bubble_greedy : bool
        The three switches of the Zero Bubble heuristic.

    Returns
    -------
    dict stage -> list of (type, microbatch)

    Raises
    ------
    _GreedyFail
        If a pass does not fit the budget even after all pending W passes.

    References
    ----------
    Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Section 3.1 (heuristic algorithm);
    its ``auto_schedule.py`` (``initial_solution``), re-implemented here for per-stage costs.
    """
    S, M = problem.num_stages, problem.num_microbatches
    # per-problem constants as Python floats (the same values as the arrays' entries)
    def floats(x) -> list[float]:
        return np.asarray(x, dtype=float).tolist()

    cost = {"F": floats(problem.t_f), "B": floats(problem.t_b), "W": floats(problem.t_w)}
    memd = {"F": floats(problem.mem_f), "B": floats(problem.mem_b), "W": floats(problem.mem_w)}
    transient = floats(problem.mem_b_transient)
    # rises[t][s]: memory rise at the op's start (a recomputing B replays its forward)
    rises = {"F": memd["F"], "B": [x + y for x, y in zip(memd["B"], transient)], "W": memd["W"]}
    budget = np.asarray(mem_budget, dtype=float)
    eps = 1e-12
    room = [b + eps * max(1.0, abs(b)) for b in budget.tolist()]  # the budget with its tolerance
    comm = [problem.comm(s) for s in range(S - 1)]

    cnt = {t: [0] * S for t in "FBW"}
    busy_until = [0.0] * S  # end of the stage's last op
    mem = [0.0] * S
    bubble = [0.0] * S
    # end time of every placed op: done[t][s][j] (0.0 until placed)
    done = {t: [[0.0] * M for _ in range(S)] for t in "FBW"}
    orders: StageOrders = {s: [] for s in range(S)}
    n_f, n_b, n_w = cnt["F"], cnt["B"], cnt["W"]
    t_w = cost["W"]

    def c(t, s):
        return cost[t][s]

    def d(t, s):
        return memd[t][s]

    def place(s: int, t: str) -> None:
        n_t = cnt[t]
        j = n_t[s]
        if mem[s] + rises[t][s] > room[s]:
            raise _GreedyFail(f"stage {s}: {t}{j} exceeds the memory budget")
        dur = cost[t][s]
        end = busy_until[s] + dur
        tight = end
        if t == "F" and s > 0:
            end = max(end, done["F"][s - 1][j] + comm[s - 1] + dur)
        if t == "B" and s < S - 1:
            end = max(end, done["B"][s + 1][j] + comm[s] + dur)
        if n_f[s] > 0:
            bubble[s] += end - tight
        busy_until[s] = end
        done[t][s][j] = end
        mem[s] += memd[t][s]
        n_t[s] = j + 1
        orders[s].append((t, j))

    def free_memory_for(s: int, t: str) -> None:
        while mem[s] + rises[t][s] > room[s]:
            if n_w[s] >= n_b[s]:
                raise _GreedyFail(f"stage {s}: no W left to free memory for {t}{cnt[t][s]}")
            place(s, "W")

    def fill_with_w(s: int, arrival: float) -> None:
        # W passes that end before the input of the next op arrives
        while n_w[s] < n_b[s] and busy_until[s] + t_w[s] <= arrival:
            place(s, "W")
        if n_w[s] < n_b[s] and busy_until[s] < arrival:
            if arrival - busy_until[s] <= max(bubble) - bubble[s]:
                if no_bubble_greedy:
                    place(s, "W")
            else:
                place(s, "W")

    for i in range(M):
        if i == 0:
            for s in range(S):
                place(s, "F")
            extra = _warmup_forwards(S, M, c, d, comm, budget, mem, busy_until, done["F"][S - 1][0], cnt["F"],
                                     allow_bubble_before_first_b)
            for s in range(S - 1, -1, -1):
                for _ in range(extra[s]):
                    place(s, "F")
                free_memory_for(s, "B")
                place(s, "B")
            continue
        want = _forwards_wanted(S, M, c, d, comm, budget, mem, busy_until, bubble, cnt, prioritize_b)
        for s in range(S):
            if not want[s]:
                continue
            free_memory_for(s, "F")
            if s > 0:
                fill_with_w(s, (done["F"][s - 1][n_f[s]] if n_f[s] < M else 0.0) + comm[s - 1])
            place(s, "F")
        for s in range(S - 1, -1, -1):
            if cnt["B"][s] != i:
                raise _GreedyFail(f"stage {s}: B{i} out of turn")
            while cnt["F"][s] <= i:  # never run a backward before its forward
                free_memory_for(s, "F")
                place(s, "F")
            free_memory_for(s, "B")
            if s + 1 < S:
                fill_with_w(s, done["B"][s + 1][i] + comm[s])
            if s == 0 and cnt["F"][s] == M:
                while n_w[s] < n_b[s]:
                    place(s, "W")
            place(s, "B")
    for s in range(S):
        while cnt["W"][s] < M:
            place(s, "W")
    return orders


def _warmup_forwards(S: int, M: int, c, d, comm: list[float], budget: np.ndarray, mem: list[float],
                     busy_until: list[float], last_f0_end: float, n_f: list[int], allow_bubble: bool) -> list[int]:
    """:func:`greedy_orders`' extra warm-up forwards of every stage after micro-batch 0's
    forward: from the last stage up, as many as fit in memory and before the first backward
    can arrive (or end before it, with ``allow_bubble``), trimmed so that no stage warms up
    more than the one before it. ``c(t, s)`` / ``d(t, s)``: duration / memory delta of an op,
    ``last_f0_end``: end of F0 on the last stage, ``n_f``: forwards placed per stage."""
    eps = 1e-12
    extra = [0] * S
    last_t = 0.0
    for s in range(S - 1, -1, -1):
        if s == S - 1:
            last_t = last_f0_end + c("B", s)
            continue
        m_s, t_s = mem[s], busy_until[s]
        while n_f[s] + extra[s] < M and m_s + d("F", s) <= budget[s] + eps * max(1.0, abs(budget[s])):
            if allow_bubble:
                if t_s + c("F", s) > last_t + comm[s]:
                    break
            elif t_s >= last_t + comm[s]:
                break
            m_s += d("F", s)
            t_s += c("F", s)
            extra[s] += 1
        last_t = max(t_s, last_t + comm[s]) + c("B", s)
    for s in range(1, S):
        while extra[s] > 0 and extra[s] >= extra[s - 1] and n_f[s] + extra[s] < M:
            extra[s] -= 1
        # never more warm-up forwards than the previous stage: their inputs come from
        # its warm-up (the reference code skips the trim when a stage reaches m
        # forwards, which deadlocks; this clamp only acts in that case)
        extra[s] = min(extra[s], extra[s - 1])
    return extra


def _forwards_wanted(S: int, M: int, c, d, comm: list[float], budget: np.ndarray, mem: list[float],
                     busy_until: list[float], bubble: list[float], cnt: dict, prioritize_b: bool) -> list[int]:
    """Which stages run a forward in :func:`greedy_orders`' step for a micro-batch > 0 (1/0):
    every stage that still has forwards, except (with ``prioritize_b``) one two forwards
    ahead of the next stage whose own backward would otherwise wait; a stage waits for the
    next one unless that one has run all its forwards."""
    want = [0] * S
    for s in range(S):
        if cnt["F"][s] >= M:
            continue
        if prioritize_b and s + 1 < S and cnt["F"][s] >= cnt["F"][s + 1] + 2:
            nxt = busy_until[s + 1] + c("F", s + 1) + c("B", s + 1) + comm[s]
            if busy_until[s] >= nxt:
                continue
            w_cost, w_cnt = 0.0, 0
            m_w = mem[s] + d("F", s)
            while m_w > budget[s] and cnt["W"][s] + w_cnt < cnt["B"][s]:
                w_cost += c("W", s)
                m_w += d("W", s)
                w_cnt += 1
            if busy_until[s] + c("F", s) + w_cost <= nxt:
                want[s] = 1
                continue
            if nxt - busy_until[s] <= max(bubble) - bubble[s]:
                continue
        want[s] = 1
    for s in range(S - 2, -1, -1):
        # a stage waits for the next one, unless that one has run all its forwards
        # (possible after the warm-up: the reference code would then starve stage s)
        if cnt["F"][s + 1] < M:
            want[s] = min(want[s], want[s + 1])
    return want


def zb_greedy(
    problem: ScheduleProblem,
    mem_budget: Sequence[float] | np.ndarray | None = None,
    *,
    method: str = "greedy",
) -> Schedule:
    """The Zero Bubble automatic-scheduling heuristic under a per-stage memory budget.

    Runs :func:`greedy_orders` with all eight combinations of its switches and keeps the
    best valid schedule for the problem's objective (ties: the first, in the order of the
    reference implementation).

    Parameters
    ----------
    problem : ScheduleProblem
    mem_budget : float array (S,), optional
        Default ``mem_limit``.
    method : str
        Name stored in the result.

    Raises
    ------
    InfeasibleError
        If no combination fits the budget.

    References
    ----------
    Qi et al. 2024, Section 3.1; reproduces their heuristic's table (see tests).
    """
    t0 = time.perf_counter()
    require_one_stage_per_device(problem, method)
    budget = _stage_limits(problem) if mem_budget is None else np.asarray(mem_budget, dtype=float)
    _min_stash_check(problem, method)
    best = None
    reasons = []
    for allow in (True, False):
        for prio in (True, False):
            for nbg in (True, False):
                try:
                    orders = _greedy_orders_once(problem, budget, allow, prio, nbg)
                except _GreedyFail as exc:
                    reasons.append(str(exc))
                    continue
                try:
                    sched = simulate(
                        problem,
                        orders,
                        method=method,
                        meta={"allow_bubble_before_first_b": allow, "prioritize_b": prio, "no_bubble_greedy": nbg},
                    )
                except InputError as exc:  # the orders deadlock: this combination fails
                    reasons.append(str(exc))
                    continue
                if best is not None and _best(problem, [best, sched]) is best:
                    continue  # not better than the best so far: whether it is valid does not matter
                if check_schedule(problem, sched):
                    reasons.append("a combination produced an invalid schedule")
                    continue
                best = _best(problem, [best, sched])
    if best is None:
        raise InfeasibleError(
            f"{method}: the Zero Bubble greedy cannot fit the memory budget "
            f"({reasons[0] if reasons else 'no schedule'}); raise mem_limit or use offload"
        )
    return _finish(problem, best, t0)


#: The last runs of :func:`greedy_orders` from :func:`zb_greedy`: (problem, budget bytes,
#: switches, orders or the failure message). ZB-H2 runs ZB-H1 inside it, and under a binding
#: limit the budgets of ZB-H2, ZB-H1 and ``greedy`` are often all ``mem_limit``: one run each.
_GREEDY_RUNS: list = []
_GREEDY_RUNS_KEEP = 48


def _greedy_orders_once(problem: ScheduleProblem, budget: np.ndarray, allow: bool, prio: bool,
                        nbg: bool) -> StageOrders:
    """:func:`greedy_orders` of (the very object) ``problem``, remembered (a fresh copy each time)."""
    key = (np.asarray(budget, dtype=float).tobytes(), allow, prio, nbg)
    for prob_seen, key_seen, out in _GREEDY_RUNS:
        if prob_seen is problem and key_seen == key:
            if isinstance(out, str):
                raise _GreedyFail(out)
            return {s: list(seq) for s, seq in out.items()}
    try:
        out = greedy_orders(problem, budget, allow_bubble_before_first_b=allow, prioritize_b=prio,
                            no_bubble_greedy=nbg)
    except _GreedyFail as exc:
        _GREEDY_RUNS.append((problem, key, str(exc)))
        del _GREEDY_RUNS[:-_GREEDY_RUNS_KEEP]
        raise
    _GREEDY_RUNS.append((problem, key, {s: list(seq) for s, seq in out.items()}))
    del _GREEDY_RUNS[:-_GREEDY_RUNS_KEEP]
    return out


def zb_h1(problem: ScheduleProblem, *, per_stage: bool = False) -> Schedule:
    """ZB-H1: 1F1B's peak memory, W passes deferred into bubbles (Qi et al. Section 2.1).

    Budget (capped by ``mem_limit``): with ``per_stage=False`` (the paper) every stage may
    hold as many bytes as 1F1B's worst stage, ``max_s min(p - s, m) mem_f[s]``, so the peak
    over all devices equals 1F1B's while later stages defer their W passes; with
    ``per_stage=True`` stage s keeps 1F1B's own peak ``min(p - s, m) mem_f[s]`` (then the last
    stage cannot defer any W and little is gained). Candidates: the Zero Bubble greedy under
    this budget and the 1F1B order itself; the better is returned, so ZB-H1 is never longer
    than 1F1B.

    Raises
    ------
    InfeasibleError
        If 1F1B's memory does not fit the limit.
    """
    t0 = time.perf_counter()
    require_one_stage_per_device(problem, "zb-h1")
    p, M = problem.num_stages, problem.num_microbatches
    _min_stash_check(problem, "zb-h1")
    budget = _stash_budget(problem, [min(p - s, M) for s in range(p)], per_stage)
    cands = []
    try:
        cands.append(zb_greedy(problem, budget, method="zb-h1"))
    except InfeasibleError:
        pass
    base = simulate(problem, orders_1f1b(p, M), method="zb-h1", meta={"source": "1f1b order"})
    if _fits(problem, base):
        cands.append(base)
    best = _best(problem, cands)
    if best is None:
        return _finish(problem, base, t0)  # raises InfeasibleError with the overflow
    return _finish(problem, best, t0)


def zb_h2(problem: ScheduleProblem, *, per_stage: bool = False) -> Schedule:
    """ZB-H2: about twice 1F1B's memory to remove bubbles (Qi et al. Section 2.2).

    Budget: ``min(2(p - s) - 1, m)`` stashes (the warm-up of Qi et al. Figure 3, bottom),
    for the worst stage (``per_stage=False``, the paper's "2p - 1") or for each stage,
    capped by ``mem_limit``; the Zero Bubble greedy fills it. ZB-H1 is kept as a candidate
    (never worse than ZB-H1).

    Raises
    ------
    InfeasibleError
        If not even 1F1B's memory fits.
    """
    t0 = time.perf_counter()
    require_one_stage_per_device(problem, "zb-h2")
    p, M = problem.num_stages, problem.num_microbatches
    _min_stash_check(problem, "zb-h2")
    budget = _stash_budget(problem, [min(2 * (p - s) - 1, M) for s in range(p)], per_stage)
    cands = []
    try:
        cands.append(zb_greedy(problem, budget, method="zb-h2"))
    except InfeasibleError:
        pass
    h1 = zb_h1(problem, per_stage=per_stage)
    cands.append(Schedule(h1.ops, h1.makespan, h1.stage_span, method="zb-h2", objective=h1.objective, meta={"source": "zb-h1"}))
    return _finish(problem, _best(problem, cands), t0)


# --------------------------------------------------------------------------------------
# Offload schedules (PipeOffload, AdaOffload)
# --------------------------------------------------------------------------------------


def _gaps(problem: ScheduleProblem, sched: Schedule) -> dict[tuple[int, int], float]:
    """F end to B start of every (stage, micro-batch): the stash lifespan on the device."""
    f_end, b_start = {}, {}
    for o in sched.ops:
        if o.type == "F":
            f_end[(o.stage, o.microbatch)] = o.end_s
        elif o.type == "B":
            b_start[(o.stage, o.microbatch)] = o.start_s
    return {k: b_start[k] - f_end[k] for k in f_end}


def _selective_offload(
    problem: ScheduleProblem,
    orders: StageOrders,
    method: str,
    force: Iterable[tuple[int, int]] = (),
    *,
    minimal: bool = True,
) -> tuple[Schedule, float]:
    """Time ``orders`` with selective offload (PipeOffload rule).

    Candidates are the (stage, mb) whose F-to-B gap (timed without offload) is at least the
    round trip ``2 t_offload`` (PipeOffload Section 4.4: shorter lifespans are not worth it),
    on stages with a finite limit, longest gap first (Section 2: longer lifespans first).
    ``minimal=False``: every candidate is offloaded (the "free lunch" rule), even when memory
    would fit without. ``minimal=True``: the shortest prefix of the list that fits is found
    by bisection (checked), none if memory fits already. Both fall back to every micro-batch
    of the stages that still overflow.

    Returns
    -------
    (schedule, overflow) : overflow <= 0 when the schedule fits.
    """
    force = set(force)
    base = simulate(problem, orders, offload=force, method=method, respect_memory=True)
    ex, _ = _overflow(problem, base)
    if minimal and ex <= 1e-9 * max(1.0, float(np.max(problem.mem_f))) and not check_schedule(problem, base):
        return base, ex
    gaps = _gaps(problem, base)
    finite = np.isfinite(_stage_limits(problem))
    cand = sorted(
        (k for k, g in gaps.items() if finite[k[0]] and k not in force and g >= 2 * problem.t_offload[k[0]] - 1e-12),
        key=lambda k: (-gaps[k], k),
    )

    def attempt(k: int) -> tuple[Schedule, float, bool]:
        s = simulate(problem, orders, offload=force | set(cand[:k]), method=method, respect_memory=True)
        e, _ = _overflow(problem, s)
        return s, e, not check_schedule(problem, s)

    best_s, best_e = base, ex
    full_s, full_e, full_ok = attempt(len(cand))
    if full_e < best_e:
        best_s, best_e = full_s, full_e
    if full_ok and not minimal:
        return full_s, full_e
    if full_ok:
        lo, hi = 0, len(cand)  # invariant: hi fits
        best_s, best_e = full_s, full_e
        while hi - lo > 1:
            mid = (lo + hi) // 2
            s_mid, e_mid, ok = attempt(mid)
            if ok:
                hi, best_s, best_e = mid, s_mid, e_mid
            else:
                lo = mid
        return best_s, best_e
    # every micro-batch of the stages that overflow, whatever its gap
    over = set()
    for s, peak in enumerate(stage_peaks(problem, full_s.ops)):
        if peak is not None and peak > _stage_limits(problem)[s]:
            over.add(s)
    allk = force | set(cand) | {(s, j) for s in over for j in range(problem.num_microbatches)}
    s_all = simulate(problem, orders, offload=allk, method=method, respect_memory=True)
    e_all, _ = _overflow(problem, s_all)
    if e_all < best_e:
        best_s, best_e = s_all, e_all
    return best_s, best_e


def pipeoffload(problem: ScheduleProblem, *, minimal: bool = False, beat: float | None = None) -> Schedule:
    """PipeOffload-style schedule: 1F1B orders with selective activation offload.

    Tries 1F1B warm-ups ``w`` = p-1, p-2, ..., 0 (stage s runs ``min(w, p - s - 1)`` warm-up
    forwards; fewer in flight = shorter lifespans, PipeOffload Section 3.2). For each, the
    stashes whose F-to-B gap exceeds the offload round trip are offloaded on stages with a
    finite limit (``minimal=True``: only as many of them, longest first, as memory needs);
    see :func:`_selective_offload`. Returns the first (largest warm-up) that fits.

    Parameters
    ----------
    problem : ScheduleProblem
    minimal : bool
        Offload only as many stashes as memory needs (see :func:`_selective_offload`).
    beat : float, optional
        A value (seconds) already found elsewhere: stop, raising InfeasibleError, at the first
        warm-up whose bound (:func:`fxpipe.schedule.bounds.limited_1f1b_bound`, which offload
        and memory waits only raise) is above it; neither it nor any smaller warm-up could
        beat it. The schedule returned when one fits before that is the one without ``beat``.

    Raises
    ------
    InfeasibleError
        If no warm-up fits even with every stash offloaded (the message gives the smallest
        overflow seen), or none can beat ``beat``.

    References
    ----------
    Wan et al. 2025, "PipeOffload", Sections 2, 3.2 and 4.2.
    """
    t0 = time.perf_counter()
    require_one_stage_per_device(problem, "pipeoffload")
    p, M = problem.num_stages, problem.num_microbatches
    _min_stash_check(problem, "pipeoffload")  # F allocates its whole stash before any offload
    best, least = None, math.inf
    for w in range(p - 1, -1, -1):
        if beat is not None:
            lb = limited_1f1b_bound(problem, w)
            if lb > beat * (1 + 1e-9) + 1e-12:
                raise InfeasibleError(f"pipeoffload: skipped: warm-up {w} or less is at least {lb:.6g} s (its lower "
                                      f"bound), more than the {beat:.6g} s found")
        warm = [min(w, p - s - 1, M) for s in range(p)]
        over = warmup_overflow_bytes(problem, warm, offload=True)
        if over > 0:  # no offload choice fits this warm-up: not timed
            least = min(least, over)
            continue
        sched, ex = _selective_offload(problem, orders_1f1b(p, M, warm), "pipeoffload", minimal=minimal)
        sched = Schedule(sched.ops, sched.makespan, sched.stage_span, method="pipeoffload", objective=problem.objective,
                         meta={"warmup": warm, "offloaded": sum(o.type == "O" for o in sched.ops)})
        if _fits(problem, sched):
            best = sched  # the largest warm-up that fits: fewer in flight only adds bubbles
            break
        else:
            least = min(least, ex)
    if best is None:
        raise InfeasibleError(
            f"pipeoffload: no 1F1B warm-up fits mem_limit even with offload (smallest overflow {least:.6g} bytes); "
            "a stage cannot hold one stash plus what arrives before its offload ends: raise mem_limit"
        )
    return _finish(problem, best, t0)


def _est_first_b(problem: ScheduleProblem) -> np.ndarray:
    """Earliest start of B(s, 0): micro-batch 0 forward through all stages, back to s."""
    S = problem.num_stages
    t = 0.0
    for s in range(S):
        t += problem.t_f[s] + (problem.comm(s) if s < S - 1 else 0.0)
    est = np.zeros(S)
    est[S - 1] = t
    for s in range(S - 2, -1, -1):
        est[s] = est[s + 1] + problem.t_b[s + 1] + problem.comm(s)
    return est


def adaoffload(problem: ScheduleProblem, *, tolerance_s: float = 0.0) -> Schedule:
    """AdaOffload (OptPipe Appendix D, Algorithm 1): a dense fill phase plus PipeOffload.

    Step 1: ``EstStart(B_{s,0})``, the earliest start of stage s's first backward (micro-batch
    0 through every forward, back through the later backwards, with comm). Step 2: stage s
    runs forwards ASAP (each followed by its offload on the copy stream) while the previous
    forward and offload end before ``EstStart(B_{s,0}) + tolerance_s`` and memory allows.
    Step 3: PipeOffload's rule for the rest: B, W, then the next forward, and the drain;
    every warm-up stash is offloaded, later stashes selectively (:func:`_selective_offload`).
    A stage whose memory still overflows falls back to one warm-up forward less, down to
    PipeOffload's warm-up.

    Parameters
    ----------
    problem : ScheduleProblem
    tolerance_s : float
        ``T`` of Algorithm 1: how much the first backward of a stage may be delayed.

    Raises
    ------
    InfeasibleError
        If even the fallback cannot fit memory.

    References
    ----------
    OptPipe (2025) Section 4.1.3 and Appendix D, Algorithm 1; Wan et al. 2025 (PipeOffload).
    """
    t0 = time.perf_counter()
    require_one_stage_per_device(problem, "adaoffload")
    p, M = problem.num_stages, problem.num_microbatches
    _min_stash_check(problem, "adaoffload")
    est = _est_first_b(problem)
    # forward-only ASAP times (exact for the fill phase, where only forwards run)
    f_end = np.zeros((p, M))
    for s in range(p):
        for j in range(M):
            ready = f_end[s - 1, j] + problem.comm(s - 1) if s > 0 else 0.0
            prev = f_end[s, j - 1] if j > 0 else 0.0
            f_end[s, j] = max(ready, prev) + problem.t_f[s]
    warm = []
    for s in range(p):
        t_off = float(problem.t_offload[s])
        o_end = -math.inf
        n = 0
        off_done: list[float] = []
        for j in range(M):
            if j > 0 and max(f_end[s, j - 1], o_end + t_off) >= est[s] + tolerance_s:
                break
            start = f_end[s, j] - problem.t_f[s]
            n_off = sum(1 for x in off_done if x <= start)
            need = (j + 1) * problem.mem_f[s] - n_off * problem.offload_bytes[s]
            if j > 0 and need > _stage_limits(problem)[s] * (1 + 1e-12):
                break
            o_end = max(o_end, f_end[s, j]) + t_off
            off_done.append(o_end)
            n = j + 1
        warm.append(max(1, n))
    warm = [min(w, M) for w in warm]

    def build(warm_s: list[int]) -> StageOrders:
        orders: StageOrders = {}
        for s in range(p):
            w = warm_s[s]
            seq = [("F", j) for j in range(w)]
            nf = w
            for j in range(M):
                seq += [("B", j), ("W", j)]
                if nf < M:
                    seq.append(("F", nf))
                    nf += 1
            orders[s] = seq
        return orders

    floor = [min(p - s, M) for s in range(p)]  # PipeOffload / 1F1B warm-up (incl. the steady F)
    cur = [max(w, f) for w, f in zip(warm, floor)]

    def monotone(ws: list[int]) -> list[int]:
        # stage s+1 runs its warm-up forwards before its first B, whose input comes after
        # stage s's first B: it cannot warm up more than stage s (else the orders deadlock)
        for s in range(1, p):
            ws[s] = min(ws[s], ws[s - 1])
        return ws

    cur = monotone(cur)
    finite = np.isfinite(_stage_limits(problem))
    best, least = None, math.inf
    for _ in range(M * p + 1):
        orders = build(cur)
        force = {(s, j) for s in range(p) if finite[s] for j in range(cur[s]) if j > 0} if finite.any() else set()
        sched, ex = _selective_offload(problem, orders, "adaoffload", force=force)
        sched = Schedule(sched.ops, sched.makespan, sched.stage_span, method="adaoffload", objective=problem.objective,
                         meta={"warmup": list(cur), "offloaded": sum(o.type == "O" for o in sched.ops),
                               "tolerance_s": tolerance_s})
        if _fits(problem, sched):
            best = sched
            break
        least = min(least, ex)
        over = []
        for s, peak in enumerate(stage_peaks(problem, sched.ops)):
            if peak is not None and peak > _stage_limits(problem)[s] * (1 + 1e-12) and cur[s] > 1:
                over.append(s)
        if not over:
            break
        for s in over:
            cur[s] -= 1
        cur = monotone(cur)
    if best is None:  # fall back to PipeOffload's rules entirely
        try:
            best = pipeoffload(problem)
        except InfeasibleError:
            best = None
    if best is None:
        raise InfeasibleError(
            f"adaoffload: cannot fit mem_limit even with every warm-up stash offloaded "
            f"(smallest overflow {least:.6g} bytes); raise mem_limit"
        )
    if best.method != "adaoffload":
        best = Schedule(best.ops, best.makespan, best.stage_span, method="adaoffload", objective=problem.objective,
                        meta={**best.meta, "fallback": "pipeoffload"})
    return _finish(problem, best, t0)


# --------------------------------------------------------------------------------------
# dispatcher
# --------------------------------------------------------------------------------------

def greedy(problem: ScheduleProblem) -> Schedule:
    """The greedy for the problem's placement.

    One stage per device: the Zero Bubble greedy (:func:`zb_greedy`, Qi et al. 2024 Section
    3.1). Several stages on a device: the memory-aware device greedy of
    :mod:`fxpipe.schedule.device_greedy` (any placement).

    Raises
    ------
    InfeasibleError
        If the greedy cannot fit ``mem_limit``.
    """
    if problem.one_stage_per_device:
        return zb_greedy(problem)
    return device_greedy(problem, method="greedy")


#: Policies :func:`offload_search_schedule` evaluates (deterministic for a given problem) ...
OFFLOAD_SEARCH_EVALS = 200
#: ... unless this many seconds pass first.
OFFLOAD_SEARCH_TIME_S = 2.0


def offload_search_schedule(problem: ScheduleProblem) -> Schedule:
    """:func:`fxpipe.schedule.offload_search.offload_search` with the generator budget.

    Raises
    ------
    InputError
        If a device holds several stages.
    InfeasibleError
        If one stash does not fit a stage (the message gives the bytes), or no policy fits.
    """
    require_one_stage_per_device(problem, "offload-search")
    _min_stash_check(problem, "offload-search")
    t0 = time.perf_counter()
    sched = offload_search_mod.offload_search(problem, time_limit_s=OFFLOAD_SEARCH_TIME_S, max_evals=OFFLOAD_SEARCH_EVALS)
    return _finish(problem, sched, t0)


def generate(problem: ScheduleProblem, method: str) -> Schedule:
    """A valid heuristic schedule of ``problem`` by ``method`` (one of :data:`ALL_METHODS`).

    ``gpipe``, ``1f1b``, ``zb-h1``, ``zb-h2``, ``pipeoffload`` and ``adaoffload`` schedule
    one stage per device; ``interleaved-1f1b`` needs the looped placement, ``zb-v`` and
    ``dualpipe-v`` the V placement (:mod:`fxpipe.schedule.multistage`); ``greedy`` works on
    any placement.

    Raises
    ------
    InputError
        On an unknown method, or a placement the method does not schedule.
    InfeasibleError
        If the method cannot fit ``mem_limit`` (the message says by how much).
    """
    key = str(method).lower()
    if key not in ALL_METHODS:
        raise InputError(f"unknown schedule method {method!r}; choose one of {', '.join(ALL_METHODS)}")
    return _registry.get(key).generate(problem)
