"""The partitioner's view of fxpipe's one memory model (:mod:`fxpipe.memory`).

This module only adapts :class:`fxpipe.memory.MemoryModel` to an :class:`~fxpipe.ir.OpGraph`
and a pipeline position; every byte count comes from :mod:`fxpipe.memory`. A stage at
pipeline position ``s`` of ``k`` holding the nodes ``V_s`` needs

``num_params(V_s) * static_bytes_per_param``
    weights, gradients and optimizer state under the model's precision policy and ZeRO
    sharding (:meth:`MemoryModel.static_bytes_per_param`, 16 bytes per parameter for the
    default mixed-precision Adam), plus with per-block FSDP2 units the full weights and gradients
    of what the stage holds unsharded (:mod:`fxpipe.memory.fsdp`: its root unit and two blocks;
    the kernels count the root per node and twice the graph's largest block per stage),
``+ inflight[s] * act_bytes(V_s)``
    its stashes by the activation rule (:func:`fxpipe.memory.inflight_stashes`: ``"floor"``,
    one stash, the default, which no schedule can do without; ``"1f1b"``, ``min(k - s, m)``),
``+ f_in[s] * in_bytes(V_s) + f_out * out_bytes(V_s)``
    the receive buffers (:meth:`MemoryModel.comm_buffer_factors`) of the stage's Contract-2
    boundary bytes (``comm="relay"``: everything crossing its two boundaries): in training one
    per micro-batch for every gradient received backward (relay: only the tensors that carry
    one, :func:`differentiable`; dag: every output), and for every tensor received forward one
    per micro-batch a pipelined schedule keeps in flight plus the one the next receive fills
    (``min(k - s, m) + 1``: fxpipe's runtime reuses them across micro-batches, and neither
    offload nor recomputation frees them) on every stage but the last, one per micro-batch on
    the last,

and must fit ``capacity - reserved`` (:attr:`MemoryModel.usable_bytes`). A block that does
not fit is infeasible: the SliceGraph DP gives it cost ``inf``. With
:attr:`PartitionMemory.checkpointing` (the planner sets it in training unless
``activation_checkpointing="none"``) a stage's stash is the smaller of its ``act_bytes`` and
what per-block checkpointing keeps plus one block's replay (:func:`activation_floor`): a stage
that fits only with a checkpoint policy is admitted with it.

Parameters are counted as parameters (:func:`num_params`): from the per-node ``num_params``
key of a captured graph (Contract 1 keeps unknown keys), else from ``size_param_bytes``
divided by ``meta["param_dtype_bytes"]``, else by :data:`DEFAULT_PARAM_DTYPE_BYTES`.
"""

from __future__ import annotations

import dataclasses as _dc
import math
from dataclasses import dataclass

import numpy as np

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import OpGraph
from fxpipe.memory import ACTIVATION_RULES, MemoryModel, format_bytes, inflight_stashes
from fxpipe.partition.objective import io_bytes

__all__ = [
    "DEFAULT_PARAM_DTYPE_BYTES",
    "PartitionMemory",
    "as_partition_memory",
    "differentiable",
    "fewest_stages_to_try",
    "infeasible_error",
    "memory_remedies",
    "memory_inputs",
    "num_params",
    "stage_memory_bytes",
]

#: Bytes per parameter assumed for a graph that records neither ``num_params`` per node nor
#: ``meta["param_dtype_bytes"]`` (bf16, the dtype large models are planned in).
DEFAULT_PARAM_DTYPE_BYTES = 2.0


