"""Run a pipeline on this machine: N gloo processes, a few training steps, results gathered.

:func:`spawn_train` captures the model in every worker (``fxpipe.passes.capture``, i.e.
``torch.export`` of one micro-batch, exactly as ``fxpipe.compile`` does),
splits it into stages, builds each rank's ``PipelineStage`` + schedule runtime
(:mod:`fxpipe.codegen.runtime`) and trains with SGD; :func:`reference_train` trains the eager
model in one process with the same micro-batch loss averaging (loss applied per micro-batch,
gradients of the mean micro-batch loss, as torch's schedules with ``scale_grads=True``).
Comparing the two is the end-to-end correctness oracle of the code generator.

Worker results travel through a temporary directory (JSON for losses, ``torch.save`` of
tensors for gradients/parameters; test plumbing only, never an fxpipe output file).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch

from fxpipe.errors import InputError

__all__ = [
    "TrainResult",
    "spawn_train",
    "spawn_train_many",
    "reference_train",
    "cross_entropy_loss",
    "generate_orders",
    "free_port",
]


@dataclass
class TrainResult:
    """Result of a few training steps.

    Attributes
    ----------
    losses : list[float]
        Mean micro-batch loss of each step (before that step's optimizer update).
    grads : dict[str, torch.Tensor]
        Gradient of every parameter (canonical FQN, i.e. ``model.named_parameters()`` names)
        after the last step's backward, before its update.
    params : dict[str, torch.Tensor]
        Parameters after all steps.
    meta : dict
        Extra information (``stage_params``: canonical FQNs held by each stage,
        ``shared_params``, ``actions``, ``wall_s``).
    """

    losses: list[float]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)


def cross_entropy_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy (mean) of logits ``(..., V)`` against ids ``(...)``."""
    return torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def _loss_fn(loss: str | Callable) -> Callable:
    if callable(loss):
        return loss
    if loss == "cross_entropy":
        return cross_entropy_loss
    if loss == "mse":
        return torch.nn.functional.mse_loss
    raise InputError(f"unknown loss {loss!r}: use 'cross_entropy', 'mse' or a callable(output, target)")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, then release it).

    Another process may take the port before the workers bind it; :func:`spawn_train_many`
    retries once with a new port when rank 0 reports ``EADDRINUSE``.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def generate_orders(name: str, num_stages: int, num_microbatches: int) -> dict[int, list[tuple[str, int]]]:
    """Per-stage F/B/W orders of a named heuristic schedule (``"1f1b"``, ``"zb-h1"``, ``"gpipe"``, ...).

    The orders come from :func:`fxpipe.schedule.heuristics.generate` on a
    :class:`~fxpipe.ir.ScheduleProblem` with unit times (``t_f = t_b = t_w = 1``, no
    communication, no memory limit), read per stage in start-time order by
    :func:`fxpipe.schedule.simulate.orders_from_schedule`; the schedule package is the one
    place the scheduling rules live.

    Parameters
    ----------
    name : str
        One of :data:`fxpipe.schedule.heuristics.METHODS` (case-insensitive).
    num_stages, num_microbatches : int
        Pipeline stages S and micro-batches m per step.

    Returns
    -------
    dict[int, list[tuple[str, int]]]
        ``{stage: [(type, microbatch), ...]}`` with types ``F``, ``B``, ``W`` (offload/reload
        ops, if the method makes any, are dropped).

    Raises
    ------
    InputError
        On an unknown schedule name or a bad count.

    References
    ----------
    Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 2-3 (ZB-H1);
    Narayanan et al. 2021 (1F1B); Huang et al. 2019 (GPipe).
    """
    from fxpipe.ir import ScheduleProblem
    from fxpipe.schedule.heuristics import METHODS, generate
    from fxpipe.schedule.simulate import orders_from_schedule

    key = str(name).lower()
    if key not in METHODS:
        raise InputError(f"unknown schedule {name!r}: use one of {', '.join(METHODS)}, or pass orders")
    problem = ScheduleProblem.create(num_stages=num_stages, num_microbatches=num_microbatches,
                                     t_f=1.0, t_b=1.0, t_w=1.0, name=f"unit-{key}")
    return orders_from_schedule(generate(problem, key), problem.num_stages)


def _split_mb(t: torch.Tensor, m: int) -> list[torch.Tensor]:
    if t.shape[0] % m:
        raise InputError(f"batch size {t.shape[0]} is not divisible by {m} micro-batches")
    return list(torch.tensor_split(t, m, dim=0))


def _microbatches(inputs, m: int) -> list:
    """Split model inputs (tuple of tensors, or dict of keyword tensors) into ``m`` micro-batches."""
    if isinstance(inputs, Mapping):
        parts = {k: _split_mb(v, m) for k, v in inputs.items()}
        return [{k: v[j] for k, v in parts.items()} for j in range(m)]
    parts = [_split_mb(t, m) for t in inputs]
    return [tuple(p[j] for p in parts) for j in range(m)]


