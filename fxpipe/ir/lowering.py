"""Lowering passes over typed actions: ``list[Action] -> list[Action]``, no text, no torch.

A device's program (:meth:`fxpipe.ir.Orders.of_device`) becomes the program a pipeline
runtime executes through a sequence of small passes, each taking one program and returning a
new list (the input is never modified), in the shape of torch's ``_merge_bw`` /
``_add_send_recv`` (torch/distributed/pipelining/schedules.py):

* :func:`compute_only` leaves out the offload/reload (O/R) actions, which torch's runtime does
  not know (fxpipe issues them itself, :mod:`fxpipe.codegen.offload`);
* :func:`merge_backward` fuses a B that the device runs immediately before its own W (same
  stage and micro-batch) into one full backward ``BW`` (torch's ``B``: one autograd pass
  instead of two);
* :func:`full_backward` turns every split backward of some stages into a full backward at the
  B (a fallback for stages whose split backward cannot be separated);
* :func:`split_full_backward` is the inverse of :func:`merge_backward` (``BW`` -> B, W), used
  when reading torch's files back into :class:`~fxpipe.ir.Orders`.

Text appears only at the boundaries: files (:meth:`Orders.to_dict`,
:mod:`fxpipe.ir.torch_csv`) and torch's ``_Action`` (:mod:`fxpipe.codegen.runtime`), both in
torch's vocabulary through :data:`fxpipe.ir.torch_csv.TORCH_TYPE`.

References
----------
Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (B/W split).
torch/distributed/pipelining/schedules.py (torch 2.13): ``_merge_bw``.
"""

from __future__ import annotations

from typing import Collection, Iterable

from fxpipe.ir.schedule import FULL_BACKWARD, Action

__all__ = ["compute_only", "merge_backward", "full_backward", "split_full_backward"]


def compute_only(program: Iterable[Action]) -> list[Action]:
    """The program without its offload/reload (O/R) actions."""
    return [a for a in program if a.is_compute]


def merge_backward(program: Iterable[Action]) -> list[Action]:
    """Fuse each B immediately followed by the W of its stage and micro-batch into a full backward ``BW``.

    Only directly adjacent pairs fuse (any action between them keeps them split), as in
    torch's ``_merge_bw``; every other action is kept in place.

    Examples
    --------
    >>> [str(a) for a in merge_backward(map(Action.parse, "0F0 0B0 0W0 0B1 0F1 0W1".split()))]
    ['0F0', '0BW0', '0B1', '0F1', '0W1']
    """
    prog = list(program)
    out: list[Action] = []
    i = 0
    while i < len(prog):
        a = prog[i]
        nxt = prog[i + 1] if i + 1 < len(prog) else None
        if a.type == "B" and nxt == Action(a.stage, "W", a.microbatch):
            out.append(Action(a.stage, FULL_BACKWARD, a.microbatch))
            i += 2
        else:
            out.append(a)
            i += 1
    return out


def full_backward(program: Iterable[Action], stages: Collection[int] | None = None) -> list[Action]:
    """Replace the split backwards (B ... W) of ``stages`` by a full backward ``BW`` at the B.

    The W actions of those stages are left out. The forward / backward-input order is
    unchanged, so deadlock-free programs stay deadlock-free.

    Parameters
    ----------
    program : iterable of Action
    stages : collection of int, optional
        Only the actions of these stages change (default: every stage).
    """
    only = None if stages is None else {int(s) for s in stages}
    out: list[Action] = []
    for a in program:
        if only is not None and a.stage not in only:
            out.append(a)
        elif a.type == "B":
            out.append(Action(a.stage, FULL_BACKWARD, a.microbatch))
        elif a.type != "W":
            out.append(a)
    return out


def split_full_backward(program: Iterable[Action]) -> list[Action]:
    """Each full backward ``BW`` as its B followed by its W (the inverse of :func:`merge_backward`)."""
    out: list[Action] = []
    for a in program:
        if a.type == FULL_BACKWARD:
            out += [Action(a.stage, "B", a.microbatch), Action(a.stage, "W", a.microbatch)]
        else:
            out.append(a)
    return out
