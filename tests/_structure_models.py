"""Models for the structural-identity tests (module level: picklable for spawned gloo workers).

* :class:`SetOrderNet`: ModernBERT's pattern (``for layer_type in set(config.layer_types)``) in a
  few lines: four branches computed in ``set`` iteration order, so the traced graph's node names
  sit on differently wired nodes under another ``PYTHONHASHSEED``.
* :class:`SdpaNet`: attention through ``F.scaled_dot_product_attention`` whose ``meta`` trace
  gains an ``aten.contiguous`` after every SDPA (as Cohere, mT5, GraniteMoE do).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

KINDS = ("alpha", "beta", "gamma", "delta")
VOCAB = 32
D = 16
MB = 2  # samples per micro-batch
MICROBATCHES = 2
SEQ = 4


class SetOrderNet(nn.Module):
    """Embedding, one branch per kind (computed in hash order), then layers each adding one branch."""

    def __init__(self, d: int = D, layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.branch = nn.ModuleDict({k: nn.Sequential(nn.Linear(d, 4 * d), nn.Tanh(), nn.Linear(4 * d, d))
                                     for k in KINDS})
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.kind_of = [KINDS[i % len(KINDS)] for i in range(layers)]
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        feats = {}
        for kind in set(self.kind_of):  # the order depends on PYTHONHASHSEED, as in ModernBERT
            feats[kind] = self.branch[kind](h)
        for kind, layer in zip(self.kind_of, self.layers):
            h = torch.tanh(layer(h)) + feats[kind]
        return self.head(h)


def make_set_order():
    torch.manual_seed(0)
    return SetOrderNet(), (torch.randint(0, VOCAB, (MB * MICROBATCHES, SEQ)),)


def batch_set_order(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (MB * MICROBATCHES, SEQ), generator=g),), \
        torch.randint(0, VOCAB, (MB * MICROBATCHES, SEQ), generator=g)


class SdpaBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).contiguous().view(b, s, d))


class SdpaNet(nn.Module):
    """``layers`` attention blocks with SDPA; ``width`` and ``layers`` make truly different models."""

    def __init__(self, width: int = D, layers: int = 2, heads: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(SdpaBlock(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def modernbert():
    """A tiny ``ModernBertForMaskedLM`` (2 layers, one global and one local) returning logits."""
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=32, pad_token_id=0,
                                        global_attn_every_n_layers=2, local_attention=2)
    cfg._attn_implementation = "eager"
    return transformers.ModernBertForMaskedLM(cfg).eval()


class Logits(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(input_ids=ids).logits


def make_modernbert():
    torch.manual_seed(0)
    return Logits(modernbert()), (torch.randint(3, VOCAB, (MB * MICROBATCHES, SEQ)),)


def stage_param_sets(plan) -> list[set[str]]:
    """The parameter names of every stage of ``plan`` on its own capture (what the plan planned)."""
    from fxpipe.codegen.split import split_stages

    staged = split_stages(plan.captured().gm, plan.captured_stage_of(), plan.num_stages)
    return [set(s.param_fqns) for s in staged.stages]


class FailingLoss:
    """A loss that raises on the last stage's first micro-batch (a real failure inside an action)."""

    def __call__(self, out, target):
        raise ValueError("loss exploded on purpose")
