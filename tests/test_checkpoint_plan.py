"""Activation checkpointing in plans (issue 28): the planner picks a policy per stage, the plan and its file
name them, older plan files load with whole-stage recomputation, bad requests fail clearly, and the
torchtitan layouts of the issue plan (planning only, meta models)."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import fxpipe
from fxpipe.api import plan_graph
from fxpipe.errors import InfeasibleError, InputError
from fxpipe.memory import MemoryModel
from fxpipe.memory.checkpoint import CheckpointPolicy
from fxpipe.models import build_hf_model
from fxpipe.schedule.dispatch import make_schedule
from fxpipe.schedule.from_partition import problem_from_partition
from fxpipe.schedule.validate import check_schedule
from fxpipe.testing import zoo

H100_96GB = 96e9


@pytest.fixture(scope="module")
def tiny_llama():
    return zoo.get("llama").one_microbatch()


def _compile(tiny, **kw):
    model, args, kwargs = tiny
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxpipe.compile(model, args, kwargs, devices=2, microbatches=8, mesh="pipeline", time_limit_s=1.0,
                              schedule_time_limit_s=0, **kw)


def test_the_planner_checkpoints_where_memory_forces_it_and_the_plan_names_each_policy(tiny_llama, tmp_path):
    free = _compile(tiny_llama)
    assert free.problem.checkpoint == ("none", "none")
    assert all(p.kind == "none" for p in free.activation_checkpointing)
    from fxpipe.schedule.device_greedy import min_device_memory

    one = float(min_device_memory(free.problem, offload=False).max())  # one micro-batch of the larger stage
    tight = _compile(tiny_llama, mem_limit_bytes=0.9 * one)  # no schedule fits without checkpointing
    assert check_schedule(tight.problem, tight.schedule) == []
    policies = tight.activation_checkpointing
    assert any(p.kind != "none" for p in policies)
    for s, (p, name) in enumerate(zip(policies, tight.problem.checkpoint)):
        opt = tight.problem.checkpoint_option(s)
        assert p.replay_s == pytest.approx(opt.replay_s) and p.kind == name.split("-")[0].replace("budget", "budget")
        names = {tight.graph.names[v] for v in np.flatnonzero(tight.partition.assignment == s)}
        assert p.nodes <= names  # segments name the stage's own nodes
    text = tight.summary()
    assert "activation checkpointing per stage" in text and "checkpoint" in text.splitlines()[1 + text.count("mesh")]
    path = tight.save(tmp_path / "p.json")
    again = fxpipe.load_plan(path)
    assert again.activation_checkpointing == policies
    # pinned: every stage with blocks runs the requested kind (or its fused variant)
    full = _compile(tiny_llama, activation_checkpointing="full")
    assert all(p.kind == "full" for p in full.activation_checkpointing)
    assert full.recompute_stages() == ()  # only whole-stage recomputation is the old runtime's replay


def test_an_old_plan_file_loads_its_recomputing_stages_as_stage(tiny_llama):
    plan = _compile(tiny_llama, activation_checkpointing="none")
    legacy = problem_from_partition(plan.graph, plan.partition, num_microbatches=plan.microbatches,
                                    pooled_buffer_bytes=plan.problem.pooled_bytes).with_recompute([0])
    sched = make_schedule(legacy, "1f1b")
    doc = plan.replace(problem=legacy, schedule=sched).to_dict()
    doc.pop("activation_checkpointing")
    doc["problem"] = legacy.to_dict()  # a pre-issue-28 problem: recompute flags, no menu
    assert "checkpoint_menu" not in doc["problem"] and doc["problem"]["recompute"] == [True, False]
    doc["stages"] = [dict(s) for s in doc["stages"]]
    from fxpipe.plan.tables import device_stats, stage_stats

    args = (plan.graph, plan.partition, legacy, sched, plan.objective, plan.memory)
    doc["stages"] = [s.to_dict() for s in stage_stats(*args)]
    doc["device_table"] = [d.to_dict() for d in device_stats(*args)]
    doc["optimality"] = {}
    old = fxpipe.Plan.from_dict(doc)
    assert [p.kind for p in old.activation_checkpointing] == ["stage", "none"]
    assert old.recompute_stages() == (0,)
    stage0 = {old.graph.names[v] for v in np.flatnonzero(old.partition.assignment == 0) if old.graph.ops[v] != "placeholder"}
    assert old.activation_checkpointing[0].nodes == stage0  # the whole stage is one segment
    # a file whose policies disagree with its problem is refused, naming the field
    doc2 = plan.to_dict()
    doc2["activation_checkpointing"] = [CheckpointPolicy("stage").to_dict()] + doc2["activation_checkpointing"][1:]
    with pytest.raises(InputError, match="activation_checkpointing disagrees"):
        fxpipe.Plan.from_dict(doc2, source="p.json")
    doc2["activation_checkpointing"][0] = {"kind": "sometimes"}
    with pytest.raises(InputError, match=r"p.json: activation_checkpointing\[0\]"):
        fxpipe.Plan.from_dict(doc2, source="p.json")


def test_bad_requests_name_the_argument_and_the_allowed_values(tiny_llama, capsys):
    model, args, kwargs = tiny_llama
    with pytest.raises(InputError, match="activation_checkpointing must be one of 'auto', 'none', 'full', 'selective'"):
        fxpipe.compile(model, args, kwargs, devices=2, activation_checkpointing="budget")
    with pytest.raises(InputError, match="activation_checkpointing"):
        plan_graph(_compile(tiny_llama).graph, devices=2, microbatches=2, activation_checkpointing=True)
    from fxpipe.cli import main

    with pytest.raises(SystemExit) as exit_info:  # argparse: usage and the allowed values, exit code 2
        main(["plan", "--hf", "llama", "--devices", "2", "--activation-checkpointing", "sometimes"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--activation-checkpointing" in err and "'selective'" in err
    assert "Traceback" not in err


# ------------------------------------------------------------------ the layouts (planning only)
@pytest.fixture(scope="module")
def llama8b_2x8192():
    return build_hf_model("llama-3-8b", {"seq_len": 8192, "batch_size": 2, "attn_implementation": "sdpa"},
                          device="meta", dtype=torch.bfloat16)


def test_torchtitan_fsdp8_selective_layout_fits_96gb(llama8b_2x8192):
    """torchtitan's Table 1 (Dec. 2024 H100 benchmark): Llama-3.1-8B, FSDP 8, local batch 2 x 8192, selective
    AC, 96 GB H100s, 82.4 GiB measured. Without checkpointing a stash alone overflows; with torchtitan's
    selective policy the layout plans and fits, its predicted peak within 20 % of the measured one."""
    model, args, kwargs = llama8b_2x8192
    common = dict(devices=8, microbatches=8, mesh={"pp": 1, "dp_shard": 8}, hardware="h100-sxm",
                  memory_bytes=H100_96GB, time_limit_s=1.0, schedule_time_limit_s=0)
    with pytest.raises(InfeasibleError, match="Per-block activation checkpointing would help"):
        fxpipe.compile(model, args, kwargs, activation_checkpointing="none", **common)
    plan = fxpipe.compile(model, args, kwargs, activation_checkpointing="selective", **common)
    assert plan.problem.checkpoint[0].startswith("selective")
    row = plan.device_table[0]
    assert row.fits and row.memory_bytes <= H100_96GB
    assert abs(row.memory_bytes / 2**30 / 82.4 - 1) < 0.20


def test_the_default_mesh_is_no_worse_than_torchtitan_fsdp8(llama8b_2x8192):
    """The same 8B job on 8 devices with the default mesh (the search, which now prices FSDP-heavy meshes
    with per-block checkpointing): its predicted step is no worse than the pinned FSDP-8 layout's."""
    model, args, kwargs = llama8b_2x8192
    common = dict(devices=8, microbatches=8, hardware="h100-sxm", memory_bytes=H100_96GB, time_limit_s=1.0,
                  schedule_time_limit_s=0)
    pinned = fxpipe.compile(model, args, kwargs, mesh={"pp": 1, "dp_shard": 8}, **common)
    default = fxpipe.compile(model, args, kwargs, **common)
    assert default.predicted_step_s <= pinned.predicted_step_s * (1 + 1e-9)
    assert any(r["mesh"] == {"pp": 1, "dp_shard": 8, "dp_replicate": 1} for r in default.options["mesh_search"])