def num_params(graph: OpGraph) -> np.ndarray:
    """Parameters owned by every node (float64 (n,)): see the module docstring.

    Raises
    ------
    InputError
        If ``num_params`` keys are malformed or ``param_dtype_bytes`` is not positive.
    """
    extra = graph.extra
    if extra and len(extra) == graph.n and all("num_params" in e for e in extra):
        try:
            out = np.array([float(e["num_params"]) for e in extra], dtype=np.float64)
        except (TypeError, ValueError):
            raise InputError("the graph's per-node num_params must be numbers") from None
        if np.any(out < 0) or not np.all(np.isfinite(out)):
            raise InputError("the graph's per-node num_params must be finite counts >= 0")
        return out
    per = graph.meta.get("param_dtype_bytes", DEFAULT_PARAM_DTYPE_BYTES)
    try:
        per = float(per)
    except (TypeError, ValueError):
        per = -1.0
    if not (math.isfinite(per) and per > 0):
        raise InputError(f"the graph's meta param_dtype_bytes must be a positive number, got {graph.meta.get('param_dtype_bytes')!r}")
    return np.asarray(graph.size_param_bytes, dtype=np.float64) / per


@dataclass(frozen=True)
class PartitionMemory:
    """How the partitioner counts a stage's memory: a :class:`MemoryModel` plus what it needs
    to know of the pipeline before there is a schedule.

    Attributes
    ----------
    model : MemoryModel
        Capacity, precision policy, ZeRO sharding, reserved fraction.
    num_microbatches : int
        m (receive buffers are one per micro-batch; the ``"1f1b"`` rule caps at m).
    activation : {"floor", "1f1b"}
        Activation rule (:func:`fxpipe.memory.inflight_stashes`).
    checkpointing : bool
        A stage may checkpoint its activations (issue 28; training only): its stash counts what
        per-block checkpointing keeps where that is less (:func:`activation_floor`).
    """

    model: MemoryModel
    num_microbatches: int = 1
    activation: str = "floor"
    checkpointing: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, MemoryModel):
            raise InputError(f"model must be a fxpipe.memory.MemoryModel, got {type(self.model).__name__}")
        if isinstance(self.num_microbatches, bool) or not isinstance(self.num_microbatches, (int, np.integer)) \
                or self.num_microbatches < 1:
            raise InputError(f"num_microbatches must be an integer >= 1, got {self.num_microbatches!r}")
        if self.activation not in ACTIVATION_RULES:
            raise InputError(f"activation must be one of {ACTIVATION_RULES}, got {self.activation!r}")

    @property
    def capacity_bytes(self) -> float:
        """Bytes of one device."""
        return self.model.capacity_bytes

    @property
    def usable_bytes(self) -> float:
        """What a stage may hold: ``capacity - reserved``."""
        return self.model.usable_bytes

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "num_microbatches": int(self.num_microbatches), "activation": self.activation,
                "checkpointing": bool(self.checkpointing)}


def as_partition_memory(memory) -> PartitionMemory | None:
    """``None`` -> ``None``; a number -> the default model with that capacity in bytes; a
    :class:`MemoryModel` -> counted with one micro-batch and the ``"floor"`` rule; a
    :class:`PartitionMemory` -> itself. An unlimited capacity gives ``None``.

    Raises
    ------
    InputError
        For anything else, or a non-positive capacity.
    """
    if memory is None:
        return None
    if isinstance(memory, PartitionMemory):
        out = memory
    elif isinstance(memory, MemoryModel):
        out = PartitionMemory(memory)
    elif isinstance(memory, bool) or not isinstance(memory, (int, float, np.integer, np.floating)):
        raise InputError(f"memory must be None, a capacity in bytes, a MemoryModel or a PartitionMemory; got {memory!r}")
    else:
        out = PartitionMemory(MemoryModel(capacity_bytes=float(memory)))
    return None if not math.isfinite(out.capacity_bytes) else out


