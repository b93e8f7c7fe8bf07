"""A memory-aware greedy list scheduler for any placement of stages on devices.

Zero Bubble's automatic scheduler (Qi et al. 2024, Section 3.1) and the ZB-V greedy of
"Pipeline Parallelism with Controllable Memory" (Qi et al. 2024, Section 4) build schedules
by walking time forward on every device and choosing, whenever a device is free, what to run
next: a backward-input pass (B) when one is ready (it unblocks the devices below), otherwise
a forward (F) if memory allows, otherwise a deferred backward-weight pass (W), which fills
bubbles and frees memory. This module implements that rule for any ``device_of_stage``
(identity, looped, V-shape, or anything else), per-stage costs and a per-device memory
budget:

* Ops of one stage keep micro-batch order per type (F, B and W of stage s run in increasing
  micro-batch order), as in every schedule of the literature and OptPipe Section 4.1.1.
* A device picks among the next F and B of each of its stages and its pending W's. At its
  free time t: a B whose inputs have arrived by t (smallest micro-batch first, then the
  later stage); else an F whose input has arrived and that memory admits (same tie-break:
  depth first); else, with ``eager_w``, the oldest pending W; else it waits for the earliest
  arriving B or admitted F (without ``eager_w`` a pending W runs only if it ends by then).
* Memory admission with a reserve: a micro-batch's stashes on all stages of a device must be
  there together before its backward can come back, so an F runs only if afterwards the
  remaining forwards of (``reserve="admitted"``) every micro-batch that has started on the
  device, or (``reserve=r``) the r oldest ones whose forwards are not all done, still fit
  next to the memory of the micro-batches not older than them. Micro-batches enter a device in
  order, so the globally oldest unfinished micro-batch can always make progress: the greedy
  is deadlock-free whenever one micro-batch's stashes over all stages of every device fit
  (``sum mem_f <= budget``); otherwise it raises. ``"admitted"`` keeps few micro-batches in
  flight (good under tight memory), ``r = 1`` the most (fewer bubbles when memory allows);
  :func:`device_greedy` tries several and keeps the best.
  When an F is not admitted, pending W's run first (they free memory).
* Comm: ``t_comm`` between stages on different devices only (Contract 3).

The greedy decides the per-device orders; the orders are then timed exactly by
:func:`fxpipe.schedule.simulate.simulate` (ASAP) and checked by the validator. Without
offload, a device's memory at each op start depends only on its own op order, so the
budget holds for the ASAP timing too.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from fxpipe.errors import InfeasibleError
from fxpipe.ir import Action, Orders, Schedule, ScheduleProblem
from fxpipe.schedule.simulate import simulate
from fxpipe.schedule.validate import check_schedule

__all__ = ["device_greedy_orders", "device_greedy", "min_device_memory", "GreedyFailure"]


#: Memory admission policies :func:`device_greedy` tries (see :func:`device_greedy_orders`).
RESERVE_POLICIES = ("admitted", 1, 2, 3, 4)


class GreedyFailure(Exception):
    """The greedy could not place the next op (memory budget too small); message says why."""


def min_device_memory(problem: ScheduleProblem, *, offload: bool = True) -> np.ndarray:
    """The least activation memory every schedule needs on each device (float64 (D,), bytes).

    At the start of F(s, j) the stage's own stash ``mem_f[s]`` is on the device, and so is
    the stash of micro-batch j on every earlier stage s' < s of the same device (its B waits
    for B(s, j)), at least ``mem_f[s'] - offload_bytes[s']`` of it if offloaded; other
    micro-batches hold >= 0. The same holds at the start of B(s, j), where the stage holds
    its stash plus the B's rise (``stash_footprint[s]``: a recomputing stage replays its
    forward). So the peak of device d is at least
    ``max_{s on d} (stash_footprint[s] + sum_{s' < s on d} (mem_f[s'] - offload_bytes[s']))``;
    running one micro-batch at a time (offloading the earlier stashes, each W right after its
    B) attains it. With one stage per device this is ``stash_footprint[s]`` (``mem_f[s]``
    without recomputation).

    Parameters
    ----------
    problem : ScheduleProblem
    offload : bool
        Count offloading (default); False gives ``sum mem_f`` over the device's stages.
    """
    out = np.zeros(problem.num_devices)
    for d, stages in enumerate(problem.device_stages):
        held = 0.0
        best = 0.0
        for s in stages:
            best = max(best, held + float(problem.stash_footprint[s]))
            keep = float(problem.mem_f[s]) - (float(problem.offload_bytes[s]) if offload else 0.0)
            held += keep
        out[d] = best
    return out


def device_greedy_orders(
    problem: ScheduleProblem,
    mem_budget: Sequence[float] | np.ndarray | None = None,
    *,
    eager_w: bool = True,
    reserve: str = "admitted",
) -> Orders:
    """Per-device orders from the memory-aware greedy (module docstring).

    Parameters
    ----------
    problem : ScheduleProblem
        Any placement.
    mem_budget : float array (D,), optional
        Bytes each device may hold (default ``mem_limit``).
    eager_w : bool
        Run a pending W whenever nothing else is ready (True), or only when it ends before
        the next B/F arrives (False).
    reserve : "admitted", "oldest" or int >= 1
        Memory admission (module docstring): reserve the remaining forwards of every
        micro-batch that has started on the device (few micro-batches in flight), or only
        those of the ``reserve`` oldest ones whose forwards are not all done ("oldest" = 1;
        more in flight).

    Returns
    -------
    Orders

    Raises
    ------
    GreedyFailure
        If a device cannot hold one micro-batch's stashes over its stages, or no device can
        make progress.

    References
    ----------
    Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Section 3.1; Qi et al. 2024,
    "Pipeline Parallelism with Controllable Memory", Section 4 (greedy V schedules).
    """
    S, M, D = problem.num_stages, problem.num_microbatches, problem.num_devices
    if reserve == "oldest":
        reserve = 1
    if reserve != "admitted" and not (isinstance(reserve, int) and reserve >= 1):
        raise ValueError(f"reserve must be 'admitted', 'oldest' or an integer >= 1, got {reserve!r}")
    dev = problem.device_of_stage
    stages_of = problem.device_stages
    budget = problem.mem_limit if mem_budget is None else np.asarray(mem_budget, dtype=float)
    tol = [1e-9 * max(1.0, abs(float(b))) if math.isfinite(float(b)) else 0.0 for b in budget]
    mem_f = problem.mem_f
    delta = {"F": problem.mem_f, "B": problem.mem_b, "W": problem.mem_w}
    dur = {"F": problem.t_f, "B": problem.t_b, "W": problem.t_w}
    comm = [problem.comm(s) for s in range(S - 1)]
    _check_one_microbatch_fits(problem, budget, tol)

    nxt = {t: [0] * S for t in "FBW"}
    end: dict[tuple[int, str, int], float] = {}
    free = [0.0] * D
    mem = [0.0] * D
    # fwd_done[d][j]: how many of device d's stages have run micro-batch j's forward
    fwd_done = [[0] * M for _ in range(D)]
    mem_mb = [[0.0] * M for _ in range(D)]  # memory device d holds for micro-batch j
    rest = [[float(sum(mem_f[x] for x in stages[i:])) for i in range(len(stages) + 1)] for stages in stages_of]
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(D)]  # (stage, mb) with B done, W not
    rows: list[list[Action]] = [[] for _ in range(D)]
    left = [3 * M * len(st) for st in stages_of]

    def ready(s: int, t: str, j: int) -> float | None:
        if j >= M:
            return None
        if t == "F":
            if s == 0:
                return 0.0
            e = end.get((s - 1, "F", j))
            return None if e is None else e + comm[s - 1]
        if (s, "F", j) not in end:
            return None
        if s == S - 1:
            return end[(s, "F", j)]
        e = end.get((s + 1, "B", j))
        return None if e is None else e + comm[s]

    def admits(d: int, s: int, j: int) -> bool:
        if mem[d] + float(mem_f[s]) > budget[d] + tol[d]:
            return False
        if reserve == "admitted":
            return _room_for_started(mem[d] + float(mem_f[s]), fwd_done[d], rest[d], j, budget[d] + tol[d])
        return _room_for_oldest(fwd_done[d], rest[d], mem_mb[d], len(stages_of[d]), reserve, j, float(mem_f[s]),
                                budget[d] + tol[d])

    def decide(d: int):
        t = free[d]
        bs, fs = [], []
        for s in stages_of[d]:
            rb = ready(s, "B", nxt["B"][s])
            if rb is not None:
                bs.append((rb, nxt["B"][s], -s, s))
            j = nxt["F"][s]
            rf = ready(s, "F", j)
            if rf is not None and admits(d, s, j):
                fs.append((rf, j, -s, s))
        now_b = [x for x in bs if x[0] <= t]
        if now_b:
            _, j, _, s = min(now_b, key=lambda x: (x[1], x[2]))
            return t, ("B", s, j)
        now_f = [x for x in fs if x[0] <= t]
        if now_f:
            _, j, _, s = min(now_f, key=lambda x: (x[1], x[2]))
            return t, ("F", s, j)
        nxt_arrival = min([x[0] for x in bs + fs], default=math.inf)
        if pending_w[d]:
            s, j = pending_w[d][0]
            if eager_w or t + float(dur["W"][s]) <= nxt_arrival or not math.isfinite(nxt_arrival):
                return t, ("W", s, j)
        if bs or fs:
            first = min(bs + fs, key=lambda x: (x[0], 0 if x in bs else 1, x[1], x[2]))
            kind = "B" if first in bs else "F"
            return first[0], (kind, first[3], first[1])
        return None

    total = sum(left)
    placed = 0
    while placed < total:
        best = _earliest_decision(decide, left)
        if best is None:
            raise _stuck(left)
        start, d, (t, s, j) = best
        e = start + float(dur[t][s])
        end[(s, t, j)] = e
        free[d] = e
        rows[d].append(Action(s, t, j))
        nxt[t][s] += 1
        left[d] -= 1
        placed += 1
        if t == "F":
            fwd_done[d][j] += 1
        elif t == "B":
            pending_w[d].append((s, j))
        else:
            pending_w[d].remove((s, j))
        x = float(delta[t][s])
        mem[d] += x
        mem_mb[d][j] += x
        # memory short for every admissible forward and no B ready: the W's queue drains
        # through decide() (a W is chosen when no F is admitted), so nothing else to do here
    return Orders(dev, tuple(tuple(r) for r in rows))


def _check_one_microbatch_fits(problem: ScheduleProblem, budget, tol: list[float]) -> None:
    """Raise :class:`GreedyFailure` unless every device can hold one micro-batch's stashes
    on all its stages at once (bytes, within ``budget + tol``)."""
    for d, stages in enumerate(problem.device_stages):
        need = float(sum(problem.mem_f[s] for s in stages))
        if need > budget[d] + tol[d]:
            raise GreedyFailure(
                f"device {d} must hold one micro-batch's stashes on all its stages {list(stages)} at once "
                f"({need:.6g} bytes) but its budget is {float(budget[d]):.6g}"
            )


def _room_for_started(held: float, done: list[int], rest: list[float], j: int, cap: float) -> bool:
    """Admission ``reserve="admitted"``: after F(s, j) (device memory ``held``) every
    micro-batch that has started on the device keeps room for its remaining forwards
    (``done[jj]`` forwards of micro-batch jj done, ``rest[n]`` bytes of the forwards after
    the n-th)."""
    for jj in range(len(done)):
        n = done[jj] + (1 if jj == j else 0)
        if n == 0:
            break
        held += rest[n]
    return held <= cap


def _room_for_oldest(done: list[int], rest: list[float], mem_mb: list[float], k: int, reserve: int, j: int,
                     f: float, cap: float) -> bool:
    """Admission ``reserve=int``: after F(s, j) (stash ``f`` bytes) the ``reserve`` oldest
    micro-batches whose forwards on the device (``k`` stages) are not all done must still
    find room for their remaining forwards next to the memory (``mem_mb``) of micro-batches
    not older than the oldest of them (older ones have all their forwards here and free
    their memory once their backwards arrive): then the oldest unfinished micro-batch
    always progresses."""
    M = len(done)
    j0, need, count = None, 0.0, 0
    for jj in range(M):
        n = done[jj] + (1 if jj == j else 0)
        if n == 0:
            break  # micro-batches start on d in order: none later has started
        if n < k:
            if j0 is None:
                j0 = jj
            need += rest[n]
            count += 1
            if count >= reserve:
                break
    if j0 is None:
        return True
    held = sum(mem_mb[jj] for jj in range(j0, M)) + (f if j >= j0 else 0.0)
    return held + need <= cap


def _earliest_decision(decide, left: list[int]):
    """``(start, device, (type, stage, mb))``: the earliest of ``decide(d)`` over the devices
    with ops left (ties: the lowest device); None when none can continue."""
    best = None
    for d in range(len(left)):
        if left[d] == 0:
            continue
        dec = decide(d)
        if dec is None:
            continue
        if best is None or dec[0] < best[0] - 1e-12:
            best = (dec[0], d, dec[1])
    return best


def _stuck(left: list[int]) -> GreedyFailure:
    """The error when no device can place its next op."""
    stuck = [f"device {d}" for d in range(len(left)) if left[d]]
    return GreedyFailure(
        f"no device can continue ({', '.join(stuck[:4])} wait for memory or for each other); "
        "the memory budget is too small for this greedy"
    )


def device_greedy(
    problem: ScheduleProblem,
    mem_budget: Sequence[float] | np.ndarray | None = None,
    *,
    method: str = "greedy",
) -> Schedule:
    """The best valid schedule of the device greedy (both W policies, every reserve policy) under a memory budget.

    Parameters
    ----------
    problem : ScheduleProblem
        Any placement.
    mem_budget : float array (D,), optional
        Default ``mem_limit`` (capped by it in any case).
    method : str
        Name stored in the result.

    Raises
    ------
    InfeasibleError
        If no variant fits (e.g. one micro-batch's stashes over a device's stages exceed
        its budget: the message gives the bytes).

    References
    ----------
    See :func:`device_greedy_orders`.
    """
    t0 = time.perf_counter()
    budget = problem.mem_limit if mem_budget is None else np.minimum(np.asarray(mem_budget, dtype=float), problem.mem_limit)
    best, reasons = None, []
    for reserve in RESERVE_POLICIES:
        for eager in (True, False):
            try:
                orders = device_greedy_orders(problem, budget, eager_w=eager, reserve=reserve)
            except GreedyFailure as exc:
                reasons.append(str(exc))
                continue
            sched = simulate(problem, orders, method=method, meta={"eager_w": eager, "reserve": reserve})
            errs = check_schedule(problem, sched)
            if errs:
                reasons.append(errs[0])
                continue
            if best is None or sched.value < best.value - 1e-12 * max(1.0, abs(best.value)):
                best = sched
    if best is None:
        raise InfeasibleError(f"{method}: {reasons[0] if reasons else 'no schedule'}; raise mem_limit or use the MILP")
    return Schedule(ops=best.ops, makespan=best.makespan, stage_span=best.stage_span, status="heuristic",
                    solver_time_s=time.perf_counter() - t0, method=method, objective=problem.objective,
                    meta=best.meta)
