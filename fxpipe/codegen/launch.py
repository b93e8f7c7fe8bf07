"""Run a pipeline on this machine: N gloo processes, a few training steps, results gathered.

:func:`spawn_train_many` starts ``world_size`` worker processes once and runs a list of
training runs in them. A worker captures each model once (``fxpipe.passes.capture``, i.e.
``torch.export`` of one micro-batch, exactly as ``fxpipe.compile`` does), keeps the capture and
its initial state for the following runs of the same model (other schedules), splits it into
stages, builds each rank's ``PipelineStage`` s + schedule runtime (:mod:`fxpipe.codegen.rank`;
several stages per rank with looped or V placements) and trains with SGD. Schedules come in as
:class:`fxpipe.ir.Orders` built by the caller (codegen never calls the scheduler). :func:`reference_train` trains the eager model in one process with the
same micro-batches (:func:`fxpipe.codegen.interface.split_microbatches`) and loss averaging
(loss applied per micro-batch, gradients of the mean micro-batch loss, as torch's schedules
with ``scale_grads=True``). :func:`fxpipe.codegen.compare.compare_training` compares the two:
the end-to-end correctness oracle of the code generator.

The processes are started by the one local launcher (:func:`fxpipe.launcher.launch`: port,
gloo group, error reports, time-outs). Worker results travel through its folder (JSON for
losses, written atomically; ``torch.save`` of tensors for gradients/parameters/buffers, read
back with ``weights_only=True``; test plumbing only, never an fxpipe output file).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from fxpipe.codegen.actions import check_orders
from fxpipe.codegen.checkpointing import captured_policies
from fxpipe.codegen.compare import gradient_precision, output_precision, random_ops_warning
from fxpipe.codegen.effects import random_ops
from fxpipe.codegen.interface import ModelInputs, as_call, call_model, split_microbatches
from fxpipe.codegen.materialize import StateSource, real_state_bytes
from fxpipe.codegen.mesh import build_mesh_rank, check_mesh_run, check_offload_run, full_tensors, init_mesh, replica_slice
from fxpipe.codegen.rank import build_rank
from fxpipe.codegen.runtime import UnshardedProbe, fsdp_offload_policy
from fxpipe.codegen.split import split_stages
from fxpipe.errors import InputError, WorkerError
from fxpipe.io import write_text_atomic
from fxpipe.ir.schedule import Orders
from fxpipe.launcher import RankContext, clear_reports, errors_text, free_port, launch, worker_error
from fxpipe.mesh import is_pure_pipeline, mesh_tp, microbatches_per_replica, normalize_mesh
from fxpipe.passes.capture import capture

__all__ = [
    "TrainResult",
    "RunError",
    "spawn_train",
    "spawn_train_many",
    "reference_train",
    "cross_entropy_loss",
    "free_port",
]


@dataclass
class TrainResult:
    """Result of a few training steps.

    Attributes
    ----------
    losses : list[float]
        Mean micro-batch loss of each step (before that step's optimizer update).
    grads : dict[str, torch.Tensor | None]
        Gradient of every parameter (canonical FQN, i.e. ``model.named_parameters()`` names)
        after the last step's backward, before its update; ``None`` where autograd produced
        none (parameters the forward never uses), as in eager PyTorch.
    params : dict[str, torch.Tensor]
        Parameters after all steps.
    buffers : dict[str, torch.Tensor]
        Buffers after all steps (``model.named_buffers()`` names; from the stage owning each).
    meta : dict
        Extra information: ``stage_params`` (canonical parameter names of every stage),
        ``shared_params``, ``actions`` (per rank), ``device_of_stage``, ``relayed``,
        ``cloned``, ``fused_full_backward`` (per stage), ``recv_buffers`` (per stage:
        ``{"fwd": n, "bwd": n}`` buffers per received tensor after reuse,
        :func:`fxpipe.codegen.runtime.recv_buffer_slots`), ``random_ops``, ``moved_nodes``,
        ``grad_precision`` and ``output_precision`` (:func:`fxpipe.codegen.compare.gradient_precision`,
        the tolerances per dtype),
        ``train_wall_s``, ``wall_s``.
    """

    losses: list[float]
    grads: dict[str, torch.Tensor | None]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunError:
    """A run of :func:`spawn_train_many` (``on_error="record"``) that failed: its message."""

    message: str


def cross_entropy_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy (mean) of logits ``(..., V)`` against ids ``(...)``.

    ``output`` may be the logits tensor or a model output holding ``logits`` (a Hugging Face
    ``ModelOutput`` or a dict).
    """
    if not isinstance(output, torch.Tensor):
        output = output["logits"]
    return torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def _loss_fn(loss: str | Callable) -> Callable:
    if callable(loss):
        return loss
    if loss == "cross_entropy":
        return cross_entropy_loss
    if loss == "mse":
        return torch.nn.functional.mse_loss
    raise InputError(f"unknown loss {loss!r}: use 'cross_entropy', 'mse' or a callable(output, target)")


def _as_inputs(inputs: Any) -> ModelInputs:
    return ModelInputs(*as_call(inputs))


def _grads_of(named: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor | None]:
    return {k: (p.grad.detach().clone() if p.grad is not None else None) for k, p in named.items()}


def reference_train(
    make_model: Callable[[], tuple[torch.nn.Module, Any]],
    make_batch: Callable[[int], tuple[Any, Any]],
    *,
    num_microbatches: int,
    steps: int = 2,
    lr: float = 0.1,
    loss: str | Callable = "cross_entropy",
    seed: int = 0,
) -> TrainResult:
    """Single-process training of the eager model with pipeline loss semantics.

    Each step: the batch from ``make_batch(step)`` is split into ``num_microbatches`` micro-batches
    (:func:`~fxpipe.codegen.interface.split_microbatches`, the pipeline's rule, also for the
    target); ``loss = mean_j loss_fn(model(mb_j), target_j)``; backward; SGD update.

    Parameters
    ----------
    make_model : callable() -> (model, example_inputs)
        Built under ``torch.manual_seed(seed)`` (same as the workers of :func:`spawn_train`).
        Inputs are a tuple (positional), a dict (keywords) or a
        :class:`~fxpipe.codegen.interface.ModelInputs`, of any pytree structure.
    make_batch : callable(step) -> (inputs, target)
        Full batch of step ``step`` (``target`` any pytree).
    num_microbatches, steps, lr, loss, seed :
        As in :func:`spawn_train`.

    Runs with one intra-op thread, as the pipeline workers do, so that both sides use the same
    kernels and reduction orders (ill-conditioned models, e.g. BatchNorm on small micro-batches,
    amplify the rounding differences of other thread counts).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' setting: the same kernels, the same reduction order
    try:
        return _reference_train(make_model, make_batch, num_microbatches, steps, lr, _loss_fn(loss), seed)
    finally:
        torch.set_num_threads(threads)


def _reference_train(make_model, make_batch, num_microbatches, steps, lr, lf, seed) -> TrainResult:
    torch.manual_seed(seed)
    model, _ = make_model()
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=lr)
    losses: list[float] = []
    grads: dict[str, torch.Tensor | None] = {}
    for step in range(steps):
        inputs, target = make_batch(step)
        opt.zero_grad(set_to_none=True)
        mbs = split_microbatches(_as_inputs(inputs), num_microbatches)
        tgts = split_microbatches(target, num_microbatches, "target")
        total = None
        vals = []
        for mb, tg in zip(mbs, tgts):
            l = lf(call_model(model, mb), tg)
            vals.append(float(l.detach()))
            total = l if total is None else total + l
        (total / num_microbatches).backward()
        losses.append(sum(vals) / len(vals))
        grads = _grads_of(params)
        opt.step()
    return TrainResult(
        losses, grads, {k: p.detach().clone() for k, p in params.items()},
        {k: b.detach().clone() for k, b in model.named_buffers()}, {"num_microbatches": num_microbatches},
    )


def _capture(model: torch.nn.Module, mb_example: ModelInputs) -> torch.fx.GraphModule:
    """The unlifted graph of one micro-batch, captured exactly as ``fxpipe.compile`` does."""
    return capture(model, mb_example.args, mb_example.kwargs).gm


class _Captured:
    """A worker's capture of one model, kept for the next runs of the same model.

    The initial values of every parameter and buffer are kept; :meth:`reset` restores them
    (and clears gradients) so each run starts from the weights ``make_model`` built.
    """

    def __init__(self, key, gm: torch.fx.GraphModule, mb_example: ModelInputs):
        self.key = key
        self.gm = gm
        self.mb_example = mb_example
        self.random_ops = None
        self.grad_precision = None
        self.output_precision = None
        self.tp_structure = None  # fxpipe.passes.tensor_parallel.find_tensor_parallel(gm), made for tp > 1 runs
        tensors = {id(t): t for _, t in list(gm.named_parameters()) + list(gm.named_buffers())}
        self._state = [(t, t.detach().clone()) for t in tensors.values()]
        self.staged: dict = {}  # (world, stage map) -> StagedProgram
        self.io_cache: dict = {}  # shape inference per staged program and rank

    def reset(self) -> None:
        with torch.no_grad():
            for t, v in self._state:
                t.copy_(v)
                if isinstance(t, torch.nn.Parameter):
                    t.grad = None


def _capture_key(run: Mapping[str, Any]):
    return (run.get("model_key", id(run["make_model"])), run["seed"], run["num_microbatches"], run.get("state") is not None)


def _captured_for(run: Mapping[str, Any], cache: dict, where: dict) -> _Captured:
    """The worker's capture of the run's model: reused (weights reset) when the previous run had the same model.

    Leaves torch's RNG seeded with ``run["seed"]``, as every run starts.
    """
    where["phase"] = "capturing the model"
    key = _capture_key(run)
    cap = cache.get("captured")
    state = run.get("state")  # per-rank materialization: the model is built on meta (fxpipe.codegen.materialize)
    if cap is None or cap.key != key:
        cache["captured"] = None
        torch.manual_seed(run["seed"])
        if state is not None:
            with torch.device("meta"):
                model, example = run["make_model"]()
        else:
            model, example = run["make_model"]()
        mb_example = split_microbatches(_as_inputs(example), run["num_microbatches"])[0]
        cap = _Captured(key, _capture(model, mb_example), mb_example)
        cap.model = model if state is not None else None
        cache["captured"] = cap
    else:
        cap.reset()
    torch.manual_seed(run["seed"])
    if cap.random_ops is None:
        cap.random_ops = [str(o) for o in random_ops(cap.gm)]
    if cap.grad_precision is None:  # tolerances per dtype of fxpipe.codegen.compare
        cap.grad_precision = gradient_precision(cap.gm)
        cap.output_precision = output_precision(cap.gm)
    return cap


def _staged_for(cap: _Captured, run: Mapping[str, Any], num_stages: int, where: dict):
    """The capture split into the run's stages (cached per stage map, except with data parallelism,
    which wraps the stage modules in place)."""
    stage_of = run["stage_of"]
    if callable(stage_of):
        where["phase"] = "matching its capture to the plan"
        stage_of = stage_of(cap.gm)
    where["phase"] = "splitting the graph into stages"
    if run.get("mesh") is not None:
        return split_stages(cap.gm, stage_of, num_stages)
    skey = (num_stages, tuple(sorted(stage_of.items())))
    if skey not in cap.staged:
        cap.staged[skey] = split_stages(cap.gm, stage_of, num_stages)
    return cap.staged[skey]


def _policies_for(cap: _Captured, run: Mapping[str, Any], num_stages: int):
    """The run's activation-checkpoint policies (plan node names) in the names of this worker's capture."""
    policies = run.get("activation_checkpointing")
    if policies is None:
        return None
    structure = getattr(run["stage_of"], "structure", None)  # a plan's stage map: match by structure
    names = None
    if structure is not None:
        from fxpipe.passes.structure import match_nodes

        names = match_nodes(structure, cap.gm)
    return captured_policies(policies, num_stages, names)


def _build_rank_program(rank: int, run: Mapping[str, Any], cap: _Captured, staged, groups: dict, dp: int):
    """This rank's ``PipelineStage`` s and schedule runtime: ``(stages, schedule, replica, pp_rank)``."""
    source = None
    state = run.get("state")
    if state is not None:
        source = StateSource(seed=state.get("seed", 0), checkpoint=state.get("checkpoint"), model=cap.model)
    build_kwargs = dict(
        num_microbatches=run["num_microbatches"] // dp, loss_fn=_loss_fn(run["loss"]),
        example_microbatch_inputs=cap.mb_example, fuse=run["fuse"], fused_backward=run["fused_backward"],
        group_cache=groups, io_cache=cap.io_cache, compile_stages=run.get("compile_stages", False),
        recompute_stages=tuple(run.get("recompute_stages", ())), state_source=source,
        activation_checkpointing=_policies_for(cap, run, staged.num_stages),
    )
    mesh = run.get("mesh")
    if mesh is None:
        stages, sched = build_rank(staged, rank, run["orders"], **build_kwargs)
        return stages, sched, 0, rank
    mkey = ("device_mesh", tuple(sorted(mesh.items())))
    if mkey not in groups:
        groups[mkey] = init_mesh(mesh)
    if mesh_tp(mesh) > 1:  # tensor parallelism: the capture's structure (fxpipe.codegen.tensor_parallel)
        if cap.tp_structure is None:
            from fxpipe.passes.tensor_parallel import find_tensor_parallel

            cap.tp_structure = find_tensor_parallel(cap.gm)
        build_kwargs["tensor_parallel"] = cap.tp_structure
        build_kwargs["tensor_parallel_params"] = run.get("tensor_parallel_params")
    stages, sched, mr = build_mesh_rank(staged, rank, run["orders"], mesh=mesh, device_mesh=groups[mkey],
                                        offload_optimizer=bool(run.get("offload_optimizer")),
                                        fsdp_blocks=run.get("fsdp_blocks"), **build_kwargs)
    return stages, sched, mr.replica, mr.pp_rank


