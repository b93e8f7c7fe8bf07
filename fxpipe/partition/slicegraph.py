"""SliceGraph: optimal slicing of one topological order into at most k pipeline stages.

Given a topological order ``pi`` of an :class:`~fxpipe.ir.OpGraph`, find cut points that
split ``pi`` into at most ``k`` contiguous segments (pipeline blocks, numbered in order)
minimising the bottleneck ``max_b f(P_b)`` of DESIGN.md Contract 2. This is Archer et al.
2024, Algorithm 1 (the DP), with the segment costs of Algorithms 4-5 computed on the fly
instead of in an ``n x n`` table:

* ``F[j, r]`` is the best bottleneck of the prefix ``pi[0..r]`` cut into exactly ``j``
  non-empty segments; ``F[j, r] = min_l max(F[j-1, l-1], cost(l, r))``.
* For a fixed right end ``r`` the left end ``l`` moves from ``r`` down to 0 and the cost of
  ``[l, r]`` is maintained incrementally: the work grows by one node, the node's output
  tensor becomes an output of the segment if its last consumer lies after ``r``, it stops
  being an input if it was one, and each producer it reads from outside the segment becomes
  an input once (a per-tensor stamp records "has a consumer in the window").
* Pruning: an incumbent bottleneck ``T`` (given by the caller, or the cost of an
  equal-work split computed first) stops extending ``l`` once the work of ``[l, r]`` alone
  exceeds ``T`` (work only grows as ``l`` moves left), and limits ``j`` for each ``r`` to
  ``ceil(W(pi[0..r]) / T) <= j <= k - ceil(W(pi[r+1..]) / T)``.
* Bound deepening: when ``T`` is missing (the equal-work split does not fit in memory) or
  more than 4x the lower bound ``LB = max(W / k, max_v work(v))``, the DP is first run with
  the bounds ``2 LB, 8 LB, 32 LB, ... < T``. A DP with bound ``t`` is exact whenever the
  optimum is ``<= t``, so the first success is the optimum, and the short windows of the
  failed tries cost less than one DP with a loose bound.

Memory is ``O(n k)`` (the DP table and its arg-min); time is ``O(sum_r window(r) * (deg +
j-range))``, at worst the ``O(n^2 k)`` of Archer Lemma 4.2.

Relay mode (``comm="relay"``) has a closed form: with contiguous blocks a tensor produced
at position ``p(u)`` whose last consumer is at ``L(u)`` is an output of the segment
``[l, r]`` iff ``p(u) <= r < L(u)`` and an input iff ``p(u) <= l-1 < L(u)``. So the relay io
of ``[l, r]`` is ``cut(l-1) + cut(r)`` where ``cut(i)`` is the total size of tensors live
across the boundary after position ``i`` (Contract 2, "relay"; checked against
:func:`fxpipe.partition.objective.block_costs` in the tests).

Empty blocks only ever occur at the end (``cuts[b] == n``): an empty block in the middle
never lowers the Contract-2 bottleneck and :meth:`Partition.from_assignment` moves empty
blocks last anyway.

References
----------
Archer, Fahrbach, Liu, Prabhu. "Practical Performance Guarantees for Pipelined DNN
Inference", ICML 2024, Section 4.1, Algorithm 1, Appendix B.2 (Algorithms 4-5), Lemma 4.2.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition._numba import NJIT, njit
from fxpipe.partition.memory import memory_inputs
from fxpipe.partition.objective import Partition, check_objective
from fxpipe.partition.orders import kernel_csr

__all__ = [
    "slice_order",
    "slice_order_arrays",
    "kernel_inputs",
    "check_order",
    "assignment_from_cuts",
]

_EPS = 1e-9


# --------------------------------------------------------------------------------------
# kernels (arrays and scalars only)
# --------------------------------------------------------------------------------------


@njit(**NJIT)
def _positions_and_last(order, succ_ptr, succ_idx):
    n = order.shape[0]
    pos = np.empty(n, dtype=np.int64)
    for p in range(n):
        pos[order[p]] = p
    last = np.full(n, -1, dtype=np.int64)
    for u in range(n):
        for e in range(succ_ptr[u], succ_ptr[u + 1]):
            pv = pos[succ_idx[e]]
            if pv > last[u]:
                last[u] = pv
    return pos, last


@njit(**NJIT)
def _relay_cuts(order, pos, last, size_out):
    """``cut[i]``: bytes of tensors produced at a position <= i and last consumed after i."""
    n = order.shape[0]
    diff = np.zeros(n + 1)
    for u in range(n):
        if last[u] > pos[u]:
            diff[pos[u]] += size_out[u]
            diff[last[u]] -= size_out[u]
    cut = np.empty(n)
    acc = 0.0
    for i in range(n):
        acc += diff[i]
        cut[i] = acc
    return cut


@njit(**NJIT)
def _ceil_ratio(w, t):
    """Smallest number of segments of cost <= t that can hold work w (with slack)."""
    if w <= 0.0:
        return 0
    if t == np.inf:
        return 0
    if t <= 0.0:
        return 1 << 40
    return int(math.ceil(w / t * (1.0 - 1e-9)))


@njit(inline="always", **NJIT)
def _grow_io(v, r, tag, inb, outb, stamp, pred_ptr, pred_idx, last, size_out):
    """Dag-mode input and output bytes ``(inb, outb)`` of a segment ending at position ``r``
    once node ``v`` joins it on the left (segments grow right to left; ``stamp[u] == tag``
    marks the producers already counted as inputs)."""
    if last[v] > r:
        outb += size_out[v]
    if stamp[v] == tag:
        inb -= size_out[v]
    for e in range(pred_ptr[v], pred_ptr[v + 1]):
        u = pred_idx[e]
        if stamp[u] != tag:
            stamp[u] = tag
            inb += size_out[u]
    return inb, outb


@njit(**NJIT)
def _segment_io(order, l, r, tag, stamp, pred_ptr, pred_idx, last, size_out, relay, cut):
    """Input and output bytes of segment [l, r] (Contract 2), fresh ``tag``."""
    if relay:
        return (cut[l - 1] if l > 0 else 0.0), cut[r]
    inb = 0.0
    outb = 0.0
    for p in range(r, l - 1, -1):
        inb, outb = _grow_io(order[p], r, tag, inb, outb, stamp, pred_ptr, pred_idx, last, size_out)
    return inb, outb


@njit(**NJIT)
def _segment_cost(order, l, r, tag, stamp, pred_ptr, pred_idx, last, work, size_out, io_scale, relay, cut):
    """Cost of segment [l, r] by the same right-to-left sweep as the DP (fresh ``tag``)."""
    w = 0.0
    for p in range(r, l - 1, -1):
        w += work[order[p]]
    inb, outb = _segment_io(order, l, r, tag, stamp, pred_ptr, pred_idx, last, size_out, relay, cut)
    return w + io_scale * (inb + outb)


@njit(**NJIT)
def slice_kernel(
    order,
    succ_ptr,
    succ_idx,
    pred_ptr,
    pred_idx,
    work,
    size_out,
    io_scale,
    relay,
    k,
    bound,
    mem_param,
    mem_act,
    inflight,
    mem_cap,
    buf_in,
    buf_out,
    size_grad,
):
    """Optimal slicing of ``order`` into at most ``k`` segments (Archer Alg. 1, 4-5).

    Parameters
    ----------
    order : int64 (n,)
        A topological order (not checked here).
    succ_ptr, succ_idx, pred_ptr, pred_idx : int64
        CSR adjacency of the OpGraph.
    work : float64 (n,)
        Per-node work in seconds (``OpGraph.work_s(objective)``).
    size_out : float64 (n,)
        Output tensor bytes.
    io_scale : float
        Seconds per io byte: ``1/B`` (inference) or ``2/B`` (training).
    relay : bool
        Contract-2 relay communication instead of dag.
    k : int
        Maximum number of blocks (>= 1).
    bound : float
        Incumbent: only slicings with bottleneck ``<= bound`` are searched (``inf``: none).
    mem_param, mem_act : float64 (n,)
        Static bytes and per-in-flight-micro-batch bytes of each node (zeros without a
        memory limit).
    inflight : float64 (k,)
        In-flight micro-batches of block position s.
    mem_cap : float
        Bytes per device (``inf``: no limit). A block with ``sum(mem_param) +
        sum(mem_act) * inflight[s] + buf_in[s] * in_bytes + buf_out * out_bytes > mem_cap`` is
        infeasible.
    buf_in : float64 (k,)
        Receive-buffer bytes per byte of the Contract-2 input boundary of the block at
        pipeline position s (:func:`fxpipe.partition.memory.memory_inputs`).
    buf_out : float
        The same per byte of a block's output boundary (its gradient buffers).
    size_grad : float64 (n,)
        Output bytes that come back as a gradient: what ``buf_out`` counts in relay mode.

    Returns
    -------
    best : float
        Optimal bottleneck (seconds), ``inf`` if no slicing is ``<= bound`` (or fits).
    cuts : int64 (k + 1,)
        Block b is ``order[cuts[b]:cuts[b+1]]``; trailing blocks may be empty.
    """
    n = order.shape[0]
    pos, last = _positions_and_last(order, succ_ptr, succ_idx)
    has_mem = mem_cap < np.inf
    cut = np.zeros(n)
    cutg = cut
    if relay:
        cut = _relay_cuts(order, pos, last, size_out)
        cutg = _relay_cuts(order, pos, last, size_grad) if has_mem else cut
    wpre = np.zeros(n + 1)
    for p in range(n):
        wpre[p + 1] = wpre[p] + work[order[p]]
    total = wpre[n]
    stamp = np.full(n, -1, dtype=np.int64)

    # ---- incumbent from an equal-work split (only used for pruning)
    T = bound
    nseg = min(k, n)
    starts = np.empty(nseg + 1, dtype=np.int64)
    starts[0] = 0
    b = 1
    for p in range(n):
        if b >= nseg:
            break
        if wpre[p + 1] >= total * b / nseg and p + 1 < n:
            # segment b-1 ends at p; keep at least one node per remaining segment
            if n - (p + 1) >= nseg - b:
                starts[b] = p + 1
                b += 1
    while b < nseg:  # not enough cuts found: cut the last nodes one by one
        starts[b] = n - (nseg - b)
        b += 1
    starts[nseg] = n
    ok = True
    for i in range(nseg):
        if starts[i] >= starts[i + 1]:
            ok = False
    if ok:
        g = 0.0
        for i in range(nseg):
            l = starts[i]
            r = starts[i + 1] - 1
            c = _segment_cost(order, l, r, n + 1 + i, stamp, pred_ptr, pred_idx, last, work, size_out, io_scale, relay, cut)
            if has_mem:
                pm = 0.0
                am = 0.0
                for p in range(l, r + 1):
                    pm += mem_param[order[p]]
                    am += mem_act[order[p]]
                ib, ob = _segment_io(order, l, r, 2 * n + 2 + i, stamp, pred_ptr, pred_idx, last, size_out, relay, cut)
                if relay:
                    ob = cutg[r]
                if pm + am * inflight[i] + buf_in[i] * ib + buf_out * ob > mem_cap:
                    c = np.inf
            if c > g:
                g = c
        g = g * (1.0 + _EPS) + 1e-300
        if g < T:
            T = g
    for v in range(n):
        stamp[v] = -1

    # ---- bounded DPs: if the incumbent is missing (memory) or far above the lower bound
    # max(total / k, max node work), try geometrically growing bounds first. A DP with
    # bound T finds the optimum whenever the optimum is <= T, and a small T keeps the
    # windows short, so the failed tries cost less than one DP with a loose bound.
    # every segment costs at most all the work plus every tensor twice (in and out)
    ub_all = 0.0
    for v in range(n):
        ub_all += size_out[v]
    ub_all = (total + io_scale * 2.0 * ub_all) * (1.0 + _EPS) + 1e-300
    if ub_all < T:
        T = ub_all
    lb = total / k
    for v in range(n):
        if work[v] > lb:
            lb = work[v]
    if lb > 0.0 and T > 4.0 * lb:
        t_try = 2.0 * lb
        while t_try < T:
            best, cuts = _bounded_dp(order, pred_ptr, pred_idx, work, size_out, io_scale, relay, k, t_try,
                                     mem_param, mem_act, inflight, mem_cap, buf_in, buf_out, last, cut, cutg, wpre, stamp)
            if best < np.inf:
                return best, cuts
            t_try *= 4.0
    return _bounded_dp(order, pred_ptr, pred_idx, work, size_out, io_scale, relay, k, T,
                       mem_param, mem_act, inflight, mem_cap, buf_in, buf_out, last, cut, cutg, wpre, stamp)


@njit(**NJIT)
def _bounded_dp(order, pred_ptr, pred_idx, work, size_out, io_scale, relay, k, T,
                mem_param, mem_act, inflight, mem_cap, buf_in, buf_out, last, cut, cutg, wpre, stamp):
    """The DP of :func:`slice_kernel` restricted to slicings with bottleneck <= T."""
    n = order.shape[0]
    total = wpre[n]
    has_mem = mem_cap < np.inf
    min_inflight = np.inf
    for s in range(k):
        if inflight[s] < min_inflight:
            min_inflight = inflight[s]
    cuts = np.full(k + 1, n, dtype=np.int64)
    cuts[0] = 0
    for v in range(n):
        stamp[v] = -1
    # ---- DP over (j, r)
    F = np.full((k + 1, n), np.inf)
    A = np.zeros((k + 1, n), dtype=np.int32)
    for r in range(n):
        lo = _ceil_ratio(wpre[r + 1], T)
        if lo < 1:
            lo = 1
        hi = k - _ceil_ratio(total - wpre[r + 1], T)
        if hi > r + 1:
            hi = r + 1
        if lo > hi:
            continue
        w = 0.0
        inb = 0.0
        outb = 0.0
        pm = 0.0
        am = 0.0
        for l in range(r, -1, -1):
            v = order[l]
            w += work[v]
            if w > T:
                break
            if has_mem:
                pm += mem_param[v]
                am += mem_act[v]
                if pm + am * min_inflight > mem_cap:
                    break
            if relay:
                io = cut[r] + (cut[l - 1] if l > 0 else 0.0)
            else:
                inb, outb = _grow_io(v, r, r, inb, outb, stamp, pred_ptr, pred_idx, last, size_out)
                io = inb + outb
            c = w + io_scale * io
            if c > T:
                continue
            bm_in = 0.0  # receive buffers of [l, r] per buf_in factor / in all (not monotone in l: checked, never a break)
            bm = 0.0
            if has_mem:
                if relay:
                    bm_in = cut[l - 1] if l > 0 else 0.0
                    bm = buf_out * cutg[r]
                else:
                    bm_in = inb
                    bm = buf_out * outb
            if l == 0:
                if lo <= 1:
                    if has_mem and pm + am * inflight[0] + buf_in[0] * bm_in + bm > mem_cap:
                        continue
                    if c < F[1, r]:
                        F[1, r] = c
                        A[1, r] = 0
                continue
            jlo = lo if lo > 2 else 2
            jhi = hi if hi < l + 1 else l + 1
            for j in range(jlo, jhi + 1):
                prev = F[j - 1, l - 1]
                if prev >= F[j, r]:
                    continue
                if has_mem and pm + am * inflight[j - 1] + buf_in[j - 1] * bm_in + bm > mem_cap:
                    continue
                val = prev if prev > c else c
                if val < F[j, r]:
                    F[j, r] = val
                    A[j, r] = l
    best = np.inf
    jbest = 0
    for j in range(1, k + 1):
        if F[j, n - 1] <= best and F[j, n - 1] < np.inf:
            best = F[j, n - 1]
            jbest = j
    if jbest == 0:
        return np.inf, cuts
    r = n - 1
    j = jbest
    while j >= 1:
        l = A[j, r]
        cuts[j - 1] = l
        r = l - 1
        j -= 1
    return best, cuts




@njit(**NJIT)
def assignment_from_cuts(order, cuts):
    """Block of every node (int64 (n,)) from an order and the cut array of :func:`slice_kernel`."""
    n = order.shape[0]
    a = np.empty(n, dtype=np.int64)
    k = cuts.shape[0] - 1
    for b in range(k):
        for p in range(cuts[b], cuts[b + 1]):
            a[order[p]] = b
    return a


# --------------------------------------------------------------------------------------
# Python wrappers
# --------------------------------------------------------------------------------------


def kernel_inputs(graph: OpGraph, k: int, objective: str = "inference", comm: str = "dag", memory=None) -> tuple[tuple, tuple]:
    """Plain-array arguments of :func:`slice_kernel` for one problem, as ``(base, mem)``.

    Parameters
    ----------
    graph : OpGraph
    k : int
    objective : {"inference", "training"}
    comm : {"dag", "relay"}
    memory : float, MemoryModel or PartitionMemory, optional

    Returns
    -------
    base : tuple
        ``(succ_ptr, succ_idx, pred_ptr, pred_idx, work (n,) s, size_out (n,) bytes,
        io_scale s/byte, relay bool, k)``: the arguments between ``order`` and ``bound``.
    mem : tuple
        ``(mem_param (n,) bytes, mem_act (n,) bytes, inflight (k,), mem_cap bytes, buf_in (k,),
        buf_out, size_grad (n,) bytes)`` from :func:`fxpipe.partition.memory.memory_inputs`: the arguments after
        ``bound``.

    Raises
    ------
    InputError
        For an unknown objective/comm or a bad memory model.
    """
    check_objective(objective, comm)
    io_scale = (2.0 if objective == "training" else 1.0) / graph.bandwidth_bytes_per_s
    base = (
        *kernel_csr(graph),
        np.array(graph.work_s(objective), dtype=np.float64),
        np.array(graph.size_out_bytes, dtype=np.float64),
        float(io_scale),
        comm == "relay",
        int(k),
    )
    return base, memory_inputs(graph, k, objective, memory)


def check_order(graph: OpGraph, order: Sequence[int] | np.ndarray) -> np.ndarray:
    """Validate that ``order`` is a permutation of ``0..n-1`` and a topological order.

    Returns
    -------
    int64 array (n,)

    Raises
    ------
    InputError
        If it is not a permutation or some edge goes backwards.
    """
    o = np.asarray(order)
    if o.shape != (graph.n,) or (o.size and o.dtype.kind not in "iu"):
        raise InputError(f"order must be a permutation of 0..{graph.n - 1} (shape ({graph.n},)), got shape {o.shape}")
    o = o.astype(np.int64)
    seen = np.zeros(graph.n, dtype=bool)
    if o.size and (o.min() < 0 or o.max() >= graph.n):
        raise InputError(f"order must contain node ids 0..{graph.n - 1}")
    seen[o] = True
    if not seen.all():
        raise InputError(f"order is not a permutation: node {int(np.flatnonzero(~seen)[0])} is missing")
    pos = np.empty(graph.n, dtype=np.int64)
    pos[o] = np.arange(graph.n)
    if graph.m:
        back = np.flatnonzero(pos[graph.edges[:, 0]] > pos[graph.edges[:, 1]])
        if back.size:
            u, v = graph.edges[back[0]].tolist()
            raise InputError(f"order is not topological: node {v} ({graph.names[v]}) comes before its producer {u} ({graph.names[u]})")
    return o


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise InputError(f"k (number of pipeline stages) must be an integer, got {k!r}")
    if k < 1:
        raise InputError(f"k (number of pipeline stages) must be >= 1, got {k}")
    return int(k)


def slice_order_arrays(order: np.ndarray, inputs: tuple, bound: float = np.inf) -> tuple[float, np.ndarray]:
    """Run :func:`slice_kernel` on a checked int64 ``order`` and ``inputs = kernel_inputs(...)``.

    Returns ``(bottleneck_s, cuts)``; see :func:`slice_kernel`. No validation: for use in
    inner loops (BRKGA, order search).
    """
    base, mem = inputs
    return slice_kernel(order, *base, float(bound), *mem)


def slice_order(
    graph: OpGraph,
    order: Sequence[int] | np.ndarray,
    k: int,
    objective: str = "inference",
    comm: str = "dag",
    incumbent: float = math.inf,
    *,
    memory=None,
) -> Partition | None:
    """Optimal partition of ``graph`` obtained by cutting ``order`` into at most k blocks.

    Parameters
    ----------
    graph : OpGraph
    order : int array (n,)
        A topological order of ``graph`` (a permutation of ``0..n-1``).
    k : int
        Maximum number of pipeline blocks, ``>= 1``. ``k > n`` leaves blocks empty.
    objective : {"inference", "training"}
    comm : {"dag", "relay"}
        Contract-2 cost model (DESIGN.md).
    incumbent : float, optional
        Bottleneck (seconds) to beat: slicings with a larger bottleneck are pruned.
    memory : float, MemoryModel or PartitionMemory, optional
        Per-device capacity (bytes), a :class:`fxpipe.memory.MemoryModel` or a
        :class:`fxpipe.partition.memory.PartitionMemory`.

    Returns
    -------
    Partition or None
        Blocks numbered in pipeline order, non-empty blocks first, costs recomputed from
        scratch by :meth:`Partition.from_assignment`; ``meta["kernel_bottleneck"]`` is the
        DP's value. ``None`` if no slicing has bottleneck ``<= incumbent`` (or fits in
        memory).

    Raises
    ------
    InputError
        If ``order`` is not a topological permutation, ``k < 1``, or the objective/comm is
        unknown.

    References
    ----------
    Archer et al. 2024, Algorithm 1 (SliceGraph) and Algorithms 4-5 (segment costs).
    """
    k = _check_k(k)
    check_objective(objective, comm)
    o = check_order(graph, order)
    try:
        inc = float(incumbent)
    except (TypeError, ValueError):
        raise InputError(f"incumbent must be a number, got {incumbent!r}") from None
    if math.isnan(inc):
        raise InputError("incumbent must not be NaN")
    inputs = kernel_inputs(graph, k, objective, comm, memory)
    best, cuts = slice_order_arrays(o, inputs, inc)
    if not np.isfinite(best):
        return None
    a = assignment_from_cuts(o, cuts)
    return Partition.from_assignment(
        graph, a, k, objective, comm, order=o, meta={"method": "slice", "kernel_bottleneck": float(best)}
    )
