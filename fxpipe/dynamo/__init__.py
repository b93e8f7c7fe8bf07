"""fxpipe as a ``torch.compile`` backend: ``torch.compile(model, backend="fxpipe", options={...})``.

- :mod:`fxpipe.dynamo.options`: the options (``fxpipe.compile``'s keyword arguments + the backend's own).
- :mod:`fxpipe.dynamo.lift`: Dynamo's graph with lifted parameters -> a module fxpipe plans.
- :mod:`fxpipe.dynamo.compiler`: the backend (graph breaks, planning, eager / Inductor / stage /
  pipelined execution), :func:`backend`, :func:`last_plan`.

Importing this package does not import torch; the backend module does.
"""

from __future__ import annotations

__all__ = ["backend", "fxpipe_backend", "last_plan", "plans", "clear_plans", "FxpipeBackend", "BackendOptions"]


def __getattr__(name):
    if name in ("backend", "fxpipe_backend", "last_plan", "plans", "clear_plans", "FxpipeBackend"):
        from fxpipe.dynamo import compiler as _backend_module  # lazy: keeps `import fxpipe.dynamo` light

        return getattr(_backend_module, name)
    if name == "BackendOptions":
        from fxpipe.dynamo.options import BackendOptions  # lazy: keeps `import fxpipe.dynamo` light

        return BackendOptions
    raise AttributeError(f"module 'fxpipe.dynamo' has no attribute {name!r}")
