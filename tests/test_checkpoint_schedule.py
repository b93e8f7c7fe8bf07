"""The schedule problem's checkpoint menu (issue 28): its fields and their validation, the derived
problems, fused backwards, the bound over every choice, and what ``auto`` picks."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import InputError
from fxpipe.ir import CheckpointOption, ScheduleProblem, schedule_to_orders
from fxpipe.ir.lowering import merge_backward
from fxpipe.schedule.auto import auto_schedule, checkpoint_ladder, least_memory
from fxpipe.schedule.bounds import combinatorial_lower_bound, recompute_lower_bound
from fxpipe.schedule.heuristics import generate
from fxpipe.schedule.validate import check_schedule, place_fused_w, memory_profile, peak_memory


def menu_problem(S=2, m=4, mem_limit=math.inf, pooled=0.0, t_w=1.0, fused=True):
    """Stages with a stash of 10 bytes (W keeps 4 of it) and three options: selective (replay 0.3 s, keeps 5,
    B peak 2 beyond, W inputs 4), full (replay 0.8 s, keeps 1, peak 1: its B's level is the 4 W inputs) and
    full fused (W's time in B, nothing held for W: level 2)."""
    menu = []
    for _ in range(S):
        opts = [CheckpointOption("none", 0.0, 10.0, 0.0, 4.0),
                CheckpointOption("selective", 0.3, 5.0, 2.0, 4.0),
                CheckpointOption("full", 0.8, 1.0, 1.0, 4.0)]
        if fused:
            opts.append(CheckpointOption("full-fused", 0.8, 1.0, 1.0, 0.0, t_w))
        menu.append(opts)
    return ScheduleProblem.create(num_stages=S, num_microbatches=m, t_f=1.0, t_b=1.0, t_w=t_w, mem_f=10.0 + pooled,
                                  mem_b=-6.0, mem_w=-4.0 - pooled, offload_bytes=0.0, pooled_bytes=pooled,
                                  mem_limit=mem_limit, checkpoint_menu=menu)


def test_with_checkpoint_sets_the_fields_of_the_option():
    p = menu_problem(pooled=2.0)
    assert p.checkpoint == ("none", "none") and p.recompute == (False, False)
    q = p.with_checkpoint({1: "selective"})
    assert q.checkpoint == ("none", "selective") and q.recompute == (False, True) and q.recompute_stages == (1,)
    assert q.t_b[1] == pytest.approx(1.3) and q.t_w[1] == 1.0 and q.offload_bytes[1] == 0.0
    assert q.mem_f[1] == pytest.approx(7.0)  # kept 5 + pooled 2
    assert -q.mem_w[1] == pytest.approx(6.0)  # W inputs 4 + pooled 2
    assert q.mem_f[1] + q.mem_b_start[1] == pytest.approx(9.0)  # B's level: kept + pooled + peak
    r = q.with_checkpoint({1: "full-fused"})  # an option to another: the replay and W move, no base lost
    assert r.t_b[1] == pytest.approx(1.0 + 0.8 + 1.0) and r.t_w[1] == 0.0
    assert r.mem_f[1] == pytest.approx(3.0) and r.mem_w[1] == pytest.approx(-2.0)
    assert r.mem_f[1] + r.mem_b_start[1] == pytest.approx(4.0)  # kept + pooled + peak, nothing held for W
    back = r.with_checkpoint({1: "full"})
    assert back.t_b[1] == pytest.approx(1.8) and back.t_w[1] == pytest.approx(1.0)
    with pytest.raises(InputError, match="cannot go back to 'none'"):
        q.with_checkpoint({1: "none"})
    with pytest.raises(InputError, match="no checkpoint option 'bogus'"):
        p.with_checkpoint({0: "bogus"})
    # JSON: the menu and the choice round-trip; a document without them is the default menu
    again = ScheduleProblem.from_dict(r.to_dict())
    assert again.checkpoint == r.checkpoint and again.checkpoint_menu == r.checkpoint_menu
    np.testing.assert_array_equal(again.t_b, r.t_b)
    legacy = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1.0, t_b=1.0, t_w=1.0, mem_f=4.0,
                                    recompute_mem_f=1.0)
    doc = legacy.with_recompute([0]).to_dict()
    assert "checkpoint" not in doc and "checkpoint_menu" not in doc and doc["recompute"] == [True, False]
    old = ScheduleProblem.from_dict(doc)
    assert old.checkpoint == ("stage", "none") and [o.name for o in old.checkpoint_menu[0]] == ["none", "stage"]


def test_bad_menus_and_choices_name_the_field():
    base = dict(num_stages=1, num_microbatches=2, t_f=1.0, t_b=1.0, t_w=1.0, mem_f=10.0, mem_w=-4.0, mem_b=-6.0,
                offload_bytes=0.0)
    none = CheckpointOption("none", 0.0, 10.0, 0.0, 4.0)
    full = CheckpointOption("full", 0.5, 1.0, 3.0, 4.0)
    cases = [
        (dict(checkpoint_menu=[[full]]), "must hold the option 'none'"),
        (dict(checkpoint_menu=[[none, full, full]]), "names an option twice"),
        (dict(checkpoint_menu=[[none, full]], checkpoint=["fancy"]), "not in its menu"),
        (dict(checkpoint_menu=[[none, full]], checkpoint=["full"], recompute=[False]), "recompute is False"),
        (dict(checkpoint_menu=[[none, full]], checkpoint=["full"]), r"mem_f \(kept_bytes \+ pooled_bytes\)"),
        (dict(checkpoint_menu=[[none, {"name": "full", "replay_s": -1}]]), "replay_s must be finite and >= 0"),
        (dict(checkpoint_menu=[[CheckpointOption("none", 0.0, 10.0, 1.0)]]), "replays nothing"),
        (dict(checkpoint_menu=[[none]], checkpoint=["none", "none"]), "each of the 1 stages"),
    ]
    for extra, msg in cases:
        with pytest.raises(InputError, match=msg):
            ScheduleProblem.create(**{**base, **extra})
    with pytest.raises(InputError, match="checkpoint_menu"):
        ScheduleProblem.from_dict({"num_stages": 1, "num_microbatches": 1, "t_f": [1], "t_b": [1], "t_w": [1],
                                   "checkpoint_menu": [[{"replay_s": 1.0}]]})
    fused = CheckpointOption("full-fused", 0.5, 1.0, 3.0, 0.0, 1.0)
    ok = ScheduleProblem.create(**{**base, "checkpoint_menu": [[none, fused]]}).with_checkpoint({0: "full-fused"})
    with pytest.raises(InputError, match="fuses W into B"):
        ok.replace(t_w=0.5)


def test_the_validator_counts_the_option_s_memory():
    """One micro-batch at a time: memory rises to kept at F, to the B's level when B starts, holds the W
    inputs until W; a limit below the level is refused."""
    p = menu_problem(S=1, m=2).with_checkpoint({0: "selective"})
    sched = generate(p.replace(mem_limit=math.inf), "1f1b")
    _, mem = memory_profile(p, sched.ops, 0)
    assert float(mem.max()) == pytest.approx(5.0 + 2.0)  # the B's level: kept + its peak
    assert check_schedule(p.replace(mem_limit=7.0), sched) == []
    assert any("over its limit" in v for v in check_schedule(p.replace(mem_limit=6.9), sched))
    two = generate(p.replace(mem_limit=math.inf), "gpipe")  # both forwards first: a kept stash beside a B
    _, mem = memory_profile(p, two.ops, 0)
    assert float(mem.max()) == pytest.approx(5.0 + 7.0)


def test_a_fused_stage_runs_each_w_right_after_its_b_and_the_runtime_fuses_them():
    p = menu_problem(S=3, m=6).with_checkpoint({1: "full-fused"})
    for method in ("zb-h1", "1f1b", "zb-h2"):
        sched = place_fused_w(p, generate(p, method))
        assert check_schedule(p, sched) == []
        b_end = {o.microbatch: o.end_s for o in sched.ops if o.stage == 1 and o.type == "B"}
        assert all(o.start_s == o.end_s == b_end[o.microbatch] for o in sched.ops if o.stage == 1 and o.type == "W")
        orders = schedule_to_orders(sched, p)
        lowered = merge_backward(orders.of_device(1))
        assert [str(a) for a in lowered if a.stage == 1 and a.type in ("B", "W")] == []  # every one a full backward
        assert sum(a.type == "BW" for a in lowered) == p.num_microbatches


def _choices(problem):
    names = [[o.name for o in problem.checkpoint_menu[s]] for s in range(problem.num_stages)]
    return itertools.product(*names)


@settings(max_examples=25, deadline=None)
@given(S=st.integers(1, 3), m=st.integers(1, 4), limit=st.sampled_from([14.0, 20.0, 30.0, 60.0, math.inf]),
       pooled=st.sampled_from([0.0, 1.0]), t_w=st.sampled_from([0.5, 2.0]))
def test_the_bound_over_checkpoint_choices_is_below_every_choice(S, m, limit, pooled, t_w):
    p = menu_problem(S=S, m=m, mem_limit=limit, pooled=pooled, t_w=t_w)
    lb = recompute_lower_bound(p)
    for choice in _choices(p):
        q = p.with_checkpoint(list(choice))
        assert lb <= combinatorial_lower_bound(q) * (1 + 1e-9) + 1e-12, choice


def test_auto_checkpoints_only_where_memory_binds_and_no_worse_than_uniform_policies():
    free = auto_schedule(menu_problem(S=3, m=6), time_limit_s=0)
    assert free.checkpoint == ("none",) * 3 and free.tried["binding"] is False
    # 1F1B holds 3, 2, 1 stashes of 10 bytes: 22 bytes bind on stage 0 only
    res = auto_schedule(menu_problem(S=3, m=6, mem_limit=22.0), time_limit_s=0)
    assert check_schedule(res.problem, res.schedule) == []
    assert res.checkpoint[0] != "none" and res.checkpoint[1:] == ("none", "none")
    assert checkpoint_ladder(menu_problem(S=3, m=6), 0) == ["none", "selective", "full", "full-fused"]
    tight = menu_problem(S=3, m=6, mem_limit=9.0)
    res = auto_schedule(tight, time_limit_s=0)
    assert check_schedule(res.problem, res.schedule) == []
    vals = [v for k, v in res.tried.items() if k.startswith(("full-all/", "selective-all/")) and isinstance(v, float)]
    assert all(res.schedule.value <= v * (1 + 1e-9) for v in vals)
    assert least_memory(tight).checkpoint == ("full-fused",) * 3
    off = auto_schedule(tight.replace(mem_limit=25.0), recompute=False, time_limit_s=0)
    assert off.checkpoint == ("none",) * 3
    assert float(np.max(peak_memory(res.problem, res.schedule.ops))) <= 9.0 * (1 + 1e-9)


def test_the_milp_schedules_the_chosen_options():
    """The MILP takes a problem whose stages run checkpoint options (one fused, one split) as it takes any
    Contract-3 problem: its schedule is valid, never worse than the heuristic it starts from, and proven."""
    import fxpipe.schedule.milp as milp

    p = menu_problem(S=2, m=3, mem_limit=12.0).with_checkpoint({0: "full-fused", 1: "selective"})
    start = place_fused_w(p, generate(p, "1f1b"))
    got = place_fused_w(p, milp.solve(p, time_limit_s=30, warm_start=start))
    assert check_schedule(p, got) == [] and got.value <= start.value * (1 + 1e-9)
    assert got.status == "optimal" and got.value == pytest.approx(combinatorial_lower_bound(p), rel=1e-6)


@settings(max_examples=25, deadline=None)
@given(S=st.integers(1, 4), m=st.integers(1, 5), limit=st.sampled_from([14.0, 20.0, 60.0, math.inf]),
       pooled=st.sampled_from([0.0, 1.0]), t_w=st.sampled_from([0.5, 2.0]), data=st.data())
def test_one_stage_view_reads_as_the_problem_with_that_stage_s_option(S, m, limit, pooled, t_w, data):
    """recompute_lower_bound's per-stage terms read stage s under each option from a view of the
    problem (no problem built per option): the same figures as the problem with_checkpoint builds."""
    from fxpipe.schedule.bounds import _StageView, _reachable, _round_trip, _stage_terms

    p = menu_problem(S=S, m=m, mem_limit=limit, pooled=pooled, t_w=t_w)
    # stages as built may offload some of their stash (no option of the menu says so)
    p = p.replace(offload_bytes=data.draw(st.sampled_from([0.0, 3.0])), t_offload=0.5)
    start = data.draw(st.lists(st.sampled_from([o.name for o in p.checkpoint_menu[0]]), min_size=S, max_size=S))
    base = p.with_checkpoint(start)
    d = _round_trip(base)
    for s in range(S):
        for o in _reachable(base, s):
            q = base.with_checkpoint({s: o.name})
            view = _StageView(base, s, o.name)
            for field in ("t_b", "t_w", "mem_f", "mem_b", "mem_w", "offload_bytes"):
                assert np.allclose(getattr(view, field), getattr(q, field), rtol=0, atol=1e-12), (field, s, o.name)
            assert _stage_terms(view, s, d[s]) == pytest.approx(_stage_terms(q, s), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("S, m, limit", [(2, 4, 14.0), (3, 4, 20.0), (3, 6, 30.0), (4, 8, 24.0)])
def test_auto_with_an_outside_best_keeps_every_checkpoint_choice_that_beats_it(S, m, limit):
    """With checkpoint menus that memory forces: auto_schedule(beat_s=b) returns what it returns
    without b when that beats b, else nothing faster than b."""
    from test_schedule_recompute import check_outside_best

    p = menu_problem(S=S, m=m, mem_limit=limit)
    ref = auto_schedule(p, time_limit_s=0.0)
    for factor in (0.5, 0.95, 1.0 + 1e-6, 1.05, 2.0):
        check_outside_best(p, ref, factor * ref.schedule.value)


@settings(max_examples=20, deadline=None)
@given(S=st.integers(1, 4), m=st.integers(1, 5), limit=st.sampled_from([14.0, 20.0, 60.0, math.inf]),
       offload=st.sampled_from([0.0, 3.0]), data=st.data())
def test_the_bound_is_the_same_as_with_a_problem_built_per_option(S, m, limit, offload, data):
    import fxpipe.schedule.bounds as bounds

    p = menu_problem(S=S, m=m, mem_limit=limit).replace(offload_bytes=offload, t_offload=0.5)
    p = p.with_checkpoint(data.draw(st.lists(st.sampled_from(["none", "selective", "full"]), min_size=S, max_size=S)))
    fast = recompute_lower_bound(p)
    real = bounds._StageView
    try:
        bounds._StageView = lambda problem, s, name: problem.with_checkpoint({s: name})
        slow = recompute_lower_bound(p)
    finally:
        bounds._StageView = real
    assert fast == pytest.approx(slow, rel=1e-12, abs=1e-12)


@settings(max_examples=25, deadline=None)
@given(S=st.integers(1, 4), m=st.integers(1, 5), limit=st.sampled_from([14.0, 20.0, 30.0, 60.0, math.inf]),
       pooled=st.sampled_from([0.0, 1.0]), t_w=st.sampled_from([0.5, 2.0]))
def test_the_memory_blind_bound_without_menus_is_below_every_checkpoint_choice(S, m, limit, pooled, t_w):
    """The planner prunes on round_trip_lower_bound of the problem built without checkpoint menus (no replay) before
    it builds them: below every schedule bound of every choice of the menus."""
    from fxpipe.schedule.bounds import round_trip_lower_bound

    p = menu_problem(S=S, m=m, mem_limit=limit, pooled=pooled, t_w=t_w)
    bare = p.replace(checkpoint_menu=None, checkpoint=None)
    quick = round_trip_lower_bound(bare)
    assert quick <= recompute_lower_bound(p) * (1 + 1e-9) + 1e-12
    for choice in _choices(p):
        assert quick <= combinatorial_lower_bound(p.with_checkpoint(list(choice))) * (1 + 1e-9) + 1e-12, choice


@settings(max_examples=30, deadline=None)
@given(S=st.integers(1, 4), m=st.integers(1, 5), limit=st.sampled_from([14.0, 20.0, 30.0, 60.0, math.inf]),
       offload=st.sampled_from([0.0, 3.0]), pooled=st.sampled_from([0.0, 1.0]), data=st.data())
def test_the_bound_skips_only_thresholds_that_cannot_lower_it(S, m, limit, offload, pooled, data):
    """recompute_lower_bound stops at the first threshold at or above its least value and skips a threshold that
    repeats the choice before it: the same value as the relaxation of every threshold's choice."""
    from fxpipe.schedule.bounds import _recompute_terms, _threshold_choice

    p = menu_problem(S=S, m=m, mem_limit=limit, pooled=pooled).replace(offload_bytes=offload, t_offload=0.5)
    p = p.with_checkpoint(data.draw(st.lists(st.sampled_from(["none", "selective", "full"]), min_size=S, max_size=S)))
    opts, h, value = _recompute_terms(p)
    thetas = sorted({-math.inf} | {v for hs in h for v in hs.values()})
    every = min((value(c) for c in (_threshold_choice(opts, h, t) for t in thetas) if c is not None), default=math.inf)
    assert recompute_lower_bound(p) == every
