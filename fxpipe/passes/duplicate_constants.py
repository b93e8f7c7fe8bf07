"""Recompute cheap constant tensors in every layer that reads them instead of relaying them.

A decoder builds some tensors from nothing but constants, buffers and the (static) shapes of
one micro-batch: the causal mask (``arange``, comparisons, ``&``), the position ids, the
rotary ``cos`` / ``sin`` tables (from the ``inv_freq`` buffer). torch.export computes each
of them once, before the first layer, and every layer reads the same node; a pipeline split
then sends it from the stage that computes it through every later stage (Contract 2's relay:
Llama-3-70B at 4096 tokens relays about 19 MB per micro-batch to every stage, and each stage
keeps a receive buffer for it). :func:`duplicate_constants` rewrites the captured graph so
that each *layer* (each element of an ``nn.ModuleList``) that reads such a tensor computes
its own copy of the subgraph that makes it. The copies are ordinary ops of the OpGraph, costed
like any other: the partitioner places a copy with its layer (nothing crosses a boundary) or,
when that is cheaper, elsewhere, and the partition's time and memory tables count what each
stage computes and keeps.

Constant nodes
    A node is *constant* when its value is the same for every micro-batch: a ``get_attr``
    of a tensor that does not require grad (a buffer or a lifted constant), or a
    ``call_function`` of an ATen op (or ``getitem``) whose node inputs are all constant, that
    draws no random numbers (``Tag.nondeterministic_seeded``), is not tagged
    ``maybe_aliasing_or_mutating``, writes none of its inputs and has a size known at capture
    time (no unbacked symbol). A tensor that the graph updates in place (and every view of it)
    is not constant. Anything computed from a model input (``placeholder``: ``input_ids``, an
    ``attention_mask`` input) or from a trainable parameter is not constant, so an
    input-dependent mask stays where it is: only stage 0 receives the model's inputs, and it
    is relayed as before.
Groups
    A constant node read by a non-constant node is a *frontier* tensor. Its non-constant
    readers are grouped by the layer they belong to: the module path up to its first numeric
    component (``model.layers.7.self_attn`` -> ``model.layers.7``), else its first component
    (``block1``); readers at the top level keep the original. The first group in program
    order keeps the original nodes, every other group gets one copy of the frontier tensors it
    reads and of their constant ancestors (shared ancestors are copied once per group),
    inserted just before the group's first reader. A copy stops at ancestors with fewer than
    ``numel(frontier) / SMALL_RATIO`` elements (``SMALL_RATIO = 16``: the index vectors a
    4096 x 4096 mask is compared from), at ``get_attr`` nodes and at constructors other
    than ``full`` / ``ones`` / ``zeros`` (an ``arange``): those are read as they are (relayed,
    a few kilobytes).
Decision rule (per frontier tensor, from shapes only, so every process that captures the
model takes the same decision)
    Duplicate when recomputing costs less than relaying the tensor:
    ``traffic + LAUNCH_ELEMENTS * kernels <= RECOMPUTE_RATIO * numel(frontier)``, where
    ``kernels`` are the copy's ops that do work (views, ``getitem`` and no-op conversions are
    free), ``traffic`` the elements they read and write, ``LAUNCH_ELEMENTS = 2**22`` the
    traffic that takes as long as a kernel launch (5 us at 3.35 TB/s of 4-byte elements) and
    ``RECOMPUTE_RATIO = 16``; and the copy has at most :data:`MAX_CONE_OPS` kernels and no
    matmul-class op (one torch's FLOP counter knows, or a matmul, convolution or attention
    composite of :mod:`fxpipe.passes.costing`: no "cheap" table needs one). Element counts
    rather than bytes keep the decision independent of the dtype a model is captured in.
    Why 16: memory bandwidth is 7.4x the per-direction device-to-device bandwidth on an H100
    SXM (3.35 TB/s vs 450 GB/s), 10.7x on an H200 and tens of times over PCIe or InfiniBand,
    and elements on the link are at least as wide as those of a mask (1-byte booleans), so a
    copy within the bound takes at most about as long as sending the tensor two stages on an
    H100 (a relayed tensor is sent through every stage between its producer and its reader,
    and each of them holds a receive buffer for it per micro-batch in flight). For Llama-3-70B
    at 4096 tokens the causal mask (16.8M elements: 4 kernels, about 7 elements of traffic
    per element, 8 with the launches) is duplicated; the rotary ``cos`` / ``sin`` tables (0.5M
    elements, 5 kernels each: about 48 per element with the launches) are not, they are
    relayed as before (1 MB each).
Input-dependent tensors
    Not duplicated (see *Constant nodes*): an ``attention_mask`` given as a model input is
    relayed from stage 0, which alone receives the model's inputs.

Placement
    A copy has no input but constants, so nothing would tie it to its layer: a partitioner
    minimising the bottleneck stage could compute every copy on stage 0 and relay them all,
    and the chain of layers (:mod:`fxpipe.partition.chain`) would lose its gates (a copy is
    comparable with no op of the layers before). Each copy therefore reads what it takes from
    outside itself (a small constant, a buffer) through ``type_as(x, e)``, with ``e`` an empty
    view of a non-constant input ``h`` of the layer's first reader, and a ``full`` / ``ones`` /
    ``zeros`` root becomes ``new_full(e, ...)`` etc.: three shape-only ops (no memory read, no
    time, no gradient to ``h``) that put the copy downstream of its layer's input. In an
    attention layer ``h`` is often the query, split over the heads under tensor parallelism;
    the empty view (a static ``(0,)`` tensor) reads no element of it, so the tensor-parallel
    finder replicates it without cutting the attention region and the runtime computes it from
    the rank's local heads (:func:`fxpipe.passes.tensor_parallel.reads_no_value`).

The graph's outputs are unchanged (the copies compute the same values with the same ops);
node names of the original graph are kept, copies are named ``<original>_dup<g>`` for
group ``g`` (0 keeps the originals). What a stage computes is then exactly what the OpGraph
costs: two layers on one stage each compute their copy (for Llama-3-70B's mask 55 us
per layer and micro-batch on h100-sxm, counted in the plan), and each layer's attention
saves its own copy for the backward (counted in its ``act_bytes``). Not done: one copy per
stage (merging the copies of the layers a stage holds, which the plan would then over-count),
and computing a constant once per step instead of once per micro-batch (held like a buffer).

References
----------
Recomputing cheap values instead of communicating them is rematerialization (Chen et al.,
"Training deep nets with sublinear memory cost", 2016); torch.fx ``Graph.node_copy``.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

__all__ = ["RECOMPUTE_RATIO", "LAUNCH_ELEMENTS", "SMALL_RATIO", "MAX_CONE_OPS", "DUPLICATED_KEY", "REPORT_KEY",
           "DuplicationReport", "constant_nodes", "duplicate_constants"]

#: Duplicate a frontier tensor when its copy costs at most this many elements of traffic (launches included)
#: per element of the tensor.
RECOMPUTE_RATIO = 16.0
#: A kernel launch, counted as the elements of memory traffic that take as long (5 us at 3.35 TB/s of 4-byte elements).
LAUNCH_ELEMENTS = 1 << 22
#: A layer's copy stops at constant tensors this many times smaller than the one it makes (they are relayed).
SMALL_RATIO = 16.0
#: Cones with more compute ops are not duplicated (a long chain is not a "cheap table").
MAX_CONE_OPS = 64
#: ``node.meta`` key set on every copy: the name of the node it copies.
DUPLICATED_KEY = "fxpipe_duplicate_of"
#: ``gm.meta`` key holding the :class:`DuplicationReport` as a dict.
REPORT_KEY = "fxpipe_duplicated_constants"

_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")


@dataclass
class DuplicationReport:
    """What :func:`duplicate_constants` did.

    Attributes
    ----------
    duplicated : dict[str, int]
        Frontier node name -> copies made (groups beyond the first).
    kept : dict[str, str]
        Frontier node name -> why it was not duplicated (``"expensive: ..."``: too many ops, a
        matmul-class op, or the traffic per element over the bound).
    nodes_added : int
        Nodes inserted in the graph (the copies and the shape-only ops tying them to their layer).
    """

    duplicated: dict[str, int] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    nodes_added: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"duplicated": dict(self.duplicated), "kept": dict(self.kept), "nodes_added": self.nodes_added}


def _numel(val: Any) -> int:
    from fxpipe.passes.fx_util import _leaves, _to_int

    total = 0
    for t in _leaves(val):
        if isinstance(t, torch.Tensor):
            n = 1
            for s in t.shape:
                n *= _to_int(s)
            total += n
    return total


def constant_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The constant nodes of ``gm`` (see the module docstring), ``get_attr`` nodes included.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        A captured, unlifted graph (:func:`fxpipe.passes.capture.capture`); nodes carry ``meta["val"]``.
    """
    from fxpipe.codegen.effects import analyze
    from fxpipe.codegen.runtime import op_aliasing
    from fxpipe.passes.fx_util import getattr_path, has_data_dependent_size

    eff = analyze(gm)
    written = eff.written_bases()
    const: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = getattr_path(gm, n.target)
            if isinstance(obj, torch.Tensor) and not obj.requires_grad and n not in written:
                const.add(n)
            continue
        if n.op != "call_function":
            continue
        if eff.base.get(n, n) in written or not all(i in const for i in n.all_input_nodes):
            continue
        if n.target is not operator.getitem:
            info = op_aliasing(n.target)
            if info is None or info.nondeterministic or info.maybe_mutating or any(w for _, w, _, _ in info.arguments):
                continue
        if has_data_dependent_size(n):
            continue
        const.add(n)
    return const


