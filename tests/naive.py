"""Brute-force oracles for tiny instances (plain Python, no numba, no solver).

Everything clever in fxpipe is tested against these.
"""

from __future__ import annotations

import itertools

import numpy as np

from fxpipe.ir import OpGraph
from fxpipe.partition.objective import block_costs


def brute_force_partition(graph: OpGraph, k: int, objective: str = "inference", comm: str = "dag"):
    """Optimal bottleneck over all acyclic partitions into at most k blocks.

    Enumerates every monotone assignment (each edge goes to the same or a later block):
    every acyclic partition has such a numbering (a topological order of its quotient
    graph), so this covers all of them. O(k^n): use n <= 9.

    Returns
    -------
    (bottleneck, assignment)
    """
    n = graph.n
    edges = graph.edges.tolist()
    best = (np.inf, None)
    for assign in itertools.product(range(k), repeat=n):
        if any(assign[u] > assign[v] for u, v in edges):
            continue
        cost = block_costs(graph, np.array(assign), k, objective, comm).max()
        if cost < best[0] - 1e-15:
            best = (float(cost), np.array(assign))
    return best
