"""Schedule-phase time of large pipelines: what the 256-device mesh search spends per mesh.

For each case (model, ``pp``, micro-batches per replica; ``dp_shard = 256 / pp`` under the
``h100-sxm`` memory model of the mesh, :func:`fxpipe.mesh.mesh_memory`, on its pipeline graph,
:func:`fxpipe.mesh.pipeline_graph`), the scheduling problems that
:func:`fxpipe.planner.plan_with_options` hands to :func:`fxpipe.schedule.auto_schedule`
(heuristics only, ``schedule_time_limit_s=0``, as the mesh search plans) are captured once
and kept in ``.fxpipe-cache/schedule-problems/`` (git-ignored; the partition is not re-run,
so every timing schedules the same problems). Each case then prints the seconds
``auto_schedule`` takes on its problems, the chosen method and the makespan.

``--baseline PATH`` times the same problems with the fxpipe checkout at ``PATH`` (e.g. a
``git worktree`` of main) in a subprocess, prints both side by side and checks that the
schedules are identical (same ops, same start and end times). The offload-aware search
(:func:`fxpipe.schedule.heuristics.offload_search_schedule`) stops after 200 policies or 2 s,
whichever comes first: on these pipelines the clock stops it, so a faster checkout evaluates
more policies in the same time and may find another schedule. ``--offload-evals N`` makes it
evaluate exactly ``N`` policies, with no time limit, on both sides (the schedules compare).

    python benchmarks/bench_schedule_speed.py [--cases llama-3-70b:16x32 llama-3-70b:32x16 ...]
        [--devices 256] [--baseline PATH] [--offload-evals N] [--profile OUT.prof]

The graphs come from ``benchmarks/model_graphs.py`` (traced on meta once and cached).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PROBLEM_DIR = os.path.join(ROOT, ".fxpipe-cache", "schedule-problems")
DEFAULT_CASES = ["llama-3-70b:16x32", "llama-3-70b:32x16", "llama-3-70b:32x32", "llama-3-70b:32x64"]


def _parse_case(text: str) -> tuple[str, int, int]:
    try:
        name, shape = text.rsplit(":", 1)
        pp, m = (int(x) for x in shape.split("x"))
    except ValueError:
        raise SystemExit(f"a case is MODEL:PPxMICROBATCHES (e.g. llama-3-70b:32x16), got {text!r}") from None
    return name, pp, m


def _case_dir(case: str, devices: int) -> str:
    return os.path.join(PROBLEM_DIR, f"{case.replace(':', '-')}-of-{devices}")


def capture(case: str, devices: int, time_limit_s: float) -> list[str]:
    """The problem files of ``case`` (captured now by planning the mesh once, unless already there)."""
    out = _case_dir(case, devices)
    index = os.path.join(out, "index.json")
    if os.path.exists(index):
        with open(index) as f:
            return [os.path.join(out, p) for p in json.load(f)]
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from model_graphs import cached_graph  # noqa: E402  (puts this checkout first on sys.path)

    import fxpipe.planner as planner
    from fxpipe.ir import write_json_atomic
    from fxpipe.mesh import mesh_memory, pipeline_graph
    from fxpipe.options import PlanOptions

    name, pp, m = _parse_case(case)
    if devices % pp:
        raise SystemExit(f"{case}: pp={pp} does not divide {devices} devices")
    mesh = {"pp": pp, "dp_shard": devices // pp}
    graph = cached_graph(name)
    mem = mesh_memory(planner.resolve_memory(graph), mesh)
    host_bytes_per_s = planner.HARDWARE[str(graph.meta["hardware"])].host_bytes_per_s  # as fxpipe.compile sets it
    captured = []
    real = planner.auto_schedule

    def spy(problem, **kw):
        captured.append((problem, kw["recompute"]))
        return real(problem, **kw)

    planner.auto_schedule = spy
    try:
        t0 = time.perf_counter()
        planner.plan_with_options(pipeline_graph(graph, mesh), devices=pp, microbatches=m, memory=mem,
                                  memory_bytes=mem.capacity_bytes,
                                  options=PlanOptions(time_limit_s=time_limit_s, schedule_time_limit_s=0,
                                                      host_bandwidth_bytes_per_s=host_bytes_per_s))
        print(f"{case}: captured {len(captured)} problem(s) in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        planner.auto_schedule = real
    os.makedirs(out, exist_ok=True)
    names = []
    for i, (p, recompute) in enumerate(captured):
        names.append(f"problem{i}{'-recompute' if recompute else ''}.json")
        p.save(os.path.join(out, names[-1]))
    write_json_atomic(index, names)
    return [os.path.join(out, p) for p in names]


def _digest(sched) -> str:
    """A hash of the schedule's ops (stage, micro-batch, type, start, end; exact floats)."""
    h = hashlib.sha256()
    for o in sched.ops:
        h.update(f"{o.stage},{o.microbatch},{o.type},{o.start_s!r},{o.end_s!r};".encode())
    h.update(f"{sched.makespan!r},{sched.stage_span!r},{sched.method}".encode())
    return h.hexdigest()[:16]


