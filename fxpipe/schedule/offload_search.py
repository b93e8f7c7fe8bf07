"""Offload-aware list scheduling with a parameter search: a primal heuristic for tight memory.

The order-based heuristics (1F1B, ZB-H1/H2, PipeOffload, AdaOffload) fix every stage's op
order first and decide offloads afterwards, so under a tight ``mem_limit`` they fall back to
few warm-up forwards and leave bubbles; on p = 8, m = 16, F = B = W = 1, offload 0.5 they
end at 55-62 time units against a lower bound of 48-58. This module decides compute *and*
copy ops together, walking time forward on every stage (a parallel schedule-generation
scheme, Kolisch 1996; the Zero Bubble greedy of Qi et al. 2024 Section 3.1 extended with
PipeOffload's offload / reload, Wan et al. 2025 Sections 2 and 4.2):

* **Compute stream**, whenever a stage is free at time ``t``: its next B if the gradient has
  arrived, its stash is on the device and memory admits a recomputing B's replay; else, if the stage holds ``w_first`` or more
  pending W passes, the oldest W; else its next F if the input has arrived, memory admits it
  (keeping room for the reload of the next backward once that backward is near) and fewer
  than ``cap`` forwards are in flight; else the oldest pending W, or (``eager_w`` off) only
  a W that ends before the next B or F can start; else it waits.
* **Copy stream** (one per stage, Contract 3 rule 3): a reload of the oldest offloaded stash
  once its backward is at most ``reload_ahead`` micro-batches away (or its gradient is at
  most ``reload_stages`` stages away), if memory admits it; else an offload of the stash
  needed last among those at least ``keep`` micro-batches ahead of the next backward, when
  the stash count is within ``margin`` of the limit (``margin`` large: offload eagerly).
* A stage may also delay its first forward by ``delay`` (the ``stage_span`` objective does not
  count time before a stage's first F, so a late start can remove later idle time).

Each parameter vector gives one schedule; :func:`offload_search` runs a seeded random search
with local moves over the vectors (per-stage ``cap``, ``keep``, ``w_first``, ``delay``,
global ``reload_ahead``, ``reload_stages``, ``margin``, ``eager_w``) under a time budget and
keeps the best schedule that passes the Contract-3 validator. Its result is a *heuristic*
(no optimality claim); the MILP uses it as a warm start.

One stage per device only (the other placements have :mod:`fxpipe.schedule.device_greedy`).
One run of the list scheduler is a numba kernel (:mod:`fxpipe.schedule._offload_kernel`,
compiled on first use and cached), so the search's time budget buys many policies on large
pipelines (a 32-stage, 16 micro-batch Llama-3-70B problem: about 4 ms a policy).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from fxpipe.errors import InfeasibleError
from fxpipe.ir import Schedule, ScheduledOp, ScheduleProblem
from fxpipe.progress import Search
from fxpipe.schedule.validate import (check_op_arrays, objective_values, objective_values_of_arrays, remember_op_arrays,
                                      require_one_stage_per_device)

__all__ = ["OffloadParams", "default_params", "offload_list_schedule", "offload_search"]

_EPS = 1e-9


@dataclass(frozen=True)
class OffloadParams:
    """One point of the search space of :func:`offload_list_schedule` (see the module docstring).

    Attributes
    ----------
    cap : tuple of int, length S
        Most forwards in flight (F done, B not started) per stage, offloaded ones included.
    keep : tuple of int, length S
        Stashes within this many micro-batches of the next backward are never offloaded.
    w_first : tuple of int, length S
        With this many pending W passes, a W runs before a forward.
    delay : tuple of float, length S
        Seconds the first forward of each stage waits beyond its input's arrival.
    reload_ahead : int
        Reload a stash once its backward is at most this many micro-batches away.
    reload_stages : int
        ... or once its gradient is at most this many stages away (its B started there).
    margin : float
        Offload only while the stage's memory plus ``margin`` stashes exceeds its limit.
    eager_w : bool
        Run a pending W whenever nothing else can run (else only if it ends in time).
    """

    cap: tuple
    keep: tuple
    w_first: tuple
    delay: tuple
    reload_ahead: int = 1
    reload_stages: int = 2
    margin: float = 1.0
    eager_w: bool = True


def default_params(problem: ScheduleProblem) -> OffloadParams:
    """A Zero-Bubble-like start point: ``2(p - s) - 1`` warm-up forwards, offload under pressure."""
    S, M = problem.num_stages, problem.num_microbatches
    return OffloadParams(
        cap=tuple(max(1, min(M, 2 * (S - s) - 1)) for s in range(S)),
        keep=tuple(1 for _ in range(S)),
        w_first=tuple(M for _ in range(S)),
        delay=tuple(0.0 for _ in range(S)),
    )


def offload_list_schedule(problem: ScheduleProblem, params: OffloadParams) -> list[ScheduledOp] | None:
    """Timed ops of one run of the offload-aware list scheduler, or None if it deadlocks.

    Parameters
    ----------
    problem : ScheduleProblem
        One stage per device (Contract 3; not checked here, :func:`offload_search` checks).
    params : OffloadParams
        The policy (module docstring).

    Returns
    -------
    list of ScheduledOp or None
        Every F, B, W and the chosen O / R ops (times in the problem's unit from 0);
        None when memory blocks every stage before all ops ran (the policy deadlocked).
        The result is *not* validated here (:func:`offload_search` does that).
    """
    cols = _columns(problem, params)
    return None if cols is None else _ops_of_columns(cols)


def _columns(problem: ScheduleProblem, params: OffloadParams) -> tuple[np.ndarray, ...] | None:
    """The kernel's ops as columns ``(stage, microbatch, type code, start, end)`` (int64, int64, int64,
    float64, float64; type codes index ``"FBWOR"``), or None if the policy deadlocked."""
    from fxpipe.schedule._offload_kernel import list_schedule  # noqa: PLC0415 (lazy: a numba kernel)

    S, M = problem.num_stages, problem.num_microbatches
    tables = [np.asarray(x, dtype=np.float64) for x in _stage_tables(problem)]
    tables[4] = np.append(tables[4], 0.0)  # comm: S entries (the last stage sends nothing)
    groups = [[g for g, grp in enumerate(problem.pcie_groups) if s in set(grp)] for s in range(S)]
    res_of = np.full((S, 1 + max(map(len, groups))), -1, dtype=np.int64)  # copy resources: stream s, group S + g
    for s in range(S):
        res_of[s, :1 + len(groups[s])] = [s] + [S + g for g in groups[s]]
    ints = [np.asarray(x, dtype=np.int64) for x in (params.cap, params.keep, params.w_first)]
    *cols, n = list_schedule(M, *tables, res_of, S + len(problem.pcie_groups), *ints,
                             np.asarray(params.delay, dtype=np.float64), int(params.reload_ahead),
                             int(params.reload_stages), float(params.margin), bool(params.eager_w))
    if n < 0:
        return None
    return tuple(c[:n] for c in cols)


def _ops_of_columns(cols: tuple[np.ndarray, ...]) -> list[ScheduledOp]:
    s_, j_, ty_, t0_, t1_ = (c.tolist() for c in cols)
    return [ScheduledOp(s, j, "FBWOR"[ty], a, e) for s, j, ty, a, e in zip(s_, j_, ty_, t0_, t1_)]


def _stage_tables(problem: ScheduleProblem) -> tuple[list, ...]:
    """Per stage as float lists: durations F, B, W, copy (s); comm to the next stage (s); memory
    deltas F, B, W, a recomputing B's transient, offloaded bytes and the device limit (bytes)."""
    S = problem.num_stages
    return ([problem.duration(s, "F") for s in range(S)],
            [problem.duration(s, "B") for s in range(S)],
            [problem.duration(s, "W") for s in range(S)],
            [float(problem.t_offload[s]) for s in range(S)],
            [problem.comm(s) for s in range(S - 1)],
            [float(problem.mem_f[s]) for s in range(S)],
            [float(problem.mem_b[s]) for s in range(S)],
            [float(problem.mem_w[s]) for s in range(S)],
            [float(problem.mem_b_transient[s]) for s in range(S)],
            [float(problem.offload_bytes[s]) for s in range(S)],
            [float(problem.mem_limit[problem.device_of_stage[s]]) for s in range(S)])


