"""Roofline costing of fx nodes: one :class:`~fxpipe.cost.roofline.OpCost` per node.

:class:`RooflineCosts` is the body of the cost annotation pass
(:class:`fxpipe.passes.annotate.AnnotateCosts`, which adds hardware-name lookup and the
measured-cost hook). It sits below the cost profiler, which runs it with a datasheet spec,
and above :mod:`fxpipe.cost.specs` / :mod:`fxpipe.cost.roofline`. It is an fx analysis pass in the style of ``torch.fx.passes`` (STYLE.md):
``requires`` checks that every node carries ``meta["val"]`` (as produced by
:func:`fxpipe.passes.capture.capture`), ``call`` writes ``node.meta["fxpipe_cost"]`` on
every node, ``ensures`` checks that every cost is finite and non-negative and that each
parameter is owned once. The graph itself is not modified (``PassResult.modified`` is False).

Everything is computed from the fake tensors in ``node.meta["val"]``: nothing is allocated,
so a model captured on the ``meta`` device is costed without its weights.

Costs are for ONE micro-batch: the example inputs given to ``capture`` are that micro-batch.

FLOPs
    ``torch.utils.flop_counter.flop_registry`` formulas (mm, addmm, bmm, baddbmm, convolution,
    attention kernels) applied to the fake tensors; every attention op (including
    ``scaled_dot_product_attention`` and the CPU kernels the registry lacks) with
    ``sdpa_flop_count`` (4 B H Sq Sk D, no causal discount); ``aten.linear``/``aten.matmul`` with the
    same ``2*M*N*K`` formula; other composite ops (einsum, conv2d, sdpa, ...) run on the fake
    tensors under ``FlopCounterMode``; grouped matmuls (MoE experts) ``2 * tokens * K * N``.
Bytes moved
    Distinct tensor inputs (activations and parameters read) + outputs.
Achieved efficiency
    An op's roofline time ``max(flops / peak, bytes / bandwidth)`` is divided by its family's
    achieved efficiency (:meth:`~fxpipe.cost.specs.HardwareSpec.efficiency_of`;
    :func:`~fxpipe.passes.op_families.efficiency_family`: matmul, attention, embedding, reduction,
    elementwise) before the launch overhead is added and B / W are derived from it; 1.0 on a
    ``"<gpu>-datasheet"`` spec, which is therefore never slower than the achieved one.
Shape-only ops
    views, reshape, permute, expand, slicing, ``getitem``, sym-size, ``_assert_*``, detach,
    no-op ``to``/``contiguous``, eval-mode dropout: zero time, zero bytes, zero activation.
Parameters
    Each parameter (deduplicated by identity, so tied weights count once) is owned by its
    first consumer in program order: ``size_param_bytes``. Buffers are not parameters and
    are not counted.
Activation memory (``act_bytes``), an approximation of what autograd saves
    Only for nodes whose output requires grad. matmul with a weight saves its non-weight
    input; matmul without weights saves both inputs; attention saves q, k, v and the output;
    embedding saves its indices; mul/div save an operand iff the other one needs a gradient
    (nothing for a Python-scalar factor); index/gather/where/masked_fill save their index or
    mask; unary
    nonlinearities save their input (gelu, silu, pow, ...) or output (tanh, sigmoid, exp,
    relu, rsqrt, softmax); normalisations save their input; dropout saves a 1-byte mask;
    add/sub/cat/copies/reductions save nothing; unknown ops save their tensor inputs.
    Normalizations also save their fp32 statistics (layer/RMS norm: mean and rstd per row;
    group norm: per sample and group; batch norm in training: per channel); max-pooling saves
    its int64 argmax indices, ``topk``/``sort`` their int64 indices; ``matmul``/``linear`` save
    what autograd saves when run on ``meta`` tensors of the operands' sizes and strides (an
    operand whose batched reshape is not a view is saved as a fresh copy). Saved views keep their base alive: a saved tensor is resolved
    through shape-only ops to its base, and each base is counted once, on the first node that
    saves it. Parameters, buffers and the model's inputs (placeholders) are never counted:
    they are resident, held by the module and by the caller for the whole step. Checked against the
    bytes autograd saves (saved-tensor hooks) in ``benchmarks/bench_activation_peak.py``.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterable

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count

from fxpipe.cost.specs import HardwareSpec
from fxpipe.cost.roofline import OpCost, backward_times, roofline_s
from fxpipe.errors import InputError
from fxpipe.passes.capture import _leaves, _packet, _to_int, getattr_path
from fxpipe.passes.op_families import ATTENTION, FLOP_COMPOSITE, MATMUL_COMPOSITE, efficiency_family, packets  # noqa: F401 (re-exported)

#: The namespaced ``node.meta`` key of the costs this pass writes.
COST_KEY = "fxpipe_cost"
#: ``node.meta`` key listing the fx nodes (by name) whose outputs the node saves for its backward (the
#: bases its ``act_bytes`` resolves to, each listed by every node that saves it, also when an earlier node
#: counted its bytes): what activation checkpointing (:mod:`fxpipe.memory.checkpoint`) replays or keeps.
SAVED_KEY = "fxpipe_saved"

aten = torch.ops.aten


_packets = packets


SHAPE_OPS = _packets(
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "expand_as",
    "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes", "chunk", "unbind",
    "narrow", "as_strided", "alias", "detach", "view_as", "flatten", "unflatten", "movedim",
    "_assert_tensor_metadata", "_assert_scalar", "_assert_async", "sym_size", "sym_numel",
    "sym_stride", "sym_storage_offset", "sym_constrain_range", "sym_constrain_range_for_size",
    "_reshape_alias", "lift_fresh", "numpy_T", "mT", "adjoint", "swapaxes", "transpose_",
    "unsqueeze_", "squeeze_", "t_", "resolve_conj", "resolve_neg", "_functional_assert_async",
    "tensor_split", "diagonal", "real",
)
#: Ops that are a no-op when the dtype/device/layout does not change.
MAYBE_NOOP = _packets("to", "_to_copy", "contiguous", "type_as")
DROPOUT = _packets("dropout", "native_dropout", "feature_dropout", "alpha_dropout")
EMBEDDING = _packets("embedding", "_embedding_bag", "embedding_bag")
NORM_OR_SOFTMAX = _packets(
    "softmax", "_softmax", "log_softmax", "_log_softmax", "layer_norm", "native_layer_norm",
    "group_norm", "native_group_norm", "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "rms_norm", "_fused_rms_norm", "instance_norm",
    "cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss_forward",
)
SAVES_NOTHING = _packets(
    "add", "sub", "neg", "cat", "stack", "to", "_to_copy", "clone", "contiguous", "pad",
    "constant_pad_nd", "sum", "mean", "copy", "copy_", "add_", "sub_", "zeros_like", "ones_like",
    "full_like", "empty_like", "new_zeros", "new_ones", "new_empty", "new_full", "repeat",
    "fill", "fill_", "type_as", "roll", "flip", "tril", "triu", "rsub",
)
SAVES_OUTPUT = _packets("tanh", "sigmoid", "exp", "relu", "softmax", "_softmax", "log_softmax",
                        "_log_softmax", "rsqrt", "sqrt", "elu", "hardtanh")
SAVES_INPUT = _packets(
    "gelu", "silu", "pow", "log", "sin", "cos", "erf", "abs", "mish", "softplus", "leaky_relu",
    "hardswish", "hardsigmoid", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
    "batch_norm", "native_batch_norm", "rms_norm", "_fused_rms_norm", "log1p", "expm1", "reciprocal",
    "clamp", "clamp_min", "clamp_max", "max", "min", "amax", "amin", "norm", "linalg_vector_norm",
    "var", "std", "var_mean", "gelu_", "silu_", "relu_", "tan", "atan", "asin", "acos", "sinh", "cosh",
)

LAYER_NORMS = _packets("layer_norm", "native_layer_norm")
RMS_NORMS = _packets("rms_norm", "_fused_rms_norm")
GROUP_NORMS = _packets("group_norm", "native_group_norm")
#: normalizations whose backward also needs per-row / per-group / per-channel statistics
NORM_STATS = LAYER_NORMS | RMS_NORMS | GROUP_NORMS | _packets("batch_norm", "native_batch_norm")
#: max-pooling saves its input and the argmax indices (int64, shaped like the output)
MAX_POOL = _packets("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
                    "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d")

#: shape ops that copy when the input's strides do not allow a view
COPYING_RESHAPES = _packets("reshape", "flatten")
#: ops whose backward needs only their int64 indices output
TOP_K = _packets("topk", "sort")

PRODUCT = _packets("mul", "div", "mul_", "div_")
DIVISION = _packets("div", "div_")
#: ops whose backward needs only an index/mask argument: packet -> argument position
INDEX_SAVES = {pkt: pos for names, pos in (
    (("index",), 1), (("gather", "index_select", "take_along_dim"), 2), (("where",), 0),
    (("masked_fill",), 1),
) for name in names for pkt in _packets(name)}

_DTYPE_NAMES = {
    torch.float32: "fp32", torch.float64: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = "fp8"


def _numel(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape:
        n *= _to_int(s)
    return n


def _tensors(val: Any) -> list[torch.Tensor]:
    return [x for x in _leaves(val) if isinstance(x, torch.Tensor)]


def _fake_mode(values: Iterable[Any]) -> Any:
    """The ``FakeTensorMode`` of the first fake tensor among ``values``, else None.

    Fake tensors (``node.meta["val"]``) carry their mode as ``.fake_mode``; this replaces the
    private ``torch._guards.detect_fake_mode``.
    """
    for x in values:
        if isinstance(x, torch.Tensor):
            mode = getattr(x, "fake_mode", None)
            if mode is not None:
                return mode
    return None


def _subgraphs(node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """Body graphs a higher-order operator node calls (its ``get_attr`` GraphModule args).

    Structural test instead of ``isinstance(target, torch._ops.HigherOrderOperator)``: aten
    ops never take a GraphModule argument, higher-order operators (``cond``,
    ``wrap_with_set_grad_enabled``, ...) take their bodies as ``get_attr`` nodes.
    """
    root = node.graph.owning_module
    if root is None:
        return []
    out = []
    for arg in node.args:
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            sub = getattr_path(root, arg.target)
            if isinstance(sub, torch.fx.GraphModule):
                out.append(sub)
    return out


class RooflineCosts(PassBase):
    """The roofline costing of every node of a captured ``GraphModule`` for one hardware spec.

    The body of the cost pass: :class:`fxpipe.passes.annotate.AnnotateCosts` is this pass with
    hardware names resolved (:func:`fxpipe.cost.hardware.get_hardware`) and the measured-cost
    hook of a profiled spec; the profiler (:func:`fxpipe.cost.profile.profile_graph`) runs it
    with a datasheet spec directly. Parameters, notes and errors: see ``AnnotateCosts``.

    Parameters
    ----------
    hardware : HardwareSpec
        The spec whose roofline costs every node (no name lookup here).
    dtype : torch.dtype, optional
        Cost floating-point tensors as this dtype.
    allow_tf32 : bool
        Cost float32 matmuls at the TF32 peak.
    cost_model : callable(node, OpCost) -> OpCost, optional
        Per-op hook run after the roofline costs are computed.
    """

    def __init__(self, hardware: HardwareSpec, dtype: torch.dtype | None = None,
                 *, allow_tf32: bool = False, cost_model=None):
        super().__init__()
        if not isinstance(hardware, HardwareSpec):
            raise InputError(f"hardware must be a HardwareSpec here, got {hardware!r} (AnnotateCosts resolves names)")
        self.hw = hardware
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise InputError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        self.dtype = dtype
        self.allow_tf32 = bool(allow_tf32)
        self.cost_model = cost_model

    # ------------------------------------------------------------------ helpers
    def _bytes(self, t: torch.Tensor) -> float:
        dt = t.dtype
        if self.dtype is not None and dt.is_floating_point:
            dt = self.dtype
        return float(_numel(t) * dt.itemsize)

    def _dtype_name(self, tensors: Iterable[torch.Tensor]) -> str:
        for t in tensors:
            dt = t.dtype
            if dt.is_floating_point:
                if self.dtype is not None:
                    dt = self.dtype
                name = _DTYPE_NAMES.get(dt, "fp32")
                if name == "fp32" and self.allow_tf32:
                    return "tf32"
                return name
        return ""

    # ------------------------------------------------------------------ pass protocol
    def requires(self, gm: torch.fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            if node.op == "placeholder" and "val" not in node.meta:
                raise InputError(
                    f"node {node.name!r} has no meta['val']: capture the model with "
                    "fxpipe.passes.capture.capture (torch.export) before costing it"
                )
            if node.op in ("call_function", "call_method") and "val" not in node.meta:
                if _packet(node.target) in SHAPE_OPS or node.target is operator.getitem:
                    continue
                if node.users:
                    raise InputError(
                        f"node {node.name!r} ({node.target}) has no meta['val'] but is used: "
                        "capture the model with fxpipe.passes.capture.capture"
                    )

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            cost = node.meta.get(COST_KEY)
            if not isinstance(cost, OpCost):
                raise AssertionError(f"the cost pass left node {node.name!r} without a cost")
            for key in ("flops", "bytes", "t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s",
                        "size_out_bytes", "size_param_bytes", "act_bytes"):
                v = getattr(cost, key)
                if not (math.isfinite(v) and v >= 0):
                    raise AssertionError(f"node {node.name!r}: {key}={v} is not finite and >= 0")
        # every parameter read by the graph is owned exactly once: the owned bytes add up
        params = {id(p): p for p in gm.parameters()}
        read: dict[int, torch.Tensor] = {}
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                obj = getattr_path(gm, node.target)
                if isinstance(obj, torch.Tensor) and id(obj) in params and node.users:
                    read[id(obj)] = obj
        want = sum(self._bytes(p) for p in read.values())
        got = sum(n.meta[COST_KEY].size_param_bytes for n in gm.graph.nodes)
        if abs(want - got) > 1e-9 * max(want, 1.0):
            raise AssertionError(f"parameter bytes owned by nodes ({got}) != bytes of parameters read ({want})")
        if len(gm.meta.get("fxpipe_param_owner", {})) != len(read):
            raise AssertionError("some parameter has no owner or more than one")
        gm.graph.lint()

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        hw = self.hw
        lo = hw.launch_overhead_s
        params = {id(p) for p in gm.parameters()}
        # -------- pass 1: parameters, their first consumer, requires-grad, view bases
        param_of: dict[torch.fx.Node, Any] = {}  # get_attr node (or a view of one) -> parameter
        seen_param: set[int] = set()
        owner_bytes: dict[torch.fx.Node, float] = {}
        owner_numel: dict[str, int] = {}
        param_owner: dict[str, str] = {}
        rg: dict[torch.fx.Node, bool] = {}
        base: dict[torch.fx.Node, torch.fx.Node] = {}
        shape_only: dict[torch.fx.Node, bool] = {}
        fallback: dict[int, tuple] = {}
        for node in gm.graph.nodes:
            shape_only[node] = self._is_shape_only(node)
            if node.op == "get_attr":
                obj = getattr_path(gm, node.target)
                if isinstance(obj, torch.Tensor) and id(obj) in params:
                    param_of[node] = obj
                    rg[node] = bool(obj.requires_grad)
                else:
                    rg[node] = False
                base[node] = node
                continue
            if node.op == "placeholder":
                rg[node] = False
                base[node] = node
                continue
            ins = node.all_input_nodes
            # parameter ownership: first consumer in program order
            # (a shape-only view of a parameter passes ownership on to ITS first consumer)
            carries = shape_only[node] and bool(ins) and ins[0] in param_of
            if carries:
                param_of[node] = param_of[ins[0]]
            for inp in ins:
                p = param_of.get(inp)
                if p is None or id(p) in seen_param:
                    continue
                if carries and inp is ins[0]:
                    fallback.setdefault(id(p), (node, p, inp))
                    continue
                seen_param.add(id(p))
                owner_bytes[node] = owner_bytes.get(node, 0.0) + self._bytes(p)
                owner_numel[node.name] = owner_numel.get(node.name, 0) + _numel(p)
                param_owner[_param_target(inp)] = node.name
            out_ts = _tensors(node.meta.get("val"))
            floating_out = any(t.dtype.is_floating_point or t.dtype.is_complex for t in out_ts)
            if node.op == "call_function" and "wrap_with_set_grad_enabled" in str(node.target) and node.args \
                    and node.args[0] is False:
                rg[node] = False
            else:
                rg[node] = floating_out and any(rg.get(i, False) for i in ins)
            if shape_only[node] and ins and not (node.target is operator.getitem and not shape_only.get(ins[0], False)):
                base[node] = base.get(ins[0], ins[0])
                # ---- begin act_bytes fix (issue 9): a reshape that cannot be a view (of an expanded
                # or transposed tensor) makes a fresh tensor, which is what a later op saves
                if _packet(node.target) in COPYING_RESHAPES and _reshape_copies(node):
                    base[node] = node
                # ---- end act_bytes fix
            else:
                base[node] = node
        for pid, (node, p, inp) in fallback.items():  # only ever viewed, never computed on
            if pid not in seen_param:
                seen_param.add(pid)
                owner_bytes[node] = owner_bytes.get(node, 0.0) + self._bytes(p)
                owner_numel[node.name] = owner_numel.get(node.name, 0) + _numel(p)
                param_owner[_param_target(inp)] = node.name
        gm.meta["fxpipe_param_owner"] = param_owner
        gm.meta["fxpipe_param_numel"] = owner_numel

        # -------- pass 2: costs
        saved_bases: set[torch.fx.Node] = set()
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            out_ts = _tensors(val)
            size_out = float(sum(self._bytes(t) for t in out_ts))
            p_bytes = owner_bytes.get(node, 0.0)
            if node.op in ("placeholder", "get_attr", "output"):
                kind = "input" if node.op != "output" else "output"
                node.meta[COST_KEY] = OpCost(size_out_bytes=size_out if node.op != "output" else 0.0,
                                             size_param_bytes=p_bytes, kind=kind)
                continue
            ins = node.all_input_nodes
            in_vals = [(i, t) for i in ins for t in _tensors(i.meta.get("val"))]
            if shape_only[node]:
                node.meta[COST_KEY] = OpCost(size_out_bytes=size_out, size_param_bytes=p_bytes, kind="shape",
                                             requires_grad=rg[node])
                continue
            # distinct input tensors (a tensor used twice is read once)
            uniq: dict[int, tuple[torch.fx.Node, torch.Tensor]] = {}
            for i, t in in_vals:
                uniq.setdefault(id(t), (i, t))
            in_bytes = sum(self._bytes(t) for _, t in uniq.values())
            bytes_moved = in_bytes + size_out
            flops = float(self._flops(node, out_ts))
            all_ts = [t for _, t in uniq.values()] + out_ts
            dname = self._dtype_name(all_ts)
            peak = hw.peak(dname or "fp32")
            pkt = _packet(node.target)
            param_in = [i for i in ins if i in param_of]
            act_in = [i for i in ins if i not in param_of]
            grad_inputs = sum(1 for i in act_in if rg.get(i, False))
            has_w = any(rg.get(i, False) for i in param_in)
            factor = 2.0 if pkt in NORM_OR_SOFTMAX else 1.0
            weight_grad = None
            if pkt in ATTENTION:
                kind = "attention"
            elif pkt in EMBEDDING and has_w:
                kind = "embedding"
                w_bytes = sum(self._bytes(param_of[i]) for i in param_in)
                weight_grad = roofline_s(0.0, 2 * size_out + w_bytes, peak, hw.hbm_bytes_per_s)
            elif flops > 0 and has_w:
                kind = "matmul_param"
            elif flops > 0:
                kind = "matmul"
            elif has_w:
                kind = "param_other"
            else:
                kind = "elementwise"
            # achieved efficiency of the op's family (1.0 on a datasheet spec): divides the roofline
            # time of F, and of B and W, which scale the forward's core time
            eff = hw.efficiency_of(efficiency_family(kind, pkt))
            core = roofline_s(flops, bytes_moved, peak, hw.hbm_bytes_per_s) / eff
            t_fwd = core + lo  # fxpipe.cost.roofline.forward_time_s at the achieved rate
            if weight_grad is not None:
                weight_grad /= eff
            if rg[node]:
                t_b, t_w = backward_times(kind, core, lo, input_grads=grad_inputs, factor=factor,
                                          weight_grad_s=weight_grad)
                if not has_w:
                    t_w = 0.0
                act = self._act_bytes(node, kind, pkt, act_in, base, saved_bases, param_of, rg)
            else:
                t_b = t_w = 0.0
                act = 0.0
            node.meta[COST_KEY] = OpCost(
                flops=flops, bytes=float(bytes_moved), t_fwd_s=t_fwd, t_bwd_input_s=t_b, t_bwd_weight_s=t_w,
                size_out_bytes=size_out, size_param_bytes=p_bytes, act_bytes=act, kind=kind, dtype=dname,
                requires_grad=rg[node],
            )
        # ---- begin fxpipe.cost hook: a measured / calibrated model replaces the roofline times
        if self.cost_model is not None:
            for node in gm.graph.nodes:
                node.meta[COST_KEY] = self.cost_model(node, node.meta[COST_KEY])
        # ---- end fxpipe.cost hook
        return PassResult(gm, False)

    # ------------------------------------------------------------------ pieces
    def _is_shape_only(self, node: torch.fx.Node) -> bool:
        if node.op == "call_module":
            return node.target == "_guards_fn"
        if node.op not in ("call_function", "call_method"):
            return False
        tgt = node.target
        if tgt is operator.getitem:
            return True
        if _packet(tgt) is None:
            # python operators on SymInts (operator.mul, sym_sum, ...) and other non-aten callables
            vals = _tensors(node.meta.get("val"))
            return not vals and getattr(tgt, "__module__", "") in ("_operator", "operator", "torch", "math",
                                                                     "torch.fx.experimental.sym_node")
        pkt = _packet(tgt)
        if pkt in SHAPE_OPS:
            return True
        if pkt in DROPOUT:
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
            p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
            return train is False or p == 0
        if pkt in MAYBE_NOOP:
            out = node.meta.get("val")
            src = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor):
                same = out.dtype == src.dtype and out.device == src.device
                if pkt in (aten.contiguous,):
                    return src.is_contiguous()
                copy = node.kwargs.get("copy", False)
                return same and not copy and src.is_contiguous() == out.is_contiguous()
        return False

    def _flops(self, node: torch.fx.Node, out_ts: list[torch.Tensor]) -> float:
        tgt = node.target
        pkt = _packet(tgt)
        if pkt is None:
            # wrap_with_set_grad_enabled, cond, ...: FLOPs of the body graph(s); 0 for other
            # non-aten callables (python operators on SymInts)
            return sum(self._flops(n, _tensors(n.meta.get("val")))
                       for sub in _subgraphs(node) for n in sub.graph.nodes if n.op == "call_function")
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        name = str(tgt)
        if "grouped_mm" in name:
            x, w = args[0], args[1]
            if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() == 2 and w.dim() == 3:
                return 2.0 * _to_int(x.shape[0]) * _to_int(w.shape[-2]) * _to_int(w.shape[-1])
            return 0.0
        if pkt in ATTENTION and len(args) >= 3 and all(isinstance(t, torch.Tensor) for t in args[:3]):
            # same formula as torch.utils.flop_counter.sdpa_flop_count (QK^T and PV, no causal
            # discount), also for the CPU kernels the registry does not list
            q, k, v = args[:3]
            shape = lambda t: tuple(_to_int(d) for d in t.shape)  # noqa: E731
            return float(sdpa_flop_count(shape(q), shape(k), shape(v)))
        if pkt in MATMUL_COMPOSITE:
            x, w = args[0], args[1]
            if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and out_ts):
                return 0.0
            k = _to_int(x.shape[-1]) if x.dim() >= 1 else 1
            return 2.0 * _numel(out_ts[0]) * k
        if pkt in flop_registry:
            out = node.meta.get("val")
            try:
                return float(flop_registry[pkt](*args, **kwargs, out_val=out))
            except Exception:
                return self._run_counted(tgt, args, kwargs)
        if pkt in FLOP_COMPOSITE:
            return self._run_counted(tgt, args, kwargs)
        return 0.0

    @staticmethod
    def _run_counted(tgt, args, kwargs) -> float:
        fake_mode = _fake_mode(_leaves((args, kwargs)))
        counter = FlopCounterMode(display=False)
        try:
            if fake_mode is not None:
                with fake_mode, counter:
                    tgt(*args, **kwargs)
            else:
                with counter:
                    tgt(*args, **kwargs)
        except Exception:
            return 0.0
        return float(counter.get_total_flops())

    def _act_bytes(self, node, kind, pkt, act_in, base, saved_bases, param_of, rg) -> float:
        def save(nodes: Iterable[torch.fx.Node]) -> float:
            total = 0.0
            for i in nodes:
                b = base.get(i, i)
                # ---- begin act_bytes fix (issue 9): model inputs (held by the caller for the whole
                # step) and buffers/constants (held by the module) are resident like parameters
                if b.op in ("placeholder", "get_attr"):
                    continue
                # ---- end act_bytes fix
                if i in param_of or b in param_of:
                    continue
                node.meta.setdefault(SAVED_KEY, []).append(b.name)  # every tensor it saves (issue 28)
                if b in saved_bases:
                    continue
                saved_bases.add(b)
                total += float(sum(self._bytes(t) for t in _tensors(b.meta.get("val"))))
            return total

        # ---- begin act_bytes fix (issue 9): matmul/linear on operands whose batched reshape is
        # not a view save fresh copies (rotary q, GQA-expanded k): ask autograd on meta tensors
        if pkt in MATMUL_COMPOSITE:
            saved = self._matmul_saved(node, rg)
            if saved is not None:
                operands, fresh = saved
                return save(i for i in operands if i not in param_of) + fresh
        if pkt in TOP_K:  # the backward scatters through the int64 indices (second output) only
            outs = _tensors(node.meta.get("val"))
            return float(sum(_numel(t) * 8 for t in outs[1:2]))
        # ---- end act_bytes fix
        if kind in ("matmul_param", "matmul", "embedding"):
            return save(act_in)
        if pkt in PRODUCT and len(node.args) >= 2:
            # d(a*b)/da needs b and d(a*b)/db needs a: save an operand iff the other needs grad;
            # a Python scalar operand needs nothing saved (x * 0.5 saves nothing)
            a, b = node.args[0], node.args[1]
            a_n, b_n = isinstance(a, torch.fx.Node), isinstance(b, torch.fx.Node)
            keep = []
            if a_n and b_n and rg.get(b, False):
                keep.append(a)
            if b_n and (rg.get(a, False) if a_n else False):
                keep.append(b)
            if pkt in DIVISION and b_n and rg.get(b, False):
                keep.append(b)
            return save(k for k in keep if k not in param_of)
        if pkt in INDEX_SAVES:
            pos = INDEX_SAVES[pkt]
            if len(node.args) <= pos:
                return 0.0
            return save(x for x in _leaves(node.args[pos]) if isinstance(x, torch.fx.Node))
        if kind == "attention":
            return save(act_in) + save([node])
        if pkt in DROPOUT:
            return float(sum(_numel(t) for t in _tensors(node.meta.get("val"))[:1]))  # bool mask
        if pkt in SAVES_NOTHING:
            return 0.0
        if pkt in SAVES_OUTPUT:
            return save([node])
        # ---- begin act_bytes fix (issue 9): what torch saves besides the input, measured with
        # saved-tensor hooks (benchmarks/bench_activation_peak.py)
        if pkt in NORM_STATS:  # mean and rstd (fp32 accumulate type) per normalized row / group / channel
            return save(act_in[:1]) + self._norm_stats_bytes(node, pkt)
        if pkt in MAX_POOL:  # the int64 argmax indices, shaped like the output
            return save(act_in[:1]) + float(sum(_numel(t) * 8 for t in _tensors(node.meta.get("val"))[:1]))
        # ---- end act_bytes fix
        if pkt in SAVES_INPUT:
            return save(act_in[:1])
        return save(act_in)

    def _matmul_saved(self, node: torch.fx.Node, rg) -> tuple[list[torch.fx.Node], float] | None:
        """What ``aten.matmul`` / ``aten.linear`` saves: operands saved as (views of) themselves, and
        bytes of fresh copies (an operand whose expand + reshape to the batched matmul's 3-D form
        is not a view is copied, and the copy is saved). Found by running the op on ``meta``
        tensors with the operands' sizes, strides and ``requires_grad`` under saved-tensor hooks;
        None when that is not possible (symbolic shapes)."""
        ops = [a for a in node.args[:3] if isinstance(a, torch.fx.Node)]
        vals = [a.meta.get("val") for a in ops]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            return None
        try:
            metas = [torch.empty_strided(tuple(_to_int(d) for d in v.shape), tuple(_to_int(d) for d in v.stride()),
                                         dtype=v.dtype, device="meta").requires_grad_(bool(rg.get(a, False)) and
                                                                                      v.dtype.is_floating_point)
                     for a, v in zip(ops, vals)]
            saved: list[torch.Tensor] = []
            args = [metas[ops.index(a)] if isinstance(a, torch.fx.Node) else a for a in node.args]
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                node.target(*args, **node.kwargs)
        except Exception:  # noqa: BLE001 - fall back to the table
            return None
        operands: list[torch.fx.Node] = []
        fresh = 0.0
        seen: set[int] = set()
        for t in saved:
            root = t._base if t._base is not None else t
            if any(root is m for m in metas):
                operands.append(ops[next(i for i, m in enumerate(metas) if root is m)])
            elif id(root) not in seen:
                seen.add(id(root))
                fresh += self._bytes(root)
        return operands, fresh

    @staticmethod
    def _norm_stats_bytes(node: torch.fx.Node, pkt) -> float:
        """Bytes of the statistics a normalization saves for its backward (fp32, 4 bytes each).

        ``layer_norm``: mean and rstd per normalized row; ``rms_norm``: rstd per row;
        ``group_norm``: mean and rstd per (sample, group); ``batch_norm`` in training: the batch
        mean and inverse std per channel (in eval it reads the running statistics, which are buffers).
        """
        x = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if not isinstance(x, torch.Tensor):
            return 0.0
        n = _numel(x)
        if pkt in LAYER_NORMS or pkt in RMS_NORMS:
            shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape", ())
            inner = 1
            for d in shape or ():
                inner *= _to_int(d)
            rows = n // max(inner, 1)
            return float(rows * 4 * (1 if pkt in RMS_NORMS else 2))
        if pkt in GROUP_NORMS:
            groups = _to_int(node.args[1]) if len(node.args) > 1 else _to_int(node.kwargs.get("num_groups", 1))
            return float(_to_int(x.shape[0]) * groups * 4 * 2)
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
        if training is True and x.dim() >= 2:
            return float(_to_int(x.shape[1]) * 4 * 2)
        return 0.0


def _reshape_copies(node: torch.fx.Node) -> bool:
    """True when ``reshape``/``flatten`` of the input's sizes and strides copies (is not a view).

    Fake values do not record view relations, so the reshape is replayed on a ``meta`` tensor
    with the input's sizes and strides; False when that is not possible.
    """
    src = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    out = node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    try:
        t = torch.empty_strided(tuple(_to_int(d) for d in src.shape), tuple(_to_int(d) for d in src.stride()),
                                dtype=src.dtype, device="meta")
        r = t.reshape(tuple(_to_int(d) for d in out.shape))
    except Exception:  # noqa: BLE001 - symbolic shapes: assume a view, as before
        return False
    return r._base is None and r is not t


def _param_target(node: torch.fx.Node) -> str:
    """The get_attr target behind a parameter node or a view chain of one."""
    while node.op != "get_attr":
        node = node.all_input_nodes[0]
    return str(node.target)
