#!/usr/bin/env python3
"""Partition quality: BRKGA against the framework baselines, as ratios to Archer's simple bound.

For every graph and every k in {2, 4, 8, 16} this measures the Contract-2 bottleneck of

* ``brkga``      -- :func:`fxpipe.partition.search.partition` (``method="brkga"``, a fixed
  number of evaluations: Archer's ``brkga-10000`` by default),
* ``equal``      -- :func:`fxpipe.partition.baselines.equal_layers` (torchtitan),
* ``params``     -- :func:`~fxpipe.partition.baselines.parameter_balanced` (DeepSpeed),
* ``time``       -- :func:`~fxpipe.partition.baselines.time_balanced` (torchgpipe),
* ``random-T``   -- :func:`~fxpipe.partition.baselines.random_orders` (Archer's random-100),

divided by the simple lower bound ``L = max(max work, total work / k)`` of Archer et al.
Lemma 3.3 (:func:`fxpipe.partition.bounds.simple.simple_work_bound`). The summary tables use
the layout of Archer et al. Table 2: geometric means of ``bottleneck / L`` over the graphs of
a data set, one row per method, one column per k (lower is better; 1.0 is provably optimal).

Graphs: the dnn-partitioning throughput inputs (objective ``inference``, ``comm="dag"``:
their own objective, see :mod:`fxpipe.partition.loaders`), the PipeDream profiles
(``training``), and traced GPT-2, T5-small, a small Mixtral and Llama-2-7B on the meta
device (``training``) when :mod:`fxpipe.passes` can trace them (skipped with a note otherwise).

Usage::

    python3 benchmarks/bench_partition_quality.py            # full run
    python3 benchmarks/bench_partition_quality.py --quick    # a few graphs, small budgets
    python3 benchmarks/bench_partition_quality.py --json out.json --no-traced
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fxpipe.ir import OpGraph, write_json_atomic  # noqa: E402
from fxpipe.partition import baselines as B  # noqa: E402
from fxpipe.partition.loaders import load_dnn_partitioning, load_pipedream  # noqa: E402
from fxpipe.partition.objective import validate_partition  # noqa: E402

DATA = "/work/shared/data"
KS = (2, 4, 8, 16)
METHODS = ("brkga", "equal", "params", "time", "random")


def simple_bound(graph: OpGraph, k: int, objective: str) -> float:
    """Archer Lemma 3.3 (from fxpipe.partition.bounds when present, else the same formula)."""
    try:
        from fxpipe.partition.bounds.simple import simple_work_bound  # noqa: PLC0415

        return simple_work_bound(graph.work_s(objective), k)
    except ImportError:  # pragma: no cover - the bounds module is part of the package
        w = graph.work_s(objective)
        return float(max(w.max(), w.sum() / k))


# --------------------------------------------------------------------------------------
# graphs
# --------------------------------------------------------------------------------------


def dnn_graphs(quick: bool) -> list[tuple[str, str, Callable[[], OpGraph], str]]:
    files = sorted(glob.glob(f"{DATA}/dnn-partitioning/throughput-inputs/*/*.json"))
    if quick:
        files = [f for f in files if "bert24_inference" in f or "OperatorGraphs/resnet50_inference" in f]
    out = []
    for f in files:
        kind = "L" if "/LayerGraphs/" in f else "O"
        name = f"{kind}:{os.path.basename(f)[:-5]}"
        out.append(("dnn-partitioning", name, (lambda f=f: load_dnn_partitioning(f)), "inference"))
    return out


def pipedream_graphs(quick: bool) -> list[tuple[str, str, Callable[[], OpGraph], str]]:
    files = sorted(glob.glob(f"{DATA}/pipedream-profiles/*.graph.txt"))
    if quick:
        files = [f for f in files if os.path.basename(f) in ("gnmt.graph.txt", "resnet50.graph.txt")]
    return [("pipedream", os.path.basename(f)[: -len(".graph.txt")], (lambda f=f: load_pipedream(f)), "training") for f in files]


def _traced(builder: str, quick: bool) -> OpGraph:
    import torch  # noqa: PLC0415
    from transformers import (  # noqa: PLC0415
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    from fxpipe.passes.to_opgraph import trace_model  # noqa: PLC0415

    seq = 128 if quick else 512
    with torch.device("meta"):
        if builder == "gpt2":
            model = GPT2LMHeadModel(GPT2Config(use_cache=False))
            args = (torch.zeros(1, seq, dtype=torch.long),)
            kwargs = {}
        elif builder == "t5-small":
            model = T5ForConditionalGeneration(T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64, use_cache=False))
            args = ()
            kwargs = {"input_ids": torch.zeros(1, seq, dtype=torch.long), "decoder_input_ids": torch.zeros(1, seq, dtype=torch.long)}
        elif builder == "mixtral-small":
            model = MixtralForCausalLM(MixtralConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                                     num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
                                                     num_experts_per_tok=2, vocab_size=8000, use_cache=False))
            args = (torch.zeros(1, seq, dtype=torch.long),)
            kwargs = {}
        elif builder == "llama2-7b":
            model = LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                                 use_cache=False))
            args = (torch.zeros(1, seq, dtype=torch.long),)
            kwargs = {}
        else:
            raise ValueError(builder)
    model.eval()
    return trace_model(model, args, kwargs, name=builder).graph


def traced_graphs(quick: bool) -> list[tuple[str, str, Callable[[], OpGraph], str]]:
    names = ["gpt2", "t5-small"] if quick else ["gpt2", "t5-small", "mixtral-small", "llama2-7b"]
    return [("traced", nm, (lambda nm=nm: _traced(nm, quick)), "training") for nm in names]


# --------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------


def run_one(graph: OpGraph, k: int, objective: str, comm: str, args) -> dict:
    L = simple_bound(graph, k, objective)
    row = {"k": k, "L": L, "bottleneck": {}, "ratio": {}, "seconds": {}}
    runs: dict[str, Callable] = {
        "equal": lambda: B.equal_layers(graph, k, objective, comm),
        "params": lambda: B.parameter_balanced(graph, k, objective, comm),
        "time": lambda: B.time_balanced(graph, k, objective, comm),
        "random": lambda: B.random_orders(graph, k, args.random_t, args.seed, objective, comm),
    }
    if not args.no_brkga:
        from fxpipe.partition.search import partition  # noqa: PLC0415

        runs = {"brkga": lambda: partition(graph, k, objective=objective, comm=comm, method="brkga",
                                           evaluations=args.brkga_evals, time_limit_s=args.brkga_time, seed=args.seed),
                **runs}
    for name, fn in runs.items():
        t0 = time.perf_counter()
        p = fn()
        row["seconds"][name] = time.perf_counter() - t0
        validate_partition(graph, p)
        row["bottleneck"][name] = p.bottleneck
        row["ratio"][name] = p.bottleneck / L if L > 0 else math.nan
        if name == "brkga":
            row["brkga_evaluations"] = p.meta.get("evaluations")
    return row


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return float(np.exp(np.mean(np.log(xs)))) if xs else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few graphs, small budgets (a minute or so)")
    ap.add_argument("--json", metavar="PATH", help="also write all measurements as JSON")
    ap.add_argument("--comm", choices=("dag", "relay"), default="dag")
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="comma-separated k values (default 2,4,8,16)")
    ap.add_argument("--brkga-evals", type=int, default=None, help="BRKGA evaluations (default 10000, quick 1000)")
    ap.add_argument("--brkga-time", type=float, default=None, help="BRKGA time limit per run, s (default 60, quick 5)")
    ap.add_argument("--random-t", type=int, default=100, help="T of random-T (default 100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-brkga", action="store_true", help="skip BRKGA")
    ap.add_argument("--no-traced", action="store_true", help="skip the traced transformer models")
    ap.add_argument("--sets", default="dnn-partitioning,pipedream,traced", help="data sets to run")
    args = ap.parse_args(argv)
    if args.brkga_evals is None:
        args.brkga_evals = 1000 if args.quick else 10000
    if args.brkga_time is None:
        args.brkga_time = 5.0 if args.quick else 60.0
    ks = [int(x) for x in args.ks.split(",") if x]
    sets = set(args.sets.split(","))

    cmd = "python3 " + " ".join([os.path.relpath(__file__)] + (sys.argv[1:] if argv is None else list(argv)))
    print(f"# Partition quality: bottleneck / L (Archer Lemma 3.3), lower is better\n\n`{cmd}`\n")
    print(f"brkga = fxpipe.partition.search.partition(method='brkga', evaluations={args.brkga_evals}, "
          f"time_limit_s={args.brkga_time}); random = random-{args.random_t}; comm={args.comm}; seed={args.seed}\n")

    graphs = []
    if "dnn-partitioning" in sets:
        graphs += dnn_graphs(args.quick)
    if "pipedream" in sets:
        graphs += pipedream_graphs(args.quick)
    if "traced" in sets and not args.no_traced:
        graphs += traced_graphs(args.quick)

    methods = [m for m in METHODS if not (m == "brkga" and args.no_brkga)]
    label = {"random": f"random-{args.random_t}", "brkga": f"brkga-{args.brkga_evals}"}
    results = []
    header = "| set | graph | n | objective | k | L | " + " | ".join(label.get(m, m) for m in methods) + " | brkga bottleneck |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    t_start = time.perf_counter()
    for dataset, name, load, objective in graphs:
        try:
            t0 = time.perf_counter()
            g = load()
            load_s = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - a model that cannot be traced is reported, not fatal
            print(f"| {dataset} | {name} | - | - | - | - | skipped: {type(exc).__name__}: {str(exc)[:120]} |", flush=True)
            results.append({"set": dataset, "graph": name, "skipped": f"{type(exc).__name__}: {exc}"})
            continue
        for k in ks:
            row = run_one(g, k, objective, args.comm, args)
            row.update({"set": dataset, "graph": name, "n": g.n, "m": g.m, "objective": objective, "load_s": load_s})
            results.append(row)
            cells = " | ".join(f"{row['ratio'][m]:.3f}" for m in methods)
            bn = f"{row['bottleneck'].get('brkga', math.nan):.4g}"
            print(f"| {dataset} | {name} | {g.n} | {objective} | {k} | {row['L']:.4g} | {cells} | {bn} |", flush=True)

    print("\n## Summary (Archer Table 2 layout): geometric mean of bottleneck / L\n")
    summary = {}
    for dataset in dict.fromkeys(r["set"] for r in results):
        rows = [r for r in results if r["set"] == dataset and "ratio" in r]
        if not rows:
            continue
        ngraphs = len({r["graph"] for r in rows})
        print(f"### {dataset} ({ngraphs} graphs)\n")
        print("| algorithm | " + " | ".join(f"k = {k}" for k in ks) + " |")
        print("|---|" + "---|" * len(ks))
        summary[dataset] = {}
        for m in methods:
            vals = [geomean([r["ratio"][m] for r in rows if r["k"] == k]) for k in ks]
            summary[dataset][m] = dict(zip(map(str, ks), vals))
            print(f"| {label.get(m, m)} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
        wins = sum(1 for r in rows if "brkga" in r["ratio"] and r["ratio"]["brkga"] <= min(r["ratio"].values()) + 1e-12)
        if "brkga" in methods:
            print(f"\nbrkga best or tied on {wins}/{len(rows)} (graph, k) pairs")
        secs = {m: sum(r["seconds"][m] for r in rows) for m in methods}
        print("total seconds: " + ", ".join(f"{label.get(m, m)} {secs[m]:.1f}" for m in methods) + "\n")
    print(f"wall time {time.perf_counter() - t_start:.0f} s")
    if args.json:
        write_json_atomic(args.json, {"command": cmd, "ks": ks, "results": results, "summary": summary,
                                      "brkga_evaluations": args.brkga_evals, "random_t": args.random_t})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
