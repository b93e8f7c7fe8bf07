"""Chain decomposition of an op graph: an exact DP for relay pipelines with gates, and the
``chain`` lower bound (no torch here).

Real models are chains: a transformer is a sequence of identical layers joined by the
residual stream, with a few tensors (attention mask, rotary tables) that every layer reads.
This module finds that chain in any OpGraph and uses it to solve the relay-communication
partition problem of Contract 2 (DESIGN.md) by dynamic programming over the chain, which
gives both a lower bound on the optimal bottleneck that stays tight for large k and, where
the chain is fine enough, an optimal partition.

Relay costs only depend on the prefixes
---------------------------------------
Blocks ``P_1..P_k`` in pipeline order define the nested *ideals* (down-closed node sets)
``I_b = P_1 u ... u P_b``. With relay communication a tensor crosses the boundary after
block b iff its producer is in ``I_b`` and some consumer is not, so block b costs exactly::

    f(P_b) = W(I_b) - W(I_{b-1}) + io_scale * (cut(I_{b-1}) + cut(I_b))          (1)

where ``W`` is the work (objective's per-node time) and ``cut(I)`` the bytes of the tensors
produced in ``I`` and consumed outside it; ``io_scale`` is ``1/B`` (inference) or ``2/B``
(training). The partition problem is to choose ``0 = I_0 <= I_1 <= ... <= I_k = V``.

Three reductions (each keeps the optimum or only lowers it)
-----------------------------------------------------------
Let ``w(v)`` be the node's work under the objective and ``s(v)`` its output bytes.

*Detached nodes* (``KIND_DETACHED``): when the graph has ``output`` nodes, nodes that are not
ancestors of one (dead code: shape assertions, unused ``arange``\\ s) are dropped for the
bound. Deleting nodes never raises the optimum (Lemma D): restricting a partition of G to
``G - X`` keeps it acyclic, removes work and never makes a tensor cross more boundaries.

*Lazy nodes* (``KIND_LAZY``): ``w(v) = 0``, at least one consumer, no consumer that is a zero
sink, and ``s(v) >= sum of s(u)`` over its producers u (views, reshapes, expands, casts, the
model inputs). Lemma L: moving such a node from its block to the earliest block of its
consumers keeps the blocks in pipeline order, changes no block's work (``w(v) = 0``) and
raises no boundary's cut: on every boundary it passes, its own tensor (``s(v)``) stops
crossing and at most its producers' tensors (``sum s(u)``) start crossing; every other
boundary is unchanged. So some optimal partition puts every lazy node with its earliest
consumer. (A consumer that is a zero sink is excluded so that the two rules below never
define a node's block through each other.)

*Zero sinks* (``KIND_SINK``): ``w(v) = 0`` and no consumer (the ``output`` node, asserts).
Lemma S: moving one to the latest block of its producers only shortens its producers'
tensors. Lazy moves only move nodes later and sink moves only earlier, so alternating them
terminates (``sum of lazy blocks - sum of sink blocks`` grows), and some optimal partition
of the reduced graph satisfies both rules at once.

The remaining nodes are *core* (``KIND_CORE``); in such a canonical partition the block of
every lazy and sink node is determined by the core nodes, and an ideal is determined by its
core part, which is an ideal of the *reduced* core order (``u < v`` if a path of lazy nodes
joins them).

Gates and segments
------------------
A core node is a *gate* if it is comparable with every other core node (an ancestor or a
descendant of each). The gates are totally ordered and cut the core nodes, in topological
order, into segments ``S_1, S_2, ...`` (each ending with its gate). Lemma G: every ideal C of
the reduced core order is ``S_<j u J`` with J an ideal of ``S_j`` alone. Proof: let
``g_j`` be the first gate not in C. Each earlier gate ``g_i`` is in C, and every node of
``S_i`` precedes ``g_i`` topologically and is comparable with it, hence an ancestor, hence
in C. Every node after ``g_j`` is comparable with it and follows it, hence a descendant, and
an ideal without ``g_j`` holds none of its descendants. So C lies between ``S_<j`` and
``S_<j u S_j``, and an order relation inside ``S_j`` only passes through nodes of ``S_j``
(positions are contiguous), so ``J = C n S_j`` is an ideal of ``S_j``. In a Llama layer
the residual additions, the norms and most matmuls are gates; a segment is a handful of
parallel branches (q/k/v projections, gate/up projections).

The DP
------
Each segment's ideals are enumerated (up to :data:`MAX_IDEALS`, segments of at most
:data:`MAX_SEGMENT_CORE` core nodes) into *points* ``(W(I), cut(I))``; the points of all
segments, sorted by ``(segment, W, |J|)`` (a linear extension of inclusion), form a chain in
which a partition is a path of at most k transitions of cost (1). A segment with too many
ideals to list is represented by *bins* ``[a, b]`` of its work range: if its ideals can still
be enumerated (up to :data:`MAX_BINNED_IDEALS`, e.g. the ~900k ideals of a Llama model's
input-processing segment) a bin carries the least work, the largest work and the least cut
of the ideals in it, otherwise the *mandatory* cut (tensors produced before the segment and
consumed after it, which cross every ideal inside it); a transition then costs at least
``lo_q - hi_p + io(p) + io(q)``.

``chain`` lower bound: the smallest T for which a path of at most k transitions of cost <= T
exists, found by bisection over a min-transitions DP: the largest key ``hi_p - io(p)`` among
the points reached in at most t transitions is non-decreasing in t, so a staircase of those
keys over the levels ``t < k`` answers "the fewest transitions to any earlier point p with
``cost(p, q) <= T``" by binary search (:func:`_within_transitions`). Feasibility is monotone
in T, so a bracket found first from the DP's paths (a probe just below a feasible path's
largest cost) decides most steps of the bisection without running the DP; the bisection's
result is the plain one's. It is a relaxation of the canonical problem (points ignore nesting
inside a segment; bins and detached nodes only lower costs), so its value is a lower bound on
the optimal bottleneck of the original graph (Lemmas D, L, S, G).

A decomposition depends on the works only through which nodes have zero work (the kinds) and
through the works of its ideals: graphs with the same edges, ops, output sizes and zero-work
nodes share one structure, weighed per graph (:func:`cached_decomposition`).

Chain partition: the same DP (a Fenwick tree over the keys, Fenwick 1994) restricted to
enumerated points, with inclusion checked for
two points of one segment, blocks of positive work, and the model inputs in the first
block. When it reaches the bound the partition is optimal; blocks are then split (without
raising the bottleneck) until all k stages hold work.

Only ``comm="relay"`` is supported: with dag communication a block's io is not a function of
its two bounding ideals.

References
----------
Archer, Fahrbach, Liu, Prabhu. "Practical Performance Guarantees for Pipelined DNN
Inference", ICML 2024: Section 2.2 (problem), Section 3.2 (superblocks: the idea of
collapsing the blocks before and after a block), Algorithm 1 (DP over a topological order;
here over a chain of ideals). Gates are the "cut vertices" of the partial order; the
enumeration of the ideals of a small poset is the classic down-set enumeration
(Squire, "Enumerating the ideals of a poset", 1995). Fenwick, "A new data structure for
cumulative frequency tables", Software: Practice and Experience 24(3), 1994.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition._numba import NJIT, njit
from fxpipe.partition.objective import Partition, check_objective
from fxpipe.partition.orders import kahn_order

__all__ = [
    "KIND_CORE",
    "KIND_LAZY",
    "KIND_SINK",
    "KIND_DETACHED",
    "MAX_SEGMENT_CORE",
    "MAX_IDEALS",
    "ChainDecomposition",
    "ChainResult",
    "decompose",
    "boundary_weighted_bound",
    "chain_bound",
    "chain_partition",
    "solve_chain",
]

KIND_CORE, KIND_LAZY, KIND_SINK, KIND_DETACHED = 0, 1, 2, 3
#: Segments with more core nodes than this are not enumerated (ideals are 64-bit masks).
MAX_SEGMENT_CORE = 62
#: Segments with more ideals than this are not listed one by one (bins instead).
MAX_IDEALS = 4096
#: Segments with up to this many ideals are still enumerated for the bound's bins.
MAX_BINNED_IDEALS = 1_000_000
#: Bins per ``W / k`` for segments that are not enumerated: a transition through a bin can
#: undercount its block's work by at most one bin width, ``W / (k * BINS_PER_BLOCK)``.
BINS_PER_BLOCK = 1000
#: Relative slack of the DP's comparisons (makes "infeasible" robust to rounding).
_REL_EPS = 1e-12


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------


@njit(**NJIT)
def _enumerate_ideals(pred_mask, cap):
    """All down-sets of a poset on ``L <= 62`` nodes numbered in a linear extension.

    ``pred_mask[i]`` has bit j set when j < i is a predecessor of i. Returns
    ``(masks, count)``; ``count = -1`` when there are more than ``cap``.
    """
    L = pred_mask.shape[0]
    out = np.empty(cap + 1, dtype=np.int64)
    cnt = 0
    stack_i = np.empty(2 * L + 2, dtype=np.int64)
    stack_m = np.empty(2 * L + 2, dtype=np.int64)
    top = 0
    stack_i[0] = 0
    stack_m[0] = 0
    top = 1
    while top > 0:
        top -= 1
        i = stack_i[top]
        m = stack_m[top]
        if i == L:
            if cnt >= cap:
                return out[:0], -1
            out[cnt] = m
            cnt += 1
            continue
        # push "exclude" last so that "include" is explored... order does not matter
        stack_i[top] = i + 1
        stack_m[top] = m
        top += 1
        if (pred_mask[i] & m) == pred_mask[i]:
            stack_i[top] = i + 1
            stack_m[top] = m | (np.int64(1) << np.int64(i))
            top += 1
    return out[:cnt], cnt


@njit(**NJIT)
def _segment_points(masks, core_bit, ev_kind, ev_ptr, ev_idx, t_size, t_state, t_always, t_ptr, t_idx,
                    ph_idx, ph_ok, base):
    """Cut bytes and the "holds every model input" flag of each ideal of a segment (its work:
    :func:`_mask_work`).

    Local evaluation: ``ev_kind[i]`` is 0 (core node: bit ``core_bit[i]`` of the mask), 1
    (lazy: member iff any of ``ev_idx[ev_ptr[i]:ev_ptr[i+1]]`` is) or 2 (zero sink: member
    iff all of them are); entries are in evaluation order. Tensor ``t`` of ``t_size[t]``
    bytes is in the ideal if ``t_state[t] == -1`` (produced before the segment) or local node
    ``t_state[t]`` is; it crosses if ``t_always[t]`` or one of its local consumers
    ``t_idx[t_ptr[t]:t_ptr[t+1]]`` is outside the ideal.
    """
    P = masks.shape[0]
    F = ev_kind.shape[0]
    cout = np.empty(P)
    flag = np.empty(P, dtype=np.bool_)
    mem = np.zeros(F, dtype=np.bool_)
    for p in range(P):
        m = masks[p]
        for i in range(F):
            kd = ev_kind[i]
            if kd == 0:
                mem[i] = (m >> core_bit[i]) & 1
            elif kd == 1:
                x = False
                for e in range(ev_ptr[i], ev_ptr[i + 1]):
                    if mem[ev_idx[e]]:
                        x = True
                        break
                mem[i] = x
            else:
                x = True
                for e in range(ev_ptr[i], ev_ptr[i + 1]):
                    if not mem[ev_idx[e]]:
                        x = False
                        break
                mem[i] = x
        c = base
        for t in range(t_size.shape[0]):
            st = t_state[t]
            if st >= 0 and not mem[st]:
                continue
            if t_always[t]:
                c += t_size[t]
                continue
            for e in range(t_ptr[t], t_ptr[t + 1]):
                if not mem[t_idx[e]]:
                    c += t_size[t]
                    break
        ok = ph_ok
        if ok:
            for e in range(ph_idx.shape[0]):
                if not mem[ph_idx[e]]:
                    ok = False
                    break
        cout[p] = c
        flag[p] = ok
    return cout, flag


@njit(**NJIT)
def _mask_work(masks, work_bits):
    """Work of each ideal of a segment: the sum of ``work_bits[b]`` over the set bits b of its mask,
    added in bit order (float64 (P,))."""
    P = masks.shape[0]
    out = np.empty(P)
    for p in range(P):
        m = masks[p]
        w = 0.0
        for b in range(work_bits.shape[0]):
            if (m >> b) & 1:
                w += work_bits[b]
        out[p] = w
    return out


@njit(**NJIT)
def _fen_update(tree_v, tree_i, pos, val, idx):
    n = tree_v.shape[0]
    i = pos + 1
    while i <= n:
        if val < tree_v[i - 1]:
            tree_v[i - 1] = val
            tree_i[i - 1] = idx
        i += i & (-i)


@njit(**NJIT)
def _fen_query(tree_v, tree_i, count):
    """(min value, its point) over ranks ``0..count-1``."""
    best = np.inf
    bi = -1
    i = count
    while i > 0:
        if tree_v[i - 1] < best:
            best = tree_v[i - 1]
            bi = tree_i[i - 1]
        i -= i & (-i)
    return best, bi


@njit(**NJIT)
def _count_ge(sorted_desc, x):
    """Number of entries >= x in a descending array."""
    lo = 0
    hi = sorted_desc.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if sorted_desc[mid] >= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(**NJIT)
def _within_transitions(wlo, key, io, end, k, T, slack):
    """Whether a path of at most k transitions from point 0 to ``end`` has every cost <= T (relaxed DP),
    and the largest cost on the path found (``-inf`` when there is none).

    Points are in chain order; a transition p -> q (p before q) costs at least
    ``wlo[q] - key[p] + io[q]`` (``key = whi - io_in``); it is allowed when
    ``key[p] >= wlo[q] + io[q] - T - slack``. With ``f[p]`` the fewest transitions to p, the points
    with ``f <= t`` reach q iff their largest key does: ``c(t) = max {key[p] : f[p] <= t, p < q}``
    is non-decreasing in t and ``f[q] = 1 + min {t : c(t) >= threshold of q}``. ``c`` is kept as a
    staircase of levels ``0..k-1`` (``lev[j]`` the first level of step j, ``val[j]`` its key,
    ``arg[j]`` the point holding it; both strictly increasing in j), so a query and an insertion are
    binary searches; points with ``f >= k`` only lead to ``f > k`` and are not inserted. The same
    fewest transitions as the Fenwick DP over all points (:func:`_exact_dp` without nesting).
    """
    P = wlo.shape[0]
    if end == 0:
        return True, -np.inf
    lev = np.empty(k + 1, dtype=np.int64)
    val = np.empty(k + 1)
    arg = np.empty(k + 1, dtype=np.int64)
    parent = np.full(P, -1, dtype=np.int64)
    m = 1
    lev[0] = 0
    val[0] = key[0]
    arg[0] = 0
    reached = False
    for q in range(1, end + 1):
        thr = wlo[q] + io[q] - T - slack
        if val[m - 1] < thr:
            continue
        a = 0
        b = m - 1
        while a < b:  # first step whose key reaches q
            mid = (a + b) >> 1
            if val[mid] >= thr:
                b = mid
            else:
                a = mid + 1
        t = lev[a] + 1  # f[q]
        parent[q] = arg[a]
        if q == end:
            reached = True
            break
        kq = key[q]
        if t >= k:
            continue
        a = 0
        b = m - 1
        while a < b:  # the step holding level t
            mid = (a + b + 1) >> 1
            if lev[mid] <= t:
                a = mid
            else:
                b = mid - 1
        j0 = a
        if val[j0] >= kq:
            continue
        a = j0 + 1
        b = m
        while a < b:  # the first step after it that q does not raise
            mid = (a + b) >> 1
            if val[mid] >= kq:
                b = mid
            else:
                a = mid + 1
        j1 = a
        ins = j0 + 1 if lev[j0] < t else j0  # steps ins..j1-1 become one step (t, kq, q)
        tail = m - j1
        if j1 > ins + 1:  # steps removed: the tail moves left
            for r in range(tail):
                lev[ins + 1 + r] = lev[j1 + r]
                val[ins + 1 + r] = val[j1 + r]
                arg[ins + 1 + r] = arg[j1 + r]
        elif j1 == ins:  # a step split in two: the tail moves right by one
            for r in range(tail - 1, -1, -1):
                lev[ins + 1 + r] = lev[j1 + r]
                val[ins + 1 + r] = val[j1 + r]
                arg[ins + 1 + r] = arg[j1 + r]
        lev[ins] = t
        val[ins] = kq
        arg[ins] = q
        m = ins + 1 + tail
    worst = -np.inf
    if reached:
        q = end
        while q != 0:
            p = parent[q]
            c = wlo[q] - key[p] + io[q]
            if c > worst:
                worst = c
            q = p
    return reached, worst


@njit(**NJIT)
def _exact_dp(seg, w, io, masks, flag, rank, keys_desc, seg_first, T, slack):
    """Fewest positive-work, nested transitions from point 0 to the last point, cost <= T.

    Exact points only (every point is an ideal); p -> q is allowed if p is in an earlier
    segment (then ``I_p`` is inside ``I_q``) or in the same segment with ``mask_p`` a
    proper subset of ``mask_q``; work must grow (``w[p] < w[q]``); transitions from the
    start (point 0) need ``flag[q]`` (the model inputs are in the first block).
    Returns ``(f, parent)``.
    """
    P = w.shape[0]
    tree_v = np.full(P, np.inf)
    tree_i = np.full(P, -1, dtype=np.int64)
    f = np.full(P, np.inf)
    parent = np.full(P, -1, dtype=np.int64)
    f[0] = 0.0
    ptr = 1  # next point to insert into the tree (the start is handled explicitly)
    cur_seg = -1
    seg_min = np.inf  # least f of the points before q in q's segment (the start excluded)
    for q in range(1, P):
        if seg[q] != cur_seg:
            cur_seg = seg[q]
            seg_min = np.inf
        # insert every earlier-segment point with less work
        while ptr < q and seg[ptr] < seg[q] and w[ptr] < w[q]:
            if f[ptr] < np.inf:
                _fen_update(tree_v, tree_i, rank[ptr], f[ptr], ptr)
            ptr += 1
        thr = w[q] + io[q] - T - slack
        best = np.inf
        bp = -1
        if flag[q] and w[q] > w[0] and (w[q] - w[0]) + io[0] + io[q] <= T + slack:
            best = 1.0
            bp = 0
        cnt = _count_ge(keys_desc, thr)
        v, i = _fen_query(tree_v, tree_i, cnt)
        if v + 1.0 < best:
            best = v + 1.0
            bp = i
        if seg_min + 1.0 < best:  # else no point of q's segment improves on best
            for p in range(seg_first[seg[q]], q):
                if p == 0 or f[p] + 1.0 >= best:
                    continue
                if w[p] >= w[q] or (masks[p] & masks[q]) != masks[p] or masks[p] == masks[q]:
                    continue
                if (w[q] - w[p]) + io[p] + io[q] <= T + slack:
                    best = f[p] + 1.0
                    bp = p
        f[q] = best
        parent[q] = bp
        if best < seg_min:
            seg_min = best
    return f, parent


# --------------------------------------------------------------------------------------
# decomposition
# --------------------------------------------------------------------------------------


@dataclass
class ChainDecomposition:
    """The chain structure of one (graph, objective) pair; reusable for every k.

    Attributes
    ----------
    objective : str
    kind : int8 array (n,)
        :data:`KIND_CORE`, :data:`KIND_LAZY`, :data:`KIND_SINK` or :data:`KIND_DETACHED`.
    topo : int64 array (n,)
        The topological order used (node ids).
    entry : int64 array (n,)
        Segment in which each non-detached node enters the canonical ideals (``-1``
        detached).
    last : int64 array (n,)
        Latest entry segment of the node's consumers (its own entry if none).
    core : int64 array (c,)
        Core nodes in topological order.
    seg_ptr : int64 array (S+1,)
        Segment j is ``core[seg_ptr[j]:seg_ptr[j+1]]``; its last node is a gate (except
        possibly for the last segment).
    seg_work_s : float64 array (S,)
        Core work of each segment (seconds).
    gate_cut_bytes : float64 array (S,)
        ``cut`` of the ideal holding segments ``0..j`` (bytes).
    mandatory_cut_bytes : float64 array (S,)
        Bytes of tensors produced before segment j and consumed after it.
    masks, point_work_s, point_cut_bytes, point_flag : list of arrays (per segment)
        Ideals of each segment (``None`` for segments of more than
        :data:`MAX_SEGMENT_CORE` core nodes) with the work and cut of ``S_<j u J`` and
        whether it holds every model input: all of them where ``complete[j]``, else the
        prefixes of the topological order (cut points for the partition only).
    complete : bool array (S,)
        Whether ``masks[j]`` lists every ideal of segment j (the bound needs that; other
        segments are bins in the bound).
    binned : dict[int, (float64 array, float64 array)]
        For segments that are not complete but have at most ``max_binned`` ideals: the work
        (sorted) and cut of every ideal, summarised into work bins by the bound (each bin's
        least cut instead of the mandatory cut).
    work_s : float64 array (n,)
        Work of every node under the objective (seconds).
    detached_work_s : float
        Work of the detached nodes (dropped by the bound).
    inputs_entry : int
        Latest entry segment of a model input (placeholder); -1 if none.
    seconds : float
        Time to build the decomposition.
    """

    objective: str
    kind: np.ndarray
    topo: np.ndarray
    entry: np.ndarray
    last: np.ndarray
    core: np.ndarray
    seg_ptr: np.ndarray
    seg_work_s: np.ndarray
    gate_cut_bytes: np.ndarray
    mandatory_cut_bytes: np.ndarray
    masks: list
    point_work_s: list
    point_cut_bytes: list
    point_flag: list
    complete: np.ndarray
    binned: dict
    work_s: np.ndarray
    detached_work_s: float
    inputs_entry: int = -1
    seconds: float = 0.0
    #: What the DPs derive from the decomposition alone, kept for every k (:func:`_points`).
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_segments(self) -> int:
        return int(self.seg_ptr.shape[0] - 1)

    @property
    def num_gates(self) -> int:
        return max(0, self.num_segments - 1)

    @property
    def enumerated(self) -> np.ndarray:
        """Bool array (S,): whether each segment's ideals were all enumerated."""
        return np.asarray(self.complete, dtype=bool)

    def summary(self) -> dict[str, Any]:
        """Plain facts for certificates and reports."""
        sizes = np.diff(self.seg_ptr)
        en = self.enumerated
        return {
            "nodes": int(self.kind.shape[0]),
            "core": int(self.core.shape[0]),
            "lazy": int(np.sum(self.kind == KIND_LAZY)),
            "zero_sinks": int(np.sum(self.kind == KIND_SINK)),
            "detached": int(np.sum(self.kind == KIND_DETACHED)),
            "detached_work_s": float(self.detached_work_s),
            "segments": int(sizes.shape[0]),
            "largest_segment": int(sizes.max(initial=0)),
            "segments_enumerated": int(en.sum()),
            "segments_binned": int(len(self.binned)),
            "ideals": int(sum(m.shape[0] for m in self.masks if m is not None)),
            "core_work_not_enumerated_s": float(self.seg_work_s[~en].sum()) if en.size else 0.0,
            "seconds": float(self.seconds),
        }


