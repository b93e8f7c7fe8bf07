"""torch's CSV pipeline-schedule format, read and written as text (no torch import).

``torch.distributed.pipelining``'s multi-stage schedules (``PipelineScheduleMulti._load_csv``
/ ``_dump_csv`` and ``_PipelineScheduleRuntime._load_csv(format="compute_only")``, torch
2.6-2.13) and torchtitan's ``pipeline_parallel_schedule_csv`` option read a schedule as a CSV
file with one row per pipeline rank; each cell is one action of that rank, in program order,
written like ``_Action.__repr__``: ``<stage><type><micro-batch>`` with type

* ``F`` forward,
* ``I`` backward-input (fxpipe's ``B``),
* ``W`` backward-weight (fxpipe's ``W``),
* ``B`` full backward (backward-input and backward-weight at once: fxpipe's ``B`` followed
  by its ``W``),

an empty cell being a no-op, and ``(a;b)OVERLAP_F_B`` an overlapped forward/backward pair
(DualPipe-V). The row number is the rank; torch infers which rank holds which stage from the
cells. torch has no offload/reload action.

:func:`orders_to_torch_csv` writes :class:`~fxpipe.ir.schedule.Orders` in this format (a B
immediately followed on its device by its own W may be written as torch's full backward
``B``); :func:`orders_from_torch_csv` reads it back (``I`` -> B, ``B`` -> B then W,
``OVERLAP_F_B`` -> its sub-actions in order).

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
from typing import Sequence

from fxpipe.errors import InputError
from fxpipe.io import read_text, write_text_atomic
from fxpipe.ir.schedule import Action, Orders

__all__ = ["torch_action_rows", "orders_to_torch_csv", "orders_from_torch_csv", "write_torch_csv", "read_torch_csv"]

_CELL = re.compile(r"^(\d+)(F|I|B|W)(\d+)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_TORCH_NON_COMPUTE = re.compile(r"^(\d+)(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")


def torch_action_rows(orders: Orders, *, fuse_backward: bool = True, offload: str = "error") -> list[list[str]]:
    """Per-rank action strings in torch's vocabulary (what ``_Action.from_str`` parses).

    Row d is device (rank) d; F -> ``"sFj"``, B -> ``"sIj"`` (or, with ``fuse_backward``,
    ``"sBj"`` when the device runs its own W right after it, the W then omitted), W ->
    ``"sWj"``.

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
        if offload == "error":
            bad = [a for a in row if not a.is_compute]
            if bad:
                raise InputError(
                    f"device {d} runs {bad[0]}: torch's schedule format has no offload/reload action; "
                    "drop them (offload='drop', CLI: a warning) to write the compute actions only"
                )
        comp = [a for a in row if a.is_compute]
        cells: list[str] = []
        i = 0
        while i < len(comp):
            a = comp[i]
            if a.type == "F":
                cells.append(f"{a.stage}F{a.microbatch}")
            elif a.type == "W":
                cells.append(f"{a.stage}W{a.microbatch}")
            else:  # B: backward-input, or a full backward when its W follows at once
                nxt = comp[i + 1] if i + 1 < len(comp) else None
                if fuse_backward and nxt is not None and nxt == Action(a.stage, "W", a.microbatch):
                    cells.append(f"{a.stage}B{a.microbatch}")
                    i += 1
                else:
                    cells.append(f"{a.stage}I{a.microbatch}")
            i += 1
        out.append(cells)
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
    m = _CELL.match(cell)
    if m is not None:
        s, t, j = int(m.group(1)), m.group(2), int(m.group(3))
        if t == "F":
            return [Action(s, "F", j)]
        if t == "I":
            return [Action(s, "B", j)]
        if t == "W":
            return [Action(s, "W", j)]
        return [Action(s, "B", j), Action(s, "W", j)]  # torch's full backward
    m = _OVERLAP.match(cell)
    if m is not None:
        out: list[Action] = []
        for sub in m.group(1).split(";"):
            if sub.strip():
                out.extend(_parse_cell(sub.strip(), where))
        return out
    if _TORCH_NON_COMPUTE.match(cell):
        raise InputError(
            f"{where}: {cell!r} is a communication/sharding action; fxpipe reads torch's compute-only "
            "schedules (dump them with format='compute_only')"
        )
    raise InputError(
        f"{where}: bad action {cell!r}: expected <stage><F|I|B|W><micro-batch> (e.g. '2F0'), "
        "'(a;b)OVERLAP_F_B' or an empty cell"
    )


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
