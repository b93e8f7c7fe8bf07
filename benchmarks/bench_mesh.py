"""Pipeline x data parallelism on 4 local gloo ranks: equal to one process, and the step time.

A small GPT-2 is planned for 4 devices as a pure pipeline (pp=4) and as pp=2 x dp_shard=2
(FSDP2) and pp=2 x dp_replicate=2 (replicate), under 1F1B, ZB-H1 and (pp=2 x dp_shard=2) ZB-V,
all with the same global batch (``--microbatches`` micro-batches per optimizer step). Every
configuration trains ``--steps`` SGD steps in one set of 4 worker processes and is compared
with single-process training on the same global batch. Columns: the worst loss difference,
the worst gradient and parameter difference relative to the largest reference value, the
measured wall time per step (slowest rank, mean over the steps) and the plan's predicted
step (``plan.predicted_step_s``: the pipeline schedule's makespan plus the data-parallel sync
it does not hide, :func:`fxpipe.mesh.pipeline_step_s`).

    python benchmarks/bench_mesh.py [--microbatches 8] [--steps 3] [--hardware profile:cpu]
    python benchmarks/bench_mesh.py --all-schedules   # equality only: every schedule method on both meshes
    python benchmarks/bench_mesh.py --zoo mixtral unet tied_deep   # fxpipe.testing.zoo models (equality only)
"""

from __future__ import annotations

import argparse
import time

from _common import add_small_gpt2_arguments, small_gpt2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_small_gpt2_arguments(ap, microbatches=8, microbatches_help="global micro-batches per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hardware", default="profile:cpu")
    ap.add_argument("--all-schedules", action="store_true",
                    help="instead: GPipe, ZB-H2, greedy, interleaved 1F1B (looped), DualPipe-V and the MILP (V) on "
                    "pp=2 x dp_shard=2 and pp=2 x dp_replicate=2")
    ap.add_argument("--zoo", nargs="+", default=None, metavar="NAME",
                    help="instead: these fxpipe.testing.zoo models as pp=2 x dp_shard=2 and pp=2 x dp_replicate=2 under 1F1B "
                    "and ZB-H1 (ZB-V with --all-schedules)")
    args = ap.parse_args()
    if args.zoo:
        return _zoo(args)

    import torch

    import fxpipe
    from fxpipe.cli.plan_cmd import _BatchFn
    from fxpipe.codegen.compare import compare_training
    from fxpipe.codegen.launch import reference_train, spawn_train_many
    from fxpipe.mesh import format_mesh
    from fxpipe.plan.core import _PlanStageOf

    fac = small_gpt2(args)
    model, a, k = fac.one_microbatch()
    cases = [({"pp": 4}, s, {}) for s in ("1f1b", "zb-h1")]
    cases += [(m, s, {}) for m in ({"pp": 2, "dp_shard": 2}, {"pp": 2, "dp_replicate": 2}) for s in ("1f1b", "zb-h1")]
    cases.append(({"pp": 2, "dp_shard": 2}, "zb-v", {"stages_per_device": 2, "placement": "v"}))
    if args.all_schedules:
        more = [("gpipe", {}), ("zb-h2", {}), ("greedy", {}),
                ("interleaved-1f1b", {"stages_per_device": 2, "placement": "looped"}),
                ("dualpipe-v", {"stages_per_device": 2, "placement": "v"}),
                ("milp", {"stages_per_device": 2, "placement": "v"})]
        cases = [(m, s, e) for m in ({"pp": 2, "dp_shard": 2}, {"pp": 2, "dp_replicate": 2}) for s, e in more]
    plans, runs = [], []
    t0 = time.perf_counter()
    for mesh, sched, extra in cases:
        plan = fxpipe.compile(model, a, k, devices=4, microbatches=args.microbatches, mesh=mesh, schedule=sched,
                              hardware=args.hardware, time_limit_s=1.0, schedule_time_limit_s=5.0, **extra)
        plans.append(plan)
        runs.append(dict(make_model=fac, stage_of=_PlanStageOf(plan.stage_of), orders=plan.orders(),
                         num_microbatches=plan.global_microbatches, make_batch=_BatchFn(fac), steps=args.steps, lr=0.05,
                         mesh=plan.mesh, model_key="gpt2"))
    plan_s = time.perf_counter() - t0
    results = spawn_train_many(runs, world_size=4, timeout_s=1800)
    ref = reference_train(fac, _BatchFn(fac), num_microbatches=args.microbatches, steps=args.steps, lr=0.05)
    print(f"GPT-2 {args.layers} layers, width {args.width}, {args.microbatches} x {args.microbatch_size} x {args.seq_len} "
          f"tokens per step, {args.steps} SGD steps, 4 gloo ranks, torch {torch.__version__} (planning {plan_s:.1f} s)")
    print("| mesh | schedule | loss diff | grad diff | param diff | measured s/step | predicted s/step |")
    print("|---|---|---|---|---|---|---|")
    for (mesh, sched, _), plan, res in zip(cases, plans, results):
        cmp = compare_training(res, ref)
        step_s = res.meta["train_wall_s"] / args.steps
        print(f"| {format_mesh(plan.mesh)} | {sched} | {max(abs(x - y) for x, y in zip(res.losses, ref.losses)):.1e} | "
              f"{cmp.max_grad_rel_diff:.1e} | {cmp.max_param_rel_diff:.1e} | {step_s:.3f} | {plan.predicted_step_s:.3f} |")


