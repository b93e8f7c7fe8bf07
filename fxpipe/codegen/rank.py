"""Build one rank of a pipeline: its ``PipelineStage`` and the schedule runtime loaded with its actions.

:func:`build_rank` assembles the pieces: the stage module from :mod:`fxpipe.codegen.split`,
its example inputs/outputs from :mod:`fxpipe.codegen.shapes` (static, on fake tensors), the
per-rank actions from :mod:`fxpipe.codegen.actions`, and :class:`~fxpipe.codegen.runtime.FxpipeScheduleRuntime`
(torch's runtime with the model's calling convention, :mod:`fxpipe.codegen.interface`).
:func:`build_pipeline_rank` does it all from a captured graph and a stage map in one call.

One stage per rank: rank ``r`` runs stage ``r``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from fxpipe.codegen.actions import actions_from_orders, fuse_backward, orders_from_schedule, parse_action
from fxpipe.codegen.interface import ModelInputs
from fxpipe.codegen.runtime import FxpipePipelineStage, FxpipeScheduleRuntime
from fxpipe.codegen.shapes import stage_io
from fxpipe.codegen.split import StagedProgram, split_stages
from fxpipe.errors import InputError

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
    from fxpipe.codegen.interface import ModelInterface
    from fxpipe.codegen.runtime import tree_unflatten

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


def _shared_param_groups(staged: StagedProgram, stage_index: int, group, module: torch.nn.Module, cache=None):
    """Create (collectively, on every rank) one process group per set of ranks sharing parameters.

    ``cache`` (a dict kept by the caller across builds in the same process group) reuses groups.
    """
    sets: dict[tuple[int, ...], list[str]] = {}
    for fqn, stages in sorted(staged.shared_params.items()):
        sets.setdefault(tuple(sorted(stages)), []).append(fqn)
    result = []
    spec = staged.stages[stage_index]
    for ranks, fqns in sorted(sets.items()):
        global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in ranks]
        key = tuple(global_ranks)
        if cache is not None and key in cache:
            grp = cache[key]
        else:
            grp = dist.new_group(ranks=global_ranks)
            if cache is not None:
                cache[key] = grp
        if stage_index in ranks:
            for fqn in fqns:
                result.append((module.get_parameter(spec.param_targets[fqn]), grp))
    return result


def build_rank(
    staged: StagedProgram,
    rank: int,
    actions: Mapping[int, Sequence[str]],
    *,
    num_microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    group=None,
    device: str | torch.device = "cpu",
    example_microbatch_inputs: Any = None,
    fused_backward: bool = False,
    group_cache: dict | None = None,
    io_cache: dict | None = None,
    device_programs: Any = None,
    recompute_stages: Sequence[int] = (),
    track_activations: bool = True,
    state_source: Any = None,
) -> tuple[FxpipePipelineStage, FxpipeScheduleRuntime]:
    """This rank's ``PipelineStage`` and a schedule runtime loaded with the per-rank actions.

    Must be called on every rank of ``group`` (it creates process groups for tied parameters
    collectively), after ``torch.distributed.init_process_group``.

    Parameters
    ----------
    staged : StagedProgram
        From :func:`fxpipe.codegen.split.split_stages`, built identically on every rank.
    rank : int
        This process's rank in ``group`` (= its stage index).
    actions : Mapping[int, Sequence[str]]
        Per-rank compute actions (``"0F1"``, ``"1I0"``, ``"1W0"``, ``"2B3"``) for *all* ranks,
        e.g. from :func:`fxpipe.codegen.actions.actions_from_orders`.
    num_microbatches : int
        Micro-batches per step.
    loss_fn : callable(output, target) -> scalar tensor, or None
        Applied to every micro-batch's output (in the model's output structure) on the last
        stage; ``None`` = forward only.
    group : ProcessGroup, optional
        Pipeline group (default: world).
    device : str or torch.device
        Device of this stage.
    example_microbatch_inputs : ModelInputs, tuple or dict
        One micro-batch of model inputs in the model's calling form (a tuple of positional
        inputs, a dict of keyword inputs, or :class:`~fxpipe.codegen.interface.ModelInputs`),
        or just the model's tensor inputs flattened in order,
        used to infer the shapes, dtypes and ``requires_grad`` of every tensor crossing a stage
        (static shape inference on fake tensors, no P2P metadata exchange, no real state touched).
    fused_backward : bool
        Fallback: run full backwards instead of split backward-input / backward-weight.
    group_cache : dict, optional
        Process groups for tied parameters created by earlier builds in this process group
        (keyed by global ranks); every rank must pass the same kind of cache.
    io_cache : dict, optional
        Shape-inference results of earlier builds of the same ``staged`` program and rank
        (they do not depend on the schedule), kept by the caller.
    device_programs : fxpipe.ir.Orders or Mapping[int, list[(type, microbatch)]], optional
        The device programs with their offload (O) and reload (R) actions (e.g.
        :func:`fxpipe.ir.schedule_to_orders`); this rank executes its device's O/R
        (:mod:`fxpipe.codegen.offload`). Without it nothing is offloaded.
    recompute_stages : sequence of int
        Stages that recompute their forward during the backward instead of stashing
        activations (:mod:`fxpipe.codegen.stash`).
    track_activations : bool
        Count live saved bytes per stage with the saved-tensor hooks (``sched.fxpipe_stash``),
        also without offload or recomputation (default).
    state_source : fxpipe.codegen.materialize.StateSource, optional
        Where this stage's parameters and buffers come from (a checkpoint and/or the model's
        initializers under a seed). Required when the stage is on ``meta``; then only this
        stage is materialized (:mod:`fxpipe.codegen.materialize`).

    Returns
    -------
    (PipelineStage, FxpipeScheduleRuntime)
        ``schedule.step(*inputs, target=..., losses=[...])`` runs one training step: the model's
        inputs for the whole batch on the first rank, the target on the last rank.

    Raises
    ------
    InputError
        On malformed actions, a rank outside the pipeline, example inputs that do not match the
        captured graph, or a schedule torch rejects (the message names rank, stage and micro-batch).
    """
    S = staged.num_stages
    world = dist.get_world_size(group)
    if world != S:
        raise InputError(f"the pipeline has {S} stages but the process group has {world} ranks; one stage per rank")
    if not 0 <= rank < S:
        raise InputError(f"rank must lie in 0..{S - 1}, got {rank}")
    if sorted(int(r) for r in actions) != list(range(S)):
        raise InputError(f"actions must list every rank 0..{S - 1}, got {sorted(actions)}")
    acts = {int(r): list(v) for r, v in actions.items()}
    for r, lst in acts.items():  # validate before anything reads the actions
        for step, a in enumerate(lst):
            act = parse_action(a, f"rank {r}, step {step}")
            if act is not None and act.stage != r:
                raise InputError(
                    f"rank {r}, step {step}: action {a!r} is for stage {act.stage}; fxpipe runs one stage per "
                    f"rank (stage s on rank s)"
                )
    if fused_backward:
        acts = fuse_backward(acts)
    if example_microbatch_inputs is None:
        raise InputError("example_microbatch_inputs is required (one micro-batch of model inputs)")
    flat = staged.interface.example_inputs(example_microbatch_inputs)
    key = (id(staged), rank, tuple((tuple(t.shape), t.dtype) for t in flat))
    io = io_cache.get(key) if io_cache is not None else None
    if io is None:
        io = stage_io(staged, rank, flat)
        if io_cache is not None:
            io_cache[key] = io
    fused_here = False
    if io.blind_params and any("I" in a for a in acts[rank]):
        # Split backward would drop these parameters' gradients: run full backwards on this
        # rank. Other ranks' communication is unaffected (B sends/receives exactly like I).
        names = list(io.blind_params)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        logger.warning(
            "stage %d: split backward (I/W) cannot compute the gradients of %s (their paths do not meet "
            "a grad-requiring stage input); running full backwards on this stage", rank, shown,
        )
        acts[rank] = fuse_backward({rank: acts[rank]})[rank]
        fused_here = True
    dev = torch.device(device)
    spec = staged.stages[rank]
    # ---- begin per-rank materialization (fxpipe.codegen.materialize): only this stage leaves meta
    from fxpipe.codegen.materialize import holds_meta, materialize_stage

    materialized = None
    if state_source is not None:
        materialized = materialize_stage(staged, rank, state_source, dev)
    elif holds_meta(spec.module):
        raise InputError(
            f"stage {rank} holds meta tensors (the model was built on meta): pass state_source="
            "fxpipe.codegen.materialize.StateSource(seed=..., checkpoint=..., model=...) to materialize it"
        )
    # ---- end per-rank materialization
    module = spec.module.to(dev)
    ins = tuple(t.to(dev) for t in io.inputs)
    outs = tuple(t.to(dev) for t in io.outputs)
    stage = FxpipePipelineStage(module, stage_index=rank, num_stages=S, device=dev, input_args=ins, output_args=outs, group=group)
    shared = _shared_param_groups(staged, rank, group, module, group_cache)
    sched = FxpipeScheduleRuntime([stage], num_microbatches, loss_fn=loss_fn, interface=staged.interface, shared_grads=shared)
    sched.load_actions(acts)
    sched.fxpipe_fused_full_backward = fused_here or fused_backward
    # ---- begin activation stash (fxpipe.codegen.stash): live saved bytes, offload/reload, recomputation
    from fxpipe.codegen.stash import device_stash

    stage.fxpipe_stash = device_stash(rank, S, acts[rank], device_programs, recompute_stages, {rank: module}, dev,
                                      track_activations)
    sched.fxpipe_stash = stage.fxpipe_stash
    sched.fxpipe_materialized = materialized
    # ---- end activation stash
    return stage, sched


def build_pipeline_rank(
    gm: torch.fx.GraphModule,
    stage_of: Mapping[str, int],
    num_stages: int,
    rank: int,
    orders: Mapping[int, Sequence[tuple[str, int]]] | Any,
    *,
    num_microbatches: int,
    loss_fn: Callable | None,
    group=None,
    device: str | torch.device = "cpu",
    example_microbatch_inputs: Any = None,
    fuse: bool = True,
    fused_backward: bool = False,
    device_programs: Any = None,
    recompute_stages: Sequence[int] = (),
    track_activations: bool = True,
    state_source: Any = None,
) -> tuple[FxpipePipelineStage, FxpipeScheduleRuntime]:
    """Split ``gm``, lower the orders and build this rank's stage and runtime (one call).

    ``orders`` is ``{stage: [(type, microbatch), ...]}`` or an ``fxpipe.ir.Schedule`` (converted
    with :func:`~fxpipe.codegen.actions.orders_from_schedule`; its O/R actions become the device
    programs unless ``device_programs`` is given). See :func:`split_stages`,
    :func:`actions_from_orders` and :func:`build_rank` for the other parameters and errors.
    Example inputs default to zeros shaped like ``gm``'s captured example
    (:func:`example_inputs_from_gm`; ``gm`` must have been captured with one micro-batch).
    """
    if isinstance(orders, Mapping) and device_programs is None and any(
            str(t) in ("O", "R") for ops in orders.values() for t, _ in ops):
        from fxpipe.ir import Orders

        device_programs = Orders.from_stage_orders(orders)
    if not isinstance(orders, Mapping):
        if device_programs is None:
            from fxpipe.ir import schedule_to_orders

            device_programs = schedule_to_orders(orders)
        orders = orders_from_schedule(orders, num_stages)
    staged = split_stages(gm, stage_of, num_stages)
    actions = actions_from_orders(orders, num_stages, num_microbatches=num_microbatches, fuse=fuse)
    if example_microbatch_inputs is None:
        example_microbatch_inputs = example_inputs_from_gm(gm)
    return build_rank(
        staged, rank, actions, num_microbatches=num_microbatches, loss_fn=loss_fn, group=group, device=device,
        example_microbatch_inputs=example_microbatch_inputs, fused_backward=fused_backward,
        device_programs=device_programs, recompute_stages=recompute_stages, track_activations=track_activations,
        state_source=state_source,
    )
