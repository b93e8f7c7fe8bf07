"""Train a saved fxpipe plan with torchrun: one process per device.

Plan once, then launch one process per device of the plan (``plan.world_size``; each runs the
stages the plan places on it; add ``--stages-per-device 2 --placement v`` to the plan for ZB-V).
``--mesh pipeline`` asks for a pipeline: this small GPT-2 fits one device, and the default mesh
search would plan pure data parallelism for it::

    fxpipe plan --hf gpt2 --config n_layer=4 n_embd=64 n_head=2 --seq-len 16 \
        --devices 2 --mesh pipeline --microbatches 4 --out gpt2.plan.json
    torchrun --standalone --nproc-per-node 2 examples/train_torchrun.py --plan gpt2.plan.json \
        --hf gpt2 --config n_layer=4 n_embd=64 n_head=2 --seq-len 16 --steps 3

Every rank rebuilds the same model (same seed), ``plan.build(rank, ...)`` re-captures it,
checks it is the graph the plan was made for, and returns this rank's ``PipelineStage`` s and
the schedule runtime. The rank holding the last stage prints the mean micro-batch loss of every
step as JSON.

A plan with data parallelism (``fxpipe plan ... --devices 4 --mesh pp=2,dp_shard=2``) runs on
``plan.world_size`` processes: ``plan.build`` wraps every stage with FSDP2 over its
data-parallel group, each rank trains on its replica's slice of the global batch
(``plan.replica_batch``) and the last stage of every replica prints its replica's losses (the
global loss is their mean).

With ``--checkpoint model.safetensors`` (or a torch state dict file) the model is built on
``meta`` and never exists whole in a process: each rank materializes only its stages' parameters
and buffers, read from the checkpoint by fully qualified name (``plan.build(rank, checkpoint=...)``).

``--save DIR`` writes the training state at the end (``fxpipe.codegen.checkpoint``: DCP in
safetensors, the model consolidated under its own names, the optimizer state sharded, the step
in JSON); ``--resume DIR`` continues from it, also under another plan of the same model (another
mesh or partition: each rank reads the slices it holds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import fxpipe
from fxpipe.cli.plan_cmd import HFFactory
from fxpipe.codegen.checkpoint import load_training_state, save_training_state
from fxpipe.codegen.launch import cross_entropy_loss
from fxpipe.models import parse_overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--config", nargs="*", default=[])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", help="build the model on meta and load each rank's stages from this file")
    ap.add_argument("--resume", help="a training-state directory written by --save: load weights, optimizer state "
                    "and step (from any mesh or partition of the same model)")
    ap.add_argument("--save", help="write the training state (DCP, safetensors + JSON) to this directory at the end")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = fxpipe.load_plan(args.plan)
    if world != plan.world_size:
        raise SystemExit(f"the plan is for {plan.world_size} devices; launch {plan.world_size} processes, not {world}")
    factory = HFFactory(args.hf, parse_overrides(args.config), plan.global_microbatches, args.microbatch_size,
                        args.seq_len, args.seed)
    torch.manual_seed(args.seed)
    model, mb_args, mb_kwargs = factory.one_microbatch(device="meta" if args.checkpoint else "cpu")
    stages, schedule = plan.build(rank, model=model, args=mb_args, kwargs=mb_kwargs, loss_fn=cross_entropy_loss,
                                  checkpoint=args.checkpoint)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in schedule.parameters()]  # FSDP2: this rank's shard
    held_bytes = sum(p.numel() * p.element_size() for p in local)
    opt = torch.optim.SGD(schedule.parameters(), lr=args.lr)  # this rank's parameters, tied ones once
    start = 0
    if args.resume:  # every rank reads its shards of the saved state (collective)
        start = load_training_state(args.resume, schedule, opt)["step"]
    last = schedule.has_last_stage
    losses_per_step = []
    for step in range(start, start + args.steps):
        inputs, target = plan.replica_batch(rank, *factory.batch(step))  # this rank's replica's slice
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        # every rank makes the same call: the runtime reads the inputs on the first stage's rank and the
        # target on the last stage's (schedule.has_first_stage / has_last_stage)
        schedule.step(*inputs, target=target, losses=losses)
        opt.step()
        if last:
            losses_per_step.append(sum(float(x.detach()) for x in losses) / len(losses))
    if args.save:
        save_training_state(args.save, schedule, opt, step=start + args.steps, mesh=plan.mesh)
    if last:
        # One write of the whole line: ranks share torchrun's stdout, and print() writes the text and its
        # newline separately when stdout is unbuffered, so two ranks' lines could run together.
        line = json.dumps({"rank": rank, "losses": losses_per_step, "param_bytes": held_bytes}) + "\n"
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), line.encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
