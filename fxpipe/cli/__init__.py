"""The ``fxpipe`` command line (DESIGN.md Contract 4).

One module per sub-command (``fxpipe/cli/<name>_cmd.py``), each exposing
``register(subparsers)`` that adds its parser and sets ``func`` to a ``run(args) -> int``.
Every command takes ``--json``. Errors a user can cause (:class:`~fxpipe.errors.FxpipeError`)
print one line on stderr and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from fxpipe import __version__
from fxpipe.errors import FxpipeError

COMMANDS = ("partition", "bounds", "schedule", "plan", "report", "models")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 already; keep its format
        self.print_usage(sys.stderr)
        self.exit(2, f"fxpipe: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available sub-command registered."""
    parser = _Parser(prog="fxpipe", description="Automatic, certified pipeline parallelism for PyTorch.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"fxpipe.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name == f"fxpipe.cli.{name}_cmd":
                continue  # command not built yet
            raise
        mod.register(sub)
    return parser


@contextlib.contextmanager
def _stdout_for_json_only(json_mode: bool):
    """With ``--json``, stdout carries the JSON document and nothing else.

    Native libraries write to file descriptor 1 behind Python's back (SCIP prints "pressed
    CTRL-C ..." from its signal handler even with output hidden, and solver subprocesses
    inherit the descriptor). While the command runs, descriptor 1 points at stderr and
    Python's ``sys.stdout`` writes to a duplicate of the real stdout, so the JSON reaches
    stdout and everything native goes to stderr.
    """
    if not json_mode:
        yield
        return
    try:
        sys.stdout.flush()
        if sys.stdout.fileno() != 1:
            raise ValueError("stdout is not descriptor 1")
        real_fd = os.dup(1)
    except (OSError, ValueError, AttributeError):  # stdout replaced (e.g. captured by a test harness)
        yield
        return
    old_stdout = sys.stdout
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real_fd, "w", closefd=False)
    try:
        yield
    finally:
        try:
            sys.stdout.flush()
        finally:
            sys.stdout = old_stdout
            os.dup2(real_fd, 1)
            os.close(real_fd)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fxpipe`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        with _stdout_for_json_only(getattr(args, "json", False)):
            code = int(args.func(args) or 0)
            sys.stdout.flush()
        return code
    except FxpipeError as exc:
        # a worker failure: its rank, stage, action and cause, without the worker's traceback
        print(f"fxpipe {args.command}: error: {getattr(exc, 'summary', None) or exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except TimeoutError as exc:  # an OSError, but no path is wrong (fxpipe's own time-outs are FxpipeErrors)
        print(f"fxpipe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # unreadable input / unwritable output path
        print(f"fxpipe {args.command}: error: {exc.strerror or exc}: {exc.filename or ''} (check the path and its permissions)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fxpipe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
