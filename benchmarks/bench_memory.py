"""Memory-true plans at real scale (issue 9): Llama-3-70B dimensions on h100-sxm.

For every device count: the plan fxpipe makes by default (capacity from the hardware profile,
memory-aware partition, ``schedule="auto"``) next to the baseline that ignores memory (no
capacity, ZB-H1, the pre-issue-9 default), both counted with the one memory model
(mixed-precision Adam, 16 B/param, 10 % reserved). Prints the largest device total against
the 80 GB capacity, the recomputing stages, offloaded stashes and the predicted step time,
or the clear error when nothing fits.

    python benchmarks/bench_memory.py [--devices 8 16 32 64] [--microbatches 8] [--seq-len 4096]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from fxpipe.api import device_stats, plan_graph, resolve_memory
from fxpipe.errors import InfeasibleError
from fxpipe.memory import format_bytes
from fxpipe.models import build_hf_model
from fxpipe.passes import trace_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-70b")
    ap.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--time-limit", type=float, default=5.0, help="partition budget per device count (s)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model, margs, mkw = build_hf_model(args.model, {"seq_len": args.seq_len}, device="meta", dtype=torch.bfloat16)
    traced = trace_model(model, margs, mkw, hardware=args.hardware)
    g = traced.graph
    mem = resolve_memory(g, None, None, traced.hardware)
    print(f"{args.model} (meta, bf16, {args.seq_len} tokens per micro-batch, m={args.microbatches}) on {args.hardware}: "
          f"{g.n} ops, captured in {time.perf_counter() - t0:.1f} s; capacity {format_bytes(mem.capacity_bytes)}, "
          f"{mem.precision.name} {mem.precision.training_bytes:g} B/param, {mem.reserved_fraction:.0%} reserved")
    print(f"{'devices':>7} | {'baseline (no capacity, zb-h1): max total':>40} | fxpipe default (capacity, auto)")
    for p in args.devices:
        base_part, base_prob, base_sched, _ = plan_graph(
            g, devices=p, microbatches=args.microbatches, schedule=None, memory_bytes=math.inf,
            time_limit_s=args.time_limit, host_bandwidth_bytes_per_s=traced.hardware.host_bytes_per_s)
        rows = device_stats(g, base_part, base_prob, base_sched, "training", mem)
        worst = max(rows, key=lambda r: r.memory_bytes)
        base = f"{format_bytes(worst.memory_bytes)} ({'fits' if worst.fits else 'OVER'})"
        t1 = time.perf_counter()
        try:
            part, prob, sched, _ = plan_graph(
                g, devices=p, microbatches=args.microbatches, memory=mem, time_limit_s=args.time_limit,
                host_bandwidth_bytes_per_s=traced.hardware.host_bytes_per_s)
        except InfeasibleError as exc:
            print(f"{p:>7} | {base:>40} | error after {time.perf_counter() - t1:.1f} s: smallest pipeline "
                  f"{exc.min_devices} devices; overflow {format_bytes(exc.overflow_bytes)}; "
                  f"ZeRO: {exc.remedies['zero']}")
            continue
        drows = device_stats(g, part, prob, sched, "training", mem)
        top = max(drows, key=lambda r: r.memory_bytes)
        n_off = sum(1 for o in sched.ops if o.type == "O")
        print(f"{p:>7} | {base:>40} | max total {format_bytes(top.memory_bytes)} "
              f"({'fits' if all(r.fits for r in drows) else 'OVER'}), {sched.method}, "
              f"{len(prob.recompute_stages)} recomputing stages, {n_off} offloads, "
              f"step {sched.value:.2f} s (lower bound {sched.lower_bound_s:.2f} s), planned in "
              f"{time.perf_counter() - t1:.1f} s")


if __name__ == "__main__":
    main()
