"""Optimizer state on the host (``MemoryModel(offload_optimizer=...)``): the host step's cost model against
torch's CPU AdamW on this machine, and what the default mesh search plans for Llama-3-70B on 16 H100s.

1. ``--measure`` (default on): the cost model (:func:`fxpipe.mesh.optimizer_host_step_s`) streams
   ``2 * (weight + optimizer) + grad`` bytes per parameter at the host memory bandwidth. Here the
   host is this CPU: its memory bandwidth is measured with STREAM's triad (``c = a + 3 b`` over
   three 400 MB fp32 tensors at the default size: two reads and one write), then ``torch.optim.AdamW`` (``foreach`` and, where torch has it on CPU, ``fused``)
   steps ``--params`` parameters in fp32 (policy ``fp32-adam``: 4 + 4 + 8 bytes, 28 streamed) and
   bf16 (``bf16-adam``: 2 + 2 + 4, 14 streamed). Printed: measured step, the model's prediction at the
   measured bandwidth, and their ratio (what fraction of the roofline the optimizer reaches).
2. ``--plan``: ``fxpipe.compile`` of Llama-3-70B (meta, bf16, SDPA, 4096 tokens, ``h100-sxm``) on
   16 devices with 32 micro-batches under the default mesh search, with the optimizer's place left
   to the search (the default) and with ``offload_optimizer=False`` (before this option: an error);
   the chosen mesh, predicted step, host step and planning time.

    python benchmarks/bench_optimizer_offload.py [--params 50e6] [--repeats 5] [--plan] [--no-measure]
"""

from __future__ import annotations

import argparse
import time


def _best_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(n: int, repeats: int) -> None:
    import torch

    from fxpipe.memory import MemoryModel
    from fxpipe.mesh import optimizer_host_step_s

    a, b, c = (torch.ones(n * 2, dtype=torch.float32) for _ in range(3))
    triad_s = _best_s(lambda: torch.add(a, b, alpha=3.0, out=c), repeats)  # STREAM's triad: 2 reads + 1 write
    bandwidth = 3 * a.numel() * 4 / triad_s
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; host memory bandwidth (STREAM triad "
          f"c = a + 3 b, best of {repeats}): {bandwidth / 1e9:.2f} GB/s")
    host = {"host_bytes_per_s": float("inf"), "host_memory_bytes_per_s": bandwidth, "host_memory_bytes": 0.0}
    print("| dtype (policy) | AdamW | parameters | measured step s | model s | measured / model |")
    print("|---|---|---|---|---|---|")
    for dtype, policy in ((torch.float32, "fp32-adam"), (torch.bfloat16, "bf16-adam")):
        model_s = optimizer_host_step_s(n, MemoryModel(policy=policy, offload_optimizer=True), host)
        for kind in ("foreach", "fused"):
            p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
            p.grad = torch.full((n,), 1e-3, dtype=dtype)
            try:
                opt = torch.optim.AdamW([p], lr=1e-4, **{kind: True})
                step_s = _best_s(opt.step, repeats)
            except (RuntimeError, TypeError) as exc:  # fused AdamW on CPU is missing in some builds / dtypes
                print(f"| {dtype} ({policy}) | {kind} | {n:.3g} | - | {model_s:.4f} | not run: {str(exc)[:60]} |")
                continue
            print(f"| {dtype} ({policy}) | {kind} | {n:.3g} | {step_s:.4f} | {model_s:.4f} | {step_s / model_s:.2f} |",
                  flush=True)


def plan_70b() -> None:
    import torch

    import fxpipe
    from fxpipe.errors import FxpipeError
    from fxpipe.memory import MemoryModel
    from fxpipe.mesh import format_mesh
    from fxpipe.models import build_hf_model

    model, a, k = build_hf_model("llama-3-70b", {"seq_len": 4096, "attn_implementation": "sdpa"}, device="meta",
                                 dtype=torch.bfloat16)
    print("| optimizer | mesh | predicted step s | schedule s | host step s | plan s | note |")
    print("|---|---|---|---|---|---|---|")
    for label, memory in (("search decides (default)", None), ("on the device", MemoryModel(offload_optimizer=False))):
        t0 = time.perf_counter()
        try:
            plan = fxpipe.compile(model, a, k, devices=16, microbatches=32, memory=memory, time_limit_s=5.0,
                                  schedule_time_limit_s=0)
        except FxpipeError as exc:
            print(f"| {label} | - | - | - | - | {time.perf_counter() - t0:.0f} | {str(exc).splitlines()[0][:120]} |")
            continue
        rows = plan.options.get("mesh_search") or []
        where = "host" if plan.memory.offload_optimizer else "device"
        print(f"| {label} | {format_mesh(plan.mesh)}, optimizer on the {where} | {plan.predicted_step_s:.3f} | "
              f"{plan.schedule.value:.3f} | {plan.optimizer_host_step_s:.3f} | {time.perf_counter() - t0:.0f} | "
              f"{len(rows)} candidates, {sum('predicted_step_s' in r for r in rows)} planned; "
              f"peak {max(d.total_bytes for d in plan.device_stats()) / 2**30:.1f} GiB of "
              f"{plan.memory.usable_bytes / 2**30:.1f} GiB usable |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6, help="parameters the optimizer steps (default 50e6)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--plan", action="store_true", help="plan Llama-3-70B on 16 x h100-sxm (minutes)")
    args = ap.parse_args()
    if args.measure:
        measure(int(args.params), args.repeats)
    if args.plan:
        plan_70b()


if __name__ == "__main__":
    main()
