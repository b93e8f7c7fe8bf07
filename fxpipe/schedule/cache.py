"""A disk cache of solved schedules keyed by a discretised problem signature (OptPipe 4.2).

Profiled times and memory sizes change a little from run to run. OptPipe Section 4.2
("cached schedule strategy") discretises the parameters into proportional values so that
nearby problems share one cached "crude" schedule, which then warm-starts the solver.

Here the signature of a problem keeps its shape (stages, micro-batches, objective, pcie
groups, the placement of stages on devices) exactly and, per stage, rounds

* every time (F, B, W, comm, offload) as ``round(log(t / t_max) / log(1 + grid))``, i.e. on a
  geometric grid of relative step ``grid`` (default 3%) relative to the largest time;
* every memory size relative to its device's limit (``mem_f / limit``), the split of the
  stash between B and W (``mem_b / mem_f``) and the offloadable fraction
  (``offload_bytes / mem_f``) on a linear grid of step ``grid``.

A hit is never trusted blindly: the cached per-device op orders
(:func:`fxpipe.ir.schedule_to_orders`) and offload decisions are replayed through
:func:`fxpipe.schedule.simulate.simulate` with the *new* durations and the
result is checked with :func:`fxpipe.schedule.validate.check_schedule`; an invalid replay is
a miss. Entries are JSON (``fxpipe.schedcache/1``: signature, the problem
(``fxpipe.schedproblem/1``) and the schedule (``fxpipe.schedule/1``)), written atomically.

References
----------
OptPipe (``shared/papers/optpipe-milp-pipeline-scheduling.txt``), Section 4.2.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import Schedule, ScheduleProblem, read_json, write_json_atomic
from fxpipe.ir import schedule_to_orders
from fxpipe.schedule.bounds import combinatorial_lower_bound
import fxpipe.schedule.milp as milp
from fxpipe.schedule.simulate import simulate
from fxpipe.schedule.validate import check_schedule

__all__ = ["CACHE_FORMAT", "ScheduleCache", "solve_cached"]

CACHE_FORMAT = "fxpipe.schedcache/1"


def _log_bin(t: float, t_max: float, grid: float) -> int | str:
    if t <= t_max * 1e-6 or t <= 0:
        return "0"
    return int(round(math.log(t / t_max) / math.log1p(grid)))


def _lin_bin(x: float, grid: float) -> int:
    return int(round(x / grid))


class ScheduleCache:
    """Schedules on disk, one JSON file per problem signature (OptPipe Section 4.2).

    Parameters
    ----------
    root : str or PathLike
        Folder holding the entries (created on first :meth:`put`).
    grid : float
        Relative discretisation step of times and memory, in (0, 0.5]; default 0.03.

    Raises
    ------
    InputError
        If ``grid`` is out of range.

    Examples
    --------
    >>> cache = ScheduleCache("/tmp/fxpipe-schedules")              # doctest: +SKIP
    >>> sched = solve_cached(problem, cache, time_limit_s=30)        # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike, *, grid: float = 0.03):
        if not (isinstance(grid, (int, float)) and 0 < grid <= 0.5):
            raise InputError(f"grid must lie in (0, 0.5], got {grid!r}")
        self.root = Path(root)
        self.grid = float(grid)

    # ------------------------------------------------------------------ signature
    def signature(self, problem: ScheduleProblem) -> dict[str, Any]:
        """The discretised, scale-free description of ``problem`` (a JSON-able dict).

        Two problems whose times differ by well under ``grid`` relative (and memory by well
        under ``grid`` of the limit) get the same signature, unless a value sits right on a
        bin boundary.
        """
        if not isinstance(problem, ScheduleProblem):
            raise InputError(f"expected a ScheduleProblem, got {type(problem).__name__}")
        g = self.grid
        times = np.concatenate([problem.t_f, problem.t_b, problem.t_w, problem.t_comm, problem.t_offload])
        t_max = float(np.max(times)) if times.size and np.max(times) > 0 else 1.0
        stages = []
        for s in range(problem.num_stages):
            lim = problem.device_mem_limit(s)
            mf = float(problem.mem_f[s])
            entry: dict[str, Any] = {
                "t": [_log_bin(float(x), t_max, g) for x in (problem.t_f[s], problem.t_b[s], problem.t_w[s], problem.t_offload[s])],
                "comm": _log_bin(float(problem.t_comm[s]), t_max, g) if s < problem.num_stages - 1 else None,
                "mem_b": _lin_bin(float(problem.mem_b[s]) / mf, g),
                "offload": _lin_bin(float(problem.offload_bytes[s]) / mf, g),
                "mem": "inf" if not math.isfinite(lim) else _lin_bin(mf / lim, g),
            }
            stages.append(entry)
        return {
            "stages": problem.num_stages,
            "microbatches": problem.num_microbatches,
            "device_of_stage": list(problem.device_of_stage),
            "objective": problem.objective,
            "pcie_groups": [sorted(grp) for grp in problem.pcie_groups],
            "grid": g,
            "per_stage": stages,
        }

    @staticmethod
    def _hash(obj: Any, n: int) -> str:
        txt = json.dumps(obj, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(txt.encode()).hexdigest()[:n]

    def key(self, problem: ScheduleProblem) -> str:
        """File name stem of ``problem``'s entry: ``<shape hash>-<signature hash>``."""
        sig = self.signature(problem)
        shape = {k: v for k, v in sig.items() if k != "per_stage"}
        return f"{self._hash(shape, 12)}-{self._hash(sig, 20)}"

    @staticmethod
    def distance(sig_a: dict, sig_b: dict) -> float:
        """Largest bin difference between two signatures of one shape (inf if shapes differ).

        0 means the same entry; 1 means every parameter is in the same or a neighbouring bin
        (what profiling noise next to a bin boundary produces).
        """
        if {k: v for k, v in sig_a.items() if k != "per_stage"} != {k: v for k, v in sig_b.items() if k != "per_stage"}:
            return math.inf
        worst = 0.0
        for a, b in zip(sig_a["per_stage"], sig_b["per_stage"]):
            for key in a:
                va, vb = a[key], b.get(key)
                for x, y in zip(va if isinstance(va, list) else [va], vb if isinstance(vb, list) else [vb]):
                    if isinstance(x, int) and isinstance(y, int):
                        worst = max(worst, abs(x - y))
                    elif x != y:
                        return math.inf
        return worst

    def path(self, problem: ScheduleProblem) -> Path:
        """Where ``problem``'s entry lives."""
        return self.root / f"{self.key(problem)}.json"

    # ------------------------------------------------------------------ access
    def _load(self, path: Path) -> dict | None:
        if not path.exists():
            return None
        try:
            doc = read_json(path, "schedule cache entry")
        except Exception:  # noqa: BLE001 - a broken entry is a miss, never a crash
            return None
        if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT:
            return None
        return doc

    def get(self, problem: ScheduleProblem, *, max_distance: int = 1) -> Schedule | None:
        """A valid schedule for ``problem`` re-timed from the cached entry, or None.

        The entry with ``problem``'s signature is used; failing that, the most similar entry
        of the same shape whose every bin is within ``max_distance`` of ``problem``'s
        (:meth:`distance`), so noise that crosses a bin boundary still hits.

        The cached per-device compute orders and offload set are replayed with
        ``problem``'s durations (:func:`fxpipe.schedule.simulate.simulate`), then validated
        (:func:`fxpipe.schedule.validate.check_schedule`). An invalid replay, an unreadable
        entry or a signature collision with another shape is a miss.

        Returns
        -------
        Schedule or None
            ``method="cache"``, ``status="cached"``; ``meta`` names the entry and the method
            that originally produced it.
        """
        sig = self.signature(problem)
        path = self.path(problem)
        doc = self._load(path)
        if doc is None or doc.get("signature") != sig:
            # the most similar entry of the same shape within one bin (OptPipe 4.2)
            doc, best_d = None, math.inf
            prefix = path.stem.split("-")[0]
            for cand in sorted(self.root.glob(f"{prefix}-*.json")) if self.root.exists() else []:
                cdoc = self._load(cand)
                if cdoc is None or not isinstance(cdoc.get("signature"), dict):
                    continue
                try:
                    d = self.distance(sig, cdoc["signature"])
                except Exception:  # noqa: BLE001
                    continue
                if d <= max_distance and d < best_d:
                    doc, best_d, path = cdoc, d, cand
            if doc is None:
                return None
        try:
            cached = Schedule.from_dict(doc["schedule"], source=str(path))
            orders = schedule_to_orders(cached, problem).compute_only()
            offload = sorted({(o.stage, o.microbatch) for o in cached.ops if o.type == "O"})
        except Exception:  # noqa: BLE001
            return None
        best = None
        for respect in (False, True):
            try:
                sched = simulate(problem, orders, offload=offload, method="cache", respect_memory=respect)
            except Exception:  # noqa: BLE001
                continue
            if check_schedule(problem, sched.ops):
                continue
            if best is None or sched.value < best.value:
                best = sched
        if best is None:
            return None
        exact = doc.get("problem") == problem.to_dict()
        if exact and not check_schedule(problem, cached.ops) and cached.value <= best.value:
            best = cached  # same problem: the stored timing itself is valid and no worse
        return Schedule(
            ops=best.ops, makespan=best.makespan, stage_span=best.stage_span,
            lower_bound_s=float(doc.get("lower_bound_s", 0.0)) if exact else 0.0,
            status=str(doc["schedule"].get("status", "cached")) if exact else "cached",
            solver_time_s=0.0, method="cache", objective=problem.objective,
            meta={"cache_key": path.stem, "cache_path": str(path), "cached_method": cached.method,
                  "cached_value_s": cached.value, "exact_problem": exact},
        )

    def put(self, problem: ScheduleProblem, schedule: Schedule) -> Path:
        """Store ``schedule`` (validated first) under ``problem``'s signature, atomically.

        An existing entry is kept when its schedule, relative to its own problem's lower
        bound, is better than the new one.

        Raises
        ------
        InputError
            If ``schedule`` does not solve ``problem`` (the violations are listed).
        """
        if not isinstance(schedule, Schedule):
            raise InputError(f"expected a Schedule, got {type(schedule).__name__}")
        errs = check_schedule(problem, schedule.ops)
        if errs:
            raise InputError("refusing to cache an invalid schedule: " + "; ".join(errs[:3]))
        lb = max(float(combinatorial_lower_bound(problem)), float(schedule.lower_bound_s or 0.0))
        ratio = schedule.value / lb if lb > 0 else 1.0
        path = self.path(problem)
        old = self._load(path)
        if old is not None and old.get("signature") == self.signature(problem):
            if float(old.get("value_over_bound", math.inf)) < ratio * (1 - 1e-9):
                return path
        doc = {
            "format": CACHE_FORMAT,
            "signature": self.signature(problem),
            "value_over_bound": ratio,
            "lower_bound_s": float(schedule.lower_bound_s or 0.0),
            "problem": problem.to_dict(),
            "schedule": schedule.to_dict(),
        }
        return write_json_atomic(path, doc)


def solve_cached(problem: ScheduleProblem, cache: ScheduleCache, *, reuse_optimal: bool = True, **kw) -> Schedule:
    """Solve with the MILP, warm-started from a cache hit, and store the result.

    Parameters
    ----------
    problem : ScheduleProblem
    cache : ScheduleCache
    reuse_optimal : bool
        If the entry was solved to optimality for exactly this problem, return it without
        solving.
    **kw
        Passed to :func:`fxpipe.schedule.milp.solve` (``time_limit_s``, ``on_incumbent``...).

    Returns
    -------
    Schedule
        ``meta["cache"]`` is ``"hit"`` or ``"miss"``.

    References
    ----------
    OptPipe Section 4.2.
    """
    if not isinstance(cache, ScheduleCache):
        raise InputError(f"cache must be a ScheduleCache, got {type(cache).__name__}")
    hit = cache.get(problem)
    if hit is not None and reuse_optimal and hit.meta.get("exact_problem") and hit.status == "optimal":
        return Schedule(ops=hit.ops, makespan=hit.makespan, stage_span=hit.stage_span, lower_bound_s=hit.lower_bound_s,
                        status="optimal", solver_time_s=0.0, method="milp", objective=problem.objective,
                        meta={**hit.meta, "cache": "hit"})
    warm = kw.pop("warm_start", None)
    if warm is None:
        warm = milp.warm_start_schedule(problem)
    if hit is not None and hit.value < warm.value:
        warm = hit
    result = milp.solve(problem, warm_start=warm, **kw)
    meta = {**result.meta, "cache": "hit" if hit is not None else "miss"}
    if hit is not None:
        meta["cache_hit_value_s"] = hit.value
    result = Schedule(ops=result.ops, makespan=result.makespan, stage_span=result.stage_span,
                      lower_bound_s=result.lower_bound_s, status=result.status, solver_time_s=result.solver_time_s,
                      method=result.method, objective=result.objective, meta=meta)
    cache.put(problem, result)
    return result
