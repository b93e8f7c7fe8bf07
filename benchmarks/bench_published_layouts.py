"""fxpipe's predicted throughput against published training layouts (torchtitan's), row by row.

Each row is a layout someone measured and published: model dimensions, GPUs and their nodes, the
mesh, the local batch and sequence length, and the activation-checkpointing policy, pinned as
published. fxpipe plans it (``fxpipe.compile`` with that mesh, on a ``meta`` model: no weights,
no GPU) and the script prints its predicted tokens/s per GPU beside the published figure and
their ratio, in the same run. Target: a ratio in 0.8-1.25; a row outside it prints which term
of the prediction is off and why (:func:`explain`).

    python benchmarks/bench_published_layouts.py [--rows a100-8b a100-70b h100-8b-fsdp8 h100-8b-fsdp128 ...]
                                                  [--hardware-variant achieved|datasheet] [--json out.json]
                                                  [--default-all | --no-default]

Rows (:data:`ROWS`; issue 29 adds the tensor-parallel ones). Sources:

* torchtitan, ``docs/performance.md`` (github.com/pytorch/torchtitan), "Llama 3 performance numbers",
  64 A100 80GB with FSDP2, local batch 1, sequence 8192: Llama-3-8B, selective (layer) AC, 2,904
  tokens/s/GPU (56.8 % MFU); Llama-3-70B, full AC, 331 (51.7 % MFU).
* the same file's later version (torchtitan paper, arXiv 2410.06511, Table 1), Grand Teton hosts of
  8 H100 (96 GB HBM2e, 2.4 TB/s, 500 W power limit; NVLink inside a host, 400 Gb/s RDMA per GPU):
  Llama-3.1-8B, FSDP, local batch 2 x 8192, selective AC: 5,762 tokens/s/GPU on 8 GPUs (82.4 GiB),
  5,605 on 128.
* the same file (torchtitan commit d4c86e3, "update performance and loss converging results", runs of
  2024/12/26), Table 4: Llama-3.1-70B, 256 GPUs, FSDP 32 x TP 8, local batch 16 x 8192, full AC,
  torch.compile + Float8: 829 tokens/s/GPU, 71.9 GiB; Table 5: Llama-3.1-405B, 512 GPUs, FSDP 8 x
  TP 8 x PP 8, local batch 32 x 8192, full AC, torch.compile + Float8 + async TP: 1F1B 100
  tokens/s/GPU (82.5 GiB), interleaved 1F1B 128 (72.7 GiB). Its Table 6 (context parallelism) has
  no fxpipe counterpart.

Tensor-parallel rows (issue 29 item 6): the published ``local_batch`` sequences per data-parallel
replica are planned as micro-batches of ``microbatch_size`` sequences (torchtitan's pipeline
default: one sequence per micro-batch; with ``pp = 1`` gradient accumulation over the same tokens).
They are planned WITH the published full AC (``activation_checkpointing="full"``): fxpipe's runtime
runs per-block checkpointing on the tensor-parallel stages (the stash keeps the local shards, a
block's replay re-runs its collectives, :mod:`fxpipe.codegen.tensor_parallel`), priced on one
tensor-parallel rank's graph; a row that still does not fit the 96 GB says so with the planner's
figures (and is then planned without a memory limit, time terms only). Float8, torch.compile and
async TP are not modelled (bf16 matmuls, collectives not overlapped): the prediction is pessimistic
by them. Each tensor-parallel row also plans fxpipe's default (``mesh="auto"``) for the same job
(same GPUs, tokens per step and micro-batch size), printed on the next line.

The 96 GB HBM2e H100 at 500 W is not a datasheet part: its capacity (96e9 bytes, the printed
figure) and memory bandwidth (2.4 TB/s) are torchtitan's, everything else (the peak FLOP/s of the
700 W H100 SXM, its links and the achieved efficiencies) is ``h100-sxm``'s. At 500 W the clocks,
and so the matmul rate, are lower by an amount nobody published: those rows' predictions are
optimistic by it, and the script does not invent a peak to hide that.

Activation checkpointing: the published policies ("selective", "full") are passed as
``fxpipe.compile(..., activation_checkpointing=...)`` (issue 28). Where this fxpipe has no such
argument, the row says "needs activation_checkpointing (issue 28)" and is planned with today's
default instead: no recomputation where the activations fit, else the schedule's whole-stage
recomputation (one more forward per step, which is what full AC costs in time).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import sys
import time

#: Published layouts, one row each: what was run and what it measured.
ROWS = [
    {"id": "a100-8b", "model": "llama-3-8b", "hardware": "a100-80gb", "devices": 64,
     "mesh": {"pp": 1, "dp_shard": 64}, "local_batch": 1, "seq_len": 8192, "ac": "selective",
     "published_tokens_per_s_per_gpu": 2904, "published_mfu": 0.568,
     "source": "torchtitan docs/performance.md, Llama 3 performance numbers (64 A100 80GB, FSDP2): 8B, batch 1, "
               "selective layer AC, 2904 WPS, 56.8% MFU"},
    {"id": "a100-70b", "model": "llama-3-70b", "hardware": "a100-80gb", "devices": 64,
     "mesh": {"pp": 1, "dp_shard": 64}, "local_batch": 1, "seq_len": 8192, "ac": "full",
     "published_tokens_per_s_per_gpu": 331, "published_mfu": 0.517,
     "source": "torchtitan docs/performance.md, Llama 3 performance numbers (64 A100 80GB, FSDP2): 70B, batch 1, "
               "full AC, 331 WPS, 51.7% MFU"},
    {"id": "h100-8b-fsdp8", "model": "llama-3-8b", "hardware": "h100-96gb-hbm2e-500w", "devices": 8,
     "mesh": {"pp": 1, "dp_shard": 8}, "local_batch": 2, "seq_len": 8192, "ac": "selective",
     "published_tokens_per_s_per_gpu": 5762,
     "source": "torchtitan docs/performance.md / arXiv 2410.06511 Table 1: Llama 3.1 8B, 8 H100 (96 GB HBM2e, 500 W), "
               "FSDP, local batch 2, selective AC: 5,762 TPS/GPU, 82.4 GiB"},
    {"id": "h100-8b-fsdp128", "model": "llama-3-8b", "hardware": "h100-96gb-hbm2e-500w", "devices": 128,
     "mesh": {"pp": 1, "dp_shard": 128}, "local_batch": 2, "seq_len": 8192, "ac": "selective",
     "published_tokens_per_s_per_gpu": 5605,
     "source": "torchtitan docs/performance.md / arXiv 2410.06511: Llama 3.1 8B, 128 H100 (96 GB HBM2e, 500 W), FSDP, "
               "local batch 2, selective AC: 5,605 TPS/GPU"},
    {"id": "h100-70b-fsdp32-tp8", "model": "llama-3-70b", "hardware": "h100-96gb-hbm2e-500w", "devices": 256,
     "mesh": {"pp": 1, "dp_shard": 32, "tp": 8}, "local_batch": 16, "microbatch_size": 1, "seq_len": 8192,
     "ac": "full", "published_tokens_per_s_per_gpu": 829, "published_memory_gib": 71.9, "default": True,
     "source": "torchtitan docs/performance.md (d4c86e3) Table 4: Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, local "
               "batch 16, full AC, torch.compile + Float8: 829 TPS/GPU, 71.9 GiB"},
    {"id": "h100-405b-1f1b", "model": "llama-3.1-405b", "hardware": "h100-96gb-hbm2e-500w", "devices": 512,
     "mesh": {"pp": 8, "dp_shard": 8, "tp": 8}, "local_batch": 32, "microbatch_size": 1, "seq_len": 8192,
     "ac": "full", "schedule": "1f1b", "published_tokens_per_s_per_gpu": 100, "published_memory_gib": 82.5,
     "default": True,
     "source": "torchtitan docs/performance.md (d4c86e3) Table 5: Llama 3.1 405B, 512 H100, FSDP 8 x TP 8 x PP 8, "
               "local batch 32, full AC, compile + Float8 + async TP, 1F1B: 100 TPS/GPU, 82.5 GiB"},
    {"id": "h100-405b-interleaved", "model": "llama-3.1-405b", "hardware": "h100-96gb-hbm2e-500w", "devices": 512,
     "mesh": {"pp": 8, "dp_shard": 8, "tp": 8}, "local_batch": 32, "microbatch_size": 1, "seq_len": 8192,
     "ac": "full", "schedule": "interleaved-1f1b", "stages_per_device": 2, "published_tokens_per_s_per_gpu": 128,
     "published_memory_gib": 72.7,
     "source": "torchtitan docs/performance.md (d4c86e3) Table 5: Llama 3.1 405B, 512 H100, FSDP 8 x TP 8 x PP 8, "
               "local batch 32, full AC, compile + Float8 + async TP, interleaved 1F1B: 128 TPS/GPU, 72.7 GiB"},
]

#: Target band of predicted / published.
BAND = (0.8, 1.25)


def hardware_of(name: str, variant: str):
    """The spec a row names: a known spec, or the 96 GB HBM2e H100 at 500 W (``h100-sxm`` with torchtitan's
    published capacity and memory bandwidth, nothing invented); ``variant="datasheet"``: its datasheet twin."""
    from fxpipe.cost.hardware import get_hardware

    if name == "h100-96gb-hbm2e-500w":
        base = get_hardware("h100-sxm")
        spec = dataclasses.replace(
            base, name=name, description="NVIDIA H100 96GB HBM2e, 500 W power limit (Grand Teton host)",
            memory_bytes=96e9, memory_datasheet_bytes=96e9, hbm_bytes_per_s=2.4e12,
            source="torchtitan docs/performance.md: 96GB HBM2e, 2.4 TB/s peak memory bandwidth, 500 W power limit, "
                   "400 Gb/s per GPU across hosts; peak FLOP/s, links and efficiencies: h100-sxm (700 W; the 500 W "
                   "clocks are not published)")
    else:
        spec = get_hardware(name)
    return spec.datasheet() if variant == "datasheet" else spec


def has_activation_checkpointing() -> bool:
    """Whether this fxpipe's ``compile`` takes ``activation_checkpointing=`` (issue 28)."""
    import fxpipe

    return "activation_checkpointing" in inspect.signature(fxpipe.compile).parameters


