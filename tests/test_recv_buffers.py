"""Receive-buffer reuse (issue 19, item 2): what step() returns stays the model's output.

The last stage returns a hidden state it received unchanged: its outputs are views of its
receive buffers, so pooling them across micro-batches would overwrite the earlier micro-batches'
returned values before step() merges them (found in review). Training equality with reuse is
checked by the multi-rank training tests (tests/test_codegen_pipeline.py reports the buffers).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.launcher import launch  # noqa: E402

from _recv_workers import ReturnsHidden, step_outputs  # noqa: E402


def test_outputs_received_unchanged_by_the_last_stage_survive_buffer_reuse(tmp_path):
    model = ReturnsHidden.make()
    plan = fxpipe.compile(model, (torch.randn(2, 8),), devices=2, microbatches=4, schedule="1f1b", time_limit_s=2.0, mesh="pipeline")
    path = str(plan.save(tmp_path / "p.json"))
    out = [r for r in launch(step_outputs, 2, args=(path,), timeout_s=300) if r]
    assert len(out) == 1
    assert out[0]["y"] == 0.0 and out[0]["h"] == 0.0, out
