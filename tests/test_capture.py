"""Tests of the torch front end: capture, OpGraph export, model builders."""

from __future__ import annotations

import operator

import numpy as np
import pytest
import torch

from fxpipe.errors import CaptureError, InputError
from fxpipe.ir import OpGraph
from fxpipe.models import build_hf_model, parse_overrides
from fxpipe.passes import COST_KEY, capture, to_opgraph, trace_model
from fxpipe.passes.annotate import AnnotateCosts

from _autograd_oracle import saved_tensor_bytes

pytestmark = pytest.mark.filterwarnings("ignore")

# eager attention: the oracles below (autograd's saved bytes, FlopCounterMode, meta == cpu costs)
# check the cost model op by op on explicit matmul/softmax attention; build_hf_model's default is
# SDPA, whose fused op is costed by its own rule (tests/test_cost.py)
SMALL = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, seq_len=8, batch_size=2,
                 bos_token_id=0, eos_token_id=0, attn_implementation="eager"),
    "t5": dict(num_layers=1, num_decoder_layers=1, d_model=64, d_ff=128, num_heads=2, d_kv=32,
               vocab_size=128, seq_len=8, batch_size=2, decoder_seq_len=6, attn_implementation="eager"),
    "llama": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=128, seq_len=8, batch_size=2, attn_implementation="eager"),
    "mixtral": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=96, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
                    seq_len=8, batch_size=2, attn_implementation="eager"),
}


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # unique by identity


@pytest.fixture(scope="module")
def traced():
    out = {}
    for arch, ov in SMALL.items():
        model, args, kwargs = build_hf_model(arch, ov)
        out[arch] = (model, args, kwargs, trace_model(model, args, kwargs, hardware="h100-sxm"))
    return out


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_capture_matches_eager_and_trains(traced, arch):
    model, args, kwargs, tm = traced[arch]
    gm = tm.gm
    inputs = list(args) + list(kwargs.values())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [tuple(n.meta["val"].shape) for n in placeholders] == [tuple(x.shape) for x in inputs]
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem and node.users:
            assert "val" in node.meta, node.name
        assert isinstance(node.meta[COST_KEY].t_fwd_s, float)
    with torch.no_grad():
        ref = model(*args, **kwargs)
        out = gm(*args, **kwargs)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    # autograd through the unlifted module reaches its (real) parameters
    gm.zero_grad(set_to_none=True)
    gm(*args, **kwargs).float().pow(2).mean().backward()
    params = dict(gm.named_parameters())
    assert params, "the unlifted module must own parameters"
    with_grad = [n for n, p in params.items() if p.grad is not None and p.grad.abs().sum() > 0]
    assert len(with_grad) >= 0.8 * len(params), sorted(set(params) - set(with_grad))[:5]
    model_params = {id(p) for p in model.parameters()}
    assert all(id(p) in model_params for p in params.values()), "gm must share the model's parameters"


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_param_bytes_sum_and_structure(traced, arch):
    model, args, kwargs, tm = traced[arch]
    g = tm.graph
    assert g.size_param_bytes.sum() == pytest.approx(_param_bytes(model))
    # node mapping: placeholders first, output last, no get_attr, ids in program order
    fx_nodes = [n for n in tm.gm.graph.nodes if n.op != "get_attr"]
    assert list(g.names) == [n.name for n in fx_nodes] == tm.node_names
    assert list(g.ops) == [n.op for n in fx_nodes]
    n_ph = sum(1 for n in fx_nodes if n.op == "placeholder")
    assert n_ph == len(args) + len(kwargs)
    assert set(g.ops[:n_ph]) == {"placeholder"} and "placeholder" not in g.ops[n_ph:]
    assert g.ops[-1] == "output" and g.t_fwd_s[-1] == 0 and g.size_out_bytes[-1] == 0
    assert np.all(g.edges[:, 0] < g.edges[:, 1]), "ids must be a topological order"
    # every fx data dependency between OpGraph nodes is an edge
    idx = {nm: i for i, nm in enumerate(g.names)}
    want = {(idx[i.name], idx[n.name]) for n in fx_nodes for i in n.all_input_nodes if i.name in idx}
    assert want == {tuple(e) for e in g.edges.tolist()}
    assert tm.node_id(g.names[3]) == 3
    with pytest.raises(InputError):
        tm.node_id(next(n.name for n in tm.gm.graph.nodes if n.op == "get_attr"))
    assert g.bandwidth_bytes_per_s == pytest.approx(450e9 * 0.822)  # h100-sxm NVLink as NCCL send/recv achieves it


