"""Benchmark: MILP pipeline schedules against the heuristics, with proven bounds.

Prints three tables (all values are the problem's objective, stage span by default):

(a) the Zero Bubble instances (toy1, toy2, profiled-4, unit-32): fxpipe's MILP value, its
    lower bound and gap next to the Zero Bubble greedy heuristic measured in the same run;
(b) a memory-limited offload case (p=4, m=16, F=B=W=1, offload 0.5, limit 2 per stage)
    where 1F1B does not fit: MILP against PipeOffload and AdaOffload;
(c) p in {4, 8}, m in {8, 16, 32}, memory limits from "1F1B fits" (p stashes) down to
    "only offloading keeps the pipeline busy" (2 stashes): GPipe, 1F1B, ZB-H1, ZB-H2,
    PipeOffload, AdaOffload and the MILP (gap, time);
(d) memory-limited without fast offload (p=4, m=8, F=B=W=1; offload time 2 = 2F, or no
    offloadable bytes; limits p and p/2 stashes): where the memory-aware combinatorial
    bound (fxpipe.schedule.bounds, warm-up/drain bubbles) exceeds the memory-blind one.
(e) several stages per device: p in {4, 8} devices, v in {1, 2} stages per device, m in
    {8, 16, 32}, the same work per device (F = B = W = 1 per device and micro-batch, so
    1/v per stage), no comm, no offload, memory limits from loose to tight in *full-device
    activations* (one = one micro-batch's stash over everything a device holds): bubble
    ratio (1 - busy / largest per-device span) of 1F1B and ZB-H1 (v = 1), interleaved 1F1B
    (v = 2, looped placement), ZB-V and DualPipe-V (v = 2, V placement), and the MILP
    (v = 1: one stage per device; v = 2: V placement), with its gap and solve time.
(f) the DualPipe case of the operator-level MIP paper (Sec. V-A): PP devices, 2 PP
    V-placed stages, F = B = W = 1 per stage, no comm, m = 2 PP, a limit of PP + 1
    full-device activations (= 2 PP + 2 stage stashes) and, tighter, PP + 1 stage stashes:
    the largest per-device bubble (span minus busy time) of ZB-V, DualPipe-V and the MILP,
    and the MILP's lower bound.
(g) traced GPT-2 (124M, 1024 tokens) and Llama-2-7B (meta device, 4096 tokens; random
    weights, no download), planned by ``fxpipe.api.plan_graph`` (the placement-aware plan of
    ``fxpipe.compile``): a partition into v * p stages (fxpipe's partitioner, training
    objective, relayed comm), placed one stage per device (v = 1), looped or V-shaped (v = 2);
    the per-device bottleneck (fxpipe.partition.placement: a device's stages plus its
    transfers to other devices), predicted step time (makespan) and per-device span of 1F1B /
    ZB-H1 (v = 1), interleaved 1F1B (looped) and ZB-V / DualPipe-V (V), and what
    ``stages_per_device="auto", placement="auto"`` keeps. Needs torch and transformers.

Tables (a), (c) and (d) print the memory-blind round-trip bound ("old LB") next to the
combinatorial bound the MILP now starts from ("comb LB", also an objective cut in the
model); "bound" is the reported lower bound (max of SCIP's dual bound, comb LB and, for MILP
limits >= 60 s, the time-indexed probe bound of ``milp.solve``; see bench_schedule_bounds.py).

Targets (from the issue): (a)/(b) MILP valid and no longer than the baselines, with a bound;
p=4, m=8 proved optimal within 60 s; p=8, m=16 within 5% of its bound within 300 s.

Usage::

    python benchmarks/bench_schedule.py --quick          # short limits, subsets of (c), (e), (f)
    python benchmarks/bench_schedule.py --time-limit 60 --big-time-limit 300
    python benchmarks/bench_schedule.py --tables ef --time-limit 60
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxpipe.errors import FxpipeError  # noqa: E402
from fxpipe.ir import ScheduleProblem, looped_placement, v_placement  # noqa: E402
from fxpipe.schedule import heuristics, milp  # noqa: E402
from fxpipe.schedule.bounds import combinatorial_lower_bound, round_trip_lower_bound  # noqa: E402
from fxpipe.schedule.validate import check_schedule, device_busy_s, device_spans  # noqa: E402

BASELINES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "pipeoffload", "adaoffload", "offload-search")


def zb_instances() -> list[tuple[str, ScheduleProblem, float]]:
    """Zero Bubble's instances with the greedy stage span quoted in the issue."""
    toy = dict(num_stages=4, num_microbatches=12, t_f=5, t_b=6, t_w=4, t_comm=0, mem_f=2, mem_b=-1, mem_w=-1,
               offload_bytes=0)
    return [
        ("toy1", ScheduleProblem.create(**toy, mem_limit=10, name="toy1"), 193.0),
        ("toy2", ScheduleProblem.create(**toy, mem_limit=14, name="toy2"), 183.0),
        ("profiled-4", ScheduleProblem.create(num_stages=4, num_microbatches=12, t_f=5478, t_b=5806, t_w=3534,
                                              t_comm=200, mem_f=2, mem_b=-1, mem_w=-1, offload_bytes=0,
                                              mem_limit=32, name="profiled-4"), 178898.0),
        ("unit-32", ScheduleProblem.create(num_stages=32, num_microbatches=16, t_f=1, t_b=1, t_w=1, mem_f=2,
                                           mem_b=-1, mem_w=-1, offload_bytes=0, mem_limit=64, name="unit-32"), 95.0),
    ]


