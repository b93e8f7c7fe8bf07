"""Several stages per device: placements and the per-device cost of a partition (no torch).

A partition into ``k = v * p`` pipeline stages (blocks in pipeline order) runs on p devices
with a *placement* ``device_of_stage``:

* ``"looped"`` (interleaved 1F1B, Narayanan et al. 2021, Section 2.2): stage s on device
  ``s mod p``; with v = 1 this is one stage per device;
* ``"v"`` (V-shape / zig-zag, ZB-V and DualPipe-V, Qi et al. 2024 "Pipeline Parallelism with
  Controllable Memory", Section 3): stages s and ``2p - 1 - s`` on device s (continuing the
  zig-zag for v > 2).

The per-device cost generalises Contract 2 (DESIGN.md) from blocks to devices: a device's
work is the sum of its stages' work, and only communication *between devices* costs time
(a tensor passed between two stages of one device stays in its memory):

* ``comm="relay"`` (what ``torch.distributed.pipelining`` runs): a tensor produced in block a
  and last consumed in block c crosses every boundary ``b -> b + 1`` with ``a <= b < c``. A
  boundary whose two stages are on different devices is an output of the first device and an
  input of the second; a boundary inside one device is free. With one stage per device this
  is exactly the relay block cost.
* ``comm="dag"`` (Archer et al. 2024, Eq. 1): the device is the union of its blocks;
  ``io(D, V \\ D)`` counts each tensor of a producer on the device with a consumer elsewhere
  once, ``io(V \\ D, D)`` each tensor from elsewhere with a consumer on the device once.

``f_dev(d) = sum_{v on d} w(v) + c * (in_d + out_d) / B`` with ``w`` the objective's work per
node (:meth:`fxpipe.ir.OpGraph.work_s`) and ``c = 2`` for training (activation forward,
gradient backward), 1 for inference. The per-device bottleneck ``max_d f_dev(d)`` is what a
pipeline with several stages per device is limited by; it is recomputed here from scratch
on the OpGraph (plain numpy), the reference the per-stage partitioner's results are scored
against when stages share devices.

What this module does not do: the partition itself is still searched for the per-*stage*
bottleneck (:func:`fxpipe.partition.search.partition`); a search that minimises the
per-device objective directly (inside the SliceGraph DP / BRKGA) is future work.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.ir.schedule import looped_placement, v_placement
from fxpipe.partition.objective import block_costs, check_objective, io_bytes

__all__ = [
    "PLACEMENTS",
    "placement_of",
    "placement_name",
    "device_io_bytes",
    "device_costs",
    "device_bottleneck",
]

#: Placement names :func:`placement_of` knows.
PLACEMENTS = ("looped", "v")


def placement_of(name: str, num_devices: int, stages_per_device: int) -> tuple[int, ...]:
    """The device of every one of ``v * p`` stages under the named placement.

    Parameters
    ----------
    name : {"looped", "v"}
        ``"looped"``: stage s on device ``s mod p``; ``"v"``: stages s and ``2p - 1 - s`` on
        device s (zig-zag for v > 2). With v = 1 both are one stage per device.
    num_devices, stages_per_device : int
        p >= 1 and v >= 1.

    Returns
    -------
    tuple of int, length v * p

    Raises
    ------
    InputError
        On an unknown name or bad counts.
    """
    if name == "looped":
        return looped_placement(num_devices, stages_per_device)
    if name == "v":
        return v_placement(num_devices, stages_per_device)
    raise InputError(f"placement must be one of {PLACEMENTS}, got {name!r}")


def placement_name(device_of_stage: Sequence[int], num_devices: int | None = None) -> str:
    """``"looped"`` or ``"v"`` when ``device_of_stage`` is that placement (looped for one stage
    per device in order), else ``"custom"``."""
    dev = tuple(int(d) for d in device_of_stage)
    p = (max(dev) + 1 if dev else 0) if num_devices is None else int(num_devices)
    if p < 1 or len(dev) % p:
        return "custom"
    v = len(dev) // p
    for name in PLACEMENTS:
        if dev == placement_of(name, p, v):
            return name
    return "custom"


def _check_placement(graph: OpGraph, assignment, device_of_stage, num_devices) -> tuple[np.ndarray, np.ndarray, int, int]:
    a = np.asarray(assignment)
    if a.shape != (graph.n,) or (a.size and a.dtype.kind not in "iu"):
        raise InputError(f"assignment must be an integer array with one block per node ({graph.n})")
    a = a.astype(np.int64)
    dev = np.asarray(device_of_stage)
    if dev.ndim != 1 or dev.size < 1 or dev.dtype.kind not in "iu":
        raise InputError("device_of_stage must be a non-empty list of integer device indices, one per stage")
    dev = dev.astype(np.int64)
    k = int(dev.size)
    if a.size and (a.min() < 0 or a.max() >= k):
        raise InputError(f"block ids must lie in 0..{k - 1} (one entry of device_of_stage per stage)")
    p = int(dev.max()) + 1 if num_devices is None else int(num_devices)
    if dev.min() < 0 or dev.max() >= p:
        raise InputError(f"device_of_stage names a device outside 0..{p - 1}")
    return a, dev, k, p


def device_io_bytes(
    graph: OpGraph,
    assignment: Sequence[int] | np.ndarray,
    device_of_stage: Sequence[int],
    comm: str = "relay",
    *,
    num_devices: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes entering and leaving each device (communication between stages of one device is free).

    Parameters
    ----------
    graph : OpGraph
    assignment : int array (n,)
        Block (stage) of every node, 0..k-1, in pipeline order for ``comm="relay"``.
    device_of_stage : int array (k,)
        Device of every stage.
    comm : {"relay", "dag"}
        See the module docstring.
    num_devices : int, optional
        p (default ``max(device_of_stage) + 1``).

    Returns
    -------
    in_bytes, out_bytes : float64 arrays (p,)

    Raises
    ------
    InputError
        On a malformed assignment or placement, or a backward edge in relay mode.
    """
    a, dev, k, p = _check_placement(graph, assignment, device_of_stage, num_devices)
    if comm == "relay":
        _, boundary = io_bytes(graph, a, k, "relay")  # boundary[b]: bytes crossing b -> b + 1
        in_b = np.zeros(p)
        out_b = np.zeros(p)
        for b in range(k - 1):
            src, dst = dev[b], dev[b + 1]
            if src != dst:
                out_b[src] += boundary[b]
                in_b[dst] += boundary[b]
        return in_b, out_b
    if comm == "dag":
        return io_bytes(graph, dev[a] if a.size else a, p, "dag")
    raise InputError(f"comm must be 'relay' or 'dag', got {comm!r}")


