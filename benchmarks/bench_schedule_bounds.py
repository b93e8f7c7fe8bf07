"""Benchmark: schedule gaps before and after bound probing (issue 13 item 4).

For p = 8, m = 16, F = B = W = 1, offload 0.5, mem_f = 1 (offload_bytes = 1), memory limits
8, 4, 2 stashes per stage (stage-span objective), runs in the same process:

* before: ``fxpipe.schedule.milp.solve(problem, time_limit_s=T, probe_time_s=0,
  search_time_s=0)`` warm-started with the best of the order-first heuristics (every warm-start
  method except ``offload-search``): the big-M MILP with the combinatorial bound as objective
  cut, as it was before issue 13;
* after: ``solve(problem, time_limit_s=T)``: the default warm start (with the 200-policy
  ``offload-search``), a tenth of T for a longer ``offload-search``
  (``fxpipe.schedule.offload_search``), a quarter of T for time-indexed bound probing
  (``fxpipe.schedule.milp.time_indexed.probe_lower_bound``), the rest for the MILP with the
  probe bound as cut.

Prints value, bound, gap and wall time of each, the warm start's value and method, and the
probe's proven value. Target: gap <= 5% within 300 s.

Usage::

    python benchmarks/bench_schedule_bounds.py --time-limit 300            # the issue's setting
    python benchmarks/bench_schedule_bounds.py --time-limit 60 --limits 2   # quicker
    python benchmarks/bench_schedule_bounds.py --after-only --time-limit 300
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxpipe.ir import ScheduleProblem  # noqa: E402
from fxpipe.schedule import heuristics, milp  # noqa: E402
from fxpipe.schedule.milp.warm_start import WARM_METHODS, sequential_schedule  # noqa: E402
from fxpipe.schedule.validate import check_schedule  # noqa: E402


def problem(p: int, m: int, limit: float) -> ScheduleProblem:
    return ScheduleProblem.create(num_stages=p, num_microbatches=m, t_f=1, t_b=1, t_w=1, t_offload=0.5, mem_f=1,
                                  mem_b=-0.5, mem_w=-0.5, mem_limit=limit, name=f"offload-p{p}-m{m}-L{limit:g}")


def order_first_warm_start(prob: ScheduleProblem):
    """The best valid schedule of the warm-start heuristics other than offload-search."""
    best = sequential_schedule(prob)
    for method in WARM_METHODS:
        if method == "offload-search":
            continue
        try:
            sched = heuristics.generate(prob, method)
        except Exception:  # noqa: BLE001 - a heuristic that does not fit is skipped, as in the warm start
            continue
        if not check_schedule(prob, sched.ops) and sched.value < best.value:
            best = sched
    return best


def run(prob: ScheduleProblem, limit_s: float, before: bool) -> dict:
    t0 = time.perf_counter()
    if before:
        res = milp.solve(prob, time_limit_s=limit_s, probe_time_s=0.0, search_time_s=0.0,
                         warm_start=order_first_warm_start(prob))
    else:
        res = milp.solve(prob, time_limit_s=limit_s)
    wall = time.perf_counter() - t0
    probe = res.meta.get("probe") or {}
    return {"value": res.value, "bound": res.lower_bound_s, "gap": res.meta["gap"], "wall": wall,
            "valid": not check_schedule(prob, res.ops), "probe": probe.get("bound_s"),
            "probe_s": probe.get("wall_s"), "method": res.meta.get("bound_method"),
            "warm": (res.meta.get("warm_start") or {}).get("value_s"), "warm_method": (res.meta.get("warm_start") or {}).get("method")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds per solve (default 300)")
    ap.add_argument("--limits", type=float, nargs="+", default=[8.0, 4.0, 2.0], help="memory limits (stashes)")
    ap.add_argument("-p", type=int, default=8)
    ap.add_argument("-m", type=int, default=16)
    ap.add_argument("--after-only", action="store_true", help="skip the runs without probing")
    args = ap.parse_args(argv)
    print(f"p={args.p} m={args.m} F=B=W=1 offload 0.5, stage span; {args.time_limit:g} s per solve "
          f"(after, when >= 60 s: {0.1 * args.time_limit:g} s offload-search, {0.25 * args.time_limit:g} s probing)")
    print(f"{'limit':>6} {'run':>7} {'warm':>6} {'warm from':>15} {'value':>7} {'bound':>7} {'gap%':>7} {'probe LB':>9} "
          f"{'probe s':>8} {'wall s':>7} {'bound from':>20} valid")
    for lim in args.limits:
        prob = problem(args.p, args.m, lim)
        runs = [("after", False)] if args.after_only else [("before", True), ("after", False)]
        for name, before in runs:
            r = run(prob, args.time_limit, before)
            pl = "-" if r["probe"] is None else f"{r['probe']:.4g}"
            ps = "-" if r["probe_s"] is None else f"{r['probe_s']:.1f}"
            print(f"{lim:>6g} {name:>7} {r['warm']:>6.4g} {str(r['warm_method']):>15} {r['value']:>7.4g} {r['bound']:>7.4g} {100 * r['gap']:>7.2f} {pl:>9} {ps:>8} "
                  f"{r['wall']:>7.1f} {str(r['method']):>20} {r['valid']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
