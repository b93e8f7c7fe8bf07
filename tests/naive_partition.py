"""Plain-Python references for the partitioner kernels (no numba, no cleverness).

Every cost here comes from :func:`fxpipe.partition.objective.block_costs` (the Contract-2
reference) on an explicit assignment, never from the kernels' incremental formulas.
"""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

from fxpipe.ir import OpGraph
from fxpipe.partition.objective import block_costs


def segment_cost(graph: OpGraph, order, l: int, r: int, objective: str, comm: str) -> float:
    """Contract-2 cost of the block ``order[l..r]`` when the order is cut before l and after r.

    The nodes before ``l`` form block 0, the segment block 1, the rest block 2. In dag mode a
    block's io depends only on its node set; in relay mode it depends on which tensors cross
    the boundaries before ``l`` and after ``r``, which this 3-block assignment reproduces.
    """
    a = np.empty(graph.n, dtype=np.int64)
    for p, v in enumerate(order):
        a[v] = 0 if p < l else (1 if p <= r else 2)
    return float(block_costs(graph, a, 3, objective, comm)[1])


def segment_io(graph: OpGraph, order, l: int, r: int, comm: str, producers=None) -> tuple[float, float]:
    """Contract-2 (in, out) bytes of the block ``order[l..r]`` (3-block assignment as above);
    ``producers``: count only these nodes' outputs."""
    from fxpipe.partition.objective import io_bytes

    a = np.empty(graph.n, dtype=np.int64)
    for p, v in enumerate(order):
        a[v] = 0 if p < l else (1 if p <= r else 2)
    i, o = io_bytes(graph, a, 3, comm, producers=producers)
    return float(i[1]), float(o[1])


def _mem_ok(graph, order, l, r, s, mem, comm):
    """``mem = (static bytes per node (n,), inflight (k,), capacity, buf_in (k,), buf_out, grad (n,) bool)``:
    the output boundary counts in relay mode only the outputs of ``grad`` nodes (gradient buffers)."""
    if mem is None:
        return True
    static_b, inflight, cap, buf_in, buf_out, grad = mem
    nodes = [order[p] for p in range(l, r + 1)]
    static = sum(static_b[v] for v in nodes)
    act = sum(graph.act_bytes[v] for v in nodes)
    i, o = segment_io(graph, order, l, r, comm)
    if comm == "relay":
        o = segment_io(graph, order, l, r, comm, producers=grad)[1]
    return static + act * inflight[s] + buf_in[s] * i + buf_out * o <= cap


def naive_slice(graph: OpGraph, order, k: int, objective: str = "inference", comm: str = "dag", mem=None):
    """O(n^2 k) DP of Archer Algorithm 1 with every segment cost from :func:`segment_cost`.

    ``mem = (static bytes per node (n,), inflight (k,), capacity_bytes, buf_in (k,), buf_out, grad (n,))`` or
    None (see :func:`_mem_ok`). Returns the optimal bottleneck
    over slicings into at most k non-empty segments numbered from the front (inf if none fits).
    """
    n = graph.n
    order = list(order)
    cost = {}
    for l in range(n):
        for r in range(l, n):
            cost[l, r] = segment_cost(graph, order, l, r, objective, comm)
    F = [[math.inf] * (n + 1) for _ in range(k + 1)]  # F[j][m]: first m nodes in exactly j segments
    F[0][0] = 0.0
    for j in range(1, k + 1):
        for m in range(1, n + 1):
            for l in range(j - 1, m):
                if F[j - 1][l] == math.inf or not _mem_ok(graph, order, l, m - 1, j - 1, mem, comm):
                    continue
                F[j][m] = min(F[j][m], max(F[j - 1][l], cost[l, m - 1]))
    return min(F[j][n] for j in range(1, k + 1))


def brute_cuts(graph: OpGraph, order, k: int, objective: str = "inference", comm: str = "dag") -> float:
    """Min over every way to cut ``order`` into at most k contiguous blocks (block_costs on each)."""
    n = graph.n
    best = math.inf
    for nb in range(1, min(k, n) + 1):
        for cuts in itertools.combinations(range(1, n), nb - 1):
            bounds = (0, *cuts, n)
            a = np.empty(n, dtype=np.int64)
            for b in range(nb):
                for p in range(bounds[b], bounds[b + 1]):
                    a[order[p]] = b
            best = min(best, float(block_costs(graph, a, k, objective, comm).max()))
    return best