def _is_free(n: torch.fx.Node) -> bool:
    """No memory traffic: views, ``getitem``, no-op conversions and copies of one input."""
    from fxpipe.codegen.runtime import op_aliasing
    from fxpipe.passes.structure import is_trivial

    if n.op == "get_attr" or n.target is operator.getitem or is_trivial(n):
        return True
    info = op_aliasing(n.target)
    return info is not None and bool(info.return_alias_sets) and not any(w for _, w, _, _ in info.arguments)


def _has_flops(n: torch.fx.Node) -> bool:
    """A matmul-class op: one torch's FLOP counter knows, or a composite the cost model counts FLOPs of."""
    from torch.utils.flop_counter import flop_registry

    from fxpipe.passes.op_families import ATTENTION, FLOP_COMPOSITE, MATMUL_COMPOSITE

    packet = getattr(n.target, "overloadpacket", None)
    return packet is not None and (packet in flop_registry or packet in MATMUL_COMPOSITE or packet in FLOP_COMPOSITE
                                   or packet in ATTENTION)


def _group_key(n: torch.fx.Node, prefix: str) -> str | None:
    from fxpipe.passes.structure import module_path

    path = module_path(n, prefix)
    if not path:
        return None
    m = _LAYER.match(path)
    return m.group(1) if m else path.split(".")[0]


