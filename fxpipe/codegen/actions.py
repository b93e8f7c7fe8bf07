"""Lower fxpipe per-stage F/B/W orders to torch action strings (pure list-to-list passes).

fxpipe schedules (Contract 3) use ``F`` (forward), ``B`` (backward-input) and ``W``
(backward-weight). ``torch.distributed.pipelining`` actions are ``F``, ``I`` (backward-input),
``W`` (backward-weight) and ``B`` (full backward = I and W fused), written ``"<stage><type><mb>"``
(``"2I0"``). :func:`actions_from_orders` maps ``B -> I`` and fuses an ``I`` immediately
followed by the ``W`` of the same micro-batch into torch's ``B``; a stage whose order has no
``W`` at all runs full backwards. :func:`check_orders` proves the orders complete and
deadlock-free before anything runs. Nothing here imports torch: the torch ``_Action`` objects
are made from these strings in :mod:`fxpipe.codegen.runtime`.

References
----------
Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (B/W split, ZB-H1).
Narayanan et al., "PipeDream" / 1F1B, SOSP 2019.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fxpipe.errors import InputError

__all__ = [
    "Action",
    "parse_action",
    "actions_from_orders",
    "check_orders",
    "fuse_backward",
    "orders_from_schedule",
    "format_actions",
]

COMPUTE_TYPES = ("F", "B", "I", "W")
_ACTION_RE = re.compile(r"^(\d+)(F|B|I|W)(\d+)$")


@dataclass(frozen=True)
class Action:
    """One compute action: ``stage``, ``type`` in F/B/I/W, ``microbatch``; ``str()`` gives ``"1I0"``."""

    stage: int
    type: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.type}{self.microbatch}"


def parse_action(a: Any, where: str) -> Action | None:
    """Parse ``"<stage><F|B|I|W><microbatch>"``; ``""`` (an idle step) gives None.

    Raises
    ------
    InputError
        Naming ``where`` (rank and step) for a non-string or a string that is not a compute action.
    """
    if not isinstance(a, str):
        raise InputError(f"{where}: action {a!r} is not a string like '0F1' (stage, type, micro-batch)")
    if a == "":
        return None
    m = _ACTION_RE.match(a)
    if m is None:
        raise InputError(
            f"{where}: bad action string {a!r}: expected '<stage><type><micro-batch>' with type F, B, I or W "
            "(e.g. '0F1', '2I0'); communication actions are added by the runtime"
        )
    return Action(int(m.group(1)), m.group(2), int(m.group(3)))


_TYPES_IN = {"F": "F", "B": "I", "I": "I", "W": "W"}


def _norm_orders(orders: Mapping[int, Sequence[tuple[str, int]]], num_stages: int, num_microbatches: int | None):
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise InputError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    keys = sorted(int(k) for k in orders)
    if keys != list(range(num_stages)):
        raise InputError(f"orders must have one entry per stage 0..{num_stages - 1}, got stages {keys}")
    out: dict[int, list[tuple[str, int]]] = {}
    for s in range(num_stages):
        ops = []
        for item in orders[s] if s in orders else orders[str(s)]:  # type: ignore[index]
            try:
                t, j = item
            except (TypeError, ValueError):
                raise InputError(f"stage {s}: order items must be (type, microbatch) pairs, got {item!r}") from None
            t = str(t)
            if t in ("O", "R"):  # offload/reload do not change compute order
                continue
            if t not in _TYPES_IN:
                raise InputError(f"stage {s}: unknown op type {t!r} (expected F, B, W; O/R are ignored)")
            try:
                ok = not isinstance(j, (bool, str, bytes)) and int(j) == j and int(j) >= 0
            except (TypeError, ValueError, OverflowError):
                ok = False
            if not ok:
                raise InputError(f"stage {s}: micro-batch index must be an integer >= 0, got {j!r}")
            ops.append((_TYPES_IN[t], int(j)))
        out[s] = ops
    # micro-batch bookkeeping
    m = num_microbatches
    if m is None:
        m = 1 + max((j for ops in out.values() for _, j in ops), default=-1)
    for s, ops in out.items():
        has_w = any(t == "W" for t, _ in ops)
        seen: dict[str, set[int]] = {"F": set(), "I": set(), "W": set()}
        for t, j in ops:
            if j >= m:
                raise InputError(f"stage {s}, micro-batch {j}: index >= number of micro-batches {m}")
            if j in seen[t]:
                raise InputError(f"stage {s}, micro-batch {j}: op {t} appears twice")
            if t == "I" and j not in seen["F"]:
                raise InputError(f"stage {s}, micro-batch {j}: backward before its forward")
            if t == "W" and j not in seen["I"]:
                raise InputError(f"stage {s}, micro-batch {j}: W (backward-weight) before its B (backward-input)")
            seen[t].add(j)
        for t in ("F", "I"):
            missing = sorted(set(range(m)) - seen[t])
            if missing:
                name = "F" if t == "F" else "B"
                raise InputError(f"stage {s}: no {name} for micro-batches {missing}")
        if has_w and seen["W"] != seen["I"]:
            raise InputError(f"stage {s}: no W for micro-batches {sorted(seen['I'] - seen['W'])}")
    return out, m


def check_orders(orders: Mapping[int, Sequence[tuple[str, int]]], num_stages: int, num_microbatches: int | None = None) -> None:
    """Check that per-stage orders are complete and can run without deadlock.

    Each stage executes its list in order; ``F(s, j)`` waits for ``F(s-1, j)`` and a backward
    ``B(s, j)`` waits for ``B(s+1, j)`` (and for ``F(s, j)`` on the last stage), as in the
    runtime. The check simulates the stages and reports the op each blocked stage waits on.

    Raises
    ------
    InputError
        On a missing/duplicate op, an op before its dependency on the same stage, or a
        deadlock (naming the blocked stage, op and micro-batch).
    """
    norm, _ = _norm_orders(orders, num_stages, num_microbatches)
    _check_deadlock(norm, num_stages)


def _check_deadlock(norm: Mapping[int, Sequence[tuple[str, int]]], num_stages: int) -> None:
    """Simulate normalised orders (``_norm_orders`` output); InputError on a deadlock."""
    S = num_stages
    done: set[tuple[int, str, int]] = set()
    ptr = {s: 0 for s in range(S)}
    total = sum(len(v) for v in norm.values())
    count = 0
    while count < total:
        progress = False
        for s in range(S):
            while ptr[s] < len(norm[s]):
                t, j = norm[s][ptr[s]]
                if t == "F":
                    ok = s == 0 or (s - 1, "F", j) in done
                elif t == "I":
                    ok = (s, "F", j) in done and (s == S - 1 or (s + 1, "I", j) in done)
                else:
                    ok = (s, "I", j) in done
                if not ok:
                    break
                done.add((s, t, j))
                ptr[s] += 1
                count += 1
                progress = True
        if not progress:
            blocked = []
            for s in range(S):
                if ptr[s] < len(norm[s]):
                    t, j = norm[s][ptr[s]]
                    blocked.append(f"stage {s} waits at {'B' if t == 'I' else t} of micro-batch {j}")
            raise InputError("the per-stage orders deadlock: " + "; ".join(blocked))


def actions_from_orders(
    orders: Mapping[int, Sequence[tuple[str, int]]],
    num_stages: int,
    *,
    num_microbatches: int | None = None,
    fuse: bool = True,
) -> dict[int, list[str]]:
    """Convert fxpipe per-stage op orders to torch action strings, one list per rank.

    Parameters
    ----------
    orders : Mapping[int, Sequence[tuple[str, int]]]
        ``{stage: [(type, microbatch), ...]}`` with type ``F``, ``B`` (backward-input) or ``W``
        (backward-weight); ``O``/``R`` (offload/reload) are ignored here. A stage with no
        ``W`` at all runs full backwards.
    num_stages : int
        Number of stages S (= ranks).
    num_microbatches : int, optional
        Checked against the orders; inferred when omitted.
    fuse : bool
        Fuse a ``B`` immediately followed by the ``W`` of the same micro-batch into torch's
        full backward ``B`` (one autograd pass instead of two).

    Returns
    -------
    dict[int, list[str]]
        ``{rank: ["0F0", "0F1", "0I0", "0W0", "0B1", ...]}`` with rank = stage.

    Raises
    ------
    InputError
        If the orders are incomplete, inconsistent or deadlock (see :func:`check_orders`).

    Examples
    --------
    >>> actions_from_orders({0: [("F", 0), ("B", 0), ("W", 0)], 1: [("F", 0), ("B", 0), ("W", 0)]}, 2)
    {0: ['0F0', '0B0'], 1: ['1F0', '1B0']}
    """
    norm, _ = _norm_orders(orders, num_stages, num_microbatches)
    _check_deadlock(norm, num_stages)
    out: dict[int, list[str]] = {}
    for s, ops in norm.items():
        has_w = any(t == "W" for t, _ in ops)
        acts: list[str] = []
        i = 0
        while i < len(ops):
            t, j = ops[i]
            if t == "I" and not has_w:
                acts.append(f"{s}B{j}")
            elif t == "I" and fuse and i + 1 < len(ops) and ops[i + 1] == ("W", j):
                acts.append(f"{s}B{j}")
                i += 1
            else:
                acts.append(f"{s}{t}{j}")
            i += 1
        out[s] = acts
    return out


def fuse_backward(actions: Mapping[int, Sequence[str]]) -> dict[int, list[str]]:
    """Fallback: replace every split backward (``I`` ... ``W``) by a full backward ``B`` at the ``I``.

    Use when a stage's split backward is not supported (e.g. custom autograd functions whose
    weight gradients cannot be separated); the forward/backward-input order is unchanged, so a
    deadlock-free schedule stays deadlock-free. Empty strings (idle steps) are dropped.

    Raises
    ------
    InputError
        If an action string does not parse (the message names rank and step).
    """
    out: dict[int, list[str]] = {}
    for r, acts in actions.items():
        new = []
        for step, a in enumerate(acts):
            act = parse_action(a, f"rank {r}, step {step}")
            if act is None or act.type == "W":
                continue
            new.append(f"{act.stage}B{act.microbatch}" if act.type == "I" else str(act))
        out[r] = new
    return out


def orders_from_schedule(schedule: Any, num_stages: int | None = None) -> dict[int, list[tuple[str, int]]]:
    """Per-stage compute order of an ``fxpipe.ir.Schedule`` (ops sorted by start time).

    Parameters
    ----------
    schedule : fxpipe.ir.Schedule or Mapping
        Anything with ``ops`` whose items have ``stage``, ``microbatch``, ``type``, ``start_s``
        (attributes or dict keys).
    num_stages : int, optional
        Number of stages; defaults to 1 + the largest stage index.

    Returns
    -------
    dict[int, list[tuple[str, int]]]
        ``{stage: [(type, microbatch), ...]}`` with only F, B, W ops, ordered by
        ``(start_s, F < B < W, microbatch)``.
    """
    ops = schedule["ops"] if isinstance(schedule, Mapping) else schedule.ops

    def get(o, k):
        return o[k] if isinstance(o, Mapping) else getattr(o, k)

    rank = {"F": 0, "B": 1, "W": 2}
    S = num_stages if num_stages is not None else 1 + max(int(get(o, "stage")) for o in ops)
    out: dict[int, list[tuple[str, int]]] = {s: [] for s in range(S)}
    rows = sorted(
        (float(get(o, "start_s")), rank[str(get(o, "type"))], int(get(o, "microbatch")), int(get(o, "stage")), str(get(o, "type")))
        for o in ops
        if str(get(o, "type")) in rank
    )
    for _, _, j, s, t in rows:
        if s not in out:
            raise InputError(f"schedule op on stage {s} outside 0..{S - 1}")
        out[s].append((t, j))
    return out


def format_actions(actions: Mapping[int, Sequence[str]]) -> str:
    """Text table of per-rank actions (one row per rank), for logs and golden tests."""
    return "\n".join(f"rank {r}: " + " ".join(actions[r]) for r in sorted(actions))