def _call(model, mb):
    return model(**mb) if isinstance(mb, Mapping) else model(*mb)


def _flat(gm: torch.fx.GraphModule, inputs) -> tuple:
    """Model inputs in ``gm``'s placeholder order (keyword inputs are matched by name)."""
    if not isinstance(inputs, Mapping):
        return tuple(inputs)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    missing = [n for n in names if n not in inputs]
    if missing:
        raise InputError(f"keyword inputs {sorted(inputs)} do not provide the graph inputs {missing}")
    return tuple(inputs[n] for n in names)


def _canonical(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(module.named_parameters())


def reference_train(
    make_model: Callable[[], tuple[torch.nn.Module, Sequence[torch.Tensor]]],
    make_batch: Callable[[int], tuple[Sequence[torch.Tensor], torch.Tensor]],
    *,
    num_microbatches: int,
    steps: int = 2,
    lr: float = 0.1,
    loss: str | Callable = "cross_entropy",
    seed: int = 0,
) -> TrainResult:
    """Single-process training of the eager model with pipeline loss semantics.

    Each step: the batch from ``make_batch(step)`` is split into ``num_microbatches`` along
    dim 0; ``loss = mean_j loss_fn(model(*mb_j), target_j)``; backward; SGD update.

    Parameters
    ----------
    make_model : callable() -> (model, example_inputs)
        Built under ``torch.manual_seed(seed)`` (same as the workers of :func:`spawn_train`).
        Inputs are a tuple of positional tensors or a dict of keyword tensors.
    make_batch : callable(step) -> (inputs tuple, target)
        Full batch of step ``step``.
    num_microbatches, steps, lr, loss, seed :
        As in :func:`spawn_train`.
    """
    lf = _loss_fn(loss)
    torch.manual_seed(seed)
    model, _ = make_model()
    params = _canonical(model)
    opt = torch.optim.SGD(params.values(), lr=lr)
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        inputs, target = make_batch(step)
        opt.zero_grad()
        mbs = _microbatches(inputs, num_microbatches)
        tgts = _split_mb(target, num_microbatches)
        total = None
        vals = []
        for mb, tg in zip(mbs, tgts):
            l = lf(_call(model, mb), tg)
            vals.append(float(l.detach()))
            total = l if total is None else total + l
        (total / num_microbatches).backward()
        losses.append(sum(vals) / len(vals))
        grads = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for k, p in params.items()}
        opt.step()
    return TrainResult(losses, grads, {k: p.detach().clone() for k, p in params.items()}, {"num_microbatches": num_microbatches})


def _capture(model: torch.nn.Module, mb_example) -> torch.fx.GraphModule:
    """The unlifted graph of one micro-batch, captured exactly as ``fxpipe.compile`` does."""
    args, kwargs = ((), dict(mb_example)) if isinstance(mb_example, Mapping) else (tuple(mb_example), {})
    try:
        from fxpipe.passes.capture import capture
    except ImportError:  # pragma: no cover - capture pass not installed
        return torch.export.export(model, args, kwargs, strict=False).module()
    return capture(model, args, kwargs).gm


def _run_one(rank: int, world: int, cfg: dict, out_dir: str, idx: int) -> None:
    """One training run inside an initialised process group (one stage per rank)."""
    from fxpipe.codegen.runtime import actions_from_orders, build_rank
    from fxpipe.codegen.split import split_stages

    m = cfg["num_microbatches"]
    torch.manual_seed(cfg["seed"])
    model, example = cfg["make_model"]()
    mb_example = _microbatches(example, m)[0]
    gm = _capture(model, mb_example)
    stage_of = cfg["stage_of"]
    if callable(stage_of):
        stage_of = stage_of(gm)
    staged = split_stages(gm, stage_of, world)
    orders = cfg["orders"]
    if isinstance(orders, str):
        orders = generate_orders(orders, world, m)
    actions = actions_from_orders(orders, world, num_microbatches=m, fuse=cfg["fuse"])
    loss_fn = _loss_fn(cfg["loss"])
    stage, sched = build_rank(
        staged, rank, actions, num_microbatches=m, loss_fn=loss_fn,
        example_microbatch_inputs=_flat(gm, mb_example), fused_backward=cfg["fused_backward"],
    )
    spec = staged.stages[rank]
    named = spec.named_parameters()
    opt = torch.optim.SGD(list(named.values()), lr=cfg["lr"]) if named else None  # pure relay stage: no params
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    t0 = time.perf_counter()
    for step in range(cfg["steps"]):
        inputs, target = cfg["make_batch"](step)
        if opt is not None:
            opt.zero_grad()
        mb_losses: list[torch.Tensor] = []
        args = _flat(gm, inputs) if stage.is_first else ()
        kwargs: dict[str, Any] = {}
        if stage.is_last:
            kwargs = {"target": target, "losses": mb_losses}
        sched.step(*args, **kwargs)
        if stage.is_last:
            losses.append(sum(float(l.detach()) for l in mb_losses) / len(mb_losses))
        grads = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for k, p in named.items()}
        if opt is not None:
            opt.step()
    wall = time.perf_counter() - t0
    torch.save(
        {"grads": grads, "params": {k: p.detach().clone() for k, p in named.items()}},
        os.path.join(out_dir, f"run{idx}_rank{rank}.pt"),
    )
    with open(os.path.join(out_dir, f"run{idx}_rank{rank}.json"), "w") as f:
        json.dump(
            {
                "losses": losses,
                "param_fqns": list(spec.param_fqns),
                "shared_params": {k: list(v) for k, v in staged.shared_params.items()},
                "relayed": {s.index: list(s.relayed_names) for s in staged.stages},
                "actions": sched.fxpipe_actions[rank],
                "train_wall_s": wall,
            },
            f,
        )


