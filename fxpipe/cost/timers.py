"""Timers of the op profiler: CPU clocks and CUDA events.

* :class:`CpuTimer` / :class:`CudaEventTimer` time one callable repeatedly (isolated mode);
* :class:`CpuStopwatch` / :class:`CudaStopwatch` time single calls inside a sequence of
  different calls (graph mode), CUDA events resolved after one synchronisation.

On CPU a clock read is taken around every call (``time.perf_counter_ns``, or the thread's CPU
time, :data:`CLOCKS`) and the clock's own cost is subtracted; on CUDA an event pair brackets
every call (the ``triton.testing.do_bench`` recipe, without its L2 flush). Callers keep the
median. The CUDA classes take an event factory and a synchronise function, so their logic is
tested without a GPU.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable, Sequence

from fxpipe.errors import InputError

__all__ = ["CLOCKS", "CpuTimer", "CudaEventTimer", "CpuStopwatch", "CudaStopwatch", "check_repeats", "median_spread",
           "timer_for"]


#: CPU clocks of the profiler: ``"wall"`` (``time.perf_counter_ns``) and ``"cpu"`` (the calling
#: thread's CPU time, ``time.thread_time_ns``: blind to time-slicing by other processes, valid
#: only when the op runs on the calling thread, i.e. one intra-op thread).
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def _null_interval_ns(clock: Callable[[], int], n: int = 2001) -> float:
    """Median interval between two back-to-back reads of ``clock`` (its own cost, ns)."""
    ts = []
    for _ in range(n):
        a = clock()
        ts.append(clock() - a)
    return float(statistics.median(ts))


class CpuTimer:
    """Timer of a callable on CPU: a clock read around every call, median kept by the caller.

    Parameters
    ----------
    clock : callable() -> int
        Nanosecond clock (default :func:`time.perf_counter_ns`; see :data:`CLOCKS`; tests inject
        a fake one).
    subtract_null : bool
        Subtract the clock's own cost from every interval (see :class:`CpuStopwatch`).
    """

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns, subtract_null: bool = True):
        self.clock = clock
        self.null_ns = _null_interval_ns(clock) if subtract_null else 0.0

    def __call__(self, fn: Callable[[], Any], *, warmup: int = 2, min_repeats: int = 5, max_repeats: int = 50,
                 min_time_s: float = 0.01) -> list[float]:
        """Run ``fn`` ``warmup`` times, then time it; returns every timed call's seconds.

        Calls are repeated until ``min_time_s`` of timed calls have passed, at least
        ``min_repeats`` and at most ``max_repeats`` times.
        """
        check_repeats(warmup, min_repeats, max_repeats)
        for _ in range(warmup):
            fn()
        times: list[float] = []
        enabled = gc.isenabled()
        gc.disable()
        try:
            total = 0.0
            while len(times) < max_repeats and (len(times) < min_repeats or total < min_time_s):
                t0 = self.clock()
                fn()
                dt = max(self.clock() - t0 - self.null_ns, 0.0) * 1e-9
                times.append(dt)
                total += dt
        finally:
            if enabled:
                gc.enable()
        return times


class CudaEventTimer:
    """GPU-side timer: a pair of CUDA events around every call, one synchronisation at the end.

    Parameters
    ----------
    event_factory : callable() -> event, optional
        Creates an event with ``record()`` and ``elapsed_time(other) -> ms`` (default
        ``torch.cuda.Event(enable_timing=True)``).
    synchronize : callable(), optional
        Waits for the device (default ``torch.cuda.synchronize``).

    Notes
    -----
    The number of timed calls is chosen from one synchronised probe call: ``min_time_s /
    probe`` clamped to ``[min_repeats, max_repeats]``, so the loop never synchronises between
    calls (which would add the launch latency to every sample).
    """

    def __init__(self, event_factory: Callable[[], Any] | None = None, synchronize: Callable[[], None] | None = None):
        self.event_factory = event_factory or (_cuda_event)
        self.synchronize = synchronize or _cuda_synchronize

    def __call__(self, fn: Callable[[], Any], *, warmup: int = 2, min_repeats: int = 5, max_repeats: int = 50,
                 min_time_s: float = 0.01) -> list[float]:
        check_repeats(warmup, min_repeats, max_repeats)
        for _ in range(warmup):
            fn()
        self.synchronize()
        start, end = self.event_factory(), self.event_factory()
        start.record()
        fn()
        end.record()
        self.synchronize()
        probe_s = max(start.elapsed_time(end) * 1e-3, 1e-9)
        n = int(min(max_repeats, max(min_repeats, round(min_time_s / probe_s))))
        pairs = [(self.event_factory(), self.event_factory()) for _ in range(n)]
        for s, e in pairs:
            s.record()
            fn()
            e.record()
        self.synchronize()
        return [s.elapsed_time(e) * 1e-3 for s, e in pairs]


class CpuStopwatch:
    """Per-call timing inside a sequence of calls on CPU (graph mode).

    Parameters
    ----------
    clock : callable() -> int
        Nanosecond clock (default ``time.perf_counter_ns``).
    subtract_null : bool
        Subtract the clock's own cost (the median of back-to-back reads; ~0.1 us for
        ``perf_counter_ns``, ~0.5 us for ``thread_time_ns``) from every interval.
    """

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns, subtract_null: bool = True):
        self.clock = clock
        self.null_ns = _null_interval_ns(clock) if subtract_null else 0.0

    def start(self) -> Any:
        return self.clock()

    def stop(self, token: Any) -> Any:
        return max(self.clock() - token - self.null_ns, 0.0) * 1e-9

    def synchronize(self) -> None:
        pass

    def seconds(self, handle: Any) -> float:
        return float(handle)


class CudaStopwatch:
    """Per-call timing inside a sequence of calls on CUDA: an event pair per call, resolved
    after one synchronisation (so the sequence runs without host stalls).

    Parameters
    ----------
    event_factory, synchronize :
        As in :class:`CudaEventTimer` (tests inject fakes).
    """

    def __init__(self, event_factory: Callable[[], Any] | None = None, synchronize: Callable[[], None] | None = None):
        self.event_factory = event_factory or (_cuda_event)
        self.synchronize = synchronize or _cuda_synchronize

    def start(self) -> Any:
        e = self.event_factory()
        e.record()
        return e

    def stop(self, token: Any) -> Any:
        e = self.event_factory()
        e.record()
        return (token, e)

    def seconds(self, handle: Any) -> float:
        start, end = handle
        return float(start.elapsed_time(end)) * 1e-3


def check_repeats(warmup: int, min_repeats: int, max_repeats: int) -> None:
    if warmup < 0 or min_repeats < 1 or max_repeats < min_repeats:
        raise InputError(f"need warmup >= 0 and 1 <= min_repeats <= max_repeats, got {warmup}, {min_repeats}, {max_repeats}")


def median_spread(times: Sequence[float]) -> tuple[float, float]:
    """Median and inter-quartile range / median of a list of times."""
    med = float(statistics.median(times))
    if len(times) < 4 or med <= 0:
        return med, 0.0
    q = statistics.quantiles(times, n=4)
    return med, float((q[2] - q[0]) / med)


def timer_for(dev: Any) -> Callable[..., list[float]]:
    """The isolated-mode timer of a ``torch.device``."""
    return CudaEventTimer() if dev.type == "cuda" else CpuTimer()


def _cuda_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


def _cuda_synchronize() -> None:
    import torch

    torch.cuda.synchronize()
