"""Lower per-device :class:`~fxpipe.ir.Orders` to each rank's torch program (typed list-to-list passes).

Codegen's only schedule input is :class:`fxpipe.ir.Orders`: the per-device programs with the
placement of stages on devices, built by the caller from a timed schedule with
:func:`fxpipe.ir.schedule_to_orders` (or by a generator of :mod:`fxpipe.schedule`). Nothing
here calls the scheduler, and nothing here imports torch; torch's ``_Action`` objects are
made from the lowered :class:`~fxpipe.ir.Action` s in :mod:`fxpipe.codegen.runtime`.

fxpipe's actions are ``F`` (forward), ``B`` (backward-input) and ``W`` (backward-weight), plus
``O``/``R`` (offload/reload of a stash) and, after lowering, ``BW`` (full backward).
``torch.distributed.pipelining`` actions are ``F``, ``I`` (backward-input), ``W``
(backward-weight) and ``B`` (full backward), written ``"<stage><type><mb>"`` (``"2I0"``); the
translation is :data:`fxpipe.ir.torch_csv.TORCH_TYPE`. The steps:

* :func:`check_orders` proves the programs complete and deadlock-free on the devices before
  anything runs (the device-level rule torch's runtime follows: a device runs its program in
  order and blocks on the first action whose input has not arrived);
* :func:`lower_orders` lowers them to one list of :class:`~fxpipe.ir.Action` per rank
  (rank = device) by the passes of :mod:`fxpipe.ir.lowering`: O/R actions are left out
  (torch has none; :mod:`fxpipe.codegen.offload` issues them), and a ``B`` immediately followed
  on its device by its own ``W`` is fused into a full backward ``BW``;
  :func:`actions_from_orders` is the same in torch's text (for logs, files and tests);
* :func:`fuse_backward` turns the split backwards of some (or all) stages of torch action
  strings into full backwards, a fallback for stages whose split backward cannot be separated
  (:func:`fxpipe.ir.lowering.full_backward` on typed actions).

Every pass returns new lists and never mutates its input.

References
----------
Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (B/W split, ZB-H1).
Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021, Section 2.2 (interleaved schedules, several stages per device).
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence

from fxpipe.errors import InputError
from fxpipe.ir.lowering import compute_only, full_backward, merge_backward
from fxpipe.ir.schedule import Action, Orders
from fxpipe.ir.torch_csv import parse_torch_action, torch_text

__all__ = [
    "check_orders",
    "lower_orders",
    "actions_from_orders",
    "parse_actions",
    "text_of_actions",
    "fuse_backward",
    "format_actions",
]


def _require_orders(orders: Any) -> Orders:
    if not isinstance(orders, Orders):
        raise InputError(
            f"codegen takes fxpipe.ir.Orders (per-device programs with the placement), got {type(orders).__name__}: "
            "build them with fxpipe.ir.schedule_to_orders(schedule, problem), a generator of fxpipe.schedule, "
            "or Orders.from_stage_orders({stage: [(type, microbatch), ...]}) for one stage per device"
        )
    return orders


def check_orders(orders: Orders, num_microbatches: int) -> None:
    """Check that per-device programs are a complete pipeline step that runs without deadlock.

    Completeness is :meth:`Orders.check` (every stage has one F, B and W of every micro-batch,
    in that order on its device; offloads come with reloads). Then the devices are simulated
    as torch's runtime runs them: each device executes its compute actions in program order
    and waits at the first one whose input is missing: ``F(s, j)`` needs ``F(s-1, j)``,
    ``B(s, j)`` needs ``F(s, j)`` and ``B(s+1, j)`` (the loss on the last stage), ``W(s, j)``
    needs ``B(s, j)``, wherever those stages run. Stages on one device pass tensors locally,
    with the same dependencies.

    Parameters
    ----------
    orders : Orders
    num_microbatches : int
        m >= 1.

    Raises
    ------
    InputError
        On anything but :class:`Orders`, a missing/duplicate/misordered action (naming stage
        and micro-batch) or a deadlock (naming every blocked device and the action it waits at).
    """
    orders = _require_orders(orders)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise InputError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    errs = orders.check(num_microbatches)
    if errs:
        more = f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""
        raise InputError("the orders are not a complete pipeline step: " + "; ".join(errs[:3]) + more)
    _check_deadlock(orders)


def _check_deadlock(orders: Orders) -> None:
    S = orders.num_stages
    programs = [[a for a in row if a.is_compute] for row in orders.actions]
    done: set[tuple[int, str, int]] = set()
    ptr = [0] * len(programs)
    remaining = sum(len(p) for p in programs)

    def ready(s: int, t: str, j: int) -> bool:
        if t == "F":
            return s == 0 or (s - 1, "F", j) in done
        if t == "B":
            return (s, "F", j) in done and (s == S - 1 or (s + 1, "B", j) in done)
        return (s, "B", j) in done

    while remaining:
        progress = False
        for d, prog in enumerate(programs):
            while ptr[d] < len(prog):
                a = prog[ptr[d]]
                if not ready(a.stage, a.type, a.microbatch):
                    break
                done.add((a.stage, a.type, a.microbatch))
                ptr[d] += 1
                remaining -= 1
                progress = True
        if not progress:
            blocked = [f"device {d} waits at {prog[ptr[d]]}" for d, prog in enumerate(programs) if ptr[d] < len(prog)]
            raise InputError(
                "the orders deadlock: every device waits for an action another device runs later ("
                + "; ".join(blocked) + "); fix the per-device orders"
            )


def lower_orders(orders: Orders, num_microbatches: int, *, fuse: bool = True) -> dict[int, list[Action]]:
    """Lower per-device orders to each rank's compute program (rank = device), as typed actions.

    The passes :func:`~fxpipe.ir.lowering.compute_only` then, with ``fuse``,
    :func:`~fxpipe.ir.lowering.merge_backward` on every device's program.

    Parameters
    ----------
    orders : Orders
        Per-device programs with the placement (``orders.device_of_stage``), checked by
        :func:`check_orders`. O/R actions are left out: torch has no offload action.
    num_microbatches : int
        Micro-batches per step m.
    fuse : bool
        Fuse a ``B`` immediately followed on its device by the ``W`` of the same stage and
        micro-batch into a full backward ``BW`` (one autograd pass instead of two).

    Returns
    -------
    dict[int, list[Action]]
        Every stage's compute actions on the rank of its device, in the device's program order.

    Raises
    ------
    InputError
        If ``orders`` is not :class:`Orders`, is incomplete or deadlocks (see :func:`check_orders`).
    """
    check_orders(orders, num_microbatches)
    lowered = {}
    for d, row in enumerate(orders.actions):
        prog = compute_only(row)
        lowered[d] = merge_backward(prog) if fuse else prog
    return lowered


def actions_from_orders(orders: Orders, num_microbatches: int, *, fuse: bool = True) -> dict[int, list[str]]:
    """:func:`lower_orders` written in torch's text, one list of action strings per rank.

    Returns
    -------
    dict[int, list[str]]
        ``{rank: ["0F0", "2F0", "0I0", "0W0", "2B1", ...]}``: every stage's actions on the rank
        of its device, in the device's program order (``B`` -> ``I``, a fused full backward ``B``).

    Raises
    ------
    InputError
        If ``orders`` is not :class:`Orders`, is incomplete or deadlocks (see :func:`check_orders`).

    Examples
    --------
    >>> from fxpipe.ir import Orders
    >>> o = Orders.from_stage_orders({0: [("F", 0), ("B", 0), ("W", 0)], 1: [("F", 0), ("B", 0), ("W", 0)]})
    >>> actions_from_orders(o, 1)
    {0: ['0F0', '0B0'], 1: ['1F0', '1B0']}
    """
    return text_of_actions(lower_orders(orders, num_microbatches, fuse=fuse))


def parse_actions(actions: Mapping[int, Sequence[Any]]) -> dict[int, list[Action]]:
    """Per-rank actions as typed :class:`~fxpipe.ir.Action` s, from torch action strings or Actions.

    ``""`` (an idle step) is dropped; strings are read in torch's vocabulary
    (:func:`fxpipe.ir.torch_csv.parse_torch_action`).

    Raises
    ------
    InputError
        If an action is neither an Action nor a torch compute-action string (the message names
        rank and step).
    """
    out: dict[int, list[Action]] = {}
    for r, acts in actions.items():
        row = []
        for step, a in enumerate(acts):
            act = a if isinstance(a, Action) else parse_torch_action(a, f"rank {r}, step {step}")
            if act is not None:
                row.append(act)
        out[r] = row
    return out


def text_of_actions(actions: Mapping[int, Sequence[Action]]) -> dict[int, list[str]]:
    """Per-rank typed compute actions written in torch's vocabulary (``"0I0"``, ``"2B1"``)."""
    return {r: [torch_text(a) for a in acts] for r, acts in actions.items()}


