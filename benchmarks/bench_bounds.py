"""Benchmark: the lower-bound hierarchy on the dnn-partitioning layer graphs.

Reproduces the layout of Archer et al. 2024, Tables 1 and 3: for each method and k, the
geometric mean over graphs of ``lower bound / best partition``. The best partition is the
BRKGA partition of ``fxpipe.partition.search`` (the paper's normaliser, measured in the same
run) or the exact MIP's incumbent if that is better. The paper's published Table 1 row
(production graphs, Gurobi/SCIP, 1 h limit) is printed next to ours as a reference, not as
a like-for-like baseline (different graphs).

Target of the issue: ``exact / best >= 0.95`` (geometric mean) for k <= 8 with at most
5 minutes per instance.

Graph sets (``--set``; objective/comm default to the set's, see ``SET_OBJECTIVE``):

* ``layer``, ``operator``: dnn-partitioning ``*_{objective}.json`` (default inference/dag);
* ``layer-training``, ``operator-training``: the dnn-partitioning ``*_training.json`` files,
  contracted by :func:`~fxpipe.partition.loaders.load_dnn_partitioning` and evaluated with
  inference/dag, which reproduces dnn-partitioning's own objective (loader docstring);
* ``pipedream``: the 14 PipeDream profiles, training/dag;
* ``traced``: GPT-2, T5-small, Mixtral (small) and Llama (Llama-2-7B widths, 2/4/8 layers)
  traced on the meta device at seq_len 512, bf16, H100 SXM costs; training/relay (what
  ``fxpipe.compile`` uses).
* ``llama70b``: Llama-3-70B (80 layers, 5,741 ops) traced on the meta device, 4096 tokens per
  micro-batch, bf16, H100 SXM, training/relay; exported once into ``.fxpipe-cache/graphs``
  by ``benchmarks/model_graphs.py`` (default ks 8,16,32,64). The issue's targets: best bound
  / bottleneck >= 0.95 at k = 64 and >= 0.97 at k = 8 and 16.

Methods run in the given order, as :func:`fxpipe.partition.bounds.compute_bounds` does: each
MIP starts from the best bound of the lower-ranked methods (``chain`` included), and once the
best partition is proven optimal (within 1e-6) the remaining MIPs are skipped (status
``skipped``, the bound they would start from) unless ``--no-skip``.

Usage::

    python benchmarks/bench_bounds.py --quick            # bert24 + gnmt, k = 2, 4, 10 s limits
    python benchmarks/bench_bounds.py                    # 4 inference graphs, k = 2..16, 60 s
    python benchmarks/bench_bounds.py --time-limit 300   # the target's 5 min/instance
    python benchmarks/bench_bounds.py --set pipedream --methods simple,bottleneck,exact \\
        --limit bottleneck=10 --limit exact=30 --search-time 3 --json out.json --markdown out.md
    python benchmarks/bench_bounds.py --settings         # SCIP settings comparison (exact MIP)
    python benchmarks/bench_bounds.py --set llama70b --methods simple,chain,bottleneck,guess,exact --time-limit 60
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np

from fxpipe.ir import write_json_atomic
from fxpipe.partition.bounds import PROVEN_RTOL, Certificate, bound, chain_certificate, make_mip_data, simple_bound
from fxpipe.partition.loaders import load_dnn_partitioning, load_pipedream
from fxpipe.partition.objective import Partition
from fxpipe.partition.search import partition

DATA_ROOT = "/work/shared/data/dnn-partitioning/throughput-inputs"
PIPEDREAM_ROOT = "/work/shared/data/pipedream-profiles"
#: dnn-partitioning sets: folder, graph names, file suffix (None: ``--objective``, the old
#: behaviour of ``--set layer/operator``). The *_training files are contracted by the loader
#: (forward and backward nodes of a colour class together) and evaluated with
#: ``inference``/``dag``, which reproduces dnn-partitioning's own objective.
SETS = {
    "layer": ("LayerGraphs", ("bert24", "gnmt", "inceptionv3", "resnet50"), None),
    "operator": ("OperatorGraphs", ("bert_l-3", "bert_l-6", "bert_l-12", "resnet50"), None),
    "layer-training": ("LayerGraphs", ("bert24", "gnmt", "inceptionv3", "resnet50"), "training"),
    "operator-training": ("OperatorGraphs", ("bert_l-3", "bert_l-6", "bert_L-12", "resnet50"), "training"),
}
PIPEDREAM_GRAPHS = (
    "alexnet", "vgg16", "gnmt", "squeezenet1_0", "resnet18", "gnmt_large", "resnet50", "resnext50",
    "inception_v3", "resnet101", "resnext101", "densenet121", "nasnetamobile", "nasnetalarge",
)
#: Traced Hugging Face models: name -> (fxpipe.models arch, config overrides). seq_len 512,
#: batch 1 (one micro-batch), costed for an H100 SXM in bf16. The Llama graphs use
#: Llama-2-7B widths (hidden 4096, 32 heads, intermediate 11008, vocab 32000) with 2, 4
#: or 8 layers; Mixtral uses fxpipe.models' small default (2 layers, hidden 256, 4 experts).
TRACED = {
    "gpt2": ("gpt2", {}),
    "t5-small": ("t5", {}),
    "mixtral-small": ("mixtral", {}),
    "llama7b-L2": ("llama-2-7b", {"num_hidden_layers": 2}),
    "llama7b-L4": ("llama-2-7b", {"num_hidden_layers": 4}),
    "llama7b-L8": ("llama-2-7b", {"num_hidden_layers": 8}),
}
TRACED_SEQ_LEN = 512
#: objective and comm mode of each set (``--objective``/``--comm`` override them).
SET_OBJECTIVE = {
    "layer": ("inference", "dag"),
    "operator": ("inference", "dag"),
    "layer-training": ("inference", "dag"),
    "operator-training": ("inference", "dag"),
    "pipedream": ("training", "dag"),
    "traced": ("training", "relay"),
    "llama70b": ("training", "relay"),
}
ALL_SETS = tuple(SET_OBJECTIVE)
METHODS = ("simple", "chain", "lp", "bottleneck", "guess", "exact")
#: the issue's targets for the 70B graph: k -> best bound / bottleneck
TARGETS_70B = {8: 0.97, 16: 0.97, 64: 0.95}
#: Archer et al. 2024, Table 1 (production graphs), k = 2, 4, 8, 16.
PAPER_TABLE1 = {
    "simple": (0.8340, 0.6627, 0.5236, 0.4598),
    "bottleneck": (0.9597, 0.7911, 0.6481, 0.5770),
    "guess": (0.9901, 0.8446, 0.6601, 0.5780),
    "exact": (0.9901, 0.9737, 0.9588, 0.9452),
}
PAPER_KS = (2, 4, 8, 16)


def geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def default_graphs(graph_set: str) -> tuple[str, ...]:
    if graph_set == "pipedream":
        return PIPEDREAM_GRAPHS
    if graph_set == "traced":
        return tuple(TRACED)
    if graph_set == "llama70b":
        return ("llama-3-70b",)
    return SETS[graph_set][1]


def load_graph(graph_set: str, name: str, objective: str):
    """The OpGraph ``name`` of ``graph_set`` (traced sets are traced on the meta device)."""
    if graph_set == "pipedream":
        return load_pipedream(os.path.join(PIPEDREAM_ROOT, f"{name}.graph.txt"))
    if graph_set == "llama70b":
        from model_graphs import cached_graph

        return cached_graph(name)
    if graph_set == "traced":
        import torch

        from fxpipe.models import build_hf_model
        from fxpipe.passes import trace_model

        if name not in TRACED:
            raise SystemExit(f"unknown traced graph {name!r}; choose from {', '.join(TRACED)}")
        arch, overrides = TRACED[name]
        model, args, kwargs = build_hf_model(arch, {"seq_len": TRACED_SEQ_LEN, **overrides}, device="meta")
        return trace_model(model, args, kwargs, hardware="h100-sxm", dtype=torch.bfloat16, name=name).graph
    folder, _, suffix = SETS[graph_set]
    return load_dnn_partitioning(os.path.join(DATA_ROOT, folder, f"{name}_{suffix or objective}.json"))


def parse_limits(items, default: float) -> dict:
    """``["exact=60", "guess=20"]`` -> per-method seconds (others: ``default``)."""
    out = {m: default for m in METHODS}
    for item in items or ():
        m, _, v = item.partition("=")
        if m not in METHODS or not v:
            raise SystemExit(f"--limit wants METHOD=SECONDS with METHOD in {METHODS}, got {item!r}")
        out[m] = float(v)
    return out


def hierarchy(g, k, objective, comm, methods, limits, warm, workers, skip=True):
    """Run ``methods`` in order as :func:`fxpipe.partition.bounds.compute_bounds` does (each
    MIP starts from the best bound of the lower-ranked methods before it; the exact MIP is
    warm-started with the best partition; with ``skip`` the MIPs are skipped once the best
    partition is proven optimal), but with a time limit per method.

    Returns (certificates by method, best Partition).
    """
    rank = {m: i for i, m in enumerate(METHODS)}
    data = None
    best = warm
    certs = {}
    for m in methods:
        if m == "simple":
            certs[m] = simple_bound(g, k, objective, comm)
            continue
        if m == "chain":
            cert, cand = chain_certificate(g, k, objective, comm)
            if cand is not None and cand.bottleneck < best.bottleneck * (1 - 1e-12):
                best = cand
            certs[m] = cert
            continue
        known = max((c.lower_bound for mm, c in certs.items() if rank[mm] < rank[m]), default=0.0)
        proven = max((c.lower_bound for c in certs.values()), default=0.0)
        if skip and proven >= best.bottleneck * (1 - PROVEN_RTOL):
            by = max(certs, key=lambda mm: certs[mm].lower_bound)
            certs[m] = Certificate(method=m, lower_bound=known, status="skipped", details={"reason": f"proven optimal by {by}"})
            continue
        if data is None:
            data = make_mip_data(g, k, objective, comm)
        cert, inc = bound(m, data, time_limit_s=limits[m], warm_start=best.assignment, workers=workers, known_lower_bound_s=known)
        if inc is not None:
            cand = Partition.from_assignment(g, inc, k, objective, comm, meta={"method": f"scip-{m}"})
            if cand.bottleneck < best.bottleneck * (1 - 1e-12):
                best = cand
        certs[m] = cert
    return certs, best


def _summary_markdown(title, rows, ks, methods, instances_per_k):
    """Markdown tables (Archer et al. Tables 1/3 layout) from the per-instance rows."""
    lines = [f"### {title}", ""]
    ratios = {m: {k: [r["ratio"][m] for r in rows if r["k"] == k and m in r["ratio"]] for k in ks} for m in methods}
    lines.append("Geometric mean of lower bound / best partition:")
    lines.append("")
    lines.append("| method | " + " | ".join(f"k={k}" for k in ks) + " | Archer Table 1 (k=2,4,8,16, published) |")
    lines.append("|---|" + "---:|" * len(ks) + "---|")
    for m in methods:
        paper = PAPER_TABLE1.get(m)
        ptxt = " / ".join(f"{x:.4f}" for x in paper) if paper else "-"
        lines.append(f"| {m} | " + " | ".join(f"{geomean(ratios[m][k]):.4f}" for k in ks) + f" | {ptxt} |")
    hier = {k: [max(r["ratio"].values()) for r in rows if r["k"] == k] for k in ks}
    lines.append("| max over methods | " + " | ".join(f"{geomean(hier[k]):.4f}" for k in ks) + " | (best bound of the hierarchy, per instance) |")
    proven = {k: sum(1 for r in rows if r["k"] == k and max(r["ratio"].values()) >= 1 - 1e-6) for k in ks}
    lines.append("| proven optimal | " + " | ".join(f"{proven[k]}/{instances_per_k.get(k, 0)}" for k in ks) + " | (best bound = best partition, any method) |")
    for m in methods:
        if m == "simple":
            continue
        ts = {k: [r["wall_s"][m] for r in rows if r["k"] == k and m in r["wall_s"] and r["status"].get(m) != "skipped"] for k in ks}
        lines.append(f"| {m} max s | " + " | ".join(f"{max(ts[k]):.1f}" if ts[k] else "skipped" for k in ks) + " | (slowest instance, seconds) |")
    brk = {k: [r["best"] / r["brkga"] for r in rows if r["k"] == k and r["brkga"] > 0] for k in ks}
    lines.append("| best/brkga | " + " | ".join(f"{geomean(brk[k]):.4f}" for k in ks) + " | (how much the MIPs improved the BRKGA partition) |")
    if "exact" in methods:
        opt = {k: sum(1 for r in rows if r["k"] == k and r["status"].get("exact") == "optimal") for k in ks}
        lines.append("| exact optimal | " + " | ".join(f"{opt[k]}/{instances_per_k.get(k, 0)}" for k in ks) + " | (instances proven optimal) |")
        ts = {k: [r["wall_s"]["exact"] for r in rows if r["k"] == k and "exact" in r["wall_s"]] for k in ks}
        lines.append("| exact max s | " + " | ".join(f"{max(ts[k]):.1f}" if ts[k] else "-" for k in ks) + " | |")
        mins = {k: min(ratios["exact"][k]) if ratios["exact"][k] else float("nan") for k in ks}
        lines.append("| exact min ratio | " + " | ".join(f"{mins[k]:.4f}" for k in ks) + " | (worst instance) |")
    return lines


def run_hierarchy(args) -> None:
    ks = [int(x) for x in args.ks.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    limits = parse_limits(args.limit, args.time_limit)
    names = args.graphs.split(",")
    lim_txt = ", ".join(f"{m} {limits[m]:g}s" for m in methods if m != "simple")
    print(
        f"set={args.graph_set} objective={args.objective} comm={args.comm} graphs={args.graphs} ks={ks} "
        f"time limits: {lim_txt}; brkga {args.search_time:g}s; guess workers {args.workers}"
    )
    print(f"{'graph':<14} {'n':>5} {'k':>3} {'brkga':>10} {'best':>10} " + " ".join(f"{m:>10}" for m in methods) + "  exact status / time")
    rows = []
    doc = {
        "benchmark": "bench_bounds",
        "command": "python benchmarks/bench_bounds.py " + " ".join(sys.argv[1:]),
        "set": args.graph_set,
        "objective": args.objective,
        "comm": args.comm,
        "ks": ks,
        "methods": methods,
        "time_limits_s": {m: limits[m] for m in methods if m != "simple"},
        "search_time_s": args.search_time,
        "workers": args.workers,
        "traced_seq_len": TRACED_SEQ_LEN if args.graph_set == "traced" else None,
        "instances": rows,
        "complete": False,
    }
    t_all = time.perf_counter()
    skipped = []
    try:
        for name in names:
            t_load = time.perf_counter()
            g = load_graph(args.graph_set, name, args.objective)
            load_s = time.perf_counter() - t_load
            for k in ks:
                if args.budget_s and time.perf_counter() - t_all > args.budget_s:
                    skipped.append(f"{name} k={k}")
                    continue
                t0 = time.perf_counter()
                brk = partition(g, k, objective=args.objective, comm=args.comm, method="brkga", time_limit_s=args.search_time, seed=0)
                certs, bestp = hierarchy(g, k, args.objective, args.comm, methods, limits, brk, args.workers, skip=not args.no_skip)
                best = bestp.bottleneck
                row = {
                    "graph": name, "n": g.n, "m": g.m, "k": k, "load_s": load_s,
                    "brkga": brk.bottleneck, "best": best, "best_method": bestp.meta.get("method"),
                    "lower_bound": {m: c.lower_bound for m, c in certs.items()},
                    "ratio": {m: (c.lower_bound / best if best > 0 else 1.0) for m, c in certs.items()},
                    "status": {m: c.status for m, c in certs.items()},
                    "wall_s": {m: c.wall_time_s for m, c in certs.items()},
                    "nodes": {m: c.nodes for m, c in certs.items()},
                    "instance_s": None,
                }
                row["instance_s"] = time.perf_counter() - t0
                rows.append(row)
                ex = certs.get("exact")
                tail = f"  {ex.status} {ex.wall_time_s:.1f}s" if ex is not None else ""
                print(
                    f"{name:<14} {g.n:>5} {k:>3} {brk.bottleneck:>10.5g} {best:>10.5g} "
                    + " ".join(f"{row['ratio'][m]:10.4f}" for m in methods) + tail + f"  (instance {row['instance_s']:.0f}s)",
                    flush=True,
                )
                if args.json:
                    write_json_atomic(args.json, doc)
        doc["complete"] = not skipped
    except KeyboardInterrupt:
        print("\ninterrupted: summarising the instances finished so far")
    doc["skipped"] = skipped
    doc["total_s"] = time.perf_counter() - t_all
    print(f"\ntotal {doc['total_s']:.0f}s" + (f"; skipped over the {args.budget_s:g}s budget: {', '.join(skipped)}" if skipped else ""))
    text, extra = render(doc)
    doc.update(extra)
    print("\n" + text)
    if args.json:
        write_json_atomic(args.json, doc)
    if args.markdown:
        write_markdown(args.markdown, doc, text, doc["command"])


def render(doc):
    """Markdown summary of a result document; returns (text, fields to add to the doc)."""
    rows, ks, methods = doc["instances"], doc["ks"], doc["methods"]
    limits = doc["time_limits_s"]
    per_k = {k: sum(1 for r in rows if r["k"] == k) for k in ks}
    title = f"set {doc['set']} ({doc['objective']}/{doc['comm']}), {len({r['graph'] for r in rows})} graphs"
    lim_txt = ", ".join(f"{m} {v:g} s" for m, v in limits.items())
    md = _summary_markdown(title, rows, ks, methods, per_k)
    md.insert(2, f"Time limits per instance: {lim_txt}; BRKGA {doc['search_time_s']:g} s; guess workers {doc['workers']}; "
                 f"total wall {doc.get('total_s', float('nan')):.0f} s" + (f"; skipped (budget): {', '.join(doc['skipped'])}" if doc.get("skipped") else "") + ".")
    md.insert(3, "")
    extra = {}
    if "exact" in methods and rows:
        small = [k for k in ks if k <= 8 and per_k[k]]
        if small:
            rat = {k: [r["ratio"]["exact"] for r in rows if r["k"] == k] for k in small}
            g8 = geomean([x for k in small for x in rat[k]])
            worst = min(geomean(rat[k]) for k in small)
            slow = max(r["wall_s"]["exact"] for r in rows if r["k"] in small)
            ok = worst >= 0.95 and limits["exact"] <= 300
            word = "MET" if ok else ("NOT MET" if limits["exact"] >= 300 else f"NOT MET at the {limits['exact']:g} s limit (5 min not run)")
            verdict = (
                f"target exact/best >= 0.95 geomean for k <= 8 at <= 5 min/instance: {word} "
                f"(worst per-k geomean {worst:.4f}, overall {g8:.4f}, exact limit {limits['exact']:g}s, slowest exact {slow:.1f}s)"
            )
            md += ["", verdict]
            extra["target"] = {"met": ok, "worst_per_k_geomean": worst, "overall_geomean": g8, "slowest_exact_s": slow}
    if doc["set"] == "llama70b" and rows:
        checks = []
        for k, want in TARGETS_70B.items():
            got = [max(r["ratio"].values()) for r in rows if r["k"] == k]
            if got:
                checks.append((k, want, min(got)))
        if checks:
            ok = all(g >= w for _, w, g in checks)
            md += ["", "70B targets (best bound / bottleneck): " + ", ".join(f"k={k} {g:.4f} (>= {w})" for k, w, g in checks)
                   + f": {'MET' if ok else 'NOT MET'}"]
            extra["target_70b"] = {"met": ok, "checks": checks}
    extra["summary"] = {
        m: {str(k): geomean([r["ratio"][m] for r in rows if r["k"] == k and m in r["ratio"]]) for k in ks} for m in methods
    }
    return "\n".join(md), extra


def write_markdown(path, doc, text, cmd):
    """The summary and a per-instance table, written atomically (temp file + rename)."""
    methods = doc["methods"]
    body = [f"<!-- {cmd} -->", text, "", "Per instance (ratio = bound / best):", "",
            "| graph | n | k | best | " + " | ".join(methods) + " | exact status | exact s | exact nodes |",
            "|---|---:|---:|---:|" + "---:|" * len(methods) + "---|---:|---:|"]
    for r in doc["instances"]:
        body.append(
            f"| {r['graph']} | {r['n']} | {r['k']} | {r['best']:.5g} | " + " | ".join(f"{r['ratio'][m]:.4f}" for m in methods)
            + f" | {r['status'].get('exact', '-')} | {r['wall_s'].get('exact', float('nan')):.1f} | {r['nodes'].get('exact', '-')} |"
        )
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write("\n".join(body) + "\n")
    os.replace(tmp, path)


def summarize(paths, markdown) -> None:
    """Re-render the markdown of saved ``--json`` documents (several: one after another)."""
    from fxpipe.ir import read_json

    for path in paths:
        doc = read_json(path)
        text, _ = render(doc)
        print(text + "\n")
        if markdown:
            tmp = markdown if len(paths) == 1 else f"{os.path.splitext(markdown)[0]}_{doc['set']}.md"
            cmd = doc.get("command") or "(command not recorded)"
            write_markdown(tmp, doc, text, f"{cmd} (re-rendered: python benchmarks/bench_bounds.py --summarize {path})")


def run_settings(args) -> None:
    """Wall time of the warm-started exact MIP and of the bottleneck MIP under several
    SCIP settings (to choose the defaults of :mod:`fxpipe.partition.bounds`)."""
    variants = [
        ("default", {}),
        ("heur off", {"heuristics": "off"}),
        ("emph optimality", {"emphasis": "optimality"}),
        ("sepa fast", {"separating": "fast"}),
        ("sepa off", {"separating": "off"}),
    ]
    if args.settings_full:
        variants += [("heur fast", {"heuristics": "fast"}), ("presolve off", {"params": {"presolving/maxrounds": 0}})]
    cases = [(name, int(k)) for name in args.graphs.split(",") for k in args.ks.split(",")]
    for method in args.settings_methods.split(","):
        print(f"\n{method} MIP (exact warm-started with BRKGA {args.search_time:g}s), limit {args.time_limit:g}s: wall seconds (status)")
        print(f"{'instance':<14} " + " ".join(f"{v:>16}" for v, _ in variants))
        totals = {v: [] for v, _ in variants}
        for name, k in cases:
            g = load_graph(args.graph_set, name, args.objective)
            brk = partition(g, k, objective=args.objective, comm=args.comm, method="brkga", time_limit_s=args.search_time, seed=0)
            data = make_mip_data(g, k, args.objective, args.comm)
            cells = []
            for v, kw in variants:
                cert, _ = bound(method, data, time_limit_s=args.time_limit, warm_start=brk.assignment, workers=1, **kw)
                totals[v].append(cert.wall_time_s)
                cells.append(f"{cert.wall_time_s:7.2f} ({cert.status[:4]})")
            print(f"{name + ' k=' + str(k):<14} " + " ".join(f"{c:>16}" for c in cells), flush=True)
        print(f"{'geomean s':<14} " + " ".join(f"{geomean(totals[v]):>16.2f}" for v, _ in variants))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="bert24 + gnmt, k = 2, 4, 10 s per method")
    p.add_argument("--settings", action="store_true", help="compare SCIP settings on the MIPs")
    p.add_argument("--settings-methods", default="exact,bottleneck", help="methods for --settings (default exact,bottleneck)")
    p.add_argument("--settings-full", action="store_true", help="also heuristics fast and presolve off")
    p.add_argument("--set", dest="graph_set", choices=ALL_SETS, default="layer", help="graph set (default layer)")
    p.add_argument("--graphs", default=None, help="comma-separated graph names of the set (default: all of it)")
    p.add_argument("--ks", default=None, help="comma-separated k values (default 2,4,8,16)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--time-limit", type=float, default=None, help="seconds per method and instance (default 60; quick 10)")
    p.add_argument("--limit", action="append", metavar="METHOD=SECONDS", help="per-method time limit (repeatable), e.g. --limit exact=30")
    p.add_argument("--search-time", type=float, default=None, help="BRKGA seconds per instance (default 10; quick 3)")
    p.add_argument("--objective", default=None, choices=("inference", "training"), help="default: the set's (see SET_OBJECTIVE)")
    p.add_argument("--comm", default=None, choices=("dag", "relay"), help="default: the set's (see SET_OBJECTIVE)")
    p.add_argument("--workers", type=int, default=2, help="processes for the guess sub-MIPs")
    p.add_argument("--no-skip", action="store_true", help="run every MIP even when the partition is already proven optimal")
    p.add_argument("--budget-s", type=float, default=None, help="skip the instances that would start after this many seconds")
    p.add_argument("--json", default=None, metavar="OUT", help="write every instance and the summary here (atomically, after each instance)")
    p.add_argument("--markdown", default=None, metavar="OUT", help="write the summary and per-instance tables as markdown")
    p.add_argument("--summarize", nargs="+", metavar="JSON", help="only re-render the markdown of saved --json results")
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize, args.markdown)
        return 0
    if args.quick:
        args.graphs = args.graphs or "bert24,gnmt"
        args.ks = args.ks or "2,4"
        args.time_limit = args.time_limit or 10.0
        args.search_time = args.search_time or 3.0
    obj, comm = SET_OBJECTIVE[args.graph_set]
    args.objective = args.objective or obj
    args.comm = args.comm or comm
    args.graphs = args.graphs or ",".join(default_graphs(args.graph_set))
    args.ks = args.ks or ("8,16,32,64" if args.graph_set == "llama70b" else "2,4,8,16")
    args.time_limit = args.time_limit or 60.0
    args.search_time = args.search_time or 10.0
    np.seterr(all="ignore")
    if args.settings:
        run_settings(args)
    else:
        run_hierarchy(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