def duplicate_constants(gm: torch.fx.GraphModule, *, ratio: float = RECOMPUTE_RATIO,
                        max_cone_ops: int = MAX_CONE_OPS) -> DuplicationReport:
    """Give every layer that reads a cheap constant tensor its own copy of the ops making it (in place).

    Parameters
    ----------
    gm : torch.fx.GraphModule
        A captured, unlifted graph (:func:`fxpipe.passes.capture.capture`); nodes carry
        ``meta["val"]`` and ``meta["nn_module_stack"]``. Modified in place and recompiled when
        anything was copied; ``gm.meta["fxpipe_duplicated_constants"]`` holds the report.
    ratio : float
        :data:`RECOMPUTE_RATIO`: the largest traffic (launches included) of a copy per element of
        the frontier tensor.
    max_cone_ops : int
        :data:`MAX_CONE_OPS`.

    Returns
    -------
    DuplicationReport
        Which frontier tensors were copied how many times, which were kept and why.
    """
    report = DuplicationReport()
    const = constant_nodes(gm)
    if not const:
        gm.meta[REPORT_KEY] = report.as_dict()
        return report
    prefix = gm.meta.get("fxpipe_module_prefix", "")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    cone_cache: dict[torch.fx.Node, frozenset] = {}

    def cone(f: torch.fx.Node) -> frozenset:
        """What a layer copies to compute frontier tensor ``f``: ``f`` and its constant compute
        ancestors, up to (excluding) the ones of fewer than ``numel(f) / SMALL_RATIO`` elements,
        which are read as they are (relayed: their bytes are negligible)."""
        got = cone_cache.get(f)
        if got is None:
            floor = _numel(f.meta.get("val")) / SMALL_RATIO
            acc, stack = set(), [f]
            while stack:
                m = stack.pop()
                if m in acc or m.op != "call_function" or (m is not f and _numel(m.meta.get("val")) < floor):
                    continue
                if not m.all_input_nodes and m.target not in _NEW_VARIANT and m is not f:
                    continue  # e.g. an arange: read as it is, through the layer's anchor
                acc.add(m)
                stack.extend(m.all_input_nodes)
            got = cone_cache[f] = frozenset(acc)
        return got

    # frontier tensors (constant, read by a non-constant node), the decision, and what each group reads
    readers: dict[str | None, list[tuple[torch.fx.Node, torch.fx.Node]]] = {}  # group -> (frontier, reader)
    for n in gm.graph.nodes:
        if n not in const or n.op != "call_function":
            continue
        users = sorted((u for u in n.users if u not in const), key=order.__getitem__)
        if not users:
            continue
        c = cone(n)
        ops = [m for m in c if not _is_free(m)]
        if len(ops) > max_cone_ops:
            report.kept[n.name] = f"expensive: {len(ops)} ops"
            continue
        if any(_has_flops(m) for m in ops):
            report.kept[n.name] = "expensive: a matmul-class op"
            continue
        traffic = sum(_numel(m.meta.get("val")) + sum(_numel(i.meta.get("val")) for i in set(m.all_input_nodes))
                      for m in ops) + LAUNCH_ELEMENTS * len(ops)
        size = max(_numel(n.meta.get("val")), 1)
        if traffic > ratio * size:
            report.kept[n.name] = f"expensive: {traffic / size:.1f} elements of traffic per element"
            continue
        for u in users:
            readers.setdefault(_group_key(u, prefix), []).append((n, u))
    layered = [g for g in readers if g is not None]
    if not layered:
        gm.meta[REPORT_KEY] = report.as_dict()
        return report
    first = {g: min((u for _, u in readers[g]), key=order.__getitem__) for g in layered}
    layered.sort(key=lambda g: order[first[g]])
    cones = {g: frozenset().union(*(cone(n) for n, _ in readers[g])) for g in readers}
    # owner: the group that reads a node's original (top-level readers, else the first layer),
    # provided every constant input of the node is read as the original by the same group
    owner: dict[torch.fx.Node, str | None] = {}
    for g in [None, *layered]:
        for m in cones.get(g, ()):
            owner.setdefault(m, g)
    nobody = object()
    for m in sorted(owner, key=order.__getitem__):
        if any(owner.get(i, owner[m]) != owner[m] for i in m.all_input_nodes if i.op == "call_function"):
            owner[m] = nobody
    for gi, g in enumerate(layered):  # group gi (in program order; 0 keeps the originals) names its copies _dup<gi>
        todo = sorted((m for m in cones[g] if owner[m] != g), key=order.__getitem__)
        if not todo:
            continue
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        with gm.graph.inserting_before(first[g]):
            tie = _Anchor(gm.graph, first[g], const)
            for m in todo:
                new = tie.copy(m, env, name=f"{m.name}_dup{gi}")
                new.meta = dict(m.meta)
                new.meta[DUPLICATED_KEY] = m.name
                env[m] = new
                report.nodes_added += 1
            report.nodes_added += tie.added
        for n in dict.fromkeys(n for n, _ in readers[g] if n in env):
            report.duplicated[n.name] = report.duplicated.get(n.name, 0) + 1
        for n, u in readers[g]:
            if n in env:
                u.replace_input_with(n, env[n])
    _stable_topological_order(gm.graph)
    from fxpipe.passes.fx_util import remove_dead_code

    gm.graph.lint()
    remove_dead_code(gm)
    gm.recompile()
    gm.meta[REPORT_KEY] = report.as_dict()
    return report


