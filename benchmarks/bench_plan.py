"""End-to-end planning benchmark: plan time by step, and plan quality against hand-made splits.

Plans GPT-2 (124M config), T5-small, Mixtral (small config), Llama-2-7B and Llama-3-70B (meta
device) and prints, per model and device count:

* the wall time of every step of ``fxpipe.compile``: model build, capture (``torch.export``),
  cost annotation, OpGraph export, partition, schedule, and the total, for the current
  planner **and for the baseline measured in the same process**: a full ``torch.export`` of
  every layer (``replicate="never"``) and the previous partition search (SliceGraph over the
  structured orders + BRKGA until the time limit or 100 generations, no chain DP, no
  contraction, no stall rule, no merging of trivial stages: ``partition(..., chain=False,
  contract=False, merge_trivial=False, brkga_params=BRKGAParams(stall_generations=None))``);
* the bottleneck stage time of both partitions, the lower bound the search proved
  (``meta["lower_bound_s"]``) and whether it is proven optimal; stages that hold only
  zero-work ops (views, ``alias``, the ``output`` node) for both;
* the bottleneck of an equal-layer contiguous split (torch.distributed.pipelining /
  torchtitan by hand) and a parameter-balanced one (DeepSpeed ``partition_method=
  "parameters"``), scored by the same Contract-2 objective (training, relay).

Costs: bf16 compute on an H100 SXM by default; one micro-batch of one sequence (GPT-2 1024
tokens, T5/Mixtral 512, Llama 4096). Capture runs once per model and capture mode; the
device counts reuse the OpGraph. The baseline's graph must equal the replicated capture's
(checked). The 70B row also runs ``fxpipe.compile`` end to end (``--compile``).

Usage::

    python benchmarks/bench_plan.py                              # all models, devices 2 4 8 (70B: 8 16 32 64)
    python benchmarks/bench_plan.py --models llama-3-70b-meta --devices 64 --compile
    python benchmarks/bench_plan.py --quick                      # small configs, for a smoke run
    python benchmarks/bench_plan.py --models gpt2-124m --devices 4 --json
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time

import numpy as np

MODELS = {
    # name: (arch, overrides, device, default device counts)
    "gpt2-124m": ("gpt2", {"seq_len": 1024}, "cpu", (2, 4, 8)),
    "t5-small": ("t5", {"seq_len": 512}, "cpu", (2, 4, 8)),
    "mixtral-small": ("mixtral", {"num_hidden_layers": 8, "seq_len": 512}, "cpu", (2, 4, 8)),
    "llama-2-7b-meta": ("llama-2-7b", {"seq_len": 4096}, "meta", (2, 4, 8)),
    "llama-3-70b-meta": ("llama-3-70b", {"seq_len": 4096}, "meta", (8, 16, 32, 64)),
}
QUICK = {
    "gpt2-124m": ("gpt2", {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 1024, "seq_len": 64}, "cpu", (2, 4)),
    "t5-small": ("t5", {"num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_ff": 128, "num_heads": 2, "d_kv": 32, "vocab_size": 512, "seq_len": 32}, "cpu", (2, 4)),
    "mixtral-small": ("mixtral", {"num_hidden_layers": 4, "seq_len": 32}, "cpu", (2, 4)),
    "llama-2-7b-meta": ("llama-2-7b", {"seq_len": 4096}, "meta", (2, 4, 8)),
    "llama-3-70b-meta": ("llama-3-70b", {"seq_len": 4096}, "meta", (8, 64)),
}
FIELDS = ("t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s", "size_out_bytes", "size_param_bytes", "act_bytes")


def trivial_stages(graph, part) -> int:
    """Stages holding ops whose work is all zero (views, aliases, the output node alone)."""
    work = np.bincount(part.assignment, weights=graph.work_s("training"), minlength=part.k)
    count = np.bincount(part.assignment, minlength=part.k)
    return int(((count > 0) & (work <= 0)).sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--devices", nargs="*", type=int, default=None, help="device counts (default: per model)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--time-limit", type=float, default=10.0, help="partition search budget per instance (s)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="compute dtype the costs assume (default bf16)")
    ap.add_argument("--quick", action="store_true", help="small configs")
    ap.add_argument("--no-baseline", action="store_true", help="skip the baseline (full export, previous search)")
    ap.add_argument("--compile", action="store_true", help="also time fxpipe.compile end to end for the largest device count")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    import fxpipe
    from fxpipe.errors import InfeasibleError
    from fxpipe.api import fill_empty_stages, graph_signature, plan_graph
    from fxpipe.models import build_hf_model
    from fxpipe.partition.baselines import equal_layers, parameter_balanced
    from fxpipe.partition.brkga import BRKGAParams
    from fxpipe.partition.search import partition
    from fxpipe.passes import trace_model

    table = QUICK if args.quick else MODELS
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    # warm up torch.export and the numba kernels so that the first model is not charged for them
    wm, wa, wk = build_hf_model("llama", {"num_hidden_layers": 2, "seq_len": 16}, device="meta")
    warm = trace_model(wm, wa, wk, hardware=args.hardware, dtype=dtype, replicate="never")
    plan_graph(warm.graph, devices=2, microbatches=2, time_limit_s=0.5)
    rows = []
    for name in args.models:
        arch, over, device, ks = table[name]
        t0 = time.perf_counter()
        model, margs, mkwargs = build_hf_model(arch, over, device=device)
        build_s = time.perf_counter() - t0
        traced = trace_model(model, margs, mkwargs, hardware=args.hardware, dtype=dtype, name=name, replicate="auto")
        graph = traced.graph
        base_traced = None
        if not args.no_baseline:
            base_traced = trace_model(model, margs, mkwargs, hardware=args.hardware, dtype=dtype, name=name, replicate="never")
            g0 = base_traced.graph
            same = g0.names == graph.names and np.array_equal(g0.edges, graph.edges) and all(
                np.array_equal(getattr(g0, f), getattr(graph, f)) for f in FIELDS)
            if not same:
                print(f"# {name}: the replicated capture differs from the full export!", file=sys.stderr)
                return 1
        for k in args.devices or ks:
            if k > graph.n:
                continue
            # memory_bytes=inf: the bottleneck comparison is against memory-blind baselines (equal
            # layers, parameter-balanced, the previous planner); the --compile row plans with the
            # device's capacity (fxpipe's default)
            part, problem, sched, tim = plan_graph(
                graph, devices=k, microbatches=args.microbatches, objective="training", schedule="zb-h1",
                time_limit_s=args.time_limit, memory_bytes=math.inf,
            )
            row = {
                "model": name, "ops": graph.n, "devices": k, "build_s": build_s,
                "capture_s": traced.capture_s, "replicated": traced.captured.replication is not None,
                "cost_s": traced.cost_s, "export_s": traced.export_s,
                "partition_s": tim["partition"], "schedule_s": tim["schedule"],
                "fxpipe_bottleneck_ms": part.bottleneck * 1e3,
                "lower_bound_ms": part.meta.get("lower_bound_s", float("nan")) * 1e3,
                "lower_bound_method": part.meta.get("lower_bound_method"),
                "proven_optimal": bool(part.meta.get("proven_optimal")),
                "stop_reason": part.meta.get("stop_reason"),
                "trivial_stages": trivial_stages(graph, part),
                "makespan_ms": sched.makespan * 1e3,
                "signature": graph_signature(graph),
            }
            row["total_s"] = row["capture_s"] + row["cost_s"] + row["export_s"] + row["partition_s"] + row["schedule_s"]
            eq = equal_layers(graph, k, objective="training", comm="relay")
            pb = parameter_balanced(graph, k, objective="training", comm="relay")
            row.update(equal_layers_ms=eq.bottleneck * 1e3, param_balanced_ms=pb.bottleneck * 1e3,
                       speedup_vs_equal=eq.bottleneck / part.bottleneck, speedup_vs_params=pb.bottleneck / part.bottleneck)
            if base_traced is not None:
                t1 = time.perf_counter()
                old = partition(graph, k, objective="training", comm="relay", time_limit_s=args.time_limit, seed=0,
                                chain=False, contract=False, merge_trivial=False, brkga_params=BRKGAParams(stall_generations=None))
                old = fill_empty_stages(graph, old)
                old_s = time.perf_counter() - t1
                row.update(
                    baseline_capture_s=base_traced.capture_s, baseline_partition_s=old_s,
                    baseline_bottleneck_ms=old.bottleneck * 1e3, baseline_trivial_stages=trivial_stages(graph, old),
                )
                row["baseline_total_s"] = (base_traced.capture_s + base_traced.cost_s + base_traced.export_s + old_s
                                           + row["schedule_s"])
            rows.append(row)
            print(f"# {name} k={k}: partition {row['partition_s']:.2f}s bottleneck {row['fxpipe_bottleneck_ms']:.3f} ms "
                  f"(lower bound {row['lower_bound_ms']:.3f}, {row['lower_bound_method']}, proven {row['proven_optimal']})"
                  + (f"; baseline partition {row['baseline_partition_s']:.2f}s {row['baseline_bottleneck_ms']:.3f} ms"
                     if base_traced is not None else ""), file=sys.stderr)
        if args.compile:
            k = max(args.devices or ks)
            t2 = time.perf_counter()
            try:
                plan = fxpipe.compile(model, margs, mkwargs, devices=k, microbatches=args.microbatches,
                                      hardware=args.hardware, dtype=dtype, objective="training",
                                      time_limit_s=args.time_limit, name=name, mesh="pipeline")
            except InfeasibleError as exc:
                wall = time.perf_counter() - t2
                rows.append({"model": name, "devices": k, "compile_wall_s": wall, "compile": True,
                             "does_not_fit": str(exc)})
                print(f"# {name}: fxpipe.compile for {k} devices does not fit the device ({wall:.1f} s): {exc}",
                      file=sys.stderr)
                del model
                continue
            wall = time.perf_counter() - t2
            rows.append({"model": name, "devices": k, "compile_wall_s": wall, "compile_timings_s": plan.timings_s,
                         "trivial_stages": trivial_stages(plan.graph, plan.partition),
                         "proven_optimal": bool(plan.partition.meta.get("proven_optimal")),
                         "fxpipe_bottleneck_ms": plan.partition.bottleneck * 1e3, "compile": True})
            print(f"# {name}: fxpipe.compile for {k} devices, {args.microbatches} micro-batches: {wall:.1f} s "
                  f"({', '.join(f'{a} {b:.2f}' for a, b in plan.timings_s.items())}); trivial stages "
                  f"{rows[-1]['trivial_stages']}; proven optimal {rows[-1]['proven_optimal']}", file=sys.stderr)
        del model
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.json:
        print(json.dumps({"rows": rows, "peak_rss_gib": peak_rss_gib}, indent=1))
        return 0
    plans = [r for r in rows if not r.get("compile")]
    print("Plan time by step (seconds; baseline = full torch.export + previous search, same process):\n")
    print("| model | ops | k | capture | cost | export | partition | schedule | total | baseline capture | baseline partition | baseline total |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in plans:
        b = (f"{r['baseline_capture_s']:.2f} | {r['baseline_partition_s']:.2f} | {r['baseline_total_s']:.2f}"
             if "baseline_total_s" in r else "- | - | -")
        print(f"| {r['model']} | {r['ops']} | {r['devices']} | {r['capture_s']:.2f}{' (r)' if r['replicated'] else ''} | "
              f"{r['cost_s']:.2f} | {r['export_s']:.2f} | {r['partition_s']:.2f} | {r['schedule_s']:.2f} | {r['total_s']:.2f} | {b} |")
    print("\n(r): replicated capture. Quality (training/relay, bottleneck stage time in ms):\n")
    print("| model | k | fxpipe | lower bound | proven | trivial stages | baseline search | baseline trivial | equal-layer | param-balanced | x vs equal | x vs params |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in plans:
        print(f"| {r['model']} | {r['devices']} | {r['fxpipe_bottleneck_ms']:.3f} | {r['lower_bound_ms']:.3f} ({r['lower_bound_method']}) | "
              f"{'yes' if r['proven_optimal'] else 'no'} | {r['trivial_stages']} | {r.get('baseline_bottleneck_ms', float('nan')):.3f} | "
              f"{r.get('baseline_trivial_stages', '-')} | {r['equal_layers_ms']:.3f} | {r['param_balanced_ms']:.3f} | "
              f"{r['speedup_vs_equal']:.2f} | {r['speedup_vs_params']:.2f} |")
    for r in rows:
        if r.get("does_not_fit"):
            print(f"\nfxpipe.compile({r['model']}, devices={r['devices']}): does not fit the device "
                  f"({r['compile_wall_s']:.1f} s): {r['does_not_fit']}")
        elif r.get("compile"):
            print(f"\nfxpipe.compile({r['model']}, devices={r['devices']}): {r['compile_wall_s']:.1f} s wall "
                  f"({', '.join(f'{a} {b:.2f}' for a, b in r['compile_timings_s'].items())}); "
                  f"trivial-only stages {r['trivial_stages']}; partition proven optimal: {r['proven_optimal']}")
    print(f"\npeak RSS {peak_rss_gib:.2f} GiB; command: python benchmarks/bench_plan.py {' '.join(argv or sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
