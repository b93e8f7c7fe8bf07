"""Cheap constant tensors are recomputed in every layer, not relayed (issue 19, item 3).

:mod:`fxpipe.passes.duplicate_constants` runs in the capture: a tensor built from constants
and buffers only (a causal mask, a rotary table) gets one copy of its ops per layer that reads
it; one built from a model input or a parameter does not. The plan then relays no constant
tensor, and a pipeline trained from it matches one process.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
to_opgraph = __import__("importlib").import_module("fxpipe.passes.to_opgraph")  # the module, not the function
from fxpipe.partition.objective import io_bytes  # noqa: E402
from fxpipe.passes.capture import capture  # noqa: E402
from fxpipe.passes.duplicate_constants import DUPLICATED_KEY, REPORT_KEY, constant_nodes  # noqa: E402

T, D, LAYERS = 2048, 8, 3  # a 4M-element mask: recomputing it costs less than sending it


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, h, mask, table, from_input, from_param, gram):
        scores = (h @ h.transpose(-1, -2)).masked_fill(~mask, -1e4).softmax(-1)
        h = scores @ self.lin(h) * table
        return h + from_input + from_param + gram.sum()


class Decoder(torch.nn.Module):
    """Each layer reads a causal mask and a rotary-like table (constants), a tensor made from
    the input and one made from a parameter, and a buffer's Gram matrix (a matmul)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, D), persistent=False)
        self.register_buffer("basis", torch.randn(4, 4), persistent=False)
        self.scale = torch.nn.Parameter(torch.ones(D))
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x, bias):
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        table = (torch.arange(T).float()[:, None] * self.inv_freq[None, :]).cos()
        from_input = bias.tanh()
        from_param = self.scale.exp()
        gram = self.basis @ self.basis.T
        h = x
        for layer in self.layers:
            h = layer(h, mask, table, from_input, from_param, gram)
        return h


def _inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, T, D, generator=g), torch.randn(D, generator=g))


def _readers(gm, layer_prefix):
    """Per layer: the set of constant-cone nodes (by their origin) that layer's ops read."""
    out = {}
    for n in gm.graph.nodes:
        st = list((n.meta.get("nn_module_stack") or {}).values())
        path = str(st[-1][0]) if st else ""
        if not path.startswith(layer_prefix):
            continue
        out.setdefault(path.split(".")[1], set()).update(n.all_input_nodes)
    return out


def test_constant_tensors_get_a_copy_per_layer_and_the_graph_computes_the_same():
    torch.manual_seed(0)
    model = Decoder()
    args = _inputs()
    before = capture(model, args, replicate="never", duplicate_constants=False).gm
    after = capture(model, args, replicate="never").gm
    report = after.meta[REPORT_KEY]
    assert report["nodes_added"] > 0 and REPORT_KEY not in before.meta
    const_before = {n.name for n in constant_nodes(before)}
    for gm, copied in ((before, False), (after, True)):
        # the nodes from outside the layers that every layer reads
        reads = {layer: {n for n in ins if n.op == "call_function"} for layer, ins in _readers(gm, "layers.").items()}
        assert sorted(reads) == [str(i) for i in range(LAYERS)]
        shared = {str(n.target) for n in set.intersection(*reads.values())}
        # the input- and parameter-dependent tensors and the Gram matrix (a matmul) stay shared
        assert {"aten.tanh.default", "aten.exp.default", "aten.matmul.default"} <= shared
        # the mask (tril) is shared only without the pass; the table (cos, 16K elements made by three kernels)
        # costs more to recompute than to send: it stays shared
        assert ("aten.tril.default" in shared) is not copied and "aten.cos.default" in shared, shared
    # every copy copies a constant of the graph without the pass, for layers 1..L-1 only
    copies = [n for n in after.graph.nodes if DUPLICATED_KEY in n.meta]
    assert copies and all(n.meta[DUPLICATED_KEY] in const_before for n in copies)
    assert {n.name.rsplit("_dup", 1)[1] for n in copies} == {str(i) for i in range(1, LAYERS)}
    assert not {str(n.target) for n in copies} & {"aten.tanh.default", "aten.exp.default", "aten.matmul.default"}
    assert "expensive: a matmul-class op" in report["kept"].values()
    assert any(k.startswith("cos") and v.startswith("expensive") for k, v in report["kept"].items()), report["kept"]
    # same values and gradients as the model itself
    ref = model(*args)
    for gm in (before, after):
        torch.testing.assert_close(gm(*args), ref, rtol=0, atol=0)
    x = args[0].clone().requires_grad_(True)
    after(x, args[1]).square().sum().backward()
    gx = x.grad.clone()
    x.grad = None
    model(x, args[1]).square().sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-6, atol=1e-6)


