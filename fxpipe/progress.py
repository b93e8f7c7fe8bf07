"""Progress of the long phases of planning on stderr (capture, partition, schedule, report).

:func:`phase` is a context manager around one phase. When progress is on (:func:`set_enabled`,
or ``fxpipe.compile(..., progress=True)``) and the phase lasts longer than ``delay_s`` (2 s),
a tqdm line on stderr names it and counts the seconds until it ends, then disappears; a
phase that ends sooner prints nothing. While a phase is shown, a first-run numba compile
(the partitioner's kernels, cached on disk after it) adds "compiling numba kernels (first
run only)" to the line, so the few seconds it takes are not silent.

Interruptible searches
----------------------
:class:`Search` is the one Ctrl-C / progress / best-so-far helper of every search
(the partition search and BRKGA, the partition bounds, the SCIP solve wrapper, the schedule
MILP and the offload policy search)::

    with Search("brkga", unit="gen", total=None, progress=True) as run:
        while not run.stopped:              # Ctrl-C sets the flag; the loop ends at its next check
            value, order = step()
            run.offer(value, order)         # keeps the smallest value and its payload
            run.update(1, best=run.best)    # the tqdm line (only with progress=True)
    run.interrupted   # True if Ctrl-C (or a KeyboardInterrupt raised in the body) stopped it
    run.best, run.best_payload             # best so far (inf / None if nothing was offered)

* **The stop flag.** While a :class:`Search` runs in the main thread and SIGINT has
  Python's default handler, a handler that only sets the flag is installed; the previous
  handler is restored when the outermost search exits. Nothing is installed at import, and
  nothing in other threads (signals reach only the main thread) or when SIGINT is ignored
  or handled by someone else. Because the handler never raises, a press during a numba
  compile (a first run) or inside a solver is seen at the next check, never inside it.
  A second press does nothing more: a search that blocks (a solver in a worker thread,
  :mod:`fxpipe.mip.solve`) polls ``run.stopped`` and stops its work itself.
* **Nesting.** A search inside a search (BRKGA inside the partition search, the partition
  search inside the bounds) shares the press: every running search's flag is set, so the
  inner one returns its best so far and the outer one stops too; a search started while an
  enclosing one is already stopped starts stopped.
* **KeyboardInterrupt** raised in the body (e.g. a handler installed by someone else, or a
  test) ends the body and is swallowed: the search goes on after the ``with`` with
  ``interrupted`` true, just as after a flagged press; what the body had written by then is
  its best so far, so keep the best-so-far state consistent at every statement (or in
  :meth:`Search.offer`). :meth:`Search.stop` raises the flag by hand (a callback that wants
  the search to end).
* **Progress.** ``progress=True`` draws a tqdm line on stderr (``desc``, count of ``unit``
  out of ``total``, the postfix given to :meth:`Search.update`, or the count and postfix
  set by :meth:`Search.set_count`, e.g. a solver's seconds); it is closed at exit.

Nothing here imports torch, so the partitioner and the scheduler may use it.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import signal
import sys
import threading
import time
from typing import IO, Any, Iterator

__all__ = ["phase", "set_enabled", "enabled", "stderr_is_terminal", "Search", "stop_all"]

_STATE = {"enabled": False}
_ACTIVE: list["_Line"] = []  # phases being shown, innermost last
_LISTENER: list[object] = []  # the numba compile listener, registered once


def stderr_is_terminal() -> bool:
    """True when stderr is an interactive terminal (progress is meant for people, not logs)."""
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def set_enabled(on: bool) -> bool:
    """Turn phase progress on or off for this process; returns the previous setting."""
    prev = _STATE["enabled"]
    _STATE["enabled"] = bool(on)
    return prev


def enabled() -> bool:
    """Whether :func:`phase` shows anything."""
    return _STATE["enabled"]


class _Line:
    """One phase's tqdm line, drawn by a background thread once ``delay_s`` has passed."""

    def __init__(self, desc: str, delay_s: float, file: IO[str], interval_s: float = 0.5):
        self.desc, self.delay_s, self.file, self.interval_s = desc, delay_s, file, interval_s
        self.note = ""
        self.bar = None
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name="fxpipe-progress", daemon=True)

    def _run(self) -> None:
        if self.stop.wait(self.delay_s):
            return
        from tqdm import tqdm  # noqa: PLC0415

        with self.lock:
            if self.stop.is_set():
                return
            # the terminal's size, 100 x 20 where it reports none (tqdm hides its line on a 0 x 0 pty)
            size = shutil.get_terminal_size((100, 20))
            self.bar = tqdm(total=None, desc=f"fxpipe: {self.desc}", file=self.file, leave=False, ncols=size.columns,
                            nrows=size.lines, bar_format="{desc}", mininterval=0)
            self._draw()
        while not self.stop.wait(self.interval_s):
            with self.lock:
                self._draw()

    def _draw(self) -> None:
        if self.bar is not None:  # seconds since the phase began (tqdm's own clock starts after the delay)
            self.bar.set_description_str(f"fxpipe: {self.desc} {time.perf_counter() - self.t0:.0f} s{self.note}",
                                         refresh=False)
            self.bar.refresh()

    def set_note(self, note: str) -> None:
        with self.lock:
            self.note = note
            self._draw()

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            if self.bar is not None:
                self.bar.close()
                self.bar = None


