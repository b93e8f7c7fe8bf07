"""Planning time per architecture on meta: `fxpipe plan --hf TYPE --devices 2` for many model types.

Every model type is planned in this process through the CLI's ``main()`` (one transformers
import), built on ``meta`` at fxpipe's small default sizes, and the table gives the task fxpipe
inferred, the sizes used (``tiny``, or ``shallow``: default widths with 2 layers when the
architecture rejects the tiny sizes), the build and plan phases' times, and for the types that
fail, why (the first line of the error fxpipe prints).

    python benchmarks/bench_models.py                      # the default list (the README's table)
    python benchmarks/bench_models.py --types qwen3 bert   # some types
    python benchmarks/bench_models.py --json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time

#: family -> model types (the test's 40 plus types that show what does not work yet)
DEFAULT = {
    "decoder": ["qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "qwen2", "falcon", "gpt_neox", "gptj",
                "gpt_bigcode", "olmo2", "starcoder2", "opt", "bloom", "cohere", "stablelm", "granite", "phi", "gemma"],
    "moe": ["qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "jamba", "granitemoe", "dbrx"],
    "encoder": ["bert", "roberta", "albert", "deberta-v2", "distilbert", "electra"],
    "encoder-decoder": ["bart", "marian", "mt5", "pegasus", "mbart"],
    "vision": ["vit", "convnext", "resnet", "swin", "beit", "deit"],
    "speech": ["whisper", "speech_to_text", "wav2vec2", "hubert", "wavlm"],
    "multimodal": ["llava", "paligemma", "gemma3", "clip", "siglip", "qwen2_vl", "mistral3", "idefics3", "blip-2"],
}


def plan_one(model_type: str, extra: list[str]) -> dict:
    from fxpipe.cli import main

    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", "--hf", model_type, "--devices", "2", "--mesh", "pipeline", "--json", *extra])
    wall = time.perf_counter() - t0
    if code != 0:
        lines = [ln for ln in err.getvalue().strip().splitlines() if ln.strip()]
        return {"model_type": model_type, "ok": False, "wall_s": wall, "error": lines[-1][:400] if lines else f"exit {code}"}
    doc = json.loads(out.getvalue())
    info, plan = doc["model_info"], doc["plan"]
    return {"model_type": model_type, "ok": True, "wall_s": wall, "task": info["task"], "sizes": info["sizes"],
            "model_class": info["model_class"], "inputs": info["inputs"], "attn": info["attn_implementation"],
            "build_s": doc["build_s"], **{f"{k}_s": v for k, v in plan["timings_s"].items()},
            "ops": sum(s["num_ops"] for s in plan["stages"]), "params": sum(s["param_bytes"] for s in plan["stages"]) / 4}


def _short(error: str) -> str:
    """The cause of a failure in one line: torch's message and where it was raised, or fxpipe's."""
    import re

    says = re.search(r"torch says: (.*?)(?: \| |$)", error)
    where = re.search(r"raised at: File \"[^\"]*/(transformers/[^\"]+)\", line (\d+), in (\w+)", error)
    if says:
        return says.group(1)[:160] + (f" ({where.group(1)}:{where.group(2)}, {where.group(3)})" if where else "")
    return error.removeprefix("fxpipe plan: error: ")[:240]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="*", default=None, help="model types (default: the families' lists)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--time-limit", type=float, default=1.0, help="partition search budget per plan (default 1 s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    todo = [("-", t) for t in args.types] if args.types else [(f, t) for f, ts in DEFAULT.items() for t in ts]
    extra = ["--seq-len", str(args.seq_len), "--microbatches", "4", "--time-limit", str(args.time_limit)]
    import fxpipe.models  # noqa: F401 - import torch and transformers once, outside the timings

    fxpipe.models._transformers()
    rows = []
    for fam, t in todo:
        row = {"family": fam, **plan_one(t, extra)}
        rows.append(row)
        print(f"{t}: {'ok' if row['ok'] else 'FAIL'} {row['wall_s']:.1f} s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    head = "| family | model type | task | sizes | ops | build s | capture s | partition s | schedule s | total s |"
    print(head)
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["ok"]:
            print(f"| {r['family']} | {r['model_type']} | {r['task']} | {r['sizes']} | {r['ops']} | {r['build_s']:.2f} | "
                  f"{r.get('capture_s', 0):.2f} | {r.get('partition_s', 0):.2f} | {r.get('schedule_s', 0):.2f} | {r['wall_s']:.2f} |")
    fails = [r for r in rows if not r["ok"]]
    ok = len(rows) - len(fails)
    print(f"\n{ok} of {len(rows)} model types planned; total {sum(r['wall_s'] for r in rows):.0f} s")
    for r in fails:
        print(f"- {r['model_type']} ({r['family']}): {_short(r['error'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
