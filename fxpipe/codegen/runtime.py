"""The one module of fxpipe that uses private torch APIs, and the schedule runtime built on them.

House rule (checked by ``tests/test_capture.py::test_private_torch_apis_only_in_codegen_runtime``):
everything torch-version specific lives here, behind small adapters that the rest of
:mod:`fxpipe.codegen` calls:

* pytrees (``torch.utils._pytree``, which knows Hugging Face ``ModelOutput`` and every type
  registered with torch): :func:`tree_flatten`, :func:`tree_unflatten`, :func:`graph_pytree_specs`;
* op schemas (``OpOverload._schema``): :func:`op_aliasing`;
* fake tensors (``torch._subclasses.fake_tensor``): :func:`fake_tensor_mode`, :func:`fake_on`,
  :func:`meta_literals_as` (a ``TorchDispatchMode``);
* autograd-graph walks of ``torch.distributed.pipelining._backward``: :func:`grad_fn_or_grad_acc`,
  :func:`construct_reverse_graph`, :func:`reverse_closure`;
* DTensor's local tensor and spec (``DTensor._local_tensor``, ``DTensor._spec``, its constructor):
  :func:`dtensor_local`, :func:`dtensor_spec`, :func:`dtensor_from_local` (the activation stash keeps a
  DTensor activation as its local shard, :mod:`fxpipe.codegen.stash`);
* torch's action type ``_Action``: :func:`torch_action`, the one conversion of a lowered
  :class:`fxpipe.ir.Action` (no text in between);
* the stage and schedule runtime (``PipelineStage`` internals, ``_PipelineScheduleRuntime``):
  :class:`FxpipePipelineStage` (split backward with disjoint parameter groups,
  :func:`merge_param_groups`) and :class:`FxpipeScheduleRuntime`.

:class:`FxpipeScheduleRuntime` runs per-rank compute actions (typed :class:`fxpipe.ir.Action` s
lowered from :class:`fxpipe.ir.Orders` by :func:`fxpipe.codegen.actions.lower_orders`, or
torch's strings ``"0F1"``, ``"1I0"``, ``"1W0"``, ``"2B3"``) with torch's runtime, which adds the SEND/RECV actions, for one or several stages per rank (the placement's
stage-to-rank map). On top of torch it (1) takes the model's own inputs - any pytree,
positional and keyword - on the rank of the first stage and splits them into micro-batches by
:mod:`fxpipe.codegen.interface`'s rule, (2) gives ``loss_fn`` each micro-batch's output in the
structure the model returns, (3) merges outputs by that structure, and (4) sums the gradients of
parameters held by stages on several ranks (tied weights) after each step. Gradient scaling
matches torch's schedules: ``loss_fn`` is applied to every micro-batch's output, gradients are
summed and divided by the number of micro-batches (as ``scale_grads=True``; done once per
parameter of the rank, see :class:`FxpipeScheduleRuntime`), i.e. the gradient of the mean
micro-batch loss.

Activation stash: a stage with ``fxpipe_stash`` set (:class:`~fxpipe.codegen.stash.DeviceStash`)
runs its forward under that stash's saved-tensor hooks, reports every compute action to it (so the
device's offload/reload actions are issued where the schedule puts them,
:mod:`fxpipe.codegen.offload`) and releases a micro-batch's stash when its last backward ends.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as _pytree
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph as _construct_reverse_graph,
    reverse_closure as _reverse_closure,
    stage_backward,
    stage_backward_weight as _stage_backward_weight,
)
from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

from fxpipe.codegen.actions import parse_actions
from fxpipe.codegen.faults import action_failure, root_cause
from fxpipe.errors import InputError, TrainingError, WorkerError
from fxpipe.ir.schedule import FULL_BACKWARD, Action
from fxpipe.ir.torch_csv import TORCH_TYPE

__all__ = [
    "tree_flatten",
    "tree_unflatten",
    "spec_str",
    "spec_children_contexts",
    "graph_pytree_specs",
    "OpAliasing",
    "op_aliasing",
    "shares_storage",
    "fake_tensor_mode",
    "fake_on",
    "meta_literals_as",
    "grad_fn_or_grad_acc",
    "current_autograd_node",
    "dtensor_local",
    "dtensor_spec",
    "dtensor_from_local",
    "op_interceptor",
    "construct_reverse_graph",
    "reverse_closure",
    "torch_action",
    "parse_torch_actions",
    "merge_param_groups",
    "own_weight_grads",
    "FxpipePipelineStage",
    "FxpipeScheduleRuntime",
    "local_tensor",
    "replicate_module",
    "fsdp_offload_policy",
    "forward_without_dp_hooks",
    "dp_unshard_fn",
    "mark_block_units",
    "UnshardedProbe",
    "block_unit_backward",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- pytrees
def tree_flatten(tree: Any) -> tuple[list, Any]:
    """Leaves and spec of a pytree (``None`` is a leaf, as in torch.export's input specs)."""
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: Sequence[Any], spec: Any) -> Any:
    """Inverse of :func:`tree_flatten`."""
    return _pytree.tree_unflatten(list(leaves), spec)


def spec_str(spec: Any) -> str:
    """A one-line readable form of a tree spec (``((*, {'a': [*, *]}), {'k': *})``)."""
    try:
        return _pytree.treespec_pprint(spec)
    except Exception:  # noqa: BLE001 - printing must never fail
        return str(spec)


def spec_children_contexts(in_spec: Any) -> list | None:
    """Keyword names, in captured order, of an ``(args, kwargs)`` input spec (None if not that shape)."""
    try:
        if in_spec.type is not tuple or in_spec.num_children != 2:
            return None
        kw = in_spec.child(1)
        return list(kw.context) if kw.type is dict else None
    except AttributeError:
        return None


def graph_pytree_specs(gm: torch.fx.GraphModule) -> tuple[Any, Any]:
    """``(in_spec, out_spec)`` recorded by ``torch.export`` on an unlifted module, or ``(None, None)``."""
    info = getattr(getattr(gm.graph, "_codegen", None), "pytree_info", None)
    if info is None:
        return None, None
    return info.in_spec, info.out_spec


# ----------------------------------------------------------------------------- op schemas
@dataclass(frozen=True)
class OpAliasing:
    """What an operator's schema says about aliasing (plain data).

    Attributes
    ----------
    arguments : tuple[tuple[str, bool, frozenset, Any], ...]
        Per schema argument: name, written (``Tensor(a!)``), alias set (``{'a'}``), default
        value (None when there is none).
    return_alias_sets : frozenset
        Alias sets the outputs share with arguments (views, in-place results).
    returns_alias_list : bool
        The op returns a list of views (``split``, ``unbind``, ``chunk``).
    maybe_mutating : bool
        Tagged ``maybe_aliasing_or_mutating``: composite ops whose schema does not tell all
        (``aten.batch_norm`` updates running statistics).
    nondeterministic : bool
        Tagged ``nondeterministic_seeded`` (draws random numbers).
    """

    arguments: tuple[tuple[str, bool, frozenset, Any], ...]
    return_alias_sets: frozenset
    returns_alias_list: bool
    maybe_mutating: bool
    nondeterministic: bool