def test_llama3_70b_fsdp64_full_fits_with_per_block_units_and_says_why_whole_stages_do_not():
    """torchtitan trains Llama-3-70B on 64 A100s with FSDP and full AC (ZeRO-3: a block's parameters gathered at
    a time). With whole-stage FSDP2 units (fsdp_units="stage") a stage's parameters and gradients stay unsharded
    for the whole step (ZeRO-1's memory, fxpipe.mesh.mesh_memory), so one stage holding the model does not fit:
    the error says so, with the static state, and that checkpointing would not help. By default the pinned mesh
    then turns to per-block units (issue 28's done-when, fxpipe.memory.fsdp) and fits."""
    model, args, kwargs = build_hf_model("llama-3-70b", {"seq_len": 8192, "attn_implementation": "sdpa"}, device="meta",
                                         dtype=torch.bfloat16)
    job = dict(devices=64, microbatches=64, mesh={"dp_shard": 64}, hardware="a100-80gb", activation_checkpointing="full",
               time_limit_s=1.0, schedule_time_limit_s=0)
    with pytest.raises(InfeasibleError) as info:
        fxpipe.compile(model, args, kwargs, memory=MemoryModel(fsdp_units="stage"), **job)
    text = str(info.value)
    assert "no partition into 1 stages fits" in text and "checkpointing would not help" in text
    plan = fxpipe.compile(model, args, kwargs, **job)
    assert plan.memory.fsdp_units == "block" and plan.memory.zero_stage == 3
    assert all(d.fits for d in plan.device_table) and {p.kind for p in plan.activation_checkpointing} == {"full"}


