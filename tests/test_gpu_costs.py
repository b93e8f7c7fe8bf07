"""The GPU specs' achieved efficiencies against the project's measured H100 steps (issue 31).

``benchmarks/data/h100_llama_steps.json`` records what one H100 80GB measured for real Llama-3
layers (4096 tokens, bf16, SDPA, batch 1, eager, forward + backward of ``logits.float().sum()``).
The test captures the same computation on ``meta`` (no weights, no GPU) and predicts it with
``h100-sxm`` (achieved efficiencies) and ``h100-sxm-datasheet`` (the plain roofline).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fxpipe.cost.hardware import HARDWARE, get_hardware
from fxpipe.cost.specs import COMPUTE_FAMILIES, EFFICIENCY_DERIVATION, EFFICIENCY_FAMILIES
from fxpipe.mesh import Topology, dp_sync_parts_s
from fxpipe.passes.annotate import AnnotateCosts
from fxpipe.passes.costing import COST_KEY

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "h100_llama_steps.json"
LLAMA_3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
              "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
DIMS = {"llama-3-8b": LLAMA_3_8B, "llama-3-70b": {**LLAMA_3_8B, "hidden_size": 8192, "num_attention_heads": 64,
                                                   "intermediate_size": 28672}}


class _SumOfLogits(torch.nn.Module):
    """What the H100 run timed: the model, then ``logits.float().sum()`` (its backward included)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids).float().sum()


def _step_s(gm) -> float:
    return sum(c.t_fwd_s + c.t_bwd_input_s + c.t_bwd_weight_s
               for c in (n.meta.get(COST_KEY) for n in gm.graph.nodes) if c is not None)


@pytest.fixture(scope="module")
def predictions():
    from fxpipe.models import build_hf_model
    from fxpipe.passes import trace_model

    doc = json.loads(DATA.read_text())
    out = {}
    for name, rec in doc["steps"].items():
        over = {**DIMS[rec["dims"]], "num_hidden_layers": rec["layers"], "seq_len": doc["setup"]["tokens"],
                "attn_implementation": "sdpa"}
        model, args, kwargs = build_hf_model("llama", over, device="meta", dtype=torch.bfloat16)
        tm = trace_model(_SumOfLogits(model), args, kwargs, hardware="h100-sxm", replicate="never")
        achieved = _step_s(tm.gm)
        per_node = {n.name: n.meta[COST_KEY] for n in tm.gm.graph.nodes}
        AnnotateCosts("h100-sxm-datasheet")(tm.gm)
        out[name] = (rec["forward_backward_s"], achieved, _step_s(tm.gm), per_node,
                     {n.name: n.meta[COST_KEY] for n in tm.gm.graph.nodes})
    return out


def test_measured_llama_steps_predicted_within_10_percent(predictions):
    """Both measured steps (48.3 ms, 83.4 ms) are predicted within 10 % with the achieved efficiencies;
    the datasheet roofline is more than 25 % low on both (what ``h100-sxm`` predicted before issue 31)."""
    assert set(predictions) == {"llama-3-8b-widths-2-layers", "llama-3-70b-widths-1-layer"}
    for name, (measured, achieved, datasheet, _, _) in predictions.items():
        assert abs(achieved / measured - 1) < 0.10, (name, measured, achieved)
        assert datasheet / measured < 0.75, (name, measured, datasheet)


def test_datasheet_spec_is_never_slower_per_op(predictions):
    """Bounds use the datasheet: every op's F, B and W on ``h100-sxm-datasheet`` are at most the achieved ones."""
    for _, _, _, achieved, sheet in predictions.values():
        for node, a in achieved.items():
            s = sheet[node]
            for key in ("t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s"):
                assert getattr(s, key) <= getattr(a, key) * (1 + 1e-12), (node, key)


