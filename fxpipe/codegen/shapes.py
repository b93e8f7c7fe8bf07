"""Static shape inference for pipeline stages: what crosses each boundary, and what split backward misses.

``PipelineStage`` needs, for its rank only, example input and output tensors with the right
shapes, dtypes and ``requires_grad`` (so it can allocate receive buffers without a metadata
exchange). :func:`stage_io` propagates one micro-batch through the stages before it on fake
tensors - no data, no compute, no activation memory - with every parameter, buffer and constant
of those stages replaced by a fake copy (``torch.func.functional_call``): shape inference never
touches real state, in particular never advances BatchNorm running statistics or
``num_batches_tracked``. When a graph cannot run on fake tensors (data-dependent output shapes)
it runs for real on *clones* of the state, with the same guarantee.

Shape inference is device-agnostic: the example inputs, parameters and buffers may live on
different devices (a model built on ``meta`` whose rank materializes only its own stages, after
shape inference, with example inputs on CPU). Every tensor becomes a fake tensor on one device
(the inputs' device, else CPU) under one ``FakeTensorMode``, and a graph captured on meta, whose
``_assert_tensor_metadata`` checks and factory calls name the meta device, runs as if they named
that device (as :func:`fxpipe.codegen.materialize.retarget_meta_devices` will make them for the
rank's own stages). A meta model whose graph cannot run on fake tensors runs on meta copies.

It also finds the parameters whose gradient torch's split backward (I then W) would silently
drop: on a stage other than the first, ``stage_backward_input`` only keeps the autograd nodes
where a parameter's path meets a path from a grad-requiring stage input, and W back-propagates
from those nodes only. A gradient path from a stage output to a parameter that meets no input
path (a decoder embedding of token ids received from the previous stage; T5's relative position
bias, computed from positions and sent on to the next stage) is lost. Such stages must run full
backwards (:func:`fxpipe.codegen.rank.build_rank` does so).

The fake-tensor mode and the autograd-graph walks come from :mod:`fxpipe.codegen.runtime`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.func import functional_call

from fxpipe.codegen.runtime import (
    construct_reverse_graph,
    fake_on,
    fake_tensor_mode,
    grad_fn_or_grad_acc,
    meta_literals_as,
    reverse_closure,
)
from fxpipe.codegen.split import StagedProgram
from fxpipe.errors import InputError

__all__ = ["StageIO", "stage_io"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageIO:
    """Example inputs/outputs of one stage for one micro-batch.

    Attributes
    ----------
    inputs, outputs : tuple[torch.Tensor, ...]
        Zero tensors (contiguous, on CPU) with the stage's input / output shapes, dtypes and
        ``requires_grad``.
    blind_params : tuple[str, ...]
        Canonical FQNs of the parameters whose gradient split backward would drop (sorted).
    static : bool
        True when inferred on fake tensors, False when the prefix had to run for real.
    """

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    blind_params: tuple[str, ...]
    static: bool


def _state_names(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the stage module holds (parameters, buffers; tied names listed once each)."""
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


