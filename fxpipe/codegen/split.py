"""Split an exported fx graph into linear-pipeline stage modules (relay communication).

Precondition: ``gm`` is an *unlifted* ``torch.fx.GraphModule`` (``torch.export.export(...).module()``
or ``fxpipe.passes.capture``): parameters and buffers are ``get_attr`` nodes. ``stage_of`` maps
node names to pipeline stages ``0..S-1`` and is monotone: every data edge goes to the same or a
later stage.

:func:`split_stages` runs small passes, each with one job:

1. :func:`_resolve_stages` places the nodes ``stage_of`` omits and checks monotonicity;
2. :func:`_respect_effects` enforces what in-place updates need (see below), moving as few nodes
   as possible to later stages (never earlier, except state-only counter updates);
3. :func:`_replicas` decides which values are recomputed on the stages that use them instead
   of being sent: non-tensor values (shape arithmetic) and views of tensors that are updated
   in place (a sent view would be a stale copy);
4. :func:`_boundaries` lists what crosses each boundary: values produced on a stage ``<= b``
   and used on a stage ``> b`` (the relay model of Contract 2: ``torch.distributed.pipelining``
   (torch 2.13) only talks to adjacent stages, so a tensor consumed two stages later is taken
   as an input and returned by every stage in between);
5. :func:`_build_stage` emits each stage's ``GraphModule``;
6. :func:`_place_unused_state` gives every parameter and buffer the forward never touches an
   owner stage, so that it is trained (gradient ``None``, as in eager) and checkpointed.

In-place updates. Training-IR graphs keep in-place ops (``h += x``, ``x[:, :4].mul_(2)``,
BatchNorm's running statistics and ``num_batches_tracked``). The pipeline runs a stage's ops for
one micro-batch at a time on its own process, so:

* **state** (parameters, buffers, constants) that the forward mutates is accessed on one stage
  only, its *owner*: all reads and writes move there (a counter update that reads nothing but
  state moves down to its module's stage, e.g. ``num_batches_tracked`` to its BatchNorm), so each
  micro-batch's update is seen by the next micro-batch exactly as in single-process training,
  and after training the owner holds the buffer's value;
* for an **activation** written in place, every access after the write (program order) runs on
  the same or a later stage than the write, and every access before it on the same or an
  earlier stage; views of such tensors are recomputed where used;
* a **received stage input that the stage mutates is cloned** first (Falcon's
  ``mlp_output += attention_output`` when a boundary falls between the two). The alternative,
  never cutting between an in-place op and the producer of its operand, would remove valid cuts
  from the partitioner's search space and needs the partitioner to know about aliasing; the
  clone costs one copy of that tensor per micro-batch, keeps every partition runnable, and is
  what autograd needs anyway (a received input is a leaf that requires grad, which may not be
  updated in place). The clone is differentiable, so the gradient flows back unchanged.

Gradients. Every floating-point input of stages ``> 0`` passes through :func:`stage_input`, an
identity whose backward returns a contiguous gradient: torch's backward-input pass
(``autograd.grad``) returns strided gradients (transposes, ``cat`` slices) or stride-0 ones
(MoE expert outputs, ``expand``), which point-to-point sends cannot take.

Only public torch APIs are used here (op schemas are read through :mod:`fxpipe.codegen.runtime`).

References
----------
Archer et al., "Practical Performance Guarantees for Pipelined DNN Inference", ICML 2024,
Sec. 2.1 (graph model) -- the relay variant is fxpipe's Contract 2.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx

from fxpipe.codegen.effects import GraphEffects, analyze
from fxpipe.codegen.interface import ModelInputs, ModelInterface
from fxpipe.errors import DataDependentCutError, InputError
from fxpipe.passes.capture import has_data_dependent_size, user_source_line

__all__ = [
    "StageSpec",
    "StagedProgram",
    "split_stages",
    "stage_input",
    "stage_output",
    "last_stage_output",
    "canonical_param_names",
    "canonical_buffer_names",
]

logger = logging.getLogger(__name__)

_COMPUTE_OPS = ("call_function", "call_module", "call_method")


class _StageInput(torch.autograd.Function):
    """Identity (or a clone) whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx, x, clone):
        return x.clone() if clone else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous(), None


