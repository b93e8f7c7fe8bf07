"""The pipeline's calling convention: micro-batch splitting, input checks, output structure and merging."""

from __future__ import annotations

import pytest
import torch

from fxpipe.codegen.interface import ModelInputs, ModelInterface, as_call, split_microbatches
from fxpipe.errors import InputError


class _M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(3, 3)

    def forward(self, inputs, *, scale: float = 1.0, flag: bool = True):
        y = self.l(inputs["x"]) * scale + inputs["b"][0]
        return {"y": y, "aux": y.pow(2).mean(), "per_feature": y.sum(0), "n": 7}


def _iface():
    x, b = torch.randn(2, 3), torch.randn(2, 3)
    gm = torch.export.export(_M(), ({"x": x, "b": [b]},), {"scale": 2.0, "flag": True}, strict=False).module()
    return ModelInterface.from_graph(gm), gm


def test_split_microbatches_rule():
    x = torch.arange(12.0).reshape(6, 2)
    parts = split_microbatches(ModelInputs(({"x": x, "s": torch.tensor(3.0)},), {"flag": "a"}), 3)
    assert len(parts) == 3 and all(isinstance(p, ModelInputs) for p in parts)
    torch.testing.assert_close(parts[1].args[0]["x"], x[2:4])
    assert parts[2].args[0]["s"] is parts[0].args[0]["s"]  # 0-dim tensors go to every micro-batch
    assert parts[0].kwargs == {"flag": "a"}
    assert split_microbatches(None, 2) == [None, None]
    with pytest.raises(InputError, match="not divisible by 4 micro-batches"):
        split_microbatches((x,), 4)
    with pytest.raises(InputError, match="wrap a single tensor"):
        as_call(x)


def test_interface_checks_structure_constants_and_shapes():
    iface, _ = _iface()
    x, b = torch.randn(2, 3), torch.randn(2, 3)
    assert iface.tensor_input_names and iface.constant_inputs
    flat = iface.flatten_inputs(ModelInputs(({"x": x, "b": [b]},), {"flag": True, "scale": 2.0}))  # kwargs any order
    assert len(flat) == 2 and flat[0] is x and flat[1] is b
    with pytest.raises(InputError, match="structured differently"):
        iface.flatten_inputs(ModelInputs(({"x": x, "b": b},), {"scale": 2.0, "flag": True}))
    with pytest.raises(InputError, match="captured as the constant True"):
        iface.flatten_inputs(ModelInputs(({"x": x, "b": [b]},), {"scale": 2.0, "flag": False}))
    with pytest.raises(InputError, match="captured with tensor\\(2, 3\\)"):
        iface.flatten_inputs(ModelInputs(({"x": torch.randn(4, 3), "b": [b]},), {"scale": 2.0, "flag": True}))
    mbs = iface.microbatch_inputs(ModelInputs(({"x": torch.randn(6, 3), "b": [torch.randn(6, 3)]},),
                                              {"scale": 2.0, "flag": True}), 3)
    assert len(mbs) == 3 and mbs[0][0].shape == (2, 3)


def test_output_structure_and_merge_rule():
    iface, gm = _iface()
    mbs = [({"x": torch.randn(2, 3), "b": [torch.randn(2, 3)]},) for _ in range(3)]
    outs = [gm(*a, scale=2.0, flag=True) for a in mbs]
    chunks = [(o["y"], o["aux"], o["per_feature"]) for o in outs]
    one = iface.output(chunks[0])
    assert set(one) == {"y", "aux", "per_feature", "n"} and one["n"] == 7 and one["aux"].dim() == 0
    merged = iface.merge(chunks)
    assert merged["y"].shape == (6, 3)  # batch dimension: concatenated
    assert merged["aux"].shape == (3,)  # 0-dim: stacked per micro-batch
    assert merged["per_feature"].shape == (3, 3)  # non-batch (3,) that is not the batch size (2): stacked
    torch.testing.assert_close(merged["aux"], torch.stack([o["aux"] for o in outs]))
    with pytest.raises(InputError, match="expected 3 output tensors"):
        iface.output(chunks[0][:2])
