"""A zoo of small real architectures for end-to-end tests and benchmarks (random weights, offline).

Test support (:mod:`fxpipe.testing`), not user API.

Every entry is a model people train, built from its Hugging Face ``transformers`` (>= 5) config
with at most 4 layers and hidden size <= 128, or a hand-written DAG that stresses the pipeline
runtime (long ``cat`` skips, BatchNorm in training mode, weights tied across distant layers,
dict / nested inputs and outputs, an in-place update of a tensor received from another stage,
an unused parameter). Nothing is downloaded: configs are built in code and weights are random.

:func:`get` returns a :class:`ZooModel`, a picklable factory usable as ``make_model`` /
``make_batch`` / ``loss`` of :func:`fxpipe.codegen.launch.spawn_train` and
:meth:`fxpipe.plan.Plan.train_local`::

    zm = fxpipe.testing.zoo.get("mixtral")
    model, args, kwargs = zm.one_microbatch()       # what fxpipe.compile captures
    plan = fxpipe.compile(model, args, kwargs, devices=2, microbatches=zm.microbatches)
    result = plan.train_local(zm, zm.batch, loss=zm.loss)

Models are returned as users write them: Hugging Face models return their ``ModelOutput``
(a pytree: ``logits``, ``aux_loss``, ``router_logits``, ...), and the loss reads the fields it
needs. Dropout probabilities are set to 0 and models run in eval mode, except the models whose
point is training-mode behaviour (ResNet and the BatchNorm DAG in train mode; GPT-2 in train mode
with dropout p = 0), so pipelined and single-process training can agree bit for bit.

The families (``ZooModel.family``): ``decoder``, ``moe``, ``ssm`` (state-space: Mamba, Mamba2,
Jamba), ``encoder``, ``encoder-decoder``, ``vision``, ``two-tower``, ``vision-language``,
``speech``, ``dag``. The groups (:data:`GROUPS`, ``names(group=...)``): ``core``, the first 32
models (issue 8; ``tests/test_arch_matrix.py``), and ``second``, 35 more (issue 17: OLMo2,
StarCoder2, GPT-J, CodeGen, Cohere, Granite, StableLM, Mamba, Mamba2, Jamba, GraniteMoE, XLM-R,
DeBERTa-v2, ELECTRA, DistilBERT, ModernBERT, mT5, UMT5, Pegasus, Marian, mBART, Swin, DeiT,
DINOv2, SegFormer, MobileViT, EfficientNet, RegNet, Wav2Vec2-Conformer, BLIP, and DAGs: inception
branches, LSTM + GRU, bf16 + fp32 parameters, integer / boolean outputs, ``padding_idx``;
``tests/test_arch_matrix2.py``). Mamba-family models run their reference torch scan (no CUDA
kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.interface import ModelInputs
from fxpipe.errors import InputError

__all__ = ["ZooModel", "get", "names", "FAMILIES", "GROUPS", "ModelInputs"]

FAMILIES = ("decoder", "moe", "ssm", "encoder", "encoder-decoder", "vision", "two-tower", "vision-language", "speech", "dag")

#: ``"core"``: the first round of architectures (issue 8); ``"second"``: the second (issue 17);
#: ``"third"``: models of the third robustness round (issue 30)
GROUPS = ("core", "second", "third")

VOCAB = 96
SEQ = 8
HIDDEN = 32
IMAGE = 32
AUDIO_SAMPLES = 400


# ----------------------------------------------------------------------------- losses
def _logits(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        return out["logits"]
    return out[0]


def token_loss(out, target):
    """Cross entropy of ``out.logits`` ``(..., V)`` against ids ``(...)`` (language models, CTC frames)."""
    logits = _logits(out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def moe_loss(out, target):
    """Token cross entropy plus the router's load-balancing auxiliary loss (a 0-dim model output)."""
    return token_loss(out, target) + 0.02 * out["aux_loss"]


def class_loss(out, target):
    """Cross entropy of ``out.logits`` ``(B, C)`` against class ids ``(B,)``."""
    return F.cross_entropy(_logits(out).float(), target)


def contrastive_loss(out, target):
    """CLIP's symmetric InfoNCE on ``logits_per_image`` ``(B, B)``; ``target`` is ``arange(B)``."""
    lpi = out["logits_per_image"]
    return 0.5 * (F.cross_entropy(lpi, target) + F.cross_entropy(lpi.t(), target))


def dict_dag_loss(out, target):
    """Loss of :class:`DictIO`: reads a dict output, a nested tuple and a 0-dim auxiliary output."""
    main = F.mse_loss(out["pred"], target["y"])
    aux, (feat, stats) = out["extras"]
    return main + 0.1 * aux + 0.01 * (feat.pow(2).mean() + stats.sum()) + 0.0 * target["w"]


def seg_loss(out, target):
    """Per-pixel cross entropy of ``out.logits`` ``(B, C, h, w)`` against class ids ``(B, h, w)`` (segmentation)."""
    return F.cross_entropy(_logits(out).float(), target)


def mse_loss(out, target):
    """Mean squared error of a tensor output (or ``out['pred']``)."""
    pred = out if isinstance(out, torch.Tensor) else out["pred"]
    return F.mse_loss(pred, target)


LOSSES: dict[str, Callable] = {
    "token": token_loss, "moe": moe_loss, "class": class_loss, "contrastive": contrastive_loss,
    "dict_dag": dict_dag_loss, "mse": mse_loss, "seg": seg_loss,
}


# ----------------------------------------------------------------------------- HF helpers
def _quiet_transformers():
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    return transformers


