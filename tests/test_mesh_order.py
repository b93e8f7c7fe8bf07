"""Rank placement on the topology (issue 18 item 2): the rank order of the mesh dimensions.

The order maps ranks to mesh coordinates one to one for every order fxpipe runs; on nodes of 8
devices it decides which groups stay on NVLink (pp=2 x dp_shard=8 on 16 devices: dp_shard
inside a node with the pipeline rank outermost, across nodes with it innermost) and which links
the pipeline's sends cross; the mesh search takes the faster order; a plan keeps its order through
save, load and reschedule (its 4-rank gloo run with the pipeline rank outermost, equal to one
process, is a case of tests/test_mesh.py's shared workers).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.memory import MemoryModel
from fxpipe.mesh import (
    MESH_DIMS,
    RANK_ORDERS,
    Topology,
    dp_links,
    normalize_mesh,
    normalize_rank_order,
    parse_mesh,
    pipeline_graph,
    pipeline_hops,
    rank_coords,
    rank_of,
)

TORCHTITAN = ("pp", "dp_replicate", "dp_shard")  # pipeline rank outermost
H100 = Topology(8, 450e9, 50e9, 3e-6, 8e-6)  # the h100-sxm profile's nodes


def test_every_rank_order_is_a_bijection_and_the_default_is_the_old_layout():
    for mesh in ({"pp": 2, "dp_shard": 3, "dp_replicate": 2}, {"pp": 4, "dp_shard": 2, "dp_replicate": 1}):
        world = mesh["pp"] * mesh["dp_shard"] * mesh["dp_replicate"]
        dp = world // mesh["pp"]
        for order in RANK_ORDERS:
            coords = [rank_coords(r, mesh, order) for r in range(world)]
            assert sorted((c["pp"], c["replica"]) for c in coords) == list(itertools.product(range(mesh["pp"]), range(dp)))
            for r, c in enumerate(coords):
                assert rank_of(mesh, pp=c["pp"], replica=c["replica"], order=order) == r
                assert c["replica"] == c["dp_replicate"] * mesh["dp_shard"] + c["dp_shard"]
        for r in range(world):  # default: rank = replica * pp + pipeline rank; torchtitan's: pipeline rank * dp + replica
            assert rank_coords(r, mesh) == rank_coords(r, mesh, MESH_DIMS)
            assert rank_of(mesh, pp=r % mesh["pp"], replica=r // mesh["pp"]) == r
            assert rank_of(mesh, pp=r // dp, replica=r % dp, order=TORCHTITAN) == r
        # the order travels with the mesh request
        assert rank_coords(1, {**mesh, "order": TORCHTITAN})["pp"] == 0
    assert normalize_rank_order(["pp", "dp_shard"]) == ("dp_replicate", "pp", "dp_shard")  # the rest outermost
    assert normalize_rank_order("pp/dp_replicate/dp_shard") == TORCHTITAN
    assert normalize_mesh({"pp": 2, "dp_shard": 2, "order": list(TORCHTITAN)}, 4)["order"] == TORCHTITAN
    assert parse_mesh("pp=2,dp_shard=2,order=pp/dp_replicate/dp_shard")["order"] == TORCHTITAN
    for bad, what in ((["pp", "dp_shard", "dp_replicate"], "dp_replicate must be outside"), (["pp", "ep"], "unknown"),
                      (["pp", "pp"], "repeated"), (["tp", "pp"], "tp is always the innermost")):
        with pytest.raises(InputError, match=what):
            normalize_rank_order(bad)


def test_rank_order_decides_which_groups_stay_inside_a_node():
    mesh = {"pp": 2, "dp_shard": 8, "dp_replicate": 1}  # 16 devices, 2 nodes of 8
    inner = dp_links(mesh, 1.0, topology=H100)  # pipeline rank innermost: dp_shard groups 2 ranks apart span 2 nodes
    outer = dp_links(mesh, 1.0, topology=H100, order=TORCHTITAN)  # dp_shard = 8 consecutive ranks: one node
    assert inner["dp_shard"] == (50e9, 8e-6) and outer["dp_shard"] == (450e9, 3e-6)
    assert pipeline_hops(mesh, H100) == (0, 8)  # every pipeline's 2 ranks are neighbours
    assert pipeline_hops(mesh, H100, TORCHTITAN) == (8, 8)  # rank r sends to r + 8: the other node
    g = _chain(2, param_bytes=1e6, out_bytes=1e6)
    assert pipeline_graph(g, mesh) is g  # in a node: the graph's own link
    assert pipeline_graph(g, {**mesh, "order": TORCHTITAN}).bandwidth_bytes_per_s == 50e9  # planned on InfiniBand
    # HSDP: dp_shard inside the node, dp_replicate across; 16 pipelines of 4 in the default order cross no node
    hsdp = {"pp": 4, "dp_shard": 2, "dp_replicate": 2}
    assert pipeline_hops(hsdp, H100)[0] == 0 and dp_links(hsdp, 1.0, topology=H100)["dp_replicate"][0] == 50e9
    assert dp_links(hsdp, 1.0, topology=H100, order=("dp_replicate", "pp", "dp_shard"))["dp_shard"][0] == 450e9


def _chain(n: int, *, param_bytes: float, out_bytes: float, t_s: float = 3e-3) -> OpGraph:
    return OpGraph.from_arrays(t_fwd_s=np.full(n, t_s), t_bwd_input_s=np.full(n, t_s), t_bwd_weight_s=np.full(n, t_s),
                               size_out_bytes=np.full(n, out_bytes), size_param_bytes=np.full(n, param_bytes),
                               edges=[(i, i + 1) for i in range(n - 1)], bandwidth_bytes_per_s=450e9,
                               meta={"topology": H100.to_dict()})


def test_mesh_search_keeps_the_data_parallel_groups_inside_a_node_when_their_sync_dominates():
    """16 devices, 2 micro-batches: pp=16 or pp=8 x dp=2. With the pipeline rank innermost the dp_shard
    pairs (r, r + 8) sync 4 GB over InfiniBand and the pure pipeline wins; with it outermost they are
    neighbours on NVLink and pp=8 x dp_shard=2 wins: the search must find that order."""
    from fxpipe.mesh.search import search_mesh
    from fxpipe.options import PlanOptions

    g = _chain(16, param_bytes=2.5e8, out_bytes=1e3)
    mesh, _, (part, problem, sched, _), table = search_mesh(
        g, devices=16, microbatches=2, memory=MemoryModel(), options=PlanOptions(schedule="1f1b", time_limit_s=0.5, seed=0))
    assert mesh == {"pp": 8, "dp_shard": 2, "dp_replicate": 1, "order": TORCHTITAN}
    rows = {r["mesh_text"]: r for r in table}
    chosen = rows["pp=8 x dp_shard=2"]
    assert chosen.get("chosen") and chosen["rank_order"] == list(TORCHTITAN)
    by = {tuple(e["rank_order"]): e for e in chosen["by_order"]}
    assert set(by) == {MESH_DIMS, TORCHTITAN}  # dp_replicate=1: the middle order is torchtitan's
    default = by[MESH_DIMS]
    # the default order alone would have lost to the pure pipeline (planned or pruned by its bound; the pure
    # pipeline planned alone when the search pruned it: its bubble is planned after the meshes without one)
    pure = rows["pp=16"].get("predicted_step_s")
    if pure is None:
        from fxpipe.planner import plan_with_options

        assert rows["pp=16"]["skipped"].startswith("pruned")
        pure = float(plan_with_options(g, devices=16, microbatches=2, memory=MemoryModel(), explain=False,
                                       options=PlanOptions(schedule="1f1b", time_limit_s=0.5, seed=0))[2].value)
    assert default.get("predicted_step_s", default["lower_bound_s"]) > pure
    assert by[TORCHTITAN]["predicted_step_s"] < pure
    assert chosen["predicted_step_s"] == pytest.approx(sched.value + chosen["exposed_sync_s"])
    # 8 pipeline ranks 2 apart: one hop in 7 crosses the node boundary, costed at the graph's link
    assert by[TORCHTITAN]["pipeline_bytes_per_s"] == 450e9 and by[TORCHTITAN]["pipeline_hops_across_nodes"] == [2, 14]
    json.dumps(table)  # the table is plain data (plan.options["mesh_search"])


def test_mesh_search_stops_at_ctrl_c_with_the_best_mesh_so_far(monkeypatch):
    """A press while the first candidate is planned (the stop flag every running search shares):
    that candidate ends with its planner's result and is returned, with a PlanWarning; the others
    are marked not planned. A KeyboardInterrupt before any candidate has a plan is a clear error."""
    import fxpipe.mesh.search as ms
    from fxpipe.errors import FxpipeError, PlanWarning
    from fxpipe.options import PlanOptions
    from fxpipe.progress import stop_all

    real = ms.plan_with_options
    calls = []

    def pressed_during(*args, **kwargs):
        calls.append(kwargs["devices"])
        stop_all()  # what the SIGINT handler does
        return real(*args, **kwargs)

    g = _chain(16, param_bytes=2.5e8, out_bytes=1e3)
    opts = PlanOptions(schedule="1f1b", time_limit_s=0.5, seed=0)
    monkeypatch.setattr(ms, "plan_with_options", pressed_during)
    with pytest.warns(PlanWarning, match="stopped .Ctrl-C. with [1-9][0-9]* candidate.s. not planned"):
        mesh, _, (part, _, sched, _), table = ms.search_mesh(g, devices=16, microbatches=2, memory=MemoryModel(),
                                                             options=opts)
    assert len(calls) == 1 and mesh["pp"] == calls[0] and part.k == calls[0]
    entries = [e for r in table for e in r["by_order"]]
    assert sum("predicted_step_s" in e for e in entries) == 1
    assert any("not planned: the search was stopped" in e.get("skipped", "") for e in entries)

    def pressed_before(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ms, "plan_with_options", pressed_before)
    with pytest.raises(FxpipeError, match="stopped .Ctrl-C. before any mesh was planned"):
        ms.search_mesh(g, devices=16, microbatches=2, memory=MemoryModel(), options=opts)


def test_sync_hides_where_the_runtime_issues_it():
    """A chain whose last op holds 1 GB of parameters (an LM head), pp=2 x dp_shard=2 under 1F1B: the
    last device's all-gather hides behind its wait for the first input and its reduce-scatter behind
    device 0's cool-down (torch's UNSHARD at the step's start, REDUCE_GRAD after the last backward),
    device 0's own sync does not; with two stages per device nothing is hidden."""
    import dataclasses

    from fxpipe.mesh import dp_sync_time_s, pipeline_dp_sync_s, pipeline_step_s
    from fxpipe.mesh.search import mesh_lower_bound_s
    from fxpipe.options import PlanOptions
    from fxpipe.planner import plan_with_options

    g = _chain(8, param_bytes=1e6, out_bytes=1e3)
    g = dataclasses.replace(g, size_param_bytes=np.r_[np.full(7, 1e6), 1e9])
    mesh = {"pp": 2, "dp_shard": 2, "dp_replicate": 1}
    part, problem, sched, _ = plan_with_options(g, devices=2, microbatches=4, memory=MemoryModel(),
                                                options=PlanOptions(schedule="1f1b", time_limit_s=0.5, seed=0))
    dev_bytes = [sum(float(b) for b, s in zip(g.size_param_bytes, part.assignment) if problem.device_of_stage[s] == d)
                 for d in range(2)]
    assert dev_bytes[1] > 100 * dev_bytes[0]  # the LM head's device
    busiest = pipeline_dp_sync_s(g, part.assignment, problem.device_of_stage, mesh)
    sync0 = dp_sync_time_s(dev_bytes[0], mesh, 1.0, topology=H100)
    for objective in ("stage_span", "makespan"):
        s = dataclasses.replace(sched, objective=objective)
        step = pipeline_step_s(g, part.assignment, problem.device_of_stage, s, mesh)
        assert s.value + sync0 <= step * (1 + 1e-9) and step < s.value + 0.5 * busiest, objective
        assert mesh_lower_bound_s(g, mesh, 8) <= step
    # four stages placed two per device (V): a stage's reduction mid-step is not modelled as hidden
    part4, problem4, sched4, _ = plan_with_options(g, devices=4, microbatches=4, memory=MemoryModel(),
                                                   options=PlanOptions(schedule="1f1b", time_limit_s=0.5, seed=0))
    twice = pipeline_step_s(g, part4.assignment, (0, 1, 1, 0), sched4, mesh)
    assert twice == pytest.approx(sched4.value + pipeline_dp_sync_s(g, part4.assignment, (0, 1, 1, 0), mesh))


