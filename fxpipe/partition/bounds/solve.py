"""Moved to :mod:`fxpipe.mip.solve` (the one SCIP solve wrapper shared by the partition
bounds and the schedule MILP); this module re-exports it for existing imports."""

from fxpipe.mip.solve import DEFAULT_PARAMS, SolveResult, scip_version, solve_model

__all__ = ["SolveResult", "solve_model", "scip_version", "DEFAULT_PARAMS"]