def _topological_order(graph: OpGraph) -> np.ndarray:
    return kahn_order(graph, np.arange(graph.n, dtype=np.float64))


def _classify(graph: OpGraph, work: np.ndarray, topo: np.ndarray) -> np.ndarray:
    """Node kinds (module docstring: detached, zero sinks, lazy, core)."""
    n = graph.n
    size = np.asarray(graph.size_out_bytes, dtype=np.float64)
    outputs = [i for i, op in enumerate(graph.ops) if op == "output"]
    alive = np.ones(n, dtype=bool)
    if outputs:
        alive[:] = False
        alive[outputs] = True
        for v in topo[::-1].tolist():
            if alive[v]:
                alive[graph.predecessors(v)] = True
    kind = np.full(n, KIND_CORE, dtype=np.int8)
    kind[~alive] = KIND_DETACHED
    zero = work <= 0.0
    for v in range(n):
        if not alive[v] or not zero[v]:
            continue
        succ = graph.successors(v)
        if not alive[succ].any():
            kind[v] = KIND_SINK
    for v in range(n):
        if kind[v] != KIND_CORE or not zero[v]:
            continue
        succ = graph.successors(v)
        succ = succ[alive[succ]]
        if succ.size == 0 or (kind[succ] == KIND_SINK).any():
            continue
        if size[v] >= float(size[graph.predecessors(v)].sum()):
            kind[v] = KIND_LAZY
    return kind


