"""Extraction of a Contract-3 schedule from a solution of the schedule MILP."""

from __future__ import annotations

import functools
from typing import Any, Callable

from fxpipe.ir import ScheduledOp, ScheduleProblem, sort_ops
from fxpipe.schedule.milp.builder import MilpVars, device_ops, durations, order_literal

__all__ = ["extract_schedule"]


def extract_schedule(problem: ScheduleProblem, V: MilpVars, values: Callable[[Any], float]) -> list[ScheduledOp]:
    """Turn a MILP solution into Contract-3 ops with exact durations.

    Start times are read from the solution (``end - start == duration`` by construction),
    then a push-right repair re-imposes, in exact floating point, every precedence the
    solution relies on: dependencies with ``t_comm`` (between devices only), the per-device
    compute order, the per-device and per-pcie-group copy order, and the memory relations
    the model assumed (``O.end <= F.start < R.start`` where a stash was counted as off the
    device, ops counted as started before an R start). Shifts are of the order of the
    solver tolerance.

    Parameters
    ----------
    problem : ScheduleProblem
    V : MilpVars
        From :func:`fxpipe.schedule.milp.build_model`.
    values : callable
        Maps a variable to its value in the solution (e.g. ``lambda v: model.getSolVal(sol, v)``).

    Returns
    -------
    list[ScheduledOp]
        Sorted in the canonical order.
    """
    S, M = problem.num_stages, problem.num_microbatches
    u = V.unit_s
    durs = durations(problem)
    start: dict = {}
    for (s, j, c), var in V.E.items():
        start[(s, j, c)] = max(0.0, (values(var) * u) - float(durs[c][s]))
    offl = {key for key, var in V.x.items() if values(var) > 0.5}
    for (s, j) in offl:
        start[(s, j, "O")] = max(0.0, values(V.O[(s, j)]) * u)
        start[(s, j, "R")] = max(0.0, values(V.R[(s, j)]) * u)

    def dur(key):
        return float(durs[key[2]][key[0]])

    # constraints (b, a, kind, gap): start[b] >= (end[a] if kind == "end" else start[a]) + gap
    cons: list[tuple] = []
    for s in range(S):
        for j in range(M):
            if s > 0:
                cons.append(((s, j, "F"), (s - 1, j, "F"), "end", problem.comm(s - 1)))
            if s < S - 1:
                cons.append(((s, j, "B"), (s + 1, j, "B"), "end", problem.comm(s)))
            cons.append(((s, j, "B"), (s, j, "F"), "end", 0.0))
            cons.append(((s, j, "W"), (s, j, "B"), "end", 0.0))
            if (s, j) in offl:
                cons.append(((s, j, "O"), (s, j, "F"), "end", 0.0))
                cons.append(((s, j, "R"), (s, j, "O"), "end", 0.0))
                cons.append(((s, j, "B"), (s, j, "R"), "end", 0.0))
        copy = sorted(((s, j, t) for (s2, j) in offl if s2 == s for t in ("O", "R")),
                      key=lambda k: (start[k], 0 if k[2] == "O" else 1, k[1]))
        for a, b in zip(copy, copy[1:]):
            cons.append((b, a, "end", 0.0))
    for d in range(problem.num_devices):
        comp = _solution_order(V, device_ops(problem, d), values)
        for a, b in zip(comp, comp[1:]):
            cons.append((b, a, "end", 0.0))
    for grp in problem.pcie_groups:
        gs = set(grp)
        copy = sorted(((s, j, t) for (s, j) in offl if s in gs for t in ("O", "R")), key=lambda k: (start[k], k[0], k[1]))
        for a, b in zip(copy, copy[1:]):
            cons.append((b, a, "end", 0.0))
    tiny = "strict"
    for (s, k, l), var in V.g.items():
        if values(var) > 0.5 and (s, l) in offl:
            cons.append(((s, k, "F"), (s, l, "O"), "end", 0.0))
            cons.append(((s, l, "R"), (s, k, "F"), "start", tiny))
    for (s, k, c, j), var in V.q.items():
        if (s, k) not in offl:
            continue
        if c == "F" and values(var) < 0.5:
            cons.append(((s, j, "F"), (s, k, "R"), "start", tiny))
        elif c in ("B", "W") and values(var) > 0.5:
            cons.append(((s, k, "R"), (s, j, c), "start", 0.0))
    for (s, k, l), var in V.w.items():
        if values(var) > 1e-6 and (s, k) in offl and (s, l) in offl:
            cons.append(((s, k, "R"), (s, l, "O"), "end", 0.0))
            cons.append(((s, l, "R"), (s, k, "R"), "start", tiny))
    _push_right(start, cons, dur)

    ops = []
    for key, t0 in start.items():
        s, j, c = key
        ops.append(ScheduledOp(s, j, c, float(t0), float(t0) + dur(key)))
    return sort_ops(ops)


def _solution_order(V: MilpVars, ops: list, values: Callable) -> list[tuple[int, int, str]]:
    """Compute ops of a device in the order the solution's binaries (and fixed orders) say.

    Using the decisions rather than the start times keeps zero-duration ops on the side of
    a tie that the memory accounting assumed.
    """

    def cmp(a, b):
        lit = order_literal(V, a, b)
        if isinstance(lit, int):
            return -1 if lit == 1 else 1
        var, sign = lit
        before = (values(var) > 0.5) == (sign > 0)
        return -1 if before else 1

    return sorted(ops, key=functools.cmp_to_key(cmp))


def _push_right(start: dict, cons: list, dur: Callable) -> None:
    """Raise start times until every constraint holds exactly (Bellman-Ford style sweeps)."""
    scale = max([1.0] + [abs(t) + dur(k) for k, t in start.items()])
    strict_gap = 1e-8 * scale
    for _ in range(200):
        changed = False
        for b, a, kind, gap in cons:
            if b not in start or a not in start:
                continue
            base = start[a] + dur(a) if kind == "end" else start[a]
            if gap == "strict":  # start[b] > base, by more than the validator's event tolerance
                need = base + strict_gap
                if start[b] < need:
                    start[b] = need
                    changed = True
                continue
            need = base + gap
            if start[b] < need:
                start[b] = need
                changed = True
        if not changed:
            return
