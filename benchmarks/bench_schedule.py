"""Benchmark: MILP pipeline schedules against the heuristics, with proven bounds.

Prints three tables (all values are the problem's objective, stage span by default):

(a) the Zero Bubble instances (toy1, toy2, profiled-4, unit-32): fxpipe's MILP value, its
    lower bound and gap next to the Zero Bubble greedy heuristic measured in the same run;
(b) a memory-limited offload case (p=4, m=16, F=B=W=1, offload 0.5, limit 2 per stage)
    where 1F1B does not fit: MILP against PipeOffload and AdaOffload;
(c) p in {4, 8}, m in {8, 16, 32}, memory limits from "1F1B fits" (p stashes) down to
    "only offloading keeps the pipeline busy" (2 stashes): GPipe, 1F1B, ZB-H1, ZB-H2,
    PipeOffload, AdaOffload and the MILP (gap, time);
(d) memory-limited without fast offload (p=4, m=8, F=B=W=1; offload time 2 = 2F, or no
    offloadable bytes; limits p and p/2 stashes): where the memory-aware combinatorial
    bound (fxpipe.schedule.bounds, warm-up/drain bubbles) exceeds the memory-blind one.

Tables (a), (c) and (d) print the memory-blind round-trip bound ("old LB") next to the
combinatorial bound the MILP now starts from ("comb LB", also an objective cut in the
model); "bound" is the reported lower bound (max of SCIP's dual bound and comb LB).

Targets (from the issue): (a)/(b) MILP valid and no longer than the baselines, with a bound;
p=4, m=8 proved optimal within 60 s; p=8, m=16 within 5% of its bound within 300 s.

Usage::

    python benchmarks/bench_schedule.py --quick          # short limits, a subset of (c)
    python benchmarks/bench_schedule.py --time-limit 60 --big-time-limit 300
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxpipe.errors import FxpipeError  # noqa: E402
from fxpipe.ir import ScheduleProblem  # noqa: E402
from fxpipe.schedule import heuristics, milp  # noqa: E402
from fxpipe.schedule.bounds import combinatorial_lower_bound, round_trip_lower_bound  # noqa: E402
from fxpipe.schedule.validate import check_schedule  # noqa: E402

BASELINES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "pipeoffload", "adaoffload")


def zb_instances() -> list[tuple[str, ScheduleProblem, float]]:
    """Zero Bubble's instances with the greedy stage span quoted in the issue."""
    toy = dict(num_stages=4, num_microbatches=12, t_f=5, t_b=6, t_w=4, t_comm=0, mem_f=2, mem_b=-1, mem_w=-1,
               offload_bytes=0)
    return [
        ("toy1", ScheduleProblem.create(**toy, mem_limit=10, name="toy1"), 193.0),
        ("toy2", ScheduleProblem.create(**toy, mem_limit=14, name="toy2"), 183.0),
        ("profiled-4", ScheduleProblem.create(num_stages=4, num_microbatches=12, t_f=5478, t_b=5806, t_w=3534,
                                              t_comm=200, mem_f=2, mem_b=-1, mem_w=-1, offload_bytes=0,
                                              mem_limit=32, name="profiled-4"), 178898.0),
        ("unit-32", ScheduleProblem.create(num_stages=32, num_microbatches=16, t_f=1, t_b=1, t_w=1, mem_f=2,
                                           mem_b=-1, mem_w=-1, offload_bytes=0, mem_limit=64, name="unit-32"), 95.0),
    ]


def offload_case(p: int = 4, m: int = 16, limit: float = 2.0) -> ScheduleProblem:
    return ScheduleProblem.create(num_stages=p, num_microbatches=m, t_f=1, t_b=1, t_w=1, t_offload=0.5, mem_f=1,
                                  mem_b=-0.5, mem_w=-0.5, mem_limit=limit, name=f"offload-p{p}-m{m}-L{limit:g}")


def baseline(problem: ScheduleProblem, method: str) -> float:
    """Objective of a heuristic, or nan if it does not fit / is invalid."""
    try:
        s = heuristics.generate(problem, method)
    except FxpipeError:
        return math.nan
    if check_schedule(problem, s.ops):
        return math.nan
    return s.value


def run_milp(problem: ScheduleProblem, limit_s: float) -> dict:
    t0 = time.perf_counter()
    res = milp.solve(problem, time_limit_s=limit_s)
    wall = time.perf_counter() - t0
    errs = check_schedule(problem, res.ops)
    return {"value": res.value, "bound": res.lower_bound_s, "old_lb": round_trip_lower_bound(problem),
            "comb_lb": combinatorial_lower_bound(problem), "dual": res.meta["dual"], "gap": res.meta["gap"],
            "status": res.status,
            "valid": not errs, "wall_s": wall, "nodes": res.meta["nodes"], "warm": res.meta["warm_start"]["method"],
            "warm_value": res.meta["warm_start"]["value_s"],
            "xf": res.meta.get("extract_failures", 0)}


def fmt(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.6g}"


def table_a(limit_s: float) -> None:
    print(f"\n(a) Zero Bubble instances, MILP time limit {limit_s:g} s")
    print(f"{'instance':<12}{'greedy':>10}{'(issue)':>10}{'old LB':>10}{'comb LB':>10}{'milp':>10}{'bound':>10}{'gap%':>8}"
          f"{'status':>11}{'valid':>7}{'wall s':>8}")
    for name, p, quoted in zb_instances():
        greedy = baseline(p, "greedy")
        r = run_milp(p, limit_s)
        ok = r["valid"] and r["value"] <= greedy + 1e-9
        print(f"{name:<12}{fmt(greedy):>10}{fmt(quoted):>10}{fmt(r['old_lb']):>10}{fmt(r['comb_lb']):>10}"
              f"{fmt(r['value']):>10}{fmt(r['bound']):>10}"
              f"{100 * r['gap']:>8.2f}{r['status']:>11}{str(ok):>7}{r['wall_s']:>8.1f}", flush=True)


