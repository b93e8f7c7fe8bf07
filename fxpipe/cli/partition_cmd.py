"""``fxpipe partition GRAPH -k K``: partition an OpGraph into pipeline stages (Contract 4).

``--json`` prints ``{"k", "assignment", "block_costs", "bottleneck", "objective", "comm",
"meta"}``; otherwise a table with one row per stage.
"""

from __future__ import annotations

import argparse

import numpy as np

from fxpipe.cli.common import add_command, add_memory_arguments, add_stage_problem_arguments, emit, load_stage_problem


def register(subparsers) -> None:
    """Add the ``partition`` sub-command."""
    p = add_command(subparsers, "partition", run,
                    help="partition an op graph into k pipeline stages (SliceGraph + BRKGA)",
                    description="Partition GRAPH into at most K pipeline stages minimising the bottleneck stage "
                    "(Archer et al. 2024: SliceGraph DP over topological orders searched by BRKGA).")
    add_stage_problem_arguments(p, comm_help="communication model (Contract 2; codegen uses relay)")
    p.add_argument("--method", choices=("brkga", "orders"), default="brkga")
    p.add_argument("--time-limit", dest="time_limit", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument("--evaluations", type=int, default=None, help="maximum number of orders decoded")
    p.add_argument("--seed", type=int, default=0)
    add_memory_arguments(p)
    p.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
    p.add_argument("--json", action="store_true", help="machine-readable output (Contract 4)")


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (errors raise FxpipeError -> exit 2)."""
    from fxpipe.partition.search import partition  # noqa: PLC0415 (lazy: numba kernels)

    problem = load_stage_problem(args)
    part = partition(
        **problem,
        method=args.method,
        time_limit_s=args.time_limit,
        seed=args.seed,
        evaluations=args.evaluations,
        progress=args.progress,
    )
    emit(args, part.to_dict(), _table(problem["graph"], part))
    return 0


def _table(graph, part) -> str:
    counts = np.bincount(part.assignment, minlength=part.k)
    work = np.bincount(part.assignment, weights=graph.work_s(part.objective), minlength=part.k)
    mem = part.meta.get("stage_memory_bytes")
    lines = [
        f"{graph.name}: {graph.n} ops -> {part.k} stages ({part.objective}, comm={part.comm}, method={part.meta.get('method')})",
        f"{'stage':>5} {'ops':>6} {'cost_ms':>12} {'work_ms':>12} {'io_ms':>12}" + (f" {'memory_GiB':>11}" if mem else ""),
    ]
    for b in range(part.k):
        c = part.block_costs[b]
        row = f"{b:>5} {counts[b]:>6} {c * 1e3:>12.4f} {work[b] * 1e3:>12.4f} {(c - work[b]) * 1e3:>12.4f}"
        if mem:
            row += f" {mem[b] / 2**30:>11.3f}"
        if c == part.bottleneck:
            row += "  <- bottleneck"
        lines.append(row)
    lines.append(
        f"bottleneck {part.bottleneck * 1e3:.4f} ms; {part.meta.get('evaluations')} orders in {part.meta.get('seconds', 0):.2f} s"
        + (" (interrupted)" if part.meta.get("interrupted") else "")
    )
    if "lower_bound_s" in part.meta:
        lb = part.meta["lower_bound_s"]
        lines.append(
            f"lower bound {lb * 1e3:.4f} ms ({part.meta.get('lower_bound_method')}): "
            + ("proven optimal" if part.meta.get("proven_optimal") else f"gap {100 * part.meta.get('gap', 0.0):.2f}%")
            + f"; search stopped: {part.meta.get('stop_reason')}"
        )
    return "\n".join(lines)