def test_module_paths_use_hf_names(traced):
    g = traced["gpt2"][3].graph
    mods = {e["module"] for e in g.extra}
    assert "transformer.h.1.mlp.c_fc" in mods and "lm_head" in mods
    assert not any(m.startswith("model.") for m in mods)
    ll = traced["llama"][3].graph
    lm = {e["module"] for e in ll.extra}
    assert "model.layers.1.self_attn.q_proj" in lm  # Llama's own names start with model.
    t5 = {e["module"] for e in traced["t5"][3].graph.extra}
    assert "encoder.block.0.layer.1.DenseReluDense.wi" in t5 and "decoder.block.0.layer.1.EncDecAttention.q" in t5
    mx = {e["module"] for e in traced["mixtral"][3].graph.extra}
    assert "model.layers.0.mlp.experts" in mx


def test_tied_weights_counted_once(traced):
    model, _, _, tm = traced["gpt2"]
    hf = model.model
    assert hf.lm_head.weight is hf.transformer.wte.weight
    owners = tm.gm.meta["fxpipe_param_owner"]
    emb = hf.transformer.wte.weight
    g = tm.graph
    # the tied matrix is one parameter: one get_attr target, owned by the token embedding
    tied = [t for t in ("model.transformer.wte.weight", "model.lm_head.weight") if t in owners]
    assert len(tied) == 1
    e = g.names.index(owners[tied[0]])
    assert g.extra[e]["target"] == "aten.embedding.default"
    assert g.size_param_bytes[e] == emb.numel() * emb.element_size()
    lm = [i for i, x in enumerate(g.extra) if x["module"] == "lm_head" and x["flops"] > 0]
    assert lm and all(g.size_param_bytes[i] == 0 for i in lm)


def test_opgraph_json_round_trip(traced, tmp_path):
    g = traced["t5"][3].graph
    path = g.save(tmp_path / "t5.json")
    h = OpGraph.load(path)
    assert h.names == g.names and h.ops == g.ops and h.name == g.name
    for key in ("t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s", "size_out_bytes", "size_param_bytes", "act_bytes"):
        np.testing.assert_array_equal(getattr(h, key), getattr(g, key))
    np.testing.assert_array_equal(h.edges, g.edges)
    assert h.extra == g.extra and h.bandwidth_bytes_per_s == g.bandwidth_bytes_per_s
    assert h.to_dict() == g.to_dict()


def test_meta_device_capture_allocates_nothing():
    model, args, kwargs = build_hf_model("llama", SMALL["llama"], device="meta")
    assert all(p.is_meta for p in model.parameters())
    tm = trace_model(model, args, kwargs, hardware="a100-80gb", dtype=torch.bfloat16)
    g = tm.graph
    assert g.size_param_bytes.sum() == pytest.approx(sum(p.numel() * 2 for p in model.parameters()))
    assert g.t_fwd_s.sum() > 0 and g.t_bwd_weight_s.sum() > 0 and g.act_bytes.sum() > 0
    # same costs as the CPU model (float32 costed as bf16 both times)
    cpu_model, cargs, ckw = build_hf_model("llama", SMALL["llama"])
    g2 = trace_model(cpu_model, cargs, ckw, hardware="a100-80gb", dtype=torch.bfloat16).graph
    assert g2.names == g.names
    np.testing.assert_allclose(g2.t_fwd_s, g.t_fwd_s)
    np.testing.assert_allclose(g2.act_bytes, g.act_bytes)


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # python branch on a tensor value
            return y * 2
        return y - 1