def _reduced_core(graph: OpGraph, kind: np.ndarray, topo: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
    """Core nodes in topological order and their reduced predecessors (core positions)."""
    core = np.array([v for v in topo.tolist() if kind[v] == KIND_CORE], dtype=np.int64)
    pos = np.full(graph.n, -1, dtype=np.int64)
    pos[core] = np.arange(core.shape[0])
    via: dict[int, frozenset] = {}  # lazy node -> core positions reachable backwards through lazy nodes
    rpred: list[list[int]] = [[] for _ in range(core.shape[0])]
    for v in topo.tolist():
        kv = kind[v]
        if kv == KIND_DETACHED or kv == KIND_SINK:
            continue
        acc: set[int] = set()
        for u in graph.predecessors(v).tolist():
            ku = kind[u]
            if ku == KIND_CORE:
                acc.add(int(pos[u]))
            elif ku == KIND_LAZY:
                acc |= via[u]
        if kv == KIND_LAZY:
            via[v] = frozenset(acc)
        else:
            rpred[int(pos[v])] = sorted(acc)
    return core, rpred


def _gates(rpred: list[list[int]]) -> np.ndarray:
    """Positions of the core nodes comparable with every other core node.

    With positions a linear extension, node p is comparable with all iff every node before
    p without a successor before p is a direct predecessor of p, and every node after p
    without a predecessor after p is a direct successor of p (a path into p from an earlier
    node must end with an edge into p, and nothing after p reaches p). Counted with
    difference arrays in O(n + m).
    """
    m = len(rpred)
    minsucc = np.full(m, m, dtype=np.int64)  # m: none
    maxpred = np.full(m, -1, dtype=np.int64)
    for v in range(m):
        for u in rpred[v]:
            if v < minsucc[u]:
                minsucc[u] = v
            if u > maxpred[v]:
                maxpred[v] = u
    has_succ = np.zeros(m, dtype=bool)
    for v in range(m):
        for u in rpred[v]:
            has_succ[u] = True
    dA = np.zeros(m + 2, dtype=np.int64)
    for x in range(m):
        hi = minsucc[x] if has_succ[x] else m  # x counts for p in [x+1, hi]
        dA[x + 1] += 1
        dA[min(hi, m) + 1] -= 1
    dB = np.zeros(m + 2, dtype=np.int64)
    for y in range(m):
        lo = max(maxpred[y], 0) if maxpred[y] >= 0 else 0  # y counts for p in [lo, y-1]
        if y - 1 >= lo:
            dB[lo] += 1
            dB[y] -= 1
    cA = np.cumsum(dA)[:m]
    cB = np.cumsum(dB)[:m]
    direct_in = np.zeros(m, dtype=np.int64)
    direct_out = np.zeros(m, dtype=np.int64)
    for v in range(m):
        for u in rpred[v]:
            if minsucc[u] == v:
                direct_in[v] += 1
            if maxpred[v] == u:
                direct_out[u] += 1
    return np.flatnonzero((cA == direct_in) & (cB == direct_out)).astype(np.int64)


def decompose(graph: OpGraph, objective: str = "training", *, max_ideals: int = MAX_IDEALS,
              max_binned: int = MAX_BINNED_IDEALS) -> ChainDecomposition:
    """Find the chain structure of ``graph`` (module docstring) and enumerate its segments.

    Parameters
    ----------
    graph : OpGraph
    objective : {"inference", "training"}
        Decides which nodes have zero work.
    max_ideals : int
        Segments with more ideals are represented by bins.
    max_binned : int
        Segments with more ideals than ``max_ideals`` but at most this many are still
        enumerated, and summarised per work bin (least cut); beyond it the bins carry only
        the mandatory cut.

    Returns
    -------
    ChainDecomposition

    Raises
    ------
    InputError
        For an unknown objective.
    """
    check_objective(objective, "relay")
    t0 = time.perf_counter()
    work = np.asarray(graph.work_s(objective), dtype=np.float64)
    dec = _weigh(_structure(graph, work, max_ideals, max_binned), work, objective)
    dec.seconds = time.perf_counter() - t0
    return dec


@dataclass
class _Structure:
    """What a decomposition takes from a graph besides its works' values: everything of
    :class:`ChainDecomposition` but the works, built from the edges, the ops, the output sizes and
    which nodes have zero work (the kinds need no more: :func:`_classify`). ``many[j]`` holds every
    ideal of a binned segment and its cut; ``source`` the arrays it was built from (edges, ops, zero
    work, sizes, caps), compared by :func:`cached_decomposition` before it reuses the structure;
    ``weighed`` weak references to the decompositions it gave there (alive while their graphs are)."""

    kind: np.ndarray
    topo: np.ndarray
    entry: np.ndarray
    last: np.ndarray
    core: np.ndarray
    seg_ptr: np.ndarray
    gate_cut_bytes: np.ndarray
    mandatory_cut_bytes: np.ndarray
    masks: list
    point_cut_bytes: list
    point_flag: list
    complete: np.ndarray
    many: dict
    inputs_entry: int
    source: tuple
    weighed: list = field(default_factory=list)


def _structure(graph: OpGraph, work: np.ndarray, max_ideals: int, max_binned: int) -> _Structure:
    """The chain structure of ``graph`` with per-node work ``work`` (only its zeros matter)."""
    size = np.asarray(graph.size_out_bytes, dtype=np.float64)
    topo = _topological_order(graph)
    kind = _classify(graph, work, topo)
    core, rpred = _reduced_core(graph, kind, topo)
    m = core.shape[0]
    seg_ptr = _segment_bounds(_gates(rpred), m)
    S = seg_ptr.shape[0] - 1
    entry, last = _entry_and_last(graph, kind, topo, core, seg_ptr)
    alive = kind != KIND_DETACHED
    gate_cut, mand_cut = _gate_and_mandatory_cuts(alive, entry, last, size, S)
    nodes = _SegmentNodes.of(graph, kind, topo, core, entry, last, size, S)
    masks: list = []
    complete: list = []
    many_of: dict = {}
    pcut: list = []
    pflag: list = []
    for j in range(S):
        lo, hi = int(seg_ptr[j]), int(seg_ptr[j + 1])
        if hi - lo > MAX_SEGMENT_CORE:
            complete.append(False)
            masks.append(None)
            pcut.append(None)
            pflag.append(None)
            continue
        ms, many, is_complete = _segment_ideals(rpred, lo, hi, max_ideals, max_binned)
        complete.append(is_complete)
        local = nodes.evaluation_inputs(j, lo, hi, float(mand_cut[j]))
        cv, fv = _segment_points(ms, *local)
        if many is not None:
            many_of[j] = (many, _segment_points(many, *local)[0])
        masks.append(ms)
        pcut.append(cv)
        pflag.append(fv)
    source = (graph.edges, graph.ops, work <= 0.0, size, int(max_ideals), int(max_binned))
    return _Structure(kind=kind, topo=topo, entry=entry, last=last, core=core, seg_ptr=seg_ptr, gate_cut_bytes=gate_cut,
                      mandatory_cut_bytes=mand_cut, masks=masks, point_cut_bytes=pcut, point_flag=pflag,
                      complete=np.array(complete, dtype=bool), many=many_of, inputs_entry=nodes.ph_entry_max,
                      source=source)


def _weigh(st: _Structure, work: np.ndarray, objective: str) -> ChainDecomposition:
    """The decomposition of structure ``st`` with per-node work ``work`` (float64 (n,), zero exactly
    where ``st`` was built with zero work): segment works, ideal works, binned ideals sorted by work."""
    S = st.seg_ptr.shape[0] - 1
    core = st.core
    seg_work = np.array([float(work[core[st.seg_ptr[j]:st.seg_ptr[j + 1]]].sum()) for j in range(S)])
    pwork: list = []
    binned: dict = {}
    w_before = 0.0
    for j in range(S):
        ms = st.masks[j]
        if ms is not None:
            work_bits = np.ascontiguousarray(work[core[st.seg_ptr[j]:st.seg_ptr[j + 1]]], dtype=np.float64)
            pwork.append(_mask_work(ms, work_bits) + w_before)
            if j in st.many:
                many, many_cut = st.many[j]
                bw = _mask_work(many, work_bits)
                order = np.argsort(bw, kind="stable")
                binned[j] = (bw[order] + w_before, many_cut[order])
        else:
            pwork.append(None)
        w_before += seg_work[j]
    return ChainDecomposition(
        objective=objective, kind=st.kind, topo=st.topo, entry=st.entry, last=st.last, core=core, seg_ptr=st.seg_ptr,
        seg_work_s=seg_work, gate_cut_bytes=st.gate_cut_bytes, mandatory_cut_bytes=st.mandatory_cut_bytes,
        masks=st.masks, point_work_s=pwork, point_cut_bytes=st.point_cut_bytes, point_flag=st.point_flag,
        complete=st.complete, binned=binned, work_s=work,
        detached_work_s=float(work[st.kind == KIND_DETACHED].sum()), inputs_entry=st.inputs_entry, seconds=0.0,
    )


def _segment_bounds(gates: np.ndarray, m: int) -> np.ndarray:
    """``seg_ptr`` (S + 1,): segment j holds the reduced-core positions ``seg_ptr[j]:seg_ptr[j+1]``,
    each segment ending at a gate (the last one at the end of the core)."""
    if m == 0:  # no work anywhere: one empty segment
        return np.zeros(2, dtype=np.int64)
    ends = gates + 1
    if ends.size == 0 or ends[-1] != m:
        ends = np.append(ends, m)
    return np.concatenate([[0], ends]).astype(np.int64)


def _entry_and_last(graph: OpGraph, kind: np.ndarray, topo: np.ndarray, core: np.ndarray,
                    seg_ptr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every node's entry segment (canonical ideals: core nodes their own, lazy nodes their
    earliest consumer's, sinks their latest producer's) and the last segment that reads it."""
    n = graph.n
    S = seg_ptr.shape[0] - 1
    seg_of_pos = np.zeros(core.shape[0], dtype=np.int64)
    for j in range(S):
        seg_of_pos[seg_ptr[j]:seg_ptr[j + 1]] = j
    entry = np.full(n, -1, dtype=np.int64)
    entry[core] = seg_of_pos
    alive = kind != KIND_DETACHED
    for v in topo[::-1].tolist():
        if kind[v] == KIND_LAZY:
            succ = graph.successors(v)
            succ = succ[alive[succ]]
            entry[v] = int(entry[succ].min())
    for v in topo.tolist():
        if kind[v] == KIND_SINK:
            pred = graph.predecessors(v)
            entry[v] = int(entry[pred].max()) if pred.size else 0
    last = entry.copy()
    for v in range(n):
        if not alive[v]:
            continue
        succ = graph.successors(v)
        succ = succ[alive[succ]]
        if succ.size:
            last[v] = int(entry[succ].max())
    return entry, last


def _gate_and_mandatory_cuts(alive: np.ndarray, entry: np.ndarray, last: np.ndarray, size: np.ndarray,
                             S: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes crossing each gate ideal, and bytes every ideal inside a segment must cut (tensors
    produced before it and read after it), both (S,)."""
    gate_diff = np.zeros(S + 1)
    mand_diff = np.zeros(S + 2)
    for v in np.flatnonzero(alive).tolist():
        if last[v] > entry[v]:
            gate_diff[entry[v]] += size[v]
            gate_diff[last[v]] -= size[v]
            if last[v] - entry[v] >= 2:  # crosses every ideal inside segments entry+1..last-1
                mand_diff[entry[v] + 1] += size[v]
                mand_diff[last[v]] -= size[v]
    return np.cumsum(gate_diff)[:S], np.cumsum(mand_diff)[:S]


def _segment_ideals(rpred: list[list[int]], lo: int, hi: int, max_ideals: int,
                    max_binned: int) -> tuple[np.ndarray, np.ndarray | None, bool]:
    """The ideals of the segment's core ``lo:hi`` as bit masks, ``(masks, many, complete)``.

    With more than ``max_ideals`` ideals, ``masks`` are the prefixes of the topological order
    (ideals too, cut points for the partition) and ``many`` every ideal if there are at most
    ``max_binned`` (the bound summarises them in work bins), else None.
    """
    L = hi - lo
    pm = np.zeros(L, dtype=np.int64)
    for i in range(L):
        for u in rpred[lo + i]:
            if u >= lo:
                pm[i] |= np.int64(1) << np.int64(u - lo)
    ms, cnt = _enumerate_ideals(pm, int(max_ideals))
    if cnt >= 0:
        return ms, None, True
    many, cnt_many = _enumerate_ideals(pm, int(max_binned)) if max_binned > 0 else (None, -1)
    if cnt_many < 0:
        many = None
    return np.array([(1 << t) - 1 for t in range(L + 1)], dtype=np.int64), many, False


@dataclass
class _SegmentNodes:
    """The nodes of every segment (its flux: nodes entering it; its inputs: produced earlier,
    last read in it) and what :func:`_segment_points` needs to evaluate its ideals."""

    graph: OpGraph
    kind: np.ndarray
    core: np.ndarray
    entry: np.ndarray
    last: np.ndarray
    size: np.ndarray
    alive: np.ndarray
    rank_topo: np.ndarray
    pos: np.ndarray
    flux: list
    inputs: list
    placeholders: list
    ph_entry_max: int

    @classmethod
    def of(cls, graph: OpGraph, kind, topo, core, entry, last, size, S: int) -> "_SegmentNodes":
        n = graph.n
        alive = kind != KIND_DETACHED
        flux: list[list[int]] = [[] for _ in range(S)]
        inputs: list[list[int]] = [[] for _ in range(S)]
        rank_topo = np.empty(n, dtype=np.int64)
        rank_topo[topo] = np.arange(n)
        for v in topo.tolist():
            if alive[v]:
                flux[entry[v]].append(v)
                if last[v] > entry[v]:
                    inputs[last[v]].append(v)
        placeholders = [v for v in range(n) if graph.ops[v] == "placeholder" and alive[v]]
        pos = np.full(n, -1, dtype=np.int64)
        pos[core] = np.arange(core.shape[0])
        return cls(graph, kind, core, entry, last, size, alive, rank_topo, pos, flux, inputs, placeholders,
                   max((int(entry[v]) for v in placeholders), default=-1))

    def evaluation_inputs(self, j: int, lo: int, hi: int, base: float) -> tuple:
        """The arguments of :func:`_segment_points` after the masks, for segment ``j`` (core
        positions ``lo:hi``, mandatory cut ``base`` bytes)."""
        graph, kind, entry, alive = self.graph, self.kind, self.entry, self.alive
        # local evaluation order: core (bits), lazy (reverse topological), sinks (topological)
        F = self.flux[j]
        core_f = [v for v in F if kind[v] == KIND_CORE]
        lazy_f = sorted((v for v in F if kind[v] == KIND_LAZY), key=lambda v: -self.rank_topo[v])
        sink_f = [v for v in F if kind[v] == KIND_SINK]
        ev_nodes = core_f + lazy_f + sink_f
        ev_loc = {v: i for i, v in enumerate(ev_nodes)}
        ev_kind = np.array([0] * len(core_f) + [1] * len(lazy_f) + [2] * len(sink_f), dtype=np.int64)
        core_bit = np.zeros(len(ev_nodes), dtype=np.int64)
        for i, v in enumerate(core_f):
            core_bit[i] = self.pos[v] - lo
        ev_ptr = [0]
        ev_idx: list[int] = []
        for v in ev_nodes:
            if kind[v] == KIND_LAZY:
                ev_idx += [ev_loc[c] for c in graph.successors(v).tolist() if alive[c] and entry[c] == j]
            elif kind[v] == KIND_SINK:
                ev_idx += [ev_loc[u] for u in graph.predecessors(v).tolist() if entry[u] == j]
            ev_ptr.append(len(ev_idx))
        t_nodes = [v for v in F if graph.successors(v).size] + self.inputs[j]
        t_size, t_state, t_always, t_ptr, t_idx = [], [], [], [0], []
        for v in t_nodes:
            succ = graph.successors(v)
            succ = succ[alive[succ]]
            if succ.size == 0:
                continue
            t_size.append(self.size[v])
            t_state.append(ev_loc[v] if entry[v] == j else -1)
            t_always.append(bool(self.last[v] > j))
            t_idx += [ev_loc[c] for c in succ.tolist() if entry[c] == j]
            t_ptr.append(len(t_idx))
        ph_idx = [ev_loc[v] for v in self.placeholders if entry[v] == j]
        return (
            core_bit, ev_kind, np.array(ev_ptr, dtype=np.int64), np.array(ev_idx, dtype=np.int64),
            np.array(t_size, dtype=np.float64), np.array(t_state, dtype=np.int64), np.array(t_always, dtype=np.bool_),
            np.array(t_ptr, dtype=np.int64), np.array(t_idx, dtype=np.int64), np.array(ph_idx, dtype=np.int64),
            bool(self.ph_entry_max <= j), base,
        )


_CACHE = None  # weakref.WeakKeyDictionary: graph -> {(objective, max_ideals): ChainDecomposition}
#: Structures built by :func:`cached_decomposition`, the most recently used last (at most
#: :data:`_STRUCTURES_KEPT`): graphs that differ only in the values of their works share one (the mesh
#: search's copies of a graph per pipeline link, its free-communication copy, the memory surrogates of
#: one graph under several memory models).
_STRUCTURES: list = []
_STRUCTURES_KEPT = 16


def cached_decomposition(graph: OpGraph, objective: str, *, max_ideals: int = MAX_IDEALS) -> ChainDecomposition:
    """:func:`decompose`, remembered per graph object (the partitioner and the bounds share it).

    A graph whose edges, ops, output sizes and zero-work nodes equal those of a graph decomposed
    recently (:class:`_Structure`) reuses that structure: only its works are weighed again
    (:func:`_weigh`), which gives the decomposition :func:`decompose` builds, field for field.
    """
    import weakref  # noqa: PLC0415

    global _CACHE
    if _CACHE is None:
        _CACHE = weakref.WeakKeyDictionary()
    per = _CACHE.setdefault(graph, {})
    key = (objective, int(max_ideals))
    if key not in per:
        check_objective(objective, "relay")
        t0 = time.perf_counter()
        work = np.asarray(graph.work_s(objective), dtype=np.float64)
        st = _known_structure(graph, work, int(max_ideals), MAX_BINNED_IDEALS)
        if st is None:
            st = _structure(graph, work, int(max_ideals), MAX_BINNED_IDEALS)
            _STRUCTURES.append(st)
            del _STRUCTURES[:-_STRUCTURES_KEPT]
        live = [d for d in (ref() for ref in st.weighed) if d is not None]
        same = next((d for d in live if np.array_equal(d.work_s, work)), None)
        if same is None:
            dec = _weigh(st, work, objective)
            dec.seconds = time.perf_counter() - t0
            live.append(dec)
        elif same.objective == objective:  # the same works: the same decomposition
            dec = same
        else:  # a copy naming this objective, sharing the points built for the other
            dec = copy.copy(same)
            dec.objective = objective
        st.weighed = [weakref.ref(d) for d in live]
        per[key] = dec
    return per[key]


def _known_structure(graph: OpGraph, work: np.ndarray, max_ideals: int, max_binned: int) -> _Structure | None:
    """A kept structure built from the same edges, ops, zero-work nodes, output sizes and caps (moved
    to the end of the list: most recently used), or None."""
    zero = work <= 0.0
    for i in range(len(_STRUCTURES) - 1, -1, -1):
        edges, ops, st_zero, size, cap, cap_binned = _STRUCTURES[i].source
        if (cap == max_ideals and cap_binned == max_binned and len(ops) == graph.n and edges.shape == graph.edges.shape
                and np.array_equal(st_zero, zero) and np.array_equal(size, graph.size_out_bytes)
                and np.array_equal(edges, graph.edges) and ops == graph.ops):
            st = _STRUCTURES.pop(i)
            _STRUCTURES.append(st)
            return st
    return None


# --------------------------------------------------------------------------------------
# points and the two DPs
# --------------------------------------------------------------------------------------


@dataclass
class _Points:
    seg: np.ndarray
    wlo: np.ndarray
    whi: np.ndarray
    cut: np.ndarray  # bytes
    mask: np.ndarray
    flag: np.ndarray
    exact: np.ndarray


def _popcount(masks: np.ndarray) -> np.ndarray:
    """Set bits of each 64-bit mask (int64 (P,) -> int64 (P,)): ``np.bitwise_count`` where numpy has
    it (2.0 and later), else :func:`_popcount_swar`."""
    u = np.ascontiguousarray(masks, dtype=np.int64).view(np.uint64)
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(u).astype(np.int64)
    return _popcount_swar(u)


def _popcount_swar(u: np.ndarray) -> np.ndarray:
    """Set bits of each uint64 by the SWAR sum of bit fields (Warren, "Hacker's Delight", 2nd ed.,
    Section 5-1, Figure 5-2), int64 (P,)."""
    u = u - ((u >> np.uint64(1)) & np.uint64(0x5555555555555555))
    u = (u & np.uint64(0x3333333333333333)) + ((u >> np.uint64(2)) & np.uint64(0x3333333333333333))
    u = (u + (u >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return ((u * np.uint64(0x0101010101010101)) >> np.uint64(56)).astype(np.int64)


_POINT_FIELDS = ("seg", "wlo", "whi", "cut", "mask", "flag", "exact")
_POINT_DTYPES = (np.int64, np.float64, np.float64, np.float64, np.int64, np.bool_, np.bool_)


def _columns(chunks: list) -> list:
    """The point columns of ``chunks`` ((seg, wlo, whi, cut, mask, flag, exact), each a scalar or an
    array of one length), concatenated in order."""
    return [np.concatenate([np.atleast_1d(np.asarray(c[i], dtype=dt)) for c in chunks]) if chunks
            else np.zeros(0, dtype=dt) for i, dt in enumerate(_POINT_DTYPES)]


def _point_layout(dec: ChainDecomposition, exact_only: bool) -> list:
    """The points of every k, in chain order: runs of points that do not depend on k (the columns of
    :func:`_columns`) between ``(j, w_before, w_after)``, the place of segment j's work bins.

    Segment by segment: the ideals of a listed segment (every one, or with ``exact_only`` the
    prefixes of the others) sorted by ``(work, |J|)`` without ``J = {}`` after the first segment (it
    is the previous segment's full ideal); for the others the start (first segment), the bins, the
    full segment. Sorted all at once (a stable sort by segment, then place in it).
    """
    S = dec.num_segments
    w_edges = [0.0]  # work before each segment, summed in segment order
    for j in range(S):
        w_edges.append(w_edges[-1] + float(dec.seg_work_s[j]))
    listed = [j for j in range(S) if dec.masks[j] is not None and (dec.complete[j] or exact_only)]
    others = [j for j in range(S) if not (dec.masks[j] is not None and (dec.complete[j] or exact_only))]
    ms = np.concatenate([dec.masks[j] for j in listed]) if listed else np.zeros(0, dtype=np.int64)
    seg = np.repeat(np.array(listed, dtype=np.int64), np.array([dec.masks[j].shape[0] for j in listed], dtype=np.int64))
    pw = np.concatenate([dec.point_work_s[j] for j in listed]) if listed else np.zeros(0)
    pc = np.concatenate([dec.point_cut_bytes[j] for j in listed]) if listed else np.zeros(0)
    pf = np.concatenate([dec.point_flag[j] for j in listed]) if listed else np.zeros(0, dtype=bool)
    order = np.lexsort((_popcount(ms), pw, seg))
    order = order[(seg[order] == 0) | (ms[order] != 0)]
    gates = np.array(others, dtype=np.int64)
    w_after = np.array([w_edges[j + 1] for j in others], dtype=np.float64)
    ns = 1 if others and others[0] == 0 else 0  # the start point (0 or 1 of it)
    cols = [
        np.concatenate([seg[order], np.zeros(ns, dtype=np.int64), gates]),
        np.concatenate([pw[order], np.zeros(ns), w_after]),
        np.concatenate([pw[order], np.zeros(ns), w_after]),
        np.concatenate([pc[order], np.zeros(ns), np.asarray(dec.gate_cut_bytes, dtype=np.float64)[gates]]),
        np.concatenate([ms[order], np.zeros(ns, dtype=np.int64), np.full(gates.shape[0], -1, dtype=np.int64)]),
        np.concatenate([pf[order], np.zeros(ns, dtype=np.bool_), dec.inputs_entry <= gates]),
        np.ones(order.shape[0] + ns + gates.shape[0], dtype=np.bool_),
    ]
    place = np.concatenate([np.ones(order.shape[0]), np.zeros(ns), np.full(gates.shape[0], 2.0)])
    chain = np.lexsort((place, cols[0]))
    cols = [np.ascontiguousarray(c[chain]) for c in cols]
    if exact_only or not others:
        return [cols]
    layout: list = []
    cut = np.flatnonzero(place[chain] == 2.0)  # the full-segment point of each segment in ``others``, in order
    prev = 0
    for j, at in zip(others, cut.tolist()):
        layout += [[c[prev:at] for c in cols], (j, w_edges[j], w_edges[j + 1])]
        prev = at
    return layout + [[c[prev:] for c in cols]]


def _bins(dec: ChainDecomposition, j: int, w_before: float, w_after: float, k: int, width: float) -> list:
    """The point columns of segment j's work bins for k stages (bins of ``width`` seconds)."""
    if width <= 0:
        return _columns([])
    if j in dec.binned:
        # every ideal of the segment, by work bin: [least, largest work] and least cut
        bw, bc = dec.binned[j]
        idx = np.minimum(((bw - w_before) / width).astype(np.int64), 4 * BINS_PER_BLOCK * max(k, 1))
        starts = np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]])
        ends = np.r_[starts[1:], bw.shape[0]]
        cmin = np.minimum.reduceat(bc, starts)
        n = starts.shape[0]
        return _columns([(np.full(n, j), bw[starts], bw[ends - 1], cmin, np.full(n, -1), np.zeros(n, dtype=bool),
                          np.zeros(n, dtype=bool))])
    nb = int(math.ceil((w_after - w_before) / width)) if w_after > w_before else 1
    nb = max(1, min(nb, 4 * BINS_PER_BLOCK))
    edges = np.linspace(w_before, w_after, nb + 1)
    return _columns([(np.full(nb, j), edges[:-1], edges[1:], np.full(nb, float(dec.mandatory_cut_bytes[j])),
                      np.full(nb, -1), np.zeros(nb, dtype=bool), np.zeros(nb, dtype=bool))])


