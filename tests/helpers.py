"""Model factories for ``fxpipe plan --model tests.helpers:NAME`` (run from the repository root).

The contract (``fxpipe.models.MODEL_FACTORY_CONTRACT``): a callable with no arguments that
returns ``(model, args, kwargs)`` of one micro-batch, ``(model, args)``, or a plain
``nn.Module`` whose inputs come from ``--input-shape`` / ``--input-dtype``.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class TinyMLP(nn.Module):
    """Four linear layers with GELU and a residual: enough ops for a 2-stage pipeline."""

    def __init__(self, d: int = 16, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, 4)

    def forward(self, x, scale: float = 1.0):
        for lin in self.layers:
            x = x + torch.nn.functional.gelu(lin(x)) * scale
        return self.head(x)


def build():
    """The contract's main form: ``(model, args, kwargs)`` of one micro-batch of 2 samples."""
    torch.manual_seed(0)
    return TinyMLP(), (torch.randn(2, 16),), {"scale": 0.5}


def build_pair():
    """``(model, args)``: kwargs may be left out."""
    torch.manual_seed(0)
    return TinyMLP(), (torch.randn(2, 16),)


def module_only():
    """A plain module: the CLI draws its input from ``--input-shape``."""
    return TinyMLP()


def build_wrong():
    """Not the contract: a dict (the error must say what to return)."""
    return {"model": TinyMLP(), "inputs": torch.randn(2, 16)}


def build_bare_tensor_args():
    """Not the contract: the args are a bare tensor instead of a tuple."""
    return TinyMLP(), torch.randn(2, 16), {}


def assert_same_training(res, ref, what: str) -> None:
    """A distributed run's losses, gradients and parameters equal the single-process reference's
    (``fxpipe.codegen.launch`` results: ``losses``, ``grads``, ``params``), within the mesh tests' tolerances."""
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref.losses), rtol=1e-6, atol=0,
                               msg=lambda m: f"{what}: losses: {m}")
    assert set(res.grads) == set(ref.grads), what
    for name, g in ref.grads.items():
        torch.testing.assert_close(res.grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{what} {n}: {m}")
    for name, p in ref.params.items():
        torch.testing.assert_close(res.params[name], p, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{what} {n}: {m}")