def _train_steps(rank: int, run: Mapping[str, Any], sched, named: Mapping[str, torch.nn.Parameter], replica: int,
                 dp: int, out_dir: str, idx: int, where: dict):
    """SGD steps of the run: ``(losses, grads after the last backward, wall seconds)``."""
    # every parameter object of the rank (with data parallelism a tied parameter has one copy per stage)
    opt_params = sched.parameters() if run.get("mesh") is not None else list(named.values())
    opt = torch.optim.SGD(opt_params, lr=run["lr"]) if opt_params else None  # pure relay stages: no params
    first, last = sched.has_first_stage, sched.has_last_stage
    losses: list[float] = []
    grads: dict[str, torch.Tensor | None] = {}
    t0 = time.perf_counter()
    for step in range(run["steps"]):
        where["phase"] = f"training step {step}"
        inputs, target = run["make_batch"](step)
        if dp > 1:  # this replica's slice of the global batch
            inputs = replica_slice(_as_inputs(inputs), replica, dp)
            target = replica_slice(target, replica, dp, "target")
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        mb_losses: list[torch.Tensor] = []
        args, kwargs = as_call(inputs) if first else ((), {})
        sched.step(*args, target=target if last else None, losses=mb_losses, return_outputs=False, **kwargs)
        if last:
            losses.append(sum(float(l.detach()) for l in mb_losses) / len(mb_losses))
        grads = _grads_of(named)
        if opt is not None:
            opt.step()
        if rank == 0 and run.get("report_progress"):
            _write_progress(out_dir, idx, step + 1)
    return losses, grads, time.perf_counter() - t0


