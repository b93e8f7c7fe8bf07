"""The torch.compile backend: planning time vs ``fxpipe.compile``, pipelined inference step time.

Prints, for GPT-2, T5 and a U-Net (``fxpipe.testing.zoo`` small configs; batch = 4 micro-batches of 2):

(a) **Planning time**, side by side in one process on the same model and micro-batch:
    ``fxpipe.compile(model, one_microbatch, devices=D, objective="inference", schedule="gpipe")``
    (the baseline: ``torch.export`` of the model itself, costs, partition, schedule; after an
    untimed warm-up of both paths: imports, numba's JIT) against the
    backend's first call ``torch.compile(model, backend="fxpipe", options={"devices": D,
    "execution": "eager"})(batch)`` - the wall time of the whole call (Dynamo's trace + fxpipe +
    running the graph) and the planning part alone (``plan.timings_s["backend_total"]``: lifting
    Dynamo's graph, exporting it, costs, partition, schedule). Partition search limit
    ``--time-limit-s`` for both. Both plans' predicted bottleneck stage time is printed: they
    must agree (same graph, same costs).
(b) **Pipelined inference step time** on ``--ranks`` local gloo ranks (CPU, one thread each):
    every rank compiles the model with the backend (the forward runs the pipelined inference of
    :class:`fxpipe.codegen.inference.InferencePipeline`) without and with ``compile_stages``
    (Inductor per stage); median of ``--iters`` calls after ``--warmup`` calls, plus the
    first call (planning + build + Inductor compile) and the largest difference to eager's
    output over the ranks (must be ~0). Eager single-process forward time is the baseline.

(c) ``--train-schedules``: **compile_stages training under every schedule** on 2 local gloo
    ranks (``spawn_train_many``, one set of workers): GPipe, 1F1B, ZB-H1, ZB-H2 on one stage per
    rank, interleaved 1F1B (looped) and ZB-V / DualPipe-V (V) on two, for small zoo models
    (``--train-models``); each run against single-process training (``compare_training``,
    tolerance 1e-4), with whether every compiled stage's backward was split into B and W.

Timings on a shared machine are noisy; the script prints what it measured.

Usage::

    python benchmarks/bench_backend.py                    # gpt2 t5 unet, 2 ranks
    python benchmarks/bench_backend.py --ranks 2 4 --iters 20
    python benchmarks/bench_backend.py --models gpt2 --skip-pipeline
    python benchmarks/bench_backend.py --skip-planning --skip-pipeline --train-schedules
    python benchmarks/bench_backend.py --skip-planning --skip-pipeline --train-schedules --train-models gpt2 unet --train-only zb-h1 zb-v
"""

from __future__ import annotations

import argparse
import statistics
import time

MICROBATCHES, MICROBATCH_SIZE = 4, 2


def _inputs(name: str):
    import torch

    import fxpipe.testing.zoo as zoo
    from fxpipe.codegen.interface import as_call

    torch.manual_seed(0)
    model, inputs = zoo.get(name, microbatches=MICROBATCHES, microbatch_size=MICROBATCH_SIZE)()
    model.eval()
    args, kwargs = as_call(inputs)
    return model, args, kwargs


def _mark(args, kwargs) -> None:
    import torch

    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor):
            torch._dynamo.mark_dynamic(t, 0)


def planning(name: str, devices: int, time_limit_s: float) -> dict:
    """(a) for one model: fxpipe.compile vs the backend's first call, in this process."""
    import torch

    import fxpipe
    from fxpipe.codegen.interface import split_microbatches

    model, args, kwargs = _inputs(name)
    mb = split_microbatches(tuple(args), MICROBATCHES)[0]
    mb_kwargs = {k: split_microbatches((v,), MICROBATCHES)[0][0] if isinstance(v, torch.Tensor) else v
                 for k, v in kwargs.items()}
    t0 = time.perf_counter()
    base = fxpipe.compile(model, mb, mb_kwargs, devices=devices, microbatches=MICROBATCHES, objective="inference",
                          schedule="gpipe", time_limit_s=time_limit_s, mesh="pipeline")
    compile_s = time.perf_counter() - t0
    torch._dynamo.reset()
    _mark(args, kwargs)
    compiled = torch.compile(model, backend="fxpipe", options={"devices": devices, "time_limit_s": time_limit_s})
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled(*args, **kwargs)
    call_s = time.perf_counter() - t0
    plan = fxpipe.last_plan()
    torch._dynamo.reset()
    return {
        "model": name, "devices": devices, "fxpipe_compile_s": compile_s, "backend_first_call_s": call_s,
        "backend_plan_s": plan.timings_s.get("backend_total", float("nan")),
        "ops_compile": sum(s.num_ops for s in base.stages),
        "ops_backend": sum(s.num_ops for s in plan.stages),
        "params_compile": sum(s.param_bytes for s in base.stages),
        "params_backend": sum(s.param_bytes for s in plan.stages),
        "bottleneck_compile_ms": base.bottleneck_s * 1e3,
        "bottleneck_backend_ms": plan.bottleneck_s * 1e3,
        "microbatches_backend": plan.microbatches,
    }


