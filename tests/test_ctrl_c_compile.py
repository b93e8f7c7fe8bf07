"""Ctrl-C while numba compiles a kernel (a first run) and in the search before any bound.

numba's compiler turns a KeyboardInterrupt raised inside it into its own errors (a
RuntimeError from the cache writer, a typing error) or loses it: a first ``fxpipe bounds`` run
interrupted while compiling printed a numba traceback (exit 1) or went on to the 60 s MIP as if
nothing was pressed. Searches run under :class:`fxpipe.progress.Search`, whose SIGINT handler
only raises a flag: the compile ends normally and the search stops at its next check.
"""

from __future__ import annotations

import json
import signal

import numpy as np
from numba import njit
from numba.core import event

import fxpipe.partition.bounds as bounds_mod
import fxpipe.partition.search  # noqa: F401  (imports every kernel module)
from fxpipe.ir import OpGraph
from fxpipe.progress import Search
from test_progress_search import default_sigint  # noqa: F401  (fixture)


def test_importing_the_partitioner_installs_nothing(default_sigint):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    listeners = event._registered.get("numba:compile", [])  # numba's registry (no public reader)
    assert not [x for x in listeners if type(x).__module__.startswith("fxpipe.partition")]


def test_a_press_inside_a_real_compile_stops_the_search_after_it(default_sigint):
    class PressDuringCompile(event.Listener):
        returned = False

        def on_start(self, ev):
            signal.raise_signal(signal.SIGINT)
            self.returned = True  # with Python's default handler the press raises right here

        def on_end(self, ev):
            pass

    @njit(cache=False)
    def kernel(x):
        s = 0.0
        for v in x:
            s += v * v
        return s

    presser = PressDuringCompile()
    event.register("numba:compile", presser)
    try:
        with Search("compile") as run:
            assert kernel(np.arange(4.0)) == 14.0  # the compile went on after the press, to its end
            assert run.stopped
    finally:
        event.unregister("numba:compile", presser)
    assert presser.returned and kernel.signatures and run.interrupted
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_before_the_search_found_anything_stops_the_bounds_run(monkeypatch):
    g = OpGraph.from_arrays(t_fwd_s=[1, 2, 3, 4], t_bwd_input_s=[1, 1, 1, 1], t_bwd_weight_s=[1, 1, 1, 1],
                            size_out_bytes=[1, 1, 1, 1], edges=[[0, 1], [1, 2], [2, 3]])

    def pressed(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(bounds_mod, "initial_partition", pressed)
    rep = bounds_mod.compute_bounds(g, 2, objective="training", methods=("simple", "exact", "guess"), time_limit_s=5)
    assert rep.interrupted and rep.partition is None
    assert list(rep.certificates) == ["simple"]  # the instant bound only; no MIP ran
    json.dumps(rep.to_dict())  # still a complete, serializable report