def offload_case(p: int = 4, m: int = 16, limit: float = 2.0) -> ScheduleProblem:
    return ScheduleProblem.create(num_stages=p, num_microbatches=m, t_f=1, t_b=1, t_w=1, t_offload=0.5, mem_f=1,
                                  mem_b=-0.5, mem_w=-0.5, mem_limit=limit, name=f"offload-p{p}-m{m}-L{limit:g}")


def baseline(problem: ScheduleProblem, method: str) -> float:
    """Objective of a heuristic, or nan if it does not fit / is invalid."""
    try:
        s = heuristics.generate(problem, method)
    except FxpipeError:
        return math.nan
    if check_schedule(problem, s.ops):
        return math.nan
    return s.value


def run_milp(problem: ScheduleProblem, limit_s: float) -> dict:
    t0 = time.perf_counter()
    res = milp.solve(problem, time_limit_s=limit_s)
    wall = time.perf_counter() - t0
    errs = check_schedule(problem, res.ops)
    return {"value": res.value, "bound": res.lower_bound_s, "old_lb": round_trip_lower_bound(problem),
            "comb_lb": combinatorial_lower_bound(problem), "dual": res.meta["dual"], "gap": res.meta["gap"],
            "status": res.status,
            "valid": not errs, "wall_s": wall, "nodes": res.meta["nodes"], "warm": res.meta["warm_start"]["method"],
            "warm_value": res.meta["warm_start"]["value_s"],
            "xf": res.meta.get("extract_failures", 0)}


def fmt(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.6g}"


def table_a(limit_s: float) -> None:
    print(f"\n(a) Zero Bubble instances, MILP time limit {limit_s:g} s")
    print(f"{'instance':<12}{'greedy':>10}{'(issue)':>10}{'old LB':>10}{'comb LB':>10}{'milp':>10}{'bound':>10}{'gap%':>8}"
          f"{'status':>11}{'valid':>7}{'wall s':>8}")
    for name, p, quoted in zb_instances():
        greedy = baseline(p, "greedy")
        r = run_milp(p, limit_s)
        ok = r["valid"] and r["value"] <= greedy + 1e-9
        print(f"{name:<12}{fmt(greedy):>10}{fmt(quoted):>10}{fmt(r['old_lb']):>10}{fmt(r['comb_lb']):>10}"
              f"{fmt(r['value']):>10}{fmt(r['bound']):>10}"
              f"{100 * r['gap']:>8.2f}{r['status']:>11}{str(ok):>7}{r['wall_s']:>8.1f}", flush=True)


