"""Partition search (orders, BRKGA) and the ``fxpipe partition`` CLI."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.cli import main
from fxpipe.errors import InputError
from fxpipe.partition import brkga as brkga_mod
from fxpipe.partition.brkga import BRKGAParams, PopulationDecoder, run_brkga
from fxpipe.partition.objective import Partition, block_costs, validate_partition
from fxpipe.partition.orders import structured_orders
from fxpipe.partition.search import partition
from fxpipe.partition.slicegraph import slice_order

from naive import brute_force_partition
from naive_partition import random_dag

COMBOS = [(o, c) for o in ("inference", "training") for c in ("dag", "relay")]


@pytest.mark.parametrize("method", ["orders", "brkga"])
@pytest.mark.parametrize("objective,comm", COMBOS)
def test_partition_is_valid_and_no_worse_than_structured_orders(method, objective, comm):
    g = random_dag(11, 40, 0.08, ops=True)
    p = partition(g, 4, objective=objective, comm=comm, method=method, evaluations=400, time_limit_s=60)
    validate_partition(g, p)
    np.testing.assert_allclose(p.block_costs, block_costs(g, p.assignment, 4, objective, comm), rtol=1e-12)
    for o in structured_orders(g).values():
        assert p.bottleneck <= slice_order(g, o, 4, objective, comm).bottleneck * (1 + 1e-12)
    for key in ("method", "evaluations", "seconds", "seed", "order", "interrupted"):
        assert key in p.meta
    assert p.meta["method"] == method and p.meta["evaluations"] <= 400 and not p.meta["interrupted"]
    order = np.asarray(p.meta["order"])
    ph = [i for i, op in enumerate(g.ops) if op == "placeholder"]
    out = [i for i, op in enumerate(g.ops) if op == "output"]
    assert set(order[: len(ph)].tolist()) == set(ph) and set(order[g.n - len(out):].tolist()) == set(out)
    assert p.assignment[ph].max() == 0 and p.assignment[out].min() == p.assignment.max()


@pytest.mark.parametrize("objective,comm", COMBOS)
def test_brkga_finds_the_brute_force_optimum_on_tiny_graphs(objective, comm):
    for seed in range(3):
        g = random_dag(seed, 7, 0.3)
        want, _ = brute_force_partition(g, 3, objective, comm)
        p = partition(g, 3, objective=objective, comm=comm, method="brkga", evaluations=600, time_limit_s=60, seed=seed)
        assert p.bottleneck >= want * (1 - 1e-9)
        assert p.bottleneck <= want * (1 + 1e-9)


def test_brkga_is_reproducible_for_a_seed():
    g = random_dag(5, 60, 0.06)
    a = partition(g, 5, method="brkga", evaluations=500, time_limit_s=120, seed=3, objective="training")
    b = partition(g, 5, method="brkga", evaluations=500, time_limit_s=120, seed=3, objective="training")
    assert a.bottleneck == b.bottleneck and a.assignment.tolist() == b.assignment.tolist()
    assert a.meta["order"] == b.meta["order"] and a.meta["evaluations"] == b.meta["evaluations"] == 500
    dec = PopulationDecoder(g, 5, "training", "dag")
    params = BRKGAParams(population=20, max_generations=5)
    r1 = run_brkga(dec, params, seed=9)
    r2 = run_brkga(dec, params, seed=9)
    assert r1.best_fitness == r2.best_fitness and r1.evaluations == r2.evaluations == 20 + 5 * 16
    assert r1.history[-1][3] == r1.best_fitness


def test_brkga_incumbent_pruning_does_not_change_the_run():
    g = random_dag(12, 40, 0.08)

    class NoPruning(PopulationDecoder):
        def __call__(self, keys, bound=math.inf):
            return super().__call__(keys, math.inf)

    params = BRKGAParams(population=24, max_generations=15)
    for objective, comm in COMBOS:
        a = run_brkga(PopulationDecoder(g, 4, objective, comm), params, seed=4)
        b = run_brkga(NoPruning(g, 4, objective, comm), params, seed=4)
        assert [(h[0], h[1], h[3]) for h in a.history] == [(h[0], h[1], h[3]) for h in b.history]
        assert a.best_keys.tolist() == b.best_keys.tolist()


def test_orders_method_with_zero_time_uses_structured_orders_only():
    g = random_dag(2, 30, 0.1)
    p = partition(g, 3, method="orders", time_limit_s=0)
    assert p.meta["evaluations"] == len(structured_orders(g))
    assert p.meta["rule"] in structured_orders(g)


def test_warm_start_is_decoded():
    g = random_dag(4, 25, 0.1)
    ref = partition(g, 4, method="orders", time_limit_s=60, evaluations=300, seed=1)
    p = partition(g, 4, method="orders", time_limit_s=0, warm_start=ref)
    assert p.bottleneck <= ref.bottleneck * (1 + 1e-12)
    # a Partition without an order: blocks then ids give a topological order
    bare = Partition.from_assignment(g, ref.assignment, 4)
    p2 = partition(g, 4, method="orders", time_limit_s=0, warm_start=bare)
    assert p2.bottleneck <= ref.bottleneck * (1 + 1e-12)


def test_ctrl_c_returns_best_so_far(monkeypatch):
    g = random_dag(6, 30, 0.1)
    calls = {"n": 0}
    real = PopulationDecoder.__call__

    def flaky(self, keys, bound=math.inf):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, keys, bound)

    monkeypatch.setattr(brkga_mod.PopulationDecoder, "__call__", flaky)
    p = partition(g, 3, method="brkga", time_limit_s=60)
    assert p.meta["interrupted"] is True
    validate_partition(g, p)


def test_k_larger_than_n_and_bad_arguments():
    g = random_dag(1, 3, 0.5)
    p = partition(g, 6, method="orders", time_limit_s=0)
    validate_partition(g, p)
    assert p.k == 6
    for kwargs in (dict(k=0), dict(k=-1), dict(k=2.0), dict(k=2, method="anneal"), dict(k=2, time_limit_s=-1),
                   dict(k=2, evaluations=0), dict(k=2, objective="x"), dict(k=2, comm="x"), dict(k=2, seed="a"),
                   dict(k=2, memory=-5), dict(k=2, memory="lots")):
        with pytest.raises(InputError):
            partition(g, **kwargs)
    with pytest.raises(InputError, match="OpGraph"):
        partition({"nodes": []}, 2)
    with pytest.raises(InputError):
        BRKGAParams(population=1)
    with pytest.raises(InputError):
        BRKGAParams(elite_fraction=0.8, mutant_fraction=0.5)


# ---------------------------------------------------------------- CLI


@pytest.fixture
def graph_file(tmp_path):
    g = random_dag(8, 20, 0.15, ops=True)
    path = tmp_path / "g.json"
    g.save(path)
    return g, path


def test_cli_json_is_contract_4(graph_file, capsys):
    g, path = graph_file
    rc = main(["partition", str(path), "-k", "3", "--objective", "training", "--comm", "relay", "--time-limit", "5",
               "--seed", "2", "--method", "orders", "--evaluations", "50", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["k"] == 3 and len(doc["assignment"]) == g.n and len(doc["block_costs"]) == 3
    assert doc["bottleneck"] == max(doc["block_costs"])
    costs = block_costs(g, np.array(doc["assignment"]), 3, "training", "relay")
    np.testing.assert_allclose(costs, doc["block_costs"], rtol=1e-12)
    assert all(doc["assignment"][u] <= doc["assignment"][v] for u, v in g.edges.tolist())


def test_cli_table_and_memory(graph_file, capsys):
    g, path = graph_file
    rc = main(["partition", str(path), "-k", "2", "--time-limit", "0", "--method", "orders", "--memory-capacity", "1TiB"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "bottleneck" in out and "stage" in out and "memory_GiB" in out


@pytest.mark.parametrize(
    "content,msg",
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        ('{"nodes": [{"id": 0, "t_fwd_s": 1, "size_out_bytes": 1}, {"id": 1, "t_fwd_s": 1, "size_out_bytes": 1}], "edges": [[0, 1], [1, 0]]}', "cycle"),
        ('{"nodes": [{"id": 0, "t_fwd_s": NaN, "size_out_bytes": 1}], "edges": []}', "finite"),
        ('{"nodes": [], "edges": []}', "non-empty"),
    ],
)
def test_cli_bad_graph_files_exit_2(tmp_path, capsys, content, msg):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    rc = main(["partition", str(path), "-k", "2", "--json"])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and "Traceback" not in err


def test_cli_bad_arguments_exit_2(graph_file, capsys):
    _, path = graph_file
    assert main(["partition", str(path), "-k", "0"]) == 2
    assert "k" in capsys.readouterr().err
    assert main(["partition", str(path), "-k", "2", "--memory-capacity", "lots"]) == 2
    assert "memory capacity" in capsys.readouterr().err
    assert main(["partition", str(path), "-k", "2", "--memory-capacity", "1", "--time-limit", "0"]) == 2
    assert "fits in" in capsys.readouterr().err


def test_relay_search_stops_at_the_chain_bound_with_every_stage_used():
    """On a chain of layers the chain DP proves the optimum: no search beyond the seeds."""
    from test_partition_chain import _path

    g = _path(3, 40)
    p = partition(g, 6, objective="inference", comm="relay", time_limit_s=30, seed=0)
    validate_partition(g, p)
    assert p.meta["proven_optimal"] and p.meta["stop_reason"] == "bound"
    assert p.meta["lower_bound_method"] == "chain"
    assert p.bottleneck <= p.meta["lower_bound_s"] * (1 + 1e-6)
    assert p.meta["seconds"] < 30 and "generations" not in p.meta
    assert (np.bincount(p.assignment, minlength=6) > 0).all()


def test_brkga_stops_at_target_and_after_stall_time():
    g = random_dag(5, 60, 0.06)
    dec = PopulationDecoder(g, 5, "training", "dag")
    res = run_brkga(dec, BRKGAParams(population=20, max_generations=50), seed=1, target=math.inf)
    assert res.stop_reason == "target" and res.generations == 0
    res = run_brkga(dec, BRKGAParams(population=20, max_generations=10**6, stall_time_s=0.0), seed=1)
    assert res.stop_reason == "stall"
    res = run_brkga(dec, BRKGAParams(population=20, max_generations=3), seed=1)
    assert res.stop_reason == "generations" and res.generations == 3
    with pytest.raises(InputError, match="stall_time_s"):
        BRKGAParams(stall_time_s=-1.0)


def test_time_limited_search_reports_why_it_stopped():
    g = random_dag(2, 80, 0.05)
    p = partition(g, 4, objective="training", comm="dag", time_limit_s=20, seed=0)
    assert p.meta["stop_reason"] in ("bound", "stall", "generations", "time")
    assert p.meta["lower_bound_method"] == "simple"
    assert 0.0 <= p.meta["gap"] < 1.0


def test_time_limit_holds_while_seed_orders_are_sliced(monkeypatch):
    """A slicing that takes longer than the time limit (a deep pipeline on a large graph): the seeds
    after the first are left undecoded, the best so far is returned with stop reason "time"."""
    import time

    from fxpipe.partition import search as search_mod

    g = random_dag(3, 40, 0.1)
    real = search_mod.slice_order_arrays

    def slow(order, inputs, bound):
        time.sleep(0.05)
        return real(order, inputs, bound)

    monkeypatch.setattr(search_mod, "slice_order_arrays", slow)
    p = partition(g, 4, comm="relay", time_limit_s=0.01)
    validate_partition(g, p)
    assert p.meta["evaluations"] == 1
    assert p.meta["seeds_left"] >= 1
    assert p.meta["stop_reason"] in ("time", "bound")
    assert p.meta["stop_reason"] == "bound" or not p.meta["proven_optimal"]


def test_a_seed_that_would_end_after_the_time_limit_is_not_sliced(monkeypatch):
    """Seeds are sliced while the last slicing's time says the next ends before the deadline: with 0.5 s
    slicings and a 0.9 s limit, one seed (a second would end at 1 s). The clock is the test's own: each
    slicing advances it by 0.5 s, nothing else does."""
    from fxpipe.partition import search as search_mod

    g = random_dag(3, 40, 0.1)
    real = search_mod.slice_order_arrays
    clock = [0.0]

    def slow(order, inputs, bound):
        clock[0] += 0.5
        return real(order, inputs, bound)

    monkeypatch.setattr(search_mod, "slice_order_arrays", slow)
    monkeypatch.setattr(search_mod.time, "perf_counter", lambda: clock[0])
    p = partition(g, 4, comm="relay", time_limit_s=0.9)
    validate_partition(g, p)
    assert p.meta["evaluations"] == 1 and p.meta["seeds_left"] >= 1 and p.meta["stop_reason"] == "time"


@pytest.mark.parametrize("graph", ["path", 0, 1, 2])
@pytest.mark.parametrize("comm,chain", [("relay", True), ("dag", False)])
def test_best_seed_is_not_sliced_twice(monkeypatch, graph, comm, chain):
    """The result is re-sliced on the original graph without a bound; when the best order is the seed the
    search sliced before it had a bound, that slicing is reused: the same partition and meta, and on a
    chain of layers (the chain seed is optimal, nothing else is sliced) one slicing instead of two."""
    from fxpipe.partition import search as search_mod

    from test_partition_chain import _path

    g = _path(3, 40) if graph == "path" else random_dag(graph, 30, 0.1, ops=True)
    real = search_mod.slice_order_arrays
    calls = []

    def counted(order, inputs, bound):
        calls.append(bound)
        return real(order, inputs, bound)

    monkeypatch.setattr(search_mod, "slice_order_arrays", counted)
    kw = dict(objective="training", comm=comm, method="orders", time_limit_s=0.0, chain=chain)
    p = partition(g, 4, **kw)
    reused = len(calls)
    monkeypatch.setattr(search_mod._SearchState, "slicing",
                        lambda self, order: search_mod.slice_order_arrays(order, self.inputs, math.inf))
    calls.clear()
    q = partition(g, 4, **kw)
    assert np.array_equal(p.assignment, q.assignment) and p.bottleneck == q.bottleneck
    assert {k: v for k, v in p.meta.items() if k != "seconds"} == {k: v for k, v in q.meta.items() if k != "seconds"}
    assert reused <= len(calls)
    if graph == "path" and chain:
        assert p.meta["stop_reason"] == "bound" and (reused, len(calls)) == (1, 2)


def test_structured_orders_computed_once_per_graph(monkeypatch):
    """Several partitions of one graph object (stage counts, memory): one computation of the structured
    orders, the same partitions as with fresh ones, and seeds a caller may change."""
    from fxpipe.partition import search as search_mod

    g = random_dag(4, 30, 0.1, ops=True)
    kw = dict(objective="training", comm="relay", method="orders", time_limit_s=0.0)
    fresh = [partition(g, k, **kw) for k in (2, 3)]
    search_mod._STRUCTURED_ORDERS.pop(g, None)
    real, calls = search_mod.structured_orders, []
    monkeypatch.setattr(search_mod, "structured_orders", lambda graph: calls.append(graph) or real(graph))
    again = [partition(g, k, **kw) for k in (2, 3, 2)]
    assert len(calls) == 1
    for p, q in zip(fresh + fresh[:1], again):
        assert np.array_equal(p.assignment, q.assignment) and p.meta["order"] == q.meta["order"]
    seeds = search_mod._seed_orders(g, None, None, None)
    seeds[0][1][:] = 0
    assert all(np.array_equal(o, real(g)[rule]) for rule, o in search_mod._seed_orders(g, None, None, None))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(4, 40), st.integers(1, 8), st.sampled_from(["dag", "relay"]),
       st.sampled_from([None, 0.6, 1.0]), st.floats(1.0, 3.0))
def test_slicing_with_a_bound_met_is_the_unbounded_slicing(seed, n, k, comm, mem, factor):
    """What ``decode``'s ``known`` bounds rely on: SliceGraph with any bound at or above an order's optimal
    bottleneck returns the unbounded result, value and cuts (memory limits included)."""
    from fxpipe.partition.memory import stage_memory_bytes
    from fxpipe.partition.orders import kahn_order
    from fxpipe.partition.slicegraph import kernel_inputs, slice_order_arrays

    g = random_dag(seed, n, 0.2, ops=True)
    rng = np.random.default_rng(seed)
    capacity = None
    if mem is not None:  # a capacity between the largest node and the whole model, scaled
        whole = stage_memory_bytes(g, np.zeros(g.n, dtype=np.int64), 1, "training", 1e30, comm)[0]
        capacity = mem * whole / max(1, k // 2)
    inputs = kernel_inputs(g, k, "training", comm, capacity)
    for order in [*structured_orders(g).values(), kahn_order(g, rng.random(g.n))]:
        val, cuts = slice_order_arrays(order, inputs, math.inf)
        if not math.isfinite(val):
            continue
        for bound in (val, val * (1 + 1e-9), val * factor):
            got_val, got_cuts = slice_order_arrays(order, inputs, bound)
            assert got_val == val and np.array_equal(got_cuts, cuts), (bound, val)


def test_no_partition_fits_without_slicing_a_seed_twice(monkeypatch):
    """When no seed's slicing fits the memory, every seed is sliced without a bound once and the
    search says so (InfeasibleError) without slicing the first seed again."""
    from fxpipe.errors import InfeasibleError
    from fxpipe.partition import search as search_mod

    g = random_dag(5, 30, 0.1, ops=True)
    real = search_mod.slice_order_arrays
    calls = []
    monkeypatch.setattr(search_mod, "slice_order_arrays", lambda o, inputs, bound: calls.append(bound) or real(o, inputs, bound))
    with pytest.raises(InfeasibleError):
        partition(g, 2, objective="training", comm="relay", method="orders", time_limit_s=0.0, memory=1.0,
                  chain=False, contract=False, _explain=False)
    assert calls and all(b == math.inf for b in calls) and len(calls) == len(structured_orders(g))
