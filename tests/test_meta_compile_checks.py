"""Compile-time checks of issue 17, item 8: a device branch baked into a capture on ``meta``, and
example inputs that are not a tuple / dict.

A model that picks ``histc``'s dtype by device (float32 on CPU, int32 elsewhere, as transformers'
GraniteMoE and Jamba do) captured on ``meta`` holds an int32 ``histc``, which CPU cannot run:
``fxpipe.compile`` warns, naming the op, the dtype, the backend and the model's source line. The
same model captured on CPU took the CPU path: no warning.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.errors import InputError  # noqa: E402
from fxpipe.passes.capture import capture  # noqa: E402

import _meta_models as mm  # noqa: E402


def test_meta_trace_of_a_device_branch_warns_at_compile_time():
    with torch.device("meta"):
        model, x = mm.DeviceBranchRouter(), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fxpipe.compile(model, (x,), devices=2, microbatches=2, time_limit_s=0.2, mesh="pipeline")
    found = [r for r in rec if "histc" in str(r.message)]
    assert len(found) == 1, [str(r.message)[:80] for r in rec]
    (w,) = found
    text = str(w.message)
    assert w.category.__name__ == "DeviceBranchWarning"
    assert "aten.histc" in text and "int32" in text and "cpu" in text
    assert "_meta_models.py" in text and "torch.histc(" in text  # the user's source line
    assert w.filename == __file__  # points at the compile call


def test_cpu_capture_of_the_same_branch_has_no_gap():
    from fxpipe.codegen.devicecheck import DeviceBranchWarning, captured_on_meta, kernel_gaps, warn_meta_kernel_gaps

    model = mm.DeviceBranchRouter()
    gm = capture(model, (torch.randn(4, 8),), {}).gm
    assert not captured_on_meta(gm)
    assert kernel_gaps(gm) == []  # the CPU path: float32 histc
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeviceBranchWarning)
        assert warn_meta_kernel_gaps(gm) == []


@pytest.mark.parametrize("args, kwargs, message", [
    (torch.randn(2, 32), None, r"args must be a tuple .* got a torch\.Tensor: wrap it: args=\(x,\)"),
    ({"x": torch.randn(2, 32)}, None, r"args must be a tuple .* got a dict: pass keyword inputs as kwargs"),
    ((torch.randn(2, 32),), [("x", 1)], r"kwargs must be a dict .* got a list"),
])
def test_compile_names_misplaced_example_inputs(args, kwargs, message):
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with pytest.raises(InputError, match=message):
        fxpipe.compile(model, args, kwargs, devices=2, mesh="pipeline")
