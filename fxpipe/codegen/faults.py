"""What a failure inside a pipeline stage names: its root cause, the op and the model's source line.

torch's pipelining wraps every exception of a stage in ``RuntimeError("[Stage 1] failed to run
forward: args: (...)")`` (and ``"Failed to run stage backward"``), raised ``from`` the user's own
exception. This module digs that cause out and says where it happened:

* :func:`root_cause`: the exception at the bottom of the ``raise ... from`` chain, stopping at
  fxpipe's own errors (whose messages are written for users).
* :func:`graph_frame`: the graph node whose generated code raised (the frame of the stage
  module's generated ``forward`` in the traceback, the node named by the assignment on that
  line) and the model's source line that ``torch.export`` recorded for it
  (``node.meta["stack_trace"]``, innermost frame).
* :func:`stack_trace_frame`: that innermost model frame of a node's recorded stack trace.
* :func:`user_frame`: the innermost frame of the traceback in the user's own code (not torch,
  not fxpipe, not the standard library): a custom op's or an autograd function's body.
* :func:`describe_action`: ``"1F3"`` -> ``"stage 1, forward of micro-batch 3"`` (torch's action text).
* :func:`action_failure`: the :class:`~fxpipe.errors.WorkerError` a failed compute action
  raises, naming the rank, stage, micro-batch, action, cause and frame
  (:class:`fxpipe.codegen.runtime.FxpipePipelineStage` raises it, so ``plan.build`` under
  torchrun, ``train_local`` and ``fxpipe plan --run`` all say the same).

No private torch API: tracebacks, ``GraphModule.forward``'s code object and the nodes' public
``stack_trace``.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import traceback
from typing import Any

from fxpipe.errors import FxpipeError, WorkerError

__all__ = ["root_cause", "user_frame", "innermost_user_frame", "is_library_file", "graph_frame", "describe_action",
           "parse_action", "action_failure", "cause_fields", "stack_trace_frame"]

#: torch's action text: stage, type, micro-batch (``"1F3"``, ``"0RECV_B2"``, ``"2W0"``; ``"0UNSHARD"`` has none)
_ACTION = re.compile(r"^\s*(\d+)([A-Z_]+?)(\d+)?\s*$")

#: what each of torch's action types does, for messages
_ACTION_KIND = {
    "F": "forward", "B": "backward", "I": "backward-input", "W": "backward-weight",
    "SEND_F": "send of the activations", "RECV_F": "receive of the activations",
    "SEND_B": "send of the gradients", "RECV_B": "receive of the gradients",
    "UNSHARD": "unshard", "RESHARD": "reshard", "REDUCE_GRAD": "gradient reduction",
}

_LINE = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$')


def root_cause(exc: BaseException) -> BaseException:
    """The exception at the bottom of ``exc``'s ``raise ... from`` chain (``__cause__``).

    Stops at the first :class:`~fxpipe.errors.FxpipeError` (its message is the one meant for
    users, even when raised from a library's exception) and at a cycle.
    """
    seen = {id(exc)}
    while not isinstance(exc, FxpipeError) and exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def _library_dirs() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """``(fxpipe and torch, the standard library, site-packages)`` folders, each ending in a separator."""
    own = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # fxpipe
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        own.append(os.path.dirname(os.path.abspath(torch.__file__)))
    paths = sysconfig.get_paths()
    std = [os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)]
    packages = [os.path.abspath(paths[k]) for k in ("purelib", "platlib") if paths.get(k)]
    return tuple(tuple(d.rstrip(os.sep) + os.sep for d in ds) for ds in (own, std, packages))


def is_library_file(filename: str) -> bool:
    """True for generated code (``<eval_with_key>``, ``<string>``) and files of fxpipe, torch and the
    standard library: what a frame of the user's own code (a model, a custom op, transformers) is not.
    (In a virtual environment the standard library's folder may hold site-packages: those files are
    the user's.)"""
    if filename.startswith("<"):
        return True
    own, std, packages = _library_dirs()
    path = os.path.abspath(filename)
    return path.startswith(own) or (path.startswith(std) and not path.startswith(packages))


def innermost_user_frame(frames) -> str | None:
    """The innermost of ``frames`` (``traceback.FrameSummary`` s, outermost first) in the user's own
    code (:func:`is_library_file`), as ``File "...", line N, in fn: code``; None if there is none."""
    for fr in reversed(list(frames)):
        if not is_library_file(fr.filename):
            return _frame_text(fr.filename, fr.lineno, fr.name, fr.line)
    return None


def _frame_text(filename: str, lineno: int | str, name: str, line: str | None) -> str:
    text = f'File "{filename}", line {lineno}, in {name}'
    return text + (f": {line.strip()}" if line and line.strip() else "")


def user_frame(exc: BaseException) -> str | None:
    """The innermost frame of ``exc``'s traceback in the user's own code, as one line, or None.

    Frames of torch, fxpipe, the standard library and generated code (``<eval_with_key>``,
    ``<string>``) are skipped: what remains is the user's model, custom op or autograd
    function (third-party packages such as transformers count as the user's code).
    """
    return innermost_user_frame(traceback.extract_tb(exc.__traceback__))


def stack_trace_frame(stack_trace: str | None) -> str | None:
    """The innermost frame of the model's code in a node's recorded stack trace (``File ..., line N,
    in fn: code``): frames of torch's own modules (``nn.Embedding.forward``) are passed over, unless
    there is no other; None without a frame.

    The one reader of ``node.meta["stack_trace"]`` for messages (a failing op here, a kernel gap in
    :mod:`fxpipe.codegen.devicecheck`).
    """
    if not stack_trace:
        return None
    lines = str(stack_trace).rstrip().splitlines()
    frames = []
    for i, text in enumerate(lines):
        m = _LINE.match(text)
        if m:
            code = lines[i + 1] if i + 1 < len(lines) and not _LINE.match(lines[i + 1]) else None
            frames.append((m.group(1), m.group(2), m.group(3), code))
    if not frames:
        return None
    own = [f for f in frames if not is_library_file(f[0])]
    return _frame_text(*(own or frames)[-1])


def graph_frame(exc: BaseException, module: Any) -> tuple[str | None, str | None]:
    """``(op, frame)`` of the node of ``module``'s graph whose generated code raised ``exc``.

    ``op`` is ``"<node> (<operator>)"``; ``frame`` the model's source line of that node (the
    innermost frame of ``node.meta["stack_trace"]`` that ``torch.export`` recorded), or None
    where the graph has none. ``(None, None)`` when the traceback does not pass through
    ``module``'s generated ``forward`` (a compiled stage, a backward).

    Parameters
    ----------
    exc : BaseException
        The root cause (:func:`root_cause`), its traceback intact.
    module : torch.fx.GraphModule or any module
        The stage module that ran.
    """
    graph = getattr(module, "graph", None)
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    if graph is None or code is None:
        return None, None
    hit = None
    for fr in traceback.extract_tb(exc.__traceback__):
        if fr.filename == code.co_filename:
            hit = fr
    if hit is None or not hit.line:
        return None, None
    m = re.match(r"\s*(\w+)\s*=", hit.line)
    node = next((n for n in graph.nodes if m and n.name == m.group(1)), None)
    if node is None:
        return None, None
    target = node.target
    op = f"{node.name} ({getattr(target, '__name__', None) if callable(target) and not hasattr(target, '_schema') else target})"
    return op, stack_trace_frame(node.meta.get("stack_trace"))


def parse_action(action: str | None) -> tuple[int | None, str | None, int | None]:
    """``"1F3"`` -> ``(1, "F", 3)``; ``(None, None, None)`` for anything else."""
    m = _ACTION.match(str(action or ""))
    if not m:
        return None, None, None
    return int(m.group(1)), m.group(2), (int(m.group(3)) if m.group(3) is not None else None)


def describe_action(action: str | None) -> str | None:
    """``"1F3"`` -> ``"stage 1, forward of micro-batch 3"``; None when ``action`` is not torch's action text."""
    stage, kind, mb = parse_action(action)
    if stage is None:
        return None
    what = _ACTION_KIND.get(kind, kind)
    return f"stage {stage}, {what}" + (f" of micro-batch {mb}" if mb is not None else "")


def cause_fields(exc: BaseException) -> dict[str, Any]:
    """What made ``exc`` happen, for a rank's error report: ``type``, ``message``, ``frame``,
    ``op`` and ``detail`` (the lines a message shows under its head: the model's source line,
    the op, where the cause was raised).

    A :class:`~fxpipe.errors.WorkerError` raised by a failed action already names them; any
    other exception is reduced to its :func:`root_cause` and that cause's :func:`user_frame`.
    """
    if isinstance(exc, WorkerError) and exc.cause_type:
        detail = [ln for ln in str(exc).splitlines()[1:] if ln.startswith("  ")]
        return {"type": exc.cause_type, "message": exc.cause, "frame": exc.frame, "op": exc.op, "detail": detail}
    root = root_cause(exc)
    frame = None if isinstance(root, FxpipeError) else user_frame(root)
    return {"type": type(root).__name__, "message": str(root).strip(), "frame": frame, "op": None,
            "detail": [f"  raised at: {frame}"] if frame else []}


def action_failure(exc: BaseException, *, rank: int | None, action: str, module: Any = None) -> WorkerError:
    """The :class:`~fxpipe.errors.WorkerError` of a compute action that raised ``exc``.

    Parameters
    ----------
    exc : BaseException
        What the action raised (torch's wrapper or the cause itself).
    rank : int or None
        The rank running the action.
    action : str
        torch's action text (``"1F0"``, ``"1I0"``, ``"1W0"``, ``"1B0"``).
    module : torch.fx.GraphModule, optional
        The stage module, to name the graph node that raised and the model's source line
        (forward actions).

    Returns
    -------
    WorkerError
        Message ``"rank 1 (stage 1, forward of micro-batch 0, action 1F0) failed: ValueError: ..."``
        and, on the next lines, the model's source line (``in the model's code: File ...``), the
        op and where the cause was raised when that is the user's own code elsewhere; its
        attributes carry the same (``cause_type``, ``cause``, ``frame``, ``op``, ``microbatch``).
    """
    if isinstance(exc, WorkerError):
        return exc
    root = root_cause(exc)
    stage, _, mb = parse_action(action)
    op, frame = graph_frame(root, module) if module is not None else (None, None)
    raised = None if isinstance(root, FxpipeError) else user_frame(root)
    where = ", ".join(p for p in (describe_action(action), f"action {action}") if p)
    cause = str(root).strip()
    head = f"rank {rank} ({where}) failed: {type(root).__name__}: {cause}"
    lines = [head]
    if frame:
        lines.append(f"  in the model's code: {frame}")
    if op:
        lines.append(f"  op: {op}")
    if raised and raised != frame:
        lines.append(f"  raised at: {raised}")
    return WorkerError("\n".join(lines), rank=rank, stages=(stage,) if stage is not None else (), action=action,
                       cause_type=type(root).__name__, cause=cause, microbatch=mb, frame=frame or raised, op=op)
