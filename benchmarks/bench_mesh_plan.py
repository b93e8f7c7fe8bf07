"""Predicted step time of the mesh ``mesh="search"`` picks against pinned meshes, for large models on H100 nodes.

For each model and device count (meta model, bf16, SDPA, ``--seq-len`` tokens per micro-batch,
``h100-sxm``: 80 GB, nodes of 8 GPUs on 450 GB/s NVLink joined by 50 GB/s InfiniBand per GPU;
schedule ``auto`` with heuristics only), in one process:

* ``search``: ``fxpipe.compile(..., mesh="search")`` (every ``pp x dp_shard x dp_replicate`` whose
  replicas divide the micro-batches, planned in order of a lower bound and pruned by it), its
  chosen mesh, predicted step (schedule + the data-parallel sync the pipeline does not hide,
  :func:`fxpipe.mesh.pipeline_step_s`) and planning time, and how many
  meshes it planned / pruned / found not to fit;
  the rank order it chose for that mesh (outermost first; ``dp_replicate/dp_shard/pp`` is
  fxpipe's default, pipeline rank innermost, ``pp/dp_replicate/dp_shard`` torchtitan's) and the
  mesh's predicted step under every order it tried (``pruned >= x``: its lower bound already
  lost);
* the pinned baselines, each planned alone with the same options: the pure pipeline
  (``pp = devices``, ``mesh="pipeline"``, the default before ``"auto"`` became the search) and torchtitan-style hand choices
  ``pp=8 x dp_shard=devices/8`` and ``pp=4 x dp_shard=devices/4`` (where they divide), each
  with the default rank order and with torchtitan's (``mesh={..., "order": [...]}``; its
  pipeline is costed at the link its hops cross, :func:`fxpipe.mesh.pipeline_graph`, once
  ``fxpipe.compile`` plans pinned meshes on it: the note says when it does not).

The search never predicts a slower step than a pinned mesh it could have chosen (it plans the
same pipeline for the same mesh); a pinned mesh that does not fit prints why and is planned again
with the optimizer state on the host (``MemoryModel(offload_optimizer=True)``), which the search
tries for every mesh whose memory binds.

    python benchmarks/bench_mesh_plan.py [--models llama-3-8b llama-3-70b] [--devices 8 16 32 64]
        [--microbatches-per-device 2] [--no-pure]
"""

from __future__ import annotations

import argparse
import time


def _pinned(devices: int, pure: bool = True) -> list[dict[str, int]]:
    out = [{"pp": devices}] if pure else []
    for pp in (8, 4):
        if devices % pp == 0 and devices > pp:
            out.append({"pp": pp, "dp_shard": devices // pp})
            out.append({"pp": pp, "dp_shard": devices // pp, "order": ["pp", "dp_replicate", "dp_shard"]})
    return out


def _sync(plan) -> str:
    """The busiest device's data-parallel sync, its host optimizer step, and (in parentheses) what of both the
    pipeline does not hide (s)."""
    return (f"{plan.dp_sync_s:.3f} | {plan.optimizer_host_step_s:.3f} "
            f"({plan.predicted_step_s - plan.schedule.value:.3f})")


def _by_order(row: dict) -> str:
    """The mesh's predicted step under each rank order the search tried (s)."""
    from fxpipe.mesh import format_rank_order

    parts = []
    for e in row.get("by_order", []):
        val = f"{e['predicted_step_s']:.3f}" if "predicted_step_s" in e else \
            (f"pruned >= {e['lower_bound_s']:.3f}" if e.get("skipped", "").startswith("pruned") else "-")
        parts.append(f"{format_rank_order(e['rank_order'])}: {val}")
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "llama-3-70b"])
    ap.add_argument("--devices", nargs="+", type=int, default=[8, 16, 32, 64])
    ap.add_argument("--microbatches-per-device", type=int, default=2,
                    help="global micro-batches per step = this x devices (default 2: 128 at 64 devices)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=5.0, help="partition search seconds per pipeline")
    ap.add_argument("--no-pure", action="store_true",
                    help="skip the pure-pipeline baseline (pp = devices: a 256-stage pipeline of 512 micro-batches "
                    "takes longer to plan than 25 minutes)")
    args = ap.parse_args()

    import torch

    import fxpipe
    from fxpipe.errors import FxpipeError
    from fxpipe.memory import MemoryModel
    from fxpipe.mesh import format_mesh, format_rank_order, pipeline_graph
    from fxpipe.models import build_hf_model

    print("| model | devices | micro-batches | mesh | rank order | predicted step s | schedule s | dp sync s "
          "| host step s (sync + host not hidden) | plan s | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
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
                chosen = next(r for r in table if r.get("chosen"))
                note = (f"search: {len(table)} meshes, {planned} planned, {pruned} pruned by their bound, "
                        f"{len(table) - planned - pruned} do not fit; chosen mesh by order: {_by_order(chosen)}")
                where = ", optimizer on host" if plan.memory.offload_optimizer else ""
                print(f"| {name} | {d} | {m} | search: {format_mesh(plan.mesh)}{where} | {format_rank_order(plan.rank_order)} | "
                      f"{plan.predicted_step_s:.3f} | {plan.schedule.value:.3f} | {_sync(plan)} | "
                      f"{wall:.0f} | {note} |", flush=True)
            except FxpipeError as exc:
                print(f"| {name} | {d} | {m} | search | - | - | - | - | - | {time.perf_counter() - t0:.0f} | "
                      f"no mesh fits: {str(exc).splitlines()[0][:100]} |", flush=True)
            for mesh in _pinned(d, pure=not args.no_pure):
                t0 = time.perf_counter()
                try:
                    p = fxpipe.compile(model, a, k, mesh=mesh, **common)
                except FxpipeError as exc:
                    print(f"| {name} | {d} | {m} | {format_mesh({'dp_shard': 1, 'dp_replicate': 1, **mesh})} | "
                          f"{format_rank_order(mesh.get('order'))} | - | - | - | - | "
                          f"{time.perf_counter() - t0:.0f} | does not fit: {str(exc).splitlines()[0][:100]} |", flush=True)
                    t0 = time.perf_counter()  # the same mesh with the optimizer state on the host
                    try:
                        p = fxpipe.compile(model, a, k, mesh=mesh, memory=MemoryModel(offload_optimizer=True), **common)
                    except FxpipeError as exc:
                        print(f"| {name} | {d} | {m} | {format_mesh({'dp_shard': 1, 'dp_replicate': 1, **mesh})}, "
                              f"optimizer on host | {format_rank_order(mesh.get('order'))} | - | - | - | - | "
                              f"{time.perf_counter() - t0:.0f} | does not fit: {str(exc).splitlines()[0][:100]} |",
                              flush=True)
                        continue
                link = pipeline_graph(p.graph, p.mesh, p.rank_order).bandwidth_bytes_per_s
                note = "" if link == p.graph.bandwidth_bytes_per_s else \
                    f"; pipeline planned at {p.graph.bandwidth_bytes_per_s / 1e9:g} GB/s, its hops cross nodes at {link / 1e9:g} GB/s"
                where = ", optimizer on host" if p.memory.offload_optimizer else ""
                print(f"| {name} | {d} | {m} | {format_mesh(p.mesh)}{where} | {format_rank_order(p.rank_order)} | "
                      f"{p.predicted_step_s:.3f} | {p.schedule.value:.3f} | {_sync(p)} | "
                      f"{time.perf_counter() - t0:.0f} | schedule {p.schedule.method}{note} |", flush=True)


if __name__ == "__main__":
    main()
