"""Tensor parallelism's costs and memory (issue 29 item 3): :func:`fxpipe.mesh.tensor_parallel.tensor_parallel_graph`.

* property tests on random chains of Megatron blocks (norm on the sequence shard, columns, ops
  between, a row, the residual): one rank's compute, parameters and activations lie between
  ``1 / tp`` of the whole and the whole; split regions get exactly their collectives (ring formulas
  on the node's link), the others none; ``tp = 1`` is the identity; the structure is unchanged;
* a Llama from the matrix: every split matmul's parameters divide by ``tp``, the norms' do not,
  the sequence-parallel stage-boundary values carry ``1 / tp`` of their bytes, every region has
  its collectives on its first column and its row;
* a pinned ``tp`` plan is planned on one rank's costs (its graph carries them; the parameters of
  its devices are about ``1 / tp`` of the ``tp = 1`` plan's).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.mesh import Topology, pipeline_graph
from fxpipe.mesh.tensor_parallel import (TP_COSTS_KEY, graph_tensor_parallel, node_domains, tensor_parallel_graph,
                                         tp_collective_s)
from fxpipe.partition.memory import num_params
from fxpipe.plan.file import graph_signature

TOPO = Topology(8, 400e9, 50e9, 1e-6, 5e-6, {"all_gather": 0.8, "reduce_scatter": 0.7, "all_reduce": 0.6})


def _chain(blocks: list[dict], seq: int, rng: np.random.Generator) -> OpGraph:
    """A chain: input, then per block a norm (``sequence``), its columns, an op between (``sharded``), a row and
    the residual add (``sequence``); ``blocks[b]``: ``{"kind", "cols": [units per column]}``."""
    names, roles, regions_of, regions = ["x"], [None], [None], []
    edges = []

    def add(name, role=None, region=None):
        names.append(name)
        roles.append(role)
        regions_of.append(region)
        return len(names) - 1

    last = 0
    for b, blk in enumerate(blocks):
        norm = add(f"norm{b}", "sequence")
        edges.append((last, norm))
        cols = []
        for c, units in enumerate(blk["cols"]):
            i = add(f"col{b}_{c}", "column", b)
            edges.append((norm, i))
            cols.append({"node": f"col{b}_{c}", "params": {f"l{b}.c{c}.weight": 0}, "units": [["output features", units]]})
        mid = add(f"mid{b}", "sharded", b)
        edges += [(names.index(c["node"]), mid) for c in cols]
        row = add(f"row{b}", "row", b)
        edges.append((mid, row))
        res = add(f"res{b}", "sequence")
        edges += [(row, res), (last, res)]
        last = res
        regions.append({"id": b, "kind": blk["kind"], "module": f"l{b}", "columns": cols,
                        "rows": [{"node": f"row{b}", "params": {f"l{b}.row.weight": 1}, "columns": list(range(len(cols)))}],
                        "gathered": False})
    n = len(names)
    params = np.where(np.isin(np.asarray(roles, dtype=object), ["column", "row"]), rng.uniform(1e3, 1e6, n), 0.0)
    params[[i for i, nm in enumerate(names) if nm.startswith("norm")]] = 64.0  # a norm's weight, replicated
    extra = [{**({"tp_role": r} if r else {}), **({"tp_region": g} if g is not None else {}),
              "num_params": float(p) / 2} for r, g, p in zip(roles, regions_of, params)]
    return OpGraph.from_arrays(
        t_fwd_s=rng.uniform(1e-6, 1e-3, n), t_bwd_input_s=rng.uniform(1e-6, 1e-3, n),
        t_bwd_weight_s=rng.uniform(0, 1e-3, n), size_out_bytes=rng.uniform(1e3, 1e7, n), size_param_bytes=params,
        act_bytes=rng.uniform(0, 1e7, n), edges=edges, names=names, bandwidth_bytes_per_s=100e9, extra=extra,
        meta={"param_dtype_bytes": 2, "tensor_parallel": {"format": 1, "regions": regions, "rejected": [],
                                                          "sequence_sizes": [seq]}})


@st.composite
def chains(draw):
    blocks = [{"kind": draw(st.sampled_from(["attention", "mlp"])),
               "cols": draw(st.lists(st.sampled_from([2, 3, 4, 6, 8, 12, 16, 32]), min_size=1, max_size=3))}
              for _ in range(draw(st.integers(1, 4)))]
    return blocks, draw(st.sampled_from([3, 4, 8, 16])), draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from([2, 4, 8]))


def _work(g) -> np.ndarray:
    return np.asarray(g.t_fwd_s + g.t_bwd_input_s + g.t_bwd_weight_s)


@settings(max_examples=60, deadline=None)
@given(chains())
def test_one_rank_holds_between_a_tp_th_and_all_and_each_split_region_gets_its_collectives(case):
    blocks, seq, seed, tp = case
    g = _chain(blocks, seq, np.random.default_rng(seed))
    assert tensor_parallel_graph(g, 1) is g
    h = tensor_parallel_graph(g, tp, TOPO)
    layout = graph_tensor_parallel(g, tp)
    assert graph_signature(h) == graph_signature(g) and h.names == g.names and (h.edges == g.edges).all()
    assert tensor_parallel_graph(h, tp, TOPO) is h  # applied once
    with pytest.raises(InputError, match="already carries the costs of tp="):
        tensor_parallel_graph(h, 2 * tp)
    costs = h.meta[TP_COSTS_KEY]
    coll = costs["collective_fwd_s"] + costs["collective_bwd_s"]
    # compute without the collectives: between 1/tp of the whole and the whole, per op and in total
    compute = _work(h) - coll_per_node(g, h, tp)
    assert np.all(compute <= _work(g) * (1 + 1e-12)) and np.all(compute >= _work(g) / tp * (1 - 1e-12))
    for field in ("size_param_bytes", "act_bytes", "size_out_bytes"):
        a, b = np.asarray(getattr(h, field)), np.asarray(getattr(g, field))
        assert np.all(a <= b * (1 + 1e-12)) and np.all(a >= b / tp * (1 - 1e-12)), field
    np.testing.assert_allclose(num_params(h) * 2, h.size_param_bytes)  # the memory model's parameters follow
    # collectives: exactly the split regions', by the ring formulas, on the op that starts / ends each
    sp = layout.sequence_parallel
    expect = 0.0
    for r in g.meta["tensor_parallel"]["regions"]:
        first, row = g.names.index(r["columns"][0]["node"]), g.names.index(r["rows"][0]["node"])
        inp, out = float(g.size_out_bytes[g.names.index(f"norm{r['id']}")]), float(g.size_out_bytes[row])
        split = r["id"] in layout.regions
        if not split:
            assert h.t_fwd_s[row] == g.t_fwd_s[row] and h.size_param_bytes[row] == g.size_param_bytes[row]
            continue
        assert h.size_param_bytes[row] == pytest.approx(g.size_param_bytes[row] / tp)
        if sp:
            f_first, f_row = tp_collective_s("all_gather", inp, tp, TOPO), tp_collective_s("reduce_scatter", out, tp, TOPO)
            b_first, b_row = tp_collective_s("reduce_scatter", inp, tp, TOPO), tp_collective_s("all_gather", out, tp, TOPO)
        else:
            f_first, f_row = 0.0, tp_collective_s("all_reduce", out, tp, TOPO)
            b_first, b_row = tp_collective_s("all_reduce", inp, tp, TOPO), 0.0
        assert h.t_fwd_s[row] == pytest.approx(g.t_fwd_s[row] / tp + f_row)
        assert h.t_bwd_input_s[row] == pytest.approx(g.t_bwd_input_s[row] / tp + b_row)
        kept = set(layout.replicated_columns.get(r["id"], ()))
        assert h.t_fwd_s[first] == pytest.approx(g.t_fwd_s[first] / (1 if 0 in kept else tp) + f_first)
        assert h.t_bwd_input_s[first] == pytest.approx(g.t_bwd_input_s[first] / (1 if 0 in kept else tp) + b_first)
        assert h.size_out_bytes[row] == pytest.approx(g.size_out_bytes[row] / (tp if sp else 1))
        expect += f_first + f_row + b_first + b_row
    assert coll == pytest.approx(expect)
    if not layout.regions:  # nothing split: every rank computes everything, no collective
        assert coll == 0 and np.allclose(_work(h), _work(g)) and np.allclose(h.size_param_bytes, g.size_param_bytes)
    # the sequence ops run on the shard when sequence parallelism is on, whole otherwise
    for i, d in enumerate(node_domains(g, layout)):
        if g.extra[i].get("tp_role") == "sequence":
            assert h.act_bytes[i] == pytest.approx(g.act_bytes[i] / (tp if sp else 1))


def coll_per_node(g, h, tp) -> np.ndarray:
    """The collectives' seconds on every node: what ``h`` adds beyond its scaled compute (scale from the domains)."""
    layout = graph_tensor_parallel(g, tp)
    dom = node_domains(g, layout)
    scale = np.array([1.0 / tp if d != "plain" else 1.0 for d in dom])
    for rid, kept in layout.replicated_columns.items():
        region = next(r for r in g.meta["tensor_parallel"]["regions"] if r["id"] == rid)
        for c in kept:
            scale[g.names.index(region["columns"][c]["node"])] = 1.0
    return np.maximum(_work(h) - _work(g) * scale, 0.0)


