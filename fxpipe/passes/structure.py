"""Identity of a captured graph by its structure, not by fx node names or hash order.

fx node names (``matmul_3``) are given in tracing order. A model whose forward iterates over
a ``set`` of strings (ModernBERT's ``for layer_type in set(config.layer_types)``) is traced in
an order that depends on ``PYTHONHASHSEED``, so two processes get the same graph with the
names on differently wired nodes. A trace on ``meta`` may also gain ops that do no work (an
``aten.contiguous`` after SDPA) that a CPU trace lacks. A plan's stage map is keyed by the
names of the process that made it; every other process must find the *same* nodes by their
structure. This module does that in three steps:

1. :func:`structural_keys`: a key per OpGraph node of a graph module, a Merkle hash of

   * the node itself: fx op, target, non-tensor arguments (devices left out), the shapes
     and dtypes of its value; a placeholder by its position and value, a parameter or buffer
     (``get_attr``) by its fully qualified name;
   * its ancestors: the keys of its inputs *in argument order* (forward hash);
   * its descendants: the keys of its consumers and the argument position it takes there
     (backward hash), so two equal computations feeding different consumers differ.

   Ops that do no work (:func:`is_trivial`: ``contiguous``, ``alias``, ``clone``, a
   ``view`` / ``reshape`` / ``expand`` to the same shape, a ``to`` that keeps the dtype, all of
   one input with the input's shape and dtype) get no key; every reference to one is read as a
   reference to its input. The keys do not depend on names or on the order of independent nodes.
2. :func:`structure_signature`: the hash of the sorted keys and of the edges as key pairs, the
   identity of the graph (:func:`fxpipe.plan.graph_signature` of a graph that carries the keys).
3. :func:`match_nodes` / :func:`map_stage_of`: a one-to-one matching of a plan's nodes (its
   :class:`~fxpipe.ir.OpGraph` with the keys in ``extra[i]["skey"]``) to another capture's
   nodes: equal keys, ties broken in topological order by the already matched inputs, every
   data edge checked. A stage map keyed by the plan's names becomes one keyed by this
   capture's names; this capture's trivial ops are left to
   :func:`fxpipe.codegen.split.split_stages`, which runs them as late as their consumers allow.
   :func:`align_order` then puts this capture's nodes in the plan's order, so the tensors
   crossing each stage boundary are listed in the same order by every process.

A truly different model (another layer count, width, input shape, parameter name) has
another multiset of keys and is refused with :class:`~fxpipe.errors.InputError` naming the
ops that differ. Keys are 64-bit hashes: a collision is astronomically unlikely and would
still be caught by the edge check unless it also preserved every edge.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from fxpipe.errors import InputError

if TYPE_CHECKING:  # torch is imported where a graph is read: loading a plan's signature needs none
    import torch
    import torch.fx

__all__ = [
    "SKEY",
    "OPKEY",
    "STRUCTURE_VERSION",
    "PlanStructure",
    "is_trivial",
    "structural_keys",
    "structure_signature",
    "graph_preds",
    "match_nodes",
    "align_order",
    "map_stage_of",
]

#: ``OpGraph.extra[i]`` key holding node i's structural key (``""``: a trivial op).
SKEY = "skey"
#: ``OpGraph.extra[i]`` key holding node i's op key (the node without its wiring).
OPKEY = "sop"
#: Bumped whenever the keys change meaning (part of every signature).
STRUCTURE_VERSION = "fxpipe.structure/1"

_KEPT_OPS = ("placeholder", "call_function", "call_module", "call_method", "output")
_CONST_ATTR = re.compile(r"^(_tensor_constant|lifted_tensor_|_lifted_tensor_constant|c_lifted_tensor_)\d+$")


def _kept(n: torch.fx.Node) -> bool:
    """An OpGraph node (:mod:`fxpipe.passes.to_opgraph`'s rule)."""
    return n.op in _KEPT_OPS and not (n.op == "call_module" and n.target == "_guards_fn")


@lru_cache(maxsize=1)
def _trivial_ops() -> frozenset:
    """Ops that return their single input's value and do no work that changes the result (a meta
    trace may add or drop them: ``contiguous`` after SDPA), and shape ops that are identities when
    the output shape equals the input's."""
    import torch

    names = [(n, "default") for n in ("contiguous", "alias", "clone", "lift_fresh_copy", "view", "reshape",
                                       "_unsafe_view", "expand")]
    names += [("to", o) for o in ("dtype", "device", "dtype_layout")]  # a no-op or a move between devices
    ops = (getattr(getattr(torch.ops.aten, n, None), o, None) for n, o in names)
    return frozenset(op for op in ops if op is not None)


def _tensor_sig(v: Any) -> Any:
    import torch

    if isinstance(v, torch.Tensor):
        return ("T", tuple(int(d) if isinstance(d, int) else "sym" for d in v.shape), str(v.dtype))
    if isinstance(v, (list, tuple)):
        return tuple(_tensor_sig(x) for x in v)
    # a scalar, whether a capture keeps it symbolic, specialises it or records no value (LLaVA's
    # image-token count: a SymInt on CPU, no recorded value on meta), is the same kind of value
    if v is None or isinstance(v, (bool, int, float, torch.SymBool, torch.SymInt, torch.SymFloat)):
        return "scalar"
    return type(v).__name__


def is_trivial(node: torch.fx.Node) -> bool:
    """True for an op that does no work on its value (see the module docstring).

    A ``call_function`` of ``contiguous`` / ``alias`` / ``clone`` / ``lift_fresh_copy``, of a
    ``view`` / ``reshape`` / ``_unsafe_view`` / ``expand`` or of a ``to`` (``dtype``, ``device``,
    ``dtype_layout``) with exactly one node input whose recorded value (``meta["val"]``) has the
    output's shape and dtype (a ``to`` may move between devices: not a different model).
    """
    import torch

    if node.op != "call_function" or node.target not in _trivial_ops():
        return False
    ins = node.all_input_nodes
    if len(ins) != 1 or not node.args or node.args[0] is not ins[0]:
        return False
    out, src = node.meta.get("val"), ins[0].meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
        return False
    return _tensor_sig(out) == _tensor_sig(src)


def _hash(obj: Any) -> str:
    return hashlib.blake2b(repr(obj).encode(), digest_size=8).hexdigest()


def target_name(target: Any) -> str:
    """A process-independent name of an fx node's target.

    ``str()`` of an aten overload is its name (``aten.add.Tensor``) but that of a Python function
    (``torch.sym_ite``, ``operator.ge``) is ``<function sym_ite at 0x7f...>``, whose address
    differs in every process: a worker would see another model. Functions are named by module
    and qualified name instead.
    """
    if isinstance(target, str):
        return target
    text = str(target)
    if " at 0x" in text or text.startswith("<"):
        mod = getattr(target, "__module__", None) or ""
        qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__
        return f"{mod}.{qual}" if mod else qual
    return text


def _const(a: Any) -> Any:
    """A name- and device-free form of a non-node argument."""
    import torch

    if isinstance(a, torch.device):
        return "<device>"
    if isinstance(a, (torch.dtype, torch.memory_format, torch.layout)):
        return str(a)
    if isinstance(a, (bool, int, float, str)) or a is None:
        return (type(a).__name__, repr(a))
    if isinstance(a, slice):
        return ("slice", _const(a.start), _const(a.stop), _const(a.step))
    if isinstance(a, torch.Tensor):
        return ("tensor", _tensor_sig(a))
    if callable(a):
        return ("fn", getattr(a, "__module__", ""), getattr(a, "__qualname__", type(a).__name__))
    return (type(a).__name__,)


@dataclass(frozen=True)
class _GraphView:
    """A graph module seen through its trivial ops: the kept nodes, their keys and resolved wiring."""

    nodes: tuple            # OpGraph nodes in program order
    keys: dict              # node -> key ("" for a trivial op)
    preds: dict             # node -> frozenset of resolved non-get_attr OpGraph input nodes
    resolve: dict           # node -> the node it stands for (itself unless trivial)
    ops: dict               # node -> op key: the node alone, its inputs' wiring left out ("" for a trivial op)


def _view(gm: torch.fx.GraphModule) -> _GraphView:
    import torch.fx

    nodes = [n for n in gm.graph.nodes if _kept(n) or n.op == "get_attr"]
    resolve: dict = {}
    for n in nodes:
        resolve[n] = resolve.get(n.args[0], n.args[0]) if _kept(n) and is_trivial(n) else n
    fwd: dict = {}
    ops: dict = {}
    uses: dict = defaultdict(list)  # resolved node -> [(consumer, position)]
    n_ph = 0
    for n in nodes:
        if resolve[n] is not n:
            continue
        if n.op == "get_attr":
            target = str(n.target)
            name = ("const", _tensor_sig(n.meta.get("val"))) if _CONST_ATTR.match(target.rsplit(".", 1)[-1]) \
                else ("attr", target)
            fwd[n] = _hash(name)
            continue
        pos = [0]

        def norm(a, _n=n, _pos=pos, _deep=True):
            if isinstance(a, torch.fx.Node):
                r = resolve.get(a, a)
                if not _deep:  # the op key: a parameter by name, any other input as a bare reference
                    return ("@", fwd.get(r, "?")) if r.op == "get_attr" else ("@",)
                i = _pos[0]
                _pos[0] += 1
                uses[r].append((_n, i))
                return ("@", fwd.get(r, "?"))
            if isinstance(a, (list, tuple)):
                return (type(a).__name__, tuple(norm(x, _deep=_deep) for x in a))
            if isinstance(a, dict):
                return ("dict", tuple((str(k), norm(v, _deep=_deep)) for k, v in a.items()))
            return _const(a)

        if n.op == "placeholder":
            label = ("placeholder", n_ph, _tensor_sig(n.meta.get("val")))
            n_ph += 1
        elif n.op == "output":
            label = ("output", norm(n.args))
        else:
            label = (n.op, target_name(n.target), norm(n.args), norm(dict(n.kwargs)), _tensor_sig(n.meta.get("val")))
        fwd[n] = _hash(label)
        if n.op in ("call_function", "call_module", "call_method"):
            ops[n] = _hash((n.op, target_name(n.target), norm(n.args, _deep=False), norm(dict(n.kwargs), _deep=False),
                            _tensor_sig(n.meta.get("val"))))
        else:
            ops[n] = fwd[n]
    keys: dict = {}
    bwd: dict = {}
    for n in reversed(nodes):
        if resolve[n] is not n:
            continue
        bwd[n] = _hash((fwd[n], tuple(sorted((bwd[u], i) for u, i in uses.get(n, ())))))
    preds: dict = {}
    for n in nodes:
        if not _kept(n):
            continue
        keys[n] = bwd[n] if resolve[n] is n else ""
        preds[n] = frozenset(resolve.get(p, p) for p in n.all_input_nodes
                             if resolve.get(p, p).op != "get_attr" and _kept(resolve.get(p, p)))
    return _GraphView(nodes=tuple(n for n in nodes if _kept(n)), keys=keys, preds=preds, resolve=resolve,
                      ops={n: ops.get(n, "") if keys[n] else "" for n in keys})


def structural_keys(gm: torch.fx.GraphModule) -> dict[str, tuple[str, str]]:
    """The structural key and the op key of every OpGraph node of ``gm`` (fx node name -> pair).

    ``gm`` is a captured graph module (:func:`fxpipe.passes.capture.capture`) whose nodes carry
    ``meta["val"]``. The structural key (16 hex digits, ``""`` for a trivial op) identifies the
    node with its wiring (see the module docstring); the op key hashes the node alone (fx op,
    target, constant arguments, parameter names, shapes and dtypes), for saying which ops differ
    when two graphs do. Neither depends on node names or on the order of independent nodes.
    """
    v = _view(gm)
    return {n.name: (v.keys[n], v.ops[n]) for n in v.nodes}


def _through_trivial(keys: Sequence[str], preds: Sequence[Sequence[int]]) -> list[int | None]:
    """For every node id, the non-trivial node it stands for (a trivial op has at most one input; None
    for a trivial op of a parameter). ``preds`` lists OpGraph predecessors; ids are topological."""
    rep: list[int | None] = []
    for i, k in enumerate(keys):
        rep.append(i if k else (rep[preds[i][0]] if preds[i] else None))
    return rep


def structure_signature(keys: Sequence[str], preds: Sequence[Sequence[int]]) -> str:
    """The identity of a graph (16 hex digits), independent of names, node order and trivial ops.

    A hash of the sorted non-empty structural keys and of the sorted data edges between them as
    key pairs (seen through trivial ops), so an edited edge list changes it too.

    Parameters
    ----------
    keys : sequence of str
        Structural key of every OpGraph node (``""`` for a trivial op), in id order.
    preds : sequence of sequences of int
        OpGraph predecessors of every node; ids are a topological order.
    """
    rep = _through_trivial(keys, preds)
    pairs = sorted(f"{keys[r]}>{k}" for i, k in enumerate(keys) if k
                   for r in {rep[p] for p in preds[i]} if r is not None)
    h = hashlib.sha256(STRUCTURE_VERSION.encode())
    h.update("\x00".join(sorted(k for k in keys if k)).encode())
    h.update(b"\x01")
    h.update("\x00".join(pairs).encode())
    return h.hexdigest()[:16]


def graph_preds(graph) -> tuple[tuple[int, ...], ...]:
    """OpGraph predecessors of every node (ids), from its CSR arrays."""
    return tuple(tuple(int(x) for x in graph.pred_idx[graph.pred_ptr[i]:graph.pred_ptr[i + 1]])
                 for i in range(graph.n))


@dataclass(frozen=True)
class PlanStructure:
    """The part of a plan's :class:`~fxpipe.ir.OpGraph` that matching needs (picklable plain data).

    Attributes
    ----------
    names : tuple[str, ...]
        Node names in the plan's capture, in topological (OpGraph id) order.
    keys : tuple[str, ...]
        Structural key of each node (``""``: a trivial op).
    preds : tuple[tuple[int, ...], ...]
        OpGraph predecessors of each node (ids).
    labels : tuple[str, ...]
        ``"target in module"`` of each node, for error messages.
    input_bytes : tuple[tuple[str, float], ...]
        Name and bytes (one micro-batch) of every placeholder, for error messages.
    ops : tuple[str, ...]
        Op key of each node (``extra[i]["sop"]``; empty for plans without it), for error messages.
    """

    names: tuple
    keys: tuple
    preds: tuple
    labels: tuple
    input_bytes: tuple = ()
    ops: tuple = ()

    @classmethod
    def from_graph(cls, graph) -> "PlanStructure | None":
        """From an OpGraph made by :func:`fxpipe.passes.to_opgraph.to_opgraph`; None for a graph without keys."""
        ext = graph.extra or ()
        if len(ext) != graph.n or not all(SKEY in e for e in ext):
            return None
        preds = graph_preds(graph)
        labels = tuple(_label(e.get("target", ""), e.get("module", "")) for e in ext)
        inputs = tuple((graph.names[i], float(graph.size_out_bytes[i])) for i in range(graph.n)
                       if graph.ops[i] == "placeholder")
        return cls(tuple(graph.names), tuple(str(e[SKEY]) for e in ext), preds, labels, inputs,
                   tuple(str(e.get(OPKEY, "")) for e in ext))


def _label(target: str, module: str) -> str:
    target = str(target)
    m = re.match(r"<(?:built-in )?function (\w+)", target)
    target = m.group(1) if m else target.replace("aten.", "").replace(".default", "")
    return f"{target} in {module}" if module else target


def _shape_text(v: Any) -> str:
    sig = _tensor_sig(v)
    if isinstance(sig, tuple) and sig and sig[0] == "T":
        return f"{list(sig[1])} {sig[2].replace('torch.', '')}"
    return str(sig)


def _bytes(v: Any) -> float:
    import torch

    return float(v.numel() * v.element_size()) if isinstance(v, torch.Tensor) else 0.0


def module_path(node: torch.fx.Node, prefix: str = "") -> str:
    """Innermost ``nn_module_stack`` path of a node, without ``prefix`` (``""`` at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, (tuple, list)) else str(path)
    path = str(path).split("@")[0]
    if path.startswith("L__self__"):
        path = path[len("L__self__"):].lstrip("_.")
    if prefix:
        stem = prefix.rstrip(".")
        if path == stem:
            return ""
        if path.startswith(prefix):
            path = path[len(prefix):]
    return path


def _node_label(n: torch.fx.Node) -> str:
    return _label(str(n.target), module_path(n, n.graph.owning_module.meta.get("fxpipe_module_prefix", "")
                                              if n.graph.owning_module is not None else ""))


def _difference(plan: PlanStructure, view: _GraphView) -> str:
    """What differs, in words: the counts, then the example inputs' sizes, else the ops one side
    lacks (by target and module), else the ops that differ alone (this capture's shapes and dtypes),
    the first in program order first."""
    plan_ops = Counter(plan.labels[i] for i, k in enumerate(plan.keys) if k)
    here_ops = Counter(_node_label(n) for n in view.nodes if view.keys[n])

    def show(c: Counter) -> str:
        items = [f"{k} (x{v})" if v > 1 else k for k, v in list(c.items())[:4]]
        return f"{sum(c.values())} ops: " + ", ".join(items) + (f" and {len(c) - 4} more kinds" if len(c) > 4 else "")

    text = (f"the plan's graph has {sum(plan_ops.values())} ops, this capture {sum(here_ops.values())} (not counting "
            "ops that do no work, such as contiguous)")
    here_in = [(n.name, _bytes(n.meta.get("val"))) for n in view.nodes if n.op == "placeholder"]
    sizes = [f"input {a!r} has {int(y)} bytes per micro-batch here, {int(x)} in the plan"
             for (a, x), (_, y) in zip(plan.input_bytes, here_in) if x != y]
    if sizes:
        return f"{text}; other example input shapes: " + "; ".join(sizes[:3])
    only_plan, only_here = plan_ops - here_ops, here_ops - plan_ops
    with_ops = len(plan.ops) == len(plan.keys) and all(o for o, k in zip(plan.ops, plan.keys) if k)
    if not (only_plan or only_here) and with_ops:
        # the same ops by target and module: compare them alone (shapes, dtypes, arguments, parameters)
        mine = Counter(view.ops[n] for n in view.nodes if view.keys[n])
        theirs = Counter(o for o, k in zip(plan.ops, plan.keys) if k)
        extra, missing = mine - theirs, theirs - mine
        only_plan = Counter(plan.labels[i] for i, o in enumerate(plan.ops) if plan.keys[i] and o in missing)
        only_here = Counter(f"{_node_label(n)} -> {_shape_text(n.meta.get('val'))}" for n in view.nodes
                            if view.keys[n] and view.ops[n] in extra)
    if only_plan or only_here:
        parts = ([f"the plan has {show(only_plan)} that this capture lacks"] if only_plan else []) + \
                ([f"this capture has {show(only_here)} that the plan lacks"] if only_here else [])
        return f"{text}; no counterpart for some: " + "; ".join(parts)
    return f"{text}; the same ops, wired differently"


def match_nodes(plan: PlanStructure, gm: torch.fx.GraphModule) -> dict[str, str]:
    """Match every non-trivial node of a plan to a node of ``gm`` with the same structure.

    Parameters
    ----------
    plan : PlanStructure
        The plan's graph (:meth:`PlanStructure.from_graph`).
    gm : torch.fx.GraphModule
        Another capture of the model (another process, hash seed or device).

    Returns
    -------
    dict[str, str]
        Plan node name -> ``gm`` node name, for every plan node with a key; one to one, onto
        the non-trivial OpGraph nodes of ``gm``; every data edge between matched nodes (seen
        through trivial ops) is an edge of ``gm``.

    Raises
    ------
    InputError
        If the two graphs differ in structure (the message names the ops that differ), or if
        no edge-preserving matching was found among structurally equal nodes.
    """
    view = _view(gm)
    groups: dict[str, list] = defaultdict(list)
    for n in view.nodes:
        if view.keys[n]:
            groups[view.keys[n]].append(n)
    if Counter(k for k in plan.keys if k) != Counter({k: len(v) for k, v in groups.items()}):
        raise InputError(
            "the model's captured graph differs from the one this plan was made for (different model, config or "
            f"example input shapes): {_difference(plan, view)}; build the plan from the model it was compiled for "
            "(same config, same micro-batch shapes), or run fxpipe.compile again"
        )

    rep = _through_trivial(plan.keys, plan.preds)  # the plan's nodes seen through its trivial ops
    used: set = set()
    image: dict[int, torch.fx.Node] = {}
    for i, k in enumerate(plan.keys):  # ids are a topological order
        if not k:
            continue
        want = frozenset(image[r] for r in (rep[p] for p in plan.preds[i]) if r is not None)
        cand = [n for n in groups[k] if n not in used]
        pick = next((n for n in cand if view.preds[n] == want), None)
        if pick is None:
            raise InputError(
                f"could not match the plan's node {plan.names[i]!r} ({plan.labels[i]}) to this capture: "
                f"{len(cand)} nodes have its structure but none is wired to the matched inputs; the model's graph "
                "differs from the plan's; run fxpipe.compile again"
            )
        used.add(pick)
        image[i] = pick
    return {plan.names[i]: n.name for i, n in image.items()}


def align_order(plan: PlanStructure, names: Mapping[str, str], gm: torch.fx.GraphModule) -> None:
    """Reorder ``gm``'s nodes (in place) so that its matched nodes run in the plan's order.

    Everything :func:`fxpipe.codegen.split.split_stages` derives from program order (the order
    of the tensors crossing each stage boundary, of a stage's parameters) must be the same in
    every process, or a receiving rank reads another rank's tensors in another order: a size
    mismatch at best (gloo aborts), silently swapped equal-shaped tensors at worst. Two
    captures that differ in hash order (``PYTHONHASHSEED``) differ exactly there, so every
    capture adopts the plan's order, a topological order of the same graph.

    A stable topological sort (Kahn 1962, with a priority queue): placeholders first in their
    own order; a matched node by its position in the plan; every other node (``get_attr``,
    ``getitem``, trivial ops, the output) right after the matched node that precedes it in
    ``gm``, ``get_attr`` nodes by target name (their order in ``gm`` may follow hash order too).
    Edges are kept, so the program computes the same values; ``gm`` is recompiled.

    Parameters
    ----------
    plan : PlanStructure
        The plan's graph.
    names : Mapping[str, str]
        Plan node name -> ``gm`` node name (:func:`match_nodes`).
    gm : torch.fx.GraphModule
        The capture to reorder.
    """
    import heapq

    nodes = list(gm.graph.nodes)
    plan_pos = {p: i for i, p in enumerate(plan.names)}
    here_pos = {here: plan_pos[p] for p, here in names.items()}
    prio: dict = {}
    anchor = -1
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            prio[n] = (-2, 0, "", i)
        elif n.name in here_pos:
            anchor = here_pos[n.name]
            prio[n] = (anchor, 0, "", i)
        elif n.op == "output":
            prio[n] = (len(plan.names), 2, "", i)
        else:
            prio[n] = (anchor, 1, str(n.target) if n.op == "get_attr" else "", i)
    indegree = {n: len(n.all_input_nodes) for n in nodes}
    ready = [prio[n] for n in nodes if not indegree[n]]  # priorities are unique (the last item is gm's index)
    heapq.heapify(ready)
    order = []
    while ready:
        n = nodes[heapq.heappop(ready)[-1]]
        order.append(n)
        for user in n.users:
            indegree[user] -= 1
            if not indegree[user]:
                heapq.heappush(ready, prio[user])
    if len(order) != len(nodes):  # pragma: no cover - a graph module is acyclic
        raise InputError("the captured graph has a cycle: it cannot be reordered into the plan's order")
    if order == nodes:
        return
    first = nodes[0]
    if order[0] is not first:
        first.prepend(order[0])
    for prev, n in zip(order, order[1:]):
        prev.append(n)
    gm.recompile()


def map_stage_of(plan: PlanStructure, stage_of: Mapping[str, int], gm: torch.fx.GraphModule) -> dict[str, int]:
    """A plan's stage map (keyed by the plan's node names) for another capture ``gm`` of the model.

    The stage of every matched node (:func:`match_nodes`); ``gm``'s trivial ops are left out
    (:func:`fxpipe.codegen.split.split_stages` places them as late as their consumers allow),
    and so are the plan's trivial ops that ``gm`` lacks. ``gm``'s nodes are reordered into the
    plan's order first (:func:`align_order`, in place), so every process splits them alike.

    Raises
    ------
    InputError
        As :func:`match_nodes`.
    """
    names = match_nodes(plan, gm)
    align_order(plan, names, gm)
    return {here: int(stage_of[p]) for p, here in names.items()}