_DROP_KEYS = ("dropout", "pdrop", "drop_prob", "dropout_rate", "layerdrop", "drop_path", "mask_time_prob",
              "mask_feature_prob", "dropout_prob")


def _no_dropout(cfg) -> None:
    """Set every dropout-like probability of a config (and its sub-configs) to 0."""
    for key, val in list(vars(cfg).items()):
        if hasattr(val, "to_dict") and hasattr(val, "model_type"):
            _no_dropout(val)
        elif isinstance(val, float) and any(k in key for k in _DROP_KEYS):
            setattr(cfg, key, 0.0)


def _eager(cfg):
    cfg._attn_implementation = "eager"
    for sub in ("text_config", "vision_config", "encoder", "decoder", "audio_config"):
        s = getattr(cfg, sub, None)
        if s is not None and hasattr(s, "model_type"):
            _eager(s)
    return cfg


def _hf(model_cls: str, config_cls: str, **cfg):
    t = _quiet_transformers()
    config = getattr(t, config_cls)(**cfg)
    _no_dropout(config)
    _eager(config)
    return getattr(t, model_cls)(config)


def _ids(g, b, s=SEQ, vocab=VOCAB, low=0):
    return torch.randint(low, vocab, (b, s), generator=g)


_DEC = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


# Each builder: (batch size, generator) -> (model or None, args, kwargs, target).
# model is built only when `build` is true (batches reuse the builder without a model).

def _decoder(model_cls, config_cls, **over):
    def build(b, g, build=True):
        model = _hf(model_cls, config_cls, **{**_DEC, **over}) if build else None
        ids = _ids(g, b, SEQ + 1, low=3)
        return model, (ids[:, :-1],), {"use_cache": False}, ids[:, 1:]

    return build


def _gpt2(b, g, build=True):
    model = _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4,
                n_positions=64, bos_token_id=1, eos_token_id=2, use_cache=False) if build else None
    if model is not None:
        model.train()  # training mode with dropout p = 0: no random op may be reported
    ids = _ids(g, b, SEQ + 1, low=3)
    return model, (ids[:, :-1],), {"use_cache": False}, ids[:, 1:]


def _falcon(b, g, build=True):
    # parallel attention + MLP: FalconDecoderLayer does `mlp_output += attention_output`, an
    # in-place update that lands on a received tensor when a stage boundary falls between them
    model = _hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                num_attention_heads=4, num_kv_heads=1, new_decoder_architecture=False, parallel_attn=True,
                multi_query=True, alibi=False, bias=False, use_cache=False, bos_token_id=1, eos_token_id=2,
                max_position_embeddings=64) if build else None
    ids = _ids(g, b, SEQ + 1, low=3)
    return model, (ids[:, :-1],), {"use_cache": False}, ids[:, 1:]


def _moe(model_cls, config_cls, **over):
    def build(b, g, build=True):
        model = _hf(model_cls, config_cls, **{**_DEC, **over, "output_router_logits": True}) if build else None
        ids = _ids(g, b, SEQ + 1, low=3)
        return model, (ids[:, :-1],), {"use_cache": False, "output_router_logits": True}, ids[:, 1:]

    return build


_ENC = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, pad_token_id=0)


def _masked_lm(model_cls, config_cls, **over):
    def build(b, g, build=True):
        model = _hf(model_cls, config_cls, **{**_ENC, **over}) if build else None
        ids = _ids(g, b, low=3)
        mask = torch.ones(b, SEQ, dtype=torch.long)
        mask[:, -2:] = torch.randint(0, 2, (b, 2), generator=g)
        return model, (ids,), {"attention_mask": mask}, _ids(g, b, low=3)

    return build


def _t5(b, g, build=True):
    model = _hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64,
                num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                use_cache=False) if build else None
    ids, dec = _ids(g, b, low=3), _ids(g, b, SEQ + 1, low=3)
    return model, (ids,), {"decoder_input_ids": dec[:, :-1], "use_cache": False}, dec[:, 1:]


def _bart(b, g, build=True):
    model = _hf("BartForConditionalGeneration", "BartConfig", vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2,
                decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                decoder_start_token_id=2, forced_eos_token_id=None, use_cache=False) if build else None
    ids, dec = _ids(g, b, low=3), _ids(g, b, SEQ + 1, low=3)
    return model, (ids,), {"decoder_input_ids": dec[:, :-1], "use_cache": False}, dec[:, 1:]


_MELS, _FRAMES = 16, 32


def _whisper(b, g, build=True):
    model = _hf("WhisperForConditionalGeneration", "WhisperConfig", vocab_size=VOCAB, d_model=HIDDEN,
                encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=_MELS, max_source_positions=_FRAMES // 2,
                max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                use_cache=False, suppress_tokens=None, begin_suppress_tokens=None) if build else None
    feats = torch.randn(b, _MELS, _FRAMES, generator=g)
    dec = _ids(g, b, SEQ + 1, low=3)
    return model, (feats,), {"decoder_input_ids": dec[:, :-1], "use_cache": False}, dec[:, 1:]


def _image(b, g, channels=3, size=IMAGE):
    return torch.randn(b, channels, size, size, generator=g)


def _vit(b, g, build=True):
    model = _hf("ViTForImageClassification", "ViTConfig", hidden_size=HIDDEN, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=64, image_size=IMAGE, patch_size=8, num_labels=10) if build else None
    return model, (_image(b, g),), {}, torch.randint(0, 10, (b,), generator=g)


