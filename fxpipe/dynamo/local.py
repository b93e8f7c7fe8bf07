"""Run a function on N local processes joined by a gloo process group (what ``torchrun`` does).

:func:`run_local` is for trying the backend's pipelined execution on one machine (tests,
``benchmarks/bench_backend.py``, a quick check before a real ``torchrun``): every process calls
``fn(rank, world_size, *args)`` after ``torch.distributed.init_process_group("gloo")``, exactly
as each worker of ``torchrun --nproc-per-node N script.py`` runs the script. Return values travel
back as JSON.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

from fxpipe.errors import InputError

__all__ = ["run_local"]


def _entry(rank: int, world: int, init_method: str, fn: Callable, args: tuple, out_dir: str, threads: int | None,
           timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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
    RuntimeError
        If a process fails (with its traceback).
    TimeoutError
        If the run exceeds ``timeout_s``.
    """
    import torch.multiprocessing as mp

    from fxpipe.codegen.launch import free_port

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be an integer >= 1, got {world_size!r}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fxpipe-local-") as out_dir:
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [ctx.Process(target=_entry, args=(r, world_size, init, fn, tuple(args), out_dir, threads, timeout_s),
                             daemon=False) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.is_alive() for p in procs):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run_local: {world_size} processes did not finish within {timeout_s:.0f} s")
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=1.0 if any(q.exitcode not in (None, 0) for q in procs) else 5.0)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5.0)
        errors = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.err")
            if os.path.exists(path):
                with open(path) as f:
                    errors.append(f"rank {r}:\n{f.read()}")
        if errors or any(p.exitcode != 0 for p in procs):
            raise RuntimeError("a local rank failed:\n" + ("\n".join(errors) or
                                                           f"exit codes {[p.exitcode for p in procs]}"))
        out = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out
