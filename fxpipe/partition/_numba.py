"""All numba flags of the partitioner in one place (house style, as in stumpy's config).

``NJIT`` is used for every kernel. ``cache=True`` writes compiled machine code next to the
sources (``__pycache__``) so a fresh process does not recompile; ``nogil=True`` lets Python
threads run kernels concurrently (the BRKGA population is decoded by a thread pool, see
:mod:`fxpipe.partition.brkga`; numba's ``prange`` was slower on a loaded machine because
OpenMP threads spin at barriers).

Kernels are compiled for writable C-contiguous arrays only (wrappers pass fresh copies), so
each kernel has a single cached signature.

Ctrl-C during a compile: numba's compiler turns a KeyboardInterrupt raised inside it into its
own errors (a ``RuntimeError`` from the cache writer, a typing error) or loses it. The
partitioner's kernels are first called inside a search (:class:`fxpipe.progress.Search`:
the partition search, BRKGA, the bounds), whose SIGINT handler only raises a stop flag, so a
press during a first-run compile is seen when the compile is over. Nothing here installs a
handler or a numba listener.

Set the environment variable ``NUMBA_DISABLE_JIT=1`` to run every kernel as plain Python
(slow, but debuggable; the test-suite supports it).
"""

from __future__ import annotations

from numba import njit  # noqa: F401  (re-exported)

NJIT = dict(cache=True, nogil=True)
