"""Topological orders: Kahn's algorithm with node priorities and structured priority rules.

Every order generated here puts the model inputs (``graph.ops[i] == "placeholder"``) first
and the model output(s) (``"output"``) last, because the runtime feeds inputs to stage 0 and
reads outputs on the last stage. This is done by a node class that dominates the priority
in Kahn's heap: class 0 (placeholder) < class 1 (other) < class 2 (output). (If a placeholder
has producers or an output has consumers, which traced graphs never have, the rule is
followed as far as the edges allow.)

References
----------
Kahn, "Topological sorting of large networks", CACM 1962.
Archer et al. 2024, Section 4.2 and Appendix B.1, Algorithm 3 (Kahn with node priorities)
and Theorem 4.3 (priorities that reproduce any topological order).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition._numba import NJIT, njit

__all__ = [
    "node_classes",
    "kahn_order",
    "kahn_kernel",
    "keys_from_order",
    "structured_orders",
    "STRUCTURED_RULES",
    "random_order",
]


# --------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------


@njit(**NJIT)
def _less(a, b, cls, keys):
    if cls[a] != cls[b]:
        return cls[a] < cls[b]
    if keys[a] != keys[b]:
        return keys[a] < keys[b]
    return a < b


@njit(**NJIT)
def _push(heap, size, v, cls, keys):
    i = size
    heap[i] = v
    while i > 0:
        parent = (i - 1) >> 1
        if _less(heap[i], heap[parent], cls, keys):
            t = heap[i]
            heap[i] = heap[parent]
            heap[parent] = t
            i = parent
        else:
            break
    return size + 1


@njit(**NJIT)
def _pop(heap, size, cls, keys):
    top = heap[0]
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        left = 2 * i + 1
        if left >= size:
            break
        c = left
        right = left + 1
        if right < size and _less(heap[right], heap[left], cls, keys):
            c = right
        if _less(heap[c], heap[i], cls, keys):
            t = heap[i]
            heap[i] = heap[c]
            heap[c] = t
            i = c
        else:
            break
    return top, size


@njit(**NJIT)
def kahn_kernel(keys, cls, succ_ptr, succ_idx, pred_ptr):
    """Kahn's algorithm with a binary heap (Archer Alg. 3); smallest ``(cls, key, id)`` first.

    Parameters
    ----------
    keys : float64 (n,)
        Node priorities (smaller is earlier).
    cls : int64 (n,)
        Node class (0 placeholder, 1 other, 2 output); dominates ``keys``.
    succ_ptr, succ_idx, pred_ptr : int64
        CSR adjacency.

    Returns
    -------
    order : int64 (n,)
        A topological order (the graph is a DAG by construction of OpGraph).
    """
    n = keys.shape[0]
    indeg = np.empty(n, dtype=np.int64)
    for v in range(n):
        indeg[v] = pred_ptr[v + 1] - pred_ptr[v]
    heap = np.empty(n, dtype=np.int64)
    size = 0
    for v in range(n):
        if indeg[v] == 0:
            size = _push(heap, size, v, cls, keys)
    order = np.empty(n, dtype=np.int64)
    i = 0
    while size > 0:
        u, size = _pop(heap, size, cls, keys)
        order[i] = u
        i += 1
        for e in range(succ_ptr[u], succ_ptr[u + 1]):
            v = succ_idx[e]
            indeg[v] -= 1
            if indeg[v] == 0:
                size = _push(heap, size, v, cls, keys)
    return order


# --------------------------------------------------------------------------------------
# Python API
# --------------------------------------------------------------------------------------


def node_classes(graph: OpGraph) -> np.ndarray:
    """Kahn class of every node: 0 placeholder, 1 other, 2 output; int64 (n,)."""
    cls = np.ones(graph.n, dtype=np.int64)
    for i, op in enumerate(graph.ops):
        if op == "placeholder":
            cls[i] = 0
        elif op == "output":
            cls[i] = 2
    return cls


def kernel_csr(graph: OpGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The graph's CSR adjacency ``(succ_ptr, succ_idx, pred_ptr, pred_idx)`` as the numba kernels take it.

    Fresh writable int64 copies: numba specialises on read-only vs writable arrays, and one
    signature per kernel keeps the on-disk cache to one entry.
    """
    return (
        np.array(graph.succ_ptr, dtype=np.int64),
        np.array(graph.succ_idx, dtype=np.int64),
        np.array(graph.pred_ptr, dtype=np.int64),
        np.array(graph.pred_idx, dtype=np.int64),
    )


def kahn_order(graph: OpGraph, priorities: Sequence[float] | np.ndarray) -> np.ndarray:
    """Topological order by Kahn's algorithm, ties broken by ``priorities`` (smaller first).

    Placeholders come first and outputs last (module docstring); remaining ties go to the
    smaller node id.

    Parameters
    ----------
    graph : OpGraph
    priorities : float array (n,)
        Any finite numbers (random keys in [0, 1) for BRKGA).

    Returns
    -------
    int64 array (n,)

    Raises
    ------
    InputError
        If ``priorities`` has the wrong length or non-finite entries.

    References
    ----------
    Archer et al. 2024, Appendix B.1, Algorithm 3.
    """
    keys = np.asarray(priorities, dtype=np.float64)
    if keys.shape != (graph.n,):
        raise InputError(f"priorities must have shape ({graph.n},), got {keys.shape}")
    if not np.all(np.isfinite(keys)):
        raise InputError("priorities must be finite numbers")
    sp, si, pp, _ = kernel_csr(graph)
    return kahn_kernel(np.array(keys, dtype=np.float64), node_classes(graph), sp, si, pp)


