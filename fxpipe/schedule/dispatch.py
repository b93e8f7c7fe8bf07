"""One entry point for every schedule method: ``make_schedule(problem, method)``.

Used by ``fxpipe.compile`` and by ``fxpipe schedule``. Heuristics come from
:mod:`fxpipe.schedule.heuristics`; ``"milp"`` is the OptPipe MILP of
:mod:`fxpipe.schedule.milp`, warm-started from the best heuristic that fits. Every schedule
is checked by the Contract-3 validator, and ``lower_bound_s`` is the best proven bound: the
MILP's dual bound or the combinatorial bound of :mod:`fxpipe.schedule.bounds`, whichever is
larger.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from typing import Sequence

from fxpipe.errors import InputError, SolverError
from fxpipe.ir import Schedule, ScheduleProblem, looped_placement, v_placement
import fxpipe.schedule.registry as registry
from fxpipe.schedule.auto import auto_schedule
from fxpipe.schedule.bounds import combinatorial_lower_bound
from fxpipe.schedule.heuristics import generate
import fxpipe.schedule.milp as milp
from fxpipe.schedule.validate import InvalidScheduleError, validate_schedule

#: Every schedule method (:data:`fxpipe.schedule.registry.REGISTRY`, heuristics first).
METHODS = (*registry.names("heuristic"), *registry.names("milp"), *registry.names("auto"))


def placement_kinds(device_of_stage: Sequence[int], num_devices: int | None = None) -> frozenset[str]:
    """The placement kinds (:data:`fxpipe.schedule.registry.PLACEMENT_KINDS`) of a placement.

    ``"any"`` always; ``"one"`` with one stage per device; ``"looped"`` when stage s is on
    device ``s mod p`` (the identity placement included); ``"v"`` for the V placement with
    two stages per device.
    """
    dev = tuple(int(d) for d in device_of_stage)
    p = (max(dev) + 1 if dev else 0) if num_devices is None else int(num_devices)
    S = len(dev)
    kinds = {"any"}
    if p == S:
        kinds.add("one")
    if p >= 1 and S % p == 0:
        v = S // p
        if dev == looped_placement(p, v):
            kinds.add("looped")
        if v == 2 and dev == v_placement(p, 2):
            kinds.add("v")
    return frozenset(kinds)


def methods_for_placement(device_of_stage: Sequence[int], num_devices: int | None = None) -> tuple[str, ...]:
    """The methods of :data:`METHODS` defined for a placement, in :data:`METHODS` order.

    * one stage per device: GPipe, 1F1B, ZB-H1/H2, the Zero Bubble greedy, PipeOffload,
      AdaOffload, the offload-aware list-scheduling search (and ``interleaved-1f1b`` = 1F1B when stage s is on device s);
    * looped (stage s on device ``s mod p``), v >= 2: ``interleaved-1f1b``;
    * V-shape with 2 stages per device: ``zb-v``, ``dualpipe-v`` (the latter also needs
      ``m >= 2p``, checked when it runs);
    * every placement: ``greedy`` (the device greedy), ``milp`` and ``auto``
      (:func:`fxpipe.schedule.auto.auto_schedule`).

    Parameters
    ----------
    device_of_stage : sequence of int
        Device of every stage.
    num_devices : int, optional
        Default ``max(device_of_stage) + 1``.
    """
    kinds = placement_kinds(device_of_stage, num_devices)
    return tuple(m for m in METHODS if registry.get(m).admits(kinds))


def default_method(device_of_stage: Sequence[int], num_devices: int | None = None) -> str:
    """The method ``fxpipe.compile`` uses for a placement when none is named.

    ``zb-h1`` with one stage per device, ``interleaved-1f1b`` on looped placements,
    ``zb-v`` on the V placement with 2 stages per device, ``greedy`` otherwise.
    """
    return registry.default_for(methods_for_placement(device_of_stage, num_devices))


def make_schedule(
    problem: ScheduleProblem,
    method: str = "zb-h1",
    *,
    time_limit_s: float = 60.0,
    progress: bool = False,
    on_incumbent: Callable | None = None,
) -> Schedule:
    """The validated schedule of ``problem`` by ``method``, with its best lower bound.

    Parameters
    ----------
    problem : ScheduleProblem
    method : str
        One of :data:`METHODS`. ``"auto"``: the best schedule that fits among the heuristics
        (offloading only when no plain schedule fits) and, within ``time_limit_s``, the MILP
        (:func:`fxpipe.schedule.auto.auto_schedule` without recomputation, which would change
        the problem).
    time_limit_s : float
        MILP budget in seconds (ignored by the heuristics).
    progress : bool
        Show the MILP's incumbent / gap progress bar.
    on_incumbent : callable, optional
        Called by the MILP with every new incumbent (OptPipe Section 4.3).

    Returns
    -------
    Schedule
        ``solver_time_s`` includes the warm start.

    Raises
    ------
    InputError
        For an unknown method.
    InfeasibleError
        If the method cannot fit the memory limit.
    SolverError
        If the MILP returns a schedule that breaks Contract 3.
    """
    if method not in METHODS:
        raise InputError(f"schedule method must be one of {METHODS}, got {method!r}")
    t0 = time.perf_counter()
    if method == "auto":
        sched = auto_schedule(problem, recompute=False, time_limit_s=time_limit_s, progress=progress).schedule
    elif method == "milp":
        # the warm start is computed inside milp.solve (its default), where a Ctrl-C during it stops the MILP
        sched = milp.solve(problem, time_limit_s=time_limit_s, progress=progress, on_incumbent=on_incumbent)
        try:
            validate_schedule(problem, sched)
        except InvalidScheduleError as exc:
            raise SolverError(f"the MILP returned a schedule that breaks Contract 3: {exc}") from None
    else:
        sched = generate(problem, method)
        validate_schedule(problem, sched)
    bound = max(float(sched.lower_bound_s), combinatorial_lower_bound(problem))
    return dataclasses.replace(
        sched,
        lower_bound_s=bound,
        solver_time_s=time.perf_counter() - t0,
        method=sched.method or method,
        objective=problem.objective,
    )
