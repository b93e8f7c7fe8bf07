"""Progress of the long phases of planning on stderr (capture, partition, schedule, report).

:func:`phase` is a context manager around one phase. When progress is on (:func:`set_enabled`,
or ``fxpipe.compile(..., progress=True)``) and the phase lasts longer than ``delay_s`` (2 s),
a tqdm line on stderr names it and counts the seconds until it ends, then disappears; a
phase that ends sooner prints nothing. While a phase is shown, a first-run numba compile
(the partitioner's kernels, cached on disk after it) adds "compiling numba kernels (first
run only)" to the line, so the few seconds it takes are not silent.

Nothing here imports torch, so the partitioner and the scheduler may use it.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
from typing import IO, Iterator

__all__ = ["phase", "set_enabled", "enabled", "stderr_is_terminal"]

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
