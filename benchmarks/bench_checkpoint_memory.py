"""Activation checkpointing measured against the model, per stage and policy (issue 28, "Measured against the model").

Every model is planned with ``fxpipe.compile`` (2 stages by default); every stage is run for one
micro-batch in this process under the runtime's stash (:mod:`fxpipe.codegen.stash`, saved-tensor
hooks: unique storages, parameters and stage inputs excluded) with each policy kind, each the
planner's option of that kind for the stage (:mod:`fxpipe.testing.checkpoint_policies`, from
:func:`fxpipe.memory.checkpoint.stage_menu`: one segment per repeated block; ``selective`` keeps
every attention output and every other matmul output of a block; ``budget`` the knapsack's keep
set at the middle budget level). Printed per stage and policy:

* ``kept meas`` / ``kept pred``: bytes the forward leaves saved for the backward (the stash), and
  :func:`fxpipe.memory.checkpoint.predict_checkpoint_bytes`' prediction from the OpGraph;
* ``replay meas`` / ``replay pred``: replayed saved tensors the backward holds at once (the
  largest segment's replay; gradients not counted);
* ``vs none``: the kept stash as a fraction of the same stage's stash without a policy (the
  baseline, measured in the same run);
* ``fb ms``: forward + backward wall time of the stage (median of ``--repeat``), beside the
  ``none`` row's: the price of the replay. On a shared CPU these are indications, not timings.

* the split-backward baseline (``--split`` section, printed last): a stage of ``--layers`` Linear +
  tanh layers as one segment, its backward split into B (input gradients) and W (weight
  gradients) as torch's zero-bubble schedules do (``stage_backward_input`` /
  ``stage_backward_weight``): how many times ``torch.utils.checkpoint`` (non-reentrant) replays
  the segment, beside fxpipe's stash (one replay per micro-batch), and the gradients' agreement.

    python benchmarks/bench_checkpoint_memory.py                   # llama, t5, vit; 2 stages
    python benchmarks/bench_checkpoint_memory.py --models llama --stages 4 --json
"""

from __future__ import annotations

import argparse
import json
import statistics

DEFAULT_MODELS = ["llama", "t5", "vit"]
KINDS = ("none", "full", "selective", "budget", "stage")


def _rows(name: str, stages: int, repeat: int) -> list[dict]:
    import fxpipe
    from fxpipe.codegen.stash import measure_stage
    from fxpipe.codegen.split import split_stages
    from fxpipe.memory.checkpoint import predict_checkpoint_bytes
    from fxpipe.plan.build import captured_checkpointing
    from fxpipe.testing import zoo
    from fxpipe.testing.checkpoint_policies import policies, stage_nodes

    zm = zoo.get(name)
    model, args, kwargs = zm.one_microbatch()
    plan = fxpipe.compile(model, args, kwargs, devices=stages, microbatches=4, time_limit_s=0.5, name=name,
                          mesh="pipeline", schedule="1f1b", seed=0)
    traced = plan.capture.traced
    staged = split_stages(traced.gm, plan.captured_stage_of(), plan.num_stages)
    inputs = [staged.stage_inputs(s, *args, **kwargs) for s in range(plan.num_stages)]
    rows = []
    for kind in KINDS:
        pols = policies(plan, kind)
        here = captured_checkpointing(plan, traced, pols)
        for s in range(plan.num_stages):
            got = measure_stage(staged, s, here[s], inputs[s], repeat=repeat + 1)
            walls = got["wall_s"][1:]  # the first run warms up
            kept, peak = predict_checkpoint_bytes(plan.graph, stage_nodes(plan, s), pols[s])
            rows.append(dict(model=name, stage=s, policy=kind, kept_meas=got["kept_bytes"], kept_pred=kept,
                             replay_meas=got["replay_peak_bytes"], replay_pred=peak, replays=got["replays"],
                             pieces=len(got["pieces"]), fb_ms=1e3 * statistics.median(walls)))
    base = {(r["stage"]): r for r in rows if r["policy"] == "none"}
    for r in rows:
        b = base[r["stage"]]
        r["vs_none"] = r["kept_meas"] / b["kept_meas"] if b["kept_meas"] else float("nan")
        r["none_fb_ms"] = b["fb_ms"]
    return rows


