"""Hardware specs, the analytic roofline cost model, measured costs and their calibration.

``specs``, ``hardware``, ``roofline``, ``database`` and ``calibrate`` are torch-free; ``profile`` (the op
profiler and the cost hook of measured hardware specs) imports torch and is not imported here.
"""

from fxpipe.cost.hardware import HARDWARE, HardwareSpec, get_hardware, list_hardware
from fxpipe.cost.roofline import OpCost, backward_times, forward_time_s, is_compute_bound, roofline_s

__all__ = ["HARDWARE", "HardwareSpec", "get_hardware", "list_hardware", "OpCost", "backward_times",
           "forward_time_s", "is_compute_bound", "roofline_s"]
