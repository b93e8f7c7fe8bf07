"""fxpipe.mip: the one SCIP solve wrapper (status vocabulary, warm starts, incumbent events,
progress) shared by the partition bounds and the schedule MILP."""

from __future__ import annotations

import math

import pyscipopt as scip
import pytest

from fxpipe.errors import SolverError
from fxpipe.mip import STATUSES, normalize_status, solve_model


def _knapsack(n: int = 12):
    m = scip.Model("knap")
    m.hideOutput()
    w = [3 + (7 * i) % 11 for i in range(n)]
    v = [5 + (5 * i) % 13 for i in range(n)]
    x = [m.addVar(f"x{i}", vtype="B") for i in range(n)]
    m.addCons(scip.quicksum(w[i] * x[i] for i in range(n)) <= sum(w) // 2)
    m.setObjective(scip.quicksum(-v[i] * x[i] for i in range(n)), "minimize")
    return m, x


def test_status_vocabulary():
    assert normalize_status("totalnodelimit") == "nodelimit"
    assert normalize_status("bestsollimit") == "sollimit"
    assert normalize_status("userinterrupt") == "userinterrupt"
    assert normalize_status("unbounded").startswith("unknown:")
    assert {"optimal", "timelimit", "feasible", "heuristic"} <= set(STATUSES)


def test_solve_model_reports_incumbents_bound_and_values():
    model, x = _knapsack()
    seen = []
    res = solve_model(model, time_limit_s=10, on_incumbent=lambda value_of, t, dual: seen.append(value_of(x[0])),
                      read_vars={i: v for i, v in enumerate(x)}, progress="knapsack")
    assert res.status == "optimal" and res.gap == 0.0
    assert res.primal == pytest.approx(res.dual)
    assert seen and all(v in (0.0, 1.0) for v in seen)
    assert set(res.values) == set(range(len(x)))
    assert res.n_solutions >= 1 and res.raw_status == "optimal"


def test_complete_warm_start_is_checked():
    model, x = _knapsack()
    res = solve_model(model, time_limit_s=10, warm_start={v.name: 0.0 for v in x}, warm_start_complete=True)
    assert res.warm_start_accepted is True
    model, x = _knapsack()
    res = solve_model(model, time_limit_s=10, warm_start={v.name: 1.0 for v in x}, warm_start_complete=True)
    assert res.warm_start_accepted is False  # over the capacity: refused, SCIP solves anyway
    assert res.status == "optimal"


def test_callback_errors_are_recorded_not_raised():
    model, _ = _knapsack()

    def boom(*_):
        raise RuntimeError("callback failed")

    res = solve_model(model, time_limit_s=10, on_incumbent=boom)
    assert res.status == "optimal" and res.callback_errors


def test_bad_settings_and_infeasible_models():
    model, _ = _knapsack()
    with pytest.raises(SolverError, match="heuristics"):
        solve_model(model, time_limit_s=1, heuristics="lots")
    with pytest.raises(SolverError, match="time limit"):
        solve_model(model, time_limit_s=0)
    m = scip.Model()
    m.hideOutput()
    y = m.addVar("y", vtype="B")
    m.addCons(y >= 2)
    res = solve_model(m, time_limit_s=5)
    assert res.status == "infeasible" and math.isinf(res.dual) and math.isinf(res.primal)
