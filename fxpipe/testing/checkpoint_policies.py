"""One activation-checkpoint policy kind on every stage of a plan, for the runtime's tests and benchmarks (issue 28).

The planner picks a policy per stage from a menu (:func:`fxpipe.memory.checkpoint.stage_menu`);
the runtime's tests and ``benchmarks/bench_checkpoint_memory.py`` pin one kind on every stage
instead, taking the menu's option of that kind (its blocks found on the graph, its keep set
the planner's), so that every kind is executed and measured whatever the planner would choose.
"""

from __future__ import annotations

from fxpipe.memory.checkpoint import CheckpointPolicy, stage_menu

__all__ = ["policy", "policies", "stage_nodes"]


def stage_nodes(plan, stage: int) -> list[int]:
    """OpGraph ids of ``stage``'s nodes, in program order (the plan's stage map)."""
    g = plan.graph
    return [i for i in range(g.n) if plan.stage_of.get(g.names[i]) == stage and g.ops[i] not in ("placeholder", "output")]


def policy(plan, stage: int, kind: str) -> CheckpointPolicy:
    """The planner's policy ``kind`` for ``stage`` (:func:`fxpipe.memory.checkpoint.stage_menu`, not fused;
    ``"budget"``: its middle budget level); ``"none"`` where the stage offers no such option (no blocks)."""
    if kind == "none":
        return CheckpointPolicy("none")
    menu = [e for e in stage_menu(plan.graph, stage_nodes(plan, stage), kinds=(kind,), fused=False)
            if e.policy.kind == kind]
    if not menu:
        return CheckpointPolicy("none")
    return menu[len(menu) // 2].policy


def policies(plan, kind: str) -> tuple[CheckpointPolicy, ...]:
    """``kind`` on every stage of ``plan``."""
    return tuple(policy(plan, s, kind) for s in range(plan.num_stages))