def differentiable(graph: OpGraph) -> np.ndarray:
    """Which nodes' outputs carry a gradient in training, bool (n,).

    A node's output requires grad when the node owns parameters (:func:`num_params`) or one of
    its inputs requires grad; graph inputs (data) do not. torch's ``PipelineStage`` allocates a
    gradient receive buffer only for a stage output that requires grad (torch 2.13 ``stage.py``,
    ``_create_grad_recv_info``), so masks, position ids and rotary tables computed from the inputs
    and buffers get none. Conservative: an op with integer or boolean outputs downstream of a
    parameter (a router's top-k indices) counts as differentiable.
    """
    hit = _DIFFERENTIABLE.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1].copy()
    import networkx as nx  # noqa: PLC0415 - heavy import kept off the partitioner's import path

    dag = nx.DiGraph()
    dag.add_nodes_from(range(graph.n))
    dag.add_edges_from(graph.edges.tolist())
    out = num_params(graph) > 0
    for v in nx.topological_sort(dag):
        if not out[v]:
            out[v] = any(out[u] for u in graph.predecessors(v))
    if len(_DIFFERENTIABLE) > 8:
        _DIFFERENTIABLE.clear()
    _DIFFERENTIABLE[id(graph)] = (graph, out.copy())  # the graph object is kept: its id stays its own
    return out


#: :func:`differentiable` per graph object (the mesh search asks for every candidate's partition).
_DIFFERENTIABLE: dict[int, tuple] = {}


def activation_floor(graph: OpGraph, objective: str, memory) -> tuple[np.ndarray, float] | None:
    """What a stage that may checkpoint keeps per micro-batch, per node, and its replay allowance (bytes).

    None unless ``memory`` is a :class:`PartitionMemory` with ``checkpointing`` in training. A stage
    running per-block ``"full"`` checkpointing keeps the inputs of its blocks and what its ops outside
    every block save (:func:`fxpipe.memory.checkpoint.partition_floor`), and while its (fused: nothing
    held for W) backward runs one replayed block on top (the allowance, the graph's largest), once per
    stage: the stage's stash is the smaller of its ``act_bytes`` and that.
    """
    pm = memory if isinstance(memory, PartitionMemory) else None
    if pm is None or not pm.checkpointing or objective != "training":
        return None
    from fxpipe.memory.checkpoint import partition_floor  # noqa: PLC0415 - the module is torch-free

    kept, allowance = partition_floor(graph)
    return kept, float(allowance)


def memory_inputs(graph: OpGraph, k: int, objective: str, memory) -> tuple:
    """Kernel arrays ``(mem_param (n,), mem_act (n,), inflight (k,), usable_bytes, buf_in (k,), buf_out, size_grad (n,))``.

    ``mem_param`` are static bytes per node, ``mem_act`` its stash bytes, ``buf_in[s]`` /
    ``buf_out`` the receive-buffer bytes per byte of the input / output boundary of the block
    at pipeline position ``s``, ``size_grad`` the output bytes that come back as a gradient
    (:func:`differentiable`; the relay output boundary counts only those). Without a memory
    model: zeros and ``usable_bytes = inf``. With ``checkpointing`` the stash is
    :func:`activation_floor`'s and the usable bytes are less its replay allowance (the kernels
    sum per node, so they count every stage as checkpointing, never less than
    :func:`stage_memory_bytes`, which takes the smaller of the two per stage).
    """
    pm = as_partition_memory(memory)
    n = graph.n
    if pm is None:
        return np.zeros(n), np.zeros(n), np.ones(k), math.inf, np.zeros(k), 0.0, np.zeros(n)
    f_in, f_out = pm.model.comm_buffer_factors(k, pm.num_microbatches, objective)
    floor = activation_floor(graph, objective, pm)
    act, allowance = (np.array(graph.act_bytes, dtype=np.float64), 0.0) if floor is None else floor
    params = num_params(graph)
    static = params * pm.model.static_bytes_per_param(objective)
    unsharded = pm.model.unsharded_bytes_per_param(objective)
    if unsharded:  # per-block FSDP2 units: the root's per node, two of the largest blocks per stage (an upper bound)
        from fxpipe.memory.fsdp import additive_unsharded  # noqa: PLC0415 - torch-free

        per_node, per_stage = additive_unsharded(graph, params)
        static = static + per_node * unsharded
        allowance += per_stage * unsharded
    return (
        np.array(static, dtype=np.float64),
        np.ascontiguousarray(act, dtype=np.float64),
        inflight_stashes(k, pm.num_microbatches, pm.activation, objective),
        float(pm.usable_bytes) - allowance,
        np.ascontiguousarray(f_in, dtype=np.float64),
        f_out,
        np.where(differentiable(graph), np.asarray(graph.size_out_bytes, dtype=np.float64), 0.0),
    )


