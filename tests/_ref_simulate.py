"""Reference timing of per-device op orders, the oracle of tests/test_schedule_scale.py.

Written from the rules alone (DESIGN.md Contract 3 and the module docstring of
:mod:`fxpipe.schedule.simulate`), as plainly as possible and slowly, sharing no code with the
fast simulator beyond the input check :func:`~fxpipe.schedule.simulate.as_orders`:

* Every step looks at the next compute op of every device whose data predecessors have all
  ended, and times the one that can start first (ties: the lowest device) at
  ``max(device free, predecessors' end + comm)``.
* A copy op (O or R) of stage s must not overlap a copy op of positive length of a stage on
  the same device or in a pcie group with s. Its slot is found by trying every candidate
  start (the earliest: the ready time and every booked end; the latest: the deadline and
  every booked start, less the duration) against every booked copy.
* O goes into the earliest free slot after F; R into the latest free slot after O that ends
  by the start B would have without it, else into the earliest free slot after O, and B
  waits for it.
* With ``respect_memory``, a forward waits for the first event time (from its start on) at
  which its device's memory (the sum of the memory events placed so far up to that time)
  leaves room for its stash.

The times of the tests are sums of halves, so they are exact in floating point and agree with
the fast simulator's bit for bit, whatever the order of the additions.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from fxpipe.errors import InputError
from fxpipe.ir import ScheduledOp, sort_ops
from fxpipe.schedule.simulate import as_orders
from fxpipe.schedule.validate import objective_values


class Timing(NamedTuple):
    ops: tuple
    makespan: float
    stage_span: float


def simulate(problem, orders, *, offload=None, respect_memory=False, method=""):
    """The timed ops and both objective values of ``orders`` (as :func:`fxpipe.schedule.simulate.simulate`;
    ``method`` is accepted and ignored)."""
    S, M, D = problem.num_stages, problem.num_microbatches, problem.num_devices
    checked = as_orders(problem, orders)
    programs = [[(a.stage, a.type, a.microbatch) for a in row if a.is_compute] for row in checked.actions]
    offloaded = set(checked.offloaded())
    for s, j in offload or ():
        if not (0 <= s < S and 0 <= j < M):
            raise InputError(f"offload names (stage {s}, micro-batch {j}) outside the problem")
        offloaded.add((s, j))
    device = problem.device_of_stage

    def copies_conflict(s: int, p: int) -> bool:
        return device[s] == device[p] or any(s in g and p in g for g in problem.pcie_groups)

    end: dict[tuple[int, str, int], float] = {}  # (stage, type, micro-batch) -> end, every op timed so far
    copies: list[tuple[int, float, float]] = []  # (stage, start, end) of every O and R placed so far
    memory: list[list[tuple[float, float]]] = [[] for _ in range(D)]  # per device (time, bytes)
    timed: list[ScheduledOp] = []

    def free(s: int, x: float, dur: float) -> bool:
        """``[x, x + dur]`` overlaps no booked copy of a conflicting stage (zero-length copies never conflict)."""
        if dur <= 0:
            return True
        return all(b <= x or a >= x + dur for p, a, b in copies if b > a and copies_conflict(s, p))

    def earliest_copy(s: int, ready: float, dur: float) -> float:
        starts = sorted({ready} | {b for p, a, b in copies if b >= ready})
        return next(x for x in starts if free(s, x, dur))

    def latest_copy(s: int, lo: float, deadline: float, dur: float) -> float | None:
        starts = sorted({deadline - dur} | {a - dur for p, a, b in copies}, reverse=True)
        return next((x for x in starts if lo <= x <= deadline - dur and free(s, x, dur)), None)

    def place(s: int, j: int, t: str, start: float) -> float:
        fin = start + problem.duration(s, t)
        timed.append(ScheduledOp(s, j, t, start, fin))
        end[(s, t, j)] = fin
        return fin

    def data_ready(s: int, t: str, j: int) -> float | None:
        """Earliest start by the data dependencies of rule 2, None while a predecessor is untimed."""
        preds = {"F": [(s - 1, "F", problem.comm(s - 1))] if s > 0 else [],
                 "B": [(s, "F", 0.0)] + ([(s + 1, "B", problem.comm(s))] if s < S - 1 else []),
                 "W": [(s, "B", 0.0)]}[t]
        if any((p, pt, j) not in end for p, pt, _ in preds):
            return None
        return max([0.0] + [end[(p, pt, j)] + lag for p, pt, lag in preds])

    def fits_from(d: int, est: float, need: float) -> float:
        lim = float(problem.mem_limit[d])
        if not math.isfinite(lim):
            return est
        for t in [est] + sorted({te for te, _ in memory[d] if te > est}):
            if sum(x for te, x in sorted(memory[d]) if te <= t) + need <= lim + 1e-9 * max(1.0, abs(lim)):
                return t
        return est

    device_free = [0.0] * D
    next_op = [0] * D
    while any(next_op[d] < len(programs[d]) for d in range(D)):
        startable = []
        for d in range(D):
            if next_op[d] < len(programs[d]):
                r = data_ready(*programs[d][next_op[d]])
                if r is not None:
                    startable.append((max(device_free[d], r), d))
        if not startable:
            heads = [(d, programs[d][next_op[d]]) for d in range(D) if next_op[d] < len(programs[d])]
            names = [f"{f'stage {s}' if len(problem.stages_of_device(d)) == 1 else f'device {d}'}: {s}{t}{j}"
                     for d, (s, t, j) in heads]
            raise InputError("the orders deadlock: every device waits for an op another device runs later "
                             f"(next ops: {', '.join(names[:8])}); fix the per-device orders")
        start, d = min(startable)
        s, t, j = programs[d][next_op[d]]
        if t == "B" and (s, j) in offloaded:
            dur, after_o = problem.duration(s, "R"), end[(s, "O", j)]
            x = latest_copy(s, after_o, start, dur)
            x = earliest_copy(s, after_o, dur) if x is None else x
            copies.append((s, x, place(s, j, "R", x)))
            memory[d].append((x, float(problem.offload_bytes[s])))
            start = max(start, end[(s, "R", j)])
        if t == "F" and respect_memory:
            start = fits_from(d, start, float(problem.mem_f[s]))
        fin = place(s, j, t, start)
        memory[d].append((start, float({"F": problem.mem_f, "B": problem.mem_b, "W": problem.mem_w}[t][s])))
        if t == "B" and problem.mem_b_transient[s]:  # the replayed forward of a recomputing stage
            memory[d] += [(start, float(problem.mem_b_transient[s])), (fin, -float(problem.mem_b_transient[s]))]
        device_free[d] = fin
        next_op[d] += 1
        if t == "F" and (s, j) in offloaded:
            x = earliest_copy(s, fin, problem.duration(s, "O"))
            copies.append((s, x, place(s, j, "O", x)))
            memory[d].append((end[(s, "O", j)], -float(problem.offload_bytes[s])))

    shift = min((o.start_s for o in timed), default=0.0)
    if not math.isfinite(shift):
        shift = 0.0
    ops = tuple(sort_ops(ScheduledOp(o.stage, o.microbatch, o.type, o.start_s - shift, o.end_s - shift) for o in timed))
    return Timing(ops, *objective_values(problem, list(ops)))
