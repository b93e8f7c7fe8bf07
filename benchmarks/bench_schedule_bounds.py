"""Benchmark: schedule gaps before and after bound probing (issue 13 item 4).

For p = 8, m = 16, F = B = W = 1, offload 0.5, mem_f = 1 (offload_bytes = 1), memory limits
8, 4, 2 stashes per stage (stage-span objective), runs in the same process:

* before: ``fxpipe.schedule.milp.solve(problem, time_limit_s=T, probe_time_s=0)``: the big-M
  MILP with the combinatorial bound as objective cut;
* after: ``solve(problem, time_limit_s=T)``: a quarter of T for time-indexed bound probing
  (``fxpipe.schedule.milp.time_indexed.probe_lower_bound``), the rest for the MILP with the
  probe bound as cut.

Prints value, bound, gap and wall time of each, and the probe's proven value. Target: gap
<= 5% within 300 s.

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
from fxpipe.schedule import milp  # noqa: E402
from fxpipe.schedule.validate import check_schedule  # noqa: E402


def problem(p: int, m: int, limit: float) -> ScheduleProblem:
    return ScheduleProblem.create(num_stages=p, num_microbatches=m, t_f=1, t_b=1, t_w=1, t_offload=0.5, mem_f=1,
                                  mem_b=-0.5, mem_w=-0.5, mem_limit=limit, name=f"offload-p{p}-m{m}-L{limit:g}")


def run(prob: ScheduleProblem, limit_s: float, probe_time_s: float | None) -> dict:
    t0 = time.perf_counter()
    res = milp.solve(prob, time_limit_s=limit_s, probe_time_s=probe_time_s)
    wall = time.perf_counter() - t0
    probe = res.meta.get("probe") or {}
    return {"value": res.value, "bound": res.lower_bound_s, "gap": res.meta["gap"], "wall": wall,
            "valid": not check_schedule(prob, res.ops), "probe": probe.get("bound_s"),
            "probe_s": probe.get("wall_s"), "method": res.meta.get("bound_method")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds per solve (default 300)")
    ap.add_argument("--limits", type=float, nargs="+", default=[8.0, 4.0, 2.0], help="memory limits (stashes)")
    ap.add_argument("-p", type=int, default=8)
    ap.add_argument("-m", type=int, default=16)
    ap.add_argument("--after-only", action="store_true", help="skip the runs without probing")
    args = ap.parse_args(argv)
    print(f"p={args.p} m={args.m} F=B=W=1 offload 0.5, stage span; {args.time_limit:g} s per solve "
          f"(after: {0.25 * args.time_limit:g} s of it probing when >= 60 s)")
    print(f"{'limit':>6} {'run':>7} {'value':>7} {'bound':>7} {'gap%':>7} {'probe LB':>9} {'probe s':>8} "
          f"{'wall s':>7} {'bound from':>20} valid")
    for lim in args.limits:
        prob = problem(args.p, args.m, lim)
        runs = [("after", None)] if args.after_only else [("before", 0.0), ("after", None)]
        for name, pt in runs:
            r = run(prob, args.time_limit, pt)
            pl = "-" if r["probe"] is None else f"{r['probe']:.4g}"
            ps = "-" if r["probe_s"] is None else f"{r['probe_s']:.1f}"
            print(f"{lim:>6g} {name:>7} {r['value']:>7.4g} {r['bound']:>7.4g} {100 * r['gap']:>7.2f} {pl:>9} {ps:>8} "
                  f"{r['wall']:>7.1f} {str(r['method']):>20} {r['valid']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
