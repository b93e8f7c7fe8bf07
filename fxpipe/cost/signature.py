"""Op signatures: the op part of a cost-database key, and the gradient roles of an op's inputs.

:func:`op_signature` names an fx node's op and arguments independently of the device the model
was captured on; :func:`input_role` and :func:`phases_of` say which inputs need a gradient
(activations, ``g``) or are trainable weights (``w``), hence whether the op has a
backward-input (B) and a backward-weight (W) phase. All read the cost annotation of
:class:`fxpipe.passes.annotate.AnnotateCosts` (``node.meta["fxpipe_cost"]``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from fxpipe.cost.roofline import OpCost
from fxpipe.passes.capture import _packet, _to_int, getattr_path
from fxpipe.passes.costing import COST_KEY

__all__ = ["op_signature", "op_key", "input_role", "phases_of", "op_class_of", "param_source", "cost_of"]

_DTYPE_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def cost_of(node: torch.fx.Node) -> OpCost | None:

    c = node.meta.get(COST_KEY)
    return c if isinstance(c, OpCost) else None


def param_source(node: torch.fx.Node) -> torch.Tensor | None:
    """The parameter behind a ``get_attr`` node or a shape-only view chain of one, else None."""

    root = node.graph.owning_module
    seen = 0
    while node.op != "get_attr":
        c = cost_of(node)
        if c is None or c.kind != "shape" or not node.all_input_nodes or seen > 64:
            return None
        node = node.all_input_nodes[0]
        seen += 1
    obj = getattr_path(root, node.target) if root is not None else None
    return obj if isinstance(obj, torch.nn.Parameter) else None


def input_role(node: torch.fx.Node) -> str:
    """``"w"``: trainable weight; ``"g"``: activation that needs a gradient; ``""``: neither."""
    p = param_source(node)
    if p is not None:
        return "w" if p.requires_grad else ""
    if node.op in ("placeholder", "get_attr"):
        return ""
    c = cost_of(node)
    return "g" if c is not None and c.requires_grad else ""


def _tensor_sig(t: torch.Tensor, dtype: torch.dtype | None) -> str:

    dt = dtype if (dtype is not None and t.dtype.is_floating_point) else t.dtype
    shape = [_to_int(s) for s in t.shape]
    s = f"{_DTYPE_SHORT.get(dt, str(dt).replace('torch.', ''))}[{','.join(map(str, shape))}]"
    try:
        contiguous = bool(t.is_contiguous())
    except Exception:  # noqa: BLE001 - symbolic strides
        contiguous = True
    if not contiguous:
        s += "{" + ",".join(str(_to_int(x)) for x in t.stride()) + "}"
    return s


def _val_sig(val: Any, dtype: torch.dtype | None) -> str:

    if isinstance(val, torch.Tensor):
        return _tensor_sig(val, dtype)
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        return str(_to_int(val))
    if isinstance(val, (list, tuple)) and not isinstance(val, torch.Size):
        return "(" + ", ".join(_val_sig(v, dtype) for v in val) + ")"
    return repr(val)


def _arg_sig(x: Any, dtype: torch.dtype | None) -> str:
    if isinstance(x, torch.fx.Node):
        return _val_sig(x.meta.get("val"), dtype) + input_role(x)
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_arg_sig(v, dtype) for v in x) + "]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}={_arg_sig(v, dtype)}" for k, v in x.items()) + "}"
    if isinstance(x, torch.device):
        return "device"
    if isinstance(x, torch.dtype):
        if dtype is not None and x.is_floating_point:
            x = dtype
        return str(x).replace("torch.", "")
    if isinstance(x, torch.SymInt):
        return _val_sig(x, dtype)
    return repr(x)


def op_signature(node: torch.fx.Node, dtype: torch.dtype | None = None) -> tuple[str, str] | None:
    """``(op, args)`` of an fx node for the cost database, or None if it cannot be profiled.

    Only ``call_function`` nodes whose target is an ATen/custom ``OpOverload`` are profiled.
    ``args`` lists every positional and keyword argument: a tensor as ``f32[64,128]`` (plus
    ``{strides}`` when not contiguous, ``g`` when it needs a gradient, ``w`` when it is a
    trainable weight), literals as Python ``repr``, devices as ``device`` (the op is measured
    on the profiling device). ``dtype`` replaces floating dtypes (costing in another dtype).

    Requires the node's graph to carry cost annotations (grad flags come from them).
    """

    if node.op != "call_function" or _packet(node.target) is None:
        return None
    parts = [_arg_sig(a, dtype) for a in node.args]
    parts += [f"{k}={_arg_sig(v, dtype)}" for k, v in node.kwargs.items()]
    return str(node.target), ", ".join(parts)


def phases_of(node: torch.fx.Node) -> tuple[bool, bool, bool]:
    """(F, B, W): whether the op has a backward-input / backward-weight phase in this graph."""
    c = cost_of(node)
    if c is None or not c.requires_grad:
        return True, False, False
    roles = {input_role(i) for i in node.all_input_nodes}
    return True, "g" in roles, "w" in roles


def op_class_of(node: torch.fx.Node) -> str:

    pkt = _packet(node.target)
    return str(pkt) if pkt is not None else str(getattr(node.target, "__name__", node.target))


def op_key(node: torch.fx.Node, dtype: torch.dtype | None = None) -> str | None:
    """The database op key ``"<op>(<args>)"`` of a node, or None (see :func:`op_signature`)."""
    s = op_signature(node, dtype)
    return None if s is None else f"{s[0]}({s[1]})"
