"""SliceGraph DP kernel and Kahn orders against plain-Python references and brute force."""

import itertools
import math
import os
import subprocess
import sys

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition.objective import block_costs, validate_partition
from fxpipe.partition.orders import (
    STRUCTURED_RULES,
    kahn_order,
    keys_from_order,
    node_classes,
    random_order,
    structured_orders,
)
from fxpipe.partition.slicegraph import kernel_inputs, slice_order, slice_order_arrays

from naive import brute_force_partition
from naive_partition import brute_cuts, kahn_reference, naive_slice, random_dag

COMBOS = [(o, c) for o in ("inference", "training") for c in ("dag", "relay")]
SETTINGS = dict(max_examples=12, deadline=None)


def _kernel_value(graph, order, k, objective, comm, incumbent=math.inf):
    inputs = kernel_inputs(graph, k, objective, comm)
    val, _ = slice_order_arrays(np.asarray(order, dtype=np.int64), inputs, incumbent)
    return val


def _close(a, b):
    return a == b or abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


@pytest.mark.parametrize("objective,comm", COMBOS)
@settings(**SETTINGS)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 13), k=st.integers(1, 5), p=st.floats(0.1, 0.7))
def test_kernel_equals_naive_dp(objective, comm, seed, n, k, p):
    g = random_dag(seed, n, p)
    order = random_order(g, np.random.default_rng(seed))
    want = naive_slice(g, order, k, objective, comm)
    part = slice_order(g, order, k, objective, comm)
    assert _close(part.meta["kernel_bottleneck"], want)
    assert _close(part.bottleneck, want)
    validate_partition(g, part)
    # costs recomputed independently of the Partition class
    assert np.allclose(block_costs(g, part.assignment, k, objective, comm), part.block_costs, rtol=1e-12)


@pytest.mark.parametrize("objective,comm", COMBOS)
@settings(**SETTINGS)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 8), k=st.integers(1, 4), integer=st.booleans())
def test_kernel_equals_brute_force_over_cuts(objective, comm, seed, n, k, integer):
    g = random_dag(seed, n, 0.4, integer=integer)
    order = random_order(g, np.random.default_rng(seed + 1))
    assert _close(_kernel_value(g, order, k, objective, comm), brute_cuts(g, order, k, objective, comm))


@pytest.mark.parametrize("objective,comm", COMBOS)
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 7), k=st.integers(1, 3))
def test_best_slicing_over_all_orders_equals_brute_force(objective, comm, seed, n, k):
    """Archer Section 4.1: every acyclic partition is a slicing of some topological order."""
    g = random_dag(seed, n, 0.35, integer=seed % 2 == 0)
    inputs = kernel_inputs(g, k, objective, comm)
    best = math.inf
    for order in nx.all_topological_sorts(g.to_networkx()):
        val, _ = slice_order_arrays(np.asarray(order, dtype=np.int64), inputs, math.inf)
        best = min(best, val)
    want, _ = brute_force_partition(g, k, objective, comm)
    assert _close(best, want)


def test_best_slicing_over_all_orders_on_8_nodes():
    for seed, (objective, comm) in zip(range(4), COMBOS):
        g = random_dag(100 + seed, 8, 0.45)
        inputs = kernel_inputs(g, 3, objective, comm)
        best = min(slice_order_arrays(np.asarray(o, dtype=np.int64), inputs, math.inf)[0] for o in nx.all_topological_sorts(g.to_networkx()))
        assert _close(best, brute_force_partition(g, 3, objective, comm)[0])


@pytest.mark.parametrize("objective,comm", COMBOS)
def test_incumbent_pruning_keeps_the_optimum(objective, comm):
    for seed in range(6):
        g = random_dag(seed, 12, 0.3)
        order = random_order(g, np.random.default_rng(seed))
        opt = _kernel_value(g, order, 4, objective, comm)
        for inc in (opt, opt * 1.5, opt * 10):
            p = slice_order(g, order, 4, objective, comm, incumbent=inc)
            assert p is not None and _close(p.bottleneck, opt)
        assert slice_order(g, order, 4, objective, comm, incumbent=opt * (1 - 1e-6)) is None


