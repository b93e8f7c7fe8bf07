"""Predicted vs measured activation peak per stage (issue 9, "Measure").

Every model is planned with ``fxpipe.compile`` (1 stage per device), scheduled (1F1B by default,
and with ``--offload`` also fxpipe's PipeOffload heuristic under a finite memory limit, whose
programs carry O/R actions), trained on local gloo ranks (CPU), and the activation stash of every
stage is measured by the runtime's saved-tensor hooks (:mod:`fxpipe.codegen.stash`: live bytes
autograd saves during the stage forward, parameters, buffers and stage inputs excluded). Printed
per stage:

* ``pred mb``: the cost model's stash of one micro-batch (``problem.mem_f``, from ``act_bytes``)
  vs ``meas mb``: the largest stash of one micro-batch the hooks saw;
* ``pred peak``: the schedule's activation peak on the device
  (:func:`fxpipe.schedule.validate.peak_memory`, the schedule's memory curve) vs ``meas peak``:
  the largest live stash the hooks counted during the steps;
* ``err``: (pred - meas) / meas of the peak (target: within 10%);
* ``in saved``: bytes of the stage's *inputs* that autograd saved for one micro-batch (they live
  in torch's receive buffers anyway, so the hooks do not count them as stash, but ``act_bytes``
  counts them on the op that saves them: a stage whose first op saves its input is
  over-predicted by this much per micro-batch in flight); ``err mb - in``: the per-micro-batch
  error once they are taken out of the prediction (stages after the first: the first stage's
  inputs are the model's inputs, which ``act_bytes`` already leaves out).

    python benchmarks/bench_activation_peak.py                       # default models, 2 ranks
    python benchmarks/bench_activation_peak.py --models gpt2 llama --ranks 4 --offload
    python benchmarks/bench_activation_peak.py --json

Figures on a shared 2-core machine are not timings: bytes do not depend on load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

DEFAULT_MODELS = ["gpt2", "llama", "mixtral", "bert", "t5", "vit", "resnet", "unet", "whisper"]


def _plan_runs(name: str, ranks: int, m: int, offload: bool):
    import numpy as np

    import fxpipe
    from fxpipe.testing import zoo
    from fxpipe.ir import schedule_to_orders
    from fxpipe.schedule.dispatch import make_schedule

    zm = zoo.get(name, microbatches=m)
    model, args, kwargs = zm.one_microbatch()
    plan = fxpipe.compile(model, args, kwargs, devices=ranks, microbatches=m, time_limit_s=0.5, name=name, mesh="pipeline")
    base = dict(make_model=zm, make_batch=zm.batch, loss=zm.loss, stage_of=plan.worker_stage_of(),
                num_microbatches=m, steps=1, lr=0.01, model_key=name)
    out = []
    pr = plan.problem
    sched = make_schedule(pr, "1f1b")
    out.append(("1f1b", pr, sched, dict(base, orders=schedule_to_orders(sched, pr))))
    if offload:
        lim = dataclasses.replace(pr, mem_limit=np.full(pr.num_devices, float(pr.mem_f.max() * m * 4)))
        sched = make_schedule(lim, "pipeoffload")
        out.append(("pipeoffload", lim, sched, dict(base, orders=schedule_to_orders(sched, lim))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--offload", action="store_true", help="also run a PipeOffload schedule per model")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    from fxpipe.codegen.launch import RunError, spawn_train_many
    from fxpipe.schedule.validate import peak_memory

    cases, runs = [], []
    for name in a.models:
        try:
            for sched_name, pr, sched, run in _plan_runs(name, a.ranks, a.microbatches, a.offload):
                cases.append((name, sched_name, pr, sched))
                runs.append(run)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other models
            print(f"{name}: cannot plan: {exc}", file=sys.stderr)
    results = spawn_train_many(runs, world_size=a.ranks, timeout_s=3600, on_error="record", run_timeout_s=600)
    rows = []
    for (name, sched_name, pr, sched), res in zip(cases, results):
        if isinstance(res, RunError):
            rows.append(dict(model=name, schedule=sched_name, error=str(res)[:200]))
            continue
        pred_peak = peak_memory(pr, sched)
        act = res.meta["activation"]
        for r in range(a.ranks):
            for s, st in act[r]["stages"].items():
                s = int(s)
                meas, meas_mb = st["peak_saved_bytes"], st["max_microbatch_bytes"]
                pred = float(pred_peak[pr.device_of_stage[s]])
                rows.append(dict(model=name, schedule=sched_name, stage=s, pred_mb=float(pr.mem_f[s]), meas_mb=meas_mb,
                                 pred_peak=pred, meas_peak=meas, offloads=st["offloads"],
                                 in_saved=st.get("max_input_saved_bytes", 0),
                                 err=(pred - meas) / meas if meas else float("nan"),
                                 err_mb_in=((float(pr.mem_f[s]) - (st.get("max_input_saved_bytes", 0) if s else 0) - meas_mb)
                                            / meas_mb if meas_mb else float("nan"))))
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"ranks={a.ranks} microbatches={a.microbatches} (CPU, gloo; bytes)")
    print("| model | schedule | stage | pred mb | meas mb | pred peak | meas peak | offloads | err | in saved | err mb - in |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    errs = []
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['schedule']} | error: {r['error']} |||||||")
            continue
        errs.append(abs(r["err"]))
        print(f"| {r['model']} | {r['schedule']} | {r['stage']} | {r['pred_mb']:.0f} | {r['meas_mb']} | "
              f"{r['pred_peak']:.0f} | {r['meas_peak']} | {r['offloads']} | {100 * r['err']:+.1f}% | {r['in_saved']} | "
              f"{100 * r['err_mb_in']:+.1f}% |")
    if errs:
        within = sum(e <= 0.10 for e in errs)
        print(f"\n{within}/{len(errs)} stages within 10%; largest |err| {100 * max(errs):.1f}%")
        mb = [abs(r["err_mb_in"]) for r in rows if "error" not in r]
        print(f"per micro-batch, stage inputs taken out: {sum(e <= 0.10 for e in mb)}/{len(mb)} within 10%; "
              f"largest |err| {100 * max(mb):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
