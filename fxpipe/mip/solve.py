"""The one SCIP solve wrapper: settings, warm start, incumbent events, progress, result.

Every MIP of fxpipe (the partition lower bounds of :mod:`fxpipe.partition.bounds` and the
schedule MILP of :mod:`fxpipe.schedule.milp`) is built by a pure builder function and solved
here; :func:`solve_model` returns a :class:`SolveResult` with primal value, dual bound, gap,
status (the vocabulary of :mod:`fxpipe.mip.status`) and wall time. A solver that runs out
of time returns its best solution with its proven bound and status ``timelimit``; Ctrl-C
stops the solve and returns the best so far (``userinterrupt``).

SCIP settings for the partition bounds, chosen by measurement (``python
benchmarks/bench_bounds.py --settings --graphs bert24,gnmt,resnet50 --ks 4,8 --time-limit
60``; geometric mean of wall seconds over the six instances, all solved to optimality;
machine shared, timings noisy):

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
* the schedule MILP: presolving ``FAST`` and, on models with more than 500 binaries,
  heuristics ``AGGRESSIVE`` with separation ``OFF`` (see :mod:`fxpipe.schedule.milp.solve`).
* always: one thread, output hidden, a fixed random seed (reproducible results).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import pyscipopt as scip

from fxpipe.errors import SolverError
from fxpipe.mip.status import normalize_status
from fxpipe.progress import Search, stop_all

__all__ = ["SolveResult", "solve_model", "scip_version", "DEFAULT_PARAMS", "IncumbentHandler", "ProgressBar"]

#: SCIP parameters every solve uses (``limits/time`` is added per call).
DEFAULT_PARAMS: dict[str, Any] = {
    "parallel/maxnthreads": 1,
    "randomization/randomseedshift": 0,
    "display/verblevel": 0,
}

_SETTINGS = {"fast": scip.SCIP_PARAMSETTING.FAST, "aggressive": scip.SCIP_PARAMSETTING.AGGRESSIVE,
             "off": scip.SCIP_PARAMSETTING.OFF}


def scip_version() -> str:
    """Version of the SCIP library inside PySCIPOpt, e.g. ``"SCIP 10.0 (PySCIPOpt 6.3.0)"``."""
    m = scip.Model()
    m.hideOutput(True)
    return f"SCIP {m.version()} (PySCIPOpt {scip.__version__})"


@dataclass
class SolveResult:
    """What one SCIP solve produced.

    Attributes
    ----------
    status : str
        fxpipe's status (:mod:`fxpipe.mip.status`): ``"optimal"``, ``"timelimit"``,
        ``"infeasible"``, ``"userinterrupt"``, ...
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
    values : dict
        Incumbent value of every variable asked for in ``read_vars`` (empty if none).
    params : dict
        The SCIP parameters and settings that were used.
    raw_status : str
        SCIP's own status string.
    n_solutions : int
        Solutions SCIP found (including an accepted warm start).
    warm_start_accepted : bool or None
        Whether a complete warm start was feasible and handed to SCIP (None: none given).
    callback_errors : list of str
        Exceptions the ``on_incumbent`` callback raised (they do not stop the solve).
    """

    status: str
    primal: float
    dual: float
    gap: float
    nodes: int
    wall_s: float
    values: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    raw_status: str = ""
    n_solutions: int = 0
    warm_start_accepted: bool | None = None
    callback_errors: list = field(default_factory=list)


def _finite(x: float) -> float:
    return x if math.isfinite(x) and abs(x) < 1e19 else (math.inf if x > 0 else -math.inf)


class ProgressBar:
    """A progress line over the time limit showing incumbent, dual bound and gap (in user
    units): the line of a :class:`fxpipe.progress.Search`, open from creation to :meth:`close`.

    Parameters
    ----------
    description : str
    time_limit_s : float
    scale : float
        Multiplies model objective values for display (e.g. seconds per model time unit).
    """

    def __init__(self, description: str, time_limit_s: float, scale: float = 1.0):
        self.scale = float(scale)
        self.limit = float(time_limit_s)
        self.line = Search(description, unit="s", total=self.limit, progress=True,
                           bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s{postfix}").__enter__()

    def update(self, now_s: float, primal: float, dual: float) -> None:
        """Show the solver time and the incumbent / bound (model units)."""
        best, bound = primal * self.scale, max(dual * self.scale, 0.0)
        gap = (best - bound) / best if best > 0 and math.isfinite(best) else math.inf
        self.line.set_count(now_s, f"incumbent={best:.6g} bound={bound:.6g} gap={100 * gap:.2f}%")

    def close(self) -> None:
        self.line.__exit__(None, None, None)


class IncumbentHandler(scip.Eventhdlr):
    """SCIP event handler: every new best solution is reported while SCIP searches.

    Calls ``on_incumbent(value_of, time_s, dual)`` on each ``BESTSOLFOUND`` event, with
    ``value_of(var)`` the variable's value in the new solution, ``time_s`` SCIP's solving
    time and ``dual`` the dual bound then (model units); exceptions it raises are recorded
    in :attr:`errors` and do not stop the solve. With a :class:`ProgressBar` it also updates
    the bar on LP and node events (at most twice a second). (OptPipe Section 4.3: training
    can switch to a better schedule while the solver keeps searching.)
    """

    def __init__(self, on_incumbent: Callable[[Callable, float, float], Any] | None = None,
                 progress: ProgressBar | None = None):
        super().__init__()
        self.on_incumbent = on_incumbent
        self.progress = progress
        self.errors: list[str] = []
        self._last = -math.inf

    def _events(self):
        ev = [scip.SCIP_EVENTTYPE.BESTSOLFOUND]
        if self.progress is not None:
            ev += [scip.SCIP_EVENTTYPE.NODESOLVED, scip.SCIP_EVENTTYPE.LPSOLVED]
        return ev

    def eventinit(self):
        for e in self._events():
            self.model.catchEvent(e, self)

    def eventexit(self):
        for e in self._events():
            self.model.dropEvent(e, self)

    def eventexec(self, event):
        m = self.model
        now = m.getSolvingTime()
        try:
            dual = m.getDualbound()
        except Exception:  # noqa: BLE001 - no bound yet
            dual = -math.inf
        best = event.getType() == scip.SCIP_EVENTTYPE.BESTSOLFOUND
        if best and self.on_incumbent is not None:
            sol = m.getBestSol()
            try:
                self.on_incumbent(lambda var: m.getSolVal(sol, var), now, dual)
            except Exception as exc:  # noqa: BLE001 - a failing callback must not stop SCIP
                self.errors.append(repr(exc)[:200])
        if self.progress is not None and (best or now - self._last > 0.5):
            self._last = now
            try:
                primal = m.getPrimalbound() if m.getNSols() > 0 else math.inf
            except Exception:  # noqa: BLE001
                primal = math.inf
            self.progress.update(now, primal, dual)


def _optimize_interruptible(model) -> bool:
    """Run ``model.optimize`` so that Ctrl-C stops it with the best result so far.

    SCIP's own SIGINT handler (``misc/catchctrlc``) sets a flag that some phases consume
    without stopping (measured: a press during the root LP of a 12k-variable model was
    ignored and the solve ran to its time limit). Instead the solve runs without the GIL in
    a worker thread while the main thread watches the stop flag of a
    :class:`fxpipe.progress.Search` (a press sets it): once it is set, ``interruptSolve``.

    Returns True when the solve was interrupted.
    """
    if threading.current_thread() is not threading.main_thread():
        # signals reach only the main thread: nothing to watch from here
        model.optimize()
        return False
    model.setParam("misc/catchctrlc", False)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            model.optimizeNogil()
        except BaseException as exc:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(exc)

    worker = threading.Thread(target=run, name="scip-solve", daemon=True)
    with Search("scip") as search:  # an enclosing search already told to stop stops this one
        # Python's own handler while SCIP runs: the KeyboardInterrupt it raises in this thread is what
        # stops SCIP promptly (measured: with a flag-setting handler, interruptSolve called every
        # 0.1 s from the press on was honoured only at the time limit, 50 s later, in the root LP)
        prev = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            worker.start()
            while worker.is_alive():
                try:
                    if search.stopped:
                        # again until SCIP stops: a press before SCIPsolve started is reset by it
                        model.interruptSolve()
                    worker.join(timeout=0.1)
                except KeyboardInterrupt:
                    # the model must outlive the solve in the worker: the loop goes on until SCIP stops
                    search.stop()
        finally:
            signal.signal(signal.SIGINT, prev)
    if errors:
        raise errors[0]
    if search.stopped:  # the enclosing searches stop too, as after a press during them
        stop_all()
    return search.interrupted


def solve_model(
    model: scip.Model,
    *,
    time_limit_s: float,
    params: Mapping[str, Any] | None = None,
    warm_start: Mapping[str, float] | None = None,
    warm_start_complete: bool = False,
    read_vars: Mapping[Any, Any] | None = None,
    heuristics: str = "default",
    emphasis: str | None = None,
    separating: str = "default",
    presolving: str = "default",
    on_incumbent: Callable[[Callable, float, float], Any] | None = None,
    progress: str | None = None,
    objective_scale: float = 1.0,
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
        A MIP start (variable name to value), e.g. from
        :func:`fxpipe.partition.bounds.models.warm_start_values` or
        :func:`fxpipe.schedule.milp.warm_start.warm_start_values`.
    warm_start_complete : bool
        The warm start sets every variable: it is checked with SCIP's ``checkSol`` and added
        only if feasible (``SolveResult.warm_start_accepted``). False: a partial solution
        that SCIP completes.
    read_vars : mapping key -> Var, optional
        Variables whose incumbent values are returned in ``values`` under their keys.
    heuristics, separating, presolving : {"default", "fast", "aggressive", "off"}
        SCIP primal-heuristic, cutting-plane and presolving settings.
    emphasis : {None, "optimality", "feasibility", "easycip", "hardlp"}
        SCIP emphasis setting (None: SCIP's default).
    on_incumbent : callable, optional
        ``on_incumbent(value_of, time_s, dual)`` at every new best solution
        (:class:`IncumbentHandler`).
    progress : str, optional
        Show a tqdm bar with this description (incumbent, bound, gap).
    objective_scale : float
        Multiplies objective values for the progress display only.

    Returns
    -------
    SolveResult

    Raises
    ------
    SolverError
        On a bad setting, or if SCIP fails other than by a limit, an interrupt or
        infeasibility.
    """
    if not time_limit_s > 0:
        raise SolverError(f"time limit must be > 0 seconds, got {time_limit_s}")
    used = _apply_settings(model, time_limit_s, params, heuristics=heuristics, separating=separating,
                           presolving=presolving, emphasis=emphasis)
    accepted = _add_warm_start(model, warm_start, warm_start_complete) if warm_start else None
    bar = ProgressBar(progress, time_limit_s, objective_scale) if progress else None
    handler = None
    if on_incumbent is not None or bar is not None:
        handler = IncumbentHandler(on_incumbent, bar)
        model.includeEventhdlr(handler, "fxpipe_incumbent", "reports new incumbents and progress")
    t0 = time.perf_counter()
    try:
        interrupted = _optimize_interruptible(model)
    except Exception as exc:  # pragma: no cover (SCIP internal failure)
        raise SolverError(f"SCIP failed while solving {model.getProbName()!r}: {exc}") from None
    finally:
        if bar is not None:
            _final_progress(model, bar)
    wall = time.perf_counter() - t0
    result = _read_result(model, interrupted, read_vars)
    result.wall_s, result.params, result.warm_start_accepted = wall, used, accepted
    result.callback_errors = list(handler.errors) if handler is not None else []
    return result


