"""Solving the schedule MILP: warm start, SCIP (through :func:`fxpipe.mip.solve_model`),
incumbents as they are found, and the validated result with its proven bound."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import Schedule, ScheduleProblem
from fxpipe.progress import Search, stop_all
from fxpipe.schedule.bounds import combinatorial_lower_bound
from fxpipe.schedule.milp.builder import build_model
from fxpipe.schedule.milp.extract import extract_schedule
from fxpipe.schedule.milp.feasibility import check_memory_feasible, objective_value
from fxpipe.schedule.milp.time_indexed import probe_lower_bound
from fxpipe.schedule.milp.warm_start import warm_start_schedule, warm_start_values
import fxpipe.schedule.offload_search as offload_search_mod
from fxpipe.schedule.validate import check_schedule, objective_values

__all__ = ["Incumbent", "solve"]


@dataclass(frozen=True)
class Incumbent:
    """A new best schedule found while SCIP searches (OptPipe Section 4.3).

    Attributes
    ----------
    value_s : float
        Objective value of ``schedule`` (seconds).
    dual_bound_s : float
        SCIP's dual bound at that moment (seconds).
    time_s : float
        Solver wall time when it was found.
    schedule : Schedule
        The extracted, validated schedule.
    """

    value_s: float
    dual_bound_s: float
    time_s: float
    schedule: Schedule


def solve(
    problem: ScheduleProblem,
    *,
    time_limit_s: float = 60.0,
    warm_start: Schedule | None = None,
    on_incumbent: Callable[[Incumbent], Any] | None = None,
    progress: bool = False,
    threads: int = 1,
    gap_limit: float = 0.0,
    triangle_cuts: bool = True,
    probe_time_s: float | None = None,
    search_time_s: float | None = None,
) -> Schedule:
    """Solve the schedule MILP with SCIP and return the best valid schedule.

    Parameters
    ----------
    problem : ScheduleProblem
        Contract 3 problem (any placement of stages on devices).
    time_limit_s : float
        Wall-clock limit for SCIP (s), > 0.
    warm_start : Schedule, optional
        A valid schedule for ``problem``; default: the best valid heuristic
        (:func:`~fxpipe.schedule.milp.warm_start.warm_start_schedule`). An invalid one is
        ignored.
    on_incumbent : callable, optional
        Called with an :class:`Incumbent` each time SCIP finds a better schedule
        (OptPipe Section 4.3: training can switch schedules while SCIP keeps searching).
        Exceptions it raises are recorded in ``meta["callback_errors"]`` and ignored.
    progress : bool
        Show a tqdm bar with incumbent, dual bound and gap.
    threads : int
        LP threads (``lp/threads``).
    gap_limit : float
        Stop at this relative gap (SCIP ``limits/gap``), e.g. 0.01.
    triangle_cuts : bool
        See :func:`~fxpipe.schedule.milp.builder.build_model`.
    probe_time_s : float, optional
        Seconds (out of ``time_limit_s``) for bound probing before SCIP
        (:func:`~fxpipe.schedule.milp.time_indexed.probe_lower_bound`: bisection on the value
        with per-device time-indexed models, when all durations lie on a common grid). The
        proven bound becomes the objective cut of the MILP and the reported bound when it is
        the larger. Default: a quarter of ``time_limit_s`` when ``time_limit_s >= 60``, else
        0 (no probing). ``meta["probe"]`` records the result.
    search_time_s : float, optional
        Seconds (out of ``time_limit_s``) for a longer primal search before probing, with one
        stage per device: :func:`fxpipe.schedule.offload_search.offload_search` (offload-aware
        list scheduling), whose best schedule replaces the warm start when shorter. Default:
        a tenth of ``time_limit_s`` when ``time_limit_s >= 60``, else 0 (the warm start's
        short search only). ``meta["search"]`` records the result.

    Returns
    -------
    Schedule
        ``method="milp"``; ``lower_bound_s = max(SCIP dual bound, combinatorial bound)``
        (only the combinatorial bound when the model is restricted, see ``meta``);
        (or the probe bound, see ``probe_time_s``, when larger; ``meta["bound_method"]``);
        ``status`` in the vocabulary of :mod:`fxpipe.mip.status` (optimal / timelimit /
        gaplimit / userinterrupt / feasible ...); ``meta`` has gap, nodes, status, primal,
        dual, scip_version, params, model counts and incumbents. The schedule always passes
        the Contract-3 validator (if no MILP solution does, the warm start is returned with
        its own method recorded in ``meta["source"]``). When the warm start already meets
        the combinatorial lower bound it is optimal and no model is built
        (``meta["proof"] = "combinatorial bound"``).

    Ctrl-C (:class:`fxpipe.progress.Search`) in any phase stops it, the phases after it do not
    run, and the best schedule so far comes back with ``status="userinterrupt"``: SCIP's
    incumbent with its dual bound and gap, or before SCIP the warm start (improved by the
    search if it ran) with the bound proven so far; an enclosing search stops too. Pressed
    before any warm start existed, the ``KeyboardInterrupt`` goes on to the caller.

    Raises
    ------
    InputError
        Bad ``problem``, ``time_limit_s``, ``threads`` or ``gap_limit``.
    InfeasibleError
        If no schedule fits the memory limits.
    fxpipe.errors.SolverError
        If SCIP fails (not on a time-out).

    References
    ----------
    OptPipe Sections 3, 4.1, 4.3 and Appendix C.
    """
    if not isinstance(problem, ScheduleProblem):
        raise InputError(f"expected a ScheduleProblem, got {type(problem).__name__}")
    probe_time_s, search_time_s = _phase_budgets(time_limit_s, threads, gap_limit, probe_time_s, search_time_s)
    t_start = time.perf_counter()
    check_memory_feasible(problem)
    comb_lb = float(combinatorial_lower_bound(problem))
    warm, warm_val, search_info, probe_info, bound_method = None, math.inf, None, None, "combinatorial"
    search_s = probe_s = 0.0
    result = None
    # Ctrl-C in any phase (the searches inside it and SCIP stop this search too): the phases
    # after it do not run and the best schedule so far comes back as "userinterrupt"
    with Search(f"milp {problem.name}") as run:
        warm = _valid_warm_start(problem, warm_start)
        warm_val = objective_value(problem, warm.ops)
        if search_time_s > 0 and problem.one_stage_per_device and not run.stopped and not _meets(warm_val, comb_lb):
            warm, warm_val, search_info = _long_search(problem, warm, warm_val, search_time_s, progress)
            search_s = time.perf_counter() - t_start
        if probe_time_s > 0 and not run.stopped and not _meets(warm_val, comb_lb):
            pb = probe_lower_bound(problem, upper_bound_s=warm_val, lower_bound_s=comb_lb,
                                   time_limit_s=float(probe_time_s), probe_time_s=max(1.0, float(probe_time_s) / 8))
            probe_info, probe_s = pb.to_dict(), pb.wall_s
            if pb.bound_s > comb_lb:  # a proven bound (see probe_lower_bound, "Soundness")
                comb_lb, bound_method = pb.bound_s, "time-indexed probe"
            if pb.interrupted:
                stop_all()  # a probe solve was stopped by Ctrl-C: this search and any enclosing one stop
        if not run.stopped and not _meets(warm_val, comb_lb):
            result = _solve_milp(problem, warm, warm_val, comb_lb, t_start,
                                 {"probe": probe_info, "search": search_info, "bound_method": bound_method},
                                 time_limit_s=max(1.0, float(time_limit_s) - probe_s - search_s), threads=threads,
                                 gap_limit=gap_limit, triangle_cuts=triangle_cuts, on_incumbent=on_incumbent,
                                 progress=progress)
    if result is not None:
        return result
    if warm is None:
        raise KeyboardInterrupt  # pressed before the warm start existed: nothing to return
    warm_val = objective_value(problem, warm.ops)
    # the warm start meets a proven lower bound: optimal, nothing to search; or Ctrl-C: the
    # warm start with the bound proven so far
    warm_info = {"method": warm.method, "value_s": warm_val, "candidates": warm.meta.get("warm_candidates", {}),
                 "accepted": None}
    return _warm_start_result(problem, warm, warm_val, comb_lb, _meets(warm_val, comb_lb), t_start,
                              {"probe": probe_info, "search": search_info, "bound_method": bound_method,
                               "warm_start": warm_info})


def _solve_milp(problem: ScheduleProblem, warm_start: Schedule, warm_val: float, comb_lb: float, t_start: float,
                phases: dict, *, time_limit_s: float, threads: int, gap_limit: float, triangle_cuts: bool,
                on_incumbent: Callable[[Incumbent], Any] | None, progress: bool) -> Schedule:
    """Build the model from the warm start and the proven bound ``comb_lb``, solve it with SCIP
    for ``time_limit_s`` (:func:`fxpipe.mip.solve_model`, which a Ctrl-C stops with its best
    so far) and return the best valid schedule (:func:`_milp_result`)."""
    from fxpipe.mip import solve_model  # imports pyscipopt (heavy): only when solving

    model, V = build_model(problem, warm_start=warm_start, triangle_cuts=triangle_cuts, lower_bound_s=comb_lb)
    params = {"limits/gap": float(gap_limit), "lp/threads": int(threads)}
    # measured on the Zero Bubble / offload instances (benchmarks/bench_schedule.py): SCIP's
    # default probing spends tens of seconds in presolve on these big-M models, and on larger
    # models the LNS heuristics (RINS, trust region) around the warm start are what improves
    # the incumbent (p=4, m=8, limit 2: 28.5 with default separation, 28 without, in 30 s).
    big = V.counts["binaries"] > 500
    build_s = time.perf_counter() - t_start
    found = _Incumbents(problem, V, warm_start, warm_val, comb_lb, on_incumbent)
    res = solve_model(
        model,
        time_limit_s=time_limit_s,
        params=params,
        warm_start=warm_start_values(problem, V, warm_start),
        warm_start_complete=True,
        read_vars={v.name: v for v in model.getVars()},
        heuristics="aggressive" if big else "default",
        separating="off" if big else "default",
        presolving="fast",
        on_incumbent=found.consider,
        progress=f"milp {problem.name}" if progress else None,
        objective_scale=V.unit_s,
    )
    if res.callback_errors:  # a failure outside extraction / the user's callback: record it
        found.extract_failures += len(res.callback_errors)
        found.extract_errors.extend(res.callback_errors)
    # the final best solution (the handler saw it already unless it came from presolve)
    if res.n_solutions > 0 and res.values and res.raw_status != "infeasible":
        found.consider(lambda var: res.values[var.name], res.wall_s, res.dual)
    warm_info = {"method": warm_start.method, "value_s": warm_val,
                 "candidates": warm_start.meta.get("warm_candidates", {}), "accepted": res.warm_start_accepted}
    return _milp_result(problem, V, res, found, comb_lb, t_start,
                        {**phases, "build_s": build_s, "warm_start": warm_info})


def _meets(value: float, bound: float) -> bool:
    """Whether ``value`` reaches the lower bound ``bound`` (up to rounding): optimal."""
    return value <= bound * (1 + 1e-9) + 1e-12


def _phase_budgets(time_limit_s, threads, gap_limit, probe_time_s, search_time_s) -> tuple[float, float]:
    """Check :func:`solve`'s limits; the probe and search budgets with their defaults filled in."""
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0 and not math.isnan(time_limit_s)):
        raise InputError(f"time_limit_s must be > 0, got {time_limit_s!r}")
    if not (isinstance(threads, int) and threads >= 1):
        raise InputError(f"threads must be an integer >= 1, got {threads!r}")
    if not (isinstance(gap_limit, (int, float)) and 0 <= gap_limit < 1):
        raise InputError(f"gap_limit must lie in [0, 1), got {gap_limit!r}")
    if probe_time_s is None:
        probe_time_s = 0.25 * float(time_limit_s) if time_limit_s >= 60 else 0.0
    if not (isinstance(probe_time_s, (int, float)) and 0 <= probe_time_s < time_limit_s):
        raise InputError(f"probe_time_s must lie in [0, time_limit_s), got {probe_time_s!r}")
    if search_time_s is None:
        search_time_s = 0.1 * float(time_limit_s) if time_limit_s >= 60 else 0.0
    if not (isinstance(search_time_s, (int, float)) and 0 <= search_time_s and probe_time_s + search_time_s < time_limit_s):
        raise InputError(f"search_time_s must lie in [0, time_limit_s - probe_time_s), got {search_time_s!r}")
    return probe_time_s, search_time_s