def test_capture_error_explains():
    with pytest.raises(CaptureError) as info:
        capture(_DataDependent(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert "data-dependent" in msg
    assert "if y.sum() > 0" in msg  # where: the user's source line
    assert "torch._dynamo.explain" in msg and "torch.cond" in msg  # what to try
    with pytest.raises(CaptureError):
        capture("not a module", ())


def test_dynamic_capture():
    model, args, kwargs = build_hf_model("gpt2", SMALL["gpt2"])
    cap = capture(model, args, kwargs, dynamic=True)
    longer = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(cap.gm(longer), model(longer))
    AnnotateCosts("h100-sxm")(cap.gm)
    g, _ = to_opgraph(cap.gm, "h100-sxm", name="dyn")
    assert g.t_fwd_s.sum() > 0


def test_model_builders_errors():
    assert parse_overrides(["n_layer=8", "act=gelu_new", "x=0.5", "flag=true", "s='a'"]) == {
        "n_layer": 8, "act": "gelu_new", "x": 0.5, "flag": True, "s": "a"}
    with pytest.raises(InputError):
        parse_overrides(["n_layer"])
    with pytest.raises(InputError, match="unknown model 'no-such-arch'"):
        build_hf_model("no-such-arch", {})
    with pytest.raises(InputError, match="config field"):
        build_hf_model("gpt2", {"n_layers_typo": 2})
    with pytest.raises(InputError):
        trace_model(torch.nn.Linear(2, 2), (torch.randn(1, 2),), hardware="tpu-v9")


def test_program_order_split_is_a_pipeline(traced):
    from fxpipe.partition.objective import Partition, validate_partition

    g = traced["llama"][3].graph
    k = 4
    a = (np.arange(g.n) * k) // g.n  # contiguous slices of the id order (a topological order)
    p = Partition.from_assignment(g, a, k, "training", "relay")
    validate_partition(g, p)
    np.testing.assert_array_equal(p.assignment, a)
    assert p.block_costs.sum() >= g.t_train_s.sum() > 0
    assert a[0] == 0 and a[-1] == k - 1  # inputs on the first stage, output on the last


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_activation_bytes_match_autograd(traced, arch):
    """Oracle: the bytes autograd really saves in an eager forward (distinct storages,
    parameters excluded) vs the sum of act_bytes; the estimate is a documented approximation."""
    model, args, kwargs, tm = traced[arch]
    real = saved_tensor_bytes(lambda: model(*args, **kwargs), model.parameters())
    assert tm.graph.act_bytes.sum() == pytest.approx(real, rel=0.10)


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_fbw_flops_match_flop_counter(traced, arch):
    """Oracle: on a hardware with 1 FLOP/s, unlimited bandwidth and no launch overhead, times
    are FLOPs; forward and B+W must equal FlopCounterMode on a real forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from fxpipe.cost.hardware import HardwareSpec

    hw = HardwareSpec(name="flops", description="1 FLOP/s", peak_flops={"fp32": 1.0}, hbm_bytes_per_s=1e30,
                      d2d_bytes_per_s=1.0, host_bytes_per_s=1.0, memory_bytes=1.0, launch_overhead_s=0.0)
    model, args, kwargs, tm = traced[arch]
    try:
        AnnotateCosts(hw)(tm.gm)
        g, _ = to_opgraph(tm.gm, hw)
    finally:
        AnnotateCosts("h100-sxm")(tm.gm)  # the fixture is shared: restore its annotation
    with FlopCounterMode(display=False) as f_fwd:
        out = model(*args, **kwargs)
    with FlopCounterMode(display=False) as f_bwd:
        out.sum().backward()
    # the MoE grouped matmul is a transformers custom op that FlopCounterMode does not see
    unseen = sum(e["flops"] for e in g.extra if "grouped_mm" in e["target"])
    assert g.t_fwd_s.sum() - unseen == pytest.approx(f_fwd.get_total_flops(), rel=1e-9)
    assert (g.t_bwd_input_s + g.t_bwd_weight_s).sum() - 2 * unseen == pytest.approx(f_bwd.get_total_flops(), rel=1e-9)
    if arch == "mixtral":
        assert unseen > 0


def test_trace_model_names_graph_after_the_wrapped_module():
    """A thin wrapper is named after its single child, whatever the child's attribute is called."""

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).relu()

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Inner()

        def forward(self, x):
            return self.net(x)

    tm = trace_model(Wrap(), (torch.randn(2, 4),), hardware="cpu")
    assert tm.captured.module_prefix == "net."
    assert tm.graph.name == "Inner"
    two = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())  # two children: no wrapper
    assert trace_model(two, (torch.randn(2, 4),), hardware="cpu").graph.name == "Sequential"


