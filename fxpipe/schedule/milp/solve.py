"""Solving the schedule MILP: warm start, SCIP (through :func:`fxpipe.mip.solve_model`),
incumbents as they are found, and the validated result with its proven bound."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import Schedule, ScheduleProblem
from fxpipe.schedule.milp.builder import build_model
from fxpipe.schedule.milp.extract import extract_schedule
from fxpipe.schedule.milp.feasibility import check_memory_feasible, objective_value
from fxpipe.schedule.milp.warm_start import warm_start_schedule, warm_start_values

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
    import pyscipopt as scip

    from fxpipe.mip import scip_version, solve_model
    from fxpipe.schedule.bounds import combinatorial_lower_bound
    from fxpipe.schedule.validate import check_schedule, objective_values

    if not isinstance(problem, ScheduleProblem):
        raise InputError(f"expected a ScheduleProblem, got {type(problem).__name__}")
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
    t_start = time.perf_counter()
    check_memory_feasible(problem)

    if warm_start is not None:
        if not isinstance(warm_start, Schedule):
            raise InputError(f"warm_start must be a Schedule, got {type(warm_start).__name__}")
        if check_schedule(problem, warm_start.ops):
            warm_start = None
    if warm_start is None:
        warm_start = warm_start_schedule(problem)
    warm_val = objective_value(problem, warm_start.ops)
    comb_lb = float(combinatorial_lower_bound(problem))
    search_info, search_s, interrupted = None, 0.0, False
    if search_time_s > 0 and problem.one_stage_per_device and warm_val > comb_lb * (1 + 1e-9) + 1e-12:
        from fxpipe.schedule.offload_search import offload_search

        try:
            found = offload_search(problem, time_limit_s=float(search_time_s), seed=1, progress=progress)
        except KeyboardInterrupt:
            found, interrupted = None, True
        except InfeasibleError:
            found = None
        search_s = time.perf_counter() - t_start
        if found is not None:
            interrupted = bool(found.meta.get("interrupted"))
            search_info = {"value_s": found.value, "evals": found.meta.get("evals"), "wall_s": found.solver_time_s,
                           "interrupted": interrupted}
            if not check_schedule(problem, found.ops) and objective_value(problem, found.ops) < warm_val - 1e-12 * max(1.0, warm_val):
                warm_start = Schedule(ops=found.ops, makespan=found.makespan, stage_span=found.stage_span,
                                      status="heuristic", method="offload-search", objective=problem.objective,
                                      meta={"warm_candidates": {**warm_start.meta.get("warm_candidates", {}),
                                                                "offload-search (long)": found.value}})
                warm_val = objective_value(problem, warm_start.ops)
    probe_info = None
    probe_s = 0.0
    bound_method = "combinatorial"
    if probe_time_s > 0 and not interrupted and warm_val > comb_lb * (1 + 1e-9) + 1e-12:
        from fxpipe.schedule.milp.time_indexed import probe_lower_bound

        pb = probe_lower_bound(problem, upper_bound_s=warm_val, lower_bound_s=comb_lb, time_limit_s=float(probe_time_s),
                               probe_time_s=max(1.0, float(probe_time_s) / 8))
        probe_info = pb.to_dict()
        probe_s = pb.wall_s
        if pb.bound_s > comb_lb:
            comb_lb = pb.bound_s  # a proven bound (see probe_lower_bound, "Soundness")
            bound_method = "time-indexed probe"
    warm_info = {"method": warm_start.method, "value_s": warm_val,
                 "candidates": warm_start.meta.get("warm_candidates", {})}

    proven = warm_val <= comb_lb * (1 + 1e-9) + 1e-12
    if proven or interrupted or (probe_info is not None and probe_info.get("interrupted")):
        # the warm start meets a proven lower bound: optimal, nothing to search; or Ctrl-C
        # during the search or probing: the warm start with the bound proven so far
        ms, span = objective_values(problem, warm_start.ops)
        status = "optimal" if proven else "userinterrupt"
        gap = 0.0 if proven else (warm_val - comb_lb) / warm_val if warm_val > 0 else 0.0
        return Schedule(
            ops=warm_start.ops, makespan=ms, stage_span=span, lower_bound_s=min(comb_lb, warm_val), status=status,
            solver_time_s=time.perf_counter() - t_start, method="milp", objective=problem.objective,
            meta={"gap": gap, "nodes": 0, "status": status, "primal": warm_val, "dual": comb_lb,
                  "combinatorial_bound_s": comb_lb, "scip_version": scip_version(), "pyscipopt_version": scip.__version__,
                  "params": {}, "model": {}, "warm_start": {**warm_info, "accepted": None}, "incumbents": [],
                  "source": f"warm_start:{warm_start.method}", "proof": f"{bound_method} bound", "build_s": 0.0,
                  "probe": probe_info, "search": search_info, "bound_method": bound_method},
        )

    model, V = build_model(problem, warm_start=warm_start, triangle_cuts=triangle_cuts, lower_bound_s=comb_lb)
    params = {"limits/gap": float(gap_limit), "lp/threads": int(threads)}
    # measured on the Zero Bubble / offload instances (benchmarks/bench_schedule.py): SCIP's
    # default probing spends tens of seconds in presolve on these big-M models, and on larger
    # models the LNS heuristics (RINS, trust region) around the warm start are what improves
    # the incumbent (p=4, m=8, limit 2: 28.5 with default separation, 28 without, in 30 s).
    big = V.counts["binaries"] > 500
    build_s = time.perf_counter() - t_start

    state = {"best": warm_start, "best_val": warm_val, "incumbents": [], "callback_errors": [], "extract_failures": 0}

    def consider(values: Callable, when: float, dual_model: float) -> None:
        dual = max(dual_model * V.unit_s, 0.0) if math.isfinite(dual_model) else 0.0
        try:
            ops = extract_schedule(problem, V, values)
        except Exception as exc:  # noqa: BLE001
            state["extract_failures"] += 1
            state.setdefault("extract_errors", []).append(repr(exc)[:200])
            return
        errs = check_schedule(problem, ops)
        if errs:
            state["extract_failures"] += 1
            state.setdefault("extract_errors", []).append(errs[0][:200])
            return
        val = objective_value(problem, ops)
        tol = 1e-12 * max(1.0, abs(val))
        if state["best"] is warm_start:
            if val > state["best_val"] + tol:
                return
        elif val >= state["best_val"] - tol:
            return
        ms, span = objective_values(problem, ops)
        lb = comb_lb if V.restricted else max(dual, comb_lb)
        sched = Schedule(ops=tuple(ops), makespan=ms, stage_span=span, lower_bound_s=lb,
                         status="feasible", solver_time_s=when, method="milp", objective=problem.objective)
        state["best"], state["best_val"] = sched, val
        state["incumbents"].append({"value_s": val, "dual_bound_s": dual, "time_s": when})
        if on_incumbent is not None:
            try:
                on_incumbent(Incumbent(value_s=val, dual_bound_s=dual, time_s=when, schedule=sched))
            except Exception as exc:  # noqa: BLE001
                state["callback_errors"].append(repr(exc)[:200])

    res = solve_model(
        model,
        time_limit_s=max(1.0, float(time_limit_s) - probe_s - search_s),
        params=params,
        warm_start=warm_start_values(problem, V, warm_start),
        warm_start_complete=True,
        read_vars={v.name: v for v in model.getVars()},
        heuristics="aggressive" if big else "default",
        separating="off" if big else "default",
        presolving="fast",
        on_incumbent=consider,
        progress=f"milp {problem.name}" if progress else None,
        objective_scale=V.unit_s,
    )
    if res.callback_errors:  # a failure outside extraction / the user's callback: record it
        state["extract_failures"] += len(res.callback_errors)
        state.setdefault("extract_errors", []).extend(res.callback_errors)
    status = res.status
    dual_s = max(res.dual * V.unit_s, 0.0) if math.isfinite(res.dual) else 0.0
    note = None
    if res.raw_status == "infeasible" or not math.isfinite(res.dual):
        # the model's conservative memory accounting (strict margins) holds no schedule of
        # value <= the warm start's: nothing is proven, the warm start is still valid
        dual_s = 0.0
        status = "feasible"
        note = "the MILP found no schedule at most as long as the warm start; returning the warm start"
    # the final best solution (the handler saw it already unless it came from presolve)
    if res.n_solutions > 0 and res.values and res.raw_status != "infeasible":
        consider(lambda var: res.values[var.name], res.wall_s, res.dual)
    best: Schedule = state["best"]
    value = state["best_val"]
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
        "probe": probe_info,
        "search": search_info,
        "bound_method": bound_method if lb > dual_s or V.restricted else "scip",
        "scip_version": scip_version(),
        "pyscipopt_version": scip.__version__,
        "params": res.params,
        "model": V.counts,
        "horizon_s": V.horizon * V.unit_s,
        "warm_start": {**warm_info, "accepted": res.warm_start_accepted},
        "incumbents": state["incumbents"],
        "source": best.method if best is not warm_start else f"warm_start:{warm_start.method}",
        "build_s": build_s,
    }
    if V.restricted:
        meta["restricted"] = V.restricted + ": the SCIP bound is not a bound for the problem, lower_bound_s is the combinatorial one"
    if note:
        meta["note"] = note
    if state["callback_errors"]:
        meta["callback_errors"] = state["callback_errors"]
    if state["extract_failures"]:
        meta["extract_failures"] = state["extract_failures"]
        meta["extract_errors"] = state.get("extract_errors", [])[:5]
    return Schedule(
        ops=best.ops, makespan=ms, stage_span=span, lower_bound_s=lb, status=status,
        solver_time_s=time.perf_counter() - t_start, method="milp", objective=problem.objective, meta=meta,
    )