@pytest.mark.slow
def test_llama3_70b_on_64_devices_default_is_no_slower_than_the_mesh_chosen_before():
    """Llama-3-70B, 64 h100-sxm, 128 micro-batches of 4096 tokens (benchmarks/bench_mesh_plan.py's row): the
    default mesh's predicted step is no worse than that of the mesh the search chose before issue 28
    (pp=32 x dp_shard=2, pipeline rank outermost), planned pinned with the same costs."""
    model, args, kwargs = build_hf_model("llama-3-70b", {"seq_len": 4096, "attn_implementation": "sdpa"}, device="meta",
                                         dtype=torch.bfloat16)
    common = dict(devices=64, microbatches=128, time_limit_s=5.0, schedule_time_limit_s=0)
    plan = fxpipe.compile(model, args, kwargs, **common)
    before = fxpipe.compile(model, args, kwargs, mesh={"pp": 32, "dp_shard": 2, "order": ["pp", "dp_replicate", "dp_shard"]},
                            **common)
    assert plan.predicted_step_s <= before.predicted_step_s * (1 + 1e-9)
    assert all(d.fits for d in plan.device_table)


def test_planning_ahead_in_worker_processes_changes_no_figure(llama8b_2x8192, monkeypatch):
    """The mesh search plans its next candidates in forked worker processes (fxpipe.mesh.prefetch) on a large
    graph; it takes a plan made there only when made from the arguments it would plan it with itself, so the
    search's table and choice are those of planning one candidate after another."""
    model, args, kwargs = llama8b_2x8192
    common = dict(devices=8, microbatches=8, hardware="h100-sxm", memory_bytes=H100_96GB, time_limit_s=1.0,
                  schedule_time_limit_s=0)
    tables = []
    for workers in ("1", "2"):
        monkeypatch.setenv("FXPIPE_SEARCH_WORKERS", workers)
        plan = fxpipe.compile(model, args, kwargs, **common)
        tables.append([(r["mesh_text"], r.get("predicted_step_s"), r.get("skipped", "")[:40], r.get("chosen"))
                       for r in plan.options["mesh_search"]])
    assert tables[0] == tables[1]


