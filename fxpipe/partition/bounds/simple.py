"""The closed-form lower bound of Archer et al. (2024), Lemma 3.3, for Contract 2.

``L = max(max_v work(v), sum_v work(v) / k)`` where ``work`` is ``t_fwd`` (inference) or
``t_fwd + t_bwd_input + t_bwd_weight`` (training).

Soundness for every Contract-2 objective: a block's cost is its work plus a non-negative
io term (``alpha * bytes / B`` with alpha in {1, 2}, in both the dag and the relay model),
so ``f(P_b) >= work(P_b)``. The node with the largest work lies in some block, and the
blocks' works sum to the total, so some block has work at least the average. Hence
``max_b f(P_b) >= L`` for every partition, and in particular for every partition that meets a
memory capacity. No io term is added: a single node's tensors may all stay inside its block,
so any io-based strengthening would need the MIPs. This is the weak, obviously sound version.
"""

from __future__ import annotations

import time

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition.bounds.certificate import Certificate
from fxpipe.partition.objective import check_objective

__all__ = ["simple_work_bound", "simple_bound"]


def simple_work_bound(work_s: np.ndarray, k: int) -> float:
    """Lemma 3.3: ``max(max work, sum work / k)`` for a float array ``work_s`` (n,) in seconds.

    Raises
    ------
    InputError
        If ``k < 1``.

    References
    ----------
    Archer et al. 2024, Lemma 3.3, Eq. (13).
    """
    if k < 1:
        raise InputError(f"k must be >= 1, got {k}")
    w = np.asarray(work_s, dtype=np.float64)
    if w.size == 0:
        return 0.0
    return float(max(w.max(), w.sum() / k))


def simple_bound(graph: OpGraph, k: int, objective: str = "inference", comm: str = "dag") -> Certificate:
    """The Lemma 3.3 bound for ``graph`` as a :class:`Certificate` (status ``"closed_form"``).

    ``comm`` does not change the bound (io is dropped) but is checked.

    References
    ----------
    Archer et al. 2024, Lemma 3.3.
    """
    check_objective(objective, comm)
    t0 = time.perf_counter()
    lb = simple_work_bound(graph.work_s(objective), k)
    return Certificate(method="simple", lower_bound=lb, status="closed_form", wall_time_s=time.perf_counter() - t0)
