"""Optimizer-state offload at run time (issue 18): ZeRO-Offload with FSDP2's ``CPUOffloadPolicy``.

A plan whose memory model has ``offload_optimizer=True`` runs every stage module wrapped by FSDP2
with ``CPUOffloadPolicy`` (:mod:`fxpipe.codegen.mesh`): parameters, gradients and optimizer state
on the host. A tiny GPT-2 (tied embedding on the first and last stage) planned with it as
pp=2 x dp_shard=2 (``fully_shard``), pp=2 x dp_replicate=2 (``replicate``) and as a 4-rank pure
pipeline (``fully_shard`` over a size-1 sub-mesh; in the same 4 worker processes), and the sharded mesh again
recomputing every stage's activations, must train to the losses, gradients and parameters of one process, every
stage under a ``CPUOffloadPolicy``. In one process,
``plan.build`` of such a plan gives host-resident sharded parameters whose Adam state is sharded
the same way, and a DCP checkpoint of them round-trips.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.cli.plan_cmd import HFFactory, _BatchFn  # noqa: E402
from fxpipe.errors import InputError  # noqa: E402
from fxpipe.memory import MemoryModel  # noqa: E402
from fxpipe.mesh import format_mesh  # noqa: E402
from fxpipe.plan.core import _PlanStageOf  # noqa: E402
from helpers import assert_same_training  # noqa: E402

GPT2 = {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 32, "n_positions": 16}
GLOBAL_MB = 4
OFFLOAD = MemoryModel(offload_optimizer=True)
POLICY = "CPUOffloadPolicy(pin_memory=False)"  # no accelerator here: host memory is not pinned


def _factory() -> HFFactory:
    return HFFactory("gpt2", GPT2, microbatches=GLOBAL_MB, microbatch_size=1, seq_len=4, seed=0)


def _plan(mesh, devices, **kw):
    model, args, kwargs = _factory().one_microbatch()
    return fxpipe.compile(model, args, kwargs, devices=devices, microbatches=GLOBAL_MB, mesh=mesh, schedule="1f1b",
                          time_limit_s=0.5, seed=0, memory=OFFLOAD, **kw)


def _run(plan) -> dict:
    """The run ``plan.train_local`` launches for ``plan`` (fxpipe/plan/train.py)."""
    fac = _factory()
    return dict(make_model=fac, stage_of=_PlanStageOf(plan.stage_of), orders=plan.orders(),
                num_microbatches=plan.global_microbatches, make_batch=_BatchFn(fac), steps=2, lr=0.05,
                mesh={**plan.mesh, "order": plan.rank_order}, offload_optimizer=plan.memory.offload_optimizer,
                model_key="gpt2")


@pytest.mark.slow
def test_offloaded_meshes_and_pure_pipeline_match_single_process():
    from fxpipe.codegen.launch import reference_train, spawn_train_many

    # one launch of 4 ranks (worker start-up dominates): the pure pipeline has 4 ranks too
    pipe = _plan("pipeline", 4)
    plans = [_plan({"pp": 2, "dp_shard": 2}, 4), _plan({"pp": 2, "dp_replicate": 2}, 4), pipe]
    assert all(p.memory.offload_optimizer for p in plans)
    assert pipe.mesh == {"pp": 4, "dp_shard": 1, "dp_replicate": 1} and pipe.world_size == 4
    # and the sharded mesh recomputing every stage's activations (FSDP2 and the stash together)
    runs = [_run(p) for p in plans] + [{**_run(plans[0]), "recompute_stages": tuple(range(plans[0].num_stages))}]
    # and what the default (mesh="auto", schedule="auto", the optimizer's place left to the search) plans on devices
    # so small that the optimizer state must leave them and activations are offloaded or recomputed too
    model, args, kwargs = _factory().one_microbatch()
    chosen = [fxpipe.compile(model, args, kwargs, devices=4, microbatches=GLOBAL_MB, time_limit_s=0.5, seed=0,
                             memory_bytes=cap) for cap in (30e3, 20e3)]
    for p in chosen:
        assert p.memory.offload_optimizer is True and (p.recompute_stages() or p.orders().offloaded()), p.summary()
    runs += [{**_run(p), "recompute_stages": p.recompute_stages()} for p in chosen]
    results = spawn_train_many(runs, world_size=4, timeout_s=600)
    results, recomputed, auto_results = results[:3], results[3], results[4:]
    pipe_res = results[-1]
    fac = _factory()
    ref = reference_train(fac, _BatchFn(fac), num_microbatches=GLOBAL_MB, steps=2, lr=0.05)
    assert ref.losses[1] != ref.losses[0]
    for res, plan in zip(results, plans):
        what = f"offloaded {format_mesh(plan.mesh)}"
        assert_same_training(res, ref, what)
        # every stage module is an FSDP2 module whose parameters (the optimizer's) FSDP keeps on the host
        assert res.meta["offload_policy"] == {s: POLICY for s in range(plan.num_stages)}, what
    assert_same_training(recomputed, ref, "offloaded pp=2 x dp_shard=2 recomputing every stage")
    for res, plan in zip(auto_results, chosen):
        assert_same_training(res, ref, f"the default plan at {plan.memory.capacity_bytes:g} B: {format_mesh(plan.mesh)}")
    # the pure pipeline keeps rank = pipeline rank: rank r runs exactly the stages the plan puts on device r
    for r, acts in pipe_res.meta["actions"].items():
        ran = {int(re.match(r"\d+", a).group()) for a in acts}
        assert ran == {s for s, d in enumerate(pipe.device_of_stage) if d == r}, (r, acts)


def test_build_puts_parameters_gradients_and_adam_state_on_the_host(single_rank_group, tmp_path):
    """``plan.build`` of a one-device plan with offload: the stage is ``fully_shard`` ed over a size-1 mesh with
    ``CPUOffloadPolicy``; Adam's state is sharded like the parameters; a DCP checkpoint of both round-trips."""
    pytest.importorskip("safetensors")
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    from fxpipe.codegen.checkpoint import load_training_state, save_training_state
    from fxpipe.codegen.interface import as_call
    from fxpipe.codegen.launch import cross_entropy_loss
    from fxpipe.codegen.runtime import fsdp_offload_policy

    plan = _plan("pipeline", 1)
    fac = _factory()
    stages, sched = plan.build(0, loss_fn=cross_entropy_loss)
    assert sched.fxpipe_mesh_rank.pp_rank == 0 and sched.fxpipe_mesh_rank.data_parallel is None
    for st in stages:
        assert isinstance(st.submod, FSDPModule)
        assert isinstance(fsdp_offload_policy(st.submod), CPUOffloadPolicy)
    params = sched.parameters()
    assert params and all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in params)
    opt = torch.optim.Adam(params, lr=1e-2)
    inputs, target = _BatchFn(fac)(0)
    args, kwargs = as_call(inputs)
    losses: list = []
    sched.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    assert len(losses) == GLOBAL_MB
    assert all(isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in params)
    opt.step()
    for p in params:
        state = opt.state[p]
        for name in ("exp_avg", "exp_avg_sq"):
            t = state[name]
            assert isinstance(t, DTensor) and t.placements == p.placements and t.device_mesh == p.device_mesh, name
            assert t.to_local().device.type == "cpu" and t.to_local().shape == p.to_local().shape, name
    want = {id(p): (p.detach().full_tensor().clone(), opt.state[p]["exp_avg"].full_tensor().clone()) for p in params}
    path = save_training_state(tmp_path / "ckpt", sched, opt, step=1, mesh=plan.mesh)
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
            opt.state[p]["exp_avg"].zero_()
    assert load_training_state(path, sched, opt)["step"] == 1
    for p in params:
        torch.testing.assert_close(p.detach().full_tensor(), want[id(p)][0], rtol=0, atol=0)
        torch.testing.assert_close(opt.state[p]["exp_avg"].full_tensor(), want[id(p)][1], rtol=0, atol=0)
        assert p.to_local().device.type == "cpu"


def test_offload_refuses_what_fsdp_stages_do_not_run_yet():
    from fxpipe.codegen.launch import spawn_train_many
    from fxpipe.codegen.mesh import check_offload_run

    plan = _plan("pipeline", 2)
    check_offload_run(plan.orders(), recompute_stages=(0, 1))  # recomputation runs under FSDP2 (test above)
    with pytest.raises(InputError, match="compile_stages"):
        check_offload_run(plan.orders(), compile_stages=True)
    with pytest.raises(InputError, match="needs the run's mesh"):
        spawn_train_many([{**_run(plan), "mesh": None}], world_size=2)
