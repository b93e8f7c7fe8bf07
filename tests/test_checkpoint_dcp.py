"""Training-state checkpoints of pipeline x data-parallel jobs (issue 18, item 5): DCP with safetensors.

A tiny GPT-2 planned as pp=2 x dp_shard=2 (FSDP2) trains with AdamW on 4 gloo ranks under
torchrun, saves after 2 steps and trains on. From other weights and a wrong learning rate,
the same plan and a 4-stage pure pipeline (another partition, no sharding) load the checkpoint
and resume: their losses must be those of the uninterrupted run. The files must be
safetensors and JSON, the model consolidated under the original names.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import fxpipe  # noqa: E402
from fxpipe.cli.plan_cmd import HFFactory  # noqa: E402
from fxpipe.errors import InputError  # noqa: E402

from _torchrun import json_lines, torchrun  # noqa: E402

GPT2 = {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 32, "n_positions": 16}
MB = 8


def _plan(devices, mesh, **kw):
    fac = HFFactory("gpt2", GPT2, microbatches=MB, microbatch_size=1, seq_len=4, seed=0)
    model, args, kwargs = fac.one_microbatch()
    return fxpipe.compile(model, args, kwargs, devices=devices, microbatches=MB, mesh=mesh, time_limit_s=0.5, seed=0, **kw)


def test_load_and_save_need_a_process_group_and_a_checkpoint(tmp_path):
    from fxpipe.codegen.checkpoint import _read_state, load_training_state, save_training_state

    with pytest.raises(InputError, match="init_process_group"):
        save_training_state(tmp_path / "c", schedule=None)
    with pytest.raises(InputError, match="init_process_group"):
        load_training_state(tmp_path / "c", schedule=None)
    with pytest.raises(InputError, match="not a training-state checkpoint"):
        _read_state(tmp_path)
    (tmp_path / "fxpipe_state.json").write_text(json.dumps({"format": "other/1"}))
    with pytest.raises(InputError, match="field 'format' is 'other/1', allowed: 'fxpipe.trainstate/1'"):
        _read_state(tmp_path)


def test_missing_safetensors_is_named_and_only_numeric_settings_are_restored(monkeypatch):
    import sys

    from fxpipe.codegen.checkpoint import _is_number_setting, _require_safetensors

    monkeypatch.setitem(sys.modules, "safetensors", None)  # import fails as if not installed
    with pytest.raises(InputError, match=r"fxpipe\[checkpoint\]"):
        _require_safetensors()
    assert _is_number_setting(0.01) and _is_number_setting((0.9, 0.999)) and _is_number_setting(0)
    assert not any(_is_number_setting(v) for v in (True, None, "x", (True, False)))  # foreach, fused, ...


@pytest.mark.slow
def test_fsdp_pipeline_saves_and_resumes_on_the_same_and_another_plan(tmp_path):
    from safetensors.torch import load_file

    a = _plan(4, {"pp": 2, "dp_shard": 2}, schedule="1f1b")
    b = _plan(4, {"pp": 4}, schedule="zb-h1")
    assert a.stage_of != b.stage_of
    spec = {"arch": "gpt2", "config": GPT2, "seq_len": 4, "lr": 0.01, "save_at": 2, "steps": 4,
            "plan_a": str(a.save(tmp_path / "a.plan.json")), "plan_b": str(b.save(tmp_path / "b.plan.json")),
            "checkpoint": str(tmp_path / "ckpt")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = torchrun(4, Path(__file__).with_name("_dcp_worker.py"), str(tmp_path / "spec.json"), timeout_s=500)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json_lines(run.stdout)

    def global_losses(name):  # the mean over the replicas' last stages (equal micro-batch counts)
        got = [r["losses"] for r in rows if r["run"] == name]
        assert got, name
        return torch.tensor(got, dtype=torch.float64).mean(0)

    straight = global_losses("straight")
    assert straight.shape == (4,) and len(set(straight.tolist())) == 4
    torch.testing.assert_close(global_losses("resumed"), straight[2:], rtol=1e-6, atol=0)
    torch.testing.assert_close(global_losses("resharded"), straight[2:], rtol=1e-5, atol=0)
    assert {r["step"] for r in rows if r["run"] != "straight"} == {2}
    # the layout: safetensors and JSON only, the model consolidated under the model's own names
    from fxpipe.codegen.checkpoint import latest_state_dir

    ckpt = Path(spec["checkpoint"])
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    assert files and all(p.suffix in (".safetensors", ".json") for p in files), files
    version = latest_state_dir(ckpt)
    assert [p for p in ckpt.iterdir() if p.is_dir()] == [version]  # one version, committed by the pointer
    doc = json.loads((version / "fxpipe_state.json").read_text())
    assert doc["step"] == 2 and doc["mesh"] == {"pp": 2, "dp_shard": 2, "dp_replicate": 1}
    assert doc["param_groups"]["model.transformer.wte.weight"]["lr"] == 0.01  # the names of the module compiled
    model, _, _ = HFFactory("gpt2", GPT2, microbatches=MB, microbatch_size=1, seq_len=4, seed=0).one_microbatch()
    saved = {}
    for f in (version / "model").glob("*.safetensors"):
        saved.update(load_file(str(f)))
    params = dict(model.named_parameters())
    assert set(params) <= set(saved), set(params) - set(saved)
    assert all(saved[k].shape == p.shape for k, p in params.items())
    assert not all(torch.equal(saved[k], p.detach()) for k, p in params.items())  # trained, not the initial weights
    assert not list(tmp_path.glob(".ckpt.*"))  # no leftovers next to it
