"""Forward-only pipelines: pipelined inference across ranks, and the same stages in one process.

:class:`InferencePipeline` is one rank's part of a forward-only pipeline (the forward half of
GPipe; Huang et al., "GPipe", NeurIPS 2019, Sec. 2.2): the first rank splits the batch into
micro-batches along dim 0 (:mod:`fxpipe.codegen.interface`'s rule) and runs its stage on each;
every other rank receives a micro-batch's boundary tensors from its predecessor, runs its stage
and sends the result on, so stage ``s`` works on micro-batch ``j`` while stage ``s + 1`` works
on ``j - 1``. Receives for all micro-batches are posted up front (shapes and dtypes are known
statically from :func:`fxpipe.codegen.shapes.stage_io`) and sends are asynchronous, so a rank
never waits for its successor. The last rank merges the micro-batch outputs into the model's
output structure (:meth:`~fxpipe.codegen.interface.ModelInterface.merge`) and broadcasts the
merged tensors, so every rank returns the same output, equal to the model's on the whole batch.

The stage modules are :func:`fxpipe.codegen.split.split_stages`'s, optionally run by Inductor
(:mod:`fxpipe.codegen.compiled`). :func:`run_stages` runs the same stage modules one after the
other in one process, micro-batch by micro-batch: the single-process twin used to check a plan.

Only public torch APIs (``torch.distributed`` point-to-point and broadcast) are used here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from fxpipe.codegen.compiled import compile_stage
from fxpipe.codegen.interface import ModelInputs, as_call
from fxpipe.codegen.runtime import tree_flatten
from fxpipe.codegen.shapes import stage_io
from fxpipe.codegen.split import StagedProgram
from fxpipe.errors import DataDependentCutError, InputError

__all__ = ["InferencePipeline", "run_stages", "merged_output_meta", "stage_runner"]


def stage_runner(staged: StagedProgram, stage: int, *, compile_stages: bool = False) -> torch.nn.Module:
    """The module that runs ``stage``: the stage's GraphModule, or it wrapped for Inductor."""
    module = staged.stages[stage].module
    if compile_stages:
        return compile_stage(module)
    return module


def _as_tuple(out: Any) -> tuple:
    if isinstance(out, tuple):
        return out
    if isinstance(out, list):  # compiled modules return lists
        return tuple(out)
    return (out,)


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype


def merged_output_meta(staged: StagedProgram, last_outputs: Sequence[torch.Tensor], num_microbatches: int) -> list[_TensorMeta]:
    """Shape and dtype of every merged output tensor (the model's output on the whole batch).

    ``last_outputs`` are example outputs of the last stage for one micro-batch. A tensor whose
    dim 0 is the micro-batch size is concatenated over micro-batches, any other is stacked along a
    new leading dimension (:meth:`ModelInterface.merge`).
    """
    iface = staged.interface
    out = []
    for i, t in enumerate(last_outputs):
        shape = iface.output_shapes[i] if i < len(iface.output_shapes) else tuple(t.shape)
        if any(d < 0 for d in shape):
            raise DataDependentCutError(
                f"model output {i} has a size that depends on the data (captured shape {shape}, -1 = data "
                "dependent): the forward-only pipeline allocates the merged output in advance; return a "
                "fixed-size tensor (e.g. torch.where(mask, x, 0) instead of x[mask]) or run the model without it"
            )
        batched = iface.microbatch_size is not None and len(shape) >= 1 and shape[0] == iface.microbatch_size
        full = (shape[0] * num_microbatches, *shape[1:]) if batched else (num_microbatches, *shape)
        out.append(_TensorMeta(tuple(int(d) for d in full), t.dtype))
    return out


def run_stages(staged: StagedProgram, inputs: Any, num_microbatches: int, modules: Sequence[torch.nn.Module] | None = None):
    """Run every stage in this process, micro-batch by micro-batch, and merge the outputs.

    Parameters
    ----------
    staged : StagedProgram
    inputs : ModelInputs, tuple or dict
        The whole batch in the model's calling form.
    num_microbatches : int
        Micro-batches (the batch's dim 0 must be divisible by it).
    modules : sequence of modules, optional
        What runs each stage (default the stage modules; e.g. :func:`stage_runner` with Inductor).

    Returns
    -------
    pytree
        The model's output for the whole batch (:meth:`ModelInterface.merge`).

    Raises
    ------
    InputError
        If the inputs do not match the captured micro-batch (shapes, structure, constants).
    """
    mods = list(modules) if modules is not None else [s.module for s in staged.stages]
    chunks = []
    for x in staged.interface.microbatch_inputs(ModelInputs(*as_call(inputs)), num_microbatches):
        for mod in mods:
            x = _as_tuple(mod(*x))
        chunks.append(x)
    return staged.interface.merge(chunks)


