"""Inductor stages with split backward (``fxpipe/codegen/compiled.py``), in one process (issue 30, item 3).

A stage whose input requires a gradient (every stage after the first) keeps that input in its W
stash; the W graph ran with grad mode on, so Inductor's ``mm(out=...)`` refused it:
"functions with out=... arguments don't support automatic differentiation" (action 1W0 of
``compile_stages=True`` under ZB-H1). B then W must give eager's gradients.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.fx as fx  # noqa: E402

from fxpipe.codegen.compiled import CompiledStageModule  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _stage():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def test_split_backward_of_a_stage_whose_input_requires_grad_equals_eager():
    eager = _stage()
    x = torch.randn(4, 32, requires_grad=True)
    target = torch.randn(4, 32)
    torch.nn.functional.mse_loss(eager(x), target).backward()

    mod = CompiledStageModule(fx.symbolic_trace(_stage()))
    xc = x.detach().clone().requires_grad_(True)  # a received activation: it requires grad
    out = mod(xc)
    mod.backward_mode = "split"  # backward-input (I): input gradients now, W stashed
    torch.nn.functional.mse_loss(out, target).backward()
    mod.backward_mode = "full"
    assert all(p.grad is None for p in mod.parameters())  # I computed no weight gradient
    stash = mod.pop_stash()
    assert stash is not None and mod.split_backward
    mod.run_weight(stash)  # backward-weight (W), outside the autograd engine, grad mode on
    assert torch.allclose(xc.grad, x.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), mod.inner.parameters()):
        assert q.grad is not None, name
        assert torch.allclose(q.grad, p.grad, rtol=1e-5, atol=1e-6), name
