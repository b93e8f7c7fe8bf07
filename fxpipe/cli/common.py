"""Helpers shared by the CLI sub-commands: graph loading by format, output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph, _json_default, read_json

GRAPH_FORMATS = ("auto", "fxpipe", "dnn-partitioning", "pipedream")


def add_graph_arguments(parser: argparse.ArgumentParser) -> None:
    """``GRAPH`` positional and ``--format``."""
    parser.add_argument("graph", metavar="GRAPH", help="graph file (fxpipe.opgraph/1 JSON, or another format with --format)")
    parser.add_argument(
        "--format",
        choices=GRAPH_FORMATS,
        default="auto",
        help="graph file format (default: auto-detect from the content)",
    )


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
    from fxpipe.partition import loaders  # noqa: PLC0415 (optional part)

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