def _valid_warm_start(problem: ScheduleProblem, warm_start: Schedule | None) -> Schedule:
    """The given warm start if valid, else the best valid heuristic schedule."""
    if warm_start is not None:
        if not isinstance(warm_start, Schedule):
            raise InputError(f"warm_start must be a Schedule, got {type(warm_start).__name__}")
        if check_schedule(problem, warm_start.ops):
            warm_start = None
    if warm_start is None:
        warm_start = warm_start_schedule(problem)
    return warm_start


def _long_search(problem: ScheduleProblem, warm_start: Schedule, warm_val: float, search_time_s: float,
                 progress: bool) -> tuple[Schedule, float, dict | None]:
    """The longer primal search (:func:`~fxpipe.schedule.offload_search.offload_search`) before
    probing: (warm start, its value, ``meta["search"]``). Its best schedule replaces the warm
    start when valid and shorter. Ctrl-C stops it (and the enclosing :func:`solve`) with its
    best so far; pressed before it had one, its ``KeyboardInterrupt`` ends :func:`solve`'s search."""
    try:
        found = offload_search_mod.offload_search(problem, time_limit_s=float(search_time_s), seed=1, progress=progress)
    except InfeasibleError:
        return warm_start, warm_val, None
    search_info = {"value_s": found.value, "evals": found.meta.get("evals"), "wall_s": found.solver_time_s,
                   "interrupted": bool(found.meta.get("interrupted"))}
    if not check_schedule(problem, found.ops) and objective_value(problem, found.ops) < warm_val - 1e-12 * max(1.0, warm_val):
        warm_start = Schedule(ops=found.ops, makespan=found.makespan, stage_span=found.stage_span,
                              status="heuristic", method="offload-search", objective=problem.objective,
                              meta={"warm_candidates": {**warm_start.meta.get("warm_candidates", {}),
                                                        "offload-search (long)": found.value}})
        warm_val = objective_value(problem, warm_start.ops)
    return warm_start, warm_val, search_info