@functools.lru_cache(maxsize=4096)
def op_aliasing(target: Any) -> OpAliasing | None:
    """The :class:`OpAliasing` of an ``OpOverload`` target, None for anything else."""
    schema = getattr(target, "_schema", None)
    if not isinstance(target, torch._ops.OpOverload) or schema is None:
        return None
    args = []
    for a in schema.arguments:
        info = a.alias_info
        default = a.default_value if a.has_default_value() else None
        args.append((a.name, bool(info is not None and info.is_write),
                     frozenset(info.before_set) if info else frozenset(), default))
    ret_sets: set[str] = set()
    alias_list = False
    for r in schema.returns:
        if r.alias_info is not None:
            ret_sets |= set(r.alias_info.before_set)
            alias_list = alias_list or str(r.type).endswith("[]")
    tags = set(getattr(target, "tags", ()))
    return OpAliasing(
        arguments=tuple(args),
        return_alias_sets=frozenset(ret_sets),
        returns_alias_list=alias_list,
        maybe_mutating=torch.Tag.maybe_aliasing_or_mutating in tags,
        nondeterministic=torch.Tag.nondeterministic_seeded in tags,
    )


def shares_storage(a: Any, b: Any) -> bool | None:
    """Whether tensors ``a`` and ``b`` (real or the fake values a capture records in ``node.meta["val"]``)
    live in one storage; None when either is not a tensor with a storage."""
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


# ----------------------------------------------------------------------------- fake tensors
def fake_tensor_mode():
    """A fresh ``FakeTensorMode`` (shapes, dtypes and autograd metadata without data or compute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _retarget_device(a, device: torch.device):
    if isinstance(a, torch.device) and a.type == "meta":
        return device
    if isinstance(a, str) and a == "meta":
        return str(device)
    if isinstance(a, (list, tuple)):
        return type(a)(_retarget_device(x, device) for x in a)
    if isinstance(a, dict):
        return {k: _retarget_device(v, device) for k, v in a.items()}
    return a


def meta_literals_as(device: str | torch.device):
    """A dispatch mode that runs every op as if its ``meta`` device arguments said ``device``.

    A graph captured on ``meta`` carries ``device=meta`` in ``_assert_tensor_metadata`` checks
    and factory calls; :func:`fxpipe.codegen.materialize.retarget_meta_devices` rewrites them to
    the run device when a rank materializes its stage. Shape inference runs the stages before
    (which stay on meta on this rank) under this mode, so it sees the program as it will run,
    without editing any graph. Enter it inside the ``FakeTensorMode``.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    dev = torch.device(device)

    class _MetaLiteralsAs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*_retarget_device(tuple(args), dev), **_retarget_device(dict(kwargs or {}), dev))

    return _MetaLiteralsAs()


