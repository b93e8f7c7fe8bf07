"""Solving a built bound model with SCIP and reading the result (no model building here).

SCIP settings, chosen by measurement (``python benchmarks/bench_bounds.py --settings
--graphs bert24,gnmt,resnet50 --ks 4,8 --time-limit 60``; geometric mean of wall seconds over
the six instances, all solved to optimality; machine shared, timings noisy):

=====================  =======  ========  ===============  =========  ========
MIP                    default  heur off  emph optimality  sepa fast  sepa off
=====================  =======  ========  ===============  =========  ========
exact (warm-started)   0.24     6.61      0.26             0.26       0.33
bottleneck             0.71     0.66      2.66             0.52       0.54
=====================  =======  ========  ===============  =========  ========

* exact: SCIP's defaults. Turning the primal heuristics off after the MIP start (the
  obvious idea) is 25x slower: the heuristics improve the BRKGA incumbent to the optimum
  quickly and the optimum closes the tree; emphasis "optimality" gains nothing.
* bottleneck and guess (three-superblock MIPs): cutting planes ``FAST``. On tiny graphs
  the default aggregation (c-MIR) separator spends ~1 s at the root of a 20-variable model
  (``FAST``: 0.18 s, same optimum); on the layer graphs ``FAST`` is as fast or faster.
* always: one thread, output hidden, a fixed random seed (reproducible certificates),
  presolving on.
* ``limits/time`` is the method's time budget; on a time-out the best dual bound reached is
  returned with status ``"timelimit"``. Ctrl-C inside SCIP stops the solve and returns the
  best bound so far (status ``"userinterrupt"``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import pyscipopt as scip

from fxpipe.errors import SolverError

__all__ = ["SolveResult", "solve_model", "scip_version", "DEFAULT_PARAMS"]

#: SCIP parameters every bound solve uses (``limits/time`` is added per call).
DEFAULT_PARAMS: dict[str, Any] = {
    "parallel/maxnthreads": 1,
    "randomization/randomseedshift": 0,
    "display/verblevel": 0,
}


def scip_version() -> str:
    """Version of the SCIP library inside PySCIPOpt, e.g. ``"10.0"`` (with PySCIPOpt's)."""
    m = scip.Model()
    m.hideOutput(True)
    return f"SCIP {m.version()} (PySCIPOpt {scip.__version__})"


@dataclass
class SolveResult:
    """What one SCIP solve produced.

    Attributes
    ----------
    status : str
        SCIP status (``"optimal"``, ``"timelimit"``, ``"infeasible"``, ``"userinterrupt"``, ...).
    primal : float
        Objective of the incumbent in model units (``inf`` if none).
    dual : float
        Best dual bound in model units (``inf`` if infeasible).
    gap : float
        ``(primal - dual) / primal`` (``inf`` without an incumbent).
    nodes : int
        Branch-and-bound nodes.
    wall_s : float
        Wall time of the solve, seconds.
    values : dict[str, float]
        Incumbent value of every variable whose name is asked for (empty if none).
    params : dict
        The SCIP parameters that were set.
    """

    status: str
    primal: float
    dual: float
    gap: float
    nodes: int
    wall_s: float
    values: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)


def _finite(x: float) -> float:
    return x if math.isfinite(x) and abs(x) < 1e19 else (math.inf if x > 0 else -math.inf)


