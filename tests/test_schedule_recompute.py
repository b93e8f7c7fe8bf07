"""Activation recomputation as a per-stage decision of the schedule problem (issue 9 item 3):
the problem algebra, the validator's transient, heuristics / auto / MILP against an
independent memory check, the exhaustive oracle and the lower bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import ScheduledOp, ScheduleProblem, looped_placement
from fxpipe.schedule.auto import auto_schedule
from fxpipe.schedule.bounds import combinatorial_lower_bound
from fxpipe.schedule.dispatch import make_schedule
from fxpipe.schedule.heuristics import generate
from fxpipe.schedule.validate import check_schedule, memory_profile, peak_memory

from naive_schedule import exhaustive_device_optimum, exhaustive_optimum


def _problem(S=2, m=2, **kw):
    base = dict(num_stages=S, num_microbatches=m, t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0, mem_f=10.0,
                mem_b=-6.0, mem_w=-4.0, offload_bytes=0.0, recompute_mem_f=2.0)
    base.update(kw)
    return ScheduleProblem.create(**base)


def independent_peak(problem: ScheduleProblem, ops) -> np.ndarray:
    """Device memory at every op start, evaluated from scratch (Contract 3 rule 5 read literally):
    started F/B/W deltas, the transient of running B's, minus offloaded stashes; times compared
    with Contract 3's tolerance (``1e-9 * max(1, T)``), as the validator does."""
    ops = list(ops)
    eps = 1e-9 * max([1.0] + [abs(x) for o in ops for x in (o.start_s, o.end_s)])
    out = np.zeros(problem.num_devices)
    oo = {(o.stage, o.microbatch, o.type): o for o in ops}
    for d in range(problem.num_devices):
        mine = [o for o in ops if problem.device_of_stage[o.stage] == d]
        for t in sorted({o.start_s for o in mine}):
            mem = 0.0
            for o in mine:
                s = o.stage
                if o.start_s <= t + eps:
                    mem += {"F": problem.mem_f[s], "B": problem.mem_b[s], "W": problem.mem_w[s]}.get(o.type, 0.0)
                if o.type == "B" and o.start_s <= t + eps and t < o.end_s - eps:
                    mem += problem.mem_b_transient[s]
                if o.type == "O":
                    r = oo[(s, o.microbatch, "R")]
                    if o.end_s <= t + eps and t < r.start_s - eps:
                        mem -= problem.offload_bytes[s]
            out[d] = max(out[d], mem)
    return out


# ------------------------------------------------------------------------------ algebra
def test_with_recompute_fields():
    p = _problem(offload_bytes=10.0, t_offload=0.5)
    q = p.with_recompute([1])
    assert q.recompute == (False, True) and q.recompute_stages == (1,)
    assert q.t_b.tolist() == [1.0, 2.0]  # the replayed forward
    assert q.mem_f.tolist() == [10.0, 2.0]  # the inputs only
    # after B the 4 bytes W needs are held; during B inputs + the whole replayed stash
    assert q.mem_b[1] == 4.0 - 2.0 and q.mem_w[1] == -4.0
    assert q.mem_b_start[1] == 10.0 and q.mem_b_transient[1] == 8.0
    assert q.stash_footprint.tolist() == [10.0, 12.0]
    assert q.offload_bytes.tolist() == [10.0, 0.0]
    assert q.with_recompute([1]) is q and q.with_recompute([True, True]).recompute == (True, True)
    doc = q.to_dict()
    assert doc["recompute"] == [False, True] and ScheduleProblem.from_dict(doc).to_dict() == doc
    # a problem without recomputation writes the same document as before the extension
    old = _problem(recompute_mem_f=None).to_dict()
    assert not {"recompute", "mem_b_transient", "recompute_mem_f"} & set(old)
    with pytest.raises(InputError):
        q.with_recompute([2])


@pytest.mark.parametrize("kw, msg", [
    (dict(mem_b=2.0, mem_w=-12.0), "only a recomputing stage"),
    (dict(recompute=[True, False], offload_bytes=1.0), "offloads nothing"),
    (dict(mem_b_transient=-1.0), "mem_b_transient"),
    (dict(recompute_mem_f=0.0), "recompute_mem_f"),
    (dict(recompute=[True]), "2 booleans"),
])
def test_bad_recompute_fields(kw, msg):
    with pytest.raises(InputError, match=msg):
        _problem(**kw)


