"""``fxpipe schedule PROBLEM.json``: a timed pipeline schedule (DESIGN.md Contract 4).

Reads a ``fxpipe.schedproblem/1`` file (one stage per device, or a placement of several
stages per device with ``num_devices`` / ``device_of_stage``), builds a schedule with a
heuristic or the MILP, validates it against Contract 3 and prints (or writes) a
``fxpipe.schedule/1`` document. The document's ``lower_bound_s`` is the best proven bound:
the combinatorial bound of :mod:`fxpipe.schedule.bounds`, or the MILP's dual bound when
larger. ``--csv`` writes the per-device orders in torch's CSV schedule format (torchtitan's
``pipeline_parallel_schedule_csv``).
"""

from __future__ import annotations

import argparse
import sys

from fxpipe.cli.common import add_command, emit
from fxpipe.errors import InputError
from fxpipe.ir import Schedule, ScheduleProblem, schedule_to_orders, write_json_atomic
from fxpipe.ir.torch_csv import write_torch_csv
from fxpipe.report import chrome_trace, gantt
from fxpipe.schedule.dispatch import METHODS, make_schedule


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``schedule`` sub-command."""
    p = add_command(subparsers, "schedule", run, help="schedule F/B/W/offload/reload ops of a pipeline problem",
                    description="Build a pipeline schedule for a fxpipe.schedproblem/1 file and validate it (Contract 3).")
    p.add_argument("problem", metavar="PROBLEM", help="schedule problem (fxpipe.schedproblem/1 JSON)")
    p.add_argument("--method", choices=METHODS, default="zb-h1",
                   help="schedule generator (default: zb-h1; interleaved-1f1b for looped placements, zb-v / "
                        "dualpipe-v for V placements, greedy / milp for any)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="MILP time limit in seconds (default 60)")
    p.add_argument("--out", metavar="SCHEDULE", help="also write the schedule to this JSON file (atomically)")
    p.add_argument("--gantt", metavar="PNG|SVG", help="write a Gantt chart with per-stage memory curves")
    p.add_argument("--trace", metavar="TRACE.json", help="write a chrome trace (open in Perfetto)")
    p.add_argument("--csv", metavar="OUT.csv",
                   help="write the per-device orders in torch's CSV schedule format (one row per rank; for "
                        "torchtitan's pipeline_parallel_schedule_csv); offload/reload ops are left out with a warning")
    p.add_argument("--csv-split-backward", action="store_true",
                   help="in --csv, write every backward as torch's I (input) and W (weight) instead of a full B "
                        "where W follows its B at once")
    p.add_argument("--json", action="store_true", help="print the fxpipe.schedule/1 document on stdout")


def _text(problem: ScheduleProblem, sched: Schedule) -> str:
    val = sched.value
    gap = (val - sched.lower_bound_s) / val if val > 0 else 0.0
    lines = [
        f"method {sched.method}  status {sched.status}  objective {sched.objective} = {val:.6g}",
        f"makespan {sched.makespan:.6g}  stage_span {sched.stage_span:.6g}  lower bound {sched.lower_bound_s:.6g}"
        f"  gap {100 * gap:.2f}%  time {sched.solver_time_s:.3f} s",
    ]
    if sched.meta.get("bound_method"):
        lines[-1] += f"  (bound: {sched.meta['bound_method']})"

    orders = schedule_to_orders(sched, problem)
    for d, row in enumerate(orders.actions):
        st = problem.stages_of_device(d)
        who = f"stage {st[0]}" if problem.identity_placement else f"device {d} (stages {','.join(map(str, st))})"
        lines.append(f"{who}: " + " ".join(map(str, row)))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fxpipe schedule``."""
    if args.time_limit <= 0:
        raise InputError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    problem = ScheduleProblem.load(args.problem)
    sched = make_schedule(problem, args.method, time_limit_s=args.time_limit, progress=sys.stderr.isatty())
    doc = sched.to_dict()
    if args.out:
        write_json_atomic(args.out, doc)
    if args.gantt or args.trace:
        if args.gantt:
            gantt(problem, sched, args.gantt)
        if args.trace:
            chrome_trace(sched, args.trace, problem)
    if args.csv:
        orders = schedule_to_orders(sched, problem)
        dropped = sum(1 for row in orders.actions for a in row if not a.is_compute)
        if dropped:
            sys.stderr.write(
                f"warning: torch's schedule format has no offload/reload action; {dropped} O/R ops left out of "
                f"{args.csv} (the stashes stay on the device: more memory than planned)\n"
            )
        write_torch_csv(args.csv, orders, fuse_backward=not args.csv_split_backward, offload="drop")
    emit(args, doc, _text(problem, sched))
    return 0
