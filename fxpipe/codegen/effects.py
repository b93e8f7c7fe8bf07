"""Side effects in a captured graph: aliasing, in-place writes, state mutation, random ops.

``torch.export`` (training IR) keeps in-place ops: ``h += x`` is ``aten.add_(h, x)``, a view
``c[:, :4]`` is ``aten.slice`` aliasing ``c``, BatchNorm in training mode updates its running
statistics inside ``aten.batch_norm`` and its counter with ``aten.add_(num_batches_tracked, 1)``.
A pipeline executes a graph on several processes, one micro-batch at a time, so the code
generator must know

* the **alias base** of every tensor (views and in-place results share their input's storage),
* which nodes **write** which base (from the op schema's ``Tensor(a!)`` annotations; ops tagged
  ``maybe_aliasing_or_mutating`` such as ``aten.batch_norm`` are assumed to write the state
  tensors - parameters, buffers, constants - they receive),
* which nodes **access** each base (read or write; a pure view is not an access, its users are),
* which ops draw **random numbers** (``Tag.nondeterministic_seeded``; dropout counts only with
  ``p > 0`` in training mode).

Everything is conservative: an unknown op is assumed to produce a fresh tensor and write
nothing unless its schema says otherwise; over-approximating writes only adds placement
constraints and clones, never wrong results. Aliases are not over-approximated: an op whose
schema says its output *may* alias its input (``contiguous``, ``reshape``, ``to``) is a view only
when the capture's values (``node.meta["val"]``, fake tensors that keep storage identity) share
the input's storage; when it copied, it is a fresh tensor (a split that took the copy for a view
recomputed it on a later stage from the input, without the in-place updates made to the copy). Op schemas are read through
:func:`fxpipe.codegen.runtime.op_aliasing` (the one module with private torch APIs).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

__all__ = ["GraphEffects", "analyze", "RandomOp", "random_ops"]

_COMPUTE = ("call_function", "call_method", "call_module")
#: tensor methods that return a view of ``self`` (graphs from ``torch.fx.symbolic_trace``)
_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "expand", "expand_as", "narrow",
    "select", "squeeze", "unsqueeze", "flatten", "unflatten", "contiguous", "split", "chunk", "unbind",
    "diagonal", "as_strided", "movedim", "swapaxes", "unfold", "detach", "T", "mT",
})


@dataclass
class GraphEffects:
    """Aliasing and side effects of one graph (see the module docstring).

    Attributes
    ----------
    base : dict[Node, Node]
        Alias base of every tensor-valued node (itself when it owns fresh storage; the
        ``get_attr`` node for views of parameters and buffers).
    views : set[Node]
        Nodes whose output aliases an input without writing (pure views).
    writes : list[tuple[Node, Node]]
        ``(writer, base)`` pairs in program order.
    accesses : dict[Node, list[Node]]
        Base -> nodes reading or writing it (program order); pure views are not accesses,
        their users are.
    state_target : dict[Node, str]
        ``get_attr`` base node -> attribute target (parameters, buffers, constants).
    inplace_source : dict[Node, Node]
        In-place op node -> the input it updates and returns (``add_(h, x)`` -> ``h``).
    """

    base: dict[fx.Node, fx.Node] = field(default_factory=dict)
    views: set[fx.Node] = field(default_factory=set)
    writes: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)
    accesses: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    state_target: dict[fx.Node, str] = field(default_factory=dict)
    inplace_source: dict[fx.Node, fx.Node] = field(default_factory=dict)

    def written_bases(self) -> set[fx.Node]:
        """Bases written by at least one node."""
        return {b for _, b in self.writes}

    def written_state(self) -> dict[str, list[fx.Node]]:
        """Attribute target -> nodes accessing it, for every parameter/buffer/constant written in the graph."""
        out: dict[str, list[fx.Node]] = {}
        written = self.written_bases()
        for b, tgt in self.state_target.items():
            if b in written:
                out.setdefault(tgt, []).extend(self.accesses.get(b, []))
        return out


def _arg_value(node: fx.Node, index: int, name: str, default=None):
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def _tensor_nodes(value) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.map_arg(value, lambda n: out.append(n))
    return out


def _call_effects(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node], bool]:
    """``(written inputs, aliased inputs, returns a list of aliases)`` of one compute node."""
    from fxpipe.codegen.runtime import op_aliasing  # lazy: torch.distributed.pipelining; planning imports this module

    if node.op == "call_method":
        name = str(node.target)
        first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if first is None:
            return [], [], False
        if name.endswith("_") and not name.startswith("__"):
            return [first], [first], False
        if name in _VIEW_METHODS:
            return [], [first], name in ("split", "chunk", "unbind")
        return [], [], False
    if node.op != "call_function":
        return [], [], False
    if node.target is operator.getitem:
        src = node.args[0]
        if isinstance(src, fx.Node) and isinstance(src.meta.get("val"), torch.Tensor):
            return [], [src], False  # indexing a tensor (symbolic_trace graphs): may be a view
        return [], [], False
    info = op_aliasing(node.target)
    if info is None:
        return [], [], False
    written: list[fx.Node] = []
    aliased: list[fx.Node] = []
    for i, (name, is_write, alias_set, _) in enumerate(info.arguments):
        val = _arg_value(node, i, name)
        nodes = [v for v in _tensor_nodes(val)] if val is not None else []
        if is_write:
            written += nodes
        if alias_set and alias_set & info.return_alias_sets:
            aliased += nodes
    if info.maybe_mutating and not info.nondeterministic:
        # e.g. aten.batch_norm updating its running statistics: the schema does not say
        for n in node.all_input_nodes:
            if n.op == "get_attr" and n not in written:
                written.append(n)
    return written, aliased, info.returns_alias_list


def _copied(node: fx.Node, src: fx.Node) -> bool:
    """Whether the capture's values say ``node``, an op whose schema lets its output alias ``src``
    (``Tensor(a)``), returned fresh storage instead: ``contiguous`` of a non-contiguous tensor,
    ``reshape`` of one no view can reshape. Such an output is a copy: an in-place update of it does
    not reach ``src``, and recomputing it on a later stage from ``src`` would lose the updates (BEiT's
    relative position index: ``permute(...).contiguous()`` then ``+=`` on a slice, issue 30 item 15).
    False when the values are unknown (then the alias is kept: a view is assumed)."""
    from fxpipe.codegen.runtime import shares_storage  # lazy: see _call_effects

    return shares_storage(node.meta.get("val"), src.meta.get("val")) is False


def analyze(gm: fx.GraphModule) -> GraphEffects:
    """Aliasing, writes and accesses of every node of ``gm``.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        A captured graph (ATen training IR from ``torch.export``, or any fx graph: tensor
        methods ending in ``_`` write ``self``, view methods alias it).

    Returns
    -------
    GraphEffects
        One pass over the nodes in program order; the base of a node is found through the
        alias annotations of its op schema (``Tensor(a)`` views, ``Tensor(a!)`` in-place
        results, ``Tensor(a)[]`` view lists followed through ``getitem``).
    """
    eff = GraphEffects()
    alias_lists: dict[fx.Node, fx.Node] = {}  # node returning a list of views -> its base
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            eff.base[n] = n
            eff.state_target[n] = str(n.target)
            continue
        if n.op == "placeholder":
            eff.base[n] = n
            continue
        if n.op == "output":
            for p in n.all_input_nodes:
                b = eff.base.get(p, p)
                eff.accesses.setdefault(b, []).append(n)
            continue
        if n.op == "call_function" and n.target is operator.getitem and n.args and n.args[0] in alias_lists:
            eff.base[n] = alias_lists[n.args[0]]
            eff.views.add(n)
            continue
        written, aliased, list_alias = _call_effects(n)
        if aliased and not written and not list_alias and _copied(n, aliased[0]):
            aliased = []  # a may-alias op that copied (contiguous of a non-contiguous tensor): fresh storage
        bases_written = []
        for w in written:
            b = eff.base.get(w, w)
            bases_written.append(b)
            eff.writes.append((n, b))
        if aliased:
            b = eff.base.get(aliased[0], aliased[0])
            if list_alias:
                alias_lists[n] = b
            eff.base[n] = b
            if not written:
                eff.views.add(n)
            elif not list_alias:
                eff.inplace_source[n] = aliased[0]
        else:
            eff.base[n] = n
        if n in eff.views:
            continue  # a pure view reads nothing; its users do
        seen = set()
        for p in n.all_input_nodes:
            b = eff.base.get(p, p)
            if b not in seen:
                seen.add(b)
                eff.accesses.setdefault(b, []).append(n)
        for b in bases_written:
            if b not in seen:
                seen.add(b)
                eff.accesses.setdefault(b, []).append(n)
    return eff


@dataclass(frozen=True)
class RandomOp:
    """A node that draws random numbers when the graph runs."""

    node: str
    target: str
    module: str

    def __str__(self) -> str:
        where = f" in {self.module}" if self.module else ""
        return f"{self.node} ({self.target}){where}"


#: schema arguments that switch a seeded op off: a probability 0, or training mode off
_PROB_ARGS = ("p", "dropout_p")
_TRAIN_ARGS = ("train", "training")


def random_ops(gm: fx.GraphModule) -> list[RandomOp]:
    """The nodes of ``gm`` that draw random numbers: every op tagged ``nondeterministic_seeded``
    (``rand``, ``randn``, ``bernoulli``, ``dropout``, ``scaled_dot_product_attention``, ...) unless
    its probability argument (``p``, ``dropout_p``) is 0 or its ``train`` argument is False.

    A pipeline draws them in another order, on other processes, than a single-process run, so
    with any of these active the two cannot agree bit for bit.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        A captured graph.

    Returns
    -------
    list[RandomOp]
        In program order, with the module path each op belongs to.
    """
    from fxpipe.codegen.runtime import op_aliasing  # lazy: torch.distributed.pipelining; planning imports this module

    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        info = op_aliasing(n.target)
        if info is None or not info.nondeterministic:
            continue
        inactive = False
        for i, (name, _, _, default) in enumerate(info.arguments):
            val = _arg_value(n, i, name, default)
            if name in _PROB_ARGS and isinstance(val, (int, float)) and not isinstance(val, bool) and val == 0:
                inactive = True  # dropout(p=0), scaled_dot_product_attention(dropout_p=0)
            if name in _TRAIN_ARGS and val is False:
                inactive = True  # dropout(train=False)
        if inactive:
            continue
        stack = n.meta.get("nn_module_stack") or {}
        module = ""
        if stack:
            last = list(stack.values())[-1]
            module = str(last[0] if isinstance(last, (tuple, list)) else last)
        out.append(RandomOp(n.name, str(n.target), module))
    return out
