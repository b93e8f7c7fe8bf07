"""Stage-to-stage links of local pipeline ranks: message times measured by a ping-pong.

:func:`measure_p2p` starts two gloo processes (one intra-op thread each, pinned to their own
cores, as :func:`fxpipe.codegen.launch.spawn_train`'s ranks; started by the one local launcher,
:func:`fxpipe.launcher.launch`) and times one-way messages of
several sizes (:func:`p2p_times`); :class:`fxpipe.cost.calibrate.LinkModel` interpolates them
and :func:`fit_link` fits one latency and bandwidth.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Mapping, Sequence

import torch

from fxpipe.cost.calibrate import fit_phase
from fxpipe.errors import InputError
from fxpipe.launcher import RankContext, launch

__all__ = ["P2P_SIZES", "p2p_times", "fit_link", "measure_p2p"]

#: Message sizes (bytes) of :func:`p2p_times`.
P2P_SIZES = (1024, 4096, 16384, 32768, 49152, 65536, 131072, 262144, 1 << 20, 4 << 20, 16 << 20)


def p2p_times(peer: int, *, sizes_bytes: Sequence[int] = P2P_SIZES, repeats: int = 15, warmup: int = 3,
              group: Any = None, device: str | torch.device = "cpu") -> dict[int, float]:
    """One-way time of a point-to-point message of each size between this rank and ``peer``.

    Call on both ranks of an initialised ``torch.distributed`` process group (any backend);
    the rank with the smaller number sends first. Each sample is half a ping-pong, timed
    with ``time.perf_counter``; the median of ``repeats`` samples after ``warmup`` is kept.

    Returns
    -------
    dict[int, float]
        Message size (bytes) -> seconds.
    """
    import torch.distributed as dist

    me = dist.get_rank(group)
    first = me < peer
    out: dict[int, float] = {}
    for n in sizes_bytes:
        buf = torch.zeros(max(int(n) // 4, 1), dtype=torch.float32, device=device)
        ts = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            if first:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            if i >= warmup:
                ts.append((time.perf_counter() - t0) / 2)
        out[int(buf.numel() * 4)] = float(statistics.median(ts))
    return out


def fit_link(times: Mapping[int, float]) -> tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of ``t = latency + bytes / bandwidth`` fitted to message times.

    The same non-negative relative least squares as the op calibration
    (:func:`fxpipe.cost.calibrate.fit_phase`, with bytes in place of the roofline time).

    Raises
    ------
    InputError
        With fewer than two message sizes.
    """
    if len(times) < 2:
        raise InputError("fit_link needs the times of at least two message sizes")
    sizes = sorted(times)
    fit = fit_phase([float(n) for n in sizes], [times[n] for n in sizes])
    bw = 1.0 / fit.scale if fit.scale > 0 else float("inf")
    return fit.overhead_s, bw


def _p2p_rank(ctx: RankContext, sizes: tuple) -> dict[str, float] | None:
    """A rank of :func:`measure_p2p` (entry of :func:`fxpipe.launcher.launch`): rank 0 returns the times."""
    ctx.where["phase"] = "ping-pong with the other rank"
    t = p2p_times(1 - ctx.rank, sizes_bytes=sizes)
    return {str(k): v for k, v in t.items()} if ctx.rank == 0 else None


def measure_p2p(*, sizes_bytes: Sequence[int] = P2P_SIZES, pin: bool = True) -> tuple[float, float, dict[int, float]]:
    """Stage-to-stage link of local CPU pipeline ranks: two gloo processes, ping-pong.

    Each process runs one intra-op thread and (with ``pin``) is pinned to its own core, as
    the ranks of :func:`fxpipe.codegen.launch.spawn_train`.

    Returns
    -------
    (latency_s, bytes_per_s, times)
        The :func:`fit_link` of the measured one-way ``times`` (size in bytes -> seconds).

    Raises
    ------
    WorkerError
        If a rank fails (:func:`fxpipe.launcher.launch`; rank, phase, cause and traceback).
    TimeoutError
        If the two ranks do not finish within 600 s.
    """
    cpus: tuple = ()
    if pin and hasattr(os, "sched_getaffinity"):
        cpus = tuple(sorted(os.sched_getaffinity(0)))[:2]
    out = launch(_p2p_rank, 2, args=(tuple(sizes_bytes),), timeout_s=600.0, threads=1, cpus=cpus, what="link profiling")
    times = {int(k): float(v) for k, v in out[0].items()}
    lat, bw = fit_link(times)
    return lat, bw, times
