"""Pure MIP builders for the lower-bound hierarchy of Archer et al. (2024), Section 3.

Every builder is a pure function of plain data (:class:`MipData`, integers) that returns a
fresh :class:`pyscipopt.Model` and a :class:`MipVars` holding the variables in dicts keyed by
index tuples. Every variable and constraint is named through :func:`_name`. Nothing here
solves a model: see :mod:`fxpipe.partition.bounds.solve`.

Notation (blocks are numbered ``1..K`` in pipeline order, as in Archer Figure 3):

* ``y[v, b]`` (binary, ``b = 1..K-1``): node ``v`` is in block ``b`` or earlier. The
  constants ``y[v, 0] = 0`` and ``y[v, K] = 1`` are not variables. ``x[v, b] = y[v, b] -
  y[v, b-1]`` is eliminated through Archer Eq. (11).
* ``comm="dag"``: ``c[u, b] >= 0`` (continuous): the tensor of ``u`` enters or leaves block
  ``b`` (Archer Eq. 9 and 10).
* ``comm="relay"``: ``z[u, b] >= 0`` (continuous, ``b = 1..K-1``): the tensor of ``u``
  crosses the boundary between block ``b`` and ``b+1``, ``z[u, b] >= y[u, b] - y[v, b]`` for
  every consumer ``v``. A relayed tensor crosses every boundary between its producer's block
  and its last consumer's block, so the relay io of block ``b`` is exactly the tensors
  crossing boundary ``b-1`` (inputs) plus those crossing boundary ``b`` (outputs): the
  pass-through term of Contract 2 comes out of the monotone "prefix" variables ``y``.
* block cost ``block[b] = sum_v work(v) x[v, b] + sum_u comm(u) * (c[u, b] | z[u, b-1] +
  z[u, b])`` (Archer Eq. 7), where ``comm(u) = alpha * size_out(u) / B`` and ``alpha = 2``
  for training (activation forward, gradient backward), 1 for inference.

All costs in :class:`MipData` are divided by a common scale so that SCIP's absolute
tolerances act on numbers of order 1; :attr:`MipData.scale` converts back to seconds.

References
----------
Archer, Fahrbach, Liu, Prabhu. "Practical Performance Guarantees for Pipelined DNN
Inference", ICML 2024. Section 3.1 (Figure 3, Eq. 5-12), Section 3.2 (Eq. 13-14),
Section 3.3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyscipopt as scip

from fxpipe.errors import InputError

__all__ = [
    "MipData",
    "MipVars",
    "build_exact",
    "build_bottleneck",
    "build_guess",
    "assignment_from_y",
]


@dataclass(frozen=True)
class MipData:
    """Plain data every builder reads (no OpGraph, so it pickles cheaply to workers).

    Attributes
    ----------
    n : int
        Number of nodes.
    edges : int64 array (m, 2)
        DAG edges ``(u, v)``: v consumes the output tensor of u.
    work : float64 array (n,)
        Node work of the objective (``t_fwd`` or ``t_fwd + t_bwd_input + t_bwd_weight``)
        divided by :attr:`scale`.
    comm_cost : float64 array (n,)
        ``alpha * size_out(u) / B / scale``: the cost one block pays for one transfer of
        the tensor of u (alpha = 2 for training, 1 for inference).
    comm : {"dag", "relay"}
        Communication model of Contract 2.
    k : int
        Number of pipeline blocks of the original problem (>= 1).
    simple_work : float
        Lemma 3.3 bound on the work of some block, ``max(max work, sum work / k)``, scaled.
    mem_bytes : float64 array (n,) or None
        Static bytes each node needs on its device (parameters times the state factor of
        :mod:`fxpipe.partition.memory`); None: no memory constraint.
    capacity_bytes : float or None
        Per-device capacity, bytes.
    act_bytes : float64 array (n,) or None
        Activation bytes of one micro-batch of each node (None: 0).
    inflight : float64 array (k,) or None
        Micro-batches in flight on the stage at pipeline position s (0-based), so stage s
        holds ``mem + inflight[s] * act`` bytes (None: all 1).
    scale : float
        Seconds per model unit: a model value ``z`` means ``z * scale`` seconds.
    """

    n: int
    edges: np.ndarray
    work: np.ndarray
    comm_cost: np.ndarray
    comm: str
    k: int
    simple_work: float
    mem_bytes: np.ndarray | None = None
    capacity_bytes: float | None = None
    scale: float = 1.0
    act_bytes: np.ndarray | None = None
    inflight: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.comm not in ("dag", "relay"):
            raise InputError(f"comm must be 'dag' or 'relay', got {self.comm!r}")
        if self.k < 1:
            raise InputError(f"k must be >= 1, got {self.k}")

    @property
    def has_memory(self) -> bool:
        """Whether a per-device capacity constraint is part of the model."""
        return self.mem_bytes is not None and self.capacity_bytes is not None


@dataclass
class MipVars:
    """Variables of a built model, keyed by index tuples.

    Attributes
    ----------
    K : int
        Number of blocks in the model (k for exact, 3 for the superblock relaxations).
    y : dict[(v, b), Var]
        Prefix variables, ``b = 1..K-1``.
    cut : dict[(u, b), Var]
        ``c[u, b]`` (dag) or ``z[u, b]`` (relay).
    bottleneck : Var or None
        The bottleneck variable (None for the three-superblock model, whose objective is
        block 2 itself).
    block : list of expressions
        ``block[b-1]`` is the cost expression of block b (scaled units).
    """

    K: int
    y: dict = field(default_factory=dict)
    cut: dict = field(default_factory=dict)
    bottleneck: Any = None
    block: list = field(default_factory=list)


def _name(kind: str, *idx: int) -> str:
    """The one naming helper for every variable and constraint: ``kind[i,j]``."""
    return f"{kind}[{','.join(str(int(i)) for i in idx)}]" if idx else kind


def _new_model(name: str) -> scip.Model:
    model = scip.Model(name)
    model.hideOutput(True)
    return model


def _Y(y: dict, v: int, b: int, K: int):
    """``y[v, b]`` with the constants ``y[v, 0] = 0`` and ``y[v, K] = 1``."""
    if b <= 0:
        return 0.0
    if b >= K:
        return 1.0
    return y[v, b]


def _add(model: scip.Model, cons, name: str) -> None:
    model.addCons(cons, name=name)


def _is_const(expr) -> bool:
    return isinstance(expr, (int, float))


def _add_blocks(model: scip.Model, data: MipData, K: int, *, relax: bool) -> MipVars:
    """Variables y and c/z, the DAG constraints (8), tensor cuts (9)/(10) or relay
    crossings, and the block-cost expressions (7) for a K-block model."""
    vt = "C" if relax else "B"
    mv = MipVars(K=K)
    n = data.n
    for v in range(n):
        for b in range(1, K):
            mv.y[v, b] = model.addVar(name=_name("y", v, b), vtype=vt, lb=0.0, ub=1.0)
    # y monotone in b
    for v in range(n):
        for b in range(2, K):
            _add(model, mv.y[v, b - 1] <= mv.y[v, b], _name("mono", v, b))
    edges = data.edges
    # (8) DAG constraints: v done by b => u done by b
    for u, v in edges.tolist():
        for b in range(1, K):
            _add(model, mv.y[u, b] >= mv.y[v, b], _name("dag", u, v, b))
    heavy = data.comm_cost > 0
    cuts_by_block: list[list] = [[] for _ in range(K + 1)]
    if data.comm == "dag":
        for u in np.flatnonzero(heavy).tolist():
            for b in range(1, K + 1):
                mv.cut[u, b] = model.addVar(name=_name("c", u, b), vtype="C", lb=0.0)
        for u, v in edges.tolist():
            if not heavy[u]:
                continue
            for b in range(1, K + 1):
                # (9) cut input tensor: u before b and v in b
                if b >= 2:
                    rhs = _Y(mv.y, u, b - 1, K) + _Y(mv.y, v, b, K) - _Y(mv.y, v, b - 1, K) - 1
                    _add(model, mv.cut[u, b] >= rhs, _name("cin", u, v, b))
                # (10) cut output tensor: u in b and v after b
                if b <= K - 1:
                    rhs = _Y(mv.y, u, b, K) - _Y(mv.y, u, b - 1, K) - _Y(mv.y, v, b, K)
                    _add(model, mv.cut[u, b] >= rhs, _name("cout", u, v, b))
        for b in range(1, K + 1):
            cuts_by_block[b] = [(float(data.comm_cost[u]), mv.cut[u, b]) for u in np.flatnonzero(heavy).tolist()]
    else:  # relay: z[u, b] = tensor of u crosses boundary b|b+1
        for u in np.flatnonzero(heavy).tolist():
            for b in range(1, K):
                mv.cut[u, b] = model.addVar(name=_name("z", u, b), vtype="C", lb=0.0)
        for u, v in edges.tolist():
            if not heavy[u]:
                continue
            for b in range(1, K):
                _add(model, mv.cut[u, b] >= mv.y[u, b] - mv.y[v, b], _name("cross", u, v, b))
        for b in range(1, K + 1):
            terms = []
            for u in np.flatnonzero(heavy).tolist():
                if b - 1 >= 1:
                    terms.append((float(data.comm_cost[u]), mv.cut[u, b - 1]))
                if b <= K - 1:
                    terms.append((float(data.comm_cost[u]), mv.cut[u, b]))
            cuts_by_block[b] = terms
    for b in range(1, K + 1):
        mv.block.append(_work_expr(data.work, mv.y, b, K) + scip.quicksum(c * var for c, var in cuts_by_block[b]))
    return mv


def _work_expr(weights: np.ndarray, y: dict, b: int, K: int):
    """``sum_v weights[v] * x[v, b]`` with x eliminated through Eq. (11)."""
    terms = []
    const = 0.0
    for v in np.flatnonzero(weights > 0).tolist():
        w = float(weights[v])
        hi, lo = _Y(y, v, b, K), _Y(y, v, b - 1, K)
        for coef, t in ((w, hi), (-w, lo)):
            if _is_const(t):
                const += coef * t
            else:
                terms.append(coef * t)
    return scip.quicksum(terms) + const


def _stage_mem(data: MipData, inflight: float) -> np.ndarray:
    """Bytes per node on a stage with ``inflight`` micro-batches, divided by the capacity."""
    mem = np.asarray(data.mem_bytes, dtype=np.float64)
    if data.act_bytes is not None:
        mem = mem + float(inflight) * np.asarray(data.act_bytes, dtype=np.float64)
    return mem / float(data.capacity_bytes)


def _inflight(data: MipData) -> np.ndarray:
    return np.ones(data.k) if data.inflight is None else np.asarray(data.inflight, dtype=np.float64)


def _add_capacity(model: scip.Model, data: MipData, mv: MipVars, b: int, positions: range, tag: str) -> None:
    """Block b of the model spans the pipeline positions ``positions`` (0-based, one
    device each): its nodes' memory, counted with the fewest in-flight micro-batches of
    those positions, is at most ``len(positions)`` capacities (sound: each real stage holds
    at least that much)."""
    if not data.has_memory or len(positions) == 0:
        return
    fl = _inflight(data)
    least = float(min(fl[p] for p in positions))
    expr = _work_expr(_stage_mem(data, least), mv.y, b, mv.K)
    if _is_const(expr):  # pragma: no cover (K >= 2 always has variables)
        return
    _add(model, expr <= float(len(positions)), _name(f"mem_{tag}", b))


def build_exact(data: MipData, *, relax: bool = False, known_lower_bound: float = 0.0) -> tuple[scip.Model, MipVars]:
    """The exact MIP of Archer Figure 3 (Eq. 5-12) for ``data.k`` blocks.

    x is eliminated through Eq. (11); the cut variables c (or z in relay mode) are
    continuous (they are integral at an optimum whenever y is). Adds the valid inequality
    ``bottleneck >= simple_work`` (Lemma 3.3) and, when a capacity is set, one memory row
    per block: block b holds ``mem + inflight[b-1] * act`` bytes (the stage model of
    :mod:`fxpipe.partition.memory`). The MIP lets empty blocks sit anywhere while
    :class:`~fxpipe.partition.objective.Partition` puts them last; moving a stage to a later
    position never raises its in-flight count, so the MIP is a relaxation of the
    memory-constrained problem and its dual bound stays valid.

    Parameters
    ----------
    data : MipData
    relax : bool
        If True, y is continuous: the LP relaxation (the ``lp`` tier).
    known_lower_bound : float
        A lower bound already proven for the same problem (scaled units), e.g. by the
        three-superblock MIPs; it becomes the lower bound of ``bottleneck`` (valid, and it
        lets SCIP prune with it).

    Returns
    -------
    model : pyscipopt.Model
        Minimises ``bottleneck`` (scaled units).
    vars : MipVars

    References
    ----------
    Archer et al. 2024, Section 3.1, Figure 3; Theorem 3.2.
    """
    K = data.k
    model = _new_model(f"exact_k{K}")
    if K == 1:
        # one block: y has no variables; the cost is a constant
        mv = MipVars(K=1)
        mv.bottleneck = model.addVar(name=_name("bottleneck"), lb=0.0)
        total = float(np.sum(data.work))
        _add(model, mv.bottleneck >= total, _name("block", 1))
        mv.block.append(total)
        if data.has_memory and float(np.sum(_stage_mem(data, _inflight(data)[0]))) > 1.0:
            _add(model, mv.bottleneck <= -1.0, _name("mem_block", 1))  # infeasible on purpose
        model.setObjective(mv.bottleneck, "minimize")
        return model, mv
    mv = _add_blocks(model, data, K, relax=relax)
    mv.bottleneck = model.addVar(name=_name("bottleneck"), lb=max(float(data.simple_work), float(known_lower_bound)))
    for b in range(1, K + 1):
        _add(model, mv.bottleneck >= mv.block[b - 1], _name("bneck", b))  # (6)
        _add_capacity(model, data, mv, b, range(b - 1, b), "block")
    model.setObjective(mv.bottleneck, "minimize")
    return model, mv


def build_bottleneck(data: MipData, *, relax: bool = False) -> tuple[scip.Model, MipVars]:
    """The three-superblock MIP of Archer Section 3.2 (Eq. 14).

    Superblock 1 holds every block before the bottleneck block, superblock 3 every block
    after it; block 2 is a block with work at least Lemma 3.3's L (constraint (14)). The
    objective is the cost of block 2 alone (block_1 and block_3 are dropped). With a
    capacity, block 2 fits one device with the fewest in-flight micro-batches of any
    position, and superblocks 1 and 3 together fit ``k - 1`` devices counted the same way.

    Soundness in relay mode: collapsing the blocks before and after block j into one
    superblock each leaves the relay io of block j unchanged (a tensor passes through j iff
    it is produced before j and last consumed after j), so the model's block 2 costs exactly
    what block j costs.

    References
    ----------
    Archer et al. 2024, Section 3.2, Eq. (13)-(14), Corollary 3.4.
    """
    K = 3
    model = _new_model("bottleneck")
    mv = _add_blocks(model, data, K, relax=relax)
    w2 = _work_expr(data.work, mv.y, 2, K)
    _add(model, w2 >= float(data.simple_work), _name("eq14"))
    if data.has_memory:
        # block 2 sits at an unknown position: count the fewest in-flight micro-batches
        _add_capacity(model, data, mv, 2, range(data.k), "block")
        if data.k > 1:
            least = _stage_mem(data, float(_inflight(data).min()))
            outer = _work_expr(least, mv.y, 1, K) + _work_expr(least, mv.y, 3, K)
            _add(model, outer <= float(data.k - 1), _name("mem_outer"))
    mv.bottleneck = model.addVar(name=_name("bottleneck"), lb=float(data.simple_work))
    _add(model, mv.bottleneck >= mv.block[1], _name("bneck", 2))
    model.setObjective(mv.bottleneck, "minimize")
    return model, mv


def build_guess(data: MipData, j: int, *, relax: bool = False, known_lower_bound: float = 0.0) -> tuple[scip.Model, MipVars]:
    """LB_j of Archer Section 3.3: guess that block ``j`` (1-based) has work >= L.

    Three superblocks: blocks ``1..j-1``, block ``j``, blocks ``j+1..k``. A superblock's
    cost counts its nodes' work and the tensors crossing its boundary once; its blocks'
    average cost is at most the bottleneck, so ``(j-1) * bottleneck >= block_1`` and
    ``(k-j) * bottleneck >= block_3``. For ``j = 1`` superblock 1 is empty (``y[v, 1] =
    0``), for ``j = k`` superblock 3 is empty (``y[v, 2] = 1``). With a capacity,
    superblocks hold ``j-1``, 1 and ``k-j`` devices' worth of memory, each counted with the
    fewest in-flight micro-batches of the positions it spans (block 2 is at position j-1).

    Soundness (dag and relay): every tensor crossing a superblock boundary is an input of
    at least one block inside superblock 3 and an output of the block producing it inside
    superblock 1, so ``block_1`` and ``block_3`` are at most the sum of the real costs of
    their blocks; block 2 costs exactly what block j costs (see :func:`build_bottleneck`).

    ``known_lower_bound`` (scaled units), a bound already proven for the same problem,
    becomes the lower bound of ``bottleneck``: the result is then ``max(LB_j, known)``,
    and ``min_j max(LB_j, known) = max(min_j LB_j, known)`` is still a valid bound. With the
    three-superblock bound as ``known`` nothing changes at optimality (every LB_j model is
    the three-superblock model plus constraints) but time-outs keep it.

    References
    ----------
    Archer et al. 2024, Section 3.3.
    """
    k = data.k
    if not 1 <= j <= k:
        raise InputError(f"guessed block j must lie in 1..{k}, got {j}")
    K = 3
    model = _new_model(f"guess_j{j}")
    mv = _add_blocks(model, data, K, relax=relax)
    for v in range(data.n):
        if j == 1:
            model.chgVarUb(mv.y[v, 1], 0.0)
        if j == k:
            model.chgVarLb(mv.y[v, 2], 1.0)
    w2 = _work_expr(data.work, mv.y, 2, K)
    _add(model, w2 >= float(data.simple_work), _name("eq14"))
    mv.bottleneck = model.addVar(name=_name("bottleneck"), lb=max(float(data.simple_work), float(known_lower_bound)))
    _add(model, mv.bottleneck >= mv.block[1], _name("bneck", 2))
    if j > 1:
        _add(model, (j - 1) * mv.bottleneck >= mv.block[0], _name("bneck", 1))
    if j < k:
        _add(model, (k - j) * mv.bottleneck >= mv.block[2], _name("bneck", 3))
    if data.has_memory:
        _add_capacity(model, data, mv, 1, range(0, j - 1), "super")
        _add_capacity(model, data, mv, 2, range(j - 1, j), "super")
        _add_capacity(model, data, mv, 3, range(j, k), "super")
    model.setObjective(mv.bottleneck, "minimize")
    return model, mv


def assignment_from_y(y_values: dict, n: int, K: int) -> np.ndarray:
    """Block (0-based) of every node from solved prefix values ``y[v, b]``.

    ``x[v, b] = 1`` for the first b with ``y[v, b] = 1`` (Eq. 11), so the 0-based block is
    the number of ``b in 1..K-1`` with ``y[v, b] < 0.5``.
    """
    a = np.zeros(n, dtype=np.int64)
    for (v, b), val in y_values.items():
        if val < 0.5:
            a[v] += 1
    return np.minimum(a, K - 1)


def warm_start_values(data: MipData, K: int, assignment: np.ndarray) -> dict[str, float]:
    """Values of y, c/z and bottleneck (by variable name) encoding a 0-based assignment
    of a K-block model (``exact``): the MIP start built from a known partition."""
    a = np.asarray(assignment, dtype=np.int64)
    vals: dict[str, float] = {}
    for v in range(data.n):
        for b in range(1, K):
            vals[_name("y", v, b)] = 1.0 if a[v] <= b - 1 else 0.0
    heavy = data.comm_cost > 0
    blocks = np.zeros(K)
    np.add.at(blocks, a, data.work)
    succ: list[list[int]] = [[] for _ in range(data.n)]
    for u, v in data.edges.tolist():
        succ[u].append(v)
    for u in np.flatnonzero(heavy).tolist():
        cons = succ[u]
        cb = sorted({int(a[v]) for v in cons})
        if data.comm == "dag":
            hit = set()
            if any(c != a[u] for c in cb):
                hit.add(int(a[u]))
            hit.update(c for c in cb if c != a[u])
            for b in range(1, K + 1):
                val = 1.0 if (b - 1) in hit else 0.0
                vals[_name("c", u, b)] = val
                blocks[b - 1] += val * data.comm_cost[u]
        else:
            last = max(cb) if cb else int(a[u])
            for b in range(1, K):  # boundary b|b+1 is between 0-based blocks b-1 and b
                val = 1.0 if a[u] <= b - 1 < last else 0.0
                vals[_name("z", u, b)] = val
                if val:
                    blocks[b - 1] += data.comm_cost[u]
                    blocks[b] += data.comm_cost[u]
    vals[_name("bottleneck")] = float(max(blocks.max(), data.simple_work))
    return vals
