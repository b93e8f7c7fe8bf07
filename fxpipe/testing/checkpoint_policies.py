"""Hand-built activation-checkpoint policies for the runtime's tests and benchmarks (issue 28; test support).

The planner chooses policies from the graph; the runtime's tests and
``benchmarks/bench_checkpoint_memory.py`` build them here, from a plan's OpGraph (node names,
module paths, op kinds) and stage map, so that they do not depend on the planner:

* ``"full"``: one segment per repeated block of a stage (the nodes whose module path has the
  same prefix up to its first numeric component: ``model.layers.3``, ``encoder.block.0``,
  ``vit.encoder.layer.1``); the other ops of the stage (embeddings, heads) stay stashed;
* ``"selective"``: the same segments, keeping the outputs of every other matmul / attention node
  of each block (torchtitan's every-other-``mm`` rule, per block);
* ``"budget"``: the same segments, keeping the largest matmul outputs of each block up to half
  of the block's matmul bytes (a stand-in for a budgeted keep set);
* ``"stage"``: the whole stage as one segment.
"""

from __future__ import annotations

from fxpipe.memory.checkpoint import CheckpointPolicy

__all__ = ["policy", "policies", "stage_nodes", "block_of"]

MATMUL_KINDS = ("matmul", "matmul_param", "attention")


def block_of(module: str) -> str | None:
    parts = module.split(".")
    for i, p in enumerate(parts):
        if p.isdigit() and i > 0:
            return ".".join(parts[: i + 1])
    return None


def stage_nodes(plan, stage: int) -> list[int]:
    """OpGraph ids of ``stage``'s nodes, in program order (the plan's stage map)."""
    g = plan.graph
    return [i for i in range(g.n) if plan.stage_of.get(g.names[i]) == stage and g.ops[i] not in ("placeholder", "output")]


def policy(plan, stage: int, kind: str) -> CheckpointPolicy:
    """The hand-built policy ``kind`` of ``stage`` (module docstring)."""
    g = plan.graph
    ids = stage_nodes(plan, stage)
    if kind == "none":
        return CheckpointPolicy("none")
    if kind == "stage":
        return CheckpointPolicy("stage", segments=(tuple(g.names[i] for i in ids),) if ids else ())
    blocks: dict[str, list[int]] = {}
    for i in ids:
        b = block_of((g.extra[i] or {}).get("module", ""))
        if b is not None:
            blocks.setdefault(b, []).append(i)
    segments = tuple(tuple(g.names[i] for i in v) for v in blocks.values())
    save: list[str] = []
    for v in blocks.values():
        mm = [i for i in v if (g.extra[i] or {}).get("kind") in MATMUL_KINDS and g.size_out_bytes[i] > 0]
        if kind == "selective":
            save += [g.names[i] for i in mm[::2]]
        elif kind == "budget":
            budget = 0.5 * sum(float(g.size_out_bytes[i]) for i in mm)
            for i in sorted(mm, key=lambda i: -float(g.size_out_bytes[i])):
                if float(g.size_out_bytes[i]) <= budget:
                    save.append(g.names[i])
                    budget -= float(g.size_out_bytes[i])
    order = {n: k for k, n in enumerate(g.names)}
    return CheckpointPolicy(kind, segments=segments, save=tuple(sorted(save, key=order.get)))


def policies(plan, kind: str) -> tuple[CheckpointPolicy, ...]:
    """``kind`` on every stage of ``plan``."""
    return tuple(policy(plan, s, kind) for s in range(plan.num_stages))