def _worker(rank: int, cfg: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out_dir = cfg["out_dir"]
    world = cfg["world_size"]
    try:
        dist.init_process_group(
            "gloo", init_method=cfg["init_method"], rank=rank, world_size=world,
            timeout=timedelta(seconds=cfg["timeout_s"]),
        )
        torch.use_deterministic_algorithms(True)
        for idx, run in enumerate(cfg["runs"]):
            _run_one(rank, world, run, out_dir, idx)
            dist.barrier()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_train(
    make_model: Callable[[], tuple[torch.nn.Module, Sequence[torch.Tensor]]],
    stage_of: Mapping[str, int] | Callable[[torch.fx.GraphModule], Mapping[str, int]],
    orders: Mapping[int, Sequence[tuple[str, int]]] | str | Any,
    *,
    world_size: int,
    num_microbatches: int,
    make_batch: Callable[[int], tuple[Sequence[torch.Tensor], torch.Tensor]],
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
        same weights; ``example_inputs`` is a full batch (dim 0 divisible by
        ``num_microbatches``) as a tuple of positional tensors or a dict of keyword tensors;
        its first micro-batch is what ``torch.export`` captures. Pipeline stage 0 receives the
        inputs in the captured graph's placeholder order (keywords matched by name).
    stage_of : Mapping[str, int] or picklable callable(gm) -> Mapping[str, int]
        Node name -> stage (see :func:`fxpipe.codegen.split.split_stages`).
    orders : Mapping[int, list[(type, microbatch)]], str or fxpipe.ir.Schedule
        Per-stage F/B/W orders, a schedule name for :func:`generate_orders`, or a timed
        schedule (converted by per-stage start order).
    world_size : int
        Number of processes = stages.
    num_microbatches : int
        Micro-batches per step.
    make_batch : picklable callable(step) -> (inputs, target)
        The full batch of each step; ``inputs`` is a tuple of positional tensors or a dict of
        keyword tensors (same convention as ``make_model``'s example inputs).
    steps, lr, loss, seed :
        SGD steps, learning rate, ``"cross_entropy"`` / ``"mse"`` / callable(output, target)
        (must be picklable), RNG seed.
    fuse, fused_backward :
        See :func:`fxpipe.codegen.runtime.actions_from_orders` / ``build_rank``.
    timeout_s : float
        Wall-clock limit for the whole run and for each collective; on expiry the workers are
        terminated and ``TimeoutError`` is raised instead of hanging.

    Returns
    -------
    TrainResult
        Losses (from the last rank), gradients and parameters of every parameter gathered from
        the ranks that hold it (canonical FQNs; tied parameters are checked to be equal on
        every holder).

    Raises
    ------
    RuntimeError
        If a worker fails (the message carries its traceback).
    TimeoutError
        If the run exceeds ``timeout_s``.
    """
    run = dict(
        make_model=make_model, stage_of=stage_of, orders=orders, num_microbatches=num_microbatches,
        make_batch=make_batch, steps=steps, lr=lr, loss=loss, seed=seed, fuse=fuse,
        fused_backward=fused_backward,
    )
    return spawn_train_many([run], world_size=world_size, timeout_s=timeout_s)[0]


def spawn_train_many(runs: Sequence[Mapping[str, Any]], *, world_size: int, timeout_s: float = 300.0) -> list[TrainResult]:
    """Several :func:`spawn_train` runs in one set of worker processes (start-up paid once).

    Parameters
    ----------
    runs : sequence of dict
        Each with the keyword arguments of :func:`spawn_train` except ``world_size`` and
        ``timeout_s`` (``make_model``, ``stage_of``, ``orders``, ``num_microbatches`` and
        ``make_batch`` are required).
    world_size, timeout_s :
        As in :func:`spawn_train` (the time limit covers all runs).

    Returns
    -------
    list[TrainResult]
        One per run, in order.
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be an integer >= 1, got {world_size!r}")
    defaults = dict(steps=2, lr=0.1, loss="cross_entropy", seed=0, fuse=True, fused_backward=False)
    norm_runs = []
    for i, r in enumerate(runs):
        missing = [k for k in ("make_model", "stage_of", "orders", "num_microbatches", "make_batch") if k not in r]
        if missing:
            raise InputError(f"run {i} lacks {missing}")
        run = {**defaults, **dict(r)}
        if isinstance(run["orders"], str):  # a schedule name: fail here, before any worker starts
            run["orders"] = generate_orders(run["orders"], world_size, run["num_microbatches"])
        elif not isinstance(run["orders"], Mapping):  # an fxpipe.ir.Schedule
            from fxpipe.codegen.runtime import orders_from_schedule

            run["orders"] = orders_from_schedule(run["orders"], world_size)
        norm_runs.append(run)
    with tempfile.TemporaryDirectory(prefix="fxpipe-spawn-") as out_dir:
        deadline = time.monotonic() + timeout_s
        t0 = time.perf_counter()
        for attempt in range(2):
            # the rendezvous address travels in the worker config (no MASTER_ADDR/MASTER_PORT
            # written to this process's environment)
            cfg = dict(out_dir=out_dir, world_size=world_size, runs=norm_runs, timeout_s=timeout_s,
                       init_method=f"tcp://127.0.0.1:{free_port()}")
            try:
                _start_and_join(mp, cfg, world_size, timeout_s, deadline)
                break
            except _PortTaken:
                if attempt:
                    raise RuntimeError(f"a pipeline worker failed twice to bind its port:{_errors(out_dir)}") from None
                for name in os.listdir(out_dir):  # forget the failed attempt
                    os.remove(os.path.join(out_dir, name))
        wall = time.perf_counter() - t0
        return [_gather(out_dir, world_size, i, wall) for i in range(len(norm_runs))]


class _PortTaken(Exception):
    """Rank 0 could not bind the rendezvous port (taken between free_port() and the bind)."""


def _start_and_join(mp, cfg: dict, world_size: int, timeout_s: float, deadline: float) -> None:
    """Start the workers and wait for them; raise on failure, timeout or a taken port."""
    out_dir = cfg["out_dir"]
    ctx = mp.start_processes(_worker, args=(cfg,), nprocs=world_size, join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"pipeline run with {world_size} ranks did not finish within {timeout_s:.0f} s"
                    + _errors(out_dir)
                )
    except mp.ProcessRaisedException as exc:
        errs = _errors(out_dir)
        if "EADDRINUSE" in errs or "EADDRINUSE" in str(exc):
            raise _PortTaken() from None
        raise RuntimeError(f"a pipeline worker failed:{errs}\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"a pipeline worker exited abnormally: {exc}{_errors(out_dir)}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)


def _errors(out_dir: str) -> str:
    msgs = []
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".err"):
            with open(os.path.join(out_dir, name)) as f:
                msgs.append(f"\n--- {name[:-4]} ---\n{f.read()}")
    return "".join(msgs)


def _gather(out_dir: str, world: int, idx: int, wall: float) -> TrainResult:
    grads: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    stage_params: list[list[str]] = []
    losses: list[float] = []
    shared: dict[str, list[int]] = {}
    actions: dict[int, list[str]] = {}
    relayed: dict[int, list[str]] = {}
    train_wall = 0.0
    for r in range(world):
        with open(os.path.join(out_dir, f"run{idx}_rank{r}.json")) as f:
            info = json.load(f)
        blob = torch.load(os.path.join(out_dir, f"run{idx}_rank{r}.pt"), weights_only=True)
        stage_params.append(info["param_fqns"])
        shared = info["shared_params"]
        actions[r] = info["actions"]
        relayed = {int(k): v for k, v in info["relayed"].items()}
        train_wall = max(train_wall, info["train_wall_s"])
        if r == world - 1:
            losses = info["losses"]
        for k, g in blob["grads"].items():
            if k in grads:
                if not torch.equal(grads[k], g):
                    raise RuntimeError(f"tied parameter {k!r}: gradient differs between the stages holding it")
                if not torch.equal(params[k], blob["params"][k]):
                    raise RuntimeError(f"tied parameter {k!r}: copies diverged between the stages holding it")
                continue
            grads[k] = g
            params[k] = blob["params"][k]
    return TrainResult(
        losses, grads, params,
        {"stage_params": stage_params, "shared_params": shared, "actions": actions, "relayed": relayed,
         "train_wall_s": train_wall, "wall_s": wall},
    )