def table_b(limit_s: float) -> None:
    p = offload_case()
    print(f"\n(b) offload case p=4 m=16 F=B=W=1 offload 0.5 limit 2, MILP time limit {limit_s:g} s")
    vals = {m: baseline(p, m) for m in ("1f1b", "zb-h1", "pipeoffload", "adaoffload", "offload-search")}
    r = run_milp(p, limit_s)
    print("  " + "  ".join(f"{k}={fmt(v)}" for k, v in vals.items()))
    print(f"  old LB={fmt(r['old_lb'])} comb LB={fmt(r['comb_lb'])} milp={fmt(r['value'])} bound={fmt(r['bound'])} "
          f"gap={100 * r['gap']:.2f}% status={r['status']} "
          f"valid={r['valid']} nodes={r['nodes']} wall={r['wall_s']:.1f}s (warm start {r['warm']} {fmt(r['warm_value'])})",
          flush=True)


def table_c(quick: bool, limit_s: float, big_limit_s: float, sizes=None) -> None:
    if sizes is None:
        sizes = [(4, 8), (4, 16)] if quick else [(4, 8), (4, 16), (4, 32), (8, 8), (8, 16), (8, 32)]
    print(f"\n(c) grid, F=B=W=1, offload 0.5, mem_f=1; MILP limit {limit_s:g} s ({big_limit_s:g} s for p=8, m=16)")
    head = "".join(f"{b:>12}" for b in BASELINES)
    print(f"{'p':>3}{'m':>4}{'limit':>7}{head}{'old LB':>8}{'comb LB':>8}{'milp':>9}{'bound':>9}{'gap%':>7}{'status':>11}"
          f"{'wall s':>8}{'xfail':>6}")
    for p, m in sizes:
        limits = sorted({float(p), max(2.0, p / 2), 2.0}, reverse=True)
        for lim in limits:
            prob = offload_case(p, m, lim)
            base = [baseline(prob, b) for b in BASELINES]
            t = big_limit_s if (p, m) == (8, 16) else limit_s
            r = run_milp(prob, t)
            vals = "".join(f"{fmt(v):>12}" for v in base)
            flag = "" if r["valid"] else " INVALID"
            print(f"{p:>3}{m:>4}{lim:>7g}{vals}{fmt(r['old_lb']):>8}{fmt(r['comb_lb']):>8}{fmt(r['value']):>9}"
                  f"{fmt(r['bound']):>9}{100 * r['gap']:>7.2f}"
                  f"{r['status']:>11}{r['wall_s']:>8.1f}{r['xf']:>6}{flag}", flush=True)


def table_d(limit_s: float, sizes=None) -> None:
    sizes = sizes or [(4, 8)]
    print(f"\n(d) memory-limited, slow or no offload, F=B=W=1, mem_f=1; MILP limit {limit_s:g} s")
    base_names = ("1f1b", "zb-h1", "pipeoffload", "adaoffload", "offload-search")
    head = "".join(f"{b:>12}" for b in base_names)
    print(f"{'p':>3}{'m':>4}{'limit':>7}{'offload':>9}{head}{'old LB':>8}{'comb LB':>8}{'milp':>9}{'bound':>9}{'gap%':>7}"
          f"{'status':>11}{'wall s':>8}")
    for p, m in sizes:
        for lim in sorted({float(p), max(2.0, p / 2)}, reverse=True):
            for label, kw in (("t=2", {"t_offload": 2.0}), ("none", {"offload_bytes": 0.0})):
                prob = ScheduleProblem.create(num_stages=p, num_microbatches=m, t_f=1, t_b=1, t_w=1, mem_f=1,
                                              mem_b=-0.5, mem_w=-0.5, mem_limit=lim, name=f"slow-p{p}-m{m}-L{lim:g}-{label}",
                                              **kw)
                base = "".join(f"{fmt(baseline(prob, b)):>12}" for b in base_names)
                r = run_milp(prob, limit_s)
                flag = "" if r["valid"] else " INVALID"
                print(f"{p:>3}{m:>4}{lim:>7g}{label:>9}{base}{fmt(r['old_lb']):>8}{fmt(r['comb_lb']):>8}"
                      f"{fmt(r['value']):>9}{fmt(r['bound']):>9}{100 * r['gap']:>7.2f}{r['status']:>11}"
                      f"{r['wall_s']:>8.1f}{flag}", flush=True)


