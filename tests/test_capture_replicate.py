"""Replicated capture (fxpipe.passes.replicate) equals the full export.

Exporting three layers and replicating the middle one must give the graph a full
``torch.export`` gives: the same fx nodes (names, ops, targets), the same OpGraph (edges,
every cost, module paths) and a module that computes and trains exactly like the model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fxpipe.models import build_hf_model
from fxpipe.passes import AnnotateCosts, capture, to_opgraph, trace_model
from fxpipe.passes.replicate import find_layer_stack, per_layer_settings_vary

pytestmark = pytest.mark.filterwarnings("ignore")

CASES = {
    "llama": dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=128, seq_len=8, batch_size=2),
    "gpt2": dict(n_layer=5, n_embd=64, n_head=2, vocab_size=128, n_positions=64, seq_len=8, batch_size=2,
                 bos_token_id=0, eos_token_id=0),
    "mixtral": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=96, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
                    seq_len=8, batch_size=2),
}

FIELDS = ("t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s", "size_out_bytes", "size_param_bytes", "act_bytes")


@pytest.mark.parametrize("arch", sorted(CASES))
def test_replicated_capture_equals_full_export(arch):
    model, args, kwargs = build_hf_model(arch, CASES[arch])
    full = capture(model, args, kwargs, replicate="never")
    rep = capture(model, args, kwargs, replicate="always")
    assert full.replication is None
    assert rep.replication is not None and rep.replication["layers"] == len(find_layer_stack(model)[1])
    fx_full = [(n.name, n.op, str(n.target)) for n in full.gm.graph.nodes]
    fx_rep = [(n.name, n.op, str(n.target)) for n in rep.gm.graph.nodes]
    assert fx_rep == fx_full
    for c in (full, rep):
        AnnotateCosts("h100-sxm", torch.bfloat16)(c.gm)
    assert rep.gm.meta["fxpipe_param_owner"] == full.gm.meta["fxpipe_param_owner"]
    g_full, _ = to_opgraph(full.gm)
    g_rep, _ = to_opgraph(rep.gm)
    assert g_rep.names == g_full.names and g_rep.ops == g_full.ops
    np.testing.assert_array_equal(g_rep.edges, g_full.edges)
    for f in FIELDS:
        np.testing.assert_array_equal(getattr(g_rep, f), getattr(g_full, f), err_msg=f)
    assert list(g_rep.extra) == list(g_full.extra)
    # it computes and trains like the model, on the model's own parameters
    with torch.no_grad():
        torch.testing.assert_close(rep.gm(*args, **kwargs), model(*args, **kwargs), rtol=0, atol=0)
    model_params = {id(p) for p in model.parameters()}
    assert {id(p) for p in rep.gm.parameters()} == model_params
    rep.gm.zero_grad(set_to_none=True)
    rep.gm(*args, **kwargs).float().pow(2).mean().backward()
    grads_rep = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model(*args, **kwargs).float().pow(2).mean().backward()
    grads_ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads_rep) == set(grads_ref)
    for n in grads_ref:
        torch.testing.assert_close(grads_rep[n], grads_ref[n], rtol=1e-6, atol=1e-7)


def test_meta_device_deep_model_replicates_in_trace_model():
    model, args, kwargs = build_hf_model("llama", dict(num_hidden_layers=20, seq_len=16), device="meta")
    tm = trace_model(model, args, kwargs, hardware="h100-sxm")  # replicate="auto": 20 >= 16 layers
    assert tm.captured.replication is not None and tm.captured.replication["layers"] == 20
    full = trace_model(model, args, kwargs, hardware="h100-sxm", replicate="never")
    assert tm.graph.names == full.graph.names
    for f in FIELDS:
        np.testing.assert_array_equal(getattr(tm.graph, f), getattr(full.graph, f))
    assert tm.timings["replication"] == tm.captured.replication


class _Block(torch.nn.Module):
    def __init__(self, idx: int):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.layer_idx = idx

    def forward(self, x):
        x = self.lin(x)
        if self.layer_idx % 2:  # a layer-dependent branch that the structure does not show
            x = torch.relu(x)
        return x


class _Stack(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(i) for i in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_layers_that_trace_differently_fall_back_to_the_full_export():
    model = _Stack(6)
    x = torch.randn(2, 8)
    cap = capture(model, (x,), replicate="always")
    assert cap.replication is None  # exported layers 0, 3, 5: layer 0 has no relu, refused
    full = capture(model, (x,), replicate="never")
    assert [n.name for n in cap.gm.graph.nodes] == [n.name for n in full.gm.graph.nodes]
    assert len(model.layers) == 6  # the model is restored


def test_per_layer_settings_block_replication():
    class Cfg:
        def __init__(self, kinds):
            self.layer_types = kinds

    assert per_layer_settings_vary([Cfg(["full"] * 5)], 5) is None
    assert per_layer_settings_vary([Cfg(["full", "sliding"] * 2 + ["full"])], 5) == "layer_types"


def test_bad_replicate_mode_is_a_capture_error():
    from fxpipe.errors import CaptureError

    with pytest.raises(CaptureError, match="replicate"):
        capture(_Stack(4), (torch.randn(2, 8),), replicate="sometimes")


def test_replicated_module_splits_into_runnable_stages():
    """codegen's split of the replicated module composes to the model (what Plan.build runs)."""
    from fxpipe.codegen.split import split_stages
    from fxpipe.partition.search import partition

    model, args, kwargs = build_hf_model("llama", CASES["llama"])
    tm = trace_model(model, args, kwargs, hardware="h100-sxm", replicate="always")
    assert tm.captured.replication is not None
    part = partition(tm.graph, 3, objective="training", comm="relay", time_limit_s=5)
    stage_of = {tm.graph.names[i]: int(part.assignment[i]) for i in range(tm.graph.n)}
    staged = split_stages(tm.gm, stage_of, 3)
    with torch.no_grad():
        torch.testing.assert_close(staged.run(*args), model(*args, **kwargs), rtol=0, atol=0)