def _versions() -> dict:
    """The SCIP and PySCIPOpt versions (``meta``)."""
    import pyscipopt as scip

    from fxpipe.mip import scip_version

    return {"scip_version": scip_version(), "pyscipopt_version": scip.__version__}


def _warm_start_result(problem: ScheduleProblem, warm_start: Schedule, warm_val: float, comb_lb: float,
                       proven: bool, t_start: float, info: dict) -> Schedule:
    """The warm start returned without a model: optimal when it meets the proven bound
    ``comb_lb``, else after Ctrl-C (``userinterrupt``) with the bound proven so far."""
    ms, span = objective_values(problem, warm_start.ops)
    status = "optimal" if proven else "userinterrupt"
    gap = 0.0 if proven else (warm_val - comb_lb) / warm_val if warm_val > 0 else 0.0
    return Schedule(
        ops=warm_start.ops, makespan=ms, stage_span=span, lower_bound_s=min(comb_lb, warm_val), status=status,
        solver_time_s=time.perf_counter() - t_start, method="milp", objective=problem.objective,
        meta={"gap": gap, "nodes": 0, "status": status, "primal": warm_val, "dual": comb_lb,
              "combinatorial_bound_s": comb_lb, **_versions(),
              "params": {}, "model": {}, "warm_start": info["warm_start"], "incumbents": [],
              "source": f"warm_start:{warm_start.method}", "proof": f"{info['bound_method']} bound", "build_s": 0.0,
              "probe": info["probe"], "search": info["search"], "bound_method": info["bound_method"]},
    )


