"""Capture + costing time and peak memory of the torch front end.

For each model, in a fresh subprocess (so that peak RSS is per model):
build the model, run ``trace_model`` (capture + AnnotateCosts + to_opgraph) and report the
time of each phase and the peak RSS (``resource.getrusage``). Two baselines are measured in
the same process: a bare ``torch.export.export(..., strict=False)`` of the same model (what
capturing costs before fxpipe adds anything) and ``trace_model(..., replicate="never")`` (a
full export of every layer, the capture before layer replication). With ``replicate="auto"``
a stack of >= 16 identical layers is captured by exporting three layers and replicating one
(:mod:`fxpipe.passes.replicate`); the benchmark checks that both give the same OpGraph (names,
edges, every cost). The FLOP count is checked against the analytic ``2 * params * tokens``
of a dense decoder (attention FLOPs come on top).

Targets: Llama-2-7B on the meta device (seq 4096, one micro-batch), whole planning front end
< 120 s and peak RSS < 4 GiB (issue "end-to-end"); Llama-3-70B: ``fxpipe.compile`` for 64
devices in under a minute, of which capture was the largest step (issue 13).

Usage::

    python benchmarks/bench_capture.py            # all models
    python benchmarks/bench_capture.py --only llama-3-70b-meta
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

CASES = {
    # name: (arch, overrides, device, cost dtype)
    "gpt2-124m": ("gpt2", {"seq_len": 1024}, "cpu", None),
    "t5-small": ("t5", {"seq_len": 512}, "cpu", None),
    "mixtral-small": ("mixtral", {"seq_len": 512}, "cpu", None),
    "llama-2-7b-meta": ("llama-2-7b", {"seq_len": 4096}, "meta", "bfloat16"),
    "llama-3-70b-meta": ("llama-3-70b", {"seq_len": 4096}, "meta", "bfloat16"),
}
FIELDS = ("t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s", "size_out_bytes", "size_param_bytes", "act_bytes")


def _measure_this_cpu():
    """A HardwareSpec of this machine from micro-benchmarks run now (matmul rate, copy
    bandwidth, tiny-op dispatch time), so the roofline is checked against the same load."""
    import torch

    from fxpipe.cost.hardware import HardwareSpec

    def best(fn, reps=5):
        fn()
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return min(out)

    a, b = torch.randn(1024, 768), torch.randn(768, 3072)
    peak = 2 * 1024 * 768 * 3072 / best(lambda: a @ b)
    x = torch.empty(32 * 2**20)  # 128 MiB
    bw = 2 * x.numel() * 4 / best(lambda: x.clone())
    one = torch.ones(1)
    lo = best(lambda: [one + 1 for _ in range(1000)]) / 1000
    return HardwareSpec(name="this-cpu", description="measured now", peak_flops={"fp32": peak},
                        hbm_bytes_per_s=bw, d2d_bytes_per_s=bw, host_bytes_per_s=bw,
                        memory_bytes=2**34, launch_overhead_s=lo, source="micro-benchmarks in this run")


def _one(name: str) -> dict:
    import torch

    from fxpipe.models import build_hf_model
    from fxpipe.passes import trace_model

    arch, ov, device, dtype = CASES[name]
    t0 = time.perf_counter()
    model, args, kwargs = build_hf_model(arch, ov, device=device)
    build_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.export.export(model, args, kwargs, strict=False)  # baseline: bare export
    bare_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    tm_full = trace_model(model, args, kwargs, hardware="h100-sxm", dtype=getattr(torch, dtype) if dtype else None, replicate="never")
    full_s = time.perf_counter() - t2
    t2 = time.perf_counter()
    tm = trace_model(model, args, kwargs, hardware="h100-sxm", dtype=getattr(torch, dtype) if dtype else None)
    trace_s = time.perf_counter() - t2
    g = tm.graph
    g0 = tm_full.graph
    same = g.names == g0.names and bool((g.edges == g0.edges).all()) and all((getattr(g, f) == getattr(g0, f)).all() for f in FIELDS)
    if not same:
        raise SystemExit(f"{name}: the replicated capture's OpGraph differs from the full export's")
    cpu_pred_ms = cpu_meas_ms = None
    if device == "cpu":  # sanity of the roofline: predicted vs measured eager forward on this CPU
        from fxpipe.passes import AnnotateCosts, to_opgraph

        here = _measure_this_cpu()
        AnnotateCosts(here)(tm.gm)
        cpu_pred_ms = 1e3 * to_opgraph(tm.gm, here, name=name)[0].t_fwd_s.sum()
        AnnotateCosts("h100-sxm")(tm.gm)  # restore
        with torch.no_grad():
            model(*args, **kwargs)
            t3 = time.perf_counter()
            model(*args, **kwargs)
            cpu_meas_ms = 1e3 * (time.perf_counter() - t3)
    n_params = sum(p.numel() for p in model.parameters())
    tokens = args[0].numel()
    flops = sum(float(e.get("flops", 0.0)) for e in g.extra)
    return {
        "model": name, "device": device, "nodes": g.n, "edges": g.m, "params_M": n_params / 1e6,
        "build_s": build_s, "bare_export_s": bare_s, "capture_s": tm.capture_s, "cost_s": tm.cost_s,
        "export_s": tm.export_s, "trace_total_s": trace_s, "front_end_total_s": build_s + trace_s,
        "replicated": tm.captured.replication is not None, "full_capture_s": tm_full.capture_s, "full_trace_s": full_s,
        "same_graph_as_full": same,
        "peak_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "fwd_TFLOP": flops / 1e12, "analytic_2NT_TFLOP": 2 * n_params * tokens / 1e12,
        "t_fwd_ms": 1e3 * g.t_fwd_s.sum(), "t_bwd_input_ms": 1e3 * g.t_bwd_input_s.sum(),
        "t_bwd_weight_ms": 1e3 * g.t_bwd_weight_s.sum(), "act_GiB": g.act_bytes.sum() / 2**30,
        "param_GiB": g.size_param_bytes.sum() / 2**30,
        "cpu_profile_pred_fwd_ms": cpu_pred_ms, "cpu_measured_fwd_ms": cpu_meas_ms,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(CASES), action="append")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print one JSON object per model")
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_one(args.child)))
        return 0
    rows = []
    for name in args.only or list(CASES):
        proc = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(f"{name}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        row = json.loads(line[len("RESULT "):])
        rows.append(row)
        if args.json:
            print(json.dumps(row))
    if not args.json:
        hdr = (f"{'model':<18}{'nodes':>6}{'params':>8}{'build':>8}{'bare export':>12}{'full capture':>13}{'capture':>9}"
               f"{'cost':>7}{'total':>8}{'RSS GiB':>9}{'TFLOP':>9}{'2NT':>9}{'t_fwd ms':>10}")
        print(hdr)
        for r in rows:
            print(f"{r['model']:<18}{r['nodes']:>6}{r['params_M']:>7.0f}M{r['build_s']:>7.1f}s{r['bare_export_s']:>11.1f}s"
                  f"{r['full_capture_s']:>12.1f}s{r['capture_s']:>7.1f}s{'r' if r['replicated'] else ' '}{r['cost_s']:>6.2f}s"
                  f"{r['front_end_total_s']:>7.1f}s{r['peak_rss_GiB']:>9.2f}"
                  f"{r['fwd_TFLOP']:>9.4f}{r['analytic_2NT_TFLOP']:>9.4f}{r['t_fwd_ms']:>10.2f}")
        print("(capture: fxpipe's capture, 'r' = three layers exported and replicated, same OpGraph as the full capture)")
        print("\nroofline sanity on this machine (spec measured now: matmul rate, copy bandwidth, dispatch time; vs measured eager forward, no_grad):")
        for r in rows:
            if r["cpu_measured_fwd_ms"] is not None:
                print(f"  {r['model']:<17} predicted {r['cpu_profile_pred_fwd_ms']:9.1f} ms   "
                      f"measured {r['cpu_measured_fwd_ms']:9.1f} ms")
        for r in rows:
            if r["model"] == "llama-2-7b-meta":
                ok = r["front_end_total_s"] < 120 and r["peak_rss_GiB"] < 4
                print(f"llama-2-7b on meta: front end {r['front_end_total_s']:.1f} s (target < 120 s), "
                      f"peak RSS {r['peak_rss_GiB']:.2f} GiB (target < 4 GiB): {'OK' if ok else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
