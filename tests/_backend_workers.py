"""Worker functions for multi-process tests of the torch.compile backend (imported by name in spawned ranks)."""

from __future__ import annotations


def _leaves(out):
    import torch

    from fxpipe.codegen.runtime import tree_flatten

    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def pipelined_inference(rank: int, world: int, names, options: dict) -> dict:
    """Every zoo model in ``names``: eager output vs ``torch.compile(backend="fxpipe")`` pipelined on this rank."""
    import hashlib
    import json

    import torch

    import fxpipe
    import fxpipe.testing.zoo as zoo
    from fxpipe.codegen.interface import as_call

    out = {}
    for name in names:
        zm = zoo.get(name, microbatches=4, microbatch_size=2)
        model, inputs = zm()
        model.eval()
        args, kwargs = as_call(inputs)
        with torch.no_grad():
            ref = model(*args, **kwargs)
        torch._dynamo.reset()
        for t in list(args) + list(kwargs.values()):
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_dynamic(t, 0)
        compiled = torch.compile(model, backend="fxpipe", options={"devices": world, "time_limit_s": 1.0, **options})
        with torch.no_grad():
            got = compiled(*args, **kwargs)
            got2 = compiled(*args, **kwargs)  # a second call reuses the pipeline
        plan = fxpipe.last_plan()
        pairs = list(zip(_leaves(ref), _leaves(got))) + list(zip(_leaves(ref), _leaves(got2)))
        out[name] = {
            "type_equal": type(ref).__name__ == type(got).__name__,
            "num_outputs": [len(_leaves(ref)), len(_leaves(got))],
            "max_abs_diff": max(float((a - b).abs().max()) for a, b in pairs),
            "shapes_equal": all(a.shape == b.shape for a, b in pairs),
            "stages": len(plan.stages),
            "microbatches": plan.microbatches,
            "pipelined": bool(plan.options.get("pipelined")),
            "objective": plan.objective,
            "stage_of_digest": hashlib.sha256(json.dumps(sorted(plan.stage_of.items())).encode()).hexdigest()[:12],
        }
    return out


def train_through_plan(rank: int, world: int, name: str, options: dict, steps: int, lr: float, seed: int) -> dict:
    """The README's training flow: ``torch.compile(backend="fxpipe")`` plans, ``fxpipe.last_plan().build(rank)`` trains.

    Mirrors :func:`fxpipe.codegen.launch.reference_train` (same seed, batches, loss, SGD) so the
    test can compare. Returns this rank's losses (last stage), gradients of the last step and
    parameters after all steps (the parameters its stages hold, by the model's names).
    """
    import torch

    import fxpipe
    import fxpipe.testing.zoo as zoo
    from _schedule_sgd import sgd_steps
    from fxpipe.codegen.interface import as_call
    from fxpipe.codegen.launch import _loss_fn

    zm = zoo.get(name, microbatches=options.get("microbatches", 4))
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model, inputs = zm()
    args, kwargs = as_call(inputs)
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor):
            torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxpipe", options={"devices": world, "time_limit_s": 1.0, **options})
    with torch.no_grad():
        ref_out = model(*args, **kwargs)
        out = compiled(*args, **kwargs)  # plans (rank 0, broadcast) and runs pipelined inference
    infer_diff = max(float((a - b).abs().max()) for a, b in zip(_leaves(ref_out), _leaves(out)))
    plan = fxpipe.last_plan()
    stages, sched = plan.build(rank, loss_fn=_loss_fn(zm.loss))  # compile_stages: the backend option
    params = sched.parameters()
    names = {id(p): n for n, p in model.named_parameters()}
    own_params = all(id(p) in names for p in params)
    named = {names[id(p)]: p for p in params}
    losses, grads = sgd_steps(sched, named, zm.batch, steps, lr, to_wire=lambda t: t.tolist())
    return {
        "losses": losses,
        "grads": grads,
        "params": {n: p.detach().tolist() for n, p in named.items()},
        "own_params": own_params,
        "compiled": [type(st.submod).__name__ for st in stages],
        "reports": [getattr(st.submod, "report", None) for st in stages],
        "actions": sched.fxpipe_actions[rank],
        "infer_max_abs_diff": infer_diff,
        "stages": plan.num_stages,
        "schedule": plan.options.get("schedule"),
    }


def jobs(rank: int, world: int, jobs_spec: list) -> list:
    """Several worker functions of this module in one set of ranks (start-up paid once)."""
    import sys

    mod = sys.modules[__name__]
    return [getattr(mod, fn)(rank, world, *args) for fn, args in jobs_spec]
