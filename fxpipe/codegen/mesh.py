"""Pipeline x data parallelism at run time: a rank's stages on a ``DeviceMesh``, wrapped by FSDP2.

A mesh plan (:mod:`fxpipe.mesh`: ``pp`` x ``dp_shard`` x ``dp_replicate``) runs ``dp =
dp_shard * dp_replicate`` copies of one pipeline. Every rank belongs to one replica (its
``pp`` ranks, consecutive under the default rank order, :func:`fxpipe.mesh.rank_coords`; the
``DeviceMesh`` is laid out in the same rank order, its dimensions named outermost first, so
torch's sub-mesh groups are exactly the ranks fxpipe's mapping gives) and builds its pipeline stages with
:func:`fxpipe.codegen.rank.build_rank` over the replica's ``pp`` process group; every stage
module is then wrapped in place over the data-parallel sub-mesh of the ranks holding the same
stage in the other replicas:

* ``dp_shard > 1``: ``torch.distributed.fsdp.fully_shard`` over ``dp_shard`` (ZeRO-3: sharded
  parameters, gradients and optimizer state), HSDP over ``(dp_replicate, dp_shard)`` when
  ``dp_replicate > 1`` too;
* ``dp_shard == 1 < dp_replicate``: FSDP2's ``replicate`` over ``dp_replicate`` (DDP).

Gradient synchronisation happens once per step, not per micro-batch: torch's pipelining runtime
(``_PipelineScheduleRuntime``, on which :class:`~fxpipe.codegen.runtime.FxpipeScheduleRuntime`
is built) lowers a schedule with ``_add_unshard_reshard`` (all-gather a stage's parameters
before its compute actions, free them after) and ``_add_reduce_grad`` (one ``REDUCE_GRAD`` per
stage after its last backward); every backward runs with ``set_requires_gradient_sync(False)``
and ``set_reshard_after_backward(False)`` (``PipelineStage.backward_maybe_with_nosync``), and
``REDUCE_GRAD`` runs FSDP's post-backward (reduce-scatter / all-reduce, averaged over the
replicas). Split backward (``I`` / ``W`` actions) works the same way: while a stage is
unsharded its module holds the unsharded parameters, whose gradients the ``W`` pass
accumulates. fxpipe's runtime then divides by the replica's micro-batches and all-reduces tied
parameters over the pipeline ranks of the replica (the local shards line up, every pipeline
rank shards a tied parameter the same way), so the gradients equal those of one process
training on the global batch with the mean micro-batch loss.

Per-block FSDP2 units (``plan.memory.fsdp_units == "block"``, ``fsdp_blocks=`` here; ZeRO-3 during the
step, :mod:`fxpipe.memory.fsdp` is their memory model): every repeated block of a stage is carved into a
submodule that owns its parameters (:mod:`fxpipe.codegen.fsdp_blocks`) and wrapped by ``fully_shard`` on
its own, then the stage (its root unit), as torchtitan wraps a model. torch's ``UNSHARD`` action then
all-gathers the root only (:func:`fxpipe.codegen.runtime.mark_block_units`); each block is all-gathered
by its own forward and backward pre-hooks (FSDP2 prefetches the next one in the backward), resharded
after its forward and its backward, and its gradients are reduce-scattered after every micro-batch's
backward into its sharded gradient (:func:`fxpipe.codegen.runtime.block_unit_backward`); only the root
defers its gradient sync to ``REDUCE_GRAD``. The backward runs fused (B and W as one), per-block
activation-checkpoint segments move into their blocks, tensor parallelism composes (each block's DTensor
parameters 2-D ``fully_shard`` ed over (dp_shard, tp)), and what does not run with them yet (activation or
optimizer offload, whole-stage recomputation, ``compile_stages``, several
parameter dtypes) is refused (:func:`check_block_units_run`; the planner never offers it).

Batches: every replica trains on its slice of the global batch,
:func:`replica_slice` (``split_microbatches(batch, dp)[replica]``), so with a global batch
of ``microbatches`` x micro-batch size along dim 0 replica ``r`` runs the global micro-batches
``r * m .. r * m + m - 1`` (``m = microbatches / dp``), exactly those of the single-process run.

A tied parameter held by two stages of one rank (GPT-2's embedding on a V placement) becomes
one copy per stage (FSDP2 cannot manage one parameter in two modules) whose gradients are
summed; the optimizer must then take ``schedule.parameters()`` (every copy).

Optimizer-state offload (``MemoryModel.offload_optimizer``, a plan's ``plan.memory``;
``offload_optimizer=True`` here): ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing
Billion-Scale Model Training", USENIX ATC) with FSDP2's ``CPUOffloadPolicy``. Every stage module
is wrapped as above with ``offload_policy=CPUOffloadPolicy(pin_memory=<device is CUDA>)``: the
sharded parameters (the optimizer's parameters), their gradients and so the optimizer state
live in host memory, and ``optimizer.step()`` over ``schedule.parameters()`` runs on the host.
``UNSHARD`` copies a stage's shard to the device and all-gathers it there; ``REDUCE_GRAD``
reduces the gradients on the device and copies the result to the host (FSDP waits for the
copy before it returns). A pure pipeline (``dp == 1``) is then wrapped by ``fully_shard``
over its size-1 ``dp_shard`` sub-mesh (the ranks are still the pipeline ranks, the ``DeviceMesh``
has the size-1 dimensions); ``dp_shard == 1 < dp_replicate`` by ``replicate`` with the same
policy (the host then holds a full copy per replica, as ``MemoryModel.host_bytes_per_param``
with ``data_parallel == dp_shard == 1`` counts). fxpipe's own gradient work after
``REDUCE_GRAD`` handles host gradients on an accelerator: the division by the micro-batch count
runs on the host tensors; the sum of tied parameters' gradients over pipeline ranks
(:meth:`~fxpipe.codegen.runtime.FxpipeScheduleRuntime.sync_shared_grads`) stages them on the
device for the collective (NCCL reduces device tensors only); :func:`full_tensors` all-gathers
on the device and returns host tensors. Checkpoints (:mod:`fxpipe.codegen.checkpoint`, DCP)
read and write the host shards in place.

Activation recomputation and offload/reload (``recompute_stages``, ``O`` / ``R`` actions in the
orders) run under FSDP2 and ``replicate`` as without data parallelism
(:mod:`fxpipe.codegen.stash`): inside a stage forward the module holds its unsharded parameters
(other tensors than the sharded DTensors), which the stash reads there as resident, so they are
never stashed, counted or offloaded; a recomputation replays the stage forward without FSDP2's
forward hooks (:func:`fxpipe.codegen.runtime.forward_without_dp_hooks`: the stage is unsharded
between torch's ``UNSHARD`` and ``RESHARD`` actions, and the replayed graph, discarded, must not
register hooks or leave FSDP2's training state in ``FORWARD``), once per micro-batch, split
backward included; gradients reach the unsharded parameters only through the original graph, so
``REDUCE_GRAD`` reduces them as without recomputation. A stage's checkpointed segments
(:mod:`fxpipe.codegen.checkpointing`) take the unsharded parameters as inputs and replay on them
(after ``module.unshard()``, :func:`fxpipe.codegen.runtime.dp_unshard_fn`).

Parameters of several dtypes (a bfloat16 model with float32 layers): FSDP2 reduces a unit's
parameters as one flat buffer of one dtype, so every stage is wrapped as one unit per dtype, the
submodules holding the parameters of each extra dtype first (:func:`dtype_units`); gradients stay
those of one process. A model with a submodule holding two dtypes itself cannot be wrapped so:
``fxpipe.compile`` records why (:func:`data_parallel_limit`) and the mesh search offers only the
pure pipeline (:mod:`fxpipe.mesh.limits`).

Tensor parallelism (``tp > 1``, always the innermost mesh dimension): the ``DeviceMesh`` gets a
fourth dimension ``tp`` after the rank order's three, every pipeline (one per replica and
tensor-parallel rank) runs over the ``pp`` ranks of one ``tp`` index, and each stage module is
first made tensor-parallel over the ``tp`` sub-mesh (:mod:`fxpipe.codegen.tensor_parallel`:
DTensor parameters with the planned placements, layout conversions between the split regions,
the sequence-parallel ops and the replicated rest), then wrapped by FSDP2 over ``dp_shard`` (2-D
``fully_shard`` over ``(dp_shard, tp)``, as torchtitan does: FSDP2 shards the DTensor
parameters' local shards further) or ``replicate`` over ``dp_replicate``. The tied-parameter
groups are per replica and tensor-parallel rank (the local shards line up).

Not yet supported with data parallelism or optimizer offload (a clear error): ``compile_stages``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from fxpipe.codegen.interface import split_microbatches
from fxpipe.codegen.rank import build_rank
from fxpipe.codegen.runtime import replicate_module
from fxpipe.errors import InputError
from fxpipe.ir.schedule import Orders
from fxpipe.mesh import (MESH_DIMS, TP_DIM, format_mesh, mesh_degrees, mesh_dp, mesh_rank_order, mesh_tp, normalize_mesh,
                         normalize_rank_order, rank_coords, rank_of)

__all__ = [
    "MeshRank",
    "init_mesh",
    "mesh_rank",
    "data_parallel_wrapper",
    "dtype_units",
    "data_parallel_limit",
    "make_shared_param_groups",
    "build_mesh_rank",
    "check_mesh_run",
    "check_offload_run",
    "replica_slice",
    "full_tensors",
]


@dataclass(frozen=True)
class MeshRank:
    """One rank's place on the mesh.

    Attributes
    ----------
    mesh : dict
        ``{"pp", "dp_shard", "dp_replicate"}`` degrees (and ``"tp"`` when above 1).
    rank : int
        Global rank.
    coords : dict
        :func:`fxpipe.mesh.rank_coords` (``dp_replicate``, ``dp_shard``, ``pp``, ``replica``, ``tp``).
    device_mesh : torch.distributed.device_mesh.DeviceMesh
        The 3-D mesh, its dimensions in ``rank_order`` (4-D with ``tp`` innermost when ``tp > 1``).
    rank_order : tuple[str, str, str]
        The mesh dimensions outermost first (:func:`fxpipe.mesh.rank_coords`).
    """

    mesh: dict
    rank: int
    coords: dict
    device_mesh: Any
    rank_order: tuple = MESH_DIMS

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline rank (its device in the plan's placement)."""
        return int(self.coords["pp"])

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica, ``0 .. dp - 1``."""
        return int(self.coords["replica"])

    @property
    def dp(self) -> int:
        """Number of data-parallel replicas."""
        return mesh_dp(self.mesh)

    @property
    def tp(self) -> int:
        """Tensor-parallel degree (1 without tensor parallelism)."""
        return mesh_tp(self.mesh)

    @property
    def tp_index(self) -> int:
        """This rank's index in its tensor-parallel group, ``0 .. tp - 1``."""
        return int(self.coords.get(TP_DIM, 0))

    @property
    def tp_mesh(self):
        """The 1-D ``tp`` sub-mesh of this rank (None without tensor parallelism)."""
        return self.device_mesh[TP_DIM] if self.tp > 1 else None

    @property
    def pp_group(self):
        """The process group of this rank's pipeline (its replica's ``pp`` ranks)."""
        return self.device_mesh["pp"].get_group()

    @property
    def data_parallel(self) -> str | None:
        """``"fsdp"``, ``"hsdp"``, ``"replicate"`` or None (no data parallelism)."""
        ds, dr = self.mesh["dp_shard"], self.mesh["dp_replicate"]
        if ds > 1:
            return "hsdp" if dr > 1 else "fsdp"
        return "replicate" if dr > 1 else None