class _Incumbents:
    """The best valid schedule so far, fed with SCIP's solutions (OptPipe Section 4.3).

    :meth:`consider` extracts and validates a solution and keeps it when it improves on the
    best (the warm start counts until a solution at most as long replaces it), reporting it
    to ``on_incumbent``; failures are counted, not raised.
    """

    def __init__(self, problem: ScheduleProblem, V, warm_start: Schedule, warm_val: float, comb_lb: float,
                 on_incumbent: Callable[[Incumbent], Any] | None) -> None:
        self.problem, self.V, self.warm_start, self.comb_lb = problem, V, warm_start, comb_lb
        self.on_incumbent = on_incumbent
        self.best, self.best_val = warm_start, warm_val
        self.incumbents: list[dict] = []
        self.callback_errors: list[str] = []
        self.extract_failures = 0
        self.extract_errors: list[str] = []

    def consider(self, values: Callable, when: float, dual_model: float) -> None:
        """A solution of the model (``values(var)``) found at ``when`` s with SCIP's dual bound."""
        problem, V = self.problem, self.V
        dual = max(dual_model * V.unit_s, 0.0) if math.isfinite(dual_model) else 0.0
        try:
            ops = extract_schedule(problem, V, values)
        except Exception as exc:  # noqa: BLE001
            self.extract_failures += 1
            self.extract_errors.append(repr(exc)[:200])
            return
        errs = check_schedule(problem, ops)
        if errs:
            self.extract_failures += 1
            self.extract_errors.append(errs[0][:200])
            return
        val = objective_value(problem, ops)
        tol = 1e-12 * max(1.0, abs(val))
        if self.best is self.warm_start:
            if val > self.best_val + tol:
                return
        elif val >= self.best_val - tol:
            return
        ms, span = objective_values(problem, ops)
        lb = self.comb_lb if V.restricted else max(dual, self.comb_lb)
        sched = Schedule(ops=tuple(ops), makespan=ms, stage_span=span, lower_bound_s=lb,
                         status="feasible", solver_time_s=when, method="milp", objective=problem.objective)
        self.best, self.best_val = sched, val
        self.incumbents.append({"value_s": val, "dual_bound_s": dual, "time_s": when})
        if self.on_incumbent is not None:
            try:
                self.on_incumbent(Incumbent(value_s=val, dual_bound_s=dual, time_s=when, schedule=sched))
            except Exception as exc:  # noqa: BLE001
                self.callback_errors.append(repr(exc)[:200])


