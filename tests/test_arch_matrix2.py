"""The second round of real architectures (issue 17, item 9): 35 more families of
``fxpipe.testing.zoo`` (group ``"second"``: OLMo2, StarCoder2, GPT-J, CodeGen, Cohere, Granite, StableLM,
Mamba, Mamba2, Jamba, GraniteMoE, XLM-R, DeBERTa-v2, ELECTRA, DistilBERT, ModernBERT, mT5, UMT5,
Pegasus, Marian, mBART, Swin, DeiT, DINOv2, SegFormer, MobileViT, EfficientNet, RegNet,
Wav2Vec2-Conformer, BLIP and five hand-written DAGs: inception, LSTM/GRU, mixed dtypes, an argmax
output, an embedding with ``padding_idx``), each planned by ``fxpipe.compile`` with its default
schedule (``auto``) and trained on 2 and 4 local gloo ranks (at 4 ranks only 16 of them, one or
more per kind, with ``FXPIPE_ARCH_MATRIX_QUICK=1``), equals single-process training
(losses within rtol 1e-4; gradients, parameters after the steps and buffers within 1e-5 of the
largest reference value). At 2 ranks, the :data:`META_CHECKPOINT` models are also built on ``meta``
in every worker, each rank materializing only its stages from a safetensors checkpoint, and
train like the whole model loaded from that checkpoint in one process.

One spawned job per pipeline size runs every model (CI time: each worker captures each model
once). Cells that fail today for reasons other branches of issue 17 fix are ``xfail(strict=False)``
naming the issue item, so they can be flipped once those land. The other schedules and the
bigger sweeps are in ``python benchmarks/arch_matrix.py --group second``.
"""

from __future__ import annotations

import functools
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fxpipe.testing import zoo  # noqa: E402
from fxpipe.testing.matrix import run_matrix  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SECOND = zoo.names(group="second")
SCHEDULE = "auto"  # fxpipe.compile's default
#: one or more per kind: what runs at 4 ranks with FXPIPE_ARCH_MATRIX_QUICK=1 (the 4-rank job costs
#: 4 captures per model on 2 cores: 88 s for all 35, 52 s for these, under load; see the README)
FOUR_RANKS_QUICK = ("mamba2", "jamba", "granitemoe", "deberta_v2", "modernbert", "mt5", "pegasus", "swin", "segformer",
                    "wav2vec2_conformer", "blip", "inception", "lstm_gru", "mixed_dtype", "argmax_output", "padding_idx")
FOUR_RANKS = FOUR_RANKS_QUICK if os.environ.get("FXPIPE_ARCH_MATRIX_QUICK") == "1" else tuple(SECOND)
#: built on meta and loaded from a checkpoint at 2 ranks (one or more per family kind); the ones
#: known to fail last (a failed run restarts the workers)
META_CHECKPOINT = ("olmo2", "mamba", "distilbert", "pegasus", "swin", "inception", "cohere", "lstm_gru",
                   "granitemoe", "segformer")

#: (model, ranks or None for both, "train" | "meta") -> why it fails today (issue 17 item)
KNOWN = {
    ("granitemoe", None, "meta"): "traced on meta, histc's input is cast to int32 (a device-dependent branch) that "
                                  "has no CPU kernel: fxpipe.compile warns (DeviceBranchWarning), no rewrite yet",
    ("segformer", None, "meta"): "traced on meta, upsample_bilinear2d is decomposed (its meta kernel is a Python "
                                 "decomposition) into ~90 ops the CPU plan lacks, so structural matching refuses the "
                                 "plan: tracing on fake tensors of the target device would fix it and granitemoe's",
}


def _known(model, ranks, kind):
    return KNOWN.get((model, ranks, kind)) or KNOWN.get((model, None, kind))


@functools.lru_cache(maxsize=None)
def _matrix(ranks):
    res = run_matrix(SECOND if ranks == 2 else FOUR_RANKS, ranks=(ranks,), schedules=(SCHEDULE,),
                     meta_checkpoint=META_CHECKPOINT if ranks == 2 else ())
    return {(c.model, c.schedule): c for c in res.cells}


def _params(ranks, kind, models):
    out = []
    for m in models:
        reason = _known(m, ranks, kind)
        marks = [pytest.mark.xfail(strict=False, reason=reason)] if reason else []
        out.append(pytest.param(m, id=m, marks=marks))
    return out


def _check(cell):
    # the verdict's tolerances are per dtype (fxpipe.codegen.compare): 1e-5 of the largest value for
    # fp32 tensors, a few ulps of bf16 where a gradient reads bf16 values (mixed_dtype)
    assert cell.ok, f"{cell.model} {cell.ranks} ranks {cell.schedule}: {cell.error or cell.problems or cell.to_dict()}"


def test_second_round_is_in_the_zoo():
    assert len(SECOND) >= 35
    assert set(META_CHECKPOINT) <= set(SECOND) and set(FOUR_RANKS_QUICK) <= set(SECOND)
    assert sum(not _known(m, 2, "meta") for m in META_CHECKPOINT) >= 6  # at least six meta builds must pass
    assert not set(SECOND) & set(zoo.names(group="core"))
    assert {zoo.get(m).family for m in SECOND} >= {"decoder", "moe", "ssm", "encoder", "encoder-decoder", "vision",
                                                   "speech", "vision-language", "dag"}


@pytest.mark.parametrize("model", _params(2, "train", SECOND))
def test_two_ranks_default_schedule_equals_single_process(model):
    _check(_matrix(2)[(model, SCHEDULE)])


@pytest.mark.parametrize("model", _params(4, "train", FOUR_RANKS))
def test_four_ranks_default_schedule_equals_single_process(model):
    _check(_matrix(4)[(model, SCHEDULE)])


@pytest.mark.parametrize("model", _params(2, "meta", META_CHECKPOINT))
def test_two_ranks_meta_build_from_checkpoint_equals_loaded_model(model):
    _check(_matrix(2)[(model, f"meta-ckpt:{SCHEDULE}")])
