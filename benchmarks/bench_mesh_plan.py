"""Predicted step time of every pp x dp_shard mesh (``mesh="search"``) for large models on H100s.

For each model and device count, ``fxpipe.compile(..., mesh="search")`` plans every mesh
``pp x dp_shard = devices`` whose replicas divide the micro-batches (meta model, bf16, SDPA,
``--seq-len`` tokens per micro-batch, ``h100-sxm``: 80 GB, one 450 GB/s link bandwidth for
the pipeline transfers and the data-parallel collectives; schedule ``auto`` with heuristics
only) and prints the predicted step (schedule + data-parallel sync) of each, or why it does not
fit, and the planning time.

    python benchmarks/bench_mesh_plan.py [--models llama-2-7b llama-3-70b] [--devices 8 16 32] [--microbatches 32]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-2-7b", "llama-3-70b"])
    ap.add_argument("--devices", nargs="+", type=int, default=[8, 16, 32])
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=5.0)
    args = ap.parse_args()

    import torch

    import fxpipe
    from fxpipe.errors import FxpipeError
    from fxpipe.models import build_hf_model

    print("| model | devices | mesh | predicted step s | schedule s | dp sync s | note |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        model, a, k = build_hf_model(name, {"seq_len": args.seq_len, "attn_implementation": "sdpa"}, device="meta",
                                     dtype=torch.bfloat16)
        for d in args.devices:
            t0 = time.perf_counter()
            try:
                plan = fxpipe.compile(model, a, k, devices=d, microbatches=args.microbatches, mesh="search",
                                      time_limit_s=args.time_limit, schedule_time_limit_s=0)
            except FxpipeError as exc:
                print(f"| {name} | {d} | - | - | - | - | no mesh fits: {str(exc).splitlines()[0][:120]} |")
                continue
            wall = time.perf_counter() - t0
            for r in plan.options["mesh_search"]:
                if "skipped" in r:
                    print(f"| {name} | {d} | {r['mesh_text']} | - | - | - | does not fit: {r['skipped'][:80]} |")
                else:
                    note = f"chosen (planned all in {wall:.0f} s)" if r.get("chosen") else ""
                    print(f"| {name} | {d} | {r['mesh_text']} | {r['predicted_step_s']:.3f} | {r['step_time_s']:.3f} | "
                          f"{r['dp_sync_s']:.3f} | {note} |", flush=True)


if __name__ == "__main__":
    main()
