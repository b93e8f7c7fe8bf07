"""The ``chain`` certificate: the chain-DP lower bound as a :class:`Certificate`.

The bound itself, its proof (Lemmas D, L, S, G of :mod:`fxpipe.partition.chain`) and the
DP live in :mod:`fxpipe.partition.chain`; this module only packages the result for
:func:`fxpipe.partition.bounds.compute_bounds` and ``fxpipe bounds --methods chain``.

Scope: relay communication (Contract 2), both objectives. The bound ignores the memory
capacity, which only removes partitions, so it also holds when a capacity is given. With
``comm="dag"`` the certificate reports Lemma 3.3 with status ``"not_applicable"``.
"""

from __future__ import annotations

import time

from fxpipe.ir import OpGraph
from fxpipe.partition.bounds.certificate import Certificate
from fxpipe.partition.bounds.simple import simple_work_bound
from fxpipe.partition.objective import Partition, check_objective

__all__ = ["chain_certificate"]

#: Where the proof is written down (reported in the certificate).
PROOF = "fxpipe.partition.chain module docstring: Lemmas D (detached nodes), L (lazy views), S (zero sinks), G (gates)"


def chain_certificate(graph: OpGraph, k: int, objective: str = "training", comm: str = "relay") -> tuple[Certificate, Partition | None]:
    """Run the chain DP and return its certificate and its partition.

    Parameters
    ----------
    graph : OpGraph
    k : int
    objective : {"inference", "training"}
    comm : {"dag", "relay"}

    Returns
    -------
    certificate : Certificate
        ``lower_bound`` = max(chain DP bound, Lemma 3.3), seconds; status ``"optimal"`` (the
        DP relaxation is solved exactly, to a relative bisection tolerance of 1e-10) or
        ``"not_applicable"`` for dag communication.
    partition : Partition or None
        The chain partition (relay), blocks in pipeline order, for use as an incumbent.

    Raises
    ------
    InputError
        For an unknown objective/comm or a bad k.
    """
    check_objective(objective, comm)
    t0 = time.perf_counter()
    simple = simple_work_bound(graph.work_s(objective), int(k))
    if comm != "relay":
        return (
            Certificate(
                method="chain", lower_bound=simple, status="not_applicable", wall_time_s=time.perf_counter() - t0,
                details={"reason": "the chain DP needs relay communication; Lemma 3.3 reported instead"},
            ),
            None,
        )
    from fxpipe.partition.chain import solve_chain  # noqa: PLC0415 (lazy: numba kernels)

    res = solve_chain(graph, int(k), objective, comm, partition=True)
    lb = max(res.lower_bound_s, simple)
    details = {
        "chain_dp_bound_s": res.lower_bound_s,
        "relaxed_value_s": res.relaxed_value_s,
        "simple_s": simple,
        "proof": PROOF,
        **res.details,
    }
    if res.partition is not None:
        details["chain_partition_bottleneck_s"] = res.partition.bottleneck
    return (
        Certificate(method="chain", lower_bound=lb, status="optimal", wall_time_s=time.perf_counter() - t0, details=details),
        res.partition,
    )
