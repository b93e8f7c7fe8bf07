"""Pipeline x data parallelism (issue 18): the mesh in the API and its runtime on 4 gloo ranks.

A tiny GPT-2 (tied embedding on the first and last stage) planned as pp=2 x dp_shard=2
(FSDP2 ``fully_shard``) and pp=2 x dp_replicate=2 (``replicate``) under 1F1B and ZB-H1, as
pp=2 x dp_shard=2 under ZB-V (split backward, the tied embedding twice on rank 0) and as
pp=1 x dp_shard=2 x dp_replicate=2 (HSDP), and pp=2 x dp_shard=2 with torchtitan's rank order
(pipeline rank outermost), must train to the losses, gradients and parameters
of one process on the same global batch. The data-parallel runs share one set of 4 worker
processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.memory import MemoryModel  # noqa: E402
from fxpipe.cli.plan_cmd import HFFactory, _BatchFn  # noqa: E402
from fxpipe.errors import InfeasibleError, InputError  # noqa: E402
from fxpipe.mesh import (  # noqa: E402
    candidate_meshes,
    dp_sync_time_s,
    format_mesh,
    microbatches_per_replica,
    pipeline_dp_sync_s,
    normalize_mesh,
    parse_mesh,
    rank_coords,
    rank_of,
    Topology,
)
from fxpipe.plan.core import Plan, _PlanStageOf, load_plan  # noqa: E402

from _torchrun import fxpipe_cli, train_example_from_checkpoint  # noqa: E402
from helpers import assert_same_training  # noqa: E402

GPT2 = {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 32, "n_positions": 16}
GLOBAL_MB = 8  # global micro-batches per step: 4 per replica (ZB-H1 then differs from 1F1B)


def _factory() -> HFFactory:
    return HFFactory("gpt2", GPT2, microbatches=GLOBAL_MB, microbatch_size=1, seq_len=4, seed=0)


def _plan(mesh, schedule, **kw):
    model, args, kwargs = _factory().one_microbatch()
    return fxpipe.compile(model, args, kwargs, devices=4, microbatches=GLOBAL_MB, mesh=mesh, schedule=schedule,
                          time_limit_s=0.5, seed=0, **kw)


# ----------------------------------------------------------------------------- plain data (no torch.distributed)
def test_normalize_and_parse_mesh():
    assert normalize_mesh({"pp": 2, "dp_shard": 2}, 4) == {"pp": 2, "dp_shard": 2, "dp_replicate": 1}
    assert normalize_mesh("auto", 8) == {"pp": 8, "dp_shard": 1, "dp_replicate": 1}
    assert parse_mesh("pp=4, dp_shard=8") == {"pp": 4, "dp_shard": 8, "dp_replicate": 1}
    assert format_mesh(parse_mesh("dp_replicate=2,pp=2")) == "pp=2 x dp_replicate=2"
    assert microbatches_per_replica(8, {"pp": 1, "dp_shard": 2, "dp_replicate": 2}) == 2
    for bad, what in [({"pp": 3}, "product"), ({"pp": 2, "dp": 2}, "unknown dimension"), ({"pp": 0, "dp_shard": 4}, ">= 1"),
                      ({"pp": 2.0, "dp_shard": 2}, "integer"), ([2, 2], "dict of degrees")]:
        with pytest.raises(InputError, match=what):
            normalize_mesh(bad, 4)
    for bad in ("pp=4,dp_shard", "pp=x", "pp=2,pp=2", ""):
        with pytest.raises(InputError):
            parse_mesh(bad)
    with pytest.raises(InputError, match="not divisible by the 4 data-parallel replicas"):
        microbatches_per_replica(6, {"pp": 1, "dp_shard": 2, "dp_replicate": 2})


def test_rank_mapping_is_a_bijection_with_pipeline_rank_innermost():
    mesh = {"pp": 3, "dp_shard": 2, "dp_replicate": 2}
    seen = set()
    for rank in range(12):
        c = rank_coords(rank, mesh)
        assert rank_of(mesh, pp=c["pp"], replica=c["replica"]) == rank
        assert c["replica"] == c["dp_replicate"] * 2 + c["dp_shard"]
        seen.add((c["dp_replicate"], c["dp_shard"], c["pp"]))
    assert len(seen) == 12
    assert [rank_coords(r, mesh)["pp"] for r in range(3)] == [0, 1, 2]  # a replica's ranks are consecutive
    with pytest.raises(InputError, match="rank must be"):
        rank_coords(12, mesh)


def test_dp_sync_time_and_candidate_meshes():
    b, bw = 8e9, 1e11  # ring collectives: all-gather / reduce-scatter move (k-1)/k of the bytes, all-reduce twice that
    assert dp_sync_time_s(b, {"pp": 4}, bw) == 0.0
    assert dp_sync_time_s(b, {"pp": 1, "dp_shard": 2}, bw) == pytest.approx(b / bw)
    assert dp_sync_time_s(b, {"pp": 1, "dp_replicate": 4}, bw) == pytest.approx(1.5 * b / bw)
    assert dp_sync_time_s(b, {"pp": 1, "dp_shard": 2, "dp_replicate": 2}, bw) == pytest.approx(1.5 * b / bw)
    assert dp_sync_time_s(b, {"pp": 1, "dp_shard": 2}, bw, latency_s=1e-3) == pytest.approx(b / bw + 2e-3)
    assert candidate_meshes(8, 4) == [{"pp": 8, "dp_shard": 1, "dp_replicate": 1}, {"pp": 4, "dp_shard": 2, "dp_replicate": 1},
                                      {"pp": 2, "dp_shard": 4, "dp_replicate": 1}]  # dp=8 does not divide 4
    assert {"pp": 2, "dp_shard": 2, "dp_replicate": 2} in candidate_meshes(8, 8, replicate=True)
    assert all(normalize_mesh(m, 12) == m for m in candidate_meshes(12, 12, replicate=True))


def test_topology_puts_each_data_parallel_dimension_on_the_links_it_spans():
    from fxpipe.cost.specs import HARDWARE

    # 8 GPUs per node, NVLink 450 GB/s, IB 50 GB/s at line rate (the datasheet twin: the links each dimension spans
    # are the point here; the achieved bus bandwidths of h100-sxm are tests/test_gpu_costs.py's)
    topo = Topology.from_dict(HARDWARE["h100-sxm-datasheet"].topology())
    assert (topo.devices_per_node, topo.intra_node_bytes_per_s, topo.inter_node_bytes_per_s) == (8, 450e9, 50e9)
    assert HARDWARE["cpu"].inter_node_bytes_per_s == 0  # unknown: its captures record no topology
    # ranks are numbered pipeline rank innermost: dp_shard groups are pp apart, dp_replicate groups pp * dp_shard
    assert topo.in_node(4, 2) and topo.in_node(1, 8) and not topo.in_node(8, 2) and not topo.in_node(3, 3, 9)
    assert topo.in_node(3, 2, 6)  # a 6-GPU job on one node: pp=3 x dp_shard=2 stays on NVLink
    assert not topo.in_node(3, 2, 12)  # 12 ranks: the group {6, 9} spans nodes 0 and 1
    b = 8e9
    intra = lambda k: 2 * ((k - 1) / k * b / 450e9 + (k - 1) * topo.intra_node_latency_s)  # noqa: E731
    inter = lambda k: 2 * ((k - 1) / k * b / 50e9 + (k - 1) * topo.inter_node_latency_s)  # noqa: E731
    assert dp_sync_time_s(b, {"pp": 4, "dp_shard": 2}, 1.0, topology=topo) == pytest.approx(intra(2))
    assert dp_sync_time_s(b, {"pp": 8, "dp_shard": 2}, 1.0, topology=topo) == pytest.approx(inter(2))  # crosses nodes
    assert dp_sync_time_s(b, {"pp": 3, "dp_shard": 2}, 1.0, topology=topo) == pytest.approx(intra(2))  # 6 GPUs, one node
    hsdp = dp_sync_time_s(b, {"pp": 4, "dp_shard": 2, "dp_replicate": 2}, 1.0, topology=topo)  # shard in, replicate across
    assert hsdp == pytest.approx(intra(2) + 2 * 0.5 * (b / 2) / 50e9 + 2 * topo.inter_node_latency_s)
    assert hsdp < dp_sync_time_s(b, {"pp": 4, "dp_shard": 4}, 1.0, topology=topo)  # dp_shard=4 spans 16 ranks: IB
    with pytest.raises(InputError, match="devices_per_node"):
        Topology(0, 1.0, 1.0)


def test_cli_mesh_errors_exit_2(capsys):
    from fxpipe.cli import main

    for argv, what in ((["--mesh", "pp=3", "--devices", "4"], "product"), (["--mesh", "pp=2,dp=2"], "unknown dimension"),
                       (["--mesh", "pp=2,dp_shard=2", "--microbatches", "3"], "not divisible")):
        code = main(["plan", "--hf", "gpt2", "--config", "n_layer=1", "n_embd=16", "n_head=2", "--seq-len", "4", *argv])
        err = capsys.readouterr().err
        assert code == 2 and what in err and "Traceback" not in err, err


def test_compile_mesh_plan_round_trip_and_errors(tmp_path):
    plan = _plan({"pp": 2, "dp_shard": 2}, "1f1b")
    assert plan.mesh == {"pp": 2, "dp_shard": 2, "dp_replicate": 1}
    assert (plan.devices, plan.microbatches, plan.world_size, plan.global_microbatches) == (2, 4, 4, 8)
    assert plan.problem.num_microbatches == 4 and plan.problem.num_devices == 2  # one pipeline of the mesh
    assert (plan.memory.zero_stage, plan.memory.data_parallel) == (1, 2)  # sharded optimizer state (mesh_memory)
    assert "mesh pp=2 x dp_shard=2 on 4 devices" in plan.summary()
    busiest = max(d.param_bytes for d in plan.device_table)  # all-gather + reduce-scatter over 2: its bytes once
    topo = Topology.of_graph(plan.graph)  # h100-sxm: 8 GPUs per node; ranks 0, 2 and 1, 3 shard inside a node
    assert topo.devices_per_node == 8 and topo.in_node(2, 2)
    # each half (all-gather, reduce-scatter) at its kind's achieved NVLink bandwidth (issue 31)
    assert plan.dp_sync_s == pytest.approx(sum(busiest / 2 / (topo.intra_node_bytes_per_s * topo.achieved(k, inter_node=False))
                                               for k in ("all_gather", "reduce_scatter")) + 2 * topo.intra_node_latency_s)
    # the pipeline sends at NVLink as NCCL send/recv achieves it
    assert topo.intra_node_bytes_per_s * topo.achieved("p2p", inter_node=False) == plan.graph.bandwidth_bytes_per_s
    assert plan.dp_sync_s > 0
    assert "data-parallel sync per step" in plan.summary() and "over dp_shard=2 inside a node" in plan.summary()
    # what data parallelism does not run yet fails before any worker starts
    from fxpipe.codegen.launch import spawn_train_many

    run = dict(make_model=_factory(), stage_of=plan.stage_of, orders=plan.orders(), num_microbatches=GLOBAL_MB,
               make_batch=_BatchFn(_factory()), mesh=plan.mesh)
    with pytest.raises(InputError, match="compile_stages"):
        spawn_train_many([{**run, "compile_stages": True}], world_size=4)
    with pytest.raises(InputError, match="not divisible"):
        spawn_train_many([{**run, "num_microbatches": 5}], world_size=4)
    path = plan.save(tmp_path / "plan.json")
    loaded = load_plan(path)
    assert loaded.mesh == plan.mesh and loaded.world_size == 4 and loaded.memory == plan.memory
    assert loaded.reschedule("zb-h1").mesh == plan.mesh
    # files saved before meshes (no "mesh" key) load as a pure pipeline
    doc = json.loads(path.read_text())
    del doc["mesh"]
    old = Plan.from_dict(doc)
    assert old.mesh == {"pp": 2, "dp_shard": 1, "dp_replicate": 1} and old.world_size == 2
    doc["mesh"] = {"pp": 4}
    with pytest.raises(InputError, match="disagrees"):
        Plan.from_dict(doc)
    model, args, kwargs = _factory().one_microbatch()
    with pytest.raises(InputError, match="product"):
        fxpipe.compile(model, args, kwargs, devices=4, mesh={"pp": 2})
    with pytest.raises(InputError, match="not divisible"):
        fxpipe.compile(model, args, kwargs, devices=4, microbatches=3, mesh={"pp": 2, "dp_replicate": 2})
    with pytest.raises(InputError, match="data_parallel=4"):
        fxpipe.compile(model, args, kwargs, devices=4, microbatches=4, mesh={"pp": 2, "dp_shard": 2},
                       memory=MemoryModel(data_parallel=4, zero_stage=3))
    # "pipeline" is the pure pipeline over all devices
    assert fxpipe.compile(model, args, kwargs, devices=2, microbatches=2, schedule="1f1b",
                          time_limit_s=0.5, mesh="pipeline").mesh == {"pp": 2, "dp_shard": 1, "dp_replicate": 1}


# ----------------------------------------------------------------------------- runtime on 4 gloo ranks
@pytest.mark.slow
def test_fsdp_and_replicate_pipelines_match_single_process():
    from fxpipe.codegen.launch import reference_train, spawn_train_many

    fac = _factory()
    runs, names = [], []
    cases = [(mesh, schedule, {}) for mesh in ({"pp": 2, "dp_shard": 2}, {"pp": 2, "dp_replicate": 2})
             for schedule in ("1f1b", "zb-h1")]
    # ZB-V: stages 0 and 3 (the tied embedding) on rank 0, split backward on stages 1-3
    cases.append(({"pp": 2, "dp_shard": 2}, "zb-v", {"stages_per_device": 2, "placement": "v"}))
    # HSDP (fully_shard over the 2-D (dp_replicate, dp_shard) sub-mesh) of a one-stage pipeline
    cases.append(({"pp": 1, "dp_shard": 2, "dp_replicate": 2}, "1f1b", {}))
    # torchtitan's rank order: pipeline rank outermost (tests/test_mesh_order.py plans it)
    cases.append(({"pp": 2, "dp_shard": 2, "order": ["pp", "dp_replicate", "dp_shard"]}, "1f1b", {}))
    for mesh, schedule, extra in cases:
        plan = _plan(mesh, schedule, **extra)
        names.append(f"{format_mesh(plan.mesh)} {'/'.join(plan.rank_order)} {schedule}")
        # the run plan.train_local launches (world_size = pp * dp ranks, the global micro-batch count)
        runs.append(dict(make_model=fac, stage_of=_PlanStageOf(plan.stage_of), orders=plan.orders(),
                         num_microbatches=plan.global_microbatches, make_batch=_BatchFn(fac), steps=2, lr=0.05,
                         mesh={**plan.mesh, "order": plan.rank_order}, model_key="gpt2"))
    results = spawn_train_many(runs, world_size=4, timeout_s=600)
    ref = reference_train(fac, _BatchFn(fac), num_microbatches=GLOBAL_MB, steps=2, lr=0.05)
    assert ref.losses[1] != ref.losses[0]
    for res, what in zip(results, names):
        assert_same_training(res, ref, what)
    # ZB-H1 ran its own order (not 1F1B's): rank 0 defers work behind later forwards
    assert results[1].meta["actions"][0] != results[0].meta["actions"][0]
    # split backward (I/W) ran under FSDP2 on both pipeline ranks of the V placement
    zbv = results[4]
    assert all(any("I" in a for a in zbv.meta["actions"][r]) for r in range(4))
    assert [zbv.meta["fused_full_backward"][s] for s in (1, 2, 3)] == [False] * 3
    # pipeline rank outermost: ranks 0, 1 run pipeline rank 0 (stage 0), ranks 2, 3 pipeline rank 1
    acts = results[6].meta["actions"]
    assert acts[0] == acts[1] and acts[2] == acts[3] and acts[0] != acts[2]


@pytest.mark.slow
def test_cli_mesh_plan_trains_with_torchrun_from_a_checkpoint(tmp_path):
    """`fxpipe plan --mesh --run` (plan.train_local on 4 ranks) -> plan file -> torchrun: plan.build on 4 ranks
    (FSDP2, ZB-V), the weights read from a checkpoint."""
    pytest.importorskip("safetensors")
    config = [f"{k}={v}" for k, v in GPT2.items()]
    common = ["--hf", "gpt2", "--config", *config, "--seq-len", "4"]
    plan_file = tmp_path / "mesh.plan.json"
    out = fxpipe_cli("plan", *common, "--mesh", "pp=2,dp_shard=2", "--microbatches", str(GLOBAL_MB), "--stages-per-device", "2",
                     "--placement", "v", "--schedule", "zb-v", "--time-limit", "0.5", "--out", str(plan_file),
                     "--run", "--steps", "2", "--lr", "0.05", "--json", timeout_s=600)
    assert out.returncode == 0, out.stderr[-4000:]  # --run: plan.train_local on 4 ranks agrees with one process
    doc = json.loads(out.stdout)
    assert doc["run"]["ok"] and doc["plan"]["mesh"] == {"pp": 2, "dp_shard": 2, "dp_replicate": 1}
    assert load_plan(plan_file).mesh == {"pp": 2, "dp_shard": 2, "dp_replicate": 1}
    fac = _factory()
    whole, _ = fac()
    lines = train_example_from_checkpoint(4, plan_file, whole, tmp_path, *common, "--steps", "2", "--lr", "0.05")
    lines.sort(key=lambda d: d["rank"])
    assert [d["rank"] for d in lines] == [0, 2]  # the last stage (V: pipeline rank 0) of each replica
    ref_losses = doc["run"]["reference_losses"]  # the single-process run of `fxpipe plan --run`, same batches
    mean = [(a + b) / 2 for a, b in zip(lines[0]["losses"], lines[1]["losses"])]
    assert lines[0]["losses"] != lines[1]["losses"]  # each replica trained on its own half of the batch
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    assert 0 < lines[0]["param_bytes"] < whole_bytes / 2  # half the stages, each sharded over 2 ranks


def test_mesh_search_keeps_the_fastest_mesh_that_fits(tmp_path):
    model, args, kwargs = _factory().one_microbatch()
    plan = fxpipe.compile(model, args, kwargs, devices=4, microbatches=4, mesh="search", schedule="zb-h1", time_limit_s=0.5,
                          memory_bytes=float("inf"))
    table = plan.options["mesh_search"]
    # the capture knows the h100-sxm's nodes (a topology), so HSDP splits are candidates too; GPT-2's MLPs split,
    # so tensor-parallel meshes are candidates as well (fxpipe.mesh.search.tensor_parallel_degrees)
    assert [r["mesh_text"] for r in table if "tp=" not in r["mesh_text"]] == [
        "pp=4", "pp=2 x dp_shard=2", "pp=2 x dp_replicate=2", "dp_shard=4", "dp_shard=2 x dp_replicate=2",
        "dp_replicate=4"]
    assert {r["mesh"].get("tp", 1) for r in table} == {1, 2, 4}
    chosen = [r for r in table if r.get("chosen")]
    assert len(chosen) == 1 and chosen[0]["mesh"] == plan.mesh
    assert all(chosen[0]["predicted_step_s"] <= r.get("predicted_step_s", float("inf")) for r in table)
    assert all(r["lower_bound_s"] <= r.get("predicted_step_s", float("inf")) * (1 + 1e-9) for r in table)
    assert plan.schedule.value + plan.dp_sync_s == pytest.approx(chosen[0]["predicted_step_s"])
    assert "mesh search (predicted step = schedule + data-parallel sync" in plan.summary()
    from fxpipe.report import write_plan_report

    md = Path(write_plan_report(plan, tmp_path / "r.html", bounds_time_limit_s=1.0)["markdown"]).read_text()
    assert f"on 4 x {plan.hardware}, mesh {format_mesh(plan.mesh)}" in md and "dp_replicate=4" in md  # title, table
    # the same prediction as the pinned mesh
    other = next((r for r in table if "predicted_step_s" in r and not r.get("chosen")), None)
    if other is not None:
        pinned = fxpipe.compile(model, args, kwargs, devices=4, microbatches=4, mesh=other["mesh"], schedule="zb-h1",
                                time_limit_s=0.5, memory_bytes=float("inf"))
        assert pinned.schedule.value + pinned.dp_sync_s == pytest.approx(other["predicted_step_s"])
    for r in table:  # every mesh pruned by its bound predicts no better when planned pinned
        if r.get("skipped", "").startswith("pruned"):
            pinned = fxpipe.compile(model, args, kwargs, devices=4, microbatches=4, mesh=r["mesh"], schedule="zb-h1",
                                    time_limit_s=0.5, memory_bytes=float("inf"))
            assert pinned.predicted_step_s >= chosen[0]["predicted_step_s"] * (1 - 1e-9)
            assert pinned.predicted_step_s >= r["lower_bound_s"] * (1 - 1e-9)
    # 50 kB: a capacity only the 4-stage pipeline of this tiny GPT-2 fits with the optimizer on the device; the other
    # meshes are skipped with the reason (the default mesh, "auto", is this search)
    tight = fxpipe.compile(model, args, kwargs, devices=4, microbatches=4, schedule="zb-h1", time_limit_s=0.5,
                           memory=MemoryModel(offload_optimizer=False), memory_bytes=50e3)
    assert tight.mesh == {"pp": 4, "dp_shard": 1, "dp_replicate": 1}
    # left to the search (the default), the meshes that do not fit try the optimizer on the host, right after their row;
    # the fastest prediction wins, its plan keeps the optimizer where it was planned
    free = fxpipe.compile(model, args, kwargs, devices=4, microbatches=4, schedule="zb-h1", time_limit_s=0.5,
                          memory_bytes=50e3)
    rows = free.options["mesh_search"]
    hosted = [r for r in rows if r["offload_optimizer"]]
    assert hosted and all(rows[rows.index(r) - 1]["mesh_text"] + ", optimizer on host" == r["mesh_text"] for r in hosted)
    chosen = next(r for r in rows if r.get("chosen"))
    assert free.memory.offload_optimizer is chosen["offload_optimizer"]
    assert chosen["predicted_step_s"] == pytest.approx(free.predicted_step_s)
    assert chosen["predicted_step_s"] <= min(r.get("predicted_step_s", float("inf")) for r in rows)
    assert all(r["lower_bound_s"] <= r.get("predicted_step_s", float("inf")) * (1 + 1e-9) for r in rows)
    # (each dp_shard mesh also tried with per-block FSDP2 units, fxpipe.memory.fsdp; the tp meshes too: skipped)
    skipped = ["skipped" in r for r in tight.options["mesh_search"]]
    assert skipped == [False] + [True] * (len(skipped) - 1) and len(skipped) > 6
    assert sum("FSDP2 unit per block" in r["mesh_text"] for r in tight.options["mesh_search"]) == 3
    assert all("\n" not in r["skipped"] and len(r["skipped"]) < 300 for r in tight.options["mesh_search"][1:])
    # 5 kB: nothing fits; one error says why each mesh was skipped and what the training state needs of all devices
    with pytest.raises(InfeasibleError) as err:
        fxpipe.compile(model, args, kwargs, devices=4, microbatches=4, mesh="search", schedule="zb-h1",
                       time_limit_s=0.5, memory=MemoryModel(offload_optimizer=False), memory_bytes=5e3)
    text = str(err.value)
    assert text.startswith("no mesh of 4 devices fits")
    assert all(f"  {r['mesh_text']}: " in text for r in tight.options["mesh_search"])
    assert "The training state alone" in text and "all 4 devices can use" in text
    assert [r["mesh_text"] for r in err.value.tried["meshes"]] == [r["mesh_text"] for r in tight.options["mesh_search"]]


def test_mesh_bound_counts_atomic_ops_and_prunes_long_pipelines_unplanned():
    """A chain whose last op (an LM head) is a quarter of the work, 8 devices, 16 micro-batches: the
    pure pipeline's bound is 16 x that op (ops are atomic), not 16 x work / 8, and stays below its
    planned step; the search prunes it by that bound without planning it."""
    import numpy as np

    from fxpipe.ir import OpGraph
    from fxpipe.mesh.search import mesh_lower_bound_s, search_mesh
    from fxpipe.options import PlanOptions
    from fxpipe.planner import plan_with_options

    n = 16
    t = np.r_[np.full(n - 1, 1e-3), 5e-3]  # the last op: 5 of the 20 ms per pass
    g = OpGraph.from_arrays(t_fwd_s=t, t_bwd_input_s=t, t_bwd_weight_s=t, size_out_bytes=np.full(n, 1e3),
                            size_param_bytes=np.full(n, 1e3), edges=[(i, i + 1) for i in range(n - 1)],
                            bandwidth_bytes_per_s=1e12)
    pure = {"pp": 8, "dp_shard": 1, "dp_replicate": 1}
    lb = mesh_lower_bound_s(g, pure, 16)
    assert lb == pytest.approx(16 * 3 * 5e-3) and lb > 16 * float(np.sum(3 * t)) / 8 * 1.5
    opts = PlanOptions(schedule="1f1b", time_limit_s=0.5, seed=0)
    _, _, sched, _ = plan_with_options(g, devices=8, microbatches=16, options=opts, memory=MemoryModel())
    assert lb <= float(sched.value) * (1 + 1e-9)
    # two of the 3 largest ops share one of 2 devices
    assert mesh_lower_bound_s(g, {"pp": 2, "dp_shard": 4, "dp_replicate": 1}, 16) >= 4 * 3 * (5e-3 + 1e-3)
    mesh, _, _, table = search_mesh(g, devices=8, microbatches=16, memory=MemoryModel(), options=opts)
    assert mesh["pp"] < 8
    assert next(r for r in table if r["mesh"]["pp"] == 8)["skipped"].startswith("pruned")


@pytest.mark.parametrize("bandwidth", [1e6, 1e12])
def test_mesh_search_bounds_are_sound_and_pruning_keeps_the_best(bandwidth):
    """On a synthetic 12-op chain: every planned mesh's lower bound is at most its predicted step;
    the mesh the pruned search keeps is the best of all meshes planned one by one; a slow link
    prunes the data-parallel meshes by their bound alone."""
    import numpy as np

    from fxpipe.ir import OpGraph
    from fxpipe.mesh.search import mesh_lower_bound_s, search_mesh
    from fxpipe.options import PlanOptions
    from fxpipe.planner import plan_with_options

    rng = np.random.default_rng(0)
    n = 12
    g = OpGraph.from_arrays(t_fwd_s=rng.uniform(1e-3, 3e-3, n), t_bwd_input_s=rng.uniform(1e-3, 3e-3, n),
                            t_bwd_weight_s=rng.uniform(1e-3, 3e-3, n), size_out_bytes=np.full(n, 1e3),
                            size_param_bytes=np.full(n, 1e6), edges=[(i, i + 1) for i in range(n - 1)],
                            bandwidth_bytes_per_s=bandwidth)
    opts = PlanOptions(schedule="1f1b", time_limit_s=0.5, seed=0)
    mesh, _, (part, problem, sched, _), table = search_mesh(g, devices=4, microbatches=8, memory=MemoryModel(),
                                                             options=opts)
    predicted = {}  # every mesh planned alone (no pruning)
    for m in candidate_meshes(4, 8):
        p, pr, s, _ = plan_with_options(g, devices=m["pp"], microbatches=8 // (m["dp_shard"] * m["dp_replicate"]),
                                        options=opts, memory=MemoryModel())
        predicted[format_mesh(m)] = float(s.value) + pipeline_dp_sync_s(g, p.assignment, pr.device_of_stage, m)
        assert mesh_lower_bound_s(g, m, 8) <= predicted[format_mesh(m)] * (1 + 1e-9)
    chosen = next(r for r in table if r.get("chosen"))
    assert chosen["predicted_step_s"] == pytest.approx(min(predicted.values()), rel=1e-9)
    for r in table:
        assert r["lower_bound_s"] <= r.get("predicted_step_s", float("inf")) * (1 + 1e-9)
    if bandwidth == 1e6:  # 1 MB/s: syncing 3 MB of parameters dwarfs the 0.2 s of compute
        assert mesh == {"pp": 4, "dp_shard": 1, "dp_replicate": 1}
        assert all(r["skipped"].startswith("pruned") for r in table if r["mesh"]["pp"] < 4)
