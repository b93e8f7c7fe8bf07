"""The stage and device tables of a plan: one row of figures per stage and per device (torch-free).

:func:`stage_stats` and :func:`device_stats` compute them from the graph, the partition, the
schedule problem (with its placement) and the schedule; :class:`StageStats` and
:class:`DeviceStats` are the rows (times in seconds, sizes in bytes) that ``Plan.to_dict``
writes and a loaded plan checks against its own recomputation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from fxpipe.ir import OpGraph, Schedule, ScheduleProblem
from fxpipe.memory import MemoryModel
from fxpipe.memory.model import ROW_FIELDS, MemoryRow
from fxpipe.memory.plan_view import device_memory, stage_memory
from fxpipe.partition.objective import Partition
from fxpipe.partition.placement import device_costs
from fxpipe.schedule.validate import device_busy_s, device_spans

__all__ = ["StageStats", "DeviceStats", "MEMORY_FIELDS", "stage_stats", "device_stats"]


@dataclass(kw_only=True)
class _PlanRow(MemoryRow):
    """The columns stage and device rows share: the work of their ops and memory by kind.

    ``num_ops``, ``param_bytes`` (in the captured graph's dtype), ``t_fwd_s``,
    ``t_bwd_input_s``, ``t_bwd_weight_s`` (sums over the row's ops) and ``cost_s``; the memory
    columns of :mod:`fxpipe.memory` (:data:`MEMORY_FIELDS`): ``activation_peak_bytes``,
    ``memory_bytes`` (the total on the device), ``params_bytes``, ``grads_bytes``,
    ``optimizer_bytes``, ``comm_buffer_bytes``, ``reserved_bytes``, ``offloaded_peak_bytes``
    (host memory) and ``capacity_bytes`` (None: unlimited); ``fits`` and ``overflow_bytes``
    come from :class:`fxpipe.memory.MemoryRow`.
    """

    num_ops: int
    param_bytes: float
    t_fwd_s: float
    t_bwd_input_s: float
    t_bwd_weight_s: float
    cost_s: float
    activation_peak_bytes: float
    memory_bytes: float
    params_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    comm_buffer_bytes: float = 0.0
    reserved_bytes: float = 0.0
    offloaded_peak_bytes: float = 0.0
    capacity_bytes: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The row as plain data (the plan file's stage / device table entry)."""
        names = [f.name for f in fields(self)]
        names = [n for n in names if n not in _ROW_COLUMNS] + [n for n in names if n in _ROW_COLUMNS]  # own first
        return {n: list(getattr(self, n)) if isinstance(getattr(self, n), (list, tuple)) else getattr(self, n)
                for n in names}


_ROW_COLUMNS = frozenset(f.name for f in fields(_PlanRow))


#: Memory columns of a stage / device row (bytes): :data:`fxpipe.memory.model.ROW_FIELDS`.
MEMORY_FIELDS = ROW_FIELDS


@dataclass
class StageStats(_PlanRow):
    """Per-stage figures of a plan (times in seconds, sizes in bytes); ``device`` holds the stage.

    The work and memory columns are :class:`_PlanRow`'s; the memory columns come from the
    plan's :class:`fxpipe.memory.MemoryModel`, the stage counted as if alone on its device
    (:func:`fxpipe.memory.plan_view.stage_memory`); ``activation_peak_bytes`` is the peak of the
    stage's curve in the schedule, net of offloaded stashes. ``recompute``: the stage replays
    its forward during B.
    """

    stage: int
    device: int
    recompute: bool = False


@dataclass
class DeviceStats(_PlanRow):
    """Per-device figures of a plan (times in seconds, sizes in bytes).

    Attributes
    ----------
    device : int
    stages : list[int]
        The stages the device holds.
    num_ops, param_bytes, t_fwd_s, t_bwd_input_s, t_bwd_weight_s :
        Sums over the device's stages.
    cost_s : float
        Per-device cost (:func:`fxpipe.partition.placement.device_costs`): the stages' work plus
        the transfers to and from other devices (free between stages of the device).
    busy_s : float
        Compute time of one step in the schedule problem (m times the stages' F + B + W).
    span_s : float
        First F to last W of the device in the schedule.
    activation_peak_bytes, memory_bytes, params_bytes, grads_bytes, optimizer_bytes, comm_buffer_bytes,
    reserved_bytes, offloaded_peak_bytes, capacity_bytes :
        Memory by kind (:func:`fxpipe.memory.plan_view.device_memory`, names of :mod:`fxpipe.memory`):
        the activation peak of the device's curve in the schedule, the static state of its
        stages, receive buffers, the reserved fraction, stashes in host memory at once, the
        total ``memory_bytes`` and the capacity (None: unlimited).
    """

    device: int
    stages: list[int]
    busy_s: float
    span_s: float


def _work_columns(graph: OpGraph, mask: np.ndarray) -> dict[str, Any]:
    """Op count, parameter bytes and F / B / W times summed over the ops in ``mask``."""
    return dict(num_ops=int(mask.sum()), param_bytes=float(graph.size_param_bytes[mask].sum()),
                t_fwd_s=float(graph.t_fwd_s[mask].sum()), t_bwd_input_s=float(graph.t_bwd_input_s[mask].sum()),
                t_bwd_weight_s=float(graph.t_bwd_weight_s[mask].sum()))


def _memory_columns(row) -> dict[str, Any]:
    """The memory columns of a stage / device row from a :class:`fxpipe.memory.DeviceMemory`."""
    return dict(
        params_bytes=row.params_bytes, grads_bytes=row.grads_bytes, optimizer_bytes=row.optimizer_bytes,
        activation_peak_bytes=row.activation_peak_bytes, comm_buffer_bytes=row.comm_buffer_bytes,
        reserved_bytes=row.reserved_bytes, offloaded_peak_bytes=row.offloaded_peak_bytes,
        memory_bytes=row.total_bytes,
        capacity_bytes=None if not math.isfinite(row.capacity_bytes) else row.capacity_bytes,
    )


def stage_stats(graph: OpGraph, partition: Partition, problem: ScheduleProblem, schedule: Schedule, objective: str,
                memory: MemoryModel | None = None) -> list[StageStats]:
    """Per-stage figures: ops, parameter bytes, F/B/W times, cost, and memory by kind.

    Memory comes from the one memory model (:func:`fxpipe.memory.plan_view.stage_memory`, each
    stage as if alone on a device; ``memory`` default: :class:`~fxpipe.memory.MemoryModel`'s
    defaults without a capacity): parameters, gradients, optimizer state, the activation peak
    of the stage's curve in ``schedule``, receive buffers, the reserved fraction, and the
    stashes offloaded at once.
    """
    model = memory if memory is not None else MemoryModel()
    a = partition.assignment
    rows = stage_memory(graph, a, problem, schedule, model, objective)
    return [StageStats(stage=s, device=int(problem.device_of_stage[s]), cost_s=float(partition.block_costs[s]),
                       recompute=bool(problem.recompute[s]), **_work_columns(graph, a == s), **_memory_columns(rows[s]))
            for s in range(partition.k)]


def device_stats(graph: OpGraph, partition: Partition, problem: ScheduleProblem, schedule: Schedule,
                 objective: str, memory: MemoryModel | None = None) -> list[DeviceStats]:
    """Per-device figures: the device's stages, ops, parameter bytes, F/B/W times, the per-device
    cost (:func:`fxpipe.partition.placement.device_costs`: its stages' work plus the transfers to
    other devices), its compute time per step and span in the schedule, and memory by kind
    (:func:`fxpipe.memory.plan_view.device_memory`)."""
    model = memory if memory is not None else MemoryModel()
    dev_of_node = np.asarray(problem.device_of_stage, dtype=np.int64)[partition.assignment]
    costs = device_costs(graph, partition.assignment, problem.device_of_stage, objective, partition.comm,
                         num_devices=problem.num_devices)
    busy = device_busy_s(problem)
    spans = device_spans(problem, schedule.ops)
    rows = device_memory(graph, partition.assignment, problem, schedule, model, objective)
    return [DeviceStats(device=d, stages=list(problem.stages_of_device(d)), cost_s=float(costs[d]), busy_s=float(busy[d]),
                        span_s=float(spans[d]), **_work_columns(graph, dev_of_node == d), **_memory_columns(rows[d]))
            for d in range(problem.num_devices)]