def _compile(model, args, *, duplicate: bool, devices: int):
    old = to_opgraph.capture
    to_opgraph.capture = functools.partial(capture, duplicate_constants=duplicate)
    try:
        return fxpipe.compile(model, args, devices=devices, microbatches=4, time_limit_s=1.0, seed=0)
    finally:
        to_opgraph.capture = old


def test_plan_relays_no_constant_table_and_its_tables_see_it():
    torch.manual_seed(0)
    model, args = Decoder(), _inputs()
    const_before = {n.name for n in constant_nodes(capture(model, args, duplicate_constants=False).gm)}
    relayed, buffers = {}, {}
    for dup in (False, True):
        plan = _compile(model, args, duplicate=dup, devices=3)
        gm, graph = plan.capture.traced.gm, plan.graph
        # the mask and what it is made of (T x T elements), originals and copies
        big = {n.name for n in gm.graph.nodes if (n.name in const_before or DUPLICATED_KEY in n.meta)
               and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() >= T * T}
        a, k = np.asarray(plan.partition.assignment), plan.problem.num_stages
        assert len(set(a.tolist())) == 3
        relayed[dup] = io_bytes(graph, a, k, "relay", producers=np.array([nm in big for nm in graph.names]))[0].sum()
        buffers[dup] = sum(s.comm_buffer_bytes for s in plan.stages)
    assert relayed[False] > 0  # without the pass the mask crosses stage boundaries
    assert relayed[True] == 0
    assert buffers[True] < buffers[False]  # the plan's receive buffers no longer hold them


@pytest.mark.slow
def test_llama_pipeline_with_copied_mask_trains_like_one_process():
    from fxpipe.cli.plan_cmd import HFFactory, _BatchFn

    factory = HFFactory("llama", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                                  "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 64,
                                  "max_position_embeddings": 2048},
                        microbatches=2, microbatch_size=1, seq_len=2048, seed=0)  # a mask worth recomputing
    model, args, kwargs = factory.one_microbatch()
    plan = fxpipe.compile(model, args, kwargs, devices=2, microbatches=2, schedule="1f1b", time_limit_s=1.0, seed=0)
    gm = plan.capture.traced.gm
    assert gm.meta[REPORT_KEY]["nodes_added"] > 0
    # the second layer's mask is computed on its stage
    copies = [n.name for n in gm.graph.nodes if DUPLICATED_KEY in n.meta]
    layer1 = [n for n in gm.graph.nodes
              if any("layers.1" in str(v[0]) for v in (n.meta.get("nn_module_stack") or {}).values())]
    assert {plan.stage_of[c] for c in copies if c in plan.stage_of} <= {plan.stage_of[n.name] for n in layer1
                                                                         if n.name in plan.stage_of}
    result = plan.train_local(factory, _BatchFn(factory), steps=2, lr=0.05, timeout_s=400)
    pipe, ref = result["results"]
    torch.testing.assert_close(torch.tensor(pipe.losses), torch.tensor(ref.losses), rtol=1e-4, atol=1e-6)
    assert pipe.losses[1] != pipe.losses[0]
    for name, g in ref.grads.items():
        torch.testing.assert_close(pipe.grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
