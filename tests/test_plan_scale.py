"""fxpipe.compile on a deep layer stack: replicated capture, a search that stops with a proof,
and no stage holding only trivial ops (issue 13), on a small-width 20-layer Llama."""

from __future__ import annotations

import numpy as np
import pytest

import fxpipe
from fxpipe.models import build_hf_model

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def deep_llama():
    return build_hf_model("llama", {"num_hidden_layers": 20, "seq_len": 64}, device="meta")


@pytest.mark.parametrize("devices", [8, 16, 24])
def test_compile_deep_model_is_proven_and_uses_every_stage(deep_llama, devices):
    model, args, kwargs = deep_llama
    plan = fxpipe.compile(model, args, kwargs, devices=devices, microbatches=2 * devices, time_limit_s=30.0, mesh="pipeline")
    part, g = plan.partition, plan.graph
    assert plan._captured.captured.replication is not None  # 20 >= 16 identical layers
    assert {"capture", "cost", "export", "partition", "schedule"} <= set(plan.timings_s)
    assert part.meta["lower_bound_method"] == "chain"
    if devices <= 16:  # at least one layer per stage: the chain DP is exact
        assert part.meta["proven_optimal"] and part.meta["stop_reason"] == "bound"
        assert part.bottleneck <= part.meta["lower_bound_s"] * (1 + 1e-6)
    else:  # stages smaller than the preamble segment, which is cut at program-order prefixes only
        assert part.meta["gap"] < 1e-3
    assert plan.timings_s["partition"] < 30.0
    work = np.bincount(part.assignment, weights=g.work_s("training"), minlength=devices)
    assert (work > 0).all(), "a stage holds only views / the output node, or nothing"
    out = g.ops.index("output")
    assert part.assignment[out] == devices - 1
    logits = [u for u in g.predecessors(out)]
    assert all(part.assignment[u] == devices - 1 for u in logits)  # the output never receives the logits alone


def test_llama3_70b_for_64_devices_is_proven_with_no_trivial_stage():
    """Issue 13's headline case (meta device, nothing allocated): 80 identical layers are
    replicated, the chain DP proves the partition optimal, every stage holds work and the
    output node sits with the logits' producer (the previous search left an ``alias`` and
    the ``output`` node alone on stages at this k, with the same bottleneck)."""
    model, args, kwargs = build_hf_model("llama-3-70b", {"seq_len": 4096}, device="meta")
    plan = fxpipe.compile(model, args, kwargs, devices=64, microbatches=8, time_limit_s=60.0, mesh="pipeline")
    part, g = plan.partition, plan.graph
    assert plan._captured.captured.replication["layers"] == 80
    assert g.n > 80 * 50  # every layer is in the graph (no third-party op count pinned here)
    assert part.meta["proven_optimal"] and part.meta["lower_bound_method"] == "chain"
    assert part.bottleneck <= part.meta["lower_bound_s"] * (1 + 1e-6)
    work = np.bincount(part.assignment, weights=g.work_s("training"), minlength=64)
    assert (work > 0).all()
    out = g.ops.index("output")
    assert all(part.assignment[u] == part.assignment[out] == 63 for u in g.predecessors(out))
