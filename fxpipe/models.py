"""Model builders for the CLI, tests and benchmarks: any Hugging Face architecture, offline.

:func:`build_hf_model` turns what a user has into ``(model, example_args, example_kwargs)``
of ONE micro-batch, ready for :func:`fxpipe.compile`. Three kinds of names are accepted:

* a preset of :data:`ARCHS` (``gpt2``, ``t5``, ``llama``, ``mixtral``, ``llama-2-7b``,
  ``llama-3-70b``): published dimensions or small test defaults;
* any ``model_type`` that ``transformers.AutoConfig.for_model`` knows (``qwen3``, ``bert``,
  ``whisper``, ``llava``, ...), built from its default config shrunk to small sizes
  (:data:`TINY`: 2 layers, width 64, 4 heads, ...) so that a CPU run is quick, with the head
  of a task (:data:`TASKS`, inferred when not given);
* a path to a ``config.json`` or to a checkpoint folder holding one (its sizes kept as
  written; weights read from its safetensors files when built on ``cpu``).

The model is wrapped in a small ``nn.Module`` (:class:`LogitsOnly` for presets,
:class:`HFHead` otherwise) that calls the Hugging Face model without KV cache and returns one
tensor (the logits, or the last hidden state of a headless model), so the exported graph has a
single tensor output and positional inputs (what a pipeline's first stage receives).
Parameter names inside the wrapper start with ``model.`` (:data:`WRAPPER_PREFIX`).

Example inputs are built from the config per modality (:func:`input_recipe`): token ids,
pixel values, audio samples or features, decoder ids for encoder-decoders, and image
placeholder tokens matching the vision tower's feature count for vision-language models.

:func:`load_model_factory` loads the user's own model, ``package.module:factory``.

Building on ``device="meta"`` allocates no weight memory, so a Llama-3-70B config can be
captured and costed on a laptop. Attention is Hugging Face's default (SDPA where the
architecture supports it); the parameter dtype is the config's (``dtype`` / ``torch_dtype``),
float32 when it names none.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import inspect
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from fxpipe.errors import InputError, MissingDependencyError
from fxpipe.io import read_json

#: Attribute name under which :class:`LogitsOnly` holds the Hugging Face model.
WRAPPER_PREFIX = "model"

#: Presets: name -> (base architecture, default overrides). Small defaults keep tests fast;
#: presets give published model dimensions and the dtype of the published checkpoint. Any
#: other transformers ``model_type`` is built generically (:data:`TINY` sizes).
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt2", {}),  # GPT-2 small (124M): 12 layers, 768 hidden, 12 heads, vocab 50257
    "t5": ("t5", {}),  # T5-small: 6+6 layers, d_model 512, 8 heads, d_ff 2048, vocab 32128
    "llama": ("llama", {
        "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 688, "vocab_size": 1024,
        "max_position_embeddings": 512,
    }),
    "mixtral": ("mixtral", {
        "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1024,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 512,
    }),
    # Llama-2-7B dimensions (Touvron et al. 2023, Table 1; HF meta-llama/Llama-2-7b-hf config.json)
    "llama-2-7b": ("llama", {
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "dtype": "float16",  # its config.json: float16
    }),
    # Llama-3-8B dimensions (Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 3;
    # HF meta-llama/Meta-Llama-3-8B config.json: vocab 128256, rope theta 500000, GQA 8 KV heads)
    "llama-3-8b": ("llama", {
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "dtype": "bfloat16",  # its config.json
    }),
    # Llama-3-70B dimensions (Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 3;
    # HF meta-llama/Meta-Llama-3-70B config.json: vocab 128256, rope theta 500000, GQA 8 KV heads)
    "llama-3-70b": ("llama", {
        "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
        "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "dtype": "bfloat16",  # its config.json
    }),
    # Llama-3.1-405B dimensions (Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 3;
    # HF meta-llama/Llama-3.1-405B config.json: 126 layers, hidden 16384, GQA 128/8 heads, FFN 53248,
    # vocab 128256; its "llama3" rope scaling changes no cost and is left at the default type)
    "llama-3.1-405b": ("llama", {
        "num_hidden_layers": 126, "hidden_size": 16384, "num_attention_heads": 128,
        "num_key_value_heads": 8, "intermediate_size": 53248, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "dtype": "bfloat16",
    }),
}

#: Example-input keys that are not config fields: batch size and sequence length.
_INPUT_KEYS = ("batch_size", "seq_len", "decoder_seq_len", "attn_implementation")


def parse_overrides(items: Sequence[str] | None) -> dict[str, Any]:
    """Parse ``["n_layer=8", "n_embd=128", "activation_function=gelu"]`` into a dict.

    Values are read as Python literals (int, float, bool, None, str in quotes); anything
    that is not a literal is kept as a string.

    Raises
    ------
    InputError
        If an item has no ``=`` or an empty key.
    """
    out: dict[str, Any] = {}
    for item in items or ():
        if "=" not in item:
            raise InputError(f"override {item!r} must look like key=value, e.g. n_layer=8")
        key, _, raw = item.partition("=")
        key = key.strip()
        if not key:
            raise InputError(f"override {item!r} has an empty key")
        raw = raw.strip()
        low = raw.lower()
        if low in ("true", "false"):
            val: Any = low == "true"
        elif low in ("none", "null"):
            val = None
        else:
            try:
                val = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                val = raw
        out[key] = val
    return out


#: Suffixes / prefixes of config fields that count something (layers, heads, experts) or size
#: something (hidden, intermediate, vocabulary): such a field must be an integer >= 1.
_COUNT_SUFFIXES = ("_layers", "_size", "_heads", "_experts", "_positions", "_model", "_ff", "_kv", "_per_tok")
_COUNT_PREFIXES = ("num_", "n_")
#: Fields that are probabilities.
_PROB_SUFFIXES = ("dropout", "_pdrop", "dropout_rate", "dropout_prob")


def _is_count_field(key: str) -> bool:
    return key.startswith(_COUNT_PREFIXES) or key.endswith(_COUNT_SUFFIXES) or key in ("d_model", "d_ff", "d_kv")


def _check_override_values(base: str, default_cfg: Any, cfg_kwargs: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """Reject config overrides that make no sense before transformers sees them.

    A field whose default is an integer and whose name says it counts or sizes something
    (``n_layer``, ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
    ``num_local_experts``, ...) must be an integer >= 1; a dropout probability must lie in
    [0, 1]; an ``*_eps`` must be > 0.

    Raises
    ------
    InputError
        Naming the field, the bad value and what is allowed.
    """
    for key in overrides:
        if key in _INPUT_KEYS or key not in cfg_kwargs:
            continue
        val = cfg_kwargs[key]
        default = getattr(default_cfg, key, None)
        if isinstance(default, int) and not isinstance(default, bool) and _is_count_field(key):
            if isinstance(val, bool) or not isinstance(val, int):
                raise InputError(f"{base} config field {key} must be an integer >= 1, got {val!r}")
            if val < 1:
                raise InputError(f"{base} config field {key} must be >= 1, got {val}: a model needs at least one")
        elif key.endswith(_PROB_SUFFIXES) and val is not None:
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0.0 <= float(val) <= 1.0:
                raise InputError(f"{base} config field {key} is a probability and must lie in [0, 1], got {val!r}")
        elif key.endswith(("_eps", "_epsilon")) and val is not None:
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not float(val) > 0.0:
                raise InputError(f"{base} config field {key} must be a positive number, got {val!r}")


class LogitsOnly(torch.nn.Module):
    """Call a Hugging Face model without KV cache and return its ``logits`` tensor.

    The Hugging Face model is the attribute ``model`` (module paths start with ``model.``,
    :data:`WRAPPER_PREFIX`). Defined at module level so that it pickles (spawned workers).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, decoder_input_ids=None):
        # positional inputs only: a pipeline feeds stage 0 a tuple of tensors, and T5's
        # own second positional argument is attention_mask, not decoder_input_ids
        kwargs = {} if decoder_input_ids is None else {"decoder_input_ids": decoder_input_ids}
        out = self.model(input_ids, use_cache=False, return_dict=True, **kwargs)
        return out.logits