def grid_problem(p: int, v: int, m: int, limit_full: float, placement: str) -> ScheduleProblem:
    """p devices, v stages per device, F = B = W = 1 per device (1/v per stage), memory in
    full-device activations (a stage stash is 1/v), no comm, no offload."""
    dev = {"identity": None, "looped": looped_placement(p, v), "v": v_placement(p, v)}[placement]
    return ScheduleProblem.create(num_stages=v * p, num_microbatches=m, t_f=1 / v, t_b=1 / v, t_w=1 / v,
                                  mem_f=1 / v, mem_b=-0.5 / v, mem_w=-0.5 / v, offload_bytes=0.0, mem_limit=limit_full,
                                  device_of_stage=dev, name=f"grid-p{p}-v{v}-m{m}-L{limit_full:g}-{placement}")


def bubble_of(problem: ScheduleProblem, method: str) -> tuple[float, float]:
    """(bubble ratio, seconds) of a heuristic: 1 - busy / largest device span; nan if it does not apply."""
    t0 = time.perf_counter()
    try:
        s = heuristics.generate(problem, method)
    except FxpipeError:
        return math.nan, time.perf_counter() - t0
    if check_schedule(problem, s.ops):
        return math.nan, time.perf_counter() - t0
    return 1.0 - float(device_busy_s(problem).max()) / s.value, time.perf_counter() - t0