def test_validator_counts_the_replay_while_b_runs():
    p = _problem(S=1, m=1, mem_limit=12.0).with_recompute([0])
    ops = [ScheduledOp(0, 0, "F", 0, 1), ScheduledOp(0, 0, "B", 1, 3), ScheduledOp(0, 0, "W", 4, 5)]
    assert check_schedule(p, ops) == []
    times, mem = memory_profile(p, ops, 0)
    assert times.tolist() == [0, 1, 3, 4] and mem.tolist() == [2, 12, 4, 0]
    tight = p.replace(mem_limit=11.9)
    errs = check_schedule(tight, ops)
    assert errs and errs[0].startswith("rule 5") and "12" in errs[0]
    # without recomputation the same stage needs its whole stash in flight, never more
    assert peak_memory(_problem(S=1, m=1), [ScheduledOp(0, 0, "F", 0, 1), ScheduledOp(0, 0, "B", 1, 2),
                                            ScheduledOp(0, 0, "W", 2, 3)]).tolist() == [10.0]


# ------------------------------------------------------------------------------ random problems
@st.composite
def recompute_problems(draw, multi=False):
    S = draw(st.integers(1, 4))
    m = draw(st.integers(1, 4))
    t = lambda: draw(st.lists(st.floats(0.1, 3.0), min_size=S, max_size=S))  # noqa: E731
    mem_f = np.array(draw(st.lists(st.floats(1.0, 10.0), min_size=S, max_size=S)))
    share = np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=S, max_size=S)))
    mem_b = -mem_f * share
    rmf = mem_f * np.array(draw(st.lists(st.floats(0.05, 1.0), min_size=S, max_size=S)))
    flags = draw(st.lists(st.booleans(), min_size=S, max_size=S))
    offload = draw(st.booleans())
    p = ScheduleProblem.create(
        num_stages=S, num_microbatches=m, t_f=t(), t_b=t(), t_w=t(), t_comm=draw(st.floats(0.0, 1.0)),
        t_offload=draw(st.floats(0.05, 2.0)), mem_f=mem_f, mem_b=mem_b, mem_w=-mem_f - mem_b,
        offload_bytes=mem_f if offload else 0.0, recompute_mem_f=rmf,
    ).with_recompute(flags)
    frac = draw(st.floats(0.3, 1.5))
    lim = np.maximum(p.stash_footprint, frac * m * np.maximum(p.mem_f, -p.mem_w) + p.mem_b_transient)
    return p.replace(mem_limit=lim * (1 + 1e-9))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=recompute_problems())
def test_heuristics_with_recompute_are_valid_and_fit(p):
    bound = combinatorial_lower_bound(p)
    found = 0
    for method in ("gpipe", "1f1b", "zb-h1", "zb-h2", "greedy", "pipeoffload", "adaoffload", "offload-search"):
        try:
            sched = generate(p, method)
        except InfeasibleError:
            continue
        found += 1
        assert check_schedule(p, sched) == []
        peak = independent_peak(p, sched.ops)
        assert np.all(peak <= p.mem_limit * (1 + 1e-9)), (method, peak, p.mem_limit)
        assert np.allclose(peak, peak_memory(p, sched))
        assert sched.value >= bound * (1 - 1e-9)
    assert found  # every limit holds the one-at-a-time footprint, so GPipe-like fallbacks exist


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=recompute_problems())
def test_auto_with_recompute_is_valid(p):
    res = auto_schedule(p, time_limit_s=0.0)
    assert check_schedule(res.problem, res.schedule) == []
    assert set(p.recompute_stages) <= set(res.recompute_stages)
    assert np.all(independent_peak(res.problem, res.schedule.ops) <= res.problem.mem_limit * (1 + 1e-9))
    assert res.schedule.lower_bound_s <= res.schedule.value * (1 + 1e-9)
    # never worse than the common fallback: 1F1B with every stage recomputing (where that saves memory)
    full = p.with_recompute([s for s in range(p.num_stages) if p.recompute_mem_f[s] < p.mem_f[s]])
    try:
        fallback = generate(full, "1f1b")
    except InfeasibleError:
        return
    if p.num_devices == p.num_stages and check_schedule(full, fallback) == []:
        assert res.schedule.value <= fallback.value * (1 + 1e-9), (res.schedule.value, fallback.value)


# ------------------------------------------------------------------------------ exact oracles
TINY = [
    # (S, m, limits, flags): the recomputing stage needs the replay on top of its inputs
    (2, 2, [20.0, 14.0], [False, True]),
    (2, 2, [12.0, 12.0], [True, True]),
    (2, 2, [25.0, 30.0], [True, False]),
    (1, 3, [16.0], [True]),
]


