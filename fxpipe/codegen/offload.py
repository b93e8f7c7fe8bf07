"""Where the offload (O) and reload (R) actions of a device program run in the torch runtime.

A schedule (Contract 3) times O/R ops on a device's copy stream; :func:`fxpipe.ir.schedule_to_orders`
keeps them in the device programs as ``Action(stage, "O"|"R", microbatch)`` at the position where
they are issued. torch's ``_PipelineScheduleRuntime`` knows only compute and communication
actions, so fxpipe executes O/R itself, attached to the compute actions torch runs:

* **Rule.** Each O/R is issued right after the compute action that precedes it in the device
  program (its *anchor*), i.e. exactly where the timed schedule starts it: an offload right after
  the forward (or whatever compute the copy stream was waiting for), a reload right after the
  compute action before the backward that needs it. On CUDA the copy runs on the device's copy
  stream and overlaps the following compute actions; the backward that needs a reloaded stash
  waits for that copy (an event), nothing else does. On CPU the copy is synchronous.
* **Anchors are lowered actions.** The device program is lowered first
  (:func:`fxpipe.codegen.actions.lower_orders`: O/R left out, a ``B`` fused with the ``W`` right
  after it into a full backward ``BW``, torch's ``B``). An O/R anchored after a ``W`` that was
  fused into an earlier full backward is anchored to the last lowered action that still precedes it,
  so the relative order of every O/R and every torch action is kept; fusion only moves a ``W``
  earlier, and no O/R waits for a ``W``.
* **Checks.** An O needs its F before it and its R after it; an R needs its O before it and its
  B after it (:class:`~fxpipe.errors.InputError` otherwise, before anything runs). At run time a
  backward that finds its stash still on the host (its reload never ran) raises
  :class:`fxpipe.codegen.stash.StashError`; nothing is silently recomputed.

Nothing here imports torch: the stash itself (saved-tensor hooks, copies, accounting) lives in
:mod:`fxpipe.codegen.stash`.

References
----------
Wan et al., "PipeOffload: Improving Scalability of Pipeline Parallelism with Memory
Optimization", 2025, Sec. 4.2 (offload/reload slots next to the compute passes, one copy stream
for both directions) and App. C.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from fxpipe.errors import InputError
from fxpipe.ir.schedule import FULL_BACKWARD, Action, Orders
from fxpipe.ir.torch_csv import parse_torch_action, torch_text

__all__ = ["OffloadProgram", "offload_program", "programs_of", "offload_all"]


@dataclass(frozen=True)
class OffloadProgram:
    """The O/R actions of one device, each attached to the lowered compute action after which it is issued.

    Attributes
    ----------
    after : Mapping[Action, tuple[Action, ...]]
        Lowered compute action (F, B, W or the full backward BW: stage, type, micro-batch) ->
        the O/R actions issued right after it, in program order.
    offloaded : frozenset[tuple[int, int]]
        ``(stage, microbatch)`` of every stash this device offloads.
    """

    after: Mapping[Action, tuple[Action, ...]] = field(default_factory=dict)
    offloaded: frozenset = frozenset()

    @property
    def empty(self) -> bool:
        """True when the device offloads nothing."""
        return not self.after

    def memops_after(self, action: Action | str) -> tuple[Action, ...]:
        """The O/R actions to issue right after ``action`` (a lowered Action, or torch's text ``"0I1"``; ``()`` when none)."""
        if not isinstance(action, Action):
            action = parse_torch_action(action, "memops_after")
        return self.after.get(action, ())

    def describe(self) -> str:
        """One line per anchor, in torch's text: ``0F3 -> 0O3``."""
        return "\n".join(f"{torch_text(k)} -> {' '.join(map(str, v))}" for k, v in self.after.items())


def _as_action(a) -> Action:
    return a if isinstance(a, Action) else Action.parse(a)


def _anchor_of(a: Action, present: set[Action]) -> Action | None:
    """The lowered action that runs compute action ``a`` of the device program (None: a W fused into its BW).

    Raises
    ------
    InputError
        If the lowered program has no action for ``a``.
    """
    full = Action(a.stage, FULL_BACKWARD, a.microbatch)
    if a.type == "B" and a not in present:
        return full
    if a.type == "W" and a not in present:
        if full not in present:
            raise InputError(f"device program: {a} has no torch action (neither {torch_text(a)} nor a full backward)")
        return None
    return a


def offload_program(program: Sequence[Action | str], lowered: Sequence[Action | str]) -> OffloadProgram:
    """Attach every O/R of one device program to the lowered compute action after which it is issued.

    Parameters
    ----------
    program : sequence of Action or str
        The device's program in fxpipe's vocabulary (F, B, W, O, R), e.g.
        ``Orders.of_device(d)`` from :func:`fxpipe.ir.schedule_to_orders`.
    lowered : sequence of Action or str
        The same device's compute actions as the runtime executes them (after fusion of ``B`` +
        ``W`` into a full backward): :func:`fxpipe.codegen.actions.lower_orders`' actions, or
        torch action strings (F, I, B, W), whose ``""`` (idle) entries are ignored.

    Returns
    -------
    OffloadProgram

    Raises
    ------
    InputError
        If an O/R has no compute action before it, an O/R pair is incomplete or out of order
        (F, O, R, B per stage and micro-batch), or the lowered actions are not a lowering of the
        program's compute actions (the message names the action).
    """
    prog = [_as_action(a) for a in program]
    typed = [a if isinstance(a, Action) else parse_torch_action(a, f"lowered action {i}") for i, a in enumerate(lowered)]
    typed = [a for a in typed if a is not None]
    present = set(typed)
    pos = {a: i for i, a in enumerate(typed)}
    after: dict[Action, list[Action]] = {}
    anchor: Action | None = None
    seen: dict[tuple[str, int, int], int] = {}
    lowered_order: list[Action] = []
    for i, a in enumerate(prog):
        key = (a.type, a.stage, a.microbatch)
        if key in seen:
            raise InputError(f"device program: {a} appears twice")
        seen[key] = i
        if a.is_compute:
            t = _anchor_of(a, present)
            if t is None:
                continue
            if t not in present:
                raise InputError(
                    f"device program: {a} has no torch action {torch_text(t)} in {[torch_text(x) for x in typed[:8]]}..."
                )
            anchor = t
            lowered_order.append(t)
            continue
        if anchor is None:
            raise InputError(f"device program: {a} comes before any compute action; an offload follows its forward")
        after.setdefault(anchor, []).append(a)
    if [pos[t] for t in lowered_order] != sorted(pos[t] for t in lowered_order) or len(lowered_order) != len(typed):
        raise InputError("the torch actions are not a lowering of the device program's compute actions (order or count differ)")
    return OffloadProgram({k: tuple(v) for k, v in after.items()}, frozenset(_offloaded(seen)))


def _offloaded(seen: Mapping[tuple[str, int, int], int]) -> set[tuple[int, int]]:
    """``(stage, microbatch)`` of every offloaded stash, checking each O/R pair's position.

    ``seen`` maps ``(type, stage, microbatch)`` to the action's index in the device program.
    """
    offloaded = set()
    for (t, s, j), i in seen.items():
        if t == "O":
            f, r, b = seen.get(("F", s, j)), seen.get(("R", s, j)), seen.get(("B", s, j))
            if f is None or f > i:
                raise InputError(f"device program: {s}O{j} is not after its forward {s}F{j}")
            if r is None:
                raise InputError(f"device program: {s}O{j} has no reload {s}R{j}: an offloaded stash must come back before its backward")
            if b is None or not i < r < b:
                raise InputError(
                    f"device program: {s}R{j} must come after {s}O{j} and before the backward {s}B{j} that needs it"
                )
            offloaded.add((s, j))
        elif t == "R" and ("O", s, j) not in seen:
            raise InputError(f"device program: {s}R{j} reloads a stash that is never offloaded ({s}O{j} missing)")
    return offloaded


def programs_of(orders: Orders | Mapping[int, Sequence[tuple[str, int]]]) -> Orders:
    """Per-device :class:`~fxpipe.ir.Orders` from Orders or the per-stage form (O/R kept)."""
    if isinstance(orders, Orders):
        return orders
    return Orders.from_stage_orders(orders)


def offload_all(orders: Orders, stages: Sequence[int] | None = None) -> Orders:
    """The same device programs with every stash of ``stages`` offloaded: ``O`` right after each ``F``, ``R`` right before each ``B``.

    The "fully offloaded" pattern of PipeOffload (App. A) on any F/B/W programs (GPipe, 1F1B,
    ZB-H1, interleaved, V-shaped, ...). O/R actions already in ``orders`` are dropped first.

    Parameters
    ----------
    orders : fxpipe.ir.Orders
        Per-device programs.
    stages : sequence of int, optional
        Stages to offload (default: all but the last, whose stash is used right away).

    Returns
    -------
    fxpipe.ir.Orders

    Raises
    ------
    InputError
        If ``stages`` names a stage outside the placement.
    """
    orders = programs_of(orders)
    S = orders.num_stages
    chosen = set(range(S - 1)) if stages is None else {int(s) for s in stages}
    bad = sorted(s for s in chosen if not 0 <= s < S)
    if bad:
        raise InputError(f"offload_all: stages {bad} are outside 0..{S - 1}")
    rows = []
    for row in orders.actions:
        out: list[Action] = []
        for a in row:
            if not a.is_compute:
                continue
            if a.stage in chosen and a.type == "B":
                out.append(Action(a.stage, "R", a.microbatch))
            out.append(a)
            if a.stage in chosen and a.type == "F":
                out.append(Action(a.stage, "O", a.microbatch))
        rows.append(tuple(out))
    return Orders(orders.device_of_stage, tuple(rows))