def _evaluate(problem: ScheduleProblem, params: OffloadParams,
              accept_at_most: float = math.inf) -> tuple[float, tuple[np.ndarray, ...] | None]:
    """Value and op columns (:func:`_columns`, idle offloads dropped, in ``sort_ops``' order) of one policy;
    (inf, None) if it deadlocks, is invalid or exceeds ``accept_at_most``.

    The value is taken on the columns (:func:`~fxpipe.schedule.validate.objective_values_of_arrays`), and only a policy that would be kept
    (value <= ``accept_at_most``) is validated, on its columns too
    (:func:`~fxpipe.schedule.validate.check_op_arrays`: the ops are built only to word a violation).
    """
    cols = _columns(problem, params)
    if cols is None:
        return math.inf, None
    cols = _drop_idle_offload_columns(cols)
    makespan, span = objective_values_of_arrays(problem, cols)
    value = span if problem.objective == "stage_span" else makespan
    if value > accept_at_most + _EPS:
        return math.inf, None
    stage, mb, ty, start, _ = cols
    order = np.lexsort((mb, ty, stage, start))  # sort_ops' canonical order
    cols = tuple(c[order] for c in cols)
    if check_op_arrays(problem, cols, lambda: _ops_of_columns(cols)):
        return math.inf, None
    return value, cols


