"""Per-device memory model of a pipeline stage, used to make the partitioner memory-aware.

A stage at pipeline position ``s`` (0-based) of ``k`` holds

* training: ``state_bytes_per_param_byte * size_param_bytes`` of its nodes (weights,
  gradients, optimizer state) plus the activations of its in-flight micro-batches. Under
  1F1B (PipeDream-Flush, Narayanan et al. 2021) stage ``s`` keeps ``k - s`` micro-batches in
  flight, so the activation term is ``(k - s) * sum(act_bytes)``.
* inference: ``size_param_bytes`` of its nodes (``state_bytes_per_param_byte = 1``) plus one
  micro-batch of activations ``sum(act_bytes)``.

The default training factor is **8.0**: ``size_param_bytes`` is taken to be the bytes of the
parameters in bf16 (2 bytes per parameter), and mixed-precision Adam keeps per parameter
bf16 weights (2) + bf16 gradients (2) + fp32 master weights (4) + two fp32 Adam moments
(4 + 4) = 16 bytes = 8 x the bf16 parameter bytes (Rajbhandari et al., ZeRO, 2020,
Section 3.1 count 16 bytes per parameter for mixed-precision Adam). For fp32 training with
plain Adam (weights, grads, 2 moments, all fp32) use 4.0.

A block whose memory exceeds the device capacity is infeasible: the SliceGraph DP gives it
cost ``inf`` (it knows each block's position ``s``, on which the in-flight count depends).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import OpGraph

__all__ = ["MemoryModel", "as_memory_model", "memory_inputs", "stage_memory_bytes", "TRAINING_STATE_FACTOR", "infeasible_error"]

#: Bytes of weights + gradients + optimizer state per byte of ``size_param_bytes`` for
#: training (mixed-precision Adam, see the module docstring).
TRAINING_STATE_FACTOR = 8.0


@dataclass(frozen=True)
class MemoryModel:
    """Memory capacity of one device and how a stage's memory is counted.

    Attributes
    ----------
    capacity_bytes : float
        Bytes available on each device (> 0).
    state_bytes_per_param_byte : float or None
        Static bytes per byte of ``size_param_bytes``. ``None``: 8.0 for training
        (mixed-precision Adam, :data:`TRAINING_STATE_FACTOR`), 1.0 for inference.
    schedule : {"1f1b", "gpipe"}
        In-flight micro-batches per stage in training: ``"1f1b"`` keeps ``k - s`` on stage
        ``s``; ``"gpipe"`` keeps ``microbatches`` on every stage.
    microbatches : int or None
        Number of micro-batches (only for ``schedule="gpipe"``).
    """

    capacity_bytes: float
    state_bytes_per_param_byte: float | None = None
    schedule: str = "1f1b"
    microbatches: int | None = None

    def __post_init__(self) -> None:
        try:
            cap = float(self.capacity_bytes)
        except (TypeError, ValueError):
            raise InputError(f"memory capacity must be a number of bytes, got {self.capacity_bytes!r}") from None
        if not (cap > 0) or math.isnan(cap):
            raise InputError(f"memory capacity must be a positive number of bytes, got {self.capacity_bytes!r}")
        if self.state_bytes_per_param_byte is not None and not (float(self.state_bytes_per_param_byte) >= 0):
            raise InputError(f"state_bytes_per_param_byte must be >= 0, got {self.state_bytes_per_param_byte!r}")
        if self.schedule not in ("1f1b", "gpipe"):
            raise InputError(f"schedule must be '1f1b' or 'gpipe', got {self.schedule!r}")
        if self.schedule == "gpipe" and (self.microbatches is None or int(self.microbatches) < 1):
            raise InputError("schedule='gpipe' needs microbatches >= 1")

    def factor(self, objective: str) -> float:
        """Static bytes per ``size_param_bytes`` byte for ``objective``."""
        if self.state_bytes_per_param_byte is not None:
            return float(self.state_bytes_per_param_byte)
        return TRAINING_STATE_FACTOR if objective == "training" else 1.0

    def inflight(self, k: int, objective: str) -> np.ndarray:
        """In-flight micro-batches of each stage position, float64 (k,)."""
        if objective != "training":
            return np.ones(k)
        if self.schedule == "gpipe":
            return np.full(k, float(self.microbatches))
        return np.arange(k, 0, -1, dtype=np.float64)


def as_memory_model(memory) -> MemoryModel | None:
    """``None`` -> ``None``; a number -> ``MemoryModel(capacity_bytes=number)``; a model -> itself.

    Raises
    ------
    InputError
        For anything else, or a non-positive capacity.
    """
    if memory is None or isinstance(memory, MemoryModel):
        return memory
    if isinstance(memory, bool) or not isinstance(memory, (int, float, np.integer, np.floating)):
        raise InputError(f"memory must be None, a capacity in bytes, or a MemoryModel; got {memory!r}")
    return MemoryModel(capacity_bytes=float(memory))


def memory_inputs(graph: OpGraph, k: int, objective: str, memory) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Kernel arrays ``(mem_param (n,), mem_act (n,), inflight (k,), capacity_bytes)``.

    Without a memory model: zeros and ``capacity_bytes = inf``.
    """
    model = as_memory_model(memory)
    n = graph.n
    if model is None:
        return np.zeros(n), np.zeros(n), np.ones(k), math.inf
    return (
        np.array(graph.size_param_bytes * model.factor(objective), dtype=np.float64),
        np.array(graph.act_bytes, dtype=np.float64),
        model.inflight(k, objective),
        float(model.capacity_bytes),
    )


