"""The pure builder of the schedule MILP (OptPipe Appendix C, per device).

:func:`build_model` turns a :class:`~fxpipe.ir.ScheduleProblem` into a SCIP model and its
variables (:class:`MilpVars`); it solves nothing and adds no start solution. See the package
docstring (:mod:`fxpipe.schedule.milp`) for the formulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import ScheduleProblem
from fxpipe.schedule.bounds import combinatorial_lower_bound
from fxpipe.schedule.milp.feasibility import check_memory_feasible, objective_value, sequential_schedule

__all__ = ["MilpVars", "build_model", "memory_implied_orders", "order_literal", "device_ops"]

_RANK = {"F": 0, "B": 1, "W": 2}
_COMPUTE = ("F", "B", "W")
#: Full triangle cuts are added only while their count stays below this (Section 4.1.2).
_MAX_FULL_TRIANGLE_CUTS = 20000
#: Devices with more compute ops than this get no full triangle cuts (the O(n^3) scan).
_MAX_TRIANGLE_OPS = 64

Op = tuple[int, int, str]  # (stage, micro-batch, type)


@dataclass
class MilpVars:
    """The variables of a built schedule MILP, keyed by index tuples.

    Times are in units of ``unit_s`` seconds, memory in units of each device's limit.

    Attributes
    ----------
    E : dict[(s, j, c), Variable]
        End time of compute op ``c`` in F/B/W of micro-batch ``j`` on stage ``s``.
    O, R : dict[(s, j), Variable]
        Start time of the offload / reload of the stash of ``(s, j)`` (phantom, zero-length
        when not offloaded); only on devices that hold one stage.
    x : dict[(s, j), Variable]
        Offload decision (1 = offloaded); absent where offloading can never help.
    pair : dict[(a, b), Variable]
        1 if compute op ``a = (s, j, c)`` runs before ``b`` on their (common) device; one
        variable per unordered pair whose order is not implied (a < b in tuple order).
    g : dict[(s, k, l), Variable]
        1 if stash ``l`` is off the device when F_k starts.
    q : dict[(s, k, c, j), Variable]
        1 if op ``(c, j)`` has started when R_k starts (counted in the memory at R_k start).
    w : dict[(s, k, l), Variable]
        Continuous, 1 if stash ``l`` (``l > k``) is off the device when R_k starts.
    yor : dict[(s, k, l), Variable]
        1 if O_l ends before R_k starts (``k < l``).
    pcie : dict
        Order binaries between copy ops of different stages in one pcie group.
    C : Variable
        The objective (largest per-device span, or makespan).
    unit_s : float
        Seconds per model time unit.
    horizon : float
        Big-M horizon ``H`` in model units (an upper bound on ``C``).
    eps : float
        Strictness margin (model units) for ``t < R.start``.
    mem_devices : tuple[int, ...]
        Devices whose memory limit can bind (memory constraints present).
    counts : dict
        Model size statistics (variables, binaries, constraints, cuts).
    index : dict[(s, j, c), int]
        Position of every compute op in the precedence closure.
    reach : list[int]
        ``reach[i]`` is a bitset of the ops that op i must precede (dependencies, the fixed
        micro-batch order and the memory-implied orders, transitively).
    restricted : str or None
        Why the model covers fewer schedules than Contract 3 allows (e.g. no offload on
        devices with several stages); None when it is exact.
    """

    E: dict = field(default_factory=dict)
    O: dict = field(default_factory=dict)
    R: dict = field(default_factory=dict)
    x: dict = field(default_factory=dict)
    pair: dict = field(default_factory=dict)
    g: dict = field(default_factory=dict)
    q: dict = field(default_factory=dict)
    w: dict = field(default_factory=dict)
    yor: dict = field(default_factory=dict)
    pcie: dict = field(default_factory=dict)
    C: Any = None
    unit_s: float = 1.0
    horizon: float = 0.0
    eps: float = 0.0
    mem_devices: tuple = ()
    counts: dict = field(default_factory=dict)
    index: dict = field(default_factory=dict)
    reach: list = field(default_factory=list)
    restricted: str | None = None
    #: memory-implied orders: B_j (resp. W_j) precedes F_k on stage s for j < rB[(s, k)] (rW)
    rB: dict = field(default_factory=dict)
    rW: dict = field(default_factory=dict)


def durations(problem: ScheduleProblem) -> dict[str, np.ndarray]:
    """Per-stage duration arrays of every op type."""
    return {"F": problem.t_f, "B": problem.t_b, "W": problem.t_w, "O": problem.t_offload, "R": problem.t_offload}


def device_ops(problem: ScheduleProblem, device: int) -> list[Op]:
    """The compute ops ``(s, j, c)`` of every stage of ``device``."""
    M = problem.num_microbatches
    return [(s, j, c) for s in problem.stages_of_device(device) for j in range(M) for c in _COMPUTE]


def memory_implied_orders(problem: ScheduleProblem) -> tuple[dict, dict]:
    """Orders that every schedule within the memory limits must follow.

    At the start of F_k on stage s the stash of F_k is on the device; a micro-batch j < k
    whose B has started holds at least 0 (after its W), one whose B has not started holds at
    least ``mem_f - offload_bytes`` (offloaded), one whose B but not W has started holds
    ``-mem_w``. With r earlier B's and w W's started the memory is at least
    ``mem_f + (k - r)(mem_f - offload_bytes) + (r - w)(-mem_w)``, so at least
    ``r_k = k - floor((limit - mem_f) / (mem_f - offload_bytes))`` B's (the first ones, by
    the fixed order) precede F_k, and at least the smallest w that fits for some
    ``r in [r_k, k]`` W's. The limit is the device's (the other stages of a device hold
    ``>= 0``, so a stage alone never exceeds its device's limit).

    Returns
    -------
    (rB, rW) : dict[(s, k), int]
        B_j (resp. W_j) must precede F_k on stage s for every ``j < rB[(s, k)]`` (``rW``).
    """
    rB, rW = {}, {}
    for s in range(problem.num_stages):
        lim = problem.device_mem_limit(s)
        if not math.isfinite(lim):
            continue
        mf, mw = float(problem.mem_f[s]), float(problem.mem_w[s])
        keep = mf - float(problem.offload_bytes[s])
        tol = 1e-9 * max(1.0, lim)
        for k in range(problem.num_microbatches):
            r = 0
            if keep > tol:
                r = max(0, k - int(math.floor((lim - mf + tol) / keep)))
            w = 0
            if mw < -tol:
                # memory with r B's and w W's started: mf + (k - r) keep + (r - w)(-mw); the
                # required w is linear in r, so its minimum over r in [r, k] is at an end.
                def w_req(rr: int) -> int:
                    need = rr - (lim - mf - (k - rr) * max(keep, 0.0)) / -mw
                    return max(0, int(math.ceil(need - 1e-9)))

                w = min(w_req(r), w_req(k))
            w = min(w, k)
            r = min(max(r, w), k)
            if r:
                rB[(s, k)] = r
            if w:
                rW[(s, k)] = w
    return rB, rW


def _closure(problem: ScheduleProblem, rB: dict, rW: dict) -> tuple[dict, list[int], list[int]]:
    """Index of every compute op and the descendant / ancestor bitsets of the precedence DAG.

    Edges: data dependencies (F down the stages, B back up, F before B before W of a stage),
    the fixed micro-batch order of each type on each stage, and the memory-implied orders.
    """
    S, M = problem.num_stages, problem.num_microbatches
    ops = [(s, j, c) for s in range(S) for j in range(M) for c in _COMPUTE]
    index = {o: i for i, o in enumerate(ops)}
    succ: list[list[int]] = [[] for _ in ops]

    def edge(a: Op, b: Op) -> None:
        succ[index[a]].append(index[b])

    for s in range(S):
        for j in range(M):
            if s + 1 < S:
                edge((s, j, "F"), (s + 1, j, "F"))
                edge((s + 1, j, "B"), (s, j, "B"))
            edge((s, j, "F"), (s, j, "B"))
            edge((s, j, "B"), (s, j, "W"))
            if j + 1 < M:
                for c in _COMPUTE:
                    edge((s, j, c), (s, j + 1, c))
    for (s, k), r in rB.items():
        edge((s, r - 1, "B"), (s, k, "F"))
    for (s, k), r in rW.items():
        edge((s, r - 1, "W"), (s, k, "F"))
    # topological order (Kahn), then descendants in reverse order
    n = len(ops)
    indeg = [0] * n
    for u in range(n):
        for v in succ[u]:
            indeg[v] += 1
    order, stack = [], [u for u in range(n) if indeg[u] == 0]
    while stack:
        u = stack.pop()
        order.append(u)
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                stack.append(v)
    if len(order) != n:  # pragma: no cover - the implied orders never form a cycle
        raise AssertionError("the precedence relation of the schedule MILP has a cycle")
    reach = [0] * n
    for u in reversed(order):
        r = 0
        for v in succ[u]:
            r |= (1 << v) | reach[v]
        reach[u] = r
    anc = [0] * n
    for u in order:
        for v in succ[u]:
            anc[v] |= anc[u] | (1 << u)
    return index, reach, anc


def order_literal(V: MilpVars, a: Op, b: Op):
    """Literal 'a before b' for two compute ops of one device.

    Returns 1 or 0 when the order is fixed (implied by dependencies, the fixed micro-batch
    order or memory), else ``(var, +1)`` meaning the variable, ``(var, -1)`` meaning 1 - var.
    """
    if a == b:
        raise ValueError("same op")
    ia, ib = V.index[a], V.index[b]
    if V.reach[ia] >> ib & 1:
        return 1
    if V.reach[ib] >> ia & 1:
        return 0
    if a < b:
        return (V.pair[(a, b)], 1)
    return (V.pair[(b, a)], -1)


def _lit_expr(lit):
    if isinstance(lit, int):
        return lit
    var, sign = lit
    return var if sign > 0 else 1 - var


def build_model(
    problem: ScheduleProblem,
    *,
    warm_start=None,
    big_m: float | None = None,
    triangle_cuts: bool = True,
    lower_bound_s: float | None = None,
):
    """Build the schedule MILP for Contract 3 (pure function: no solve, no start solution).

    Parameters
    ----------
    problem : ScheduleProblem
        S stages on D devices x m micro-batches (times in s, memory in bytes).
    warm_start : Schedule, optional
        A valid schedule; its objective value becomes the horizon ``H`` (big-M and the
        upper bound of ``C``). Hand it to the solver with
        :func:`fxpipe.schedule.milp.warm_start.warm_start_values`.
    big_m : float, optional
        Horizon ``H`` in seconds; overrides the warm start's value. Without either, the
        one-micro-batch-at-a-time schedule's value is used (always valid).
    triangle_cuts : bool
        Add the full triangle-inequality cuts of OptPipe Section 4.1.2 (when fewer than
        20000 and devices have at most 64 ops); monotonicity cuts (one fixed leg) are
        always added.
    lower_bound_s : float, optional
        A proven lower bound on the objective (seconds) added as the cut ``C >= bound``;
        default the combinatorial bound of :mod:`fxpipe.schedule.bounds`.

    Returns
    -------
    (pyscipopt.Model, MilpVars)
        The model (objective: minimise ``C``) and its variables.

    Raises
    ------
    InputError
        If ``problem`` is not a :class:`ScheduleProblem`, ``big_m`` is not positive, or a
        device with several stages needs offload to fit (not modelled).
    InfeasibleError
        If one micro-batch's stashes exceed a device's memory limit.

    References
    ----------
    OptPipe Appendix C, Eq. 2-19; Sections 4.1.1-4.1.3.
    """
    import pyscipopt as scip

    if not isinstance(problem, ScheduleProblem):
        raise InputError(f"expected a ScheduleProblem, got {type(problem).__name__}")
    check_memory_feasible(problem)
    durs = durations(problem)
    all_times = np.concatenate([problem.t_f, problem.t_b, problem.t_w, problem.t_comm, problem.t_offload])
    unit = float(np.max(all_times)) if all_times.size and np.max(all_times) > 0 else 1.0
    H = _horizon_s(problem, warm_start, big_m) / unit * (1 + 1e-9) + 1e-9
    T = {c: durs[c] / unit for c in durs}

    V = MilpVars(unit_s=unit, horizon=H, eps=1e-5)
    V.rB, V.rW = memory_implied_orders(problem)
    V.index, V.reach, anc = _closure(problem, V.rB, V.rW)
    model = scip.Model(f"fxpipe-schedule-{problem.name}")
    model.hideOutput()
    add = _Rows(model)
    # absolute bound on every time: device windows are <= H long and stage s+1's first F
    # starts at most H after stage s's (B(s,0) waits on B(s+1,0), both in windows of <= H)
    tmax = H if problem.objective == "makespan" else problem.num_stages * H
    _add_times_and_dependencies(model, add, V, problem, T, tmax)
    dev_ops = [device_ops(problem, d) for d in range(problem.num_devices)]
    pair_list = _add_order_pairs(model, add, V, dev_ops, T, H)
    n_ht = _add_head_tail(add, V, problem, dev_ops, anc, T)
    n_mono = _add_monotone_cuts(add, V, pair_list, problem.num_microbatches)
    n_tri = _add_triangle_cuts(add, V, dev_ops) if triangle_cuts else 0
    _add_memory(model, add, V, problem, T, H, tmax)
    _add_pcie_groups(model, add, V, problem, T, H)
    _add_objective(model, add, V, problem, T, H, lower_bound_s)

    V.counts = {
        "variables": model.getNVars(),
        "binaries": sum(1 for v in model.getVars() if v.vtype() == "BINARY"),
        "constraints": add.count,
        "monotone_cuts": n_mono,
        "triangle_cuts": n_tri,
        "head_tail": n_ht,
        "memory_implied_orders": int(sum(V.rB.values()) + sum(V.rW.values())),
    }
    return model, V


class _Rows:
    """``add(expr, name)``: add a constraint to the model and count it."""

    def __init__(self, model) -> None:
        self.model = model
        self.count = 0

    def __call__(self, expr, name: str):
        self.count += 1
        return self.model.addCons(expr, name=name)


def _horizon_s(problem: ScheduleProblem, warm_start, big_m: float | None) -> float:
    """The horizon ``H`` in seconds: ``big_m``, else the warm start's value, else the
    one-micro-batch-at-a-time schedule's value."""
    if big_m is not None:
        if not (isinstance(big_m, (int, float)) and math.isfinite(big_m) and big_m > 0):
            raise InputError(f"big_m must be a positive number of seconds, got {big_m!r}")
        return float(big_m)
    if warm_start is not None:
        return objective_value(problem, warm_start.ops)
    return objective_value(problem, sequential_schedule(problem).ops)


def _add_times_and_dependencies(model, add: _Rows, V: MilpVars, problem: ScheduleProblem, T: dict,
                                tmax: float) -> None:
    """End-time variables, the time origin, the pipeline data dependencies (Eq. 5, 6, 8; comm
    only between devices), the fixed micro-batch order (Eq. 1) and the memory-implied orders."""
    S, M = problem.num_stages, problem.num_microbatches
    comm = problem.t_comm_effective / V.unit_s
    for s in range(S):
        for j in range(M):
            for c in _COMPUTE:
                V.E[(s, j, c)] = model.addVar(f"E_{s}_{j}_{c}", lb=T[c][s], ub=tmax)
    V.C = model.addVar("C", lb=0.0, ub=V.horizon)
    E = V.E

    # fix the time origin: F(0,0) starts at 0 (translation invariance)
    add(E[(0, 0, "F")] == T["F"][0], "origin")
    for s in range(S):
        for j in range(M):
            if s > 0:
                add(E[(s, j, "F")] >= E[(s - 1, j, "F")] + comm[s - 1] + T["F"][s], f"depF_{s}_{j}")
            if s < S - 1:
                add(E[(s, j, "B")] >= E[(s + 1, j, "B")] + comm[s] + T["B"][s], f"depB_{s}_{j}")
            add(E[(s, j, "B")] >= E[(s, j, "F")] + T["B"][s], f"FB_{s}_{j}")
            add(E[(s, j, "W")] >= E[(s, j, "B")] + T["W"][s], f"BW_{s}_{j}")
            if j + 1 < M:
                for c in _COMPUTE:
                    add(E[(s, j + 1, c)] >= E[(s, j, c)] + T[c][s], f"ord{c}_{s}_{j}")
    # memory-implied orders (their transitive consequences follow from these rows)
    for (s, k), r in V.rB.items():
        add(E[(s, k, "F")] - T["F"][s] >= E[(s, r - 1, "B")], f"mem_ordB_{s}_{k}")
    for (s, k), r in V.rW.items():
        add(E[(s, k, "F")] - T["F"][s] >= E[(s, r - 1, "W")], f"mem_ordW_{s}_{k}")


def _add_order_pairs(model, add: _Rows, V: MilpVars, dev_ops: list[list[Op]], T: dict, H: float) -> list:
    """One binary per unordered undetermined pair of ops of a device (Section 4.1.1) with
    big-M = H (Eq. 7): every op of a device lies in its window of length <= C <= H.
    Returns the pairs in the order their variables were added."""
    E = V.E
    pair_list = []
    for ops_d in dev_ops:
        for ia, a in enumerate(ops_d):
            ra = V.reach[V.index[a]]
            for b in ops_d[ia + 1:]:
                ib = V.index[b]
                if ra >> ib & 1 or V.reach[ib] >> V.index[a] & 1:
                    continue
                key = (a, b) if a < b else (b, a)
                lo, hi = key
                y = model.addVar(f"P_{lo[0]}{lo[2]}{lo[1]}_{hi[0]}{hi[2]}{hi[1]}", vtype="B")
                V.pair[key] = y
                pair_list.append(key)
                # y = 1: lo before hi; y = 0: hi before lo
                add(E[hi] - T[hi[2]][hi[0]] >= E[lo] - H * (1 - y), f"seq1_{lo}_{hi}")
                add(E[lo] - T[lo[2]][lo[0]] >= E[hi] - H * y, f"seq0_{lo}_{hi}")
    return pair_list


def _add_head_tail(add: _Rows, V: MilpVars, problem: ScheduleProblem, dev_ops: list[list[Op]], anc: list[int],
                   T: dict) -> int:
    """Energetic head/tail inequalities from the fixed (incl. memory-implied) orders: every op
    fixed before ``a`` runs between the device's first op (the first F of its lowest stage)
    and a's start; every op fixed after ``a`` runs after a, before the device's end.
    Returns the number of rows."""
    E = V.E
    n_ht = 0
    for d, ops_d in enumerate(dev_ops):
        on_dev = 0
        for o in ops_d:
            on_dev |= 1 << V.index[o]
        first = (problem.stages_of_device(d)[0], 0, "F")
        f0_start = E[first] - T["F"][first[0]]
        for a in ops_d:
            i = V.index[a]
            head = sum(float(T[o[2]][o[0]]) for o in _members(anc[i] & on_dev, V))
            tail = sum(float(T[o[2]][o[0]]) for o in _members(V.reach[i] & on_dev, V))
            a_start = E[a] - T[a[2]][a[0]]
            if head > 0:
                add(a_start >= f0_start + head, f"head_{a}")
            if problem.objective == "stage_span":
                add(V.C >= a_start - f0_start + T[a[2]][a[0]] + tail, f"tail_{a}")
            else:
                add(V.C >= a_start + T[a[2]][a[0]] + tail, f"tail_{a}")
            n_ht += 2
    return n_ht


def _add_monotone_cuts(add: _Rows, V: MilpVars, pair_list: list, M: int) -> int:
    """Monotonicity cuts (triangles with one fixed leg, Section 4.1.2): a before b implies a
    before every immediate successor of b on its stage, and every immediate predecessor of
    a on its stage before b (when those orders are open). Returns the number of cuts."""
    n_mono = 0
    for key in pair_list:
        y = V.pair[key]
        a, b = key
        for nb in _stage_succ(b, M):
            lit = order_literal(V, a, nb)
            if not isinstance(lit, int):
                add(_lit_expr(lit) >= y, f"mono_s_{a}_{b}_{nb}")
                n_mono += 1
        for pa in _stage_pred(a):
            lit = order_literal(V, pa, b)
            if not isinstance(lit, int):
                add(_lit_expr(lit) >= y, f"mono_p_{a}_{b}_{pa}")
                n_mono += 1
    return n_mono


def _triangles(V: MilpVars, dev_ops: list[list[Op]]) -> list | None:
    """The open triangles (a<b, b<c, a<c literals) of every device; None when a device has
    more than ``_MAX_TRIANGLE_OPS`` ops or there are more than ``_MAX_FULL_TRIANGLE_CUTS``."""
    cuts = []
    for ops in dev_ops:
        n = len(ops)
        if n > _MAX_TRIANGLE_OPS:
            return None
        for ia in range(n):
            for ib in range(n):
                if ib == ia:
                    continue
                lab = order_literal(V, ops[ia], ops[ib])
                if isinstance(lab, int):
                    continue
                for ic in range(n):
                    if ic == ia or ic == ib:
                        continue
                    lbc = order_literal(V, ops[ib], ops[ic])
                    if isinstance(lbc, int):
                        continue
                    lac = order_literal(V, ops[ia], ops[ic])
                    if lac == 1:
                        continue
                    cuts.append((lab, lbc, lac))
                    if len(cuts) > _MAX_FULL_TRIANGLE_CUTS:
                        return None
    return cuts


def _add_triangle_cuts(add: _Rows, V: MilpVars, dev_ops: list[list[Op]]) -> int:
    """Full triangle-inequality cuts (Section 4.1.2) when the model is small enough; returns
    their number (0 when too many)."""
    cuts = _triangles(V, dev_ops)
    if cuts is None:
        return 0
    for i, (lab, lbc, lac) in enumerate(cuts):
        add(_lit_expr(lac) >= _lit_expr(lab) + _lit_expr(lbc) - 1, f"tri_{i}")
    return len(cuts)


def _add_memory(model, add: _Rows, V: MilpVars, problem: ScheduleProblem, T: dict, H: float, tmax: float) -> None:
    """Memory rows (Contract 3 rule 5; OptPipe Eq. 9, 14-17 restated for start-time
    semantics) on every device whose limit can bind."""
    mem_devices = []
    for d in range(problem.num_devices):
        lim = float(problem.mem_limit[d])
        stages = problem.stages_of_device(d)
        if not math.isfinite(lim) or _memory_upper_bound(problem, stages) <= lim:
            continue  # the limit can never bind on this device
        mem_devices.append(d)
        if len(stages) == 1:
            _single_stage_memory(model, V, problem, stages[0], lim, T, H, tmax, V.eps, add)
        else:
            if any(float(problem.offload_bytes[s]) > 0 for s in stages):
                V.restricted = "no offload on devices that hold several stages"
            _device_memory(model, V, problem, d, lim, add)
        _recompute_memory(V, problem, d, lim, add)
    V.mem_devices = tuple(mem_devices)


def _add_pcie_groups(model, add: _Rows, V: MilpVars, problem: ScheduleProblem, T: dict, H: float) -> None:
    """pcie groups (Eq. 18-19): copy ops of stages in one group never overlap."""
    M = problem.num_microbatches
    for gi, grp in enumerate(problem.pcie_groups):
        stages = sorted(set(s for s in grp if any((s, j) in V.x for j in range(M))))
        for a_i, s1 in enumerate(stages):
            for s2 in stages[a_i + 1:]:
                Mx = (abs(s2 - s1) + 1) * H + 2 * float(max(T["O"][s1], T["O"][s2])) + 1.0
                if problem.objective == "makespan":
                    Mx = H + 2 * float(max(T["O"][s1], T["O"][s2])) + 1.0
                for j in range(M):
                    for k in range(M):
                        for t1, v1 in (("O", V.O[(s1, j)]), ("R", V.R[(s1, j)])):
                            for t2, v2 in (("O", V.O[(s2, k)]), ("R", V.R[(s2, k)])):
                                z = model.addVar(f"Z_{gi}_{s1}{t1}{j}_{s2}{t2}{k}", vtype="B")
                                V.pcie[(s1, t1, j, s2, t2, k)] = z
                                both = 2 - V.x[(s1, j)] - V.x[(s2, k)]
                                add(v2 >= v1 + T["O"][s1] - Mx * (1 - z) - Mx * both, f"pc1_{gi}_{s1}{t1}{j}_{s2}{t2}{k}")
                                add(v1 >= v2 + T["O"][s2] - Mx * z - Mx * both, f"pc0_{gi}_{s1}{t1}{j}_{s2}{t2}{k}")


def _add_objective(model, add: _Rows, V: MilpVars, problem: ScheduleProblem, T: dict, H: float,
                   lower_bound_s: float | None) -> None:
    """The objective ``C`` (per-device span or makespan), minimised, with two valid lower
    bounds: the busiest device's compute time and a proven bound (by default the
    combinatorial one: memory-aware warm-up/drain bubbles)."""
    E, M = V.E, problem.num_microbatches
    for d in range(problem.num_devices):
        stages = problem.stages_of_device(d)
        first = stages[0]
        for s in stages:
            if problem.objective == "stage_span":
                add(V.C >= E[(s, M - 1, "W")] - (E[(first, 0, "F")] - T["F"][first]), f"span_{d}_{s}")
            else:
                add(V.C >= E[(s, M - 1, "W")], f"makespan_{d}_{s}")
    busy = max(float(sum(M * (T["F"][s] + T["B"][s] + T["W"][s]) for s in problem.stages_of_device(d)))
               for d in range(problem.num_devices))
    add(V.C >= busy, "busy")
    # the proven bound is slightly relaxed so rounding never cuts off the optimum, and capped
    # at the horizon so a warm start at the bound stays feasible
    if lower_bound_s is None:
        lower_bound_s = combinatorial_lower_bound(problem)
    comb = min(float(lower_bound_s) / V.unit_s * (1 - 1e-9), H)
    if comb > busy:
        add(V.C >= comb, "comb_lb")
    model.setObjective(V.C, "minimize")


def _members(bits: int, V: MilpVars) -> list[Op]:
    if not hasattr(V, "_ops_by_index"):
        V._ops_by_index = {i: o for o, i in V.index.items()}  # type: ignore[attr-defined]
    out = []
    ops = V._ops_by_index  # type: ignore[attr-defined]
    while bits:
        low = bits & -bits
        out.append(ops[low.bit_length() - 1])
        bits ^= low
    return out


def _stage_succ(o: Op, M: int) -> list[Op]:
    s, j, c = o
    out = [(s, j + 1, c)] if j + 1 < M else []
    if c == "F":
        out.append((s, j, "B"))
    elif c == "B":
        out.append((s, j, "W"))
    return out


def _stage_pred(o: Op) -> list[Op]:
    s, j, c = o
    out = [(s, j - 1, c)] if j > 0 else []
    if c == "W":
        out.append((s, j, "B"))
    elif c == "B":
        out.append((s, j, "F"))
    return out


def _memory_at_start(V: MilpVars, problem: ScheduleProblem, ops_d: list[Op], e: Op, own: float, lim: float):
    """Memory of a device at the start of its op ``e`` in units of its limit ``lim``: ``own``
    (what ``e`` adds at its start) plus the delta of every other op of the device
    (``ops_d``) ordered before ``e`` (a constant when every order is fixed)."""
    delta = {"F": problem.mem_f, "B": problem.mem_b, "W": problem.mem_w}
    expr = own
    for o in ops_d:
        if o == e:
            continue
        coef = float(delta[o[2]][o[0]]) / lim
        if coef == 0.0:
            continue
        expr = expr + coef * _lit_expr(order_literal(V, o, e))
    return expr


# ---- begin recomputation (issue 9): memory rows at the B starts of recomputing stages --------
def _memory_upper_bound(problem: ScheduleProblem, stages) -> float:
    """Most activation memory a device can ever hold (bytes): every micro-batch of each stage
    at its largest (``mem_f``, or ``-mem_w`` after a recomputing B), plus one B's transient
    (one B runs at a time on a device)."""
    M = problem.num_microbatches
    held = sum(M * max(float(problem.mem_f[s]), -float(problem.mem_w[s])) for s in stages)
    return held + max(float(problem.mem_b_transient[s]) for s in stages)


def _recompute_memory(V: MilpVars, problem: ScheduleProblem, d: int, lim: float, add) -> None:
    """Memory of device ``d`` at the start of every B that raises it (Contract 3 rule 5).

    Without recomputation memory rises only at F and R starts, which the rows of
    :func:`_single_stage_memory` / :func:`_device_memory` check. A recomputing stage's B
    replays its forward: at its start the device holds the deltas of every op started
    before it (ops of one device do not overlap, so their transients are over) plus
    ``mem_b + mem_b_transient``. A recomputing stage offloads nothing (``offload_bytes = 0``),
    but other stages of the device may: their offloaded stashes are counted as on the
    device here, which only makes these rows stricter than Contract 3 when offload and
    recomputation share a device (then ``V.restricted`` says so).
    """
    ops_d = device_ops(problem, d)
    rise = problem.mem_b_start
    stages = problem.stages_of_device(d)
    rows = [e for e in ops_d if e[2] == "B" and float(rise[e[0]]) > 0.0]
    if rows and any(float(problem.offload_bytes[s]) > 0 for s in stages):
        V.restricted = "offloaded stashes are counted on the device at recomputing B starts"
    for e in rows:
        expr = _memory_at_start(V, problem, ops_d, e, float(rise[e[0]]) / lim, lim)
        if not isinstance(expr, (int, float)):
            add(expr <= 1.0, f"memB_{d}_{e}")
        elif expr > 1.0 + 1e-9:
            add(V.C <= -1.0, f"memB_{d}_{e}")  # pragma: no cover - excluded by check_memory_feasible
# ---- end recomputation ---------------------------------------------------------------------


def _device_memory(model, V: MilpVars, problem: ScheduleProblem, d: int, lim: float, add) -> None:
    """Memory of a device holding several stages at every F start (no offload modelled)."""
    ops_d = device_ops(problem, d)
    for e in ops_d:
        if e[2] != "F":
            continue
        expr = _memory_at_start(V, problem, ops_d, e, float(problem.mem_f[e[0]]) / lim, lim)
        if not isinstance(expr, (int, float)):
            add(expr <= 1.0, f"memF_{d}_{e}")


def _single_stage_memory(model, V: MilpVars, problem: ScheduleProblem, s: int, lim: float, T: dict, H: float,
                         tmax: float, eps: float, add) -> None:
    """Memory of a device holding one stage, with offload (the formulation of OptPipe Appendix C)."""
    M = problem.num_microbatches
    E = V.E
    mf = float(problem.mem_f[s]) / lim
    mb = float(problem.mem_b[s]) / lim
    mw = float(problem.mem_w[s]) / lim
    off = float(problem.offload_bytes[s]) / lim
    to = float(T["O"][s])
    can_offload = off > 0
    tf, tb = T["F"][s], T["B"][s]

    def lit(a: tuple[str, int], b: tuple[str, int]):
        return order_literal(V, (s, a[1], a[0]), (s, b[1], b[0]))

    if can_offload:
        chain_gap = to if to > 0 else eps
        for j in range(M):
            V.x[(s, j)] = model.addVar(f"x_{s}_{j}", vtype="B")
            V.O[(s, j)] = model.addVar(f"O_{s}_{j}", lb=0.0, ub=tmax)
            V.R[(s, j)] = model.addVar(f"R_{s}_{j}", lb=0.0, ub=tmax)
        for j in range(M):
            x, O, R = V.x[(s, j)], V.O[(s, j)], V.R[(s, j)]
            add(O >= E[(s, j, "F")], f"OF_{s}_{j}")  # rule 4
            add(R >= O + to * x, f"OR_{s}_{j}")
            add(R + to * x <= E[(s, j, "B")] - tb, f"RB_{s}_{j}")  # rule 4
            if j + 1 < M:  # fixed order of offloads and reloads (Section 4.1.1)
                add(V.O[(s, j + 1)] >= O + chain_gap * x, f"ordO_{s}_{j}")
                add(V.R[(s, j + 1)] >= R + chain_gap * x, f"ordR_{s}_{j}")
        # O_l against R_k for k < l: the only undetermined copy-stream pairs
        for k in range(M):
            for l in range(k + 1, M):
                y = model.addVar(f"Y_{s}_{k}_{l}", vtype="B")  # 1: O_l ends before R_k starts
                V.yor[(s, k, l)] = y
                both = 2 - V.x[(s, k)] - V.x[(s, l)]
                add(V.R[(s, k)] >= V.O[(s, l)] + to - H * (1 - y) - H * both, f"OR1_{s}_{k}_{l}")
                add(V.O[(s, l)] >= V.R[(s, k)] + to - H * y - H * both, f"OR0_{s}_{k}_{l}")
        for k in range(M):
            for l in range(k + 1, M):
                if l - 1 > k:
                    add(V.yor[(s, k, l)] <= V.yor[(s, k, l - 1)], f"monoY1_{s}_{k}_{l}")
                if k + 1 < l:
                    add(V.yor[(s, k, l)] <= V.yor[(s, k + 1, l)], f"monoY2_{s}_{k}_{l}")
    # memory at every F start
    for k in range(M):
        expr = (k + 1) * mf
        for j in range(k):
            expr = expr + mb * _lit_expr(lit(("B", j), ("F", k)))
            expr = expr + mw * _lit_expr(lit(("W", j), ("F", k)))
        if can_offload:
            Fk_start = E[(s, k, "F")] - tf
            for l in range(k):
                lt = lit(("B", l), ("F", k))
                if lt == 1:  # B_l (hence R_l) precedes F_k: stash l is back on the device
                    continue
                g = model.addVar(f"g_{s}_{k}_{l}", vtype="B")
                V.g[(s, k, l)] = g
                add(g <= V.x[(s, l)], f"gx_{s}_{k}_{l}")
                add(g <= 1 - _lit_expr(lt), f"gB_{s}_{k}_{l}")
                add(V.O[(s, l)] + to <= Fk_start + (H + to) * (1 - g), f"gO_{s}_{k}_{l}")
                add(V.R[(s, l)] >= Fk_start + eps - (H + eps) * (1 - g), f"gR_{s}_{k}_{l}")
                expr = expr - off * g
        if not isinstance(expr, (int, float)):
            add(expr <= 1.0, f"memF_{s}_{k}")
    # memory at every R start of an offloaded stash
    if can_offload:
        bigmem = M * mf
        for k in range(M):
            Rk = V.R[(s, k)]
            expr = (k + 1) * mf
            for j in range(k + 1, M):
                qf = model.addVar(f"qF_{s}_{k}_{j}", vtype="B")
                V.q[(s, k, "F", j)] = qf
                # qf = 0 -> F_j starts strictly after R_k starts
                add(E[(s, j, "F")] - tf >= Rk + eps - (H + eps) * qf, f"qF_{s}_{k}_{j}")
                if j > k + 1:
                    add(qf <= V.q[(s, k, "F", j - 1)], f"monoqF_{s}_{k}_{j}")
                expr = expr + mf * qf
            for j in range(k):
                qb = model.addVar(f"qB_{s}_{k}_{j}", vtype="B")
                qw = model.addVar(f"qW_{s}_{k}_{j}", vtype="B")
                V.q[(s, k, "B", j)] = qb
                V.q[(s, k, "W", j)] = qw
                # q = 1 -> the op started by the time R_k starts
                add(E[(s, j, "B")] - tb <= Rk + H * (1 - qb), f"qB_{s}_{k}_{j}")
                add(E[(s, j, "W")] - T["W"][s] <= Rk + H * (1 - qw), f"qW_{s}_{k}_{j}")
                add(qw <= qb, f"qWB_{s}_{k}_{j}")
                if j > 0:
                    add(qb <= V.q[(s, k, "B", j - 1)], f"monoqB_{s}_{k}_{j}")
                    add(qw <= V.q[(s, k, "W", j - 1)], f"monoqW_{s}_{k}_{j}")
                expr = expr + mb * qb + mw * qw
            for l in range(k + 1, M):
                lt = lit(("B", k), ("F", l))
                if lt == 1:  # O_l after F_l after B_k after R_k: l cannot be off
                    continue
                wv = model.addVar(f"w_{s}_{k}_{l}", lb=0.0, ub=1.0)
                V.w[(s, k, l)] = wv
                add(wv <= V.x[(s, l)], f"wx_{s}_{k}_{l}")
                add(wv <= V.yor[(s, k, l)], f"wy_{s}_{k}_{l}")
                add(wv <= 1 - _lit_expr(lt), f"wB_{s}_{k}_{l}")
                expr = expr - off * wv
            add(expr <= 1.0 + bigmem * (1 - V.x[(s, k)]), f"memR_{s}_{k}")
