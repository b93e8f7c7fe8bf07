"""Receive buffers per stage with reuse across micro-batches, against torch's one per micro-batch (issue 19, item 2).

A small GPT-2 is planned for 4 devices under GPipe, 1F1B, ZB-H1 and ZB-H2 with ``--microbatches``
micro-batches and trained on 4 local gloo ranks (compared with one process on the same batch).
For every stage the runtime reports how many buffers it holds per received activation and per
received gradient after reuse (``recv_buffer_slots``: a buffer is busy from its RECV until the
micro-batch's weight gradient); torch's ``PipelineStage`` allocates ``microbatches`` of each.
The bytes column is the receive-buffer memory of the busiest stage, with reuse and without
(the buffers' sizes read from the plan's stage boundaries, the model's dtype).

    python benchmarks/bench_recv_buffers.py [--microbatches 16] [--layers 4] [--width 64]
"""

from __future__ import annotations

import argparse

from _common import add_small_gpt2_arguments, small_gpt2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_small_gpt2_arguments(ap, microbatches=16)
    args = ap.parse_args()

    import numpy as np
    import torch

    import fxpipe
    from fxpipe.cli.plan_cmd import _BatchFn
    from fxpipe.codegen.compare import compare_training
    from fxpipe.codegen.launch import reference_train, spawn_train_many
    from fxpipe.io import format_bytes
    from fxpipe.partition.objective import io_bytes

    m = args.microbatches
    fac = small_gpt2(args)
    model, a, k = fac.one_microbatch()
    schedules = ("gpipe", "1f1b", "zb-h1", "zb-h2")
    plans = [fxpipe.compile(model, a, k, devices=4, microbatches=m, schedule=s, time_limit_s=1.0, memory_bytes=float("inf"), mesh="pipeline")
             for s in schedules]
    runs = [dict(make_model=fac, stage_of=p.worker_stage_of(), orders=p.orders(), num_microbatches=m,
                 make_batch=_BatchFn(fac), steps=1, lr=0.05, model_key="gpt2") for p in plans]
    results = spawn_train_many(runs, world_size=4, timeout_s=1800)
    ref = reference_train(fac, _BatchFn(fac), num_microbatches=m, steps=1, lr=0.05)
    print(f"GPT-2 {args.layers} layers, width {args.width}, {m} micro-batches of {args.microbatch_size} x {args.seq_len} "
          f"tokens, 4 stages on 4 gloo ranks, torch {torch.__version__}")
    print("| schedule | equal to one process | activation buffers per stage | gradient buffers per stage | "
          "busiest stage's buffers: reused / torch's |")
    print("|---|---|---|---|---|")
    for s, plan, res in zip(schedules, plans, results):
        rb = res.meta["recv_buffers"]
        fwd = [rb[i]["fwd"] for i in sorted(rb)]
        bwd = [rb[i]["bwd"] for i in sorted(rb)]
        inp, out = io_bytes(plan.graph, plan.partition.assignment, plan.num_stages, plan.comm)
        reused = np.asarray(fwd) * inp + np.asarray(bwd) * out
        full = m * (inp + out)
        busiest = int(np.argmax(full))
        ok = compare_training(res, ref).ok
        print(f"| {s} | {ok} | {fwd} | {bwd} | {format_bytes(reused[busiest])} / {format_bytes(full[busiest])} |")


if __name__ == "__main__":
    main()
