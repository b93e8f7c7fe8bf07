"""Trivial-op contraction (fxpipe.partition.contract) is exact for Contract 2, and the search
built on it leaves no stage with only trivial ops."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.ir import OpGraph
from fxpipe.partition.contract import contract_trivial, trivial_nodes
from fxpipe.partition.objective import Partition, block_costs, validate_partition
from fxpipe.partition.search import merge_trivial_stages, partition

from test_partition_chain import _graph


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(3, 9), st.sampled_from(["inference", "training"]), st.sampled_from(["dag", "relay"]))
def test_contracted_costs_equal_expanded_costs(seed, n, objective, comm):
    g = _graph(seed, n, p_edge=0.35, p_zero=0.5)
    con = contract_trivial(g, objective)
    cg = con.graph
    assert cg.n <= g.n
    # totals are kept
    for f in ("t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s", "size_param_bytes", "act_bytes"):
        assert getattr(cg, f).sum() == pytest.approx(getattr(g, f).sum())
    # a merged trivial node never sits alone unless nothing could take it
    k = 3
    rng = np.random.default_rng(seed)
    edges = cg.edges.tolist()
    for _ in range(25):
        a = rng.integers(0, k, cg.n)
        # make it monotone along edges (pipeline order) by a forward sweep over a topological order
        from fxpipe.partition.orders import kahn_order

        for v in kahn_order(cg, np.arange(cg.n, dtype=float)).tolist():
            preds = cg.predecessors(v)
            if preds.size:
                a[v] = max(a[v], a[preds].max())
        assert all(a[u] <= a[v] for u, v in edges)
        want = block_costs(g, con.expand(a), k, objective, comm)
        got = block_costs(cg, a, k, objective, comm)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # placeholders and outputs keep their kinds
    for v in range(g.n):
        if g.ops[v] == "placeholder":
            assert cg.ops[con.group[v]] == "placeholder"
        if g.ops[v] == "output":
            assert cg.ops[con.group[v]] == "output"


def test_output_node_joins_its_producer_and_views_join_consumers():
    # x -> view -> mm (work) -> logits (work) -> output ; a view with one consumer and the output merge
    g = OpGraph.from_arrays(
        t_fwd_s=[0.0, 0.0, 1.0, 2.0, 0.0], size_out_bytes=[1.0, 1.0, 4.0, 100.0, 0.0],
        edges=[(0, 1), (1, 2), (2, 3), (3, 4)], ops=["placeholder", "call_function", "call_function", "call_function", "output"],
    )
    con = contract_trivial(g, "inference")
    assert con.group[1] == con.group[2]  # view joins its consumer
    assert con.group[4] == con.group[3]  # output joins the logits producer
    assert con.group[0] != con.group[3]
    assert trivial_nodes(g, "inference").tolist() == [False, True, False, False, True]


def _logits_model(n_layers: int = 6) -> OpGraph:
    """input -> layers (work 1 each, 1-byte activations) -> lm_head (work 1) -> output, the
    lm_head output (logits) 1000x bigger than an activation; an alias after the last layer."""
    t, size, ops, edges = [0.0], [1.0], ["placeholder"], []
    prev = 0
    for _ in range(n_layers):
        t.append(1.0)
        size.append(1.0)
        ops.append("call_function")
        edges.append((prev, len(t) - 1))
        prev = len(t) - 1
    t.append(0.0)  # alias
    size.append(1.0)
    ops.append("call_function")
    edges.append((prev, len(t) - 1))
    prev = len(t) - 1
    t.append(1.0)  # lm_head
    size.append(1000.0)
    ops.append("call_function")
    edges.append((prev, len(t) - 1))
    prev = len(t) - 1
    t.append(0.0)
    size.append(0.0)
    ops.append("output")
    edges.append((prev, len(t) - 1))
    return OpGraph.from_arrays(t_fwd_s=t, size_out_bytes=size, edges=edges, ops=ops, bandwidth_bytes_per_s=1000.0)


def test_merge_trivial_stages_puts_the_output_with_the_logits():
    g = _logits_model()  # nodes: 0 input, 1-6 layers, 7 alias, 8 lm_head, 9 output
    k = 4
    alias_alone = np.array([0, 0, 0, 0, 1, 1, 1, 2, 3, 3])
    output_alone = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 3])  # stage 3 receives the logits
    for assign in (alias_alone, output_alone):
        p = Partition.from_assignment(g, assign, k, "inference", "relay")
        q = merge_trivial_stages(g, p, "inference")
        validate_partition(g, q)
        work = np.bincount(q.assignment, weights=g.t_fwd_s, minlength=k)
        cnt = np.bincount(q.assignment, minlength=k)
        assert not ((cnt > 0) & (work == 0)).any()
        assert q.bottleneck <= p.bottleneck * (1 + 1e-12)
        assert q.assignment[9] == q.assignment[8]  # output with lm_head


@pytest.mark.parametrize("comm", ["dag", "relay"])
def test_search_leaves_no_trivial_only_stage(comm):
    g = _logits_model(10)
    for k in (2, 3, 4, 6):
        p = partition(g, k, objective="inference", comm=comm, time_limit_s=2, seed=0)
        validate_partition(g, p)
        work = np.bincount(p.assignment, weights=g.t_fwd_s, minlength=k)
        cnt = np.bincount(p.assignment, minlength=k)
        assert not ((cnt > 0) & (work == 0)).any(), (k, p.assignment)
        out = g.ops.index("output")
        assert p.assignment[out] == p.assignment[out - 1]