# ----------------------------------------------------------------------------- runtime on 4 gloo ranks
def test_rank_order_is_planned_saved_and_loaded(tmp_path):
    """A pinned mesh with torchtitan's order keeps it through save, load and reschedule (its training on 4 gloo
    ranks runs in tests/test_mesh.py's shared workers)."""
    pytest.importorskip("torch")
    import fxpipe
    from fxpipe.cli.plan_cmd import HFFactory
    from fxpipe.plan import Plan, load_plan

    fac = HFFactory("gpt2", {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 32, "n_positions": 16},
                    microbatches=4, microbatch_size=1, seq_len=4, seed=0)
    model, args, kwargs = fac.one_microbatch()
    plan = fxpipe.compile(model, args, kwargs, devices=4, microbatches=4, schedule="1f1b", time_limit_s=0.5, seed=0,
                          mesh={"pp": 2, "dp_shard": 2, "order": list(TORCHTITAN)})
    assert plan.mesh == {"pp": 2, "dp_shard": 2, "dp_replicate": 1} and plan.rank_order == TORCHTITAN
    assert "ranks ordered pp/dp_replicate/dp_shard" in plan.summary()
    loaded = load_plan(plan.save(tmp_path / "plan.json"))
    assert loaded.rank_order == TORCHTITAN and loaded.reschedule("zb-h1").rank_order == TORCHTITAN
    doc = json.loads((tmp_path / "plan.json").read_text())
    del doc["rank_order"]  # files saved before rank orders: pipeline rank innermost
    assert Plan.from_dict(doc).rank_order == MESH_DIMS


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pipeline_hops_count_the_sends_between_the_ranks_rank_of_places(tp):
    # oracle: every replica's pipeline, rank by rank through rank_of, on nodes of 8 devices
    for pp, ds, dr in ((2, 4, 2), (4, 2, 4), (8, 1, 2), (16, 2, 1), (3, 3, 2)):
        mesh = {"pp": pp, "dp_shard": ds, "dp_replicate": dr, "tp": tp}
        for order in RANK_ORDERS:
            crossing = 0
            for replica in range(ds * dr):
                nodes = [rank_of(mesh, pp=k, replica=replica, order=order) // 8 for k in range(pp)]
                crossing += sum(a != b for a, b in zip(nodes, nodes[1:]))
            assert pipeline_hops(mesh, H100, order) == (crossing, ds * dr * (pp - 1)), (mesh, order)
