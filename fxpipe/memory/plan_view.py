"""A plan's memory by kind: the plan view of the one memory model (:mod:`fxpipe.memory.model`).

This module applies :class:`fxpipe.memory.MemoryModel` to a costed graph, a partition into
stages, their placement on devices and a schedule. It adds no formula of its own: the
parameters of a stage are :func:`fxpipe.partition.memory.num_params` summed over its nodes,
its receive buffers are :meth:`MemoryModel.comm_buffer_bytes` of its Contract-2 relay
boundary bytes (:func:`fxpipe.partition.objective.io_bytes`; backward, only the tensors that
carry a gradient, :func:`fxpipe.partition.memory.differentiable`: torch allocates no gradient
buffer for a mask or a rotary table, which the partitioner still counts) for the step-long ones and
:meth:`MemoryModel.pooled_buffer_bytes` per micro-batch in flight for the pooled ones (the
schedule problem adds those to each stash, so the activation peak counts them), the static state is
:meth:`MemoryModel.static_bytes` (with per-block FSDP2 units, of the parameters each stage holds
unsharded too, :func:`fxpipe.memory.fsdp.unsharded_params`), the activation budget the schedule gets is
:meth:`MemoryModel.activation_budget_bytes` (Contract 3's ``mem_limit``), and the activation
peak is read from the schedule's memory curve (:func:`fxpipe.schedule.validate.peak_memory`,
:func:`~fxpipe.schedule.validate.memory_profile`). The partitioner
(:func:`fxpipe.partition.memory.stage_memory_bytes`), the schedule problem and the plan's
stage table therefore count the same bytes (``tests/test_plan_memory.py`` recomputes all
three).

Torch-free: usable by ``plan_graph`` on a loaded graph.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fxpipe.errors import InfeasibleError
from fxpipe.ir import OpGraph, Schedule, ScheduleProblem
from fxpipe.io import format_bytes
from fxpipe.memory.fsdp import unsharded_params
from fxpipe.memory.model import DeviceMemory, MemoryModel
from fxpipe.partition.memory import differentiable, num_params
from fxpipe.partition.objective import io_bytes
from fxpipe.schedule.validate import memory_profile, offloaded_peak, peak_memory

__all__ = ["StageStatic", "stage_static", "schedule_mem_limit", "stage_memory", "device_memory"]


class StageStatic:
    """Parameters and receive-buffer bytes of every stage (float64 arrays (k,)).

    Attributes
    ----------
    num_params : float64 (k,)
        Parameters each stage holds.
    comm_buffer_bytes : float64 (k,)
        Receive buffers of each stage allocated for the whole step (:meth:`MemoryModel.comm_buffer_bytes`).
    pooled_buffer_bytes : float64 (k,)
        Pooled receive buffers of each stage per micro-batch in flight
        (:meth:`MemoryModel.pooled_buffer_bytes`; the schedule problem's ``mem_f`` includes them).
    input_bytes, output_bytes : float64 (k,)
        Relay bytes a stage receives / sends forward per micro-batch.
    unsharded_params : float64 (k,) or None
        With per-block FSDP2 units (:attr:`MemoryModel.block_units`): the parameters each stage holds
        unsharded at its peak (:func:`fxpipe.memory.fsdp.unsharded_params`); None otherwise.
    """

    def __init__(self, num_params, comm_buffer_bytes, input_bytes, output_bytes, pooled_buffer_bytes=None,
                 unsharded_params=None):
        self.unsharded_params = None if unsharded_params is None else np.asarray(unsharded_params, dtype=np.float64)
        self.num_params = np.asarray(num_params, dtype=np.float64)
        self.comm_buffer_bytes = np.asarray(comm_buffer_bytes, dtype=np.float64)
        self.input_bytes = np.asarray(input_bytes, dtype=np.float64)
        self.output_bytes = np.asarray(output_bytes, dtype=np.float64)
        self.pooled_buffer_bytes = (np.zeros_like(self.input_bytes) if pooled_buffer_bytes is None
                                    else np.asarray(pooled_buffer_bytes, dtype=np.float64))


def stage_static(graph: OpGraph, assignment, k: int, model: MemoryModel, num_microbatches: int,
                 objective: str, device_of_stage: Sequence[int] | None = None) -> StageStatic:
    """Parameters and receive buffers of the ``k`` stages of ``assignment`` (see the module docstring).

    Parameters
    ----------
    graph : OpGraph
    assignment : int array (n,)
        Stage of every node, in pipeline order (every edge to the same or a later stage).
    k : int
    model : MemoryModel
    num_microbatches : int
    objective : {"training", "inference"}
    device_of_stage : int sequence (k,), optional
        The placement: a stage fed by a stage on its own device pools no receive buffer
        (:meth:`MemoryModel.pooled_stages`); default one stage per device.
    """
    a = np.asarray(assignment, dtype=np.int64)
    per_node = num_params(graph)
    params = np.bincount(a, weights=per_node, minlength=k)
    unsharded = unsharded_params(graph, a, k, per_node) if model.block_units and objective == "training" else None
    in_b, out_b = io_bytes(graph, a, k, "relay")
    # gradient buffers: only for relayed tensors that carry a gradient (not masks, positions, rotary tables)
    grad_b = io_bytes(graph, a, k, "relay", producers=differentiable(graph))[1] if objective == "training" else out_b
    comm = model.comm_buffer_bytes(in_b, grad_b, num_microbatches, objective, device_of_stage)
    return StageStatic(params, comm, in_b, out_b, model.pooled_buffer_bytes(in_b, objective, device_of_stage),
                       unsharded)


def schedule_mem_limit(graph: OpGraph, assignment, k: int, device_of_stage: Sequence[int], model: MemoryModel,
                       num_microbatches: int, objective: str) -> np.ndarray:
    """Contract 3's ``mem_limit`` per device: ``capacity - reserved - static`` of its stages (bytes).

    The static state counts the step-long receive buffers only; the pooled ones travel with each
    micro-batch's stash, so the schedule problem must carry them
    (``problem_from_partition(..., pooled_buffer_bytes=stage_static(...).pooled_buffer_bytes)``).

    ``inf`` everywhere for an unlimited capacity.

    Raises
    ------
    InfeasibleError
        When a device's static state (parameters, gradients, optimizer state, receive buffers)
        alone leaves no room for activations; the message names the device and the overflow.
    """
    st = stage_static(graph, assignment, k, model, num_microbatches, objective, device_of_stage)
    limit = model.activation_budget_bytes(st.num_params, st.comm_buffer_bytes, objective, device_of_stage,
                                          st.unsharded_params)
    bad = np.flatnonzero(limit <= 0)
    if bad.size:
        d = int(bad[np.argmin(limit[bad])])
        stages = [s for s in range(k) if int(device_of_stage[s]) == d]
        err = InfeasibleError(
            f"device {d} (stages {stages}): its static state (parameters, gradients, optimizer state, receive buffers "
            f"under the {model.precision.name} policy) needs {format_bytes(model.usable_bytes - float(limit[d]))}, "
            f"over the usable {format_bytes(model.usable_bytes)} of {format_bytes(model.capacity_bytes)} by "
            f"{format_bytes(-float(limit[d]))}; no schedule can fit: use more devices, fewer stages per device, "
            "ZeRO sharding over data-parallel replicas or devices with more memory",
            overflow_bytes=-float(limit[d]), stage=d,
        )
        raise err
    return limit


def _offloaded_of_stage(problem: ScheduleProblem, ops, s: int) -> float:
    mine = [o for o in ops if o.stage == s]
    return float(offloaded_peak(problem, mine)[problem.device_of_stage[s]])


def stage_memory(graph: OpGraph, assignment, problem: ScheduleProblem, schedule: Schedule, model: MemoryModel,
                 objective: str) -> list[DeviceMemory]:
    """Memory of every stage by kind, each stage counted as if alone on a device (reserved included).

    With one stage per device this is :func:`device_memory`. The activation peak is the
    maximum of the stage's memory curve in ``schedule``; the offloaded peak the most of its
    stashes in host memory at once.
    """
    k = problem.num_stages
    st = stage_static(graph, assignment, k, model, problem.num_microbatches, objective, problem.device_of_stage)
    ops = list(schedule.ops)
    act = np.zeros(k)
    off = np.zeros(k)
    for s in range(k):
        _, mem = memory_profile(problem, ops, s)
        act[s] = float(mem.max()) if mem.size else 0.0
        off[s] = _offloaded_of_stage(problem, ops, s)
    rows = model.breakdown(st.num_params, st.comm_buffer_bytes, act, objective, offloaded_peak_bytes=off,
                           unsharded_params_per_stage=st.unsharded_params)
    return [DeviceMemory(**{**r.__dict__, "device": int(problem.device_of_stage[s])}) for s, r in enumerate(rows)]


def device_memory(graph: OpGraph, assignment, problem: ScheduleProblem, schedule: Schedule, model: MemoryModel,
                  objective: str) -> list[DeviceMemory]:
    """Memory of every device by kind: its stages' static state, the peak of its activation
    curve in ``schedule`` (:func:`fxpipe.schedule.validate.peak_memory`), its offloaded peak
    (:func:`~fxpipe.schedule.validate.offloaded_peak`) and the reserved fraction."""
    st = stage_static(graph, assignment, problem.num_stages, model, problem.num_microbatches, objective,
                      problem.device_of_stage)
    return model.breakdown(st.num_params, st.comm_buffer_bytes, peak_memory(problem, schedule.ops), objective,
                           offloaded_peak_bytes=offloaded_peak(problem, schedule.ops),
                           device_of_stage=problem.device_of_stage, unsharded_params_per_stage=st.unsharded_params)
