"""Build one rank of a pipeline: its ``PipelineStage`` s and the schedule runtime loaded with its actions.

:func:`build_rank` assembles the pieces: the stage modules from :mod:`fxpipe.codegen.split`,
their example inputs/outputs from :mod:`fxpipe.codegen.shapes` (static, on fake tensors), the
per-rank actions lowered from the :class:`~fxpipe.ir.Orders` by :mod:`fxpipe.codegen.actions`,
and :class:`~fxpipe.codegen.runtime.FxpipeScheduleRuntime` (torch's runtime with the model's
calling convention, :mod:`fxpipe.codegen.interface`). :func:`build_pipeline_rank` does it all
from a captured graph and a stage map in one call.

Placement: rank ``r`` runs every stage ``s`` with ``orders.device_of_stage[s] == r`` (one stage
per rank, looped ``s mod p``, V-shape, or any placement torch's runtime can run).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from fxpipe.codegen.actions import lower_orders
from fxpipe.codegen.checkpointing import CarvedStage, apply_checkpoint, captured_policies, policy_kind, tag_for_compile
from fxpipe.codegen.compiled import CompiledPipelineStage, compile_stage
from fxpipe.codegen.interface import ModelInputs, ModelInterface
from fxpipe.codegen.materialize import holds_meta, materialize_stage
from fxpipe.codegen.runtime import FxpipePipelineStage, FxpipeScheduleRuntime, dp_unshard_fn, tree_unflatten
from fxpipe.codegen.shapes import stage_io
from fxpipe.codegen.split import StagedProgram, split_stages
from fxpipe.codegen.stash import device_stash
from fxpipe.errors import InputError
from fxpipe.ir.lowering import full_backward
from fxpipe.ir.schedule import Action, Orders

__all__ = ["build_rank", "build_pipeline_rank", "example_inputs_from_gm"]

logger = logging.getLogger(__name__)


def example_inputs_from_gm(gm: torch.fx.GraphModule) -> ModelInputs:
    """One micro-batch of inputs shaped like ``gm``'s captured example: zero tensors, captured constants.

    Zeros are valid indices for embeddings, so they are safe example inputs for shape inference
    of token-id models. The result is in the model's calling form (:class:`ModelInputs`).

    Raises
    ------
    InputError
        If a tensor placeholder has no recorded value (``node.meta['val']``).
    """
    iface = ModelInterface.from_graph(gm)
    leaves = []
    for leaf in iface.input_leaves:
        if not leaf.is_tensor:
            leaves.append(leaf.value)
        elif leaf.dtype is None:
            raise InputError(
                f"placeholder {leaf.name!r} has no tensor metadata (node.meta['val']); pass "
                f"example_microbatch_inputs explicitly"
            )
        else:
            leaves.append(torch.zeros(leaf.shape, dtype=leaf.dtype))
    args, kwargs = tree_unflatten(leaves, iface.in_spec)
    return ModelInputs(tuple(args), dict(kwargs))


def _shared_param_groups(staged: StagedProgram, device_of_stage: Sequence[int], rank: int, group,
                         modules: Mapping[int, torch.nn.Module], cache=None):
    """Create (collectively, on every rank) one process group per set of ranks sharing parameters.

    A tied parameter held by stages on several ranks gets its gradient all-reduced over those
    ranks; stages of one rank share one parameter object, so a parameter all of whose holders
    are on one rank needs no group. ``modules`` maps this rank's stages to their modules.
    ``cache`` (a dict kept by the caller across builds in the same process group) reuses groups.
    """
    sets: dict[tuple[int, ...], list[str]] = {}
    for fqn, stages in sorted(staged.shared_params.items()):
        ranks = tuple(sorted({int(device_of_stage[s]) for s in stages}))
        if len(ranks) > 1:
            sets.setdefault(ranks, []).append(fqn)
    result = []
    for ranks, fqns in sorted(sets.items()):
        global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in ranks]
        key = tuple(global_ranks)
        if cache is not None and key in cache:
            grp = cache[key]
        else:
            grp = dist.new_group(ranks=global_ranks)
            if cache is not None:
                cache[key] = grp
        if rank not in ranks:
            continue
        for fqn in fqns:
            s = next(s for s in staged.shared_params[fqn] if s in modules)
            result.append((modules[s].get_parameter(staged.stages[s].param_targets[fqn]), grp))
    return result


def build_rank(
    staged: StagedProgram,
    rank: int,
    orders: Orders,
    *,
    num_microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    group=None,
    device: str | torch.device = "cpu",
    example_microbatch_inputs: Any = None,
    fuse: bool = True,
    fused_backward: bool = False,
    group_cache: dict | None = None,
    io_cache: dict | None = None,
    compile_stages: bool = False,
    recompute_stages: Sequence[int] = (),
    track_activations: bool = True,
    state_source: Any = None,
    wrap_module: Callable[[int, torch.nn.Module], None] | None = None,
    local_io: Callable[[int, Any], Any] | None = None,
    activation_checkpointing: Sequence[Any] | None = None,
) -> tuple[tuple[FxpipePipelineStage, ...], FxpipeScheduleRuntime]:
    """This rank's ``PipelineStage`` s and a schedule runtime loaded with their actions.

    Must be called on every rank of ``group`` (it creates process groups for tied parameters
    collectively), after ``torch.distributed.init_process_group``.

    Parameters
    ----------
    staged : StagedProgram
        From :func:`fxpipe.codegen.split.split_stages`, built identically on every rank.
    rank : int
        This process's rank in ``group`` (= its device in the placement).
    orders : fxpipe.ir.Orders
        Per-device programs of every device with the placement (``orders.device_of_stage``,
        one device per rank), e.g. :func:`fxpipe.ir.schedule_to_orders` of a schedule.
        Lowered by :func:`fxpipe.codegen.actions.lower_orders` (checked complete and
        deadlock-free first).
    num_microbatches : int
        Micro-batches per step.
    loss_fn : callable(output, target) -> scalar tensor, or None
        Applied to every micro-batch's output (in the model's output structure) on the last
        stage; ``None`` = forward only.
    group : ProcessGroup, optional
        Pipeline group (default: world); its size must be the number of devices.
    device : str or torch.device
        Device of this rank's stages.
    example_microbatch_inputs : ModelInputs, tuple or dict
        One micro-batch of model inputs in the model's calling form (a tuple of positional
        inputs, a dict of keyword inputs, or :class:`~fxpipe.codegen.interface.ModelInputs`),
        or just the model's tensor inputs flattened in order,
        used to infer the shapes, dtypes and ``requires_grad`` of every tensor crossing a stage
        (static shape inference on fake tensors, no P2P metadata exchange, no real state touched).
    fuse : bool
        Lower a B immediately followed on its device by its own W to torch's full backward.
    fused_backward : bool
        Fallback: run full backwards instead of split backward-input / backward-weight.
    group_cache : dict, optional
        Process groups for tied parameters created by earlier builds in this process group
        (keyed by global ranks); every rank must pass the same kind of cache.
    io_cache : dict, optional
        Shape-inference results of earlier builds of the same ``staged`` program and stage
        (they do not depend on the schedule), kept by the caller.
    compile_stages : bool
        Run the stage module with Inductor, its backward split into backward-input and
        backward-weight graphs (:mod:`fxpipe.codegen.compiled`); no blind-parameter fallback is
        needed then.
    recompute_stages : sequence of int
        Stages that recompute their forward during the backward instead of stashing
        activations (:mod:`fxpipe.codegen.stash`).
    track_activations : bool
        Count live saved bytes per stage with the saved-tensor hooks (``sched.fxpipe_stash``),
        also without offload or recomputation (default).
    state_source : fxpipe.codegen.materialize.StateSource, optional
        Where this rank's stage parameters and buffers come from (a checkpoint and/or the
        model's initializers under a seed). Required when the stages are on ``meta``; then only
        this rank's stages are materialized (:mod:`fxpipe.codegen.materialize`).
    wrap_module : callable(stage, module) -> None, optional
        Applied in place to every stage module of this rank once it holds real tensors on
        ``device``, before the ``PipelineStage`` s and the tied-parameter groups are made (data
        parallelism: ``fully_shard`` / ``replicate``, :mod:`fxpipe.codegen.mesh`; tensor
        parallelism, :mod:`fxpipe.codegen.tensor_parallel`).
    local_io : callable(stage, StageIO) -> StageIO, optional
        The stage's inputs and outputs as this rank sends and receives them (tensor
        parallelism: the sequence shard of sequence-parallel values), from the model's shapes.
    activation_checkpointing : sequence of CheckpointPolicy or None, optional
        One :class:`~fxpipe.memory.checkpoint.CheckpointPolicy` per stage
        (``plan.activation_checkpointing``), node names of *this* capture
        (:func:`fxpipe.codegen.checkpointing.captured_policies` maps a plan's). Segments are
        carved into the stage programs and replayed during the backward, kept op results stay
        (:mod:`fxpipe.codegen.checkpointing`); ``"stage"`` policies join ``recompute_stages``.
        With ``compile_stages`` the segments are tags for Inductor's partitioner instead.
        ``schedule.fxpipe_checkpointing`` reports what each local stage carved.

    Returns
    -------
    (stages, FxpipeScheduleRuntime)
        ``stages``: this rank's ``PipelineStage`` s (a tuple, in increasing stage order; one per
        stage the placement puts on this rank). ``schedule.step(*inputs, target=..., losses=[...])``
        runs one training step: the model's inputs for the whole batch on the rank of stage 0,
        the target on the rank of the last stage (``schedule.has_first_stage`` /
        ``has_last_stage``); ``schedule.parameters()`` lists this rank's parameters once each.

    Raises
    ------
    InputError
        On orders that are not :class:`Orders`, incomplete or deadlocking; a placement whose
        number of stages or devices disagrees with ``staged`` or the process group; a rank
        outside the pipeline; example inputs that do not match the captured graph; or a
        schedule torch rejects (the message names rank, stage and micro-batch).
    """
    policies = captured_policies(activation_checkpointing, staged.num_stages)
    if not compile_stages:  # whole-stage policies: the stash's recomputation (compiled stages: Inductor's tags)
        recompute_stages = tuple(sorted(set(int(s) for s in recompute_stages)
                                        | {s for s, p in enumerate(policies) if policy_kind(p) == "stage"}))
    _check_rank_request(staged, rank, orders, group, compile_stages, recompute_stages)
    acts = lower_orders(orders, num_microbatches, fuse=fuse)
    if fused_backward:
        acts = {r: full_backward(a) for r, a in acts.items()}
    if example_microbatch_inputs is None:
        raise InputError("example_microbatch_inputs is required (one micro-batch of model inputs)")
    local = [s for s in range(staged.num_stages) if orders.device_of_stage[s] == rank]
    ios = _stage_ios(staged, local, staged.interface.example_inputs(example_microbatch_inputs), io_cache)
    if local_io is not None:
        ios = {s: local_io(s, io) for s, io in ios.items()}
    fused_here = {s: bool(fused_backward) for s in local}
    if not compile_stages:  # a compiled stage splits its backward without blind parameters
        acts, blind = _fuse_blind_stages(acts, rank, ios)
        fused_here.update({s: True for s in blind})
    dev = torch.device(device)
    materialized = _materialize_stages(staged, local, state_source, dev)
    carved = {s: _checkpoint_stage(staged.stages[s].module, policies[s], s, compile_stages, recompute_stages)
              for s in local}
    pipeline_stages, modules = _pipeline_stages(staged, local, ios, dev, group, wrap_module, compile_stages)
    shared = _shared_param_groups(staged, orders.device_of_stage, rank, group, modules, group_cache)
    sched = FxpipeScheduleRuntime(pipeline_stages, num_microbatches, loss_fn=loss_fn, interface=staged.interface,
                                  device_of_stage=orders.device_of_stage, shared_grads=shared)
    sched.load_actions(acts)
    sched.fxpipe_fused_full_backward = fused_here
    # the original model's names of this rank's state (fxpipe.codegen.checkpoint keys checkpoints by them)
    sched.fxpipe_named_state = {s: (modules[s], dict(staged.stages[s].param_targets), dict(staged.stages[s].buffer_targets))
                                for s in modules}
    _attach_stash(sched, pipeline_stages, carved, rank, orders, acts[rank], recompute_stages, modules, dev,
                  track_activations)
    sched.fxpipe_materialized = materialized or None
    return tuple(pipeline_stages), sched


def _attach_stash(sched, pipeline_stages, carved, rank: int, orders, actions, recompute_stages, modules, dev,
                  track_activations: bool) -> None:
    """The device's activation stash (:mod:`fxpipe.codegen.stash`: live saved bytes, offload/reload,
    recomputation and checkpointed segments' replays) on the schedule and its stages."""
    segmented = any(c is not None and c.pieces for c in carved.values())
    stash = device_stash(rank, orders, actions, recompute_stages, modules, dev, track_activations or segmented)
    for st in pipeline_stages:
        st.fxpipe_stash = stash
    if stash is not None:  # a replay outside the stage forward needs FSDP2's unsharded parameters
        stash.before_replay.update({s: fn for s, m in modules.items() if (fn := dp_unshard_fn(m)) is not None})
    sched.fxpipe_stash = stash
    sched.fxpipe_checkpointing = carved


