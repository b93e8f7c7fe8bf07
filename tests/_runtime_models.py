"""Tiny models that each hit one stage-runtime bug at a known cut (picklable: used by spawned workers).

``cut_after(names)`` gives a stage map that puts every node up to (and including) the last of
``names`` on stage 0 and the rest on stage 1, so a test can place a boundary exactly where the
bug lives.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

D = 8
BATCH = 8
MICROBATCHES = 4


class StridedGrads(nn.Module):
    """Received tensors used so that their input gradients are strided: a transpose, a ``cat``
    slice and an expansion (``mean``'s gradient has stride 0, like MoE expert outputs)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.c = nn.Linear(D, D)
        self.mix = nn.Linear(4, 4)
        self.out = nn.Linear(2 * D + 1, D)

    def forward(self, x):  # x: (B, 4, D)
        h = self.a(x)
        g = self.b(x)
        k = self.c(x)
        # --- cut here: h, g, k are received by stage 1
        t = self.mix(h.transpose(1, 2)).transpose(1, 2)  # grad of h: transposed
        cat = torch.cat([t, g], dim=-1)  # grad of g: a slice of cat's gradient
        m = k.mean(dim=-1, keepdim=True)  # grad of k: expanded, stride 0
        return self.out(torch.cat([cat, m], dim=-1))


class InplaceOnReceived(nn.Module):
    """``c += a`` on a received ``c`` (Falcon's ``mlp_output += attention_output``), then an
    update through a view ``c[:, :2].mul_()`` whose result is read by a node that a naive
    stage map puts before the update."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D, D)
        self.l2 = nn.Linear(D, D)
        self.l3 = nn.Linear(D, D)

    def forward(self, x):
        a = self.l1(x)
        c = self.l2(torch.tanh(a))
        c += a
        c[:, :2].mul_(0.5)
        return self.l3(c) + c


class BNUnused(nn.Module):
    """BatchNorm in training mode (running statistics, ``num_batches_tracked``), a bias before
    the BatchNorm (true gradient 0: per-parameter relative differences are noise), and a
    parameter the forward never uses."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, D)
        self.never_used = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.out(F.relu(self.bn(self.inp(x))))


class SharedLayers(nn.Module):
    """One block applied twice (ALBERT's weight sharing across layers)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.block = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D), nn.Tanh())
        self.out = nn.Linear(D, D)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.block(h)
        h = h + self.block(h)
        return self.out(h)


class PytreeIO(nn.Module):
    """Called ``model({"x": x, "parts": [a, b]}, scale=2.0, mode="sum")``; returns a dict with a
    nested tuple, a 0-dim auxiliary output, a non-batch tensor and a constant."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D, D)
        self.l2 = nn.Linear(D, D)
        self.l3 = nn.Linear(D, D)
        self.w = nn.Parameter(torch.ones(D))

    def forward(self, inputs, scale: float = 1.0, mode: str = "sum"):
        a, b = inputs["parts"]
        h = torch.tanh(self.l1(inputs["x"]))
        h = h + self.l2(a) * scale if mode == "sum" else h * self.l2(a)
        y = self.l3(h) + b
        return {"y": y, "aux": (h.pow(2).mean(), (h, (h * self.w).mean(dim=0))), "tag": 3}


class DropoutMLP(nn.Module):
    def __init__(self, p: float = 0.1):
        super().__init__()
        self.l1 = nn.Linear(D, D)
        self.drop = nn.Dropout(p)
        self.l2 = nn.Linear(D, D)

    def forward(self, x):
        return self.l2(self.drop(torch.tanh(self.l1(x))))


def _x(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make_bn_unused():
    torch.manual_seed(0)
    return BNUnused().train(), (_x((BATCH, D), 1),)


def batch_bn_unused(step: int):
    return (_x((BATCH, D), 10 + step),), _x((BATCH, D), 20 + step)


def make_dropout():
    torch.manual_seed(0)
    return DropoutMLP().train(), (_x((BATCH, D), 1),)


def pytree_tensors(seed: int, batch: int = BATCH):
    """``x, a, b`` for :class:`PytreeIO`, called as ``model({"x": x, "parts": [a, b]}, scale=2.0, mode="sum")``."""
    return tuple(_x((batch, D), seed + i) for i in range(3))


def pytree_loss(out, target):
    aux, (h, stats) = out["aux"]
    assert out["tag"] == 3 and aux.dim() == 0 and stats.shape == (D,)
    return F.mse_loss(out["y"], target["y"]) + 0.1 * aux + 0.01 * stats.sum() * target["w"]


def _cut(gm, last_stage0: str, num_stages: int = 2) -> dict[str, int]:
    """Nodes up to ``last_stage0`` (program order) on stage 0, the rest on the last stage."""
    out, stage = {}, 0
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            continue
        out[n.name] = 0 if n.op == "placeholder" else (num_stages - 1 if n.op == "output" else stage)
        if n.name == last_stage0:
            stage = num_stages - 1
    return out


def cut_after(name: str):
    """Picklable ``gm -> stage_of`` for :func:`_cut`."""
    return functools.partial(_cut, last_stage0=name)