@pytest.mark.parametrize("S, m, lim, flags", TINY)
@pytest.mark.parametrize("objective", ["stage_span", "makespan"])
def test_milp_and_bounds_match_exhaustive_with_recompute(S, m, lim, flags, objective):
    p = _problem(S=S, m=m, t_f=[1.0, 2.0][:S], t_b=[2.0, 1.0][:S], t_w=[1.0, 1.5][:S], t_comm=0.5 if S > 1 else 0.0,
                 objective=objective).with_recompute(flags).replace(mem_limit=lim)
    want, ref = exhaustive_optimum(p)
    assert check_schedule(p, ref) == []
    got = make_schedule(p, "milp", time_limit_s=60)
    assert got.status == "optimal"
    assert got.value == pytest.approx(want, rel=1e-6)
    assert combinatorial_lower_bound(p) <= want * (1 + 1e-9)
    assert auto_schedule(p, recompute=False, time_limit_s=0).schedule.value >= want * (1 - 1e-9)


def test_milp_matches_exhaustive_with_recompute_on_a_shared_device():
    # two stages on one device (looped placement, p = 1, v = 2), one micro-batch in two
    p = ScheduleProblem.create(
        num_stages=2, num_microbatches=2, num_devices=1, device_of_stage=looped_placement(1, 2),
        t_f=[1.0, 1.0], t_b=[1.0, 2.0], t_w=[1.0, 1.0], mem_f=[6.0, 6.0], mem_b=[-3.0, -3.0], mem_w=[-3.0, -3.0],
        offload_bytes=0.0, recompute_mem_f=[1.0, 1.0],
    ).with_recompute([True, False]).replace(mem_limit=14.0)
    want, ref = exhaustive_device_optimum(p, fixed_microbatch_order=True)
    assert check_schedule(p, ref) == []
    got = make_schedule(p, "milp", time_limit_s=60)
    assert got.value == pytest.approx(want, rel=1e-6)
    assert combinatorial_lower_bound(p) <= want * (1 + 1e-9)


def test_recompute_trades_time_for_memory_in_the_oracle():
    """The same stage with and without recomputation: recomputing fits a limit that nothing else
    fits (no offload), at the price of the replayed forwards."""
    base = _problem(S=1, m=3, mem_limit=16.0)
    with pytest.raises(InfeasibleError):
        exhaustive_optimum(base.replace(mem_limit=9.0))
    fast, _ = exhaustive_optimum(base.replace(mem_limit=math.inf))
    slow, _ = exhaustive_optimum(base.with_recompute([0]).replace(mem_limit=12.0))
    assert slow == pytest.approx(fast + 3 * 1.0)  # three replayed forwards of 1 s


# ------------------------------------------------------------------------------ auto's choices
def test_auto_recomputes_only_when_forced_and_where_it_pays():
    S, m = 3, 6

    def prob(t_f):
        return ScheduleProblem.create(num_stages=S, num_microbatches=m, t_f=t_f, t_b=1.0, t_w=1.0, mem_f=10.0,
                                      mem_b=-5.0, mem_w=-5.0, offload_bytes=0.0, recompute_mem_f=1.0)

    free = auto_schedule(prob(0.1).replace(mem_limit=1e6), time_limit_s=0)
    assert free.recompute_stages == () and free.offloaded == 0 and free.tried["binding"] is False
    # 1F1B holds 3, 2, 1 stashes (30, 20, 10 bytes): a limit of 25 binds on device 0 only, so
    # only stage 0 may recompute; with a cheap forward that beats fewer forwards in flight
    for t_f in (0.1, 4.0):
        res = auto_schedule(prob(t_f).replace(mem_limit=25.0), time_limit_s=0)
        assert res.tried["binding"] is True
        assert set(res.recompute_stages) <= {0}
        assert check_schedule(res.problem, res.schedule) == []
        assert res.schedule.meta["auto"]["recompute_stages"] == list(res.recompute_stages)
        # the fastest candidate wins
        vals = [v for k, v in res.tried.items() if "/" in k and not k.startswith("unlimited/") and isinstance(v, float)]
        assert res.schedule.value == pytest.approx(min(vals))
        if t_f == 0.1:
            assert res.recompute_stages == (0,)
            assert res.schedule.value < res.tried["plain/zb-h2"]
    # nothing fits when even one micro-batch plus its replay exceeds the limit
    with pytest.raises(InfeasibleError, match="device 0"):
        auto_schedule(prob(0.1).with_recompute([0, 1, 2]).replace(mem_limit=10.5), time_limit_s=0)