def _convnext(b, g, build=True):
    model = _hf("ConvNextForImageClassification", "ConvNextConfig", num_channels=3, patch_size=4,
                hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=IMAGE, num_labels=10) if build else None
    return model, (_image(b, g),), {}, torch.randint(0, 10, (b,), generator=g)


def _resnet(b, g, build=True):
    model = _hf("ResNetForImageClassification", "ResNetConfig", num_channels=3, embedding_size=16,
                hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10) if build else None
    if model is not None:
        model.train()  # BatchNorm in training mode: batch statistics, running stats and counters
    return model, (_image(b, g),), {}, torch.randint(0, 10, (b,), generator=g)


def _clip(model_cls, config_cls, text_cls, vision_cls):
    def build(b, g, build=True):
        model = None
        if build:
            t = _quiet_transformers()
            text = getattr(t, text_cls)(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=SEQ,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
            vision = getattr(t, vision_cls)(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=IMAGE, patch_size=8)
            cfg = getattr(t, config_cls)(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=HIDDEN)
            _no_dropout(cfg)
            _eager(cfg)
            model = getattr(t, model_cls)(cfg)
        ids = _ids(g, b, low=3)
        return model, (), {"input_ids": ids, "pixel_values": _image(b, g)}, torch.arange(b)

    return build


def _llava(b, g, build=True):
    model = None
    image_token = VOCAB - 1
    n_patches = (IMAGE // 8) ** 2
    if build:
        t = _quiet_transformers()
        vision = t.CLIPVisionConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, image_size=IMAGE, patch_size=8)
        text = t.LlamaConfig(**{**_DEC, "vocab_size": VOCAB})
        cfg = t.LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=image_token,
                            vision_feature_layer=-1, vision_feature_select_strategy="default",
                            projector_hidden_act="gelu", image_seq_length=n_patches)
        _no_dropout(cfg)
        _eager(cfg)
        model = t.LlavaForConditionalGeneration(cfg)
    text_len = SEQ
    ids = _ids(g, b, n_patches + text_len + 1, vocab=VOCAB - 1, low=3)
    ids[:, 1:1 + n_patches] = image_token  # <bos> <image> x n_patches, then text
    labels = ids[:, 1:].clone()
    return model, (), {"input_ids": ids[:, :-1], "pixel_values": _image(b, g), "use_cache": False}, labels


def _vision_encoder_decoder(b, g, build=True):
    model = None
    if build:
        t = _quiet_transformers()
        enc = t.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          image_size=IMAGE, patch_size=8)
        dec = t.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                           eos_token_id=2, add_cross_attention=True, is_decoder=True)
        cfg = t.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
        cfg.decoder_start_token_id = 1
        cfg.pad_token_id = 0
        _no_dropout(cfg)
        _eager(cfg)
        model = t.VisionEncoderDecoderModel(cfg)
    dec_ids = _ids(g, b, SEQ + 1, low=3)
    return model, (_image(b, g),), {"decoder_input_ids": dec_ids[:, :-1], "use_cache": False}, dec_ids[:, 1:]


_W2V = dict(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=4, feat_extract_norm="group", do_stable_layer_norm=False, pad_token_id=0)


