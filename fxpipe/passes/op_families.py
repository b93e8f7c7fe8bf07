"""Families of ATen ops recognised by their ``OpOverloadPacket`` (torch only, no fxpipe import).

The matmul-class families are shared by the cost model (:mod:`fxpipe.passes.costing`, which
counts their FLOPs) and by the capture's constant duplication
(:mod:`fxpipe.passes.duplicate_constants`, which never copies a matmul-class op); a leaf
module, so the capture (which runs the duplication) and the cost model (which reads capture
helpers) do not import each other.
"""

from __future__ import annotations

import torch

__all__ = ["packets", "MATMUL_COMPOSITE", "FLOP_COMPOSITE", "ATTENTION", "REDUCTION", "efficiency_family"]

aten = torch.ops.aten


def packets(*names: str) -> frozenset:
    """The ``aten`` packets of ``names`` this torch has (a name it lacks is left out)."""
    out = set()
    for n in names:
        if hasattr(aten, n):
            out.add(getattr(aten, n))
    return frozenset(out)


#: Composite matmuls (``linear``, ``matmul``): their FLOPs are those of the mm / addmm / bmm they become.
MATMUL_COMPOSITE = packets("linear", "matmul")
#: Other composites with FLOPs torch's counter sees only after decomposition.
FLOP_COMPOSITE = packets(
    "einsum", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "scaled_dot_product_attention", "bilinear", "tensordot", "chain_matmul",
    "addbmm", "addmv", "mv", "dot", "vdot", "outer", "inner",
)
#: Attention kernels (SDPA and its backends).
ATTENTION = packets(
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
    "_efficient_attention_forward",
)
#: Reductions (one memory-bound pass that shrinks a dimension): the ``"reduction"`` efficiency family.
REDUCTION = packets(
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "var_mean", "std_mean", "norm",
    "linalg_vector_norm", "logsumexp", "cumsum", "cumprod", "argmax", "argmin", "softmax", "_softmax", "log_softmax",
    "_log_softmax", "nll_loss", "nll_loss_forward", "nll_loss_nd", "cross_entropy_loss", "any", "all", "count_nonzero",
)

#: Roofline op kind (:data:`fxpipe.cost.roofline.KINDS`) -> efficiency family, where the kind decides it.
_KIND_FAMILY = {"matmul_param": "matmul", "matmul": "matmul", "attention": "attention", "embedding": "embedding"}


def efficiency_family(kind: str, packet) -> str:
    """The efficiency family (:data:`fxpipe.cost.specs.COMPUTE_FAMILIES`) of an op of roofline ``kind`` and ATen ``packet``.

    Matmul-class kinds -> ``"matmul"``, attention -> ``"attention"``, embedding -> ``"embedding"``;
    the other (memory-bound) ops -> ``"reduction"`` when their packet is in :data:`REDUCTION`, else
    ``"elementwise"``.
    """
    fam = _KIND_FAMILY.get(kind)
    if fam is not None:
        return fam
    return "reduction" if packet in REDUCTION else "elementwise"
