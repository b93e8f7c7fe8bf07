"""Reschedule a plan: the same partition and placement with another schedule method (torch-free).

:func:`reschedule` is :meth:`fxpipe.plan.Plan.reschedule`; the new plan shares the old one's
graph, partition, memory model and capture, with new stage and device tables.
"""

from __future__ import annotations

import dataclasses
import time

from fxpipe.errors import InputError
from fxpipe.options import SCHEDULES
from fxpipe.plan.tables import device_stats, stage_stats
from fxpipe.schedule.auto import auto_schedule
from fxpipe.schedule.dispatch import make_schedule, methods_for_placement
__all__ = ["reschedule"]


def reschedule(plan, schedule: str, *, time_limit_s: float = 60.0, progress: bool = False):
    """``plan``'s partition and placement with another schedule (``"1f1b"``, ``"zb-h2"``, ``"zb-v"``, ``"milp"``, ...).

    Parameters
    ----------
    plan : Plan
        The plan to reschedule (:meth:`fxpipe.plan.Plan.reschedule` calls this with itself).
    schedule : str
        A method of :func:`fxpipe.schedule.dispatch.make_schedule` valid for the plan's
        placement (:func:`fxpipe.schedule.dispatch.methods_for_placement`). ``"auto"``
        is :func:`fxpipe.schedule.auto.auto_schedule` with recomputation in training, as
        in :func:`fxpipe.compile` (the new plan's problem carries the recomputing stages).
    time_limit_s : float
        MILP budget in seconds (``schedule="milp"``).

    Returns
    -------
    Plan
        A new plan sharing this plan's graph, partition, problem and capture.

    Raises
    ------
    InputError
        For an unknown schedule method or one the placement does not admit.
    InfeasibleError
        When the schedule cannot fit the problem's memory limit.
    """
    if schedule not in SCHEDULES:
        raise InputError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    valid = methods_for_placement(plan.device_of_stage, plan.devices)
    if schedule not in valid:
        raise InputError(
            f"schedule {schedule!r} does not schedule this plan's {plan.placement} placement with "
            f"{plan.stages_per_device} stages per device; use one of {', '.join(valid)}"
        )
    t0 = time.perf_counter()
    problem = plan.problem
    if schedule == "auto":  # as in compile: recomputation where memory forces it

        chosen = auto_schedule(problem, recompute=plan.objective == "training", time_limit_s=time_limit_s,
                               progress=progress)
        problem, sched = chosen.problem, chosen.schedule
    else:
        sched = make_schedule(problem, schedule, time_limit_s=time_limit_s, progress=progress)
    args = (plan.graph, plan.partition, problem, sched, plan.objective, plan.memory)
    return dataclasses.replace(
        plan, stage_of=dict(plan.stage_of), problem=problem, schedule=sched, stages=stage_stats(*args),
        device_table=device_stats(*args), timings_s={**plan.timings_s, "schedule": time.perf_counter() - t0},
        options={**plan.options, "schedule": schedule}, mesh=dict(plan.mesh), rank_order=plan.rank_order,
    )
