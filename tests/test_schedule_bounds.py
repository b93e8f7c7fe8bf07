"""The combinatorial lower bounds are sound and reasonably tight.

Oracles: ``tests/naive_schedule.exhaustive_optimum`` (enumeration + LP timing) on tiny
problems with and without memory limits and offload; every valid heuristic schedule on
random larger problems (hypothesis); hand-derived values (Zero Bubble's toy instances,
one-stash-in-flight pipelines); the MILP's proven optimum where the bound is its cut.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from naive_schedule import exhaustive_optimum

from fxpipe.errors import FxpipeError, InfeasibleError
from fxpipe.ir import ScheduleProblem
from fxpipe.schedule import (
    METHODS,
    combinatorial_lower_bound,
    generate,
    milp,
    stage_span_bounds,
)
from fxpipe.schedule.bounds import (
    chain_stage_span_bounds,
    memory_lower_bound,
    memory_stage_span_bounds,
    memory_time_stage_span_bounds,
    recompute_lower_bound,
    round_trip_lower_bound,
)
from fxpipe.schedule.validate import check_schedule


@st.composite
def tiny_problems(draw):
    S, M = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (4, 1)]))
    t = st.integers(0, 4)
    return ScheduleProblem.create(
        num_stages=S,
        num_microbatches=M,
        t_f=[draw(st.integers(1, 4)) for _ in range(S)],
        t_b=[draw(t) for _ in range(S)],
        t_w=[draw(t) for _ in range(S)],
        t_comm=[draw(st.integers(0, 2)) for _ in range(S - 1)],
        objective=draw(st.sampled_from(["stage_span", "makespan"])),
    )


@settings(max_examples=12, deadline=None)
@given(tiny_problems())
def test_lower_bound_below_exhaustive_optimum(problem):
    opt, sched = exhaustive_optimum(problem)
    lb = combinatorial_lower_bound(problem)
    assert lb <= opt + 1e-9
    assert sched.value == pytest.approx(opt)


@pytest.mark.parametrize("limit,t_off", [(3.0, 0.5), (4.0, 2.0)])
def test_lower_bound_sound_with_memory_and_offload(limit, t_off):
    for obj in ("stage_span", "makespan"):
        p = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=[1, 2], t_b=[2, 1], t_w=[1, 1],
                                   t_comm=[1], t_offload=t_off, mem_f=2.0, mem_b=-1.0, mem_w=-1.0,
                                   mem_limit=limit, objective=obj)
        opt, _ = exhaustive_optimum(p)
        assert combinatorial_lower_bound(p) <= opt + 1e-9


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 10), st.integers(1, 5), st.integers(0, 5), st.integers(0, 5),
       st.integers(0, 3), st.sampled_from(["stage_span", "makespan"]))
def test_lower_bound_below_every_heuristic(S, M, f, b, w, c, obj):
    p = ScheduleProblem.create(num_stages=S, num_microbatches=M, t_f=f, t_b=b, t_w=w, t_comm=c, objective=obj)
    lb = combinatorial_lower_bound(p)
    assert lb >= M * (f + b + w) - 1e-9  # at least the busy time of a stage
    for method in METHODS:
        assert generate(p, method).value >= lb - 1e-9


def test_bound_exact_cases():
    # one stage: no bubbles at all
    p = ScheduleProblem.create(num_stages=1, num_microbatches=5, t_f=2, t_b=3, t_w=1)
    assert combinatorial_lower_bound(p) == 30
    # one micro-batch: the whole chain is the critical path
    p = ScheduleProblem.create(num_stages=3, num_microbatches=1, t_f=[1, 2, 3], t_b=[3, 2, 1], t_w=[1, 1, 1],
                               t_comm=[1, 2], objective="makespan")
    assert combinatorial_lower_bound(p) == (1 + 2 + 3) + (3 + 2 + 1) + 2 * (1 + 2) + 1
    # uniform F = B = W, many micro-batches: ZB-H2 reaches the bound (zero bubble)
    p = ScheduleProblem.create(num_stages=4, num_microbatches=8, t_f=1, t_b=1, t_w=1, mem_f=2, mem_b=-1, mem_w=-1)
    assert generate(p, "zb-h2").stage_span == combinatorial_lower_bound(p) == 24
    assert stage_span_bounds(p).shape == (4,)


# ---------------------------------------------------------------- memory-aware bound


def _memory_problem(draw, S, M, *, t_max, comm_max, offload_s, mem_f, freed_by_b, limit_x):
    """A drawn S-stage, M-micro-batch problem with memory: each stage's F stashes one of ``mem_f``,
    its B frees a drawn fraction (``freed_by_b``) of it and its W the rest; an offload moves none,
    half or all of the stash in one of ``offload_s`` seconds; the limit is a drawn multiple
    (``limit_x``) of the stash. F, B, W and comm times are integers up to ``t_max`` / ``comm_max``."""
    mf = [draw(st.sampled_from(mem_f)) for _ in range(S)]
    frac = [draw(st.sampled_from(freed_by_b)) for _ in range(S)]
    f_max, b_max, w_max = t_max
    return ScheduleProblem.create(
        num_stages=S,
        num_microbatches=M,
        t_f=[draw(st.integers(1, f_max)) for _ in range(S)],
        t_b=[draw(st.integers(0, b_max)) for _ in range(S)],
        t_w=[draw(st.integers(0, w_max)) for _ in range(S)],
        t_comm=[draw(st.integers(0, comm_max)) for _ in range(S - 1)],
        t_offload=[draw(st.sampled_from(offload_s)) for _ in range(S)],
        mem_f=mf,
        mem_b=[-x * f for x, f in zip(mf, frac)],
        mem_w=[-x * (1 - f) for x, f in zip(mf, frac)],
        offload_bytes=[x * draw(st.sampled_from([0.0, 0.5, 1.0])) for x in mf],
        mem_limit=[x * draw(st.sampled_from(limit_x)) for x in mf],
        objective=draw(st.sampled_from(["stage_span", "makespan"])),
    )


@st.composite
def tiny_memory_problems(draw):
    S, M = draw(st.sampled_from([(2, 2), (2, 2), (1, 3), (3, 1), (1, 2)]))
    return _memory_problem(draw, S, M, t_max=(3, 3, 2), comm_max=1, offload_s=[0.0, 0.5, 1.0, 3.0], mem_f=[1.0],
                           freed_by_b=[0.0, 0.5, 1.0], limit_x=[1.0, 1.5, 2.0, 100.0])


@settings(max_examples=15, deadline=None)
@given(tiny_memory_problems())
def test_memory_bound_below_exhaustive_optimum(problem):
    opt, _ = exhaustive_optimum(problem)
    assert memory_lower_bound(problem) <= opt + 1e-9
    assert combinatorial_lower_bound(problem) <= opt + 1e-9


@pytest.mark.parametrize("kw,want_lb,want_opt", [
    # slow offload: the second forward waits for the first stash's offload (or for B)
    ({"t_f": 1, "t_b": 1, "t_w": 1, "mem_b": -0.5, "mem_w": -0.5, "mem_limit": 1.0, "t_offload": 2.0}, 8.0, 10.0),
    # no offload at all: one stash at a time on each stage
    ({"t_f": 1, "t_b": 1, "t_w": 1, "mem_b": -0.5, "mem_w": -0.5, "mem_limit": 1.0, "offload_bytes": 0.0}, 10.0, 10.0),
    ({"t_f": [2, 1], "t_b": [1, 2], "t_w": [1, 0], "t_comm": 1, "mem_b": -0.5, "mem_w": -0.5, "mem_limit": 1.2,
      "t_offload": 3, "offload_bytes": 0.5}, 18.0, 18.0),
])
def test_memory_bound_tighter_than_round_trip(kw, want_lb, want_opt):
    # the old (memory-blind) bound is 7 / 7 / 11 on these
    p = ScheduleProblem.create(num_stages=2, num_microbatches=2, mem_f=1.0, **kw)
    opt, _ = exhaustive_optimum(p)
    assert opt == pytest.approx(want_opt)
    assert round_trip_lower_bound(p) < want_lb - 0.5
    assert combinatorial_lower_bound(p) == pytest.approx(want_lb)


@st.composite
def memory_problems(draw):
    S, M = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    return _memory_problem(draw, S, M, t_max=(4, 4, 4), comm_max=2, offload_s=[0.0, 0.5, 1.0, 2.0, 4.0],
                           mem_f=[1.0, 2.0], freed_by_b=[0.0, 0.25, 0.5, 1.0], limit_x=[1.0, 1.5, 2.0, 3.0, 5.0, 100.0])


@settings(max_examples=40, deadline=None)
@given(memory_problems())
def test_memory_bound_below_every_valid_heuristic(problem):
    lb = combinatorial_lower_bound(problem)
    assert lb >= round_trip_lower_bound(problem)
    for method in METHODS:
        try:
            s = generate(problem, method)
        except FxpipeError:
            continue  # this heuristic does not fit the memory limit
        if check_schedule(problem, s.ops):
            continue
        assert s.value >= lb - 1e-9 * max(1.0, lb), method


def _toy(limit):
    return ScheduleProblem.create(num_stages=4, num_microbatches=12, t_f=5, t_b=6, t_w=4, t_comm=0, mem_f=2,
                                  mem_b=-1, mem_w=-1, offload_bytes=0, mem_limit=limit)


def test_zero_bubble_toy_instances():
    # Zero Bubble's toy instances (limits of 5 and 7 stashes, no offload): the warm-up of
    # stage 0 needs F + D = 38 but only 5 (7) forwards fit: 180 + 13 = 193, 180 + 3 = 183,
    # the optima the MILP proves (benchmarks/bench_schedule.py table (a))
    for limit, want in ((10, 193.0), (14, 183.0)):
        p = _toy(limit)
        assert round_trip_lower_bound(p) == 180.0
        assert memory_lower_bound(p) == want
        assert combinatorial_lower_bound(p) == want
        sched = generate(p, "greedy")
        assert not check_schedule(p, sched.ops) and sched.value >= want
    prof = ScheduleProblem.create(num_stages=4, num_microbatches=12, t_f=5478, t_b=5806, t_w=3534, t_comm=200,
                                  mem_f=2, mem_b=-1, mem_w=-1, offload_bytes=0, mem_limit=32)
    assert combinatorial_lower_bound(prof) <= 178898.0
    unit = ScheduleProblem.create(num_stages=32, num_microbatches=16, t_f=1, t_b=1, t_w=1, mem_f=2, mem_b=-1,
                                  mem_w=-1, offload_bytes=0, mem_limit=64)
    assert combinatorial_lower_bound(unit) == 95.0


def test_memory_bound_hand_derived_and_monotone():
    # p=2, m=4, F=B=W=1, one stash without offload. Stage 0: D = 2; head x = 1 leaves idle
    # F + D - F = 2; at the last F start 4 - (y_B + y_W)/2 <= 1 needs y_B = y_W = 3, so the
    # tail holds F + B + W = 3 of work in a window >= F + D + B + W = 5: idle 2. 12 + 4 = 16.
    p = ScheduleProblem.create(num_stages=2, num_microbatches=4, t_f=1, t_b=1, t_w=1, mem_f=1, mem_b=-0.5,
                               mem_w=-0.5, offload_bytes=0, mem_limit=1)
    assert memory_stage_span_bounds(p).tolist() == [16.0, 12.0]
    assert round_trip_lower_bound(p) == 12.0
    # unlimited memory: the memory-aware argument does not apply (and adds nothing)
    q = ScheduleProblem.create(num_stages=4, num_microbatches=8, t_f=1, t_b=2, t_w=1, t_comm=0.5)
    assert combinatorial_lower_bound(q) == round_trip_lower_bound(q)
    # a smaller limit or a slower offload never lowers the bound
    grid = {}
    for limit in (100.0, 8.0, 6.0, 4.0, 2.0):
        for tau in (0.5, 1.0, 2.0, 4.0):
            r = ScheduleProblem.create(num_stages=8, num_microbatches=16, t_f=1, t_b=1, t_w=1, t_offload=tau,
                                       mem_f=1, mem_b=-0.5, mem_w=-0.5, mem_limit=limit)
            grid[limit, tau] = combinatorial_lower_bound(r)
    for (limit, tau), lb in grid.items():
        assert lb >= 48.0
        for (l2, t2), lb2 in grid.items():
            if l2 <= limit and t2 >= tau:
                assert lb2 >= lb - 1e-12
    assert grid[2.0, 4.0] > 48.0


def test_milp_uses_the_bound_as_an_objective_cut():
    # no offloadable bytes, 4 stashes per stage: the warm-up bubble makes ZB-H1's 27 optimal;
    # the round-trip bound (24) cannot show it, the memory-aware bound does
    p = ScheduleProblem.create(num_stages=4, num_microbatches=8, t_f=1, t_b=1, t_w=1, mem_f=1, mem_b=-0.5,
                               mem_w=-0.5, offload_bytes=0, mem_limit=4)
    assert round_trip_lower_bound(p) == 24.0
    assert combinatorial_lower_bound(p) == 27.0
    model, _ = milp.build_model(p, warm_start=generate(p, "zb-h1"))
    assert any(c.name == "comb_lb" for c in model.getConss())
    res = milp.solve(p, time_limit_s=30)
    assert check_schedule(p, res.ops) == []
    assert res.value == pytest.approx(27.0)
    assert res.lower_bound_s == pytest.approx(27.0)
    assert res.status == "optimal"
    # one stage: the bound is the busy time, no extra constraint
    q = ScheduleProblem.create(num_stages=1, num_microbatches=3, t_f=1, t_b=1, t_w=1)
    assert combinatorial_lower_bound(q) == 9.0
    model, _ = milp.build_model(q)
    assert not any(c.name == "comb_lb" for c in model.getConss())


def test_memory_time_bound_one_stash_in_flight():
    # stage 0 holds one stash (no offload) for F + D = 1 + 10 = 11 per micro-batch (B frees
    # all of it): Little's law gives 4 * 11 / 1 = 44; the warm-up/drain bound only
    # 12 + 10 (head, x = 1) + 7 (tail: y_B = 3, y_W = 0 leaves 1 + 1 + 4 work in >= 13) = 29
    p = ScheduleProblem.create(num_stages=2, num_microbatches=4, t_f=[1, 5], t_b=[1, 5], t_w=[1, 0], mem_f=1,
                               mem_b=-1, mem_w=0, offload_bytes=0, mem_limit=[1, math.inf])
    lt = memory_time_stage_span_bounds(p)
    assert lt[0] == pytest.approx(44.0, rel=1e-6) and lt[0] <= 44.0
    assert lt[1] == -math.inf
    assert memory_stage_span_bounds(p)[0] == 29.0
    assert combinatorial_lower_bound(p) == pytest.approx(44.0, rel=1e-6)
    vals = []
    for method in METHODS:
        try:
            s = generate(p, method)
        except FxpipeError:
            continue
        if not check_schedule(p, s.ops):
            vals.append(s.value)
    assert vals and min(vals) >= 44.0
    # offloading a fast copy shortens each stash's stay: the bound drops accordingly
    q = ScheduleProblem.create(num_stages=2, num_microbatches=4, t_f=[1, 5], t_b=[1, 5], t_w=[1, 0], mem_f=1,
                               mem_b=-1, mem_w=0, offload_bytes=1, t_offload=1, mem_limit=[1, math.inf])
    # n offloaded: max((n (1 + 2) + (4 - n) 11) / 1, 2 n) is smallest at n = 4: 12
    assert memory_time_stage_span_bounds(q)[0] == pytest.approx(12.0, rel=1e-6)


# ---------------------------------------------------------------- downstream chain bound (part 6)


def test_chain_bound_is_the_optimum_where_the_old_bounds_were_not():
    # a slow last stage: stage 0's span holds F0 + B0 (the round trip) and all of stage 1's
    # F and B work: 1 + 1 + 2 (2 + 2) + W0 1 = 11; parts 1-5 gave 9 (stage 0 fills its head)
    p = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=[1, 2], t_b=[1, 2], t_w=[1, 0])
    assert chain_stage_span_bounds(p).tolist() == [11.0, -math.inf]
    assert combinatorial_lower_bound(p) == 11.0 == exhaustive_optimum(p)[0]


@pytest.mark.parametrize("recompute", [False, True])
def test_chain_bound_counts_the_w_passes_memory_forces(recompute):
    # stage 1 may owe no W at its last B's start (each owed W holds -w = 1 byte of a 1.5 / 1.6
    # limit), so one W of stage 1 runs before that B: 2 + 2 (1 + B1) + 1 + 1 more than blind
    if recompute:  # B1 replays F1 (B1 = 2) and holds inputs + replayed stash: a + b + tr = 1.25
        p = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=1, t_w=1, mem_f=1, mem_b=-0.5,
                                   mem_w=-0.5, offload_bytes=0, mem_limit=[100, 1.6],
                                   recompute_mem_f=0.25).with_recompute([1])
        want = 10.0
    else:
        p = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=1, t_w=1, mem_f=1, mem_b=0, mem_w=-1,
                                   offload_bytes=0, mem_limit=[100, 1.5])
        want = 8.0
    assert chain_stage_span_bounds(p, memory=False)[0] == want - 1.0
    assert chain_stage_span_bounds(p)[0] == want
    assert combinatorial_lower_bound(p) == want == exhaustive_optimum(p)[0]


@st.composite
def recompute_problems(draw, max_stages=6):
    """A memory problem (as :func:`memory_problems`) with a drawn ``recompute_mem_f`` and a drawn
    set of stages to recompute."""
    S, M = draw(st.integers(1, max_stages)), draw(st.integers(1, 12))
    p = _memory_problem(draw, S, M, t_max=(4, 4, 4), comm_max=2, offload_s=[0.0, 0.5, 1.0, 2.0, 4.0],
                        mem_f=[1.0, 2.0], freed_by_b=[0.0, 0.25, 0.5, 1.0], limit_x=[1.0, 1.5, 2.0, 3.0, 5.0, 100.0])
    keep = [float(p.mem_f[s]) * draw(st.sampled_from([0.25, 0.5, 1.0])) for s in range(S)]
    return p.replace(recompute_mem_f=keep), [s for s in range(S) if draw(st.booleans())]


@settings(max_examples=60, deadline=None)
@given(recompute_problems())
def test_bounds_below_every_valid_heuristic_with_recomputation(drawn):
    base, rec = drawn
    problem = base.with_recompute(rec)
    lb = combinatorial_lower_bound(problem)
    assert lb >= max(chain_stage_span_bounds(problem)) - 1e-9 * max(1.0, lb)
    for method in ("1f1b", "zb-h1", "zb-h2", "greedy", "pipeoffload", "adaoffload"):  # offload-search: 2 s each
        try:
            s = generate(problem, method)
        except FxpipeError:
            continue
        if check_schedule(problem, s.ops):
            continue
        assert s.value >= lb - 1e-9 * max(1.0, lb), method


@st.composite
def tiny_recompute_problems(draw):
    S, M = draw(st.sampled_from([(2, 2), (1, 3), (3, 1)]))
    p = _memory_problem(draw, S, M, t_max=(3, 3, 2), comm_max=1, offload_s=[0.5], mem_f=[1.0],
                        freed_by_b=[0.0, 0.5, 1.0], limit_x=[1.5, 2.0, 2.5])
    p = p.replace(offload_bytes=0.0, recompute_mem_f=[draw(st.sampled_from([0.25, 0.5])) for _ in range(S)])
    return p.with_recompute([s for s in range(S) if draw(st.booleans())])


@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(tiny_recompute_problems())
def test_bound_below_exhaustive_optimum_with_recomputation(problem):
    try:
        opt, _ = exhaustive_optimum(problem)
    except InfeasibleError:  # the replay does not fit beside the stash: no schedule to bound
        return
    assert combinatorial_lower_bound(problem) <= opt + 1e-9


@settings(max_examples=25, deadline=None)
@given(recompute_problems(max_stages=4), st.data())
def test_recompute_bound_below_every_recompute_choice(drawn, data):
    # part 7: below the combinatorial bound (hence every schedule) of each of the 2^S choices,
    # also with several stages on a device
    base, _ = drawn
    S = base.num_stages
    dev = data.draw(st.lists(st.integers(0, S - 1), min_size=S, max_size=S))
    used = sorted(set(dev))
    base = base.replace(num_devices=len(used), device_of_stage=[used.index(d) for d in dev],
                        mem_limit=[data.draw(st.sampled_from([2.0, 3.0, 5.0, 8.0, math.inf])) for _ in used])
    lb = recompute_lower_bound(base)
    S = base.num_stages
    for mask in range(2 ** S):
        q = base.with_recompute([s for s in range(S) if mask >> s & 1])
        assert lb <= combinatorial_lower_bound(q) * (1 + 1e-9) + 1e-12, mask


@settings(max_examples=60, deadline=None)
@given(memory_problems(), st.sampled_from(["stage_span", "makespan"]), st.data())
def test_the_combined_bound_is_the_larger_of_its_two_parts(problem, objective, data):
    # combinatorial_lower_bound computes each per-stage bound once for both parts: the same value, bit for bit
    problem = problem.replace(objective=objective)
    if data.draw(st.booleans()) and problem.num_stages > 1:
        problem = problem.with_recompute([0])
    assert combinatorial_lower_bound(problem) == max(round_trip_lower_bound(problem), memory_lower_bound(problem))
