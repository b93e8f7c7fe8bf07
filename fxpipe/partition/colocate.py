"""Keep tensors whose size depends on the data inside one pipeline stage.

An op such as ``x[mask]`` (boolean-mask indexing), ``nonzero``, ``unique`` or
``masked_select`` produces a tensor whose size is only known at run time (torch.export gives
it an *unbacked* symbolic size such as ``u0``). The pipeline runtime sizes every receive buffer
from the example micro-batch, so such a tensor must never cross a stage boundary. The capture
marks these ops in the OpGraph (``graph.extra[i]["data_dependent"]``, read by
:attr:`fxpipe.ir.OpGraph.data_dependent`; ``extra[i]["source"]`` holds the user's source
line), and the partitioner honours the constraint

    stage(u) == stage(v) for every edge (u, v) whose producer u is data dependent

by contracting: the edges are unioned into groups, and every node on a path between two
members of a group joins it (a monotone pipeline assignment that is constant on a group is
constant on such a node too: the quotient graph's strongly connected components are merged).
The search runs on the contracted graph and the assignment is expanded, so every stage
boundary carries fixed-size tensors only.

Exactness (Contract 2). A group whose only tensor leaving it is one member's output is an
OpGraph node with one output tensor: the cost of a partition of the contracted graph equals
the cost of the expanded partition, so the contracted problem *is* the constrained problem
and every lower bound computed on the contracted graph (Lemma 3.3, the chain DP) is a valid
lower bound of the constrained problem (it may exceed the unconstrained optimum). A group with
several leaving tensors is given their summed size, sent to the farthest consumer of any of
them: a partition's contracted cost is then >= its true cost (the search may rank
partitions slightly pessimistically; results are re-scored on the original graph), and only
work-based bounds of the contracted graph stay valid (``Contraction`` ``exact=False``).
A bound computed on the original graph ignoring the constraint is always a valid, possibly
weaker, lower bound of the constrained problem (a relaxation).

Torch-free: plain arrays and flags.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxpipe.errors import DataDependentCutError, InputError
from fxpipe.ir import OpGraph
from fxpipe.partition.contract import Contraction, _find  # one union-find for both contractions

__all__ = [
    "ColocatedContraction",
    "forbidden_cut_edges",
    "colocation_groups",
    "contract_colocated",
    "crossing_forbidden_edges",
    "check_no_forbidden_cuts",
    "describe_node",
]


def forbidden_cut_edges(graph: OpGraph) -> np.ndarray:
    """Bool array (m,): edges whose producer has a data-dependent size (may not be cut)."""
    dd = graph.data_dependent
    e = np.asarray(graph.edges, dtype=np.int64).reshape(-1, 2)
    if not dd.any() or e.shape[0] == 0:
        return np.zeros(e.shape[0], dtype=bool)
    return dd[e[:, 0]]


def colocation_groups(graph: OpGraph, forbidden: np.ndarray | None = None) -> np.ndarray | None:
    """Group of every node such that a pipeline assignment honouring the forbidden cuts is
    constant on each group, and every assignment constant on the groups (and monotone) honours them.

    Parameters
    ----------
    graph : OpGraph
    forbidden : bool array (m,), optional
        Edges that may not be cut (default :func:`forbidden_cut_edges`).

    Returns
    -------
    int64 array (n,) or None
        Group ids ``0..g-1`` numbered in a topological order of the (acyclic) quotient graph;
        None when no edge is forbidden.
    """
    e = np.asarray(graph.edges, dtype=np.int64).reshape(-1, 2)
    f = forbidden_cut_edges(graph) if forbidden is None else np.asarray(forbidden, dtype=bool)
    if f.shape != (e.shape[0],):
        raise InputError(f"forbidden must have one flag per edge ({e.shape[0]}), got {f.shape}")
    if not f.any():
        return None
    n = graph.n
    parent = np.arange(n)
    for u, v in e[f].tolist():
        a, b = _find(parent, u), _find(parent, v)
        if a != b:
            parent[b] = a
    roots = np.array([_find(parent, v) for v in range(n)], dtype=np.int64)
    # merge the strongly connected components of the quotient graph (nodes between members)
    import networkx as nx  # noqa: PLC0415

    q = nx.DiGraph()
    q.add_nodes_from(np.unique(roots).tolist())
    qe = roots[e]
    qe = qe[qe[:, 0] != qe[:, 1]]
    q.add_edges_from(map(tuple, np.unique(qe, axis=0).tolist()) if qe.size else [])
    comp = {}
    for c, members in enumerate(nx.strongly_connected_components(q)):
        for r in members:
            comp[r] = c
    raw = np.array([comp[r] for r in roots.tolist()], dtype=np.int64)
    # number groups in a topological order of the condensation (ties: smallest member id)
    cq = nx.DiGraph()
    cq.add_nodes_from(range(len(set(comp.values()))))
    ce = raw[e]
    ce = ce[ce[:, 0] != ce[:, 1]]
    cq.add_edges_from(map(tuple, np.unique(ce, axis=0).tolist()) if ce.size else [])
    first = np.full(cq.number_of_nodes(), n, dtype=np.int64)
    np.minimum.at(first, raw, np.arange(n))
    order = list(nx.lexicographical_topological_sort(cq, key=lambda c: int(first[c])))
    gid = np.empty(len(order), dtype=np.int64)
    gid[order] = np.arange(len(order))
    return gid[raw]


@dataclass(frozen=True)
class ColocatedContraction(Contraction):
    """A :class:`~fxpipe.partition.contract.Contraction` whose groups must share a stage.

    Attributes
    ----------
    exact : bool
        Every group has at most one tensor leaving it (the contracted Contract-2 cost equals the
        expanded one; module docstring). False: summed leaving sizes, an upper bound of the cost.
    """

    exact: bool = True


def contract_colocated(graph: OpGraph, forbidden: np.ndarray | None = None) -> ColocatedContraction | None:
    """Contract the :func:`colocation_groups` into single nodes (module docstring).

    Returns
    -------
    ColocatedContraction or None
        None when no edge is forbidden (nothing to contract). The contracted graph carries no
        data-dependent flags (its edges may all be cut).
    """
    group = colocation_groups(graph, forbidden)
    if group is None:
        return None
    n = graph.n
    g = int(group.max()) + 1
    e = np.asarray(graph.edges, dtype=np.int64).reshape(-1, 2)
    ge = group[e]
    leaves = ge[:, 0] != ge[:, 1]
    # members whose tensor leaves their group
    leaving = np.zeros(n, dtype=bool)
    leaving[e[leaves, 0]] = True
    size_out = np.asarray(graph.size_out_bytes, dtype=np.float64)
    size = np.bincount(group, weights=np.where(leaving, size_out, 0.0), minlength=g)
    nleave = np.bincount(group, weights=leaving.astype(np.float64), minlength=g)
    exact = bool((nleave <= 1).all())
    # a group with no leaving tensor keeps the size of its last member (as an OpGraph sink)
    is_ph = np.array([op == "placeholder" for op in graph.ops], dtype=bool)
    is_out = np.array([op == "output" for op in graph.ops], dtype=bool)
    has_ph = np.bincount(group, weights=is_ph.astype(np.float64), minlength=g) > 0
    has_out = np.bincount(group, weights=is_out.astype(np.float64), minlength=g) > 0
    ops, names = [], []
    work = np.asarray(graph.t_train_s)
    rep = np.full(g, -1, dtype=np.int64)
    for v in range(n):  # the first member with work names the group (else the first member)
        gv = group[v]
        if rep[gv] < 0 or (work[rep[gv]] <= 0.0 < work[v]):
            rep[gv] = v
    for c in range(g):
        ops.append("output" if has_out[c] else ("placeholder" if has_ph[c] else "call_function"))
        names.append(graph.names[int(rep[c])])

    def summed(arr):
        return np.bincount(group, weights=np.asarray(arr, dtype=np.float64), minlength=g)

    cg = OpGraph.from_arrays(
        t_fwd_s=summed(graph.t_fwd_s), t_bwd_input_s=summed(graph.t_bwd_input_s), t_bwd_weight_s=summed(graph.t_bwd_weight_s),
        size_out_bytes=size, size_param_bytes=summed(graph.size_param_bytes), act_bytes=summed(graph.act_bytes),
        edges=np.unique(ge[leaves], axis=0) if leaves.any() else [], bandwidth_bytes_per_s=graph.bandwidth_bytes_per_s,
        names=names, ops=ops, name=f"{graph.name} (data-dependent sizes colocated)",
    )
    return ColocatedContraction(graph=cg, group=group, original=graph, exact=exact)


def crossing_forbidden_edges(graph: OpGraph, assignment: np.ndarray) -> np.ndarray:
    """Indices into ``graph.edges`` of the forbidden edges (:func:`forbidden_cut_edges`) whose
    two ends are on different stages under ``assignment`` (int array (n,)), int64."""
    a = np.asarray(assignment, dtype=np.int64)
    if a.shape != (graph.n,):
        raise InputError(f"assignment must have one stage per node ({graph.n}), got {a.shape}")
    f = forbidden_cut_edges(graph)
    if not f.any():
        return np.zeros(0, dtype=np.int64)
    e = np.asarray(graph.edges, dtype=np.int64).reshape(-1, 2)
    return np.flatnonzero(f & (a[e[:, 0]] != a[e[:, 1]]))


def describe_node(graph: OpGraph, v: int) -> str:
    """``'index' (aten.index.Tensor) at File "model.py", line 30: sel = h[mask]'`` for error messages."""
    ex = graph.extra[v] if graph.extra else {}
    text = repr(graph.names[v])
    if ex.get("target"):
        text += f" ({ex['target']})"
    if ex.get("source"):
        text += f" at {ex['source']}"
    return text