def pct(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def table_e(quick: bool, limit_s: float) -> None:
    ps = (4,) if quick else (4, 8)
    ms = (8, 16) if quick else (8, 16, 32)
    print(f"\n(e) several stages per device: bubble ratio % (1 - busy / largest device span), F=B=W=1 per device, "
          f"no comm, no offload; MILP limit {limit_s:g} s")
    cols = ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipe-v")
    print(f"{'p':>3}{'v':>3}{'m':>4}{'limit':>7}" + "".join(f"{c:>17}" for c in cols)
          + f"{'milp':>7}{'bound':>7}{'gap%':>7}{'status':>11}{'milp s':>8}{'heur s':>8}")
    for p in ps:
        limits = (math.inf, p + 1.0, float(p), p / 2)
        for v in (1, 2):
            for m in ms:
                for lim in limits:
                    if v == 1:
                        probs = {"1f1b": grid_problem(p, 1, m, lim, "identity"), "zb-h1": grid_problem(p, 1, m, lim, "identity")}
                        mp = probs["1f1b"]
                    else:
                        lp, vp = grid_problem(p, 2, m, lim, "looped"), grid_problem(p, 2, m, lim, "v")
                        probs = {"interleaved-1f1b": lp, "zb-v": vp, "dualpipe-v": vp}
                        mp = vp
                    row, heur_s = [], 0.0
                    for c in cols:
                        if c in probs:
                            b, t = bubble_of(probs[c], c)
                            heur_s += t
                            row.append(pct(b))
                        else:
                            row.append("")
                    try:
                        t0 = time.perf_counter()
                        res = milp.solve(mp, time_limit_s=limit_s)
                        wall = time.perf_counter() - t0
                        busy = float(device_busy_s(mp).max())
                        mb = pct(1 - busy / res.value)
                        bnd = pct(1 - busy / res.lower_bound_s) if res.lower_bound_s > 0 else "-"
                        gap, status = f"{100 * res.meta['gap']:.2f}", res.status
                    except FxpipeError as exc:
                        mb, bnd, gap, status, wall = "-", "-", "-", type(exc).__name__[:10], 0.0
                    print(f"{p:>3}{v:>3}{m:>4}{lim:>7g}" + "".join(f"{x:>17}" for x in row)
                          + f"{mb:>7}{bnd:>7}{gap:>7}{status:>11}{wall:>8.1f}{heur_s:>8.2f}", flush=True)


def dualpipe_problem(pp: int, limit_stage_stashes: float) -> ScheduleProblem:
    """Sec. V-A of the operator-level MIP paper, V-shaped: 2 PP unit stages on PP devices."""
    return ScheduleProblem.create(num_stages=2 * pp, num_microbatches=2 * pp, t_f=1, t_b=1, t_w=1, t_comm=0,
                                  mem_f=1.0, mem_b=-0.5, mem_w=-0.5, offload_bytes=0.0, mem_limit=limit_stage_stashes,
                                  device_of_stage=v_placement(pp), name=f"dualpipe-pp{pp}-L{limit_stage_stashes:g}")


def table_f(quick: bool, limit_s: float) -> None:
    print(f"\n(f) DualPipe case (paper Sec. V-A): largest per-device bubble (span - busy), unit F/B/W; MILP limit {limit_s:g} s")
    print(f"{'PP':>3}{'limit (stage stashes)':>23}{'target':>8}{'greedy':>8}{'zb-v':>8}{'dualpipe-v':>12}{'milp':>8}"
          f"{'bound':>8}{'status':>11}{'milp s':>8}")
    for pp in ((4,) if quick else (4, 8)):
        for label, lim in ((f"{pp + 1} full = {2 * pp + 2}", 2.0 * (pp + 1)), (f"{pp + 1} stage", float(pp + 1))):
            prob = dualpipe_problem(pp, lim)
            busy = float(device_busy_s(prob).max())
            vals = []
            for meth in ("greedy", "zb-v", "dualpipe-v"):
                try:
                    s = heuristics.generate(prob, meth)
                    vals.append(fmt(float((device_spans(prob, s) - device_busy_s(prob)).max())))
                except FxpipeError:
                    vals.append("-")
            t0 = time.perf_counter()
            res = milp.solve(prob, time_limit_s=limit_s)
            wall = time.perf_counter() - t0
            bub = float((device_spans(prob, res) - device_busy_s(prob)).max())
            print(f"{pp:>3}{label:>23}{pp / 2 - 1:>8g}{vals[0]:>8}{vals[1]:>8}{vals[2]:>12}{fmt(bub):>8}"
                  f"{fmt(res.lower_bound_s - busy):>8}{res.status:>11}{wall:>8.1f}", flush=True)


def table_g(quick: bool, limit_s: float) -> None:
    """Traced models: v = 1 vs v = 2 (looped and V placement), predicted step time of the plan."""
    import torch

    from fxpipe.api import plan_graph
    from fxpipe.models import build_hf_model
    from fxpipe.partition.placement import device_bottleneck, placement_name
    from fxpipe.passes import trace_model
    from fxpipe.schedule.dispatch import make_schedule

    models = {"gpt2": ("gpt2", {"seq_len": 1024}, "cpu"), "llama-7b": ("llama-2-7b", {"seq_len": 4096}, "meta")}
    if quick:
        models = {"gpt2": ("gpt2", {"n_layer": 4, "n_embd": 256, "n_head": 4, "seq_len": 128}, "cpu")}
    print("\n(g) traced models, training objective, relayed comm, bf16 on H100 SXM roofline costs, m = 2 p, no memory limit;"
          " plan_graph with stages_per_device v and the placement")
    print(f"{'model':<9}{'p':>3}{'v':>3}{'placement':>10}{'method':>18}{'dev bottleneck ms':>19}{'makespan ms':>13}"
          f"{'device span ms':>16}{'bubble %':>10}{'vs v=1':>8}")
    for name, (arch, over, device) in models.items():
        model, margs, mkwargs = build_hf_model(arch, over, device=device)
        graph = trace_model(model, margs, mkwargs, hardware="h100-sxm", dtype=torch.bfloat16, name=name).graph
        del model
        for p in ((2,) if quick else (2, 4, 8)):
            m = 2 * p
            base = None
            rows = [(1, "looped", ("1f1b", "zb-h1")), (2, "looped", ("interleaved-1f1b",)), (2, "v", ("zb-v", "dualpipe-v"))]
            for v, placement, methods in rows:
                # one plan per (v, placement) with its default generator; the others reschedule it
                part, prob, first, _ = plan_graph(graph, devices=p, microbatches=m, stages_per_device=v, schedule=None,
                                                  placement=placement, time_limit_s=limit_s)
                for meth in methods:
                    try:
                        s = first if first.method == meth else make_schedule(prob, meth)
                    except FxpipeError as exc:
                        print(f"{name:<9}{p:>3}{v:>3}{placement:>10}{meth:>18}  failed: {exc}", flush=True)
                        continue
                    busy = float(device_busy_s(prob).max())
                    dev_b = device_bottleneck(graph, part.assignment, prob.device_of_stage)
                    if base is None:
                        base = s.makespan
                    print(f"{name:<9}{p:>3}{v:>3}{placement:>10}{meth:>18}{dev_b * 1e3:>19.3f}{s.makespan * 1e3:>13.3f}"
                          f"{s.stage_span * 1e3:>16.3f}{100 * (1 - busy / s.stage_span):>10.1f}"
                          f"{s.makespan / base:>8.3f}", flush=True)
            part, prob, s, _ = plan_graph(graph, devices=p, microbatches=m, stages_per_device="auto", placement="auto",
                                          time_limit_s=limit_s, schedule=None)  # each placement's default generator
            print(f"{name:<9}{p:>3}  auto: kept v={prob.num_stages // p} {placement_name(prob.device_of_stage, p)} "
                  f"{s.method} (predicted step time {s.value * 1e3:.3f} ms)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short limits and a subset of table (c)")
    ap.add_argument("--time-limit", type=float, default=None, help="MILP limit per instance (s)")
    ap.add_argument("--big-time-limit", type=float, default=None, help="MILP limit for p=8, m=16 (s)")
    ap.add_argument("--tables", default="abcdef", help="which tables to run, e.g. 'ab' ('g' traces models: torch)")
    ap.add_argument("--sizes", default=None, help="table (c) sizes as PxM list, e.g. '4x8,8x16'")
    args = ap.parse_args(argv)
    limit = args.time_limit if args.time_limit is not None else (20.0 if args.quick else 60.0)
    big = args.big_time_limit if args.big_time_limit is not None else (limit if args.quick else 300.0)
    print(f"fxpipe schedule benchmark (quick={args.quick}, limit {limit:g} s, big {big:g} s, 1 SCIP thread)")
    if "a" in args.tables:
        table_a(limit)
    if "b" in args.tables:
        table_b(limit)
    if "c" in args.tables:
        sizes = None
        if args.sizes:
            sizes = [tuple(int(x) for x in item.split("x")) for item in args.sizes.split(",")]
        table_c(args.quick, limit, big, sizes)
    if "d" in args.tables:
        table_d(limit)
    if "e" in args.tables:
        table_e(args.quick, limit)
    if "f" in args.tables:
        table_f(args.quick, limit)
    if "g" in args.tables:
        table_g(args.quick, 10.0 if not args.quick else 2.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
