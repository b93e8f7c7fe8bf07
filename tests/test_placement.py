"""Several stages per device, torch-free half: per-device costs of a partition under a placement,
and plan_graph's placement choice (fxpipe.partition.placement, fxpipe.api.plan_graph)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from naive_partition import random_dag

from fxpipe.api import plan_graph
from fxpipe.errors import InputError
from fxpipe.ir import OpGraph, looped_placement, v_placement
from fxpipe.partition.objective import block_costs, validate_partition
from fxpipe.partition.placement import (
    device_bottleneck,
    device_costs,
    device_io_bytes,
    placement_name,
    placement_of,
)
from fxpipe.schedule.dispatch import default_method, methods_for_placement
from fxpipe.schedule.validate import validate_schedule


def _topo(graph: OpGraph) -> list[int]:
    indeg = np.zeros(graph.n, dtype=int)
    for _, v in graph.edges:
        indeg[v] += 1
    ready = [v for v in range(graph.n) if indeg[v] == 0]
    out = []
    while ready:
        u = ready.pop()
        out.append(u)
        for v in graph.successors(u):
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(int(v))
    return out


def _pipeline_assignment(graph: OpGraph, k: int, rng) -> np.ndarray:
    """A random assignment in pipeline order: a topological order cut into k (possibly empty) slices."""
    order = _topo(graph)
    cuts = np.sort(rng.integers(0, graph.n + 1, k - 1))
    a = np.empty(graph.n, dtype=np.int64)
    bounds = [0, *cuts.tolist(), graph.n]
    for b in range(k):
        for v in order[bounds[b]:bounds[b + 1]]:
            a[v] = b
    return a


def _naive_device_costs(graph, a, dev, objective, comm, p):
    """Per-device cost by walking every tensor (independent of fxpipe's io_bytes)."""
    factor = 2.0 if objective == "training" else 1.0
    work = graph.work_s(objective)
    cost = np.zeros(p)
    for v in range(graph.n):
        cost[dev[a[v]]] += work[v]
    for u in range(graph.n):
        cons = [int(c) for c in graph.successors(u)]
        if not cons:
            continue
        size = graph.size_out_bytes[u] / graph.bandwidth_bytes_per_s
        if comm == "relay":
            # the tensor passes stage by stage from its producer's to its last consumer's stage
            path = list(range(a[u], max(a[c] for c in cons) + 1))
            for s, t in zip(path, path[1:]):
                if dev[s] != dev[t]:
                    cost[dev[s]] += factor * size
                    cost[dev[t]] += factor * size
        else:  # dag: once out of the producer's device, once into every other device with a consumer
            targets = {dev[a[c]] for c in cons} - {dev[a[u]]}
            if targets:
                cost[dev[a[u]]] += factor * size
                for d in targets:
                    cost[d] += factor * size
    return cost


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 14), p=st.integers(1, 4), v=st.integers(1, 3),
       objective=st.sampled_from(["training", "inference"]), comm=st.sampled_from(["relay", "dag"]),
       shape=st.sampled_from(["looped", "v"]))
def test_device_costs_equal_naive_walk_and_block_costs_with_one_stage_per_device(seed, n, p, v, objective, comm, shape):
    graph = random_dag(seed, n)
    rng = np.random.default_rng(seed)
    dev = placement_of(shape, p, v)
    a = _pipeline_assignment(graph, v * p, rng)
    got = device_costs(graph, a, dev, objective, comm)
    np.testing.assert_allclose(got, _naive_device_costs(graph, a, dev, objective, comm, p), rtol=1e-12, atol=1e-12)
    assert device_bottleneck(graph, a, dev, objective, comm) == pytest.approx(got.max())
    # a device never costs more than its stages did on devices of their own (same-device comm is free)
    per_stage = block_costs(graph, a, v * p, objective, comm)
    own = np.bincount(np.asarray(dev), weights=per_stage, minlength=p)
    assert np.all(got <= own * (1 + 1e-12) + 1e-12)
    if v == 1:  # one stage per device: exactly the Contract-2 block costs
        np.testing.assert_array_equal(device_costs(graph, a, tuple(range(p)), objective, comm), per_stage)


def test_same_device_transfers_are_free():
    # chain 0 -> 1 -> 2 -> 3 of unit work, 10 bytes per tensor at 1 byte/s, one node per stage
    g = OpGraph.from_arrays(t_fwd_s=[1.0] * 4, size_out_bytes=[10.0] * 4, edges=[[0, 1], [1, 2], [2, 3]],
                            bandwidth_bytes_per_s=1.0)
    a = np.arange(4)
    # V placement on 2 devices: device 1 holds stages 1 and 2, whose boundary is free
    in_b, out_b = device_io_bytes(g, a, v_placement(2), "relay")
    assert in_b.tolist() == [10.0, 10.0] and out_b.tolist() == [10.0, 10.0]
    assert device_costs(g, a, v_placement(2), "inference").tolist() == [2 + 20.0, 2 + 20.0]
    # looped: every boundary crosses devices
    assert device_costs(g, a, looped_placement(2, 2), "inference").tolist() == [2 + 30.0, 2 + 30.0]
    # everything on one device: no communication at all
    assert device_costs(g, a, (0, 0, 0, 0), "training").tolist() == [g.work_s("training").sum()]
    # the skip tensor 0 -> 3 is relayed through device 1 (stages 1 and 2): it crosses to device 1
    # and back (2 bytes per device), the free boundary 1 -> 2 costs nothing; tensor 2 -> 3 crosses once
    g2 = OpGraph.from_arrays(t_fwd_s=[0.0] * 4, size_out_bytes=[1.0, 1.0, 1.0, 0.0],
                             edges=[[0, 1], [1, 2], [2, 3], [0, 3]], bandwidth_bytes_per_s=1.0)
    np.testing.assert_allclose(device_costs(g2, a, v_placement(2), "inference"), [3.0, 3.0])
    np.testing.assert_allclose(device_costs(g2, a, looped_placement(2, 2), "inference"), [2.0 + 3.0, 2.0 + 3.0])