def logits_only(model: torch.nn.Module) -> LogitsOnly:
    """Wrap a Hugging Face model so its forward returns the logits tensor."""
    return LogitsOnly(model)


def _build_preset(
    arch: str,
    overrides: Mapping[str, Any] | None = None,
    device: str = "cpu",
    dtype: Any = None,
    *,
    seed: int = 0,
):
    """One of the presets of :data:`ARCHS` (see :func:`build_hf_model`).

    Parameters
    ----------
    arch : str
        One of ``"gpt2"``, ``"t5"``, ``"llama"``, ``"mixtral"`` or the presets
        ``"llama-2-7b"`` (32 layers, hidden 4096, 32 heads, intermediate 11008, vocab 32000,
        float16), ``"llama-3-8b"`` (32 layers, hidden 4096, GQA 32/8 heads, intermediate 14336,
        vocab 128256, bfloat16), ``"llama-3-70b"`` (80 layers, hidden 8192, GQA 64/8 heads,
        bfloat16) and ``"llama-3.1-405b"`` (126 layers, hidden 16384, GQA 128/8 heads, intermediate
        53248, bfloat16).
    overrides : mapping, optional
        Config fields to override (e.g. ``{"n_layer": 2, "n_embd": 64}``), plus the
        example-input sizes ``batch_size`` (default 1), ``seq_len`` (default 128) and, for T5,
        ``decoder_seq_len`` (default ``seq_len``), and ``attn_implementation`` (``"sdpa"``, the
        default as in Hugging Face, or ``"eager"``). The example inputs are ONE micro-batch:
        the cost model costs exactly these shapes.
    device : {"cpu", "meta"}
        ``"meta"`` allocates no weights (shapes only); the model then cannot be run, only
        captured and costed.
    dtype : torch.dtype or str, optional
        Parameter dtype (default: the config's ``dtype``, which ``overrides`` may set; float32
        when it names none).
    seed : int
        Seed for the random weights and inputs.

    Returns
    -------
    model : torch.nn.Module
        :class:`LogitsOnly` wrapper in eval mode (dropout off); forward returns logits of
        shape ``(batch, seq, vocab)``.
    example_args : tuple
        ``(input_ids,)``, int64 of shape ``(batch_size, seq_len)``; for T5
        ``(input_ids, decoder_input_ids)`` (positional, so a pipeline's stage 0 and the
        eager model take the same tuple).
    example_kwargs : dict
        ``{}`` (kept for the ``(model, args, kwargs)`` calling convention).

    Raises
    ------
    InputError
        For an unknown architecture, an unknown config field, or an unknown device.
    """
    try:
        import transformers
    except ImportError:
        raise MissingDependencyError(
            "building Hugging Face architectures needs the transformers package, which is not installed: "
            'from a checkout of fxpipe, pip install -e ".[hf]" (fxpipe is not on PyPI)'
        ) from None

    if arch not in ARCHS:
        raise InputError(f"unknown model architecture {arch!r}; known: {sorted(ARCHS)}")
    if device not in ("cpu", "meta"):
        raise InputError(f"device must be 'cpu' or 'meta', got {device!r}")
    base, defaults = ARCHS[arch]
    cfg_kwargs = dict(defaults)
    inputs = {"batch_size": 1, "seq_len": 128, "decoder_seq_len": None, "attn_implementation": None}
    for key, val in (overrides or {}).items():
        if key in _INPUT_KEYS:
            inputs[key] = val
        else:
            cfg_kwargs[key] = val
    cfg_cls = {
        "gpt2": transformers.GPT2Config,
        "t5": transformers.T5Config,
        "llama": transformers.LlamaConfig,
        "mixtral": transformers.MixtralConfig,
    }[base]
    model_cls = {
        "gpt2": transformers.GPT2LMHeadModel,
        "t5": transformers.T5ForConditionalGeneration,
        "llama": transformers.LlamaForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
    }[base]
    default_cfg = cfg_cls()
    known = set(default_cfg.to_dict())
    unknown = [k for k in cfg_kwargs if k not in known and not hasattr(default_cfg, k)]
    if unknown:
        raise InputError(
            f"unknown {base} config field(s) {unknown}; known fields include "
            f"{sorted(k for k in known if not k.startswith('_'))[:40]}"
        )
    _check_override_values(base, default_cfg, cfg_kwargs, overrides or {})
    cfg_kwargs.setdefault("use_cache", False)
    vocab_given = cfg_kwargs.get("vocab_size")
    if base == "gpt2" and vocab_given is not None:
        # GPT-2's special tokens are id 50256: keep them inside a smaller test vocabulary
        for tok in ("bos_token_id", "eos_token_id"):
            cfg_kwargs.setdefault(tok, min(50256, int(vocab_given) - 1))
    try:
        config = cfg_cls(**cfg_kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation errors have many types
        msg = " ".join(str(exc).split())
        raise InputError(f"invalid {base} config {cfg_kwargs}: {msg[:300]}") from None
    bs, sl, dsl = _input_sizes(inputs)
    max_pos = getattr(config, "n_positions", None) if base == "gpt2" else getattr(config, "max_position_embeddings", None)
    if max_pos is not None and base != "t5" and sl > int(max_pos):
        raise InputError(f"seq_len {sl} exceeds the model's {int(max_pos)} positions: raise n_positions / max_position_embeddings or shorten seq_len")
    # default SDPA as in Hugging Face: one fused scaled_dot_product_attention op per layer
    # (FlashAttention-like costs); "eager" gives explicit matmul/softmax ops
    attn = _check_attn(inputs["attn_implementation"]) or "sdpa"
    config._attn_implementation = attn
    dtype = resolve_dtype(dtype, config)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        try:
            if device == "meta":
                with torch.device("meta"):
                    hf = model_cls(config)
            else:
                hf = model_cls(config)
        except (TypeError, ValueError, RuntimeError) as exc:  # e.g. hidden size not divisible by heads
            raise InputError(f"cannot build {base} from config {cfg_kwargs}: {str(exc).splitlines()[0]}") from None
    if device == "meta":
        stray_state_to_meta(hf)
    hf = hf.to(dtype=dtype)
    hf.eval()
    model = logits_only(hf).eval()
    model.fxpipe_info = {"source": "preset", "model_type": base, "model_class": model_cls.__name__,
                         "task": "seq2seq" if base == "t5" else "causal-lm", "sizes": "preset",
                         "dtype": str(dtype).replace("torch.", ""), "attn_implementation": attn,
                         "weights": "random" if device != "meta" else "none (meta)",
                         "inputs": ["input_ids", "decoder_input_ids"] if base == "t5" else ["input_ids"]}

    vocab = int(config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (bs, sl), generator=gen)
    args: tuple = (input_ids,)
    if base == "t5":
        args = (input_ids, torch.randint(0, vocab, (bs, dsl), generator=gen))
    if device == "meta":
        args = tuple(a.to("meta") for a in args)
    return model, args, {}


def stray_state_to_meta(model: torch.nn.Module) -> int:
    """Move to ``meta`` the parameters and buffers a model built under ``torch.device("meta")`` still
    holds elsewhere; returns how many tensors moved.

    A legacy constructor ignores the device context: XLNet's attention weights are
    ``nn.Parameter(torch.FloatTensor(...))``, so they come out on CPU (uninitialised memory, no
    trained weights) beside the meta ones, and the capture fails on the first op that meets both.
    Tied tensors stay tied (one moved tensor per original).
    """
    from fxpipe.codegen.runtime import module_tensor_slots, set_tensor_slot  # lazy: torch.distributed

    moved: dict[int, torch.Tensor] = {}
    for _, mod, kind, key, t in module_tensor_slots(model):
        if t.device.type == "meta":
            continue
        new = moved.get(id(t))
        if new is None:
            new = t.detach().to("meta")
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            moved[id(t)] = new
        set_tensor_slot(mod, kind, key, new)
    return len(moved)


# ----------------------------------------------------------------------------- dtype and attention
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(value: Any) -> torch.dtype | None:
    """``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"`` or a ``torch.dtype`` -> ``torch.dtype`` (None stays None).

    Raises
    ------
    InputError
        For anything but float32, bfloat16 or float16 (the dtypes models are trained in).
    """
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise InputError(f"dtype must be a floating-point type (float32, bfloat16, float16), got {value}")
        return value
    key = str(value).strip().lower().removeprefix("torch.")
    if key == "auto":
        return None
    if key not in _DTYPES:
        raise InputError(f"unknown dtype {value!r}: use float32, bfloat16 or float16 (or fp32, bf16, fp16)")
    return _DTYPES[key]


def resolve_dtype(dtype: Any, config: Any = None) -> torch.dtype:
    """The parameter dtype: ``dtype`` if given, else the config's ``dtype`` (``torch_dtype``), else float32."""
    explicit = parse_dtype(dtype)
    if explicit is not None:
        return explicit
    for attr in ("dtype",) if hasattr(config, "dtype") else ("torch_dtype",):  # torch_dtype: older configs
        val = getattr(config, attr, None) if config is not None else None
        if val is not None:
            try:
                found = parse_dtype(val)
            except InputError:
                continue  # e.g. float64 in an odd config: fall back to float32
            if found is not None:
                return found
    return torch.float32


def _check_attn(value: Any) -> str | None:
    if value is None:
        return None
    if value not in ("eager", "sdpa"):
        raise InputError(f"attn_implementation must be 'sdpa' (Hugging Face's default) or 'eager', got {value!r}")
    return str(value)


# ----------------------------------------------------------------------------- tasks
#: Tasks -> the transformers auto-mapping that gives each model type its class for the task.
TASKS: dict[str, str] = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "audio-classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "base": "MODEL_MAPPING_NAMES",
}
#: The order in which the task is inferred: the first the architecture has a head for
#: (encoder-decoders try the seq2seq tasks first; vision-language before plain language
#: modelling; a bidirectional encoder's masked-LM head before its causal-LM head).
TASK_ORDER = ("image-text-to-text", "masked-lm", "causal-lm", "seq2seq", "speech-seq2seq", "ctc",
              "image-classification", "audio-classification", "base")
