"""Compare pipelined training with single-process training: losses, gradients, parameters, buffers.

The oracle of the code generator: the same model, data and micro-batch loss averaging, trained
by the pipeline and in one process, must agree. :func:`compare_training` measures every part:

* **losses**: the largest relative difference over steps, ``|l_pipe - l_ref| / |l_ref|``;
* **gradients** (of the last step, before its update): per floating dtype of the parameters,
  the largest absolute difference over every element of every parameter of that dtype, divided
  by the largest reference gradient among them (``max_grad_rel_diff`` is the largest of these
  ratios; with one dtype it is the model's figure). A per-parameter relative figure is reported
  beside it (``worst_param_grad_rel_diff`` and its parameter) but is not the verdict: a parameter
  whose true gradient is ~0 (a bias behind a normalisation, an attention key bias) has a large
  per-parameter ratio from float rounding alone (up to 2.8 in the architecture matrix);
* **parameters** after all steps and **buffers** (BatchNorm running statistics, counters),
  the same way per dtype, relative to the largest reference value of their kind and dtype;
  integer buffers (counters) must be equal;
* gradients that are ``None`` in eager (parameters the forward never uses) must be ``None`` in
  the pipeline too, and every parameter and buffer must be present on both sides.

**Tolerances per dtype.** Rounding differences (another summation order of the micro-batch
gradients, another reduction order) are a few units in the last place (ulps) *of the tensor's
own dtype*: bfloat16's machine epsilon is 2**-7 = 7.8e-3, 2**16 times fp32's. One tolerance for
the model (1e-5 of its largest gradient) calls a bf16 + fp32 model whose every gradient is within
2 ulps of its dtype a mismatch. So tensors are compared in groups of one kind and dtype, and
each tensor passes within ``max(rtol * scale, ulps * eps * scale_t, ulps_of_largest * eps *
scale)``: ``eps = torch.finfo(dtype).eps`` (1.2e-7 fp32, 9.8e-4 fp16, 7.8e-3 bf16), ``scale_t``
the tensor's largest reference value, ``scale`` the group's. For fp32 and wider ``rtol`` (1e-5,
84 fp32 ulps) is the largest term, so an fp32 model's verdict is the model-wide rule above; for
bf16 / fp16 the ulps terms decide: 8 ulps at the tensor's own scale (measured: <= 1.9 on a
bf16 + fp32 MLP at 3 micro-batches, 2 and 3 steps, 2 seeds; a dropped micro-batch or a missing
gradient path is off by a sizable fraction of the tensor and is caught), with a floor of 2 ulps
at the group's largest for tensors whose true value is ~0 (measured <= 0.97 there). A gradient
carries the rounding of every dtype it depends on, not only of its parameter's: an fp32 parameter
feeding a bf16 block gets bf16-sized differences, and after one update so does an fp32 head
reading bf16-computed activations (measured: 4e-3 of the largest fp32 gradient on a bf16 + fp32
MLP at 3 micro-batches, 2 steps). Gradients and trained parameters are therefore grouped by the
least precise dtype among the values their backward reads (:func:`gradient_precision` of the
captured graph, recorded by the training workers), the loss likewise (:func:`output_precision`);
without a graph, by their own dtype. In a model with a bf16 block that is bf16 for nearly every
parameter: the honest precision of such a model's training.
:meth:`TrainingComparison.explain` lists every group: its tensors, worst tensor, worst difference
in ulps of its dtype and the tolerance used.

With random ops active (dropout with ``p > 0`` in training mode, ``rand``...) the two runs draw
different random numbers, so equality cannot hold: :func:`random_ops_warning` says how to compare.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import torch

from fxpipe.codegen.split import canonical_param_names
from fxpipe.errors import FxpipeWarning, InputError

__all__ = ["TrainingComparison", "DtypeCheck", "compare_training", "gradient_precision", "output_precision",
           "RandomOpsWarning", "random_ops_warning"]


class RandomOpsWarning(FxpipeWarning):
    """The model draws random numbers in training mode: pipelined and single-process runs differ."""


def random_ops_warning(ops: Sequence[Any], *, stacklevel: int = 3) -> None:
    """Warn (:class:`RandomOpsWarning`) that bitwise equality cannot hold with these random ops."""
    if not ops:
        return
    listed = ", ".join(str(o) for o in list(ops)[:5]) + (f" and {len(ops) - 5} more" if len(ops) > 5 else "")
    warnings.warn(
        f"the model draws random numbers in training mode ({listed}): the pipeline draws them on other "
        "processes and in another order than a single-process run, so losses and gradients cannot match "
        "exactly. To compare, train in eval mode (model.eval()) or set every dropout probability to 0; "
        "to train for real, keep them and compare loss curves statistically.",
        RandomOpsWarning,
        stacklevel=stacklevel,
    )


@dataclass
class DtypeCheck:
    """The comparison of one kind of tensor (gradients, parameters, buffers) of one floating dtype.

    Each tensor ``t`` of the group passes when its largest difference ``err_t`` is within
    ``tol_t = max(rtol * scale, ulps * eps * scale_t, ulps_of_largest * eps * scale)``
    (``scale_t``: its own largest reference value; see :func:`compare_training`).

    Attributes
    ----------
    kind : {"grad", "param", "buffer"}
    dtype : str
        ``"bfloat16"``, ``"float32"``, ...
    tensors : int
        Tensors of this kind and dtype compared.
    scale : float
        Largest ``|reference value|`` among them.
    max_abs_diff : float
        Largest ``|pipeline - reference|`` over all their elements.
    rel_diff : float
        ``max_abs_diff / scale`` (the model-wide figure of earlier versions, per dtype).
    worst : str
        The tensor closest to (or furthest beyond) its tolerance: largest ``err_t / tol_t``.
    worst_scale : float
        Its largest reference value ``scale_t``.
    ulps : float
        Its difference in units of the dtype's spacing at its own scale, ``err_t / (eps * scale_t)``.
    ulps_of_largest : float
        The same at the group's scale, ``err_t / (eps * scale)``.
    tolerance : float
        Its tolerance ``tol_t`` (absolute).
    ratio : float
        ``err_t / tol_t`` of the worst tensor (the group passes when <= 1).
    eps : float
        ``torch.finfo(dtype).eps``.
    ok : bool
        Every tensor within its tolerance.
    lowered : tuple[str, ...]
        Tensors of a more precise dtype compared in this group because their gradient depends
        on values of this dtype (:func:`gradient_precision`; gradients and trained parameters only).
    rule : str
        The tolerance rule with its settings, e.g. ``"max(1e-05 x largest, 8 ulps x own, 2 ulps x largest)"``.
    """

    kind: str
    dtype: str
    tensors: int
    scale: float
    max_abs_diff: float
    rel_diff: float
    worst: str
    worst_scale: float
    ulps: float
    ulps_of_largest: float
    tolerance: float
    ratio: float
    eps: float
    ok: bool
    lowered: tuple[str, ...] = ()
    rule: str = ""

    def explain(self) -> str:
        """One line: what was compared, the worst tensor and difference, the tolerance, the verdict."""
        what = {"grad": "gradients", "param": "parameters", "buffer": "buffers"}.get(self.kind, self.kind)
        low = ""
        if self.lowered:
            shown = ", ".join(self.lowered[:3]) + (f" and {len(self.lowered) - 3} more" if len(self.lowered) > 3 else "")
            low = (f", {len(self.lowered)} of them of a more precise dtype whose gradient depends on "
                   f"{self.dtype} values: {shown}")
        return (f"{what} {self.dtype} ({self.tensors} tensors{low}; largest reference {self.scale:.2e}): worst "
                f"{self.worst or '-'} (largest {self.worst_scale:.2e}), {self.ulps:.3g} ulps of {self.dtype} at its "
                f"own scale, {self.ulps_of_largest:.3g} at the largest; tolerance {self.tolerance:.2e} = {self.rule} "
                f"= {self.tolerance / (self.eps * self.worst_scale) if self.worst_scale > 0 else math.inf:.3g} ulps "
                f"at its own scale: {'ok' if self.ok else 'DIFFERENT'}")


@dataclass
class TrainingComparison:
    """Differences between a pipelined and a single-process training run (see the module docstring).

    Attributes
    ----------
    ok : bool
        Every figure within its tolerance and nothing missing.
    loss_rel_diff : float
        Largest relative loss difference over steps.
    max_grad_abs_diff : float
        Largest ``|g_pipe - g_ref|`` over all gradient elements.
    grad_scale : float
        Largest ``|g_ref|`` of the model.
    max_grad_rel_diff : float
        The largest gradient difference relative to the largest reference gradient of its dtype,
        over the dtypes (with one dtype: ``max_grad_abs_diff / grad_scale``). The verdict compares
        each dtype with its own tolerance (``checks``).
    worst_param_grad_rel_diff, worst_param : float, str
        Largest per-parameter ``max|g_pipe - g_ref| / max|g_ref|`` and its parameter (reported, not a verdict).
    max_param_rel_diff, max_buffer_rel_diff : float
        Largest parameter / buffer difference after training relative to the largest reference
        value of its kind and dtype, over the dtypes.
    worst_buffer : str
        Buffer with the largest difference ("" if none).
    num_params, num_buffers : int
    problems : list[str]
        Missing parameters/buffers, gradient None on one side only, integer buffers that differ.
    random_ops : list[str]
        Random ops found in the graph (comparison not meaningful if non-empty).
    tolerances : dict
        ``loss_rtol``, ``rtol`` and ``ulps`` used for the verdict.
    checks : list[DtypeCheck]
        One per kind (gradients, parameters, floating buffers) and floating dtype: the verdict's
        terms (:meth:`explain`).
    """

    ok: bool
    loss_rel_diff: float
    max_grad_abs_diff: float
    grad_scale: float
    max_grad_rel_diff: float
    worst_param_grad_rel_diff: float
    worst_param: str
    max_param_rel_diff: float
    max_buffer_rel_diff: float
    worst_buffer: str
    num_params: int
    num_buffers: int
    problems: list[str] = field(default_factory=list)
    random_ops: list[str] = field(default_factory=list)
    tolerances: dict = field(default_factory=dict)
    checks: list[DtypeCheck] = field(default_factory=list)

    def __post_init__(self):
        # TrainingComparison(**cmp.to_dict()) (the CLI's JSON round trip) gives the checks as dicts
        self.checks = [DtypeCheck(**{**c, "lowered": tuple(c.get("lowered", ()))}) if isinstance(c, dict) else c
                       for c in self.checks]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return asdict(self)

    @property
    def meaningful(self) -> bool:
        """False when random ops make bitwise agreement impossible."""
        return not self.random_ops

    def summary(self) -> str:
        """One readable line."""
        verdict = "equal" if self.ok else "DIFFERENT"
        text = (
            f"{verdict}: loss rel {self.loss_rel_diff:.1e}, grad {self.max_grad_rel_diff:.1e} of the largest gradient "
            f"(worst parameter {self.worst_param or '-'} {self.worst_param_grad_rel_diff:.1e} of its own), "
            f"params {self.max_param_rel_diff:.1e}, buffers {self.max_buffer_rel_diff:.1e} "
            f"({self.num_params} parameters, {self.num_buffers} buffers)"
        )
        if len({c.dtype for c in self.checks}) > 1 or any(not c.ok for c in self.checks):
            shown = [c for c in self.checks if not c.ok] or [c for c in self.checks if c.kind == "grad"]
            text += "; per dtype: " + "; ".join(c.explain() for c in shown)
        if self.problems:
            text += "; " + "; ".join(self.problems[:5])
        if self.random_ops:
            text += f"; random ops active: {', '.join(self.random_ops[:3])}"
        return text

    def explain(self) -> str:
        """The verdict, one line per term: losses, then every (kind, dtype) group with its worst
        tensor, its worst difference in ulps of its dtype and the tolerance used, then problems."""
        loss_tol = self.tolerances.get("loss_tol", self.tolerances.get("loss_rtol", 0.0))
        loss_prec = self.tolerances.get("loss_precision")
        lines = [f"{'equal' if self.ok else 'DIFFERENT'} ({self.num_params} parameters, {self.num_buffers} buffers)",
                 f"losses{' (' + loss_prec + ')' if loss_prec else ''}: {self.loss_rel_diff:.1e} relative; "
                 f"tolerance {loss_tol:.1e}: {'ok' if self.loss_rel_diff <= loss_tol else 'DIFFERENT'}"]
        lines += [c.explain() for c in self.checks]
        lines += [f"problem: {p}" for p in self.problems]
        if self.random_ops:
            lines.append(f"random ops active (equality cannot hold): {', '.join(self.random_ops[:5])}")
        return "\n".join(lines)


def _max_abs(t: torch.Tensor) -> float:
    return float(t.detach().double().abs().max()) if t.numel() else 0.0


def _rel(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def _dtype(d) -> torch.dtype:
    """A dtype from a dtype or its name (``"bfloat16"``, ``"torch.bfloat16"``)."""
    if isinstance(d, torch.dtype):
        return d
    got = getattr(torch, str(d).removeprefix("torch."), None)
    if not isinstance(got, torch.dtype):
        raise InputError(f"unknown dtype {d!r}: use a torch.dtype or its name, e.g. 'bfloat16'")
    return got


def _eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating (or complex: of its real part) dtype."""
    if dtype.is_complex:
        dtype = torch.empty(0, dtype=dtype).real.dtype
    return float(torch.finfo(dtype).eps)


