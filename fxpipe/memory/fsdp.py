"""Per-block FSDP2 units: which parameters a stage holds unsharded during the step (torch-free).

With ``dp_shard > 1`` and :attr:`fxpipe.memory.MemoryModel.fsdp_units` ``== "block"`` every repeated
block of a stage (:func:`fxpipe.memory.checkpoint.find_blocks`, the one home of "block") is its own FSDP2
unit and the stage's ops outside every block form its root unit, as torchtitan wraps a model
(``fully_shard`` on every transformer block, then on the root). FSDP2 (Zhao et al., "PyTorch FSDP:
Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023, Sec. 3.2.2 and 4.2) all-gathers a unit
just before it computes, prefetches the next one (forward: the next block; backward: the previous
one) and frees the unsharded copy after the unit's forward and again after its backward; a block's
unsharded gradients live from its backward until their reduce-scatter, which overlaps the next
block's backward. So at any moment a stage holds unsharded:

* its root unit's parameters (torchtitan's root stays unsharded from the forward through the
  backward) and their gradients;
* the parameters of at most two blocks (the one computing and the one prefetched) and, in the
  backward, the gradients of at most two blocks (the one computing and the one being reduced).

:func:`unsharded_params` counts the parameters of that set per stage: the root's, plus the two
largest of the stage's blocks (a block split between two stages is one unit on each). The memory
model (:meth:`fxpipe.memory.MemoryModel.static_bytes`) adds their full weights and gradients to the
sharded state (ZeRO-3: weights, gradients and optimizer state divided by ``dp_shard``; FSDP2 keeps
the sharded copy while the unit is unsharded). What this assumes: gradients are reduce-scattered
after every micro-batch's backward (no deferred gradient sync, which would keep every block's
unsharded gradients for the step) and blocks are resharded after their backward.

The partitioner sums per node, so :func:`additive_unsharded` gives it an upper bound of the same
set: the root's parameters per node and, per stage, twice the graph's largest block.
"""

from __future__ import annotations

import numpy as np

from fxpipe.errors import InputError

__all__ = ["block_units", "unsharded_params", "additive_unsharded"]

#: block_units per graph object (the mesh search asks for every candidate).
_UNITS: dict[int, tuple] = {}


def block_units(graph) -> np.ndarray:
    """FSDP2 unit of every node of ``graph`` with per-block units: its block
    (:func:`fxpipe.memory.checkpoint.find_blocks`), ``-1`` for the root unit (int64 (n,))."""
    hit = _UNITS.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    from fxpipe.memory.checkpoint import find_blocks  # noqa: PLC0415 - torch-free, imported where needed

    out = np.asarray(find_blocks(graph).block_of, dtype=np.int64)
    if len(_UNITS) > 8:
        _UNITS.clear()
    _UNITS[id(graph)] = (graph, out)  # the graph object is kept: its id stays its own
    return out


def unsharded_params(graph, assignment, k: int, params) -> np.ndarray:
    """Parameters each of ``k`` stages holds unsharded at its peak under per-block units, float64 (k,).

    Parameters
    ----------
    graph : OpGraph
        Its blocks (:func:`block_units`).
    assignment : int array (n,)
        Stage of every node.
    k : int
        Stages.
    params : float array (n,)
        Parameters of every node (:func:`fxpipe.partition.memory.num_params`).

    Returns
    -------
    float64 array (k,)
        The stage's root parameters (nodes outside every block) plus its two largest blocks' (the
        module docstring). A stage without blocks holds everything unsharded, as one unit.
    """
    a = np.asarray(assignment, dtype=np.int64)
    p = np.asarray(params, dtype=np.float64)
    if a.shape != p.shape or a.shape[0] != graph.n:
        raise InputError(f"assignment and params must have one entry per node ({graph.n}), got {a.shape} and {p.shape}")
    unit = block_units(graph)
    root = unit < 0
    out = np.bincount(a[root], weights=p[root], minlength=int(k)).astype(np.float64)
    if not root.all():
        nb = int(unit.max()) + 1
        per = np.zeros((int(k), nb))
        np.add.at(per, (a[~root], unit[~root]), p[~root])
        top = np.sort(per, axis=1)[:, -2:]
        out += top.sum(axis=1)
    return out


def additive_unsharded(graph, params) -> tuple[np.ndarray, float]:
    """An upper bound of :func:`unsharded_params` that sums per node: ``(per_node float64 (n,), per_stage)``.

    ``per_node`` is a node's parameters when it is in the root unit (0 in a block), ``per_stage`` twice the
    parameters of the graph's largest block: for any stage, its root nodes' sum plus ``per_stage`` is at
    least what :func:`unsharded_params` counts (its two largest blocks hold at most two of the largest).
    """
    p = np.asarray(params, dtype=np.float64)
    unit = block_units(graph)
    root = unit < 0
    per_node = np.where(root, p, 0.0)
    if root.all():
        return per_node, 0.0
    largest = float(np.bincount(unit[~root], weights=p[~root]).max())
    return per_node, 2.0 * largest
