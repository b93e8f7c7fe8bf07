"""Run a function on N local processes joined by a gloo process group (what ``torchrun`` does).

:func:`run_local` is for trying the backend's pipelined execution on one machine (tests,
``benchmarks/bench_backend.py``, a quick check before a real ``torchrun``): every process calls
``fn(rank, world_size, *args)`` after ``torch.distributed.init_process_group("gloo")``, exactly
as each worker of ``torchrun --nproc-per-node N script.py`` runs the script. The processes are
started by the one local launcher (:func:`fxpipe.launcher.launch`); return values travel back as
JSON.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from fxpipe.launcher import RankContext, launch

__all__ = ["run_local"]


def _call(ctx: RankContext, fn: Callable, args: tuple) -> Any:
    """A rank of :func:`run_local`: ``fn(rank, world_size, *args)``."""
    ctx.where["phase"] = f"running {getattr(fn, '__qualname__', fn)!s}"
    return fn(ctx.rank, ctx.world_size, *args)


def run_local(fn: Callable, world_size: int, *, args: Sequence[Any] = (), timeout_s: float = 300.0,
              threads: int | None = 1) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` local gloo processes.

    Parameters
    ----------
    fn : picklable callable(rank, world_size, *args) -> JSON-able value
        A module-level function (it is imported by name in every process).
    world_size : int
        Processes, >= 1.
    args : sequence
        Extra picklable arguments.
    timeout_s : float
        Wall-clock limit of the whole run and of every collective; the processes are
        terminated on expiry.
    threads : int or None
        Intra-op threads per process (``torch.set_num_threads``); None keeps torch's default.

    Returns
    -------
    list
        ``fn``'s return value on each rank, in rank order.

    Raises
    ------
    InputError
        For a bad world size.
    WorkerError
        If a process fails (:class:`fxpipe.errors.WorkerError`, a ``RuntimeError``): the first
        real failure (rank, cause) and its traceback.
    TimeoutError
        If the run exceeds ``timeout_s``.
    """
    return launch(_call, world_size, args=(fn, tuple(args)), timeout_s=timeout_s, threads=threads, what="local")