class _Groups:
    """Per (kind, dtype): every tensor's difference and scale."""

    def __init__(self):
        self.acc: dict[tuple[str, torch.dtype], list] = {}  # -> [(name, err, scale_t, lowered)]

    def add(self, kind: str, name: str, ref: torch.Tensor, pipe: torch.Tensor, dtype: torch.dtype | None = None) -> float:
        d = _max_abs(pipe.detach().double() - ref.detach().double()) if ref.numel() else 0.0
        group = dtype if dtype is not None and _eps(dtype) > _eps(ref.dtype) else ref.dtype
        self.acc.setdefault((kind, group), []).append((name, d, _max_abs(ref), group != ref.dtype))
        return d

    def checks(self, rtol: float, ulps: float, ulps_of_largest: float) -> list[DtypeCheck]:
        order = {"grad": 0, "param": 1, "buffer": 2}
        out = []
        for (kind, dtype), rows in sorted(self.acc.items(), key=lambda kv: (order[kv[0][0]], str(kv[0][1]))):
            eps = _eps(dtype)
            scale = max(r[2] for r in rows)
            diff = max(r[1] for r in rows)
            floor = max(rtol * scale, ulps_of_largest * eps * scale)
            worst, worst_ratio, worst_tol = rows[0], -1.0, 0.0
            for row in rows:
                tol = max(floor, ulps * eps * row[2])
                ratio = _rel(row[1], tol)
                if ratio > worst_ratio:
                    worst, worst_ratio, worst_tol = row, ratio, tol
            name, err, scale_t, _ = worst
            out.append(DtypeCheck(kind=kind, dtype=str(dtype).removeprefix("torch."), tensors=len(rows), scale=scale,
                                  max_abs_diff=diff, rel_diff=_rel(diff, scale), worst=name, worst_scale=scale_t,
                                  ulps=_rel(err, eps * scale_t), ulps_of_largest=_rel(err, eps * scale),
                                  tolerance=worst_tol, ratio=worst_ratio, eps=eps, ok=worst_ratio <= 1.0,
                                  lowered=tuple(r[0] for r in rows if r[3]),
                                  rule=f"max({rtol:g} x largest, {ulps:g} ulps x own, {ulps_of_largest:g} ulps x largest)"))
        return out


