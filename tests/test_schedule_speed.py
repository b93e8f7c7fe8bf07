"""The shortcuts that keep ``schedule="auto"`` fast never change what it returns.

* ``auto.limited_1f1b`` skips warm-ups that :func:`~fxpipe.schedule.heuristics.warmup_overflow_bytes`
  proves over the limit: every one of them is refused by the validator when timed.
* ``pipeoffload`` skips warm-ups that it proves over the limit whatever is offloaded;
  ``pipeoffload(beat=...)`` returns the schedule it returns without ``beat``, or refuses only
  when that schedule is slower than ``beat``.
* ``auto_schedule`` skips the offload heuristics when the problem's lower bound is above a
  recomputation candidate, and chooses the schedule the unpruned candidates would.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import InfeasibleError
from fxpipe.ir import ScheduleProblem
from fxpipe.schedule.auto import auto_schedule
from fxpipe.schedule.heuristics import generate, orders_1f1b, pipeoffload, warmup_overflow_bytes
from fxpipe.schedule.simulate import simulate
from fxpipe.schedule.validate import check_schedule


@st.composite
def limited_problems(draw):
    S, M = draw(st.integers(2, 5)), draw(st.integers(1, 8))
    mf = [draw(st.sampled_from([1.0, 2.0])) for _ in range(S)]
    p = ScheduleProblem.create(
        num_stages=S,
        num_microbatches=M,
        t_f=[draw(st.sampled_from([0.0, 1e-12, 0.5, 1.0, 2.0])) for _ in range(S)],
        t_b=[draw(st.sampled_from([0.0, 1.0, 2.0])) for _ in range(S)],
        t_w=[draw(st.sampled_from([0.0, 1.0])) for _ in range(S)],
        t_comm=[draw(st.sampled_from([0.0, 0.5])) for _ in range(S - 1)],
        t_offload=[draw(st.sampled_from([0.0, 0.5, 2.0])) for _ in range(S)],
        mem_f=mf,
        mem_b=[-x / 2 for x in mf],
        mem_w=[-x / 2 for x in mf],
        offload_bytes=[x * draw(st.sampled_from([0.0, 0.5, 1.0])) for x in mf],
        recompute_mem_f=[x / 4 for x in mf],
        mem_limit=[draw(st.sampled_from([1.0, 2.0, 2.0 + 1e-10, 3.0, 4.0, math.inf])) for _ in range(S)],
    )
    rec = draw(st.lists(st.integers(0, S - 1), max_size=2))
    return p.with_recompute(sorted(set(rec))) if rec else p


@settings(max_examples=80, deadline=None)
@given(limited_problems(), st.integers(0, 6), st.data())
def test_warmup_overflow_shortcut_only_skips_refused_orders(problem, w, data):
    p, M = problem.num_stages, problem.num_microbatches
    warm = [min(w, p - s - 1, M) for s in range(p)]
    orders = orders_1f1b(p, M, warm)
    errs = check_schedule(problem, simulate(problem, orders))
    if warmup_overflow_bytes(problem, warm) > 0:
        assert errs and all(e.startswith("rule 5") for e in errs)
    # with any offload, memory-aware or not (as pipeoffload times them)
    off = data.draw(st.sets(st.tuples(st.integers(0, p - 1), st.integers(0, M - 1))))
    respect = data.draw(st.booleans())
    errs = check_schedule(problem, simulate(problem, orders, offload=off, respect_memory=respect))
    if warmup_overflow_bytes(problem, warm, offload=True) > 0:
        assert errs and all(e.startswith("rule 5") for e in errs)


def test_warmup_overflow_shortcut_catches_the_plain_case():
    # 3 stashes of 2 bytes on stage 0 under a 5-byte limit: over whatever the timing
    p = ScheduleProblem.create(num_stages=3, num_microbatches=6, t_f=1.0, t_b=1.0, t_w=1.0, mem_f=2.0, mem_b=-1.0,
                               mem_w=-1.0, mem_limit=5.0)
    assert warmup_overflow_bytes(p, [2, 1, 0]) == pytest.approx(1.0)
    assert warmup_overflow_bytes(p, [1, 1, 0]) < 0


def _offload_problem(limit: float, t_off: float = 0.5, m: int = 6, t_f: float = 1.0) -> ScheduleProblem:
    return ScheduleProblem.create(num_stages=3, num_microbatches=m, t_f=t_f, t_b=1.0, t_w=1.0, mem_f=10.0,
                                  mem_b=-5.0, mem_w=-5.0, offload_bytes=10.0, t_offload=t_off, mem_limit=limit,
                                  recompute_mem_f=1.0)


@pytest.mark.parametrize("limit,t_off", [(22.0, 0.5), (22.0, 3.0), (12.0, 2.0)])
def test_pipeoffload_beat_keeps_its_schedule_or_refuses_a_slower_one(limit, t_off):
    p = _offload_problem(limit, t_off)
    try:
        ref = pipeoffload(p, minimal=True)
    except InfeasibleError:
        ref = None
    for beat in (1e9, ref.value if ref else 1e9, (ref.value if ref else 20.0) * 0.8, 1.0):
        try:
            got = pipeoffload(p, minimal=True, beat=beat)
        except InfeasibleError:
            assert ref is None or ref.value > beat
            continue
        assert ref is not None and got.ops == ref.ops and got.value == ref.value


def test_auto_skips_offload_only_when_it_cannot_win():
    # a slow copy stream: recomputation wins and the offload heuristics are not run; with a
    # fast one they are candidates (and may win)
    p = _offload_problem(15.0, t_off=5.0, t_f=0.1)
    slow = auto_schedule(p, time_limit_s=0)
    skipped = [k for k, v in slow.tried.items() if k.startswith("offload/") and str(v).startswith("skipped")]
    assert skipped == ["offload/pipeoffload", "offload/adaoffload", "offload/offload-search"]
    assert slow.recompute_stages and slow.offloaded == 0
    assert check_schedule(slow.problem, slow.schedule) == []
    for method in ("pipeoffload", "adaoffload", "offload-search"):  # none of them would have won
        try:
            sched = pipeoffload(p, minimal=True) if method == "pipeoffload" else generate(p, method)
        except InfeasibleError:
            continue
        assert sched.value > slow.schedule.value
    fast = auto_schedule(_offload_problem(22.0, t_off=0.1), time_limit_s=0)
    assert all(isinstance(fast.tried[f"offload/{m}"], (float, str)) for m in ("pipeoffload", "adaoffload"))
    assert not any(str(v).startswith("skipped: every schedule") for k, v in fast.tried.items() if k.startswith("offload/"))
    # the result is the best of what was tried
    vals = [v for k, v in fast.tried.items() if "/" in k and not k.startswith("unlimited/") and isinstance(v, float)]
    assert fast.schedule.value == pytest.approx(min(vals))


@settings(max_examples=60, deadline=None)
@given(limited_problems())
def test_gpipe_refuses_untimed_only_orders_the_validator_refuses(problem):
    # gpipe checks its orders (every forward before the first backward) against the limits before timing them
    from fxpipe.schedule.heuristics import gpipe, orders_gpipe

    timed = check_schedule(problem, simulate(problem, orders_gpipe(problem.num_stages, problem.num_microbatches)))
    try:
        sched = gpipe(problem)
    except InfeasibleError as exc:
        if "however it is timed" in str(exc):  # the refusal before timing (not the one-stash check before it)
            assert timed and all(e.startswith("rule 5") for e in timed)
        return
    assert not timed and check_schedule(problem, sched) == []


@st.composite
def deep_limited_problems(draw):
    """Problems large enough for limited_1f1b's bisection (3 S m > 300, S > 8), memory from loose to tight."""
    S, M = draw(st.sampled_from([9, 10, 12])), draw(st.integers(11, 16))
    mf = [draw(st.sampled_from([1.0, 2.0])) for _ in range(S)]
    return ScheduleProblem.create(
        num_stages=S, num_microbatches=M,
        t_f=[draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in range(S)],
        t_b=[draw(st.sampled_from([1.0, 2.0])) for _ in range(S)],
        t_w=[draw(st.sampled_from([0.0, 1.0])) for _ in range(S)],
        t_comm=[draw(st.sampled_from([0.0, 0.5])) for _ in range(S - 1)],
        mem_f=mf, mem_b=[-x / 2 for x in mf], mem_w=[-x / 2 for x in mf],
        mem_limit=[draw(st.sampled_from([2.0, 4.0, 6.0, 9.0, 20.0, math.inf])) for _ in range(S)],
    )


@settings(max_examples=40, deadline=None)
@given(deep_limited_problems(), st.sampled_from([0.5, 0.9, 1.0, 1.1, 2.0]))
def test_limited_1f1b_with_a_best_so_far_times_the_same_warmup_or_refuses_a_slower_one(problem, factor):
    # with beat, the bisection starts at the least warm-up whose bound may beat it: the same schedule as without
    # beat whenever that one is no slower than beat, a refusal only when it is slower
    from fxpipe.schedule.auto import limited_1f1b

    try:
        ref = limited_1f1b(problem)
    except InfeasibleError:
        ref = None
    beat = factor * (ref.value if ref is not None else sum(problem.t_f + problem.t_b + problem.t_w) * 4)
    try:
        got = limited_1f1b(problem, beat=beat)
    except InfeasibleError:
        assert ref is None or ref.value > beat * (1 + 1e-9)
        return
    assert ref is not None and got.ops == ref.ops and got.meta == ref.meta
