"""End-to-end planning benchmark (issue: fxpipe end to end, "Measure").

Plans GPT-2 (124M config), T5-small, Mixtral (small config) and Llama-2-7B (meta device) for
2, 4 and 8 devices and prints, per model and device count: capture, costing, partition and
schedule wall times, and the bottleneck stage time of fxpipe's partition next to

(a) an equal-layer contiguous split (what users of torch.distributed.pipelining write by hand,
    torchtitan's equal chunks), and
(b) a parameter-balanced contiguous split (DeepSpeed's ``partition_method="parameters"``),

all scored by the same cost model and the same Contract-2 objective (training, relay), with
costs for bf16 compute on an H100 SXM by default.
Capture and costing run once per model; the device counts reuse the OpGraph.

Usage::

    python benchmarks/bench_plan.py                 # all four models, devices 2 4 8
    python benchmarks/bench_plan.py --quick         # small configs, for a smoke run
    python benchmarks/bench_plan.py --models gpt2 --devices 4 --json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

MODELS = {
    # name: (arch, overrides, device)
    "gpt2-124m": ("gpt2", {"seq_len": 1024}, "cpu"),
    "t5-small": ("t5", {"seq_len": 512}, "cpu"),
    "mixtral-small": ("mixtral", {"num_hidden_layers": 8, "seq_len": 512}, "cpu"),
    "llama-2-7b-meta": ("llama-2-7b", {"seq_len": 4096}, "meta"),
}
QUICK = {
    "gpt2-124m": ("gpt2", {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 1024, "seq_len": 64}, "cpu"),
    "t5-small": ("t5", {"num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_ff": 128, "num_heads": 2, "d_kv": 32, "vocab_size": 512, "seq_len": 32}, "cpu"),
    "mixtral-small": ("mixtral", {"num_hidden_layers": 4, "seq_len": 32}, "cpu"),
    "llama-2-7b-meta": ("llama-2-7b", {"seq_len": 4096}, "meta"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--devices", nargs="*", type=int, default=[2, 4, 8])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--time-limit", type=float, default=10.0, help="partition search budget per instance (s)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="compute dtype the costs assume (default bf16)")
    ap.add_argument("--quick", action="store_true", help="small configs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from fxpipe.api import graph_signature, plan_graph
    from fxpipe.models import build_hf_model
    from fxpipe.partition.baselines import equal_layers, parameter_balanced
    from fxpipe.passes import trace_model

    table = QUICK if args.quick else MODELS
    rows = []
    for name in args.models:
        arch, over, device = table[name]
        t0 = time.perf_counter()
        model, margs, mkwargs = build_hf_model(arch, over, device=device)
        build_s = time.perf_counter() - t0
        import torch

        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        traced = trace_model(model, margs, mkwargs, hardware=args.hardware, dtype=dtype, name=name)
        graph = traced.graph
        del model
        for k in args.devices:
            if k > graph.n:
                continue
            part, problem, sched, tim = plan_graph(
                graph, devices=k, microbatches=args.microbatches, objective="training", schedule="zb-h1", time_limit_s=args.time_limit
            )
            eq = equal_layers(graph, k, objective="training", comm="relay")
            pb = parameter_balanced(graph, k, objective="training", comm="relay")
            rows.append(
                {
                    "model": name,
                    "ops": graph.n,
                    "devices": k,
                    "build_s": build_s,
                    "capture_s": traced.capture_s,
                    "cost_s": traced.cost_s,
                    "partition_s": tim["partition"],
                    "schedule_s": tim["schedule"],
                    "fxpipe_bottleneck_ms": part.bottleneck * 1e3,
                    "equal_layers_ms": eq.bottleneck * 1e3,
                    "param_balanced_ms": pb.bottleneck * 1e3,
                    "speedup_vs_equal": eq.bottleneck / part.bottleneck,
                    "speedup_vs_params": pb.bottleneck / part.bottleneck,
                    "makespan_ms": sched.makespan * 1e3,
                    "signature": graph_signature(graph),
                }
            )
            print(f"# {name} k={k}: fxpipe {part.bottleneck * 1e3:.3f} ms, equal-layer {eq.bottleneck * 1e3:.3f} ms, "
                  f"param-balanced {pb.bottleneck * 1e3:.3f} ms", file=sys.stderr)
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.json:
        print(json.dumps({"rows": rows, "peak_rss_gib": peak_rss_gib}, indent=1))
        return 0
    hdr = ("| model | ops | k | capture s | cost s | partition s | schedule s | fxpipe bottleneck ms | "
           "equal-layer ms | param-balanced ms | x vs equal | x vs params |")
    print(hdr)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['ops']} | {r['devices']} | {r['capture_s']:.1f} | {r['cost_s']:.1f} | {r['partition_s']:.1f} | "
            f"{r['schedule_s']:.2f} | {r['fxpipe_bottleneck_ms']:.3f} | {r['equal_layers_ms']:.3f} | "
            f"{r['param_balanced_ms']:.3f} | {r['speedup_vs_equal']:.2f} | {r['speedup_vs_params']:.2f} |"
        )
    print(f"\npeak RSS {peak_rss_gib:.2f} GiB; command: python benchmarks/bench_plan.py {' '.join(argv or sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
