"""Predicted step time of the mesh ``mesh="search"`` picks against pinned meshes, for large models on H100 nodes.

For each model and device count (meta model, bf16, SDPA, ``--seq-len`` tokens per micro-batch,
``h100-sxm``: 80 GB, nodes of 8 GPUs on 450 GB/s NVLink joined by 50 GB/s InfiniBand per GPU;
schedule ``auto`` with heuristics only), in one process:

* ``search``: ``fxpipe.compile(..., mesh="search")`` (every ``pp x dp_shard x dp_replicate`` whose
  replicas divide the micro-batches, planned in order of a lower bound and pruned by it), its
  chosen mesh, predicted step (schedule + data-parallel sync) and planning time, and how many
  meshes it planned / pruned / found not to fit;
* the pinned baselines, each planned alone with the same options: the pure pipeline
  (``pp = devices``, today's default ``mesh="auto"``) and torchtitan-style hand choices
  ``pp=8 x dp_shard=devices/8`` and ``pp=4 x dp_shard=devices/4`` (where they divide).

The search never predicts a slower step than a pinned mesh it could have chosen (it plans the
same pipeline for the same mesh); a pinned mesh that does not fit prints why.

    python benchmarks/bench_mesh_plan.py [--models llama-3-8b llama-3-70b] [--devices 8 16 32 64]
        [--microbatches-per-device 2]
"""

from __future__ import annotations

import argparse
import time


def _pinned(devices: int) -> list[dict[str, int]]:
    out = [{"pp": devices}]
    for pp in (8, 4):
        if devices % pp == 0 and devices > pp:
            out.append({"pp": pp, "dp_shard": devices // pp})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "llama-3-70b"])
    ap.add_argument("--devices", nargs="+", type=int, default=[8, 16, 32, 64])
    ap.add_argument("--microbatches-per-device", type=int, default=2,
                    help="global micro-batches per step = this x devices (default 2: 128 at 64 devices)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=5.0, help="partition search seconds per pipeline")
    args = ap.parse_args()

    import torch

    import fxpipe
    from fxpipe.errors import FxpipeError
    from fxpipe.mesh import format_mesh
    from fxpipe.models import build_hf_model

    print("| model | devices | micro-batches | mesh | predicted step s | schedule s | dp sync s | plan s | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        model, a, k = build_hf_model(name, {"seq_len": args.seq_len, "attn_implementation": "sdpa"}, device="meta",
                                     dtype=torch.bfloat16)
        for d in args.devices:
            m = args.microbatches_per_device * d
            common = dict(devices=d, microbatches=m, time_limit_s=args.time_limit, schedule_time_limit_s=0)
            t0 = time.perf_counter()
            try:
                plan = fxpipe.compile(model, a, k, mesh="search", **common)
                wall = time.perf_counter() - t0
                table = plan.options["mesh_search"]
                planned = sum("predicted_step_s" in r for r in table)
                pruned = sum(r.get("skipped", "").startswith("pruned") for r in table)
                note = (f"search: {len(table)} meshes, {planned} planned, {pruned} pruned by their bound, "
                        f"{len(table) - planned - pruned} do not fit")
                print(f"| {name} | {d} | {m} | search: {format_mesh(plan.mesh)} | "
                      f"{plan.schedule.value + plan.dp_sync_s:.3f} | {plan.schedule.value:.3f} | {plan.dp_sync_s:.3f} | "
                      f"{wall:.0f} | {note} |", flush=True)
            except FxpipeError as exc:
                print(f"| {name} | {d} | {m} | search | - | - | - | {time.perf_counter() - t0:.0f} | "
                      f"no mesh fits: {str(exc).splitlines()[0][:100]} |", flush=True)
            for mesh in _pinned(d):
                t0 = time.perf_counter()
                try:
                    p = fxpipe.compile(model, a, k, mesh=mesh, **common)
                except FxpipeError as exc:
                    print(f"| {name} | {d} | {m} | {format_mesh({'dp_shard': 1, 'dp_replicate': 1, **mesh})} | - | - | - | "
                          f"{time.perf_counter() - t0:.0f} | does not fit: {str(exc).splitlines()[0][:100]} |", flush=True)
                    continue
                print(f"| {name} | {d} | {m} | {format_mesh(p.mesh)} | {p.schedule.value + p.dp_sync_s:.3f} | "
                      f"{p.schedule.value:.3f} | {p.dp_sync_s:.3f} | {time.perf_counter() - t0:.0f} | "
                      f"schedule {p.schedule.method} |", flush=True)


if __name__ == "__main__":
    main()