def job_of(row: dict) -> tuple[int, int, float]:
    """``(global micro-batches, sequences per micro-batch, tokens per GPU per step)`` of a row's job: every
    data-parallel replica runs ``local_batch`` sequences per step in micro-batches of ``microbatch_size``."""
    mesh = row["mesh"]
    dp = row["devices"] // (mesh.get("pp", 1) * mesh.get("tp", 1))
    mbs = row.get("microbatch_size", row["local_batch"])
    return dp * row["local_batch"] // mbs, mbs, row["local_batch"] * row["seq_len"] * dp / row["devices"]


def plan_row(row: dict, variant: str, time_limit_s: float, default: bool = False) -> dict:
    """Plan one row pinned as published (``default=True``: fxpipe's default, ``mesh="auto"``, for the same job);
    returns the prediction, its terms and notes (or the error)."""
    import torch

    import fxpipe
    from fxpipe.errors import FxpipeError, InfeasibleError
    from fxpipe.mesh import format_mesh
    from fxpipe.models import build_hf_model

    hw = hardware_of(row["hardware"], variant)
    out = {"id": row["id"], "hardware": hw.name, "notes": []}
    microbatches, mbs, tokens = job_of(row)
    model, args, kwargs = build_hf_model(row["model"], {"seq_len": row["seq_len"], "batch_size": mbs,
                                                        "attn_implementation": "sdpa"}, device="meta", dtype=torch.bfloat16)
    tp = int(row["mesh"].get("tp", 1))
    extra = {}
    if default:
        out["ac_planned"] = "auto"
    elif has_activation_checkpointing():
        extra["activation_checkpointing"] = row["ac"]
        out["ac_planned"] = row["ac"]
    else:
        out["ac_planned"] = "today's default (whole-stage recompute where memory binds)"
        out["notes"].append(f"needs activation_checkpointing (issue 28) for the published '{row['ac']}' AC")
    if not default:
        extra.update({k: row[k] for k in ("schedule", "stages_per_device") if k in row})
    t0 = time.perf_counter()
    common = dict(devices=row["devices"], microbatches=microbatches, hardware=hw,
                  mesh="auto" if default else dict(row["mesh"]), time_limit_s=time_limit_s, schedule_time_limit_s=0,
                  **extra)
    try:
        plan = fxpipe.compile(model, args, kwargs, **common)
    except InfeasibleError as exc:
        if default or tp == 1 and extra.get("activation_checkpointing") not in (None, "none"):
            out.update(error=str(exc).splitlines()[0][:300], plan_s=time.perf_counter() - t0)
            return out
        # the published batch does not fit as planned: plan it without a memory limit, clearly labelled, so the
        # time terms and the memory it would need can still be compared
        out["notes"].append(f"DOES NOT FIT with AC {out['ac_planned']!r} (" + str(exc).splitlines()[0][:160] +
                            "); planned WITHOUT a memory limit: time terms only, memory column = what it would need")
        out["ac_planned"] = f"{out['ac_planned']} (memory not checked)"
        out["fits"] = False
        try:
            plan = fxpipe.compile(model, args, kwargs, **{**common, "memory_bytes": math.inf})
        except FxpipeError as exc2:
            out.update(error=str(exc2).splitlines()[0][:300], plan_s=time.perf_counter() - t0)
            return out
    except FxpipeError as exc:
        out.update(error=str(exc).splitlines()[0][:300], plan_s=time.perf_counter() - t0)
        return out
    g = plan.graph
    step = float(plan.predicted_step_s)
    memory = max(float(d.memory_bytes) for d in plan.device_table)
    out.setdefault("fits", memory <= 96e9 if "96" in row["hardware"] else True)
    out.update(
        plan_s=time.perf_counter() - t0, predicted_step_s=step, schedule_s=float(plan.schedule.value),
        dp_sync_s=float(plan.dp_sync_s), exposed_sync_s=step - float(plan.schedule.value),
        compute_fbw_s=float((g.t_fwd_s + g.t_bwd_input_s + g.t_bwd_weight_s).sum()),
        forward_s=float(g.t_fwd_s.sum()), recompute_stages=list(plan.recompute_stages()),
        predicted_tokens_per_s_per_gpu=tokens / step, memory_gib=memory / 2**30,
        mesh_planned=format_mesh(plan.mesh), schedule_planned=str(plan.options.get("schedule")),
        tp_collectives_s=sum((g.meta.get("tp_costs") or {}).get(k, 0.0) for k in ("collective_fwd_s", "collective_bwd_s")),
        by_family_fbw_s=_by_family(g),
    )
    if plan.tp > 1:  # what tensor parallelism splits, by region kind (split / found)
        regions = (g.meta.get("tensor_parallel") or {}).get("regions", [])
        split = set(plan.tensor_parallel.regions)
        kinds = sorted({r["kind"] for r in regions})
        out["tp_split"] = ", ".join(f"{k} {sum(1 for r in regions if r['kind'] == k and int(r['id']) in split)}/"
                                    f"{sum(1 for r in regions if r['kind'] == k)}" for k in kinds)
    return out


