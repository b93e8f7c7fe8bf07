"""The one interruptible-search helper (:class:`fxpipe.progress.Search`) and the searches
that use it: Ctrl-C (a real SIGINT sent to this process) stops a search, which returns its
best result so far with its status; the SIGINT handler exists only while a search runs."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time

import pyscipopt as scip
import pytest
from naive_partition import random_dag

import fxpipe.mip.solve as mip_solve_mod
import fxpipe.schedule.offload_search as offload_mod
from fxpipe.ir import ScheduleProblem
from fxpipe.mip import solve_model
from fxpipe.partition import brkga as brkga_mod
from fxpipe.partition.objective import validate_partition
from fxpipe.partition.search import partition
from fxpipe.progress import Search
from fxpipe.schedule import milp
from fxpipe.schedule.offload_search import offload_search
from fxpipe.schedule.validate import check_schedule


@pytest.fixture
def default_sigint():
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_handler_only_while_a_search_runs_and_presses_reach_nested_searches(default_sigint):
    with Search("outer") as outer:
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        with Search("inner") as inner:
            outer.offer(3.0, "a")
            assert not outer.offer(4.0, "b") and outer.best_payload == "a"
            signal.raise_signal(signal.SIGINT)  # a press: no exception, both flags raised
            assert inner.stopped and outer.stopped
        assert inner.interrupted
    assert outer.interrupted and outer.best == 3.0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with Search("after") as fresh:  # a new search starts unflagged
        assert not fresh.stopped
    assert not fresh.interrupted


def test_keyboardinterrupt_in_the_body_is_an_interrupt_and_others_handlers_stay(default_sigint):
    with Search("raised") as run:
        raise KeyboardInterrupt
    assert run.interrupted
    mine = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGINT, mine)
    with Search("custom"):
        assert signal.getsignal(signal.SIGINT) is mine  # someone else's handler is left alone
    seen = {}

    def in_thread():
        with Search("thread"):
            seen["handler"] = signal.getsignal(signal.SIGINT)

    signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert seen["handler"] is signal.default_int_handler  # nothing installed from another thread


def test_partition_pressed_during_brkga_returns_best_so_far(monkeypatch, default_sigint):
    g = random_dag(6, 30, 0.1)
    calls = {"n": 0}
    real = brkga_mod.PopulationDecoder.__call__

    def press_on_third(self, keys, bound=math.inf):
        calls["n"] += 1
        if calls["n"] == 3:
            signal.raise_signal(signal.SIGINT)
        return real(self, keys, bound)

    monkeypatch.setattr(brkga_mod.PopulationDecoder, "__call__", press_on_third)
    p = partition(g, 3, method="brkga", time_limit_s=60)
    assert p.meta["interrupted"] is True and p.meta["stop_reason"] in ("interrupted", "bound")
    assert calls["n"] <= 4  # stopped at the next check, not at the 60 s limit
    validate_partition(g, p)
    assert math.isfinite(p.bottleneck)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_scip_pressed_at_the_first_incumbent_returns_it(default_sigint):
    m = scip.Model()
    m.hideOutput(True)
    xs = [m.addVar(vtype="I", lb=0, ub=50) for _ in range(12)]
    m.addCons(scip.quicksum((i + 3) * x for i, x in enumerate(xs)) == 997)
    m.setObjective(scip.quicksum((i % 5 + 1) * x for i, x in enumerate(xs)), "minimize")
    res = solve_model(m, time_limit_s=30, on_incumbent=lambda value_of, t, dual: signal.raise_signal(signal.SIGINT))
    assert res.status == "userinterrupt" and math.isfinite(res.primal) and res.wall_s < 30
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _offload_problem(m: int) -> ScheduleProblem:
    """p = 4 under a tight memory limit: the searches and SCIP have work for many seconds."""
    return ScheduleProblem.create(num_stages=4, num_microbatches=m, t_f=1, t_b=1, t_w=1, t_offload=0.5, mem_f=1,
                                  mem_b=-0.5, mem_w=-0.5, mem_limit=2.0)


def _press_in(delay_s: float) -> threading.Timer:
    """A Ctrl-C (SIGINT to this process) ``delay_s`` seconds from now, from another thread."""
    presser = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGINT))
    presser.start()
    return presser


def test_offload_search_pressed_alone_and_inside_another_search_returns_best_so_far(default_sigint):
    # inside another search (the MILP's) the press only raises flags: the offload search used
    # to ignore them and run to its time limit
    p = _offload_problem(8)
    with Search("outer") as outer:
        for inside in (False, True):
            with Search("inner") if inside else contextlib.nullcontext():
                t0 = time.perf_counter()
                presser = _press_in(0.5)
                s = offload_search(p, time_limit_s=20)
                wall = time.perf_counter() - t0
                presser.join()
            assert s.meta["interrupted"] is True and wall < 8
            assert check_schedule(p, s.ops) == [] and s.meta["evals"] >= 1
    assert outer.interrupted
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_milp_pressed_during_its_warm_start_skips_scip(monkeypatch, default_sigint):
    # the press stopped the warm start's offload search, which returned its best so far, and
    # the MILP used to go on to a full SCIP solve as if nothing was pressed
    calls = {"n": 0}
    real = offload_mod._evaluate

    def press_on_third(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kw)

    monkeypatch.setattr(offload_mod, "_evaluate", press_on_third)
    p = _offload_problem(6)
    t0 = time.perf_counter()
    res = milp.solve(p, time_limit_s=20, probe_time_s=0, search_time_s=0)
    assert time.perf_counter() - t0 < 8 and calls["n"] <= 4
    assert res.status == "userinterrupt" and res.meta["nodes"] == 0 and res.meta["source"].startswith("warm_start:")
    assert check_schedule(p, res.ops) == [] and res.lower_bound_s <= res.value
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_milp_pressed_during_scip_returns_the_incumbent_and_stops_the_enclosing_search(monkeypatch, default_sigint):
    real = mip_solve_mod._optimize_interruptible
    pressers = []

    def press_a_second_in(model):
        pressers.append(_press_in(1.0))
        return real(model)

    monkeypatch.setattr(mip_solve_mod, "_optimize_interruptible", press_a_second_in)
    p = _offload_problem(6)  # SCIP runs to any time limit on it (23 -> 22 in 15 s, bound 19)
    with Search("outer") as outer:
        t0 = time.perf_counter()
        res = milp.solve(p, time_limit_s=30, probe_time_s=0, search_time_s=0)
        wall = time.perf_counter() - t0
    assert len(pressers) == 1 and wall < 10 and outer.interrupted
    assert res.status == "userinterrupt" and res.meta["model"] and res.meta["nodes"] >= 1
    assert check_schedule(p, res.ops) == [] and res.value <= res.meta["warm_start"]["value_s"]
    assert res.lower_bound_s <= res.value and 0 <= res.meta["gap"] < 1 and math.isfinite(res.meta["dual"])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