def _private_torch_uses(path) -> list[str]:
    """Private torch modules/attributes referenced by the code (not strings) of one file."""
    import ast

    tree = ast.parse(path.read_text())
    found = []

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and private(node.module):
            found.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            found += [f"{node.module}.{a.name}" for a in node.names if private(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if private(a.name)]
        elif isinstance(node, ast.Attribute):
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name):
                dotted = ".".join([cur.id] + parts[::-1])
                if private(dotted):
                    found.append(dotted)
    return found


def test_private_torch_apis_only_in_codegen_runtime():
    """House rule: private torch APIs live in fxpipe/codegen/runtime.py only."""
    from pathlib import Path

    import fxpipe

    root = Path(fxpipe.__file__).parent
    files = [p for p in root.rglob("*.py") if p != root / "codegen" / "runtime.py"]
    bad = {str(p.relative_to(root)): uses for p in files if (uses := _private_torch_uses(p))}
    assert not bad, bad
    assert _private_torch_uses(root / "codegen" / "runtime.py")  # the check can fail


class _DeadCode(torch.nn.Module):
    """Builds a tensor it never reads (as transformers 5.24's mask helper does), beside a
    dropout (random: impure) and an in-place update of a buffer (mutation: impure)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.unused = torch.nn.Linear(8, 8)  # a parameter no op reads stays a parameter
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        dead = torch.arange(x.shape[1]).unsqueeze(0).unsqueeze(2)  # noqa: F841
        self.count.add_(1)
        return torch.nn.functional.dropout(self.lin(x), p=0.1, training=True)


def test_capture_removes_dead_pure_ops_only():
    from fxpipe.passes.capture import remove_dead_code

    cap = capture(_DeadCode(), (torch.randn(2, 8),), replicate="never")
    nodes = list(cap.gm.graph.nodes)
    targets = [str(n.target) for n in nodes if n.op == "call_function"]
    assert not any("arange" in t or "unsqueeze" in t for t in targets), targets
    assert any("dropout" in t or "bernoulli" in t or "native_dropout" in t for t in targets), targets
    assert any("add_" in t or "copy_" in t for t in targets), targets  # the buffer update stays
    dead = [n.name for n in nodes if n.op == "call_function" and not n.users and not n.is_impure()]
    assert dead == []
    assert remove_dead_code(cap.gm) == 0  # a fixed point
    assert set(dict(cap.gm.named_parameters())) >= {"lin.weight", "unused.weight"}
    # the exported program itself keeps the dead ops: the removal is fxpipe's, and can fail
    exported_targets = [str(n.target) for n in cap.exported.graph.nodes if n.op == "call_function"]
    assert any("arange" in t for t in exported_targets)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])  # a preset and a generic model type share one check
@pytest.mark.parametrize("bad, says", [({"seq_len": 0}, "must be >= 1"), ({"batch_size": "x"}, "must be integers")])
def test_example_input_sizes_are_checked(arch, bad, says):
    with pytest.raises(InputError, match=says):
        build_hf_model(arch, bad, device="meta")