def _apply_settings(model, time_limit_s: float, params, *, heuristics: str, separating: str, presolving: str,
                    emphasis: str | None) -> dict:
    """Set :data:`DEFAULT_PARAMS`, ``params``, the time limit and the setting groups on
    ``model``; returns every parameter and setting used. Raises SolverError on a bad one."""
    used = dict(DEFAULT_PARAMS)
    used.update(params or {})
    used["limits/time"] = float(time_limit_s)
    for key, val in used.items():
        model.setParam(key, val)
    for name, value, setter in (("heuristics", heuristics, model.setHeuristics),
                                ("separating", separating, model.setSeparating),
                                ("presolving", presolving, model.setPresolve)):
        if value != "default":
            if value not in _SETTINGS:
                raise SolverError(f"{name} must be one of default, {', '.join(_SETTINGS)}; got {value!r}")
            setter(_SETTINGS[value])
        used[name] = value
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
    return used


def _add_warm_start(model, warm_start: Mapping[str, float], complete: bool) -> bool | None:
    """Hand ``warm_start`` (variable name -> value) to SCIP: a complete one only if
    ``checkSol`` accepts it (returns whether it did), a partial one for SCIP to complete
    (returns None)."""
    byname = {v.name: v for v in model.getVars()}
    sol = model.createSol() if complete else model.createPartialSol()
    for name, val in warm_start.items():
        var = byname.get(name)
        if var is not None:
            model.setSolVal(sol, var, float(val))
    if not complete:
        model.addSol(sol)
        return None
    try:
        accepted = bool(model.checkSol(sol, printreason=False))
    except Exception:  # noqa: BLE001
        accepted = False
    if accepted:
        model.addSol(sol, free=True)
    else:
        model.freeSol(sol)
    return accepted