def test_k_larger_than_n_leaves_trailing_blocks_empty():
    g = random_dag(3, 4, 0.5)
    order = random_order(g, np.random.default_rng(0))
    p = slice_order(g, order, 7, "training", "relay")
    validate_partition(g, p)
    assert p.k == 7 and p.assignment.max() <= 3
    assert np.all(p.block_costs[4:] == 0)


def test_hand_computed_relay_example():
    # chain 0 -> 1 -> 2 plus a skip 0 -> 2; cut [0], [1], [2]: tensor 0 passes through block 1
    g = OpGraph.from_arrays(t_fwd_s=[1, 1, 1], size_out_bytes=[10, 1, 0], edges=[[0, 1], [1, 2], [0, 2]], bandwidth_bytes_per_s=1.0)
    assert block_costs(g, [0, 1, 2], 3, "inference", "relay").tolist() == [11, 1 + 10 + 11, 1 + 11]
    p = slice_order(g, [0, 1, 2], 3, "inference", "relay")
    assert p.bottleneck == 3.0 and p.assignment.tolist() == [0, 0, 0]  # one block: no io
    p2 = slice_order(g, [0, 1, 2], 3, "inference", "dag")
    assert p2.bottleneck == 3.0


def test_zero_costs():
    g = OpGraph.from_arrays(t_fwd_s=[0, 0, 0, 0], size_out_bytes=[0, 0, 0, 0], edges=[[0, 1], [1, 2], [2, 3]])
    p = slice_order(g, [0, 1, 2, 3], 3)
    validate_partition(g, p)
    assert p.bottleneck == 0.0


def test_slice_order_rejects_bad_input():
    g = random_dag(1, 5, 0.6)
    order = random_order(g, np.random.default_rng(0))
    with pytest.raises(InputError, match="permutation"):
        slice_order(g, order[:-1], 2)
    with pytest.raises(InputError, match="permutation"):
        slice_order(g, np.r_[order[:-1], order[0]], 2)
    with pytest.raises(InputError, match="topological"):
        slice_order(g, order[::-1], 2)
    with pytest.raises(InputError, match="k"):
        slice_order(g, order, 0)
    with pytest.raises(InputError, match="k"):
        slice_order(g, order, 2.5)
    with pytest.raises(InputError, match="objective"):
        slice_order(g, order, 2, objective="latency")
    with pytest.raises(InputError, match="comm"):
        slice_order(g, order, 2, comm="ring")


# ---------------------------------------------------------------- orders


@settings(**SETTINGS)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 30))
def test_kahn_kernel_equals_heapq_reference(seed, n):
    g = random_dag(seed, n, 0.2, ops=True)
    keys = np.random.default_rng(seed).random(n)
    assert kahn_order(g, keys).tolist() == kahn_reference(g, keys, node_classes(g))


def _assert_topological_with_io_rule(g, order):
    pos = np.empty(g.n, dtype=np.int64)
    pos[order] = np.arange(g.n)
    assert sorted(order.tolist()) == list(range(g.n))
    assert all(pos[u] < pos[v] for u, v in g.edges.tolist())
    ph = [i for i, op in enumerate(g.ops) if op == "placeholder"]
    outs = [i for i, op in enumerate(g.ops) if op == "output"]
    assert sorted(pos[ph].tolist()) == list(range(len(ph)))
    assert sorted(pos[outs].tolist()) == list(range(g.n - len(outs), g.n))