def _run_one(rank: int, world: int, run: dict, out_dir: str, idx: int, cache: dict, groups: dict,
             where: dict | None = None) -> None:
    """One training run inside an initialised process group (this rank runs its stages of the placement).

    Capture (or reuse the capture of the previous run), split into stages, build this rank's
    stages and schedule, train, write the results (``run<idx>_rank<rank>.json`` and ``.pt``).
    ``where`` is updated with what the worker is doing (``phase``, ``stages``), for its error report.
    """
    where = where if where is not None else {}
    orders = run["orders"]
    mesh = run.get("mesh")  # pipeline x data parallelism (fxpipe.codegen.mesh); None: a pure pipeline
    dp = 1 if mesh is None else mesh["dp_shard"] * mesh["dp_replicate"]
    S = orders.num_stages
    where["stages"] = [s for s in range(S) if orders.device_of_stage[s] == rank]
    cap = _captured_for(run, cache, where)  # the RNG is then seeded with run["seed"]
    staged = _staged_for(cap, run, S, where)
    where["phase"] = "building its stages and schedule"
    stages, sched, replica, pp_rank = _build_rank_program(rank, run, cap, staged, groups, dp)
    for st in stages:  # every compute action into the rank's heartbeat (fxpipe.launcher)
        st.fxpipe_on_action = functools.partial(_beat_action, where)
    if dp > 1 and run.get("mesh") is not None:  # FSDP2's unsharded parameters, measured (fxpipe.memory.fsdp)
        from torch.distributed.fsdp import FSDPModule

        sched.fxpipe_unsharded = {st.stage_index: UnshardedProbe(st.submod) for st in stages
                                  if isinstance(st.submod, FSDPModule)}
    local = [st.stage_index for st in stages]
    named: dict[str, torch.nn.Parameter] = {}
    for s in local:  # stages of one rank share tied parameter objects: each once
        for fqn, prm in staged.stages[s].named_parameters().items():
            named.setdefault(fqn, prm)
    losses, grads, wall = _train_steps(rank, run, sched, named, replica, dp, out_dir, idx, where)
    where["phase"] = "writing its results"
    _write_run_results(out_dir, idx, rank, run, cap, staged, stages, sched, named, grads, losses, wall,
                       replica, pp_rank, dp)


