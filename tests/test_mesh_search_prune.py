"""The mesh search's prune after partitioning (fxpipe.planner ``beat_s``) and its planning order (issues 28, 29).

A candidate whose partition's schedule lower bound (:func:`fxpipe.schedule.bounds.recompute_lower_bound`, every
schedule under every checkpoint choice) is no better than the best predicted step so far is not scheduled; the
candidates are planned in the order of :func:`fxpipe.mesh.search.planning_key_s`. Oracle: the same search without
either (bound order, nothing pruned after partitioning) picks the same mesh at the same predicted step, and every
candidate the fast search pruned is predicted no faster there.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

import fxpipe.mesh.search as ms
import fxpipe.planner as planner
from fxpipe.ir import OpGraph
from fxpipe.memory import MemoryModel
from fxpipe.options import PlanOptions


def _chain(n: int = 12, seed: int = 0) -> OpGraph:
    rng = np.random.default_rng(seed)
    return OpGraph.from_arrays(t_fwd_s=rng.uniform(1e-3, 3e-3, n), t_bwd_input_s=rng.uniform(1e-3, 3e-3, n),
                               t_bwd_weight_s=rng.uniform(1e-3, 3e-3, n), size_out_bytes=np.full(n, 1e3),
                               size_param_bytes=np.full(n, 2e6), act_bytes=np.full(n, 1e6),
                               edges=[(i, i + 1) for i in range(n - 1)], bandwidth_bytes_per_s=1e9)


def _search(graph, devices: int, microbatches: int, options: PlanOptions):
    return ms.search_mesh(graph, devices=devices, microbatches=microbatches, memory=MemoryModel(), options=options)


def _unpruned(monkeypatch):
    """The search as before: candidates in bound order, nothing pruned after partitioning."""
    monkeypatch.setattr(ms, "planning_key_s", lambda lower_bound_s, mesh, microbatches: lower_bound_s)
    monkeypatch.setattr(planner, "recompute_lower_bound", lambda problem: -math.inf)
    monkeypatch.setattr(planner, "round_trip_lower_bound", lambda problem: -math.inf)
    real_auto = planner.auto_schedule  # and every schedule method run, whatever the best so far
    monkeypatch.setattr(planner, "auto_schedule", lambda problem, beat_s=None, **kw: real_auto(problem, **kw))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_prune_after_partition_keeps_the_search_choice(seed, monkeypatch):
    """Random 12-op chains, 8 devices, 8 micro-batches, parameters whose sync matters: the 8-stage pipeline's bound
    without a bubble passes, its schedule's bound (the round trip of 8 micro-batches) does not, so it is pruned
    after partitioning, and the search without the prune picks the same mesh at the same predicted step."""
    g = _chain(seed=seed)
    opts = PlanOptions(time_limit_s=0.3, seed=0, schedule_time_limit_s=0)
    mesh, _, _, table = _search(g, 8, 8, opts)
    pruned = {r["mesh_text"]: r for r in table if r.get("skipped", "").startswith("pruned after partitioning")}
    if seed in (0, 2):  # the prune is exercised (on these chains the 8-stage pipeline's bubble loses)
        assert pruned, [r.get("skipped") for r in table]
    chosen = next(r for r in table if r.get("chosen"))
    with monkeypatch.context() as mp:
        _unpruned(mp)
        mesh0, _, _, table0 = _search(g, 8, 8, opts)
    chosen0 = next(r for r in table0 if r.get("chosen"))
    assert mesh == mesh0
    assert chosen["predicted_step_s"] == pytest.approx(chosen0["predicted_step_s"], rel=1e-12)
    by_text = {r["mesh_text"]: r for r in table0}
    for text, row in pruned.items():  # planned without the prune: no faster, and its bound held
        full = by_text[text]
        assert "predicted_step_s" in full, full.get("skipped")
        assert full["predicted_step_s"] >= chosen0["predicted_step_s"] * (1 - 1e-12)
        assert row["lower_bound_s"] <= full["predicted_step_s"] * (1 + 1e-9)
    for row in table:  # every planned candidate's predicted step is at least its schedule's value
        if "predicted_step_s" in row:
            assert row["predicted_step_s"] >= row["step_time_s"] * (1 - 1e-12)


def test_planner_beat_prunes_only_what_cannot_beat_it():
    """``plan_with_options(beat_s=...)``: above the plan's value the same plan; at or below the schedule's bound
    :class:`~fxpipe.planner.CandidatePruned` with that bound, which is at most the value (sound); it pickles
    (raised in the search's worker processes)."""
    g = _chain(seed=3)
    opts = PlanOptions(time_limit_s=0.3, seed=0, schedule_time_limit_s=0)
    kw = dict(devices=4, microbatches=4, options=opts, memory=MemoryModel(), explain=False)
    part, problem, sched, _ = planner.plan_with_options(g, **kw)
    part2, _, sched2, _ = planner.plan_with_options(g, beat_s=float(sched.value) * 1.001, **kw)
    assert (part2.assignment == part.assignment).all() and sched2.value == sched.value
    with pytest.raises(planner.CandidatePruned) as err:
        planner.plan_with_options(g, beat_s=0.0, **kw)
    assert 0 < err.value.lower_bound_s <= float(sched.value) * (1 + 1e-9)
    back = pickle.loads(pickle.dumps(err.value))
    assert isinstance(back, planner.CandidatePruned) and back.lower_bound_s == err.value.lower_bound_s


def test_planner_reports_a_candidate_pruned_while_scheduling(monkeypatch):
    """When the schedule search, given the best so far, finds nothing that may beat it
    (:class:`~fxpipe.schedule.auto.ScheduleCannotBeat`), the planner raises
    :class:`~fxpipe.planner.CandidatePruned` marked ``while_scheduling`` with the candidate's schedule lower bound,
    which stays at most the value of the schedule it would have found."""
    from fxpipe.schedule.auto import ScheduleCannotBeat

    g = _chain(seed=3)
    opts = PlanOptions(time_limit_s=0.3, seed=0, schedule_time_limit_s=0)
    kw = dict(devices=4, microbatches=4, options=opts, memory=MemoryModel(), explain=False)
    _, _, sched, _ = planner.plan_with_options(g, **kw)

    def cannot_beat(problem, beat_s=None, **_):
        assert beat_s is not None  # the planner passes the best so far down
        raise ScheduleCannotBeat(f"no method's bound is below {beat_s}")

    monkeypatch.setattr(planner, "auto_schedule", cannot_beat)
    with pytest.raises(planner.CandidatePruned) as err:
        planner.plan_with_options(g, beat_s=float(sched.value) * 1.001, **kw)
    assert err.value.while_scheduling and "pruned while scheduling" in str(err.value)
    assert 0 < err.value.lower_bound_s <= float(sched.value) * (1 + 1e-9)
    assert pickle.loads(pickle.dumps(err.value)).while_scheduling


def test_planning_key_orders_by_the_bubble():
    """The order estimate stretches the bound by the 1F1B bubble: a deep pipeline of few micro-batches comes after
    a data-parallel mesh of the same bound; one stage is the bound itself."""
    assert ms.planning_key_s(1.0, {"pp": 1, "dp_shard": 8}, 8) == 1.0
    assert ms.planning_key_s(1.0, {"pp": 8}, 8) == pytest.approx(15 / 8)
    assert ms.planning_key_s(1.0, {"pp": 4, "dp_shard": 2}, 8) < ms.planning_key_s(1.0, {"pp": 8}, 8)
