"""Activation checkpointing policies side by side (issue 28): predicted step, memory peak and plan time.

For each job and each ``activation_checkpointing`` value (``none``, ``selective``, ``full``, ``auto``,
the default, where the planner picks per stage, ``budget`` included), in one process, planning only
(meta models, bf16, SDPA, roofline costs, schedule ``auto`` with heuristics only):

* ``8b-fsdp8``: torchtitan's Table 1 layout (December 2024 H100 benchmark): Llama-3.1-8B, local
  batch 2 x 8192 tokens, 8 micro-batches, ``mesh={"pp": 1, "dp_shard": 8}``, ``h100-sxm`` with
  ``memory_bytes=96e9`` (the 96 GB H100s it ran on). torchtitan measured 82.4 GiB per GPU with
  selective AC; the device's predicted total (its static state, the activation peak of the
  schedule, the 10 % reserved) is printed beside it, once per FSDP2 unit (``--fsdp-units``:
  ``stage``, one unit per pipeline stage, ZeRO-1's memory during the step; ``block``, one unit per
  transformer block and the root, torchtitan's wrapping, ZeRO-3's memory plus two blocks and the
  root unsharded, :mod:`fxpipe.memory.fsdp`). Then the same job with the default mesh
  (``mesh="auto"``, the search, whole-stage units), whose predicted step must be no worse than the
  pinned FSDP-8 layout's.
* ``70b-fsdp64``: Llama-3-70B, 1 x 8192 tokens, ``{"dp_shard": 64}`` on ``a100-80gb`` with
  ``"full"`` (torchtitan's 64-A100 layout; it trains at 331 tokens/s per GPU, 24.7 s per step of
  8192 tokens per GPU): with whole-stage units the stage's parameters and gradients stay unsharded
  for the whole step, so the static state alone does not fit (the error says it); with per-block
  units it plans and fits, its predicted step printed beside torchtitan's.
* ``70b-64``: Llama-3-70B, 64 devices, 128 micro-batches of 4096 tokens, ``h100-sxm``, the default
  mesh (the search), beside the mesh the search chose before issue 28 (``pp=32 x dp_shard=2``, pipeline
  rank outermost) pinned and planned in the same run: the predicted step and the plan time (wall without
  the capture, CPU seconds of the whole call), against 30 s.
* ``llama-tiny``: the matrix's tiny Llama on 2 devices with an activation limit under one
  micro-batch's stash (nothing fits without checkpointing).

Plan time is ``fxpipe.compile``'s wall time without the capture (``plan.timings_s``: partition and
schedule) and the process CPU time of the whole call; the machine is shared (2 cores), so CPU time is
the steadier figure.

    python benchmarks/bench_checkpointing.py [--jobs 8b-fsdp8 70b-fsdp64 70b-64 llama-tiny]
        [--policies none selective full auto] [--time-limit 5] [--fsdp-units stage block]
"""

from __future__ import annotations

import argparse
import time
import warnings

TORCHTITAN_8B_GIB = 82.4
#: torchtitan's 70B on 64 A100 80GB, FSDP, full AC: 331 tokens/s per GPU (its published A100 run), so one step of
#: 1 x 8192 tokens per GPU takes 8192 / 331 s.
TORCHTITAN_70B_STEP_S = 8192 / 331
FSDP_UNITS = ("stage", "block")
#: The mesh the search chose for the 70b-64 job before issue 28 (README's mesh-search table, 2026-11-26).
BEFORE_70B_64_MESH = {"pp": 32, "dp_shard": 2, "order": ["pp", "dp_replicate", "dp_shard"]}
POLICIES = ("none", "selective", "full", "auto")


def _row(job: str, policy: str, mesh: str, plan=None, wall: float = 0.0, cpu: float = 0.0, note: str = "") -> str:
    if plan is None:
        return f"| {job} | {policy} | {mesh} | - | - | - | {wall:.1f} / {cpu:.1f} | {note} |"
    peak = max(d.memory_bytes for d in plan.device_table) / 2**30
    chosen = ", ".join(sorted(set(plan.problem.checkpoint)))
    from fxpipe.mesh import format_mesh

    units = ", FSDP2 unit per block" if plan.memory.block_units else ""
    return (f"| {job} | {policy} | {format_mesh(plan.mesh)}{units} | {plan.predicted_step_s:.3f} | {peak:.1f} | {chosen} | "
            f"{wall:.1f} / {cpu:.1f} | {note} |")


