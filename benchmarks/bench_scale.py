"""Plan time and plan quality at realistic scale (issue 19, items 4 and 5).

Llama-3-8B and Llama-3-70B dimensions (meta device, bf16, SDPA attention, 4096 tokens,
h100-sxm costs), pure pipeline on p devices with m in {p, 2p, 4p} micro-batches. Per row:

* plan time by phase: ``partition`` and ``schedule`` (``fxpipe.api.plan_graph``'s timings;
  the schedule phase is ``schedule="auto"``);
* the predicted step (the schedule objective), the schedule's lower bound (valid for the
  chosen recomputation) and their ratio; ``recompute_lower_bound`` of the problem before
  recomputation (valid for every recomputation choice) and the step's ratio to it; stashes
  offloaded and stages recomputing;
* memory per device: the largest activation peak over the devices and the smallest limit;
* with ``--baseline-ref REF`` (a git commit of this repository, e.g. the one before the
  issue-19 work): ``auto_schedule`` of the very same problem timed with that commit's code and
  with the current code, each in a fresh subprocess, and whether both chose the same schedule
  (method, value, and a hash of every op's times).

Capture and cost annotation run once per model; the problems of the baseline comparison are
written to a temporary directory. The machine is shared: read the load average printed at the
start and end.

Usage::

    python benchmarks/bench_scale.py --quick                         # 70B at 32 x 64 only
    python benchmarks/bench_scale.py --models llama-3-70b --devices 32 64 --mult 2 --baseline-ref 69ce2db
    python benchmarks/bench_scale.py                                 # 8B and 70B at 8/16/32/64 x {p, 2p, 4p}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

MODELS = {
    # name: (preset, config overrides); Llama-3-8B: HF meta-llama/Meta-Llama-3-8B config.json
    "llama-3-8b": ("llama", {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    "llama-3-70b": ("llama-3-70b", {}),
}

_RUNNER = r"""
import hashlib, json, sys, time
import fxpipe
from fxpipe.ir import ScheduleProblem
from fxpipe.schedule.auto import auto_schedule
prob = ScheduleProblem.load(sys.argv[1])
t = time.perf_counter()
r = auto_schedule(prob, recompute=True, time_limit_s=0.0)
dt = time.perf_counter() - t
s = r.schedule
h = hashlib.sha1(repr([(o.stage, o.microbatch, o.type, o.start_s, o.end_s) for o in s.ops]).encode()).hexdigest()[:12]
print(json.dumps({"fxpipe": fxpipe.__file__, "time_s": dt, "method": s.method, "value": s.value, "hash": h, "offloaded": r.offloaded,
                  "recompute": len(r.recompute_stages)}))
