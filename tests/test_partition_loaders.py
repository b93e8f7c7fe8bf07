"""Loaders for the dnn-partitioning and PipeDream graphs: real files, hand-made files, errors.

The dnn-partitioning oracle below recomputes that project's own throughput objective
(``computeLoadForResultOrg`` in ``throughput-dp/dp.cpp``) from the raw JSON, independently of
the loader, and compares it with the Contract-2 cost of the loaded OpGraph.
"""

from __future__ import annotations

import collections
import glob
import json
import math
import os
import re

import numpy as np
import pytest

from fxpipe.errors import InputError
from fxpipe.partition.loaders import PIPEDREAM_DEFAULT_BANDWIDTH_BYTES_PER_S, load_dnn_partitioning, load_pipedream
from fxpipe.partition.objective import block_costs

DATA = "/work/shared/data"
DNN_FILES = sorted(glob.glob(f"{DATA}/dnn-partitioning/throughput-inputs/*/*.json"))
PD_FILES = sorted(glob.glob(f"{DATA}/pipedream-profiles/*.graph.txt"))
needs_data = pytest.mark.skipif(not DNN_FILES or not PD_FILES, reason="shared data not available")


# --------------------------------------------------------------------------------------
# independent oracle: dnn-partitioning's objective on original nodes
# --------------------------------------------------------------------------------------


def their_block_loads(doc: dict, device_of_original: dict[int, int], k: int) -> np.ndarray:
    lat = collections.defaultdict(float)
    for node in doc["nodes"]:
        lat[device_of_original[node["id"]]] += node["fpgaLatency"]
    out_cost = {}
    for e in doc["edges"]:
        out_cost[e["sourceId"]] = max(out_cost.get(e["sourceId"], 0.0), e["cost"])
    groups_with_edge_from = collections.defaultdict(set)
    for e in doc["edges"]:
        a, b = device_of_original[e["sourceId"]], device_of_original[e["destId"]]
        if a != b:
            groups_with_edge_from[e["sourceId"]].add(b)
    comm = collections.defaultdict(float)
    for u, groups in groups_with_edge_from.items():
        comm[device_of_original[u]] += out_cost[u]
        for g in groups:
            comm[g] += out_cost[u]
    return np.array([lat[b] + comm[b] for b in range(k)])


def _random_monotone_assignment(graph, k, rng):
    # contiguous split of a random topological order (Kahn with random priorities)
    indeg = np.diff(graph.pred_ptr).copy()
    ready = [v for v in range(graph.n) if indeg[v] == 0]
    order = []
    while ready:
        v = ready.pop(int(rng.integers(len(ready))))
        order.append(v)
        for w in graph.successors(v):
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.append(int(w))
    cuts = np.sort(rng.integers(0, graph.n + 1, size=k - 1))
    a = np.empty(graph.n, dtype=np.int64)
    for pos, v in enumerate(order):
        a[v] = int(np.searchsorted(cuts, pos, side="right"))
    return a


@needs_data
@pytest.mark.parametrize("path", DNN_FILES, ids=lambda p: "/".join(p.split("/")[-2:]))
def test_dnn_partitioning_real_files(path):
    g = load_dnn_partitioning(path)
    doc = json.load(open(path))
    # sane sizes, a DAG (from_arrays checks it), non-negative costs
    assert 1 <= g.n <= len(doc["nodes"])
    assert g.m <= len(doc["edges"])
    for arr in (g.t_fwd_s, g.size_out_bytes, g.size_param_bytes):
        assert np.all(arr >= 0) and np.all(np.isfinite(arr))
    assert np.all(g.t_bwd_input_s == 0) and np.all(g.t_bwd_weight_s == 0)
    assert g.bandwidth_bytes_per_s == 1.0
    assert g.meta["time_unit"]
    # every original node in exactly one group; work and memory are conserved
    members = [m for e in g.extra for m in e["members"]]
    assert sorted(members) == sorted(n["id"] for n in doc["nodes"])
    assert math.isclose(g.t_fwd_s.sum(), sum(n["fpgaLatency"] for n in doc["nodes"]), rel_tol=1e-12)
    assert math.isclose(g.size_param_bytes.sum(), sum(n.get("size", 0.0) for n in doc["nodes"]), rel_tol=1e-12)
    # a colour class never spans two groups
    group_of = {m: i for i, e in enumerate(g.extra) for m in e["members"]}
    by_class = collections.defaultdict(set)
    for node in doc["nodes"]:
        if "colorClass" in node:
            by_class[node["colorClass"]].add(group_of[node["id"]])
    assert all(len(s) == 1 for s in by_class.values())
    # training graphs: forward and backward of a layer end up together
    if any(n["isBackwardNode"] for n in doc["nodes"]):
        assert g.meta["training"]
        assert any(e["backward_members"] for e in g.extra)
    # ids are a topological order
    if g.m:
        assert np.all(g.edges[:, 0] < g.edges[:, 1])
    # the Contract-2 cost equals dnn-partitioning's objective (exact files) or bounds it
    rng = np.random.default_rng(0)
    for k in (2, 3, 5):
        for _ in range(3):
            a = _random_monotone_assignment(g, k, rng)
            ours = block_costs(g, a, k, "inference", "dag")
            dev = {m: int(a[group_of[m]]) for m in members}
            theirs = their_block_loads(doc, dev, k)
            if g.meta["io_exact"]:
                np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-12)
            else:
                assert np.all(ours >= theirs - 1e-9 * np.maximum(1, theirs))


