"""Hugging Face model builders for tests, benchmarks and the CLI (random weights, no download).

:func:`build_hf_model` turns an architecture name plus config overrides into
``(model, example_args, example_kwargs)`` ready for :func:`fxpipe.passes.capture.capture`.
The model is wrapped in :class:`LogitsOnly`, a small ``nn.Module`` that calls the Hugging
Face model with ``use_cache=False`` and returns the ``logits`` tensor, so the exported graph
has a single tensor output. Parameter names inside the wrapper start with ``model.``; the
OpGraph export strips that prefix (see :data:`WRAPPER_PREFIX`).

Building on ``device="meta"`` allocates no weight memory, so a Llama-2-7B config can be
captured and costed on a laptop.
"""

from __future__ import annotations

import ast
from typing import Any, Mapping, Sequence

import torch

from fxpipe.errors import InputError, MissingDependencyError

#: Attribute name under which :class:`LogitsOnly` holds the Hugging Face model.
WRAPPER_PREFIX = "model"

#: Known architectures and presets: name -> (base architecture, default overrides).
#: Small defaults keep tests fast; presets give published model dimensions.
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
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    }),
    # Llama-3-70B dimensions (Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 3;
    # HF meta-llama/Meta-Llama-3-70B config.json: vocab 128256, rope theta 500000, GQA 8 KV heads)
    "llama-3-70b": ("llama", {
        "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
        "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
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


def build_hf_model(
    arch: str,
    overrides: Mapping[str, Any] | None = None,
    device: str = "cpu",
    dtype: Any = None,
    *,
    seed: int = 0,
):
    """Build a randomly initialised Hugging Face causal LM / seq2seq model from a config.

    Parameters
    ----------
    arch : str
        One of ``"gpt2"``, ``"t5"``, ``"llama"``, ``"mixtral"`` or the preset
        ``"llama-2-7b"`` (32 layers, hidden 4096, 32 heads, intermediate 11008, vocab 32000).
    overrides : mapping, optional
        Config fields to override (e.g. ``{"n_layer": 2, "n_embd": 64}``), plus the
        example-input sizes ``batch_size`` (default 1), ``seq_len`` (default 128) and, for T5,
        ``decoder_seq_len`` (default ``seq_len``), and ``attn_implementation`` (``"eager"``, the
        default, or ``"sdpa"``). The example inputs are ONE micro-batch:
        the cost model costs exactly these shapes.
    device : {"cpu", "meta"}
        ``"meta"`` allocates no weights (shapes only); the model then cannot be run, only
        captured and costed.
    dtype : torch.dtype, optional
        Parameter dtype (default float32).
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
    inputs = {"batch_size": 1, "seq_len": 128, "decoder_seq_len": None, "attn_implementation": "eager"}
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
    try:
        bs, sl = int(inputs["batch_size"]), int(inputs["seq_len"])
        dsl = int(inputs["decoder_seq_len"] or sl)
    except (TypeError, ValueError):
        raise InputError(f"batch_size, seq_len and decoder_seq_len must be integers, got {inputs}") from None
    if bs < 1 or sl < 1 or dsl < 1:
        raise InputError(f"batch_size and seq_len must be >= 1, got {bs}, {sl}")
    max_pos = getattr(config, "n_positions", None) if base == "gpt2" else getattr(config, "max_position_embeddings", None)
    if max_pos is not None and base != "t5" and sl > int(max_pos):
        raise InputError(f"seq_len {sl} exceeds the model's {int(max_pos)} positions: raise n_positions / max_position_embeddings or shorten seq_len")
    # default eager attention: explicit matmul/softmax ops, same on every backend, exportable;
    # "sdpa" gives one fused scaled_dot_product_attention op per layer (FlashAttention-like costs)
    if inputs["attn_implementation"] not in ("eager", "sdpa"):
        raise InputError(f"attn_implementation must be 'eager' or 'sdpa', got {inputs['attn_implementation']!r}")
    config._attn_implementation = inputs["attn_implementation"]
    dtype = dtype or torch.float32
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
    hf = hf.to(dtype=dtype)
    hf.eval()
    model = logits_only(hf).eval()

    vocab = int(config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (bs, sl), generator=gen)
    args: tuple = (input_ids,)
    if base == "t5":
        args = (input_ids, torch.randint(0, vocab, (bs, dsl), generator=gen))
    if device == "meta":
        args = tuple(a.to("meta") for a in args)
    return model, args, {}
