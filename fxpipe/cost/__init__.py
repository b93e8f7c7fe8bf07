"""Hardware specs and the analytic roofline cost model (torch-free)."""

from fxpipe.cost.hardware import HARDWARE, HardwareSpec, get_hardware, list_hardware
from fxpipe.cost.roofline import OpCost, backward_times, forward_time_s, is_compute_bound, roofline_s

__all__ = ["HARDWARE", "HardwareSpec", "get_hardware", "list_hardware", "OpCost", "backward_times",
           "forward_time_s", "is_compute_bound", "roofline_s"]
