"""One local process launcher: N ranks on this machine joined by a gloo process group.

What ``torchrun --nproc-per-node N`` does for one machine, for fxpipe's own local runs:
training a plan (:func:`fxpipe.codegen.launch.spawn_train_many`, behind ``Plan.train_local``),
the torch.compile backend's local runs (:func:`fxpipe.dynamo.local.run_local`) and the link
profiler (:func:`fxpipe.cost.links.measure_p2p`). :func:`launch` spawns the ranks, waits for
them and returns what each rank's entry function returned.

Protocol (one folder per launch, ``out_dir``):

* Rendezvous: a file store, ``file://<out_dir>/rendezvous-<uuid>``, new for every launch; the
  address travels in the ranks' arguments, the environment (``MASTER_ADDR`` / ``MASTER_PORT``)
  is left alone. No port is chosen ahead: with a TCP store on a port that "was free a moment
  ago" (:func:`free_port`, the old way), two launches at once on one machine could pick the
  same port, and the ranks of one joined the other's store and both waited until the time-out
  (seen on 2026-11-26: a CI run's 4-rank test hung 600 s while a 2-rank test ran beside it).
  gloo's own connections between the ranks bind ephemeral ports, exchanged through the store.
* Each rank runs ``entry(ctx, *args)`` (:class:`RankContext`) after
  ``torch.distributed.init_process_group("gloo")``, with ``threads`` intra-op threads and,
  with ``cpus``, pinned to one core.
* Result: the entry's return value, JSON, written atomically to ``rank<r>.json``.
* Error: a rank that raises writes ``rank<r>.err`` (JSON, atomically): its rank, what it was
  doing (``ctx.where``: ``phase``, ``stages``, ``action``, ``run``), the exception's type,
  message and traceback, and the time. The parent turns the reports into one
  :class:`~fxpipe.errors.WorkerError` led by the first real failure (:func:`worker_error`),
  not by the lost connections of the ranks that waited for it.
* Time-outs: ``timeout_s`` limits the whole launch and ``collective_timeout_s`` every
  collective; ``poll`` (called about twice a second) may raise ``TimeoutError`` for finer
  limits. On expiry the ranks are terminated and ``TimeoutError`` names what the reports say.

Tensors are no results here: a caller that needs them writes its own files in ``out_dir``
(``torch.save`` of tensors, read back with ``weights_only=True``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fxpipe.errors import InputError, WorkerError
from fxpipe.io import write_json_atomic, write_text_atomic

__all__ = ["RankContext", "clear_reports", "errors_text", "free_port", "launch", "reports", "worker_error"]


@dataclass
class RankContext:
    """What a rank's entry function gets: its place in the group and a note of what it does.

    Attributes
    ----------
    rank, world_size : int
    out_dir : str
        The launch's folder (for files of the caller's own; results travel as return values).
    where : dict
        Updated by the entry with what it is doing, for its error report: ``phase`` (str),
        ``stages`` (list of int), ``action`` (str or None), ``run`` (int); other keys are kept
        in the report too.
    """

    rank: int
    world_size: int
    out_dir: str
    where: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, then release it).

    Another process may take the port before it is bound again: :func:`launch` no longer uses
    it (its rendezvous is a file); for callers that need a port (a ``torchrun`` command line).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.json")


def _rank_main(rank: int, spec: dict) -> None:
    """A spawned rank: join the group, run the entry, write its result or its error report."""
    world = spec["world_size"]
    if spec["threads"] is not None:
        torch.set_num_threads(spec["threads"])
    cpus = spec["cpus"]
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    ctx = RankContext(rank, world, spec["out_dir"], {"phase": "joining the process group", "stages": []})
    try:
        dist.init_process_group("gloo", init_method=spec["init_method"], rank=rank, world_size=world,
                                timeout=timedelta(seconds=spec["collective_timeout_s"]))
        result = spec["entry"](ctx, *spec["args"])
        ctx.where["phase"] = "writing its result"
        write_text_atomic(_result_path(spec["out_dir"], rank), json.dumps(result))
    except BaseException as exc:
        report = {"run": -1, "action": None, **ctx.where, "rank": rank, "type": type(exc).__name__,
                  "message": str(exc), "traceback": traceback.format_exc(), "time": time.time()}
        write_json_atomic(os.path.join(spec["out_dir"], f"rank{rank}.err"), report, indent=None)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(entry: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (), timeout_s: float | None = 300.0,
           collective_timeout_s: float | None = None, threads: int | None = 1, cpus: Sequence[int] = (),
           out_dir: str | None = None, poll: Callable[[], None] | None = None, what: str = "local") -> list[Any]:
    """Run ``entry(ctx, *args)`` on ``world_size`` local processes joined by a gloo group.

    Parameters
    ----------
    entry : picklable callable(RankContext, *args) -> JSON-able value
        A module-level function (each spawned process imports it by name).
    world_size : int
        Processes (ranks), >= 1.
    args : sequence
        Extra picklable arguments of ``entry``.
    timeout_s : float or None
        Wall-clock limit of the whole launch, seconds (None: no limit; then ``poll`` should
        set one).
    collective_timeout_s : float, optional
        Limit of every collective (default ``timeout_s``, or 300 s when that is None).
    threads : int or None
        Intra-op threads per rank (``torch.set_num_threads``); None keeps torch's default.
    cpus : sequence of int
        Pin rank ``r`` to core ``cpus[r % len(cpus)]`` (Linux); empty: no pinning.
    out_dir : str, optional
        The launch's folder (kept); default a temporary folder, removed afterwards.
    poll : callable() -> None, optional
        Called about every 0.5 s while the ranks run and once after they finished; it may
        raise (``TimeoutError`` for a per-phase limit), which stops the ranks.
    what : str
        What the ranks are, for messages: ``"<what> worker rank 1 (...) failed: ..."``,
        ``"<what> run with 2 ranks did not finish within ..."``.

    Returns
    -------
    list
        ``entry``'s return value on each rank, in rank order (as JSON gives it back: tuples
        become lists, dict keys strings).

    Raises
    ------
    InputError
        For a bad ``world_size``.
    WorkerError
        If a rank fails: the first real failure (rank, stages, action or phase, cause) and its
        traceback; a ``RuntimeError`` too.
    TimeoutError
        If the launch exceeds ``timeout_s`` (or ``poll`` raises it).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be an integer >= 1, got {world_size!r}")
    if out_dir is None:
        with tempfile.TemporaryDirectory(prefix="fxpipe-launch-") as tmp:
            return launch(entry, world_size, args=args, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s,
                          threads=threads, cpus=cpus, out_dir=tmp, poll=poll, what=what)
    spec = dict(entry=entry, args=tuple(args), world_size=world_size, out_dir=out_dir, threads=threads,
                cpus=tuple(cpus), collective_timeout_s=float(collective_timeout_s or timeout_s or 300.0))
    spec["init_method"] = "file://" + os.path.join(os.path.abspath(out_dir), f"rendezvous-{uuid.uuid4().hex}")
    _spawn_and_wait(spec, timeout_s, poll, what)
    results = []
    for r in range(world_size):
        with open(_result_path(out_dir, r), encoding="utf-8") as fh:
            results.append(json.load(fh))
    return results


