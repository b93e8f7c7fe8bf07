"""Compare pipelined training with single-process training: losses, gradients, parameters, buffers.

The oracle of the code generator: the same model, data and micro-batch loss averaging, trained
by the pipeline and in one process, must agree. :func:`compare_training` measures every part:

* **losses**: the largest relative difference over steps, ``|l_pipe - l_ref| / |l_ref|``;
* **gradients** (of the last step, before its update): the largest absolute difference over
  every element of every parameter, divided by the largest reference gradient of the *model*
  (``max_grad_rel_diff``, the verdict). A per-parameter relative figure is reported beside it
  (``worst_param_grad_rel_diff`` and its parameter) but is not the verdict: a parameter whose
  true gradient is ~0 (a bias behind a normalisation, an attention key bias) has a large
  per-parameter ratio from float rounding alone;
* **parameters** after all steps and **buffers** (BatchNorm running statistics, counters),
  each relative to the largest reference value of its kind; integer buffers (counters) must be
  equal;
* gradients that are ``None`` in eager (parameters the forward never uses) must be ``None`` in
  the pipeline too, and every parameter and buffer must be present on both sides.

With random ops active (dropout with ``p > 0`` in training mode, ``rand``...) the two runs draw
different random numbers, so equality cannot hold: :func:`random_ops_warning` says how to compare.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

__all__ = ["TrainingComparison", "compare_training", "RandomOpsWarning", "random_ops_warning"]


class RandomOpsWarning(UserWarning):
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
        ``max_grad_abs_diff / grad_scale`` (the gradient verdict).
    worst_param_grad_rel_diff, worst_param : float, str
        Largest per-parameter ``max|g_pipe - g_ref| / max|g_ref|`` and its parameter (reported, not a verdict).
    max_param_rel_diff, max_buffer_rel_diff : float
        Largest parameter / buffer difference after training relative to the largest reference value of its kind.
    worst_buffer : str
        Buffer with the largest difference ("" if none).
    num_params, num_buffers : int
    problems : list[str]
        Missing parameters/buffers, gradient None on one side only, integer buffers that differ.
    random_ops : list[str]
        Random ops found in the graph (comparison not meaningful if non-empty).
    tolerances : dict
        ``loss_rtol``, ``rtol`` used for the verdict.
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
        if self.problems:
            text += "; " + "; ".join(self.problems[:5])
        if self.random_ops:
            text += f"; random ops active: {', '.join(self.random_ops[:3])}"
        return text


def _max_abs(t: torch.Tensor) -> float:
    return float(t.detach().double().abs().max()) if t.numel() else 0.0


def _rel(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def compare_training(pipe, ref, *, loss_rtol: float = 1e-4, rtol: float = 1e-5,
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
        of their kind (default 1e-5).
    random_ops : sequence
        Random ops of the model (recorded; they make the comparison meaningless).

    Returns
    -------
    TrainingComparison
    """
    problems: list[str] = []
    if len(pipe.losses) != len(ref.losses):
        problems.append(f"{len(pipe.losses)} pipeline losses vs {len(ref.losses)} reference losses")
    loss_rel = max((_rel(abs(a - b), abs(b)) for a, b in zip(pipe.losses, ref.losses)), default=0.0)
    if any(not math.isfinite(x) for x in list(pipe.losses) + list(ref.losses)):
        problems.append("a loss is not finite")

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
        if g is None:
            continue
        d = _max_abs(gp - g)
        s = _max_abs(g)
        grad_abs = max(grad_abs, d)
        grad_scale = max(grad_scale, s)
        r = _rel(d, s)
        if r > worst_rel or not worst_name:
            worst_rel, worst_name = r, name
    extra = sorted(set(pipe.grads) - set(ref.grads))
    if extra:
        problems.append(f"parameters only in the pipeline: {extra[:5]}")

    param_abs, param_scale = 0.0, 0.0
    for name, p in ref.params.items():
        if name not in pipe.params:
            continue  # reported with the gradients
        param_abs = max(param_abs, _max_abs(pipe.params[name] - p))
        param_scale = max(param_scale, _max_abs(p))

    buf_abs, buf_scale, worst_buf, worst_buf_d = 0.0, 0.0, "", -1.0
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
        d = _max_abs(bp - b)
        buf_abs = max(buf_abs, d)
        buf_scale = max(buf_scale, _max_abs(b))
        if d > worst_buf_d:
            worst_buf, worst_buf_d = name, d

    cmp = TrainingComparison(
        ok=False,
        loss_rel_diff=loss_rel,
        max_grad_abs_diff=grad_abs,
        grad_scale=grad_scale,
        max_grad_rel_diff=_rel(grad_abs, grad_scale),
        worst_param_grad_rel_diff=worst_rel,
        worst_param=worst_name,
        max_param_rel_diff=_rel(param_abs, param_scale),
        max_buffer_rel_diff=_rel(buf_abs, buf_scale),
        worst_buffer=worst_buf,
        num_params=len(ref.grads),
        num_buffers=len(ref_buffers),
        problems=problems,
        random_ops=[str(o) for o in random_ops],
        tolerances={"loss_rtol": loss_rtol, "rtol": rtol},
    )
    cmp.ok = (not problems and cmp.loss_rel_diff <= loss_rtol and cmp.max_grad_rel_diff <= rtol
              and cmp.max_param_rel_diff <= rtol and cmp.max_buffer_rel_diff <= rtol)
    return cmp