def fuse_backward(actions: Mapping[int, Sequence[str]], stages: Collection[int] | None = None) -> dict[int, list[str]]:
    """Replace split backwards (``I`` ... ``W``) by a full backward ``B`` at the ``I``.

    A fallback for stages whose split backward cannot be separated (e.g. parameters whose
    gradient path meets no stage input, see :mod:`fxpipe.codegen.shapes`); the text form of
    :func:`fxpipe.ir.lowering.full_backward`. The forward / backward-input order is unchanged,
    so deadlock-free actions stay deadlock-free. Empty strings (idle steps) are dropped.

    Parameters
    ----------
    actions : Mapping[int, Sequence[str]]
        Per-rank torch action strings.
    stages : collection of int, optional
        Only the actions of these stages change (default: every stage).

    Returns
    -------
    dict[int, list[str]]
        New lists; ``actions`` is not modified.

    Raises
    ------
    InputError
        If an action string does not parse (the message names rank and step).
    """
    typed = parse_actions(actions)
    return text_of_actions({r: full_backward(acts, stages) for r, acts in typed.items()})


def format_actions(actions: Mapping[int, Sequence[str | Action]]) -> str:
    """Text table of per-rank actions (one row per rank, torch's vocabulary), for logs and golden tests."""
    return "\n".join(
        f"rank {r}: " + " ".join(a if isinstance(a, str) else torch_text(a) for a in actions[r]) for r in sorted(actions)
    )
