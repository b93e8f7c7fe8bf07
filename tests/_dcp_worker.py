"""torchrun worker of tests/test_checkpoint_dcp.py: train, save, resume (same plan and another plan).

Usage: ``torchrun --nproc-per-node 4 tests/_dcp_worker.py SPEC.json``. SPEC holds the HF
architecture, its config, the two plan files, the checkpoint directory and the steps. Every
rank prints one JSON line per run in which it holds the last stage.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import fxpipe
from fxpipe.cli.plan_cmd import HFFactory
from fxpipe.codegen.checkpoint import load_training_state, save_training_state
from fxpipe.codegen.launch import cross_entropy_loss


def _emit(doc: dict) -> None:
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(doc) + "\n").encode())


def _build(plan, factory, seed: int, rank: int):
    torch.manual_seed(seed)
    fac = HFFactory(factory.arch, factory.overrides, plan.global_microbatches, 1, factory.seq_len, seed)
    model, args, kwargs = fac.one_microbatch()
    stages, schedule = plan.build(rank, model=model, args=args, kwargs=kwargs, loss_fn=cross_entropy_loss)
    return schedule


def _train(plan, schedule, opt, factory, rank: int, steps) -> list[float]:
    out = []
    for step in steps:
        inputs, target = plan.replica_batch(rank, *factory.batch(step))
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        last = schedule.has_last_stage
        # every rank makes the same call: the runtime reads the inputs on the first stage's rank and the
        # target on the last stage's (schedule.has_first_stage / has_last_stage)
        schedule.step(*inputs, target=target, losses=losses)
        opt.step()
        if last:
            out.append(sum(float(x.detach()) for x in losses) / len(losses))
    return out


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    a, b = fxpipe.load_plan(spec["plan_a"]), fxpipe.load_plan(spec["plan_b"])
    data = HFFactory(spec["arch"], spec["config"], a.global_microbatches, 1, spec["seq_len"], 0)  # the batches
    ckpt, save_at, steps = spec["checkpoint"], spec["save_at"], spec["steps"]

    # run A: train, save after `save_at` steps, go on
    sched = _build(a, data, 0, rank)
    opt = torch.optim.AdamW(sched.parameters(), lr=spec["lr"], weight_decay=0.1)
    losses = _train(a, sched, opt, data, rank, range(save_at))
    save_training_state(ckpt, sched, opt, step=save_at, mesh=a.mesh)
    losses += _train(a, sched, opt, data, rank, range(save_at, steps))
    if sched.has_last_stage:
        _emit({"run": "straight", "rank": rank, "losses": losses})

    # the same plan and the other plan, from other weights and a wrong learning rate: load, resume
    for name, plan in (("resumed", a), ("resharded", b)):
        sched = _build(plan, data, 1, rank)
        opt = torch.optim.AdamW(sched.parameters(), lr=10 * spec["lr"], weight_decay=0.1)
        doc = load_training_state(ckpt, sched, opt)
        resumed = _train(plan, sched, opt, data, rank, range(doc["step"], steps))
        if sched.has_last_stage:
            _emit({"run": name, "rank": rank, "losses": resumed, "step": doc["step"]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
