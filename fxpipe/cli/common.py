"""Helpers shared by the CLI sub-commands: their parsers, graph loading by format, memory options, output."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Any, Callable

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph, _json_default, read_json
from fxpipe.memory import DEFAULT_POLICY, DEFAULT_RESERVED_FRACTION, FSDP_UNITS, POLICIES, MemoryModel
from fxpipe.partition import loaders
from fxpipe.partition.memory import PartitionMemory

GRAPH_FORMATS = ("auto", "fxpipe", "dnn-partitioning", "pipedream")


def add_command(subparsers: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int], *,
                help: str, description: str, raw_description: bool = False) -> argparse.ArgumentParser:
    """Add the sub-command ``fxpipe NAME``, run by ``run(args) -> exit code``; returns its parser.

    ``raw_description``: the description (a module docstring) is printed with its own line
    breaks rather than re-wrapped.
    """
    formatter = argparse.RawDescriptionHelpFormatter if raw_description else argparse.HelpFormatter
    parser = subparsers.add_parser(name, help=help, description=description, formatter_class=formatter)
    parser.set_defaults(func=run)
    return parser


def add_graph_arguments(parser: argparse.ArgumentParser) -> None:
    """``GRAPH`` positional and ``--format``."""
    parser.add_argument("graph", metavar="GRAPH", help="graph file (fxpipe.opgraph/1 JSON, or another format with --format)")
    parser.add_argument(
        "--format",
        choices=GRAPH_FORMATS,
        default="auto",
        help="graph file format (default: auto-detect from the content)",
    )


def add_stage_problem_arguments(parser: argparse.ArgumentParser, *, comm_help: str) -> None:
    """The partition problem of ``partition``, ``bounds`` and ``report``: ``GRAPH``, ``--format``,
    ``-k``, ``--objective`` and ``--comm`` (Contract 2)."""
    add_graph_arguments(parser)
    parser.add_argument("-k", "--stages", dest="k", type=int, required=True, help="number of pipeline stages (devices)")
    parser.add_argument("--objective", choices=("inference", "training"), default="inference")
    parser.add_argument("--comm", choices=("dag", "relay"), default="dag", help=comm_help)


def load_stage_problem(args: argparse.Namespace) -> dict[str, Any]:
    """The partition problem of :func:`add_stage_problem_arguments` and :func:`add_memory_arguments`
    as the keyword arguments :func:`fxpipe.partition.search.partition` and
    :func:`fxpipe.partition.bounds.compute_bounds` share: ``graph`` (OpGraph), ``k``,
    ``objective``, ``comm`` and ``memory`` (PartitionMemory or None).

    Raises
    ------
    InputError
        On a missing or malformed graph, a stage count outside ``1..graph.n`` or a malformed
        memory option.
    """
    graph = load_graph(args.graph, args.format)
    check_stage_count(args.k, graph)
    return {"graph": graph, "k": args.k, "objective": args.objective, "comm": args.comm,
            "memory": partition_memory_from_args(args)}


def load_graph(path: str, fmt: str = "auto") -> OpGraph:
    """Load a graph file in any supported format as an :class:`OpGraph`.

    ``auto`` picks ``pipedream`` for ``*.txt`` files, ``dnn-partitioning`` for JSON with
    ``fpgaLatency`` nodes, and ``fxpipe`` otherwise.

    Raises
    ------
    InputError
        If the file is missing or malformed.
    """
    if fmt == "auto":
        if path.lower().endswith(".txt"):
            fmt = "pipedream"
        else:
            doc = read_json(path, "graph file")
            nodes = doc.get("nodes") if isinstance(doc, dict) else None
            if isinstance(nodes, list) and nodes and isinstance(nodes[0], dict) and "fpgaLatency" in nodes[0]:
                fmt = "dnn-partitioning"
            else:
                return OpGraph.from_dict(doc, source=path)
    if fmt == "fxpipe":
        return OpGraph.load(path)

    if fmt == "dnn-partitioning":
        return loaders.load_dnn_partitioning(path)
    if fmt == "pipedream":
        return loaders.load_pipedream(path)
    raise InputError(f"unknown graph format {fmt!r}; choose one of {GRAPH_FORMATS}")


def emit(args: argparse.Namespace, doc: dict[str, Any], text: str) -> None:
    """Print ``doc`` as JSON when ``--json`` was given, else the human-readable ``text``."""
    if getattr(args, "json", False):
        json.dump(doc, sys.stdout, indent=1, allow_nan=False, default=_json_default)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text.rstrip("\n") + "\n")


def check_stage_count(k: int, graph: OpGraph) -> int:
    """``-k`` must be a positive number of stages no larger than the graph's op count.

    Raises
    ------
    InputError
        For ``k < 1`` or ``k > graph.n`` (every pipeline stage needs at least one op).
    """
    if k is None or k < 1:
        raise InputError(f"-k must be a positive number of stages, got {k}")
    if k > graph.n:
        raise InputError(
            f"-k {k} is more stages than the {graph.n} ops of {graph.name!r}: every pipeline stage needs "
            f"at least one op; use -k {graph.n} or fewer"
        )
    return int(k)


def check_writable(path: str, flag: str) -> None:
    """Fail early, before any work, when an output path cannot be written.

    Raises
    ------
    InputError
        If ``path`` is a directory, or its parent exists and is not a writable directory.
    """
    import os
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag} {path!r} is a directory: give a file name")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise InputError(f"{flag} {path!r} cannot be written: {str(parent)!r} is not a writable folder")


def status(message: str) -> None:
    """One progress line on stderr (stdout stays clean for ``--json``)."""
    print(f"fxpipe: {message}", file=sys.stderr, flush=True)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, *, allow_inf: bool = False) -> float:
    """``"80GB"``, ``"16GiB"``, ``"1.5e9"`` -> bytes (float); ``"inf"`` with ``allow_inf``.

    Raises
    ------
    InputError
        If the text is not a positive number with an optional unit (B, KB, MB, GB, TB,
        KiB, MiB, GiB, TiB).
    """
    if allow_inf and str(text).strip().lower() in ("inf", "none", "unlimited"):
        return math.inf
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        extra = " (or 'inf' for no limit)" if allow_inf else ""
        raise InputError(f"memory capacity {text!r} is not a size: write bytes like 8e10, 80GB or 16GiB{extra}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise InputError(f"memory capacity must be positive, got {text!r}")
    return value


def add_memory_arguments(parser: argparse.ArgumentParser, *, plan: bool = False) -> None:
    """``--memory`` and the memory model's options (:class:`fxpipe.memory.MemoryModel`).

    With ``plan`` the capacity defaults to the hardware profile's and ``inf`` turns memory
    off; otherwise memory is counted only when ``--memory`` is given (also spelled
    ``--memory-capacity``), and ``--microbatches`` sets the receive buffers counted.
    """
    if plan:
        parser.add_argument("--memory-bytes", "--memory", dest="memory", default=None, metavar="SIZE",
                            help="bytes per device, e.g. 80GB or 16GiB (default: the hardware profile's memory; 'inf': no "
                            "limit); the partition keeps every stage within it and the schedule offloads or checkpoints "
                            "activations where it must")
    else:
        parser.add_argument("--memory", "--memory-capacity", dest="memory", default=None, metavar="SIZE",
                            help="bytes per device, e.g. 80GB or 16GiB: stages must fit (default: no memory limit)")
        parser.add_argument("--microbatches", type=int, default=1, metavar="M",
                            help="micro-batches whose receive buffers a stage holds, with --memory (default 1)")
    parser.add_argument("--precision", choices=sorted(POLICIES), default=DEFAULT_POLICY,
                        help=f"bytes per parameter of weights, grads and optimizer state (default {DEFAULT_POLICY}: 16 B/param)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0,
                        help="ZeRO sharding over --data-parallel: 1 optimizer state, 2 + gradients, 3 + weights (default 0)")
    parser.add_argument("--data-parallel", type=int, default=1, metavar="D",
                        help="data-parallel degree the ZeRO stage shards over (default 1)")
    parser.add_argument("--reserved-fraction", type=float, default=DEFAULT_RESERVED_FRACTION, metavar="F",
                        help=f"fraction of each device kept for the runtime (default {DEFAULT_RESERVED_FRACTION:g})")
    parser.add_argument("--offload-optimizer", action=argparse.BooleanOptionalAction, default=None,
                        help="keep the optimizer state on the host and step it there (ZeRO-Offload; FSDP2's "
                        "CPUOffloadPolicy at run time), so the devices hold weights and gradients only; "
                        "--no-offload-optimizer: never (default: on the device, but `fxpipe plan --mesh auto` also tries "
                        "the host for a mesh whose memory binds)")
    parser.add_argument("--fsdp-units", choices=FSDP_UNITS, default=None,
                        help="with --mesh dp_shard > 1: one FSDP2 unit per pipeline stage (stage, the default: ZeRO-1's "
                        "memory during the step) or per repeated block with the rest of a stage as its root (block: "
                        "ZeRO-3's memory plus the root and two blocks unsharded, all-gathers and reduce-scatters "
                        "every micro-batch; runs without offload and whole-stage recomputation)")


def memory_model_from_args(args: argparse.Namespace, default_capacity_bytes: float | None = None):
    """The :class:`fxpipe.memory.MemoryModel` of the options of :func:`add_memory_arguments`.

    Returns None when there is no capacity (no ``--memory`` and no default).

    Raises
    ------
    InputError
        On a malformed size or model option.
    """
    if args.memory is not None:
        cap = parse_bytes(args.memory, allow_inf=default_capacity_bytes is not None)
    elif default_capacity_bytes is not None:
        cap = float(default_capacity_bytes)
    else:
        return None
    return MemoryModel(capacity_bytes=cap, policy=args.precision, data_parallel=args.data_parallel,
                       zero_stage=args.zero_stage, reserved_fraction=args.reserved_fraction,
                       offload_optimizer=getattr(args, "offload_optimizer", None),
                       fsdp_units=getattr(args, "fsdp_units", None))


def partition_memory_from_args(args: argparse.Namespace):
    """The :class:`~fxpipe.partition.memory.PartitionMemory` of ``--memory`` and its options (None without).

    Raises
    ------
    InputError
        On a malformed size or model option, or ``--microbatches < 1``.
    """
    model = memory_model_from_args(args)
    if model is None:
        return None
    if args.microbatches < 1:
        raise InputError(f"--microbatches must be >= 1, got {args.microbatches}")
    return PartitionMemory(model, num_microbatches=args.microbatches)
