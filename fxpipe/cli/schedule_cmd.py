"""``fxpipe schedule PROBLEM.json``: a timed pipeline schedule (DESIGN.md Contract 4).

Reads a ``fxpipe.schedproblem/1`` file, builds a schedule with a heuristic or the MILP,
validates it against Contract 3 and prints (or writes) a ``fxpipe.schedule/1`` document.
The document's ``lower_bound_s`` is the best proven bound: the combinatorial bound of
:mod:`fxpipe.schedule.bounds`, or the MILP's dual bound when larger.
"""

from __future__ import annotations

import argparse
import sys

from fxpipe.cli.common import emit
from fxpipe.errors import InputError
from fxpipe.ir import Schedule, ScheduleProblem, write_json_atomic

def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``schedule`` sub-command."""
    from fxpipe.schedule.dispatch import METHODS

    p = subparsers.add_parser(
        "schedule",
        help="schedule F/B/W/offload/reload ops of a pipeline problem",
        description="Build a pipeline schedule for a fxpipe.schedproblem/1 file and validate it (Contract 3).",
    )
    p.add_argument("problem", metavar="PROBLEM", help="schedule problem (fxpipe.schedproblem/1 JSON)")
    p.add_argument("--method", choices=METHODS, default="zb-h1", help="schedule generator (default: zb-h1)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="MILP time limit in seconds (default 60)")
    p.add_argument("--out", metavar="SCHEDULE", help="also write the schedule to this JSON file (atomically)")
    p.add_argument("--gantt", metavar="PNG|SVG", help="write a Gantt chart with per-stage memory curves")
    p.add_argument("--trace", metavar="TRACE.json", help="write a chrome trace (open in Perfetto)")
    p.add_argument("--json", action="store_true", help="print the fxpipe.schedule/1 document on stdout")
    p.set_defaults(func=run)


def _text(problem: ScheduleProblem, sched: Schedule) -> str:
    val = sched.value
    gap = (val - sched.lower_bound_s) / val if val > 0 else 0.0
    lines = [
        f"method {sched.method}  status {sched.status}  objective {sched.objective} = {val:.6g}",
        f"makespan {sched.makespan:.6g}  stage_span {sched.stage_span:.6g}  lower bound {sched.lower_bound_s:.6g}"
        f"  gap {100 * gap:.2f}%  time {sched.solver_time_s:.3f} s",
    ]
    for s in range(problem.num_stages):
        acts = " ".join(str(o) for o in sched.ops_of_stage(s))
        lines.append(f"stage {s}: {acts}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fxpipe schedule``."""
    from fxpipe.schedule.dispatch import make_schedule

    if args.time_limit <= 0:
        raise InputError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    problem = ScheduleProblem.load(args.problem)
    sched = make_schedule(problem, args.method, time_limit_s=args.time_limit, progress=sys.stderr.isatty())
    doc = sched.to_dict()
    if args.out:
        write_json_atomic(args.out, doc)
    if args.gantt or args.trace:
        from fxpipe.schedule.plot import chrome_trace, gantt

        if args.gantt:
            gantt(problem, sched, args.gantt)
        if args.trace:
            chrome_trace(sched, args.trace)
    emit(args, doc, _text(problem, sched))
    return 0