def _copied_state(module: torch.nn.Module, copy: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Name -> copy of every state tensor (a leaf with the original's ``requires_grad``), tied
    names sharing one copy."""
    memo: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in _state_names(module).items():
        if id(t) not in memo:
            memo[id(t)] = copy(t).detach().requires_grad_(t.requires_grad)
        out[name] = memo[id(t)]
    return out


def _leaf_like(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t


def _propagate(staged: StagedProgram, stage: int, flat_inputs: Sequence[Any], copy: Callable):
    """Run stages ``0..stage`` on ``flat_inputs`` with copied state; returns
    ``(stage inputs, stage outputs, blind parameter names)``."""
    spec = staged.stages[stage]
    with torch.enable_grad():
        x = tuple(flat_inputs)
        for prev in staged.stages[:stage]:
            out = functional_call(prev.module, _copied_state(prev.module, copy), x)
            x = tuple(_leaf_like(t) for t in (out if isinstance(out, tuple) else (out,)))
        state = _copied_state(spec.module, copy)
        out = functional_call(spec.module, state, x)
        outs = out if isinstance(out, tuple) else (out,)
        blind: list[str] = []
        if stage > 0:
            roots = {grad_fn_or_grad_acc(t) for t in outs if isinstance(t, torch.Tensor) and t.requires_grad} - {None}
            in_fns = [grad_fn_or_grad_acc(t) for t in x if isinstance(t, torch.Tensor) and t.requires_grad]
            rev = construct_reverse_graph(list(roots))
            in_closure, _ = reverse_closure([f for f in in_fns if f is not None], set(), rev)
            for fqn, target in spec.param_targets.items():
                p = state[target]
                if not p.requires_grad:
                    continue
                fn = grad_fn_or_grad_acc(p)
                if fn is None or (fn not in rev and fn not in roots):
                    continue  # the parameter does not reach the outputs
                # nodes reachable from the parameter before meeting an input path: if an output
                # is among them, part of the gradient bypasses every I/W intermediate
                closure, _ = reverse_closure([fn], in_closure, rev)
                if closure & roots:
                    blind.append(fqn)
            blind.sort()
    return x, outs, tuple(blind)


def _zeros_like_meta(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    z = torch.zeros(tuple(int(d) for d in t.shape), dtype=t.dtype)
    return z.requires_grad_(True) if t.requires_grad else z


def _inference_device(staged: StagedProgram, stage: int, flat_inputs: Sequence[Any], device) -> torch.device:
    """The one device shape inference simulates: ``device`` if given, else the first non-meta
    device of the example inputs, else CPU (parameters and buffers may be anywhere, ``meta``
    included: they are re-homed on this device as fake tensors)."""
    if device is not None:
        return torch.device(device)
    for t in flat_inputs:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _holds_meta(staged: StagedProgram, stage: int, flat_inputs: Sequence[Any]) -> bool:
    tensors = [t for spec in staged.stages[: stage + 1] for t in _state_names(spec.module).values()]
    tensors += [t for t in flat_inputs if isinstance(t, torch.Tensor)]
    return any(t.device.type == "meta" for t in tensors)


def _meta_literals(staged: StagedProgram, stage: int) -> bool:
    """Whether the graphs of stages ``0..stage`` name the ``meta`` device (a capture on meta)."""
    def named(a) -> bool:
        if isinstance(a, torch.device):
            return a.type == "meta"
        if isinstance(a, str):
            return a == "meta"
        if isinstance(a, (list, tuple)):
            return any(named(x) for x in a)
        if isinstance(a, dict):
            return any(named(x) for x in a.values())
        return False

    return any(named(n.args) or named(n.kwargs) for spec in staged.stages[: stage + 1] for n in spec.module.graph.nodes
               if n.op == "call_function")


def stage_io(staged: StagedProgram, stage: int, flat_inputs: Sequence[Any], *, fake: bool = True,
             device: str | torch.device | None = None) -> StageIO:
    """Example inputs/outputs of ``stage`` and its split-backward-blind parameters.

    Parameters
    ----------
    staged : StagedProgram
        Its parameters and buffers may live on any device, ``meta`` included (a model built on
        meta whose ranks materialize only their stages).
    stage : int
        Stage index.
    flat_inputs : sequence of tensors
        One micro-batch of stage 0's inputs (``staged.interface.flatten_inputs(...)``), on any
        device (``meta`` included).
    fake : bool
        Propagate on fake tensors (the default). Every input, parameter and buffer becomes a fake
        tensor on one device (``device``) under one ``FakeTensorMode``, so where the weights live
        does not matter. When the graph cannot run on fake tensors (data-dependent output shapes)
        it runs for real on cloned state; when that state (or an input) is on ``meta``, for real
        on ``meta`` copies of everything. ``False`` always runs for real.
    device : str or torch.device, optional
        The device fake propagation simulates (default: the first non-meta device of
        ``flat_inputs``, else CPU).

    Returns
    -------
    StageIO
        Never mutates the real parameters or buffers of any stage.

    Raises
    ------
    InputError
        When the stage's state or inputs are on ``meta`` and neither fake nor meta propagation
        can run the stages up to ``stage`` (the message says why and what to do).
    """
    target = _inference_device(staged, stage, flat_inputs, device)
    fake_exc: Exception | None = None
    if fake:
        retarget = contextlib.nullcontext()
        if target.type != "meta" and _meta_literals(staged, stage):
            retarget = meta_literals_as(target)
        try:
            with fake_tensor_mode() as mode, retarget:
                def to_fake(t):
                    return fake_on(mode, t, target)

                fake_in = tuple(to_fake(t).detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                                for t in flat_inputs)
                ins, outs, blind = _propagate(staged, stage, fake_in, to_fake)
                meta_in = [(tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else t for t in ins]
                meta_out = [(tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else t for t in outs]
            return StageIO(tuple(_from_meta(m) for m in meta_in), tuple(_from_meta(m) for m in meta_out), blind, True)
        except Exception as exc:  # noqa: BLE001 - any failure of fake propagation: compute for real
            fake_exc = exc
            logger.info("stage %d: fake-tensor shape inference on %s failed (%s); running the prefix for real on copies",
                        stage, target, exc)
    on_meta = _holds_meta(staged, stage, flat_inputs)
    if on_meta:
        # real state does not exist: run on meta copies of everything (no data, no compute)
        def copy(t):
            return t.detach().to("meta")
    else:
        def copy(t):
            return t.detach().clone()
    try:
        with torch.random.fork_rng(devices=[]):
            real_in = tuple(copy(t).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in flat_inputs)
            ins, outs, blind = _propagate(staged, stage, real_in, copy)
    except Exception as exc:
        if not on_meta:
            raise

        raise InputError(
            f"shape inference of stage {stage} failed: the model's weights are on meta and stages 0..{stage} run "
            f"neither on fake tensors ({type(fake_exc).__name__}: {fake_exc}) nor on meta tensors ({exc}). An op whose output size depends on "
            "data (nonzero, masked_select, unique) cannot run without data: build such a model on a real device "
            "(meta builds do not support it yet)"
        ) from exc
    return StageIO(tuple(_zeros_like_meta(t) for t in ins), tuple(_zeros_like_meta(t) for t in outs), blind, False)


def _from_meta(m: Any) -> Any:
    if not isinstance(m, tuple):
        return m
    shape, dtype, rg = m
    z = torch.zeros(shape, dtype=dtype)
    return z.requires_grad_(True) if rg else z