@pytest.fixture(scope="module")
def llama():
    from fxpipe.passes import trace_model
    from fxpipe.testing import zoo

    model, args, kwargs = zoo.get("llama").one_microbatch()
    return trace_model(model, args, kwargs).graph


def test_llama_matmul_parameters_divide_by_tp_norms_do_not_and_every_region_has_collectives(llama):
    g = llama
    assert pipeline_graph(g, {"pp": 2}) is g  # tp = 1: the identity
    for tp in (2, 4):
        h = pipeline_graph(g, {"pp": 2, "tp": tp})
        layout = graph_tensor_parallel(g, tp)
        regions = g.meta["tensor_parallel"]["regions"]
        assert len(layout.regions) == len(regions) == h.meta[TP_COSTS_KEY]["regions"]
        nodes = {c["node"] for r in regions for c in r["columns"]} | {w["node"] for r in regions for w in r["rows"]}
        kept = {regions[rid]["columns"][c]["node"] for rid, cs in layout.replicated_columns.items() for c in cs}
        for i, name in enumerate(g.names):
            if name in nodes and name not in kept:
                assert h.size_param_bytes[i] == g.size_param_bytes[i] / tp, name
            else:  # norms' weights, k / v projections kept whole (grouped-query attention at tp = 4)
                assert h.size_param_bytes[i] == g.size_param_bytes[i], name
        assert (tp == 4) == bool(kept)  # the zoo Llama has 2 kv heads
        assert float(num_params(h).sum()) < float(num_params(g).sum()) / tp * 1.3
        # every split region: the forward collective on its row (reduce-scatter) and its first column (all-gather)
        for r in regions:
            for row in r["rows"]:
                i = g.names.index(row["node"])
                assert h.t_fwd_s[i] > g.t_fwd_s[i] / tp and h.t_bwd_input_s[i] > g.t_bwd_input_s[i] / tp
        # pipeline sends: a sequence-parallel value carries the shard
        seq = [i for i, e in enumerate(g.extra) if e.get("tp_role") == "sequence" and g.size_out_bytes[i] > 0]
        assert seq and all(h.size_out_bytes[i] == g.size_out_bytes[i] / tp for i in seq)
        assert graph_signature(h) == graph_signature(g)


