"""The one status vocabulary of fxpipe's solver results (bounds, schedules, certificates).

SCIP's own status names are kept where they exist, so a certificate reads like SCIP's log;
SCIP's several node and solution limits are folded into one name each, and two statuses
describe results that no MIP proved:

===============  =====================================================================
``optimal``      solved to optimality (the dual bound meets the incumbent)
``timelimit``    stopped at the time limit: best incumbent and the proven dual bound
``gaplimit``     stopped at the requested relative gap
``nodelimit``    stopped at a node limit (SCIP ``nodelimit``, ``totalnodelimit``, ``stallnodelimit``)
``sollimit``     stopped at a solution limit (SCIP ``sollimit``, ``bestsollimit``)
``memlimit``     stopped at SCIP's memory limit
``userinterrupt`` stopped by Ctrl-C (SCIP's name): best result so far
``infeasible``   the model has no solution
``feasible``     a valid solution without a finished proof that is not a solver limit (e.g. a
                 schedule MILP that fell back to its warm start)
``heuristic``    a schedule from a heuristic, not from a solver
``cached``       a schedule replayed from the schedule cache
===============  =====================================================================
"""

from __future__ import annotations

__all__ = ["STATUSES", "STOPPED_EARLY", "normalize_status"]

STATUSES = (
    "optimal", "timelimit", "gaplimit", "nodelimit", "sollimit", "memlimit", "userinterrupt", "infeasible",
    "feasible", "heuristic", "cached",
)
#: Statuses of a solve that ended before its proof finished (the bound is still valid).
STOPPED_EARLY = ("timelimit", "gaplimit", "nodelimit", "sollimit", "memlimit", "userinterrupt")

_SCIP = {
    "optimal": "optimal",
    "timelimit": "timelimit",
    "gaplimit": "gaplimit",
    "nodelimit": "nodelimit",
    "totalnodelimit": "nodelimit",
    "stallnodelimit": "nodelimit",
    "sollimit": "sollimit",
    "bestsollimit": "sollimit",
    "memlimit": "memlimit",
    "userinterrupt": "userinterrupt",
    "infeasible": "infeasible",
}


def normalize_status(scip_status: str) -> str:
    """fxpipe's name (:data:`STATUSES`) for a SCIP status string.

    Returns ``"unknown:<status>"`` for a status SCIP should not end a solve with
    (``unbounded``, ``inforunbd``, ``unknown``): the caller treats it as a failure.
    """
    return _SCIP.get(str(scip_status), f"unknown:{scip_status}")
