"""Heuristic schedules: valid on random problems, known values, memory, errors, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.cli import main as cli_main
from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import OpGraph, Schedule, ScheduleProblem
from fxpipe.schedule import (
    METHODS,
    check_schedule,
    generate,
    one_f_one_b,
    peak_memory,
    problem_from_partition,
    simulate,
    zb_greedy,
    zb_h1,
    zb_h2,
)
from fxpipe.schedule.heuristics import orders_1f1b

from naive_schedule import exhaustive_optimum


@st.composite
def problems(draw, max_stages=5, max_mb=8, limited=None):
    S = draw(st.integers(1, max_stages))
    M = draw(st.integers(1, max_mb))
    t = st.integers(0, 6)
    t_f = [draw(st.integers(1, 6)) for _ in range(S)]
    t_b = [draw(t) for _ in range(S)]
    t_w = [draw(t) for _ in range(S)]
    comm = [draw(st.integers(0, 2)) for _ in range(S - 1)]
    mem_f = [draw(st.integers(1, 4)) * 2.0 for _ in range(S)]
    frac = [draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])) for _ in range(S)]
    mem_b = [-f * x for f, x in zip(mem_f, frac)]
    mem_w = [-f - b for f, b in zip(mem_f, mem_b)]
    lim_on = draw(st.booleans()) if limited is None else limited
    mem_limit = [f * draw(st.sampled_from([1, 1.5, 2, 3, 5])) for f in mem_f] if lim_on else math.inf
    t_off = [draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])) for _ in range(S)]
    groups = [[0, 1]] if S >= 2 and draw(st.booleans()) else []
    return ScheduleProblem.create(
        num_stages=S, num_microbatches=M, t_f=t_f, t_b=t_b, t_w=t_w, t_comm=comm, t_offload=t_off,
        mem_f=mem_f, mem_b=mem_b, mem_w=mem_w, mem_limit=mem_limit, pcie_groups=groups,
        objective=draw(st.sampled_from(["stage_span", "makespan"])),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_generator_is_valid_or_says_infeasible(problem):
    unlimited = not np.isfinite(problem.mem_limit).any()
    for method in METHODS:
        try:
            sched = generate(problem, method)
        except InfeasibleError as exc:
            assert not unlimited, f"{method} infeasible without a memory limit: {exc}"
            assert "by" in str(exc) or "overflow" in str(exc) or "cannot" in str(exc)
            continue
        assert check_schedule(problem, sched) == [], method
        assert sched.status == "heuristic" and sched.method == method
        assert sched.objective == problem.objective
        assert sched.value == (sched.stage_span if problem.objective == "stage_span" else sched.makespan)


@settings(max_examples=25, deadline=None)
@given(problems(limited=False))
def test_zb_h1_never_longer_than_1f1b_and_same_peak(problem):
    a, b = one_f_one_b(problem), zb_h1(problem)
    assert b.value <= a.value + 1e-9
    # ZB-H1 keeps 1F1B's worst-device peak (Qi et al. Section 2.1) ...
    assert peak_memory(problem, b).max() <= peak_memory(problem, a).max() * (1 + 1e-12)
    # ... and ZB-H2 is never worse than ZB-H1
    assert zb_h2(problem).value <= b.value + 1e-9


@settings(max_examples=25, deadline=None)
@given(problems(limited=False))
def test_1f1b_and_per_stage_zb_h1_hold_at_most_p_minus_s_stashes(problem):
    p, M = problem.num_stages, problem.num_microbatches
    cap = np.minimum(p - np.arange(p), M) * problem.mem_f
    for sched in (one_f_one_b(problem), zb_h1(problem, per_stage=True)):
        assert np.all(peak_memory(problem, sched) <= cap + 1e-9)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 3), (4, 8), (5, 2), (8, 16)])
@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 1.0), (2.0, 3.0, 1.5)])
def test_1f1b_fused_closed_form(p, m, f, b, w):
    # fused backward: W folded into B (t_w = 0); uniform stages, zero comm
    prob = ScheduleProblem.create(num_stages=p, num_microbatches=m, t_f=f, t_b=b + w, t_w=0.0)
    s = one_f_one_b(prob)
    assert s.makespan == pytest.approx((m + p - 1) * (f + b + w))
    assert s.stage_span == pytest.approx(m * (f + b + w) + (p - 1) * (f + b + w))


def test_zero_bubble_handcrafted_values():
    # Qi et al. Section 2 with F = B = W: ZB-H1 bubble (p-1)(F+B-W), ZB-H2 none
    p, m = 4, 8
    prob = ScheduleProblem.create(num_stages=p, num_microbatches=m, t_f=1, t_b=1, t_w=1, mem_f=2, mem_b=-1, mem_w=-1)
    assert one_f_one_b(prob).stage_span == 30
    assert zb_h1(prob).stage_span == 3 * m + (p - 1) * (1 + 1 - 1)
    assert zb_h2(prob).stage_span == 3 * m


@pytest.mark.parametrize(
    "name,kw,expected",
    [
        ("toy1", dict(num_stages=4, num_microbatches=12, t_f=5, t_b=6, t_w=4, t_comm=0, mem_limit=10), 193),
        ("toy2", dict(num_stages=4, num_microbatches=12, t_f=5, t_b=6, t_w=4, t_comm=0, mem_limit=14), 183),
        ("profiled-4", dict(num_stages=4, num_microbatches=12, t_f=5478, t_b=5806, t_w=3534, t_comm=200, mem_limit=32), 178898),
        ("unit-32", dict(num_stages=32, num_microbatches=16, t_f=1, t_b=1, t_w=1, t_comm=0, mem_limit=64), 95),
    ],
)
def test_greedy_reproduces_zero_bubble_table(name, kw, expected):
    prob = ScheduleProblem.create(**kw, mem_f=2, mem_b=-1, mem_w=-1)
    s = zb_greedy(prob)
    assert check_schedule(prob, s) == []
    assert s.stage_span == expected, name
    assert np.all(peak_memory(prob, s) <= kw["mem_limit"])


def test_offload_schedules_fit_where_1f1b_cannot():
    prob = ScheduleProblem.create(num_stages=4, num_microbatches=12, t_f=5, t_b=6, t_w=4, t_offload=1.0,
                                  mem_f=2, mem_b=-1, mem_w=-1, mem_limit=4, pcie_groups=[[0, 1], [2, 3]])
    with pytest.raises(InfeasibleError, match="over its limit 4 by 4"):
        one_f_one_b(prob)
    for method in ("pipeoffload", "adaoffload"):
        s = generate(prob, method)
        assert check_schedule(prob, s) == []
        assert any(o.type == "O" for o in s.ops)
        assert np.all(peak_memory(prob, s) <= 4)


@pytest.mark.parametrize("seed", range(4))
def test_heuristics_never_beat_exhaustive_optimum(seed):
    rng = np.random.default_rng(seed)
    kw = dict(num_stages=2, num_microbatches=2, t_f=rng.integers(1, 4, 2), t_b=rng.integers(1, 4, 2),
              t_w=rng.integers(0, 3, 2), t_comm=[int(rng.integers(0, 2))], t_offload=0.5,
              mem_f=2.0, mem_b=-1.0, mem_w=-1.0, objective=["stage_span", "makespan"][seed % 2])
    for limit in (math.inf, 3.0):
        prob = ScheduleProblem.create(**kw, mem_limit=limit)
        opt, sched = exhaustive_optimum(prob)
        assert check_schedule(prob, sched) == []
        for method in METHODS:
            try:
                s = generate(prob, method)
            except InfeasibleError:
                assert limit < math.inf
                continue
            assert s.value >= opt - 1e-9, method


def test_bad_input_errors():
    with pytest.raises(InputError, match=">= 0"):
        ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=[1, -1], t_b=1, t_w=1)
    with pytest.raises(InputError, match="must be 0"):
        ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=1, t_w=1, mem_f=2, mem_b=-1, mem_w=-0.5)
    with pytest.raises(InputError, match="unknown schedule method"):
        generate(ScheduleProblem.create(num_stages=1, num_microbatches=1, t_f=1, t_b=1, t_w=1), "nope")
    # a limit below one stash: F allocates the whole stash before any offload can start
    for offload_bytes in (0.0, 2.0):
        prob = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=1, t_w=1, mem_f=2.0,
                                      offload_bytes=offload_bytes, t_offload=0.1, mem_limit=1.5)
        for method in METHODS:
            with pytest.raises(InfeasibleError) as info:
                generate(prob, method)
            assert "stage 0" in str(info.value) or "stage 1" in str(info.value)
        with pytest.raises(InfeasibleError):
            exhaustive_optimum(prob)


def test_problem_from_partition():
    g = OpGraph.from_arrays(
        t_fwd_s=[1, 2, 3, 1], t_bwd_input_s=[1, 1, 2, 0], t_bwd_weight_s=[1, 1, 0, 0],
        size_out_bytes=[10, 20, 30, 40], act_bytes=[4, 4, 6, 0],
        edges=[[0, 1], [1, 2], [0, 3], [2, 3]], bandwidth_bytes_per_s=10,
    )
    p = problem_from_partition(g, np.array([0, 0, 1, 2]), num_microbatches=3, host_bandwidth_bytes_per_s=2.0,
                               mem_limit_bytes=100.0, objective="makespan")
    assert p.num_stages == 3 and p.num_microbatches == 3
    assert p.t_f.tolist() == [3, 3, 1] and p.t_b.tolist() == [2, 2, 0] and p.t_w.tolist() == [2, 0, 0]
    # boundary 0: tensors of 0 (to 3) and 1 (to 2); boundary 1: 0 passes through, 2 -> 3
    assert p.t_comm.tolist() == pytest.approx([3.0, 4.0])
    assert p.mem_f.tolist() == [8, 6, 1]  # empty stash -> 1 byte
    assert p.mem_b.tolist() == pytest.approx([-4, -6, -0.5])
    assert p.t_offload.tolist() == pytest.approx([4, 3, 0.5])
    assert p.objective == "makespan"
    assert check_schedule(p, generate(p, "1f1b")) == []
    no_host = problem_from_partition(g, [0, 0, 1, 1], num_microbatches=2)
    assert no_host.offload_bytes.tolist() == [0, 0]
    with pytest.raises(InputError, match="earlier block"):
        problem_from_partition(g, [1, 1, 0, 1], num_microbatches=2)


def test_cli_schedule(tmp_path, capsys):
    prob = ScheduleProblem.create(num_stages=3, num_microbatches=4, t_f=1, t_b=1, t_w=1, t_comm=0.1,
                                  mem_f=2, mem_limit=5, t_offload=0.5)
    path = tmp_path / "p.json"
    prob.save(path)
    out = tmp_path / "s.json"
    assert cli_main(["schedule", str(path), "--method", "adaoffload", "--json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "fxpipe.schedule/1" and doc["method"] == "adaoffload"
    sched = Schedule.load(out)
    assert check_schedule(prob, sched) == []
    assert 0 < doc["lower_bound_s"] <= doc["stage_span"]
    assert cli_main(["schedule", str(path), "--method", "zb-h2"]) == 0
    assert "stage 0:" in capsys.readouterr().out
    # bad files and infeasible problems: exit code 2, one line on stderr
    assert cli_main(["schedule", str(tmp_path / "missing.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli_main(["schedule", str(bad)]) == 2
    bad.write_text(json.dumps({"num_stages": 2, "num_microbatches": 2, "t_f": [1, -1], "t_b": 1, "t_w": 1}))
    assert cli_main(["schedule", str(bad)]) == 2
    assert cli_main(["schedule", str(path), "--method", "gpipe"]) == 2
    err = capsys.readouterr().err
    assert "over its limit" in err and "Traceback" not in err


def test_pipeoffload_policies():
    prob = ScheduleProblem.create(num_stages=4, num_microbatches=8, t_f=5, t_b=6, t_w=4, t_offload=1.0,
                                  mem_f=2, mem_b=-1, mem_w=-1, mem_limit=6)
    from fxpipe.schedule import pipeoffload

    eager, lean = pipeoffload(prob), pipeoffload(prob, minimal=True)
    for s in (eager, lean):
        assert check_schedule(prob, s) == []
    n = lambda s: sum(o.type == "O" for o in s.ops)  # noqa: E731
    assert 0 < n(lean) <= n(eager)


def test_simulate_offload_placement_and_pcie_groups():
    kw = dict(num_stages=2, num_microbatches=2, t_f=1.0, t_b=1.0, t_w=1.0, t_offload=0.5, mem_f=1.0)
    orders = orders_1f1b(2, 2)
    prob = ScheduleProblem.create(**kw)
    s = simulate(prob, orders, offload=[(0, 0), (1, 0)])
    assert check_schedule(prob, s) == []
    get = {(o.stage, o.microbatch, o.type): o for o in s.ops}
    for st_ in (0, 1):
        assert get[(st_, 0, "O")].start_s == get[(st_, 0, "F")].end_s  # right after F
        assert get[(st_, 0, "R")].end_s == get[(st_, 0, "B")].start_s  # as late as possible
    grouped = ScheduleProblem.create(**kw, pcie_groups=[[0, 1]])
    g = simulate(grouped, orders, offload=[(0, 0), (0, 1), (1, 0), (1, 1)])
    assert check_schedule(grouped, g) == []
    copies = sorted((o.start_s, o.end_s) for o in g.ops if o.type in "OR")
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(copies, copies[1:]))  # serialized