def stage_input(x, clone: bool = False):
    """A received stage input as the stage's ops see it.

    Returns ``x`` through an identity (a clone when the stage updates it in place) whose
    gradient is made contiguous on the way back: the gradient the stage sends to its
    predecessor must be a dense tensor (torch's split backward computes input gradients with
    ``autograd.grad``, which keeps the strides of transposes, ``cat`` slices and stride-0
    expansions).
    """
    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
        return _StageInput.apply(x, clone)
    if isinstance(x, torch.Tensor) and clone:
        return x.clone()
    return x


def stage_output(x):
    """Return ``x`` as a fresh, contiguous, non-view tensor, for a (non-last) stage output.

    ``torch.distributed.pipelining`` calls ``detach_()`` on every stage output after the
    backward-input (I) pass. That fails on views, detaches the receive buffer when an input is
    returned as-is (a relay), and breaks the later backward-weight (W) pass whenever the output
    tensor is saved for backward by an op of the stage (an activation such as ``exp``/``tanh``
    saves its result; a residual stream reused inside the stage is saved by the next op).
    A ``clone`` is saved by nothing, and point-to-point sends need contiguous tensors.
    ``clone`` is differentiable, so the gradient flows back unchanged.
    """
    if isinstance(x, torch.Tensor):
        return x.clone(memory_format=torch.contiguous_format)
    return x