def _compile(model, a, k, **kw):
    import fxpipe

    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = fxpipe.compile(model, a, k, **kw)
        except fxpipe.errors.FxpipeError as exc:
            return None, time.perf_counter() - t0, time.process_time() - c0, str(exc).splitlines()[0][:160]
    capture = sum(plan.timings_s.get(x, 0.0) for x in ("capture", "cost", "export"))
    return plan, time.perf_counter() - t0 - capture, time.process_time() - c0, f"capture {capture:.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", nargs="+", default=["llama-tiny", "8b-fsdp8", "70b-fsdp64", "70b-64"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--time-limit", type=float, default=5.0, help="partition search seconds per pipeline")
    ap.add_argument("--fsdp-units", nargs="+", default=list(FSDP_UNITS), choices=FSDP_UNITS,
                    help="FSDP2 units of the pinned FSDP layouts (MemoryModel.fsdp_units)")
    args = ap.parse_args()

    import torch

    from fxpipe.memory import MemoryModel
    from fxpipe.models import build_hf_model

    common = dict(time_limit_s=args.time_limit, schedule_time_limit_s=0)
    print("| job | activation_checkpointing | mesh | predicted step s | peak GiB (device total) | options chosen "
          "| plan s (wall without capture / CPU) | note |")
    print("|---|---|---|---|---|---|---|---|")
    if "llama-tiny" in args.jobs:
        from fxpipe.schedule.device_greedy import min_device_memory
        from fxpipe.testing import zoo

        model, a, k = zoo.get("llama").one_microbatch()
        base = dict(devices=2, microbatches=8, mesh="pipeline", **common)
        free, *_ = _compile(model, a, k, activation_checkpointing="none", **base)
        limit = 0.9 * float(min_device_memory(free.problem, offload=False).max())
        for policy in args.policies:
            plan, wall, cpu, note = _compile(model, a, k, activation_checkpointing=policy, mem_limit_bytes=limit, **base)
            print(_row("llama-tiny, 2 devices, activations < 1 micro-batch", policy, "pp=2", plan, wall, cpu, note),
                  flush=True)
    if "8b-fsdp8" in args.jobs:
        model, a, k = build_hf_model("llama-3-8b", {"seq_len": 8192, "batch_size": 2, "attn_implementation": "sdpa"},
                                     device="meta", dtype=torch.bfloat16)
        job = dict(devices=8, microbatches=8, hardware="h100-sxm", memory_bytes=96e9, **common)
        pinned = {}
        for units in args.fsdp_units:
            for policy in args.policies:
                plan, wall, cpu, note = _compile(model, a, k, mesh={"pp": 1, "dp_shard": 8},
                                                 activation_checkpointing=policy, memory=MemoryModel(fsdp_units=units),
                                                 **job)
                if plan is not None:
                    if units == "stage":
                        pinned[policy] = plan.predicted_step_s
                    peak = max(d.memory_bytes for d in plan.device_table) / 2**30
                    note += (f"; peak {peak:.1f} GiB vs torchtitan's {TORCHTITAN_8B_GIB} GiB "
                             f"({peak / TORCHTITAN_8B_GIB - 1:+.0%})")
                print(_row(f"8B 2x8192, FSDP 8 pinned, {units} units", policy, "dp_shard=8", plan, wall, cpu, note),
                      flush=True)
        for policy in args.policies:
            plan, wall, cpu, note = _compile(model, a, k, mesh="auto", activation_checkpointing=policy, **job)
            if plan is not None and policy in pinned:
                ref = pinned[policy]
                note += (f"; vs FSDP-8 pinned with {policy!r} {ref:.3f} s: "
                         f"{'no worse' if plan.predicted_step_s <= ref * (1 + 1e-9) else 'WORSE'}")
            print(_row("8B 2x8192, default mesh", policy, "search", plan, wall, cpu, note), flush=True)
    if "70b-fsdp64" in args.jobs:
        model, a, k = build_hf_model("llama-3-70b", {"seq_len": 8192, "batch_size": 1, "attn_implementation": "sdpa"},
                                     device="meta", dtype=torch.bfloat16)
        for units in args.fsdp_units:
            plan, wall, cpu, note = _compile(model, a, k, devices=64, microbatches=64, mesh={"dp_shard": 64},
                                             hardware="a100-80gb", activation_checkpointing="full",
                                             memory=MemoryModel(fsdp_units=units), **common)
            if plan is not None:
                note += (f"; step vs torchtitan's {TORCHTITAN_70B_STEP_S:.1f} s (331 tokens/s/GPU): "
                         f"{plan.predicted_step_s / TORCHTITAN_70B_STEP_S - 1:+.0%}")
            print(_row(f"70B 1x8192, FSDP 64 pinned, a100-80gb, {units} units", "full", "dp_shard=64", plan, wall, cpu,
                       note), flush=True)
    if "70b-64" in args.jobs:
        model, a, k = build_hf_model("llama-3-70b", {"seq_len": 4096, "attn_implementation": "sdpa"}, device="meta",
                                     dtype=torch.bfloat16)
        for policy in args.policies:
            before, *_ = _compile(model, a, k, devices=64, microbatches=128, mesh=BEFORE_70B_64_MESH,
                                  activation_checkpointing=policy, **common)
            plan, wall, cpu, note = _compile(model, a, k, devices=64, microbatches=128, mesh="auto",
                                             activation_checkpointing=policy, **common)
            if plan is not None:
                note += f"; order {'/'.join(plan.rank_order)}"
                if before is not None:
                    note += (f"; the mesh chosen before issue 28 (pp=32 x dp_shard=2, pp outermost) now: "
                             f"{before.predicted_step_s:.3f} s ({plan.predicted_step_s / before.predicted_step_s - 1:+.1%})")
            print(_row("70B 4096, 64 devices, 128 micro-batches", policy, "search", plan, wall, cpu, note), flush=True)


if __name__ == "__main__":
    main()