def _stable_topological_order(graph: torch.fx.Graph) -> None:
    """Move nodes so that every node follows its inputs, keeping the program order otherwise
    (Kahn's algorithm, always taking the earliest ready node); a no-op on a valid order."""
    import heapq

    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    if all(pos[i] < pos[n] for n in nodes for i in n.all_input_nodes):
        return
    indeg = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [pos[n] for n in nodes if indeg[n] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        out.append(n)
        for u in n.users:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, pos[u])
    prev = out[0]
    for n in out[1:]:
        prev.append(n)
        prev = n


aten = torch.ops.aten
#: Constructors without a tensor input, and the ``new_*`` form a copy uses to read the layer's anchor.
_NEW_VARIANT = {aten.full.default: aten.new_full.default, aten.ones.default: aten.new_ones.default,
                aten.zeros.default: aten.new_zeros.default}


class _Anchor:
    """Ties one layer's copies to the layer's data: every input a copy reads from outside the copy
    (a small constant, a buffer) is read through ``type_as(x, e)``, and a constructor (``full``,
    ``ones``, ``zeros``) becomes its ``new_*`` form on ``e``, where ``e`` is an empty view
    (``as_strided(h, [0], [1], 0)``, viewed as the dtype needed) of ``h``, a non-constant input
    of the layer's first reader. ``type_as`` to the same dtype returns its input and the views
    read no memory: values, gradients (``h`` gets none through ``e``) and costs (all three are
    shape-only ops) are unchanged, but the copy is now downstream of the layer's input, so
    the partitioner cannot hoist it to an earlier stage and the chain of layers keeps its
    gates (:mod:`fxpipe.partition.chain`). Under tensor parallelism ``h`` may be sharded: the
    empty view is read from the rank's local tensor (role ``shape`` of
    :mod:`fxpipe.passes.tensor_parallel`), no communication."""

    def __init__(self, graph: torch.fx.Graph, reader: torch.fx.Node, const: set):
        self.graph = graph
        self.h = next((i for i in reader.all_input_nodes
                       if i not in const and isinstance(i.meta.get("val"), torch.Tensor)), None)
        self.empty: dict[torch.dtype, torch.fx.Node] = {}
        self.tied: dict[torch.fx.Node, torch.fx.Node] = {}
        self.added = 0

    def _node(self, target, args, kwargs, val) -> torch.fx.Node:
        node = self.graph.create_node("call_function", target, args, kwargs)
        node.meta = {"val": val, **({"nn_module_stack": self.h.meta["nn_module_stack"]}
                                    if "nn_module_stack" in self.h.meta else {})}
        self.added += 1
        return node

    def empty_of(self, dtype: torch.dtype) -> torch.fx.Node:
        e = self.empty.get(dtype)
        if e is None:
            hv = self.h.meta["val"]
            base = self.empty.get(hv.dtype)
            if base is None:
                base = self.empty[hv.dtype] = self._node(aten.as_strided.default, (self.h, [0], [1], 0), {},
                                                         hv.new_empty_strided((0,), (1,)))
            e = base if dtype == hv.dtype else self._node(aten.view.dtype, (base, dtype), {},
                                                          hv.new_empty_strided((0,), (1,), dtype=dtype))
            self.empty[dtype] = e
        return e

    def read(self, x: Any, env: dict) -> Any:
        """The argument ``x`` of a copy: its copy, or ``x`` read through the anchor."""
        if not isinstance(x, torch.fx.Node):
            return x
        if x in env:
            return env[x]
        val = x.meta.get("val")
        if self.h is None or x.op not in ("call_function", "get_attr") or not isinstance(val, torch.Tensor):
            return x
        t = self.tied.get(x)
        if t is None:
            t = self.tied[x] = self._node(aten.type_as.default, (x, self.empty_of(val.dtype)), {}, val)
        return t

    def copy(self, m: torch.fx.Node, env: dict, *, name: str) -> torch.fx.Node:
        args = torch.fx.node.map_arg(m.args, lambda x: self.read(x, env))
        kwargs = torch.fx.node.map_arg(m.kwargs, lambda x: self.read(x, env))
        target = m.target
        if target in _NEW_VARIANT and self.h is not None:  # full(size, ...) -> new_full(e, size, ...)
            val = m.meta["val"]
            kwargs = {**kwargs, "dtype": kwargs.get("dtype") or val.dtype,
                      "device": kwargs.get("device", val.device)}
            args, target = (self.empty_of(val.dtype), *args), _NEW_VARIANT[target]
        return self.graph.create_node("call_function", target, args, kwargs, name=name)