def _order(mesh: Mapping[str, Any], rank_order: Any) -> tuple[str, str, str]:
    """``rank_order``, else the mesh's ``"order"`` entry, else the default (pipeline rank innermost)."""
    return mesh_rank_order(mesh) if rank_order is None else normalize_rank_order(rank_order)


def _mesh_dims(mesh: Mapping[str, Any], order: tuple[str, ...]) -> tuple[str, ...]:
    """The ``DeviceMesh``'s dimension names: the rank order, then ``tp`` (innermost) when it is above 1."""
    return tuple(order) + ((TP_DIM,) if mesh_tp(mesh) > 1 else ())


def init_mesh(mesh: Mapping[str, int], device_type: str = "cpu", rank_order: Any = None):
    """``init_device_mesh`` over the mesh's dimensions in rank order (collective: every rank calls it).

    Needs an initialised default process group of ``pp * dp_shard * dp_replicate * tp`` ranks.
    The device mesh's shape and ``mesh_dim_names`` follow ``rank_order`` (default: the mesh's
    ``"order"`` entry, else :data:`fxpipe.mesh.MESH_DIMS`), outermost first, then ``tp`` when it
    is above 1, so the rank at coordinates ``c`` of the ``DeviceMesh`` (row-major over global
    ranks) is :func:`fxpipe.mesh.rank_of`'s.

    Raises
    ------
    InputError
        If the process group's size is not the mesh's number of devices, or for a bad order.
    """
    from torch.distributed.device_mesh import init_device_mesh

    order = _order(mesh, rank_order)
    m = mesh_degrees(normalize_mesh(mesh))
    world = dist.get_world_size()
    need = m["pp"] * m["dp_shard"] * m["dp_replicate"] * mesh_tp(m)
    if world != need:
        raise InputError(f"mesh {format_mesh(m)} needs {need} ranks but the process group has {world}: "
                         "launch one process per device")
    dims = _mesh_dims(m, order)
    return init_device_mesh(device_type, tuple(m.get(d, 1) for d in dims), mesh_dim_names=dims)