def device_costs(
    graph: OpGraph,
    assignment: Sequence[int] | np.ndarray,
    device_of_stage: Sequence[int],
    objective: str = "training",
    comm: str = "relay",
    *,
    num_devices: int | None = None,
) -> np.ndarray:
    """Cost ``f_dev(d)`` of every device (seconds), float64 array (p,).

    The sum of the work of the device's stages plus the cost of the tensors that cross to or
    from other devices (module docstring). With one stage per device (identity placement)
    this equals :func:`fxpipe.partition.objective.block_costs`.

    Parameters
    ----------
    graph : OpGraph
    assignment : int array (n,)
        Block (stage) of every node.
    device_of_stage : int array (k,)
        Device of every stage.
    objective : {"training", "inference"}
    comm : {"relay", "dag"}
    num_devices : int, optional
        p (default ``max(device_of_stage) + 1``).

    Raises
    ------
    InputError
        On an unknown objective/comm or a malformed assignment or placement.

    References
    ----------
    DESIGN.md Contract 2 (relay/training variants); Archer et al., "Practical Performance
    Guarantees for Pipelined DNN Inference", ICML 2024, Eq. 1 and 3 (applied to the union of
    a device's blocks).
    """
    check_objective(objective, comm)
    a, dev, k, p = _check_placement(graph, assignment, device_of_stage, num_devices)
    if comm == "dag":
        return block_costs(graph, dev[a] if a.size else a, p, objective, "dag")
    in_b, out_b = device_io_bytes(graph, a, dev, comm, num_devices=p)
    work = np.bincount(dev[a] if a.size else a, weights=graph.work_s(objective), minlength=p)
    return work + (2.0 if objective == "training" else 1.0) * (in_b + out_b) / graph.bandwidth_bytes_per_s


def device_bottleneck(
    graph: OpGraph,
    assignment: Sequence[int] | np.ndarray,
    device_of_stage: Sequence[int],
    objective: str = "training",
    comm: str = "relay",
) -> float:
    """``max_d f_dev(d)``: the per-device bottleneck of a partition under a placement (seconds)."""
    return float(device_costs(graph, assignment, device_of_stage, objective, comm).max())
