"""Time-indexed feasibility probes: proven lower bounds for the schedule MILP by bisection.

The big-M MILP of :mod:`fxpipe.schedule.milp.builder` has a weak LP relaxation: on the
p = 8, m = 16 offload instances its dual bound never leaves the busy time of a stage. This
module proves stronger bounds with a different model, solved as a sequence of yes/no
questions "is there a schedule of value <= T?" (bound probing):

1. **Exact grid.** When every duration (F, B, W, offload, communication) is an integer
   multiple of a common grid ``g`` (:func:`exact_grid`), every valid schedule can be moved
   onto the grid without increasing its value by more than rounding up to the next grid
   point (see :func:`probe_lower_bound`, "Soundness").
2. **Temporal windows** (:func:`temporal_windows`): for a value ``T`` (grid units) the
   earliest and latest start of every compute op follow from a longest-path computation over
   the difference constraints every schedule of value <= T satisfies: the data dependencies,
   the fixed micro-batch order and the memory-implied orders of the MILP (OptPipe Section
   4.1.1; :func:`fxpipe.schedule.milp.builder.memory_implied_orders`), the deadline
   ``T`` and the energetic head/tail sums of the ops fixed before / after an op on its device.
   A positive cycle (empty window) proves "no schedule of value <= T".
3. **Time-indexed model** (:func:`build_probe`): binaries ``z[i, t] = 1`` iff op ``i`` has
   started by grid point ``t`` (step form, Pritsker-Watters-Wolfe 1969; Sousa & Wolsey 1992:
   its LP relaxation is much stronger than big-M precedence models), offload binaries and
   "offload ended by t" / "reload started by t" step variables, with one-op-at-a-time
   capacity on each device's compute and copy streams and the Contract-3 memory at every grid
   point. Restricted to the ops of one device (with the windows of step 2, which carry the
   rest of the pipeline) it is a *relaxation* of the problem; its infeasibility proves the
   bound. Per-device probes are small (a few thousand binaries at p = 8, m = 16) where the
   whole-pipeline model is too big to solve its root LP in minutes.

:func:`probe_lower_bound` bisects on ``T`` between the combinatorial bound and an
incumbent, and returns the largest ``T`` proven infeasible. :func:`fxpipe.schedule.milp.solve`
calls it before SCIP and uses the result as the objective cut and reported bound.

References
----------
OptPipe (``shared/papers/optpipe-milp-pipeline-scheduling.txt``) Section 4.1.1 (fixed
micro-batch order, implied orders) and Appendix C (memory with offload); DESIGN.md Contract 3
(the schedule semantics proven against here). A. A. B. Pritsker, L. J. Watters, P. M. Wolfe,
"Multiproject scheduling with limited resources: a zero-one programming approach",
Management Science 16(1), 1969; J. P. Sousa, L. A. Wolsey, "A time indexed formulation of
non-preemptive single machine scheduling problems", Math. Programming 54, 1992.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Sequence

import numpy as np

from fxpipe.ir import ScheduleProblem
from fxpipe.schedule.milp.builder import _closure, memory_implied_orders

__all__ = ["ProbeBound", "Windows", "build_probe", "exact_grid", "probe_lower_bound", "temporal_windows"]

_COMPUTE = ("F", "B", "W")
#: A probe is skipped (treated as unknown) when its horizon exceeds this many grid points.
MAX_GRID_POINTS = 4000


def exact_grid(problem: ScheduleProblem, max_den: int = 64) -> float | None:
    """The largest grid (s) of which every duration of ``problem`` is an integer multiple.

    Parameters
    ----------
    problem : ScheduleProblem
    max_den : int
        Durations are compared as fractions of the largest one with denominators up to this.

    Returns
    -------
    float or None
        The grid in seconds, or None when the durations are not commensurable within
        ``max_den`` (then no probe is exact and :func:`probe_lower_bound` proves nothing).
    """
    vals = np.concatenate([problem.t_f, problem.t_b, problem.t_w, problem.t_offload, problem.t_comm_effective])
    vals = [float(v) for v in vals if v > 0]
    if not vals:
        return 1.0
    scale = max(vals)
    fracs = []
    for v in vals:
        f = Fraction(v / scale).limit_denominator(max_den)
        if abs(float(f) - v / scale) > 1e-12 * max(1.0, v / scale):
            return None
        fracs.append(f)
    g = fracs[0]
    for f in fracs[1:]:  # gcd of fractions: gcd(a/b, c/d) = gcd(a d, c b) / (b d)
        g = Fraction(math.gcd(g.numerator * f.denominator, f.numerator * g.denominator), g.denominator * f.denominator)
    return float(g) * scale


@dataclass
class Windows:
    """Earliest / latest start of every compute op (grid units) for a value ``<= T``.

    Attributes
    ----------
    index : dict[(s, j, c), int]
        Position of each compute op.
    ops : list[(s, j, c)]
        The ops by position.
    es, ls : int64 arrays
        Earliest and latest start (grid units, origin: the start of F(0, 0)).
    dur : dict[str, list[int]]
        Durations per type and stage in grid units.
    edges : list[(a, b, l)]
        The difference constraints ``start_b >= start_a + l`` behind the windows.
    feasible : bool
        False when the constraints have a positive cycle or an empty window: no schedule of
        value ``<= T`` exists.
    """

    index: dict
    ops: list
    es: np.ndarray
    ls: np.ndarray
    dur: dict
    edges: list = field(default_factory=list)
    feasible: bool = True


def _bits(x: int):
    while x:
        low = x & -x
        yield low.bit_length() - 1
        x ^= low


def temporal_windows(problem: ScheduleProblem, T: int, grid: float) -> Windows:
    """Start-time windows of every compute op in every schedule of value ``<= T * grid``.

    Every schedule of value ``<= T * grid`` with the fixed micro-batch order (which loses no
    optimal schedule, OptPipe Section 4.1.1) satisfies these difference constraints on start
    times, the origin being the start of F(0, 0), the earliest op of every schedule:

    * dependencies (Contract 3 rule 2, ``t_comm`` between devices) and the fixed micro-batch
      order of each type on each stage;
    * the memory-implied orders of :func:`~fxpipe.schedule.milp.builder.memory_implied_orders`;
    * ``stage_span``: every op of a device starts after the device's first F plus the work of
      its on-device ancestors, and ends, followed by the work of its on-device descendants,
      by that first F plus ``T`` (the energetic head/tail argument of the MILP);
      ``makespan``: every op ends by ``T``.

    Windows are longest paths from / to the origin (Bellman-Ford); a positive cycle proves
    that no schedule of value ``<= T * grid`` exists.

    Parameters
    ----------
    problem : ScheduleProblem
    T : int
        Value to test, in grid units.
    grid : float
        From :func:`exact_grid` (s).

    Returns
    -------
    Windows
    """
    S, M = problem.num_stages, problem.num_microbatches
    rB, rW = memory_implied_orders(problem)
    index, reach, anc = _closure(problem, rB, rW)
    ops = [None] * len(index)
    for o, i in index.items():
        ops[i] = o

    def g(x: float) -> int:
        return int(round(float(x) / grid))

    du = {"F": [g(x) for x in problem.t_f], "B": [g(x) for x in problem.t_b], "W": [g(x) for x in problem.t_w]}
    c = [g(x) for x in problem.t_comm_effective]
    d_of = np.array([du[o[2]][o[0]] for o in ops], dtype=np.int64)
    edges: list[tuple[int, int, int]] = []

    def E(a, b, length):
        edges.append((index[a], index[b], int(length)))

    for s in range(S):
        for j in range(M):
            if s + 1 < S:
                E((s, j, "F"), (s + 1, j, "F"), du["F"][s] + c[s])
                E((s + 1, j, "B"), (s, j, "B"), du["B"][s + 1] + c[s])
            E((s, j, "F"), (s, j, "B"), du["F"][s])
            E((s, j, "B"), (s, j, "W"), du["B"][s])
            if j + 1 < M:
                for t in _COMPUTE:
                    E((s, j, t), (s, j + 1, t), du[t][s])
    for (s, k), r in rB.items():
        E((s, r - 1, "B"), (s, k, "F"), du["B"][s])
    for (s, k), r in rW.items():
        E((s, r - 1, "W"), (s, k, "F"), du["W"][s])
    origin = index[(0, 0, "F")]
    n = len(ops)
    if problem.objective == "stage_span":
        for stages in problem.device_stages:
            first = (stages[0], 0, "F")
            on_dev = 0
            dev_ops = [o for o in ops if o[0] in stages]
            for o in dev_ops:
                on_dev |= 1 << index[o]
            for o in dev_ops:
                i = index[o]
                pre = sum(int(d_of[k]) for k in _bits(anc[i] & on_dev))
                post = sum(int(d_of[k]) for k in _bits(reach[i] & on_dev))
                if o != first:
                    E(first, o, pre)
                E(o, first, int(d_of[i]) + post - T)
    else:
        for i in range(n):
            edges.append((i, origin, int(d_of[i]) - T))
    ea = np.array([e[0] for e in edges])
    eb = np.array([e[1] for e in edges])
    el = np.array([e[2] for e in edges], dtype=np.int64)
    NEG = -(10 ** 12)

    def longest(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, bool]:
        dist = np.full(n, NEG, dtype=np.int64)
        dist[origin] = 0
        for _ in range(n + 2):
            cand = np.where(dist[src] > NEG // 2, dist[src] + el, NEG)
            new = dist.copy()
            np.maximum.at(new, dst, cand)
            if np.array_equal(new, dist):
                return dist, True
            dist = new
        return dist, False  # still growing: a positive cycle

    es, ok1 = longest(ea, eb)
    to_origin, ok2 = longest(eb, ea)  # longest path from each op to the origin
    ls = -to_origin
    ok = ok1 and ok2 and bool(np.all(es > NEG // 2)) and bool(np.all(to_origin > NEG // 2))
    if ok and (np.any(es > ls) or es[origin] != 0 or ls[origin] != 0):
        ok = False
    return Windows(index=index, ops=ops, es=es, ls=ls, dur=du, edges=edges, feasible=ok)


def build_probe(problem: ScheduleProblem, T: int, grid: float, devices: Sequence[int] | None = None,
                windows: Windows | None = None):
    """Time-indexed feasibility model "a schedule of value <= T * grid exists" (pure builder).

    Variables (grid units): ``z[i, t]`` = op ``i`` has started by ``t`` (0 before its
    earliest, 1 from its latest start), nondecreasing in ``t``; for every stash that may be
    offloaded, ``y`` (offloaded), ``u[t]`` = its offload has ended by ``t``, ``v[t]`` = its
    reload has started by ``t`` (``v <= u``, both reach ``y``). Constraints: the difference
    constraints of the windows as ``z[b, t] <= z[a, t - l]``; at most one F/B/W running per
    device and grid cell; at most one O/R per device and grid cell; ``O.start >= F.end``,
    ``R.end <= B.start``; the device memory of Contract 3 rule 5 at every grid point (ops
    started by ``t``, minus offloaded stashes with ``O.end <= t < R.start``).

    Parameters
    ----------
    problem : ScheduleProblem
    T : int
        Value in grid units.
    grid : float
        From :func:`exact_grid`.
    devices : sequence of int, optional
        Keep only the ops of these devices (the rest of the pipeline acts through the
        windows): a relaxation. Default: all devices (exact on the grid).
    windows : Windows, optional
        Precomputed :func:`temporal_windows` for ``(problem, T, grid)``.

    Returns
    -------
    (model, info)
        ``model`` is None when the windows alone prove infeasibility. ``info`` has the
        windows and the variable dictionaries (``z``, ``y``, ``u``, ``v``) and sizes.
    """
    import pyscipopt as scip

    win = windows if windows is not None else temporal_windows(problem, T, grid)
    if not win.feasible:
        return None, {"win": win}
    M = problem.num_microbatches
    devs = list(range(problem.num_devices)) if devices is None else [int(d) for d in devices]
    keep_st = {s for d in devs for s in problem.device_stages[d]}
    keep = sorted(i for i, o in enumerate(win.ops) if o[0] in keep_st)
    model = scip.Model("probe")
    model.hideOutput()
    p = _Probe(problem, win, model, grid, scip.quicksum)
    p.add_start_vars(keep)
    p.add_windows(set(keep))
    for d in devs:
        stages = problem.device_stages[d]
        idx = [win.index[(s, j, c)] for s in stages for j in range(M) for c in _COMPUTE]
        dlo = min(int(win.es[i]) for i in idx)
        dhi = max(int(win.ls[i]) + p.dur(i) for i in idx)
        p.add_compute_stream(idx, dlo, dhi)
        lim = float(problem.mem_limit[d])
        if not math.isfinite(lim):
            continue
        keys = p.add_offload_vars(stages)
        p.add_offload_links(keys)
        p.add_copy_stream(keys, dlo, dhi)
        p.add_memory(stages, lim, dlo, dhi)
    model.setObjective(0)
    return model, {"win": win, "z": p.z, "y": p.Y, "u": p.U, "v": p.V, "constraints": p.ncons,
                   "variables": model.getNVars()}


class _Probe:
    """The rows of :func:`build_probe`'s model, family by family (``ncons`` counts them).

    ``started(i, t)``: op ``i`` has started by grid point ``t`` (0 before its earliest start,
    1 from its latest, else its variable); ``step(D, s, j, t)``: the offload (``D = U``) has
    ended / the reload (``D = V``) has started by ``t`` for stash ``(s, j)`` (0 when it
    cannot be offloaded, ``y`` after its window).
    """

    def __init__(self, problem: ScheduleProblem, win: Windows, model, grid: float, quicksum) -> None:
        self.problem, self.win, self.model, self.quicksum = problem, win, model, quicksum
        self.M = problem.num_microbatches
        self.tau = [int(round(float(x) / grid)) for x in problem.t_offload]
        self.z: dict[tuple[int, int], Any] = {}
        self.Y: dict[tuple[int, int], tuple[Any, int, int]] = {}
        self.U: dict[tuple[int, int, int], Any] = {}
        self.V: dict[tuple[int, int, int], Any] = {}
        self.ncons = 0

    def dur(self, i: int) -> int:
        """Duration of op ``i`` in grid units."""
        o = self.win.ops[i]
        return self.win.dur[o[2]][o[0]]

    def started(self, i: int, t: int):
        if t < self.win.es[i]:
            return 0
        if t >= self.win.ls[i]:
            return 1
        return self.z[(i, t)]

    def step(self, D: dict, s: int, j: int, t: int):
        if (s, j) not in self.Y:
            return 0
        y, lo, hi = self.Y[(s, j)]
        if t < lo:
            return 0
        if t >= hi:
            return y
        return D[(s, j, t)]

    def add_start_vars(self, keep: list[int]) -> None:
        """``z[i, t]`` for every kept op inside its window, nondecreasing in ``t``."""
        es, ls = self.win.es, self.win.ls
        for i in keep:
            o = self.win.ops[i]
            for t in range(int(es[i]), int(ls[i])):
                self.z[(i, t)] = self.model.addVar(f"z_{o[0]}{o[2]}{o[1]}_{t}", vtype="B")
        for i in keep:
            for t in range(int(es[i]), int(ls[i]) - 1):
                self.model.addCons(self.z[(i, t)] <= self.z[(i, t + 1)])
                self.ncons += 1

    def add_windows(self, keep: set[int]) -> None:
        """The difference constraints of the windows: ``z[b, t] <= z[a, t - l]``."""
        for a, b, length in self.win.edges:
            if a not in keep or b not in keep:
                continue
            for t in range(int(self.win.es[b]), int(self.win.ls[b])):
                za = self.started(a, t - length)
                if _is_one(za):
                    continue
                self.model.addCons(self.started(b, t) <= za)
                self.ncons += 1

    def add_compute_stream(self, idx: list[int], dlo: int, dhi: int) -> None:
        """At most one F/B/W of a device (ops ``idx``) per grid cell: op i runs in cell t iff
        it started in (t - d, t]."""
        es, ls = self.win.es, self.win.ls
        for t in range(dlo, dhi):
            terms = []
            for i in idx:
                dd = self.dur(i)
                if dd <= 0 or t - dd >= ls[i] or t < es[i]:
                    continue
                terms.append(self.started(i, t) - self.started(i, t - dd))
            if len(terms) > 1:
                self.model.addCons(self.quicksum(terms) <= 1)
                self.ncons += 1

    def add_offload_vars(self, stages) -> list[tuple[int, int]]:
        """``y``, ``u[t]``, ``v[t]`` of every stash of ``stages`` that may be offloaded (its
        offload can end before its reload must start); returns those stashes."""
        es, ls, du, tau = self.win.es, self.win.ls, self.win.dur, self.tau
        for s in stages:
            if float(self.problem.offload_bytes[s]) <= 0:
                continue
            f = du["F"][s]
            for j in range(self.M):
                iF, iB = self.win.index[(s, j, "F")], self.win.index[(s, j, "B")]
                lo = int(es[iF]) + f + tau[s]  # earliest end of the offload
                hi = int(ls[iB]) - tau[s]  # latest start of the reload
                if hi < lo:
                    continue
                y = self.model.addVar(f"y_{s}_{j}", vtype="B")
                self.Y[(s, j)] = (y, lo, hi)
                for t in range(lo, hi):
                    self.U[(s, j, t)] = self.model.addVar(f"u_{s}_{j}_{t}", vtype="B")
                    self.V[(s, j, t)] = self.model.addVar(f"v_{s}_{j}_{t}", vtype="B")
        return [(s, j) for s in stages for j in range(self.M) if (s, j) in self.Y]

    def add_offload_links(self, keys: list[tuple[int, int]]) -> None:
        """``u``, ``v`` nondecreasing, ``v <= u``, ``O.start >= F.end``, ``R.end <= B.start``."""
        U, V, tau, model = self.U, self.V, self.tau, self.model
        for (s, j) in keys:
            y, lo, hi = self.Y[(s, j)]
            iF, iB = self.win.index[(s, j, "F")], self.win.index[(s, j, "B")]
            f = self.win.dur["F"][s]
            for t in range(lo, hi):
                model.addCons(self.step(U, s, j, t) <= self.step(U, s, j, t + 1))
                model.addCons(self.step(V, s, j, t) <= self.step(V, s, j, t + 1))
                model.addCons(self.step(V, s, j, t) <= self.step(U, s, j, t))
                zf = self.started(iF, t - f - tau[s])  # offload ended by t -> F ended by t - tau
                if not _is_one(zf):
                    model.addCons(self.step(U, s, j, t) <= zf)
                self.ncons += 4
            for t in range(int(self.win.es[iB]), int(self.win.ls[iB])):  # B started by t -> reload ended by t
                model.addCons(self.started(iB, t) <= 1 - y + self.step(V, s, j, t - tau[s]))
                self.ncons += 1

    def add_copy_stream(self, keys: list[tuple[int, int]], dlo: int, dhi: int) -> None:
        """At most one O or R per device and grid cell."""
        U, V, tau = self.U, self.V, self.tau
        if not keys or max(tau[s] for s, _ in keys) <= 0:
            return
        for t in range(dlo, dhi):
            terms = []
            for (s, j) in keys:
                _, lo, hi = self.Y[(s, j)]
                ts = tau[s]
                if ts <= 0 or t + ts < lo or t - ts >= hi:
                    continue
                terms.append(self.step(U, s, j, t + ts) - self.step(U, s, j, t)
                             + self.step(V, s, j, t) - self.step(V, s, j, t - ts))
            if len(terms) > 1:
                self.model.addCons(self.quicksum(terms) <= 1)
                self.ncons += 1

    def add_memory(self, stages, lim: float, dlo: int, dhi: int) -> None:
        """The device memory at every grid point (Contract 3 rule 5): ops started by ``t``,
        minus offloaded stashes with ``O.end <= t < R.start``."""
        problem, index = self.problem, self.win.index
        for t in range(dlo, dhi):
            expr = 0
            const = 0.0
            for s in stages:
                coef = {"F": float(problem.mem_f[s]), "B": float(problem.mem_b[s]), "W": float(problem.mem_w[s])}
                for j in range(self.M):
                    for ty in _COMPUTE:
                        zz = self.started(index[(s, j, ty)], t)
                        if isinstance(zz, int):
                            const += coef[ty] * zz
                        else:
                            expr = expr + coef[ty] * zz
                    if (s, j) in self.Y:
                        expr = expr - float(problem.offload_bytes[s]) * (self.step(self.U, s, j, t)
                                                                         - self.step(self.V, s, j, t))
            if isinstance(expr, (int, float)):
                if const > lim * (1 + 1e-9):
                    self.model.addCons(self.quicksum([]) >= 1)  # fixed ops alone exceed the limit
            else:
                self.model.addCons(expr <= lim * (1 + 1e-9) - const)
            self.ncons += 1


def _is_one(e) -> bool:
    return isinstance(e, int) and e == 1


@dataclass
class ProbeBound:
    """Result of :func:`probe_lower_bound`.

    Attributes
    ----------
    bound_s : float
        Proven lower bound on the objective (s); the input ``lower_bound_s`` when nothing
        better was proven.
    grid_s : float or None
        The exact grid (None: durations not commensurable, nothing probed).
    infeasible_T : int or None
        Largest value (grid units) proven infeasible.
    probes : list of dict
        Every probe: ``T`` (grid units), ``device``, ``result`` ("infeasible", "feasible",
        "unknown", "windows"), ``wall_s``.
    wall_s : float
        Total time.
    interrupted : bool
        Ctrl-C stopped a probe (the bound so far is valid; bisection stopped there).
    """

    bound_s: float
    grid_s: float | None
    infeasible_T: int | None
    probes: list = field(default_factory=list)
    wall_s: float = 0.0
    interrupted: bool = False

    def to_dict(self) -> dict:
        return {"bound_s": self.bound_s, "grid_s": self.grid_s, "infeasible_T": self.infeasible_T,
                "probes": len(self.probes), "wall_s": self.wall_s, "interrupted": self.interrupted,
                "proven": [p for p in self.probes if p["result"] in ("infeasible", "windows")][-3:]}


def probe_lower_bound(problem: ScheduleProblem, *, upper_bound_s: float, lower_bound_s: float = 0.0,
                      time_limit_s: float = 60.0, probe_time_s: float = 10.0) -> ProbeBound:
    """Largest value proven infeasible by bisection with per-device time-indexed probes.

    For ``T`` (grid units) strictly between ``lower_bound_s`` and ``upper_bound_s`` the
    probe asks whether a schedule of value ``<= T * grid`` exists: first through the
    windows (:func:`temporal_windows`), then per device through :func:`build_probe`
    restricted to that device, each solved by SCIP (:func:`fxpipe.mip.solve_model`) under
    ``probe_time_s``. One infeasible device proves ``T`` infeasible; feasibility is monotone
    in ``T``, so a device infeasible at ``T`` is infeasible below and one feasible at ``T``
    feasible above (both are reused).

    Soundness
    ---------
    Let a valid schedule of value ``v <= T * grid`` exist. By the exchange argument of
    OptPipe Section 4.1.1 one with the fixed micro-batch order exists with the same value,
    and it obeys the memory-implied orders. Translate it so that F(0, 0) starts at 0 and
    round every start time down to the grid, ``x -> g * floor(x / g)``. Durations are
    multiples of ``g``, so ends round down the same way, and ``floor`` is monotone: every
    dependency, non-overlap and copy-order relation ``a + l <= b`` (``l`` a multiple of
    ``g``) survives. Memory: the rounded schedule's memory at grid point ``t`` counts the ops
    that start before ``t + g`` and the stashes with ``O.end < t + g <= R.start``, i.e. the
    real memory just before ``t + g``; memory only rises at F and R starts, where Contract 3
    checks it, so it is within the limit at every time, hence at every grid point. A span
    ``e - s`` becomes ``floor(e) - floor(s) <= ceil(e - s)``, so the rounded value is at most
    ``T``. So "no grid schedule of value <= T" (a fortiori: no schedule of one device's
    relaxation, which drops constraints) proves that every schedule has value ``> T * grid``;
    the returned bound ``T * grid`` is valid (with ``makespan`` the bound could be
    ``(T + 1) * grid``, since a common shift keeps the earliest start on the grid; it is not
    claimed). Tested against exhaustive search (``tests/test_schedule_probe.py``).

    Parameters
    ----------
    problem : ScheduleProblem
    upper_bound_s : float
        Value of a known schedule (s): only values below it are probed.
    lower_bound_s : float
        A known lower bound (s), e.g. :func:`fxpipe.schedule.bounds.combinatorial_lower_bound`.
    time_limit_s : float
        Total budget (s).
    probe_time_s : float
        SCIP limit per device probe (s).

    Returns
    -------
    ProbeBound
    """
    from fxpipe.mip import solve_model

    t0 = time.perf_counter()
    grid = exact_grid(problem)
    out = ProbeBound(bound_s=float(lower_bound_s), grid_s=grid, infeasible_T=None)
    if grid is None or not upper_bound_s > lower_bound_s:
        return out
    a = int(math.floor(lower_bound_s / grid + 1e-9))  # T = a * grid <= lower bound: no news
    b = int(math.ceil(upper_bound_s / grid - 1e-9)) - 1  # largest T below the upper bound
    a += 1
    infeasible_at: dict[int, int] = {}  # device -> largest T proven infeasible
    feasible_at: dict[int, int] = {}  # device -> smallest T found feasible
    order = list(reversed(range(problem.num_devices)))

    def left() -> float:
        return time_limit_s - (time.perf_counter() - t0)

    def probe(T: int) -> bool:
        """True when T is proven infeasible."""
        if any(Ti >= T for Ti in infeasible_at.values()):
            return True
        ts = time.perf_counter()
        win = temporal_windows(problem, T, grid)
        if not win.feasible:
            out.probes.append({"T": T, "device": None, "result": "windows", "wall_s": time.perf_counter() - ts})
            infeasible_at[-1] = max(infeasible_at.get(-1, T), T)
            return True
        if int(win.ls.max()) - int(win.es.min()) > MAX_GRID_POINTS:
            return False
        devs = sorted(order, key=lambda d: (-infeasible_at.get(d, -1), order.index(d)))
        for d in devs:
            if d in feasible_at and feasible_at[d] <= T:
                continue
            if left() <= 0.5:
                return False
            ts = time.perf_counter()
            model, info = build_probe(problem, T, grid, devices=[d], windows=win)
            if model is None:  # pragma: no cover - the windows were feasible above
                return True
            res = solve_model(model, time_limit_s=max(0.5, min(probe_time_s, left())), presolving="default")
            if res.status == "userinterrupt":  # Ctrl-C: no more probes
                out.interrupted = True
                return False
            result = {"infeasible": "infeasible", "optimal": "feasible"}.get(res.raw_status, "unknown")
            if res.n_solutions > 0:
                result = "feasible"
            out.probes.append({"T": T, "device": d, "result": result, "wall_s": time.perf_counter() - ts})
            if result == "infeasible":
                infeasible_at[d] = max(infeasible_at.get(d, T), T)
                return True
            if result == "feasible":
                feasible_at[d] = min(feasible_at.get(d, T), T)
        return False

    while a <= b and left() > 0.5 and not out.interrupted:
        mid = (a + b + 1) // 2
        if probe(mid):
            out.infeasible_T = mid
            a = mid + 1
        else:
            b = mid - 1
    if out.infeasible_T is not None:
        out.bound_s = max(out.bound_s, out.infeasible_T * grid)
    out.wall_s = time.perf_counter() - t0
    return out
