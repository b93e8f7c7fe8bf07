"""Tests of the cost side: hardware specs, roofline math, the AnnotateCosts pass."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.cost import HARDWARE, OpCost, backward_times, get_hardware, is_compute_bound, roofline_s
from fxpipe.errors import InputError
from fxpipe.passes import COST_KEY, AnnotateCosts, capture, to_opgraph

from _autograd_oracle import saved_tensor_bytes

pytestmark = pytest.mark.filterwarnings("ignore")


def _costed(model, args, hardware="h100-sxm", dtype=None):
    cap = capture(model, args)
    AnnotateCosts(hardware, dtype)(cap.gm)
    return cap.gm


def _nodes(gm, target_name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and target_name in str(n.target)]


# ----------------------------------------------------------------------------- hardware
def test_hardware_specs():
    for name in ("a100-80gb", "h100-sxm", "h200", "cpu"):
        hw = get_hardware(name)
        assert hw.name == name and hw.source
        assert hw.peak("bf16") >= hw.peak("fp32") > 0
        assert hw.hbm_bytes_per_s > 0 and hw.d2d_bytes_per_s > 0 and hw.host_bytes_per_s > 0
        assert hw.memory_bytes > 0 and 0 < hw.launch_overhead_s < 1e-3
        with pytest.raises(dataclasses.FrozenInstanceError):
            hw.hbm_bytes_per_s = 1.0
    assert get_hardware("H100-SXM") is HARDWARE["h100-sxm"]
    assert get_hardware("h100-sxm").peak("fp8") == pytest.approx(2 * get_hardware("h100-sxm").peak("bf16"))
    assert get_hardware("h200").memory_bytes > get_hardware("h100-sxm").memory_bytes
    # capacities: what CUDA exposes (total_memory, measured on the H100 and H200), above the datasheets'
    # decimal "80GB" / "141GB", which each spec keeps for the record (issue 31)
    assert get_hardware("h100-sxm").memory_bytes == 85.02e9 and get_hardware("h200").memory_bytes == 150.11e9
    for name, sheet in (("a100-80gb", 80e9), ("h100-sxm", 80e9), ("h200", 141e9)):
        hw = get_hardware(name)
        assert hw.memory_datasheet_bytes == sheet < hw.memory_bytes < 1.1 * sheet
        assert get_hardware(f"{name}-datasheet").memory_bytes == hw.memory_bytes
    with pytest.raises(InputError) as info:
        get_hardware("tpu-v9")
    assert "h100-sxm" in str(info.value) and "a100-80gb" in str(info.value)


# ----------------------------------------------------------------------------- roofline math
def test_roofline_functions():
    assert roofline_s(100.0, 10.0, 10.0, 10.0) == 10.0
    assert roofline_s(10.0, 100.0, 10.0, 10.0) == 10.0
    assert is_compute_bound(1e12, 1e6, 1e12, 1e9) and not is_compute_bound(1e6, 1e9, 1e12, 1e9)
    with pytest.raises(ValueError):
        roofline_s(-1.0, 0.0, 1.0, 1.0)
    assert backward_times("shape", 1.0, 0.1) == (0.0, 0.0)
    assert backward_times("matmul_param", 1.0, 0.1) == (1.1, 1.1)
    assert backward_times("matmul_param", 1.0, 0.1, input_grads=0) == (0.0, 1.1)
    assert backward_times("matmul", 1.0, 0.1, input_grads=2) == (2.1, 0.0)
    assert backward_times("elementwise", 1.0, 0.1, factor=2.0) == (2.1, 0.0)
    with pytest.raises(ValueError):
        backward_times("nope", 1.0, 0.0)


# ----------------------------------------------------------------------------- FLOPs
class _Mix(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 48)
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.w = torch.nn.Parameter(torch.randn(48, 24))

    def forward(self, x, img):
        h = self.lin(x)  # (4, 16, 48)
        q = h.view(4, 16, 6, 8).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q)
        s = torch.matmul(q, q.transpose(-1, -2))  # bmm-like
        e = torch.einsum("bnd,de->bne", h, self.w)
        m = torch.mm(h.reshape(-1, 48), self.w)
        c = self.conv(img)
        return a.sum() + s.sum() + e.sum() + m.sum() + c.sum()


def test_flops_match_flop_counter_on_a_real_run():
    model = _Mix()
    args = (torch.randn(4, 16, 32), torch.randn(2, 3, 10, 10))
    gm = _costed(model, args)
    lin = _nodes(gm, "aten.linear")[0]
    assert lin.meta[COST_KEY].flops == 2 * (4 * 16) * 48 * 32  # 2*M*N*K
    with FlopCounterMode(display=False) as fc:
        model(*args)
    ours = sum(n.meta[COST_KEY].flops for n in gm.graph.nodes)
    # FlopCounterMode on CPU does not count the CPU attention kernel; we cost it like the GPU one
    sdpa = _nodes(gm, "scaled_dot_product_attention")[0].meta[COST_KEY].flops
    assert sdpa == 4 * (4 * 6 * 16 * 16 * 8)  # 2 matmuls of 2*B*H*S*S*D
    assert ours - sdpa == fc.get_total_flops()
    # op by op
    for name, fn in (
        ("aten.matmul", lambda: torch.matmul(torch.randn(4, 6, 16, 8), torch.randn(4, 6, 8, 16))),
        ("aten.einsum", lambda: torch.einsum("bnd,de->bne", torch.randn(4, 16, 48), torch.randn(48, 24))),
        ("aten.mm", lambda: torch.mm(torch.randn(64, 48), torch.randn(48, 24))),
        ("aten.conv2d", lambda: model.conv(args[1])),
    ):
        with FlopCounterMode(display=False) as one:
            fn()
        assert _nodes(gm, name)[0].meta[COST_KEY].flops == one.get_total_flops(), name


# ----------------------------------------------------------------------------- roofline regimes and zero-cost views
class _Big(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8192, 8192, bias=False)

    def forward(self, x):
        y = self.lin(x)
        z = torch.relu(y)
        return z.view(-1).reshape(8192, 8192).permute(1, 0).unsqueeze(0).expand(2, -1, -1)


def test_roofline_regimes_and_views_on_meta():
    with torch.device("meta"):
        model = _Big().to(torch.bfloat16)
        x = torch.randn(8192, 8192, dtype=torch.bfloat16)
    gm = _costed(model, (x,), "h100-sxm-datasheet")  # the plain roofline
    hw = get_hardware("h100-sxm-datasheet")
    lin = _nodes(gm, "aten.linear")[0].meta[COST_KEY]
    relu = _nodes(gm, "aten.relu")[0].meta[COST_KEY]
    assert lin.flops == 2 * 8192**3 and lin.dtype == "bf16"
    assert is_compute_bound(lin.flops, lin.bytes, hw.peak("bf16"), hw.hbm_bytes_per_s)
    assert lin.t_fwd_s == pytest.approx(lin.flops / hw.peak("bf16") + hw.launch_overhead_s)
    assert relu.flops == 0 and relu.bytes == 2 * 8192 * 8192 * 2
    assert relu.t_fwd_s == pytest.approx(relu.bytes / hw.hbm_bytes_per_s + hw.launch_overhead_s)
    for op in ("aten.view", "aten.reshape", "aten.permute", "aten.unsqueeze", "aten.expand"):
        for n in _nodes(gm, op):
            c = n.meta[COST_KEY]
            assert c.kind == "shape" and c.t_fwd_s == 0 and c.t_bwd_input_s == 0 and c.bytes == 0 and c.act_bytes == 0
            # the tensor still has (logical) bytes if a stage boundary cuts there
            assert c.size_out_bytes == 8192 * 8192 * 2 * (2 if op == "aten.expand" else 1)
    # the weight needs a gradient, the input does not: W but no B
    assert lin.t_bwd_input_s == 0 and lin.t_bwd_weight_s == pytest.approx(lin.t_fwd_s)
    assert relu.t_bwd_input_s == pytest.approx(relu.t_fwd_s) and relu.t_bwd_weight_s == 0
    # the achieved spec divides each family's roofline time by the family's efficiency (issue 31)
    ach = get_hardware("h100-sxm")
    gm2 = _costed(model, (x,), "h100-sxm")
    lin2, relu2 = (_nodes(gm2, op)[0].meta[COST_KEY] for op in ("aten.linear", "aten.relu"))
    lo = hw.launch_overhead_s
    assert lin2.t_fwd_s - lo == pytest.approx((lin.t_fwd_s - lo) / ach.efficiency_of("matmul"))
    assert lin2.t_bwd_weight_s - lo == pytest.approx((lin.t_bwd_weight_s - lo) / ach.efficiency_of("matmul"))
    assert relu2.t_fwd_s - lo == pytest.approx((relu.t_fwd_s - lo) / ach.efficiency_of("elementwise"))
    assert ach.efficiency_of("matmul") != ach.efficiency_of("elementwise")  # per family, not one global factor


# ----------------------------------------------------------------------------- F/B/W, activations, params
class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        x = self.emb(ids)
        h = self.fc1(x)
        g = F.gelu(h)
        y = self.fc2(g) + x
        return self.head(torch.tanh(y))


def _saved_bytes_eager(model, args) -> int:
    """Bytes autograd really saves, parameters and the model's inputs excluded: they are
    resident, held by the module and the caller for the whole step."""
    return saved_tensor_bytes(lambda: model(*args), [*model.parameters(), *(a for a in args if isinstance(a, torch.Tensor))])


def test_fbw_activation_and_param_accounting():
    torch.manual_seed(0)
    model = _MLP()
    args = (torch.randint(0, 50, (4, 8)),)
    gm = _costed(model, args, "a100-80gb")
    c = {n.name: n.meta[COST_KEY] for n in gm.graph.nodes}
    fc2 = next(n for n in _nodes(gm, "aten.linear") if n.meta[COST_KEY].size_param_bytes == (64 * 16 + 16) * 4)
    k = fc2.meta[COST_KEY]
    assert k.kind == "matmul_param" and k.t_bwd_input_s == pytest.approx(k.t_fwd_s) == pytest.approx(k.t_bwd_weight_s)
    emb = _nodes(gm, "aten.embedding")[0].meta[COST_KEY]
    assert emb.kind == "embedding" and emb.t_bwd_input_s == 0 and emb.t_bwd_weight_s > 0
    gelu = _nodes(gm, "aten.gelu")[0].meta[COST_KEY]
    assert gelu.t_bwd_weight_s == 0 and gelu.t_bwd_input_s > 0
    # activation memory equals what autograd really saves
    ours = sum(x.act_bytes for x in c.values())
    assert ours == _saved_bytes_eager(model, args)
    # parameters: each counted once (tied weight too), on an OpGraph node
    g, names = to_opgraph(gm, "a100-80gb", name="mlp")
    assert g.size_param_bytes.sum() == sum(p.numel() * p.element_size() for p in model.parameters())
    assert g.bandwidth_bytes_per_s == get_hardware("a100-80gb").d2d_bytes_per_s * 0.767  # NVLink as NCCL sends achieve it
    # integer-only ops take no part in the backward
    assert all(x.t_bwd_input_s == 0 and x.act_bytes == 0 for x in c.values() if not x.requires_grad)


def test_dtype_override_and_bad_input():
    model = _MLP()
    args = (torch.randint(0, 50, (4, 8)),)
    g32 = _costed(model, args)
    g16 = _costed(model, args, dtype=torch.bfloat16)
    for a, b in zip(g32.graph.nodes, g16.graph.nodes):
        ca, cb = a.meta[COST_KEY], b.meta[COST_KEY]
        if ca.dtype == "fp32":
            assert cb.dtype == "bf16"
            assert cb.size_out_bytes == pytest.approx(ca.size_out_bytes / 2)
    with pytest.raises(InputError):
        AnnotateCosts("h100-sxm", torch.int32)
    traced = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))  # no meta["val"]
    with pytest.raises(InputError, match="capture"):
        AnnotateCosts("h100-sxm")(traced)
    assert math.isfinite(OpCost().t_fwd_s)


class _NoGradBody(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            y = torch.mm(x, x.t())  # recorded as a higher-order op with a body graph
        return self.lin(x) + y.sum()


def test_higher_order_op_body_flops_and_no_grad():
    model = _NoGradBody()
    args = (torch.randn(4, 8),)
    gm = _costed(model, args)
    with FlopCounterMode(display=False) as fc:
        model(*args)
    assert sum(n.meta[COST_KEY].flops for n in gm.graph.nodes) == fc.get_total_flops()
    hop = [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert hop, "torch.export records the no_grad region as wrap_with_set_grad_enabled"
    c = hop[0].meta[COST_KEY]  # the body is costed, and it takes no part in the backward
    assert c.flops == 2 * 4 * 4 * 8 and c.t_bwd_input_s == 0 and c.act_bytes == 0


def test_sdpa_attention_backward_factor():
    from fxpipe.cost.roofline import ATTENTION_BWD_FACTOR

    class Att(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    gm = _costed(Att(), (torch.randn(2, 8, 16),))
    att = [n.meta[COST_KEY] for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)][0]
    lo = get_hardware("h100-sxm").launch_overhead_s
    assert att.kind == "attention" and att.flops > 0
    assert att.t_bwd_input_s - lo == pytest.approx(ATTENTION_BWD_FACTOR * (att.t_fwd_s - lo))
    assert att.t_bwd_weight_s == 0
    # saves q, k, v (one base: the qkv output) and its own output
    assert att.act_bytes == (2 * 8 * 48 + 2 * 2 * 8 * 8) * 4
