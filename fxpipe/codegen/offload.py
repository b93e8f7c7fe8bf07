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
* **Anchors are torch actions.** The device program is lowered to torch actions first
  (:func:`fxpipe.codegen.actions.actions_from_orders`: ``B`` becomes ``I``, or torch's full
  backward ``B`` when fused with the ``W`` right after it). An O/R anchored after a ``W`` that was
  fused into an earlier full backward is anchored to the last torch action that still precedes it,
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
from fxpipe.ir import Action, Orders

__all__ = ["OffloadProgram", "offload_program", "programs_of", "offload_all"]


@dataclass(frozen=True)
class OffloadProgram:
    """The O/R actions of one device, each attached to the torch action after which it is issued.

    Attributes
    ----------
    after : Mapping[str, tuple[Action, ...]]
        torch compute action (``"0F1"``, ``"0I1"``, ``"0B1"``, ``"0W1"``: stage, type,
        micro-batch) -> the O/R actions issued right after it, in program order.
    offloaded : frozenset[tuple[int, int]]
        ``(stage, microbatch)`` of every stash this device offloads.
    """

    after: Mapping[str, tuple[Action, ...]] = field(default_factory=dict)
    offloaded: frozenset = frozenset()

    @property
    def empty(self) -> bool:
        """True when the device offloads nothing."""
        return not self.after

    def memops_after(self, torch_action: str) -> tuple[Action, ...]:
        """The O/R actions to issue right after ``torch_action`` (``()`` when none)."""
        return self.after.get(torch_action, ())

    def describe(self) -> str:
        """One line per anchor: ``0F3 -> 0O3``."""
        return "\n".join(f"{k} -> {' '.join(map(str, v))}" for k, v in self.after.items())


def _as_action(a) -> Action:
    return a if isinstance(a, Action) else Action.parse(a)


def offload_program(program: Sequence[Action | str], torch_actions: Sequence[str]) -> OffloadProgram:
    """Attach every O/R of one device program to the torch action after which it is issued.

    Parameters
    ----------
    program : sequence of Action or str
        The device's program in fxpipe's vocabulary (F, B, W, O, R), e.g.
        ``Orders.of_device(d)`` from :func:`fxpipe.ir.schedule_to_orders`.
    torch_actions : sequence of str
        The same device's compute actions in torch's vocabulary (F, I, B, W) as the runtime
        executes them (after fusion of ``B`` + ``W`` into a full backward ``B``); ``""`` (idle)
        entries are ignored.

    Returns
    -------
    OffloadProgram

    Raises
    ------
    InputError
        If an O/R has no compute action before it, an O/R pair is incomplete or out of order
        (F, O, R, B per stage and micro-batch), or the torch actions are not a lowering of the
        program's compute actions (the message names the action).
    """
    prog = [_as_action(a) for a in program]
    torch_list = [a for a in torch_actions if a]
    present = set(torch_list)
    pos = {a: i for i, a in enumerate(torch_list)}
    after: dict[str, list[Action]] = {}
    anchor: str | None = None
    seen: dict[tuple[str, int, int], int] = {}
    lowered_order: list[str] = []
    for i, a in enumerate(prog):
        key = (a.type, a.stage, a.microbatch)
        if key in seen:
            raise InputError(f"device program: {a} appears twice")
        seen[key] = i
        if a.is_compute:
            if a.type == "F":
                t = f"{a.stage}F{a.microbatch}"
            elif a.type == "B":
                t = f"{a.stage}I{a.microbatch}"
                if t not in present:
                    t = f"{a.stage}B{a.microbatch}"
            else:  # W: its own torch action, or fused into the full backward at its B
                t = f"{a.stage}W{a.microbatch}"
                if t not in present:
                    if f"{a.stage}B{a.microbatch}" not in present:
                        raise InputError(f"device program: {a} has no torch action (neither {t} nor a full backward)")
                    continue
            if t not in present:
                raise InputError(f"device program: {a} has no torch action {t} in {torch_list[:8]}...")
            anchor = t
            lowered_order.append(t)
            continue
        if anchor is None:
            raise InputError(f"device program: {a} comes before any compute action; an offload follows its forward")
        after.setdefault(anchor, []).append(a)
    if [pos[t] for t in lowered_order] != sorted(pos[t] for t in lowered_order) or len(lowered_order) != len(torch_list):
        raise InputError("the torch actions are not a lowering of the device program's compute actions (order or count differ)")
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
    return OffloadProgram({k: tuple(v) for k, v in after.items()}, frozenset(offloaded))


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