def last_stage_output(x):
    """Return ``x`` through a zero-copy view, for the last stage's output.

    After the backward-input pass of the last stage torch detaches its outputs in place unless
    they are views; a view keeps the tensor saved for backward intact for the W pass.
    """
    if isinstance(x, torch.Tensor):
        return x.view_as(x)
    return x


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage.

    Attributes
    ----------
    index : int
        Stage index 0..S-1.
    module : torch.fx.GraphModule
        ``forward(*inputs)`` takes exactly the tuple the previous stage returns (stage 0: the
        model's tensor inputs, flattened in placeholder order); non-last stages return a
        tuple of tensors named ``output_names``; the last stage returns the tuple of the
        model output's tensor leaves (:class:`~fxpipe.codegen.interface.ModelInterface`
        rebuilds the model's structure).
    input_names, output_names : tuple[str, ...]
        Names of the original fx nodes whose values enter / leave the stage.
    relayed_names : tuple[str, ...]
        Inputs that the stage also returns for a later stage (Contract 2's ``comm="relay"``);
        the stage may consume them itself as well. Empty for the first and the last stage.
    node_names : tuple[str, ...]
        Original compute nodes executed on this stage.
    param_fqns : tuple[str, ...]
        Canonical fully-qualified names of the parameters this stage holds (tied parameters
        share one canonical name, see :attr:`StagedProgram.shared_params`), including
        parameters the forward never uses that this stage owns.
    param_targets : Mapping[str, str]
        Canonical FQN -> attribute path of that parameter inside ``module``.
    param_bytes : int
        Bytes of the parameters held by this stage.
    buffer_targets : Mapping[str, str]
        Canonical buffer FQN -> attribute path inside ``module``, for the model buffers this
        stage holds.
    cloned_inputs : tuple[str, ...]
        Inputs cloned because the stage updates them in place.
    """

    index: int
    module: fx.GraphModule
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    relayed_names: tuple[str, ...]
    node_names: tuple[str, ...]
    param_fqns: tuple[str, ...]
    param_targets: Mapping[str, str]
    param_bytes: int
    buffer_targets: Mapping[str, str] = field(default_factory=dict)
    cloned_inputs: tuple[str, ...] = ()

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Canonical FQN -> parameter object of this stage's module."""
        return {fqn: self.module.get_parameter(t) for fqn, t in self.param_targets.items()}

    def named_buffers(self) -> dict[str, torch.Tensor]:
        """Canonical FQN -> buffer tensor of this stage's module."""
        return {fqn: self.module.get_buffer(t) for fqn, t in self.buffer_targets.items()}


@dataclass(frozen=True)
class StagedProgram:
    """The stage modules of a pipeline and what crosses each boundary.

    Attributes
    ----------
    stages : tuple[StageSpec, ...]
        One entry per stage, in pipeline order.
    input_names : tuple[str, ...]
        Placeholder names of the model's tensor inputs (stage 0's inputs).
    shared_params : Mapping[str, tuple[int, ...]]
        Canonical FQN -> stages holding a copy, for parameters present on more than one stage
        (tied weights, e.g. GPT-2's ``wte`` used by the embedding and the LM head). Their
        gradients must be summed over those stages after backward.
    boundary_names : tuple[tuple[str, ...], ...]
        ``boundary_names[b]``: names of the tensors sent from stage ``b`` to ``b + 1``.
    interface : ModelInterface
        The model's pytree inputs/outputs (:mod:`fxpipe.codegen.interface`).
    buffer_owner : Mapping[str, int]
        Canonical buffer FQN -> the stage whose copy is the model's buffer (the only stage
        touching a buffer the forward mutates; the first holder of a read-only one).
    moved_nodes : Mapping[str, tuple[int, int]]
        Nodes placed on another stage than ``stage_of`` said, to respect in-place updates:
        name -> (planned stage, stage used).
    """

    stages: tuple[StageSpec, ...]
    input_names: tuple[str, ...]
    shared_params: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    boundary_names: tuple[tuple[str, ...], ...] = ()
    interface: Any = None
    buffer_owner: Mapping[str, int] = field(default_factory=dict)
    moved_nodes: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def param_bytes(self) -> list[int]:
        """Parameter bytes per stage (tied parameters counted on every stage that holds them)."""
        return [s.param_bytes for s in self.stages]

    def flat_inputs(self, *args, **kwargs) -> tuple:
        """Stage 0's input tensors for one call ``model(*args, **kwargs)`` (no shape check)."""
        return self.interface.flatten_inputs(ModelInputs(args, kwargs), check_shapes=False)

    def run(self, *args, **kwargs):
        """Run all stages in sequence in this process, called like the model; returns the model's output.

        The composition equals ``gm(*args, **kwargs)`` (same structure, same values).
        """
        x = self.flat_inputs(*args, **kwargs)
        for spec in self.stages:
            out = spec.module(*x)
            x = out if isinstance(out, tuple) else (out,)
        return self.interface.output(x)

    def stage_inputs(self, stage: int, *args, **kwargs) -> tuple:
        """The input tuple of ``stage`` for model inputs ``(args, kwargs)`` (runs stages ``0..stage-1``)."""
        x = self.flat_inputs(*args, **kwargs)
        for spec in self.stages[:stage]:
            out = spec.module(*x)
            x = out if isinstance(out, tuple) else (out,)
        return x

    def describe(self) -> str:
        """A human-readable table of stages: nodes, inputs, outputs, relays, parameters."""
        lines = [f"StagedProgram: {self.num_stages} stages, inputs {list(self.input_names)}"]
        for s in self.stages:
            lines.append(
                f"  stage {s.index}: {len(s.node_names)} nodes, {len(s.param_fqns)} params "
                f"({s.param_bytes} bytes), {len(s.buffer_targets)} buffers"
            )
            lines.append(f"    inputs  ({len(s.input_names)}): {', '.join(s.input_names)}")
            lines.append(f"    outputs ({len(s.output_names)}): {', '.join(s.output_names)}")
            if s.relayed_names:
                lines.append(f"    relayed ({len(s.relayed_names)}): {', '.join(s.relayed_names)}")
            if s.cloned_inputs:
                lines.append(f"    cloned (updated in place): {', '.join(s.cloned_inputs)}")
        if self.shared_params:
            lines.append("  shared parameters (gradients summed across stages):")
            for fqn, st in self.shared_params.items():
                lines.append(f"    {fqn}: stages {list(st)}")
        if self.moved_nodes:
            lines.append(f"  moved for in-place updates: {dict(self.moved_nodes)}")
        return "\n".join(lines)


def _value_of(node: fx.Node):
    return node.meta.get("val", node.meta.get("example_value"))


def _is_tensor_value(node: fx.Node) -> bool | None:
    """True/False when the node's recorded value says so, None when unknown."""
    if "val" not in node.meta and "example_value" not in node.meta:
        return None
    return isinstance(_value_of(node), torch.Tensor)


def _is_constant_input(node: fx.Node) -> bool:
    """A placeholder whose captured value is not a tensor: torch.export specialised it."""
    return node.op == "placeholder" and _is_tensor_value(node) is False


# ----------------------------------------------------------------------------- pass 1: stages
def _resolve_stages(gm: fx.GraphModule, stage_of: Mapping[str, int], num_stages: int) -> dict[fx.Node, int]:
    nodes = list(gm.graph.nodes)
    last = num_stages - 1
    st: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "get_attr":
            continue
        if n.name in stage_of:
            v = stage_of[n.name]
            if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__"):
                raise InputError(f"stage_of[{n.name!r}] must be an integer, got {v!r}")
            v = int(v)
            if not 0 <= v < num_stages:
                raise InputError(f"stage_of[{n.name!r}] = {v} lies outside 0..{last}")
            st[n] = v
    for n in nodes:
        if n.op == "placeholder":
            if st.get(n, 0) != 0:
                raise InputError(f"placeholder {n.name!r} must be on stage 0, got stage {st[n]}")
            st[n] = 0
        elif n.op == "output":
            if st.get(n, last) != last:
                raise InputError(f"the output node must be on the last stage {last}, got {st[n]}")
            st[n] = last
    # Nodes absent from stage_of (helpers such as getitem, guards): as late as their consumers
    # allow (so constants are recomputed where used instead of relayed), never before a producer.
    for n in reversed(nodes):
        if n in st or n.op == "get_attr":
            continue
        cons = [st[u] for u in n.users if u in st]
        prods = [st[p] for p in n.all_input_nodes if p in st]
        lo = max(prods, default=0)
        st[n] = max(lo, min(cons, default=lo))
    for n in nodes:  # producers may have been placed above; re-check lower bounds
        if n.op == "get_attr" or n.name in stage_of or n.op in ("placeholder", "output"):
            continue
        prods = [st[p] for p in n.all_input_nodes if p.op != "get_attr"]
        st[n] = max([st[n], *prods])
    # getitem of a multi-output op (tuple value, cannot be sent) runs with its producer.
    for n in nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            src = n.args[0]
            if isinstance(src, fx.Node) and src in st and st[src] < st[n] and _is_tensor_value(src) is not True:
                st[n] = st[src]
    _check_monotone(nodes, st)
    return st


def _check_monotone(nodes, st) -> None:
    for n in nodes:
        if n.op == "get_attr":
            continue
        for p in n.all_input_nodes:
            if p.op == "get_attr":
                continue
            if st[p] > st[n]:
                raise InputError(
                    f"stage_of is not monotone: {p.name!r} (stage {st[p]}) feeds {n.name!r} "
                    f"(stage {st[n]}); every data edge must go to the same or a later stage"
                )


# ----------------------------------------------------------------------------- pass 2: effects
def _state_only(nodes, eff: GraphEffects) -> set[fx.Node]:
    """Compute nodes that read nothing but state (parameters, buffers, constants) and other such
    nodes: they can run on any stage, e.g. ``num_batches_tracked.add_(1)``."""
    out: set[fx.Node] = set()
    for n in nodes:
        if n.op in _COMPUTE_OPS and all(p.op == "get_attr" or p in out for p in n.all_input_nodes):
            out.add(n)
    return out


def _respect_effects(gm: fx.GraphModule, st: dict[fx.Node, int], eff: GraphEffects) -> dict[fx.Node, int]:
    """Move nodes so that in-place updates run in the right order on the right stage.

    Rules (module docstring): mutated state is accessed on one owner stage; accesses to an
    activation after (before) an in-place write of it run on the same or a later (earlier)
    stage. Nodes only ever move to later stages (their consumers follow), except state-only
    nodes, which move to their owner. Returns ``{node: planned stage}`` for moved nodes.
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    planned = dict(st)
    state_only = _state_only(nodes, eff)
    last = max(st.values())

    def raise_to(n: fx.Node, s: int) -> bool:
        if n.op in ("get_attr", "placeholder") or st[n] >= s:
            return False
        stack = [n]
        st[n] = s
        while stack:
            u = stack.pop()
            for v in u.users:
                if v.op != "get_attr" and st[v] < s:
                    st[v] = s
                    stack.append(v)
        return True

    def lower_state_only(n: fx.Node, s: int) -> None:
        st[n] = s
        for p in n.all_input_nodes:
            if p in state_only and st[p] > s:
                lower_state_only(p, s)
        for v in n.users:
            if v.op != "get_attr" and st[v] < s:
                raise_to(v, s)

    def owner_by_module(target: str, accs: list[fx.Node]) -> int:
        prefix = target.rsplit(".", 1)[0] + "." if "." in target else ""
        stages = [st[u] for b, tgt in eff.state_target.items() if tgt.startswith(prefix) and tgt != target
                  for u in eff.accesses.get(b, []) if u not in state_only and u.op != "output"]
        return min(stages) if stages else min(st[u] for u in accs)

    for _ in range(4 * len(nodes) + 8):  # each round only raises stages: bounded
        changed = False
        for target, accs in eff.written_state().items():
            fixed = [u for u in accs if u not in state_only]
            owner = max(st[u] for u in fixed) if fixed else owner_by_module(target, accs)
            for u in accs:
                if st[u] < owner:
                    changed |= raise_to(u, owner)
                elif st[u] > owner and u in state_only:
                    lower_state_only(u, owner)
                    changed = True
        for w, b in eff.writes:
            for u in eff.accesses.get(b, []):
                if u is w:
                    continue
                if pos[u] > pos[w] and st[u] < st[w]:
                    changed |= raise_to(u, st[w])
                elif pos[u] < pos[w] and st[u] > st[w]:
                    changed |= raise_to(w, st[u])
        if not changed:
            break
    else:  # pragma: no cover - the loop only raises stages, so it settles
        raise AssertionError("in-place update placement did not settle; this is a bug in fxpipe")
    if any(v > last for v in st.values()):  # pragma: no cover - raise_to never exceeds the output's stage
        raise AssertionError("a node was moved past the last stage; this is a bug in fxpipe")
    _check_monotone(nodes, st)
    return {n: planned[n] for n in st if st[n] != planned[n]}


# ----------------------------------------------------------------------------- pass 3: replicas
def _replicas(nodes, st, eff: GraphEffects, num_stages: int) -> dict[int, set[fx.Node]]:
    """Per stage, the nodes recomputed there rather than received: non-tensor values, views of
    tensors that are updated in place (a sent view would be a stale copy), and results of
    in-place ops (on a later stage they are the updated tensor itself, not re-executed)."""
    mutated = eff.written_bases()
    rep: dict[int, set[fx.Node]] = {c: set() for c in range(num_stages)}

    def needs_replica(n: fx.Node) -> bool:
        if n.op == "get_attr" or _is_constant_input(n):
            return False
        if _is_tensor_value(n) is False:
            return True
        return n in eff.inplace_source or (n in eff.views and eff.base.get(n) in mutated)

    def replicate(n: fx.Node, c: int, user: fx.Node) -> None:
        if n in rep[c] or st[n] == c:
            return
        if n.op not in _COMPUTE_OPS:
            raise InputError(
                f"node {n.name!r} (stage {st[n]}) produces a non-tensor value "
                f"({type(_value_of(n)).__name__}) consumed on stage {c} by {user.name!r}: only tensors "
                f"can cross pipeline stages; assign {user.name!r} to stage {st[n]}"
            )
        rep[c].add(n)
        deps = [eff.inplace_source[n]] if n in eff.inplace_source else n.all_input_nodes
        for p in deps:
            if needs_replica(p):
                replicate(p, c, n)

    for n in nodes:
        if not needs_replica(n):
            continue
        for u in n.users:
            if u.op != "get_attr" and st[u] > st[n]:
                replicate(n, st[u], u)
    return rep


def _replica_inputs(n: fx.Node, eff: GraphEffects) -> list[fx.Node]:
    """What a replica of ``n`` reads: the updated input of an in-place result, else its inputs."""
    return [eff.inplace_source[n]] if n in eff.inplace_source else list(n.all_input_nodes)


# ----------------------------------------------------------------------------- pass 4: boundaries
def _boundaries(nodes, st, rep, eff: GraphEffects, num_stages: int) -> list[list[fx.Node]]:
    last_use: dict[fx.Node, int] = {}

    def use(p: fx.Node, c: int) -> None:
        if p.op != "get_attr" and p not in rep[c] and not _is_constant_input(p):
            last_use[p] = max(last_use.get(p, -1), c)

    for n in nodes:
        if n.op == "get_attr":
            continue
        for p in n.all_input_nodes:
            use(p, st[n])
    for c in range(num_stages):
        for r in rep[c]:
            for p in _replica_inputs(r, eff):
                use(p, c)
    boundaries: list[list[fx.Node]] = []
    for b in range(num_stages - 1):
        cross = [n for n in nodes if n in last_use and st[n] <= b < last_use[n]]
        if not cross:
            raise InputError(
                f"no tensor crosses the boundary between stage {b} and {b + 1}: a pipeline stage "
                f"must receive at least one tensor; use fewer stages or move nodes"
            )
        boundaries.append(cross)
    return boundaries


def _check_static_boundaries(boundaries: list[list[fx.Node]], st: dict[fx.Node, int]) -> None:
    """Refuse a boundary tensor whose size depends on the data (``x[mask]``, ``nonzero``, ...):
    receive buffers are sized from the example micro-batch (issue 17; the partitioner never
    cuts such edges, :mod:`fxpipe.partition.colocate`, but a given ``stage_of`` may)."""
    for b, cross in enumerate(boundaries):
        bad = [n for n in cross if has_data_dependent_size(n)]
        if bad:
            n = bad[0]
            src = user_source_line(n)
            users = sorted((u for u in n.users if st.get(u, -1) > b), key=lambda u: st[u])
            raise DataDependentCutError(
                f"the stage assignment puts a stage boundary on a tensor whose size depends on the data: "
                f"{n.name!r} ({n.target}, shape {tuple(getattr(_value_of(n), 'shape', ()))})"
                + (f" at {src}" if src else "")
                + f" is computed on stage {st[n]} and used on stage {st[users[0]] if users else b + 1}"
                + (f" by {users[0].name!r}" if users else "")
                + f" (boundary {b}/{b + 1}). The pipeline runtime sizes receive buffers from the example "
                "micro-batch, so such a tensor cannot cross stages. What to do: put the op and its consumers "
                "on one stage (let fxpipe.compile choose the partition, or move the pinned boundary), use fewer "
                "stages, or make the size static (e.g. torch.where(mask, x, 0) instead of x[mask])."
            )


# ----------------------------------------------------------------------------- pass 5: stage graphs
def _build_stage(gm, s, nodes, st, rep, boundaries, eff: GraphEffects, out_node, inputs):
    """One stage's ``GraphModule`` and the names of its cloned inputs."""
    S = len(boundaries) + 1
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    # received inputs the stage updates in place: written bases among the inputs
    written_here = {b for w, b in eff.writes if st[w] == s}
    cloned = []
    for n in inputs:
        ph = g.placeholder(n.name)
        ph.meta = dict(n.meta)
        if s == 0:
            env[n] = ph
            continue
        clone = n in written_here
        if clone:
            cloned.append(n.name)
        val = _value_of(n)
        floating = isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())
        if floating or clone:
            env[n] = g.call_function(stage_input, (ph, clone))
            env[n].meta = dict(n.meta)
        else:
            env[n] = ph

    def arg(a: fx.Node):
        if a not in env:
            if _is_constant_input(a):
                return _value_of(a)
            if a.op != "get_attr":  # pragma: no cover - guarded by the monotone check
                raise AssertionError(f"{a.name} not available on stage {s}")
            env[a] = g.node_copy(a)
        return env[a]

    for n in nodes:  # replicas and the stage's own ops, in program order
        if n.op in _COMPUTE_OPS and st[n] == s:
            env[n] = g.node_copy(n, arg)
        elif n in rep[s] and n in eff.inplace_source:
            env[n] = arg(eff.inplace_source[n])  # the tensor the earlier stage updated, not a second update
        elif n in rep[s]:
            env[n] = g.node_copy(n, arg)
    if s < S - 1:
        outs = [g.call_function(stage_output, (env[n],)) for n in boundaries[s]]
        g.output(tuple(outs))
        out_names = tuple(n.name for n in boundaries[s])
    else:
        from fxpipe.codegen.runtime import tree_flatten  # lazy: torch.distributed.pipelining; planning imports this module

        leaves, _ = tree_flatten(out_node.args[0])
        outs, names = [], []
        for a in leaves:
            if isinstance(a, fx.Node) and not _is_constant_input(a) and _is_tensor_value(a) is not False:
                outs.append(g.call_function(last_stage_output, (arg(a),)))
                names.append(a.name)
        g.output(tuple(outs))
        out_names = tuple(names)
    g.lint()
    mod = fx.GraphModule(gm, g, class_name=f"Stage{s}")
    return mod, out_names, tuple(cloned)


def _set_attr(root: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    """Register ``value`` at the dotted ``target`` of ``root`` (parameter or buffer), creating
    empty container modules on the way."""
    *path, name = target.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, torch.nn.Parameter):
        mod.register_parameter(name, value)
    else:
        mod.register_buffer(name, value)


# ----------------------------------------------------------------------------- pass 6: unused state
def _owner_stage_by_module(target: str, held: dict[str, set[int]]) -> int:
    """The stage of the nearest enclosing module that has state on some stage (stage 0 at the root)."""
    parts = target.split(".")[:-1]
    while True:
        prefix = ".".join(parts) + "." if parts else ""
        stages = {s for fqn, ss in held.items() if fqn.startswith(prefix) for s in ss}
        if stages:
            return min(stages)
        if not parts:
            return 0
        parts.pop()


def _place_unused_state(gm: fx.GraphModule, modules: list[fx.GraphModule]) -> None:
    """Register on one stage every parameter and buffer of ``gm`` that no stage holds yet."""
    held: dict[str, set[int]] = {}
    ids_held: set[int] = set()
    for s, mod in enumerate(modules):
        for fqn, t in list(mod.named_parameters()) + list(mod.named_buffers()):
            held.setdefault(fqn, set()).add(s)
            ids_held.add(id(t))
    for fqn, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        if id(t) in ids_held:
            continue
        s = _owner_stage_by_module(fqn, held)
        _set_attr(modules[s], fqn, t)
        ids_held.add(id(t))


def split_stages(
    gm: fx.GraphModule,
    stage_of: Mapping[str, int],
    num_stages: int,
) -> StagedProgram:
    """Build one ``GraphModule`` per pipeline stage from an exported graph.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        Unlifted exported module (parameters/buffers as ``get_attr`` nodes). Not mutated.
    stage_of : Mapping[str, int]
        Stage 0..S-1 of each placeholder / call_* / output node, by node name. Nodes that are
        missing (e.g. helper ``getitem`` or guard nodes) are placed as late as their consumers
        allow. Placeholders must be on stage 0 and the output on stage S-1.
    num_stages : int
        Number of stages S >= 1.

    Returns
    -------
    StagedProgram
        Stage modules sharing ``gm``'s parameter and buffer objects (so a single-process
        composition trains exactly like ``gm``); a parameter used on several stages is present
        in each; every parameter and buffer of ``gm`` is held by some stage.

    Raises
    ------
    InputError
        If ``stage_of`` is out of range or not monotone, or a boundary carries no tensor.
    DataDependentCutError
        (an InputError) If a boundary would carry a tensor whose size depends on the data
        (``x[mask]``, ``nonzero``, ...); the message names the op and the user's source line.

    Notes
    -----
    Tensors crossing a boundary are the values produced on a stage ``<= b`` and consumed on a
    stage ``> b`` (the relay model of Contract 2): stage ``b``'s outputs are exactly stage
    ``b + 1``'s inputs, in the program order of their producers. Only tensors cross: a
    ``getitem`` of a multi-output op runs on the op's stage (the selected tensor crosses), any
    other non-tensor value (shape arithmetic, ``None``) used on a later stage is recomputed
    there from its inputs (which cross if they are tensors), and non-tensor model inputs are the
    constants ``torch.export`` specialised. Values whose type is unknown (no
    ``node.meta['val']``) are assumed to be tensors. In-place updates may move a few nodes to
    later stages (:attr:`StagedProgram.moved_nodes`, see the module docstring).
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise InputError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if not isinstance(gm, fx.GraphModule):
        raise InputError(f"split_stages needs a torch.fx.GraphModule, got {type(gm).__name__}")

    nodes = list(gm.graph.nodes)
    st = _resolve_stages(gm, stage_of, num_stages)
    eff = analyze(gm)
    moved = _respect_effects(gm, st, eff)
    if moved:
        logger.info("moved %d node(s) to later stages to respect in-place updates: %s", len(moved),
                    {n.name: (p, st[n]) for n, p in moved.items()})
    S = num_stages
    placeholders = [n for n in nodes if n.op == "placeholder" and not _is_constant_input(n)]
    out_node = next(n for n in nodes if n.op == "output")
    rep = _replicas(nodes, st, eff, S)
    boundaries = _boundaries(nodes, st, rep, eff, S)
    _check_static_boundaries(boundaries, st)

    modules, metas = [], []
    for s in range(S):
        ins = placeholders if s == 0 else boundaries[s - 1]
        mod, out_names, cloned = _build_stage(gm, s, nodes, st, rep, boundaries, eff, out_node, ins)
        modules.append(mod)
        metas.append((ins, out_names, cloned))
    _place_unused_state(gm, modules)

    # canonical names: the ones gm.named_parameters() / named_buffers() report (tied aliases collapse)
    canon: dict[int, str] = {}
    for fqn, p in gm.named_parameters():
        canon.setdefault(id(p), fqn)
    canon_buf: dict[int, str] = {}
    for fqn, b in gm.named_buffers():
        canon_buf.setdefault(id(b), fqn)

    stages: list[StageSpec] = []
    holders: dict[str, list[int]] = {}
    buffer_owner: dict[str, int] = {}
    for s, (mod, (ins, out_names, cloned)) in enumerate(zip(modules, metas)):
        targets: dict[str, str] = {}
        nbytes = 0
        for fqn, p in mod.named_parameters(remove_duplicate=False):
            c = canon.get(id(p), fqn)
            if c not in targets:
                targets[c] = fqn
                nbytes += p.numel() * p.element_size()
        buffers: dict[str, str] = {}
        for fqn, b in mod.named_buffers(remove_duplicate=False):
            c = canon_buf.get(id(b))
            if c is not None and c not in buffers:
                buffers[c] = fqn
                buffer_owner.setdefault(c, s)  # a mutated buffer has one holder (pass 2)
        for c in targets:
            holders.setdefault(c, []).append(s)
        relayed = tuple(n.name for n in ins if 0 < s < S - 1 and n in boundaries[s])
        stages.append(
            StageSpec(
                index=s,
                module=mod,
                input_names=tuple(n.name for n in ins),
                output_names=out_names,
                relayed_names=relayed,
                node_names=tuple(n.name for n in nodes if n.op in _COMPUTE_OPS and st[n] == s),
                param_fqns=tuple(targets),
                param_targets=dict(targets),
                param_bytes=int(nbytes),
                buffer_targets=buffers,
                cloned_inputs=cloned,
            )
        )
    shared = {c: tuple(v) for c, v in holders.items() if len(v) > 1}
    return StagedProgram(
        stages=tuple(stages),
        input_names=tuple(n.name for n in placeholders),
        shared_params=shared,
        boundary_names=tuple(tuple(n.name for n in b) for b in boundaries),
        interface=ModelInterface.from_graph(gm),
        buffer_owner=buffer_owner,
        moved_nodes={n.name: (p, st[n]) for n, p in moved.items()},
    )


def canonical_param_names(module: torch.nn.Module) -> dict[str, str]:
    """Map every parameter alias name of ``module`` to its canonical (first) name.

    ``module.named_parameters(remove_duplicate=False)`` lists tied parameters under each
    alias; the canonical name is the one ``named_parameters()`` reports.
    """
    first: dict[int, str] = {}
    for name, p in module.named_parameters():
        first.setdefault(id(p), name)
    return {name: first[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}


def canonical_buffer_names(module: torch.nn.Module) -> dict[str, str]:
    """:func:`canonical_param_names` for buffers."""
    first: dict[int, str] = {}
    for name, b in module.named_buffers():
        first.setdefault(id(b), name)
    return {name: first[id(b)] for name, b in module.named_buffers(remove_duplicate=False)}
