"""Contract trivially cheap ops into their neighbours before searching, expand after.

A *trivial* op has zero work under the objective (views, reshapes, aliases, ``getitem``,
casts that change nothing, the ``output`` node). The order search (SliceGraph over Kahn
orders, BRKGA) is run on a smaller graph in which each trivial op is merged with a
neighbour, so that no stage can consist of trivial ops only and the ``output`` node always
shares a stage with the op that produces the model output (it never receives the logits on
a stage of its own).

Merges are *exact*: every group has at most one member whose tensor leaves the group, so a
group is an OpGraph node with one output tensor, and the Contract-2 cost of a partition of
the contracted graph equals the cost of the expanded partition of the original graph (both
``dag`` and ``relay``). Two merge rules, applied to a fixpoint with a union-find:

* forward: a trivial node u whose only consumer is v joins v's group (u's tensor becomes
  internal; no other path u -> v exists, so the quotient stays acyclic);
* backward: a trivial node v with a single producer u joins u's group if u's only consumer
  is v (u's tensor becomes internal, v's leaves instead) or if v has no consumer (a sink
  such as ``output`` or a shape assertion; nothing new leaves the group). No other path
  u -> v exists (v's only producer is u).

A group containing a model input is a ``placeholder`` (Kahn puts it first) and a group
containing the ``output`` node an ``output`` (last); an input and an output are never merged.

References
----------
Archer et al. 2024, Section 2.1 (one output tensor per op, Eq. 1); contracting
series-parallel chains before partitioning is the coarsening step of multilevel acyclic
partitioners (Herrmann et al., "Multilevel algorithms for acyclic partitioning of directed
acyclic graphs", SIAM J. Sci. Comput. 41(4), 2019).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition.objective import check_objective

__all__ = ["Contraction", "contract_trivial", "trivial_nodes"]


def trivial_nodes(graph: OpGraph, objective: str) -> np.ndarray:
    """Bool array (n,): nodes with zero work under ``objective`` (placeholders excluded)."""
    check_objective(objective, "dag")
    work = np.asarray(graph.work_s(objective))
    is_ph = np.array([op == "placeholder" for op in graph.ops], dtype=bool)
    return (work <= 0.0) & ~is_ph


@dataclass(frozen=True)
class Contraction:
    """A contracted graph and the map back to the original.

    Attributes
    ----------
    graph : OpGraph
        The contracted graph (groups in topological order of their representatives).
    group : int64 array (n,)
        Contracted node of every original node.
    original : OpGraph
    """

    graph: OpGraph
    group: np.ndarray
    original: OpGraph

    @property
    def identity(self) -> bool:
        return self.graph.n == self.original.n

    def expand(self, assignment: np.ndarray) -> np.ndarray:
        """Block of every original node from a block per contracted node, int64 (n,)."""
        a = np.asarray(assignment, dtype=np.int64)
        if a.shape != (self.graph.n,):
            raise InputError(f"assignment must have one block per contracted node ({self.graph.n}), got {a.shape}")
        return a[self.group]

    def order_to_original(self, order: np.ndarray) -> np.ndarray:
        """A topological order of the original graph that lists the groups in ``order``.

        Members of a group keep their relative order in a topological order of the
        original graph.
        """
        from fxpipe.partition.orders import kahn_order  # noqa: PLC0415 (lazy: numba kernels)

        pos = np.empty(self.graph.n, dtype=np.float64)
        pos[np.asarray(order, dtype=np.int64)] = np.arange(self.graph.n)
        base = kahn_order(self.original, np.arange(self.original.n, dtype=np.float64))
        within = np.empty(self.original.n)
        within[base] = np.arange(self.original.n) / max(self.original.n, 1)
        return kahn_order(self.original, pos[self.group] + 0.5 * within)

    def order_from_original(self, order: np.ndarray) -> np.ndarray:
        """A topological order of the contracted graph following an original order."""
        from fxpipe.partition.orders import kahn_order  # noqa: PLC0415 (lazy: numba kernels)

        first = np.full(self.graph.n, np.inf)
        pos = np.empty(self.original.n)
        pos[np.asarray(order, dtype=np.int64)] = np.arange(self.original.n)
        np.minimum.at(first, self.group, pos)
        return kahn_order(self.graph, first)


def _find(parent: np.ndarray, x: int) -> int:
    root = x
    while parent[root] != root:
        root = parent[root]
    while parent[x] != root:
        parent[x], x = root, parent[x]
    return root


def contract_trivial(graph: OpGraph, objective: str = "training") -> Contraction:
    """Merge trivial ops into neighbours (module docstring); exact for Contract 2.

    Parameters
    ----------
    graph : OpGraph
    objective : {"inference", "training"}
        Decides which ops are trivial (zero work).

    Returns
    -------
    Contraction
        ``contraction.graph`` has one node per group; ``expand`` maps assignments back.
    """
    check_objective(objective, "dag")
    n = graph.n
    trivial = trivial_nodes(graph, objective)
    is_ph = np.array([op == "placeholder" for op in graph.ops], dtype=bool)
    is_out = np.array([op == "output" for op in graph.ops], dtype=bool)
    parent = np.arange(n)
    has_ph = is_ph.copy()
    has_out = is_out.copy()
    # the member whose tensor leaves the group (-1: none)
    out_member = np.arange(n)
    nsucc = np.diff(graph.succ_ptr)
    npred = np.diff(graph.pred_ptr)

    def union(keep: int, gone: int, leaving: int) -> bool:
        a, b = _find(parent, keep), _find(parent, gone)
        if a == b or (has_ph[a] or has_ph[b]) and (has_out[a] or has_out[b]):
            return False
        parent[b] = a
        has_ph[a] |= has_ph[b]
        has_out[a] |= has_out[b]
        out_member[a] = leaving
        return True

    from fxpipe.partition.orders import kahn_order  # noqa: PLC0415 (lazy: numba kernels)

    topo = kahn_order(graph, np.arange(n, dtype=np.float64))
    changed = True
    while changed:
        changed = False
        for u in topo.tolist():
            if trivial[u] and nsucc[u] == 1:  # forward
                v = int(graph.succ_idx[graph.succ_ptr[u]])
                gu, gv = _find(parent, u), _find(parent, v)
                # u's tensor must be its group's only leaving tensor (then it becomes internal)
                if gu != gv and out_member[gu] == u and union(gv, gu, int(out_member[gv])):
                    changed = True
                    continue
            if trivial[u] and npred[u] == 1:  # backward
                p = int(graph.pred_idx[graph.pred_ptr[u]])
                gp, gu = _find(parent, p), _find(parent, u)
                if gp == gu:
                    continue
                if nsucc[u] == 0 and out_member[gu] == u:
                    if union(gp, gu, int(out_member[gp])):
                        changed = True
                elif nsucc[p] == 1 and out_member[gp] == p and out_member[gu] == u:
                    if union(gp, gu, u):
                        changed = True
    roots = np.array([_find(parent, v) for v in range(n)], dtype=np.int64)
    uniq, first_pos = np.unique(roots, return_index=True)
    if uniq.shape[0] == n:
        return Contraction(graph=graph, group=np.arange(n, dtype=np.int64), original=graph)
    # number groups by the topological position of their first member
    pos = np.empty(n, dtype=np.int64)
    pos[topo] = np.arange(n)
    first = np.full(n, n, dtype=np.int64)
    np.minimum.at(first, roots, pos)
    order = uniq[np.argsort(first[uniq], kind="stable")]
    gid = np.full(n, -1, dtype=np.int64)
    gid[order] = np.arange(order.shape[0])
    group = gid[roots]
    m = order.shape[0]

    def summed(arr):
        return np.bincount(group, weights=np.asarray(arr, dtype=np.float64), minlength=m)

    size = np.zeros(m)
    leaving = out_member[order]
    size[:] = np.where(leaving >= 0, np.asarray(graph.size_out_bytes)[np.maximum(leaving, 0)], 0.0)
    e = np.asarray(graph.edges, dtype=np.int64).reshape(-1, 2)
    ge = group[e]
    keep = ge[:, 0] != ge[:, 1]
    # an edge leaving a group must come from its leaving member (exactness)
    if keep.any() and not np.all(out_member[roots[e[keep, 0]]] == e[keep, 0]):  # pragma: no cover
        raise AssertionError("contraction left a group with two outgoing tensors (bug)")
    ops = []
    names = []
    for r in order.tolist():
        ops.append("placeholder" if has_ph[r] else ("output" if has_out[r] else "call_function"))
    members_first = np.full(m, -1, dtype=np.int64)
    nontriv_first = np.full(m, -1, dtype=np.int64)
    for v in topo.tolist():
        g = group[v]
        if members_first[g] < 0:
            members_first[g] = v
        if nontriv_first[g] < 0 and not trivial[v]:
            nontriv_first[g] = v
    for g in range(m):
        rep = nontriv_first[g] if nontriv_first[g] >= 0 else members_first[g]
        names.append(graph.names[rep])
    cg = OpGraph.from_arrays(
        t_fwd_s=summed(graph.t_fwd_s), t_bwd_input_s=summed(graph.t_bwd_input_s), t_bwd_weight_s=summed(graph.t_bwd_weight_s),
        size_out_bytes=size, size_param_bytes=summed(graph.size_param_bytes), act_bytes=summed(graph.act_bytes),
        edges=np.unique(ge[keep], axis=0) if keep.any() else [], bandwidth_bytes_per_s=graph.bandwidth_bytes_per_s,
        names=names, ops=ops, name=f"{graph.name} (contracted)",
    )
    return Contraction(graph=cg, group=group, original=graph)
