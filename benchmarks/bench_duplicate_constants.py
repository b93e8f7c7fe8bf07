"""Constant tensors recomputed per layer instead of relayed (issue 19, item 3): before / after.

Llama-3-70B dimensions (meta device, bf16, SDPA attention, 4096 tokens, h100-sxm costs, the
same model as ``benchmarks/bench_scale.py``), pure pipeline, planned with ``fxpipe.compile``
twice: with the capture's :func:`fxpipe.passes.duplicate_constants.duplicate_constants` off
("before": the causal mask and the rotary tables are computed once and relayed) and on
("after", the default). Per run:

* ops in the graph and the capture + plan time;
* bytes of constant tensors (:func:`fxpipe.passes.duplicate_constants.constant_nodes` and the
  layers' copies) crossing stage boundaries per micro-batch (summed over the boundaries) and
  all relayed bytes per micro-batch;
* per stage: receive buffers, activation peak and total memory (largest over the stages,
  and stage 3, the one issue 19 quotes; every stage with ``--json``);
* the predicted step (the schedule objective) and the schedule's lower bound; how the
  partition was found and bounded (``rule``, ``lower_bound_method``, ``proven_optimal``).

Usage::

    python benchmarks/bench_duplicate_constants.py                      # 70B at 32 x 64
    python benchmarks/bench_duplicate_constants.py --devices 8 --microbatches 16 --layers 16
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import warnings


def _run(model, margs, mkw, *, duplicate: bool, devices: int, microbatches: int, time_limit_s: float) -> dict:
    import numpy as np

    import importlib

    import fxpipe
    from fxpipe.partition.objective import io_bytes
    from fxpipe.passes.capture import capture
    from fxpipe.passes.duplicate_constants import DUPLICATED_KEY, constant_nodes

    to_opgraph = importlib.import_module("fxpipe.passes.to_opgraph")  # the module, not fxpipe.passes.to_opgraph()
    t0 = time.perf_counter()
    to_opgraph.capture = functools.partial(capture, duplicate_constants=duplicate)
    try:
        plan = fxpipe.compile(model, margs, mkw, devices=devices, microbatches=microbatches, hardware="h100-sxm",
                              time_limit_s=time_limit_s)
    finally:
        to_opgraph.capture = capture
    wall = time.perf_counter() - t0
    graph, a, k = plan.graph, np.asarray(plan.partition.assignment), plan.problem.num_stages
    gm = plan.capture.traced.gm
    names = {n.name for n in constant_nodes(gm) if n.op == "call_function"} | \
        {n.name for n in gm.graph.nodes if DUPLICATED_KEY in n.meta}
    const = np.array([nm in names for nm in graph.names])
    in_all, _ = io_bytes(graph, a, k, "relay")
    in_const, _ = io_bytes(graph, a, k, "relay", producers=const)
    st = plan.stages
    return {
        "duplicate_constants": duplicate, "ops": graph.n, "wall_s": round(wall, 1),
        "timings_s": {key: round(float(v), 2) for key, v in plan.timings_s.items() if isinstance(v, (int, float))},
        "const_relayed_mb_per_microbatch": float(in_const.sum()) / 1e6,
        "relayed_mb_per_microbatch": float(in_all.sum()) / 1e6,
        "max_comm_buffer_gb": max(s.comm_buffer_bytes for s in st) / 1e9,
        "max_activation_peak_gb": max(s.activation_peak_bytes for s in st) / 1e9,
        "max_memory_gb": max(s.memory_bytes for s in st) / 1e9,
        "stage3": {"comm_buffer_gb": st[3].comm_buffer_bytes / 1e9 if len(st) > 3 else None,
                   "activation_peak_gb": st[3].activation_peak_bytes / 1e9 if len(st) > 3 else None,
                   "memory_gb": st[3].memory_bytes / 1e9 if len(st) > 3 else None},
        "per_stage_gb": {"activation_peak": [round(s.activation_peak_bytes / 1e9, 2) for s in st],
                         "comm_buffer": [round(s.comm_buffer_bytes / 1e9, 2) for s in st],
                         "memory": [round(s.memory_bytes / 1e9, 2) for s in st]},
        "step_s": float(plan.schedule.value), "lower_bound_s": float(plan.schedule.lower_bound_s),
        "schedule": plan.schedule.method,
        "partition": {key: plan.partition.meta.get(key) for key in ("rule", "lower_bound_method", "proven_optimal")},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=None, help="override the 80 layers (a quicker check)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="partition search budget (s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    from fxpipe.models import build_hf_model

    over = {"seq_len": args.seq_len, "attn_implementation": "sdpa"}
    if args.layers:
        over["num_hidden_layers"] = args.layers
    model, margs, mkw = build_hf_model("llama-3-70b", over, device="meta", dtype=torch.bfloat16)
    print(f"# load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)",
          flush=True)
    rows = []
    for dup in (False, True):
        row = _run(model, margs, mkw, duplicate=dup, devices=args.devices, microbatches=args.microbatches,
                   time_limit_s=args.time_limit)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{'after ' if dup else 'before'}: {row['ops']} ops, compile {row['wall_s']} s | constants relayed "
                  f"{row['const_relayed_mb_per_microbatch']:.1f} MB/micro-batch, all relayed "
                  f"{row['relayed_mb_per_microbatch']:.1f} MB | max receive buffers {row['max_comm_buffer_gb']:.2f} GB, "
                  f"max act peak {row['max_activation_peak_gb']:.2f} GB, max memory {row['max_memory_gb']:.2f} GB | "
                  f"stage 3: {json.dumps(row['stage3'])} | step {row['step_s']:.3f} s ({row['schedule']}), "
                  f"bound {row['lower_bound_s']:.3f} s | timings {row['timings_s']} | partition {row['partition']}",
                  flush=True)
    print(f"# load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