def _zoo(args) -> None:
    import fxpipe
    from fxpipe.testing import zoo
    from fxpipe.codegen.compare import compare_training
    from fxpipe.codegen.launch import reference_train, spawn_train_many
    from fxpipe.mesh import format_mesh
    from fxpipe.plan.core import _PlanStageOf

    print(f"fxpipe.testing.zoo models, {args.microbatches} micro-batches of 2 per step, {args.steps} SGD steps, 4 gloo ranks")
    print("| model | mesh | schedule | ok | loss diff | grad diff | param diff | buffer diff |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.zoo:
        zm = zoo.get(name, microbatches=args.microbatches, microbatch_size=2)
        model, a, k = zm.one_microbatch()
        cases, runs = [], []
        for mesh in ({"pp": 2, "dp_shard": 2}, {"pp": 2, "dp_replicate": 2}):
            for sched, extra in (("1f1b", {}), ("zb-h1", {})):
                plan = fxpipe.compile(model, a, k, devices=4, microbatches=args.microbatches, mesh=mesh, schedule=sched,
                                      time_limit_s=1.0, **extra)
                cases.append((format_mesh(plan.mesh), sched))
                runs.append(dict(make_model=zm, stage_of=_PlanStageOf(plan.stage_of), orders=plan.orders(),
                                 num_microbatches=plan.global_microbatches, make_batch=zm.batch, loss=zm.loss,
                                 steps=args.steps, lr=0.05, mesh=plan.mesh, model_key=name))
        results = spawn_train_many(runs, world_size=4, timeout_s=1800, on_error="record")
        ref = reference_train(zm, zm.batch, num_microbatches=args.microbatches, steps=args.steps, lr=0.05, loss=zm.loss)
        for (mesh, sched), res in zip(cases, results):
            if not hasattr(res, "losses"):
                print(f"| {name} | {mesh} | {sched} | error: {res.message.splitlines()[-1][:100]} | | | | |")
                continue
            c = compare_training(res, ref)
            print(f"| {name} | {mesh} | {sched} | {c.ok} | {max(abs(x - y) for x, y in zip(res.losses, ref.losses)):.1e} | "
                  f"{c.max_grad_rel_diff:.1e} | {c.max_param_rel_diff:.1e} | {c.max_buffer_rel_diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
