"""Pipeline schedules (DESIGN.md Contract 3): validator, simulator, heuristics, bounds.

Any placement of stages on devices (``ScheduleProblem.device_of_stage``): one stage per
device (GPipe, 1F1B, ZB-H1/H2, the Zero Bubble greedy, PipeOffload, AdaOffload), looped
(interleaved 1F1B) and V-shape (ZB-V, DualPipe-V), and any placement (the device greedy, the
MILP). No torch here. The MILP lives in :mod:`fxpipe.schedule.milp` (imported lazily by
callers).
"""

from fxpipe.schedule.bounds import combinatorial_lower_bound, device_span_bounds, stage_span_bounds
from fxpipe.schedule.device_greedy import device_greedy, min_device_memory
from fxpipe.schedule.from_partition import problem_from_partition
from fxpipe.schedule.heuristics import (
    ALL_METHODS,
    METHODS,
    V_METHODS,
    adaoffload,
    generate,
    gpipe,
    greedy,
    one_f_one_b,
    orders_1f1b,
    orders_gpipe,
    pipeoffload,
    zb_greedy,
    zb_h1,
    zb_h2,
)
from fxpipe.schedule.multistage import (
    dualpipe_v,
    interleaved_1f1b,
    orders_dualpipe_v,
    orders_interleaved_1f1b,
    orders_zbv,
    zb_v,
)
from fxpipe.schedule.simulate import as_orders, simulate
from fxpipe.schedule.validate import (
    InvalidScheduleError,
    check_schedule,
    device_busy_s,
    device_memory_profile,
    device_spans,
    memory_profile,
    objective_values,
    peak_memory,
    validate_schedule,
)

__all__ = [
    "ALL_METHODS",
    "METHODS",
    "V_METHODS",
    "as_orders",
    "device_busy_s",
    "device_greedy",
    "device_memory_profile",
    "device_span_bounds",
    "device_spans",
    "dualpipe_v",
    "greedy",
    "interleaved_1f1b",
    "min_device_memory",
    "orders_dualpipe_v",
    "orders_interleaved_1f1b",
    "orders_zbv",
    "zb_v",
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
