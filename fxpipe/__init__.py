"""fxpipe: automatic, certified pipeline parallelism for PyTorch models.

``fxpipe.compile(model, args, devices=4, microbatches=8)`` captures the model with
torch.export, costs every op, partitions the op DAG into pipeline stages (SliceGraph + BRKGA,
Archer et al. 2024), schedules F / B / W per micro-batch and returns a :class:`Plan` that
builds a ``torch.distributed.pipelining`` program; ``torch.compile(model, backend="fxpipe",
options={"devices": 4})`` plans the graph Dynamo captures (``fxpipe.backend``, ``fxpipe.last_plan``).
Importing fxpipe does not import torch;
the partitioner and scheduler never do.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["compile", "backend", "last_plan", "load_plan", "Plan", "OpGraph", "ScheduleProblem", "Schedule",
           "__version__"]


#: Submodules reachable as attributes of the package without importing them first
#: (``import fxpipe; fxpipe.models.build_hf_model(...)``); each is imported on first access.
_SUBMODULES = ("models", "memory", "report", "errors", "ir", "io", "api", "testing", "progress", "partition",
               "schedule", "cost", "codegen", "passes", "dynamo", "mip", "cli")


def __getattr__(name):  # lazy: keep `import fxpipe` light
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"fxpipe.{name}")
    if name == "compile":
        from fxpipe import api

        return api.compile
    if name in ("backend", "last_plan"):  # the torch.compile backend (torch.compile(m, backend="fxpipe"))
        from fxpipe.dynamo import compiler as _backend

        return getattr(_backend, name)
    if name in ("load_plan", "Plan"):
        from fxpipe import plan

        return getattr(plan, name)
    if name in ("OpGraph", "ScheduleProblem", "Schedule"):
        from fxpipe import ir

        return getattr(ir, name)
    raise AttributeError(f"module 'fxpipe' has no attribute {name!r}")
