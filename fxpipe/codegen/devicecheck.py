"""Device-dependent paths baked into a capture on ``meta``: ops the run device has no kernel for.

A model captured on the ``meta`` device runs its Python with ``x.device.type == "meta"``, so a
branch on the device takes the path for "not CPU": transformers' GraniteMoE and Jamba count
tokens per expert with ``torch.histc`` in float32 on CPU and int32 elsewhere, and the meta trace
bakes in int32, for which CPU has no ``histc`` kernel. Training then fails on the rank of that
stage, long after planning. The branch itself is gone from the graph; what is left, and what
:func:`kernel_gaps` detects, is its consequence: an op whose traced input dtypes the backend
cannot run.

How: for every distinct (aten op, input dtypes) of the graph, the op is run once on each backend
available in this process (CPU; CUDA when present) with zero tensors of the traced dtypes (the
traced shapes when small, else every dimension 1) and the traced non-tensor arguments, under a
forked RNG (ops with a size argument above 4096 elements are skipped: no large allocation). An
error saying the op is not implemented for a dtype, or cannot run on the backend, is a gap; any
other error (a shape the stand-in inputs do not satisfy) says nothing and is ignored. Cost: one
tiny op per distinct signature, 0.17 s on Llama-2-7B dimensions (2,446 nodes), run only for a
capture on meta.

What it cannot see: a device branch whose meta path *does* run on the backend (another dtype or
algorithm that CPU also supports: numerics may differ, nothing fails); ops outside ``aten``;
backends absent from this process (a plan for CUDA checked on a CPU-only machine checks CPU
only); a failure that only real data or real shapes trigger. On transformers 5.24 it finds the
int32 ``histc`` in GraniteMoE and in the shared experts implementation (``integrations/moe.py``)
of Mixtral and Qwen2-MoE captured on meta.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from fxpipe.codegen.faults import stack_trace_frame
from fxpipe.errors import FxpipeWarning

__all__ = ["DeviceBranchWarning", "KernelGap", "kernel_gaps", "captured_on_meta", "warn_meta_kernel_gaps"]

#: largest traced tensor (elements) probed with its traced shape; larger ones become all-ones shapes
_PROBE_NUMEL = 4096
#: messages of errors that mean "no kernel for this dtype / backend"
_GAP_MARKERS = ("not implemented for", "Could not run", "no kernel", "not supported for")


class DeviceBranchWarning(FxpipeWarning):
    """A capture on ``meta`` holds an op the run device's backend has no kernel for (see the module)."""


@dataclass(frozen=True)
class KernelGap:
    """One op of a captured graph that a backend cannot run with its traced input dtypes.

    Attributes
    ----------
    node : str
        fx node name.
    op : str
        The aten overload (``"aten.histc.default"``).
    input_dtypes : tuple[str, ...]
        Dtypes of its tensor inputs, as traced.
    backend : str
        ``"cpu"`` or ``"cuda"``.
    error : str
        First line of the backend's error.
    source : str
        The model's source line that made the op (the innermost frame of the model's own code in
        ``node.meta['stack_trace']``, :func:`fxpipe.codegen.faults.stack_trace_frame`), or "".
    """

    node: str
    op: str
    input_dtypes: tuple[str, ...]
    backend: str
    error: str
    source: str

    def describe(self) -> str:
        """One readable line."""
        where = f" (at {self.source})" if self.source else ""
        return (f"{self.op} on {', '.join(self.input_dtypes) or 'no tensor'} input, node {self.node}{where}: "
                f"{self.backend} has no kernel ({self.error})")


def captured_on_meta(gm: torch.fx.GraphModule) -> bool:
    """True when ``gm`` was captured with parameters, buffers or inputs on the ``meta`` device."""
    tensors = list(gm.parameters()) + list(gm.buffers())
    if any(t.is_meta for t in tensors):
        return True
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.device.type == "meta":
                return True
    return False


def _source_line(node: torch.fx.Node) -> str:
    """The model's source line of ``node`` (:func:`fxpipe.codegen.faults.stack_trace_frame`), or ""."""
    return (stack_trace_frame(node.meta.get("stack_trace")) or "")[:200]


def _stand_in(val: torch.Tensor, device: str) -> torch.Tensor:
    shape = tuple(int(d) for d in val.shape)
    if math.prod(shape) > _PROBE_NUMEL:
        shape = (1,) * len(shape)
    return torch.zeros(shape, dtype=val.dtype, device=device)


def _retarget(a: Any, device: str) -> Any:
    if isinstance(a, torch.device) or (isinstance(a, str) and a == "meta"):
        return torch.device(device) if isinstance(a, torch.device) else device
    if isinstance(a, (list, tuple)):
        return type(a)(_retarget(x, device) for x in a)
    if isinstance(a, dict):
        return {k: _retarget(v, device) for k, v in a.items()}
    return a


