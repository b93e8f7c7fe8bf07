"""Plan the mesh search's next candidates in parallel processes while it waits on the current one (torch-free).

:func:`fxpipe.mesh.search.search_mesh` plans its candidates one after another, in the order of their
lower bounds, and prunes a candidate whose bound is no better than the best predicted step found
before it. :class:`PlanPrefetch` keeps the next candidates the search will plan unless pruned
(those that pass every check it can make now: their bound below the best so far, runnable, their
static state within the memory) planning in worker processes, so that a candidate's plan is often
ready when the search reaches it. The search's result does not depend on it: a prefetched plan is
taken only when it was made from exactly the arguments the search would plan it with then (the
same partition handed over, the same memory); otherwise, and for candidates pruned meanwhile, it
is dropped. Planning is deterministic, so a plan made in a worker equals the one the search would
have made itself.

Workers are forked (the planner imports no torch; the parent's caches come along) and only used
for large graphs; ``FXPIPE_SEARCH_WORKERS`` (default: 2 where there are four cores or more; 1 turns
it off) sets how many. Not on two cores: there the main process and two workers share them, and since the
search prunes most candidates after partitioning (:func:`fxpipe.planner.plan_with_options` ``beat_s``) a
worker's plan made ahead is mostly work the search would have pruned; Llama-3-70B on 64 devices planned
in 35.6 s one candidate after another against 60.2 s with two workers (2026-11-29, 2 cores, load 3-4).
Nothing is prefetched before the search has a best step: until then a plan made ahead could not be pruned.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Callable

__all__ = ["PlanPrefetch", "search_workers", "MIN_PREFETCH_NODES"]

#: Graphs with fewer nodes plan their candidates in a fraction of a second: no worker processes.
MIN_PREFETCH_NODES = 1000


def search_workers(graph) -> int:
    """Worker processes for a search over ``graph``: ``FXPIPE_SEARCH_WORKERS`` if set, else 2 on a machine of
    four cores or more, 1 (none) on fewer, without ``fork`` or for graphs under :data:`MIN_PREFETCH_NODES`."""
    env = os.environ.get("FXPIPE_SEARCH_WORKERS")
    if env is not None:
        try:
            return max(1, int(env))
        except ValueError:
            return 1
    if graph.n < MIN_PREFETCH_NODES or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return 2 if (os.cpu_count() or 1) >= 4 else 1


def _plan(kwargs: dict) -> Any:
    """A worker's job: :func:`fxpipe.planner.plan_with_options` of ``kwargs``, or the error it raised."""
    from fxpipe.errors import FxpipeError, InputError  # noqa: PLC0415
    from fxpipe.planner import plan_with_options  # noqa: PLC0415

    try:
        return plan_with_options(**kwargs)
    except (FxpipeError, InputError) as exc:
        return exc


def _beats_compatible(made: float | None, now: float | None) -> bool:
    """Whether a job made with the best-so-far ``made`` (:func:`~fxpipe.planner.plan_with_options`'s ``beat_s``)
    may answer for ``now``: the best only improves, so ``now`` is no looser (see :func:`_pruned_still`)."""
    return made is None or (now is not None and now <= made)


def _pruned_still(result: Any, made: float | None, now: float | None) -> tuple[bool, Any]:
    """``(True, result)`` when the planner would return ``result`` under ``now`` too: a
    :class:`~fxpipe.planner.CandidatePruned` whose bound still prunes, or a plan (or another error) made with that
    same target (one made with a looser target might be pruned now, and the table would differ); else
    ``(False, None)``."""
    from fxpipe.planner import CandidatePruned  # noqa: PLC0415

    if isinstance(result, CandidatePruned) and result.while_scheduling:  # nothing found that may beat ``made``
        return (True, result) if now is not None and made is not None and now <= made else (False, None)
    if isinstance(result, CandidatePruned):
        return (True, result) if now is not None and result.lower_bound_s >= now else (False, None)
    return (True, result) if made == now else (False, None)


def _same_partitions(a: dict | None, b: dict | None) -> bool:
    a, b = a or {}, b or {}
    return set(a) == set(b) and all((a[k].assignment == b[k].assignment).all() for k in a)


class PlanPrefetch:
    """Candidates' plans made ahead in worker processes (module docstring).

    Parameters
    ----------
    workers : int
        Worker processes (>= 2; with fewer nothing is prefetched).
    """

    def __init__(self, workers: int):
        self.workers = int(workers)
        self.pool: ProcessPoolExecutor | None = None
        self.jobs: dict[tuple, tuple[Future, dict]] = {}

    @property
    def on(self) -> bool:
        return self.workers >= 2

    def submit(self, key: tuple, kwargs: dict) -> None:
        """Start planning ``key`` with :func:`~fxpipe.planner.plan_with_options` ``kwargs`` (once per key)."""
        if not self.on or key in self.jobs:
            return
        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"))
        self.jobs[key] = (self.pool.submit(_plan, dict(kwargs)), dict(kwargs))

    def busy(self) -> int:
        """Jobs not finished yet."""
        return sum(1 for f, _ in self.jobs.values() if not f.done())

    def take(self, key: tuple, kwargs: dict) -> tuple[bool, Any]:
        """``(True, result or error)`` of ``key`` when it was prefetched with these same ``kwargs`` (waiting for
        it), else ``(False, None)``; the job is forgotten either way."""
        job = self.jobs.pop(key, None)
        if job is None:
            return False, None
        future, made = job
        same = (set(made) == set(kwargs) and made["graph"] is kwargs["graph"]
                and all(made[k] == kwargs[k] for k in kwargs if k not in ("partitions", "graph", "beat_s")))
        if not same or not _beats_compatible(made.get("beat_s"), kwargs.get("beat_s")):
            future.cancel()
            return False, None
        if _same_partitions(made.get("partitions"), kwargs.get("partitions")):
            return _pruned_still(future.result(), made.get("beat_s"), kwargs.get("beat_s"))
        # handed a partition now (a sibling's, proven optimal) but not then: the plan is this one's when the
        # worker's own search found that very partition
        result = future.result()
        want = kwargs.get("partitions") or {}
        if not made.get("partitions") and not isinstance(result, Exception) and len(want) == 1 and \
                made.get("beat_s") == kwargs.get("beat_s"):
            (k, part), = want.items()
            if result[0].k == k and (result[0].assignment == part.assignment).all():
                return True, result
        return False, None



    def ahead(self, candidates: list, plan_args: Callable[[Any], tuple | None]) -> None:
        """Prefetch the first of ``candidates`` (in the search's order) that ``plan_args`` gives a ``(key,
        kwargs)`` for (None: it would be pruned, skipped, is planned already or reuses a plan), up to
        ``workers`` jobs at a time."""
        if not self.on:
            return
        for cand in candidates:
            if self.busy() >= self.workers:
                return
            got = plan_args(cand)
            if got is not None:
                self.submit(*got)

    def __enter__(self) -> "PlanPrefetch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (jobs not started are cancelled)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
        self.jobs.clear()