def _by_family(graph) -> dict:
    """F + B + W seconds per efficiency family of the graph's ops (what each family contributes)."""
    fam: dict = {}
    for i, e in enumerate(graph.extra or []):
        kind = e.get("kind", "")
        if kind in ("shape", "input", "output"):
            continue
        f = {"matmul_param": "matmul", "matmul": "matmul"}.get(kind, kind if kind in ("attention", "embedding")
                                                                   else "elementwise+reduction")
        fam[f] = fam.get(f, 0.0) + float(graph.t_fwd_s[i] + graph.t_bwd_input_s[i] + graph.t_bwd_weight_s[i])
    return fam


def explain(row: dict, res: dict) -> list[str]:
    """Which term of the prediction is off, for a row outside :data:`BAND` (and facts worth printing for every row)."""
    notes = []
    pub, pred = row["published_tokens_per_s_per_gpu"], res.get("predicted_tokens_per_s_per_gpu")
    if pred is None:
        return notes
    ratio = pred / pub
    tokens = job_of(row)[2]
    exposed = res["exposed_sync_s"]
    if exposed > 0.05 * res["predicted_step_s"]:
        hidden = tokens / max(res["schedule_s"], res["dp_sync_s"]) / pub
        notes.append(f"data-parallel sync {res['dp_sync_s']:.2f} s, {exposed:.2f} s of it exposed: fxpipe's runtime "
                     f"shards a stage as one FSDP unit, gathered before its compute and reduced after its backward "
                     f"(fxpipe.mesh.pipeline_step_s); with pp=1 that is the whole model, where torchtitan wraps every "
                     f"layer and FSDP2 prefetches them under compute (ratio with the sync hidden: {hidden:.2f})")
    if row["ac"] == "selective" and not res["recompute_stages"]:
        notes.append("no recomputation planned where torchtitan's selective AC recomputes part of the forward "
                     "(a few % of the step): the prediction is that much optimistic")
    if row["ac"] == "full" and not res["recompute_stages"] and not str(res.get("ac_planned", "")).startswith("full"):
        with_ac = tokens / (res["predicted_step_s"] + res["forward_s"]) / pub
        both = tokens / max(res["schedule_s"] + res["forward_s"], res["dp_sync_s"]) / pub
        notes.append(f"full AC recomputes the forward, {res['forward_s']:.2f} s more per step, not planned here "
                     f"(ratio with it added: {with_ac:.2f}; with it added and the sync hidden: {both:.2f})")
    if row["hardware"] == "h100-96gb-hbm2e-500w":
        notes.append("500 W H100: the matmul rate is the 700 W part's (the 500 W clocks are not published); "
                     "the prediction is optimistic by the clock drop")
    att = res["by_family_fbw_s"].get("attention", 0.0)
    if att > 0.08 * res["compute_fbw_s"]:
        notes.append(f"attention {att / res['compute_fbw_s']:.0%} of compute: the captured graph's SDPA has an explicit "
                     "causal mask (memory-efficient kernel over the full S x S); torchtitan calls SDPA with "
                     "is_causal=True (flash, half the work), so this term is about 2x torchtitan's")
    if not BAND[0] <= ratio <= BAND[1]:
        notes.insert(0, f"OUTSIDE {BAND[0]}-{BAND[1]}")
    return notes


