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
* Heartbeat: every change of ``ctx.where`` is written at once to ``rank<r>.beat`` (JSON, one
  ``pwrite`` of a fixed file, no fsync: cheap enough for every schedule action) with the time
  of that change, the rank's last progress. The pipeline runtime reports each compute action
  as it starts and ends (``running``, ``last_action``). The parent reads the heartbeats to say
  which rank is late and what it is doing, also for a rank killed without a report.
* Time-outs: ``timeout_s`` limits the whole launch, ``action_timeout_s`` the time a rank may
  spend inside one schedule action (a stuck rank fails fast, start-up and capture not
  counted) and ``collective_timeout_s`` every collective; ``poll`` (called about twice a
  second) may raise ``TimeoutError`` for finer limits. On expiry the ranks are terminated and
  a :class:`~fxpipe.errors.WorkerTimeoutError` (a ``TimeoutError``) names the late rank, its
  stage, action and phase and how long it made no progress, then what the other ranks were doing.

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

from fxpipe.codegen.faults import cause_fields, describe_action, parse_action
from fxpipe.errors import InputError, WorkerError, WorkerTimeoutError
from fxpipe.io import write_json_atomic, write_text_atomic

__all__ = ["RankContext", "clear_reports", "errors_text", "free_port", "heartbeats", "launch", "reports",
           "timeout_error", "worker_error"]