@contextlib.contextmanager
def phase(desc: str, *, delay_s: float = 2.0, file: IO[str] | None = None, on: bool | None = None) -> Iterator[None]:
    """Show ``desc`` and the elapsed seconds on stderr while the body runs longer than ``delay_s``.

    Parameters
    ----------
    desc : str
        What runs, e.g. ``"partition into 8 stages"``.
    delay_s : float
        Nothing is drawn for a phase shorter than this (seconds).
    file : text stream, optional
        Where to draw (default ``sys.stderr``; stdout stays clean for ``--json``).
    on : bool, optional
        Override :func:`enabled` for this phase.
    """
    if not (enabled() if on is None else on):
        yield
        return
    _watch_numba()
    line = _Line(desc, delay_s, file if file is not None else sys.stderr)
    _ACTIVE.append(line)
    line.thread.start()
    try:
        yield
    finally:
        line.close()
        _ACTIVE.remove(line)


def _watch_numba() -> None:
    """Register (once) a numba listener that notes first-run kernel compiles on the shown phase."""
    if _LISTENER:
        return
    try:
        from numba.core import event  # noqa: PLC0415
    except ImportError:  # pragma: no cover - numba is a dependency
        _LISTENER.append(None)
        return

    class _CompileNote(event.Listener):
        depth = 0

        def on_start(self, ev) -> None:
            if threading.current_thread() is threading.main_thread():
                self.depth += 1
                if self.depth == 1 and _ACTIVE:
                    _ACTIVE[-1].set_note(" (compiling numba kernels, first run only)")

        def on_end(self, ev) -> None:
            if threading.current_thread() is threading.main_thread() and self.depth > 0:
                self.depth -= 1
                if self.depth == 0 and _ACTIVE:
                    _ACTIVE[-1].set_note("")

    listener = _CompileNote()
    event.register("numba:compile", listener)
    _LISTENER.append(listener)


# ------------------------------------------------------------------------- interruptible searches

_RUNNING: list["Search"] = []  # searches running now (all threads), outermost first
_RUN_LOCK = threading.RLock()  # guards _RUNNING and the handler swap (not taken by the handler)


def _flag_press(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    """SIGINT handler while a search runs: raise every running search's stop flag.

    It takes no lock: it runs in the main thread between two bytecodes, possibly while that
    thread holds ``_RUN_LOCK``; it reads a copy of the list and only sets events."""
    for run in list(_RUNNING):
        run.stop()


def stop_all() -> None:
    """Raise the stop flag of every running search, as a Ctrl-C during them does (for code that
    caught the KeyboardInterrupt itself, e.g. around a SCIP solve)."""
    with _RUN_LOCK:
        for run in _RUNNING:
            run.stop()


class Search:
    """One interruptible search: a Ctrl-C stop flag, a tqdm progress line, the best so far.

    See the module docstring for how it is used and what it installs.

    Parameters
    ----------
    desc : str
        Name on the progress line, e.g. ``"brkga"``.
    unit : str
        What :meth:`update` counts (``"it"``, ``"gen"``, ``"order"``, ``"s"``).
    total : float, optional
        Expected count (None: unknown).
    progress : bool
        Draw the tqdm line on stderr.
    bar_format : str, optional
        tqdm's ``bar_format`` for the line.
    """

    def __init__(self, desc: str, *, unit: str = "it", total: float | None = None, progress: bool = False,
                 bar_format: str | None = None):
        self.desc, self.unit, self.total, self.progress = desc, unit, total, bool(progress)
        self.bar_format = bar_format
        self.best: float = math.inf
        self.best_payload: Any = None
        self.interrupted = False
        self._flag = threading.Event()
        self._bar = None
        self._prev_handler = None
        self._installed = False

    # -- the stop flag
    @property
    def stopped(self) -> bool:
        """True once Ctrl-C was pressed (or :meth:`stop` called) during this search."""
        return self._flag.is_set()

    def stop(self) -> None:
        """Raise the stop flag (what a Ctrl-C does); the search ends at its next check."""
        self._flag.set()

    # -- best so far
    def offer(self, value: float, payload: Any = None) -> bool:
        """Keep ``(value, payload)`` if ``value`` is smaller than the best so far; True if kept."""
        if value < self.best:
            self.best, self.best_payload = float(value), payload
            return True
        return False

    # -- the progress line
    def update(self, n: float = 1, **postfix: Any) -> None:
        """Advance the progress line by ``n`` units and show ``postfix`` (no-op without progress)."""
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix(**postfix, refresh=False)

    def set_count(self, n: float, postfix: str = "") -> None:
        """Set the progress line's count to ``n`` (e.g. solver seconds) with a postfix string."""
        if self._bar is not None:
            self._bar.n = min(n, self.total) if self.total is not None else n
            self._bar.set_postfix_str(postfix, refresh=True)

    # -- context manager
    def __enter__(self) -> "Search":
        if self.progress:
            from tqdm.auto import tqdm  # noqa: PLC0415 (tqdm's import is not free)

            fmt = {} if self.bar_format is None else {"bar_format": self.bar_format}
            self._bar = tqdm(total=self.total, desc=self.desc, unit=self.unit, leave=False, **fmt)
        with _RUN_LOCK:
            main = threading.current_thread() is threading.main_thread()
            if main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._prev_handler = signal.signal(signal.SIGINT, _flag_press)
                self._installed = True
            if any(run.stopped for run in _RUNNING):
                self._flag.set()  # an enclosing search was already told to stop
            _RUNNING.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        with _RUN_LOCK:
            _RUNNING.remove(self)
            if self._installed:
                signal.signal(signal.SIGINT, self._prev_handler)
                self._installed = False
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            self._flag.set()
            with _RUN_LOCK:  # the enclosing searches stop too, as after a flagged press
                for run in _RUNNING:
                    run.stop()
        self.interrupted = self.stopped
        return exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
