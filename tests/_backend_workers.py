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
    import fxpipe.zoo as zoo
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
