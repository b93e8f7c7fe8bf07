"""Predicted step time of the meshes ``mesh="search"`` tries for large models on H100 nodes.

For each model and device count, ``fxpipe.compile(..., mesh="search")`` considers every mesh
``pp x dp_shard x dp_replicate = devices`` whose replicas divide the micro-batches (meta model,
bf16, SDPA, ``--seq-len`` tokens per micro-batch, ``h100-sxm``: 80 GB, nodes of 8 GPUs on
450 GB/s NVLink joined by 50 GB/s InfiniBand per GPU; schedule ``auto`` with heuristics only),
plans them in order of their lower bound and prints, per mesh, the bound, the predicted step
(schedule + data-parallel sync) or why it was skipped (pruned by its bound, or does not fit),
and the planning time of the whole search.

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

    print("| model | devices | mesh | lower bound s | predicted step s | schedule s | dp sync s | note |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        model, a, k = build_hf_model(name, {"seq_len": args.seq_len, "attn_implementation": "sdpa"}, device="meta",
                                     dtype=torch.bfloat16)
        for d in args.devices:
            t0 = time.perf_counter()
            try:
                plan = fxpipe.compile(model, a, k, devices=d, microbatches=args.microbatches, mesh="search",
                                      time_limit_s=args.time_limit, schedule_time_limit_s=0)
            except FxpipeError as exc:
                print(f"| {name} | {d} | - | - | - | - | - | no mesh fits: {str(exc).splitlines()[0][:120]} |")
                continue
            wall = time.perf_counter() - t0
            for r in plan.options["mesh_search"]:
                bound = f"{r['lower_bound_s']:.3f}"
                if "skipped" in r:
                    why = "pruned by its bound" if r["skipped"].startswith("pruned") else f"does not fit: {r['skipped'][:80]}"
                    print(f"| {name} | {d} | {r['mesh_text']} | {bound} | - | - | - | {why} |")
                else:
                    note = f"chosen (search took {wall:.0f} s)" if r.get("chosen") else ""
                    print(f"| {name} | {d} | {r['mesh_text']} | {bound} | {r['predicted_step_s']:.3f} | "
                          f"{r['step_time_s']:.3f} | {r['dp_sync_s']:.3f} | {note} |", flush=True)


if __name__ == "__main__":
    main()