def brute_force_memory(graph: OpGraph, k: int, objective: str, comm: str, mem) -> float:
    """Best bottleneck over all acyclic partitions whose stages fit in memory (n <= 8).

    Enumerates monotone assignments, compresses the used blocks to 0..j-1 (what
    ``Partition.from_assignment`` does: empty blocks last), and checks stage s's memory
    ``static + act * inflight[s] + buf_in[s] * in_bytes + buf_out * out_bytes <= cap`` with
    ``mem = (static bytes per node (n,), inflight (k,), cap, buf_in (k,), buf_out, grad (n,))``
    (relay: ``out_bytes`` of the ``grad`` nodes only).
    """
    from fxpipe.partition.objective import io_bytes

    static_b, inflight, cap, buf_in, buf_out, grad = mem
    n = graph.n
    edges = graph.edges.tolist()
    best = math.inf
    seen = set()
    for assign in itertools.product(range(k), repeat=n):
        if any(assign[u] > assign[v] for u, v in edges):
            continue
        used = sorted(set(assign))
        remap = {b: i for i, b in enumerate(used)}
        a = tuple(remap[b] for b in assign)
        if a in seen:
            continue
        seen.add(a)
        ok = True
        ins, outs = io_bytes(graph, np.array(a), k, comm)
        if comm == "relay":
            outs = io_bytes(graph, np.array(a), k, comm, producers=grad)[1]
        for s in range(len(used)):
            nodes = [v for v in range(n) if a[v] == s]
            m = sum(static_b[v] for v in nodes) + sum(graph.act_bytes[v] for v in nodes) * inflight[s]
            m += buf_in[s] * ins[s] + buf_out * outs[s]
            if m > cap:
                ok = False
                break
        if not ok:
            continue
        best = min(best, float(block_costs(graph, np.array(a), k, objective, comm).max()))
    return best


def kahn_reference(graph: OpGraph, keys, cls) -> list[int]:
    """Kahn's algorithm with heapq: smallest (class, key, id) first (Archer Algorithm 3)."""
    indeg = [int(graph.pred_ptr[v + 1] - graph.pred_ptr[v]) for v in range(graph.n)]
    heap = [(int(cls[v]), float(keys[v]), v) for v in range(graph.n) if indeg[v] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, _, u = heapq.heappop(heap)
        out.append(u)
        for v in graph.successors(u).tolist():
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (int(cls[v]), float(keys[v]), v))
    return out


def random_dag(seed: int, n: int, p_edge: float = 0.35, *, ops: bool = False, integer: bool = False, bandwidth: float | None = None) -> OpGraph:
    """A random costed DAG with n nodes (ids shuffled so that id order is not topological).

    ``ops=True`` marks the first source as a placeholder and the last sink as the output.
    """
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    edges = [[int(perm[i]), int(perm[j])] for i in range(n) for j in range(i + 1, n) if rng.random() < p_edge]
    if integer:
        vals = lambda: rng.integers(0, 6, n).astype(float)  # noqa: E731
    else:
        vals = lambda: rng.random(n) * rng.choice([0.1, 1.0, 10.0])  # noqa: E731
    kinds = None
    if ops:
        kinds = ["call_function"] * n
        preds = {v for _, v in edges}
        succs = {u for u, _ in edges}
        sources = [int(v) for v in perm if int(v) not in preds]
        sinks = [int(v) for v in perm if int(v) not in succs]
        kinds[sources[0]] = "placeholder"
        if sinks[-1] != sources[0]:
            kinds[sinks[-1]] = "output"
    return OpGraph.from_arrays(
        t_fwd_s=vals(), t_bwd_input_s=vals(), t_bwd_weight_s=vals(), size_out_bytes=np.round(vals() * 100),
        size_param_bytes=np.round(vals() * 1000), act_bytes=np.round(vals() * 100), edges=edges,
        bandwidth_bytes_per_s=bandwidth if bandwidth is not None else float(rng.choice([10.0, 100.0, 1000.0])), ops=kinds,
    )


def carries_grad_by_hand(graph: OpGraph, n_params) -> list[bool]:
    """Nodes whose output requires grad: they own parameters (``n_params[v] > 0``) or a predecessor's
    output requires grad; a fixed point over the edges, not a topological pass."""
    grad = [float(p) > 0 for p in n_params]
    changed = True
    while changed:
        changed = False
        for u, v in graph.edges.tolist():
            if grad[u] and not grad[v]:
                grad[v] = changed = True
    return grad