def fake_on(mode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor of ``mode`` with ``t``'s shape, strides and dtype on ``device`` (a detached leaf).

    ``mode.from_tensor`` keeps ``t``'s device, so a model whose parameters are on ``meta`` and
    whose example inputs are on CPU would propagate tensors of two devices and fail on the first op
    that mixes them (``addmm``). Re-homing every tensor on one device makes shape inference
    independent of where the weights live. A tensor already on ``device`` goes through
    ``from_tensor`` (which keeps the constants of small CPU tensors).
    """
    if t.device == device:
        return mode.from_tensor(t)
    with mode:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)


# ----------------------------------------------------------------------------- autograd graph
def grad_fn_or_grad_acc(t: torch.Tensor):
    """The autograd node of ``t`` (its ``grad_fn``, or the gradient accumulator of a leaf)."""
    return _get_grad_fn_or_grad_acc(t)


def construct_reverse_graph(roots: list) -> dict:
    """Autograd node -> nodes that consume its output, for the graph under ``roots``."""
    return _construct_reverse_graph(roots)


def reverse_closure(roots: list, targets: set, reverse_edges: dict) -> tuple[set, set]:
    """Nodes reachable from ``roots`` along reverse edges, stopping at ``targets`` (see torch's ``_backward``)."""
    return _reverse_closure(roots, targets, reverse_edges)


def current_autograd_node():
    """The autograd node whose backward is running on this thread (None outside a backward).

    Read by a saved tensor's unpack hook, it names the node that reads the tensor
    (:mod:`fxpipe.codegen.stash`: which replayed tensors a split backward's ``W`` reads again).
    """
    return torch._C._current_autograd_node()


def dtensor_local(t: Any) -> torch.Tensor | None:
    """The local shard of a ``DTensor`` (the very tensor it wraps, sharing its storage); None for anything else.

    An ``AsyncCollectiveTensor`` local (a functional collective's pending result) is waited for
    first and its plain result returned. The activation stash (:mod:`fxpipe.codegen.stash`) counts,
    offloads and replays DTensor activations through their local shards: under tensor
    parallelism autograd saves the DTensor wrappers, whose storage is their local tensor's.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    local = t._local_tensor
    wait = getattr(local, "trigger_wait", None)  # torch.distributed._functional_collectives.AsyncCollectiveTensor
    return wait() if callable(wait) else local


def dtensor_spec(t: Any) -> Any:
    """The layout of a ``DTensor`` (mesh, placements, global shape and stride; no data): what
    :func:`dtensor_from_local` needs to wrap a local shard again. None for anything else."""
    from torch.distributed.tensor import DTensor

    return t._spec if isinstance(t, DTensor) else None


def dtensor_from_local(local: torch.Tensor, spec: Any) -> torch.Tensor:
    """The ``DTensor`` of layout ``spec`` (:func:`dtensor_spec`) over ``local``, without autograd history and
    without communication (what a saved DTensor was, rebuilt by the stash's unpack hook)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


def op_interceptor(fn: Callable[[Any, tuple, dict], Any]):
    """A dispatch mode that hands every ATen op to ``fn(func, args, kwargs)`` (which runs it, or not).

    ``torch.utils._python_dispatch.TorchDispatchMode``: it sees the ops below autograd (after
    composite ops are decomposed), so ``fn`` can return a result kept from an earlier run
    instead of computing it (:mod:`fxpipe.codegen.checkpointing`: the kept outputs of a
    selective activation-checkpoint policy). Inside ``fn`` the mode is off.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Intercept(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return fn(func, args, kwargs or {})

    return _Intercept()


# ----------------------------------------------------------------------------- actions
def torch_action(a: Action) -> _Action:
    """torch's ``_Action`` of a lowered compute action: THE conversion to torch's action type.

    fxpipe's F, B (backward-input), W and BW (full backward) become torch's F, I, W and B
    (:data:`fxpipe.ir.torch_csv.TORCH_TYPE`).

    Raises
    ------
    InputError
        For an offload / reload (O, R): they are not torch compute actions (lowering keeps
        them out, :func:`fxpipe.ir.lowering.compute_only`).
    """
    if a.type not in TORCH_TYPE:
        raise InputError(f"{a} is not a compute action torch runs (F, B, W or BW); lower the orders first")
    return _Action(a.stage, _ComputationType.from_str(TORCH_TYPE[a.type]), a.microbatch)


def parse_torch_actions(actions: Mapping[int, Sequence[Action | str]], device_of_stage: Sequence[int]) -> dict[int, list[_Action]]:
    """Check per-rank compute actions and convert them to torch ``_Action`` s; ``""`` (idle) is skipped.

    Parameters
    ----------
    actions : Mapping[int, Sequence[Action | str]]
        Per-rank lowered actions (:func:`fxpipe.codegen.actions.lower_orders`) or torch action
        strings (:func:`fxpipe.codegen.actions.actions_from_orders`).
    device_of_stage : sequence of int
        Rank of every stage (the placement); every action must be on its stage's rank.

    Raises
    ------
    InputError
        Naming rank and step for an action that is not a string, does not parse, is not a
        compute action, names a stage outside the placement or runs on another rank than its
        stage's.
    """
    dev = [int(d) for d in device_of_stage]
    typed = parse_actions({r: actions[r] for r in sorted(actions)})
    parsed: dict[int, list[_Action]] = {}
    for r, acts in typed.items():
        for act in acts:
            where = f"rank {r}"
            if act.type not in TORCH_TYPE:
                raise InputError(f"{where}: {act} is an offload/reload action; torch's runtime runs compute actions only")
            if not 0 <= act.stage < len(dev):
                raise InputError(f"{where}: action {act!s} names a stage outside 0..{len(dev) - 1}")
            if dev[act.stage] != int(r):
                raise InputError(
                    f"{where}: action {act!s} is for stage {act.stage}, which the placement puts on rank {dev[act.stage]}"
                )
        parsed[int(r)] = [torch_action(a) for a in acts]
    return parsed


def merge_param_groups(groups: list[dict]) -> list[dict]:
    """Make the parameter groups of torch's split backward disjoint.

    ``stage_backward_input`` (torch 2.13) groups parameters by the autograd nodes where their
    gradient paths meet the stage inputs' paths ("intermediates") and records the gradient
    reaching each intermediate; ``stage_backward_weight`` then back-propagates each group
    separately. Its grouping merges a parameter into the group of only the *last* shared
    intermediate it meets, so when parameters share intermediates transitively (weights used in
    several places: ALBERT's shared layers, T5's shared relative position bias) two groups keep
    the same intermediates and parameters: the W pass then runs the same autograd nodes twice
    ("Trying to backward through the graph a second time") or counts gradients twice. This
    post-processing is a union-find over groups sharing a parameter or an intermediate; each
    intermediate keeps its one recorded gradient. Intermediates the backward-input pass never
    reached (no recorded gradient) carry no gradient and are dropped.

    Parameters
    ----------
    groups : list of dict
        torch's groups: ``params`` (set of gradient accumulators), ``intermediates`` (list of
        autograd nodes), ``grads`` (list aligned with ``intermediates``; may be missing).

    Returns
    -------
    list of dict
        Disjoint groups in the same format.
    """
    parent = list(range(len(groups)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Any, int] = {}
    for i, g in enumerate(groups):
        for key in list(g["params"]) + list(g["intermediates"]):
            j = owner.setdefault(key, i)
            if find(j) != find(i):
                parent[find(i)] = find(j)
    merged: dict[int, dict] = {}
    for i, g in enumerate(groups):
        root = merged.setdefault(find(i), {"params": set(), "intermediates": [], "grads": [], "_seen": set()})
        root["params"] |= set(g["params"])
        grads = g.get("grads") or [None] * len(g["intermediates"])
        for node, grad in zip(g["intermediates"], grads):
            if grad is None or node in root["_seen"]:
                continue
            root["_seen"].add(node)
            root["intermediates"].append(node)
            root["grads"].append(grad)
    out = []
    for g in merged.values():
        del g["_seen"]
        if g["intermediates"]:
            out.append(g)
    return out


def recv_buffer_slots(actions: Sequence[_Action], stages: Sequence[int]) -> dict[int, dict[str, dict[int, int]]]:
    """Which receive buffer each micro-batch of each local stage uses, reusing buffers across micro-batches.

    torch's ``PipelineStage`` allocates one receive buffer per micro-batch for every tensor a
    stage receives forward (activations) and backward (gradients). A buffer is busy from the
    ``RECV_F`` / ``RECV_B`` that fills it until the compute that last reads it: the activation
    buffer is the stage input autograd saves, the gradient buffer the gradient of the stage output
    that a split backward's weight pass reads again (torch's backward-input keeps it among the
    intermediates' gradients): both until the micro-batch's weight gradient (``W``, or the full
    backward ``B``; ``F`` itself for a stage without backward). (The runtime pools only the
    activation buffers, and not on the last stage; see :class:`FxpipePipelineStage`.) Walking this rank's program in order (with
    torch's send/recv actions, :func:`torch.distributed.pipelining.schedules._add_send_recv`),
    each receive takes the lowest free slot, so a stage holds as many buffers as micro-batches
    it has in flight, not ``num_microbatches``.

    Parameters
    ----------
    actions : sequence of torch ``_Action``
        This rank's program with communication (``pipeline_order_with_comms[rank]``).
    stages : sequence of int
        This rank's stages.

    Returns
    -------
    dict
        ``{stage: {"fwd": {microbatch: slot}, "bwd": {microbatch: slot}}}``; a stage's number
        of buffers per received tensor is ``max(slot) + 1``.
    """
    C = _ComputationType
    has_bwd = {s: False for s in stages}
    for a in actions:
        if a.stage_index in has_bwd and a.computation_type in (C.FULL_BACKWARD, C.BACKWARD_INPUT):
            has_bwd[a.stage_index] = True
    out = {s: {"fwd": {}, "bwd": {}} for s in stages}
    busy = {(s, k): {} for s in stages for k in ("fwd", "bwd")}  # slot -> micro-batch

    def take(s: int, kind: str, mb: int) -> None:
        if mb in out[s][kind]:
            return
        used = busy[(s, kind)]
        slot = next(i for i in range(len(used) + 1) if i not in used)
        used[slot] = mb
        out[s][kind][mb] = slot

    def release(s: int, kind: str, mb: int) -> None:
        slot = out[s][kind].get(mb)
        if slot is not None and busy[(s, kind)].get(slot) == mb:
            del busy[(s, kind)][slot]

    for a in actions:
        s, mb, ct = a.stage_index, a.microbatch_index, a.computation_type
        if s not in out or mb is None:
            continue
        if ct == C.RECV_F:
            take(s, "fwd", mb)
        elif ct == C.RECV_B:
            take(s, "bwd", mb)
        elif ct == C.FORWARD and not has_bwd[s]:
            release(s, "fwd", mb)
        elif ct in (C.FULL_BACKWARD, C.BACKWARD_WEIGHT):
            release(s, "fwd", mb)
            release(s, "bwd", mb)
    return out


def _pool_recv_buffers(recv_info: dict, slots: Mapping[int, int] | None) -> int:
    """Point every micro-batch's receive buffers at its slot's (the first micro-batch of a slot keeps
    its own); returns the buffers per received tensor now in use (``len(recv_info)`` without slots)."""
    if not slots or any(mb not in slots for mb in recv_info):
        return len(recv_info)
    pool: dict[tuple[int, int], torch.Tensor] = {}
    for mb in sorted(recv_info):
        for i, info in enumerate(recv_info[mb]):
            buf = getattr(info, "buffer", None)
            if not isinstance(buf, torch.Tensor):
                continue
            key = (i, slots[mb])
            if key in pool and pool[key].shape == buf.shape and pool[key].dtype == buf.dtype:
                info.buffer = pool[key]
            else:
                pool[key] = buf
    return max(slots[mb] for mb in recv_info) + 1 if recv_info else 0


class FxpipePipelineStage(PipelineStage):
    """torch's ``PipelineStage`` with a split backward that holds for shared weights.

    * Backward-input: the parameter groups are made disjoint (:func:`merge_param_groups`).
    * Backward-weight: every group's ``autograd.grad`` keeps the graph (``retain_graph=True``).
      A group whose parameter is used in several places (ALBERT's layers, a weight tied across
      layers) has several intermediates, one downstream of another; back-propagating from the
      upstream one runs, and would free, the autograd nodes in between, which other groups still
      need ("Trying to backward through the graph a second time"). The recorded gradient of the
      downstream intermediate replaces what flows into it (torch's pre-hook), so results are
      exact; the saved tensors are released when the micro-batch's W state is dropped, right
      after this call, instead of node by node.
    """

    # ---- begin receive-buffer reuse (recv_buffer_slots): buffers per micro-batch in flight, not per micro-batch
    #: ``{"fwd": {mb: slot}, "bwd": {mb: slot}}`` set by the runtime from the rank's program, or None
    fxpipe_recv_slots = None
    #: buffers per received activation / gradient after pooling (set when the infra is prepared)
    fxpipe_recv_buffers: dict[str, int] | None = None

    def _prepare_forward_infra(self, num_microbatches, args, kwargs=None, has_backward=False):
        out = super()._prepare_forward_infra(num_microbatches, args, kwargs, has_backward=has_backward)
        # not on the last stage: its outputs are views of what it computed, and a leaf it received and
        # returns unchanged would be a view of a pooled buffer that later micro-batches overwrite
        # before step() merges the outputs
        slots = {} if self.is_last else (self.fxpipe_recv_slots or {})
        self.fxpipe_recv_buffers = dict(self.fxpipe_recv_buffers or {},
                                        fwd=0 if self.is_first else _pool_recv_buffers(self.args_recv_info, slots.get("fwd")))
        return out

    def _prepare_backward_infra(self, num_microbatches, loss_fn=None, target=None, received_grad_meta=None,
                                loss_kwargs=None):
        out = super()._prepare_backward_infra(num_microbatches, loss_fn=loss_fn, target=target,
                                              received_grad_meta=received_grad_meta, loss_kwargs=loss_kwargs)
        # gradient buffers are not pooled (yet): with them pooled, Mamba at 4 ranks under ZB-H2 trained to
        # wrong gradients (dt_proj.bias), cause not found; recv_buffer_slots computes their slots
        self.fxpipe_recv_buffers = dict(self.fxpipe_recv_buffers or {}, bwd=0 if self.is_last else len(self.grad_recv_info))
        return out

    def _retrieve_recv_activations(self, fwd_chunk_id):
        # a pooled buffer is the stage-input leaf of every micro-batch of its slot in turn: torch's split
        # backward-input accumulates into the leaf's .grad, so the previous micro-batch's must go
        for info in self.args_recv_info.get(fwd_chunk_id, ()):
            buf = getattr(info, "buffer", None)
            if isinstance(buf, torch.Tensor) and buf.grad is not None:
                buf.grad = None
        return super()._retrieve_recv_activations(fwd_chunk_id)

    # ---- end receive-buffer reuse

    # ---- begin activation stash hooks (fxpipe.codegen.stash: live saved bytes, offload/reload, recomputation)
    #: the rank's :class:`~fxpipe.codegen.stash.DeviceStash` (set by :func:`fxpipe.codegen.rank.build_rank`), or None
    fxpipe_stash = None
    _fxpipe_mb = -1
    _fxpipe_bmb = -1

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        self._fxpipe_mb = fwd_chunk_id
        with self._fxpipe_action("F", fwd_chunk_id):
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            if self.fxpipe_stash is not None:
                self.fxpipe_stash.after(Action(self.stage_index, "F", fwd_chunk_id))
        return out

    def forward_maybe_with_nosync(self, *args, **kwargs):
        stash = self.fxpipe_stash
        if stash is None or not torch.is_grad_enabled():
            return super().forward_maybe_with_nosync(*args, **kwargs)
        submod = self.submod

        def resident():  # read again inside the forward, where FSDP2 has put the unsharded parameters in place
            return list(submod.parameters()) + list(submod.buffers())

        return stash.forward(self.stage_index, self._fxpipe_mb, submod, args, kwargs, resident,
                             recompute_fn=forward_without_dp_hooks(submod))

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        with self._fxpipe_action("B" if full_backward else "I", bwd_chunk_id):
            stash = self.fxpipe_stash
            if stash is not None:
                stash.before_backward(self.stage_index, bwd_chunk_id)
            self._fxpipe_bmb = bwd_chunk_id
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
            if stash is not None:
                if full_backward:
                    stash.release(self.stage_index, bwd_chunk_id)
                else:
                    stash.end_backward_input(self.stage_index, bwd_chunk_id)
                stash.after(Action(self.stage_index, FULL_BACKWARD if full_backward else "B", bwd_chunk_id))

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        with self._fxpipe_action("W", bwd_chunk_id):
            if self.fxpipe_stash is not None:  # a W may replay too (a B that reached no stage input did no work)
                self.fxpipe_stash.before_backward(self.stage_index, bwd_chunk_id)
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if self.fxpipe_stash is not None:
                self.fxpipe_stash.release(self.stage_index, bwd_chunk_id)
                self.fxpipe_stash.after(Action(self.stage_index, "W", bwd_chunk_id))
    # ---- end activation stash hooks

    # ---- begin action progress and failures (fxpipe.codegen.faults; the launcher's heartbeat)
    #: called as ``fxpipe_on_action(action, running)`` when a compute action (torch's text, ``"1F0"``)
    #: starts (``running=True``) and ends; None: no one listens (set by fxpipe.codegen.launch for its ranks)
    fxpipe_on_action: Callable[[str, bool], None] | None = None

    @contextlib.contextmanager
    def _fxpipe_action(self, kind: str, mb: int):
        """Report the compute action ``<stage><kind><mb>`` to :attr:`fxpipe_on_action` and turn an
        exception inside it into a :class:`~fxpipe.errors.WorkerError` naming the rank, stage,
        micro-batch, action, root cause and the model's source line (:func:`fxpipe.codegen.faults.action_failure`)."""
        action = f"{self.stage_index}{kind}{mb}"
        beat = self.fxpipe_on_action
        if beat is not None:
            beat(action, True)
        try:
            yield
        except WorkerError:  # an inner action's (a recomputation inside a backward) already names it
            raise
        except Exception as exc:
            rank = dist.get_rank() if dist.is_initialized() else getattr(self, "group_rank", None)
            raise action_failure(exc, rank=rank, action=action, module=self.submod if kind == "F" else None) \
                from root_cause(exc)
        if beat is not None:
            beat(action, False)
    # ---- end action progress and failures

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type == "weight":
            params = list(self.submod.parameters())
            before = [p.grad for p in params]
            recorded = _recorded_grad_storages(bwd_kwargs["param_groups"])
            out = _stage_backward_weight(params, bwd_kwargs["param_groups"], retain_graph=True)
            own_weight_grads(params, before, recorded)
            return out, None
        if backward_type == "full" and getattr(self.submod, "fxpipe_fsdp_blocks", ()):  # per-block FSDP2 units
            return block_unit_backward(self.submod, bwd_kwargs)
        stash = self.fxpipe_stash
        scope = contextlib.nullcontext()
        if stash is not None and backward_type == "input":  # activation checkpointing: keep only what W reads again
            scope = stash.backward_scope(self.stage_index, self._fxpipe_bmb, bwd_kwargs.get("input_values"))
        with scope:
            grads, param_groups = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type == "input" and param_groups:
            param_groups = merge_param_groups(param_groups)
        return grads, param_groups


def _recorded_grad_storages(groups) -> set[int]:
    """Storage addresses of the gradients torch's backward-input recorded for the W pass."""
    out = set()
    for g in groups or ():
        for grads in g.get("grads") or ():
            for t in grads if isinstance(grads, (tuple, list)) else (grads,):
                if isinstance(t, torch.Tensor):
                    out.add(local_tensor(t).untyped_storage().data_ptr())  # a DTensor's: its local shard's
    return out


def own_weight_grads(params: Sequence[torch.Tensor], before: Sequence[torch.Tensor | None],
                     recorded: set[int] = frozenset()) -> None:
    """Give every parameter whose ``.grad`` the backward-weight pass just set a gradient of its own.

    torch's ``stage_backward_weight`` (torch 2.13) stores the first gradient of a parameter as
    ``weight.grad = dw`` and adds later ones in place. Autograd's own accumulation
    (``AccumulateGrad``) only keeps ``dw`` when nothing else refers to it and its strides are the
    parameter's, else it copies. Kept as is, ``dw`` can be a view of another tensor: MobileBERT's
    MLM decoder uses the word embedding as ``cat([decoder.weight.t(), dense.weight])``, so the
    embedding's gradient is a transposed slice of the ``cat`` gradient. Such a gradient then reached
    the all-reduce of tied parameters (:meth:`FxpipeScheduleRuntime.sync_shared_grads`) as a
    non-contiguous view, and the copies of the tie ended the step with different, wrong gradients
    (issue 30 item 12); a gradient that is a recorded output gradient of the stage (a bias gradient
    equal to its input) would be overwritten with the next micro-batch's. Such gradients are copied
    into a tensor with the parameter's strides, as ``AccumulateGrad`` does.

    Parameters
    ----------
    params : sequence of Tensor
        The stage's parameters.
    before : sequence of Tensor or None
        Their ``.grad`` before the pass (same order).
    recorded : set of int
        Storage addresses of the gradients the backward-input pass recorded (the W pass's inputs).
    """
    from torch.distributed.tensor import DTensor

    for p, g0 in zip(params, before):
        g = p.grad
        if g is None or g is g0 or g0 is not None:
            continue  # unchanged, or accumulated in place into a gradient that was already the parameter's
        gl, pl = local_tensor(g), local_tensor(p)  # a DTensor gradient (tensor parallelism): its local shard
        if gl._base is not None or gl.stride() != pl.stride() or gl.untyped_storage().data_ptr() in recorded:
            # the parameter's strides; a DTensor gradient of other placements (a partial sum) keeps its own shape
            own = torch.empty_strided(pl.shape, pl.stride(), dtype=gl.dtype, device=gl.device) \
                if gl.shape == pl.shape else torch.empty(gl.shape, dtype=gl.dtype, device=gl.device)
            own.copy_(gl)
            p.grad = own if not isinstance(g, DTensor) else \
                DTensor.from_local(own, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride())


class FxpipeScheduleRuntime(_PipelineScheduleRuntime):
    """torch's schedule runtime with the model's calling convention and tied-gradient sums.

    Runs any number of stages per rank (torch's ``_PipelineScheduleRuntime`` with the
    stage-to-rank map of the loaded actions): looped, V-shape or any placement whose per-rank
    programs torch's send/recv lowering accepts. Adjacent stages on one rank pass tensors
    locally (torch's "V-schedule special case").

    Parameters
    ----------
    stages : list[PipelineStage]
        This rank's stages, in increasing stage order.
    n_microbatches : int
        Micro-batches per step.
    loss_fn : callable(output, target) -> scalar tensor, or None
        ``output`` is one micro-batch's model output in the model's own structure.
    interface : fxpipe.codegen.interface.ModelInterface
        The model's pytree inputs/outputs (see :mod:`fxpipe.codegen.interface`).
    device_of_stage : sequence of int
        Rank of every stage of the pipeline (the placement).
    shared_grads : sequence of (Parameter, ProcessGroup)
        Parameters held by stages on several ranks and the group of those ranks.

    Notes
    -----
    ``step(*args, target=None, losses=None, return_outputs=True, loss_kwargs=None, **kwargs)``:
    ``args``/``kwargs`` are the model's inputs for the whole batch (read on the rank of the
    first stage, ignored elsewhere, so every rank may run the same line); ``target`` is any
    pytree (read on the rank of the last stage). It returns, on the last stage's rank with
    ``return_outputs``, the merged outputs in the model's structure (:meth:`ModelInterface.merge`).

    Gradients: ``loss_fn`` is applied to every micro-batch's output and the step's gradient is
    that of the mean micro-batch loss, as torch's ``scale_grads=True``. The division by the
    number of micro-batches happens once per parameter after the step's last backward on this
    rank (torch's per-stage scaling would divide a parameter held by two stages of one rank -
    GPT-2's tied embedding on a V placement - twice, and possibly before the second stage's
    gradient arrived). Then the gradients of parameters held by stages on several ranks (tied
    weights) are all-reduced (sum) over those ranks, so each copy gets the full gradient and an
    optimizer keeps the copies equal, exactly as in single-process training; stages of one rank
    share one parameter object, so their contributions add up locally.
    """

    def __init__(self, stages, n_microbatches: int, *, loss_fn: Callable | None, interface, device_of_stage,
                 shared_grads=(), **kwargs):
        super().__init__(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False, **kwargs)
        self._interface = interface
        self._device_of_stage = tuple(int(d) for d in device_of_stage)
        self._shared_grads = list(shared_grads)
        self.fxpipe_actions: dict[int, list[str]] = {}
        self.fxpipe_fused_full_backward: dict[int, bool] = {s.stage_index: False for s in stages}
        #: callables run after the step's last backward, before the gradients are scaled and tied ones summed
        #: (tensor parallelism reduces partial-sum DTensor gradients there, fxpipe.codegen.tensor_parallel)
        self.fxpipe_before_grad_scaling: list[Callable[[], None]] = []
        #: training steps run so far (calls of :meth:`step` with a backward); numbers the steps in errors
        self.fxpipe_steps = 0

    # ------------------------------------------------------------------ this rank's view
    @property
    def stages(self) -> tuple:
        """This rank's stages, in increasing stage order."""
        return tuple(self._stages)

    @property
    def has_first_stage(self) -> bool:
        """This rank holds stage 0 (it reads the model's inputs)."""
        return any(s.is_first for s in self._stages)

    @property
    def has_last_stage(self) -> bool:
        """This rank holds the last stage (it reads the target and computes the loss)."""
        return any(s.is_last for s in self._stages)

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters of this rank's stages, each once (stages of a rank share tied ones)."""
        seen: set[int] = set()
        out = []
        for stage in self._stages:
            for p in stage.submod.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def load_actions(self, actions: Mapping[int, Sequence[Action | str]]) -> None:
        """Load every rank's lowered compute actions (then lowered with torch's send/recv pass).

        ``actions`` are :func:`fxpipe.codegen.actions.lower_orders`' typed actions, or torch
        action strings; :attr:`fxpipe_actions` keeps them in torch's text.

        Raises
        ------
        InputError
            For malformed actions, an action on another rank than its stage's, or a schedule
            torch rejects.
        """
        parsed = parse_torch_actions(actions, self._device_of_stage)
        self.pipeline_order = {r: list(v) for r, v in parsed.items()}
        self.fxpipe_actions = {r: [str(a) for a in v] for r, v in parsed.items()}
        try:
            self._prepare_schedule_with_comms({r: list(v) for r, v in parsed.items()})
        except (AssertionError, ValueError, RuntimeError) as exc:
            raise InputError(f"torch rejected the schedule on rank {self.rank}: {exc}") from None
        local = [st.stage_index for st in self._stages]
        slots = recv_buffer_slots(self.pipeline_order_with_comms.get(self.rank, []), local)
        for st in self._stages:
            st.fxpipe_recv_slots = slots[st.stage_index]
        mapping = {s: self.stage_index_to_group_rank[s] for s in range(self._num_stages)}
        if mapping != dict(enumerate(self._device_of_stage)):  # pragma: no cover - guarded by parse_torch_actions
            raise InputError(f"torch inferred the stage-to-rank map {mapping}, the placement is {list(self._device_of_stage)}")

    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, **kwargs):  # noqa: D401 - torch's step contract
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() computes gradients: do not call it under torch.no_grad(); use eval() instead")
        m = self._n_microbatches
        first = self.has_first_stage
        last = self.has_last_stage
        if first:
            arg_mbs = self._interface.call_microbatches(args, kwargs, m)
        else:
            arg_mbs = [()] * m
        target_mbs = None
        if last and self._loss_fn is not None and target is not None:
            target_mbs = self._interface.target_microbatches(target, m)
        elif last and self._has_backward and self._loss_fn is not None:
            raise InputError("the last rank computes loss_fn(output, target) for every micro-batch: pass target=")
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        stashes = {id(s.fxpipe_stash): s.fxpipe_stash for s in self._stages if s.fxpipe_stash is not None}.values()
        for stash in stashes:  # activation stash (fxpipe.codegen.stash): a fresh step
            stash.begin_step()
        self._step_microbatches(arg_mbs, [{}] * m, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        for stash in stashes:
            stash.end_step()
        if self._has_backward:
            self.fxpipe_steps += 1
            for hook in self.fxpipe_before_grad_scaling:
                hook()
            self.scale_local_grads()
            self.sync_shared_grads()
        if last and return_outputs:
            stage = next(s for s in self._stages if s.is_last)
            return self._interface.merge(stage.output_chunks)
        return None

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        if target_mbs is None:  # forward only (eval) without a target: no loss
            return
        super()._maybe_compute_loss(stage, output, target_mbs, mb_index, loss_kwargs)

    def _compute_loss(self, output, target, loss_kwargs=None):
        return self._loss_fn(self._interface.output(output), target, **(loss_kwargs or {}))

    def _update_losses(self, stages, losses):
        computed = list(self._internal_losses)
        super()._update_losses(stages, losses)
        if self._has_backward and computed:
            self.check_losses_finite(computed)

    def check_losses_finite(self, losses: Sequence[torch.Tensor]) -> None:
        """Stop a training step whose loss is not finite (called by :meth:`step` on the last stage's rank).

        One reduction and one host read per step, after the step's last backward (the gradients are
        then NaN or inf too, and :meth:`step` raises before the caller's ``optimizer.step()`` can
        write them into the weights).

        Parameters
        ----------
        losses : sequence of Tensor
            This step's micro-batch losses, in micro-batch order.

        Raises
        ------
        TrainingError
            "the loss is not finite at step s, stage k, micro-batch j", counting from 0.
        """
        with torch.no_grad():
            vals = torch.stack([torch.as_tensor(v).detach().float().reshape(-1).sum() for v in losses])
            ok = bool(torch.isfinite(vals).all())
        if ok:
            return
        bad = [j for j, v in enumerate(vals.tolist()) if not math.isfinite(v)]
        stage = next((st.stage_index for st in self._stages if st.is_last), self._num_stages - 1)
        more = f" (and micro-batch(es) {', '.join(map(str, bad[1:]))})" if len(bad) > 1 else ""
        raise TrainingError(
            f"the loss is not finite at step {self.fxpipe_steps}, stage {stage}, micro-batch {bad[0]}{more}: "
            f"{vals[bad[0]].item()} (steps and micro-batches counted from 0). The model's output or the loss is "
            "inf/NaN for that micro-batch's data; its gradients are too, so the step stops before the optimizer "
            "uses them: check the inputs of that micro-batch, the learning rate and the loss function")

    def scale_local_grads(self) -> None:
        """Divide the gradient of every parameter of this rank by the number of micro-batches, once.

        With data parallelism (stages wrapped by ``fully_shard`` / ``replicate``,
        :mod:`fxpipe.codegen.mesh`) this runs after torch's ``REDUCE_GRAD`` action averaged the
        summed micro-batch gradients over the replicas, so the result is the gradient of the mean
        loss over every micro-batch of every replica (the sharded gradient, a DTensor).
        """
        m = self._n_microbatches
        if m == 1:
            return
        for p in self.parameters():
            if p.grad is not None:
                p.grad.div_(m)

    def set_shared_grads(self, shared_grads) -> None:
        """Replace the tied-parameter entries: ``(Parameter or tuple of copies, ProcessGroup or None)``.

        A tuple lists copies of one tied parameter held by this rank's stages (data parallelism
        gives every stage its own copy, :mod:`fxpipe.codegen.mesh`): their gradients are summed,
        all-reduced over the group if any, and every copy gets the total.
        """
        self._shared_grads = list(shared_grads)

    def _all_reduce_sum(self, t: torch.Tensor, grp, op=None) -> None:
        """``all_reduce(t, SUM)`` (or ``op``) over ``grp`` in place; a host tensor of an accelerator
        rank (an FSDP2 gradient under optimizer offload) goes through the stages' device: NCCL
        reduces device tensors only; a non-contiguous tensor goes through a contiguous copy."""
        op = dist.ReduceOp.SUM if op is None else op
        dev = self._stages[0].device if self._stages else t.device
        if t.device.type == "cpu" and torch.device(dev).type != "cpu":
            buf = t.to(dev)
            dist.all_reduce(buf, op=op, group=grp)
            t.copy_(buf)
        elif not t.is_contiguous():
            buf = t.contiguous()
            dist.all_reduce(buf, op=op, group=grp)
            t.copy_(buf)
        else:
            dist.all_reduce(t, op=op, group=grp)

    def sync_shared_grads(self) -> None:
        """All-reduce (sum) the gradients of tied parameters over the ranks that hold them."""
        for entry, grp in self._shared_grads:
            copies = (entry,) if isinstance(entry, torch.Tensor) else tuple(entry)
            for p in copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            total = copies[0].grad
            if len(copies) > 1:
                total = total.clone()
                for p in copies[1:]:
                    total.add_(p.grad)
            # a sharded (FSDP2) parameter: every pipeline rank holding it shards it the same way over
            # its own data-parallel group, so the local shards of one replica line up
            if grp is not None:
                self._all_reduce_sum(local_tensor(total), grp)
                self._check_tied_agreement(copies[0], total, grp)
            if len(copies) > 1:
                for p in copies:
                    p.grad.copy_(total)

    #: relative spread (to the sum of magnitudes) above which tied copies are said to disagree
    TIED_AGREEMENT_RTOL = 1e-6

    def _check_tied_agreement(self, param: torch.Tensor, grad: torch.Tensor, grp) -> None:
        """Check that every rank of ``grp`` holds the same tied parameter and the same summed gradient.

        One all-reduce (max) of four numbers: the sum and the sum of magnitudes of this rank's
        parameter copy and of its gradient after the all-reduce, and their negatives (the max of the
        negatives is minus the min). Copies that agree give equal numbers up to the order of a float
        sum. Copies that drifted apart (an optimizer that misses one) or a gradient that went wrong
        on one rank make them differ.

        Raises
        ------
        TrainingError
            Naming the parameter, with the spread of each figure.
        """
        with torch.no_grad():
            p, g = local_tensor(param).detach(), local_tensor(grad).detach()
            sums = torch.stack([p.double().sum(), p.double().abs().sum(), g.double().sum(), g.double().abs().sum()])
            both = torch.cat([sums, -sums])
            self._all_reduce_sum(both, grp, op=dist.ReduceOp.MAX)
            spread = (both[:4] + both[4:]).tolist()
            scale = both[:4].abs().tolist()
        bad = [(what, s, sc) for what, s, sc in zip(("parameter sum", "parameter |sum|", "gradient sum", "gradient |sum|"),
                                                  spread, scale)
               if s > self.TIED_AGREEMENT_RTOL * max(scale[1] if what.startswith("parameter") else scale[3], 1e-30)]
        if bad:
            names = [f"{st.stage_index}:{n}" for st in self._stages for n, q in st.submod.named_parameters()
                     if q is param]
            ranks = dist.get_process_group_ranks(grp)
            detail = "; ".join(f"{what} spread {s:.3g} (of {sc:.3g})" for what, s, sc in bad)
            raise TrainingError(
                f"tied parameter {', '.join(names) or '?'} (stage:name): its copies on ranks {ranks} disagree after the "
                f"gradient all-reduce: {detail}. The copies of a tied parameter must get equal gradients and be "
                "updated by the same optimizer (build the optimizer over schedule.parameters() on every rank)")


# ---- begin data parallelism adapters (used by fxpipe/codegen/mesh.py)
def fsdp_offload_policy(module: torch.nn.Module):
    """The offload policy of an FSDP2 module (``fully_shard`` / ``replicate``): FSDP2's
    ``CPUOffloadPolicy`` (parameters, gradients and optimizer state on the host) or its
    ``OffloadPolicy`` (none); None for a module FSDP2 does not manage or one without parameters."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    groups = module._get_fsdp_state()._fsdp_param_groups
    return groups[0].offload_policy if groups else None


class _DoneUnshard:
    """The handle of an all-gather that is not issued (a block unit left to FSDP2's own hooks)."""

    def wait(self) -> None:
        return None


def mark_block_units(module: torch.nn.Module) -> None:
    """Let FSDP2 unshard the carved blocks of a stage module itself (per-block units, :mod:`fxpipe.codegen.fsdp_blocks`).

    torch's schedule runtime (``_PipelineScheduleRuntime``, ``UNSHARD`` action) all-gathers every FSDP2
    module inside a stage before its first compute and keeps it so until the step's ``RESHARD``: every
    block unsharded for the step, ZeRO-1's memory. Here a carved block's ``unshard`` called by that action
    issues nothing (an already completed handle): the block's own forward pre-hook all-gathers it (its
    backward pre-hook again), and it is resharded after its forward and after its backward, in which its
    gradients are reduce-scattered (:meth:`FxpipePipelineStage.backward_maybe_with_nosync`); the stage
    module (the root unit) is unsharded by the action as before. ``unshard`` on a block from anywhere
    else is not used by fxpipe.
    """
    from fxpipe.codegen.fsdp_blocks import block_modules

    for block in block_modules(module):
        block.unshard = lambda async_op=False: _DoneUnshard() if async_op else None  # noqa: B023 - no capture


class UnshardedProbe:
    """The most parameters of a stage's FSDP2 units held unsharded at once, sampled during training.

    Samples (the elements of every FSDP2 parameter whose unsharded copy has storage, each once) are
    taken when a unit's forward starts (after FSDP2's pre-forward all-gather, which runs first) and
    when autograd computes a gradient of an unsharded parameter (a unit's backward: it and the unit
    FSDP2 prefetched are unsharded). The per-block memory model (:func:`fxpipe.memory.fsdp.unsharded_params`)
    predicts at most the root's parameters and two blocks'; whole-stage units hold all of them.
    Reads FSDP2's private per-parameter state (``_get_fsdp_state``, ``fsdp_params``, ``_unsharded_param``).

    Attributes
    ----------
    peak_params : int
        Most unsharded parameter elements seen at one sample.
    samples : int
    """

    def __init__(self, module: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self.peak_params = 0
        self.samples = 0
        self._units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        self._hooked: set[int] = set()
        for unit in self._units:
            unit.register_forward_pre_hook(lambda *_: self._sample())

    def _params(self):
        for unit in self._units:
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                yield from group.fsdp_params

    def _sample(self) -> None:
        total, seen = 0, set()
        for fp in self._params():
            up = getattr(fp, "_unsharded_param", None)
            if up is None:
                continue
            if id(up) not in self._hooked and up.requires_grad:  # created at the first all-gather, kept after
                self._hooked.add(id(up))
                up.register_hook(lambda g: (self._sample(), g)[1])
            st = up.untyped_storage()
            if st.nbytes() > 0 and id(up) not in seen:
                seen.add(id(up))
                total += up.numel()
        self.samples += 1
        self.peak_params = max(self.peak_params, total)


def block_unit_backward(stage_module: torch.nn.Module, bwd_kwargs: dict):
    """One micro-batch's fused backward of a stage with per-block FSDP2 units: ``(input grads, None)``.

    torch's ``PipelineStage.backward_maybe_with_nosync`` turns off gradient sync and the reshard after
    backward on every FSDP2 module of a stage (sync once, in ``REDUCE_GRAD``): the blocks would keep
    unsharded parameters and gradients for the step. Here only the root unit (the stage module, its
    non-block parameters) defers its sync and stays unsharded, as torchtitan's root; every block
    reshards after its backward and reduce-scatters its gradients there, accumulating them in its
    sharded gradient over the micro-batches (Zhao et al., "PyTorch FSDP", VLDB 2023, Sec. 3.2). The
    step's ``REDUCE_GRAD`` then reduces the root and finalises every unit (a block's second
    ``post_backward`` finds no unsharded gradient and does nothing).
    """
    from fxpipe.codegen.fsdp_blocks import block_modules

    stage_module.set_is_last_backward(False)
    stage_module.set_reshard_after_backward(False, recurse=False)
    stage_module.set_requires_gradient_sync(False, recurse=False)
    for block in block_modules(stage_module):
        block.set_reshard_after_backward(True, recurse=False)
        block.set_requires_gradient_sync(True, recurse=False)
    grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
    return grads, None


def dp_unshard_fn(module: torch.nn.Module) -> Callable[[], None] | None:
    """``module.unshard`` for a stage wrapped by FSDP2 (``fully_shard`` / ``replicate``), else None.

    A checkpointed segment's replay (:mod:`fxpipe.codegen.stash`) runs outside the stage's
    forward, on the unsharded parameters the forward used; this makes sure they hold data (a
    no-op while torch's runtime keeps the stage unsharded between ``UNSHARD`` and ``RESHARD``).
    """
    from torch.distributed.fsdp import FSDPModule

    return module.unshard if isinstance(module, FSDPModule) else None


def forward_without_dp_hooks(module: torch.nn.Module) -> Callable:
    """``module``'s forward for a recomputation during the backward, around FSDP2's hooks.

    A stage wrapped by ``fully_shard`` / ``replicate`` (an ``FSDPModule``) runs its forward
    through FSDP2's forward pre- and post-hooks: unshard, register the post-backward hooks on
    the inputs and the pre-backward hooks on the outputs, set the training state (``FORWARD``,
    then ``IDLE``) and reshard. A recomputation replays the forward inside a backward (``B`` or,
    with a split backward, ``W``) and stops as soon as the saved tensors are back
    (:mod:`fxpipe.codegen.stash`), so the post-hook would never run: outside FSDP2's own
    activation-checkpointing case (training state ``PRE_BACKWARD``, set only by a backward that
    starts at the stage outputs) that would leave the state in ``FORWARD`` and skip the next
    forward's hook registration. The returned function instead makes sure the parameters are
    unsharded (``FSDPModule.unshard``, a no-op while torch's runtime holds the stage unsharded
    between its ``UNSHARD`` and ``RESHARD`` actions) and calls ``module.forward`` directly, which
    runs no hook of ``module`` itself (fxpipe's stage modules carry only FSDP2's; no input cast:
    fxpipe wraps without a mixed-precision policy). Gradients still flow to the unsharded
    parameters only through the original forward's graph: the replayed graph is discarded.
    Other modules: ``module`` itself.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return module

    def replay(*args, **kwargs):
        module.unshard()
        return module.forward(*args, **kwargs)

    return replay


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (sharing its storage: in-place ops write the DTensor), else ``t``."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def replicate_module(module: torch.nn.Module, mesh, offload_policy=None) -> torch.nn.Module:
    """Replicate ``module`` in place over the 1-D ``mesh`` (FSDP2-based DDP: ``replicate_with_fsdp.replicate``).

    The module becomes an ``FSDPModule`` (torch's pipelining runtime accumulates the
    micro-batches' gradients unsynchronised and all-reduces them once, in its ``REDUCE_GRAD``
    action); its parameters become replicated DTensors. ``offload_policy``: FSDP2's
    ``CPUOffloadPolicy`` keeps them, their gradients and the optimizer state on the host
    (torch 2.13's ``replicate`` takes it as ``fully_shard`` does).
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate

    if offload_policy is None:
        return replicate(module, mesh=mesh)
    return replicate(module, mesh=mesh, offload_policy=offload_policy)
# ---- end data parallelism adapters


# ---- begin torch.compile backend adapters (owner: issue 10; used by fxpipe/dynamo/* and fxpipe/codegen/compiled.py)
def dynamo_source_name(node: torch.fx.Node) -> str | None:
    """Dynamo's source of a placeholder of the graph it hands a backend (``"L['self']._modules['h']..."``), or None."""
    src = getattr(node, "_dynamo_source", None)
    if src is None:
        return None
    name = src.name
    return str(name() if callable(name) else name)


@dataclass(frozen=True)
class GraphBreakInfo:
    """Why Dynamo ended a graph (its ``GraphCompileReason``), as plain data.

    Attributes
    ----------
    graph_break : bool
        True when the graph ends at a graph break (False: it ends at the function's return).
    reason : str
        Dynamo's reason (``"return_value"``, or the unsupported construct and Dynamo's hints).
    user_stack : tuple[str, ...]
        ``File "...", line N, in fn`` followed by the source line, innermost frame last.
    """

    graph_break: bool
    reason: str
    user_stack: tuple[str, ...]


def graph_break_info(gm: torch.fx.GraphModule) -> GraphBreakInfo:
    """The :class:`GraphBreakInfo` of a graph Dynamo hands a backend (no break when Dynamo recorded none)."""
    r = getattr(gm, "compile_subgraph_reason", None)
    if r is None:
        return GraphBreakInfo(False, "", ())
    frames = []
    for fr in getattr(r, "user_stack", None) or ():
        line = f'File "{fr.filename}", line {fr.lineno}, in {fr.name}'
        if getattr(fr, "line", None):
            line += f"\n    {fr.line.strip()}"
        frames.append(line)
    return GraphBreakInfo(bool(getattr(r, "graph_break", False)), str(getattr(r, "reason", "")), tuple(frames))


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, inner_compile: Callable | None = None):
    """Inductor's ``compile_fx`` (AOTAutograd + Inductor) of ``gm``; ``inner_compile`` replaces the per-graph compiler.

    ``inner_compile(gm, example_inputs, **kwargs)`` receives AOTAutograd's forward graph, then (at the
    first backward) its backward graph with ``kwargs["is_backward"] = True``; the default is
    :func:`inductor_compile_graph`. Returns a callable taking ``example_inputs``-like arguments.
    """
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    if inner_compile is None:
        return compile_fx(gm, list(example_inputs), inner_compile=compile_fx_inner)
    # AOTAutograd's cache returns a whole cached forward+backward without calling inner_compile,
    # so a custom backward (the B/W split) would silently not happen on a cache hit
    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(gm, list(example_inputs), inner_compile=inner_compile)


def inductor_compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs):
    """Inductor's code generation for one AOTAutograd graph (``compile_fx_inner``); returns a boxed callable."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, list(example_inputs), **kwargs)


def dynamo_frame_owner() -> str | None:
    """Class name of ``self`` in the frame Dynamo is compiling (the compiled module), if any.

    Only meaningful inside a backend call; None when Dynamo is not tracing a method.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        owner = tx.f_locals.get("self") if tx is not None else None
    except Exception:  # noqa: BLE001 - a name is a nicety; never fail a compile for it
        return None
    return type(owner).__name__ if isinstance(owner, torch.nn.Module) else None


def concrete_int(value: Any) -> Any:
    """The example value of a symbolic int Dynamo passes (its hint); anything else unchanged."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else value
    return value


@contextlib.contextmanager
def outside_dynamo_tracing():
    """Run code from inside a Dynamo backend as if no graph were being traced.

    A backend is called with Dynamo's ``TracingContext`` (and its fake-tensor mode) installed;
    ``torch.export`` and fake-tensor shape inference would pick that mode up and meet real
    parameters. Inside this context there is no tracing context.
    """
    with torch._guards.tracing(None):
        yield


@contextlib.contextmanager
def donated_backward_inputs(allowed: Callable[[int], bool]):
    """Restrict which inputs of the backward graph being compiled Inductor may reuse in place.

    AOTAutograd lets Inductor write into saved activations the backward no longer needs
    ("donated buffers", ``fw_metadata.bw_donated_idxs``, indices of backward placeholders). A
    backward split into B and W graphs must not let B clobber a saved tensor that W reads later:
    inside this context only the donated indices with ``allowed(i)`` stay donated.
    """
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    old = getattr(meta, "bw_donated_idxs", None)
    if old:
        meta.bw_donated_idxs = [i for i in old if allowed(i)]
    try:
        yield
    finally:
        if old:
            meta.bw_donated_idxs = old


def boxed_callable(fn: Callable[[list], Any]) -> Callable[[list], Any]:
    """Mark ``fn(args_list)`` as taking AOTAutograd's boxed calling convention (one list argument)."""
    fn._boxed_call = True  # noqa: SLF001 - AOTAutograd's protocol
    return fn
# ---- end torch.compile backend adapters


# ----------------------------------------------------------------------------- module and graph internals
_SLOT_DICTS = {"parameter": "_parameters", "buffer": "_buffers"}


def module_tensor_slots(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, str, torch.Tensor]]:
    """Every ``(module qualname, module, kind, key, tensor)`` slot holding a parameter or buffer.

    ``kind`` is ``"parameter"`` or ``"buffer"``; shared modules and tied tensors appear once per
    slot (``remove_duplicate=False``), which is what swapping tensors in place needs
    (:mod:`fxpipe.codegen.materialize`). Reads ``nn.Module._parameters`` / ``_buffers``.
    """
    out = []
    for qual, mod in model.named_modules(remove_duplicate=False):
        for kind, attr in _SLOT_DICTS.items():
            for key, t in getattr(mod, attr).items():
                if t is not None:
                    out.append((qual, mod, kind, key, t))
    return out


def get_tensor_slot(mod: torch.nn.Module, kind: str, key: str) -> torch.Tensor | None:
    """The tensor in ``mod``'s ``kind`` (``"parameter"`` / ``"buffer"``) slot ``key``."""
    return getattr(mod, _SLOT_DICTS[kind])[key]


def set_tensor_slot(mod: torch.nn.Module, kind: str, key: str, value: torch.Tensor | None) -> None:
    """Put ``value`` in ``mod``'s slot without the checks of ``register_parameter`` (a meta
    placeholder swapped for a real tensor and back, a parameter shared across modules)."""
    getattr(mod, _SLOT_DICTS[kind])[key] = value


def copy_graph_codegen(dst: torch.fx.Graph, src: torch.fx.Graph) -> None:
    """Give ``dst`` the calling convention of ``src`` (its pytree codegen: ``fx.Graph._codegen``)."""
    dst._codegen = src._codegen  # noqa: SLF001
