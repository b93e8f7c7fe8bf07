"""The torchrun path: a plan saved by the CLI, loaded by every rank, built with Plan.build.

The plan puts 4 stages V-shaped on 2 devices (ZB-V): each rank builds two stages, and rank 0,
which holds the first and the last stage, reads the inputs and reports the losses."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fxpipe.cli.plan_cmd import HFFactory, _BatchFn  # noqa: E402
from fxpipe.codegen.launch import reference_train  # noqa: E402

from _torchrun import TRAIN_EXAMPLE, fxpipe_cli, json_lines, torchrun, train_example_from_checkpoint  # noqa: E402

CONFIG = ["n_layer=4", "n_embd=32", "n_head=2", "vocab_size=64", "n_positions=32"]


@pytest.mark.slow
def test_torchrun_trains_saved_plan_like_single_process(tmp_path):
    plan_file = tmp_path / "gpt2.plan.json"
    common = ["--hf", "gpt2", "--config", *CONFIG, "--seq-len", "8"]
    out = fxpipe_cli("plan", *common, "--devices", "2", "--mesh", "pipeline", "--microbatches", "4", "--stages-per-device", "2", "--placement", "v",
                     "--schedule", "zb-v", "--time-limit", "0.5", "--out", str(plan_file), timeout_s=300)
    assert out.returncode == 0, out.stderr
    run = torchrun(2, TRAIN_EXAMPLE, "--plan", str(plan_file), *common, "--steps", "2", "--lr", "0.05", timeout_s=400)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = json_lines(run.stdout)
    assert len(lines) == 1 and lines[0]["rank"] == 0  # V placement: the last stage is on rank 0
    factory = HFFactory("gpt2", {k: int(v) for k, v in (c.split("=") for c in CONFIG)}, microbatches=4, microbatch_size=1, seq_len=8)
    ref = reference_train(factory, _BatchFn(factory), num_microbatches=4, steps=2, lr=0.05)
    torch.testing.assert_close(torch.tensor(lines[0]["losses"]), torch.tensor(ref.losses), rtol=1e-4, atol=1e-6)

    # the model built on meta, each rank loading only its stages from a safetensors checkpoint of
    # the same weights (plan.build(rank, checkpoint=...)): the same training, less than the model per rank
    pytest.importorskip("safetensors")
    whole, _ = factory()
    lines = train_example_from_checkpoint(2, plan_file, whole, tmp_path, *common, "--steps", "2", "--lr", "0.05")
    assert len(lines) == 1
    torch.testing.assert_close(torch.tensor(lines[0]["losses"]), torch.tensor(ref.losses), rtol=1e-4, atol=1e-6)
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    assert 0 < lines[0]["param_bytes"] < whole_bytes

    # a plan for 2 stages refuses a launch with another world size, with a clear message
    bad = torchrun(1, TRAIN_EXAMPLE, "--plan", str(plan_file), *common, timeout_s=300)
    assert bad.returncode != 0 and "launch 2 processes" in bad.stderr
