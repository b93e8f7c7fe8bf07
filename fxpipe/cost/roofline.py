"""Analytic roofline cost model of one op, and the per-op cost record :class:`OpCost`.

No torch here: these functions take FLOPs, bytes and a :class:`~fxpipe.cost.hardware.HardwareSpec`
and return seconds. The fx pass :class:`fxpipe.passes.annotate.AnnotateCosts` extracts FLOPs
and bytes from a captured graph and calls them.

Forward time (roofline model, Williams, Waterman & Patterson, "Roofline: an insightful visual
performance model for multicore architectures", CACM 52(4), 2009)::

    t_fwd = max(flops / peak(dtype), bytes / hbm_bandwidth) + launch_overhead

Backward time follows Zero Bubble's F/B/W split (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, Section 2): B computes the gradient w.r.t. the op's input, W the
gradient w.r.t. its weights. For a matmul ``Y = X W``, ``dX = dY W^T`` and ``dW = X^T dY``
are each one matmul of the forward's size, so ``t_B ~ t_W ~ t_F`` (Zero Bubble's
``T_F ~ T_B ~ T_W``). The rules, per op kind (``core = t_fwd - launch_overhead``):

==================  ==========================  ============================
kind                t_bwd_input_s               t_bwd_weight_s
==================  ==========================  ============================
``shape``           0                           0
``matmul_param``    core (if input needs grad)  core
``matmul``          core x (# inputs w/ grad)   0
``attention``       2.5 core                    0
``embedding``       0 (integer indices)         (2 out + weight) bytes / bw
``param_other``     factor x core               core
``elementwise``     factor x core               0
==================  ==========================  ============================

``factor`` is 2 for softmax and normalisation ops (their gradient reads the input and the
output gradient and does two reductions), 1 otherwise; ``+ launch_overhead`` for every
non-zero term. Ops whose output needs no gradient (integer ops, masks, ops under
``no_grad``) have B = W = 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: Op kinds understood by :func:`backward_times`.
KINDS = ("shape", "matmul_param", "matmul", "attention", "embedding", "param_other", "elementwise", "input", "output")

#: Attention backward / forward FLOP ratio (FlashAttention-2: 2.5x; Dao 2023, Section 3.1).
ATTENTION_BWD_FACTOR = 2.5


@dataclass(frozen=True)
class OpCost:
    """Cost of one fx node for ONE micro-batch (stored under ``node.meta["fxpipe_cost"]``).

    Attributes
    ----------
    flops : float
        Forward FLOPs (multiply-add = 2 FLOPs; matmul, convolution and attention FLOPs, as
        counted by ``torch.utils.flop_counter``; elementwise ops count 0 and are memory-bound).
    bytes : float
        Bytes the forward reads and writes (tensor inputs, parameters read, outputs).
    t_fwd_s, t_bwd_input_s, t_bwd_weight_s : float
        Forward, backward-input (B) and backward-weight (W) time, seconds.
    size_out_bytes : float
        Sum of the bytes of the node's output tensors.
    size_param_bytes : float
        Bytes of the parameters this node owns (each parameter owned by its first consumer
        in program order).
    act_bytes : float
        Bytes this node's forward keeps alive for its backward (see
        :mod:`fxpipe.passes.annotate` for the approximation).
    kind : str
        One of :data:`KINDS`.
    dtype : str
        Compute dtype name used for the peak (``"fp32"``, ``"bf16"``, ...), ``""`` if none.
    requires_grad : bool
        Whether the node's output takes part in the backward.
    """

    flops: float = 0.0
    bytes: float = 0.0
    t_fwd_s: float = 0.0
    t_bwd_input_s: float = 0.0
    t_bwd_weight_s: float = 0.0
    size_out_bytes: float = 0.0
    size_param_bytes: float = 0.0
    act_bytes: float = 0.0
    kind: str = "elementwise"
    dtype: str = ""
    requires_grad: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def roofline_s(flops: float, bytes_moved: float, peak_flops_per_s: float, mem_bytes_per_s: float) -> float:
    """Roofline time without launch overhead: ``max(flops / peak, bytes / bandwidth)`` (s).

    Raises
    ------
    ValueError
        If a rate is not positive or an amount is negative.
    """
    if peak_flops_per_s <= 0 or mem_bytes_per_s <= 0:
        raise ValueError("peak FLOP/s and bandwidth must be positive")
    if flops < 0 or bytes_moved < 0:
        raise ValueError("flops and bytes must be >= 0")
    return max(flops / peak_flops_per_s, bytes_moved / mem_bytes_per_s)


def is_compute_bound(flops: float, bytes_moved: float, peak_flops_per_s: float, mem_bytes_per_s: float) -> bool:
    """True when the op's arithmetic intensity ``flops / bytes`` exceeds the ridge point."""
    return flops * mem_bytes_per_s > bytes_moved * peak_flops_per_s


def forward_time_s(flops: float, bytes_moved: float, peak_flops_per_s: float, mem_bytes_per_s: float,
                   launch_overhead_s: float) -> float:
    """``roofline_s(...) + launch_overhead_s`` (seconds)."""
    return roofline_s(flops, bytes_moved, peak_flops_per_s, mem_bytes_per_s) + launch_overhead_s


def backward_times(kind: str, core_s: float, launch_overhead_s: float, *, input_grads: int = 1,
                   factor: float = 1.0, weight_grad_s: float | None = None) -> tuple[float, float]:
    """``(t_bwd_input_s, t_bwd_weight_s)`` of one op from its forward core time (table above).

    Parameters
    ----------
    kind : str
        Op kind (:data:`KINDS`).
    core_s : float
        Forward roofline time without launch overhead, seconds.
    launch_overhead_s : float
        Per-kernel overhead added to every non-zero term.
    input_grads : int
        Number of tensor inputs (non-parameter) that need a gradient.
    factor : float
        B/F ratio for ``elementwise``/``param_other`` ops (2 for softmax/normalisation).
    weight_grad_s : float, optional
        Core time of the weight gradient where it is not ``core_s`` (embedding).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown op kind {kind!r}")

    def t(x: float) -> float:
        return x + launch_overhead_s if x > 0 else 0.0

    w_core = core_s if weight_grad_s is None else weight_grad_s
    if kind in ("shape", "input", "output"):
        return 0.0, 0.0
    if kind == "matmul_param":
        return (t(core_s) if input_grads > 0 else 0.0), t(w_core)
    if kind == "matmul":
        return t(core_s * input_grads), 0.0
    if kind == "attention":
        return t(ATTENTION_BWD_FACTOR * core_s) if input_grads > 0 else 0.0, 0.0
    if kind == "embedding":
        return (t(core_s) if input_grads > 0 else 0.0), t(w_core)
    if kind == "param_other":
        return (t(factor * core_s) if input_grads > 0 else 0.0), t(w_core)
    # elementwise and everything else without weights
    return (t(factor * core_s) if input_grads > 0 else 0.0), 0.0
