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


class RelativeIndex(nn.Module):
    """BEiT's relative position bias, condensed (transformers' ``generate_relative_position_index``):
    an index built in ``forward`` by in-place updates of ``permute(...).contiguous()`` (a copy) and
    gathered from a learned table, added to attention scores."""

    def __init__(self, w: int = 3, heads: int = 2):
        super().__init__()
        self.w = w
        self.table = nn.Parameter(torch.randn((2 * w - 1) ** 2, heads))
        self.proj = nn.Linear(D, D)

    def forward(self, x):  # x: (B, w * w, D)
        w = self.w
        coords = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += w - 1
        rel[:, :, 1] += w - 1
        rel[:, :, 0] *= 2 * w - 1
        bias = self.table[rel.sum(-1).view(-1)].view(w * w, w * w, -1).permute(2, 0, 1)
        h = self.proj(x)
        scores = torch.einsum("bnd,bmd->bnm", h, h)[:, None] + bias
        return scores.softmax(-1).mean(1) @ h


# ---- issue 30: a loss that turns NaN, a submodule holding two dtypes, a model tied across ranks
def make_mlp():
    """A 5-layer MLP (no tie, one dtype): ``(model, full batch)``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, D)), \
        (_x((BATCH, D), 1),)


NAN_STEP, NAN_MICROBATCH = 1, 2


def batch_nan(step: int):
    """:func:`batch_bn_unused`'s batches, with a NaN in micro-batch ``NAN_MICROBATCH`` of step ``NAN_STEP``."""
    (x,), target = batch_bn_unused(step)
    if step == NAN_STEP:
        x = x.clone()
        x[NAN_MICROBATCH * (BATCH // MICROBATCHES), 0] = float("nan")
    return (x,), target


class ScaledLinear(nn.Module):
    """A linear layer whose float32 weight is scaled per output by a bfloat16 parameter it holds too:
    one submodule with trainable parameters of two dtypes (FSDP2 cannot put them in units of one dtype)."""

    def __init__(self, d: int = D):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.scale = nn.Parameter(torch.ones(d, dtype=torch.bfloat16))

    def forward(self, x):
        return (x @ self.weight.t()) * self.scale.float()


class TwoDtypeModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = ScaledLinear()
        self.c = nn.Linear(D, D)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class TiedEnds(nn.Module):
    """The first layer's weight used again, transposed, by the last (a tie across pipeline ranks)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(D, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.bias = nn.Parameter(torch.zeros(D))

    def forward(self, x):
        return self.mid(torch.tanh(self.first(x))) @ self.first.weight + self.bias


def make_tied_ends():
    torch.manual_seed(0)
    return TiedEnds(), (_x((BATCH, D), 1),)


def user_loop(rank: int, world: int, plan_path: str, make: str, batch: str, steps: int,
              freeze_tied_on_rank: int | None = None) -> dict:
    """A user's training loop over ``plan.build`` (what ``torchrun`` runs): SGD over ``sched.parameters()``
    (on rank ``freeze_tied_on_rank`` without the parameters tied across ranks: its copy goes stale).
    Returns the step and message of the ``TrainingError`` that stopped it, if any."""
    import sys

    import fxpipe
    from fxpipe.errors import TrainingError

    mod = sys.modules[__name__]
    plan = fxpipe.load_plan(plan_path)
    model, args = getattr(mod, make)()
    stages, sched = plan.build(rank, model=model, args=tuple(a[: BATCH // MICROBATCHES] for a in args),
                               loss_fn=F.mse_loss)
    params = sched.parameters()
    if rank == freeze_tied_on_rank:
        tied = {id(p) for p in model.first.parameters()}
        params = [p for p in params if id(p) not in tied]
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        (x,), target = getattr(mod, batch)(step)
        opt.zero_grad(set_to_none=True)
        try:
            sched.step(x, target=target, losses=[], return_outputs=False)
        except TrainingError as exc:
            return {"step": step, "error": str(exc)}
        opt.step()
    return {"step": steps, "error": None}


def user_loops(rank: int, world: int, jobs: list) -> list:
    """:func:`user_loop` for each ``(plan_path, make, batch, steps, freeze_tied_on_rank)`` in turn (one process group)."""
    return [user_loop(rank, world, *job) for job in jobs]
