"""The combinatorial lower bound is sound (<= exhaustive optimum) and reasonably tight."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.ir import ScheduleProblem
from fxpipe.schedule import METHODS, combinatorial_lower_bound, generate, stage_span_bounds

from naive_schedule import exhaustive_optimum


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
        opt, sched = exhaustive_optimum(p)
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
