"""Code generation: stage modules and the ``torch.distributed.pipelining`` runtime.

Small passes, one job each:

- :mod:`fxpipe.codegen.effects`: aliasing, in-place writes, state mutation and random ops of a graph.
- :mod:`fxpipe.codegen.split`: :func:`split_stages` turns an exported ``GraphModule`` and a
  node -> stage map into per-stage ``GraphModule`` s (relayed skip tensors, in-place updates
  placed and cloned, contiguous gradients, every parameter and buffer owned by a stage).
- :mod:`fxpipe.codegen.interface`: the model's pytree inputs/outputs <-> flat stage tensors,
  micro-batch splitting and output merging (:class:`ModelInputs`, :class:`ModelInterface`).
- :mod:`fxpipe.codegen.actions`: per-device :class:`fxpipe.ir.Orders` -> torch action strings
  (pure list-to-list passes; codegen's one schedule input is ``Orders``, it never calls the scheduler).
- :mod:`fxpipe.codegen.shapes`: static shape inference on fake tensors (never touches real state).
- :mod:`fxpipe.codegen.runtime`: the only module importing private torch APIs (pytrees, op
  schemas, fake tensors, ``_PipelineScheduleRuntime``) and :class:`FxpipeScheduleRuntime`.
- :mod:`fxpipe.codegen.rank`: :func:`build_rank` / :func:`build_pipeline_rank` (this rank's
  ``PipelineStage`` s - several with looped or V placements - and the schedule runtime).
- :mod:`fxpipe.codegen.checkpointing`: a stage's activation-checkpoint policy carved into its
  program (segments replayed by the stash during the backward, kept op results tied to fx nodes).
- :mod:`fxpipe.codegen.mesh`: pipeline x data parallelism on a ``DeviceMesh`` (a rank's stages
  wrapped by FSDP2 ``fully_shard`` / ``replicate`` over its data-parallel group, :func:`build_mesh_rank`).
- :mod:`fxpipe.codegen.launch`: :func:`spawn_train` (multi-process gloo training on this
  machine) and :func:`reference_train` (single-process oracle).
- :mod:`fxpipe.codegen.compare`: :func:`compare_training` (losses, gradients, parameters, buffers).
"""

from __future__ import annotations

from fxpipe.codegen.actions import actions_from_orders, check_orders, format_actions, fuse_backward
from fxpipe.codegen.interface import ModelInputs, ModelInterface, split_microbatches
from fxpipe.codegen.split import StagedProgram, StageSpec, canonical_param_names, split_stages

__all__ = [
    "StagedProgram",
    "StageSpec",
    "split_stages",
    "canonical_param_names",
    "ModelInputs",
    "ModelInterface",
    "split_microbatches",
    "actions_from_orders",
    "check_orders",
    "fuse_backward",
    "format_actions",
    "build_rank",
    "build_pipeline_rank",
    "spawn_train",
    "spawn_train_many",
    "reference_train",
    "TrainResult",
    "compare_training",
    "TrainingComparison",
]

_LAZY = {
    "build_rank": "rank",
    "build_pipeline_rank": "rank",
    "spawn_train": "launch",
    "spawn_train_many": "launch",
    "reference_train": "launch",
    "TrainResult": "launch",
    "compare_training": "compare",
    "TrainingComparison": "compare",
}


def __getattr__(name):  # rank/launch import torch.distributed lazily
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"fxpipe.codegen.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'fxpipe.codegen' has no attribute {name!r}")