def time_problems(paths: list[str], profile: str | None = None, offload_evals: int | None = None) -> dict:
    """``auto_schedule`` of every problem file (``-recompute`` in its name: with recomputation, as the
    planner ran it): total seconds, and per problem its method, makespan and digest."""
    import fxpipe
    from fxpipe.ir import ScheduleProblem
    import fxpipe.schedule.heuristics as heuristics
    from fxpipe.schedule.auto import auto_schedule

    if offload_evals is not None:
        heuristics.OFFLOAD_SEARCH_EVALS, heuristics.OFFLOAD_SEARCH_TIME_S = offload_evals, float("inf")
    problems = [(ScheduleProblem.load(p), p.endswith("-recompute.json")) for p in paths]
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    rows = []
    for p, recompute in problems:
        r = auto_schedule(p, recompute=recompute, time_limit_s=0)
        method = r.schedule.method + (f" ({r.schedule.meta['evals']} policies)" if "evals" in r.schedule.meta else "")
        rows.append({"method": method, "makespan_s": float(r.schedule.makespan),
                     "value_s": float(r.schedule.value), "recompute": list(r.recompute_stages),
                     "offloaded": r.offloaded, "digest": _digest(r.schedule)})
    seconds = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    return {"seconds": seconds, "rows": rows, "fxpipe": os.path.dirname(fxpipe.__file__)}


def _run_baseline(path: str, paths: list[str], offload_evals: int | None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
    evals = [] if offload_evals is None else ["--offload-evals", str(offload_evals)]
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *evals, "--time-only", *paths], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="MODEL:PPxMICROBATCHES (per replica)")
    ap.add_argument("--devices", type=int, default=256)
    ap.add_argument("--time-limit", type=float, default=5.0, help="partition search seconds (capture only)")
    ap.add_argument("--baseline", help="an fxpipe checkout to time the same problems with (subprocess)")
    ap.add_argument("--offload-evals", type=int, help="the offload search evaluates exactly this many policies "
                    "(no time limit; default: up to 200 policies or 2 s)")
    ap.add_argument("--profile", help="write a cProfile of the schedule phase of the last case here")
    ap.add_argument("--time-only", nargs="+", help=argparse.SUPPRESS)  # the baseline subprocess
    args = ap.parse_args()
    if args.time_only:
        print(json.dumps(time_problems(args.time_only, offload_evals=args.offload_evals)))
        return

    head = "| case | problems | schedule s | method | makespan s |" + (" baseline s | speed-up | same schedules |"
                                                                      if args.baseline else "")
    print(head)
    print("|" + "---|" * head.count(" |"))
    from fxpipe.errors import FxpipeError

    for i, case in enumerate(args.cases):
        try:
            paths = capture(case, args.devices, args.time_limit)
        except FxpipeError as exc:
            print(f"| {case} | - | does not fit: {str(exc).splitlines()[0][:120]} |", flush=True)
            continue
        base = _run_baseline(args.baseline, paths, args.offload_evals) if args.baseline else None
        new = time_problems(paths, args.profile if i == len(args.cases) - 1 else None, args.offload_evals)
        last = new["rows"][-1] if new["rows"] else {}
        best = min(new["rows"], key=lambda r: r["value_s"]) if new["rows"] else last
        line = (f"| {case} | {len(paths)} | {new['seconds']:.1f} | {best.get('method', '-')} | "
                f"{best.get('makespan_s', float('nan')):.4f} |")
        if base is not None:
            same = [a["digest"] == b["digest"] for a, b in zip(new["rows"], base["rows"])]
            other = "; ".join(f"{b['method']}, {b['makespan_s']:.4f} s" for b, ok in zip(base["rows"], same) if not ok)
            line += (f" {base['seconds']:.1f} | {base['seconds'] / max(new['seconds'], 1e-9):.1f}x | "
                     f"{'yes' if all(same) and len(same) == len(paths) else 'no: baseline ' + other} |")
        print(line, flush=True)


if __name__ == "__main__":
    main()