def solve_model(
    model: scip.Model,
    *,
    time_limit_s: float,
    params: Mapping[str, Any] | None = None,
    warm_start: Mapping[str, float] | None = None,
    read_vars: Mapping[Any, Any] | None = None,
    heuristics: str = "default",
    emphasis: str | None = None,
    separating: str = "default",
) -> SolveResult:
    """Solve ``model`` under a time limit and read the incumbent and the dual bound.

    Parameters
    ----------
    model : pyscipopt.Model
        A freshly built model (consumed: solved in place).
    time_limit_s : float
        Wall-clock limit (> 0), seconds.
    params : mapping, optional
        Extra SCIP parameters (override :data:`DEFAULT_PARAMS`).
    warm_start : mapping name -> value, optional
        A complete MIP start (variable name to value), e.g. from
        :func:`fxpipe.partition.bounds.models.warm_start_values`.
    read_vars : mapping key -> Var, optional
        Variables whose incumbent values are returned in ``values`` under their keys.
    heuristics : {"default", "fast", "aggressive", "off"}
        SCIP primal-heuristic setting.
    emphasis : {None, "optimality", "feasibility", "easycip", "hardlp"}
        SCIP emphasis setting (None: SCIP's default).
    separating : {"default", "fast", "aggressive", "off"}
        SCIP cutting-plane setting.

    Returns
    -------
    SolveResult

    Raises
    ------
    SolverError
        If SCIP fails other than by a limit, an interrupt or infeasibility.
    """
    if not time_limit_s > 0:
        raise SolverError(f"time limit must be > 0 seconds, got {time_limit_s}")
    used = dict(DEFAULT_PARAMS)
    used.update(params or {})
    used["limits/time"] = float(time_limit_s)
    for key, val in used.items():
        model.setParam(key, val)
    settings = {"fast": scip.SCIP_PARAMSETTING.FAST, "aggressive": scip.SCIP_PARAMSETTING.AGGRESSIVE, "off": scip.SCIP_PARAMSETTING.OFF}
    if heuristics != "default":
        if heuristics not in settings:
            raise SolverError(f"heuristics must be one of default, {', '.join(settings)}; got {heuristics!r}")
        model.setHeuristics(settings[heuristics])
    used["heuristics"] = heuristics
    if separating != "default":
        if separating not in settings:
            raise SolverError(f"separating must be one of default, {', '.join(settings)}; got {separating!r}")
        model.setSeparating(settings[separating])
    used["separating"] = separating
    if emphasis is not None:
        emph = {
            "optimality": scip.SCIP_PARAMEMPHASIS.OPTIMALITY,
            "feasibility": scip.SCIP_PARAMEMPHASIS.FEASIBILITY,
            "easycip": scip.SCIP_PARAMEMPHASIS.EASYCIP,
            "hardlp": scip.SCIP_PARAMEMPHASIS.HARDLP,
        }
        if emphasis not in emph:
            raise SolverError(f"emphasis must be one of {', '.join(emph)}; got {emphasis!r}")
        model.setEmphasis(emph[emphasis])
        used["emphasis"] = emphasis
    if warm_start:
        sol = model.createPartialSol()
        byname = {v.name: v for v in model.getVars()}
        for name, val in warm_start.items():
            var = byname.get(name)
            if var is not None:
                model.setSolVal(sol, var, float(val))
        model.addSol(sol)
    t0 = time.perf_counter()
    try:
        model.optimize()
    except Exception as exc:  # pragma: no cover (SCIP internal failure)
        raise SolverError(f"SCIP failed while solving {model.getProbName()!r}: {exc}") from None
    wall = time.perf_counter() - t0
    status = model.getStatus()
    nsols = model.getNSols()
    primal = _finite(model.getObjVal()) if nsols > 0 else math.inf
    if status == "infeasible":
        dual = math.inf
    else:
        dual = _finite(model.getDualbound())
        if nsols > 0:
            dual = min(dual, primal)
    if status not in ("optimal", "timelimit", "infeasible", "userinterrupt", "gaplimit", "nodelimit", "memlimit", "sollimit", "bestsollimit", "stallnodelimit", "totalnodelimit"):
        raise SolverError(f"SCIP ended {model.getProbName()!r} with status {status!r}; the model may be malformed")
    if math.isfinite(primal) and math.isfinite(dual):
        gap = (primal - dual) / abs(primal) if primal else 0.0
    else:
        gap = math.inf if status != "infeasible" else math.nan
    values: dict = {}
    if read_vars and nsols > 0:
        best = model.getBestSol()
        for key, var in read_vars.items():
            values[key] = model.getSolVal(best, var)
    return SolveResult(
        status=status,
        primal=primal,
        dual=dual,
        gap=max(gap, 0.0) if math.isfinite(gap) else gap,
        nodes=int(model.getNNodes()),
        wall_s=wall,
        values=values,
        params=used,
    )