def _milp_result(problem: ScheduleProblem, V, res, found: _Incumbents, comb_lb: float, t_start: float,
                 info: dict) -> Schedule:
    """The best schedule after SCIP, with its status, proven bound and ``meta``."""
    status = res.status
    dual_s = max(res.dual * V.unit_s, 0.0) if math.isfinite(res.dual) else 0.0
    note = None
    if res.raw_status == "infeasible" or not math.isfinite(res.dual):
        # the model's conservative memory accounting (strict margins) holds no schedule of
        # value <= the warm start's: nothing is proven, the warm start is still valid
        dual_s = 0.0
        status = "feasible"
        note = "the MILP found no schedule at most as long as the warm start; returning the warm start"
    best: Schedule = found.best
    value = found.best_val
    primal_s = res.primal * V.unit_s if res.n_solutions > 0 else float("inf")
    lb = comb_lb if V.restricted else max(dual_s, comb_lb)
    lb = min(lb, value)  # the returned schedule's value may exceed the model optimum by repair noise
    if V.restricted and status == "optimal":
        status = "optimal" if value <= comb_lb * (1 + 1e-9) else "feasible"
    if status == "optimal" and value > primal_s * (1 + 1e-6) + 1e-12:
        status = "feasible"  # SCIP's optimum could not be reproduced exactly (see meta)
    gap = (value - lb) / value if value > 0 else 0.0
    if status == "optimal":
        gap = max(gap, 0.0)
    ms, span = objective_values(problem, best.ops)
    meta = {
        "gap": gap,
        "nodes": res.nodes,
        "status": res.raw_status,
        "primal": primal_s,
        "dual": dual_s,
        "combinatorial_bound_s": float(combinatorial_lower_bound(problem)),
        "probe": info["probe"],
        "search": info["search"],
        "bound_method": info["bound_method"] if lb > dual_s or V.restricted else "scip",
        **_versions(),
        "params": res.params,
        "model": V.counts,
        "horizon_s": V.horizon * V.unit_s,
        "warm_start": info["warm_start"],
        "incumbents": found.incumbents,
        "source": best.method if best is not found.warm_start else f"warm_start:{found.warm_start.method}",
        "build_s": info["build_s"],
    }
    if V.restricted:
        meta["restricted"] = V.restricted + ": the SCIP bound is not a bound for the problem, lower_bound_s is the combinatorial one"
    if note:
        meta["note"] = note
    if found.callback_errors:
        meta["callback_errors"] = found.callback_errors
    if found.extract_failures:
        meta["extract_failures"] = found.extract_failures
        meta["extract_errors"] = found.extract_errors[:5]
    return Schedule(
        ops=best.ops, makespan=ms, stage_span=span, lower_bound_s=lb, status=status,
        solver_time_s=time.perf_counter() - t_start, method="milp", objective=problem.objective, meta=meta,
    )