def _materialize(a: Any, device: str) -> tuple[Any, bool]:
    """fx args -> probe args; False when an input has no recorded tensor value."""
    if isinstance(a, torch.fx.Node):
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            return _stand_in(val, device), True
        if isinstance(val, (int, float, bool)):
            return val, True
        return None, False
    if isinstance(a, (list, tuple)):
        out, ok = [], True
        for x in a:
            v, good = _materialize(x, device)
            out.append(v)
            ok = ok and good
        return type(a)(out), ok
    if isinstance(a, dict):
        out_d, ok = {}, True
        for k, x in a.items():
            out_d[k], good = _materialize(x, device)
            ok = ok and good
        return out_d, ok
    return _retarget(a, device), True


def _too_big(a: Any) -> bool:
    """An int list whose product could allocate a large tensor (a size argument of new_zeros, repeat...)."""
    if isinstance(a, (list, tuple)):
        if a and all(isinstance(x, int) and not isinstance(x, bool) for x in a):
            return math.prod(abs(x) for x in a) > _PROBE_NUMEL
        return any(_too_big(x) for x in a)
    if isinstance(a, dict):
        return any(_too_big(x) for x in a.values())
    return False


def _dtypes(node: torch.fx.Node) -> tuple[str, ...]:
    out = []
    for a in node.all_input_nodes:
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            out.append(str(val.dtype).removeprefix("torch."))
    return tuple(out)


def _backends() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def kernel_gaps(gm: torch.fx.GraphModule, backends: Sequence[str] | None = None) -> list[KernelGap]:
    """Ops of ``gm`` that a backend cannot run with their traced input dtypes (see the module).

    Parameters
    ----------
    gm : torch.fx.GraphModule
        A captured graph whose nodes carry ``meta['val']`` (``fxpipe.passes.capture.capture``).
    backends : sequence of str, optional
        Device types to check (default: ``"cpu"``, and ``"cuda"`` when available). A backend not
        available in this process cannot be checked.

    Returns
    -------
    list[KernelGap]
        One per (op, input dtypes, backend) that fails, in graph order (the first node of each).
    """
    found: list[KernelGap] = []
    tried: set = set()
    for backend in backends if backends is not None else _backends():
        for node in gm.graph.nodes:
            target = node.target
            if node.op != "call_function" or getattr(target, "namespace", None) != "aten":
                continue
            name = str(target)
            if name.startswith("aten._assert") or name.startswith("aten.sym_"):
                continue
            dtypes = _dtypes(node)
            if not dtypes:  # factory ops: no traced input dtype to disagree with
                continue
            key = (backend, name, dtypes)
            if key in tried:
                continue
            tried.add(key)
            args, ok_a = _materialize(tuple(node.args), backend)
            kwargs, ok_k = _materialize(dict(node.kwargs), backend)
            if not (ok_a and ok_k) or _too_big(node.args) or _too_big(dict(node.kwargs)):
                continue
            try:
                with torch.random.fork_rng(devices=[]), torch.no_grad():
                    target(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - only kernel-missing errors count, see _GAP_MARKERS
                msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                if any(m in msg for m in _GAP_MARKERS):
                    found.append(KernelGap(node=node.name, op=name, input_dtypes=dtypes, backend=backend,
                                           error=msg[:200], source=_source_line(node)))
    return found


def warn_meta_kernel_gaps(gm: torch.fx.GraphModule, *, backends: Iterable[str] | None = None,
                          stacklevel: int = 3) -> list[KernelGap]:
    """Warn (:class:`DeviceBranchWarning`) when a capture on ``meta`` holds ops a backend cannot run.

    Does nothing (returns ``[]``) for a capture on a real device: its paths are the device's own.

    Returns
    -------
    list[KernelGap]
        The gaps warned about.
    """
    if not captured_on_meta(gm):
        return []
    gaps = kernel_gaps(gm, None if backends is None else list(backends))
    if gaps:
        shown = "; ".join(g.describe() for g in gaps[:3]) + (f"; and {len(gaps) - 3} more" if len(gaps) > 3 else "")
        backends = "/".join(sorted({g.backend for g in gaps}))
        warnings.warn(
            f"the model was captured on the meta device (shapes only, no weights), where its code took a branch "
            f"for devices other than CPU that {backends} cannot run: {shown}. The plan's partition and schedule do "
            f"not depend on it, but running this capture on {backends} fails in that op (transformers' "
            "GraniteMoE/Jamba/MoE experts pick histc's dtype by x.device). To train, capture the model on the "
            "device type it will run on: build it there (fxpipe plan: --run or --checkpoint build it on CPU), or "
            "patch the branch to test for 'meta' too.",
            DeviceBranchWarning,
            stacklevel=stacklevel,
        )
    return gaps