def mesh_rank(mesh: Mapping[str, int], rank: int, device_mesh=None, device_type: str = "cpu",
              rank_order: Any = None) -> MeshRank:
    """The :class:`MeshRank` of global rank ``rank`` (creates the device mesh when not given).

    ``rank_order``: as :func:`init_mesh`; a given ``device_mesh`` must have been made in it.
    """
    order = _order(mesh, rank_order)
    m = mesh_degrees(normalize_mesh(mesh))
    coords = rank_coords(int(rank), m, order)
    if device_mesh is None:
        device_mesh = init_mesh(m, device_type, order)
    elif tuple(device_mesh.mesh_dim_names or ()) != _mesh_dims(m, order):
        raise InputError(f"the device mesh's dimensions {device_mesh.mesh_dim_names} are not in the rank order "
                         f"{_mesh_dims(m, order)}: make it with init_mesh(mesh, rank_order=...) of the same order")
    return MeshRank(m, int(rank), coords, device_mesh, order)


def data_parallel_wrapper(mr: MeshRank, offload_optimizer: bool = False,
                          fsdp_blocks: Sequence[str] | None = None) -> Callable[[int, torch.nn.Module], None] | None:
    """The in-place wrapper of a stage module for :func:`~fxpipe.codegen.rank.build_rank`'s ``wrap_module``.

    ``fully_shard`` over the ``dp_shard`` sub-mesh (HSDP over ``(dp_replicate, dp_shard)``), or
    ``replicate`` over ``dp_replicate``; None without data parallelism.

    With ``offload_optimizer`` (ZeRO-Offload, Ren et al. 2021; the plan's
    ``MemoryModel.offload_optimizer``) the same wrapping gets FSDP2's
    ``CPUOffloadPolicy(pin_memory=...)`` (pinned host memory on a CUDA mesh only: pinning needs
    an accelerator), so the sharded parameters, their gradients and the optimizer's state over
    them live in host memory and the optimizer steps there; without data parallelism the stage
    is wrapped by ``fully_shard`` over the size-1 ``dp_shard`` sub-mesh (the module docstring
    says what runs where).

    With ``fsdp_blocks`` (the module paths of the model's repeated blocks; per-block FSDP2 units,
    ``plan.memory.fsdp_units == "block"``, ``dp_shard > 1``) every block a stage computes is first carved
    into a submodule owning its parameters (:func:`fxpipe.codegen.fsdp_blocks.carve_blocks`) and wrapped
    by ``fully_shard`` on its own, then the stage (its root unit), as torchtitan wraps a model; the
    runtime keeps only the root unsharded for the step (:func:`fxpipe.codegen.runtime.mark_block_units`).
    """
    kind = mr.data_parallel
    if kind is None and not offload_optimizer:
        return None
    policy = {}
    if offload_optimizer:
        from torch.distributed.fsdp import CPUOffloadPolicy

        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=mr.device_mesh.device_type == "cuda")}
    # FSDP2 warns when a wrapped module returns a view: an in-place op on that output would drop its
    # pre-backward hook. A stage's outputs are never modified in place: the next stage gets them through
    # send/recv or, on the same rank, detached (torch's PipelineStage), and the unshard before a backward
    # is an explicit UNSHARD action of the runtime. The warning is noise here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    dm = mr.device_mesh
    if kind == "replicate":
        sub = dm["dp_replicate"]

        def wrap(stage: int, module: torch.nn.Module) -> None:
            for unit in dtype_units(module, f"stage {stage}"):  # one FSDP2 unit per parameter dtype
                for owner in unit:  # replicate takes one module
                    replicate_module(owner, sub, **policy)
            replicate_module(module, sub, **policy)

        return wrap
    from torch.distributed.fsdp import fully_shard

    sub = dm["dp_replicate", "dp_shard"] if kind == "hsdp" else dm["dp_shard"]  # FSDP or offload alone: dp_shard

    def wrap(stage: int, module: torch.nn.Module) -> None:  # noqa: F811 - one of the two wrappers
        if fsdp_blocks:  # per-block units (fxpipe.codegen.fsdp_blocks), then the stage as the root unit
            from fxpipe.codegen.fsdp_blocks import block_modules, carve_blocks
            from fxpipe.codegen.runtime import mark_block_units

            if dtype_units(module, f"stage {stage}"):
                raise InputError(f"stage {stage}: per-block FSDP2 units need one parameter dtype per stage; "
                                 "plan with MemoryModel(fsdp_units='stage')")
            carve_blocks(module, fsdp_blocks, stage)
            for block in block_modules(module):
                fully_shard(block, mesh=sub, **policy)
            fully_shard(module, mesh=sub, **policy)
            mark_block_units(module)
            return
        for unit in dtype_units(module, f"stage {stage}"):  # one FSDP2 unit per parameter dtype
            fully_shard(unit, mesh=sub, **policy)
        fully_shard(module, mesh=sub, **policy)

    return wrap