def test_a_pinned_tp_plan_is_planned_on_one_ranks_costs():
    import fxpipe
    from fxpipe.testing import zoo

    model, args, kwargs = zoo.get("llama").one_microbatch()
    common = dict(devices=4, microbatches=4, schedule="1f1b", time_limit_s=0.3, seed=0)
    tp2 = fxpipe.compile(model, args, kwargs, mesh={"pp": 2, "tp": 2}, **common)
    pp2 = fxpipe.compile(model, args, kwargs, mesh={"pp": 2, "dp_shard": 2}, **common)
    assert tp2.graph.meta[TP_COSTS_KEY]["tp"] == 2 and TP_COSTS_KEY not in pp2.graph.meta
    assert float(tp2.graph.size_param_bytes.sum()) < 0.6 * float(pp2.graph.size_param_bytes.sum())
    assert "collectives per micro-batch" in tp2.summary()


# ----------------------------------------------------------------------------- the search (issue 29 item 4)
def _heavy_chain(blocks: int = 4, param_bytes: float = 4e9, units: int = 8):
    """A chain of Megatron blocks whose matmuls are heavy in parameters and compute, light in activations:
    data parallelism pays a large parameter sync, tensor parallelism small collectives."""
    g = _chain([{"kind": "mlp", "cols": [units]}] * blocks, 8, np.random.default_rng(0))
    roles = [e.get("tp_role") for e in g.extra]
    mm = np.isin(np.asarray(roles, dtype=object), ["column", "row"])
    import dataclasses

    n = g.n
    return dataclasses.replace(
        g, t_fwd_s=np.where(mm, 10e-3, 1e-5), t_bwd_input_s=np.where(mm, 10e-3, 1e-5),
        t_bwd_weight_s=np.where(mm, 10e-3, 0.0), size_out_bytes=np.full(n, 1e6), act_bytes=np.full(n, 1e6),
        size_param_bytes=np.where(mm, param_bytes, np.asarray(g.size_param_bytes)),
        extra=tuple(dict(e, num_params=float(p) / 2) for e, p in zip(g.extra, np.where(mm, param_bytes,
                                                                                        g.size_param_bytes))),
        meta={**g.meta, "topology": TOPO.to_dict()})


