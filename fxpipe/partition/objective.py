"""Contract 2 of DESIGN.md: the partition objective, computed from scratch.

This is the reference implementation every fast kernel and every MIP is checked against.
It is deliberately plain numpy (no numba) and O(n + m) per call.

For a block S and bandwidth B (Archer et al. 2024, Eq. 1 and Eq. 3):

* ``io(S, T) = (1/B) * sum of size_out(u)`` over producers u in S with a consumer in T,
  each tensor counted once however many consumers it has.
* inference: ``f(S) = io(V\\S, S) + sum_{v in S} t_fwd(v) + io(S, V\\S)``.
* training: ``f(S) = 2 * (io(V\\S, S) + io(S, V\\S)) + sum_{v in S} (t_fwd + t_bwd_input + t_bwd_weight)(v)``.
* ``comm="dag"``: a tensor of u in block a is an input of every other block holding one of
  its consumers and an output of block a if any consumer is outside a.
* ``comm="relay"`` (a linear pipeline, blocks numbered in pipeline order): a tensor produced
  in block a whose last consumer is in block c > a is an output of every block a..c-1 and an
  input of every block a+1..c (it passes through the blocks in between).

The objective of a partition is ``max_b f(P_b)`` over k possibly empty blocks whose
quotient graph is acyclic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph

OBJECTIVES = ("inference", "training")
COMM_MODES = ("dag", "relay")


def check_objective(objective: str, comm: str) -> None:
    """Raise :class:`InputError` for an unknown objective or communication mode."""
    if objective not in OBJECTIVES:
        raise InputError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if comm not in COMM_MODES:
        raise InputError(f"comm must be one of {COMM_MODES}, got {comm!r}")


def _check_assignment(graph: OpGraph, assignment: Sequence[int] | np.ndarray, k: int) -> np.ndarray:
    a = np.asarray(assignment)
    if a.shape != (graph.n,):
        raise InputError(f"assignment must have one block per node ({graph.n}), got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise InputError("assignment must contain integer block ids")
    a = a.astype(np.int64)
    if k < 1:
        raise InputError(f"k must be >= 1, got {k}")
    if graph.n and (a.min() < 0 or a.max() >= k):
        raise InputError(f"block ids must lie in 0..{k - 1}, got range {a.min()}..{a.max()}")
    return a


def io_bytes(graph: OpGraph, assignment: Sequence[int] | np.ndarray, k: int, comm: str = "dag",
             producers: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Bytes entering and leaving each block under Contract 2.

    Parameters
    ----------
    graph : OpGraph
    assignment : int array (n,)
        Block of every node, 0..k-1. For ``comm="relay"`` blocks must be in pipeline
        order (every edge goes to the same or a later block).
    k : int
        Number of blocks.
    comm : {"dag", "relay"}
    producers : bool array (n,), optional
        Count only the outputs of these nodes (default all), e.g. those that carry a
        gradient backward (:func:`fxpipe.partition.memory.differentiable`).

    Returns
    -------
    in_bytes, out_bytes : float64 arrays (k,)

    Raises
    ------
    InputError
        On a malformed assignment, or a backward edge in relay mode.
    """
    a = _check_assignment(graph, assignment, k)
    if comm not in COMM_MODES:
        raise InputError(f"comm must be one of {COMM_MODES}, got {comm!r}")
    fast = _io_bytes_arrays(graph, a, k, comm, producers)
    if fast is not None:
        return fast
    in_b = np.zeros(k)
    out_b = np.zeros(k)
    for u in range(graph.n):  # a relay edge to an earlier block: the first one, named in the error
        cons = graph.successors(u)
        if cons.size == 0 or (producers is not None and not producers[u]):
            continue
        bu = a[u]
        cb = np.unique(a[cons])
        others = cb[cb != bu]
        if others.size == 0:
            continue
        size = graph.size_out_bytes[u]
        if comm == "dag":
            in_b[others] += size
            out_b[bu] += size
        elif comm == "relay":
            if cb.min() < bu:
                raise InputError(
                    f"edge {u} -> {int(cons[np.argmin(a[cons])])} goes from block {bu} to an earlier block: "
                    "relay mode needs blocks in pipeline order"
                )
            last = int(cb.max())
            out_b[bu:last] += size
            in_b[bu + 1 : last + 1] += size
        else:
            raise InputError(f"comm must be one of {COMM_MODES}, got {comm!r}")
    return in_b, out_b