def dtype_units(module: torch.nn.Module, what: str = "the module") -> list[list[torch.nn.Module]]:
    """Submodules to wrap (each list one FSDP2 unit) before ``module`` so every unit's trainable
    parameters share one dtype.

    FSDP2 all-gathers and reduces a unit's parameters as one flat buffer and requires one original
    dtype per unit ("FSDP expects uniform original parameter dtype"); a ``MixedPrecisionPolicy``
    does not lift that (it checks the original dtypes) and would change the numerics. A stage of a
    model with, e.g., bfloat16 blocks between float32 layers (Hugging Face's
    ``_keep_in_fp32_modules``) therefore becomes one unit per dtype: the submodules that hold the
    parameters of each dtype other than ``module``'s own (the dtype of its direct parameters, else
    the one with the most elements) are wrapped first, ``module`` then takes the rest. Gradients and
    numerics are those of one process (each parameter is reduced in its own dtype). torch's
    pipelining runtime unshards, reshards and reduces every FSDP2 module inside a stage.

    Parameters
    ----------
    module : torch.nn.Module
        A stage module (its submodules hold the parameters; ``requires_grad=False`` ones do not count).
    what : str
        The module's name in error messages.

    Returns
    -------
    list[list[torch.nn.Module]]
        One list of submodules per extra dtype (empty when the trainable parameters share one dtype).

    Raises
    ------
    InputError
        If one submodule holds trainable parameters of two dtypes directly, or a submodule of one
        dtype contains trainable parameters of another (no grouping by submodules separates them).
        ``fxpipe.compile`` finds this on the whole model (:func:`data_parallel_limit`) and the mesh
        search then offers no mesh that needs it.
    """
    units, problem = _dtype_units(module)
    if problem is not None:
        raise InputError(f"{what}: {problem}; data parallelism (FSDP2) needs one dtype per unit: give those "
                         "parameters one dtype, or plan with mesh='pipeline'")
    return units


