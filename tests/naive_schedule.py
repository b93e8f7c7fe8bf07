"""Exhaustive-search oracle for tiny pipeline scheduling problems (no MILP solver).

:func:`exhaustive_optimum` enumerates every *class* of schedules and times each class
optimally with an LP (scipy's HiGHS), so it is independent of the MILP in
``fxpipe.schedule.milp``. A class fixes

* the order of the F/B/W ops of every stage (every interleaving with F_j < B_j < W_j);
* which (stage, micro-batch) stashes are offloaded (only when some memory limit is finite:
  with unlimited memory offloading can only add constraints);
* the order of the O/R ops on every copy resource (a stage's copy stream, or a whole pcie
  group);
* for every O the compute op before whose start it ends and for every R the compute op
  before whose start it starts (memory is evaluated from this exactly, Contract 3 rule 5).

With all orders fixed every constraint of Contract 3 is a difference constraint, so the
optimal timing of a class is an LP; the minimum over classes is the optimum. Strict orders
("R starts after op k starts") are relaxed to their closure (>=), and every candidate is
re-checked with :func:`fxpipe.schedule.validate.check_schedule`; a class whose optimum is
only an infimum (a tie that breaks memory) is skipped, so the oracle can in principle
report a value slightly above an unattained infimum. Use only for about
2 stages x 2 micro-batches (3 with no memory limit).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy.optimize import linprog

from fxpipe.errors import InfeasibleError
from fxpipe.ir import Schedule, ScheduledOp, ScheduleProblem, sort_ops
from fxpipe.schedule.validate import check_schedule, objective_values


def stage_orders(m: int):
    """Every order of the 3m compute ops of one stage with F_j < B_j < W_j."""
    seqs = []

    def rec(prefix, nxt):
        if len(prefix) == 3 * m:
            seqs.append(tuple(prefix))
            return
        for j in range(m):
            k = nxt[j]
            if k < 3:
                t = "FBW"[k]
                nxt[j] += 1
                prefix.append((t, j))
                rec(prefix, nxt)
                prefix.pop()
                nxt[j] -= 1

    rec([], [0] * m)
    return seqs


def _deadlocks(problem: ScheduleProblem, orders) -> bool:
    """True if the per-stage orders cannot all be executed (cyclic waiting)."""
    return _device_deadlock(problem, [[(s, j, t) for t, j in orders[s]] for s in range(problem.num_stages)])


class _LP:
    """Difference-constraint LP over op start times; minimises the objective."""

    def __init__(self, problem: ScheduleProblem):
        self.p = problem
        self.index: dict[tuple[int, int, str], int] = {}
        self.rows: list[tuple[int, int, float]] = []  # x_a - x_b >= c

    def var(self, key):
        if key not in self.index:
            self.index[key] = len(self.index)
        return self.index[key]

    def ge(self, a, b, c):
        self.rows.append((self.var(a), self.var(b), float(c)))

    def solve(self, first_f, last_w):
        spans = [(self.index[first_f[s]], self.index[last_w[s]]) for s in range(self.p.num_stages)]
        return _lp_optimum(self.p, self.index, self.rows, spans)


def _lp_optimum(p: ScheduleProblem, index: dict, rows: list, spans: list):
    """Minimise the objective over op start times ``x[index[op]]`` subject to ``rows``
    (``x_a - x_b >= c``); ``spans``: (first op, last op) columns whose distance (plus the
    last op's duration) is a span, for ``stage_span``. Returns (value, ops) or None."""
    n = len(index)
    dur = np.zeros(n)
    for (s, j, t), i in index.items():
        dur[i] = p.duration(s, t)
    # variables: x_0..x_{n-1}, C, z (z <= every start, for makespan)
    nv = n + 2
    A, b = [], []
    for a, bb, c in rows:  # x_a - x_b >= c  ->  -x_a + x_b <= -c
        row = np.zeros(nv)
        row[a] -= 1
        row[bb] += 1
        A.append(row)
        b.append(-c)
    C, z = n, n + 1
    if p.objective == "makespan":
        for i in range(n):
            row = np.zeros(nv)  # x_i + d_i - z <= C
            row[i] += 1
            row[z] -= 1
            row[C] -= 1
            A.append(row)
            b.append(-dur[i])
            row = np.zeros(nv)  # z <= x_i
            row[z] += 1
            row[i] -= 1
            A.append(row)
            b.append(0.0)
    else:
        for f, w in spans:
            row = np.zeros(nv)
            row[w] += 1
            row[f] -= 1
            row[C] -= 1
            A.append(row)
            b.append(-dur[w])
    cost = np.zeros(nv)
    cost[C] = 1.0
    bounds = [(0, None)] * n + [(None, None), (None, None)]
    res = linprog(cost, A_ub=np.array(A), b_ub=np.array(b), bounds=bounds, method="highs")
    if res.status != 0:
        return None
    x = res.x
    ops = [ScheduledOp(s, j, t, float(x[i]), float(x[i] + dur[i])) for (s, j, t), i in index.items()]
    return float(res.fun), ops


def _timing_lp(problem, orders, copy_orders, gaps, offload):
    """Optimal timing of one class; returns (value, ops) or None."""
    p = problem
    S = p.num_stages
    lp = _LP(p)
    for s in range(S):
        for (t, j) in orders[s]:
            lp.var((s, j, t))
    for s in range(S):
        seq = orders[s]
        for k in range(1, len(seq)):
            (t0, j0), (t1, j1) = seq[k - 1], seq[k]
            lp.ge((s, j1, t1), (s, j0, t0), p.duration(s, t0))
        for j in range(p.num_microbatches):
            if s > 0:
                lp.ge((s, j, "F"), (s - 1, j, "F"), p.duration(s - 1, "F") + p.comm(s - 1))
            if s < S - 1:
                lp.ge((s, j, "B"), (s + 1, j, "B"), p.duration(s + 1, "B") + p.comm(s))
            else:
                lp.ge((s, j, "B"), (s, j, "F"), p.duration(s, "F"))
            lp.ge((s, j, "W"), (s, j, "B"), p.duration(s, "B"))
    for (s, j) in offload:
        d = p.duration(s, "O")
        lp.ge((s, j, "O"), (s, j, "F"), p.duration(s, "F"))
        lp.ge((s, j, "B"), (s, j, "R"), d)
        lp.ge((s, j, "R"), (s, j, "O"), d)
    for seq in copy_orders:
        for k in range(1, len(seq)):
            a, b = seq[k - 1], seq[k]
            lp.ge(b, a, p.duration(a[0], a[2]))
    # gap of each copy event within its stage's compute sequence:
    # g means compute op g-1 starts at or before the event, compute op g at or after it.
    for key, g in gaps.items():
        s, j, t = key
        seq = orders[s]
        shift = p.duration(s, "O") if t == "O" else 0.0  # the event is O's end, R's start
        if g > 0:
            tp, jp = seq[g - 1]
            lp.ge(key, (s, jp, tp), -shift)
        if g < len(seq):
            tn, jn = seq[g]
            lp.ge((s, jn, tn), key, shift)
    first_f = {s: next((s, j, t) for t, j in orders[s] if t == "F") for s in range(S)}
    last_w = {s: next((s, j, t) for t, j in reversed(orders[s]) if t == "W") for s in range(S)}
    return lp.solve(first_f, last_w)


def _memory_ok(problem, s, order, events) -> bool:
    """Memory of stage s at every compute start and R start, for a fixed event class.

    ``events``: list of (gap, kind, j) in copy order with kind 'O' (end) / 'R' (start).
    """
    lim = float(problem.mem_limit[s])
    if not math.isfinite(lim):
        return True
    tol = 1e-9 * max(1.0, lim)
    delta = {"F": problem.mem_f[s], "B": problem.mem_b[s], "W": problem.mem_w[s]}
    off = float(problem.offload_bytes[s])
    # timeline: for gap g, first the copy events in gap g (in copy order), then compute op g
    by_gap: dict[int, list] = {}
    for g, kind, j in events:
        by_gap.setdefault(g, []).append((kind, j))
    cur = 0.0
    for g in range(len(order) + 1):
        for kind, j in by_gap.get(g, []):
            if kind == "O":
                cur -= off
            else:
                cur += off
                if cur > lim + tol:
                    return False
        if g < len(order):
            t, _ = order[g]
            tr = float(problem.mem_b_transient[s]) if t == "B" else 0.0
            cur += float(delta[t]) + tr  # a recomputing B replays its forward while it runs
            if cur > lim + tol:
                return False
            cur -= tr
    return True


def _copy_classes(problem, orders, offload):
    """Yield (copy_orders, gaps) for every copy-order / gap class of an offload set."""
    S = problem.num_stages
    # copy resources: connected groups of stages through pcie groups
    parent = list(range(S))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for g in problem.pcie_groups:
        g = list(g)
        for a in g[1:]:
            parent[find(a)] = find(g[0])
    resources: dict[int, list] = {}
    for (s, j) in sorted(offload):
        resources.setdefault(find(s), []).extend([(s, j, "O"), (s, j, "R")])
    res_orders = []
    for ops in resources.values():
        cands = []
        for perm in itertools.permutations(ops):
            seen = set()
            ok = True
            for (s, j, t) in perm:
                if t == "R" and (s, j) not in seen:
                    ok = False
                    break
                seen.add((s, j))
            if ok:
                cands.append(perm)
        res_orders.append(cands)
    pos = {s: {(t, j): k for k, (t, j) in enumerate(orders[s])} for s in range(S)}
    for combo in itertools.product(*res_orders):
        # per stage, the copy events in copy order
        per_stage: dict[int, list] = {}
        for seq in combo:
            for (s, j, t) in seq:
                per_stage.setdefault(s, []).append((s, j, t))
        # gap choices per stage: non-decreasing along the copy order
        stage_choices = []
        for s, evs in per_stage.items():
            n = len(orders[s])
            ranges = []
            for (s_, j, t) in evs:
                if t == "O":
                    ranges.append(range(pos[s][("F", j)] + 1, pos[s][("B", j)] + 1))
                else:
                    ranges.append(range(pos[s][("F", j)] + 1, pos[s][("B", j)] + 1))
            opts = []

            def rec(k, lo, acc):
                if k == len(evs):
                    opts.append(tuple(acc))
                    return
                for g in ranges[k]:
                    if g >= lo:
                        acc.append(g)
                        rec(k + 1, g, acc)
                        acc.pop()

            rec(0, 0, [])
            good = []
            for gs in opts:
                events = [(g, t, j) for g, (_, j, t) in zip(gs, evs)]
                if _memory_ok(problem, s, orders[s], events):
                    good.append(dict(zip(evs, gs)))
            stage_choices.append(good)
        for parts in itertools.product(*stage_choices):
            gaps = {}
            for d in parts:
                gaps.update(d)
            yield combo, gaps


def exhaustive_optimum(problem: ScheduleProblem, *, max_classes: int = 2_000_000):
    """Optimal value and an optimal schedule of a tiny problem by exhaustive search.

    Parameters
    ----------
    problem : ScheduleProblem
        About 2 stages x 2 micro-batches (with offload), 3 x 2 or 2 x 3 without.

    Returns
    -------
    (value, Schedule)
        ``value`` of the problem's objective; the schedule is valid (checked).

    Raises
    ------
    InfeasibleError
        If no class is feasible (the memory limit cannot be met even with offload).
    """
    p = problem
    S, M = p.num_stages, p.num_microbatches
    if np.any(p.stash_footprint > p.mem_limit):  # an F allocates its whole stash before any offload
        raise InfeasibleError("no valid schedule exists: a stage cannot hold one stash")
    per_stage = stage_orders(M)
    finite = any(math.isfinite(x) for x in p.mem_limit)
    pairs = [(s, j) for s in range(S) for j in range(M)]
    # offload subsets: only where a limit is finite (offload never helps otherwise)
    subsets = [()]
    if finite:
        subsets = [
            tuple(c)
            for r in range(len(pairs) + 1)
            for c in itertools.combinations([x for x in pairs if math.isfinite(p.mem_limit[x[0]])], r)
        ]
    # stage-wise memory check without offload prunes compute orders early
    def mem_ok_plain(s, order):
        return _memory_ok(p, s, order, [])

    best_val, best_ops = math.inf, None
    classes = 0
    candidates = []
    for orders in itertools.product(per_stage, repeat=S):
        if _deadlocks(p, orders):
            continue
        res = _timing_lp(p, orders, (), {}, ())
        if res is None:
            continue
        candidates.append((res[0], orders, res[1]))
    candidates.sort(key=lambda x: x[0])
    tol = 1e-9
    for base_val, orders, base_ops in candidates:
        if base_val >= best_val - tol * max(1.0, abs(best_val)):
            break  # offload only adds constraints: no class of this order can do better
        if all(mem_ok_plain(s, orders[s]) for s in range(S)):
            if not check_schedule(p, base_ops):
                best_val, best_ops = base_val, base_ops
            continue
        for sub in subsets[1:]:
            for copy_orders, gaps in _copy_classes(p, orders, sub):
                classes += 1
                if classes > max_classes:
                    raise RuntimeError("exhaustive_optimum: too many classes; use a smaller problem")
                res = _timing_lp(p, orders, copy_orders, gaps, sub)
                if res is None or res[0] >= best_val - tol * max(1.0, abs(best_val)):
                    continue
                if not check_schedule(p, res[1]):
                    best_val, best_ops = res
    return _optimum(p, best_val, best_ops, "memory limit too small even with offload")


def _optimum(p: ScheduleProblem, best_val: float, best_ops, why: str):
    """``(value, Schedule)`` of the best valid ops found by enumeration (InfeasibleError: none)."""
    if best_ops is None:
        raise InfeasibleError(f"no valid schedule exists ({why})")
    makespan, stage_span = objective_values(p, best_ops)
    return best_val, Schedule(ops=tuple(sort_ops(best_ops)), makespan=makespan, stage_span=stage_span,
                              lower_bound_s=best_val, status="optimal", method="exhaustive", objective=p.objective)


# ------------------------------------------------------------------------------ placements
def _device_sequences(problem: ScheduleProblem, d: int, fixed_microbatch_order: bool = False):
    """Every order of the compute ops of device d with F < B < W per (stage, micro-batch) and
    the data dependencies between its own stages (F up, B down the chain). Without
    ``fixed_microbatch_order`` micro-batches may run in any order (the independent oracle of
    Contract 3 rule 3 with placements); with it, each type runs in micro-batch order on each
    stage (the exchange argument of OptPipe Section 4.1.1: micro-batches are identical)."""
    M = problem.num_microbatches
    stages = problem.stages_of_device(d)
    ops = [(s, j, t) for s in stages for j in range(M) for t in "FBW"]
    preds = {o: set() for o in ops}
    for s in stages:
        for j in range(M):
            preds[(s, j, "B")].add((s, j, "F"))
            preds[(s, j, "W")].add((s, j, "B"))
            if fixed_microbatch_order and j > 0:
                for t in "FBW":
                    preds[(s, j, t)].add((s, j - 1, t))
            for s2 in stages:
                if s2 > s:
                    preds[(s2, j, "F")].add((s, j, "F"))
                    preds[(s, j, "B")].add((s2, j, "B"))
    out = []

    def rec(prefix, done):
        if len(prefix) == len(ops):
            out.append(tuple(prefix))
            return
        for o in ops:
            if o not in done and preds[o] <= done:
                done.add(o)
                prefix.append(o)
                rec(prefix, done)
                prefix.pop()
                done.discard(o)

    rec([], set())
    return out


def _device_memory_ok(problem: ScheduleProblem, d: int, seq) -> bool:
    lim = float(problem.mem_limit[d])
    if not math.isfinite(lim):
        return True
    delta = {"F": problem.mem_f, "B": problem.mem_b, "W": problem.mem_w}
    cur = 0.0
    for s, _, t in seq:
        tr = float(problem.mem_b_transient[s]) if t == "B" else 0.0
        cur += float(delta[t][s]) + tr
        if cur > lim * (1 + 1e-9) + 1e-12:
            return False
        cur -= tr
    return True


def _device_lp(problem: ScheduleProblem, seqs):
    """Optimal timing of fixed per-device orders (difference constraints), or None."""
    p = problem
    S, M = p.num_stages, p.num_microbatches
    keys = [o for seq in seqs for o in seq]
    index = {k: i for i, k in enumerate(keys)}
    dur = np.array([p.duration(s, t) for s, _, t in keys])
    rows = []  # x_a - x_b >= c
    for seq in seqs:
        for a, b in zip(seq, seq[1:]):
            rows.append((index[b], index[a], dur[index[a]]))
    for s in range(S):
        for j in range(M):
            if s > 0:
                rows.append((index[(s, j, "F")], index[(s - 1, j, "F")], p.duration(s - 1, "F") + p.comm(s - 1)))
            if s < S - 1:
                rows.append((index[(s, j, "B")], index[(s + 1, j, "B")], p.duration(s + 1, "B") + p.comm(s)))
            rows.append((index[(s, j, "B")], index[(s, j, "F")], p.duration(s, "F")))
            rows.append((index[(s, j, "W")], index[(s, j, "B")], p.duration(s, "B")))
    return _lp_optimum(p, index, rows, [(index[seq[0]], index[seq[-1]]) for seq in seqs])


def exhaustive_device_optimum(problem: ScheduleProblem, *, max_combinations: int = 200_000,
                              fixed_microbatch_order: bool = False):
    """Optimal value of a tiny problem with any placement and no offload, by enumeration.

    Every combination of per-device op orders (:func:`_device_sequences`) that fits each
    device's memory (memory at an op start depends only on the device's own order) and does
    not deadlock is timed optimally with an LP; the best valid one is returned. Use for
    about 2 devices x 2 stages x 1 micro-batch (2 micro-batches with
    ``fixed_microbatch_order``).

    Returns
    -------
    (value, Schedule)

    Raises
    ------
    InfeasibleError
        If no combination fits memory.
    """
    p = problem
    per_dev = []
    for d in range(p.num_devices):
        seqs = [q for q in _device_sequences(p, d, fixed_microbatch_order) if _device_memory_ok(p, d, q)]
        per_dev.append(seqs)
    total = 1
    for x in per_dev:
        total *= max(1, len(x))
    if total > max_combinations:
        raise RuntimeError(f"exhaustive_device_optimum: {total} combinations; use a smaller problem")
    best_val, best_ops = math.inf, None
    for combo in itertools.product(*per_dev):
        if _device_deadlock(p, combo):
            continue
        res = _device_lp(p, combo)
        if res is None or res[0] >= best_val - 1e-9 * max(1.0, abs(best_val)):
            continue
        if not check_schedule(p, res[1]):
            best_val, best_ops = res
    return _optimum(p, best_val, best_ops, "memory limit too small")


def _device_deadlock(problem: ScheduleProblem, seqs) -> bool:
    """True if the per-device sequences of ``(stage, mb, type)`` cannot all run (cyclic waiting)."""
    S = problem.num_stages
    pos = [0] * len(seqs)
    done = set()
    total = sum(len(q) for q in seqs)
    while len(done) < total:
        progressed = False
        for d, seq in enumerate(seqs):
            while pos[d] < len(seq):
                s, j, t = seq[pos[d]]
                if t == "F":
                    ok = s == 0 or (s - 1, j, "F") in done
                elif t == "B":
                    ok = (s, j, "F") in done and (s == S - 1 or (s + 1, j, "B") in done)
                else:
                    ok = (s, j, "B") in done
                if not ok:
                    break
                done.add((s, j, t))
                pos[d] += 1
                progressed = True
        if not progressed:
            return True
    return False
