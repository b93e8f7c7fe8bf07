"""Train a plan on local gloo ranks next to a single-process reference (:meth:`fxpipe.plan.Plan.train_local`).

The ranks are started by :mod:`fxpipe.codegen.launch` (``spawn_train_many``); the reference
and the comparison are :func:`fxpipe.codegen.launch.reference_train` and
:func:`fxpipe.codegen.compare.compare_training`. torch is imported only when training runs.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from fxpipe.plan.build import compile_stages_option, fsdp_blocks

__all__ = ["train_local"]


def train_local(
    plan,
    make_model: Callable,
    make_batch: Callable,
    *,
    steps: int = 2,
    lr: float = 0.01,
    loss: str | Callable = "cross_entropy",
    seed: int = 0,
    reference: bool = True,
    timeout_s: float = 600.0,
    loss_rtol: float = 1e-4,
    rtol: float = 1e-5,
    compile_stages: bool | None = None,
    progress: bool | None = None,
    action_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Train ``plan`` for a few steps on ``world_size`` local gloo processes (CPU) and compare.

    Every worker builds the model with ``make_model()`` under the same seed, captures
    its first micro-batch, checks the graph against this plan, and runs its stages of the
    plan's placement and schedule through ``torch.distributed.pipelining``; with ``reference=True`` the same
    steps run in this process without pipelining and
    :func:`fxpipe.codegen.compare.compare_training` compares losses, every gradient, every
    parameter after the steps and every buffer.

    Parameters
    ----------
    plan : Plan
        The plan to train (:meth:`fxpipe.plan.Plan.train_local` calls this with itself).
    make_model : picklable callable() -> (model, full_batch_inputs)
        Inputs in the model's calling form: a tuple (positional), a dict (keywords) or
        :class:`fxpipe.codegen.interface.ModelInputs`, of any pytree structure.
    make_batch : picklable callable(step) -> (inputs, target)
        The full batch (``global_microbatches`` micro-batches along dim 0) of each step;
        with data parallelism every replica trains on its slice (:func:`fxpipe.plan.build.replica_batch`) and
        the reference on the whole batch.
    steps, lr, loss, seed :
        SGD steps and learning rate, loss (``"cross_entropy"``, ``"mse"`` or a picklable
        callable(output, target) receiving the model's output structure), weight/data seed.
    loss_rtol, rtol : float
        Tolerances of the verdict ``ok``: relative loss difference, and gradient /
        parameter / buffer difference relative to the largest reference value of its kind.
    compile_stages : bool, optional
        Run the stages with Inductor (:meth:`fxpipe.plan.Plan.build`); Inductor reassociates float sums, so
        compare with ``rtol`` about 1e-4 then.
    progress : bool or None
        A tqdm bar of the pipelined training steps on stderr (None: when stderr is a terminal).
    timeout_s : float
        Wall-clock limit of the pipelined run, seconds (start-up and capture included).
    action_timeout_s : float, optional
        Longest time a rank may spend inside one schedule action (the forward, backward or
        weight gradient of one micro-batch on one stage) before the run stops as stuck,
        seconds (None: only ``timeout_s``).

    Returns
    -------
    dict
        ``pipeline_losses``, ``pipeline_wall_s`` and, with a reference, ``reference_losses``,
        ``ok``, ``comparison`` (:meth:`TrainingComparison.to_dict`), ``max_grad_abs_diff``,
        ``max_grad_rel_diff`` (the largest gradient difference relative to the largest
        reference gradient of the model: the verdict), ``worst_param_grad_rel_diff`` and
        ``worst_param`` (per-parameter, reported beside it), ``max_param_rel_diff``,
        ``max_buffer_rel_diff``, ``num_params``, ``num_buffers``, ``random_ops``; the
        :class:`~fxpipe.codegen.launch.TrainResult` objects under ``"results"`` (not JSON).

    Raises
    ------
    WorkerError
        A rank failed: its rank, stage, micro-batch and action, the root cause (the model's own
        exception, not torch's "failed to run forward") and the model's source line.
    WorkerTimeoutError
        Over ``timeout_s`` or ``action_timeout_s`` (a ``TimeoutError``): the rank that is late,
        the action it is in and for how long, and what the other ranks were doing.

    Warns
    -----
    RandomOpsWarning
        When the model draws random numbers in training mode (active dropout): bitwise
        equality with the reference cannot hold; compare in eval mode or with p = 0.
    """
    from fxpipe.codegen.compare import compare_training, random_ops_warning  # lazy: torch
    from fxpipe.codegen.launch import reference_train, spawn_train_many  # lazy: torch

    rnd: list[str] | None = None
    if plan.capture.traced is not None:
        from fxpipe.codegen.effects import random_ops  # lazy: torch

        rnd = [str(o) for o in random_ops(plan.capture.traced.gm)]
        random_ops_warning(rnd)
    t0 = time.perf_counter()
    run = dict(make_model=make_model, stage_of=plan.worker_stage_of(), orders=plan.orders(),
               num_microbatches=plan.global_microbatches, make_batch=make_batch, steps=steps, lr=lr, loss=loss,
               seed=seed, recompute_stages=plan.recompute_stages(), compile_stages=compile_stages_option(plan, compile_stages),
               activation_checkpointing=getattr(plan, "activation_checkpointing", None),
               mesh={**plan.mesh, "order": plan.rank_order},
               **({"tensor_parallel_params": plan.tensor_parallel.params} if plan.tp > 1 else {}),
               offload_optimizer=bool(getattr(plan.memory, "offload_optimizer", False)), fsdp_blocks=fsdp_blocks(plan))
    res = spawn_train_many([run], world_size=plan.world_size, timeout_s=timeout_s, warn_random=rnd is None,
                           progress=progress, action_timeout_s=action_timeout_s)[0]
    out: dict[str, Any] = {"pipeline_losses": list(res.losses), "pipeline_wall_s": time.perf_counter() - t0}
    if rnd is None:
        rnd = list(res.meta.get("random_ops", []))
    out["random_ops"] = rnd
    if reference:
        ref = reference_train(make_model, make_batch, num_microbatches=plan.global_microbatches, steps=steps, lr=lr,
                              loss=loss, seed=seed)
        cmp = compare_training(res, ref, loss_rtol=loss_rtol, rtol=rtol, random_ops=rnd)
        out["reference_losses"] = list(ref.losses)
        out.update(
            ok=cmp.ok, comparison=cmp.to_dict(), max_grad_abs_diff=cmp.max_grad_abs_diff,
            max_grad_rel_diff=cmp.max_grad_rel_diff, worst_param_grad_rel_diff=cmp.worst_param_grad_rel_diff,
            worst_param=cmp.worst_param, max_param_rel_diff=cmp.max_param_rel_diff,
            max_buffer_rel_diff=cmp.max_buffer_rel_diff, num_params=cmp.num_params, num_buffers=cmp.num_buffers,
        )
        out["results"] = (res, ref)
    else:
        out["results"] = (res,)
    return out

