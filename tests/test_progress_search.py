"""The one interruptible-search helper (:class:`fxpipe.progress.Search`) and the searches
that use it: Ctrl-C (a real SIGINT sent to this process) stops a search, which returns its
best result so far with its status; the SIGINT handler exists only while a search runs."""

from __future__ import annotations

import math
import signal
import threading

import pyscipopt as scip
import pytest
from naive_partition import random_dag

from fxpipe.mip import solve_model
from fxpipe.partition import brkga as brkga_mod
from fxpipe.partition.objective import validate_partition
from fxpipe.partition.search import partition
from fxpipe.progress import Search


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