def _drop_idle_offload_columns(cols: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """``cols`` without the O / R pairs that never left the device (the reload starting when the offload
    ends, within 1e-9 s), order kept."""
    stage, mb, ty, start, end = cols
    o, r = np.flatnonzero(ty == 3), np.flatnonzero(ty == 4)
    if not len(r):
        return cols
    key_scale = int(mb.max()) + 1
    o_key = stage[o] * key_scale + mb[o]
    order = np.argsort(o_key, kind="stable")
    r_key = stage[r] * key_scale + mb[r]
    pos = order[np.searchsorted(o_key[order], r_key)]  # every R follows its own O
    idle = start[r] <= end[o[pos]] + _EPS
    if not idle.any():
        return cols
    drop = np.zeros(len(ty), dtype=bool)
    drop[r[idle]] = True
    drop[o[pos[idle]]] = True
    keep = ~drop
    return tuple(c[keep] for c in cols)


def _mutate(problem: ScheduleProblem, p: OffloadParams, rng: random.Random) -> OffloadParams:
    S, M = problem.num_stages, problem.num_microbatches
    step = min(float(np.min(problem.t_f)), float(np.min(problem.t_b)))
    half = step / 2
    k = rng.randrange(8)
    s = rng.randrange(S)

    def bump(vec, lo, hi, delta):
        v = list(vec)
        v[s] = min(hi, max(lo, v[s] + delta))
        return tuple(v)

    d = rng.choice((-2, -1, 1, 2))
    if k <= 1:
        return replace(p, cap=bump(p.cap, 1, M, d))
    if k == 2:
        return replace(p, keep=bump(p.keep, 0, M, d))
    if k == 3:
        return replace(p, w_first=bump(p.w_first, 1, M, d * rng.choice((1, 4))))
    if k == 4:
        return replace(p, delay=bump(p.delay, 0.0, 4 * S * step, d * half))
    if k == 5:
        return replace(p, reload_ahead=max(0, min(M, p.reload_ahead + d)), reload_stages=max(0, min(S, p.reload_stages + rng.choice((-1, 1)))))
    if k == 6:
        return replace(p, margin=max(0.0, min(4.0 * M, p.margin + d * 0.5)))
    return replace(p, eager_w=not p.eager_w)


def _random_params(problem: ScheduleProblem, rng: random.Random) -> OffloadParams:
    S, M = problem.num_stages, problem.num_microbatches
    base = rng.choice((1, 2))
    return OffloadParams(
        cap=tuple(max(1, min(M, base * (S - s) - rng.randrange(0, 2) + rng.randrange(0, 3))) for s in range(S)),
        keep=tuple(rng.randrange(0, 3) for _ in range(S)),
        w_first=tuple(rng.choice((M, M, 2, 3, 4, 6)) for _ in range(S)),
        delay=tuple(0.0 for _ in range(S)),
        reload_ahead=rng.randrange(0, 4),
        reload_stages=rng.randrange(0, 4),
        margin=rng.choice((0.0, 1.0, 2.0, 4.0 * M)),
        eager_w=rng.random() < 0.7,
    )


def offload_search(
    problem: ScheduleProblem,
    *,
    time_limit_s: float = 2.0,
    seed: int = 0,
    max_evals: int | None = None,
    on_improve: Callable[[float, int], None] | None = None,
    progress: bool = False,
) -> Schedule:
    """The best schedule of :func:`offload_list_schedule` over a seeded parameter search.

    Random restarts (a third of the evaluations) and local moves around the best vector
    (one parameter changed at a time, ties accepted so the search drifts across plateaus),
    until ``time_limit_s`` or ``max_evals``. Every candidate is checked by the Contract-3
    validator; only valid schedules are kept.

    Parameters
    ----------
    problem : ScheduleProblem
        One stage per device.
    time_limit_s : float
        Wall-clock budget (s).
    seed : int
        Seed of the search (the result is deterministic for a given ``max_evals``).
    max_evals : int, optional
        Stop after this many schedules (default: only the time limit).
    on_improve : callable(value, evals), optional
        Called on every improvement.
    progress : bool
        A tqdm bar (stderr) with the evaluations and the best value so far.

    Ctrl-C (:class:`fxpipe.progress.Search`) stops the search at its next evaluation and
    returns the best schedule so far with ``meta["interrupted"]`` true (an enclosing search,
    e.g. :func:`fxpipe.schedule.milp.solve`, stops too); pressed before any valid schedule,
    the ``KeyboardInterrupt`` goes on to the caller.

    Returns
    -------
    Schedule
        ``method="offload-search"``, ``status="heuristic"``, ``meta`` with ``evals`` and the
        best parameters.

    Raises
    ------
    InputError
        If a device holds several stages.
    InfeasibleError
        If no evaluated policy produced a valid schedule (e.g. one stash does not fit).
    """
    require_one_stage_per_device(problem, "offload-search")
    t0 = time.perf_counter()
    rng = random.Random(seed)
    best = None  # (value, op columns, params) of the best valid schedule so far, replaced in one statement
    evals = 0
    with Search(f"offload-search {problem.name}", unit="schedule", progress=progress) as run:
        p0 = default_params(problem)
        v0, cols0 = _evaluate(problem, p0)
        evals = 1
        if cols0 is not None:
            best = (v0, cols0, p0)
        while (not run.stopped and time.perf_counter() - t0 < time_limit_s
               and (max_evals is None or evals < max_evals)):
            if best is None or rng.random() < 1 / 3:
                cand = _random_params(problem, rng)
            else:
                cand = _mutate(problem, best[2], rng)
                for _ in range(rng.randrange(0, 3)):
                    cand = _mutate(problem, cand, rng)
            best_v = math.inf if best is None else best[0]
            v, cols = _evaluate(problem, cand, best_v)
            evals += 1
            if cols is not None and v <= best_v + _EPS:
                best = (v, cols, cand)  # ties accepted: the search drifts across plateaus
                if v < best_v - _EPS and on_improve is not None:
                    on_improve(v, evals)
            run.update(1, best=f"{math.inf if best is None else best[0]:.6g}")
    if best is None:
        if run.interrupted:
            raise KeyboardInterrupt  # pressed before the search had a schedule to return
        raise InfeasibleError(
            f"offload-search: cannot fit mem_limit with any of the {evals} list-scheduling policies tried (each "
            "deadlocked or overflowed a stage); raise the limit, use more stages or the MILP")
    _, cols, best_p = best
    ops = tuple(_ops_of_columns(cols))  # in sort_ops' order
    remember_op_arrays(ops, cols)  # the callers' checks of these ops read the columns
    ms, span = objective_values(problem, ops)
    return Schedule(ops=ops, makespan=ms, stage_span=span, status="heuristic",
                    solver_time_s=time.perf_counter() - t0, method="offload-search", objective=problem.objective,
                    meta={"evals": evals, "interrupted": run.interrupted,
                          "params": {k: (list(v) if isinstance(v, tuple) else v) for k, v in best_p.__dict__.items()}})