def _pipeline_worker(rank: int, world: int, names: list, warmup: int, iters: int) -> dict:
    import torch

    from fxpipe.codegen.runtime import tree_flatten

    def leaves(o):
        return [t for t in tree_flatten(o)[0] if isinstance(t, torch.Tensor)]

    out = {}
    for name in names:
        model, args, kwargs = _inputs(name)
        with torch.no_grad():
            ref = model(*args, **kwargs)
            t_eager = []
            for _ in range(warmup + iters):
                t0 = time.perf_counter()
                model(*args, **kwargs)
                t_eager.append(time.perf_counter() - t0)
        row = {"eager_ms": statistics.median(t_eager[warmup:]) * 1e3}
        for cs in (False, True):
            torch._dynamo.reset()
            _mark(args, kwargs)
            compiled = torch.compile(model, backend="fxpipe",
                                     options={"devices": world, "time_limit_s": 1.0, "compile_stages": cs})
            times = []
            with torch.no_grad():
                for i in range(1 + warmup + iters):
                    torch.distributed.barrier()
                    t0 = time.perf_counter()
                    got = compiled(*args, **kwargs)
                    times.append(time.perf_counter() - t0)
            key = "compiled" if cs else "eager_stages"
            row[f"{key}_first_s"] = times[0]
            row[f"{key}_ms"] = statistics.median(times[1 + warmup:]) * 1e3
            row[f"{key}_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(leaves(ref), leaves(got)))
        out[name] = row
    return out


def pipelined(names: list, ranks: int, warmup: int, iters: int) -> dict:
    """(b): every rank's figures; the step time of a call is the slowest rank's."""
    from fxpipe.dynamo.local import run_local

    per_rank = run_local(_pipeline_worker, ranks, args=(names, warmup, iters), timeout_s=1800)
    out = {}
    for name in names:
        rows = [r[name] for r in per_rank]
        out[name] = {k: (max(row[k] for row in rows)) for k in rows[0]}
    return out


#: (stages per device, placement, schedules) of (c)
TRAIN_PLACEMENTS = ((1, "looped", ("gpipe", "1f1b", "zb-h1", "zb-h2")), (2, "looped", ("interleaved-1f1b",)),
                    (2, "v", ("zb-v", "dualpipe-v")))


def train_schedules(names: list, microbatches: int = 4, steps: int = 2, lr: float = 0.1,
                    only: list | None = None) -> list[dict]:
    """(c): compile_stages training under every schedule vs single-process training."""
    import fxpipe
    import fxpipe.testing.zoo as zoo
    from fxpipe.codegen.compare import compare_training
    from fxpipe.codegen.launch import reference_train, spawn_train_many

    runs, meta = [], []
    for name in names:
        zm = zoo.get(name, microbatches=microbatches)
        model, args, kwargs = zm.one_microbatch()
        for v, placement, schedules in TRAIN_PLACEMENTS:
            schedules = [x for x in schedules if only is None or x in only]
            if not schedules:
                continue
            plan = fxpipe.compile(model, args, kwargs, devices=2, microbatches=microbatches, time_limit_s=0.5, name=name,
                                  stages_per_device=v, placement=placement, mesh="pipeline")
            for sched in schedules:
                p = plan if plan.options["schedule"] == sched else plan.reschedule(sched)
                runs.append(dict(make_model=zm, make_batch=zm.batch, loss=zm.loss, stage_of=p.worker_stage_of(),
                                 orders=p.orders(), num_microbatches=microbatches, steps=steps, lr=lr, model_key=name,
                                 compile_stages=True))
                meta.append((name, sched, zm))
    results = spawn_train_many(runs, world_size=2, timeout_s=3600, on_error="record")
    refs: dict = {}
    rows = []
    for (name, sched, zm), res in zip(meta, results):
        if not hasattr(res, "losses"):
            rows.append({"model": name, "schedule": sched, "ok": False, "error": str(res)[:300]})
            continue
        if name not in refs:
            refs[name] = reference_train(zm, zm.batch, num_microbatches=microbatches, steps=steps, lr=lr, loss=zm.loss)
        cmp = compare_training(res, refs[name], loss_rtol=1e-4, rtol=1e-4)
        splits = [sig["split"] for rep in (res.meta.get("compiled_stages") or {}).values() if rep
                  for sig in rep["signatures"]]
        rows.append({"model": name, "schedule": sched, "ok": cmp.ok, "grad_rel": cmp.max_grad_rel_diff,
                     "param_rel": cmp.max_param_rel_diff, "split": bool(splits) and all(splits)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "t5", "unet"])
    ap.add_argument("--devices", type=int, default=2, help="devices for the planning comparison (a)")
    ap.add_argument("--ranks", nargs="+", type=int, default=[2], help="local gloo ranks for (b)")
    ap.add_argument("--time-limit-s", type=float, default=1.0, help="partition search limit, both planners")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-planning", action="store_true")
    ap.add_argument("--skip-pipeline", action="store_true")
    ap.add_argument("--train-schedules", action="store_true", help="(c) compile_stages training under every schedule")
    ap.add_argument("--train-models", nargs="+", default=["received_inplace", "tied_deep"])
    ap.add_argument("--train-only", nargs="+", default=None, help="(c) only these schedules (e.g. zb-h1 zb-v)")
    a = ap.parse_args()

    if not a.skip_planning:
        planning("unet", a.devices, a.time_limit_s)  # warm-up: imports, numba JIT, Dynamo; not timed
        print(f"(a) planning time, {a.devices} devices, {MICROBATCHES} micro-batches of {MICROBATCH_SIZE} "
              f"(partition limit {a.time_limit_s} s)")
        print(f"{'model':8} {'fxpipe.compile s':>17} {'backend call s':>15} {'backend plan s':>15} "
              f"{'ops c/b':>11} {'param MB c/b':>14} {'bottleneck c/b ms':>20} {'m':>3}")
        for name in a.models:
            r = planning(name, a.devices, a.time_limit_s)
            bn = f"{r['bottleneck_compile_ms']:.4f}/{r['bottleneck_backend_ms']:.4f}"
            print(f"{name:8} {r['fxpipe_compile_s']:17.2f} {r['backend_first_call_s']:15.2f} {r['backend_plan_s']:15.2f} "
                  f"{str(r['ops_compile']) + '/' + str(r['ops_backend']):>11} "
                  f"{r['params_compile'] / 1e6:6.2f}/{r['params_backend'] / 1e6:<7.2f} {bn:>20} {r['microbatches_backend']:3d}",
                  flush=True)
    if not a.skip_pipeline:
        for ranks in a.ranks:
            print(f"\n(b) pipelined inference on {ranks} local gloo ranks (1 thread each), batch "
                  f"{MICROBATCHES * MICROBATCH_SIZE}, median of {a.iters} calls after {a.warmup}; slowest rank")
            print(f"{'model':8} {'eager 1 proc ms':>16} {'stages ms':>10} {'compile_stages ms':>18} "
                  f"{'1st call s (eager/ind)':>23} {'max |diff| vs eager':>22}")
            res = pipelined(a.models, ranks, a.warmup, a.iters)
            for name, r in res.items():
                print(f"{name:8} {r['eager_ms']:16.2f} {r['eager_stages_ms']:10.2f} {r['compiled_ms']:18.2f} "
                      f"{r['eager_stages_first_s']:11.1f}/{r['compiled_first_s']:<11.1f} "
                      f"{r['eager_stages_max_abs_diff']:10.2e}/{r['compiled_max_abs_diff']:<10.2e}", flush=True)

    if a.train_schedules:
        print("\n(c) compile_stages training on 2 gloo ranks vs one process (2 SGD steps, tolerance 1e-4)")
        print(f"{'model':18} {'schedule':17} {'equal':>6} {'grad rel diff':>14} {'param rel diff':>15} {'B/W split':>10}")
        for r in train_schedules(a.train_models, only=a.train_only):
            if "error" in r:
                print(f"{r['model']:18} {r['schedule']:17} {'ERROR':>6} {r['error']}")
            else:
                print(f"{r['model']:18} {r['schedule']:17} {str(r['ok']):>6} {r['grad_rel']:14.2e} {r['param_rel']:15.2e} "
                      f"{str(r['split']):>10}", flush=True)


if __name__ == "__main__":
    main()