def _line(row: dict, res: dict, what: str) -> str:
    """One table line: the row's job (``what``: the pinned published layout or fxpipe's default) and its figures."""
    shape = f"{row['local_batch']} x {row['seq_len']}" + (f" (micro-batches of {row['microbatch_size']})"
                                                         if "microbatch_size" in row else "")
    pub_mem = f"{row['published_memory_gib']:g}" if "published_memory_gib" in row else "-"
    head = f"| {row['id']} ({row['model']}, {res['hardware']}) | {what} | {row['devices']} | {shape} | "
    if "error" in res:
        return (head + f"{row['ac']} / {res['ac_planned']} | - | - | - / {pub_mem} | {row['published_tokens_per_s_per_gpu']:,} | "
                f"- | {'; '.join(res['notes'] + ['not planned: ' + res['error']])} |")
    ratio = res["predicted_tokens_per_s_per_gpu"] / row["published_tokens_per_s_per_gpu"]
    notes = res["notes"] + explain(row, res)
    if res.get("tp_split"):
        notes.append(f"tp splits {res['tp_split']} regions")
    if res.get("tp_collectives_s"):
        notes.append(f"tensor-parallel collectives {res['tp_collectives_s'] * 1e3:.1f} ms per micro-batch, not overlapped")
    fit = "" if res.get("fits", True) else " (over 96 GB)"
    return (head + f"{row['ac']} / {res['ac_planned']} | {res['mesh_planned']}, {res['schedule_planned']} | "
            f"{res['predicted_step_s']:.3f} ({res['schedule_s']:.3f}, {res['exposed_sync_s']:.3f}) | "
            f"{res['memory_gib']:.1f}{fit} / {pub_mem} | {row['published_tokens_per_s_per_gpu']:,} | "
            f"{res['predicted_tokens_per_s_per_gpu']:,.0f} ({ratio:.2f}) | {'; '.join(notes)} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", default=[r["id"] for r in ROWS], choices=[r["id"] for r in ROWS])
    ap.add_argument("--hardware-variant", default="achieved", choices=["achieved", "datasheet"],
                    help="achieved efficiencies (what fxpipe predicts with) or the datasheet roofline (the baseline)")
    ap.add_argument("--time-limit", type=float, default=5.0, help="partition search seconds per plan")
    ap.add_argument("--default-all", action="store_true", help="plan fxpipe's default (mesh='auto') for every row, "
                    "not only the tensor-parallel ones")
    ap.add_argument("--no-default", action="store_true", help="plan only the published layouts")
    ap.add_argument("--json", default=None, help="write every row's figures here")
    args = ap.parse_args(argv)
    rows = [r for r in ROWS if r["id"] in args.rows]
    print(f"activation_checkpointing argument in fxpipe.compile: {has_activation_checkpointing()}; "
          f"hardware variant: {args.hardware_variant}\n")
    print("| layout | planned as | GPUs | local batch x seq | AC published / planned | mesh, schedule | predicted step s "
          "(schedule, exposed sync) | memory GiB (fxpipe / published) | published tokens/s/GPU | predicted (ratio) | note |")
    print("|---|---|---:|---|---|---|---|---|---:|---:|---|")
    results = []
    for row in rows:
        res = plan_row(row, args.hardware_variant, args.time_limit)
        entry = {"row": row, "result": res}
        print(_line(row, res, "published, pinned"), flush=True)
        if not args.no_default and (args.default_all or row.get("default")):
            auto = plan_row(row, args.hardware_variant, args.time_limit, default=True)
            entry["default"] = auto
            print(_line(row, auto, f"fxpipe default ({auto.get('plan_s', 0):.0f} s)"), flush=True)
            if "predicted_step_s" in auto and "predicted_step_s" in res:
                print(f"|  | default vs pinned: predicted step {auto['predicted_step_s']:.3f} s vs "
                      f"{res['predicted_step_s']:.3f} s ({res['predicted_step_s'] / auto['predicted_step_s']:.2f}x)"
                      + ("" if res.get("fits", True) else ", the pinned layout not fitting") + " |", flush=True)
        results.append(entry)
    if args.json:
        from fxpipe.io import write_json_atomic

        write_json_atomic(args.json, {"variant": args.hardware_variant, "rows": results}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