@needs_data
def test_layer_graphs_are_exact_and_training_keeps_the_forward_structure():
    base = f"{DATA}/dnn-partitioning/throughput-inputs/LayerGraphs"
    for model in ("bert24", "gnmt", "inceptionv3", "resnet50"):
        inf = load_dnn_partitioning(f"{base}/{model}_inference.json")
        tr = load_dnn_partitioning(f"{base}/{model}_training.json")
        assert inf.meta["io_exact"] and tr.meta["io_exact"]
        # one node per forward layer in both; training adds the backward work
        assert tr.n == inf.n and tr.m == inf.m
        assert tr.t_fwd_s.sum() > inf.t_fwd_s.sum()


def _write(tmp_path, doc, name="g.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


def _node(i, lat=1.0, cc=None, bwd=0, size=0.0):
    d = {"id": i, "name": f"n{i}", "fpgaLatency": lat, "cpuLatency": 10 * lat, "isBackwardNode": bwd,
         "supportedOnFpga": 1, "size": size}
    if cc is not None:
        d["colorClass"] = cc
    return d


def _edge(u, v, c):
    return {"sourceId": u, "destId": v, "cost": c, "size": 0.0}


def _doc(nodes, edges):
    return {"maxSizePerFPGA": 1e9, "maxFPGAs": 4, "maxCPUs": 1, "nodes": nodes, "edges": edges}


def test_dnn_colour_classes_are_contracted(tmp_path):
    # chain 1 -> 2 -> 3 -> 4; nodes 2 and 3 share a class
    doc = _doc([_node(1, 1, 1), _node(2, 2, 7), _node(3, 3, 7), _node(4, 4, 4, size=5.0)],
               [_edge(1, 2, 0.5), _edge(2, 3, 0.25), _edge(3, 4, 0.125)])
    g = load_dnn_partitioning(_write(tmp_path, doc))
    assert g.n == 3 and g.edges.tolist() == [[0, 1], [1, 2]]
    assert g.t_fwd_s.tolist() == [1, 5, 4]
    assert g.size_out_bytes.tolist() == [0.5, 0.125, 0.0]  # 2 -> 3 is internal
    assert g.size_param_bytes.tolist() == [0, 0, 5]
    assert g.extra[1]["members"] == [2, 3]
    assert g.meta["maxFPGAs"] == 4 and g.meta["io_exact"]


def test_dnn_cycle_from_contraction_is_merged(tmp_path):
    # 1 -> 2 -> 3 -> 4 with 1 and 3 in one class: {1,3} <-> 2 is a cycle, so 1, 2, 3 merge
    doc = _doc([_node(1, 1, 1), _node(2, 1, 2), _node(3, 1, 1), _node(4, 1, 4)],
               [_edge(1, 2, 1.0), _edge(2, 3, 1.0), _edge(3, 4, 2.0)])
    g = load_dnn_partitioning(_write(tmp_path, doc))
    assert g.n == 2 and g.edges.tolist() == [[0, 1]]
    assert g.extra[0]["members"] == [1, 2, 3]
    assert g.t_fwd_s.tolist() == [3, 1] and g.size_out_bytes.tolist() == [2.0, 0.0]
    assert g.meta["merged_components"] == 1


def test_dnn_training_pairs_and_gradients(tmp_path):
    # forward 1 -> 2 -> 3, backward 13 -> 12 -> 11 (gradients flow back), classes 1, 2, 3
    nodes = [_node(1, 1, 1), _node(2, 2, 2), _node(3, 3, 3),
             _node(11, 10, 1, bwd=1), _node(12, 20, 2, bwd=1), _node(13, 30, 3, bwd=1)]
    edges = [_edge(1, 2, 1.0), _edge(2, 3, 2.0), _edge(13, 12, 4.0), _edge(12, 11, 8.0)]
    g = load_dnn_partitioning(_write(tmp_path, _doc(nodes, edges)))
    assert g.n == 3 and g.edges.tolist() == [[0, 1], [1, 2]]
    assert g.t_fwd_s.tolist() == [11, 22, 33]
    # cut between 1|2 costs 1 (activation) + 8 (gradient of 12) on both sides
    assert g.size_out_bytes.tolist() == [1 + 8, 2 + 4, 0]
    assert g.meta["training"] and g.meta["io_exact"]
    np.testing.assert_allclose(block_costs(g, [0, 1, 1], 2), [11 + 9, 55 + 9])


def test_dnn_orphan_backward_class_and_missing_colour(tmp_path):
    # class 5 has only a backward node; it is placed by the mirrored backward edge 13 -> 15
    nodes = [_node(1, 1, 1), _node(3, 1, 3), _node(11, 1, 1, bwd=1), _node(13, 1, 3, bwd=1),
             _node(15, 2, 5, bwd=1), _node(20, 1)]  # node 20 has no colorClass: its own class
    edges = [_edge(1, 3, 1.0), _edge(13, 15, 1.0), _edge(15, 11, 1.0), _edge(3, 20, 1.0)]
    g = load_dnn_partitioning(_write(tmp_path, _doc(nodes, edges)))
    group_of = {m: i for i, e in enumerate(g.extra) for m in e["members"]}
    assert len({group_of[1], group_of[3], group_of[15], group_of[20]}) == 4
    assert group_of[1] < group_of[15] < group_of[3]  # mirrored: 15 sits between 1 and 3


def test_dnn_inconsistent_costs_take_the_max(tmp_path):
    doc = _doc([_node(1), _node(2), _node(3)], [_edge(1, 2, 1.0), _edge(1, 3, 3.0)])
    g = load_dnn_partitioning(_write(tmp_path, doc))
    assert g.size_out_bytes[0] == 3.0 and g.meta["inconsistent_edge_costs"] == 1


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("nodes"), "'nodes' must be a non-empty list"),
        (lambda d: d["nodes"][0].pop("fpgaLatency"), "lacks the required key 'fpgaLatency'"),
        (lambda d: d["nodes"][1].update(fpgaLatency=-1.0), "expected a finite number >= 0"),
        (lambda d: d["nodes"][1].update(fpgaLatency="fast"), "expected a number"),
        (lambda d: d["nodes"][1].update(id=1), "appears twice"),
        (lambda d: d["edges"].append(_edge(1, 99, 1.0)), "names node 99"),
        (lambda d: d["edges"][0].pop("cost"), "lacks the required key 'cost'"),
        (lambda d: d["edges"].append(_edge(2, 2, 1.0)), "self-loop"),
        (lambda d: d["nodes"][0].update(isBackwardNode=1), "backward node 1 feeds forward node 2"),
    ],
)
def test_dnn_malformed_files(tmp_path, mutate, message):
    doc = _doc([_node(1), _node(2)], [_edge(1, 2, 1.0)])
    mutate(doc)
    with pytest.raises(InputError, match=re.escape(message)):
        load_dnn_partitioning(_write(tmp_path, doc))