def _wav2vec2(model_cls, config_cls):
    def build(b, g, build=True):
        model = _hf(model_cls, config_cls, **_W2V) if build else None
        frames = ((AUDIO_SAMPLES - 10) // 5 + 1 - 8) // 4 + 1
        return model, (torch.randn(b, AUDIO_SAMPLES, generator=g),), {}, torch.randint(0, 32, (b, frames), generator=g)

    return build


# ----------------------------------------------------------------------------- hand-written DAGs
class UNet(nn.Module):
    """A 3-level convolutional UNet: encoder convs + max-pooling, a bottleneck, decoder
    transposed convs whose inputs ``cat`` the encoder features of the same level (long skip
    connections that cross many stages), GroupNorm, a 1x1 output head."""

    def __init__(self, ch: int = 8):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.SiLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.SiLU())

        self.enc1, self.enc2, self.enc3 = block(3, ch), block(ch, 2 * ch), block(2 * ch, 4 * ch)
        self.mid = block(4 * ch, 4 * ch)
        self.up3 = nn.ConvTranspose2d(4 * ch, 4 * ch, 2, stride=2)
        self.dec3 = block(8 * ch, 2 * ch)
        self.up2 = nn.ConvTranspose2d(2 * ch, 2 * ch, 2, stride=2)
        self.dec2 = block(4 * ch, ch)
        self.up1 = nn.ConvTranspose2d(ch, ch, 2, stride=2)
        self.dec1 = block(2 * ch, ch)
        self.head = nn.Conv2d(ch, 3, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        m = self.mid(F.max_pool2d(e3, 2))
        d3 = self.dec3(torch.cat([self.up3(m), e3], dim=1))
        d2 = self.dec2(torch.cat([self.up2(d3), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1)


class BatchNormNet(nn.Module):
    """Conv/BatchNorm/ReLU stack trained in training mode (batch statistics in the forward,
    running mean/var and ``num_batches_tracked`` updated in place; bias-free convolutions as
    in ResNets), a BatchNorm1d over the pooled sequence, a linear head."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1, bias=False) for i in range(4))
        self.bns = nn.ModuleList(nn.BatchNorm2d(8) for _ in range(4))
        self.bn_seq = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 10)

    def forward(self, x):
        for conv, bn in zip(self.convs, self.bns):
            x = F.relu(bn(conv(x)))
        x = self.bn_seq(x.mean(dim=3))  # (B, C, H): statistics over B * H values per channel
        return self.out(x.mean(dim=2))


class TiedDeep(nn.Module):
    """Token model whose input embedding is reused, transposed, by the output projection six
    layers later (weights tied across distant layers), with a transposed activation crossing
    the middle of the network and a parameter that the forward never uses."""

    def __init__(self, vocab: int = VOCAB, d: int = HIDDEN, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(layers))
        self.mix = nn.Linear(SEQ, SEQ)  # mixes along the sequence: works on a transposed view
        self.norm = nn.LayerNorm(d)
        self.scale = d ** -0.5
        self.never_used = nn.Linear(d, d)  # the forward never touches it: gradient None

    def forward(self, ids):
        h = self.embed(ids)
        for i, layer in enumerate(self.layers):
            h = h + layer(h)
            if i == 1:
                h = h + self.mix(h.transpose(1, 2)).transpose(1, 2)
        return F.linear(self.norm(h) * self.scale, self.embed.weight)


class DictIO(nn.Module):
    """A model called as ``model({"x": ..., "parts": [a, b]}, scale=2.0, mode="sum")``: one
    positional dict holding a nested list, a keyword tensor, non-tensor constants; it returns a
    dict with a nested tuple, a 0-dim auxiliary output and a non-batch tensor."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp = nn.Linear(d, 2 * d)
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(d, 2 * d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2 * d, 2 * d), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(2 * d, d)
        self.feature_scale = nn.Parameter(torch.ones(2 * d))

    def forward(self, inputs, bias=None, scale: float = 1.0, mode: str = "sum"):
        h = self.inp(inputs["x"])
        a, b = inputs["parts"]
        h = h + self.a(a) if mode == "sum" else h * self.a(a)
        for i, blk in enumerate(self.blocks):
            h = blk(h)
            if i == 0:
                h = h + self.b(b) * scale
        if bias is not None:
            h = h + bias
        pred = self.head(h)
        aux = h.pow(2).mean()  # 0-dim auxiliary output
        stats = (h * self.feature_scale).mean(dim=0)  # non-batch output: (2d,)
        return {"pred": pred, "extras": (aux, (h, stats))}


class ReceivedInplace(nn.Module):
    """``h += skip`` on a tensor that a boundary can bring in from the previous stage, plus
    ``x.mul_()`` on a view of one (the Falcon pattern, made to sit on every possible cut)."""

    def __init__(self, d: int = HIDDEN):
        super().__init__()
        self.l1 = nn.Linear(d, d)
        self.l2 = nn.Linear(d, d)
        self.l3 = nn.Linear(d, d)
        self.l4 = nn.Linear(d, d)

    def forward(self, x):
        a = self.l1(x)
        b = torch.tanh(self.l2(a))
        c = self.l3(b)
        c += a  # in place, `a` produced earlier
        c[:, :4].mul_(0.5)  # in place through a view; `c` is read again below
        d = self.l4(c)
        d += b
        return torch.tanh(d) + c


def _unet(b, g, build=True):
    return (UNet() if build else None), (_image(b, g, size=16),), {}, torch.randn(b, 3, 16, 16, generator=g)


def _bnnet(b, g, build=True):
    model = BatchNormNet().train() if build else None
    return model, (_image(b, g, size=8),), {}, torch.randint(0, 10, (b,), generator=g)


def _tied(b, g, build=True):
    ids = _ids(g, b, SEQ + 1)
    return (TiedDeep() if build else None), (ids[:, :-1],), {}, ids[:, 1:]


def _dictio(b, g, build=True):
    d = 16
    x, a, bb = (torch.randn(b, d, generator=g) for _ in range(3))
    inputs = {"x": x, "parts": [a, bb]}
    target = {"y": torch.randn(b, d, generator=g), "w": torch.tensor(1.0)}
    return (DictIO() if build else None), (inputs,), {"scale": 2.0, "mode": "sum"}, target


def _inplace(b, g, build=True):
    return (ReceivedInplace() if build else None), (torch.randn(b, SEQ, HIDDEN, generator=g),), {}, \
        torch.randn(b, SEQ, HIDDEN, generator=g)


# ----------------------------------------------------------------------------- the second round (issue 17)
def _gptj_like(model_cls, config_cls):
    # GPT-J / CodeGen: parallel attention + MLP, rotary on part of each head, n_* config names
    def build(b, g, build=True):
        model = _hf(model_cls, config_cls, vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, rotary_dim=4,
                    n_positions=64, n_inner=64, bos_token_id=1, eos_token_id=2, use_cache=False,
                    tie_word_embeddings=False) if build else None
        ids = _ids(g, b, SEQ + 1, low=3)
        return model, (ids[:, :-1],), {"use_cache": False}, ids[:, 1:]

    return build


def _ssm(model_cls, config_cls, **over):
    # Mamba / Mamba2 without their CUDA kernels: the reference (torch) selective scan
    def build(b, g, build=True):
        model = _hf(model_cls, config_cls, vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, use_cache=False,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2, **over) if build else None
        ids = _ids(g, b, SEQ + 1, low=3)
        return model, (ids[:, :-1],), {"use_cache": False}, ids[:, 1:]

    return build


def _distilbert(b, g, build=True):
    model = _hf("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=VOCAB, dim=HIDDEN, n_layers=2, n_heads=4,
                hidden_dim=64, max_position_embeddings=64, pad_token_id=0) if build else None
    ids = _ids(g, b, low=3)
    mask = torch.ones(b, SEQ, dtype=torch.long)
    mask[:, -2:] = torch.randint(0, 2, (b, 2), generator=g)
    return model, (ids,), {"attention_mask": mask}, _ids(g, b, low=3)


def _t5_like(model_cls, config_cls, **over):
    def build(b, g, build=True):
        model = _hf(model_cls, config_cls, **{**dict(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0, use_cache=False, tie_word_embeddings=False), **over}) if build else None
        ids, dec = _ids(g, b, low=3), _ids(g, b, SEQ + 1, low=3)
        return model, (ids,), {"decoder_input_ids": dec[:, :-1], "use_cache": False}, dec[:, 1:]

    return build


def _bart_like(model_cls, config_cls, **over):
    def build(b, g, build=True):
        model = _hf(model_cls, config_cls, **{**dict(
            vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
            use_cache=False), **over}) if build else None
        ids, dec = _ids(g, b, low=3), _ids(g, b, SEQ + 1, low=3)
        return model, (ids,), {"decoder_input_ids": dec[:, :-1], "use_cache": False}, dec[:, 1:]

    return build


def _classifier(model_cls, config_cls, size=IMAGE, **cfg):
    def build(b, g, build=True):
        model = _hf(model_cls, config_cls, num_labels=10, **cfg) if build else None
        return model, (_image(b, g, size=size),), {}, torch.randint(0, 10, (b,), generator=g)

    return build


def _segformer(b, g, build=True):
    model = _hf("SegformerForSemanticSegmentation", "SegformerConfig", num_channels=3, num_encoder_blocks=2,
                depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=4) if build else None
    # logits at 1/4 of the input resolution
    return model, (_image(b, g),), {}, torch.randint(0, 4, (b, IMAGE // 4, IMAGE // 4), generator=g)


def _blip(b, g, build=True):
    model = None
    if build:
        t = _quiet_transformers()
        text = t.BlipTextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=64, encoder_hidden_size=HIDDEN,
                                bos_token_id=1, eos_token_id=2, pad_token_id=0, sep_token_id=2)
        vision = t.BlipVisionConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=IMAGE, patch_size=8)
        cfg = t.BlipConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=HIDDEN)
        _no_dropout(cfg)
        _eager(cfg)
        model = t.BlipForConditionalGeneration(cfg)
    ids = _ids(g, b, SEQ + 1, low=3)
    return model, (), {"pixel_values": _image(b, g), "input_ids": ids[:, :-1]}, ids[:, 1:]


class Inception(nn.Module):
    """Two Inception blocks (1x1 / 3x3 / 5x5 / pooled branches run in parallel and ``cat`` along
    channels), a stride-2 stem, global average pooling, a linear head."""

    class Block(nn.Module):
        def __init__(self, cin: int, c: int):
            super().__init__()
            self.b1 = nn.Conv2d(cin, c, 1)
            self.b3 = nn.Sequential(nn.Conv2d(cin, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
            self.b5 = nn.Sequential(nn.Conv2d(cin, c // 2, 1), nn.ReLU(), nn.Conv2d(c // 2, c, 5, padding=2))
            self.bp = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), nn.Conv2d(cin, c, 1))

        def forward(self, x):
            return F.relu(torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], dim=1))

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, 2 * c, 3, stride=2, padding=1)
        self.block1 = Inception.Block(2 * c, c)
        self.block2 = Inception.Block(4 * c, c)
        self.head = nn.Linear(4 * c, 10)

    def forward(self, x):
        x = self.block2(self.block1(F.relu(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


class RecurrentLM(nn.Module):
    """Embedding, a 2-layer LSTM, a GRU over the LSTM's outputs (both ``batch_first``), a linear head:
    cuDNN-style fused recurrent ops whose weights are flat parameter lists."""

    def __init__(self, vocab: int = VOCAB, d: int = HIDDEN):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, num_layers=2, batch_first=True)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h, _ = self.lstm(self.embed(ids))
        h2, _ = self.gru(h)
        return self.head(h + h2)


class MixedDtype(nn.Module):
    """A bfloat16 middle between float32 layers: parameters of two dtypes, casts at the edges."""

    def __init__(self, d: int = HIDDEN):
        super().__init__()
        self.inp = nn.Linear(d, 2 * d)
        self.mid = nn.Sequential(nn.Linear(2 * d, 2 * d), nn.GELU(), nn.Linear(2 * d, 2 * d)).to(torch.bfloat16)
        self.norm = nn.LayerNorm(2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + self.mid(h.to(torch.bfloat16)).float()
        return self.out(self.norm(h))


class ArgmaxOutput(nn.Module):
    """A classifier that also returns its integer predictions (``argmax``, no gradient) and a
    boolean mask of confident rows: outputs that are not differentiable, next to the logits."""

    def __init__(self, d: int = HIDDEN):
        super().__init__()
        self.l1 = nn.Linear(d, 2 * d)
        self.l2 = nn.Linear(2 * d, 2 * d)
        self.l3 = nn.Linear(2 * d, 10)

    def forward(self, x):
        h = F.gelu(self.l2(F.gelu(self.l1(x))))
        logits = self.l3(h)
        pred = logits.argmax(dim=-1)
        return {"logits": logits, "pred": pred, "confident": logits.softmax(-1).amax(-1) > 0.5}


class PaddedEmbed(nn.Module):
    """Token model whose embeddings have a ``padding_idx`` (row 0 gets no gradient) and whose
    inputs contain padding; an ``EmbeddingBag`` summary of the sequence is added to every position."""

    def __init__(self, vocab: int = VOCAB, d: int = HIDDEN):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.bag = nn.EmbeddingBag(vocab, d, mode="mean", padding_idx=0)
        self.body = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.embed(ids) + self.bag(ids).unsqueeze(1)
        return self.head(h + self.body(h))


def _inception(b, g, build=True):
    return (Inception() if build else None), (_image(b, g, size=16),), {}, torch.randint(0, 10, (b,), generator=g)


def _recurrent(b, g, build=True):
    ids = _ids(g, b, SEQ + 1, low=3)
    return (RecurrentLM() if build else None), (ids[:, :-1],), {}, ids[:, 1:]


def _mixed(b, g, build=True):
    return (MixedDtype() if build else None), (torch.randn(b, HIDDEN, generator=g),), {}, torch.randn(b, HIDDEN, generator=g)


def _argmax(b, g, build=True):
    return (ArgmaxOutput() if build else None), (torch.randn(b, HIDDEN, generator=g),), {}, \
        torch.randint(0, 10, (b,), generator=g)


def _padded(b, g, build=True):
    ids = _ids(g, b, SEQ + 1, low=3)
    ids[:, -3:] = 0  # trailing padding
    return (PaddedEmbed() if build else None), (ids[:, :-1],), {}, ids[:, 1:]


@dataclass(frozen=True)
class _Entry:
    family: str
    build: Callable
    loss: str
    group: str = "core"


_REGISTRY: dict[str, _Entry] = {
    # decoders
    "gpt2": _Entry("decoder", _gpt2, "token"),
    "llama": _Entry("decoder", _decoder("LlamaForCausalLM", "LlamaConfig"), "token"),
    "mistral": _Entry("decoder", _decoder("MistralForCausalLM", "MistralConfig", sliding_window=4), "token"),
    "qwen2": _Entry("decoder", _decoder("Qwen2ForCausalLM", "Qwen2Config", tie_word_embeddings=True), "token"),
    "gemma": _Entry("decoder", _decoder("GemmaForCausalLM", "GemmaConfig", head_dim=8), "token"),
    "falcon": _Entry("decoder", _falcon, "token"),
    "phi": _Entry("decoder", _decoder("PhiForCausalLM", "PhiConfig", num_key_value_heads=4, partial_rotary_factor=0.5), "token"),
    "gpt_neox": _Entry("decoder", _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", rotary_pct=0.5), "token"),
    "opt": _Entry("decoder", _decoder("OPTForCausalLM", "OPTConfig", ffn_dim=64, word_embed_proj_dim=HIDDEN,
                                      num_attention_heads=4), "token"),
    "bloom": _Entry("decoder", _decoder("BloomForCausalLM", "BloomConfig", n_head=4, n_layer=2), "token"),
    # mixture of experts with the router's auxiliary loss in the model output
    "mixtral": _Entry("moe", _moe("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2), "moe"),
    "qwen2_moe": _Entry("moe", _moe("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=32), "moe"),
    # encoders
    "bert": _Entry("encoder", _masked_lm("BertForMaskedLM", "BertConfig"), "token"),
    "roberta": _Entry("encoder", _masked_lm("RobertaForMaskedLM", "RobertaConfig", max_position_embeddings=72), "token"),
    "albert": _Entry("encoder", _masked_lm("AlbertForMaskedLM", "AlbertConfig", embedding_size=16), "token"),
    # encoder-decoders
    "t5": _Entry("encoder-decoder", _t5, "token"),
    "bart": _Entry("encoder-decoder", _bart, "token"),
    # vision
    "vit": _Entry("vision", _vit, "class"),
    "convnext": _Entry("vision", _convnext, "class"),
    "resnet": _Entry("vision", _resnet, "class"),
    # two-tower
    "clip": _Entry("two-tower", _clip("CLIPModel", "CLIPConfig", "CLIPTextConfig", "CLIPVisionConfig"), "contrastive"),
    "siglip": _Entry("two-tower", _clip("SiglipModel", "SiglipConfig", "SiglipTextConfig", "SiglipVisionConfig"), "contrastive"),
    # vision-language
    "llava": _Entry("vision-language", _llava, "token"),
    "vision_encoder_decoder": _Entry("vision-language", _vision_encoder_decoder, "token"),
    # speech
    "whisper": _Entry("speech", _whisper, "token"),
    "wav2vec2": _Entry("speech", _wav2vec2("Wav2Vec2ForCTC", "Wav2Vec2Config"), "token"),
    "hubert": _Entry("speech", _wav2vec2("HubertForCTC", "HubertConfig"), "token"),
    # hand-written DAGs
    "unet": _Entry("dag", _unet, "mse"),
    "batchnorm": _Entry("dag", _bnnet, "class"),
    "tied_deep": _Entry("dag", _tied, "token"),
    "dict_io": _Entry("dag", _dictio, "dict_dag"),
    "received_inplace": _Entry("dag", _inplace, "mse"),
}

_MOE2 = dict(num_local_experts=4, num_experts_per_tok=2)
_SECOND: dict[str, _Entry] = {  # issue 17: the second round of architectures
    "olmo2": _Entry("decoder", _decoder("Olmo2ForCausalLM", "Olmo2Config"), "token"),
    "starcoder2": _Entry("decoder", _decoder("Starcoder2ForCausalLM", "Starcoder2Config"), "token"),
    "gptj": _Entry("decoder", _gptj_like("GPTJForCausalLM", "GPTJConfig"), "token"),
    "codegen": _Entry("decoder", _gptj_like("CodeGenForCausalLM", "CodeGenConfig"), "token"),
    "cohere": _Entry("decoder", _decoder("CohereForCausalLM", "CohereConfig"), "token"),
    "granite": _Entry("decoder", _decoder("GraniteForCausalLM", "GraniteConfig", embedding_multiplier=2.0,
                                          residual_multiplier=0.5, logits_scaling=2.0), "token"),
    "stablelm": _Entry("decoder", _decoder("StableLmForCausalLM", "StableLmConfig"), "token"),
    "mamba": _Entry("ssm", _ssm("MambaForCausalLM", "MambaConfig", state_size=8, expand=2, conv_kernel=4,
                                time_step_rank=4), "token"),
    "mamba2": _Entry("ssm", _ssm("Mamba2ForCausalLM", "Mamba2Config", num_heads=8, head_dim=8, expand=2, n_groups=1,
                                 state_size=8, conv_kernel=4, chunk_size=4, time_step_rank=4), "token"),
    "jamba": _Entry("ssm", _moe("JambaForCausalLM", "JambaConfig", num_experts=4, num_experts_per_tok=2,
                                attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                                use_mamba_kernels=False), "moe"),
    "granitemoe": _Entry("moe", _moe("GraniteMoeForCausalLM", "GraniteMoeConfig", **_MOE2), "moe"),
    "xlm_roberta": _Entry("encoder", _masked_lm("XLMRobertaForMaskedLM", "XLMRobertaConfig", max_position_embeddings=72), "token"),
    "deberta_v2": _Entry("encoder", _masked_lm("DebertaV2ForMaskedLM", "DebertaV2Config", relative_attention=True,
                                               pos_att_type=["p2c", "c2p"], position_buckets=8,
                                               max_relative_positions=16), "token"),
    "electra": _Entry("encoder", _masked_lm("ElectraForMaskedLM", "ElectraConfig", embedding_size=16), "token"),
    "distilbert": _Entry("encoder", _distilbert, "token"),
    "modernbert": _Entry("encoder", _masked_lm("ModernBertForMaskedLM", "ModernBertConfig", global_attn_every_n_layers=2,
                                               local_attention=4), "token"),
    "mt5": _Entry("encoder-decoder", _t5_like("MT5ForConditionalGeneration", "MT5Config"), "token"),
    "umt5": _Entry("encoder-decoder", _t5_like("UMT5ForConditionalGeneration", "UMT5Config"), "token"),
    "pegasus": _Entry("encoder-decoder", _bart_like("PegasusForConditionalGeneration", "PegasusConfig"), "token"),
    "marian": _Entry("encoder-decoder", _bart_like("MarianMTModel", "MarianConfig", decoder_vocab_size=VOCAB,
                                                   decoder_start_token_id=0), "token"),
    "mbart": _Entry("encoder-decoder", _bart_like("MBartForConditionalGeneration", "MBartConfig"), "token"),
    "swin": _Entry("vision", _classifier("SwinForImageClassification", "SwinConfig", image_size=IMAGE, patch_size=4,
                                         embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4), "class"),
    "deit": _Entry("vision", _classifier("DeiTForImageClassification", "DeiTConfig", hidden_size=HIDDEN,
                                         num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                         image_size=IMAGE, patch_size=8), "class"),
    "dinov2": _Entry("vision", _classifier("Dinov2ForImageClassification", "Dinov2Config", hidden_size=HIDDEN,
                                           num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=IMAGE,
                                           patch_size=8), "class"),
    "segformer": _Entry("vision", _segformer, "seg"),
    "mobilevit": _Entry("vision", _classifier("MobileViTForImageClassification", "MobileViTConfig", size=64,
                                              image_size=64, patch_size=2, hidden_sizes=[16, 16, 24],
                                              neck_hidden_sizes=[8, 8, 16, 16, 16, 24, 32], num_attention_heads=2,
                                              expand_ratio=2.0), "class"),
    "efficientnet": _Entry("vision", _classifier("EfficientNetForImageClassification", "EfficientNetConfig",
                                                 image_size=IMAGE, width_coefficient=0.25, depth_coefficient=1.0,
                                                 kernel_sizes=[3, 5], in_channels=[32, 16], out_channels=[16, 24],
                                                 depthwise_padding=[], strides=[1, 2], num_block_repeats=[1, 1],
                                                 expand_ratios=[1, 6], hidden_dim=320), "class"),
    "regnet": _Entry("vision", _classifier("RegNetForImageClassification", "RegNetConfig", embedding_size=16,
                                           hidden_sizes=[16, 32], depths=[1, 1], groups_width=8, layer_type="x"),
                     "class"),
    "wav2vec2_conformer": _Entry("speech", _wav2vec2("Wav2Vec2ConformerForCTC", "Wav2Vec2ConformerConfig"), "token"),
    "blip": _Entry("vision-language", _blip, "token"),
    "inception": _Entry("dag", _inception, "class"),
    "lstm_gru": _Entry("dag", _recurrent, "token"),
    "mixed_dtype": _Entry("dag", _mixed, "mse"),
    "argmax_output": _Entry("dag", _argmax, "class"),
    "padding_idx": _Entry("dag", _padded, "token"),
}
_REGISTRY.update({k: _Entry(e.family, e.build, e.loss, "second") for k, e in _SECOND.items()})


def _t5_mixed(b, g, build=True):
    """T5 as transformers loads it with ``dtype=torch.bfloat16``: every weight in bfloat16 except the
    feed-forward output projections ``wo`` (``T5PreTrainedModel._keep_in_fp32_modules``), kept in float32.

    Compare it after one step: its bf16 gradients depend on the order the micro-batches' gradients are
    summed in (about 1 bf16 ulp), and a bf16 weight update amplifies that by the next step. One process
    backpropagating its 4 micro-batches one by one differs from its own single backward by 0.0048 of the
    largest gradient at step 1 and 0.026 at step 2, exactly what a pipeline differs by."""
    model, args, kwargs, target = _t5(b, g, build)
    if model is not None:
        model.to(torch.bfloat16)
        for name in getattr(model, "_keep_in_fp32_modules", None) or ["wo"]:
            for mod_name, mod in model.named_modules():
                if mod_name.split(".")[-1] == name:
                    mod.float()
    return model, args, kwargs, target


_BEIT = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=IMAGE,
             patch_size=8, use_relative_position_bias=True, use_mean_pooling=True)
_THIRD: dict[str, _Entry] = {  # issue 30: the architectures of the third robustness round
    # the MLM decoder uses the tied word embedding as cat([decoder.weight.t(), dense.weight])
    "mobilebert": _Entry("encoder", _masked_lm("MobileBertForMaskedLM", "MobileBertConfig", embedding_size=16,
                                               intra_bottleneck_size=16, true_hidden_size=16,
                                               num_feedforward_networks=2), "token"),
    # relative position bias: an index tensor torch.export lifts out of forward (lifted_tensor_*)
    "beit": _Entry("vision", _classifier("BeitForImageClassification", "BeitConfig", **_BEIT), "class"),
    # one relative position bias shared by its 4 layers: its index is built in forward by in-place updates
    # of a contiguous() copy, which a stage boundary between the updates used to lose (issue 30 item 15)
    "data2vec_vision": _Entry("vision", _classifier("Data2VecVisionForImageClassification", "Data2VecVisionConfig",
                                                    **{**_BEIT, "num_hidden_layers": 4, "use_relative_position_bias": False,
                                                       "use_shared_relative_position_bias": True}), "class"),
    # bfloat16 and float32 parameters (transformers' _keep_in_fp32_modules)
    "t5_mixed": _Entry("encoder-decoder", _t5_mixed, "token"),
}
_REGISTRY.update({k: _Entry(e.family, e.build, e.loss, "third") for k, e in _THIRD.items()})


#: models trained in training mode (BatchNorm statistics; GPT-2 with dropout p = 0)
_TRAIN_MODE = ("gpt2", "resnet", "batchnorm")


def names(family: str | None = None, group: str | None = None) -> list[str]:
    """Names of the zoo's models, in a fixed order: of one family and / or one group, if given.

    ``group``: ``"core"`` (the first 32, issue 8) or ``"second"`` (the second round, issue 17).
    """
    if family is not None and family not in FAMILIES:
        raise InputError(f"unknown family {family!r}; use one of {FAMILIES}")
    if group is not None and group not in GROUPS:
        raise InputError(f"unknown group {group!r}; use one of {GROUPS}")
    return [k for k, e in _REGISTRY.items() if (family is None or e.family == family) and (group is None or e.group == group)]


@dataclass(frozen=True)
class ZooModel:
    """A picklable model + data factory (``make_model`` / ``make_batch`` / ``loss``).

    Attributes
    ----------
    name : str
        Entry of :func:`names`.
    microbatches : int
        Micro-batches per training step.
    microbatch_size : int
        Samples per micro-batch.
    seed : int
        Seed of the weights and of every batch.
    """

    name: str
    microbatches: int = 4
    microbatch_size: int = 2
    seed: int = 0

    def __post_init__(self):
        if self.name not in _REGISTRY:
            raise InputError(f"unknown zoo model {self.name!r}; known: {', '.join(_REGISTRY)}")

    @property
    def family(self) -> str:
        return _REGISTRY[self.name].family

    @property
    def loss(self) -> Callable:
        """The loss ``loss(output, target)`` for this model's output structure (module-level, picklable)."""
        return LOSSES[_REGISTRY[self.name].loss]

    def _make(self, batch: int, g: torch.Generator, build: bool):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model, args, kwargs, target = _REGISTRY[self.name].build(batch, g, build)
        if model is not None and self.name not in _TRAIN_MODE:
            model.eval()
        return model, args, kwargs, target

    def one_microbatch(self):
        """``(model, args, kwargs)`` with one micro-batch of inputs: what ``fxpipe.compile`` captures."""
        g = torch.Generator().manual_seed(self.seed)
        model, args, kwargs, _ = self._make(self.microbatch_size, g, True)
        return model, args, kwargs

    def __call__(self):
        """``make_model()``: the model and a full batch of inputs (``ModelInputs``)."""
        model, args, kwargs = self.one_microbatch()
        inputs, _ = self.batch(0)
        return model, inputs

    def batch(self, step: int):
        """``make_batch(step)``: ``(inputs, target)`` of a full batch (``microbatches * microbatch_size``)."""
        g = torch.Generator().manual_seed(self.seed * 1000 + 17 + step)
        _, args, kwargs, target = self._make(self.microbatches * self.microbatch_size, g, False)
        if _REGISTRY[self.name].loss == "contrastive":  # matching pairs within each micro-batch
            target = torch.arange(self.microbatch_size).repeat(self.microbatches)
        return ModelInputs(args, kwargs), target


def get(name: str, *, microbatches: int = 4, microbatch_size: int = 2, seed: int = 0) -> ZooModel:
    """The zoo model ``name`` (see :func:`names`).

    Raises
    ------
    InputError
        For an unknown name.
    """
    return ZooModel(name, microbatches=microbatches, microbatch_size=microbatch_size, seed=seed)
