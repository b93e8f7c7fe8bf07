"""``fxpipe report GRAPH -k K -o OUT.html``: an offline partition + certificate report.

Partitions GRAPH (the warm-start search of :mod:`fxpipe.partition.bounds`), proves the
lower bounds of the chosen methods, and writes one self-contained HTML file (and Markdown
with ``--markdown``) with graph statistics, the stage table, a stage-cost chart, the
certificate hierarchy and the command that reproduces it. ``--json`` prints the bounds
document (Contract 4 shape) plus the files written.
"""

from __future__ import annotations

import argparse
import shlex

from fxpipe.cli.bounds_cmd import add_bounds_arguments, compute_from_args
from fxpipe.cli.common import add_command, emit
from fxpipe.report import write_report


def register(subparsers) -> None:
    """Add the ``report`` sub-command."""
    p = add_command(subparsers, "report", run,
                    help="write an HTML/Markdown report: partition, stage costs and lower-bound certificates",
                    description="Partition GRAPH into K stages, prove lower bounds (Archer et al. 2024, Section 3) "
                    "and write a self-contained HTML report (and Markdown).")
    add_bounds_arguments(p, time_default=30.0)
    p.add_argument("-o", "--output", dest="output", required=True, metavar="OUT.html", help="HTML file to write")
    p.add_argument("--markdown", default=None, metavar="OUT.md", help="also write a Markdown report")
    p.add_argument("--certificate", default=None, metavar="OUT.json", help="also write an fxpipe.certificate/1 file")
    p.add_argument("--no-charts", dest="charts", action="store_false", help="leave out the matplotlib charts")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def reproduce_command(args: argparse.Namespace) -> str:
    """The canonical ``fxpipe report`` command line that reproduces this run (every option
    spelled out, so defaults changing later do not change what it means)."""
    parts = ["fxpipe", "report", args.graph, "--format", args.format, "-k", str(args.k), "--objective", args.objective,
             "--comm", args.comm, "--methods", args.methods, "--time-limit", f"{args.time_limit:g}", "--workers", str(args.workers)]
    if args.search_time_limit is not None:
        parts += ["--search-time-limit", f"{args.search_time_limit:g}"]
    if args.memory is not None:
        parts += ["--memory", str(args.memory), "--microbatches", str(args.microbatches), "--precision", args.precision,
                  "--zero-stage", str(args.zero_stage), "--data-parallel", str(args.data_parallel),
                  "--reserved-fraction", f"{args.reserved_fraction:g}"]
    parts += ["-o", args.output]
    if args.markdown:
        parts += ["--markdown", args.markdown]
    if args.certificate:
        parts += ["--certificate", args.certificate]
    if not args.charts:
        parts.append("--no-charts")
    return " ".join(shlex.quote(str(p)) for p in parts)


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (errors raise FxpipeError -> exit 2)."""
    from fxpipe.partition.bounds import write_certificate  # noqa: PLC0415 (lazy: the bounds package loads SCIP)

    graph, report = compute_from_args(args)
    command = reproduce_command(args)
    written = write_report(graph, report.partition, report, args.output, args.markdown, command=command, charts=args.charts)
    if args.certificate:
        written["certificate"] = write_certificate(args.certificate, report, graph)
    doc = report.to_dict()
    doc["files"] = {k: str(v) for k, v in written.items()}
    text = report.format_table() + "\n" + "\n".join(f"wrote {k}: {v}" for k, v in written.items())
    emit(args, doc, text)
    return 0