def test_tensor_parallelism_plans_checkpointing_on_one_rank_and_refuses_only_compile_stages(tiny_llama):
    """Under tp > 1 (the runtime runs every policy on the local shards, tests/test_tensor_parallel_run.py):
    a pinned ``"full"`` plans on every stage, priced on one tensor-parallel rank's graph (it keeps less than at
    tp = 1: the residual stream's sequence shard); ``"auto"`` checkpoints where one rank's memory forces it;
    the runtime's own check refuses compile_stages only."""
    from fxpipe.codegen.tensor_parallel import check_tensor_parallel_run
    from fxpipe.schedule.device_greedy import min_device_memory

    model, args, kwargs = tiny_llama
    common = dict(devices=4, microbatches=4, schedule="1f1b", time_limit_s=0.3, seed=0)
    kept = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tp in (1, 2):
            plan = fxpipe.compile(model, args, kwargs, **{**common, "devices": 2 * tp}, mesh={"pp": 2, "tp": tp},
                                  activation_checkpointing="full")
            assert [p.kind for p in plan.activation_checkpointing] == ["full", "full"]
            kept[tp] = [p.kept_bytes for p in plan.activation_checkpointing]
            check_tensor_parallel_run(tp, activation_checkpointing=plan.activation_checkpointing)
        assert all(0 < k2 < k1 for k1, k2 in zip(kept[1], kept[2])), kept
        free = fxpipe.compile(model, args, kwargs, **common, mesh={"pp": 2, "tp": 2})
        assert [p.kind for p in free.activation_checkpointing] == ["none", "none"]
        one = float(min_device_memory(free.problem, offload=False).max())  # one micro-batch of the larger stage
        tight = fxpipe.compile(model, args, kwargs, devices=4, microbatches=4, time_limit_s=1.0, schedule_time_limit_s=0,
                               seed=0, mesh={"pp": 2, "tp": 2}, mem_limit_bytes=0.9 * one)
    assert tight.tp == 2 and any(p.kind != "none" for p in tight.activation_checkpointing)
    assert check_schedule(tight.problem, tight.schedule) == []
    with pytest.raises(InputError, match="compile_stages"):
        check_tensor_parallel_run(2, compile_stages=True)
    check_tensor_parallel_run(1, compile_stages=True)

def test_a_pinned_policy_under_a_pinned_1f1b_runs_fused_where_its_split_backward_does_not_fit():
    """A split backward of a per-block policy holds every W input from B to W; where that does not fit under a
    pinned schedule, the plan runs the policy's fused variant (B and W as one full backward, one segment's
    replay held), as torchtitan's full AC under 1F1B does (at tp = 2, the published Table 5 layout's shape)."""
    model, args, kwargs = build_hf_model("llama", {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "vocab_size": 96, "num_hidden_layers": 8,
                                                   "seq_len": 16, "batch_size": 1})
    common = dict(devices=4, microbatches=8, mesh={"pp": 2, "tp": 2}, schedule="1f1b", activation_checkpointing="full",
                  time_limit_s=1.0, schedule_time_limit_s=0, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = fxpipe.compile(model, args, kwargs, **common)
        assert free.problem.checkpoint == ("full", "full")
        split_one = float(np.max(free.problem.stash_footprint))  # one micro-batch's B under the split variant
        tight = fxpipe.compile(model, args, kwargs, **common, mem_limit_bytes=0.9 * split_one)
    assert tight.problem.checkpoint == ("full-fused", "full-fused")
    assert check_schedule(tight.problem, tight.schedule) == []
    assert [p.kind for p in tight.activation_checkpointing] == ["full", "full"]
