"""Higher-order op bodies of a capture on ``meta``: a ``torch.no_grad()`` block in ``forward``.

torch.export turns ``with torch.no_grad():`` into a ``wrap_with_set_grad_enabled(False, body)``
node whose body is a graph of its own, and a capture on ``meta`` writes ``device=meta`` into that
body too (``arange``, ``_assert_tensor_metadata``). Hugging Face Llama's rotary embedding is such a
block in transformers 5.17. Found on the first GPU run of ``benchmarks/bench_gpu_profile.py``:

* the profiler replayed the top-level graph on the profiling device but the body on ``meta``;
  the body failed inside ``no_grad``, the higher-order op does not restore the grad mode on an
  exception, and every later op ran without autograd: B = W = 0 for the whole model, and grad
  mode left off for the caller;
* ``retarget_meta_devices`` (the materialized stage's graph) rewrote the top-level graph only.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from fxpipe.codegen.materialize import retarget_meta_devices  # noqa: E402
from fxpipe.cost.profile import trace_measured  # noqa: E402
from fxpipe.passes import trace_model  # noqa: E402


class NoGradTable(torch.nn.Module):
    """A linear layer scaled by a table computed under ``no_grad`` from a buffer and the sequence length."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, width))

    def forward(self, x):
        with torch.no_grad():
            pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
            table = torch.outer(pos, self.inv_freq).cos().to(x.dtype)
        return self.lin(x) * table


def _meta_capture():
    with torch.device("meta"):
        model = NoGradTable()
    x = torch.empty(2, 4, 8, device="meta")
    traced = trace_model(model, (x,), hardware="cpu")
    if not any("wrap_with_set_grad_enabled" in str(n.target) for n in traced.gm.graph.nodes):
        pytest.skip("this torch inlines no_grad blocks: no higher-order op body to test")
    return model, x, traced


def _meta_literals(gm: torch.fx.GraphModule) -> int:
    def has_meta(a) -> bool:
        if isinstance(a, torch.device):
            return a.type == "meta"
        if isinstance(a, (list, tuple)):
            return any(has_meta(v) for v in a)
        if isinstance(a, dict):
            return any(has_meta(v) for v in a.values())
        return isinstance(a, str) and a == "meta"

    return sum(has_meta(n.args) or has_meta(n.kwargs) for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
               for n in sub.graph.nodes)


def test_profiler_times_backward_through_a_meta_no_grad_body_and_restores_grad_mode(tmp_path):
    model, x, _ = _meta_capture()
    traced, report = trace_measured(model, (x,), hardware="measured", db=tmp_path / "db.json", device="cpu",
                                    min_repeats=1, max_repeats=2, warmup=1, min_time_s=0.0)
    assert torch.is_grad_enabled()
    assert not report.failed, report.failed
    g = traced.graph
    lin = [i for i in range(g.n) if g.size_param_bytes[i] > 0]
    assert lin and all(g.t_bwd_weight_s[i] > 0 for i in lin)  # the linear's W was timed (0 before the fix)
    assert g.t_bwd_input_s.sum() > 0


def test_retarget_meta_devices_rewrites_the_bodies_and_the_stage_computes():
    model, x, traced = _meta_capture()
    gm = copy.deepcopy(traced.gm)
    assert _meta_literals(gm) > 0
    assert retarget_meta_devices(gm, "cpu") > 0
    assert _meta_literals(gm) == 0
    torch.manual_seed(0)
    real = NoGradTable()
    gm = gm.to_empty(device="cpu")
    missing, _ = gm.load_state_dict(real.state_dict(), strict=False)
    assert not missing
    xr = torch.randn(2, 4, 8)
    out = gm(xr)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, real(xr))
