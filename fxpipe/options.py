"""The planning options shared by :func:`fxpipe.compile` and :func:`fxpipe.api.plan_graph` (torch-free).

:class:`PlanOptions` is the one declaration of the knobs of the partition, placement and
schedule search, with their defaults (:data:`DEFAULTS`) and validation; both public functions
keep their keyword signatures (defaults taken from :data:`DEFAULTS`) and build a
``PlanOptions`` from them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import numpy as np

import fxpipe.schedule.registry as _schedule_registry
from fxpipe.errors import InputError
from fxpipe.memory.checkpoint import CHECKPOINT_REQUESTS, check_request

__all__ = ["PlanOptions", "DEFAULTS", "SCHEDULES", "PLACEMENTS", "OBJECTIVES", "AUTO_STAGES_PER_DEVICE", "CHECKPOINT_REQUESTS",
           "DEFAULT_MILP_TIME_LIMIT_S", "DEFAULT_AUTO_MILP_TIME_LIMIT_S", "AUTO_MILP_MIN_SHARE", "check_count"]

#: every schedule method (= :data:`fxpipe.schedule.dispatch.METHODS`); which ones a placement
#: admits: :func:`fxpipe.schedule.dispatch.methods_for_placement`.
SCHEDULES = _schedule_registry.names()
#: placements of ``stages_per_device`` stages on every device (``"auto"``: the best by predicted step time).
PLACEMENTS = ("looped", "v", "auto")
#: Contract-2 objectives a partition minimises.
OBJECTIVES = ("training", "inference")
#: stages per device tried by ``stages_per_device="auto"``.
AUTO_STAGES_PER_DEVICE = (1, 2)
#: MILP budget (seconds) when ``schedule_time_limit_s`` is not given: ``schedule="milp"`` /
#: ``schedule="auto"`` (whose MILP only tries to improve a feasible heuristic schedule).
DEFAULT_MILP_TIME_LIMIT_S = 60.0
DEFAULT_AUTO_MILP_TIME_LIMIT_S = 5.0
#: smallest share of :data:`DEFAULT_AUTO_MILP_TIME_LIMIT_S` :func:`fxpipe.planner.auto_milp_budget_s` gives a small problem.
AUTO_MILP_MIN_SHARE = 0.2


def check_count(value: Any, what: str) -> int:
    """``value`` as an int >= 1 (devices, micro-batches, stages per device); InputError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{what} must be an integer, got {value!r}")
    if value < 1:
        raise InputError(f"{what} must be >= 1, got {value}")
    return int(value)


@dataclass(frozen=True)
class PlanOptions:
    """The options of the partition, placement and schedule search (validated on construction).

    Attributes
    ----------
    objective : {"training", "inference"}
        Contract-2 objective the partition minimises.
    schedule : str or None
        A method of :data:`SCHEDULES` (``"auto"``: the fastest that fits memory, see
        :func:`fxpipe.api.plan_graph`; None: the placement's default method).
    stages_per_device : int or "auto"
        v >= 1 stages on every device, or ``"auto"``: try :data:`AUTO_STAGES_PER_DEVICE`.
    placement : {"looped", "v", "auto"}
        Placement of the ``v * p`` stages (ignored when v = 1).
    time_limit_s : float
        Partition search budget (seconds, per stage count).
    schedule_time_limit_s : float or None
        MILP budget per candidate (seconds; None: :data:`DEFAULT_MILP_TIME_LIMIT_S` for
        ``"milp"``, :func:`fxpipe.planner.auto_milp_budget_s` for ``"auto"``).
    seed : int
        Seed of the partition search.
    mem_limit_bytes : float or None
        An extra cap on every device's activation memory (bytes).
    host_bandwidth_bytes_per_s : float or None
        Device-host bandwidth (enables offload).
    progress : bool
        tqdm progress bars.
    activation_checkpointing : {"auto", "none", "full", "selective"}
        The activation-checkpoint policy of every stage (issue 28, :mod:`fxpipe.memory.checkpoint`):
        ``"auto"`` lets the planner choose per stage among none, per-block selective, budgeted and
        full checkpointing and whole-stage recomputation, where memory forces it; ``"none"``
        never checkpoints; ``"full"`` / ``"selective"`` run that per-block policy on every stage
        with blocks (training only).

    Raises
    ------
    InputError
        On an unknown objective, schedule, placement or activation-checkpointing value, or a bad
        ``stages_per_device``.
    """

    objective: str = "training"
    schedule: str | None = "auto"
    stages_per_device: int | str = 1
    placement: str = "looped"
    time_limit_s: float = 10.0
    schedule_time_limit_s: float | None = None
    seed: int = 0
    mem_limit_bytes: float | None = None
    host_bandwidth_bytes_per_s: float | None = None
    progress: bool = False
    activation_checkpointing: str = "auto"

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise InputError(f"objective must be 'training' or 'inference', got {self.objective!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise InputError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        self.placement_candidates()  # bad placement / stages_per_device values fail here
        check_request(self.activation_checkpointing)

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, Any]) -> "PlanOptions":
        """The options named in ``keywords`` (e.g. a public function's ``locals()``); others are ignored."""
        return cls(**{f.name: keywords[f.name] for f in fields(cls) if f.name in keywords})

    def stages_per_device_candidates(self) -> tuple[int, ...]:
        """The values of v to try."""
        if isinstance(self.stages_per_device, str):
            if self.stages_per_device != "auto":
                raise InputError(f"stages_per_device must be an integer >= 1 or 'auto', got {self.stages_per_device!r}")
            return AUTO_STAGES_PER_DEVICE
        return (check_count(self.stages_per_device, "stages_per_device"),)

    def placement_candidates(self) -> list[tuple[int, str]]:
        """(v, placement) pairs to try, in the order of preference on equal predicted step time."""
        if self.placement not in PLACEMENTS:
            raise InputError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        out: list[tuple[int, str]] = []
        for v in self.stages_per_device_candidates():
            for name in (("looped", "v") if self.placement == "auto" else (self.placement,)):
                if v == 1 and out and out[-1][0] == 1:
                    continue  # with one stage per device every placement is the same
                out.append((v, name))
        return out


#: The default options: the defaults of :func:`fxpipe.compile`'s and :func:`fxpipe.api.plan_graph`'s keywords.
DEFAULTS = PlanOptions()