def _dtype_units(module: torch.nn.Module) -> tuple[list[list[torch.nn.Module]], str | None]:
    """:func:`dtype_units`' units, or ``([], why they cannot be formed)``."""
    owners: list[tuple[str, torch.nn.Module, torch.dtype, int]] = []
    seen: set[int] = set()
    for name, m in module.named_modules():
        direct = [p for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in direct)
        dtypes = {p.dtype for p in direct}
        if len(dtypes) > 1:
            return [], (f"submodule {name or '<root>'!r} holds trainable parameters of several dtypes itself "
                        f"({', '.join(sorted(str(d) for d in dtypes))})")
        if direct:
            owners.append((name, m, direct[0].dtype, sum(p.numel() for p in direct)))
    if len({d for _, _, d, _ in owners}) <= 1:
        return [], None
    if owners[0][0] == "":
        root = owners[0][2]
    else:
        size: dict[torch.dtype, int] = {}
        for _, _, d, n in owners:
            size[d] = size.get(d, 0) + n
        root = max(size, key=size.get)
    units: dict[torch.dtype, list[tuple[str, torch.nn.Module]]] = {}
    for name, m, d, _ in owners:
        if d == root:
            continue
        unit = units.setdefault(d, [])
        if not any(name.startswith(outer + ".") for outer, _ in unit):  # a submodule's parameters come with it
            unit.append((name, m))
    for d, unit in units.items():
        for name, m in unit:
            other = sorted({str(p.dtype) for p in m.parameters() if p.requires_grad and p.dtype != d})
            if other:
                return [], f"submodule {name!r} holds {d} parameters and, inside it, {', '.join(other)} ones"
    return [[m for _, m in unit] for unit in units.values()], None


def block_units_limit(model: torch.nn.Module) -> str | None:
    """Why per-block FSDP2 units (``fsdp_units="block"``) could not wrap ``model``'s stages, or None: they need
    one trainable parameter dtype (a stage of several dtypes is wrapped as one unit per dtype,
    :func:`dtype_units`, which per-block units do not do yet)."""
    units, problem = _dtype_units(model)
    if problem is not None or units:
        return "per-block FSDP2 units need one trainable parameter dtype (the model has several)"
    return None


def data_parallel_limit(model: torch.nn.Module) -> str | None:
    """Why the stages of ``model`` could not be wrapped for data parallelism (FSDP2), or None.

    :func:`dtype_units` on the whole captured module: a submodule that holds trainable parameters of
    two dtypes itself (or of one dtype around a submodule of another) cannot be split into FSDP2 units
    of one dtype. A stage holds a subset of the model's modules, so a model without such a submodule
    has none in its stages. ``fxpipe.compile`` records the reason with the graph
    (:func:`fxpipe.mesh.limits.record_runtime_limits`) and the mesh search skips the meshes it rules out.
    """
    problem = _dtype_units(model)[1]
    return None if problem is None else f"{problem}, and FSDP2 needs one dtype per unit"


def make_shared_param_groups(staged, device_of_stage: Sequence[int], mesh: Mapping[str, int],
                             cache: dict | None = None, rank_order: Any = None) -> dict:
    """Create, collectively and in the same order on every rank, the tied-parameter groups of every replica.

    :func:`~fxpipe.codegen.rank.build_rank` all-reduces the gradient of a parameter held by
    stages on several pipeline ranks over a group of those ranks; with several replicas there is
    one such group per replica, and ``torch.distributed.new_group`` must be entered by every rank
    of the job. The groups go into ``cache`` (keyed by their global ranks), which ``build_rank``
    then finds them in (``group_cache``). ``rank_order``: as :func:`init_mesh`.
    """
    order = _order(mesh, rank_order)
    cache = {} if cache is None else cache
    sets = sorted({tuple(sorted({int(device_of_stage[s]) for s in stages}))
                   for stages in staged.shared_params.values()})
    for replica in range(mesh_dp(mesh)):
        for t in range(mesh_tp(mesh)):
            for ranks in sets:
                if len(ranks) < 2:
                    continue
                key = tuple(rank_of(mesh, pp=r, replica=replica, order=order, tp=t) for r in ranks)
                if key not in cache:
                    cache[key] = dist.new_group(ranks=list(key))
    return cache


