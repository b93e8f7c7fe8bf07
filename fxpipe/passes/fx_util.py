"""Small helpers on fx graphs and exported values, shared by the capture and the passes after it (torch only).

A leaf of :mod:`fxpipe.passes`: the capture (:mod:`fxpipe.passes.capture`, which runs the
constant duplication) and the passes it runs import these from here, so neither imports the
other. :mod:`fxpipe.passes.capture` re-exports them under their old names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["remove_dead_code", "getattr_path", "has_data_dependent_size"]


def remove_dead_code(gm: torch.fx.GraphModule) -> int:
    """Delete the pure ``call_function`` nodes whose value nobody uses; returns how many.

    ``torch.export`` keeps dead computations that a model's Python code builds and drops
    (transformers 5.24's causal-mask helper builds an ``arange`` and three ``unsqueeze`` it
    never reads). Left in the graph they are real kernels of some stage, dead weight for the
    partition's cost and a node that the chain bound (:mod:`fxpipe.partition.chain`, Lemma D)
    must ignore, so a graph with one of them can never be proven optimal. A node is kept if
    torch says it is impure (asserts, in-place and random ops: ``Node.is_impure``); only
    ``call_function`` nodes are candidates (parameters, buffers and inputs stay, used or not).
    Runs to a fixed point in one reverse sweep (users are visited before their producers).
    """
    removed = 0
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and not node.users and not node.is_impure():
            gm.graph.erase_node(node)
            removed += 1
    if removed:
        gm.recompile()
    return removed


def _to_int(x: Any) -> int:
    """A concrete size: the example's (hinted) value of a symbolic size; a data-dependent
    (unbacked) size such as the rows of ``x[mask]`` or ``nonzero`` is costed at the upper end of
    its value range (every candidate row kept: time and memory are not under-estimated), or 1
    when that range is unbounded."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        hint = getattr(x.node, "hint", None)
        if hint is not None:
            return int(hint)
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        env = x.node.shape_env
        if free_unbacked_symbols(x):
            try:
                upper = env.bound_sympy(x.node.expr).upper
                if upper.is_finite:
                    return int(upper)
            except Exception:  # noqa: BLE001 - no range known
                pass
            return 1
        try:
            return int(env.size_hint(x.node.expr))
        except Exception:  # a symbol without a hint: assume 1
            return 1
    return int(x)


def _leaves(val: Any) -> list[Any]:
    """Leaves of nested tuples / lists / dicts (what fx node args and ``meta["val"]`` hold).

    A public-API stand-in for ``torch.utils._pytree.tree_leaves`` on the containers that
    appear in exported graphs (``torch.Size`` and named tuples are tuples; fx's immutable
    list/dict subclass list/dict). Other objects are leaves.
    """
    out: list[Any] = []
    stack = [val]
    while stack:
        x = stack.pop()
        if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        else:
            out.append(x)
    return out


def _packet(target: Any) -> Any:
    """The ``OpOverloadPacket`` of an aten/custom ``OpOverload`` target, else None.

    Duck typing on the public ``overloadpacket`` attribute replaces an
    ``isinstance(target, torch._ops.OpOverload)`` check (``torch._ops`` is private): only
    ``OpOverload`` objects carry it (packets, higher-order operators and Python callables
    do not).
    """
    return getattr(target, "overloadpacket", None)


def getattr_path(root: torch.nn.Module, target: str) -> Any:
    """Resolve a dotted ``get_attr`` target on ``root`` (returns None if missing)."""
    obj: Any = root
    for part in str(target).split("."):
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj


def has_data_dependent_size(node: torch.fx.Node) -> bool:
    """True when the node's value (``meta["val"]``: a tensor's sizes/strides, a symbolic
    int/bool, or a tuple of them) involves an *unbacked* symbol, i.e. a size or value known
    only at run time: ``x[mask]``, ``nonzero``, ``unique``, ``masked_select``, ``.item()``,
    and everything computed from them that keeps the symbol. Backed dynamic sizes
    (``dynamic=True`` inputs) do not count."""
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None:
        return False
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for leaf in _leaves(val):
        if isinstance(leaf, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            try:
                if free_unbacked_symbols(leaf):
                    return True
            except Exception:  # noqa: BLE001 - a value symbolic_shapes cannot inspect
                continue
    return False
