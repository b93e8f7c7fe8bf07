"""Pipeline schedules (DESIGN.md Contract 3): validator, simulator, heuristics, bounds.

No torch here. The MILP lives in :mod:`fxpipe.schedule.milp` (imported lazily by callers).
"""

from fxpipe.schedule.bounds import combinatorial_lower_bound, stage_span_bounds
from fxpipe.schedule.from_partition import problem_from_partition
from fxpipe.schedule.heuristics import (
    METHODS,
    adaoffload,
    generate,
    gpipe,
    one_f_one_b,
    orders_1f1b,
    orders_gpipe,
    pipeoffload,
    zb_greedy,
    zb_h1,
    zb_h2,
)
from fxpipe.schedule.simulate import orders_from_schedule, simulate
from fxpipe.schedule.validate import (
    InvalidScheduleError,
    check_schedule,
    memory_profile,
    objective_values,
    peak_memory,
    validate_schedule,
)

__all__ = [
    "METHODS",
    "InvalidScheduleError",
    "adaoffload",
    "check_schedule",
    "combinatorial_lower_bound",
    "generate",
    "gpipe",
    "memory_profile",
    "objective_values",
    "one_f_one_b",
    "orders_1f1b",
    "orders_from_schedule",
    "orders_gpipe",
    "peak_memory",
    "pipeoffload",
    "problem_from_partition",
    "simulate",
    "stage_span_bounds",
    "validate_schedule",
    "zb_greedy",
    "zb_h1",
    "zb_h2",
]