def _spawn_and_wait(spec: dict, timeout_s: float | None, poll: Callable[[], None] | None, what: str) -> None:
    """Start the ranks and wait for them; raise on failure or time-out."""
    out_dir, world = spec["out_dir"], spec["world_size"]
    start = time.monotonic()
    ctx = mp.start_processes(_rank_main, args=(spec,), nprocs=world, join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=0.5):
            if poll is not None:
                poll()
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{what} run with {world} ranks did not finish within {timeout_s:.0f} s"
                                   + errors_text(out_dir))
        if poll is not None:
            poll()
    except mp.ProcessRaisedException as exc:
        raise worker_error(out_dir, exc.error_index, str(exc), what) from None
    except mp.ProcessExitedException as exc:
        raise worker_error(out_dir, exc.error_index, f"the process exited abnormally: {exc}", what) from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)


def clear_reports(out_dir: str) -> None:
    """Remove the ranks' error reports (before a new attempt)."""
    for name in os.listdir(out_dir):
        if name.endswith(".err"):
            os.remove(os.path.join(out_dir, name))


def reports(out_dir: str) -> list[dict]:
    """The ranks' error reports (``rank<r>.err``), by rank."""
    out = []
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".err"):
            try:
                with open(os.path.join(out_dir, name), encoding="utf-8") as f:
                    out.append(json.load(f))
            except (OSError, ValueError):  # a report being written as the rank was stopped
                continue
    return sorted(out, key=lambda r: r.get("rank", 0))