def test_dnn_not_json_and_missing(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{nodes: ")
    with pytest.raises(InputError, match="not valid JSON"):
        load_dnn_partitioning(str(p))
    with pytest.raises(InputError, match="does not exist"):
        load_dnn_partitioning(str(tmp_path / "missing.json"))


# --------------------------------------------------------------------------------------
# PipeDream
# --------------------------------------------------------------------------------------


def _parse_pd(path):
    nodes, edges = {}, []
    for line in open(path):
        s = line.strip()
        if not s:
            continue
        if "forward_compute_time=" in s:
            nodes[s.split(" -- ")[0]] = s
        else:
            a, b = s.split(" -- ")
            edges.append((a, b))
    return nodes, edges


@needs_data
@pytest.mark.parametrize("path", PD_FILES, ids=os.path.basename)
def test_pipedream_real_files(path):
    g = load_pipedream(path)
    nodes, edges = _parse_pd(path)
    assert g.n == len(nodes)
    assert g.m == len(set(edges))
    assert g.bandwidth_bytes_per_s == PIPEDREAM_DEFAULT_BANDWIDTH_BYTES_PER_S
    for arr in (g.t_fwd_s, g.t_bwd_input_s, g.t_bwd_weight_s, g.size_out_bytes, g.size_param_bytes):
        assert np.all(arr >= 0) and np.all(np.isfinite(arr))
    # ids are a topological order and every file edge is present
    pos = {name: i for i, name in enumerate(g.names)}
    assert np.all(g.edges[:, 0] < g.edges[:, 1])
    assert {(pos[a], pos[b]) for a, b in edges} == set(map(tuple, g.edges.tolist()))
    # ms -> s; the first node's numbers match the file
    name0 = g.names[0]
    f = float(re.search(r"forward_compute_time=([\d.]+)", nodes[name0]).group(1))
    assert math.isclose(g.t_fwd_s[0], f * 1e-3)
    assert g.ops.count("placeholder") >= 1 and g.ops[0] == "placeholder"
    even = load_pipedream(path, backward_split="even", bandwidth_bytes_per_s=1e9)
    np.testing.assert_allclose(even.t_train_s, g.t_train_s)
    assert np.all(even.t_bwd_weight_s[even.size_param_bytes == 0] == 0)
    assert even.bandwidth_bytes_per_s == 1e9


PD_OK = """node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=16.0, parameter_size=0.000
node3 -- ReLU() -- forward_compute_time=2.000, backward_compute_time=1.000, activation_size=[8.0; 4.0], parameter_size=0.000
node2 -- Linear(in_features=4, out_features=4, bias=True) -- forward_compute_time=1.500, backward_compute_time=3.000, activation_size=16.0, parameter_size=80.000
\tnode1 -- node2
\tnode2 -- node3
"""


def test_pipedream_hand_made(tmp_path):
    p = tmp_path / "tiny.graph.txt"
    p.write_text(PD_OK)
    g = load_pipedream(str(p))
    assert g.name == "tiny"
    assert g.names == ("node1", "node2", "node3")
    assert g.ops == ("placeholder", "call_module", "call_module")
    np.testing.assert_allclose(g.t_fwd_s, [0, 1.5e-3, 2e-3])
    np.testing.assert_allclose(g.t_bwd_input_s, [0, 3e-3, 1e-3])
    np.testing.assert_allclose(g.size_out_bytes, [16, 16, 12])
    np.testing.assert_allclose(g.size_param_bytes, [0, 80, 0])
    assert g.edges.tolist() == [[0, 1], [1, 2]]
    e = load_pipedream(str(p), backward_split="even")
    np.testing.assert_allclose(e.t_bwd_weight_s, [0, 1.5e-3, 0])


@pytest.mark.parametrize(
    "text, message",
    [
        (PD_OK.replace("parameter_size=80.000", ""), "lacks parameter_size="),
        (PD_OK.replace("forward_compute_time=2.000", "forward_compute_time=abc"), "is not a number"),
        (PD_OK.replace("forward_compute_time=2.000", "forward_compute_time=-2"), "must be finite and >= 0"),
        (PD_OK + "\tnode3 -- node9\n", "names node9, which has no node line"),
        (PD_OK + "\tnode3 -- node1\n", "cycle"),
        (PD_OK + "garbage line\n", "cannot parse"),
        (PD_OK + PD_OK.splitlines()[0] + "\n", "declared twice"),
        ("\n\n", "no node lines"),
    ],
)
def test_pipedream_malformed(tmp_path, text, message):
    p = tmp_path / "bad.graph.txt"
    p.write_text(text)
    with pytest.raises(InputError, match=re.escape(message)):
        load_pipedream(str(p))


def test_pipedream_bad_arguments(tmp_path):
    p = tmp_path / "tiny.graph.txt"
    p.write_text(PD_OK)
    with pytest.raises(InputError, match="bandwidth"):
        load_pipedream(str(p), bandwidth_bytes_per_s=0)
    with pytest.raises(InputError, match="backward_split"):
        load_pipedream(str(p), backward_split="half")
    with pytest.raises(InputError, match="does not exist"):
        load_pipedream(str(tmp_path / "nope.graph.txt"))


@needs_data
def test_cli_loader_dispatch():
    from fxpipe.cli.common import load_graph

    g = load_graph(DNN_FILES[0])
    assert g.meta["source_format"] == "dnn-partitioning"
    g = load_graph(PD_FILES[0])
    assert g.meta["source_format"] == "pipedream"