def stage_memory_bytes(graph: OpGraph, assignment, k: int, objective: str, memory, comm: str = "relay") -> np.ndarray:
    """Bytes every stage needs by the partitioner's rule, float64 (k,), blocks in pipeline order.

    Static state + ``inflight`` stashes + receive buffers (module docstring); compare with
    ``as_partition_memory(memory).usable_bytes``. ``memory=None`` counts with the default
    model (mixed-precision Adam) and no capacity.
    """
    if isinstance(memory, PartitionMemory):
        pm = memory
    else:
        pm = PartitionMemory(MemoryModel() if memory is None else as_model(memory))
    a = np.asarray(assignment, dtype=np.int64)
    params = num_params(graph)
    static = np.bincount(a, weights=params * pm.model.static_bytes_per_param(objective), minlength=k)
    unsharded = pm.model.unsharded_bytes_per_param(objective)
    if unsharded:  # per-block FSDP2 units: what each stage holds unsharded
        from fxpipe.memory.fsdp import unsharded_params  # noqa: PLC0415 - torch-free

        static = static + unsharded_params(graph, a, k, params) * unsharded
    act = np.bincount(a, weights=graph.act_bytes, minlength=k)
    in_b, out_b = io_bytes(graph, a, k, comm)
    if comm == "relay":  # gradient buffers: only the relayed tensors that carry one
        out_b = io_bytes(graph, a, k, comm, producers=differentiable(graph))[1]
    f_in, f_out = pm.model.comm_buffer_factors(k, pm.num_microbatches, objective)
    inflight = inflight_stashes(k, pm.num_microbatches, pm.activation, objective)
    stash = act * inflight
    floor = activation_floor(graph, objective, pm)
    if floor is not None:  # a stage that fits only when it checkpoints is admitted with it
        stash = np.minimum(stash, np.bincount(a, weights=floor[0], minlength=k) * inflight + floor[1])
    return static + stash + f_in * in_b + f_out * out_b


def as_model(memory) -> MemoryModel:
    """The :class:`MemoryModel` of a capacity, model or :class:`PartitionMemory`."""
    if isinstance(memory, PartitionMemory):
        return memory.model
    if isinstance(memory, MemoryModel):
        return memory
    return MemoryModel(capacity_bytes=float(memory))


def fewest_stages_to_try(graph: OpGraph, k: int, objective: str, memory) -> int:
    """The first stage count above ``k`` that could fit: every stage holds its static state and
    one stash (with ``checkpointing``, at least what per-block checkpointing keeps), so no count
    below ``total / usable`` fits (the search for the smallest feasible count of
    :func:`infeasible_error` starts here)."""
    pm = memory if isinstance(memory, PartitionMemory) else as_partition_memory(memory)
    floor = activation_floor(graph, objective, pm)
    act = float(np.sum(graph.act_bytes)) if floor is None else min(float(np.sum(graph.act_bytes)), float(np.sum(floor[0])))
    total = float(np.sum(num_params(graph)) * pm.model.static_bytes_per_param(objective) + act)
    return max(k + 1, int(math.ceil(total / pm.usable_bytes - 1e-9)))