def _points(dec: ChainDecomposition, k: int, *, exact_only: bool) -> _Points:
    """Chain points in order ``(segment, work, |J|)`` (module docstring); read-only arrays.

    What does not depend on k (the exact points; with ``exact_only`` every point) is built once per
    decomposition (:func:`_point_layout`); only the work bins of the segments that are not listed
    (:func:`_bins`, ``W / (k * BINS_PER_BLOCK)`` wide) are built per k.
    """
    key = ("points", bool(exact_only))
    layout = dec._memo.get(key)
    if layout is None:
        layout = dec._memo[key] = _point_layout(dec, exact_only)
        for part in layout:
            if isinstance(part, list):
                for col in part:
                    col.flags.writeable = False
    if len(layout) == 1:
        return _Points(*layout[0])
    total = float(dec.seg_work_s.sum())
    width = total / (max(k, 1) * BINS_PER_BLOCK) if total > 0 else 0.0
    parts = [part if isinstance(part, list) else _bins(dec, *part, k, width) for part in layout]
    cols = [np.concatenate([part[i] for part in parts]) for i in range(len(_POINT_FIELDS))]
    for col in cols:
        col.flags.writeable = False
    return _Points(*cols)


def _keys(whi: np.ndarray, io: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keys = whi - io
    order = np.argsort(-keys, kind="stable")
    rank = np.empty(keys.shape[0], dtype=np.int64)
    rank[order] = np.arange(keys.shape[0])
    return rank, np.ascontiguousarray(keys[order])


class _Threshold:
    """Feasibility of thresholds T for the relaxed DP (:func:`_within_transitions`), remembering the
    largest threshold found infeasible (``lo``) and the smallest found feasible (``hi``).

    Feasibility is monotone in T, also in floating point: the DP's test ``key[p] >= wlo[q] + io[q] - T
    - 1e-9 * T`` only gets easier as T grows (IEEE rounding is monotone), so every T >= ``hi`` is feasible
    and every T <= ``lo`` infeasible without running the DP again.
    """

    def __init__(self, wlo: np.ndarray, key: np.ndarray, io_out: np.ndarray, k: int, hi: float):
        self.wlo, self.key, self.io_out, self.k = wlo, key, io_out, int(k)
        self.lo, self.hi, self.runs = -math.inf, hi, 0

    def run(self, T: float) -> float | None:
        """Run the DP at T: None if infeasible, else the largest transition cost of the path found."""
        self.runs += 1
        ok, worst = _within_transitions(self.wlo, self.key, self.io_out, self.wlo.shape[0] - 1, self.k, T, 1e-9 * T)
        if not ok:
            self.lo = max(self.lo, T)
            return None
        self.hi = min(self.hi, T)
        return float(worst)

    def feasible(self, T: float) -> bool:
        if T >= self.hi:
            return True
        if T <= self.lo:
            return False
        return self.run(T) is not None

    def narrow(self, guesses: tuple, rel_tol: float, max_runs: int = 40) -> None:
        """Shrink ``[lo, hi]`` to ``rel_tol * hi`` with few DP runs: the ``guesses`` first, then bisection,
        each feasible bisection step followed by a probe just below the largest cost on its path (no
        threshold below that cost can be met by that path; when none is met, ``[lo, hi]`` closes around
        it with a probe just above). The path's largest cost is the optimum once the bracket holds no
        other transition cost, long before bisection alone gets there."""
        eps = rel_tol / 16
        below = None
        for T in guesses:
            if self.lo < T < self.hi:
                below = self._below(T)
        while self.hi - self.lo > rel_tol * self.hi and self.runs < max_runs:
            if below is not None and self.lo < below * (1 - eps) < self.hi:
                if self.run(below * (1 - eps)) is None and below * (1 + eps) < self.hi:
                    self.run(below * (1 + eps))
                below = None
            else:
                below = self._below(0.5 * (max(self.lo, 0.0) + self.hi))

    def _below(self, T: float) -> float | None:
        """Run the DP at T; the threshold at which the path found has its largest cost (None if none)."""
        worst = self.run(T)
        return worst / (1 + 1e-9) if worst is not None and worst > 0 else None


def _relaxed_min_bottleneck(pts: _Points, io_scale: float, k: int, rel_tol: float = 1e-10,
                            out_scale: float | None = None) -> tuple[float, float, int, int]:
    """Bisection for the smallest T with a path of <= k transitions: ``(lo, hi, iterations, DP runs)``.

    ``lo`` is a threshold proven infeasible (a valid lower bound), ``hi`` a feasible one, both those of
    the bisection of ``[0, H]`` (H the cost of one block holding everything) halved until
    ``hi - lo <= rel_tol * hi``. The DP runs only where its answer is not known yet
    (:class:`_Threshold`): a bracket found first by :meth:`_Threshold.narrow` decides most bisection
    steps, so the result is the same with a third to a half of the runs. A block's input cut is
    weighted by ``io_scale``, its output cut by ``out_scale`` (default: the same).
    """
    io_in = pts.cut * io_scale
    io_out = io_in if out_scale is None else pts.cut * out_scale
    end = pts.seg.shape[0] - 1
    hi = float(pts.whi[end] - pts.wlo[0]) + float(io_in.max(initial=0.0)) + float(io_out.max(initial=0.0)) + 1e-300
    io_max = float(io_in.max(initial=0.0)) + float(io_out.max(initial=0.0))
    probe = _Threshold(np.ascontiguousarray(pts.wlo), pts.whi - io_in, io_out, k, hi)
    work_per_stage = float(pts.whi[end] - pts.wlo[0]) / max(k, 1)
    # the optimum is near the work per stage: bins undercount a block by at most 1 / BINS_PER_BLOCK of it
    probe.narrow((work_per_stage * (1 - 2.0 / BINS_PER_BLOCK), work_per_stage * 1.02 + io_max), rel_tol)
    lo = 0.0
    it = 0
    while hi - lo > rel_tol * hi and it < 200:
        mid = 0.5 * (lo + hi)
        if probe.feasible(mid):
            hi = mid
        else:
            lo = mid
        it += 1
    return lo, hi, it, probe.runs


def _exact_feasible(pts: _Points, io: np.ndarray, rank, keys_desc, seg_first, T: float):
    f, parent = _exact_dp(pts.seg, pts.wlo, io, pts.mask, pts.flag, rank, keys_desc, seg_first, float(T), 1e-9 * float(T))
    return f, parent


def _chain_of(parent: np.ndarray, end: int) -> list[int]:
    out = [end]
    while out[-1] != 0:
        p = int(parent[out[-1]])
        if p < 0:
            raise AssertionError("broken DP chain (bug)")  # pragma: no cover
        out.append(p)
    return out[::-1]


def _transition_cost(pts: _Points, io: np.ndarray, p: int, q: int) -> float:
    return float(pts.wlo[q] - pts.wlo[p] + io[p] + io[q])


def _nested(pts: _Points, p: int, q: int) -> bool:
    """Whether the ideal of point p is a proper subset of point q's (exact points, p before q)."""
    if pts.seg[p] < pts.seg[q]:
        return pts.wlo[p] < pts.wlo[q]
    mp, mq = int(pts.mask[p]), int(pts.mask[q])
    return pts.wlo[p] < pts.wlo[q] and (mp & mq) == mp and mp != mq


def _fill_stages(pts: _Points, io: np.ndarray, chain: list[int], k: int, limit: float) -> list[int]:
    """Split blocks at chain points until k blocks, never above ``limit`` (the bottleneck).

    Each step splits the most expensive block that can be split with both parts of positive
    work and cost <= limit, at the point minimising the larger part.
    """
    chain = list(chain)
    while len(chain) - 1 < k:
        costs = [_transition_cost(pts, io, a, b) for a, b in zip(chain[:-1], chain[1:])]
        done = False
        for i in np.argsort(costs)[::-1].tolist():
            a, b = chain[i], chain[i + 1]
            best, best_r = math.inf, -1
            for r in range(a + 1, b):
                if not (_nested(pts, a, r) and _nested(pts, r, b)):
                    continue
                if a == 0 and not pts.flag[r]:
                    continue
                c = max(_transition_cost(pts, io, a, r), _transition_cost(pts, io, r, b))
                if c < best:
                    best, best_r = c, r
            if best_r >= 0 and best <= limit:
                chain.insert(i + 1, best_r)
                done = True
                break
        if not done:
            break
    return chain


def _assignment(graph: OpGraph, dec: ChainDecomposition, pts: _Points, chain: list[int]) -> np.ndarray:
    """Blocks (0-based, pipeline order) of every node from a chain of exact points."""
    n = graph.n
    a = np.full(n, -1, dtype=np.int64)
    seg_of = np.zeros(dec.core.shape[0], dtype=np.int64)
    for j in range(dec.num_segments):
        seg_of[dec.seg_ptr[j]:dec.seg_ptr[j + 1]] = j
    bits = np.arange(dec.core.shape[0]) - dec.seg_ptr[seg_of]
    block = np.full(dec.core.shape[0], -1, dtype=np.int64)
    for b, q in enumerate(chain[1:]):
        sq, mq = int(pts.seg[q]), int(pts.mask[q])
        inside = (seg_of < sq) | ((seg_of == sq) & (mq != -1) & (((mq >> np.minimum(bits, 62)) & 1) == 1))
        if mq == -1:  # end point of a segment that was not enumerated: the whole segment
            inside |= seg_of == sq
        new = inside & (block < 0)
        block[new] = b
    a[dec.core] = block
    alive = dec.kind != KIND_DETACHED
    for v in dec.topo[::-1].tolist():
        if dec.kind[v] == KIND_LAZY:
            succ = graph.successors(v)
            succ = succ[alive[succ]]
            a[v] = int(a[succ].min())
    for v in dec.topo.tolist():
        if dec.kind[v] == KIND_SINK:
            pred = graph.predecessors(v)
            a[v] = int(a[pred].max()) if pred.size else 0
    if (~alive).any():
        work = dec.work_s
        load = np.bincount(a[alive], weights=work[alive], minlength=max(1, len(chain) - 1))
        for v in dec.topo.tolist():
            if alive[v]:
                continue
            pred = graph.predecessors(v)
            if pred.size:
                a[v] = int(a[pred].max())
            else:  # a source of dead code: model inputs go first, others where the load is least
                a[v] = 0 if graph.ops[v] == "placeholder" else int(np.argmin(load))
            load[a[v]] += work[v]
    if (a < 0).any():  # pragma: no cover
        raise AssertionError("chain partition left a node without a block (bug)")
    return a


@dataclass
class ChainResult:
    """Outcome of :func:`solve_chain`.

    Attributes
    ----------
    lower_bound_s : float
        Proven lower bound on the optimal bottleneck (seconds), relay communication.
    relaxed_value_s : float
        A threshold the relaxed DP meets (the bound is within ``1e-10`` of it).
    partition : Partition or None
        The chain partition (``None`` if not requested or the chain has no enumerated
        structure to cut); its ``meta["method"]`` is ``"chain"``.
    details : dict
        Decomposition summary, points, bisection steps, times.
    """

    lower_bound_s: float
    relaxed_value_s: float
    partition: Partition | None
    details: dict


def solve_chain(
    graph: OpGraph,
    k: int,
    objective: str = "training",
    comm: str = "relay",
    *,
    partition: bool = True,
    decomposition: ChainDecomposition | None = None,
) -> ChainResult:
    """The ``chain`` lower bound and, optionally, the chain partition (module docstring).

    Parameters
    ----------
    graph : OpGraph
    k : int
        Number of pipeline stages, >= 1.
    objective : {"inference", "training"}
    comm : {"relay"}
        Only relay communication is supported.
    partition : bool
        Also build the chain partition.
    decomposition : ChainDecomposition, optional
        Reuse a decomposition of the same graph and objective.

    Returns
    -------
    ChainResult

    Raises
    ------
    InputError
        For ``comm="dag"``, a bad k or objective.

    References
    ----------
    Module docstring (Lemmas D, L, S, G); Archer et al. 2024, Eq. (1)-(4).
    """
    check_objective(objective, comm)
    if comm != "relay":
        raise InputError("the chain method needs relay communication (comm='relay'): with dag communication a block's "
                         "io is not a function of the two ideals around it; use the MIP methods for comm='dag'")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k must be a positive integer, got {k!r}")
    k = int(k)
    t0 = time.perf_counter()
    dec = decomposition if decomposition is not None else cached_decomposition(graph, objective)
    t_dec = time.perf_counter() - t0
    io_scale = (2.0 if objective == "training" else 1.0) / float(graph.bandwidth_bytes_per_s)
    pts = _points(dec, k, exact_only=False)
    lo, hi, iters, runs = _relaxed_min_bottleneck(pts, io_scale, k)
    t_bound = time.perf_counter() - t0
    details: dict[str, Any] = {
        "decomposition": dec.summary(),
        "points": int(pts.seg.shape[0]),
        "bins": int((~pts.exact).sum()),
        "bisection_steps": iters,
        "bisection_dp_runs": runs,
        "decompose_s": t_dec,
        "bound_s": t_bound - t_dec,
    }
    part = None
    if partition:
        t1 = time.perf_counter()
        part = _chain_partition(graph, dec, k, objective, io_scale, hi, details)
        details["partition_s"] = time.perf_counter() - t1
    details["seconds"] = time.perf_counter() - t0
    return ChainResult(lower_bound_s=float(lo), relaxed_value_s=float(hi), partition=part, details=details)


def _chain_partition(graph, dec, k, objective, io_scale, upper, details) -> Partition | None:
    ex = _points(dec, k, exact_only=True)
    P = ex.seg.shape[0]
    if P < 2:
        return None
    key = ("exact_dp", float(io_scale))
    if key not in dec._memo:
        io = ex.cut * io_scale
        # first point of each segment (points are in segment order), of the next segment holding points
        # if it holds none, 0 past the last one
        seg_first = np.searchsorted(ex.seg, np.arange(dec.num_segments + 1), side="left").astype(np.int64)
        seg_first[seg_first == P] = 0
        dec._memo[key] = (io, *_keys(ex.wlo, io), seg_first)
    io, rank, keys_desc, seg_first = dec._memo[key]
    end = P - 1
    # the exact optimum is >= the relaxed optimum: try the relaxed threshold first, then bisect upwards
    T = max(upper, 1e-300)
    f, parent = _exact_feasible(ex, io, rank, keys_desc, seg_first, T)
    steps = 1
    if not f[end] <= k:
        lo, hi = T, float(ex.wlo[end] - ex.wlo[0]) * (1 + 1e-9) + 2 * float(io.max(initial=0.0)) + 1e-300
        f_hi, parent_hi = _exact_feasible(ex, io, rank, keys_desc, seg_first, hi)
        steps += 1
        if not f_hi[end] <= k:
            details["partition_status"] = "no chain partition (model inputs cannot share a first block)"
            return None
        f, parent = f_hi, parent_hi
        while hi - lo > 1e-10 * hi and steps < 200:
            mid = 0.5 * (lo + hi)
            fm, pm = _exact_feasible(ex, io, rank, keys_desc, seg_first, mid)
            steps += 1
            if fm[end] <= k:
                hi, f, parent = mid, fm, pm
            else:
                lo = mid
        T = hi
    chain = _chain_of(parent, end)
    limit = max(_transition_cost(ex, io, a, b) for a, b in zip(chain[:-1], chain[1:]))
    chain = _fill_stages(ex, io, chain, k, limit)
    details["partition_dp_steps"] = steps
    details["partition_blocks"] = len(chain) - 1
    a = _assignment(graph, dec, ex, chain)
    return Partition.from_assignment(graph, a, k, objective, "relay", meta={"method": "chain", "chain_threshold_s": float(T)})


def boundary_weighted_bound(graph: OpGraph, k: int, in_per_byte: float, out_per_byte: float) -> float:
    """A lower bound on ``max_s (work(V_s) + in_per_byte * in_s + out_per_byte * out_s)`` over every
    partition of ``graph`` into ``k`` stages with relay communication (``work`` is ``t_fwd_s``; ``in_s`` /
    ``out_s`` the bytes crossing the stage's input / output boundary, Contract 2).

    The relaxed chain DP of :func:`solve_chain` (Lemmas D, L, S, G of the module docstring) with the
    two boundaries of a block weighted apart: a transition ``p -> q`` costs at least
    ``wlo[q] - whi[p] + in_per_byte * cut[p] + out_per_byte * cut[q]``. With both weights equal to
    ``1 / bandwidth`` it is :func:`chain_bound` in inference.

    Parameters
    ----------
    graph : OpGraph
        Its ``t_fwd_s`` (float64 (n,)) is the work per node, its ``size_out_bytes`` the tensors cut.
    k : int
        Stages, >= 1.
    in_per_byte, out_per_byte : float
        Cost per byte of a stage's input / output boundary (units of ``t_fwd_s`` per byte), >= 0.

    Returns
    -------
    float
        The bound, in the units of ``t_fwd_s``.

    Raises
    ------
    InputError
        For a bad ``k`` or a negative weight.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k must be a positive integer, got {k!r}")
    if not (in_per_byte >= 0 and out_per_byte >= 0):
        raise InputError(f"boundary weights must be >= 0, got {in_per_byte!r}, {out_per_byte!r}")
    pts = _points(cached_decomposition(graph, "inference"), int(k), exact_only=False)
    return float(_relaxed_min_bottleneck(pts, float(in_per_byte), int(k), out_scale=float(out_per_byte))[0])


def chain_bound(graph: OpGraph, k: int, objective: str = "training", comm: str = "relay") -> float:
    """The ``chain`` lower bound in seconds (see :func:`solve_chain`)."""
    return solve_chain(graph, k, objective, comm, partition=False).lower_bound_s


def chain_partition(graph: OpGraph, k: int, objective: str = "training", comm: str = "relay") -> Partition | None:
    """The chain partition (see :func:`solve_chain`), or None if the chain cannot be cut."""
    return solve_chain(graph, k, objective, comm, partition=True).partition