_ENC_DEC_ORDER = ("seq2seq", "speech-seq2seq")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MissingDependencyError(
            "building Hugging Face architectures needs the transformers package, which is not installed: "
            'pip install "fxpipe[hf]"'
        ) from None
    from transformers.utils import logging

    logging.set_verbosity_error()  # "You are using a model of type ..." and init warnings
    return transformers


def _task_class_name(model_type: str, task: str) -> str | None:
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, TASKS[task], {})
    name = names.get(model_type)
    if isinstance(name, (tuple, list)):
        name = name[0]
    return name


def model_tasks(model_type: str) -> list[str]:
    """The tasks of :data:`TASKS` that transformers has a model class for, for this ``model_type``."""
    _transformers()
    return [t for t in TASKS if _task_class_name(model_type, t)]


def infer_task(model_type: str, config: Any = None) -> str:
    """The task of a model type when none is given: the first of :data:`TASK_ORDER` it has a head
    for (``seq2seq`` / ``speech-seq2seq`` first for an encoder-decoder config).

    Raises
    ------
    InputError
        If transformers has no model class for it at all.
    """
    have = set(model_tasks(model_type))
    order = TASK_ORDER
    if config is not None and getattr(config, "is_encoder_decoder", False):
        order = _ENC_DEC_ORDER + order
    elif config is not None and _sub(config, "text_config") is not None and _sub(config, "vision_config") is not None \
            and "image-text-to-text" not in have:
        order = ("base",) + order  # a two-tower model (CLIP, SigLIP): both towers and the similarity logits
    for task in order:
        if task in have:
            return task
    raise InputError(
        f"transformers has no model class for model type {model_type!r} (not in any of its auto mappings): "
        "use --model package.module:factory to plan your own module"
    )


def _model_class(model_type: str, task: str):
    t = _transformers()
    if task not in TASKS:
        raise InputError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    name = _task_class_name(model_type, task)
    if name is None:
        have = model_tasks(model_type)
        raise InputError(f"transformers has no {task} model for {model_type!r}; its tasks: {', '.join(have) or 'none'}")
    cls = getattr(t, name, None)
    if cls is None:
        raise InputError(f"transformers names {name} for {model_type!r} ({task}) but cannot import it in this install")
    return cls


# ----------------------------------------------------------------------------- tiny sizes
#: Small sizes applied to a model type's default config (and to its sub-configs: text,
#: vision, audio, ...) so that a CPU run takes seconds: field -> rule. ``min``: at most this
#: value; ``set``: this value when the field is set at all. Fields not named keep the default.
TINY: dict[str, tuple[str, Any]] = {
    # depth
    **{k: ("min", 2) for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers",
                                "decoder_layers", "num_decoder_layers", "num_encoder_layers", "depth")},
    # width
    **{k: ("min", 64) for k in ("hidden_size", "d_model", "n_embd", "embed_dim", "word_embed_proj_dim",
                                "projection_dim", "text_embed_dim", "vision_embed_dim", "out_hidden_size")},
    **{k: ("min", 32) for k in ("embedding_size",)},
    **{k: ("min", 128) for k in ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
                                 "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size")},
    # attention
    **{k: ("set", 4) for k in ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                               "decoder_attention_heads")},
    **{k: ("min", 16) for k in ("head_dim", "d_kv", "kv_channels", "qk_nope_head_dim", "v_head_dim")},
    **{k: ("min", 16) for k in ("qk_rope_head_dim",)},
    **{k: ("min", 64) for k in ("projection_size",)},
    **{k: ("min", 8) for k in ("rotary_dim",)},
    **{k: ("min", 32) for k in ("kv_lora_rank", "q_lora_rank")},
    # vocabulary (special token ids are moved inside it)
    "vocab_size": ("min", 512),
    # mixture of experts
    **{k: ("min", 4) for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")},
    **{k: ("min", 2) for k in ("num_experts_per_tok", "moe_topk", "top_k")},
    **{k: ("min", 1) for k in ("n_shared_experts", "n_group", "topk_group", "first_k_dense_replace")},
    # audio feature extractors
    "max_source_positions": ("min", 32),
    "num_conv_pos_embeddings": ("min", 16),
    "num_conv_pos_embedding_groups": ("min", 4),
    # vision-language: image features merged into the text
    **{k: ("min", 16) for k in ("mm_tokens_per_image", "image_seq_length")},
}
#: fields holding the number of key/value heads: 4 (multi-head), 2 (grouped) or 1 (multi-query), as the default has
_KV_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_LAYER_FIELDS = tuple(k for k, v in TINY.items() if v == ("min", 2))
_TOKEN_SUFFIXES = ("_token_id", "_token_index")


def _is_config(obj: Any) -> bool:
    return hasattr(obj, "to_dict") and hasattr(obj, "model_type") and not isinstance(obj, type)


#: learned position tables: raised to the example's length (plus the two offsets RoBERTa-like models add)
_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_target_positions")