def infeasible_error(graph: OpGraph, k: int, objective: str, comm: str, memory, *, free_assignment,
                     min_devices: int | None, max_k: int) -> InfeasibleError:
    """The :class:`InfeasibleError` for "no partition into k stages fits in memory".

    Computed, not guessed, from figures the caller (:func:`fxpipe.partition.search.partition`)
    searched: ``free_assignment`` is the best partition into ``k`` stages ignoring memory; it
    gives the bytes its biggest stage needs by the partitioner's rule and by how much that
    overflows the usable capacity. ``min_devices`` is the smallest feasible stage count found
    by trying ``fewest_stages_to_try(...)``, ... up to ``max_k`` (None if none fits).
    :func:`memory_remedies` says whether offload, activation recomputation or ZeRO sharding
    would help. The attributes ``overflow_bytes``, ``required_capacity_bytes`` (a capacity
    whose usable part holds that stage), ``stage``, ``min_devices`` and ``remedies`` (dict:
    ``"devices"``, ``"offload"``, ``"recompute"``, ``"zero"`` -> one sentence each) carry the
    figures.
    """
    pm = as_partition_memory(memory)
    mem = stage_memory_bytes(graph, free_assignment, k, objective, pm, comm)
    worst = int(np.argmax(mem))
    need = float(mem.max())
    over = need - pm.usable_bytes
    required = need / (1.0 - pm.model.reserved_fraction)
    remedies = memory_remedies(graph, free_assignment, k, objective, comm, pm)
    if min_devices is not None:
        remedies["devices"] = (f"More devices would help: use at least {min_devices} devices (the smallest pipeline that "
                               f"fits), or devices with >= {required:.0f} bytes.")
    else:
        remedies["devices"] = f"No device count up to {max_k} fits; use devices with >= {required:.0f} bytes."
    msg = (
        f"no partition into {k} stages fits in {format_bytes(pm.capacity_bytes)} per device "
        f"({format_bytes(pm.usable_bytes)} usable; {objective}): the best partition ignoring memory needs "
        f"{format_bytes(need)} on stage {worst} (overflow {format_bytes(over)} = {over:.0f} bytes). "
    )
    msg += " ".join(remedies[key] for key in ("devices", "offload", "recompute", "zero", "host") if key in remedies)
    return InfeasibleError(msg, overflow_bytes=over, required_capacity_bytes=required, stage=worst,
                           min_devices=min_devices, remedies=remedies)


#: Data-parallel degrees :func:`memory_remedies` tries ZeRO sharding over.
ZERO_DEGREES = (2, 4, 8, 16, 32, 64)


