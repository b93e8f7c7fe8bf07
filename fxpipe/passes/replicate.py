"""Capture a deep model by exporting three of its layers and replicating the middle one.

``torch.export`` traces every layer of a model, so its time grows with depth (about 7 s for
the 80 layers of Llama-3-70B on this machine, idle). When a model's layers are structurally
identical, the graph of layer i is the graph of layer 1 with layer i's parameters, so
:func:`capture_replicated`:

1. finds the largest ``nn.ModuleList`` whose children have the same class, the same
   parameter and buffer names, shapes and dtypes, the same simple attributes (except layer
   indices such as ``layer_idx``) and no hooks (:func:`find_layer_stack`);
2. swaps it, for the duration of one export only, for the list of layers ``0``, ``L//2`` and
   ``L-1`` and exports that truncated model (the parent's ``forward`` must iterate over the
   list; HF models do); a model whose configuration lists a per-layer setting that varies
   (``config.layer_types`` of sliding-window models, any list of length L with different
   entries on the parent module or the config) is not replicated;
3. checks that the graphs of the last two exported layers (a middle layer and the last
   layer, so that periodic layer patterns are caught) are the same graph up to their inputs (same ops,
   same constants, each input the corresponding node of the same layer, of the previous
   layer, a node before the layers, or the layer's own parameter) and that node names
   advance by a constant step per layer, otherwise it gives up
   (:class:`ReplicationError`, the caller falls back to a full export);
4. builds the full graph: the nodes before the layers, layer 0, copies of layer 1 for layers
   1..L-1 (inputs rewired to the previous copy, ``get_attr`` nodes pointing at layer i's own
   parameters, ``nn_module_stack`` renamed, the template's fake tensors), the
   nodes after the layers, with the names ``torch.export`` gives a full export
   (``base_<counter>``, counters advancing by the per-layer step), and wraps it in a
   ``GraphModule`` over the real model's parameters.

The result is the same graph a full export produces (tests compare node names, targets,
edges and every cost on models of up to a dozen layers, and run the replicated module
against the eager model); the time is that of a three-layer export plus a linear copy.

The model is modified only during the truncated export and restored in a ``finally`` block
(not thread-safe for the same model object).

References
----------
PyTorch ``torch.fx`` Graph API (``Graph.create_node``, ``GraphModule``); the per-layer
replication mirrors what pipeline frameworks do by hand when they trace one block and stamp
it (e.g. torchtitan's per-layer ``torch.compile`` of identical transformer blocks).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch
import torch.fx

__all__ = ["ReplicationError", "find_layer_stack", "replicate_layers", "truncated_layers", "per_layer_settings_vary",
           "INDEX_ATTRIBUTES", "TEMPLATE_LAYERS"]

#: Attributes allowed to differ between otherwise identical layers (their position).
INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "idx", "block_idx"})
#: Layers exported: layer 0 (kept), a middle layer (the template) and the last (the check).
TEMPLATE_LAYERS = 3

_SIMPLE = (int, float, str, bool, type(None))
_NAME = re.compile(r"^(.*?)(?:_(\d+))?$")


class ReplicationError(RuntimeError):
    """The model's layers cannot be replicated safely (the caller exports the full model)."""


def _attr_signature(mod: torch.nn.Module) -> tuple:
    items = []
    for key, val in sorted(vars(mod).items()):
        if key.startswith("_") or key in INDEX_ATTRIBUTES or key == "training":
            continue
        if isinstance(val, _SIMPLE) or (isinstance(val, tuple) and all(isinstance(x, _SIMPLE) for x in val)):
            items.append((key, val))
        elif isinstance(val, torch.Tensor):
            items.append((key, "tensor", tuple(val.shape), str(val.dtype)))
        else:
            items.append((key, type(val).__qualname__))
    return tuple(items)


def _signature(layer: torch.nn.Module) -> tuple | None:
    """Structure of a layer (None if it has hooks, which may differ per layer)."""
    sig = []
    for name, mod in layer.named_modules():
        if mod._forward_hooks or mod._forward_pre_hooks or getattr(mod, "_backward_hooks", None):
            return None
        sig.append((name, type(mod).__qualname__, _attr_signature(mod)))
    for name, p in layer.named_parameters():
        sig.append(("p", name, tuple(p.shape), str(p.dtype), bool(p.requires_grad)))
    for name, b in layer.named_buffers():
        sig.append(("b", name, tuple(b.shape), str(b.dtype)))
    return tuple(sig)