def errors_text(out_dir: str) -> str:
    """Every rank's error report, its traceback included (for time-outs and retries)."""
    return "".join(f"\n--- rank {r['rank']} ---\n{r['traceback']}" for r in reports(out_dir))


#: Errors that follow another rank's failure (its process closed the connection).
_SECONDARY = re.compile(r"connection closed by peer|connection reset by peer|broken pipe|econnreset|"
                        r"socket closed|read error|enotconn|epipe", re.I)


def _secondary(report: Mapping[str, Any]) -> bool:
    return bool(_SECONDARY.search(f"{report.get('type', '')}: {report.get('message', '')}"))


def _describe(report: Mapping[str, Any]) -> tuple[str, tuple[int, ...]]:
    """``"rank 1 (stage 3, action 3F0 of training step 0, run 0)"`` and the stages (the action's first)."""
    stages = tuple(int(s) for s in report.get("stages") or ())
    action = report.get("action")
    m = re.match(r"\s*(\d+)", str(action or ""))
    if m:
        stages = (int(m.group(1)),) + tuple(s for s in stages if s != int(m.group(1)))
    parts = []
    if stages:
        parts.append(("stage " if action or len(stages) == 1 else "stages ")
                     + (str(stages[0]) if action else ", ".join(map(str, stages))))
    what = f"action {action} of {report.get('phase')}" if action else str(report.get("phase") or "starting")
    parts.append(what)
    if int(report.get("run", -1)) >= 0:
        parts.append(f"run {report['run']}")
    return f"rank {report.get('rank')} ({', '.join(parts)})", stages


def worker_error(out_dir: str, failed_rank: int | None, fallback: str, what: str = "local") -> WorkerError:
    """The first real rank failure as a :class:`~fxpipe.errors.WorkerError`.

    Among the ranks' reports, a failure that is not a lost connection to a failed peer wins,
    the earliest first; the other ranks' causes follow in one line each. A failed rank that
    left no report (killed by a signal, out of memory) is the first failure, with ``fallback``
    as its cause.
    """
    reps = reports(out_dir)
    if all(_secondary(r) and r.get("rank") != failed_rank for r in reps):
        lost = f"; ranks {', '.join(str(r['rank']) for r in reps)} lost their connection to it" if reps else ""
        return WorkerError(f"{what} worker rank {failed_rank} failed: {fallback}{lost}", rank=failed_rank,
                           cause=fallback)
    primary = min(reps, key=lambda r: (_secondary(r), r.get("time", 0.0)))
    where, stages = _describe(primary)
    cause = f"{primary['type']}: {primary['message']}".strip()
    lines = [f"{what} worker {where} failed: {cause}"]
    others = [r for r in reps if r is not primary]
    if others:
        lines.append("other ranks: " + "; ".join(
            f"rank {r['rank']} " + ("lost its connection to the failed rank" if _secondary(r) else
                                    f"failed too ({r['type']}: {str(r['message']).splitlines()[0][:200] if r['message'] else ''})")
            for r in others))
    summary = "\n".join(lines)
    lines.append(f"--- traceback of rank {primary['rank']} ---\n{primary['traceback'].rstrip()}")
    return WorkerError("\n".join(lines), rank=primary.get("rank"), stages=stages, action=primary.get("action"),
                       phase=primary.get("phase"), cause_type=primary.get("type"), cause=primary.get("message"),
                       summary=summary)
