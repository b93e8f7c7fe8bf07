"""fxpipe's one memory model: what a pipeline stage holds on its device, by kind.

Every part of fxpipe that counts device memory (the memory-aware partitioner, the schedule
problem's activation limit, the plan's stage table, the report) uses this module and its
names. It is a leaf: plain numbers and numpy arrays in, plain numbers and arrays out; it
imports nothing else of fxpipe but the errors.

A stage holding ``P`` parameters on a device of ``capacity_bytes`` needs, in bytes:

``params_bytes``
    the weights it computes with: ``P * policy.weight_bytes`` (divided by the data-parallel
    degree under ZeRO stage 3 / FSDP full sharding);
``grads_bytes``
    their gradients (training only): ``P * policy.grad_bytes`` (sharded from ZeRO stage 2);
``optimizer_bytes``
    master weights and optimizer moments (training only): ``P * policy.optimizer_bytes``
    (sharded from ZeRO stage 1);
``activation_peak_bytes``
    the activations (stashes) its schedule keeps alive at the worst moment, net of what is
    offloaded to host memory at that moment: read from the schedule's memory curve
    (:func:`fxpipe.schedule.validate.peak_memory`), never from a 1F1B formula;
``comm_buffer_bytes``
    the receive buffers of ``torch.distributed.pipelining`` that stay allocated for the whole
    step: a ``PipelineStage`` allocates one receive buffer per micro-batch for each tensor it
    receives forward and one per micro-batch for each gradient it receives backward (torch 2.13
    ``stage.py``, ``_setup_forward_recv_info`` and ``_create_grad_recv_info`` run for every
    ``chunk_id``). fxpipe's runtime reuses the *activation* buffers of every stage but the last
    across micro-batches (:func:`fxpipe.codegen.runtime.recv_buffer_slots`: a buffer is busy
    from the receive that fills it to the micro-batch's last backward op on the stage), so in
    training this is ``m * output_bytes`` (the gradient buffers, not pooled; only for tensors
    that carry a gradient) plus, on the last stage, ``m * input_bytes``, and on the others
    ``input_bytes``: the buffer the next micro-batch's receive fills while the micro-batches in
    flight hold theirs (torch posts a ``RECV_F`` before the compute that frees a slot); in
    inference ``m * input_bytes`` (counted unpooled);
``pooled buffers``
    the pooled activation receive buffers of a training stage but the last: ``input_bytes``
    for every micro-batch in flight on the stage (:meth:`MemoryModel.pooled_buffer_bytes`).
    They live and die with the micro-batch's stash, so they are counted there: the schedule
    problem adds them to the stage's ``mem_f`` (not offloadable: the pool keeps them on the
    device; :func:`fxpipe.schedule.from_partition.problem_from_partition`), the partitioner
    counts one per counted stash, and the plan's ``activation_peak_bytes`` includes them;
``reserved_bytes``
    a fraction of the device kept for what no model counts: the CUDA context and kernels'
    workspaces, the caching allocator's fragmentation, NCCL's own buffers, temporaries of the
    largest op. Default :data:`DEFAULT_RESERVED_FRACTION` = 10 % (PyTorch's allocator typically
    leaves 5-15 % of a training run's peak unused to fragmentation; the CUDA context alone takes
    0.3-1 GiB).

The activation budget a schedule may use on a device is therefore
``capacity - reserved - (params + grads + optimizer + comm buffers)`` of that device's stages
(:meth:`MemoryModel.activation_budget_bytes`).

Names (one per quantity, everywhere in fxpipe)
----------------------------------------------
``capacity_bytes``
    Bytes of one device: :attr:`MemoryModel.capacity_bytes`; a hardware profile's
    ``memory_bytes`` (:class:`fxpipe.cost.hardware.HardwareSpec`) and the ``memory_bytes=``
    / ``--memory`` override of ``fxpipe.compile``, ``plan_graph`` and ``fxpipe plan`` set it.
``mem_limit``
    The activation budget of a device: the schedule problem's ``mem_limit`` (Contract 3),
    ``capacity - reserved - static``.

Activations before a schedule exists (the partitioner)
------------------------------------------------------
The partitioner chooses stages before any schedule, so it counts activations by a rule
(:data:`ACTIVATION_RULES`, :func:`inflight_stashes`), in stashes of the stage (one
micro-batch's ``act_bytes``):

``"floor"``
    one stash: the least any schedule holds. The running forward's stash is on the device
    (a forward allocates it before any offload), so is a backward's (reloaded, or replayed
    by recomputation, which holds the stash plus the stage inputs), so *no* schedule,
    offloading or recomputing, fits a stage whose static state plus one stash exceeds the
    usable capacity. A partition that meets this rule is not ruled out by memory; whether a
    schedule fits it (and with how much offload / recomputation) is the schedule's question.
``"1f1b"``
    ``min(k - s, m)`` stashes on stage s: what 1F1B (and ZB-H1) hold without offload
    (Narayanan et al. 2021). A partition that meets it fits a cheap schedule; planners try it
    first and keep it when it schedules at least as fast (``fxpipe.api.plan_graph``).

Inference keeps no stashes for a backward; both rules count one micro-batch's ``act_bytes``
there as the working set of the running forward.

Precision policies (bytes per parameter; :data:`POLICIES`):

=================  ======  =====  =========  ======================================================
policy             weights grads  optimizer  what it is
=================  ======  =====  =========  ======================================================
``mixed-adam``     2       2      12         bf16/fp16 weights and gradients, fp32 master weights and
                                             two fp32 Adam moments: 16 bytes per parameter
                                             (Rajbhandari et al. 2020, ZeRO, Sec. 3.1, "K = 12"). The
                                             default.
``fp32-adam``      4       4      8          fp32 weights, gradients and two Adam moments.
``bf16-adam``      2       2      4          bf16 everywhere, Adam moments in bf16, no master copy.
``fp32-sgd``       4       4      0          fp32 weights and gradients, plain SGD (no state).
``bf16-sgd``       2       2      0          bf16 weights and gradients, plain SGD.
=================  ======  =====  =========  ======================================================

Inference keeps the weights only (``policy.weight_bytes`` per parameter, no sharding).

ZeRO sharding over a data-parallel degree ``d`` (Rajbhandari et al. 2020, Sec. 5; FSDP's
``SHARD_GRAD_OP`` is stage 2 and ``FULL_SHARD`` stage 3): stage 1 divides the optimizer state
by ``d``, stage 2 also the gradients, stage 3 also the weights. Under stage 3 with per-block FSDP2
units (``fsdp_units="block"``, :mod:`fxpipe.memory.fsdp`) a stage also holds, unsharded, the weights
and gradients of its root unit and of at most two blocks at a time (the working set of torchtitan's
``fully_shard`` per block; Zhao et al. 2023, "PyTorch FSDP", Sec. 3.2.2 and 4.2: one unit all-gathered
ahead of the one computing).

References
----------
Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020, Sec. 3.1 (16 bytes per parameter) and Sec. 5 (stages 1-3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.io import format_bytes

__all__ = [
    "ACTIVATION_RULES",
    "DEFAULT_POLICY",
    "DEFAULT_RESERVED_FRACTION",
    "FSDP_UNITS",
    "KINDS",
    "POLICIES",
    "KIND_LABELS",
    "ROW_FIELDS",
    "DeviceMemory",
    "MemoryModel",
    "MemoryRow",
    "PrecisionPolicy",
    "fits_capacity",
    "format_bytes",
    "inflight_stashes",
]

#: Activation rules of the partitioner (module docstring).
ACTIVATION_RULES = ("floor", "1f1b")

#: What one FSDP2 unit of a stage is (:attr:`MemoryModel.fsdp_units`).
FSDP_UNITS = ("stage", "block")

#: Fraction of each device's capacity kept back for the runtime (see the module docstring).
DEFAULT_RESERVED_FRACTION = 0.10

#: Memory kinds of a stage, in the order the stage table and the report show them.
KINDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_peak_bytes", "comm_buffer_bytes", "reserved_bytes")

#: Short label of every kind, for tables and chart legends.
KIND_LABELS = {"params_bytes": "params", "grads_bytes": "grads", "optimizer_bytes": "optimizer",
               "activation_peak_bytes": "activation peak", "comm_buffer_bytes": "comm buffers",
               "reserved_bytes": "reserved", "offloaded_peak_bytes": "offloaded"}

#: The memory columns of a row of a plan's stage or device table (bytes): the :data:`KINDS`,
#: the offloaded peak (host memory), ``memory_bytes`` (their total on the device) and
#: ``capacity_bytes`` (None: unlimited). :class:`MemoryRow` is their capacity check,
#: :meth:`DeviceMemory.row` fills them.
ROW_FIELDS = KINDS + ("offloaded_peak_bytes", "memory_bytes", "capacity_bytes")


def fits_capacity(memory_bytes: float, capacity_bytes: float | None) -> bool:
    """``memory_bytes <= capacity_bytes`` up to rounding (1e-12 relative); True without a
    capacity (``None`` or ``inf``). The one capacity check of every memory row."""
    return capacity_bytes is None or memory_bytes <= capacity_bytes * (1 + 1e-12)


class MemoryRow:
    """Mixin of a table row with memory columns (:data:`ROW_FIELDS`): its capacity check.

    A row class (a plan's stage or device row, :class:`DeviceMemory`) provides
    ``memory_bytes`` (its total) and ``capacity_bytes`` (``None`` or ``inf``: unlimited).
    """

    memory_bytes: float
    capacity_bytes: float | None

    @property
    def fits(self) -> bool:
        """The row's total fits its capacity (:func:`fits_capacity`)."""
        return fits_capacity(self.memory_bytes, self.capacity_bytes)

    @property
    def overflow_bytes(self) -> float:
        """``memory - capacity`` when positive, else 0."""
        cap = self.capacity_bytes
        return 0.0 if cap is None else max(0.0, self.memory_bytes - cap)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Bytes per parameter of a training set-up's static state.

    Attributes
    ----------
    name : str
    weight_bytes, grad_bytes, optimizer_bytes : float
        Bytes per parameter of the weights, their gradients, and the optimizer's state
        (master weights and moments), each >= 0.
    description : str
    """

    name: str
    weight_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    description: str = ""

    @property
    def training_bytes(self) -> float:
        """Bytes per parameter in training without sharding (16 for ``mixed-adam``)."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


#: The named precision policies (see the module docstring's table).
POLICIES: dict[str, PrecisionPolicy] = {
    p.name: p
    for p in (
        PrecisionPolicy("mixed-adam", 2.0, 2.0, 12.0, "bf16 weights and grads, fp32 master weights + Adam moments (ZeRO Sec. 3.1)"),
        PrecisionPolicy("fp32-adam", 4.0, 4.0, 8.0, "fp32 weights, grads and Adam moments"),
        PrecisionPolicy("bf16-adam", 2.0, 2.0, 4.0, "bf16 weights, grads and Adam moments, no master copy"),
        PrecisionPolicy("fp32-sgd", 4.0, 4.0, 0.0, "fp32 weights and grads, SGD without momentum"),
        PrecisionPolicy("bf16-sgd", 2.0, 2.0, 0.0, "bf16 weights and grads, SGD without momentum"),
    )
}

#: The default policy: mixed-precision Adam, 16 bytes per parameter.
DEFAULT_POLICY = "mixed-adam"


def _as_policy(policy: str | PrecisionPolicy) -> PrecisionPolicy:
    if isinstance(policy, PrecisionPolicy):
        for key in ("weight_bytes", "grad_bytes", "optimizer_bytes"):
            val = getattr(policy, key)
            if not (isinstance(val, (int, float)) and math.isfinite(val) and val >= 0):
                raise InputError(f"precision policy {policy.name!r}: {key} must be a finite number >= 0, got {val!r}")
        return policy
    if policy not in POLICIES:
        raise InputError(f"unknown precision policy {policy!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[policy]


def inflight_stashes(k: int, num_microbatches: int, rule: str, objective: str = "training") -> np.ndarray:
    """Stashes the partitioner counts on each pipeline position (float64 (k,)).

    Parameters
    ----------
    k : int
        Number of stages (>= 1).
    num_microbatches : int
        m >= 1.
    rule : {"floor", "1f1b"}
        See the module docstring: ``"floor"`` one stash (what every schedule needs),
        ``"1f1b"`` ``min(k - s, m)`` on stage s.
    objective : {"training", "inference"}
        Inference counts one micro-batch everywhere.

    Raises
    ------
    InputError
        On an unknown rule or objective, or counts < 1.
    """
    if rule not in ACTIVATION_RULES:
        raise InputError(f"activation rule must be one of {ACTIVATION_RULES}, got {rule!r}")
    if objective not in ("training", "inference"):
        raise InputError(f"objective must be 'training' or 'inference', got {objective!r}")
    k, m = int(k), int(num_microbatches)
    if k < 1 or m < 1:
        raise InputError(f"k and num_microbatches must be >= 1, got {k} and {m}")
    if rule == "floor" or objective == "inference":
        return np.ones(k)
    return np.minimum(np.arange(k, 0, -1, dtype=np.float64), float(m))


@dataclass(frozen=True)
class DeviceMemory(MemoryRow):
    """Memory of one device by kind, in bytes (the sum over the stages it holds).

    Attributes
    ----------
    device : int
    stages : tuple[int, ...]
        The stages the device holds.
    params_bytes, grads_bytes, optimizer_bytes, activation_peak_bytes, comm_buffer_bytes, reserved_bytes : float
        See the module docstring.
    offloaded_peak_bytes : float
        Most activation bytes the device holds in host memory at once (0 without offload).
    capacity_bytes : float
        The device's capacity (``inf`` when none is set).
    """

    device: int
    stages: tuple[int, ...]
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_peak_bytes: float
    comm_buffer_bytes: float
    reserved_bytes: float
    offloaded_peak_bytes: float = 0.0
    capacity_bytes: float = math.inf

    @property
    def static_bytes(self) -> float:
        """Bytes held for the whole run: params + grads + optimizer + comm buffers."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.comm_buffer_bytes

    @property
    def total_bytes(self) -> float:
        """Everything the device needs: static + activation peak + reserved."""
        return self.static_bytes + self.activation_peak_bytes + self.reserved_bytes

    @property
    def memory_bytes(self) -> float:
        """The row's total (:attr:`total_bytes`; the name of a plan's stage / device tables)."""
        return self.total_bytes

    def row(self) -> dict[str, Any]:
        """The :data:`ROW_FIELDS` of a plan's stage / device row (an unlimited capacity is ``None``)."""
        out = {k: float(getattr(self, k)) for k in ROW_FIELDS}
        out["capacity_bytes"] = None if not math.isfinite(self.capacity_bytes) else float(self.capacity_bytes)
        return out

    def to_dict(self) -> dict[str, Any]:
        out = {k: float(getattr(self, k)) for k in KINDS}
        out.update(
            device=self.device,
            stages=list(self.stages),
            offloaded_peak_bytes=float(self.offloaded_peak_bytes),
            total_bytes=float(self.total_bytes),
            capacity_bytes=None if not math.isfinite(self.capacity_bytes) else float(self.capacity_bytes),
            fits=bool(self.fits),
        )
        return out


@dataclass(frozen=True)
class MemoryModel:
    """How a pipeline stage's device memory is counted (see the module docstring).

    Parameters
    ----------
    capacity_bytes : float
        Bytes of one device (> 0; ``inf``: unlimited, nothing is checked).
    policy : str or PrecisionPolicy
        Precision policy of the static state (default ``"mixed-adam"``, 16 bytes/parameter).
    data_parallel : int
        Data-parallel degree the optimizer state / gradients / weights are sharded over (>= 1).
    zero_stage : {0, 1, 2, 3}
        ZeRO stage (0: no sharding; 1: optimizer state; 2: + gradients; 3: + weights).
    reserved_fraction : float
        Fraction of the capacity kept for the runtime, in [0, 1).
    offload_optimizer : bool or None
        Training only. ``True``: the optimizer state lives in host memory and the optimizer steps
        on the host (ZeRO-Offload, Ren et al. 2021, Sec. 4; FSDP2's ``CPUOffloadPolicy``, which
        also keeps the sharded weights and gradients there). The device holds the weights it
        computes with and their gradients for the whole step (torch's pipelining runtime keeps a
        stage unsharded from its first compute to its ``REDUCE_GRAD``), so its optimizer bytes
        per parameter are 0; :meth:`host_bytes_per_param` counts what moves to the host.
        ``False``: on the device, always. ``None`` (the default): on the device, except that the
        mesh search (``mesh="auto"``, :mod:`fxpipe.mesh.search`) also tries the host for a
        mesh whose memory binds and keeps it when it predicts a faster step.
    fsdp_units : {"stage", "block"} or None
        Training with ``dp_shard > 1`` (:func:`fxpipe.mesh.mesh_memory`): what one FSDP2 unit is.
        ``"stage"``: the whole pipeline stage, unsharded from its first compute of the step to its
        ``REDUCE_GRAD`` (ZeRO-1's memory during the step). ``None`` (the default; plan files without
        the field): whole stages, except that a mesh whose whole-stage units do not fit (pinned, or a
        candidate of the mesh search) is planned with ``"block"`` where the runtime runs them
        (:func:`fxpipe.mesh.search.block_units_allowed`). ``"block"``: every repeated block of the graph
        (:func:`fxpipe.memory.checkpoint.find_blocks`) is its own unit, the ops outside every block
        the stage's root unit (torchtitan's ``fully_shard`` per transformer block, then the root):
        the weights, gradients and optimizer state are sharded (ZeRO-3, ``zero_stage=3``) and a
        device holds unsharded only its root units' weights and gradients plus those of at most two
        blocks per stage (the one computing and the one prefetched,
        :func:`fxpipe.memory.fsdp.unsharded_params`; :meth:`static_bytes`' ``unsharded_params_per_stage``).
        The runtime wraps such plans so (:mod:`fxpipe.codegen.fsdp_blocks`); the planner then offers no
        activation offload, whole-stage recomputation or optimizer offload, which do not run with them yet.

    Raises
    ------
    InputError
        On a non-positive capacity, an unknown policy, ``data_parallel < 1``, a ZeRO stage
        outside 0..3, ZeRO without data parallelism, or a reserved fraction outside [0, 1).
    """

    capacity_bytes: float = math.inf
    policy: str | PrecisionPolicy = DEFAULT_POLICY
    data_parallel: int = 1
    zero_stage: int = 0
    reserved_fraction: float = DEFAULT_RESERVED_FRACTION
    offload_optimizer: bool | None = None
    fsdp_units: str | None = None
    _policy: PrecisionPolicy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            cap = float(self.capacity_bytes)
        except (TypeError, ValueError):
            raise InputError(f"memory capacity must be a number of bytes, got {self.capacity_bytes!r}") from None
        if math.isnan(cap) or cap <= 0:
            raise InputError(f"memory capacity must be a positive number of bytes, got {self.capacity_bytes!r}")
        object.__setattr__(self, "capacity_bytes", cap)
        object.__setattr__(self, "_policy", _as_policy(self.policy))
        if isinstance(self.data_parallel, bool) or not isinstance(self.data_parallel, (int, np.integer)) or self.data_parallel < 1:
            raise InputError(f"data_parallel must be an integer >= 1, got {self.data_parallel!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise InputError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if not (isinstance(self.reserved_fraction, (int, float)) and 0.0 <= float(self.reserved_fraction) < 1.0):
            raise InputError(f"reserved_fraction must lie in [0, 1), got {self.reserved_fraction!r}")
        if self.offload_optimizer is not None:
            if not isinstance(self.offload_optimizer, (bool, np.bool_)):
                raise InputError(f"offload_optimizer must be True, False or None (let the mesh search choose), "
                                 f"got {self.offload_optimizer!r}")
            object.__setattr__(self, "offload_optimizer", bool(self.offload_optimizer))
        if self.fsdp_units not in FSDP_UNITS + (None,):
            raise InputError(f"fsdp_units must be one of {FSDP_UNITS} or None (whole stages), got {self.fsdp_units!r}")

    @property
    def block_units(self) -> bool:
        """Per-block FSDP2 units hold part of the parameters unsharded (``fsdp_units == "block"`` under ZeRO-3,
        which :func:`fxpipe.mesh.mesh_memory` sets for ``dp_shard > 1``): :meth:`static_bytes` then adds the
        unsharded working set."""
        return self.fsdp_units == "block" and self.zero_stage >= 3 and self.data_parallel > 1

    # ------------------------------------------------------------------ per parameter
    @property
    def precision(self) -> PrecisionPolicy:
        """The resolved :class:`PrecisionPolicy`."""
        return self._policy

    def bytes_per_param(self, objective: str) -> tuple[float, float, float]:
        """``(weights, grads, optimizer)`` bytes per parameter after ZeRO sharding.

        Raises
        ------
        InputError
            For an objective other than ``"training"`` / ``"inference"``.
        """
        p = self._policy
        if objective == "inference":
            return (p.weight_bytes, 0.0, 0.0)
        if objective != "training":
            raise InputError(f"objective must be 'training' or 'inference', got {objective!r}")
        d = float(self.data_parallel)
        w = p.weight_bytes / d if self.zero_stage >= 3 else p.weight_bytes
        g = p.grad_bytes / d if self.zero_stage >= 2 else p.grad_bytes
        o = p.optimizer_bytes / d if self.zero_stage >= 1 else p.optimizer_bytes
        return (w, g, 0.0 if self.offload_optimizer is True else o)

    def host_bytes_per_param(self, objective: str = "training") -> float:
        """Host-memory bytes per parameter of the device's stages under :attr:`offload_optimizer`.

        FSDP2's ``CPUOffloadPolicy`` keeps the device's shard of the weights, the gradients and
        the optimizer state on the host: ``(weight + grad + optimizer bytes) / data_parallel``
        (the shard over ``data_parallel`` ranks; all of it without data parallelism). 0 without
        offload or in inference.
        """
        if self.offload_optimizer is not True or objective != "training":
            return 0.0
        p = self._policy
        return (p.weight_bytes + p.grad_bytes + p.optimizer_bytes) / float(self.data_parallel)

    def static_bytes_per_param(self, objective: str) -> float:
        """Weights + gradients + optimizer bytes per parameter (16 for mixed-precision Adam)."""
        return float(sum(self.bytes_per_param(objective)))

    @property
    def reserved_bytes(self) -> float:
        """Bytes kept back for the runtime (0 for an unlimited capacity)."""
        return 0.0 if not math.isfinite(self.capacity_bytes) else self.capacity_bytes * float(self.reserved_fraction)

    @property
    def usable_bytes(self) -> float:
        """``capacity - reserved``."""
        return self.capacity_bytes - self.reserved_bytes

    # ------------------------------------------------------------------ per stage
    def pooled_stages(self, k: int, objective: str, device_of_stage=None) -> np.ndarray:
        """Which of ``k`` stages reuse their activation receive buffers, float64 (k,) of 0 / 1.

        In training every stage but the last whose inputs come from another device (fxpipe's
        runtime, :func:`fxpipe.codegen.runtime.recv_buffer_slots`, pools the buffers its
        ``RECV_F`` actions fill; a stage fed by a stage on its own device, the turn of a V
        placement, receives nothing over the network and keeps torch's one buffer per
        micro-batch). ``device_of_stage`` (length k) gives the placement; without it stage s-1
        is taken to be on another device (one stage per device, or looped). In inference none
        is counted pooled.
        """
        if objective not in ("training", "inference"):
            raise InputError(f"objective must be 'training' or 'inference', got {objective!r}")
        k = int(k)
        if k < 1:
            raise InputError(f"k must be >= 1, got {k}")
        pooled = np.zeros(k)
        if objective == "training":
            pooled[: k - 1] = 1.0
            if device_of_stage is not None:
                dev = [int(d) for d in device_of_stage]
                if len(dev) != k:
                    raise InputError(f"device_of_stage must list the device of each of the {k} stages, got {dev}")
                for s in range(1, k):
                    if dev[s] == dev[s - 1]:
                        pooled[s] = 0.0
        return pooled

    def comm_buffer_factors(self, k: int, num_microbatches: int, objective: str) -> tuple[np.ndarray, float]:
        """Receive-buffer bytes per byte of a stage's input and of its output boundary, before a schedule.

        A pooled stage holds one activation buffer per micro-batch in flight, and neither
        offload nor recomputation frees it (the pool keeps it; a recomputing stage keeps exactly
        its inputs), plus the one the next receive fills; so the partitioner counts the
        micro-batches a pipelined schedule keeps in flight on pipeline position ``s`` of ``k``,
        ``min(k - s, m)`` (1F1B, Narayanan et al. 2021; fewer means a stage waits for the next
        micro-batch's backward before starting its forward, serialising the pipeline), plus one,
        whatever activation rule counts the stashes.

        Parameters
        ----------
        k : int
            Stages.
        num_microbatches : int
            m.
        objective : {"training", "inference"}

        Returns
        -------
        (f_in float64 (k,), f_out float)
            ``f_in[s]``: ``min(k - s, m) + 1`` on a pooled stage, ``m`` otherwise; ``f_out``: ``m``
            in training (gradient buffers), 0 in inference. See :meth:`comm_buffer_bytes`.
        """
        m = int(num_microbatches)
        if m < 1:
            raise InputError(f"num_microbatches must be >= 1, got {num_microbatches!r}")
        pooled = self.pooled_stages(k, objective)
        inflight = np.minimum(np.arange(int(k), 0, -1, dtype=np.float64), float(m))
        f_in = pooled * (inflight + 1.0) + (1.0 - pooled) * m
        return f_in, (float(m) if objective == "training" else 0.0)

    def comm_buffer_bytes(self, input_bytes, output_bytes, num_microbatches: int, objective: str,
                          device_of_stage=None) -> np.ndarray:
        """Receive buffers of each stage allocated for the whole step (bytes), float64 (k,).

        ``m * output_bytes`` (gradients, training) plus ``m * input_bytes`` on a stage that does
        not pool its activation buffers (the last in training, all in inference) and
        ``input_bytes`` on one that does (the buffer the next receive fills); the other pooled
        ones are :meth:`pooled_buffer_bytes` per micro-batch in flight.

        Parameters
        ----------
        input_bytes, output_bytes : float array (k,)
            Bytes of the tensors a stage receives forward / sends forward per micro-batch
            (relay boundary bytes; 0 for the first stage's input and the last stage's output).
        num_microbatches : int
            m: ``torch.distributed.pipelining`` keeps one receive buffer per micro-batch.
        objective : {"training", "inference"}
            Inference receives no gradients.
        device_of_stage : int sequence (k,), optional
            The placement (:meth:`pooled_stages`).
        """
        inp, out = self._io_arrays(input_bytes, output_bytes)
        m = int(num_microbatches)
        if m < 1:
            raise InputError(f"num_microbatches must be >= 1, got {num_microbatches!r}")
        pooled = self.pooled_stages(inp.shape[0], objective, device_of_stage)
        return (m * (1.0 - pooled) + pooled) * inp + (float(m) if objective == "training" else 0.0) * out

    def pooled_buffer_bytes(self, input_bytes, objective: str, device_of_stage=None) -> np.ndarray:
        """Pooled activation receive-buffer bytes of each stage per micro-batch in flight, float64 (k,).

        ``input_bytes`` on a pooled stage (:meth:`pooled_stages` of ``device_of_stage``), 0 elsewhere.
        """
        inp, _ = self._io_arrays(input_bytes, input_bytes)
        return self.pooled_stages(inp.shape[0], objective, device_of_stage) * inp

    @staticmethod
    def _io_arrays(input_bytes, output_bytes) -> tuple[np.ndarray, np.ndarray]:
        inp = np.asarray(input_bytes, dtype=np.float64)
        out = np.asarray(output_bytes, dtype=np.float64)
        if inp.shape != out.shape or inp.ndim != 1 or inp.shape[0] < 1:
            raise InputError(f"input_bytes and output_bytes must be 1-d arrays of equal length, got {inp.shape} and {out.shape}")
        return inp, out

    def static_bytes(self, params_per_stage, objective: str,
                     unsharded_params_per_stage=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(params, grads, optimizer)`` bytes of every stage, each float64 (k,).

        Parameters
        ----------
        params_per_stage : float array (k,)
            Number of parameters held by each stage (a tied parameter counts on every stage
            that holds a copy).
        unsharded_params_per_stage : float array (k,), optional
            With per-block FSDP2 units (:attr:`block_units`, training): the parameters a stage holds
            unsharded at its peak (:func:`fxpipe.memory.fsdp.unsharded_params`: its root unit and its
            two largest blocks). Their full weights and full gradients are added to the sharded ones
            (FSDP2 keeps the sharded copy while a unit is all-gathered; a block's unsharded gradients
            live from its backward to their reduce-scatter). Ignored otherwise.
        """
        n = np.asarray(params_per_stage, dtype=np.float64)
        if n.ndim != 1 or np.any(n < 0) or not np.all(np.isfinite(n)):
            raise InputError("params_per_stage must be a 1-d array of finite counts >= 0")
        w, g, o = self.bytes_per_param(objective)
        params, grads = n * w, n * g
        if unsharded_params_per_stage is not None and self.block_units and objective == "training":
            u = np.asarray(unsharded_params_per_stage, dtype=np.float64)
            if u.shape != n.shape or np.any(u < 0) or not np.all(np.isfinite(u)):
                raise InputError(f"unsharded_params_per_stage must be {n.shape[0]} finite counts >= 0, got shape {u.shape}")
            params = params + u * self._policy.weight_bytes
            grads = grads + u * self._policy.grad_bytes
        return params, grads, n * o

    def unsharded_bytes_per_param(self, objective: str) -> float:
        """Bytes per parameter a per-block FSDP2 unit adds while unsharded (full weights and gradients; 0 unless
        :attr:`block_units` in training): the factor of :meth:`static_bytes`' ``unsharded_params_per_stage``."""
        if not (self.block_units and objective == "training"):
            return 0.0
        return self._policy.weight_bytes + self._policy.grad_bytes

    def activation_budget_bytes(
        self,
        params_per_stage,
        comm_buffer_bytes,
        objective: str,
        device_of_stage: Sequence[int] | None = None,
        unsharded_params_per_stage=None,
    ) -> np.ndarray:
        """Bytes each device may use for activations: ``usable - static`` of its stages.

        This is the schedule problem's ``mem_limit`` (Contract 3: bytes available for
        activations, one entry per device). ``inf`` for an unlimited capacity. A negative
        entry means the device's static state alone does not fit.

        Parameters
        ----------
        params_per_stage : float array (S,)
        comm_buffer_bytes : float array (S,)
            From :meth:`comm_buffer_bytes`.
        objective : {"training", "inference"}
        device_of_stage : sequence of int, optional
            Device of every stage (default: stage s on device s).
        unsharded_params_per_stage : float array (S,), optional
            Per-block FSDP2 units' working set (:meth:`static_bytes`).

        Returns
        -------
        float64 array (num_devices,)
        """
        p, g, o = self.static_bytes(params_per_stage, objective, unsharded_params_per_stage)
        per_stage = p + g + o + np.asarray(comm_buffer_bytes, dtype=np.float64)
        per_device = _per_device(per_stage, device_of_stage)
        if not math.isfinite(self.capacity_bytes):
            return np.full(per_device.shape, math.inf)
        return self.usable_bytes - per_device

    def breakdown(
        self,
        params_per_stage,
        comm_buffer_bytes,
        activation_peak_bytes,
        objective: str,
        *,
        offloaded_peak_bytes=None,
        device_of_stage: Sequence[int] | None = None,
        unsharded_params_per_stage=None,
    ) -> list[DeviceMemory]:
        """Memory of every device by kind (one :class:`DeviceMemory` per device).

        Parameters
        ----------
        params_per_stage, comm_buffer_bytes : float arrays (S,)
        activation_peak_bytes : float array (num_devices,)
            Peak of each device's activation curve under the chosen schedule (net of
            offloaded stashes), e.g. :func:`fxpipe.schedule.validate.peak_memory`.
        objective : {"training", "inference"}
        offloaded_peak_bytes : float array (num_devices,), optional
            Most bytes of stashes the device holds in host memory at once
            (:func:`fxpipe.schedule.validate.offloaded_peak`).
        device_of_stage : sequence of int, optional
            Default: stage s on device s (then "device" and "stage" coincide).
        unsharded_params_per_stage : float array (S,), optional
            Per-block FSDP2 units' working set (:meth:`static_bytes`).
        """
        p, g, o = self.static_bytes(params_per_stage, objective, unsharded_params_per_stage)
        comm = np.asarray(comm_buffer_bytes, dtype=np.float64)
        dev = [_per_device(x, device_of_stage) for x in (p, g, o, comm)]
        act = np.asarray(activation_peak_bytes, dtype=np.float64)
        if act.shape != dev[0].shape:
            raise InputError(f"activation_peak_bytes must have one entry per device ({dev[0].shape[0]}), got {act.shape}")
        off = np.zeros_like(act) if offloaded_peak_bytes is None else np.asarray(offloaded_peak_bytes, dtype=np.float64)
        n_stages = len(np.asarray(params_per_stage))
        dev_of = list(range(n_stages)) if device_of_stage is None else [int(x) for x in device_of_stage]
        return [
            DeviceMemory(
                device=d,
                stages=tuple(s for s in range(n_stages) if dev_of[s] == d),
                params_bytes=float(dev[0][d]),
                grads_bytes=float(dev[1][d]),
                optimizer_bytes=float(dev[2][d]),
                activation_peak_bytes=float(act[d]),
                comm_buffer_bytes=float(dev[3][d]),
                reserved_bytes=self.reserved_bytes,
                offloaded_peak_bytes=float(off[d]),
                capacity_bytes=self.capacity_bytes,
            )
            for d in range(act.shape[0])
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON form (a plan's ``memory`` entry); an unlimited capacity is ``null``."""
        p = self._policy
        return {
            "capacity_bytes": None if not math.isfinite(self.capacity_bytes) else self.capacity_bytes,
            "policy": {"name": p.name, "weight_bytes": p.weight_bytes, "grad_bytes": p.grad_bytes,
                       "optimizer_bytes": p.optimizer_bytes},
            "data_parallel": int(self.data_parallel),
            "zero_stage": int(self.zero_stage),
            "reserved_fraction": float(self.reserved_fraction),
            "offload_optimizer": self.offload_optimizer,
            "fsdp_units": self.fsdp_units,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "MemoryModel":
        """Inverse of :meth:`to_dict`.

        Raises
        ------
        InputError
            On a malformed document.
        """
        try:
            pol = doc["policy"]
            policy = pol if isinstance(pol, str) else PrecisionPolicy(
                str(pol["name"]), float(pol["weight_bytes"]), float(pol["grad_bytes"]), float(pol["optimizer_bytes"])
            )
            named = POLICIES.get(policy) if isinstance(policy, str) else POLICIES.get(policy.name)
            if named is not None and not isinstance(policy, str) and (
                    (named.weight_bytes, named.grad_bytes, named.optimizer_bytes)
                    == (policy.weight_bytes, policy.grad_bytes, policy.optimizer_bytes)):
                policy = named.name  # a named policy round-trips as its name
            cap = doc.get("capacity_bytes")
            return cls(
                capacity_bytes=math.inf if cap is None else float(cap),
                policy=policy,
                data_parallel=int(doc.get("data_parallel", 1)),
                zero_stage=int(doc.get("zero_stage", 0)),
                reserved_fraction=float(doc.get("reserved_fraction", DEFAULT_RESERVED_FRACTION)),
                offload_optimizer=None if doc.get("offload_optimizer") is None else bool(doc["offload_optimizer"]),
                fsdp_units=doc.get("fsdp_units"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"malformed memory model {dict(doc)!r:.200}: {exc}") from None


def _per_device(per_stage: np.ndarray, device_of_stage: Sequence[int] | None) -> np.ndarray:
    per_stage = np.asarray(per_stage, dtype=np.float64)
    if device_of_stage is None:
        return per_stage.copy()
    dev = np.asarray(device_of_stage, dtype=np.int64)
    if dev.shape != per_stage.shape:
        raise InputError(f"device_of_stage must have one entry per stage ({per_stage.shape[0]}), got {dev.shape}")
    if dev.size and dev.min() < 0:
        raise InputError("device_of_stage entries must be >= 0")
    return np.bincount(dev, weights=per_stage, minlength=int(dev.max()) + 1 if dev.size else 0)
