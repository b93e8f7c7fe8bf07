"""A model built on ``meta`` builds and trains from the README's ``plan.build(rank, model=meta_model, ...)``
(issue 17, item 4).

``plan.build`` infers each stage's boundary shapes from zero example inputs on CPU while the
stages' parameters are still on ``meta`` (each rank materializes only its own stages, after shape
inference), and a graph captured on ``meta`` names the meta device in its ``_assert_tensor_metadata``
checks. Shape inference runs every tensor as a fake tensor on one device, meta device literals read
as that device; before, it failed on the first op mixing CPU inputs and meta weights and fell back to
a real run, which cannot run on meta weights.

A tiny transformers Swin (window attention, patch merging, 2-D ``addmm`` classifier) and an
inception-style DAG (four parallel branches concatenated, twice) are planned on meta for 2 ranks;
both ranks build them on meta and materialize their stages, Swin from the initializers under a seed,
the inception net from a safetensors checkpoint; 2 SGD steps equal single-process training of the
same weights.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.codegen.compare import compare_training  # noqa: E402
from fxpipe.codegen.launch import TrainResult, reference_train  # noqa: E402
from fxpipe.codegen.materialize import MetaInit  # noqa: E402
from fxpipe.codegen.rank import example_inputs_from_gm  # noqa: E402
from fxpipe.codegen.shapes import stage_io  # noqa: E402
from fxpipe.codegen.split import split_stages  # noqa: E402
from fxpipe.dynamo.local import run_local  # noqa: E402

import _meta_models as mm  # noqa: E402

STEPS, LR = 2, 0.1


def _meta_plan(name: str):
    make, _ = mm.META_MODELS[name]
    with torch.device("meta"):
        model, example = make()
    return fxpipe.compile(model, example.args, example.kwargs, devices=2, microbatches=mm.MICROBATCHES,
                          time_limit_s=0.3, name=name)


def test_stage_shapes_of_a_meta_model_from_cpu_inputs_are_static_and_exact():
    """Meta weights, CPU example inputs (what ``plan.build`` passes): fake inference succeeds and
    gives the shapes the same model gives with real weights."""
    plan = _meta_plan("inception")
    gm = plan.captured().gm
    assert any(p.is_meta for p in gm.parameters())
    staged = split_stages(gm, plan.stage_of, 2)
    flat = staged.interface.example_inputs(example_inputs_from_gm(gm))
    assert all(t.device.type == "cpu" for t in flat)
    real_model, example = mm.make_inception()
    real_plan = fxpipe.compile(real_model, example.args, example.kwargs, devices=2, microbatches=mm.MICROBATCHES,
                               time_limit_s=0.3)
    real_staged = split_stages(real_plan.captured().gm, plan.stage_of, 2)
    for s in range(2):
        got = stage_io(staged, s, flat)
        want = stage_io(real_staged, s, flat)
        assert got.static
        for a, b in zip(got.inputs + got.outputs, want.inputs + want.outputs, strict=True):
            assert (a.shape, a.dtype, a.requires_grad) == (b.shape, b.dtype, b.requires_grad)
    assert all(p.is_meta for p in gm.parameters())  # shape inference materialized nothing


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from safetensors.torch import save_model

    tmp = tmp_path_factory.mktemp("meta_build")
    ckpt = str(tmp / "inception.safetensors")
    whole, _ = MetaInit(mm.make_inception, seed=7)()
    save_model(whole, ckpt)
    runs, refs = [], {}
    for name, state, ref_model in (("swin", {"seed": 3}, MetaInit(mm.make_swin, seed=3)),
                                   ("inception", {"checkpoint": ckpt}, MetaInit(mm.make_inception, checkpoint=ckpt))):
        runs.append((name, str(_meta_plan(name).save(tmp / f"{name}.json")), state))
        refs[name] = reference_train(ref_model, mm.META_MODELS[name][1], num_microbatches=mm.MICROBATCHES,
                                     steps=STEPS, lr=LR, loss=mm.class_loss)
    per_rank = run_local(mm.train_meta_build, 2, args=(runs, STEPS, LR), timeout_s=600)
    return per_rank, refs


@pytest.mark.parametrize("name", ["swin", "inception"])
def test_meta_build_trains_like_one_process(trained, name):
    per_rank, refs = trained
    ref = refs[name]
    losses, grads, params, buffers = [], {}, {}, {}
    for r in per_rank:
        got = r[name]
        losses = got["losses"] or losses
        grads.update({n: None if g is None else torch.tensor(g) for n, g in got["grads"].items()})
        params.update({n: torch.tensor(p) for n, p in got["params"].items()})
        buffers.update({n: torch.tensor(b, dtype=getattr(torch, d.split(".")[1])) for n, (b, d) in got["buffers"].items()})
        assert 0 < got["held_param_bytes"] < sum(p.numel() * 4 for p in ref.params.values())  # only its stage
    cmp = compare_training(TrainResult(losses, grads, params, buffers), ref)
    assert cmp.ok, cmp.summary()
    assert ref.losses[1] != ref.losses[0]  # the update moved the weights: the comparison can fail