def find_layer_stack(model: torch.nn.Module, min_layers: int = TEMPLATE_LAYERS + 1) -> tuple[str, torch.nn.ModuleList] | None:
    """The longest ``nn.ModuleList`` of structurally identical layers, as ``(path, list)``.

    Parameters
    ----------
    model : torch.nn.Module
    min_layers : int
        Shorter lists are ignored.

    Returns
    -------
    (str, nn.ModuleList) or None
        The dotted path from ``model`` and the list, or None if there is none.
    """
    best = None
    for path, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < max(min_layers, TEMPLATE_LAYERS + 1):
            continue
        first = _signature(mod[0])
        if first is None or any(_signature(m) != first for m in list(mod)[1:]):
            continue
        if best is None or len(mod) > len(best[1]):
            best = (path, mod)
    return best


def truncated_layers(layers: torch.nn.ModuleList) -> list[torch.nn.Module]:
    """The layers exported for replication: the first, a middle one and the last."""
    n = len(layers)
    return [layers[0], layers[n // 2], layers[n - 1]]


def per_layer_settings_vary(owners: list, num_layers: int) -> str | None:
    """Name of a list attribute of length ``num_layers`` whose entries differ, else None.

    ``owners`` are objects to scan (the layer list's parent module, the model's config).
    """
    for obj in owners:
        if obj is None:
            continue
        items = vars(obj).items() if hasattr(obj, "__dict__") else ()
        for key, val in items:
            if isinstance(val, (list, tuple)) and len(val) == num_layers and num_layers > 1:
                try:
                    same = all(v == val[0] for v in val)
                except Exception:  # noqa: BLE001 - unusual entries: be conservative
                    same = False
                if not same:
                    return str(key)
    return None


def _split_name(name: str) -> tuple[str, int]:
    m = _NAME.match(name)
    return m.group(1), int(m.group(2)) if m.group(2) is not None else 0


def _join_name(base: str, counter: int) -> str:
    return base if counter == 0 else f"{base}_{counter}"


def _layer_of(node: torch.fx.Node, prefix: str) -> int | None:
    """Index of the layer (``prefix<i>``) in the node's module stack, else None."""
    for val in (node.meta.get("nn_module_stack") or {}).values():
        path = val[0] if isinstance(val, (tuple, list)) else str(val)
        path = str(path).split("@")[0]
        if path.startswith("L__self__"):
            path = path[len("L__self__"):].lstrip("_.")
        if path.startswith(prefix):
            head = path[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def _param_rel(target: str, prefix: str) -> tuple[int, str] | None:
    if not str(target).startswith(prefix):
        return None
    head, _, rest = str(target)[len(prefix):].partition(".")
    return (int(head), rest) if head.isdigit() else None


def _rename_stack(stack: dict, prefix: str, src: int, dst: int) -> dict:
    """``nn_module_stack`` of layer ``src`` rewritten for layer ``dst`` (dotted and ``_`` forms)."""
    dotted = re.compile(re.escape(f"{prefix}{src}") + r"(?=$|\.)")
    under_old = prefix.replace(".", "_") + str(src)
    under = re.compile(re.escape(under_old) + r"(?=$|_)")

    def sub(s: str) -> str:
        s = dotted.sub(f"{prefix}{dst}", s)
        return under.sub(prefix.replace(".", "_") + str(dst), s)

    out = {}
    for key, val in stack.items():
        k2 = sub(key) if isinstance(key, str) else key
        out[k2] = (sub(str(val[0])), *val[1:]) if isinstance(val, tuple) else sub(str(val))
    return out


def _fresh(val: Any) -> Any:
    """A new fake tensor with the metadata of ``val`` (distinct object), else ``val``."""
    if isinstance(val, torch.Tensor):
        try:
            return val.new_empty_strided(val.size(), val.stride())
        except Exception:  # noqa: BLE001 - odd subclasses: keep the original
            return val
    if isinstance(val, (list, tuple)):
        return type(val)(_fresh(v) for v in val) if not hasattr(val, "_fields") else val
    return val


def _canon(node: torch.fx.Node, lay: dict, index: dict, prefix: str, layer: int, *, refs: bool = True):
    """Canonical form of a layer node: op, target and args with node refs made relative
    (``refs=False``: every node ref is the same token, only ops and constants count)."""

    def ref(x):
        if not isinstance(x, torch.fx.Node):
            return ("const", repr(x))
        if not refs:
            return ("node",)
        li = lay.get(x)
        if li == layer:
            return ("self", index[x])
        if li == layer - 1:
            return ("prev", index[x])
        if li is not None:
            return ("other-layer", li)
        if x.op == "get_attr":
            rel = _param_rel(x.target, prefix)
            if rel is not None:
                return ("param", rel[0] - layer, rel[1])
            return ("attr", str(x.target))
        return ("outer", x.name)

    args = torch.fx.node.map_aggregate(node.args, ref)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, ref)
    return (node.op, str(node.target), repr(args), repr(kwargs))


class _Template(NamedTuple):
    """The three exported layers, checked: what :func:`replicate_layers` copies and how."""

    nodes: list  # the small export's nodes, in program order
    lay: dict  # node -> layer index (None: outside the layers), for non-attribute nodes
    per: list  # per[i]: the nodes of layer i, in program order
    index: dict  # node -> its position within its layer
    step: dict  # node-name base -> counter step between consecutive layers
    fresh: set  # template positions whose copies need a fresh fake tensor
    attrs: list  # get_attr nodes
    layer_attr: dict  # get_attr node -> (layer, name relative to the layer) or None


def _check_template(g: torch.fx.Graph, prefix: str) -> _Template:
    """Find the exported layers and check they have the structure replication assumes.

    Raises
    ------
    ReplicationError
        If the layers are not contiguous, differ, read non-adjacent layers, or their node
        names do not advance by a constant step per layer.
    """
    nodes = list(g.nodes)
    lay = {n: _layer_of(n, prefix) for n in nodes if n.op not in ("placeholder", "get_attr", "output")}
    seq = [n for n in nodes if n in lay]
    ids = [lay[n] for n in seq]
    present = sorted({i for i in ids if i is not None})
    if present != list(range(TEMPLATE_LAYERS)):
        raise ReplicationError(f"expected nodes of layers 0..{TEMPLATE_LAYERS - 1} in the export, found {present}")
    # contiguity: outer nodes, then layer 0, 1, 2, then outer nodes
    first = ids.index(0)
    last = len(ids) - 1 - ids[::-1].index(TEMPLATE_LAYERS - 1)
    body = ids[first:last + 1]
    if any(i is None for i in body) or body != sorted(body):
        raise ReplicationError("the layers' nodes are not contiguous in program order")
    per = [[n for n in seq if lay[n] == i] for i in range(TEMPLATE_LAYERS)]
    index = {n: j for layer_nodes in per for j, n in enumerate(layer_nodes)}
    if len(per[1]) != len(per[2]):
        raise ReplicationError("layers 1 and 2 have different node counts")
    c1 = [_canon(n, lay, index, prefix, 1) for n in per[1]]
    c2 = [_canon(n, lay, index, prefix, 2) for n in per[2]]
    if c1 != c2:
        raise ReplicationError("layers 1 and 2 differ (a layer-dependent branch or constant)")
    # layer 0 reads the embedding instead of a previous layer, so compare it without inputs:
    # the same ops with the same constants (catches layer patterns the sample of two misses)
    if [_canon(n, lay, index, prefix, 0, refs=False) for n in per[0]] != [_canon(n, lay, index, prefix, 1, refs=False) for n in per[1]]:
        raise ReplicationError("layer 0 and the middle layer differ")
    if any(c[0] != "call_function" and c[0] != "call_method" and c[0] != "call_module" for c in c1):
        raise ReplicationError("unexpected node kind inside a layer")
    if any("other-layer" in c[2] or "other-layer" in c[3] for c in c1):
        raise ReplicationError("a layer reads a node of a non-adjacent layer")
    # per-base name step between consecutive layers
    step: dict[str, int] = {}
    for a, b in zip(per[1], per[2]):
        (ba, ca), (bb, cb) = _split_name(a.name), _split_name(b.name)
        if ba != bb or cb <= ca or step.setdefault(ba, cb - ca) != cb - ca:
            raise ReplicationError(f"node names do not advance by a constant step per layer ({a.name} -> {b.name})")
    for a, b in zip(per[0], per[1]):
        ba, ca = _split_name(a.name)
        bb, cb = _split_name(b.name)
        if ba != bb or (ba in step and cb - ca != step[ba]):
            raise ReplicationError(f"layer 0 names do not fit the per-layer step ({a.name} -> {b.name})")
    # fake tensors are shared between the copies of a template node (creating 5,000 fresh
    # ones costs seconds); a node reading node t of its own layer and node t of the
    # previous one would then see one tensor object twice (the cost pass deduplicates
    # inputs by identity), so those positions get fresh ones
    fresh = set()
    for j, n in enumerate(per[1]):
        mine = {index[x] for x in n.all_input_nodes if lay.get(x) == 1}
        prev = {index[x] for x in n.all_input_nodes if lay.get(x) == 0}
        fresh |= mine & prev
    # get_attr nodes: names are the dotted target with "_"
    attrs = [n for n in nodes if n.op == "get_attr"]
    layer_attr = {n: _param_rel(n.target, prefix) for n in attrs}
    for n in attrs:
        if layer_attr[n] is not None and n.name != str(n.target).replace(".", "_"):
            raise ReplicationError(f"unexpected get_attr name {n.name!r} for {n.target!r}")
    return _Template(nodes, lay, per, index, step, fresh, attrs, layer_attr)


def _replicated_graph(g: torch.fx.Graph, tpl: _Template, num_layers: int, prefix: str) -> torch.fx.Graph:
    """The full-depth graph: outer nodes and layer 0 as exported, layer 1 copied for layers
    1..num_layers-1 (names, parameters and module paths advanced per layer), layer 2 dropped."""
    nodes, lay, per, index, step, fresh, attrs, layer_attr = tpl
    extra = num_layers - TEMPLATE_LAYERS
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    copies: list[list[torch.fx.Node]] = []  # copies[i][j]: node j of layer i (i >= 1)
    attr_of: dict[tuple[int, str], torch.fx.Node] = {}

    def emit(op, target, args, kwargs, name, meta):
        node = new.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise ReplicationError(f"fx renamed {name!r} to {node.name!r}")
        node.meta = meta
        return node

    def copy_attr(src: torch.fx.Node, layer: int, rel: str):
        target = f"{prefix}{layer}.{rel}"
        node = emit("get_attr", target, (), {}, target.replace(".", "_"), dict(src.meta))
        attr_of[layer, rel] = node
        return node

    template_attrs = [n for n in attrs if layer_attr[n] is not None and layer_attr[n][0] == 1]
    layers_started = False
    for n in nodes:
        if n.op == "get_attr":
            rel = layer_attr[n]
            if rel is None or rel[0] == 0:
                env[n] = emit("get_attr", n.target, (), {}, n.name, dict(n.meta))
                if rel is not None:
                    attr_of[0, rel[1]] = env[n]
            elif rel[0] == 1 and n is template_attrs[0]:
                for i in range(1, num_layers):
                    for t in template_attrs:
                        copy_attr(t, i, layer_attr[t][1])
            continue
        li = lay.get(n)
        if li is None:
            # outer node (placeholder, before/after the layers, output): renamed after the layers
            if layers_started and n.op != "placeholder" and n.op != "output":
                base, cnt = _split_name(n.name)
                name = _join_name(base, cnt + extra * step.get(base, 0))
            else:
                name = n.name

            def arg(x):
                if x in env:
                    return env[x]
                li2 = lay.get(x)
                if li2 == TEMPLATE_LAYERS - 1:
                    return copies[num_layers - 1][index[x]]
                raise ReplicationError(f"outer node {n.name} reads {x.name} of layer {li2}")

            args = torch.fx.node.map_arg(n.args, arg)
            kwargs = torch.fx.node.map_arg(n.kwargs, arg)
            env[n] = emit(n.op, n.target, args, kwargs, name, dict(n.meta))
            continue
        layers_started = True
        if li == 0:
            env[n] = emit(n.op, n.target, torch.fx.node.map_arg(n.args, lambda x: env[x]),
                          torch.fx.node.map_arg(n.kwargs, lambda x: env[x]), n.name, dict(n.meta))
            if index[n] == len(per[0]) - 1:
                copies.append([env[m] for m in per[0]])
            continue
        if li == 2:
            continue  # layer 2 only served as the check
        # li == 1: the template; emit layers 1..num_layers-1 when its last node is reached
        if index[n] != len(per[1]) - 1:
            continue
        for i in range(1, num_layers):
            out: list[torch.fx.Node] = []
            for j, t in enumerate(per[1]):
                def arg(x, i=i, out=out):
                    lx = lay.get(x)
                    if lx == 1:
                        return out[index[x]]
                    if lx == 0:
                        return copies[i - 1][index[x]]
                    if x.op == "get_attr" and layer_attr.get(x) is not None:
                        src, rel = layer_attr[x]
                        return attr_of[i + src - 1, rel]  # the same parameter relative to the layer
                    return env[x]

                base, cnt = _split_name(t.name)
                meta = dict(t.meta)
                if "nn_module_stack" in meta:
                    meta["nn_module_stack"] = _rename_stack(meta["nn_module_stack"], prefix, 1, i)
                if j in fresh and "val" in meta:
                    meta["val"] = _fresh(meta["val"])
                out.append(emit(t.op, t.target, torch.fx.node.map_arg(t.args, arg), torch.fx.node.map_arg(t.kwargs, arg),
                                _join_name(base, cnt + (i - 1) * step[base]), meta))
            copies.append(out)
    new._codegen = g._codegen  # in/out pytree specs: the same model inputs and outputs
    new.lint()
    return new


def _graph_module(new: torch.fx.Graph, gm_small: torch.fx.GraphModule, model: torch.nn.Module,
                  path: str) -> torch.fx.GraphModule:
    """The graph module of the full-depth graph, its attributes from the real model and the small export."""
    # the module: attributes under the layer list's top-level module come from the real model
    # (as in a full export, whose unlifted module holds the model's own parameter objects);
    # export-made attributes (higher-order-op bodies, the input guard) from the small export
    root = path.split(".")[0]
    holder = torch.nn.Module()
    holder.add_module(root, getattr(model, root))
    for n in new.nodes:
        if n.op not in ("get_attr", "call_module"):
            continue
        top = str(n.target).split(".")[0]
        if hasattr(holder, top):
            continue
        obj = getattr(gm_small, top)
        if isinstance(obj, torch.nn.Module):
            holder.add_module(top, obj)
        elif isinstance(obj, torch.nn.Parameter):
            holder.register_parameter(top, obj)
        elif isinstance(obj, torch.Tensor):
            holder.register_buffer(top, obj)
        else:
            setattr(holder, top, obj)
    gm = torch.fx.GraphModule(holder, new)
    gm.meta.update(getattr(gm_small, "meta", {}))
    return gm


def replicate_layers(gm_small: torch.fx.GraphModule, model: torch.nn.Module, path: str, num_layers: int) -> torch.fx.GraphModule:
    """The full-depth graph module from the export of :data:`TEMPLATE_LAYERS` layers.

    Parameters
    ----------
    gm_small : torch.fx.GraphModule
        Unlifted export of ``model`` with its layer list cut to three layers
        (:func:`truncated_layers`).
    model : torch.nn.Module
        The full model (its parameters are the new module's parameters).
    path : str
        Dotted path of the layer list in ``model`` (e.g. ``"model.model.layers"``).
    num_layers : int
        Layers of the full model.

    Returns
    -------
    torch.fx.GraphModule

    Raises
    ------
    ReplicationError
        If the three exported layers do not have the structure replication assumes.
    """
    prefix = f"{path}."
    tpl = _check_template(gm_small.graph, prefix)
    new = _replicated_graph(gm_small.graph, tpl, num_layers, prefix)
    return _graph_module(new, gm_small, model, path)
