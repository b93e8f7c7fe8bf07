"""Costed OpGraphs of real model presets, traced once and cached (not committed).

``cached_graph("llama-3-70b")`` traces the preset on the meta device (one micro-batch of
``seq_len`` tokens, bf16 costs on an H100 SXM: the README's Llama rows) and writes the
``fxpipe.opgraph/1`` file to ``.fxpipe-cache/graphs/<name>.opgraph.json`` (git-ignored);
later calls read the file. Benchmarks share this cache so the 70B graph is exported once.

Usage::

    python benchmarks/model_graphs.py llama-3-70b          # export (or re-use) and summarise
    python benchmarks/model_graphs.py llama-3-70b --force  # re-trace
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fxpipe.ir import OpGraph  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CACHE_DIR = os.path.join(ROOT, ".fxpipe-cache", "graphs")

#: name -> (fxpipe.models arch, overrides). seq_len 4096 and bf16 as in the README's Llama rows.
PRESETS = {
    "llama-3-70b": ("llama-3-70b", {"seq_len": 4096}),
    "llama-2-7b": ("llama-2-7b", {"seq_len": 4096}),
}


def cache_path(name: str) -> str:
    return os.path.join(CACHE_DIR, f"{name}.opgraph.json")


def trace_preset(name: str, *, fast: bool | None = None):
    """Trace a preset on the meta device; returns the :class:`~fxpipe.passes.TracedModel`."""
    import torch

    from fxpipe.models import build_hf_model
    from fxpipe.passes import trace_model

    arch, overrides = PRESETS[name]
    model, args, kwargs = build_hf_model(arch, overrides, device="meta")
    kw = {} if fast is None else {"fast": fast}
    return trace_model(model, args, kwargs, hardware="h100-sxm", dtype=torch.bfloat16, name=name, **kw)


def cached_graph(name: str, *, force: bool = False) -> OpGraph:
    """The OpGraph of preset ``name``, from the cache or traced now (and cached)."""
    if name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    path = cache_path(name)
    if not force and os.path.exists(path):
        return OpGraph.load(path)
    graph = trace_preset(name).graph
    os.makedirs(CACHE_DIR, exist_ok=True)
    graph.save(path)
    return graph


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(PRESETS))
    ap.add_argument("--force", action="store_true", help="re-trace even if cached")
    args = ap.parse_args(argv)
    for name in args.names:
        t0 = time.perf_counter()
        g = cached_graph(name, force=args.force)
        print(f"{name}: n={g.n} m={g.m} total training work {g.work_s('training').sum() * 1e3:.1f} ms, "
              f"params {g.size_param_bytes.sum() / 2**30:.1f} GiB -> {cache_path(name)} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