def _search(g, devices, microbatches, **opts):
    import math

    from fxpipe.mesh.search import search_mesh
    from fxpipe.options import PlanOptions
    from fxpipe.planner import resolve_memory

    memory = resolve_memory(g, None, opts.pop("memory_bytes", math.inf), None)
    return search_mesh(g, devices=devices, microbatches=microbatches, memory=memory,
                       options=PlanOptions(time_limit_s=0.3, schedule_time_limit_s=0, seed=0, **opts))


def test_the_search_offers_tp_where_the_graph_admits_it_and_picks_it_when_it_predicts_faster():
    g = _heavy_chain()
    mesh, _, (part, problem, sched, _), table = _search(g, 2, 2)
    texts = [r["mesh_text"] for r in table]
    assert "tp=2" in texts and "pp=2" in texts and "dp_shard=2" in texts
    assert mesh.get("tp") == 2, table  # 8 GB of parameters to sync over dp, 1 MB activations to gather over tp
    chosen = next(r for r in table if r.get("chosen"))
    for r in table:  # the winner is no slower than any planned candidate; every bound is below its prediction
        if "predicted_step_s" in r:
            assert chosen["predicted_step_s"] <= r["predicted_step_s"] * (1 + 1e-9)
            assert r["lower_bound_s"] <= r["predicted_step_s"] * (1 + 1e-9)
    # planned on one rank's graph: half of every matmul's parameters on the device
    assert problem is not None and float(sum(g.size_param_bytes)) > 1.9 * float(
        sum(pipeline_graph(g, mesh).size_param_bytes))
    # unlimited memory: no recomputation, no offload in the chosen plan
    assert not any(getattr(problem, "recompute", ()) or ()) and not any(o.type in ("O", "R") for o in sched.ops)
    # a pinned per-block checkpointing policy is searched with tp too (the runtime runs it on the local shards)
    _, _, _, table = _search(g, 2, 2, activation_checkpointing="full")
    assert any("tp=2" in r["mesh_text"] for r in table)
    # only the degrees that divide the widths: 6 output features admit tp = 2, not 4 or 8
    _, _, _, table = _search(_heavy_chain(param_bytes=1e6, units=6), 8, 8)
    tps = {r["mesh"].get("tp", 1) for r in table}
    assert tps == {1, 2}, tps
