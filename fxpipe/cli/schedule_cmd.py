"""``fxpipe schedule PROBLEM.json``: a timed pipeline schedule (DESIGN.md Contract 4).

Reads a ``fxpipe.schedproblem/1`` file, builds a schedule with a heuristic or the MILP,
validates it against Contract 3 and prints (or writes) a ``fxpipe.schedule/1`` document.
The document's ``lower_bound_s`` is the best proven bound: the combinatorial bound of
:mod:`fxpipe.schedule.bounds`, or the MILP's dual bound when larger.
"""

from __future__ import annotations

import argparse
import sys
import time

from fxpipe.cli.common import emit
from fxpipe.errors import InfeasibleError, SolverError
from fxpipe.ir import Schedule, ScheduleProblem, write_json_atomic

METHOD_CHOICES = ("1f1b", "zb-h1", "zb-h2", "gpipe", "greedy", "pipeoffload", "adaoffload", "milp")

#: Heuristics tried, in order, for the MILP warm start (the best valid one is used).
WARM_START_METHODS = ("zb-h2", "greedy", "zb-h1", "1f1b", "adaoffload", "pipeoffload", "gpipe")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``schedule`` sub-command."""
    p = subparsers.add_parser(
        "schedule",
        help="schedule F/B/W/offload/reload ops of a pipeline problem",
        description="Build a pipeline schedule for a fxpipe.schedproblem/1 file and validate it (Contract 3).",
    )
    p.add_argument("problem", metavar="PROBLEM", help="schedule problem (fxpipe.schedproblem/1 JSON)")
    p.add_argument("--method", choices=METHOD_CHOICES, default="zb-h1", help="schedule generator (default: zb-h1)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="MILP time limit in seconds (default 60)")
    p.add_argument("--out", metavar="SCHEDULE", help="also write the schedule to this JSON file (atomically)")
    p.add_argument("--json", action="store_true", help="print the fxpipe.schedule/1 document on stdout")
    p.set_defaults(func=run)


def _warm_start(problem: ScheduleProblem) -> Schedule | None:
    from fxpipe.schedule.heuristics import generate

    best = None
    for m in WARM_START_METHODS:
        try:
            s = generate(problem, m)
        except InfeasibleError:
            continue
        if best is None or s.value < best.value:
            best = s
    return best


def solve(problem: ScheduleProblem, method: str, time_limit_s: float = 60.0) -> Schedule:
    """The validated schedule of ``problem`` by ``method`` with its best lower bound.

    Raises
    ------
    InfeasibleError
        If the method cannot fit the memory limit.
    SolverError
        If the MILP is unavailable or returns an invalid schedule.
    """
    from fxpipe.schedule.bounds import combinatorial_lower_bound
    from fxpipe.schedule.heuristics import generate
    from fxpipe.schedule.validate import InvalidScheduleError, validate_schedule

    t0 = time.perf_counter()
    if method == "milp":
        try:
            from fxpipe.schedule import milp  # noqa: PLC0415 (optional part, needs SCIP)
        except ImportError as exc:
            raise SolverError(f"the MILP scheduler is not available ({exc}); use a heuristic --method") from None
        warm = _warm_start(problem)
        sched = milp.solve(problem, time_limit_s=time_limit_s, warm_start=warm, progress=sys.stderr.isatty())
        try:
            validate_schedule(problem, sched)
        except InvalidScheduleError as exc:
            raise SolverError(f"the MILP returned a schedule that breaks Contract 3: {exc}") from None
    else:
        sched = generate(problem, method)
        validate_schedule(problem, sched)
    lb = max(float(sched.lower_bound_s), combinatorial_lower_bound(problem))
    return Schedule(
        ops=sched.ops,
        makespan=sched.makespan,
        stage_span=sched.stage_span,
        lower_bound_s=lb,
        status=sched.status,
        solver_time_s=sched.solver_time_s if method == "milp" else time.perf_counter() - t0,
        method=sched.method or method,
        objective=problem.objective,
        meta=sched.meta,
    )


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
    problem = ScheduleProblem.load(args.problem)
    sched = solve(problem, args.method, args.time_limit)
    doc = sched.to_dict()
    if args.out:
        write_json_atomic(args.out, doc)
    emit(args, doc, _text(problem, sched))
    return 0
