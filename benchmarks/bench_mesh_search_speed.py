"""Plan time of the mesh search (``mesh="auto"``) on large jobs, beside the same search without its speed-ups.

Jobs (issues 28, 29; capture excluded from the plan time):

* ``70b-64``: Llama-3-70B (meta, bf16, SDPA), 64 devices, 128 micro-batches of 4096 tokens, ``h100-sxm``.
  Target: under 30 s.
* ``405b-512``: Llama-3.1-405B, 512 devices, torchtitan's Table 5 job (8 per host, local batch 32 x 8192
  per data-parallel replica; :mod:`bench_published_layouts`, row ``h100-405b-1f1b``). Target: under 60 s.

Each job is planned twice in the same run: as fxpipe plans it, and as the search planned before the prune
after partitioning (candidates in bound order, every candidate that passes its partition-free bound scheduled:
:func:`fxpipe.mesh.search.planning_key_s` replaced by the bound and the planner's
:func:`~fxpipe.schedule.bounds.recompute_lower_bound` and ``round_trip_lower_bound`` by ``-inf``, and
:func:`~fxpipe.schedule.auto.auto_schedule`
run without the best so far as its ``beat_s``), one candidate at a time in both
(``FXPIPE_SEARCH_WORKERS=1`` unless set). It prints the wall and CPU seconds of the search (the machine may be
shared: the load average is printed too), the chosen mesh and its predicted step, which must be equal.

    python benchmarks/bench_mesh_search_speed.py [--jobs 70b-64 405b-512] [--no-baseline]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _job(name: str):
    import torch

    from fxpipe.models import build_hf_model

    if name == "70b-64":
        model, args, kwargs = build_hf_model("llama-3-70b", {"seq_len": 4096, "attn_implementation": "sdpa"},
                                             device="meta", dtype=torch.bfloat16)
        return model, args, kwargs, dict(devices=64, microbatches=128, hardware="h100-sxm")
    from bench_published_layouts import ROWS, hardware_of, job_of

    row = next(r for r in ROWS if r["id"] == "h100-405b-1f1b")
    microbatches, mbs, _ = job_of(row)
    model, args, kwargs = build_hf_model(row["model"], {"seq_len": row["seq_len"], "batch_size": mbs,
                                                        "attn_implementation": "sdpa"}, device="meta",
                                         dtype=torch.bfloat16)
    return model, args, kwargs, dict(devices=row["devices"], microbatches=microbatches,
                                     hardware=hardware_of(row["hardware"], "achieved"))


def _plan(model, args, kwargs, common: dict, baseline: bool) -> str:
    import fxpipe
    import fxpipe.mesh.search as ms
    import fxpipe.planner as planner

    saved = ms.planning_key_s, planner.recompute_lower_bound, planner.auto_schedule, planner.round_trip_lower_bound
    if baseline:
        ms.planning_key_s = lambda lower_bound_s, mesh, microbatches: lower_bound_s
        planner.recompute_lower_bound = planner.round_trip_lower_bound = lambda problem: -math.inf
        planner.auto_schedule = lambda problem, beat_s=None, **kw: saved[2](problem, **kw)
    t0, c0, load = time.perf_counter(), _cpu_s(), os.getloadavg()[0]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = fxpipe.compile(model, args, kwargs, mesh="auto", time_limit_s=5, schedule_time_limit_s=0, **common)
    finally:
        ms.planning_key_s, planner.recompute_lower_bound, planner.auto_schedule, planner.round_trip_lower_bound = saved
    capture = sum(plan.timings_s.get(k, 0.0) for k in ("capture", "cost", "export"))
    wall, cpu = time.perf_counter() - t0 - capture, _cpu_s() - c0
    rows = plan.options.get("mesh_search") or []
    pruned = sum(1 for r in rows if str(r.get("skipped", "")).startswith("pruned after partitioning"))
    pruned_sched = sum(1 for r in rows if str(r.get("skipped", "")).startswith("pruned while scheduling"))
    planned = sum(1 for r in rows if "predicted_step_s" in r)
    mesh = ", ".join(f"{k}={v}" for k, v in plan.mesh.items() if k != "order" and v != 1)
    units = ", FSDP2 unit per block" if plan.memory.block_units else ""
    return (f"{wall:7.1f} s wall | {cpu:7.1f} s CPU (with capture) | load {load:.1f} | {mesh}{units} | "
            f"predicted {plan.predicted_step_s:.4f} s | {planned} planned, {pruned} pruned after partitioning, "
            f"{pruned_sched} while scheduling")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", nargs="+", default=["70b-64"], choices=["70b-64", "405b-512"])
    ap.add_argument("--no-baseline", action="store_true", help="plan only as fxpipe plans now")
    a = ap.parse_args(argv)
    os.environ.setdefault("FXPIPE_SEARCH_WORKERS", "1")
    for name in a.jobs:
        model, args, kwargs, common = _job(name)
        print(f"{name:9s} fxpipe    | {_plan(model, args, kwargs, common, baseline=False)}", flush=True)
        if not a.no_baseline:
            print(f"{name:9s} baseline  | {_plan(model, args, kwargs, common, baseline=True)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