def test_auto_recomputes_the_cheapest_stage_of_a_device_first():
    p = ScheduleProblem.create(num_stages=4, num_microbatches=4, num_devices=2, device_of_stage=looped_placement(2, 2),
                               t_f=[0.5, 0.5, 0.1, 0.3], t_b=1.0, t_w=1.0, mem_f=10.0, offload_bytes=0.0,
                               recompute_mem_f=1.0)
    peak = auto_schedule(p.replace(mem_limit=1e6), time_limit_s=0)
    assert peak.recompute_stages == ()
    need = float(np.max(peak_memory(p, peak.schedule)))
    res = auto_schedule(p.replace(mem_limit=0.75 * need), time_limit_s=0)
    assert check_schedule(res.problem, res.schedule) == []
    if res.recompute_stages:
        # on each device the stage with the smallest forward goes first: 2 (device 0), 3 (device 1)
        for d, order in ((0, [2, 0]), (1, [3, 1])):
            mine = [s for s in res.recompute_stages if p.device_of_stage[s] == d]
            assert mine == sorted(order[: len(mine)])


def test_auto_prefers_offload_when_the_copy_stream_keeps_up():
    S, m = 3, 6  # 1F1B needs 30 bytes on stage 0; a 22-byte limit holds two stashes
    p = ScheduleProblem.create(num_stages=S, num_microbatches=m, t_f=2.0, t_b=2.0, t_w=2.0, mem_f=10.0,
                               t_offload=0.1, offload_bytes=10.0, recompute_mem_f=1.0, mem_limit=22.0)
    res = auto_schedule(p, time_limit_s=0)
    assert check_schedule(res.problem, res.schedule) == []
    assert res.recompute_stages == () and res.offloaded > 0
    assert any(k.startswith("recompute") for k in res.tried)  # recomputation was considered too


def test_peak_reads_an_offload_ending_as_an_f_starts_as_one_instant():
    """Found by hypothesis: offload-search starts F(1, 1) when O(1, 0) ends, the two times
    differing by rounding (5e-17 s). check_schedule (Contract 3's tolerance) accepts it; the peak
    must read it the same way (1 stash, not 2 over a limit of 1.5)."""
    doc = {"format": "fxpipe.schedproblem/1", "num_stages": 3, "num_microbatches": 3, "num_devices": 3,
           "device_of_stage": [0, 1, 2], "t_f": [0.109375, 0.109375, 1.0], "t_b": [1.0, 1.0, 1.0],
           "t_w": [1.0, 1.0, 1.0], "t_comm": [0.0, 0.0], "t_offload": [0.05, 0.05, 0.05], "mem_f": [1.0, 1.0, 1.0],
           "mem_b": [0.0, 0.0, 0.0], "mem_w": [-1.0, -1.0, -1.0], "offload_bytes": [1.0, 1.0, 1.0],
           "mem_limit": [1.5000000015] * 3, "pcie_groups": [], "objective": "stage_span"}
    p = ScheduleProblem.from_dict(doc)
    sched = generate(p, "offload-search")
    assert check_schedule(p, sched) == []
    assert np.all(peak_memory(p, sched) <= p.mem_limit * (1 + 1e-9)), peak_memory(p, sched)
    assert np.allclose(independent_peak(p, sched.ops), peak_memory(p, sched))
    from fxpipe.schedule.validate import memory_profile, stage_peaks  # every peak reads it alike

    assert np.allclose(stage_peaks(p, sched), peak_memory(p, sched))
    assert np.allclose([memory_profile(p, sched, s)[1].max() for s in range(3)], peak_memory(p, sched))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=recompute_problems(), factor=st.sampled_from([0.5, 0.9, 0.999, 1.001, 1.2, 3.0]))
def test_auto_with_an_outside_best_finds_every_schedule_that_beats_it(p, factor):
    """auto_schedule(beat_s=b) skips only methods whose bounds are above b: the schedule it returns
    without b is returned with it whenever it beats b; otherwise it returns nothing better than b
    (ScheduleCannotBeat, or a schedule no faster than b)."""
    ref = auto_schedule(p, time_limit_s=0.0)
    check_outside_best(p, ref, factor * ref.schedule.value)


def check_outside_best(p, ref, beat):
    """auto_schedule(p, beat_s=beat) against ``ref`` = auto_schedule(p): the same when ``ref`` beats ``beat``,
    else ScheduleCannotBeat or a valid schedule no faster than ``beat``."""
    from fxpipe.schedule.auto import ScheduleCannotBeat

    try:
        got = auto_schedule(p, time_limit_s=0.0, beat_s=beat)
    except ScheduleCannotBeat:
        assert ref.schedule.value >= beat * (1 - 1e-9)
        return
    assert check_schedule(got.problem, got.schedule) == []
    if ref.schedule.value < beat:
        assert got.schedule.value == pytest.approx(ref.schedule.value, rel=1e-12)
        assert got.problem.checkpoint == ref.problem.checkpoint
    else:
        assert got.schedule.value >= beat * (1 - 1e-9)
