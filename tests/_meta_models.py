"""Small models for the meta-build and mixed-dtype tests (picklable: used by spawned workers).

Each ``make_*`` is a ``make_model`` (``() -> (model, ModelInputs)``, built under the caller's
seed); each ``batch_*`` a ``make_batch`` (``step -> (inputs, target)``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.interface import ModelInputs

MICROBATCHES = 2
MB = 2  # samples per micro-batch
IMAGE = 16
CLASSES = 5


class InceptionBlock(nn.Module):
    """Four parallel branches (1x1; 1x1 -> 3x3; 1x1 -> 5x5; 3x3 max-pool -> 1x1) concatenated."""

    def __init__(self, cin: int, width: int):
        super().__init__()
        self.b1 = nn.Conv2d(cin, width, 1)
        self.b3 = nn.Sequential(nn.Conv2d(cin, width, 1), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(cin, width, 1), nn.ReLU(), nn.Conv2d(width, width, 5, padding=2))
        self.bp = nn.Conv2d(cin, width, 1)

    def forward(self, x):
        pooled = F.max_pool2d(x, 3, stride=1, padding=1)
        return F.relu(torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(pooled)], dim=1))


class InceptionNet(nn.Module):
    """Stem conv, two inception blocks, global average pool, a linear classifier (a 2-D ``addmm``)."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block1 = InceptionBlock(8, width)
        self.block2 = InceptionBlock(4 * width, width)
        self.head = nn.Linear(4 * width, CLASSES)

    def forward(self, x):
        h = self.block2(self.block1(F.relu(self.stem(x))))
        return self.head(h.mean(dim=(2, 3)))


def _images(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, 3, IMAGE, IMAGE, generator=g)


def make_inception():
    g = torch.Generator().manual_seed(1)
    return InceptionNet(), ModelInputs((_images(MB, g),), {})


def batch_inception(step: int):
    g = torch.Generator().manual_seed(100 + step)
    n = MB * MICROBATCHES
    return ModelInputs((_images(n, g),), {}), torch.randint(0, CLASSES, (n,), generator=g)


def make_swin():
    """transformers' ``SwinForImageClassification``, 2 stages of 1 block, embed dim 8, 4x4 windows."""
    from transformers import SwinConfig, SwinForImageClassification
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = SwinConfig(image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1], num_heads=[2, 2],
                     window_size=4, mlp_ratio=2.0, num_labels=CLASSES, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    cfg._attn_implementation = "eager"
    g = torch.Generator().manual_seed(2)
    return SwinForImageClassification(cfg).eval(), ModelInputs((), {"pixel_values": _images(MB, g)})


def batch_swin(step: int):
    g = torch.Generator().manual_seed(200 + step)
    n = MB * MICROBATCHES
    return ModelInputs((), {"pixel_values": _images(n, g)}), torch.randint(0, CLASSES, (n,), generator=g)


def make_beit():
    """transformers' ``BeitForImageClassification`` with relative position bias: its index tensor is built in
    ``forward``, so ``torch.export`` lifts it out as a constant (``lifted_tensor_*``, issue 30 item 13)."""
    from transformers import BeitConfig, BeitForImageClassification
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = BeitConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=32, use_relative_position_bias=True,
                     use_mean_pooling=True, num_labels=CLASSES, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    cfg._attn_implementation = "eager"
    g = torch.Generator().manual_seed(5)
    return BeitForImageClassification(cfg).eval(), ModelInputs((), {"pixel_values": _images(MB, g)})


def batch_beit(step: int):
    g = torch.Generator().manual_seed(500 + step)
    n = MB * MICROBATCHES
    return ModelInputs((), {"pixel_values": _images(n, g)}), torch.randint(0, CLASSES, (n,), generator=g)


def class_loss(out, target):
    """Cross entropy of the logits (a tensor or ``out.logits``) against class ids."""
    logits = out if isinstance(out, torch.Tensor) else out["logits"]
    return F.cross_entropy(logits.float(), target)




def _wire(t: torch.Tensor) -> list:
    """A tensor as JSON-able ``[values, dtype name]`` (bf16 values are exact in Python floats)."""
    return [t.detach().tolist(), str(t.dtype).removeprefix("torch.")]