def check_mesh_run(mesh: Mapping[str, int], orders: Orders, recompute_stages: Sequence[int] = (),
                   compile_stages: bool = False, activation_checkpointing: Sequence[Any] | None = None,
                   fsdp_blocks: Sequence[str] | None = None, offload_optimizer: bool = False) -> None:
    """Refuse, before any process group is touched, what data parallelism does not support yet.

    Activation recomputation (``recompute_stages``) and offload/reload actions in ``orders``
    run with any mesh (see the module docstring); ``recompute_stages`` is accepted for the
    callers' uniformity. With ``fsdp_blocks`` (per-block FSDP2 units): also
    :func:`check_block_units_run`.

    Raises
    ------
    InputError
        With ``dp > 1``: ``compile_stages``; with any mesh, a ``pp`` other than the orders'
        number of devices; with ``tp > 1``, what tensor parallelism does not run yet
        (:func:`fxpipe.codegen.tensor_parallel.check_tensor_parallel_run`).
    """
    from fxpipe.codegen.tensor_parallel import check_tensor_parallel_run

    m = normalize_mesh(mesh)
    if orders.num_devices != m["pp"]:
        raise InputError(f"the orders place the stages on {orders.num_devices} devices but mesh {format_mesh(m)} has "
                         f"pp={m['pp']}")
    check_tensor_parallel_run(mesh_tp(m), recompute_stages, bool(orders.offloaded()), compile_stages,
                              activation_checkpointing)
    if fsdp_blocks:
        check_block_units_run(m, orders, bool(offload_optimizer), recompute_stages, compile_stages,
                              activation_checkpointing)
    if mesh_dp(m) == 1:
        return
    what = f"mesh {format_mesh(m)}"
    if compile_stages:
        raise InputError(f"{what}: compile_stages=True with data parallelism is not supported yet; "
                         "use compile_stages=False, or plan a pure pipeline to compile its stages "
                         "(fxpipe.compile(..., mesh='pipeline'))")


def check_block_units_run(mesh: Mapping[str, int], orders: Orders, offload_optimizer: bool = False,
                          recompute_stages: Sequence[int] = (), compile_stages: bool = False,
                          activation_checkpointing: Sequence[Any] | None = None) -> None:
    """Refuse what per-block FSDP2 units do not run with yet (before any process group is touched).

    They run on meshes with ``dp_shard > 1`` (FSDP, HSDP) with per-block activation-checkpoint segments
    (which move into their blocks, :func:`fxpipe.codegen.fsdp_blocks.carve_blocks`), with tensor parallelism
    (2-D ``fully_shard`` of each block over its DTensor parameters), without optimizer offload, activation offload / reload, whole-stage recomputation (its replay runs
    the stage without FSDP2's hooks, which the blocks need) and ``compile_stages``. A schedule that splits B and W runs with them fused (a block's gradients are
    reduce-scattered after its backward).

    Raises
    ------
    InputError
        Naming the combination.
    """
    from fxpipe.codegen.checkpointing import policy_kind

    m = normalize_mesh(mesh)
    why = None
    if m.get("dp_shard", 1) == 1:
        why = "they need dp_shard > 1"
    elif offload_optimizer:
        why = "optimizer offload does not run with them yet"
    elif orders.offloaded():
        why = "activation offload / reload does not run with them yet"
    elif recompute_stages or any(policy_kind(p) == "stage" for p in activation_checkpointing or () if p is not None):
        why = ("whole-stage recomputation (activation_checkpointing 'stage') does not run with them yet (per-block "
               "'full' / 'selective' / 'budget' segments do)")
    elif compile_stages:
        why = "compile_stages does not run with them yet"
    if why is not None:
        raise InputError(f"mesh {format_mesh(m)} with per-block FSDP2 units (memory.fsdp_units='block'): {why}; "
                         "plan with MemoryModel(fsdp_units='stage')")


def check_offload_run(orders: Orders, recompute_stages: Sequence[int] = (), compile_stages: bool = False) -> None:
    """Refuse, before any process group is touched, what optimizer offload does not support yet.

    Optimizer offload wraps every stage in FSDP2 (:func:`data_parallel_wrapper`), also in a pure
    pipeline, so it has the limits of data parallelism (:func:`check_mesh_run`): activation
    recomputation and offload/reload run (as under data parallelism), ``compile_stages`` does not.

    Raises
    ------
    InputError
        For ``compile_stages``.
    """
    if compile_stages:
        raise InputError("optimizer offload (offload_optimizer=True) with compile_stages=True is not supported yet: "
                         "use compile_stages=False or a memory model without offload_optimizer")