def memory_remedies(graph: OpGraph, assignment, k: int, objective: str, comm: str, memory) -> dict[str, str]:
    """Which remedy would let ``assignment`` (a partition that overflows) fit, one sentence each.

    Keys ``"offload"``, ``"recompute"``, ``"zero"``, ``"devices"``, and ``"host"`` when keeping the
    optimizer state on the host (:attr:`fxpipe.memory.MemoryModel.offload_optimizer`, not already
    set) would fit ``assignment`` by the ``"floor"`` rule. Offload and activation
    recomputation reduce the micro-batches whose stashes are on the device at once, never
    below one stash (:data:`fxpipe.memory.ACTIVATION_RULES`, ``"floor"``): they help only
    when static state + one stash of every stage fits. ZeRO sharding (Rajbhandari et al. 2020,
    Sec. 5) divides the static state over a data-parallel degree: the smallest degree of
    :data:`ZERO_DEGREES` dividing the micro-batches at which ZeRO-1 fits every stage of
    ``assignment`` is named as the mesh that runs it (``pp=k x dp_shard=d``); failing that, the
    smallest degree and stage at which ZeRO-2/3 would fit, with the note that fxpipe's pipeline
    runtime does not give their memory.
    """
    pm = memory if isinstance(memory, PartitionMemory) else as_partition_memory(memory)
    floor = _dc.replace(pm, activation="floor", checkpointing=False)
    need_floor = stage_memory_bytes(graph, assignment, k, objective, floor, comm)
    fits_floor = bool(need_floor.max() <= pm.usable_bytes)
    ckpt = _dc.replace(floor, checkpointing=True)
    need_ckpt = stage_memory_bytes(graph, assignment, k, objective, ckpt, comm)
    out: dict[str, str] = {}
    if fits_floor:
        out["offload"] = ("Offloading stashes to host memory would help: static state plus one micro-batch's stash "
                          "fits every stage.")
        out["recompute"] = ("Activation checkpointing would help: it keeps fewer activations between F and B "
                            "(activation_checkpointing='auto').")
    else:
        s = int(np.argmax(need_floor))
        out["offload"] = (f"Offload would not help: stage {s}'s static state, receive buffers and a single "
                          f"micro-batch's stash ({format_bytes(float(need_floor[s]))}) already exceed the usable "
                          f"{format_bytes(pm.usable_bytes)}.")
        c = int(np.argmax(need_ckpt))
        if objective == "training" and need_ckpt.max() <= pm.usable_bytes:
            out["recompute"] = ("Per-block activation checkpointing would help: keeping only each block's inputs and "
                                f"replaying one block at a time, the largest stage needs {format_bytes(float(need_ckpt[c]))} "
                                "(activation_checkpointing='auto' or 'full').")
        else:
            out["recompute"] = ("Activation checkpointing would not help either: even keeping only each block's inputs "
                                f"and replaying one block at a time, stage {c} needs {format_bytes(float(need_ckpt[c]))}.")
    zero = None
    if objective == "training":
        # ZeRO-1 at any degree first: it is what a mesh runs (dp_shard), and it must divide the micro-batches
        tries = [(d, 1) for d in ZERO_DEGREES if pm.num_microbatches % d == 0]
        tries += [(d, z) for z in (2, 3) for d in ZERO_DEGREES]
        for d, z in tries:
            if pm.model.zero_stage >= z and pm.model.data_parallel >= d:
                continue
            # ZeRO-3 as fxpipe runs it: per-block FSDP2 units, the root and two blocks unsharded (fxpipe.memory.fsdp)
            units = "block" if z == 3 else pm.model.fsdp_units
            m2 = _dc.replace(floor, model=_dc.replace(pm.model, data_parallel=d, zero_stage=z, fsdp_units=units))
            if stage_memory_bytes(graph, assignment, k, objective, m2, comm).max() <= pm.usable_bytes:
                zero = (d, z)
                break
    if zero and zero[1] == 1:
        out["zero"] = (f"A mesh of {k * zero[0]} devices, pp={k} x dp_shard={zero[0]} (mesh=, --mesh; fxpipe shards "
                       f"the optimizer state over dp_shard, ZeRO-1), would fit this partition (with offload or "
                       f"recomputation where the schedule needs it).")
    elif zero and zero[1] == 3 and pm.num_microbatches % zero[0] == 0:
        out["zero"] = (f"A mesh of {k * zero[0]} devices, pp={k} x dp_shard={zero[0]} with per-block FSDP2 units "
                       "(ZeRO-3: MemoryModel(fsdp_units='block'), --fsdp-units block; the default when whole-stage units "
                       "do not fit), would fit this partition.")
    elif zero:
        out["zero"] = (f"ZeRO-{zero[1]} sharding over {zero[0]} data-parallel replicas would fit this partition, but "
                       "fxpipe's pipeline runtime gives ZeRO-1's memory only (torch's PipelineStage keeps a stage's "
                       "full parameters and gradients for the whole step).")
    else:
        out["zero"] = f"ZeRO sharding over up to {ZERO_DEGREES[-1]} data-parallel replicas would not fit this partition."
    if objective == "training" and pm.model.offload_optimizer is not True:
        hosted = _dc.replace(floor, model=_dc.replace(pm.model, offload_optimizer=True))
        if stage_memory_bytes(graph, assignment, k, objective, hosted, comm).max() <= pm.usable_bytes:
            out["host"] = ("Keeping the optimizer state on the host would fit this partition (MemoryModel("
                           "offload_optimizer=True), --offload-optimizer; ZeRO-Offload: the devices hold weights and "
                           "gradients only, the optimizer steps on the host).")
    out["devices"] = "More pipeline devices would help (smaller stages)."  # refined by infeasible_error
    return out