def keys_from_order(order: Sequence[int] | np.ndarray) -> np.ndarray:
    """Random keys in (0, 1) that make Kahn reproduce a topological ``order`` (float64 (n,)).

    ``key[v] = (position(v) + 0.5) / n``: at every step the next node of the order is
    available and has the smallest key of all remaining nodes (Archer Theorem 4.3). With the
    placeholder/output classes the order is reproduced exactly if it already has the
    placeholders first and the outputs last.
    """
    o = np.asarray(order, dtype=np.int64)
    n = o.shape[0]
    keys = np.empty(n)
    keys[o] = (np.arange(n) + 0.5) / max(n, 1)
    return keys


def random_order(graph: OpGraph, rng: np.random.Generator) -> np.ndarray:
    """Kahn order with i.i.d. U(0, 1) priorities (Archer Section 4.2, "Random weights")."""
    return kahn_order(graph, rng.random(graph.n))


def _depth_from_sources(graph: OpGraph) -> np.ndarray:
    order = kahn_order(graph, np.arange(graph.n, dtype=np.float64))
    depth = np.zeros(graph.n, dtype=np.int64)
    for v in order:
        preds = graph.predecessors(v)
        if preds.size:
            depth[v] = depth[preds].max() + 1
    return depth


def _height_to_sinks(graph: OpGraph, weights: np.ndarray | None = None) -> np.ndarray:
    order = kahn_order(graph, np.arange(graph.n, dtype=np.float64))
    w = np.ones(graph.n) if weights is None else np.asarray(weights, dtype=np.float64)
    h = np.zeros(graph.n)
    for v in order[::-1]:
        succ = graph.successors(v)
        h[v] = w[v] + (h[succ].max() if succ.size else 0.0)
    return h


def _dfs_order(graph: OpGraph) -> np.ndarray:
    """Reverse postorder of an iterative DFS from the sources in id order (topological)."""
    n = graph.n
    visited = np.zeros(n, dtype=bool)
    post: list[int] = []
    for s in range(n - 1, -1, -1):  # reversed so that the final order starts with small ids
        if visited[s] or graph.pred_ptr[s + 1] != graph.pred_ptr[s]:
            continue
        visited[s] = True
        stack = [(s, 0)]
        while stack:
            v, i = stack[-1]
            succ = graph.successors(v)
            if i < succ.size:
                stack[-1] = (v, i + 1)
                w = int(succ[succ.size - 1 - i])
                if not visited[w]:
                    visited[w] = True
                    stack.append((w, 0))
            else:
                stack.pop()
                post.append(v)
    return np.asarray(post[::-1], dtype=np.int64)


def _rule_keys(graph: OpGraph, rule: str) -> np.ndarray:
    n = graph.n
    ids = np.arange(n, dtype=np.float64)
    if rule == "program":
        return ids
    if rule == "reverse_program":
        return -ids
    if rule == "bfs_depth":
        return _depth_from_sources(graph) * float(n) + ids
    if rule == "alap":
        h = _height_to_sinks(graph)
        return -h * float(n) + ids
    if rule == "critical_path":
        return -_height_to_sinks(graph, graph.t_train_s + 1e-30)
    if rule == "dfs":
        return keys_from_order(_dfs_order(graph))
    if rule == "large_output_first":
        return -np.asarray(graph.size_out_bytes, dtype=np.float64)
    raise InputError(f"unknown order rule {rule!r}; choose from {STRUCTURED_RULES}")


#: Names of the structured priority rules of :func:`structured_orders`.
STRUCTURED_RULES = ("program", "reverse_program", "bfs_depth", "alap", "critical_path", "dfs", "large_output_first")


def structured_orders(graph: OpGraph, rules: Sequence[str] = STRUCTURED_RULES) -> dict[str, np.ndarray]:
    """Deterministic topological orders from simple priority rules, deduplicated.

    Rules (all through :func:`kahn_order`, so placeholders first and outputs last):

    * ``program``: node id (program order of a traced model when ids are topological);
    * ``reverse_program``: largest id first (a depth-first-like order);
    * ``bfs_depth``: by depth (longest path in edges from a source), ties by id;
    * ``alap``: by longest path in edges to a sink, longest first ("as late as possible"
      reversed: nodes on long chains first);
    * ``critical_path``: by longest training-work path to a sink, longest first;
    * ``dfs``: reverse postorder of a depth-first search from the sources;
    * ``large_output_first``: among ready nodes the one with the largest output tensor
      first (ties by id).

    Returns
    -------
    dict[str, int64 array (n,)]
        Rule name -> order, keeping the first rule for duplicate orders.
    """
    out: dict[str, np.ndarray] = {}
    seen: set[bytes] = set()
    for rule in rules:
        o = kahn_order(graph, _rule_keys(graph, rule))
        key = o.tobytes()
        if key in seen:
            continue
        seen.add(key)
        out[rule] = o
    return out