@dataclass
class RankContext:
    """What a rank's entry function gets: its place in the group and a note of what it does.

    Attributes
    ----------
    rank, world_size : int
    out_dir : str
        The launch's folder (for files of the caller's own; results travel as return values).
    where : dict
        Updated by the entry with what it is doing, for its error report and its heartbeat:
        ``phase`` (str), ``stages`` (list of int), ``action`` (str or None: the action that
        failed), ``running`` (the schedule action in progress, torch's text ``"1F0"``, or
        None), ``last_action``, ``run`` (int); other keys are kept too. In a launched rank every
        item assignment and ``update`` is also written to the rank's heartbeat file with its time.
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


def _beat_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.beat")


class _Heartbeat(dict):
    """A rank's ``ctx.where`` that writes itself, with the time of the change, to ``rank<r>.beat``.

    Item assignment and ``update`` write; the file is rewritten in place (``os.pwrite`` at
    offset 0, padded with spaces to its longest content), so a reader sees the last state or,
    rarely, a torn one it skips. ``since`` is the wall-clock time (``time.time()``) of the change.
    """

    def __init__(self, path: str, rank: int, initial: dict):
        super().__init__(initial)
        self._rank = rank
        self._size = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._write()

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._write()

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._write()

    def _write(self) -> None:
        data = json.dumps({**self, "rank": self._rank, "pid": os.getpid(), "since": time.time()},
                          default=str).encode()
        try:
            os.pwrite(self._fd, data + b" " * max(0, self._size - len(data)), 0)
        except OSError:  # a full disk must not fail the training; the heartbeat is a diagnosis aid
            return
        self._size = max(self._size, len(data))

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


def heartbeats(out_dir: str) -> dict[int, dict]:
    """The ranks' last heartbeats (``rank<r>.beat``: their ``ctx.where``, ``pid`` and ``since``), by rank.

    A heartbeat being rewritten as it is read (rare) is left out of that reading.
    """
    out: dict[int, dict] = {}
    try:
        names = os.listdir(out_dir)
    except OSError:
        return out
    for name in names:
        m = re.fullmatch(r"rank(\d+)\.beat", name)
        if not m:
            continue
        try:
            with open(os.path.join(out_dir, name), encoding="utf-8") as f:
                out[int(m.group(1))] = json.loads(f.read())
        except (OSError, ValueError):
            continue
    return out


def _rank_main(rank: int, spec: dict) -> None:
    """A spawned rank: join the group, run the entry, write its result or its error report."""
    world = spec["world_size"]
    if spec["threads"] is not None:
        torch.set_num_threads(spec["threads"])
    cpus = spec["cpus"]
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    where = _Heartbeat(_beat_path(spec["out_dir"], rank), rank, {"phase": "joining the process group", "stages": []})
    ctx = RankContext(rank, world, spec["out_dir"], where)
    try:
        dist.init_process_group("gloo", init_method=spec["init_method"], rank=rank, world_size=world,
                                timeout=timedelta(seconds=spec["collective_timeout_s"]))
        result = spec["entry"](ctx, *spec["args"])
        ctx.where.update(phase="writing its result", running=None)
        write_text_atomic(_result_path(spec["out_dir"], rank), json.dumps(result))
        ctx.where["phase"] = "done"
    except BaseException as exc:
        # the root cause (the user's exception under torch's "failed to run forward") and its frame
        report = {"run": -1, "action": None, **ctx.where, "rank": rank, **cause_fields(exc),
                  "traceback": traceback.format_exc(), "time": time.time()}
        report["action"] = report["action"] or getattr(exc, "action", None) or ctx.where.get("running")
        write_json_atomic(os.path.join(spec["out_dir"], f"rank{rank}.err"), report, indent=None)
        raise
    finally:
        where.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(entry: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (), timeout_s: float | None = 300.0,
           collective_timeout_s: float | None = None, threads: int | None = 1, cpus: Sequence[int] = (),
           out_dir: str | None = None, poll: Callable[[], None] | None = None, what: str = "local",
           action_timeout_s: float | None = None) -> list[Any]:
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
    action_timeout_s : float, optional
        Longest time a rank may stay inside one schedule action (``ctx.where["running"]`` set,
        as the pipeline runtime does for every forward, backward and weight-gradient action),
        seconds; a rank over it is stuck and the launch stops (None: no limit). Start-up,
        capture and the phases between actions are not counted.

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
    WorkerTimeoutError
        If the launch exceeds ``timeout_s`` or a rank ``action_timeout_s`` (or ``poll`` raises a
        ``TimeoutError``): a ``TimeoutError`` naming the late rank and what it was doing.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be an integer >= 1, got {world_size!r}")
    for name, val in (("timeout_s", timeout_s), ("action_timeout_s", action_timeout_s)):
        if val is not None and not (isinstance(val, (int, float)) and not isinstance(val, bool) and val > 0):
            raise InputError(f"{name} must be a positive number of seconds or None, got {val!r}")
    if out_dir is None:
        with tempfile.TemporaryDirectory(prefix="fxpipe-launch-") as tmp:
            return launch(entry, world_size, args=args, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s,
                          threads=threads, cpus=cpus, out_dir=tmp, poll=poll, what=what,
                          action_timeout_s=action_timeout_s)
    spec = dict(entry=entry, args=tuple(args), world_size=world_size, out_dir=out_dir, threads=threads,
                cpus=tuple(cpus), collective_timeout_s=float(collective_timeout_s or timeout_s or 300.0))
    spec["init_method"] = "file://" + os.path.join(os.path.abspath(out_dir), f"rendezvous-{uuid.uuid4().hex}")
    _spawn_and_wait(spec, timeout_s, poll, what, action_timeout_s)
    results = []
    for r in range(world_size):
        with open(_result_path(out_dir, r), encoding="utf-8") as fh:
            results.append(json.load(fh))
    return results


def _spawn_and_wait(spec: dict, timeout_s: float | None, poll: Callable[[], None] | None, what: str,
                    action_timeout_s: float | None = None) -> None:
    """Start the ranks and wait for them; raise on failure or time-out."""
    out_dir, world = spec["out_dir"], spec["world_size"]
    start = time.monotonic()
    ctx = mp.start_processes(_rank_main, args=(spec,), nprocs=world, join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=0.5):
            if poll is not None:
                try:
                    poll()
                except WorkerTimeoutError:
                    raise
                except TimeoutError as exc:  # a caller's finer limit: name the late rank too
                    raise timeout_error(out_dir, world, str(exc).split("\n", 1)[0], what) from None
            if action_timeout_s is not None:
                _check_actions(out_dir, world, action_timeout_s, what)
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise timeout_error(out_dir, world, f"{what} run with {world} ranks did not finish within {timeout_s:.0f} s",
                                    what)
        if poll is not None:
            poll()
    except mp.ProcessRaisedException as exc:
        raise worker_error(out_dir, exc.error_index, str(exc), what) from None
    except mp.ProcessExitedException as exc:
        sig = getattr(exc, "signal_name", None)
        cause = (f"killed by signal {sig}, without an error report (the kernel's out-of-memory killer or a kill "
                 f"from outside)" if sig else f"the process exited abnormally: {exc}")
        raise worker_error(out_dir, exc.error_index, cause, what) from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)


def _check_actions(out_dir: str, world: int, limit_s: float, what: str) -> None:
    """Raise :class:`WorkerTimeoutError` when a rank has been inside one schedule action longer than ``limit_s``."""
    now = time.time()
    for r, beat in sorted(heartbeats(out_dir).items()):
        if beat.get("running") and now - float(beat.get("since", now)) > limit_s:
            raise timeout_error(out_dir, world, f"{what} run with {world} ranks stopped: a rank spent more than the "
                                f"action time-out of {limit_s:g} s in one action", what)


def _idle_text(beat: Mapping[str, Any], now: float) -> str:
    if beat.get("since") is None:
        return "no heartbeat yet"
    idle = max(0.0, now - float(beat["since"]))
    if beat.get("running"):
        return f"in that action for {idle:.1f} s"
    last = f", after action {beat['last_action']}" if beat.get("last_action") else ""
    return f"no progress for {idle:.1f} s{last}"


def timeout_error(out_dir: str, world: int, headline: str, what: str = "local") -> WorkerTimeoutError:
    """A :class:`~fxpipe.errors.WorkerTimeoutError`: ``headline``, then the late rank and what every rank was doing.

    The late rank is, among the ranks that have not finished, one inside a schedule action
    (the others wait for it) that started longest ago, else the one whose last progress is
    oldest (:func:`heartbeats`). A rank without a heartbeat had not started its entry yet.
    """
    now = time.time()
    beats = heartbeats(out_dir)
    for r in range(world):  # no heartbeat yet: still importing torch or joining the group, the furthest behind
        beats.setdefault(r, {"rank": r, "phase": "starting: importing torch, joining the process group", "since": None})
    waiting = {r: b for r, b in beats.items() if b.get("phase") != "done"}
    if not waiting:
        return WorkerTimeoutError(headline + errors_text(out_dir), summary=headline)
    late = min(waiting, key=lambda r: (waiting[r].get("since") is not None, not waiting[r].get("running"),
                                       float(waiting[r].get("since") or 0.0)))
    beat = waiting[late]
    where, stages = _describe(beat)
    idle = None if beat.get("since") is None else max(0.0, now - float(beat["since"]))
    lines = [f"{headline}: {what} worker {where} is late: {_idle_text(beat, now)}"]
    others = [f"rank {r} ({_describe(b)[0].split('(', 1)[-1].rstrip(')')}), {_idle_text(b, now)}"
              for r, b in sorted(beats.items()) if r != late]
    if others:
        lines.append("other ranks: " + "; ".join(others))
    summary = "\n".join(lines)
    return WorkerTimeoutError(summary + errors_text(out_dir), rank=late, stages=stages,
                              action=beat.get("running"), phase=beat.get("phase"), idle_s=idle, summary=summary)


def clear_reports(out_dir: str) -> None:
    """Remove the ranks' error reports and heartbeats (before a new attempt)."""
    for name in os.listdir(out_dir):
        if name.endswith((".err", ".beat")):
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
    """``"rank 1 (stage 3, forward of micro-batch 0, action 3F0, training step 0, run 0)"`` and the stages
    (the action's first), from an error report or a heartbeat."""
    stages = tuple(int(s) for s in report.get("stages") or ())
    action = report.get("action") or report.get("running")
    act_stage, _, _ = parse_action(action)
    if act_stage is not None:
        stages = (act_stage,) + tuple(s for s in stages if s != act_stage)
    parts = []
    if act_stage is not None:
        parts.append(describe_action(action))
    elif stages:
        parts.append(("stage " if len(stages) == 1 else "stages ") + ", ".join(map(str, stages)))
    if action:
        parts.append(f"action {action}")
    parts.append(str(report.get("phase") or "starting"))
    if int(report.get("run", -1)) >= 0:
        parts.append(f"run {report['run']}")
    return f"rank {report.get('rank')} ({', '.join(parts)})", stages