def _least_precise(dtypes) -> torch.dtype | None:
    """The floating dtype with the largest machine epsilon (ties: the first seen)."""
    best = None
    for d in dtypes:
        if (d.is_floating_point or d.is_complex) and (best is None or _eps(d) > _eps(best)):
            best = d
    return best


def _val_dtypes(val) -> list[torch.dtype]:
    if isinstance(val, torch.Tensor):
        return [val.dtype]
    if isinstance(val, (list, tuple)):
        return [d for v in val for d in _val_dtypes(v)]
    return []


def gradient_precision(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Parameter -> the least precise floating dtype its gradient (and trained value) depends on.

    The gradient of a parameter is computed by the backward of every op its value reaches, and
    each such backward reads that op's other inputs: so it carries the rounding of every dtype
    among the reached ops' outputs *and their ancestors* (after a first update, another
    parameter's bf16 rounding difference reaches an fp32 head's gradient through the activations
    it multiplies). With ``A(v)`` the least precise dtype among ``v`` and its ancestors, the
    answer for parameter ``p`` is the least precise ``A(v)`` over ``p``'s descendants ``v`` (the
    output node excluded): one forward and one reverse pass over the graph, ``O(nodes + edges)``.
    Dtypes come from the recorded values (``node.meta['val']``) of a captured (unlifted) graph;
    "least precise" means the largest ``torch.finfo(dtype).eps``. In an all-fp32 model every
    answer is ``"float32"``; in a model with a bf16 block most gradients are ``"bfloat16"``.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        The captured graph (``fxpipe.passes.capture.capture(...).gm``).

    Returns
    -------
    dict[str, str]
        Canonical parameter name (``named_parameters()``) -> dtype name without ``torch.``,
        for every parameter that requires grad and is read by the graph.
    """
    canon = canonical_param_names(gm)
    nodes = list(gm.graph.nodes)
    anc: dict = {}
    for n in nodes:  # topological order
        own = _val_dtypes(n.meta.get("val"))
        if n.op == "get_attr" and str(n.target) in canon:
            own.append(gm.get_parameter(str(n.target)).dtype)
        anc[n] = _least_precise(own + [anc[a] for a in n.all_input_nodes if anc.get(a) is not None])
    reach: dict = {}
    for n in reversed(nodes):
        if n.op == "output":
            continue
        reach[n] = _least_precise([d for d in [anc[n]] + [reach.get(u) for u in n.users] if d is not None])
    out: dict[str, str] = {}
    for n in nodes:
        if n.op != "get_attr" or str(n.target) not in canon:
            continue
        p = gm.get_parameter(str(n.target))
        if not p.requires_grad:
            continue
        name = canon[str(n.target)]
        d = _least_precise([reach.get(n) or p.dtype] + ([getattr(torch, out[name])] if name in out else []))
        out[name] = str(d or p.dtype).removeprefix("torch.")
    return out


def output_precision(gm: torch.fx.GraphModule) -> str | None:
    """The least precise floating dtype among the model's outputs and their ancestors (the
    precision of a loss computed from them; see :func:`gradient_precision`), or None."""
    anc: dict = {}
    for n in gm.graph.nodes:
        own = _val_dtypes(n.meta.get("val")) if n.op != "output" else []
        anc[n] = _least_precise(own + [anc[a] for a in n.all_input_nodes if anc.get(a) is not None])
        if n.op == "output":
            return None if anc[n] is None else str(anc[n]).removeprefix("torch.")
    return None


def compare_training(pipe, ref, *, loss_rtol: float = 1e-4, rtol: float = 1e-5, ulps: float = 8.0,
                     ulps_of_largest: float = 2.0,
                     precision: Mapping[str, Any] | None = None, loss_precision: Any = None,
                     random_ops: Sequence[Any] = ()) -> TrainingComparison:
    """Compare two :class:`~fxpipe.codegen.launch.TrainResult` s (pipeline, reference).

    Parameters
    ----------
    pipe, ref : TrainResult
        ``losses``, ``grads`` (None where eager has no gradient), ``params``, ``buffers``.
    loss_rtol : float
        Tolerance on the relative loss difference (default 1e-4).
    rtol : float
        Tolerance on gradients, parameters and buffers relative to the largest reference value
        of their kind and dtype (default 1e-5), for every dtype.
    ulps, ulps_of_largest : float
        Tolerances in units of each dtype's spacing (``eps = torch.finfo(dtype).eps``): a tensor
        ``t`` of a (kind, dtype) group with largest reference value ``scale_t``, in a group whose
        largest is ``scale``, passes when its largest difference is within
        ``max(rtol * scale, ulps * eps * scale_t, ulps_of_largest * eps * scale)`` (defaults 8 and
        2). ``rtol`` decides for fp32 and wider (both ulps terms are below 1e-5 of the largest),
        so an fp32 model's verdict is unchanged; for bf16 / fp16 the ulps terms decide: 8 ulps of
        the tensor's own scale (a dropped micro-batch, a missing path is off by a sizable
        fraction of the gradient: caught), 2 ulps of the group's largest for a tensor whose true
        value is ~0 (its rounding is that of the larger terms it cancels).    precision : mapping, optional
        Parameter name -> the least precise dtype its gradient passes through (a dtype or its
        name; :func:`gradient_precision` of the captured graph). A parameter's gradient and
        trained value are compared in the group of that dtype when it is less precise than the
        parameter's own. Default: ``pipe.meta["grad_precision"]`` (the workers of
        :func:`~fxpipe.codegen.launch.spawn_train` record it), else every parameter's own dtype.
    loss_precision : torch.dtype or str, optional
        The least precise dtype the model's outputs depend on (:func:`output_precision`); the
        losses pass within ``max(loss_rtol, ulps * eps)`` relative of it. Default:
        ``pipe.meta["output_precision"]``, else fp32 (``loss_rtol`` alone).
    random_ops : sequence
        Random ops of the model (recorded; they make the comparison meaningless).

    Returns
    -------
    TrainingComparison
        ``checks`` holds one :class:`DtypeCheck` per kind and dtype; ``explain()`` prints them.
    """
    problems: list[str] = []
    if len(pipe.losses) != len(ref.losses):
        problems.append(f"{len(pipe.losses)} pipeline losses vs {len(ref.losses)} reference losses")
    loss_rel = max((_rel(abs(a - b), abs(b)) for a, b in zip(pipe.losses, ref.losses)), default=0.0)
    if any(not math.isfinite(x) for x in list(pipe.losses) + list(ref.losses)):
        problems.append("a loss is not finite")

    groups = _Groups()
    meta = getattr(pipe, "meta", None) or {}
    if precision is None:
        precision = meta.get("grad_precision") or {}
    lowered = {k: _dtype(v) for k, v in precision.items()}
    if loss_precision is None:
        loss_precision = meta.get("output_precision")
    loss_tol = loss_rtol if loss_precision is None else max(loss_rtol, ulps * _eps(_dtype(loss_precision)))

    def same_dtype(kind: str, name: str, a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.dtype == b.dtype:
            return True
        problems.append(f"{kind} {name} is {a.dtype} in the pipeline, {b.dtype} in eager")
        return False

    grad_abs, grad_scale, worst_rel, worst_name = 0.0, 0.0, 0.0, ""
    for name, g in ref.grads.items():
        if name not in pipe.grads:
            problems.append(f"parameter {name} missing from the pipeline")
            continue
        gp = pipe.grads[name]
        if (g is None) != (gp is None):
            problems.append(f"gradient of {name} is {'None' if gp is None else 'a tensor'} in the pipeline, "
                            f"{'None' if g is None else 'a tensor'} in eager")
            continue
        if g is None or not same_dtype("gradient of", name, gp, g):
            continue
        d = groups.add("grad", name, g, gp, lowered.get(name))
        s = _max_abs(g)
        grad_abs = max(grad_abs, d)
        grad_scale = max(grad_scale, s)
        r = _rel(d, s)
        if r > worst_rel or not worst_name:
            worst_rel, worst_name = r, name
    extra = sorted(set(pipe.grads) - set(ref.grads))
    if extra:
        problems.append(f"parameters only in the pipeline: {extra[:5]}")

    for name, p in ref.params.items():
        if name not in pipe.params:
            continue  # reported with the gradients
        if same_dtype("parameter", name, pipe.params[name], p):
            groups.add("param", name, p, pipe.params[name], lowered.get(name))

    ref_buffers = getattr(ref, "buffers", {}) or {}
    pipe_buffers = getattr(pipe, "buffers", {}) or {}
    for name, b in ref_buffers.items():
        if name not in pipe_buffers:
            problems.append(f"buffer {name} missing from the pipeline")
            continue
        bp = pipe_buffers[name]
        if tuple(bp.shape) != tuple(b.shape):
            problems.append(f"buffer {name} has shape {tuple(bp.shape)} in the pipeline, {tuple(b.shape)} in eager")
            continue
        if not (b.is_floating_point() or b.is_complex()):
            if not torch.equal(bp, b):
                problems.append(f"integer buffer {name} differs: {bp.flatten()[:4].tolist()} vs {b.flatten()[:4].tolist()}")
            continue
        if same_dtype("buffer", name, bp, b):
            groups.add("buffer", name, b, bp)

    checks = groups.checks(rtol, ulps, ulps_of_largest)

    def worst(kind: str) -> tuple[float, str]:
        mine = [c for c in checks if c.kind == kind]
        top = max(mine, key=lambda c: c.rel_diff, default=None)
        return (top.rel_diff, top.worst) if top is not None else (0.0, "")

    cmp = TrainingComparison(
        ok=False,
        loss_rel_diff=loss_rel,
        max_grad_abs_diff=grad_abs,
        grad_scale=grad_scale,
        max_grad_rel_diff=worst("grad")[0],
        worst_param_grad_rel_diff=worst_rel,
        worst_param=worst_name,
        max_param_rel_diff=worst("param")[0],
        max_buffer_rel_diff=worst("buffer")[0],
        worst_buffer=worst("buffer")[1],
        num_params=len(ref.grads),
        num_buffers=len(ref_buffers),
        problems=problems,
        random_ops=[str(o) for o in random_ops],
        tolerances={"loss_rtol": loss_rtol, "rtol": rtol, "ulps": ulps, "ulps_of_largest": ulps_of_largest,
                    "loss_tol": loss_tol,
                    "loss_precision": None if loss_precision is None else str(_dtype(loss_precision)).removeprefix("torch.")},
        checks=checks,
    )
    cmp.ok = not problems and cmp.loss_rel_diff <= loss_tol and all(c.ok for c in checks)
    return cmp