def build_mesh_rank(
    staged,
    rank: int,
    orders: Orders,
    *,
    mesh: Mapping[str, int],
    num_microbatches: int,
    loss_fn: Callable | None,
    device_mesh=None,
    device: str | torch.device = "cpu",
    example_microbatch_inputs: Any = None,
    group_cache: dict | None = None,
    rank_order: Any = None,
    offload_optimizer: bool = False,
    tensor_parallel: Any = None,
    tensor_parallel_params: Mapping[str, str] | None = None,
    fsdp_blocks: Sequence[str] | None = None,
    **build_kwargs: Any,
):
    """This global rank's pipeline stages on the mesh, wrapped for data parallelism, and its runtime.

    Collective: every rank of the job calls it (the device mesh and the tied-parameter groups
    are created on all ranks).

    Parameters
    ----------
    staged : StagedProgram
        From :func:`fxpipe.codegen.split.split_stages` (identical on every rank).
    rank : int
        Global rank, ``0 .. pp * dp - 1`` (:func:`fxpipe.mesh.rank_coords` gives its replica and
        pipeline rank).
    orders : fxpipe.ir.Orders
        The pipeline's per-device programs over ``mesh["pp"]`` devices, for
        ``num_microbatches`` micro-batches.
    mesh : Mapping[str, int]
        ``{"pp", "dp_shard", "dp_replicate"}`` (missing = 1; an ``"order"`` entry is the rank
        order when ``rank_order`` is None).
    num_microbatches : int
        Micro-batches of ONE replica per step (the global count divided by ``dp``).
    loss_fn, device, example_microbatch_inputs, build_kwargs :
        As in :func:`~fxpipe.codegen.rank.build_rank` (``fuse``, ``fused_backward``,
        ``io_cache``, ``state_source``, ...).
    device_mesh : DeviceMesh, optional
        From :func:`init_mesh`, reused across builds (default: created here).
    group_cache : dict, optional
        Tied-parameter process groups kept across builds (see :func:`make_shared_param_groups`).
    rank_order : sequence of str, optional
        The mesh dimensions outermost first (``plan.rank_order``; default the mesh's ``"order"``,
        else pipeline rank innermost, :data:`fxpipe.mesh.MESH_DIMS`); every rank must pass the same.
    offload_optimizer : bool
        Keep the sharded parameters, gradients and optimizer state on the host
        (``plan.memory.offload_optimizer``; :func:`data_parallel_wrapper`); also wraps a pure
        pipeline's stages (``fully_shard`` over a size-1 sub-mesh).
    tensor_parallel : TensorParallelStructure, optional
        Required with ``tp > 1``: :func:`fxpipe.passes.tensor_parallel.find_tensor_parallel` of
        the graph ``staged`` was split from (:mod:`fxpipe.codegen.tensor_parallel`).
    tensor_parallel_params : Mapping[str, str], optional
        The plan's parameter placements (``plan.tensor_parallel.params``), checked against the
        ones resolved here.
    fsdp_blocks : sequence of str, optional
        Per-block FSDP2 units (``plan.memory.fsdp_units == "block"``): the module paths of the model's
        repeated blocks (:func:`fxpipe.memory.checkpoint.find_blocks` of the plan's graph); needs
        ``dp_shard > 1`` and refuses what they do not run with yet (:func:`check_block_units_run`).

    Returns
    -------
    (stages, schedule, MeshRank)
        As :func:`~fxpipe.codegen.rank.build_rank`, plus this rank's :class:`MeshRank`
        (``schedule.fxpipe_mesh_rank`` too). ``schedule.step`` takes this replica's slice of the
        global batch (:func:`replica_slice`).

    Raises
    ------
    InputError
        For a mesh whose ``pp`` is not the orders' number of devices, a process group of
        another size, or what data parallelism does not support yet (see the module docstring).
    """
    order = _order(mesh, rank_order)
    m = mesh_degrees(normalize_mesh(mesh))
    check_mesh_run(m, orders, build_kwargs.get("recompute_stages", ()), build_kwargs.get("compile_stages", False),
                   build_kwargs.get("activation_checkpointing"), fsdp_blocks, offload_optimizer)
    if offload_optimizer:
        check_offload_run(orders, build_kwargs.get("recompute_stages", ()), build_kwargs.get("compile_stages", False))
    if fsdp_blocks:
        build_kwargs["fused_backward"] = True  # a block's gradients are reduced after its backward: no separate W
    mr = mesh_rank(m, rank, device_mesh, torch.device(device).type, order)
    cache = make_shared_param_groups(staged, orders.device_of_stage, m, group_cache, order)
    wrap = data_parallel_wrapper(mr, offload_optimizer, fsdp_blocks)
    if wrap is not None:
        wrap = _untie_then(wrap, staged)
    tpr = None
    if mr.tp > 1:  # tensor parallelism first, then FSDP2 / replicate over the DTensor parameters
        from fxpipe.codegen.tensor_parallel import TensorParallelRank

        if tensor_parallel is None:
            raise InputError(f"mesh {format_mesh(m)}: tensor parallelism needs the capture's tensor-parallel structure "
                             "(tensor_parallel=fxpipe.passes.tensor_parallel.find_tensor_parallel(gm))")
        tpr = TensorParallelRank(tensor_parallel, mr.tp_mesh, tensor_parallel_params)
        wrap = _tensor_parallel_then(tpr, staged, wrap)
        last = staged.num_stages - 1
        build_kwargs["local_io"] = lambda s, io: tpr.local_io(staged.stages[s], io, s == last)
    stages, sched = build_rank(
        staged, mr.pp_rank, orders, num_microbatches=num_microbatches, loss_fn=loss_fn, group=mr.pp_group,
        device=device, example_microbatch_inputs=example_microbatch_inputs, group_cache=cache,
        wrap_module=wrap, **build_kwargs,
    )
    if wrap is not None:
        sched.set_shared_grads(_tied_copies(staged, orders.device_of_stage, mr, cache))
    if tpr is not None:
        sched.fxpipe_before_grad_scaling = [lambda: tpr.reduce_grads(sched.parameters())]
        sched.fxpipe_tensor_parallel = tpr
    sched.fxpipe_mesh_rank = mr
    return stages, sched, mr