def stage_memory_bytes(graph: OpGraph, assignment, k: int, objective: str, memory) -> np.ndarray:
    """Memory of every stage (bytes), float64 (k,), for blocks numbered in pipeline order.

    ``memory`` supplies the counting rules (a capacity or a :class:`MemoryModel`; ``None``
    uses the defaults with no capacity).
    """
    model = as_memory_model(memory) or MemoryModel(capacity_bytes=1.0)
    a = np.asarray(assignment, dtype=np.int64)
    static = np.bincount(a, weights=graph.size_param_bytes * model.factor(objective), minlength=k)
    act = np.bincount(a, weights=graph.act_bytes, minlength=k)
    return static + act * model.inflight(k, objective)


def _fmt_bytes(x: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def infeasible_error(graph: OpGraph, k: int, objective: str, comm: str, memory, *, max_k: int | None = None) -> InfeasibleError:
    """Build the :class:`InfeasibleError` for "no partition into k stages fits in memory".

    The message is computed, not guessed: the best partition found ignoring memory (over the
    structured orders) gives the capacity that partition needs and by how much its biggest
    stage overflows; the smallest feasible device count is searched by trying ``k+1, k+2,
    ...`` up to ``max_k`` (default ``min(n, 4k)``) with the structured orders. Note that in
    training more stages do not always help: stage 0 holds ``k`` micro-batches in flight.
    """
    from fxpipe.partition.search import partition as _partition  # noqa: PLC0415 (cycle)

    model = as_memory_model(memory)
    quick = dict(method="orders", time_limit_s=0.0, seed=0, chain=False, contract=False)  # structured orders only
    free = _partition(graph, k, objective=objective, comm=comm, **quick)
    mem = stage_memory_bytes(graph, free.assignment, k, objective, model)
    worst = int(np.argmax(mem))
    need = float(mem.max())
    over = need - model.capacity_bytes
    if max_k is None:
        max_k = min(graph.n, 4 * k)
    fit_k = None
    for kk in range(k + 1, max_k + 1):
        try:
            _partition(graph, kk, objective=objective, comm=comm, memory=model, _explain=False, **quick)
        except InfeasibleError:
            continue
        fit_k = kk
        break
    msg = (
        f"no partition into {k} stages fits in {_fmt_bytes(model.capacity_bytes)} per device "
        f"({objective}): the best partition ignoring memory needs {_fmt_bytes(need)} on stage {worst} "
        f"(overflow {_fmt_bytes(over)} = {over:.0f} bytes); "
    )
    if fit_k is not None:
        msg += f"use at least {fit_k} devices, or devices with >= {need:.0f} bytes"
    else:
        msg += f"no device count up to {max_k} fits; use devices with >= {need:.0f} bytes"
    err = InfeasibleError(msg)
    err.overflow_bytes = over
    err.required_capacity_bytes = need
    err.min_devices = fit_k
    return err
