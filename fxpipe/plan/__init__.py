"""The plan: what ``fxpipe.compile`` returns, its file, its tables, and what runs from it.

* :mod:`fxpipe.plan.core`: :class:`Plan` (frozen plain data plus the captured program) and
  :func:`load_plan`;
* :mod:`fxpipe.plan.file`: the ``fxpipe.plan/2`` file format and the loader of older files;
* :mod:`fxpipe.plan.tables`: the per-stage and per-device tables (work, memory by kind);
* :mod:`fxpipe.plan.build`: one rank's ``torch.distributed.pipelining`` stages and runtime;
* :mod:`fxpipe.plan.reschedule`: the same partition under another schedule;
* :mod:`fxpipe.plan.train`: local gloo ranks trained next to a single-process reference.

``from fxpipe.plan import Plan, load_plan`` (and ``fxpipe.Plan``, ``fxpipe.load_plan``) work.
"""

from fxpipe.plan.core import PLAN_FORMAT, CaptureCell, Plan, graph_signature, load_plan
from fxpipe.plan.tables import DeviceStats, StageStats

__all__ = ["Plan", "CaptureCell", "StageStats", "DeviceStats", "PLAN_FORMAT", "graph_signature", "load_plan"]