def _io_bytes_arrays(graph: OpGraph, a: np.ndarray, k: int, comm: str,
                     producers: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`io_bytes` over the edge arrays (each tensor counted once per block, as there); None when a
    relay edge goes to an earlier block (the loop there names it)."""
    edges = np.asarray(graph.edges, dtype=np.int64).reshape(-1, 2)
    src, dst = edges[:, 0], edges[:, 1]
    if producers is not None:
        keep = np.asarray(producers, dtype=bool)[src]
        src, dst = src[keep], dst[keep]
    size = np.asarray(graph.size_out_bytes, dtype=np.float64)
    bs, bd = a[src], a[dst]
    if comm == "relay":
        if np.any(bd < bs):
            return None
        last = np.full(graph.n, -1, dtype=np.int64)
        np.maximum.at(last, src, bd)
        u = np.flatnonzero(last > a)  # producers with a consumer in a later block
        lo, hi, w = a[u], last[u], size[u]
        d_out = np.zeros(k + 1)
        np.add.at(d_out, lo, w)
        np.add.at(d_out, hi, -w)  # out over blocks lo .. hi-1
        d_in = np.zeros(k + 2)
        np.add.at(d_in, lo + 1, w)
        np.add.at(d_in, hi + 1, -w)  # in over blocks lo+1 .. hi
        return np.cumsum(d_in)[:k], np.cumsum(d_out)[:k]
    other = bd != bs  # dag: every other block a tensor reaches, once; its producer's block sends it once
    pairs = np.unique(np.stack([src[other], bd[other]], axis=1), axis=0) if other.any() else np.zeros((0, 2), np.int64)
    in_b = np.bincount(pairs[:, 1], weights=size[pairs[:, 0]], minlength=k).astype(np.float64)[:k]
    senders = np.unique(pairs[:, 0])
    out_b = np.bincount(a[senders], weights=size[senders], minlength=k).astype(np.float64)[:k]
    return in_b, out_b


def block_costs(
    graph: OpGraph,
    assignment: Sequence[int] | np.ndarray,
    k: int,
    objective: str = "inference",
    comm: str = "dag",
) -> np.ndarray:
    """Cost ``f(P_b)`` of every block under Contract 2 (seconds), float64 array (k,).

    Source: Archer et al. 2024, Eq. 1 and Eq. 3 (inference); the training and relay
    variants are DESIGN.md Contract 2.

    Raises
    ------
    InputError
        On an unknown objective/comm or a malformed assignment.
    """
    check_objective(objective, comm)
    a = _check_assignment(graph, assignment, k)
    in_b, out_b = io_bytes(graph, a, k, comm)
    work = np.bincount(a, weights=graph.work_s(objective), minlength=k)
    io_s = (in_b + out_b) / graph.bandwidth_bytes_per_s
    return work + (2.0 if objective == "training" else 1.0) * io_s


def quotient_order(graph: OpGraph, assignment: Sequence[int] | np.ndarray, k: int) -> list[int] | None:
    """A topological order of the quotient graph's blocks, or ``None`` if it has a cycle."""
    a = _check_assignment(graph, assignment, k)
    if graph.m == 0:
        return list(range(k))
    src, dst = a[graph.edges[:, 0]], a[graph.edges[:, 1]]
    mask = src != dst
    qe = set(zip(src[mask].tolist(), dst[mask].tolist()))
    indeg = [0] * k
    succ: list[list[int]] = [[] for _ in range(k)]
    for u, v in qe:
        succ[u].append(v)
        indeg[v] += 1
    ready = sorted(b for b in range(k) if indeg[b] == 0)
    order = []
    while ready:
        b = ready.pop(0)
        order.append(b)
        for c in sorted(succ[b]):
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
        ready.sort()
    return order if len(order) == k else None


@dataclass(frozen=True, eq=False)
class Partition:
    """A partition of an OpGraph into k pipeline blocks (stages).

    Attributes
    ----------
    k : int
        Number of blocks (some may be empty).
    assignment : int64 array (n,)
        Block of each node; blocks are numbered in pipeline order (every edge goes from a
        block to the same or a later one).
    block_costs : float64 array (k,)
        Contract-2 cost of each block, seconds.
    bottleneck : float
        ``max(block_costs)``: the objective.
    objective, comm : str
        Which Contract-2 objective the costs are for.
    order : int64 array (n,) or None
        The topological order the partition was sliced from, if any.
    meta : dict
        How it was found (method, evaluations, time, seed, ...).
    """

    k: int
    assignment: np.ndarray
    block_costs: np.ndarray
    bottleneck: float
    objective: str = "inference"
    comm: str = "dag"
    order: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_assignment(
        cls,
        graph: OpGraph,
        assignment: Sequence[int] | np.ndarray,
        k: int,
        objective: str = "inference",
        comm: str = "dag",
        *,
        order: np.ndarray | None = None,
        meta: dict | None = None,
    ) -> "Partition":
        """Score an assignment from scratch and renumber its blocks into pipeline order.

        Empty blocks are placed last. Raises :class:`InputError` if the quotient graph is
        cyclic (no pipeline order exists) or the assignment is malformed.
        """
        a = _check_assignment(graph, assignment, k)
        qo = quotient_order(graph, a, k)
        if qo is None:
            raise InputError("the partition's quotient graph has a cycle: blocks cannot form a pipeline")
        used = set(a.tolist())
        ranked = [b for b in qo if b in used] + [b for b in qo if b not in used]
        remap = np.empty(k, dtype=np.int64)
        remap[ranked] = np.arange(k)
        a2 = remap[a]
        costs = block_costs(graph, a2, k, objective, comm)
        return cls(
            k=k,
            assignment=a2,
            block_costs=costs,
            bottleneck=float(costs.max()),
            objective=objective,
            comm=comm,
            order=None if order is None else np.asarray(order, dtype=np.int64),
            meta=dict(meta or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of Contract 4 (``fxpipe partition --json``)."""
        return {
            "k": self.k,
            "objective": self.objective,
            "comm": self.comm,
            "assignment": self.assignment.tolist(),
            "block_costs": self.block_costs.tolist(),
            "bottleneck": self.bottleneck,
            "meta": self.meta,
        }


def validate_partition(
    graph: OpGraph,
    partition: Partition,
    *,
    rtol: float = 1e-9,
) -> None:
    """Independent check of a partition: Contract 2 and 4 invariants.

    Checks that every node is in exactly one block 0..k-1, that every edge goes from a block
    to the same or a later one (so the quotient graph is acyclic and the numbering is a
    pipeline order), and that the block costs recomputed from scratch equal the stored ones.

    Raises
    ------
    AssertionError
        With a message naming the violated rule (a bug, not bad user input).
    """
    a = np.asarray(partition.assignment)
    if not (a.shape == (graph.n,)):
        raise AssertionError(f"assignment has shape {a.shape}, expected ({graph.n},)")
    if not (a.min() >= 0 and a.max() < partition.k):
        raise AssertionError("block id outside 0..k-1")
    if graph.m:
        bu, bv = a[graph.edges[:, 0]], a[graph.edges[:, 1]]
        bad = np.flatnonzero(bu > bv)
        if not (bad.size == 0):
            raise AssertionError(f"edge {graph.edges[bad[0]].tolist()} goes from block {bu[bad[0]]} back to {bv[bad[0]]}")
    if not (quotient_order(graph, a, partition.k) is not None):
        raise AssertionError("quotient graph is cyclic")
    costs = block_costs(graph, a, partition.k, partition.objective, partition.comm)
    np.testing.assert_allclose(partition.block_costs, costs, rtol=rtol, atol=1e-15, err_msg="stored block costs differ from recomputation")
    if not (abs(partition.bottleneck - costs.max()) <= rtol * max(1.0, abs(costs.max())) + 1e-15):
        raise AssertionError("bottleneck != max block cost")
