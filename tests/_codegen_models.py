"""Tiny models, stage assignments and rule-based schedule orders for the codegen tests.

Everything here is picklable at module level (used by spawned gloo workers).
"""

from __future__ import annotations

import re

import torch

VOCAB = 64
BATCH = 8
SEQ = 8
MICROBATCHES = 4


class GPT2Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, use_cache=False).logits


class T5Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, decoder_input_ids):
        return self.m(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False).logits


def make_gpt2():
    """GPT-2, 4 layers, n_embd 32, 2 heads, vocab 64 (tied wte/lm_head), dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    model = GPT2Logits(GPT2LMHeadModel(cfg)).eval()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model, (ids,)


def make_t5():
    """T5 encoder-decoder, d_model 32, 2+2 layers, vocab 64, dropout off."""
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = T5Config(
        d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=VOCAB,
        d_kv=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )
    model = T5Logits(T5ForConditionalGeneration(cfg)).eval()
    g = torch.Generator().manual_seed(4321)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    dec = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model, (ids, dec)


def make_batch_gpt2(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return (ids,), tgt


def make_batch_t5(step: int):
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    dec = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return (ids, dec), tgt


def export_gm(model, example_inputs, microbatches=MICROBATCHES):
    """Unlifted exported module for one micro-batch of the example inputs."""
    mb = tuple(t[: t.shape[0] // microbatches] for t in example_inputs)
    return torch.export.export(model, mb, strict=False).module(), mb


# ----------------------------------------------------------------------------- partitions
_BLOCK_PATTERNS = (
    (re.compile(r"(?:^|\.)h\.(\d+)(?:\.|$)"), 0),  # GPT-2 transformer.h.<i>
    (re.compile(r"(?:^|\.)encoder\.block\.(\d+)(?:\.|$)"), 0),  # T5 encoder
    (re.compile(r"(?:^|\.)decoder\.block\.(\d+)(?:\.|$)"), 1000),  # T5 decoder (after encoder)
)


def _block_of(node) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    best = None
    for path, _ in stack.values():
        for pat, off in _BLOCK_PATTERNS:
            for mt in pat.finditer(str(path)):
                best = off + int(mt.group(1))
    return best


def stage_of_by_blocks(gm, starts: list[int]) -> dict[str, int]:
    """Stage per node: the node list in program order is cut where a block with a global id
    in ``starts`` (sorted) first appears. Global ids: GPT-2 block i -> i; T5 encoder block i ->
    i, decoder block i -> 1000 + i."""
    stage = 0
    out: dict[str, int] = {}
    nodes = list(gm.graph.nodes)
    num = len(starts) + 1
    for n in nodes:
        if n.op == "get_attr":
            continue
        if n.op == "placeholder":
            out[n.name] = 0
            continue
        if n.op == "output":
            out[n.name] = num - 1
            continue
        b = _block_of(n)
        if b is not None:
            while stage < len(starts) and b >= starts[stage]:
                stage += 1
        out[n.name] = stage
    return out


def stage_of_by_fraction(gm, num_stages: int) -> dict[str, int]:
    """Cut the compute nodes in program order into ``num_stages`` equal-count chunks."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("get_attr",)]
    comp = [n for n in nodes if n.op not in ("placeholder", "output")]
    out = {}
    for i, n in enumerate(comp):
        out[n.name] = min(num_stages - 1, i * num_stages // len(comp))
    for n in nodes:
        if n.op == "placeholder":
            out[n.name] = 0
        elif n.op == "output":
            out[n.name] = num_stages - 1
    return out


# ----------------------------------------------------------------------------- orders
# Rule-based per-stage orders (one stage per device), returned as fxpipe.ir.Orders: codegen's
# one schedule input.
def _orders(per_stage):
    from fxpipe.ir import Orders

    return Orders.from_stage_orders(per_stage)


def orders_1f1b(num_stages: int, m: int):
    """Classic 1F1B (PipeDream-flush): warm-up forwards, then one F one B; W right after B."""
    out = {}
    for s in range(num_stages):
        warm = min(num_stages - 1 - s, m)
        ops: list[tuple[str, int]] = [("F", j) for j in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                ops.append(("F", f))
                f += 1
            ops.append(("B", b))
            ops.append(("W", b))
            b += 1
        out[s] = ops
    return _orders(out)


def orders_zbh1(num_stages: int, m: int):
    """ZB-H1-like order: 1F1B forwards/backward-inputs, each W deferred by ``S - 1 - s``
    backward-inputs (Qi et al. 2024, Fig. 3 top: later stages fill bubbles with W)."""
    out = {}
    for s in range(num_stages):
        delay = num_stages - 1 - s
        warm = min(num_stages - 1 - s, m)
        ops: list[tuple[str, int]] = [("F", j) for j in range(warm)]
        f, b, w = warm, 0, 0
        while b < m:
            if f < m:
                ops.append(("F", f))
                f += 1
            ops.append(("B", b))
            b += 1
            if b - w > delay:
                ops.append(("W", w))
                w += 1
        while w < m:
            ops.append(("W", w))
            w += 1
        out[s] = ops
    return _orders(out)


def orders_gpipe(num_stages: int, m: int):
    """All forwards, then all backwards, each W right after its B (lowered to full backwards)."""
    return _orders({s: [("F", j) for j in range(m)] + [t for j in range(m) for t in (("B", j), ("W", j))]
                    for s in range(num_stages)})


def unit_orders(method: str, num_devices: int, m: int, stages_per_device: int = 1, placement: str = "looped"):
    """Orders of a generator of :mod:`fxpipe.schedule` on unit times (F = B = W = 1, no comm)."""
    from fxpipe.ir import ScheduleProblem, looped_placement, schedule_to_orders, v_placement
    from fxpipe.schedule.heuristics import generate

    v = stages_per_device
    dev = looped_placement(num_devices, v) if placement == "looped" else v_placement(num_devices, v)
    prob = ScheduleProblem.create(num_stages=v * num_devices, num_microbatches=m, t_f=1.0, t_b=1.0, t_w=1.0,
                                  device_of_stage=dev)
    return schedule_to_orders(generate(prob, method), prob)


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def make_mlp():
    """A two-layer MLP (no transformers import: fast worker start-up)."""
    return _MLP(), (torch.randn(8, 4),)


def make_batch_mlp(step: int):
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randn(8, 4, generator=g),), torch.randn(8, 4, generator=g)


def make_t5_kw():
    """:func:`make_t5` with keyword example inputs (exercises keyword capture and ordering)."""
    model, (ids, dec) = make_t5()
    return model, {"decoder_input_ids": dec, "input_ids": ids}


def make_batch_t5_kw(step: int):
    (ids, dec), tgt = make_batch_t5(step)
    return {"decoder_input_ids": dec, "input_ids": ids}, tgt