def test_every_efficiency_has_a_source_and_every_gpu_a_datasheet_twin():
    for name, derivation in EFFICIENCY_DERIVATION.items():
        hw, sheet = get_hardware(name), get_hardware(f"{name}-datasheet")
        assert set(hw.efficiency) == set(EFFICIENCY_FAMILIES) == set(derivation) == set(hw.efficiency_sources)
        assert all(len(src) > 20 for src in hw.efficiency_sources.values())
        assert not sheet.efficiency and all(sheet.efficiency_of(f) == 1.0 for f in EFFICIENCY_FAMILIES)
        assert (sheet.peak_flops, sheet.hbm_bytes_per_s, sheet.memory_bytes) == (hw.peak_flops, hw.hbm_bytes_per_s,
                                                                                 hw.memory_bytes)
        # compute never beats the datasheet peak; only NVLink SHARP's all-reduce may exceed the line rate
        assert all(0 < hw.efficiency_of(f) <= 1 for f in COMPUTE_FAMILIES)
        # and it does so on 8 GPUs only: the ring formula every group is priced with takes the ring's bus bandwidth
        assert 0 < hw.efficiency_of("all_reduce") <= 1
    assert sorted(HARDWARE) == sorted([*EFFICIENCY_DERIVATION, *(f"{n}-datasheet" for n in EFFICIENCY_DERIVATION), "cpu"])


def test_collectives_run_at_their_kinds_achieved_bandwidth():
    """The data-parallel sync prices each collective kind at its NCCL bus bandwidth (the spec's topology),
    the datasheet twin at the line rate."""
    hw = get_hardware("h100-sxm")
    topo, line = Topology.from_dict(hw.topology()), Topology.from_dict(hw.datasheet().topology())
    n = 16e9
    gather, reduce = dp_sync_parts_s(n, {"pp": 1, "dp_shard": 8}, 1.0, topology=topo)
    g0, r0 = dp_sync_parts_s(n, {"pp": 1, "dp_shard": 8}, 1.0, topology=line)
    assert gather == pytest.approx(g0 / hw.efficiency_of("all_gather"), rel=1e-3)
    assert reduce == pytest.approx(r0 / hw.efficiency_of("reduce_scatter"), rel=1e-3)
    # 8 x 2 nodes: dp_replicate across nodes at the NIC's achieved bus bandwidth
    _, r_hsdp = dp_sync_parts_s(n, {"pp": 1, "dp_shard": 8, "dp_replicate": 2}, 1.0, topology=topo)
    _, r_hsdp0 = dp_sync_parts_s(n, {"pp": 1, "dp_shard": 8, "dp_replicate": 2}, 1.0, topology=line)
    allreduce, allreduce0 = r_hsdp - reduce, r_hsdp0 - r0
    assert allreduce == pytest.approx(allreduce0 / hw.efficiency_of("inter_node"), rel=1e-3)
    assert Topology.from_dict(topo.to_dict()) == topo


def test_a_gpu_profile_keeps_its_twins_link_efficiencies():
    """A profile measured on an H100 (base ``h100-sxm-datasheet``) replaces op times, not the links: its spec keeps
    h100-sxm's collective / network / host-copy efficiencies, and none for compute (the calibration is its own)."""
    from fxpipe.cost.calibrate import CostProfile
    from fxpipe.cost.database import DeviceInfo, Measurement

    gpu = DeviceInfo("cuda: NVIDIA H100 80GB HBM3", "2.11.0+cu130", 16)
    ms = [Measurement(op="aten.mm.default", args=f"bf16[{i}]", op_class="aten.mm", kind="matmul", t_fwd_s=2e-4 * i,
                      roofline_spec="h100-sxm-datasheet", roofline_s=(1e-4 * i + 5e-6, 0.0, 0.0)) for i in (1, 2, 3)]
    spec = CostProfile.from_measurements(ms, device=gpu, base="h100-sxm-datasheet", name="h100-sxm").hardware()
    twin = get_hardware("h100-sxm")
    assert spec.profile is not None and spec.peak_flops == twin.peak_flops
    assert all(spec.efficiency_of(f) == 1.0 for f in COMPUTE_FAMILIES)
    for f in ("all_gather", "reduce_scatter", "all_reduce", "p2p", "inter_node", "host_copy"):
        assert spec.efficiency_of(f) == twin.efficiency_of(f) != 1.0
    assert Topology.from_dict(spec.topology()) == Topology.from_dict(twin.topology())
