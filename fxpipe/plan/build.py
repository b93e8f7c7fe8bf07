"""Build one rank of a plan: its ``torch.distributed.pipelining`` stages and schedule runtime.

:func:`build_rank` is :meth:`fxpipe.plan.Plan.build`; :func:`replica_batch` gives a rank its
replica's slice of a global batch; :func:`worker_stage_of` is the picklable stage map worker
processes apply to their own capture. torch is imported only inside the functions that run a rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fxpipe.errors import InputError
from fxpipe.mesh import rank_coords

__all__ = ["build_rank", "replica_batch", "compile_stages_option", "worker_stage_of", "PlanStageOf",
           "captured_checkpointing"]


def fsdp_blocks(plan) -> tuple[str, ...] | None:
    """The module paths of the blocks a plan with per-block FSDP2 units wraps one by one
    (:func:`fxpipe.memory.checkpoint.find_blocks` of its graph), or None (whole-stage units: no
    ``memory.fsdp_units == "block"``, or no ``dp_shard > 1``)."""
    if not (getattr(plan.memory, "block_units", False) and int(plan.mesh.get("dp_shard", 1)) > 1):
        return None
    from fxpipe.memory.checkpoint import find_blocks

    return tuple(find_blocks(plan.graph).names)


def build_rank(plan, rank: int, *, model=None, args=(), kwargs=None, loss_fn: Callable | None = None, group=None,
               device="cpu", checkpoint=None, seed: int | None = None, init_fn: Callable | None = None,
               compile_stages: bool | None = None, activation_checkpointing=None):
    """This rank's ``PipelineStage`` s and schedule runtime, inside an initialised process group.

    Call from every worker of ``torchrun`` / ``torch.multiprocessing`` after
    ``torch.distributed.init_process_group`` with ``world_size == plan.world_size``
    (``plan.devices`` for a pure pipeline).

    With data parallelism (``plan.dp > 1``) the ranks form the mesh of
    :func:`fxpipe.mesh.rank_coords` in ``plan.rank_order`` (by default ``rank = replica * pp +
    pipeline rank``; pipeline rank outermost: ``rank = pipeline rank * dp + replica``; with tensor
    parallelism, ``plan.tp > 1``, every such rank is ``tp`` consecutive ranks whose stage modules
    run on DTensor with the plan's placements, :mod:`fxpipe.codegen.tensor_parallel`); the call is
    collective (it creates the ``DeviceMesh`` and process groups), every stage module is
    wrapped by ``fully_shard`` / ``replicate`` over its data-parallel sub-mesh
    (:mod:`fxpipe.codegen.mesh`), and ``schedule.step`` takes this rank's replica slice of
    the global batch (:func:`replica_batch`); ``schedule.fxpipe_mesh_rank`` holds the rank's
    coordinates. Gradients are those of the mean loss over all ``global_microbatches``.

    With optimizer offload (``plan.memory.offload_optimizer``, ZeRO-Offload) the stages are
    wrapped the same way with FSDP2's ``CPUOffloadPolicy``, a pure pipeline's by ``fully_shard``
    over a size-1 sub-mesh (collective too; rank = pipeline rank as before): the parameters
    ``schedule.parameters()`` lists are host-resident DTensor shards, their gradients arrive on
    the host, and an optimizer built over them keeps its state and steps on the host.

    Parameters
    ----------
    plan : Plan
        The plan (:meth:`fxpipe.plan.Plan.build` calls this with itself).
    rank : int
        Global rank, 0..world_size-1; its pipeline rank (= ``rank`` for a pure pipeline)
        runs the stages ``plan.device_of_stage`` puts on it.
    model : nn.Module, optional
        Needed only for a plan loaded from a file (it is re-captured and checked).
    args, kwargs :
        One micro-batch of example inputs (only for re-capture).
    loss_fn : callable(output, target) -> scalar tensor
        Applied on the last stage to every micro-batch.
    checkpoint : str, os.PathLike or Mapping[str, Tensor], optional
        Load this rank's stage parameters and buffers by fully qualified name from a
        ``.safetensors`` file, a sharded safetensors index, a directory holding either, a
        torch state dict file or a mapping (only the tensors this rank needs are read;
        :mod:`fxpipe.codegen.materialize`). Buffers it lacks come from the initializers.
    seed : int, optional
        Materialize this rank's stages from the model's initializers under this seed
        (same values as :class:`fxpipe.codegen.materialize.MetaInit` gives the whole model).
        Needed (or ``checkpoint``) when the model was captured on ``meta``.
    init_fn : callable(module) -> None, optional
        Initializer of every module, replacing the model's own (with ``seed``).
    compile_stages : bool, optional
        Run every stage with Inductor, its backward split into backward-input and
        backward-weight graphs (:mod:`fxpipe.codegen.compiled`). Default: the
        ``compile_stages`` option of the ``torch.compile`` backend that made the plan, else False.
    activation_checkpointing : sequence of CheckpointPolicy, optional
        One policy per stage in the plan's node names, instead of ``plan.activation_checkpointing``.

    The stages the schedule problem marks for recomputation (:meth:`recompute_stages`) replay
    their forward during the backward; ``plan.activation_checkpointing`` (one
    :class:`~fxpipe.memory.checkpoint.CheckpointPolicy` per stage, when the plan has it) is
    executed: segments replayed, kept outputs kept (:mod:`fxpipe.codegen.checkpointing`,
    :func:`captured_checkpointing`); the schedule's offload/reload actions are executed
    (:mod:`fxpipe.codegen.stash`; ``schedule.fxpipe_stash.stats()`` reports the measured
    activation peaks).

    Returns
    -------
    (stages, schedule)
        ``stages``: this rank's ``torch.distributed.pipelining.PipelineStage`` s (a tuple
        in stage order, one entry per stage on this device); ``schedule``: the runtime whose
        ``step(*inputs, target=..., losses=[])`` runs one training step (inputs read on the
        rank of stage 0, ``schedule.has_first_stage``; the target on the rank of the last
        stage, ``schedule.has_last_stage``); ``schedule.parameters()`` lists the rank's
        parameters once each (for the optimizer).

    Raises
    ------
    InputError
        On a rank outside 0..world_size-1, a model that does not match the plan, or (with data
        parallelism) what :func:`fxpipe.codegen.mesh.build_mesh_rank` does not support yet (per-block
        FSDP2 units: :func:`fxpipe.codegen.mesh.check_block_units_run`).
    """
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= int(rank) < plan.world_size:
        raise InputError(f"rank must be an integer in 0..{plan.world_size - 1}, got {rank!r}")
    from fxpipe.codegen import build_pipeline_rank  # lazy: torch

    traced = plan.captured(model, args, kwargs)
    source = None
    if checkpoint is not None or seed is not None or init_fn is not None:
        from fxpipe.codegen.materialize import StateSource  # lazy: torch

        source = StateSource(seed=0 if seed is None else int(seed), checkpoint=checkpoint, init_fn=init_fn,
                             model=model if model is not None else getattr(traced, "model", None))
    offload = bool(getattr(plan.memory, "offload_optimizer", False))
    stage_of = plan.captured_stage_of()
    policies = captured_checkpointing(plan, traced, activation_checkpointing)
    if plan.dp > 1 or offload or plan.tp > 1:  # ---- mesh (fxpipe.codegen.mesh): pipeline x data x tensor parallelism
        import torch.distributed as dist  # lazy: torch

        from fxpipe.codegen.mesh import build_mesh_rank  # lazy: torch
        from fxpipe.codegen.rank import example_inputs_from_gm  # lazy: torch
        from fxpipe.codegen.split import split_stages  # lazy: torch

        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            what = "data parallelism" if plan.dp > 1 else ("tensor parallelism" if plan.tp > 1 else "optimizer offload")
            raise InputError(
                f"a plan with {what} runs on the default process "
                f"group (its device mesh): leave group=None and launch exactly {plan.world_size} processes"
            )
        tp_kwargs = {}
        if plan.tp > 1:  # tensor parallelism (fxpipe.codegen.tensor_parallel): this capture's structure, the plan's placements
            from fxpipe.passes.tensor_parallel import find_tensor_parallel  # lazy: torch

            tp_kwargs = dict(tensor_parallel=find_tensor_parallel(traced.gm),
                             tensor_parallel_params=plan.tensor_parallel.params)
        stages, sched, _ = build_mesh_rank(
            split_stages(traced.gm, stage_of, plan.num_stages), int(rank), plan.orders(), mesh=plan.mesh,
            rank_order=plan.rank_order,
            num_microbatches=plan.microbatches, loss_fn=loss_fn, device=device,
            example_microbatch_inputs=example_inputs_from_gm(traced.gm), recompute_stages=plan.recompute_stages(),
            state_source=source, compile_stages=compile_stages_option(plan, compile_stages), offload_optimizer=offload,
            activation_checkpointing=policies, fsdp_blocks=fsdp_blocks(plan), **tp_kwargs,
        )
        return stages, sched
    return build_pipeline_rank(
        traced.gm,
        stage_of,
        int(rank),
        plan.orders(),
        num_microbatches=plan.microbatches,
        loss_fn=loss_fn,
        group=group,
        device=device,
        recompute_stages=plan.recompute_stages(),
        state_source=source,
        compile_stages=compile_stages_option(plan, compile_stages),
        activation_checkpointing=policies,
    )


def captured_checkpointing(plan, traced, policies=None) -> tuple | None:
    """``plan``'s per-stage activation-checkpoint policies (or ``policies``) in the node names of ``traced``.

    ``plan.activation_checkpointing`` names the plan's nodes; the capture ``traced`` (this
    process's, or a worker's) is matched to them by structure
    (:func:`fxpipe.passes.structure.match_nodes`), as the stage map is. None when the plan has
    no policies.
    """
    policies = getattr(plan, "activation_checkpointing", None) if policies is None else policies
    if policies is None:
        return None
    from fxpipe.codegen.checkpointing import captured_policies  # lazy: torch
    from fxpipe.passes.structure import PlanStructure, match_nodes  # lazy: torch

    structure = PlanStructure.from_graph(plan.graph)
    names = match_nodes(structure, traced.gm) if structure is not None else None
    return captured_policies(policies, plan.num_stages, names)


def replica_batch(plan, rank: int, inputs: Any, target: Any = None) -> tuple[Any, Any]:
    """``plan``'s global rank ``rank``'s part of a global batch: its replica's slice (all of it without data parallelism).

    ``inputs`` (a tuple of positional inputs, a dict of keywords or
    :class:`~fxpipe.codegen.interface.ModelInputs`) and ``target`` hold
    :attr:`global_microbatches` micro-batches along dim 0; replica ``r`` gets the ``r``-th
    of ``dp`` equal slices (:func:`fxpipe.codegen.mesh.replica_slice`), i.e. the global
    micro-batches ``r * microbatches .. (r + 1) * microbatches - 1``. Returns
    ``(inputs, target)`` in the same forms.
    """
    replica = rank_coords(int(rank), plan.mesh, plan.rank_order)["replica"]
    if plan.dp == 1:
        return inputs, target
    from fxpipe.codegen.mesh import replica_slice  # lazy: torch

    return replica_slice(inputs, replica, plan.dp), replica_slice(target, replica, plan.dp, "target")


def compile_stages_option(plan, compile_stages: bool | None) -> bool:
    """Whether ``plan``'s stages run with Inductor: ``compile_stages``, or (None) the ``compile_stages``
    option of the ``torch.compile`` backend that made the plan, else False."""
    if compile_stages is None:
        return bool((plan.options.get("backend") or {}).get("compile_stages", False))
    if not isinstance(compile_stages, bool):
        raise InputError(f"compile_stages must be True, False or None, got {compile_stages!r}")
    return compile_stages


def worker_stage_of(plan) -> PlanStageOf:
    """``plan``'s picklable ``gm -> stage map`` for worker processes that capture the model themselves.

    Matches each worker's capture to the plan by structure (:meth:`fxpipe.plan.Plan.adopt_capture`), so every
    worker runs exactly the planned partition whatever its hash seed or device; use it as the
    ``stage_of`` of :func:`fxpipe.codegen.launch.spawn_train_many` runs.
    """
    from fxpipe.passes.structure import PlanStructure  # lazy: torch

    return PlanStageOf(dict(plan.stage_of), PlanStructure.from_graph(plan.graph))

@dataclass(frozen=True)
class PlanStageOf:
    """Picklable ``gm -> stage_of`` for workers: the plan's stage map for the worker's own capture.

    With the plan's structure (:func:`worker_stage_of`), the worker's nodes are matched to
    the plan's by structure (:func:`fxpipe.passes.structure.map_stage_of`): node names and the
    order of independent nodes may differ between processes (``PYTHONHASHSEED``). Without it,
    the names must agree.
    """

    stage_of: dict
    structure: Any = None

    def __call__(self, gm) -> dict:
        if self.structure is not None:
            from fxpipe.passes.structure import map_stage_of  # lazy: torch

            return map_stage_of(self.structure, self.stage_of, gm)
        names = {n.name for n in gm.graph.nodes if n.op != "get_attr"}
        missing = sorted(set(self.stage_of) - names)
        extra = sorted(names - set(self.stage_of))
        if missing or extra:
            raise InputError(
                "the worker's captured graph differs from the plan's "
                f"(plan nodes missing: {missing[:5]}, unplanned nodes: {extra[:5]}): "
                "make_model must build the model the plan was compiled for, with the same micro-batch shapes"
            )
        return self.stage_of