class InferencePipeline:
    """One rank of a forward-only pipeline over a process group (see the module docstring).

    Parameters
    ----------
    staged : StagedProgram
        Built identically on every rank (:func:`fxpipe.codegen.split.split_stages`).
    rank : int
        This process's rank in ``group`` = the stage it runs.
    num_microbatches : int
        Micro-batches per call.
    example_microbatch_inputs : ModelInputs, tuple or dict
        One micro-batch of model inputs (shapes for the static receive buffers).
    group : ProcessGroup, optional
        Pipeline group (default: the world); its size must be the number of stages.
    compile_stages : bool
        Run this rank's stage with Inductor (:mod:`fxpipe.codegen.compiled`).
    device : str or torch.device, optional
        Device of the receive buffers (default: the device of the stage's first parameter, else CPU).

    Raises
    ------
    InputError
        If the process group's size is not the number of stages, the rank is out of range, or
        the example inputs do not match the captured graph.
    """

    def __init__(self, staged: StagedProgram, rank: int, *, num_microbatches: int, example_microbatch_inputs: Any,
                 group=None, compile_stages: bool = False, device: str | torch.device | None = None):
        S = staged.num_stages
        if not dist.is_available() or not dist.is_initialized():
            raise InputError("a pipeline across ranks needs torch.distributed initialised (torchrun, init_process_group)")
        world = dist.get_world_size(group)
        if world != S:
            raise InputError(f"the pipeline has {S} stages but the process group has {world} ranks; one stage per rank")
        if not 0 <= rank < S:
            raise InputError(f"rank must lie in 0..{S - 1}, got {rank}")
        self.staged = staged
        self.rank = rank
        self.num_stages = S
        self.num_microbatches = int(num_microbatches)
        self.group = group
        flat = staged.interface.example_inputs(example_microbatch_inputs)
        io = stage_io(staged, rank, flat)
        last_io = io if rank == S - 1 else stage_io(staged, S - 1, flat)
        self.recv_meta = [_TensorMeta(tuple(t.shape), t.dtype) for t in io.inputs] if rank > 0 else []
        self.output_meta = merged_output_meta(staged, last_io.outputs, self.num_microbatches)
        self.module = stage_runner(staged, rank, compile_stages=compile_stages)
        if device is None:
            p = next(iter(staged.stages[rank].module.parameters()), None)
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)

    def _peer(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def __call__(self, inputs: Any = (), *, broadcast: bool = True):
        """Run the pipeline on a whole batch (read on the first rank; ignored elsewhere).

        Parameters
        ----------
        inputs : ModelInputs, tuple or dict
            The model's inputs for the whole batch (dim 0 divisible by the micro-batch count).
        broadcast : bool
            Broadcast the merged output from the last rank, so every rank returns it.

        Returns
        -------
        pytree or None
            The model's output for the whole batch on every rank (``broadcast``), else on the
            last rank only (None elsewhere).
        """
        m, S, r = self.num_microbatches, self.num_stages, self.rank
        with torch.no_grad():
            if r == 0:
                mbs = self.staged.interface.microbatch_inputs(ModelInputs(*as_call(inputs)), m)
            else:
                bufs = [[torch.empty(t.shape, dtype=_wire_dtype(t.dtype), device=self.device) for t in self.recv_meta]
                        for _ in range(m)]
                recvs = [[dist.irecv(b, src=self._peer(r - 1), group=self.group, tag=j) for b in bufs[j]]
                         for j in range(m)]
            sends = []
            chunks = []
            for j in range(m):
                if r == 0:
                    x = mbs[j]
                else:
                    for req in recvs[j]:
                        req.wait()
                    x = tuple(_from_wire(b, t.dtype) for b, t in zip(bufs[j], self.recv_meta))
                out = _as_tuple(self.module(*x))
                if r < S - 1:
                    for t in out:
                        wire = _to_wire(t)
                        sends.append((dist.isend(wire, dst=self._peer(r + 1), group=self.group, tag=j), wire))
                else:
                    chunks.append(out)
            for req, _ in sends:
                req.wait()
            merged = self.staged.interface.merge(chunks) if r == S - 1 else None
            if not broadcast:
                return merged
            return self._broadcast(merged)

    def _broadcast(self, merged: Any):
        src = self._peer(self.num_stages - 1)
        if self.rank == self.num_stages - 1:
            leaves, _ = tree_flatten(merged)
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            for t, meta in zip(tensors, self.output_meta):
                if tuple(t.shape) != meta.shape:
                    raise AssertionError(f"merged output has shape {tuple(t.shape)}, expected {meta.shape}: a bug in fxpipe")
                dist.broadcast(_to_wire(t), src=src, group=self.group)
            return merged
        received = []
        for meta in self.output_meta:
            buf = torch.empty(meta.shape, dtype=_wire_dtype(meta.dtype), device=self.device)
            dist.broadcast(buf, src=src, group=self.group)
            received.append(_from_wire(buf, meta.dtype))
        return self.staged.interface.output(received)


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """gloo moves no ``bool`` tensors: they travel as ``uint8``."""
    return torch.uint8 if dtype == torch.bool else dtype


def _to_wire(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _from_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(torch.bool) if dtype == torch.bool else t
