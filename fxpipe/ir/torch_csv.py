"""torch's action vocabulary and CSV pipeline-schedule format, read and written as text (no torch import).

``torch.distributed.pipelining``'s multi-stage schedules (``PipelineScheduleMulti._load_csv``
/ ``_dump_csv`` and ``_PipelineScheduleRuntime._load_csv(format="compute_only")``, torch
2.6-2.13) and torchtitan's ``pipeline_parallel_schedule_csv`` option read a schedule as a CSV
file with one row per pipeline rank; each cell is one action of that rank, in program order,
written like ``_Action.__repr__``: ``<stage><type><micro-batch>`` with type

* ``F`` forward,
* ``I`` backward-input (fxpipe's ``B``),
* ``W`` backward-weight (fxpipe's ``W``),
* ``B`` full backward (backward-input and backward-weight at once: fxpipe's ``B`` followed
  by its ``W``, the lowered ``BW``),

an empty cell being a no-op, and ``(a;b)OVERLAP_F_B`` an overlapped forward/backward pair
(DualPipe-V). The row number is the rank; torch infers which rank holds which stage from the
cells. torch has no offload/reload action.

:func:`orders_to_torch_csv` writes :class:`~fxpipe.ir.schedule.Orders` in this format (a B
immediately followed on its device by its own W may be written as torch's full backward
``B``); :func:`orders_from_torch_csv` reads it back (``I`` -> B, ``B`` -> B then W,
``OVERLAP_F_B`` -> its sub-actions in order). :data:`TORCH_TYPE` is the one translation of
action types between fxpipe and torch, :func:`torch_text` / :func:`parse_torch_action` the
text of one action in torch's vocabulary (on :func:`fxpipe.ir.schedule.split_action_text`,
the one grammar).

References
----------
torch/distributed/pipelining/schedules.py (torch 2.13): ``_Action.from_str``,
``PipelineScheduleMulti._load_csv``, ``_PipelineScheduleRuntime._dump_csv``.
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path
from typing import Any, Sequence

from fxpipe.errors import InputError
from fxpipe.io import read_text, write_text_atomic
from fxpipe.ir.lowering import compute_only, merge_backward, split_full_backward
from fxpipe.ir.schedule import FULL_BACKWARD, Action, Orders, split_action_text

__all__ = [
    "TORCH_TYPE",
    "torch_text",
    "parse_torch_action",
    "torch_action_rows",
    "orders_to_torch_csv",
    "orders_from_torch_csv",
    "write_torch_csv",
    "read_torch_csv",
]

#: fxpipe's compute action type -> torch's (the letter of ``_ComputationType``): the one
#: translation between the two vocabularies, used for files and for torch's ``_Action``.
TORCH_TYPE = {"F": "F", "B": "I", "W": "W", FULL_BACKWARD: "B"}
_FROM_TORCH = {t: f for f, t in TORCH_TYPE.items()}
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")


def torch_text(a: Action) -> str:
    """``a`` in torch's vocabulary (``"2I0"`` for fxpipe's ``2B0``, ``"2B0"`` for ``2BW0``).

    Raises
    ------
    InputError
        For an offload/reload action (torch has none).
    """
    if a.type not in TORCH_TYPE:
        raise InputError(f"{a}: torch has no offload/reload action; leave O/R out (fxpipe.ir.lowering.compute_only)")
    return f"{a.stage}{TORCH_TYPE[a.type]}{a.microbatch}"


def parse_torch_action(text: Any, where: str) -> Action | None:
    """The action written ``text`` in torch's vocabulary (F, I, W, B); ``""`` (an idle step) gives None.

    torch's ``I`` becomes fxpipe's B, its full backward ``B`` the lowered ``BW``
    (:data:`TORCH_TYPE`); the text grammar is :func:`fxpipe.ir.schedule.split_action_text`.

    Raises
    ------
    InputError
        Naming ``where`` for a non-string, a communication/sharding action (torch's runtime adds
        those itself) or a string that is not a compute action.
    """
    if not isinstance(text, str):
        raise InputError(f"{where}: action {text!r} is not a string like '0F1' (stage, type, micro-batch)")
    if text == "":
        return None
    parts = split_action_text(text)
    if parts is not None and parts[1] in _FROM_TORCH and parts[2] is not None:
        return Action(parts[0], _FROM_TORCH[parts[1]], parts[2])
    if parts is not None and len(parts[1]) > 1:
        raise InputError(
            f"{where}: {text!r} is a communication/sharding action; fxpipe reads torch's compute-only "
            "schedules (dump them with format='compute_only'; the runtime adds communication itself)"
        )
    raise InputError(
        f"{where}: bad action string {text!r}: expected '<stage><type><micro-batch>' with type F, I, W or B "
        "(e.g. '0F1', '2I0')"
    )


def torch_action_rows(orders: Orders, *, fuse_backward: bool = True, offload: str = "error") -> list[list[str]]:
    """Per-rank action strings in torch's vocabulary (what ``_Action.from_str`` parses).

    Row d is device (rank) d; F -> ``"sFj"``, B -> ``"sIj"`` (or, with ``fuse_backward``,
    ``"sBj"`` when the device runs its own W right after it, the W then omitted), W ->
    ``"sWj"``: the passes :func:`~fxpipe.ir.lowering.compute_only` and
    :func:`~fxpipe.ir.lowering.merge_backward`, written with :func:`torch_text`.

    Parameters
    ----------
    orders : Orders
        Per-device programs.
    fuse_backward : bool
        Write a B immediately followed on its device by its own W as torch's full backward.
    offload : {"error", "drop"}
        torch has no offload/reload action: refuse O/R actions, or leave them out.

    Returns
    -------
    list of list of str

    Raises
    ------
    InputError
        On O/R actions with ``offload="error"``, or a bad ``offload`` value.
    """
    if offload not in ("error", "drop"):
        raise InputError(f"offload must be 'error' or 'drop', got {offload!r}")
    out = []
    for d, row in enumerate(orders.actions):
        comp = compute_only(row)
        if offload == "error" and len(comp) != len(row):
            bad = next(a for a in row if not a.is_compute)
            raise InputError(
                f"device {d} runs {bad}: torch's schedule format has no offload/reload action; "
                "drop them (offload='drop', CLI: a warning) to write the compute actions only"
            )
        out.append([torch_text(a) for a in (merge_backward(comp) if fuse_backward else comp)])
    return out


def orders_to_torch_csv(orders: Orders, *, fuse_backward: bool = True, offload: str = "error") -> str:
    """torch's compute-only CSV text of ``orders`` (one row per device = pipeline rank).

    Parameters
    ----------
    orders : Orders
        Per-device programs; device d becomes rank d (row d).
    fuse_backward : bool
        Write a B that its device runs immediately before its own W (same stage and
        micro-batch, no compute action between them) as torch's full backward ``B``; other
        B actions become ``I``. False: always ``I`` and ``W``.
    offload : {"error", "drop"}
        torch has no offload/reload action: ``"error"`` refuses orders with O/R actions,
        ``"drop"`` leaves them out (the stashes then stay on the device, which needs more
        memory than the schedule planned).

    Returns
    -------
    str
        CSV text (``\\r\\n`` line ends, as Python's ``csv`` writes and torch reads).

    Raises
    ------
    InputError
        On O/R actions with ``offload="error"``, or a bad ``offload`` value.
    """
    buf = io.StringIO()
    writer = csv.writer(buf)
    for cells in torch_action_rows(orders, fuse_backward=fuse_backward, offload=offload):
        writer.writerow(cells)
    return buf.getvalue()


def _parse_cell(cell: str, where: str) -> list[Action]:
    """fxpipe's actions of one CSV cell: torch's full backward as B then W, an overlap as its parts."""
    m = _OVERLAP.match(cell)
    if m is not None:
        out: list[Action] = []
        for sub in m.group(1).split(";"):
            if sub.strip():
                out.extend(_parse_cell(sub.strip(), where))
        return out
    return split_full_backward([parse_torch_action(cell, where)])


def orders_from_torch_csv(text: str, device_of_stage: Sequence[int] | None = None, *, source: str = "csv") -> Orders:
    """Per-device orders from torch's compute-only CSV text (the inverse of :func:`orders_to_torch_csv`).

    Row r is rank (device) r. ``I`` becomes fxpipe's B, torch's full backward ``B`` becomes
    B followed by W, ``(a;b)OVERLAP_F_B`` its sub-actions in order; empty cells are skipped.

    Parameters
    ----------
    text : str
        The CSV text.
    device_of_stage : sequence of int, optional
        The expected placement; default: inferred from the rows (stage s is on the row
        where its actions are).
    source : str
        Name used in error messages (e.g. the file name).

    Returns
    -------
    Orders

    Raises
    ------
    InputError
        On a bad cell, a communication action, a stage on two rows, a stage without any
        action, or a placement that disagrees with ``device_of_stage``.
    """
    rows: list[list[Action]] = []
    stage_row: dict[int, int] = {}
    for r, cells in enumerate(csv.reader(io.StringIO(text))):
        acts: list[Action] = []
        for c, cell in enumerate(cells):
            cell = cell.strip()
            if not cell:
                continue
            for a in _parse_cell(cell, f"{source}: rank {r}, column {c}"):
                prev = stage_row.setdefault(a.stage, r)
                if prev != r:
                    raise InputError(f"{source}: stage {a.stage} has actions on rank {prev} and on rank {r}")
                acts.append(a)
        rows.append(acts)
    if not rows:
        raise InputError(f"{source}: the CSV has no rows (one row per pipeline rank expected)")
    S = 1 + max(stage_row, default=-1)
    missing = sorted(set(range(S)) - set(stage_row))
    if missing:
        raise InputError(f"{source}: stage {missing[0]} has no action (stages must be 0..{S - 1})")
    inferred = tuple(stage_row[s] for s in range(S))
    if device_of_stage is not None:
        want = tuple(int(d) for d in device_of_stage)
        if want != inferred:
            raise InputError(f"{source}: the rows place stages on ranks {list(inferred)}, expected {list(want)}")
    try:
        return Orders(inferred, tuple(tuple(r) for r in rows))
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None


def write_torch_csv(path: str | os.PathLike, orders: Orders, *, fuse_backward: bool = True, offload: str = "error") -> Path:
    """Write :func:`orders_to_torch_csv` to ``path`` atomically (for ``pipeline_parallel_schedule_csv``)."""
    return write_text_atomic(path, orders_to_torch_csv(orders, fuse_backward=fuse_backward, offload=offload))


def read_torch_csv(path: str | os.PathLike, device_of_stage: Sequence[int] | None = None) -> Orders:
    """Read a torch CSV schedule file (see :func:`orders_from_torch_csv`)."""
    return orders_from_torch_csv(read_text(path, "torch CSV schedule"), device_of_stage, source=str(path))