def _beat_action(where: dict, action: str, running: bool) -> None:
    """A compute action starts (``running``) or ends: the heartbeat's ``running`` / ``last_action``."""
    if running:
        where["running"] = action
    else:
        where.update(running=None, last_action=action)


def _write_run_results(out_dir: str, idx: int, rank: int, run: Mapping[str, Any], cap: _Captured, staged, stages,
                       sched, named: Mapping[str, torch.nn.Parameter], grads: dict, losses: list[float], wall: float,
                       replica: int, pp_rank: int, dp: int) -> None:
    """The rank's tensors (``run<idx>_rank<rank>.pt``) and everything else (``.json``) of one run."""
    local = [st.stage_index for st in stages]
    stash = getattr(sched, "fxpipe_stash", None)
    mat = getattr(sched, "fxpipe_materialized", None)
    if run.get("state") is not None:
        held = real_state_bytes(cap.gm, cap.model, *(s.module for s in staged.stages))
    else:
        held = None
    bufs: dict[str, torch.Tensor] = {}
    for s in local:
        owned = {fqn for fqn, o in staged.buffer_owner.items() if o == s}
        bufs.update({k: b.detach().clone() for k, b in staged.stages[s].named_buffers().items() if k in owned})
    params = {k: p.detach().clone() for k, p in named.items()}
    mr = getattr(sched, "fxpipe_mesh_rank", None)
    tp_index = mr.tp_index if mr is not None else 0
    if dp > 1 or run.get("offload_optimizer") or (mr is not None and mr.tp > 1):
        # DTensors: full values (collective over each stage's data- and tensor-parallel groups)
        grads, params = full_tensors(grads), full_tensors(params)
        if replica or tp_index:  # replica 0's first tensor-parallel rank reports the model state; the others their losses
            grads, params, bufs = {}, {}, {}
    torch.save({"grads": grads, "params": params, "buffers": bufs}, os.path.join(out_dir, f"run{idx}_rank{rank}.pt"))
    write_text_atomic(
        os.path.join(out_dir, f"run{idx}_rank{rank}.json"),
        json.dumps(
            {
                "losses": losses,
                "has_last_stage": sched.has_last_stage,
                "replica": replica,
                "stages": local,
                "stage_param_fqns": {s: list(staged.stages[s].param_fqns) for s in local},
                "device_of_stage": list(run["orders"].device_of_stage),
                "shared_params": {k: list(v) for k, v in staged.shared_params.items()},
                "relayed": {s.index: list(s.relayed_names) for s in staged.stages},
                "cloned": {s.index: list(s.cloned_inputs) for s in staged.stages},
                "moved_nodes": {k: list(v) for k, v in staged.moved_nodes.items()},
                "actions": sched.fxpipe_actions[pp_rank],
                "fused_full_backward": {s: bool(v) for s, v in sched.fxpipe_fused_full_backward.items()},
                "recv_buffers": {st.stage_index: st.fxpipe_recv_buffers for st in stages},
                "compiled_stages": {st.stage_index: getattr(st.submod, "report", None) for st in stages},  # compile_stages (issue 10)
                "random_ops": cap.random_ops,
                "grad_precision": cap.grad_precision,
                "output_precision": cap.output_precision,
                "train_wall_s": wall,
                "activation": stash.stats().to_dict() if stash is not None else None,
                "checkpointing": {s: vars(c) for s, c in (getattr(sched, "fxpipe_checkpointing", None) or {}).items()
                                  if c is not None},
                "materialized": {s: r.to_dict() for s, r in mat.items()} if mat else None,
                "held_state_bytes": held,
                "offload_policy": {st.stage_index: repr(fsdp_offload_policy(st.submod)) for st in stages},
                "fsdp_blocks": {st.stage_index: list(getattr(st.submod, "fxpipe_fsdp_blocks", ())) for st in stages},
                "unsharded_peak_params": {s: p.peak_params
                                          for s, p in (getattr(sched, "fxpipe_unsharded", None) or {}).items()},
            }
        ),
    )


