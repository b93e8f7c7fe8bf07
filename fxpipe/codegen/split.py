"""Split an exported fx graph into linear-pipeline stage modules (relay communication).

Precondition: ``gm`` is an *unlifted* ``torch.fx.GraphModule`` (``torch.export.export(...).module()``
or ``fxpipe.passes.capture``): parameters and buffers are ``get_attr`` nodes. ``stage_of`` maps
node names to pipeline stages ``0..S-1`` and is monotone: every data edge goes to the same or a
later stage.

``torch.distributed.pipelining`` (torch 2.13) only communicates between adjacent stages, so a
tensor produced on stage ``a`` and consumed on stage ``c > a + 1`` is *relayed*: every stage
``a < b < c`` takes it as an input and returns it unchanged (as a fresh tensor, so that autograd
carries the gradient back through the relay and the runtime may ``detach_`` stage outputs; see
:func:`stage_output`).
This is the ``comm="relay"`` cost model of Contract 2.

Only public torch APIs are used here.

References
----------
Archer et al., "Practical Performance Guarantees for Pipelined DNN Inference", ICML 2024,
Sec. 2.1 (graph model) -- the relay variant is fxpipe's Contract 2.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.fx as fx

from fxpipe.errors import InputError

__all__ = ["StageSpec", "StagedProgram", "split_stages", "stage_output", "last_stage_output", "canonical_param_names"]

_COMPUTE_OPS = ("call_function", "call_module", "call_method")


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
        flattened model inputs in placeholder order); non-last stages return a tuple of
        tensors named ``output_names``; the last stage returns the model output (a single
        tensor when the model has one output, else a tuple).
    input_names, output_names : tuple[str, ...]
        Names of the original fx nodes whose values enter / leave the stage.
    relayed_names : tuple[str, ...]
        Inputs that the stage also returns unchanged for a later stage (produced on an
        earlier stage, still needed after this one): the relay of Contract 2's
        ``comm="relay"``. The stage may consume them itself as well (e.g. a T5 encoder output
        used by every decoder stage); empty for the first and the last stage.
    node_names : tuple[str, ...]
        Original compute nodes executed on this stage.
    param_fqns : tuple[str, ...]
        Canonical fully-qualified names of the parameters this stage holds (tied parameters
        share one canonical name, see :attr:`StagedProgram.shared_params`).
    param_targets : Mapping[str, str]
        Canonical FQN -> attribute path of that parameter inside ``module``.
    param_bytes : int
        Bytes of the parameters held by this stage.
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

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Canonical FQN -> parameter object of this stage's module."""
        return {fqn: self.module.get_parameter(t) for fqn, t in self.param_targets.items()}


@dataclass(frozen=True)
class StagedProgram:
    """The stage modules of a pipeline and what crosses each boundary.

    Attributes
    ----------
    stages : tuple[StageSpec, ...]
        One entry per stage, in pipeline order.
    input_names : tuple[str, ...]
        Placeholder names of the model (stage 0's inputs).
    shared_params : Mapping[str, tuple[int, ...]]
        Canonical FQN -> stages holding a copy, for parameters present on more than one stage
        (tied weights, e.g. GPT-2's ``wte`` used by the embedding and the LM head). Their
        gradients must be summed over those stages after backward.
    boundary_names : tuple[tuple[str, ...], ...]
        ``boundary_names[b]``: names of the tensors sent from stage ``b`` to ``b + 1``.
    """

    stages: tuple[StageSpec, ...]
    input_names: tuple[str, ...]
    shared_params: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    boundary_names: tuple[tuple[str, ...], ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def param_bytes(self) -> list[int]:
        """Parameter bytes per stage (tied parameters counted on every stage that holds them)."""
        return [s.param_bytes for s in self.stages]

    def run(self, *inputs):
        """Run all stages in sequence in this process (the composition equals ``gm(*inputs)``)."""
        x = tuple(inputs)
        out = None
        for spec in self.stages:
            out = spec.module(*x)
            x = out if isinstance(out, tuple) else (out,)
        return out

    def stage_inputs(self, stage: int, *inputs) -> tuple:
        """The input tuple of ``stage`` for model inputs ``inputs`` (runs stages ``0..stage-1``)."""
        x = tuple(inputs)
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
                f"({s.param_bytes} bytes)"
            )
            lines.append(f"    inputs  ({len(s.input_names)}): {', '.join(s.input_names)}")
            lines.append(f"    outputs ({len(s.output_names)}): {', '.join(s.output_names)}")
            if s.relayed_names:
                lines.append(f"    relayed ({len(s.relayed_names)}): {', '.join(s.relayed_names)}")
        if self.shared_params:
            lines.append("  shared parameters (gradients summed across stages):")
            for fqn, st in self.shared_params.items():
                lines.append(f"    {fqn}: stages {list(st)}")
        return "\n".join(lines)