"""


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _auto_in(path: str, problem_file: str, timeout_s: float) -> dict:
    """``auto_schedule`` of the problem in a fresh interpreter importing fxpipe from ``path``
    (run from the problem's folder, so the working directory's fxpipe cannot shadow it)."""
    env = {**os.environ, "PYTHONPATH": path}
    try:
        out = subprocess.run([sys.executable, "-c", _RUNNER, problem_file], env=env, capture_output=True, text=True,
                             timeout=timeout_s, check=True, cwd=os.path.dirname(problem_file))
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout_s:g} s"}
    except subprocess.CalledProcessError as exc:
        return {"error": exc.stderr.strip().splitlines()[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--devices", nargs="+", type=int, default=[8, 16, 32, 64])
    ap.add_argument("--mult", nargs="+", type=int, default=[1, 2, 4], help="micro-batches = mult x devices")
    ap.add_argument("--quick", action="store_true", help="Llama-3-70B at 32 devices x 64 micro-batches only")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=30.0, help="partition search budget (s)")
    ap.add_argument("--baseline-ref", default=None, help="git commit whose auto_schedule is timed on the same problems")
    ap.add_argument("--baseline-timeout", type=float, default=1800.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.devices, args.mult = ["llama-3-70b"], [32], [2]
    warnings.filterwarnings("ignore")
    import numpy as np
    import torch

    from fxpipe.api import plan_graph, resolve_memory
    from fxpipe.models import build_hf_model
    from fxpipe.passes import trace_model
    from fxpipe.schedule.bounds import recompute_lower_bound
    from fxpipe.schedule.validate import peak_memory

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="bench_scale_")
    base_path = None
    if args.baseline_ref:
        base_path = os.path.join(tmp, "baseline")
        os.makedirs(base_path)
        arch = subprocess.run(["git", "-C", here, "archive", args.baseline_ref, "fxpipe"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", base_path], input=arch.stdout, check=True)
    print(f"# load average at start: {_load()} ({os.cpu_count()} CPUs)", flush=True)
    rows = []
    for name in args.models:
        preset, over = MODELS[name]
        t0 = time.perf_counter()
        model, margs, mkw = build_hf_model(preset, {**over, "seq_len": args.seq_len, "attn_implementation": "sdpa"},
                                           device="meta", dtype=torch.bfloat16)
        traced = trace_model(model, margs, mkw, hardware="h100-sxm")
        graph = traced.graph
        mem = resolve_memory(graph, None, None, traced.hardware)
        print(f"# {name}: capture + costs {time.perf_counter() - t0:.1f} s, {graph.n} ops", flush=True)
        for p in args.devices:
            for k in args.mult:
                m = k * p
                captured = {}
                import fxpipe.planner as auto_mod  # plan_graph calls the name it imported there

                real = auto_mod.auto_schedule

                def spy(problem, **kw):
                    captured["problem"] = problem
                    return real(problem, **kw)

                auto_mod.auto_schedule = spy
                try:
                    part, prob, sched, timings = plan_graph(
                        graph, devices=p, microbatches=m, memory=mem, time_limit_s=args.time_limit,
                        host_bandwidth_bytes_per_s=traced.hardware.host_bytes_per_s)
                except Exception as exc:  # noqa: BLE001 - a benchmark row records any failure
                    rows.append({"model": name, "p": p, "m": m, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                finally:
                    auto_mod.auto_schedule = real
                peak = peak_memory(prob, sched)
                t_rb = time.perf_counter()
                rlb = recompute_lower_bound(captured["problem"]) if "problem" in captured else float("nan")
                t_rb = time.perf_counter() - t_rb
                row = {
                    "model": name, "p": p, "m": m,
                    "partition_s": round(timings["partition"], 2), "schedule_s": round(timings["schedule"], 2),
                    "method": sched.method, "step_s": float(sched.value), "lower_bound_s": float(sched.lower_bound_s),
                    "ratio": float(sched.value / sched.lower_bound_s) if sched.lower_bound_s > 0 else None,
                    "recompute_lower_bound_s": float(rlb), "recompute_ratio": float(sched.value / rlb) if rlb > 0 else None,
                    "recompute_bound_time_s": round(t_rb, 2),
                    "offloaded": sum(1 for o in sched.ops if o.type == "O"), "recompute": int(sum(prob.recompute)),
                    "peak_act_gb": float(np.max(peak)) / 1e9,
                    "min_limit_gb": float(np.min(np.asarray(prob.mem_limit))) / 1e9,
                }
                if base_path is not None and "problem" in captured:
                    pf = os.path.join(tmp, f"{name}_{p}x{m}.json")
                    captured["problem"].save(pf)
                    row["now"] = _auto_in(here, pf, args.baseline_timeout)
                    row["baseline"] = _auto_in(base_path, pf, args.baseline_timeout)
                    for who, where in (("now", here), ("baseline", base_path)):
                        got = row[who].get("fxpipe", "")
                        if got and not os.path.realpath(got).startswith(os.path.realpath(where)):
                            raise SystemExit(f"{who} imported fxpipe from {got}, not from {where}")
                    same = all(row["now"].get(f) == row["baseline"].get(f) for f in ("method", "value", "hash"))
                    row["same_schedule"] = same and "error" not in row["now"]
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    extra = ""
                    if "baseline" in row:
                        b, n = row["baseline"], row["now"]
                        extra = (f" | auto: now {n.get('time_s', float('nan')):.1f} s, baseline "
                                 f"{b.get('time_s', float('nan')):.1f} s {b.get('error', '')}, same schedule "
                                 f"{row['same_schedule']}")
                    print(f"{name} {p:3d} x {m:4d}: partition {row['partition_s']:7.1f} s, schedule {row['schedule_s']:7.1f} s"
                          f" | {row['method']}: step {row['step_s']:.3f} s, bound {row['lower_bound_s']:.3f} s, ratio "
                          f"{row['ratio'] or float('nan'):.2f} (any recomputation: bound {rlb:.3f} s, ratio "
                          f"{row['recompute_ratio'] or float('nan'):.2f}), {row['offloaded']} offloaded, {row['recompute']} recompute"
                          f" | act peak {row['peak_act_gb']:.1f} GB, min limit {row['min_limit_gb']:.1f} GB{extra}",
                          flush=True)
    print(f"# load average at end: {_load()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