def table_b(limit_s: float) -> None:
    p = offload_case()
    print(f"\n(b) offload case p=4 m=16 F=B=W=1 offload 0.5 limit 2, MILP time limit {limit_s:g} s")
    vals = {m: baseline(p, m) for m in ("1f1b", "zb-h1", "pipeoffload", "adaoffload")}
    r = run_milp(p, limit_s)
    print("  " + "  ".join(f"{k}={fmt(v)}" for k, v in vals.items()))
    print(f"  old LB={fmt(r['old_lb'])} comb LB={fmt(r['comb_lb'])} milp={fmt(r['value'])} bound={fmt(r['bound'])} "
          f"gap={100 * r['gap']:.2f}% status={r['status']} "
          f"valid={r['valid']} nodes={r['nodes']} wall={r['wall_s']:.1f}s (warm start {r['warm']} {fmt(r['warm_value'])})",
          flush=True)


def table_c(quick: bool, limit_s: float, big_limit_s: float, sizes=None) -> None:
    if sizes is None:
        sizes = [(4, 8), (4, 16)] if quick else [(4, 8), (4, 16), (4, 32), (8, 8), (8, 16), (8, 32)]
    print(f"\n(c) grid, F=B=W=1, offload 0.5, mem_f=1; MILP limit {limit_s:g} s ({big_limit_s:g} s for p=8, m=16)")
    head = "".join(f"{b:>12}" for b in BASELINES)
    print(f"{'p':>3}{'m':>4}{'limit':>7}{head}{'old LB':>8}{'comb LB':>8}{'milp':>9}{'bound':>9}{'gap%':>7}{'status':>11}"
          f"{'wall s':>8}{'xfail':>6}")
    for p, m in sizes:
        limits = sorted({float(p), max(2.0, p / 2), 2.0}, reverse=True)
        for lim in limits:
            prob = offload_case(p, m, lim)
            base = [baseline(prob, b) for b in BASELINES]
            t = big_limit_s if (p, m) == (8, 16) else limit_s
            r = run_milp(prob, t)
            vals = "".join(f"{fmt(v):>12}" for v in base)
            flag = "" if r["valid"] else " INVALID"
            print(f"{p:>3}{m:>4}{lim:>7g}{vals}{fmt(r['old_lb']):>8}{fmt(r['comb_lb']):>8}{fmt(r['value']):>9}"
                  f"{fmt(r['bound']):>9}{100 * r['gap']:>7.2f}"
                  f"{r['status']:>11}{r['wall_s']:>8.1f}{r['xf']:>6}{flag}", flush=True)


def table_d(limit_s: float, sizes=None) -> None:
    sizes = sizes or [(4, 8)]
    print(f"\n(d) memory-limited, slow or no offload, F=B=W=1, mem_f=1; MILP limit {limit_s:g} s")
    base_names = ("1f1b", "zb-h1", "pipeoffload", "adaoffload")
    head = "".join(f"{b:>12}" for b in base_names)
    print(f"{'p':>3}{'m':>4}{'limit':>7}{'offload':>9}{head}{'old LB':>8}{'comb LB':>8}{'milp':>9}{'bound':>9}{'gap%':>7}"
          f"{'status':>11}{'wall s':>8}")
    for p, m in sizes:
        for lim in sorted({float(p), max(2.0, p / 2)}, reverse=True):
            for label, kw in (("t=2", {"t_offload": 2.0}), ("none", {"offload_bytes": 0.0})):
                prob = ScheduleProblem.create(num_stages=p, num_microbatches=m, t_f=1, t_b=1, t_w=1, mem_f=1,
                                              mem_b=-0.5, mem_w=-0.5, mem_limit=lim, name=f"slow-p{p}-m{m}-L{lim:g}-{label}",
                                              **kw)
                base = "".join(f"{fmt(baseline(prob, b)):>12}" for b in base_names)
                r = run_milp(prob, limit_s)
                flag = "" if r["valid"] else " INVALID"
                print(f"{p:>3}{m:>4}{lim:>7g}{label:>9}{base}{fmt(r['old_lb']):>8}{fmt(r['comb_lb']):>8}"
                      f"{fmt(r['value']):>9}{fmt(r['bound']):>9}{100 * r['gap']:>7.2f}{r['status']:>11}"
                      f"{r['wall_s']:>8.1f}{flag}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short limits and a subset of table (c)")
    ap.add_argument("--time-limit", type=float, default=None, help="MILP limit per instance (s)")
    ap.add_argument("--big-time-limit", type=float, default=None, help="MILP limit for p=8, m=16 (s)")
    ap.add_argument("--tables", default="abcd", help="which tables to run, e.g. 'ab'")
    ap.add_argument("--sizes", default=None, help="table (c) sizes as PxM list, e.g. '4x8,8x16'")
    args = ap.parse_args(argv)
    limit = args.time_limit if args.time_limit is not None else (20.0 if args.quick else 60.0)
    big = args.big_time_limit if args.big_time_limit is not None else (limit if args.quick else 300.0)
    print(f"fxpipe schedule benchmark (quick={args.quick}, limit {limit:g} s, big {big:g} s, 1 SCIP thread)")
    if "a" in args.tables:
        table_a(limit)
    if "b" in args.tables:
        table_b(limit)
    if "c" in args.tables:
        sizes = None
        if args.sizes:
            sizes = [tuple(int(x) for x in item.split("x")) for item in args.sizes.split(",")]
        table_c(args.quick, limit, big, sizes)
    if "d" in args.tables:
        table_d(limit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
