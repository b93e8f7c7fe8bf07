"""The runtime executes a planned activation-checkpoint policy, measured against the model (issue 28, items 5-6).

* The policy's file form round-trips and bad input is refused with an InputError naming the field.
* Carving segments into a stage program is reversible and leaves the stage's state alone; a replay
  leaves the state its forward updates (BatchNorm's running statistics) as the forward did.
* Measured against the model: one micro-batch of every stage of a Llama, a T5 and a ViT from the
  zoo, under every policy kind, run in this process under the stash's saved-tensor hooks: the
  bytes the forward leaves saved (unique storages) and the replayed bytes the backward holds at
  once are within 10 % of :func:`fxpipe.memory.checkpoint.predict_checkpoint_bytes` (they agree
  exactly today), and the parameter gradients equal those without a policy bit for bit.
* On 2 gloo ranks a Llama trains under every policy kind to the single-process result: ``"full"``
  under 1F1B, ``"selective"`` under ZB-H1 with every backward split into B and W (the W of a
  checkpointed segment finds what it needs: each segment replays once per micro-batch), ``"budget"``
  with every stash offloaded to host memory and reloaded, ``"stage"`` (whole-stage recomputation).
* Slow: on 4 gloo ranks a Llama and a ViT as pp=2 x dp_shard=2 (FSDP2) under ``"full"`` and
  ``"selective"`` (ZB-H1 split backward for one of them), a Llama as pp=2 x dp_replicate=2, and a
  Llama with ``compile_stages=True`` (Inductor honours the segments as recompute tags) train
  like one process.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.codegen.checkpointing import CheckpointSegment, apply_checkpoint, captured_policies  # noqa: E402
from fxpipe.codegen.stash import measure_stage  # noqa: E402
from fxpipe.codegen.launch import reference_train, spawn_train_many  # noqa: E402
from fxpipe.codegen.offload import offload_all  # noqa: E402
from fxpipe.codegen.split import split_stages  # noqa: E402
from fxpipe.errors import InputError  # noqa: E402
from fxpipe.memory.checkpoint import CHECKPOINT_KINDS, CheckpointPolicy, predict_checkpoint_bytes  # noqa: E402
from fxpipe.plan.build import captured_checkpointing  # noqa: E402
from fxpipe.testing import zoo  # noqa: E402
from fxpipe.testing.checkpoint_policies import policies, policy, stage_nodes  # noqa: E402
from helpers import assert_same_training  # noqa: E402

M = 4
STEPS, LR = 2, 0.1
_PLANS: dict = {}


def _plan(name: str, devices: int = 2, mesh="pipeline", microbatches: int = M):
    key = (name, devices, str(mesh), microbatches)
    if key not in _PLANS:
        zm = zoo.get(name, microbatches=microbatches)
        model, args, kwargs = zm.one_microbatch()
        _PLANS[key] = (zm, fxpipe.compile(model, args, kwargs, devices=devices, microbatches=microbatches,
                                          time_limit_s=0.5, name=name, mesh=mesh, schedule="1f1b", seed=0))
    return _PLANS[key]


# ----------------------------------------------------------------------------- the policy's data
def test_policy_file_form_round_trips_and_refuses_bad_input():
    p = CheckpointPolicy("selective", segments=(("a", "b"), ("c",)), save=("b",), replay_s=1e-3, kept_bytes=10.0)
    assert CheckpointPolicy.from_dict(p.to_dict()) == p
    assert set(CHECKPOINT_KINDS) == {"none", "full", "selective", "budget", "stage"}
    bad = [({"kind": "some"}, "kind"), ({"kind": "full", "segments": [["a"], ["a"]]}, "disjoint"),
           ({"kind": "full", "segments": [["a"]], "save": ["z"]}, "save"),
           ({"kind": "full", "segments": "a"}, "segments"), ({"kind": "full", "kept_bytes": -1}, "kept_bytes"),
           ({"kind": "none", "segments": [["a"]]}, "none")]
    for doc, what in bad:
        with pytest.raises(InputError, match=what) as exc:
            CheckpointPolicy.from_dict(doc, source="plan.json")
        assert "plan.json" in str(exc.value)
    with pytest.raises(InputError, match="2 policies for 3 stages"):
        captured_policies([p, p], 3)
    # another capture's names (structural matching): segments follow, unmatched trivial nodes drop out
    (q,) = captured_policies([p], 1, {"a": "x_1", "b": "y_1"})
    assert q.segments == (("x_1", "y_1"),) and q.save == ("y_1",) and q.kept_bytes == p.kept_bytes
    with pytest.raises(InputError, match="lacks"):
        captured_policies([p], 1, {"a": "x_1"})


class _Stop(Exception):
    pass


def test_plan_build_and_train_local_hand_the_plan_policies_to_the_runtime(monkeypatch):
    """``plan.activation_checkpointing`` (plan names) reaches the rank builder in the capture's names, and the
    workers of ``train_local`` (which map it to their own captures by structure)."""
    import fxpipe.codegen as codegen
    import fxpipe.codegen.launch as launch
    from fxpipe.plan.build import build_rank

    zm, plan = _plan("llama")
    pols = policies(plan, "selective")
    seen = {}

    def grab(*args, **kwargs):
        seen.update(kwargs, args=args)
        raise _Stop

    monkeypatch.setattr(codegen, "build_pipeline_rank", grab)
    with pytest.raises(_Stop):
        build_rank(plan, 0, activation_checkpointing=pols)
    names = set(plan.captured_stage_of())
    got = seen["activation_checkpointing"]
    assert [p.kind for p in got] == ["selective"] * plan.num_stages
    assert all(n in names for p in got for seg in p.segments for n in seg) and all(p.save for p in got)
    object.__setattr__(plan, "activation_checkpointing", pols)  # as h-28plan's plans carry it
    try:
        monkeypatch.setattr(launch, "spawn_train_many", grab)
        with pytest.raises(_Stop):
            plan.train_local(zm, zm.batch, loss=zm.loss)
        (run,) = seen["args"][0]
        assert run["activation_checkpointing"] is pols and run["stage_of"].structure is not None
    finally:
        object.__delattr__(plan, "activation_checkpointing")


def test_carving_is_reversible_and_shares_the_stage_state():
    zm, plan = _plan("llama")
    staged = split_stages(plan.capture.traced.gm, plan.captured_stage_of(), plan.num_stages)
    pols = captured_checkpointing(plan, plan.capture.traced, policies(plan, "selective"))
    mod = staged.stages[0].module
    before = mod.code
    state = {k: id(v) for k, v in list(mod.named_parameters()) + list(mod.named_buffers())}
    carved = apply_checkpoint(mod, pols[0], 0)
    assert carved.pieces and all(isinstance(mod.get_submodule(n), CheckpointSegment) for n in carved.pieces)
    kept = set(pols[0].save)
    assert kept and kept == set().union(*(mod.get_submodule(n).save for n in carved.pieces))
    assert not list(mod.get_submodule(carved.pieces[0]).parameters())  # parameters come in as inputs
    assert {k: id(v) for k, v in list(mod.named_parameters()) + list(mod.named_buffers())} == state
    assert apply_checkpoint(mod, pols[0], 0).pieces == carved.pieces  # idempotent
    apply_checkpoint(mod, None, 0)
    assert mod.code == before and not any(isinstance(m, CheckpointSegment) for m in mod.modules())
    with pytest.raises(InputError, match="another capture"):
        apply_checkpoint(mod, CheckpointPolicy("full", segments=(("no_such_node",),)), 0)


# ----------------------------------------------------------------------------- measured against the model
@pytest.mark.parametrize("name", ["llama", pytest.param("t5", marks=pytest.mark.slow),
                                  pytest.param("vit", marks=pytest.mark.slow)])
def test_measured_kept_and_replay_bytes_match_the_prediction(name):
    zm, plan = _plan(name)
    traced = plan.capture.traced
    _, args, kwargs = zm.one_microbatch()
    staged = split_stages(traced.gm, plan.captured_stage_of(), plan.num_stages)
    inputs = [staged.stage_inputs(s, *args, **kwargs) for s in range(plan.num_stages)]
    plain = [measure_stage(staged, s, None, inputs[s]) for s in range(plan.num_stages)]
    rows = []
    for kind in CHECKPOINT_KINDS:
        pols = policies(plan, kind)
        here = captured_checkpointing(plan, traced, pols)
        for s in range(plan.num_stages):
            got = measure_stage(staged, s, here[s], inputs[s])
            kept, peak = predict_checkpoint_bytes(plan.graph, stage_nodes(plan, s), pols[s])
            rows.append((kind, s, got["kept_bytes"], kept, got["replay_peak_bytes"], peak))
            for fqn, g in plain[s]["grads"].items():  # numerics: the replay recomputes exactly
                assert (g is None) == (got["grads"][fqn] is None), (kind, s, fqn)
                if g is not None:
                    assert torch.equal(g, got["grads"][fqn]), (kind, s, fqn)
            if kind in ("full", "selective", "budget"):
                assert got["pieces"] and got["replays"] >= 1, (kind, s, got["pieces"])
            if kind == "stage":
                assert got["kept_bytes"] == 0 and got["replays"] == 1
    for kind, s, kept_m, kept_p, peak_m, peak_p in rows:
        assert kept_m == pytest.approx(kept_p, rel=0.1), (name, kind, s, rows)
        assert peak_m == pytest.approx(peak_p, rel=0.1, abs=1.0), (name, kind, s, rows)
    by = {(k, s): (km, pm) for k, s, km, _, pm, _ in rows}
    for s in range(plan.num_stages):  # the policies do what they are for
        assert by[("full", s)][0] < by[("selective", s)][0] < by[("none", s)][0], (s, by)
        assert by[("full", s)][1] < by[("stage", s)][1], (s, by)


def test_replay_restores_the_state_the_forward_updates():
    """BatchNorm in training mode updates its running statistics in the forward: a segment's replay runs with
    them set back to their value before the forward and leaves them as the forward did (gradients and buffers
    equal those without a policy)."""
    zm, plan = _plan("batchnorm")
    traced = plan.capture.traced
    _, args, kwargs = zm.one_microbatch()
    staged = split_stages(traced.gm, plan.captured_stage_of(), plan.num_stages)
    # the planner finds no repeated block around the BatchNorms (its stacks need compute per index): the
    # whole stage is the replayed segment there
    pols = captured_checkpointing(plan, traced, [p if p.kind != "none" else policy(plan, s, "stage")
                                                 for s, p in enumerate(policies(plan, "full"))])
    for s in range(plan.num_stages):
        ins = staged.stage_inputs(s, *args, **kwargs)
        bufs = staged.stages[s].named_buffers()
        before = {k: b.clone() for k, b in bufs.items()}
        plain = measure_stage(staged, s, None, ins)
        want = {k: b.clone() for k, b in bufs.items()}
        assert any(not torch.equal(want[k], before[k]) for k in bufs)  # the forward does update them
        for k, b in bufs.items():
            b.copy_(before[k])
        got = measure_stage(staged, s, pols[s], ins)
        assert got["replays"] >= 1, got
        for k in bufs:
            assert torch.equal(bufs[k], want[k]), (s, k)
        for k, g in plain["grads"].items():
            assert (g is None and got["grads"][k] is None) or torch.equal(g, got["grads"][k]), (s, k)


# ----------------------------------------------------------------------------- trains like one process
def _runs(zm, plan, cases, **common):
    return [dict(make_model=zm, make_batch=zm.batch, loss=zm.loss, stage_of=p.worker_stage_of(), orders=orders,
                 num_microbatches=p.global_microbatches, steps=STEPS, lr=LR, model_key=zm.name,
                 activation_checkpointing=policies(p, kind), **common, **extra)
            for kind, p, orders, extra in cases]


def _stats(res) -> dict[int, list[dict]]:
    out: dict[int, list] = {}
    for act in res.meta["activation"].values():
        for s, st in (act or {}).get("stages", {}).items():
            out.setdefault(int(s), []).append(st)
    return out


def test_two_ranks_every_policy_kind_trains_like_one_process():
    zm, plan = _plan("llama")
    zb = plan.reschedule("zb-h1")
    cases = {
        "full 1f1b": ("full", plan, plan.orders(), {}),
        "selective zb-h1 split": ("selective", zb, zb.orders(), {"fuse": False}),
        "budget offload": ("budget", plan, offload_all(plan.orders()), {}),
        "stage": ("stage", plan, plan.orders(), {}),
    }
    results = dict(zip(cases, spawn_train_many(_runs(zm, plan, cases.values()), world_size=2, timeout_s=900)))
    ref = reference_train(zm, zm.batch, num_microbatches=M, steps=STEPS, lr=LR, loss=zm.loss)
    assert ref.losses[1] != ref.losses[0]
    for name, res in results.items():
        assert_same_training(res, ref, name)
    per_mb = STEPS * M
    for name in ("full 1f1b", "selective zb-h1 split", "budget offload"):
        st = _stats(results[name])
        ck = results[name].meta["checkpointing"]
        for s in (0, 1):
            pieces = len(ck[s]["pieces"])
            assert pieces >= 1 and ck[s]["kind"] == cases[name][0], (name, ck)
            # every piece runs once per micro-batch and replays at most once (exactly once where it saves anything)
            assert st[s][0]["segment_runs"] == pieces * per_mb, (name, s, st)
            assert 0 < st[s][0]["replays"] <= st[s][0]["segment_runs"], (name, s, st)
    split = _stats(results["selective zb-h1 split"])[1][0]
    assert results["selective zb-h1 split"].meta["fused_full_backward"][1] is False
    # B drops a replayed tensor once read unless W reads it again: what it leaves is less than one replay
    # (keeping every replayed tensor until W, as a plain retain_graph backward does, would leave them all)
    assert 0 < split["max_w_held_bytes"] < split["max_replay_peak_bytes"], split
    off = _stats(results["budget offload"])[0][0]
    assert off["offloads"] == off["reloads"] == per_mb and off["offloaded_bytes_total"] == per_mb * off["max_microbatch_bytes"]
    whole = _stats(results["stage"])
    assert all(st["recomputes"] == per_mb for s in (0, 1) for st in whole[s])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_four_ranks_llama_and_vit_pp2_dp_shard2_full_and_selective_train_like_one_process():
    shard, repl = {"pp": 2, "dp_shard": 2}, {"pp": 2, "dp_replicate": 2}
    runs, names, refs = [], [], {}
    for model in ("llama", "vit"):
        zm, plan = _plan(model, devices=4, mesh=shard, microbatches=2 * M)
        zb = plan.reschedule("zb-h1")
        cases = [("full", plan, plan.orders(), {"mesh": shard}), ("selective", zb, zb.orders(), {"mesh": shard, "fuse": False})]
        if model == "llama":
            cases.append(("selective", plan, plan.orders(), {"mesh": repl}))
        runs += _runs(zm, plan, cases)
        names += [f"{model} {k} {e['mesh']} {'split' if 'fuse' in e else ''}" for k, _, _, e in cases]
        refs[model] = reference_train(zm, zm.batch, num_microbatches=2 * M, steps=STEPS, lr=LR, loss=zm.loss)
    results = spawn_train_many(runs, world_size=4, timeout_s=1700)
    for name, res in zip(names, results):
        assert_same_training(res, refs[name.split()[0]], name)
        st = _stats(res)
        for s in (0, 1):
            for one in st[s]:  # 2 replicas, 4 micro-batches each: every piece replays at most once per micro-batch
                assert 0 < one["replays"] <= one["segment_runs"], (name, s, one)
                assert one["max_microbatch_bytes"] > 0, (name, s, one)


def _compiled_report(tagged: bool):
    """Gradients and the B/W graph sizes of a small exported MLP compiled by Inductor, with or without
    a "full" segment over all its ops (fxpipe.codegen.checkpointing.tag_for_compile)."""
    from fxpipe.codegen.checkpointing import tag_for_compile
    from fxpipe.codegen.compiled import CompiledStageModule

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                              torch.nn.Linear(64, 16))
    x = torch.randn(4, 16, requires_grad=True)
    gm = torch.export.export(net, (x,)).module()
    names = tuple(n.name for n in gm.graph.nodes if n.op == "call_function")
    assert tag_for_compile(gm, CheckpointPolicy("full", segments=(names,)) if tagged else None) == (len(names) if tagged else 0)
    cm = CompiledStageModule(gm)
    cm(x).square().sum().backward()
    sig = cm.report["signatures"][0]
    return [p.grad for p in gm.parameters()], sig["b_nodes"] + sig["w_nodes"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compiled_stages_take_the_segments_as_recompute_tags():
    plain, plain_nodes = _compiled_report(False)
    tagged, tagged_nodes = _compiled_report(True)
    assert tagged_nodes > plain_nodes  # the backward recomputes the segment's forward ops
    for a, b in zip(plain, tagged):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    zm, plan = _plan("llama")
    cases = [("full", plan, plan.orders(), {"compile_stages": True})]
    res = spawn_train_many(_runs(zm, plan, cases), world_size=2, timeout_s=1700)[0]
    ref = reference_train(zm, zm.batch, num_microbatches=M, steps=STEPS, lr=LR, loss=zm.loss)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    for k, g in ref.grads.items():
        torch.testing.assert_close(res.grads[k], g, rtol=1e-4, atol=1e-6)
    ck = res.meta["checkpointing"]
    assert all("tagged for Inductor" in ck[s]["pieces"][0] for s in (0, 1)), ck
    assert all(v and v.get("signatures") for v in res.meta["compiled_stages"].values())
