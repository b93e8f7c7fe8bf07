"""A pipeline schedule as a Chrome/Perfetto trace.

:func:`chrome_trace` writes the Trace Event Format JSON that ``chrome://tracing`` and Perfetto
(ui.perfetto.dev) open: one process per device, thread 0 = compute stream, thread 1 = copy
stream, complete events (``ph: "X"``) with real durations in microseconds.

References
----------
Trace Event Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import os
from pathlib import Path

from fxpipe.errors import InputError
from fxpipe.io import write_json_atomic
from fxpipe.ir import Schedule, ScheduleProblem

__all__ = ["chrome_trace"]


def chrome_trace(schedule: Schedule, path: str | os.PathLike, device_of_stage=None) -> Path:
    """Write ``schedule`` as a Chrome/Perfetto trace (JSON, written atomically).

    Every op becomes a complete event ``{"name": "F3", "ph": "X", "ts": start_us,
    "dur": duration_us, "pid": device, "tid": 0 (compute) or 1 (copy)}`` (with several
    stages per device the name is ``"F3 (stage 5)"``); metadata events name the processes
    ("stage s" with one stage per device, else "device d") and threads ("compute", "copy").

    Parameters
    ----------
    schedule : Schedule
        Timed ops in seconds.
    path : str or PathLike
        Output ``.json`` file.
    device_of_stage : sequence of int or ScheduleProblem, optional
        The placement (default one stage per device).

    Returns
    -------
    Path
        The file written.
    """
    if not isinstance(schedule, Schedule):
        raise InputError(f"chrome_trace: expected a Schedule, got {type(schedule).__name__}")
    events = []
    if isinstance(device_of_stage, ScheduleProblem):
        device_of_stage = device_of_stage.device_of_stage
    stages = sorted({o.stage for o in schedule.ops})
    if device_of_stage is None:
        dev = {s: s for s in stages}
    else:
        dev = {s: int(device_of_stage[s]) for s in stages}
    multi = len(set(dev.values())) < len(dev)
    for d in sorted(set(dev.values())):
        name = f"device {d}" if multi else f"stage {next(s for s in stages if dev[s] == d)}"
        events.append({"name": "process_name", "ph": "M", "pid": d, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": d, "tid": 0, "args": {"sort_index": d}})
        events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 0, "args": {"name": "compute"}})
        events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 1, "args": {"name": "copy"}})
    names = {"F": "forward", "B": "backward-input", "W": "backward-weight", "O": "offload", "R": "reload"}
    for o in schedule.ops:
        events.append({
            "name": f"{o.type}{o.microbatch}" + (f" (stage {o.stage})" if multi else ""),
            "cat": names.get(o.type, o.type),
            "ph": "X",
            "ts": o.start_s * 1e6,
            "dur": max(o.end_s - o.start_s, 0.0) * 1e6,
            "pid": dev[o.stage],
            "tid": 1 if o.type in ("O", "R") else 0,
            "args": {"stage": o.stage, "microbatch": o.microbatch, "type": o.type},
        })
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"format": "fxpipe.schedule/1 trace", "method": schedule.method, "objective": schedule.objective,
                      "value_s": schedule.value, "lower_bound_s": schedule.lower_bound_s, "status": schedule.status},
    }
    return write_json_atomic(path, doc)