def _shrink_dict(d: dict[str, Any], sub: Mapping[str, Any], depth_only: bool,
                 over: Mapping[str, Any] | None = None, min_positions: int = 0) -> dict[str, Any]:
    """Apply :data:`TINY` to one config's dict (sub-configs given as dicts in ``sub``); the
    user's ``over`` fields are kept as given, per-layer lists follow the final depth, and
    position tables hold at least ``min_positions``."""
    over = dict(over or {})
    out = dict(d)
    old_layers = {k: d[k] for k in _LAYER_FIELDS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)}
    heads = over.get("num_attention_heads", over.get("n_head", d.get("num_attention_heads", d.get("n_head"))))
    for key, val in d.items():
        if key in sub:
            out[key] = sub[key]
            continue
        if key in over:
            continue
        rule = TINY.get(key)
        if isinstance(val, bool) or rule is None and key not in _KV_FIELDS and key not in ("hidden_sizes", "depths",
                                                                                              "conv_dim", "image_size"):
            continue
        if depth_only and key not in _LAYER_FIELDS and key not in ("num_local_experts", "num_experts",
                                                                    "n_routed_experts", "moe_num_experts", "depths"):
            continue
        if key in _KV_FIELDS and isinstance(val, int):
            out[key] = 1 if val == 1 else (4 if val == heads else 2)
        elif key == "hidden_sizes" and isinstance(val, (list, tuple)) and all(isinstance(v, int) for v in val):
            out[key] = [max(8, int(v) // 8) for v in val]
        elif key == "depths" and isinstance(val, (list, tuple)) and all(isinstance(v, int) for v in val):
            out[key] = [1] * len(val)
        elif key == "conv_dim" and isinstance(val, (list, tuple)):
            out[key] = [min(int(v), 32) for v in val]
        elif key == "image_size" and isinstance(val, int):
            patch = d.get("patch_size")
            out[key] = min(val, max(4 * patch, 64)) if isinstance(patch, int) and patch > 1 else min(val, 64)
        elif isinstance(val, int) and rule is not None:
            how, n = rule
            out[key] = n if how == "set" else min(val, n)
    # heads per stage (Swin-like) follow a narrower embedding
    if isinstance(d.get("num_heads"), list) and isinstance(d.get("embed_dim"), int) and out.get("embed_dim") != d["embed_dim"]:
        out["num_heads"] = [max(1, int(h) * int(out["embed_dim"]) // int(d["embed_dim"])) for h in d["num_heads"]]
    out.update({k: v for k, v in over.items() if not isinstance(v, dict)})
    for key in _POSITION_FIELDS:
        val = out.get(key)
        if key not in over and isinstance(val, int) and not isinstance(val, bool) and 0 < val < min_positions:
            out[key] = min_positions
    # per-layer lists (layer_types, ...) follow the new depth (cut, or repeated as a pattern);
    # backbone outputs are recomputed
    for lk, old in old_layers.items():
        new = out.get(lk)
        if new == old or not isinstance(new, int) or new < 1:
            continue
        for key in ("out_features", "out_indices"):
            out.pop(key, None)
        for key, val in d.items():
            if key not in sub and key not in over and isinstance(val, list) and len(val) == old and old > 1:
                src = list(out[key])
                out[key] = (src * (new // len(src) + 1))[:new] if src else src
    if not depth_only:
        # multimodal rope sections must sum to half the (new) head dimension
        rope = out.get("rope_parameters") or out.get("rope_scaling")
        hd = out.get("head_dim") or ((out.get("hidden_size") or 0) // max(1, int(out.get("num_attention_heads") or 1)))
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and hd:
            sec = [int(x) for x in rope["mrope_section"]]
            target = int(hd) // 2
            if sum(sec) != target and sum(sec) > 0:
                new_sec = [max(1, x * target // sum(sec)) for x in sec]
                new_sec[0] += target - sum(new_sec)
                rope = {**rope, "mrope_section": new_sec}
                out["rope_parameters" if "rope_parameters" in out else "rope_scaling"] = rope
    return out


def _config_to_kwargs(cfg: Any, depth_only: bool, over: Mapping[str, Any] | None = None,
                      min_positions: int = 0) -> dict[str, Any]:
    """The constructor keywords of a shrunk copy of ``cfg`` (sub-configs shrunk recursively;
    ``over``: the user's overrides, nested by sub-config, kept as given)."""
    over = dict(over or {})
    d = cfg.to_dict()
    sub = {}
    for key, val in vars(cfg).items():
        if _is_config(val):
            sub_over = over.get(key) if isinstance(over.get(key), dict) else None
            sub[key] = _config_to_kwargs(val, depth_only, sub_over, min_positions)
    for key in ("_name_or_path", "transformers_version", "architectures", "_commit_hash", "model_type"):
        d.pop(key, None)
    return _shrink_dict(d, sub, depth_only, over, min_positions)


def _special_token_ids(kw: Mapping[str, Any], vocab: int) -> dict[str, Any]:
    """Token-id fields (``pad_token_id``, ``image_token_index``, ...) at or past ``vocab`` moved to
    distinct ids at the top of the vocabulary (``vocab - 1``, ``vocab - 2``, ...)."""
    out = dict(kw)
    nxt = vocab - 1
    moved: dict[int, int] = {}
    for key in sorted(kw):
        val = kw[key]
        if key.endswith(_TOKEN_SUFFIXES) and isinstance(val, int) and not isinstance(val, bool) and val >= vocab:
            if val not in moved:
                moved[val] = nxt
                nxt -= 1
            out[key] = moved[val]
        elif key.endswith(_TOKEN_SUFFIXES) and isinstance(val, list) and any(isinstance(v, int) and v >= vocab for v in val):
            out[key] = [v if not isinstance(v, int) or v < vocab else moved.setdefault(v, vocab - 1 - len(moved)) for v in val]
    return out


def _fix_token_ids(kw: dict[str, Any], vocab: int | None) -> dict[str, Any]:
    if vocab is None:
        vocab = kw.get("vocab_size") if isinstance(kw.get("vocab_size"), int) else None
    if vocab is None and isinstance(kw.get("text_config"), dict):  # vision-language: the language model's vocabulary
        v = kw["text_config"].get("vocab_size")
        vocab = v if isinstance(v, int) else None
    for key, val in list(kw.items()):
        if isinstance(val, dict) and key.endswith("_config"):
            v = val.get("vocab_size") if isinstance(val.get("vocab_size"), int) else vocab
            kw[key] = _fix_token_ids(dict(val), v)
    if vocab:
        kw = _special_token_ids(kw, int(vocab))
    return kw


def _set_nested(kw: dict[str, Any], key: str, val: Any, create: bool = False) -> None:
    """``text_config.hidden_size`` -> ``kw["text_config"]["hidden_size"]``."""
    parts = key.split(".")
    d = kw
    for p in parts[:-1]:
        nxt = d.get(p)
        if nxt is None and create:
            nxt = {}
        if not isinstance(nxt, dict):
            raise InputError(f"config override {key!r}: {p!r} is not a sub-config of this model")
        d[p] = nxt = dict(nxt)
        d = nxt
    d[parts[-1]] = val


# ----------------------------------------------------------------------------- the wrapper
_OUTPUT_KEYS = ("logits", "logits_per_image", "prediction_logits", "last_hidden_state", "image_embeds",
                "audio_values", "spectrogram")


def main_output(out: Any):
    """The one tensor a model output stands for: ``logits`` if present, else the first of
    ``logits_per_image``, ``prediction_logits``, ``last_hidden_state`` ..., else its first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    getter = out.get if hasattr(out, "get") else None
    if getter is not None:
        for key in _OUTPUT_KEYS:
            val = getter(key)
            if isinstance(val, torch.Tensor):
                return val
        for val in out.values():
            if isinstance(val, torch.Tensor):
                return val
    if isinstance(out, (tuple, list)):
        for val in out:
            if isinstance(val, torch.Tensor):
                return val
    raise InputError(f"the model's output {type(out).__name__} holds no tensor to plan for")


class HFHead(torch.nn.Module):
    """Call a Hugging Face model with named inputs given positionally; return one tensor.

    ``forward(*inputs)`` calls ``model(**dict(zip(input_names, inputs)))`` (the KV cache is
    off in the config) and returns :func:`main_output` of the result. Positional inputs are
    what a pipeline's first stage receives. Defined at module level so that it pickles.
    """

    def __init__(self, model: torch.nn.Module, input_names: Sequence[str]):
        super().__init__()
        self.model = model
        self.input_names = tuple(input_names)

    def forward(self, *inputs):
        return main_output(self.model(**dict(zip(self.input_names, inputs))))


# ----------------------------------------------------------------------------- example inputs
@dataclasses.dataclass(frozen=True)
class InputSpec:
    """How to draw one example input (without its batch dimension).

    ``kind``: ``"ids"`` (integers in ``[low, high)``, with ``n_image_tokens`` copies of
    ``image_token`` after the first position when set), or ``"float"`` (standard normal).
    """

    name: str
    kind: str
    shape: tuple
    low: int = 0
    high: int = 1
    image_token: int | None = None
    n_image_tokens: int = 0

    def draw(self, batch_size: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor of shape ``(batch_size, *shape)``."""
        shape = (batch_size, *self.shape)
        if self.kind == "float":
            return torch.randn(shape, generator=gen).to(dtype)
        ids = torch.randint(self.low, self.high, shape, generator=gen)
        if self.image_token is not None and self.n_image_tokens:
            ids[:, 1:1 + self.n_image_tokens] = self.image_token
        return ids


def _sub(config: Any, name: str) -> Any:
    sub = getattr(config, name, None)
    return sub if _is_config(sub) else None


def _token_ids(config: Any) -> dict[str, int]:
    out = {}
    cfgs = [config] + [v for v in vars(config).values() if _is_config(v)]
    for c in cfgs:
        for key, val in vars(c).items():
            if key.endswith(_TOKEN_SUFFIXES) and isinstance(val, int) and not isinstance(val, bool) and val >= 0:
                out.setdefault(key, val)
    return out


def _image_token(config: Any) -> int | None:
    for key in ("image_token_id", "image_token_index"):
        for c in (config, _sub(config, "text_config")):
            val = getattr(c, key, None) if c is not None else None
            if isinstance(val, int) and not isinstance(val, bool):
                return val
    return None


def _count_image_tokens(hf: torch.nn.Module, pixel_values: torch.Tensor) -> int | None:
    """Image features per image the model merges into its token sequence (its vision tower run
    on ``pixel_values`` of one image, on the model's device: free on meta)."""
    fn = getattr(hf, "get_image_features", None)
    if fn is None and hasattr(hf, "model"):
        fn = getattr(hf.model, "get_image_features", None)
    if fn is None:
        return None
    with torch.no_grad():
        feats = fn(pixel_values=pixel_values)
    if not isinstance(feats, torch.Tensor) and hasattr(feats, "get"):
        feats = next((feats.get(k) for k in ("pooler_output", "image_embeds", "last_hidden_state")
                      if feats.get(k) is not None), None)
    if isinstance(feats, (list, tuple)):
        feats = [f for f in feats if isinstance(f, torch.Tensor)]
        if not feats:
            return None
        return sum(int(math.prod(f.shape[:-1])) for f in feats)
    if isinstance(feats, torch.Tensor):
        return int(math.prod(feats.shape[:-1]))
    return None


def _as_hw(size: Any) -> tuple[int, int] | None:
    if isinstance(size, int) and not isinstance(size, bool):
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) for s in size):
        return int(size[0]), int(size[1])
    if isinstance(size, dict) and "height" in size and "width" in size:
        return int(size["height"]), int(size["width"])
    return None


def input_recipe(config: Any, model_cls: Any, task: str, seq_len: int, decoder_seq_len: int,
                 hf: torch.nn.Module | None = None) -> list[InputSpec]:
    """The example inputs of one sample, by modality, from the config and the forward signature.

    * text: ``input_ids`` ``(seq_len,)`` drawn below the model's high special-token ids;
    * vision: ``pixel_values`` ``(channels, H, W)`` from ``image_size`` (64 x 64 when the config
      names no size);
    * audio: ``input_values`` ``(seq_len * total conv stride,)`` samples, or ``input_features``
      ``(mel bins, 2 * max_source_positions)`` (Whisper) / ``(seq_len, features)``;
    * encoder-decoders: ``decoder_input_ids`` ``(decoder_seq_len,)``;
    * vision-language: ``input_ids`` of ``seq_len`` text tokens plus one image placeholder
      token per image feature (after the first token), counted by running the vision tower of
      ``hf`` on one image (on meta: free).

    Raises
    ------
    InputError
        Naming what to pass (``--model`` with a factory) when no input the model takes is known.
    """
    params = inspect.signature(model_cls.forward).parameters
    text_cfg = _sub(config, "text_config") or _sub(config, "decoder") or config
    vision_cfg = _sub(config, "vision_config") or _sub(config, "encoder") or config
    audio_cfg = _sub(config, "audio_config") or config
    vocab = getattr(config, "vocab_size", None) or getattr(text_cfg, "vocab_size", None)
    specs: list[InputSpec] = []
    audio_task = task in ("ctc", "audio-classification", "speech-seq2seq")
    vision_task = task == "image-classification"

    pixel = None
    if "pixel_values" in params and not audio_task:
        hw = _as_hw(getattr(vision_cfg, "image_size", None)) or _as_hw(getattr(config, "image_size", None)) or (64, 64)
        ch = getattr(vision_cfg, "num_channels", None) or getattr(config, "num_channels", None) or 3
        pixel = InputSpec("pixel_values", "float", (int(ch), *hw))
    audio = None
    if "input_values" in params and not vision_task:
        strides = getattr(audio_cfg, "conv_stride", None)
        stride = int(math.prod(strides)) if isinstance(strides, (list, tuple)) and strides else 320
        if hasattr(audio_cfg, "max_length") and hasattr(audio_cfg, "num_mel_bins"):  # spectrogram transformers
            audio = InputSpec("input_values", "float", (int(audio_cfg.max_length), int(audio_cfg.num_mel_bins)))
        else:
            audio = InputSpec("input_values", "float", (seq_len * stride,))
    elif "input_features" in params and not vision_task:
        mel = getattr(audio_cfg, "num_mel_bins", None)
        src = getattr(audio_cfg, "max_source_positions", None)
        per_channel = getattr(audio_cfg, "input_feat_per_channel", None)
        feat = getattr(audio_cfg, "feature_size", None)
        if mel and src and getattr(audio_cfg, "model_type", "") in ("whisper", "qwen2_audio_encoder"):
            audio = InputSpec("input_features", "float", (int(mel), 2 * int(src)))
        elif per_channel:
            audio = InputSpec("input_features", "float", (seq_len, int(per_channel) * int(getattr(audio_cfg, "input_channels", 1))))
        elif feat:
            audio = InputSpec("input_features", "float", (seq_len, int(feat)))
        elif mel and src:
            audio = InputSpec("input_features", "float", (int(mel), 2 * int(src)))
        elif mel:
            audio = InputSpec("input_features", "float", (int(mel), seq_len))

    specials = _token_ids(config)
    low, high = 0, int(vocab or 0)
    if vocab:
        big = [v for v in specials.values() if int(vocab) // 2 <= v < int(vocab)]
        small = [v for v in specials.values() if v < min(64, int(vocab) // 4)]
        high = min(big) if big else int(vocab)
        low = max(small) + 1 if small else 0
        if low >= high:
            low = 0
    wants_text = "input_ids" in params and vocab and not audio_task and not vision_task
    if wants_text and audio is not None and task not in ("causal-lm", "masked-lm", "base"):
        wants_text = False
    if audio is not None and "input_ids" in params and task in ("base",) and pixel is None:
        wants_text = False  # an audio encoder-only base model
    if wants_text:
        n_img, tok = 0, None
        if pixel is not None and (tok := _image_token(config)) is not None:
            if hf is not None:
                pv = pixel.draw(1, torch.Generator().manual_seed(0)).to(next(hf.parameters()).device)
                try:
                    n_img = _count_image_tokens(hf, pv) or 0
                except Exception:  # noqa: BLE001 - the forward check reports what fails
                    n_img = 0
            tok = tok if tok < int(vocab) else None
        specs.append(InputSpec("input_ids", "ids", (seq_len + n_img,), low, high, tok if n_img else None, n_img))
    if pixel is not None and (not wants_text or task in ("image-classification", "image-text-to-text", "base")
                              or _image_token(config) is not None):
        specs.append(pixel)
    if audio is not None:
        specs.append(audio)
    enc_dec = task in ("seq2seq", "speech-seq2seq") or bool(getattr(config, "is_encoder_decoder", False))
    if "decoder_input_ids" in params and enc_dec:
        dvocab = getattr(_sub(config, "decoder") or text_cfg, "vocab_size", None) or vocab
        if not dvocab:
            raise InputError(f"{type(config).__name__} names no vocab_size for the decoder's input ids")
        dhigh = high if dvocab == vocab else int(dvocab)
        specs.append(InputSpec("decoder_input_ids", "ids", (decoder_seq_len,), min(low, dhigh - 1), dhigh))
    if not specs:
        takes = [p for p in params if p not in ("self", "kwargs")][:8]
        raise InputError(
            f"fxpipe cannot tell which example inputs {model_cls.__name__} needs (it takes {takes}): pass your own "
            "model and inputs with --model package.module:factory (see `fxpipe models`)"
        )
    return specs


# ----------------------------------------------------------------------------- sources
def _looks_like_path(arch: str) -> bool:
    return os.sep in arch or arch.endswith(".json") or arch.startswith(".") or os.path.exists(arch)


def _read_config_path(path: str) -> tuple[dict[str, Any], Path | None]:
    """A config.json (or a folder holding one) -> (its dict, the checkpoint folder or None)."""
    p = Path(path)
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise InputError(f"--hf {path!r} is a folder without a config.json: give a checkpoint folder or a config file")
        folder: Path | None = p
    elif p.is_file():
        cfg, folder = p, None
    else:
        raise InputError(f"--hf {path!r}: no such file or folder (give a preset, a model type, a config.json or a checkpoint folder)")

    doc = read_json(cfg, "model config")
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        raise InputError(f"{cfg} has no \"model_type\": a Hugging Face config.json names its architecture there")
    return doc, folder


def _weight_files(folder: Path | None) -> list[Path]:
    if folder is None:
        return []
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("pytorch_model*.bin"))


def known_model_types() -> list[str]:
    """Every ``model_type`` this transformers install knows (``AutoConfig.for_model``)."""
    _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def _unknown_name_error(arch: str) -> InputError:
    names = sorted(ARCHS) + known_model_types()
    close = difflib.get_close_matches(arch.lower(), names, n=4, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return InputError(
        f"unknown model {arch!r}{hint} Give a preset ({', '.join(sorted(ARCHS))}), a transformers model type "
        f"({len(names) - len(ARCHS)} known, e.g. qwen3, bert, whisper, llava; `fxpipe models --all` lists them), "
        "a config.json or checkpoint folder, or --model package.module:factory for your own module"
    )


def _check_generic_overrides(model_type: str, default_cfg: Any, overrides: Mapping[str, Any]) -> None:
    nested: dict[str, dict[str, Any]] = {}
    for key, val in overrides.items():
        if "." in key:
            head, _, rest = key.partition(".")
            nested.setdefault(head, {})[rest] = val
    for head, sub_over in nested.items():
        sub = getattr(default_cfg, head, None)
        if not _is_config(sub):
            subs = sorted(k for k, v in vars(default_cfg).items() if _is_config(v))
            raise InputError(f"config override {head}.*: {model_type} has no sub-config {head!r}; its sub-configs: {subs or 'none'}")
        _check_generic_overrides(f"{model_type}.{head}", sub, sub_over)
    known = set(default_cfg.to_dict())
    unknown = [k for k in overrides if "." not in k and k not in known and not hasattr(default_cfg, k)]
    if unknown:
        close = {k: difflib.get_close_matches(k, sorted(known), n=2) for k in unknown}
        hint = "; ".join(f"{k}: did you mean {', '.join(v)}?" for k, v in close.items() if v)
        raise InputError(
            f"unknown {model_type} config field(s) {unknown}{' (' + hint + ')' if hint else ''}; known fields include "
            f"{sorted(k for k in known if not k.startswith('_'))[:40]}"
        )
    _check_override_values(model_type, default_cfg, dict(overrides), overrides)


def _set_attn(config: Any, attn: str) -> None:
    config._attn_implementation = attn
    for val in vars(config).values():
        if _is_config(val):
            _set_attn(val, attn)


def _no_cache(config: Any) -> None:
    for c in [config] + [v for v in vars(config).values() if _is_config(v)]:
        if hasattr(c, "use_cache"):
            c.use_cache = False


def _build_generic(arch: str, overrides: Mapping[str, Any], device: str, dtype: Any, seed: int,
                   task: str | None):
    t = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    inputs = {"batch_size": 1, "seq_len": 128, "decoder_seq_len": None, "attn_implementation": None}
    cfg_over: dict[str, Any] = {}
    for key, val in overrides.items():
        (inputs if key in _INPUT_KEYS else cfg_over)[key] = val
    bs, sl, dsl = _input_sizes(inputs)
    attn = _check_attn(inputs["attn_implementation"])

    folder: Path | None = None
    if _looks_like_path(arch):
        doc, folder = _read_config_path(arch)
        model_type = doc["model_type"]
        if model_type not in CONFIG_MAPPING_NAMES:
            raise InputError(f"{arch}: model_type {model_type!r} is unknown to transformers {t.__version__}: "
                             "upgrade transformers, or plan your module with --model package.module:factory")
        source = "checkpoint" if folder is not None else "config"
        base_kw = {k: v for k, v in doc.items() if k not in ("model_type", "transformers_version", "_name_or_path")}
        ladder = ("as configured",)
    else:
        if arch not in CONFIG_MAPPING_NAMES:
            raise _unknown_name_error(arch)
        model_type, source, base_kw = arch, "model_type", None
        ladder = ("tiny", "shallow")  # shallow: default widths, 2 layers (planned on meta only)
    cfg_cls = CONFIG_MAPPING[model_type]
    try:
        default_cfg = cfg_cls()
    except Exception as exc:  # noqa: BLE001 - transformers' config classes raise many types
        raise InputError(f"transformers cannot build a default {model_type} config: {' '.join(str(exc).split())[:300]}") from None
    _check_generic_overrides(model_type, default_cfg, {k: v for k, v in cfg_over.items() if k not in ("dtype", "torch_dtype")})
    task = task or infer_task(model_type, default_cfg)
    model_cls = _model_class(model_type, task)

    errors: list[str] = []
    for sizes in ladder:
        if base_kw is not None:
            kw = dict(base_kw)
            for key, val in cfg_over.items():
                _set_nested(kw, key, val)
        else:
            nested: dict[str, Any] = {}
            for key, val in cfg_over.items():
                _set_nested(nested, key, val, create=True)
            kw = _config_to_kwargs(default_cfg, sizes == "shallow", nested, min_positions=max(sl, dsl) + 2)
        kw.pop("use_cache", None)
        if base_kw is None:
            kw = _fix_token_ids(kw, None)
        try:
            config = cfg_cls(**kw)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{sizes} config: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            continue
        _no_cache(config)
        if attn is not None:
            _set_attn(config, attn)
        pdtype = resolve_dtype(dtype, config)
        try:
            model, args, info = _instantiate(t, model_cls, config, task, device, pdtype, seed, bs, sl, dsl,
                                             folder=folder, check=sizes == "tiny")
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - model construction / forward errors of any type
            errors.append(f"{sizes} sizes: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            continue
        info.update(source=source, model_type=model_type, task=task, sizes=sizes, path=str(arch) if base_kw is not None else None)
        if errors:
            info["fallback_reason"] = errors[-1]
        model.fxpipe_info = info
        return model, args, {}
    raise InputError(f"cannot build {model_type} ({task}, {model_cls.__name__}) from its config: " + " | ".join(errors))


def _instantiate(t, model_cls, config, task, device, dtype, seed, bs, sl, dsl, *, folder, check):
    """Build the model (random weights, or the checkpoint's on cpu), its recipe and inputs."""
    weights = "random"
    files = _weight_files(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if check:
            # generated (tiny) sizes: built on cpu (small) and run once, so that a size the
            # architecture rejects falls back to the next rung; eager Hugging Face code cannot run
            # on meta tensors (it reads mask values), only torch.export traces it there
            cpu_hf = model_cls(config).to(dtype=dtype).eval()
            specs = input_recipe(config, model_cls, task, sl, dsl, cpu_hf)
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                main_output(cpu_hf(**{s.name: s.draw(1, gen, dtype) for s in specs}))
            if device == "meta":
                torch.manual_seed(seed)
                with torch.device("meta"):
                    hf = model_cls(config)
            else:
                hf = cpu_hf
        else:
            with torch.device("meta"):
                meta_hf = model_cls(config)
            meta_hf = meta_hf.to(dtype=dtype).eval()
            specs = input_recipe(config, model_cls, task, sl, dsl, meta_hf)
            if device == "meta":
                hf = meta_hf
            elif files:
                hf = _from_pretrained(model_cls, folder, files, config, dtype)
                weights = f"checkpoint {folder}"
            else:
                torch.manual_seed(seed)
                hf = model_cls(config)
    if device == "meta":
        stray_state_to_meta(hf)
    hf = hf.to(dtype=dtype).eval()
    attn = getattr(hf.config, "_attn_implementation", None)
    model = HFHead(hf, [s.name for s in specs]).eval()
    gen = torch.Generator().manual_seed(seed)
    args = tuple(s.draw(bs, gen, dtype) for s in specs)
    if device == "meta":
        args = tuple(a.to("meta") for a in args)
    info = {"model_class": model_cls.__name__, "dtype": str(dtype).replace("torch.", ""), "attn_implementation": attn,
            "weights": weights if device != "meta" else "none (meta)", "inputs": [s.name for s in specs],
            "input_specs": [dataclasses.asdict(s) for s in specs]}
    return model, args, info


def _from_pretrained(model_cls, folder: Path, files: Sequence[Path], config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """``model_cls.from_pretrained(folder)``, refusing a checkpoint that does not fill every parameter as stored.

    transformers initializes a parameter the checkpoint lacks at random (and casts an integer tensor
    into a floating-point parameter): here its loading report and the safetensors headers go
    through the check ``plan.build(checkpoint=...)`` applies
    (:func:`fxpipe.codegen.materialize.checkpoint_mismatches`), and an unreadable safetensors
    file is named before transformers opens it.

    Raises
    ------
    InputError
        For a missing or mis-shaped parameter, an integer tensor stored for a floating-point one
        (or the other way round), or an empty, truncated or garbage safetensors file.
    """
    from fxpipe.codegen.materialize import checkpoint_mismatches  # lazy: the codegen side
    from fxpipe.codegen.safetensors_files import dtype_kind, safetensors_header, safetensors_index

    stored: dict[str, str] = {}
    for f in files:
        if f.name.endswith(".safetensors"):
            stored.update({k: code for k, (code, _) in safetensors_header(f).items()})
    for index in folder.glob("*.safetensors.index.json"):
        safetensors_index(index)  # its weight_map stays inside the folder
    # mismatched shapes are reported (and refused below, naming them), not raised by transformers without their names
    hf, info = model_cls.from_pretrained(str(folder), config=config, dtype=dtype, output_loading_info=True,
                                         ignore_mismatched_sizes=True)
    own = {**dict(hf.named_parameters(remove_duplicate=False)), **dict(hf.named_buffers(remove_duplicate=False))}
    prefix = f"{getattr(hf, 'base_model_prefix', '')}."
    dtypes = []
    for key, code in stored.items():  # the checkpoint's key as the model names it (with or without the base prefix)
        t = own.get(key, own.get(prefix + key, own.get(key[len(prefix):] if key.startswith(prefix) else None)))
        if t is not None and dtype_kind(code) != dtype_kind(t.dtype):
            dtypes.append((key, code, t.dtype))
    shapes = [(k, a, b) for k, a, b in info.get("mismatched_keys") or ()]
    checkpoint_mismatches(str(folder), sorted(info.get("missing_keys") or ()), shapes, dtypes)
    return hf


def _input_sizes(inputs: dict) -> tuple[int, int, int]:
    """``(batch_size, seq_len, decoder_seq_len)`` of the example inputs, checked.

    Raises
    ------
    InputError
        When one is not an integer or is < 1.
    """
    try:
        bs, sl = int(inputs["batch_size"]), int(inputs["seq_len"])
        dsl = int(inputs["decoder_seq_len"] or sl)
    except (TypeError, ValueError):
        raise InputError(f"batch_size, seq_len and decoder_seq_len must be integers, got {inputs}") from None
    if bs < 1 or sl < 1 or dsl < 1:
        raise InputError(f"batch_size, seq_len and decoder_seq_len must be >= 1, got {bs}, {sl}, {dsl}")
    return bs, sl, dsl


def build_hf_model(
    arch: str,
    overrides: Mapping[str, Any] | None = None,
    device: str = "cpu",
    dtype: Any = None,
    *,
    seed: int = 0,
    task: str | None = None,
):
    """Build a Hugging Face model from a preset, a model type or a config path; no download.

    Parameters
    ----------
    arch : str
        A preset of :data:`ARCHS` (``"gpt2"``, ``"t5"``, ``"llama"``, ``"mixtral"``,
        ``"llama-2-7b"``, ``"llama-3-8b"``, ``"llama-3-70b"``, ``"llama-3.1-405b"``); any other transformers ``model_type``
        (``"qwen3"``, ``"bert"``, ``"whisper"``, ``"llava"``, ...; :func:`known_model_types`),
        built from its default config with the small sizes of :data:`TINY` (falling back to
        the default widths with 2 layers when the architecture rejects them); or a path to a
        ``config.json`` or a checkpoint folder holding one (sizes as written).
    overrides : mapping, optional
        Config fields to override (e.g. ``{"n_layer": 2, "n_embd": 64}``; a sub-config's
        field as ``"text_config.hidden_size"``), plus the example-input sizes ``batch_size``
        (default 1), ``seq_len`` (default 128; audio: frames), ``decoder_seq_len`` (default
        ``seq_len``), and ``attn_implementation`` (``"sdpa"`` or ``"eager"``; default
        Hugging Face's: SDPA where the architecture supports it). The example inputs are ONE
        micro-batch: the cost model costs exactly these shapes.
    device : {"cpu", "meta"}
        ``"meta"`` allocates no weights (shapes only); the model then cannot be run, only
        captured and costed. On ``"cpu"`` a checkpoint folder's safetensors weights are loaded.
    dtype : torch.dtype or str, optional
        Parameter dtype (default: the config's ``dtype`` / ``torch_dtype``, e.g. bfloat16 for
        ``llama-3-70b``; float32 when the config names none).
    seed : int
        Seed for the random weights and inputs.
    task : str, optional
        Head for model types and config paths (:data:`TASKS`, e.g. ``"causal-lm"``,
        ``"seq2seq"``, ``"masked-lm"``, ``"image-classification"``, ``"ctc"``, ``"base"``);
        default :func:`infer_task`. Presets have one task each.

    Returns
    -------
    model : torch.nn.Module
        :class:`LogitsOnly` (presets) or :class:`HFHead` in eval mode; forward returns one
        tensor (logits ``(batch, seq, vocab)`` for language models, ``(batch, classes)`` for
        classifiers, the last hidden state for ``base``). ``model.fxpipe_info`` describes
        what was built: source, model type, task, class, sizes, dtype, attention, weights, inputs.
    example_args : tuple
        The inputs, positional, in ``model.fxpipe_info["inputs"]`` order: e.g. ``(input_ids,)``
        int64 ``(batch_size, seq_len)``; T5 ``(input_ids, decoder_input_ids)``; ViT
        ``(pixel_values,)``; Whisper ``(input_features, decoder_input_ids)``; LLaVA
        ``(input_ids, pixel_values)``.
    example_kwargs : dict
        ``{}`` (kept for the ``(model, args, kwargs)`` calling convention).

    Raises
    ------
    InputError
        For an unknown name (with close matches), an unknown config field, a task the
        architecture has no head for, inputs fxpipe cannot infer, or an unknown device.
    MissingDependencyError
        Without transformers.
    """
    if device not in ("cpu", "meta"):
        raise InputError(f"device must be 'cpu' or 'meta', got {device!r}")
    if not isinstance(arch, (str, os.PathLike)):
        raise InputError(f"arch must be a preset name, a model type or a config path, got {type(arch).__name__}")
    arch = os.fspath(arch)
    if arch in ARCHS:
        base = ARCHS[arch][0]
        own = "seq2seq" if base == "t5" else "causal-lm"
        if task not in (None, own):
            raise InputError(f"the preset {arch!r} is a {own} model; for another task give the model type "
                             f"with --task (e.g. --hf {base} --task {task}) or a config file")
        return _build_preset(arch, overrides, device, dtype, seed=seed)
    _transformers()
    return _build_generic(arch, dict(overrides or {}), device, dtype, seed, task)


# ----------------------------------------------------------------------------- the user's model
MODEL_FACTORY_CONTRACT = """\
--model package.module:factory names a callable (a function or a class) that fxpipe imports
and calls with no arguments (the current folder is on the import path). It returns ONE
micro-batch of the model as it is called:

    (model, args, kwargs)    model: torch.nn.Module; args: tuple of inputs; kwargs: dict
    (model, args)            the same without keyword inputs
    model                    a plain nn.Module: give its input with --input-shape 8,128
                             (repeat for several inputs) and --input-dtype float32|int64|...

fxpipe calls model(*args, **kwargs) once to capture it. Build it on the meta device
(with torch.device("meta"): ...) to plan a model too large for this machine."""


def _import_factory(spec: str) -> Callable:
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise InputError(f"--model {spec!r} must look like package.module:factory (a module path, a colon, a callable)")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name and mod_name.startswith(exc.name):
            raise InputError(f"--model {spec!r}: cannot import module {mod_name!r} ({exc}): run from the folder that "
                             "holds the package, or add it to PYTHONPATH") from None
        raise
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(mod) if not n.startswith("_") and callable(getattr(mod, n)))[:12]
            raise InputError(f"--model {spec!r}: module {mod_name!r} has no {attr!r}; its callables: {public}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InputError(f"--model {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable that returns the model")
    return obj


_INT_DTYPES = {"int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int64, "bool": torch.bool}


def _input_from_shape(shape: Sequence[int], dtype_name: str | None, gen: torch.Generator) -> torch.Tensor:
    name = (dtype_name or "float32").lower().removeprefix("torch.")
    if name in _INT_DTYPES:
        # integer inputs are drawn from {0, 1}: valid indices for any embedding or label set
        return torch.randint(0, 2, tuple(shape), generator=gen).to(_INT_DTYPES[name])
    dt = parse_dtype(name)
    return torch.randn(tuple(shape), generator=gen).to(dt)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8,128"`` or ``"8x128"`` -> ``(8, 128)``.

    Raises
    ------
    InputError
        Unless every part is an integer >= 1.
    """
    parts = [p for p in str(text).replace("x", ",").replace(" ", ",").split(",") if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise InputError(f"--input-shape {text!r} must be positive integers separated by commas, e.g. 8,128")
    return shape


def load_model_factory(spec: str, input_shapes: Sequence[Sequence[int]] = (), input_dtypes: Sequence[str] = (),
                       *, seed: int = 0):
    """Import ``package.module:factory``, call it and check what it returns (see :data:`MODEL_FACTORY_CONTRACT`).

    Parameters
    ----------
    spec : str
        ``"package.module:factory"``; the factory takes no arguments.
    input_shapes, input_dtypes : sequences
        Inputs to draw when the factory returns a plain ``nn.Module``: one shape per input
        (batch dimension included), dtypes by position (default float32; integer dtypes are
        drawn from {0, 1}).
    seed : int
        Seed of the factory call (weights) and of drawn inputs.

    Returns
    -------
    (model, args, kwargs)
        One micro-batch.

    Raises
    ------
    InputError
        If the module or callable cannot be found, or the factory returns something else
        than the contract says (the message says what to return).
    """
    factory = _import_factory(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = factory()
    what = (f"--model {spec}: the factory must return (model, args, kwargs) of one micro-batch: model a "
            "torch.nn.Module, args a tuple of inputs, kwargs a dict (or a plain nn.Module with --input-shape)")
    if isinstance(out, torch.nn.Module):
        if not input_shapes:
            raise InputError(f"--model {spec} returned a plain {type(out).__name__}: give its input with --input-shape "
                             "(e.g. --input-shape 8,128, repeated for several inputs) and --input-dtype, or make the "
                             "factory return (model, args, kwargs)")
        dts = list(input_dtypes or ())
        if len(dts) > len(input_shapes):
            raise InputError(f"{len(dts)} --input-dtype values for {len(input_shapes)} --input-shape values")
        gen = torch.Generator().manual_seed(seed)
        args = tuple(_input_from_shape(s, dts[i] if i < len(dts) else (dts[0] if len(dts) == 1 else None), gen)
                     for i, s in enumerate(input_shapes))
        return out, args, {}
    if input_shapes:
        raise InputError(f"--input-shape is for a factory that returns a plain nn.Module; {spec} returns its own inputs")
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        got = type(out).__name__ + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise InputError(f"{what}; it returned a {got}")
    model, args = out[0], out[1]
    kwargs = out[2] if len(out) == 3 else {}
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"{what}; its first item is a {type(model).__name__}")
    if isinstance(args, torch.Tensor):
        raise InputError(f"{what}; args is a bare tensor: return (model, (x,), {{}})")
    if not isinstance(args, (tuple, list)):
        raise InputError(f"{what}; args is a {type(args).__name__}")
    if not isinstance(kwargs, Mapping):
        raise InputError(f"{what}; kwargs is a {type(kwargs).__name__}")
    return model, tuple(args), dict(kwargs)


# ----------------------------------------------------------------------------- losses for --run
def seeded_cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the model's main output ``(batch, ..., C)`` against class ids drawn from
    one seed per sample (``target``: int64 ``(batch,)``) over the output's shape.

    Any head (language-model logits, classifier logits, CTC frames, a last hidden state) gets
    a training signal without fxpipe knowing its label shape; pipelined and single-process
    training draw the same labels from the same seeds.
    """
    out = main_output(output).float()
    if out.dim() == 1:
        out = out.unsqueeze(0)
    n_cls = out.shape[-1]
    labels = torch.stack([torch.randint(0, n_cls, tuple(out.shape[1:-1]), generator=torch.Generator().manual_seed(int(s)))
                          for s in target.reshape(-1)[: out.shape[0]]])
    return torch.nn.functional.cross_entropy(out.reshape(-1, n_cls), labels.reshape(-1))


def output_square_loss(output: Any, target: Any = None) -> torch.Tensor:
    """Mean square of every floating-point tensor in the output pytree (``target`` unused): the
    ``--run`` loss of a ``--model`` factory, whose output structure fxpipe does not know."""
    # lazy: torch.distributed.pipelining; torch's pytree (private API) lives there
    from fxpipe.codegen.runtime import tree_flatten

    leaves = tree_flatten(output)[0] if not isinstance(output, torch.Tensor) else [output]
    floats = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not floats:
        raise InputError("the model's output holds no floating-point tensor to train on")
    return sum(x.float().pow(2).mean() for x in floats) / len(floats)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors of a tuple / dict / list (one level deep) cast to ``dtype``."""
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    if isinstance(tree, Mapping):
        return {k: cast(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(cast(v) for v in tree)
    return cast(tree)
