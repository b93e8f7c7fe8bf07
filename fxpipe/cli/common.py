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
