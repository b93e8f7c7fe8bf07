"""Issue 30, item 14: a capture on meta that meets a tensor on a fixed device gets the right advice.

torch.export on meta raises ``FakeTensorDeviceMismatchError`` when a model mixes meta tensors with
tensors on a fixed device; fxpipe used to read "Fake" in its name and advise registering a fake
kernel. The message now says what made the tensor and where, and points to planning on CPU:

* a forward that makes a tensor without ``device=`` (``torch.arange(n)``): the line that made it
  and the line where it meets the meta tensors;
* parameters an ``__init__`` made on a fixed device (a legacy ``torch.FloatTensor(...)``
  ignores ``torch.device("meta")``, as XLNet's attention weights do): which ones and by whom.

XLNet itself now plans on meta: ``fxpipe.models.build_hf_model(device="meta")`` moves such
stray parameters to meta (they hold no weights there), and ``fxpipe plan --no-meta`` plans a
model built on CPU.
"""

from __future__ import annotations

import inspect
import json

import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.errors import CaptureError  # noqa: E402


class PositionsInForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        pos = torch.arange(x.shape[-1], dtype=x.dtype)  # no device=: always on cpu
        shift = pos * 0.5
        return self.lin(x + shift)


class LegacyInit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.FloatTensor(8, 8))  # ignores torch.device("meta")

    def forward(self, x):
        return self.lin(x) @ self.w


def _line(cls, text: str) -> int:
    lines, start = inspect.getsourcelines(cls)
    return start + next(i for i, ln in enumerate(lines) if text in ln)


def _compile_error(model_cls) -> str:
    with torch.device("meta"):
        model, x = model_cls(), torch.randn(2, 8)
    with pytest.raises(CaptureError) as info:
        fxpipe.compile(model, (x,), devices=2, microbatches=2, mesh="pipeline", time_limit_s=0.2)
    return str(info.value)


def test_a_forward_that_makes_a_cpu_tensor_names_the_line_and_points_to_cpu():
    msg = _compile_error(PositionsInForward)
    made = _line(PositionsInForward, "torch.arange(")
    met = _line(PositionsInForward, "self.lin(x + shift)")
    assert msg.startswith(f"cannot capture PositionsInForward with torch.export on the meta device: its forward makes a "
                          f"tensor on cpu at File \"{__file__}\", line {made}, in forward: pos = torch.arange("), msg
    assert f"which meets the model's meta tensors at File \"{__file__}\", line {met}, in forward" in msg
    assert "create it on the device of its inputs (device=x.device)" in msg
    assert "plan the model on CPU instead" in msg and "--no-meta" in msg
    assert "fake kernel" not in msg


def test_parameters_an_init_left_on_cpu_are_named():
    msg = _compile_error(LegacyInit)
    assert "1 of the model's 3 parameters and buffers are on cpu while the others are on meta (w; made by LegacyInit.w)" \
        in msg, msg
    assert "torch.FloatTensor(...)" in msg and "model.to('meta')" in msg and "plan the model on CPU instead" in msg
    assert "fake kernel" not in msg


def test_xlnet_plans_on_meta(capsys):
    """XLNet's legacy-constructed attention weights are moved to meta: `fxpipe plan --hf xlnet` plans
    (it failed with the fake-kernel advice)."""
    from fxpipe.cli import main

    code = main(["plan", "--hf", "xlnet", "--devices", "2", "--mesh", "pipeline", "--microbatches", "2",
                 "--time-limit", "0.5", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    doc = json.loads(captured.out)
    assert doc["model_info"]["weights"] == "none (meta)" and doc["plan"]["devices"] == 2


def test_no_meta_plans_a_model_built_on_cpu(capsys):
    from fxpipe.cli import main

    code = main(["plan", "--hf", "gpt2", "--config", "n_layer=2", "n_embd=32", "n_head=2", "--devices", "2",
                 "--mesh", "pipeline", "--microbatches", "2", "--time-limit", "0.5", "--no-meta", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    assert json.loads(captured.out)["model_info"]["weights"] == "random"