def _final_progress(model, bar: ProgressBar) -> None:
    """Show the final solver time, incumbent and bound on ``bar``, then close it."""
    try:
        bar.update(model.getSolvingTime(), model.getPrimalbound() if model.getNSols() else math.inf,
                   model.getDualbound())
    except Exception:  # noqa: BLE001
        pass
    bar.close()


def _read_result(model, interrupted: bool, read_vars) -> SolveResult:
    """Status, incumbent, dual bound, gap and ``read_vars`` values of a solved ``model`` (the
    wall time, parameters and warm-start fields are filled by :func:`solve_model`)."""
    raw = model.getStatus()
    # a press is reported as such even when SCIP finished at the same moment (its bounds are
    # valid either way): callers stop their remaining work on "userinterrupt"
    status = "userinterrupt" if interrupted else normalize_status(raw)
    if status.startswith("unknown:"):
        raise SolverError(f"SCIP ended {model.getProbName()!r} with status {raw!r}; the model may be malformed")
    nsols = model.getNSols()
    # getObjVal reads the solution optimize() caches; optimizeNogil does not set it
    primal = _finite(model.getSolObjVal(model.getBestSol())) if nsols > 0 else math.inf
    if status == "infeasible":
        dual = math.inf
    else:
        try:
            dual = _finite(model.getDualbound())
        except Exception:  # noqa: BLE001
            dual = -math.inf
        if nsols > 0:
            dual = min(dual, primal)
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
        wall_s=0.0,
        values=values,
        raw_status=str(raw),
        n_solutions=int(nsols),
    )