def _transformer_like(layers=3):
    """placeholder -> embedding -> [attention, mlp with residual] * layers -> output."""
    names, ops, edges = ["x", "params"], ["placeholder", "placeholder"], []
    prev = None

    def add(name, *preds, op="call_function"):
        names.append(name)
        ops.append(op)
        v = len(names) - 1
        edges.extend([p, v] for p in preds)
        return v

    prev = add("emb", 0, 1)
    for i in range(layers):
        q, kk, vv = add(f"q{i}", prev), add(f"k{i}", prev), add(f"v{i}", prev)
        att = add(f"att{i}", q, kk, vv)
        r1 = add(f"res1_{i}", att, prev)
        up = add(f"up{i}", r1)
        down = add(f"down{i}", up)
        prev = add(f"res2_{i}", down, r1)
    add("output", prev, op="output")
    n = len(names)
    rng = np.random.default_rng(0)
    return OpGraph.from_arrays(t_fwd_s=rng.random(n), size_out_bytes=rng.integers(1, 100, n), edges=edges, names=names, ops=ops)


def test_structured_and_random_orders_put_placeholders_first_and_output_last():
    g = _transformer_like()
    orders = structured_orders(g)
    assert set(orders) <= set(STRUCTURED_RULES) and len(orders) >= 2
    for o in orders.values():
        _assert_topological_with_io_rule(g, o)
    rng = np.random.default_rng(0)
    for _ in range(20):
        _assert_topological_with_io_rule(g, random_order(g, rng))
    for seed in range(10):
        gr = random_dag(seed, 15, 0.25, ops=True)
        for o in structured_orders(gr).values():
            _assert_topological_with_io_rule(gr, o)


def test_program_order_is_identity_for_traced_ids():
    g = _transformer_like()
    assert structured_orders(g)["program"].tolist() == list(range(g.n))


def test_keys_from_order_reproduce_any_topological_order():
    g = random_dag(7, 7, 0.3)
    for o in itertools.islice(nx.all_topological_sorts(g.to_networkx()), 200):
        assert kahn_order(g, keys_from_order(o)).tolist() == list(o)


def test_kahn_order_rejects_bad_priorities():
    g = random_dag(1, 4, 0.5)
    with pytest.raises(InputError):
        kahn_order(g, [0.1, 0.2])
    with pytest.raises(InputError):
        kahn_order(g, [0.1, np.nan, 0.2, 0.3])


def test_kernel_without_jit_matches_naive():
    """The kernels also run as plain Python (NUMBA_DISABLE_JIT=1): a subset, in a subprocess."""
    code = (
        "import numpy as np, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "from naive_partition import random_dag, naive_slice\n"
        "from fxpipe.partition.orders import random_order\n"
        "from fxpipe.partition.slicegraph import slice_order\n"
        "from fxpipe.partition.search import partition\n"
        "from fxpipe.partition.objective import validate_partition\n"
        "for seed in range(8):\n"
        "    g = random_dag(seed, 9, 0.3)\n"
        "    o = random_order(g, np.random.default_rng(seed))\n"
        "    for obj, comm in [('inference','dag'),('training','relay'),('training','dag'),('inference','relay')]:\n"
        "        want = naive_slice(g, o, 3, obj, comm)\n"
        "        got = slice_order(g, o, 3, obj, comm).bottleneck\n"
        "        assert abs(got - want) <= 1e-9 * max(1, want), (seed, obj, comm, got, want)\n"
        "p = partition(random_dag(1, 12, 0.3), 3, method='brkga', evaluations=60, brkga_params=None)\n"
        "validate_partition(random_dag(1, 12, 0.3), p)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("ok")


@pytest.mark.parametrize("objective,comm", COMBOS)
def test_io_dominated_graphs_use_bound_deepening_exactly(objective, comm):
    """Tiny bandwidth: the equal-work incumbent is far above max(W/k, max work)."""
    for seed in range(5):
        g0 = random_dag(300 + seed, 12, 0.3)
        g = OpGraph.from_arrays(t_fwd_s=g0.t_fwd_s, t_bwd_input_s=g0.t_bwd_input_s, t_bwd_weight_s=g0.t_bwd_weight_s,
                                size_out_bytes=g0.size_out_bytes, edges=g0.edges, bandwidth_bytes_per_s=1e-3)
        order = random_order(g, np.random.default_rng(seed))
        for k in (2, 4):
            assert _close(_kernel_value(g, order, k, objective, comm), naive_slice(g, order, k, objective, comm))
