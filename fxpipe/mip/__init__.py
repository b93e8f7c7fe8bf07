"""Shared MIP machinery: one SCIP solve wrapper, one status vocabulary, one incumbent handler.

Models are built by pure builder functions elsewhere (:mod:`fxpipe.partition.bounds.models`,
:mod:`fxpipe.schedule.milp.builder`) and solved with :func:`solve_model`, which reports
primal value, dual bound, gap, status (:mod:`fxpipe.mip.status`) and wall time, shows
progress (tqdm) and reports incumbents as they are found (:class:`IncumbentHandler`).
"""

from fxpipe.mip.solve import DEFAULT_PARAMS, IncumbentHandler, ProgressBar, SolveResult, scip_version, solve_model
from fxpipe.mip.status import STATUSES, STOPPED_EARLY, normalize_status

__all__ = [
    "DEFAULT_PARAMS",
    "IncumbentHandler",
    "ProgressBar",
    "STATUSES",
    "STOPPED_EARLY",
    "SolveResult",
    "normalize_status",
    "scip_version",
    "solve_model",
]
