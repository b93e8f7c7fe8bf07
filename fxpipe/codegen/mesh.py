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
from fxpipe.mesh import MESH_DIMS, format_mesh, mesh_degrees, mesh_dp, mesh_rank_order, normalize_mesh, normalize_rank_order, rank_coords, rank_of

__all__ = [
    "MeshRank",
    "init_mesh",
    "mesh_rank",
    "data_parallel_wrapper",
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
        ``{"pp", "dp_shard", "dp_replicate"}`` degrees.
    rank : int
        Global rank.
    coords : dict
        :func:`fxpipe.mesh.rank_coords` (``dp_replicate``, ``dp_shard``, ``pp``, ``replica``).
    device_mesh : torch.distributed.device_mesh.DeviceMesh
        The 3-D mesh, its dimensions in ``rank_order``.
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


def init_mesh(mesh: Mapping[str, int], device_type: str = "cpu", rank_order: Any = None):
    """``init_device_mesh`` over the mesh's dimensions in rank order (collective: every rank calls it).

    Needs an initialised default process group of ``pp * dp_shard * dp_replicate`` ranks. The
    device mesh's shape and ``mesh_dim_names`` follow ``rank_order`` (default: the mesh's
    ``"order"`` entry, else :data:`fxpipe.mesh.MESH_DIMS`), outermost first, so the rank at
    coordinates ``c`` of the ``DeviceMesh`` (row-major over global ranks) is
    :func:`fxpipe.mesh.rank_of`'s.

    Raises
    ------
    InputError
        If the process group's size is not the mesh's number of devices, or for a bad order.
    """
    from torch.distributed.device_mesh import init_device_mesh

    order = _order(mesh, rank_order)
    m = mesh_degrees(normalize_mesh(mesh))
    world = dist.get_world_size()
    need = m["pp"] * m["dp_shard"] * m["dp_replicate"]
    if world != need:
        raise InputError(f"mesh {format_mesh(m)} needs {need} ranks but the process group has {world}: "
                         "launch one process per device")
    return init_device_mesh(device_type, tuple(m[d] for d in order), mesh_dim_names=order)


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
    elif tuple(device_mesh.mesh_dim_names or ()) != order:
        raise InputError(f"the device mesh's dimensions {device_mesh.mesh_dim_names} are not in the rank order {order}: "
                         "make it with init_mesh(mesh, rank_order=...) of the same order")
    return MeshRank(m, int(rank), coords, device_mesh, order)


def data_parallel_wrapper(mr: MeshRank, offload_optimizer: bool = False) -> Callable[[int, torch.nn.Module], None] | None:
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
            replicate_module(module, sub, **policy)

        return wrap
    from torch.distributed.fsdp import fully_shard

    sub = dm["dp_replicate", "dp_shard"] if kind == "hsdp" else dm["dp_shard"]  # FSDP or offload alone: dp_shard

    def wrap(stage: int, module: torch.nn.Module) -> None:  # noqa: F811 - one of the two wrappers
        fully_shard(module, mesh=sub, **policy)

    return wrap


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
        for ranks in sets:
            if len(ranks) < 2:
                continue
            key = tuple(rank_of(mesh, pp=r, replica=replica, order=order) for r in ranks)
            if key not in cache:
                cache[key] = dist.new_group(ranks=list(key))
    return cache


def check_mesh_run(mesh: Mapping[str, int], orders: Orders, recompute_stages: Sequence[int] = (),
                   compile_stages: bool = False) -> None:
    """Refuse, before any process group is touched, what data parallelism does not support yet.

    Activation recomputation (``recompute_stages``) and offload/reload actions in ``orders``
    run with any mesh (see the module docstring); ``recompute_stages`` is accepted for the
    callers' uniformity.

    Raises
    ------
    InputError
        With ``dp > 1``: ``compile_stages``; with any mesh, a ``pp`` other than the orders'
        number of devices.
    """
    m = normalize_mesh(mesh)
    if orders.num_devices != m["pp"]:
        raise InputError(f"the orders place the stages on {orders.num_devices} devices but mesh {format_mesh(m)} has "
                         f"pp={m['pp']}")
    if mesh_dp(m) == 1:
        return
    what = f"mesh {format_mesh(m)}"
    if compile_stages:
        raise InputError(f"{what}: compile_stages=True with data parallelism is not supported yet; "
                         "use compile_stages=False")


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
    check_mesh_run(m, orders, build_kwargs.get("recompute_stages", ()), build_kwargs.get("compile_stages", False))
    if offload_optimizer:
        check_offload_run(orders, build_kwargs.get("recompute_stages", ()), build_kwargs.get("compile_stages", False))
    mr = mesh_rank(m, rank, device_mesh, torch.device(device).type, order)
    cache = make_shared_param_groups(staged, orders.device_of_stage, m, group_cache, order)
    wrap = data_parallel_wrapper(mr, offload_optimizer)
    if wrap is not None:
        wrap = _untie_then(wrap, staged)
    stages, sched = build_rank(
        staged, mr.pp_rank, orders, num_microbatches=num_microbatches, loss_fn=loss_fn, group=mr.pp_group,
        device=device, example_microbatch_inputs=example_microbatch_inputs, group_cache=cache,
        wrap_module=wrap, **build_kwargs,
    )
    if wrap is not None:
        sched.set_shared_grads(_tied_copies(staged, orders.device_of_stage, mr, cache))
    sched.fxpipe_mesh_rank = mr
    return stages, sched, mr


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
        key = tuple(rank_of(mr.mesh, pp=r, replica=mr.replica, order=mr.rank_order) for r in ranks)
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

