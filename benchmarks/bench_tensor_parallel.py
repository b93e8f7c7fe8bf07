"""Tensor parallelism on local gloo ranks: equal to one process, model by model and mesh by mesh.

Every ``fxpipe.testing.zoo`` model given is planned with a pinned mesh holding ``tp``
(``fxpipe.compile(mesh=...)``), trained ``--steps`` SGD steps on ``pp * dp * tp`` local gloo
ranks (the stage modules on DTensor, :mod:`fxpipe.codegen.tensor_parallel`) and compared with
single-process training on the same global batch. Columns: what tensor parallelism split (the
plan's regions, the sequence parallelism), the loss difference, the worst gradient and parameter
difference relative to the largest reference value (``fxpipe.codegen.compare``), the verdict and
the wall time of the ranks' training. The runs of one mesh share one set of workers.

    python benchmarks/bench_tensor_parallel.py                       # Llama, Qwen3-MoE; pp=2 x tp=2 and tp=2 x dp_shard=2
    python benchmarks/bench_tensor_parallel.py --models gpt2 bert vit t5 convnext resnet whisper mixtral --mesh tp=2
    python benchmarks/bench_tensor_parallel.py --mesh tp=4 --models llama bert   # GQA: k / v replicated at tp=4
"""

from __future__ import annotations

import argparse
import math
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama", "qwen3_moe"], metavar="NAME")
    ap.add_argument("--mesh", nargs="+", default=["pp=2,tp=2", "tp=2,dp_shard=2"], metavar="MESH")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4, help="global micro-batches per step")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()

    import fxpipe
    from fxpipe.errors import InputError
    from fxpipe.codegen.compare import compare_training
    from fxpipe.codegen.launch import reference_train, spawn_train_many
    from fxpipe.mesh import format_mesh, parse_mesh
    from fxpipe.testing import zoo

    print("| model | mesh | schedule | split | loss diff | grad diff | param diff | equal | train s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for text in args.mesh:
        mesh = parse_mesh(text)
        world = math.prod(int(mesh.get(d, 1)) for d in ("pp", "dp_shard", "dp_replicate", "tp"))
        runs, plans, names = [], [], []
        for name in args.models:
            zm = zoo.get(name, microbatches=args.microbatches)
            model, margs, mkwargs = zm.one_microbatch()
            try:
                plan = fxpipe.compile(model, margs, mkwargs, devices=world, microbatches=args.microbatches, mesh=mesh,
                                      schedule=args.schedule, time_limit_s=0.5, seed=0)
            except InputError as exc:  # a tp the model's blocks refuse, or nothing to split: the reason
                print(f"| {name} | {format_mesh(mesh)} | {args.schedule} | refused: {str(exc)[:160]} | - | - | - | - | - |")
                continue
            plans.append(plan)
            names.append(name)
            runs.append(dict(make_model=zm, stage_of=plan.worker_stage_of(), orders=plan.orders(),
                             num_microbatches=args.microbatches, make_batch=zm.batch, loss=zm.loss, steps=args.steps,
                             lr=0.05, mesh={**plan.mesh, "order": plan.rank_order}, model_key=name,
                             tensor_parallel_params=plan.tensor_parallel.params))
        if not runs:
            continue
        t0 = time.perf_counter()
        results = spawn_train_many(runs, world_size=world, timeout_s=3600, on_error="record")
        wall = time.perf_counter() - t0
        for name, plan, res in zip(names, plans, results):
            layout = plan.tensor_parallel
            split = f"{len(layout.regions)} region{'' if len(layout.regions) == 1 else 's'}" + (", seq. parallel" if layout.sequence_parallel else "")
            if not hasattr(res, "losses"):
                print(f"| {name} | {format_mesh(plan.mesh)} | {args.schedule} | {split} | - | - | - | error: "
                      f"{res.message.splitlines()[0][:80]} | - |")
                continue
            zm = zoo.get(name, microbatches=args.microbatches)
            ref = reference_train(zm, zm.batch, num_microbatches=args.microbatches, steps=args.steps, lr=0.05,
                                  loss=zm.loss)
            cmp = compare_training(res, ref)
            print(f"| {name} | {format_mesh(plan.mesh)} | {args.schedule} | {split} | {cmp.loss_rel_diff:.1e} | "
                  f"{cmp.max_grad_rel_diff:.1e} | {cmp.max_param_rel_diff:.1e} | {'yes' if cmp.ok else 'NO'} | "
                  f"{res.meta['train_wall_s']:.1f} |")
        print(f"<!-- {format_mesh(mesh)}: {len(runs)} runs in one set of {world} workers, {wall:.0f} s -->")


if __name__ == "__main__":
    main()