def _checkpoint_stage(module: torch.nn.Module, policy: Any, stage: int, compile_stages: bool,
                      recompute_stages: Sequence[int]) -> CarvedStage | None:
    """Put ``policy`` into a stage module (:mod:`fxpipe.codegen.checkpointing`): carved segments, or
    Inductor's recompute tags with ``compile_stages``; a recomputing stage replays all of it instead."""
    if not isinstance(module, torch.fx.GraphModule):
        return None
    if compile_stages:
        n = tag_for_compile(module, None if stage in recompute_stages else policy)
        return CarvedStage(policy_kind(policy), pieces=[f"{n} nodes tagged for Inductor"] if n else [])
    if stage in recompute_stages:  # the whole stage replays (fxpipe.codegen.stash)
        apply_checkpoint(module, None, stage)
        return CarvedStage("stage")
    return apply_checkpoint(module, policy, stage)


def _check_rank_request(staged: StagedProgram, rank: Any, orders: Any, group, compile_stages: bool,
                        recompute_stages: Sequence[int]) -> None:
    """Refuse orders, a placement, a rank or options that :func:`build_rank` cannot build (InputError)."""
    if not isinstance(orders, Orders):
        raise InputError(
            f"build_rank takes fxpipe.ir.Orders, got {type(orders).__name__}: convert a schedule with "
            "fxpipe.ir.schedule_to_orders(schedule, problem)"
        )
    S = staged.num_stages
    if orders.num_stages != S:
        raise InputError(f"the orders place {orders.num_stages} stages but the staged program has {S}")
    D = orders.num_devices
    world = dist.get_world_size(group)
    if world != D:
        raise InputError(
            f"the placement uses {D} devices but the process group has {world} ranks: launch one process per device"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < D:
        raise InputError(f"rank must be an integer in 0..{D - 1}, got {rank!r}")
    if compile_stages and (tuple(recompute_stages) or orders.offloaded()):
        # the stash offloads / recomputes eager autograd's saved tensors and replays the eager
        # stage forward; a compiled stage saves its activations inside AOTAutograd's graph
        raise InputError(
            "compile_stages=True does not combine with activation recomputation or offload/reload (O/R) yet: "
            "use a schedule without them (schedule='zb-h1', '1f1b', ...) or compile_stages=False"
        )


def _stage_ios(staged: StagedProgram, local: Sequence[int], flat: Sequence[torch.Tensor], io_cache: dict | None) -> dict:
    """Static shape inference of every stage in ``local`` (:func:`stage_io`), reusing ``io_cache``.

    The results depend on the staged program, the stage and the example inputs' shapes and
    dtypes, not on the schedule, so the cache key is those. An entry holds its staged program and
    is used only for that very object: a key of ``id(staged)`` alone outlives the program, and a
    new one (a mesh run splits the graph afresh, its stage modules are wrapped in place) can be
    allocated at the same address, which gave a 4-stage V partition the inputs of a 2-stage one.
    """
    shape_key = tuple((tuple(t.shape), t.dtype) for t in flat)
    ios = {}
    for s in local:
        key = (id(staged), s, shape_key)
        hit = io_cache.get(key) if io_cache is not None else None
        io = hit[1] if isinstance(hit, tuple) and hit[0] is staged else None
        if io is None:
            io = stage_io(staged, s, flat)
            if io_cache is not None:
                io_cache[key] = (staged, io)  # keeps the program alive, so its id is not reused while cached
        ios[s] = io
    return ios


def _fuse_blind_stages(acts: dict[int, list[Action]], rank: int, ios: Mapping[int, Any]) -> tuple[dict[int, list[Action]], list[int]]:
    """Full backwards on this rank's stages whose split backward would drop parameter gradients.

    A stage with "blind" parameters (gradient paths that meet no grad-requiring stage input)
    that still runs a backward-input B gets all its backwards fused
    (:func:`fxpipe.ir.lowering.full_backward`). Other stages' communication is unaffected (a
    full backward sends/receives exactly like a backward-input). Returns the new actions and
    the stages fused.
    """
    fused = []
    for s, io in ios.items():
        if not io.blind_params or not any(a.stage == s and a.type == "B" for a in acts[rank]):
            continue
        names = list(io.blind_params)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        logger.warning(
            "stage %d: split backward (I/W) cannot compute the gradients of %s (their paths do not meet "
            "a grad-requiring stage input); running full backwards on this stage", s, shown,
        )
        acts = {r: full_backward(a, stages=[s]) for r, a in acts.items()}
        fused.append(s)
    return acts, fused


def _materialize_stages(staged: StagedProgram, local: Sequence[int], state_source: Any, dev: torch.device) -> dict:
    """Real parameters and buffers of this rank's stages (:mod:`fxpipe.codegen.materialize`).

    Only this rank's stages leave meta, after shape inference (which runs the stages before
    this one on fake tensors); a parameter tied across this rank's stages stays one tensor.

    Raises
    ------
    InputError
        If a stage holds meta tensors and no ``state_source`` is given.
    """
    materialized = {}
    made: dict = {}
    for s in local:
        if state_source is not None:
            materialized[s] = materialize_stage(staged, s, state_source, dev, shared=made)
        elif holds_meta(staged.stages[s].module):
            raise InputError(
                f"stage {s} holds meta tensors (the model was built on meta): pass state_source="
                "fxpipe.codegen.materialize.StateSource(seed=..., checkpoint=..., model=...) to materialize it"
            )
    return materialized


def _pipeline_stages(staged: StagedProgram, local: Sequence[int], ios: Mapping[int, Any], dev: torch.device, group,
                     wrap_module: Callable | None, compile_stages: bool) -> tuple[list[FxpipePipelineStage], dict]:
    """This rank's ``PipelineStage`` s (eager, or Inductor-compiled with split backward) and their modules.

    Each stage module is moved to ``dev`` and wrapped (``wrap_module``, data parallelism)
    before its ``PipelineStage`` is made with the statically inferred inputs and outputs.
    """
    pipeline_stages: list[FxpipePipelineStage] = []
    modules: dict[int, torch.nn.Module] = {}
    for s in local:
        io = ios[s]
        module = staged.stages[s].module.to(dev)
        if wrap_module is not None:
            wrap_module(s, module)
        modules[s] = module
        ins = tuple(t.to(dev) for t in io.inputs)
        outs = tuple(t.to(dev) for t in io.outputs)
        stage_cls, run_module = FxpipePipelineStage, module
        # ---- begin compile_stages (owner: issue 10): Inductor per stage with split backward
        if compile_stages:
            stage_cls, run_module = CompiledPipelineStage, compile_stage(module)
        # ---- end compile_stages
        pipeline_stages.append(stage_cls(run_module, stage_index=s, num_stages=staged.num_stages, device=dev,
                                         input_args=ins, output_args=outs, group=group))
    return pipeline_stages, modules


def build_pipeline_rank(
    gm: torch.fx.GraphModule,
    stage_of: Mapping[str, int],
    rank: int,
    orders: Orders,
    *,
    num_microbatches: int,
    loss_fn: Callable | None,
    group=None,
    device: str | torch.device = "cpu",
    example_microbatch_inputs: Any = None,
    fuse: bool = True,
    fused_backward: bool = False,
    compile_stages: bool = False,
    recompute_stages: Sequence[int] = (),
    track_activations: bool = True,
    state_source: Any = None,
    activation_checkpointing: Sequence[Any] | None = None,
) -> tuple[tuple[FxpipePipelineStage, ...], FxpipeScheduleRuntime]:
    """Split ``gm`` into ``orders.num_stages`` stages and build this rank's stages and runtime (one call).

    ``orders`` are the per-device :class:`~fxpipe.ir.Orders` (with the placement; their O/R
    actions are executed); see :func:`split_stages` and :func:`build_rank` for the other
    parameters, the return value and errors. Example inputs default to zeros shaped like
    ``gm``'s captured example (:func:`example_inputs_from_gm`; ``gm`` must have been captured
    with one micro-batch).
    """
    if not isinstance(orders, Orders):
        raise InputError(
            f"build_pipeline_rank takes fxpipe.ir.Orders, got {type(orders).__name__}: convert a schedule with "
            "fxpipe.ir.schedule_to_orders(schedule, problem)"
        )
    staged = split_stages(gm, stage_of, orders.num_stages)
    if example_microbatch_inputs is None:
        example_microbatch_inputs = example_inputs_from_gm(gm)
    return build_rank(
        staged, rank, orders, num_microbatches=num_microbatches, loss_fn=loss_fn, group=group, device=device,
        example_microbatch_inputs=example_microbatch_inputs, fuse=fuse, fused_backward=fused_backward,
        compile_stages=compile_stages,
        recompute_stages=recompute_stages, track_activations=track_activations, state_source=state_source,
        activation_checkpointing=activation_checkpointing,
    )