def test_placement_names_and_errors():
    assert placement_of("looped", 3, 2) == (0, 1, 2, 0, 1, 2)
    assert placement_of("v", 3, 2) == (0, 1, 2, 2, 1, 0)
    assert placement_name((0, 1, 2, 0, 1, 2)) == "looped"
    assert placement_name((0, 1, 1, 0)) == "v"
    assert placement_name((0, 1, 2)) == "looped"  # one stage per device, in order
    assert placement_name((1, 0)) == "custom" and placement_name((0, 0, 1)) == "custom"
    with pytest.raises(InputError, match="placement must be one of"):
        placement_of("zigzag", 2, 2)
    g = random_dag(0, 5)
    with pytest.raises(InputError, match="block ids must lie in 0..1"):
        device_costs(g, [0, 1, 2, 0, 1], (0, 1))
    with pytest.raises(InputError, match="one block per node"):
        device_costs(g, [0, 1], (0, 1))
    with pytest.raises(InputError, match="comm must be one of"):
        device_costs(g, [0] * 5, (0,), comm="p2p")


def test_methods_for_placement():
    assert methods_for_placement(tuple(range(4)))[:3] == ("gpipe", "1f1b", "zb-h1")
    assert "zb-v" not in methods_for_placement(tuple(range(4)))
    assert methods_for_placement(looped_placement(2, 2)) == ("greedy", "interleaved-1f1b", "milp", "auto")
    assert methods_for_placement(v_placement(2)) == ("greedy", "zb-v", "dualpipe-v", "milp", "auto")
    assert methods_for_placement(v_placement(2, 3)) == ("greedy", "milp", "auto")
    assert default_method(tuple(range(3))) == "zb-h1"
    assert default_method(looped_placement(3, 2)) == "interleaved-1f1b"
    assert default_method(v_placement(3)) == "zb-v"
    assert default_method((0, 1, 1)) == "greedy"


def _chain(n=12, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.5, 1.5, n)
    ops = ["placeholder"] + ["call_function"] * (n - 2) + ["output"]
    return OpGraph.from_arrays(t_fwd_s=t, t_bwd_input_s=t, t_bwd_weight_s=t / 2, size_out_bytes=[1.0] * n,
                               act_bytes=[1.0] * n, edges=[[i, i + 1] for i in range(n - 1)], ops=ops,
                               bandwidth_bytes_per_s=100.0)


@pytest.mark.parametrize("placement, method", [("looped", "interleaved-1f1b"), ("v", "zb-v")])
def test_plan_graph_places_v_times_p_stages(placement, method):
    g = _chain()
    part, problem, sched, _ = plan_graph(g, devices=2, microbatches=4, stages_per_device=2, placement=placement,
                                         time_limit_s=0.5, schedule=None)  # None: the placement's default method
    assert part.k == 4 and problem.num_devices == 2
    assert problem.device_of_stage == placement_of(placement, 2, 2)
    assert sched.method == method
    validate_partition(g, part)
    validate_schedule(problem, sched)
    assert "placement_search" not in sched.meta  # a single candidate


def test_plan_graph_auto_keeps_the_best_predicted_step_time():
    g = _chain(16, seed=3)
    part, problem, sched, _ = plan_graph(g, devices=2, microbatches=8, stages_per_device="auto", placement="auto",
                                         time_limit_s=0.5)
    cands = sched.meta["placement_search"]
    assert [(c["stages_per_device"], c["placement"]) for c in cands] == [(1, "looped"), (2, "looped"), (2, "v")]
    chosen = [c for c in cands if c.get("chosen")]
    assert len(chosen) == 1 and chosen[0]["step_time_s"] == pytest.approx(sched.value)
    assert sched.value == pytest.approx(min(c["step_time_s"] for c in cands))
    assert problem.num_stages == 2 * chosen[0]["stages_per_device"]
    for c in cands:  # every candidate was scored per device
        assert c["device_bottleneck_s"] <= c["stage_bottleneck_s"] * c["stages_per_device"] + 1e-12
    # a schedule that only one placement admits restricts the candidates
    _, problem_v, sched_v, _ = plan_graph(g, devices=2, microbatches=8, stages_per_device="auto", placement="auto",
                                          schedule="zb-v", time_limit_s=0.5)
    assert problem_v.device_of_stage == v_placement(2) and sched_v.method == "zb-v"
    assert sum("skipped" in c for c in sched_v.meta["placement_search"]) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(stages_per_device=2, placement="looped", schedule="zb-v"), "does not schedule the looped placement.*interleaved-1f1b"),
     (dict(stages_per_device=2, schedule="zb-h1"), "zb-h1.*use one of greedy, interleaved-1f1b, milp"),
     (dict(stages_per_device=4), "8 stages.*more than the 6 ops"),
     (dict(stages_per_device=0), "stages_per_device must be >= 1"),
     (dict(stages_per_device="two"), "stages_per_device must be an integer >= 1 or 'auto'"),
     (dict(placement="zigzag"), "placement must be one of")],
)
def test_plan_graph_placement_errors(kwargs, message):
    with pytest.raises(InputError, match=message):
        plan_graph(_chain(6), devices=2, microbatches=4, time_limit_s=0.2, **kwargs)
