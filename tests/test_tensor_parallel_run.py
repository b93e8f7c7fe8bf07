"""Tensor parallelism on CPU gloo ranks (issue 29): training equal to one process, DCP across tp degrees.

A Llama of the zoo (grouped-query attention, SwiGLU, untied embedding and output projection)
planned with a pinned ``tp`` trains to the losses, gradients and parameters of one process on
the same global batch:

* ``{"pp": 2, "tp": 2}`` under 1F1B on 4 ranks (the default run's one representative; the
  stage modules run on DTensor, the pipeline sends carry the sequence shard);
* slow: the same under ZB-H1 (split backward) and ZB-V (two stages per rank), ``{"tp": 2,
  "dp_shard": 2}`` (2-D FSDP2 over (dp_shard, tp)), ``{"tp": 2, "dp_replicate": 2}`` (DDP) and
  ``{"pp": 2, "tp": 2}`` of a Qwen3-MoE (experts and router replicated, attention split) and of
  Falcon, the optimizer on the host, on 4 ranks, sharing one set of workers; ten zoo models of
  every kind at ``{"tp": 2}`` on 2 ranks; ``{"pp": 2, "tp": 2, "dp_shard": 2}`` on 8 ranks;
* slow: a DCP checkpoint of AdamW training saved at ``{"pp": 2, "tp": 2}`` resumes at tp = 1
  (``{"pp": 2, "dp_shard": 2}``) and at tp = 2 with the losses of the uninterrupted run
  (torchrun, ``tests/_dcp_worker.py``);
* slow: ``fxpipe plan --mesh pp=2,tp=2 --run`` (plan.train_local) writes the plan file that
  torchrun trains with ``plan.build`` on 4 ranks, each rank reading its stages from a safetensors
  file of the whole model (meta-built model, sharded after materialization), to the same losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import fxpipe  # noqa: E402
from fxpipe.codegen.launch import reference_train, spawn_train_many  # noqa: E402
from fxpipe.mesh import format_mesh  # noqa: E402
from fxpipe.testing import zoo  # noqa: E402

from helpers import assert_same_training  # noqa: E402

GLOBAL_MB = 4


def _planned_run(name, mesh, schedule, offload=False, **kw):
    """A spawn_train_many run of zoo model ``name`` planned with ``mesh``, and its label (``offload``: the
    optimizer state on the host, FSDP2's CPUOffloadPolicy around the tensor-parallel stages)."""
    zm = zoo.get(name, microbatches=GLOBAL_MB)
    model, args, kwargs = zm.one_microbatch()
    world = 1
    for d in ("pp", "dp_shard", "dp_replicate", "tp"):
        world *= mesh.get(d, 1)
    plan = fxpipe.compile(model, args, kwargs, devices=world, microbatches=GLOBAL_MB, mesh=mesh, schedule=schedule,
                          time_limit_s=0.3, seed=0, **kw)
    assert plan.tp == mesh["tp"] and plan.world_size == world
    run = dict(make_model=zm, stage_of=plan.worker_stage_of(), orders=plan.orders(), num_microbatches=GLOBAL_MB,
               make_batch=zm.batch, loss=zm.loss, steps=2, lr=0.05, mesh={**plan.mesh, "order": plan.rank_order},
               model_key=name, tensor_parallel_params=plan.tensor_parallel.params, offload_optimizer=offload)
    return run, f"{name} {format_mesh(plan.mesh)} {schedule}" + (" optimizer on the host" if offload else ""), plan


def _run(name, mesh, schedule, offload=False, **kw):
    """:func:`_planned_run` without the plan."""
    return _planned_run(name, mesh, schedule, offload, **kw)[:2]


def _check(results, labels, runs):
    for res, label, run in zip(results, labels, runs):
        zm = run["make_model"]
        ref = reference_train(zm, zm.batch, num_microbatches=GLOBAL_MB, steps=2, lr=0.05, loss=zm.loss)
        assert ref.losses[1] != ref.losses[0]
        assert_same_training(res, ref, label)


def test_llama_pp2_tp2_trains_like_one_process():
    run, label = _run("llama", {"pp": 2, "tp": 2}, "1f1b")
    res = spawn_train_many([run], world_size=4, timeout_s=600)
    _check(res, [label], [run])
    # 4 ranks, each its pipeline stage of one tensor-parallel half: ranks 0, 1 run stage 0, ranks 2, 3 stage 1
    acts = res[0].meta["actions"]
    assert acts[0] == acts[1] and acts[2] == acts[3] and acts[0] != acts[2]


def _checkpointed(name, mesh, schedule, kind, offload=False, **kw):
    """A :func:`_run` whose every stage runs the planner's ``kind`` policy (``fxpipe.testing.checkpoint_policies``),
    the plan (for its predictions) and the label; ``offload``: every stash offloaded to the host and reloaded."""
    from fxpipe.codegen.offload import offload_all
    from fxpipe.testing.checkpoint_policies import policies

    run, label, plan = _planned_run(name, mesh, schedule, **kw)
    run["activation_checkpointing"] = policies(plan, kind)
    if offload:
        run["orders"] = offload_all(run["orders"])
    if schedule.startswith("zb"):
        run["fuse"] = False  # every backward split into B and W
    return run, plan, f"{label} {kind}" + (" offloaded" if offload else "")


def _stage_stats(res) -> dict:
    """Per stage, the activation measurements of its first rank (``meta["activation"]``)."""
    out: dict = {}
    for act in res.meta["activation"].values():
        for s, st in (act or {}).get("stages", {}).items():
            out.setdefault(int(s), st)
    return out


def test_tp2_checkpointing_trains_like_one_process_and_measures_as_predicted():
    """Activation checkpointing under tensor parallelism (issue 29 with issue 28's policies), 2 gloo ranks at tp=2.

    Per-block ``full`` (1F1B), torchtitan-style ``selective`` (1F1B, and ZB-H1 with every backward split into B
    and W) train a Llama to the single-process result; every carved segment runs once per micro-batch and
    replays; and what the stash's saved-tensor hooks measure on a rank (its local shards: kept bytes after the
    forward, replayed bytes held at once in a full backward) is within 10 % of the policy's prediction on one
    tensor-parallel rank's graph (:func:`fxpipe.memory.checkpoint.predict_checkpoint_bytes` of
    ``plan.graph``). Before the stash kept DTensor activations by their local shards it counted none of them,
    and checkpointing under tp kept them all."""
    from fxpipe.memory.checkpoint import predict_checkpoint_bytes
    from fxpipe.testing.checkpoint_policies import stage_nodes

    mesh = {"pp": 1, "tp": 2}
    cases = [_checkpointed("llama", mesh, "1f1b", "full"), _checkpointed("llama", mesh, "1f1b", "selective"),
             _checkpointed("llama", mesh, "zb-h1", "selective")]
    runs, plans, labels = zip(*cases)
    res = spawn_train_many(list(runs), world_size=2, timeout_s=900)
    _check(res, labels, runs)
    for r, run, plan, label in zip(res, runs, plans, labels):
        st = _stage_stats(r)[0]
        pol = run["activation_checkpointing"][0]
        pieces = r.meta["checkpointing"][0]["pieces"]
        assert pieces and st["segment_runs"] == len(pieces) * 2 * GLOBAL_MB // mesh["pp"], (label, st)
        assert 0 < st["replays"] <= st["segment_runs"], (label, st)
        kept, peak = predict_checkpoint_bytes(plan.graph, stage_nodes(plan, 0), pol)
        assert st["max_microbatch_bytes"] == pytest.approx(kept, rel=0.1), (label, st, kept)
        if "zb" not in label:
            assert st["max_replay_peak_bytes"] == pytest.approx(peak, rel=0.1), (label, st, peak)
    # the policies do what they are for, on the local shards: full keeps least, both less than the plain stash
    plain = plans[0].graph
    none_kept, _ = predict_checkpoint_bytes(plain, stage_nodes(plans[0], 0), None)
    full, sel = (_stage_stats(r)[0]["max_microbatch_bytes"] for r in res[:2])
    assert full < sel < none_kept, (full, sel, none_kept)


@pytest.mark.slow
def test_tp_checkpointing_composes_with_pipelining_split_backward_offload_fsdp_and_moe_on_4_ranks():
    """pp2 x tp2 of a Llama under ``full`` (1F1B), ``selective`` (ZB-H1, split backward), ``budget`` with every
    stash offloaded and reloaded, whole-stage ``stage`` recomputation; tp2 x dp_shard2 (2-D FSDP2) under
    ``full``, with whole-stage units and with per-block units (every block carved, its segment inside it);
    pp2 x tp2 of a Qwen3-MoE under ``full``: each trains like one process."""
    from fxpipe.memory import MemoryModel
    from fxpipe.plan.build import fsdp_blocks

    pp_tp = {"pp": 2, "tp": 2}
    cases = [_checkpointed("llama", pp_tp, "1f1b", "full"), _checkpointed("llama", pp_tp, "zb-h1", "selective"),
             _checkpointed("llama", pp_tp, "1f1b", "budget", offload=True),
             _checkpointed("llama", pp_tp, "1f1b", "stage"),
             _checkpointed("llama", {"pp": 1, "tp": 2, "dp_shard": 2}, "1f1b", "full"),
             _checkpointed("qwen3_moe", pp_tp, "1f1b", "full"),
             # per-block FSDP2 units over (dp_shard, tp), the checkpoint segments inside their blocks
             _checkpointed("llama", {"pp": 1, "tp": 2, "dp_shard": 2}, "1f1b", "full",
                           memory=MemoryModel(fsdp_units="block"))]
    blocks = fsdp_blocks(cases[-1][1])
    assert blocks == ("model.layers.0", "model.layers.1")
    cases[-1][0]["fsdp_blocks"] = blocks
    runs, _, labels = zip(*cases)
    res = spawn_train_many(list(runs), world_size=4, timeout_s=1500)
    _check(res, labels, runs)
    for r, run, label in zip(res, runs, labels):
        stats = _stage_stats(r)
        kinds = {p.kind for p in run["activation_checkpointing"]}
        if kinds & {"full", "selective", "budget"}:
            assert all(st["replays"] > 0 for st in stats.values()), (label, stats)
        if "stage" in kinds:
            assert all(st["recomputes"] > 0 for st in stats.values()), (label, stats)
        if "offloaded" in label:
            assert any(st["offloads"] > 0 and st["offloads"] == st["reloads"] for st in stats.values()), (label, stats)
    split = _stage_stats(res[1])
    assert res[1].meta["fused_full_backward"][1] is False and split[1]["max_w_held_bytes"] > 0, split
    assert all(got == list(blocks) for got in res[-1].meta["fsdp_blocks"].values()), res[-1].meta["fsdp_blocks"]


@pytest.mark.slow
def test_tp_composes_with_split_backward_fsdp_ddp_and_moe_on_4_ranks():
    cases = [("llama", {"pp": 2, "tp": 2}, "zb-h1", {}),
             ("llama", {"pp": 2, "tp": 2}, "zb-v", {"stages_per_device": 2, "placement": "v"}),
             ("llama", {"pp": 1, "tp": 2, "dp_shard": 2}, "1f1b", {}),
             ("llama", {"pp": 1, "tp": 2, "dp_replicate": 2}, "1f1b", {}),
             ("qwen3_moe", {"pp": 2, "tp": 2}, "1f1b", {}),
             # the embedding (a masked partial sum) sent on and read by a norm on the sequence shard at once
             ("falcon", {"pp": 2, "tp": 2}, "1f1b", {}),
             ("llama", {"pp": 2, "tp": 2}, "1f1b", {"offload": True})]
    runs, labels = zip(*(_run(n, m, s, **kw) for n, m, s, kw in cases))
    res = spawn_train_many(list(runs), world_size=4, timeout_s=1500)
    _check(res, labels, runs)
    assert all(not v for v in res[0].meta["fused_full_backward"].values())  # ZB-H1 ran its split backward
    zbv = res[1]  # ZB-V: two stages per rank, backward-input (I) and backward-weight (W) on every rank
    assert all(any("I" in a for a in zbv.meta["actions"][r]) for r in range(4))
    assert [zbv.meta["fused_full_backward"][s] for s in (1, 2, 3)] == [False] * 3


#: zoo models of every kind at tp=2 on 2 ranks, each for what it exercises: a tied embedding and output with GPT-2's
#: fused QKV rejected (gpt2), biases and an MLM head (bert), an encoder-decoder (t5), 17 tokens, no sequence
#: parallelism (vit), an embedding read by three domains (olmo2: q / k rejected at their full-width norm), a 1-D
#: weight meeting the sequence shard (cohere), an in-place add on a region's output (blip), MoE experts replicated
#: (mixtral), a state-space model (mamba), convolutions and a classifier (resnet)
ZOO_TP2 = ("gpt2", "bert", "t5", "vit", "olmo2", "cohere", "blip", "mixtral", "mamba", "resnet")


@pytest.mark.slow
def test_zoo_models_at_tp2_on_2_ranks():
    runs, labels = zip(*(_run(n, {"pp": 1, "tp": 2}, "1f1b") for n in ZOO_TP2))
    res = spawn_train_many(list(runs), world_size=2, timeout_s=1500)
    _check(res, labels, runs)


@pytest.mark.slow
def test_pp2_tp2_dp_shard2_on_8_ranks():
    run, label = _run("llama", {"pp": 2, "tp": 2, "dp_shard": 2}, "1f1b")
    res = spawn_train_many([run], world_size=8, timeout_s=1200)
    _check(res, [label], [run])


@pytest.mark.slow
def test_dcp_checkpoint_saved_at_tp2_resumes_at_tp1(tmp_path):
    pytest.importorskip("safetensors")
    from fxpipe.cli.plan_cmd import HFFactory

    from _torchrun import json_lines, torchrun

    config = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 96, "num_hidden_layers": 2}
    fac = HFFactory("llama", config, microbatches=GLOBAL_MB, microbatch_size=1, seq_len=8, seed=0)
    model, args, kwargs = fac.one_microbatch()
    plans = {}
    for key, mesh in (("plan_a", {"pp": 2, "tp": 2}), ("plan_b", {"pp": 2, "dp_shard": 2})):
        plan = fxpipe.compile(model, args, kwargs, devices=4, microbatches=GLOBAL_MB, mesh=mesh, schedule="1f1b",
                              time_limit_s=0.3, seed=0)
        plans[key] = str(plan.save(tmp_path / f"{key}.plan.json"))
    spec = {"arch": "llama", "config": config, "seq_len": 8, "lr": 0.01, "save_at": 2, "steps": 4,
            "checkpoint": str(tmp_path / "ckpt"), **plans}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = torchrun(4, Path(__file__).with_name("_dcp_worker.py"), str(tmp_path / "spec.json"), timeout_s=900)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json_lines(run.stdout)

    def global_losses(name):  # the mean over the last stages of the replicas (tp ranks report the same losses)
        got = [r["losses"] for r in rows if r["run"] == name]
        assert got, name
        return torch.tensor(got, dtype=torch.float64).mean(0)

    straight = global_losses("straight")
    assert straight.shape == (4,) and len(set(straight.tolist())) == 4
    torch.testing.assert_close(global_losses("resumed"), straight[2:], rtol=1e-6, atol=0)  # tp=2 -> tp=2
    torch.testing.assert_close(global_losses("resharded"), straight[2:], rtol=1e-5, atol=0)  # tp=2 -> tp=1
    from fxpipe.codegen.checkpoint import latest_state_dir

    doc = json.loads((latest_state_dir(tmp_path / "ckpt") / "fxpipe_state.json").read_text())
    assert doc["mesh"]["tp"] == 2 and doc["step"] == 2