def worker_error(out_dir: str, failed_rank: int | None, fallback: str, what: str = "local") -> WorkerError:
    """The first real rank failure as a :class:`~fxpipe.errors.WorkerError`.

    Among the ranks' reports, a failure that is not a lost connection to a failed peer wins,
    the earliest first; it names the root cause (the user's exception under torch's wrappers)
    and, on the next lines, the model's source line and the op (:func:`fxpipe.codegen.faults.cause_fields`);
    the other ranks' causes follow in one line each. A failed rank that left no report (killed
    by a signal, out of memory) is the first failure, with ``fallback`` as its cause and what
    its heartbeat last said it was doing.
    """
    reps = reports(out_dir)
    if all(_secondary(r) and r.get("rank") != failed_rank for r in reps):
        beat = heartbeats(out_dir).get(failed_rank) if failed_rank is not None else None
        where, stages = _describe(beat) if beat else (f"rank {failed_rank}", ())
        lost = f"; ranks {', '.join(str(r['rank']) for r in reps)} lost their connection to it" if reps else ""
        msg = f"{what} worker {where} failed: {fallback}{lost}"
        return WorkerError(msg, rank=failed_rank, stages=stages, action=(beat or {}).get("running"),
                           phase=(beat or {}).get("phase"), cause=fallback, summary=msg)
    primary = min(reps, key=lambda r: (_secondary(r), r.get("time", 0.0)))
    where, stages = _describe(primary)
    cause = f"{primary['type']}: {primary['message']}".strip()
    lines = [f"{what} worker {where} failed: {cause}", *primary.get("detail", ())]
    others = [r for r in reps if r is not primary]
    if others:
        lines.append("other ranks: " + "; ".join(
            f"rank {r['rank']} " + ("lost its connection to the failed rank" if _secondary(r) else
                                    f"failed too ({r['type']}: {str(r['message']).splitlines()[0][:200] if r['message'] else ''})")
            for r in others))
    summary = "\n".join(lines)
    lines.append(f"--- traceback of rank {primary['rank']} ---\n{primary['traceback'].rstrip()}")
    _, _, mb = parse_action(primary.get("action"))
    return WorkerError("\n".join(lines), rank=primary.get("rank"), stages=stages, action=primary.get("action"),
                       phase=primary.get("phase"), cause_type=primary.get("type"), cause=primary.get("message"),
                       summary=summary, microbatch=mb, frame=primary.get("frame"), op=primary.get("op"))
