"""Hardware specs, the analytic roofline cost model, measured costs and their calibration.

``specs``, ``hardware``, ``roofline``, ``database`` and ``calibrate`` are torch-free; the profiler
(``measure``: op timing and the cost hook of measured hardware specs; ``suite``; ``profile``: its
front end and command line) imports torch and is not imported here. ``hardware`` reaches the
profiler only to measure ``hardware="measured"``, through a function-local import.
"""

from fxpipe.cost.hardware import HARDWARE, HardwareSpec, get_hardware, list_hardware
from fxpipe.cost.roofline import OpCost, backward_times, forward_time_s, is_compute_bound, roofline_s

__all__ = ["HARDWARE", "HardwareSpec", "get_hardware", "list_hardware", "OpCost", "backward_times",
           "forward_time_s", "is_compute_bound", "roofline_s"]
