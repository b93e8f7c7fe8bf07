"""Former home of the plan view of the memory model: now :mod:`fxpipe.memory.plan_view`.

Kept so that ``from fxpipe.plan_memory import ...`` keeps working.
"""

from fxpipe.memory.plan_view import StageStatic, device_memory, schedule_mem_limit, stage_memory, stage_static

__all__ = ["StageStatic", "stage_static", "schedule_mem_limit", "stage_memory", "device_memory"]