def _tensor_parallel_then(tpr, staged, wrap: Callable[[int, torch.nn.Module], None] | None) -> Callable[[int, torch.nn.Module], None]:
    """Make a stage module tensor-parallel (:meth:`TensorParallelRank.shard_stage`), then apply ``wrap`` (data parallelism)."""

    from fxpipe.codegen.checkpointing import rewrite_under_checkpoint

    def shard_then_wrap(stage: int, module: torch.nn.Module) -> None:
        # checkpoint segments carved already are carved again into the tensor-parallel program (its collectives replay)
        rewrite_under_checkpoint(module, lambda m: tpr.shard_stage(staged.stages[stage], m), stage)
        if wrap is not None:
            wrap(stage, module)

    return shard_then_wrap


def _untie_then(wrap: Callable[[int, torch.nn.Module], None], staged) -> Callable[[int, torch.nn.Module], None]:
    """``wrap`` after giving a stage its own copy of every tied parameter an earlier stage of this rank holds.

    Stages of one rank share a tied parameter object (GPT-2's embedding on a V placement), but
    FSDP2 cannot manage one parameter in two ``fully_shard`` modules. Each stage gets its own
    copy (same value); :func:`_tied_copies` keeps the copies' gradients summed, so an optimizer
    over all of them (``schedule.parameters()``) keeps them equal.
    """
    tied = set(staged.shared_params)
    seen: set[int] = set()

    def untie_and_wrap(stage: int, module: torch.nn.Module) -> None:
        for fqn, target in staged.stages[stage].param_targets.items():
            p = module.get_parameter(target)
            if fqn in tied and id(p) in seen:
                owner, _, name = target.rpartition(".")
                setattr(module.get_submodule(owner) if owner else module, name,
                        torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
            seen.add(id(p))
        wrap(stage, module)

    return untie_and_wrap


def _tied_copies(staged, device_of_stage: Sequence[int], mr: MeshRank, cache: Mapping) -> list:
    """``(copies on this rank, group of the other pipeline ranks holding it or None)`` per tied parameter."""
    out = []
    for fqn, holders in sorted(staged.shared_params.items()):
        local = [s for s in holders if int(device_of_stage[s]) == mr.pp_rank]
        if not local:
            continue
        copies = {}
        for s in local:
            p = staged.stages[s].module.get_parameter(staged.stages[s].param_targets[fqn])
            copies.setdefault(id(p), p)
        ranks = sorted({int(device_of_stage[s]) for s in holders})
        key = tuple(rank_of(mr.mesh, pp=r, replica=mr.replica, order=mr.rank_order, tp=mr.tp_index) for r in ranks)
        grp = cache[key] if len(ranks) > 1 else None
        if len(copies) > 1 or grp is not None:
            out.append((tuple(copies.values()), grp))
    return out


def replica_slice(tree: Any, replica: int, dp: int, what: str = "inputs") -> Any:
    """Replica ``replica``'s part of a global batch: ``split_microbatches(tree, dp, what)[replica]``.

    Raises
    ------
    InputError
        If a tensor's dim 0 is not divisible by ``dp``.
    """
    if dp == 1:
        return tree
    return split_microbatches(tree, dp, what)[replica]


def full_tensors(named: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """The full (unsharded) value of every DTensor in ``named``, other tensors as they are.

    Collective over each DTensor's mesh: every rank holding the same stages calls it with the
    same names in the same order. A DTensor whose shard lives on the host while its mesh is on
    an accelerator (optimizer offload) is all-gathered on the mesh's device; the full tensor
    comes back on the shard's device.
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor | None] = {}
    for k, t in named.items():
        if isinstance(t, DTensor):
            local = t.to_local()
            if local.device.type != t.device_mesh.device_type:  # host shard (optimizer offload): gather on the device
                t = DTensor.from_local(local.to(t.device_mesh.device_type), t.device_mesh, t.placements,
                                       run_check=False, shape=t.shape, stride=t.stride())
            out[k] = t.full_tensor().detach().to(local.device, copy=True)
        else:
            out[k] = None if t is None else t.detach().clone()
    return out

