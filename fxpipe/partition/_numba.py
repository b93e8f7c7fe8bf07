"""All numba flags of the partitioner in one place (house style, as in stumpy's config).

``NJIT`` is used for every kernel. ``cache=True`` writes compiled machine code next to the
sources (``__pycache__``) so a fresh process does not recompile; ``nogil=True`` lets Python
threads run kernels concurrently (the BRKGA population is decoded by a thread pool, see
:mod:`fxpipe.partition.brkga`; numba's ``prange`` was slower on a loaded machine because
OpenMP threads spin at barriers).

Kernels are compiled for writable C-contiguous arrays only (wrappers pass fresh copies), so
each kernel has a single cached signature.

Ctrl-C during a compile is deferred to its end (:class:`DeferSigintDuringCompile`): numba's
compiler turns a KeyboardInterrupt raised inside it into its own errors (a ``RuntimeError``
from the cache writer, a typing error) or loses it, so a first run interrupted while
compiling printed a numba traceback, or went on as if nothing was pressed.

Set the environment variable ``NUMBA_DISABLE_JIT=1`` to run every kernel as plain Python
(slow, but debuggable; the test-suite supports it).
"""

from __future__ import annotations

import signal
import threading

from numba import njit  # noqa: F401  (re-exported)
from numba.core import event

NJIT = dict(cache=True, nogil=True)


class DeferSigintDuringCompile(event.Listener):
    """A numba event listener that holds a Ctrl-C pressed while numba compiles on the main thread.

    On the start of the outermost ``numba:compile`` event on the main thread (compiles nest:
    a kernel compiles the kernels it calls), when SIGINT has Python's default handler, the
    handler is swapped for one that only records the press; at the end of that event the
    default handler comes back and a recorded press raises KeyboardInterrupt there, out of
    the dispatcher, where fxpipe's Ctrl-C handling sees it. Compiles on other threads are
    left alone (signals reach only the main thread).
    """

    def __init__(self) -> None:
        self.depth = 0
        self.pressed = False
        self.swapped = False

    def _record(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        self.pressed = True

    def on_start(self, ev) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.depth += 1
        if self.depth == 1 and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._record)
            self.swapped = True

    def on_end(self, ev) -> None:
        if threading.current_thread() is not threading.main_thread() or self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0 and self.swapped:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.swapped = False
            if self.pressed:
                self.pressed = False
                raise KeyboardInterrupt


event.register("numba:compile", DeferSigintDuringCompile())
