"""Optimizer state on the host (issue 18: 70B on 16 x 80 GB): the memory model, the host step's cost,
and the mesh search's choice of where the optimizer lives (planning only; the gloo runs of such plans
are in tests/test_optimizer_offload.py)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.memory import MemoryModel
from fxpipe.mesh import candidate_meshes, device_host_step_s, host_links, optimizer_host_step_s, pipeline_step_s
from fxpipe.mesh.search import mesh_lower_bound_s, search_mesh
from fxpipe.options import PlanOptions
from fxpipe.planner import plan_with_options

HOST = {"host_bytes_per_s": 64e9, "host_memory_bytes_per_s": 76.8e9, "host_memory_bytes": 250e9}  # h100-sxm's


def _chain(n: int = 12, param_bytes: float = 2e6, host=HOST) -> OpGraph:
    """A chain of equal ops with 1e6 bf16 parameters each (2 bytes per parameter)."""
    t = np.full(n, 1e-3)
    return OpGraph.from_arrays(t_fwd_s=t, t_bwd_input_s=t, t_bwd_weight_s=t, size_out_bytes=np.full(n, 1e3),
                               size_param_bytes=np.full(n, param_bytes), edges=[(i, i + 1) for i in range(n - 1)],
                               bandwidth_bytes_per_s=1e10, meta={"param_dtype_bytes": 2, **({"host": host} if host else {})})


def test_memory_model_moves_the_optimizer_state_to_the_host():
    on, off = MemoryModel(offload_optimizer=True), MemoryModel()
    assert off.offload_optimizer is None and off.bytes_per_param("training") == (2.0, 2.0, 12.0)
    assert on.bytes_per_param("training") == (2.0, 2.0, 0.0) and on.host_bytes_per_param() == 16.0
    assert off.host_bytes_per_param() == 0.0 and on.host_bytes_per_param("inference") == 0.0
    sharded = MemoryModel(offload_optimizer=True, data_parallel=4, zero_stage=1)
    assert sharded.host_bytes_per_param() == 4.0  # the rank's shard of weights, gradients and optimizer state
    for m in (on, off, MemoryModel(offload_optimizer=False)):
        assert MemoryModel.from_dict(m.to_dict()) == m
    with pytest.raises(InputError, match="offload_optimizer must be True, False or None"):
        MemoryModel(offload_optimizer="yes")


def test_host_step_is_the_shards_transfer_and_its_memory_bound_update():
    m = MemoryModel(offload_optimizer=True, data_parallel=2, zero_stage=1)  # mixed-adam: 2 + 2 + 12 bytes
    shard = 0.5e9
    expected = shard * (2 + 2) / 64e9 + shard * (2 * (2 + 12) + 2) / 76.8e9
    assert optimizer_host_step_s(1e9, m, HOST) == pytest.approx(expected)
    assert optimizer_host_step_s(1e9, MemoryModel(), HOST) == 0.0
    with pytest.raises(InputError, match="host link and host memory bandwidth"):
        optimizer_host_step_s(1e9, m, None)
    g = _chain()
    assert host_links(g) == HOST and host_links(_chain(host=None)) is None
    per_device = device_host_step_s(g, np.repeat([0, 1, 2], 4), [0, 1, 2], 3, MemoryModel(offload_optimizer=True))
    assert per_device == pytest.approx([optimizer_host_step_s(4e6, MemoryModel(offload_optimizer=True), HOST)] * 3)


@pytest.mark.parametrize("objective", ["makespan", "stage_span"])
def test_predicted_step_adds_each_devices_host_step_after_its_last_backward(objective):
    import dataclasses

    g = _chain()
    mem = MemoryModel(offload_optimizer=True)
    part, problem, sched, _ = plan_with_options(g, devices=3, microbatches=6, memory=mem,
                                                options=PlanOptions(schedule="1f1b", time_limit_s=0.5, seed=0))
    sched = dataclasses.replace(sched, objective=objective)
    mesh = {"pp": 3, "dp_shard": 1, "dp_replicate": 1}
    host = device_host_step_s(g, part.assignment, problem.device_of_stage, 3, mem)
    step = pipeline_step_s(g, part.assignment, problem.device_of_stage, sched, mesh, memory=mem)
    assert pipeline_step_s(g, part.assignment, problem.device_of_stage, sched, mesh) == float(sched.value)
    assert float(sched.value) + min(host) * (1 - 1e-9) <= step <= float(sched.value) + max(host) * (1 + 1e-9)
    assert mesh_lower_bound_s(g, mesh, 6, memory=mem) <= step * (1 + 1e-9)


def test_search_offloads_only_where_memory_binds_and_keeps_the_fastest():
    """2e8 parameters (16 bytes each: 3.2 GB of state) on 4 devices of 0.7 GB: no mesh fits with the optimizer
    on the device; with it on the host (4 bytes per parameter on the device) every mesh with pp >= 2 can.
    The search tries the host right after each mesh that does not fit, its bounds stay below its predictions,
    and it keeps the fastest; without a known host link it cannot offload and says no mesh fits."""
    from fxpipe.errors import InfeasibleError

    g = _chain(n=8, param_bytes=2 * 2.5e7)
    opts = PlanOptions(schedule="1f1b", time_limit_s=0.5, seed=0)
    mem = MemoryModel(capacity_bytes=0.7e9)
    mesh, chosen_mem, (part, problem, sched, _), table = search_mesh(g, devices=4, microbatches=8, memory=mem,
                                                                      options=opts)
    assert chosen_mem.offload_optimizer is True
    assert [r["mesh_text"] for r in table if not r["offload_optimizer"]] == \
        [f"pp={m['pp']}" + (f" x dp_shard={m['dp_shard']}" if m["dp_shard"] > 1 else "") if m["pp"] > 1
         else f"dp_shard={m['dp_shard']}" for m in candidate_meshes(4, 8)]
    for i, r in enumerate(table):
        if r["offload_optimizer"]:
            assert table[i - 1]["mesh_text"] + ", optimizer on host" == r["mesh_text"]
            assert table[i - 1]["skipped"].startswith("cannot fit")
        assert r["lower_bound_s"] <= r.get("predicted_step_s", float("inf")) * (1 + 1e-9)
    best = next(r for r in table if r.get("chosen"))
    assert best["offload_optimizer"] and best["optimizer_host_step_s"] > 0
    assert best["predicted_step_s"] == min(r.get("predicted_step_s", float("inf")) for r in table)
    # unlimited memory: nothing binds, no row offloads
    _, free_mem, _, free_table = search_mesh(g, devices=4, microbatches=8, memory=MemoryModel(), options=opts)
    assert free_mem.offload_optimizer is False and not any(r["offload_optimizer"] for r in free_table)
    # the user's "never" and an unknown host link: no mesh fits, and the error names the host as a remedy
    for graph, memory in ((g, MemoryModel(capacity_bytes=0.7e9, offload_optimizer=False)),
                          (_chain(n=8, param_bytes=2 * 2.5e7, host=None), mem)):
        with pytest.raises(InfeasibleError, match="no mesh of 4 devices fits") as err:
            search_mesh(graph, devices=4, microbatches=8, memory=memory, options=opts)
        assert "the optimizer state on the host (MemoryModel(offload_optimizer=True)" in str(err.value)
    # a host too small for the optimizer state: the host rows are skipped, saying why, and the error does not
    # suggest the host again
    small = _chain(n=8, param_bytes=2 * 2.5e7, host={**HOST, "host_memory_bytes": 1e8})
    with pytest.raises(InfeasibleError) as err:
        search_mesh(small, devices=4, microbatches=8, memory=mem, options=opts)
    rows = err.value.tried["meshes"]
    hosted = [r for r in rows if r["offload_optimizer"]]
    assert hosted and all(r["skipped"].startswith("cannot fit") for r in hosted)
    assert any("of host memory" in r["skipped"] for r in hosted)
    assert "MemoryModel(offload_optimizer=True)" not in str(err.value)


def test_cli_offload_optimizer_flag_is_three_way():
    from fxpipe.cli.common import add_memory_arguments, memory_model_from_args

    p = argparse.ArgumentParser()
    add_memory_arguments(p, plan=True)
    for argv, want in (([], None), (["--offload-optimizer"], True), (["--no-offload-optimizer"], False)):
        assert memory_model_from_args(p.parse_args(argv), float("inf")).offload_optimizer is want


def test_offload_without_a_known_host_link_is_a_clear_error_at_plan_time():
    with pytest.raises(InputError, match="offload_optimizer needs the host link"):
        plan_with_options(_chain(host=None), devices=2, microbatches=2, memory=MemoryModel(offload_optimizer=True),
                          options=PlanOptions(schedule="1f1b", time_limit_s=0.2, seed=0))


def test_plan_file_keeps_where_the_optimizer_lives(tmp_path):
    """A compiled plan with the optimizer on the host: the summary says so, the host step is in the predicted
    step, and save -> load keeps both."""
    pytest.importorskip("torch")
    import fxpipe
    from fxpipe.cli.plan_cmd import HFFactory

    fac = HFFactory("gpt2", {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 32, "n_positions": 16},
                    microbatches=4, microbatch_size=1, seq_len=4, seed=0)
    model, args, kwargs = fac.one_microbatch()
    plan = fxpipe.compile(model, args, kwargs, devices=2, microbatches=4, mesh="pipeline", schedule="1f1b",
                          time_limit_s=0.5, seed=0, memory=MemoryModel(offload_optimizer=True))
    assert plan.memory.offload_optimizer is True and plan.optimizer_host_step_s > 0
    assert plan.predicted_step_s > float(plan.schedule.value)
    assert "optimizer state offloaded to the host" in plan.summary()
    assert "optimizer state on the host; capacity" in plan.memory_summary()
    path = plan.save(tmp_path / "plan.json")
    back = fxpipe.load_plan(path)
    assert back.memory == plan.memory and back.predicted_step_s == pytest.approx(plan.predicted_step_s)


def test_a_looser_siblings_plan_is_reused_only_where_it_fits():
    """The mesh search reuses a plan made under looser memory for a sibling mesh (same pp, same link) when its
    schedule satisfies every rule under the sibling's activation limits: the problem then carries those
    limits; a sibling whose memory the schedule exceeds is planned afresh."""
    from fxpipe.memory.plan_view import schedule_mem_limit
    from fxpipe.mesh.search import _reuse
    from fxpipe.schedule.validate import check_schedule

    g = _chain(n=8, param_bytes=2 * 2.5e7)  # 2e8 parameters
    opts = PlanOptions(schedule="1f1b", time_limit_s=0.5, seed=0)
    loose = MemoryModel(capacity_bytes=4e9, data_parallel=4, zero_stage=1)  # 2 + 2 + 3 B/param
    result = plan_with_options(g, devices=2, microbatches=4, options=opts, memory=loose)
    part, problem, sched, _ = result
    roomy = MemoryModel(capacity_bytes=4e9, data_parallel=2, zero_stage=1)  # 2 + 2 + 6 B/param: 1e9 B per device
    reused = _reuse(g, result, roomy, opts)
    assert reused is not None and reused[0] is part and reused[2] is sched
    want = schedule_mem_limit(g, part.assignment, part.k, problem.device_of_stage, roomy, 4, "training")
    assert np.allclose(reused[1].mem_limit, want) and not check_schedule(reused[1], sched)
    assert _reuse(g, result, MemoryModel(capacity_bytes=1.05e9, data_parallel=2, zero_stage=1), opts) is None  # 1e9 static
    # static state fits, but the looser plan's stashes (1F1B: two of 4e7 bytes on stage 0) exceed 5e7 bytes
    t = np.full(8, 1e-3)
    g2 = OpGraph.from_arrays(t_fwd_s=t, t_bwd_input_s=t, t_bwd_weight_s=t, size_out_bytes=np.full(8, 1e3),
                             act_bytes=np.full(8, 1e7), size_param_bytes=np.full(8, 5e7),
                             edges=[(i, i + 1) for i in range(7)], bandwidth_bytes_per_s=1e10,
                             meta={"param_dtype_bytes": 2, "host": HOST})
    result2 = plan_with_options(g2, devices=2, microbatches=4, options=opts, memory=loose)
    assert not any(op.type in ("O", "R") for op in result2[2].ops) and not any(result2[1].recompute)
    assert _reuse(g2, result2, MemoryModel(capacity_bytes=(1e9 + 5e7) / 0.9, data_parallel=2, zero_stage=1),
                  opts) is None
