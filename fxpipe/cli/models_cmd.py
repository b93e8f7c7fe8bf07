"""``fxpipe models``: the presets, the four ways to name a model, and what a model type offers.

Example::

    fxpipe models                 # presets and the four ways in
    fxpipe models qwen3           # one model type: its tasks, the default one, the class built
    fxpipe models --all           # every model type this transformers install knows, with its tasks

Nothing is built or downloaded: the answers come from the presets and transformers' own
config and model-class mappings.
"""

from __future__ import annotations

import argparse
from typing import Any

from fxpipe.cli.common import add_command, emit


def _count_word(n: int) -> str:
    """``4`` -> ``"four"`` (up to ten), else the digits: the heading counts the ways it lists."""
    words = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
    return words[n] if 0 <= n < len(words) else str(n)


WAYS = [
    ("--hf PRESET", "a preset below: published dimensions and dtype (llama-3-70b: bf16), or small test sizes",
     "fxpipe plan --hf llama-3-70b --seq-len 4096 --devices 32"),
    ("--hf MODEL_TYPE", "any transformers model type (`fxpipe models --all`), built from its default config at small "
     "sizes (2 layers, width 64, 4 heads, vocabulary 512, ...; --config overrides any field), with the head of --task "
     "(inferred when not given)",
     "fxpipe plan --hf qwen3 --devices 2 --config num_hidden_layers=8"),
    ("--hf PATH", "a config.json, or a checkpoint folder holding one: sizes as written; with --run (or --checkpoint) "
     "the folder's safetensors weights are loaded, otherwise the model is planned on meta",
     "fxpipe plan --hf ./my-checkpoint --devices 4 --run"),
    ("--model PKG.MODULE:FACTORY", "your own nn.Module: the factory returns (model, args, kwargs) of one micro-batch, "
     "or a plain module with --input-shape / --input-dtype",
     "fxpipe plan --model mypkg.models:build --devices 2"),
]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(sub, "models", run, help="list the model presets and the ways to name a model for `fxpipe plan`",
                    description=__doc__, raw_description=True)
    p.add_argument("name", nargs="?", metavar="MODEL_TYPE", help="show one model type (or preset): its tasks and classes")
    p.add_argument("--all", action="store_true", help="list every model type transformers knows, with its tasks")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def _preset_dims(name: str) -> dict[str, Any]:
    """Layers, width, heads, vocabulary and dtype of a preset, read from its config (not built)."""
    from fxpipe.models import ARCHS, _transformers  # lazy: torch

    t = _transformers()
    base, over = ARCHS[name]
    cls = {"gpt2": t.GPT2Config, "t5": t.T5Config, "llama": t.LlamaConfig, "mixtral": t.MixtralConfig}[base]
    cfg = cls(**over)

    def get(*keys):
        return next((getattr(cfg, k) for k in keys if getattr(cfg, k, None) is not None), None)

    dt = getattr(cfg, "dtype", None)
    return {"name": name, "model_type": base, "layers": get("num_hidden_layers", "n_layer", "num_layers"),
            "hidden": get("hidden_size", "n_embd", "d_model"), "heads": get("num_attention_heads", "n_head", "num_heads"),
            "vocab": get("vocab_size"), "experts": get("num_local_experts"),
            "dtype": str(dt).replace("torch.", "") if dt is not None else "float32",
            "task": "seq2seq" if base == "t5" else "causal-lm"}


def _type_info(name: str) -> dict[str, Any]:
    # lazy: torch
    from fxpipe.models import ARCHS, TASKS, _task_class_name, _unknown_name_error, infer_task, known_model_types, model_tasks

    if name in ARCHS:
        return {"name": name, "preset": True, **_preset_dims(name)}
    if name not in known_model_types():
        raise _unknown_name_error(name)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        cfg = CONFIG_MAPPING[name]()
    except Exception:  # noqa: BLE001 - a config class that cannot build its defaults
        cfg = None
    tasks = model_tasks(name)
    try:
        default = infer_task(name, cfg)
    except Exception:  # noqa: BLE001
        default = None
    return {"name": name, "preset": False, "tasks": {t: _task_class_name(name, t) for t in tasks if t in TASKS},
            "default_task": default}


def run(args: argparse.Namespace) -> int:
    from fxpipe.models import TASK_ORDER, TASKS, known_model_types, model_tasks  # lazy: torch

    if args.name:
        info = _type_info(args.name)
        if info["preset"]:
            text = (f"{info['name']}: preset of {info['model_type']} ({info['task']}): {info['layers']} layers, hidden "
                    f"{info['hidden']}, {info['heads']} heads, vocabulary {info['vocab']}, {info['dtype']}")
        else:
            lines = [f"{info['name']}: transformers model type; default task {info['default_task'] or '(none)'}"]
            lines += [f"  --task {t:<24} {cls}" for t, cls in info["tasks"].items()]
            if not info["tasks"]:
                lines.append("  transformers has no model class for it: plan it with --model package.module:factory")
            text = "\n".join(lines)
        emit(args, info, text)
        return 0
    if args.all:
        rows = [{"model_type": t, "tasks": model_tasks(t)} for t in known_model_types()]
        text = "\n".join(f"{r['model_type']:<40} {', '.join(r['tasks']) or '-'}" for r in rows)
        text += f"\n{len(rows)} model types; `fxpipe models TYPE` shows one, `fxpipe plan --hf TYPE --task TASK` plans it"
        emit(args, {"model_types": rows}, text)
        return 0
    from fxpipe.models import ARCHS  # lazy: torch

    presets = [_preset_dims(n) for n in ARCHS]
    lines = [f"The {_count_word(len(WAYS))} ways to name a model for `fxpipe plan`:", ""]
    for flag, what, example in WAYS:
        lines += [f"  {flag}", f"      {what}", f"      e.g. {example}", ""]
    lines.append("Presets:")
    lines.append(f"  {'name':<13} {'type':<8} {'task':<10} {'layers':>6} {'hidden':>6} {'heads':>5} {'vocab':>7}  dtype")
    for r in presets:
        lines.append(f"  {r['name']:<13} {r['model_type']:<8} {r['task']:<10} {r['layers']:>6} {r['hidden']:>6} "
                     f"{r['heads']:>5} {r['vocab']:>7}  {r['dtype']}" + (f", {r['experts']} experts" if r["experts"] else ""))
    lines += ["", f"Tasks (--task): {', '.join(TASKS)}; inferred in the order {', '.join(TASK_ORDER)}.",
              "Other options of --hf models: --dtype (default the config's), --attn-implementation sdpa|eager "
              "(default Hugging Face's), --config KEY=VALUE (a sub-config's field as text_config.KEY=VALUE).",
              f"{len(known_model_types())} model types are known to this transformers install: `fxpipe models --all`."]
    from fxpipe.models import MODEL_FACTORY_CONTRACT  # lazy: torch

    lines += ["", "The --model contract:", *("  " + ln for ln in MODEL_FACTORY_CONTRACT.splitlines())]
    doc = {"ways": [{"flag": f, "what": w, "example": e} for f, w, e in WAYS], "presets": presets,
           "tasks": list(TASKS), "task_order": list(TASK_ORDER), "model_factory_contract": MODEL_FACTORY_CONTRACT}
    emit(args, doc, "\n".join(lines))
    return 0
