"""Memory feasibility and the trivial schedule of the schedule MILP (OptPipe Section 4.1.3).

Shared by the model builder (:mod:`~fxpipe.schedule.milp.builder`: the horizon ``H`` of
the one-micro-batch-at-a-time schedule) and the warm start
(:mod:`~fxpipe.schedule.milp.warm_start`); this module imports neither, so the two do not
import each other. No torch.
"""

from __future__ import annotations

from fxpipe.errors import InfeasibleError, InputError
from fxpipe.ir import Schedule, ScheduledOp, ScheduleProblem, sort_ops
from fxpipe.schedule.device_greedy import min_device_memory
from fxpipe.schedule.validate import objective_values

__all__ = ["check_memory_feasible", "objective_value", "sequential_schedule"]


def objective_value(problem: ScheduleProblem, ops) -> float:
    """The problem's objective of a list of timed ops (per-device span or makespan)."""
    ms, span = objective_values(problem, ops)
    return float(span if problem.objective == "stage_span" else ms)


def check_memory_feasible(problem: ScheduleProblem) -> None:
    """Raise unless some schedule the MILP models fits every device's memory limit.

    A device holding one stage s: the exact condition is ``mem_f[s] <= mem_limit``.
    Necessary: at the start of any F the op's own ``mem_f`` is counted, and every other
    micro-batch contributes ``>= 0`` (``mem_f - offload_bytes >= 0`` while offloaded,
    ``mem_f + mem_b = -mem_w >= 0`` after B, 0 after W), so offloading cannot help the first
    F. Sufficient: running one micro-batch at a time (OptPipe Section 4.1.3's trivial
    schedule) peaks at exactly ``mem_f``. A device holding several stages must hold one
    micro-batch's stashes on all of them at once (its first stage's B waits for the last
    stage's): ``sum mem_f`` without offload, which the MILP does not model there.

    Raises
    ------
    InfeasibleError
        Naming the first device where no schedule fits, even with offloading.
    InputError
        If a device with several stages fits only with offloading (not modelled).
    """
    need_off = min_device_memory(problem, offload=True)
    need = min_device_memory(problem, offload=False)
    for d, stages in enumerate(problem.device_stages):
        lim = float(problem.mem_limit[d])
        if need_off[d] > lim * (1 + 1e-12):
            if len(stages) == 1:
                s = stages[0]
                raise InfeasibleError(
                    f"stage {s}: one micro-batch needs {problem.stash_footprint[s]:g} bytes (its stash mem_f="
                    f"{float(problem.mem_f[s]):g}, plus the replayed forward if it recomputes) but mem_limit is {lim:g}; no schedule fits even with "
                    "offloading (the stash of the running op is on the device). Raise the limit, use more stages "
                    "or smaller micro-batches."
                )
            raise InfeasibleError(
                f"device {d} (stages {list(stages)}): one micro-batch needs {need_off[d]:g} bytes on it even with "
                f"offloading, over its mem_limit {lim:g}; no schedule fits. Raise the limit or place fewer stages on it."
            )
        if len(stages) > 1 and need[d] > lim * (1 + 1e-12):
            raise InputError(
                f"device {d} (stages {list(stages)}): one micro-batch's stashes on all its stages need {need[d]:g} "
                f"bytes, over its mem_limit {lim:g}; only offloading could fit it, which fxpipe does not schedule "
                "on devices with several stages yet. Raise the limit or use one stage per device."
            )


def sequential_schedule(problem: ScheduleProblem) -> Schedule:
    """One micro-batch in flight at a time: the trivial feasible schedule (OptPipe 4.1.3).

    Forward through every stage, then backward back with each W right after its B; comm only
    between devices.
    Any placement; its peak memory is :func:`fxpipe.schedule.device_greedy.min_device_memory`
    without offload.
    """
    S, M = problem.num_stages, problem.num_microbatches
    ops: list[ScheduledOp] = []
    t = 0.0
    for j in range(M):
        for s in range(S):
            if s > 0:
                t += problem.comm(s - 1)
            d = problem.duration(s, "F")
            ops.append(ScheduledOp(s, j, "F", t, t + d))
            t += d
        for s in reversed(range(S)):
            if s < S - 1:
                t += problem.comm(s)
            d = problem.duration(s, "B")
            ops.append(ScheduledOp(s, j, "B", t, t + d))
            t += d
            # W right after its B: what a recomputing B keeps for W is freed before the next
            # B's replay, so the peak is min_device_memory (without offload)
            d = problem.duration(s, "W")
            ops.append(ScheduledOp(s, j, "W", t, t + d))
            t += d
    ops = sort_ops(ops)
    ms, span = objective_values(problem, ops)
    return Schedule(ops=tuple(ops), makespan=ms, stage_span=span, method="sequential", objective=problem.objective)
