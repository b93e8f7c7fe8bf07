"""Property test of :func:`fxpipe.passes.structure.align_order` on random DAGs (issue 17 item 2).

Two fx graphs of one random DAG, emitted in two random topological orders (what two processes
with different ``PYTHONHASHSEED`` trace: the same ops under other names, independent ops in
another order), are matched to the first one's structure and split at the same cuts: every
stage boundary must list the same tensors in the same order on both, and both staged programs
must compute what the graph computes.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxpipe.codegen.split import split_stages
from fxpipe.passes.structure import PlanStructure, map_stage_of, match_nodes, structural_keys

WIDTH = 4


@st.composite
def dags(draw):
    """``(parents, widths)`` of 2..10 nodes; node ``i``'s parents are earlier nodes or -1 (the input)."""
    n = draw(st.integers(2, 10))
    parents, widths = [], []
    for i in range(n):
        pool = list(range(-1, i))
        parents.append(sorted(draw(st.sets(st.sampled_from(pool), min_size=1, max_size=min(3, len(pool))))))
        widths.append(draw(st.integers(1, WIDTH)))
    return parents, widths


def _emit(parents, widths, seed: int) -> fx.GraphModule:
    """The DAG as a graph module, its nodes emitted in the topological order a seeded random
    priority gives: node i is ``tanh(cat(parents)[:, :w] * (i + 1))`` (``w``: ``w_i``, at most the
    parents' width); the output is every sink."""
    rng = random.Random(seed)
    n = len(parents)
    g = fx.Graph()
    x = g.placeholder("x")
    value: dict[int, fx.Node] = {-1: x}
    out_width: dict[int, int] = {}
    done: set[int] = set()
    while len(done) < n:
        ready = [i for i in range(n) if i not in done and all(p in done or p == -1 for p in parents[i])]
        i = rng.choice(ready)
        ins = [value[p] for p in parents[i]]
        cat = g.call_function(torch.cat, (ins, 1)) if len(ins) > 1 else ins[0]
        width = min(widths[i], sum(WIDTH if p == -1 else out_width[p] for p in parents[i]))
        out_width[i] = width
        cut = g.call_function(torch.narrow, (cat, 1, 0, width))
        value[i] = g.call_function(torch.tanh, (g.call_function(torch.mul, (cut, float(i + 1))),))
        done.add(i)
    used = {p for ps in parents for p in ps}
    g.output(tuple(value[i] for i in range(n) if i not in used))
    gm = fx.GraphModule(torch.nn.Module(), g)
    FakeTensorProp(gm).propagate(torch.zeros(2, WIDTH))
    return gm


def _structure(gm: fx.GraphModule) -> PlanStructure:
    """What a plan keeps of ``gm`` (its OpGraph nodes: placeholders, calls, the output)."""
    keys = structural_keys(gm)
    names = list(keys)
    index = {m: i for i, m in enumerate(names)}
    by_name = {n.name: n for n in gm.graph.nodes}
    preds = tuple(tuple(index[a.name] for a in by_name[m].all_input_nodes if a.name in index) for m in names)
    return PlanStructure(tuple(names), tuple(keys[m][0] for m in names), preds, tuple(names))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag=dags(), seeds=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), cuts=st.data())
def test_every_order_splits_into_the_plans_boundaries(dag, seeds, cuts):
    plan_gm, other = _emit(*dag, seeds[0]), _emit(*dag, seeds[1])
    structure = _structure(plan_gm)
    order = [n.name for n in plan_gm.graph.nodes]
    k = cuts.draw(st.integers(2, 4))
    at = sorted(cuts.draw(st.sets(st.integers(1, len(order) - 1), min_size=k - 1, max_size=k - 1)))
    stage_of = {m: sum(i >= a for a in at) for i, m in enumerate(order)}  # a prefix cut of a topological order

    theirs = split_stages(plan_gm, map_stage_of(structure, stage_of, plan_gm), k)
    mine = split_stages(other, map_stage_of(structure, stage_of, other), k)
    to_plan = {here: p for p, here in match_nodes(structure, other).items()}
    assert [[to_plan.get(m, m) for m in b] for b in mine.boundary_names] == [list(b) for b in theirs.boundary_names]
    x = torch.randn(2, WIDTH)
    want = plan_gm(x)
    for staged in (theirs, mine):
        got = staged.run(x)
        got = got if isinstance(got, tuple) else (got,)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_a_reordered_graph_still_computes_the_same():
    """align_order moves nodes only: the graph module computes what it did."""
    dag = ([[-1], [-1], [0, 1], [0], [2, 3]], [4, 3, 2, 4, 1])
    plan_gm, other = _emit(*dag, 1), _emit(*dag, 2)
    x = torch.randn(2, WIDTH)
    before = other(x)
    assert [n.name for n in other.graph.nodes] != [n.name for n in plan_gm.graph.nodes]
    map_stage_of(_structure(plan_gm), {n.name: 0 for n in plan_gm.graph.nodes}, other)
    for a, b in zip(other(x), before):
        torch.testing.assert_close(a, b)
    other.graph.lint()