@pytest.mark.slow
def test_cli_tp_plan_trains_with_torchrun_from_a_safetensors_checkpoint(tmp_path):
    pytest.importorskip("safetensors")
    from fxpipe.cli.plan_cmd import HFFactory

    from _torchrun import fxpipe_cli, train_example_from_checkpoint

    config = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 96, "num_hidden_layers": 2}
    common = ["--hf", "llama", "--config", *[f"{k}={v}" for k, v in config.items()], "--seq-len", "8"]
    plan_file = tmp_path / "tp.plan.json"
    out = fxpipe_cli("plan", *common, "--mesh", "pp=2,tp=2", "--microbatches", str(GLOBAL_MB), "--schedule", "1f1b",
                     "--time-limit", "0.3", "--out", str(plan_file), "--run", "--steps", "2", "--lr", "0.05", "--json",
                     timeout_s=900)
    assert out.returncode == 0, out.stderr[-4000:]
    doc = json.loads(out.stdout)
    assert doc["run"]["ok"] and doc["plan"]["mesh"]["tp"] == 2 and not any("not modelled" in w for w in doc["warnings"])
    whole, _ = HFFactory("llama", config, microbatches=GLOBAL_MB, microbatch_size=1, seq_len=8, seed=0)()
    lines = train_example_from_checkpoint(4, plan_file, whole, tmp_path, *common, "--steps", "2", "--lr", "0.05")
    lines.sort(key=lambda d: d["rank"])
    assert [d["rank"] for d in lines] == [2, 3]  # the last stage's two tensor-parallel ranks
    torch.testing.assert_close(torch.tensor(lines[0]["losses"]), torch.tensor(doc["run"]["reference_losses"]),
                               rtol=1e-6, atol=0)
    assert lines[0]["losses"] == lines[1]["losses"]