def unwire(v) -> torch.Tensor | None:
    """Inverse of :func:`_wire` (None stays None)."""
    return None if v is None else torch.tensor(v[0], dtype=getattr(torch, v[1]))


def train_meta_build(rank: int, world: int, runs: list, steps: int, lr: float) -> dict:
    """The README's meta build in every rank: for each ``(name, plan_path, state)`` of ``runs``, the
    model is built on ``meta``, ``plan.build(rank, model=..., seed=... | checkpoint=...)``
    materializes only this rank's stages, and ``steps`` SGD steps train it.

    Returns, per name: this rank's losses (last stage only), gradients of the last step and
    parameters and buffers after all steps (lists, by the stage modules' names), and the bytes of
    real parameters this rank holds.
    """
    import fxpipe
    from _schedule_sgd import sgd_steps

    torch.set_num_threads(1)
    out = {}
    for name, plan_path, state in runs:
        make, batch, _, loss = META_MODELS[name]
        with torch.device("meta"):
            model, example = make()
        plan = fxpipe.load_plan(plan_path)
        stages, sched = plan.build(rank, model=model, args=example.args, kwargs=example.kwargs, loss_fn=loss, **state)
        named = {}
        for st in stages:
            for n, p in st.submod.named_parameters():
                named.setdefault(n, p)
        losses, grads = sgd_steps(sched, named, batch, steps, lr, to_wire=_wire)
        out[name] = {
            "losses": losses,
            "grads": grads,
            "params": {n: _wire(p) for n, p in named.items()},
            "buffers": {n: _wire(b) for st in stages for n, b in st.submod.named_buffers()},
            "held_param_bytes": sum(p.numel() * p.element_size() for p in named.values() if not p.is_meta),
        }
    return out


class MixedDtypeNet(nn.Module):
    """fp32 input projection, a bf16 middle (two linears and a GELU), fp32 norm and head."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.mid1 = nn.Linear(d, 2 * d).to(torch.bfloat16)
        self.mid2 = nn.Linear(2 * d, d).to(torch.bfloat16)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x).to(torch.bfloat16)
        h = self.mid2(F.gelu(self.mid1(h))).float()
        return self.head(self.norm(h))


def make_mixed():
    g = torch.Generator().manual_seed(3)
    return MixedDtypeNet(), ModelInputs((torch.randn(MB, 8, generator=g),), {})


MIXED_MICROBATCHES = 3  # not a power of two: scaling the summed micro-batch gradients by 1/3 rounds


def batch_mixed(step: int):
    g = torch.Generator().manual_seed(300 + step)
    n = MB * MIXED_MICROBATCHES
    return ModelInputs((torch.randn(n, 8, generator=g),), {}), torch.randn(n, 4, generator=g)


def mse_loss(out, target):
    """Mean squared error in fp32."""
    return F.mse_loss(out.float(), target)


#: name -> (make_model, make_batch, micro-batches, loss)
META_MODELS = {"swin": (make_swin, batch_swin, MICROBATCHES, class_loss),
               "inception": (make_inception, batch_inception, MICROBATCHES, class_loss),
               "mixed": (make_mixed, batch_mixed, MIXED_MICROBATCHES, mse_loss),
               "beit": (make_beit, batch_beit, MICROBATCHES, class_loss)}


class DeviceBranchRouter(nn.Module):
    """A router that counts tokens per expert with ``histc`` in a dtype picked by device, as
    transformers' GraniteMoE / Jamba do: float32 on CPU, int32 elsewhere (``meta`` included),
    which has no CPU kernel."""

    def __init__(self, d: int = 8, experts: int = 4):
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(d, experts)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        logits = self.router(x)
        chosen = logits.argmax(dim=-1)
        dtype = torch.float32 if x.device.type in ("cpu", "mps") else torch.int32
        counts = torch.histc(chosen.reshape(-1).to(dtype), bins=self.experts, min=0, max=self.experts)
        balance = (counts.float() / chosen.numel() * logits.softmax(-1).mean(dim=0)).sum()
        return self.out(x), balance


class MaskedRows(nn.Module):
    """Keeps the rows whose first feature is positive (``h[mask]``: a data-dependent row count)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        h = self.a(x)
        return self.b(h[h[:, 0] > 0]).sum()