class _ActionLog(logging.Handler):
    """Keeps the action torch's schedule runtime reports when an action raises (and silences its schedule dump)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.action: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        if "caught" in msg and "action" in msg and record.args and isinstance(record.args, tuple):
            self.action = str(record.args[-1])


def _train_ranks(ctx: RankContext, cfg: dict) -> None:
    """A rank of :func:`spawn_train_many` (entry of :func:`fxpipe.launcher.launch`): every run in turn.

    The schedule action that raised (torch's runtime logs it) goes into the rank's error report.
    """
    import torch.distributed as dist

    actions = _ActionLog()
    sched_log = logging.getLogger("torch.distributed.pipelining.schedules")
    sched_log.addHandler(actions)
    sched_log.propagate = False  # the worker's error report names the action; no schedule dump on stderr
    try:
        torch.use_deterministic_algorithms(True)
        cache: dict = {}
        groups: dict = {}
        for idx, run in cfg["runs"]:
            ctx.where["run"] = idx
            actions.action = None
            _run_one(ctx.rank, ctx.world_size, run, ctx.out_dir, idx, cache, groups, ctx.where)
            ctx.where["phase"] = "waiting for the other ranks at the end of the run"
            dist.barrier()
    except BaseException:
        ctx.where["action"] = actions.action
        raise


def spawn_train(
    make_model: Callable[[], tuple[torch.nn.Module, Any]],
    stage_of: Mapping[str, int] | Callable[[torch.fx.GraphModule], Mapping[str, int]],
    orders: Orders,
    *,
    world_size: int,
    num_microbatches: int,
    make_batch: Callable[[int], tuple[Any, Any]],
    steps: int = 2,
    lr: float = 0.1,
    loss: str | Callable = "cross_entropy",
    seed: int = 0,
    fuse: bool = True,
    fused_backward: bool = False,
    timeout_s: float = 180.0,
) -> TrainResult:
    """Train a pipeline of ``world_size`` gloo processes on this machine for a few steps.

    Parameters
    ----------
    make_model : picklable callable() -> (model, example_inputs)
        Called under ``torch.manual_seed(seed)`` in every worker, so all ranks start from the
        same weights; ``example_inputs`` is a full batch in the model's calling form (a tuple
        of positional inputs, a dict of keyword inputs or a
        :class:`~fxpipe.codegen.interface.ModelInputs`; any pytree), whose first micro-batch
        (:func:`~fxpipe.codegen.interface.split_microbatches`) is what ``torch.export`` captures.
    stage_of : Mapping[str, int] or picklable callable(gm) -> Mapping[str, int]
        Node name -> stage (see :func:`fxpipe.codegen.split.split_stages`).
    orders : fxpipe.ir.Orders
        Per-device programs with the placement of the stages on the devices (ranks), e.g.
        ``fxpipe.ir.schedule_to_orders(schedule, problem)`` of a schedule from
        :mod:`fxpipe.schedule`, or :meth:`fxpipe.plan.Plan.orders`. ``orders.num_stages`` is the
        number of stages ``stage_of`` uses.
    world_size : int
        Number of processes = devices of the placement (``orders.num_devices``).
    num_microbatches : int
        Micro-batches per step.
    make_batch : picklable callable(step) -> (inputs, target)
        The full batch of each step, inputs in the same form as ``make_model``'s example;
        ``target`` any pytree (tensors split along dim 0 like the inputs).
    steps, lr, loss, seed :
        SGD steps, learning rate, ``"cross_entropy"`` / ``"mse"`` / callable(output, target)
        (must be picklable; ``output`` has the model's output structure), RNG seed.
    fuse, fused_backward :
        See :func:`fxpipe.codegen.actions.actions_from_orders` / :func:`fxpipe.codegen.rank.build_rank`.
    timeout_s : float
        Wall-clock limit for the whole run and for each collective; on expiry the workers are
        terminated and ``TimeoutError`` is raised instead of hanging.

    Returns
    -------
    TrainResult
        Losses (from the rank of the last stage), gradients and parameters of every parameter
        gathered from the ranks that hold it (canonical FQNs; tied parameters are checked to be equal on
        every holder), buffers from the stage that owns each.

    Raises
    ------
    InputError
        Before any worker starts: orders that are not :class:`~fxpipe.ir.Orders`, are
        incomplete or deadlock, or whose number of devices is not ``world_size``.
    WorkerError
        If a worker fails (:class:`fxpipe.errors.WorkerError`, also a ``RuntimeError``): the
        message leads with the first real failure (rank, stage, action or phase, cause), not
        the lost connections of the other ranks, and carries its traceback.
    TimeoutError
        If the run exceeds ``timeout_s``.
    """
    run = dict(
        make_model=make_model, stage_of=stage_of, orders=orders, num_microbatches=num_microbatches,
        make_batch=make_batch, steps=steps, lr=lr, loss=loss, seed=seed, fuse=fuse,
        fused_backward=fused_backward,
    )
    return spawn_train_many([run], world_size=world_size, timeout_s=timeout_s)[0]


def spawn_train_many(runs: Sequence[Mapping[str, Any]], *, world_size: int, timeout_s: float = 300.0,
                     on_error: str = "raise", run_timeout_s: float | None = None,
                     warn_random: bool = True, progress: bool | None = False,
                     action_timeout_s: float | None = None) -> list[TrainResult | RunError]:
    """Several :func:`spawn_train` runs in one set of worker processes (start-up paid once).

    Runs of the same model (same ``make_model`` object or the same ``model_key``, seed and
    micro-batch count) that follow each other reuse the workers' capture; put them next to each
    other.

    Parameters
    ----------
    runs : sequence of dict
        Each with the keyword arguments of :func:`spawn_train` except ``world_size`` and
        ``timeout_s`` (``make_model``, ``stage_of``, ``orders``, ``num_microbatches`` and
        ``make_batch`` are required), plus optionally ``model_key`` (hashable, names the model
        for capture reuse), ``recompute_stages`` (stages that recompute their forward during the
        backward), ``activation_checkpointing`` (one
        :class:`~fxpipe.memory.checkpoint.CheckpointPolicy` per stage, in the node names of
        ``stage_of``'s plan, matched to each worker's capture by structure when ``stage_of`` is
        a plan's; ``TrainResult.meta["checkpointing"]`` says what each stage carved,
        :mod:`fxpipe.codegen.checkpointing`) and ``state`` (a dict with ``seed`` and optionally ``checkpoint``: every worker
        builds the model on ``meta`` and materializes only its stages from the model's
        initializers under that seed and/or the checkpoint; the single-process reference is
        :class:`fxpipe.codegen.materialize.MetaInit`), and ``mesh`` (``{"pp", "dp_shard",
        "dp_replicate"}``, :mod:`fxpipe.codegen.mesh`: ``world_size = pp * dp`` ranks run ``dp``
        replicas of the ``pp``-device orders, stages wrapped by FSDP2; ``num_microbatches`` is
        then the global count, ``num_microbatches / dp`` per replica, every replica training on
        its slice of the batch; results hold the full parameters and gradients, the losses are
        the mean over the replicas), and ``offload_optimizer`` (with ``mesh``, also a pure
        pipeline's: parameters, gradients and optimizer state on the host, FSDP2's
        ``CPUOffloadPolicy``, :mod:`fxpipe.codegen.mesh`; ``TrainResult.meta["offload_policy"]``
        names every stage's policy). A mesh with ``"tp"`` runs tensor parallelism
        (:mod:`fxpipe.codegen.tensor_parallel`, ``world_size = pp * dp * tp``), optionally checked
        against the plan's ``tensor_parallel_params`` (``plan.tensor_parallel.params``). The ``Orders`` may carry offload/reload actions
        (``Action(s, "O", j)`` / ``"R"``; :func:`fxpipe.ir.schedule_to_orders` keeps a
        schedule's), which the workers execute. ``TrainResult.meta`` then holds,
        per rank, ``activation`` (the saved-tensor hooks' measurements,
        :class:`~fxpipe.codegen.stash.ActivationStats`), ``materialized`` and
        ``held_state_bytes`` (bytes of real parameters and buffers the rank holds).
    world_size : int
        As in :func:`spawn_train`.
    timeout_s : float
        Limit for all runs together (``on_error="raise"``) or, when ``run_timeout_s`` is not
        given, for each run (``on_error="record"``).
    on_error : {"raise", "record"}
        ``"raise"``: the first failing run raises. ``"record"``: a failing run becomes a
        :class:`RunError` in the result list and the workers restart with the next run.
    run_timeout_s : float, optional
        With ``on_error="record"``: limit for one run (default ``timeout_s``).
    warn_random : bool
        Warn (:class:`~fxpipe.codegen.compare.RandomOpsWarning`) for a model with active random ops.
    progress : bool or None
        Show a tqdm bar of training steps done over all runs on stderr (None: when stderr is
        a terminal).
    action_timeout_s : float, optional
        Longest time one schedule action (a forward, backward or weight gradient of one
        micro-batch) may run on a rank before the run stops as stuck (:func:`fxpipe.launcher.launch`).

    Returns
    -------
    list[TrainResult | RunError]
        One per run, in order.

    Raises
    ------
    WorkerError
        With ``on_error="raise"``, the first failure: rank, stage, micro-batch, action, the
        root cause and the model's source line (:mod:`fxpipe.codegen.faults`).
    WorkerTimeoutError
        Over ``timeout_s`` or ``action_timeout_s``: the late rank and its action (a ``TimeoutError``).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be an integer >= 1, got {world_size!r}")
    if on_error not in ("raise", "record"):
        raise InputError(f"on_error must be 'raise' or 'record', got {on_error!r}")
    defaults = dict(steps=2, lr=0.1, loss="cross_entropy", seed=0, fuse=True, fused_backward=False, compile_stages=False)
    norm_runs = []
    for i, r in enumerate(runs):
        missing = [k for k in ("make_model", "stage_of", "orders", "num_microbatches", "make_batch") if k not in r]
        if missing:
            raise InputError(f"run {i} lacks {missing}")
        run = {**defaults, **dict(r)}
        try:  # fail here, before any worker starts
            m_pipe = run["num_microbatches"]
            if run.get("mesh") is not None:
                mesh = normalize_mesh(run["mesh"], world_size)
                check_mesh_run(mesh, run["orders"], tuple(run.get("recompute_stages", ())), run["compile_stages"],
                               run.get("activation_checkpointing"), run.get("fsdp_blocks"), run.get("offload_optimizer"))
                m_pipe = microbatches_per_replica(run["num_microbatches"], mesh)
                run["mesh"] = None if is_pure_pipeline(mesh) and mesh_tp(mesh) == 1 and not run.get("offload_optimizer") \
                    else mesh
            if run.get("offload_optimizer"):
                if run.get("mesh") is None:
                    raise InputError("offload_optimizer needs the run's mesh (a pure pipeline: {'pp': world_size})")
                check_offload_run(run["orders"], tuple(run.get("recompute_stages", ())), run["compile_stages"])
            check_orders(run["orders"], m_pipe)
        except InputError as exc:
            raise InputError(f"run {i}: {exc}") from None
        if run.get("mesh") is None and run["orders"].num_devices != world_size:
            raise InputError(
                f"run {i}: the orders place the stages on {run['orders'].num_devices} devices but world_size is "
                f"{world_size}: one process per device"
            )
        norm_runs.append(run)
    results: dict[int, TrainResult | RunError] = {}
    per_run = run_timeout_s if run_timeout_s is not None else timeout_s
    if progress is None:
        progress = sys.stderr.isatty()
    from tqdm import tqdm

    bar = tqdm(total=sum(int(r["steps"]) for r in norm_runs), desc=f"pipeline training ({world_size} ranks)",
               unit="step", disable=not progress, leave=False)
    for run in norm_runs:
        run["report_progress"] = not bar.disable  # rank 0 writes a file per step only for a shown bar
    with bar, tempfile.TemporaryDirectory(prefix="fxpipe-spawn-") as out_dir:
        t0 = time.perf_counter()
        pending = list(range(len(norm_runs)))
        while pending:
            runs_now = [(i, norm_runs[i]) for i in pending]
            try:
                launch(_train_ranks, world_size, args=(dict(runs=runs_now),), threads=1, out_dir=out_dir,
                       timeout_s=timeout_s if on_error == "raise" else None,
                       collective_timeout_s=per_run if on_error == "record" else timeout_s,
                       poll=_watch(out_dir, runs_now, world_size, per_run if on_error == "record" else None,
                                   None if bar.disable else bar),
                       what="pipeline", action_timeout_s=action_timeout_s)
                pending = []
            except (RuntimeError, TimeoutError) as exc:
                done = [i for i in pending if _complete(out_dir, i, world_size)]
                failed = next((i for i in pending if i not in done), None)
                if on_error == "raise" or failed is None:
                    raise
                results[failed] = RunError(str(exc))
                clear_reports(out_dir)
                pending = [i for i in pending if i not in done and i != failed]
        wall = time.perf_counter() - t0
        for i in range(len(norm_runs)):
            if i not in results:
                results[i] = _gather(out_dir, world_size, i, wall)
    out = [results[i] for i in range(len(norm_runs))]
    if warn_random:
        seen: set = set()
        for r in out:
            ops = tuple(r.meta.get("random_ops", ())) if isinstance(r, TrainResult) else ()
            if ops and ops not in seen:
                seen.add(ops)
                random_ops_warning(ops)
    return out


def _write_progress(out_dir: str, idx: int, steps_done: int) -> None:
    """Rank 0 records how many steps of run ``idx`` are done (read by the launcher's bar)."""
    write_text_atomic(os.path.join(out_dir, f"progress{idx}"), str(steps_done))


def _steps_done(out_dir: str, runs) -> int:
    total = 0
    for i, _ in runs:
        try:
            with open(os.path.join(out_dir, f"progress{i}")) as f:
                total += int(f.read() or 0)
        except (OSError, ValueError):
            pass
    return total


def _complete(out_dir: str, idx: int, world: int) -> bool:
    return all(os.path.exists(os.path.join(out_dir, f"run{idx}_rank{r}.json")) for r in range(world))


def _watch(out_dir: str, runs: Sequence[tuple[int, Any]], world_size: int, run_timeout_s: float | None,
           bar=None) -> Callable[[], None]:
    """The launcher's poll: advance ``bar`` (tqdm) to the training steps done (rank 0's progress
    files) and raise ``TimeoutError`` when no run completed for ``run_timeout_s`` seconds."""
    state = {"done": 0, "since": time.monotonic()}

    def poll() -> None:
        now = time.monotonic()
        if bar is not None:
            bar.n = _steps_done(out_dir, runs)
            bar.refresh()
        if run_timeout_s is not None:
            done = sum(1 for i, _ in runs if _complete(out_dir, i, world_size))
            if done != state["done"]:
                state.update(done=done, since=now)
            if now - state["since"] > run_timeout_s:
                raise TimeoutError(f"a pipeline run with {world_size} ranks did not finish within "
                                   f"{run_timeout_s:.0f} s" + errors_text(out_dir))

    return poll


def _worker_error(out_dir: str, failed_rank: int | None, fallback: str) -> WorkerError:
    """The first real failure of the pipeline workers (:func:`fxpipe.launcher.worker_error`)."""
    return worker_error(out_dir, failed_rank, fallback, what="pipeline")


def _gather(out_dir: str, world: int, idx: int, wall: float) -> TrainResult:
    grads: dict[str, torch.Tensor | None] = {}
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    stage_params: dict[int, list[str]] = {}
    replica_losses: list[list[float]] = []
    info: dict[str, Any] = {}
    actions: dict[int, list[str]] = {}
    fused: dict[int, bool] = {}
    recv_buffers: dict[int, Any] = {}
    compiled: dict[int, Any] = {}
    activation: dict[int, Any] = {}
    materialized: dict[int, Any] = {}
    held: dict[int, Any] = {}
    offload: dict[int, Any] = {}
    checkpointing: dict[int, Any] = {}
    fsdp_blocks: dict[int, Any] = {}
    unsharded: dict[int, dict[int, int]] = {}
    train_wall = 0.0
    for r in range(world):
        with open(os.path.join(out_dir, f"run{idx}_rank{r}.json")) as f:
            info = json.load(f)
        blob = torch.load(os.path.join(out_dir, f"run{idx}_rank{r}.pt"), weights_only=True)
        stage_params.update({int(s): v for s, v in info["stage_param_fqns"].items()})
        actions[r] = info["actions"]
        fused.update({int(s): v for s, v in info["fused_full_backward"].items()})
        recv_buffers.update({int(s): v for s, v in (info.get("recv_buffers") or {}).items()})
        compiled.update({int(s): v for s, v in (info.get("compiled_stages") or {}).items()})
        checkpointing.update({int(s): v for s, v in (info.get("checkpointing") or {}).items()})
        activation[r] = info.get("activation")
        materialized[r] = info.get("materialized")
        held[r] = info.get("held_state_bytes")
        offload.update({int(s): v for s, v in (info.get("offload_policy") or {}).items()})
        fsdp_blocks.update({int(s): v for s, v in (info.get("fsdp_blocks") or {}).items()})
        unsharded[r] = {int(s): v for s, v in (info.get("unsharded_peak_params") or {}).items()}
        train_wall = max(train_wall, info["train_wall_s"])
        if info["has_last_stage"]:  # one per data-parallel replica
            replica_losses.append(info["losses"])
        buffers.update(blob["buffers"])
        for k, g in blob["grads"].items():
            if k in params:
                same_grad = (g is None and grads[k] is None) or (
                    g is not None and grads[k] is not None and torch.equal(grads[k], g))
                if not same_grad:
                    raise RuntimeError(f"tied parameter {k!r}: gradient differs between the ranks holding it")
                if not torch.equal(params[k], blob["params"][k]):
                    raise RuntimeError(f"tied parameter {k!r}: copies diverged between the ranks holding it")
                continue
            grads[k] = g
            params[k] = blob["params"][k]
    # the step's loss: the mean over every micro-batch of every replica (equal-sized replicas)
    losses = [sum(v) / len(v) for v in zip(*replica_losses)] if replica_losses else []
    return TrainResult(
        losses, grads, params, buffers,
        {"stage_params": [stage_params[s] for s in sorted(stage_params)],
         "shared_params": info.get("shared_params", {}), "actions": actions,
         "device_of_stage": info.get("device_of_stage", []),
         "relayed": {int(k): v for k, v in info.get("relayed", {}).items()},
         "cloned": {int(k): v for k, v in info.get("cloned", {}).items()},
         "moved_nodes": info.get("moved_nodes", {}), "random_ops": info.get("random_ops", []),
         "grad_precision": info.get("grad_precision") or {}, "output_precision": info.get("output_precision"),
         "fused_full_backward": fused, "recv_buffers": recv_buffers, "compiled_stages": compiled, "train_wall_s": train_wall, "wall_s": wall,
         "activation": activation, "materialized": materialized, "held_state_bytes": held,
         "offload_policy": offload, "checkpointing": checkpointing, "fsdp_blocks": fsdp_blocks,
         "unsharded_peak_params": unsharded},
    )