def _split_baseline(layers: int) -> dict:
    """Replays of one checkpointed segment under a split backward: torch.utils.checkpoint vs fxpipe's stash."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.utils.checkpoint import checkpoint

    from fxpipe.codegen.checkpointing import apply_checkpoint
    from fxpipe.codegen.stash import DeviceStash
    from fxpipe.memory.checkpoint import CheckpointPolicy

    torch.manual_seed(0)
    body = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())])
    head = torch.nn.Linear(16, 16)
    calls = [0]

    def seg(x):
        calls[0] += 1
        return body(x)

    x0 = torch.randn(4, 16)
    params = list(body.parameters()) + list(head.parameters())

    def split_backward(out, x):
        for p in params:
            p.grad = None
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
        stage_backward_weight(iter(params), groups, retain_graph=True)
        return [p.grad.clone() for p in params], len(groups)

    x = x0.clone().requires_grad_()
    grads_torch, groups = split_backward(head(checkpoint(seg, x, use_reentrant=False)), x)
    torch_replays = calls[0] - 1
    from torch.utils.checkpoint import GraphExecGroup  # one replay for several backward calls, if they read apart

    x = x0.clone().requires_grad_()
    try:
        with GraphExecGroup():
            split_backward(head(checkpoint(seg, x, use_reentrant=False)), x)
        group = "ran"
    except Exception as exc:  # noqa: BLE001 - the baseline reports what torch says
        group = type(exc).__name__
    gm = torch.export.export(body, (x0,)).module()
    params = list(gm.parameters()) + list(head.parameters())
    carved = apply_checkpoint(gm, CheckpointPolicy("full", segments=(tuple(n.name for n in gm.graph.nodes
                                                                          if n.op == "call_function"),)))
    assert carved.pieces, carved
    stash = DeviceStash("cpu")
    x = x0.clone().requires_grad_()
    out = head(stash.forward(0, 0, gm, (x,), {}, lambda: params))
    stash.before_backward(0, 0)
    with stash.backward_scope(0, 0, [x]):
        for p in params:
            p.grad = None
        _, groups2 = stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
    stash.end_backward_input(0, 0)
    stage_backward_weight(iter(params), groups2, retain_graph=True)
    grads_fx = [p.grad.clone() for p in params]
    stash.release(0, 0)
    st = stash.stats().stages[0]
    same = all(torch.equal(a, b) for a, b in zip(grads_torch, grads_fx))
    return dict(layers=layers, param_groups=groups, torch_replays=torch_replays, graph_exec_group=group,
                fxpipe_replays=st.replays,
                w_held_bytes=st.max_w_held_bytes, replay_peak_bytes=st.max_replay_peak_bytes, same_grads=same)


def _err(meas: float, pred: float) -> str:
    if meas == 0:
        return "  exact" if pred == 0 else "      -"
    return f"{(pred - meas) / meas:+7.1%}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4, help="layers of the split-backward baseline's segment")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [r for m in args.models for r in _rows(m, args.stages, args.repeat)]
    split = _split_baseline(args.layers)
    if args.json:
        print(json.dumps({"rows": rows, "split_backward": split}, indent=1))
        return 0
    print(f"{'model':8s} {'st':>2s} {'policy':9s} {'kept meas':>10s} {'kept pred':>10s} {'err':>7s} "
          f"{'replay meas':>11s} {'replay pred':>11s} {'err':>7s} {'vs none':>7s} {'fb ms':>7s} {'none ms':>7s}")
    for r in rows:
        print(f"{r['model']:8s} {r['stage']:2d} {r['policy']:9s} {r['kept_meas']:10d} {r['kept_pred']:10.0f} "
              f"{_err(r['kept_meas'], r['kept_pred'])} {r['replay_meas']:11d} {r['replay_pred']:11.0f} "
              f"{_err(r['replay_meas'], r['replay_pred'])} {r['vs_none']:7.0%} {r['fb_ms']:7.1f} {r['none_fb_ms']:7.1f}")
    worst = max(abs(r["kept_pred"] - r["kept_meas"]) / max(r["kept_meas"], 1) for r in rows)
    worst_r = max(abs(r["replay_pred"] - r["replay_meas"]) / max(r["replay_meas"], 1) for r in rows)
    print(f"largest |error|: kept {worst:.1%}, replay {worst_r:.1%} (target: 10%)")
    print(f"split backward (B then W), one segment of {split['layers']} Linear+tanh layers, "
          f"{split['param_groups']} parameter groups: replays per micro-batch torch.utils.checkpoint "
          f"{split['torch_replays']}, fxpipe {split['fxpipe_replays']} (W keeps {split['w_held_bytes']} bytes of "
          f"{split['replay_peak_bytes']} replayed); gradients equal: {split['same_grads']}; torch's GraphExecGroup "
          f"around B and W: {split['graph_exec_group']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