def _value_of(node: fx.Node):
    return node.meta.get("val", node.meta.get("example_value"))


def _is_tensor_value(node: fx.Node) -> bool | None:
    """True/False when the node's recorded value says so, None when unknown."""
    if "val" not in node.meta and "example_value" not in node.meta:
        return None
    return isinstance(_value_of(node), torch.Tensor)


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
    # monotone check
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
    return st


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
        Stage modules sharing ``gm``'s parameter objects (so a single-process composition
        trains exactly like ``gm``); a parameter used on several stages is present in each.

    Raises
    ------
    InputError
        If ``stage_of`` is out of range or not monotone, a non-tensor model input is used
        after stage 0, or a boundary carries no tensor.

    Notes
    -----
    Tensors crossing a boundary are the values produced on a stage ``<= b`` and consumed on a
    stage ``> b`` (the relay model of Contract 2): stage ``b``'s outputs are exactly stage
    ``b + 1``'s inputs, in the program order of their producers. Only tensors cross: a
    ``getitem`` of a multi-output op runs on the op's stage (the selected tensor crosses), and
    any other non-tensor value (shape arithmetic, ``None``) used on a later stage is recomputed
    there from its inputs (which cross if they are tensors). Values whose type is unknown
    (no ``node.meta['val']``) are assumed to be tensors.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise InputError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if not isinstance(gm, fx.GraphModule):
        raise InputError(f"split_stages needs a torch.fx.GraphModule, got {type(gm).__name__}")
    nodes = list(gm.graph.nodes)
    st = _resolve_stages(gm, stage_of, num_stages)
    S = num_stages
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = next(n for n in nodes if n.op == "output")

    # Non-tensor values (Python ints from shape arithmetic, None, ...) cannot be sent: they are
    # recomputed on every later stage that uses them, together with their non-tensor inputs.
    replicas: dict[int, list[fx.Node]] = {c: [] for c in range(S)}
    rep_set: dict[int, set[fx.Node]] = {c: set() for c in range(S)}

    def replicate(n: fx.Node, c: int, user: fx.Node) -> None:
        if n in rep_set[c] or st[n] == c:
            return
        if n.op not in _COMPUTE_OPS:
            raise InputError(
                f"node {n.name!r} (stage {st[n]}) produces a non-tensor value "
                f"({type(_value_of(n)).__name__}) consumed on stage {c} by {user.name!r}: only tensors "
                f"can cross pipeline stages; assign {user.name!r} to stage {st[n]}"
            )
        rep_set[c].add(n)
        for p in n.all_input_nodes:
            if p.op != "get_attr" and _is_tensor_value(p) is False:
                replicate(p, c, n)

    for n in nodes:
        if n.op == "get_attr" or _is_tensor_value(n) is not False:
            continue
        for u in n.users:
            if u.op != "get_attr" and st[u] > st[n]:
                replicate(n, st[u], u)
    for c in range(S):
        replicas[c] = [n for n in nodes if n in rep_set[c]]

    # boundary b (between stage b and b+1): produced on <= b, consumed on > b
    last_use: dict[fx.Node, int] = {}

    def use(p: fx.Node, c: int) -> None:
        if p.op != "get_attr" and p not in rep_set[c]:
            last_use[p] = max(last_use.get(p, -1), c)

    for n in nodes:
        if n.op == "get_attr":
            continue
        for p in n.all_input_nodes:
            use(p, st[n])
    for c in range(S):
        for r in replicas[c]:
            for p in r.all_input_nodes:
                use(p, c)
    boundaries: list[list[fx.Node]] = []
    for b in range(S - 1):
        cross = [n for n in nodes if n in last_use and st[n] <= b < last_use[n]]
        if not cross:
            raise InputError(
                f"no tensor crosses the boundary between stage {b} and {b + 1}: a pipeline stage "
                f"must receive at least one tensor; use fewer stages or move nodes"
            )
        boundaries.append(cross)

    # canonical parameter names: the name gm.named_parameters() reports (tied aliases collapse)
    canon: dict[int, str] = {}
    for fqn, p in gm.named_parameters():
        canon.setdefault(id(p), fqn)

    stages: list[StageSpec] = []
    holders: dict[str, list[int]] = {}
    for s in range(S):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        ins = placeholders if s == 0 else boundaries[s - 1]
        for n in ins:
            ph = g.placeholder(n.name)
            ph.meta = dict(n.meta)
            env[n] = ph

        def arg(a: fx.Node) -> fx.Node:
            if a not in env:
                if a.op != "get_attr":  # pragma: no cover - guarded by the monotone check
                    raise AssertionError(f"{a.name} not available on stage {s}")
                env[a] = g.node_copy(a)
            return env[a]

        for n in replicas[s]:  # recomputed non-tensor values (program order)
            env[n] = g.node_copy(n, arg)
        body = [n for n in nodes if n.op in _COMPUTE_OPS and st[n] == s]
        for n in body:
            env[n] = g.node_copy(n, arg)
        if s < S - 1:
            outs = []
            for n in boundaries[s]:
                v = env[n]
                outs.append(g.call_function(stage_output, (v,)))
            g.output(tuple(outs))
            out_names = tuple(n.name for n in boundaries[s])
        else:
            res = out_node.args[0]
            leaves = res if isinstance(res, (tuple, list)) else (res,)
            mapped = tuple(
                g.call_function(last_stage_output, (a,)) if isinstance(a, fx.Node) else a
                for a in fx.map_arg(tuple(leaves), arg)
            )
            g.output(mapped[0] if len(mapped) == 1 else tuple(mapped))
            out_names = tuple(a.name if isinstance(a, fx.Node) else repr(a) for a in leaves)
        g.lint()
        mod = fx.GraphModule(gm, g, class_name=f"Stage{s}")
        targets: dict[str, str] = {}
        nbytes = 0
        for n in mod.graph.nodes:
            for fqn, p in _params_of_node(mod, n):
                c = canon.get(id(p), fqn)
                if c not in targets:
                    targets[c] = fqn
                    nbytes += p.numel() * p.element_size()
        for c in targets:
            holders.setdefault(c, []).append(s)
        relayed = tuple(n.name for n in ins if s > 0 and s < S - 1 and n in boundaries[s])
        stages.append(
            StageSpec(
                index=s,
                module=mod,
                input_names=tuple(n.name for n in ins),
                output_names=out_names,
                relayed_names=relayed,
                node_names=tuple(n.name for n in body),
                param_fqns=tuple(targets),
                param_targets=dict(targets),
                param_bytes=int(nbytes),
            )
        )
    shared = {c: tuple(v) for c, v in holders.items() if len(v) > 1}
    return StagedProgram(
        stages=tuple(stages),
        input_names=tuple(n.name for n in placeholders),
        shared_params=shared,
        boundary_names=tuple(tuple(n.name for n in b) for b in boundaries),
    )


def _params_of_node(root: torch.nn.Module, n: fx.Node) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters a get_attr / call_module node refers to, with their FQNs in ``root``."""
    if n.op == "get_attr":
        try:
            obj = root.get_parameter(n.target)
        except AttributeError:
            return []
        return [(n.target, obj)]
    if n.op == "call_module":
        sub = root.get_submodule(n.target)
        return [(f"{n.target}.{k}", p) for k, p in sub.named_parameters()]
    return []


def canonical_param_names(module: torch.nn.Module) -> dict[str, str]:
    """Map every parameter alias name of ``module`` to its canonical (first) name.

    ``module.named_parameters(remove_duplicate=False)`` lists tied parameters under each
    alias; the canonical name is the one ``named_parameters()`` reports.
    """
    first: dict[int, str] = {}
    for name, p in module.named_parameters():
        first.setdefault(id(p), name)
    return {name: first[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}