def check_no_forbidden_cuts(graph: OpGraph, assignment: np.ndarray, *, what: str = "the partition") -> None:
    """Raise when a data-dependent-size tensor would cross a stage boundary.

    Parameters
    ----------
    graph : OpGraph
    assignment : int array (n,)
        Stage of every node.
    what : str
        Names the assignment in the message.

    Raises
    ------
    DataDependentCutError
        Naming the op whose output size depends on the data, the user's source line, the two
        stages and what to do.
    """
    bad = crossing_forbidden_edges(graph, assignment)
    if bad.size == 0:
        return
    a = np.asarray(assignment, dtype=np.int64)
    e = np.asarray(graph.edges, dtype=np.int64).reshape(-1, 2)
    seen: dict[int, list[int]] = {}
    for i in bad.tolist():
        seen.setdefault(int(e[i, 0]), []).append(int(e[i, 1]))
    parts = []
    for u, vs in list(seen.items())[:3]:
        parts.append(f"{describe_node(graph, u)} on stage {a[u]} is consumed by "
                     + ", ".join(f"{graph.names[v]!r} on stage {a[v]}" for v in vs[:3]))
    more = f" (and {len(seen) - 3} more)" if len(seen) > 3 else ""
    raise DataDependentCutError(
        f"{what} puts a stage boundary on a tensor whose size depends on the data: " + "; ".join(parts) + more
        + ". The pipeline runtime sizes receive buffers from the example micro-batch, so such a tensor cannot "
        "cross stages. What to do: keep the op and its consumers on one stage (let fxpipe choose the partition, "
        "or move the pinned boundary), use fewer stages, or make the size static (e.g. torch.where(mask, x, 0) "
        "or masked arithmetic instead of x[mask] / nonzero / unique)."
    )
