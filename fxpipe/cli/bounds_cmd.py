"""``fxpipe bounds GRAPH -k K``: lower-bound certificates for a partition (Contract 4).

Runs the MIP hierarchy of Archer et al. 2024, Section 3 (``simple``, ``lp``, ``bottleneck``,
``guess``, ``exact``) and the chain DP (``chain``, relay communication,
:mod:`fxpipe.partition.chain`), and prints one row per method: the bound, its ratio to the best
partition known, SCIP's status and the wall time. ``--json`` prints ``{"k", "solution":
{"bottleneck", "assignment"}, "lower_bounds", "best_lower_bound", "ratio", "solver"}``;
``--certificate OUT.json`` writes an ``fxpipe.certificate/1`` file a third party can check.
"""

from __future__ import annotations

import argparse

from fxpipe.cli.common import add_command, add_memory_arguments, add_stage_problem_arguments, emit, load_stage_problem
from fxpipe.errors import InputError

DEFAULT_METHODS = "simple,chain,bottleneck,guess,exact"


def parse_methods(text: str) -> list[str]:
    """``"simple,exact"`` -> ``["simple", "exact"]``.

    Raises
    ------
    InputError
        On an unknown method name.
    """
    from fxpipe.partition.bounds import METHODS  # noqa: PLC0415 (lazy: the bounds package loads SCIP)

    methods = [m.strip() for m in str(text).split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise InputError(f"--methods {text!r}: unknown method(s) {bad}; choose a comma-separated subset of {','.join(METHODS)}")
    return methods


def add_bounds_arguments(p: argparse.ArgumentParser, *, time_default: float = 60.0) -> None:
    """Options shared by ``bounds`` and ``report``."""
    add_stage_problem_arguments(p, comm_help="communication model (Contract 2)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated subset of simple,chain,lp,bottleneck,guess,exact (default {DEFAULT_METHODS}; chain needs --comm relay; "
                   "MIPs are skipped once the partition is proven optimal)")
    p.add_argument("--time-limit", dest="time_limit", type=float, default=time_default, help=f"seconds per MIP method (default {time_default:g})")
    p.add_argument("--search-time-limit", dest="search_time_limit", type=float, default=None, help="seconds for the warm-start partition search (default min(10, time limit))")
    add_memory_arguments(p)
    p.add_argument("--workers", type=int, default=2, help="processes for the guess sub-MIPs (default 2)")


def register(subparsers) -> None:
    """Add the ``bounds`` sub-command."""
    p = add_command(subparsers, "bounds", run,
                    help="prove lower bounds on the best pipeline bottleneck (SCIP MIP hierarchy)",
                    description="Compute lower bounds on the optimal bottleneck of GRAPH split into K pipeline stages "
                    "(Archer et al. 2024, Section 3) and compare them with the best partition found.")
    add_bounds_arguments(p)
    p.add_argument("--certificate", default=None, metavar="OUT.json", help="write an fxpipe.certificate/1 file")
    p.add_argument("--json", action="store_true", help="machine-readable output (Contract 4)")


def compute_from_args(args: argparse.Namespace):
    """Load the graph and run :func:`fxpipe.partition.bounds.compute_bounds` from CLI args.

    Returns
    -------
    (graph, BoundsReport)
    """
    from fxpipe.partition.bounds import compute_bounds  # noqa: PLC0415 (lazy: the bounds package loads SCIP)

    if args.k is None or args.k < 1:
        raise InputError(f"-k must be a positive number of stages, got {args.k}")
    if not args.time_limit > 0:
        raise InputError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    methods = parse_methods(args.methods)
    problem = load_stage_problem(args)
    report = compute_bounds(
        **problem,
        methods=methods,
        time_limit_s=args.time_limit,
        search_time_limit_s=args.search_time_limit,
        workers=max(1, args.workers),
    )
    return problem["graph"], report


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (errors raise FxpipeError -> exit 2)."""
    from fxpipe.partition.bounds import write_certificate  # noqa: PLC0415 (lazy: the bounds package loads SCIP)

    graph, report = compute_from_args(args)
    if args.certificate:
        write_certificate(args.certificate, report, graph)
    text = f"{graph.name}: n={graph.n} m={graph.m} k={args.k} objective={args.objective} comm={args.comm}\n" + report.format_table()
    if args.certificate:
        text += f"\ncertificate written to {args.certificate}"
    if report.interrupted:
        text += "\ninterrupted (Ctrl-C): the bounds above are the methods finished so far; each is valid"
    emit(args, report.to_dict(), text)
    return 130 if report.interrupted else 0
