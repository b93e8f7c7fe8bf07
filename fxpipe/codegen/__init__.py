"""Code generation: stage modules and the ``torch.distributed.pipelining`` runtime.

- :mod:`fxpipe.codegen.split`: :func:`split_stages` turns an exported ``GraphModule`` and a
  node -> stage map into per-stage ``GraphModule`` s (relaying tensors that skip stages).
- :mod:`fxpipe.codegen.runtime`: :func:`actions_from_orders` (fxpipe F/B/W orders -> torch
  action strings), :func:`build_rank` / :func:`build_pipeline_rank` (this rank's
  ``PipelineStage`` + schedule runtime). The only module importing private torch APIs.
- :mod:`fxpipe.codegen.launch`: :func:`spawn_train` (multi-process gloo training on this
  machine) and :func:`reference_train` (single-process oracle).
"""

from __future__ import annotations

from fxpipe.codegen.split import StagedProgram, StageSpec, canonical_param_names, split_stages

__all__ = [
    "StagedProgram",
    "StageSpec",
    "split_stages",
    "canonical_param_names",
    "actions_from_orders",
    "orders_from_schedule",
    "check_orders",
    "fuse_backward",
    "build_rank",
    "build_pipeline_rank",
    "spawn_train",
    "reference_train",
    "TrainResult",
]

_RUNTIME = {"actions_from_orders", "orders_from_schedule", "check_orders", "fuse_backward", "build_rank", "build_pipeline_rank"}
_LAUNCH = {"spawn_train", "reference_train", "TrainResult"}


def __getattr__(name):  # runtime/launch import torch.distributed lazily
    if name in _RUNTIME:
        from fxpipe.codegen import runtime

        return getattr(runtime, name)
    if name in _LAUNCH:
        from fxpipe.codegen import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'fxpipe.codegen' has no attribute {name!r}")
