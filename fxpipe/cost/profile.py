"""Op-level profiler: measure every op of a captured graph on this device.

:func:`profile_graph` runs each op of a captured :class:`torch.fx.GraphModule` (as produced by
:func:`fxpipe.passes.capture.capture`) on the current device, on tensors of the recorded shapes,
dtypes and strides, and measures three times per op (Zero Bubble's F/B/W split, Qi et al.,
"Zero Bubble Pipeline Parallelism", ICLR 2024, Section 2):

* forward (F): the op with autograd recording, as in a training forward;
* backward-input (B): ``torch.autograd.grad`` of the op's outputs w.r.t. its activation
  inputs that need a gradient;
* backward-weight (W): the same w.r.t. its trainable weights.

Autograd computes only the gradients asked for (its ``needs_input_grad`` / output masks), so B
and W are measured apart, as the Zero Bubble runtime runs them. The fixed cost of one
``torch.autograd.grad`` call (graph-task set-up, measured on a chain of tiny ops) is
subtracted from B, since a stage's backward-input is one call over all its ops; it is kept in
W, since ``torch.distributed.pipelining`` computes weight gradients with one call per
parameter group (``stage_backward_weight``), i.e. about one per op with weights.

Timing. On CPU, :class:`CpuTimer`: ``time.perf_counter_ns`` around every call, after warm-up,
with Python's garbage collector off, repeated until ``min_time_s`` has passed (between
``min_repeats`` and ``max_repeats`` calls), and the median is kept (the intra-op thread
count is part of the key). On CUDA, :class:`CudaEventTimer`: a pair of CUDA events around
every call, one synchronisation at the end, the median of the event intervals (the usual
``triton.testing.do_bench`` recipe, without its L2 flush).

Inputs. Floating tensors are uniform in [0.5, 1.5) (no NaN, no denormals); integer and bool
tensors take their real values when the model has real weights and example inputs (one
forward under :class:`torch.fx.Interpreter` records every integer/bool intermediate: token
ids, position ids, masks), else zeros (integers, always valid indices) and random bits
(bools). A model on the ``meta`` device is profiled without its weights: only the shapes are
needed.

Database. Every measurement goes into a :class:`~fxpipe.cost.database.CostDatabase` keyed by
(op signature, device, torch version, threads); a key already there is not measured again,
so the second profile of a model measures nothing.

The cost hook. :class:`MeasuredCosts` is what :class:`fxpipe.passes.annotate.AnnotateCosts`
calls on every node when its hardware spec carries a profile
(:attr:`fxpipe.cost.hardware.HardwareSpec.profile`): the node's F/B/W times become the
measured ones if its signature was profiled, else the calibrated prediction
(:mod:`fxpipe.cost.calibrate`).

Command line (how the shipped CPU profile was made)::

    python -m fxpipe.cost.profile --suite --threads 1 --out fxpipe/cost/profiles/cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import operator
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx

from fxpipe.cost.calibrate import DEFAULT_MIN_SAMPLES, CostProfile, cross_validate
from fxpipe.cost.database import CostDatabase, DeviceInfo, Measurement, default_db_path
from fxpipe.cost.hardware import HARDWARE, HardwareSpec
from fxpipe.cost.roofline import OpCost
from fxpipe.errors import InputError

__all__ = [
    "CpuTimer",
    "CudaEventTimer",
    "MeasuredCosts",
    "ProfileReport",
    "base_hardware",
    "device_info",
    "measure_autograd_overhead",
    "measured_hardware",
    "measured_profile",
    "op_signature",
    "profile_graph",
    "run_suite",
    "trace_measured",
    "measure_loss",
    "add_loss_costs",
    "p2p_times",
    "fit_link",
    "measure_p2p",
]

_DTYPE_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


# ----------------------------------------------------------------------------- device
def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"the profiler runs on 'cpu' or 'cuda' devices, got {str(device)!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' was asked for but torch.cuda.is_available() is False: profile on 'cpu'")
    return dev


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_info(device: str | torch.device | None = None, threads: int | None = None) -> DeviceInfo:
    """Name, torch version and thread count of a profiling device.

    Parameters
    ----------
    device : str or torch.device, optional
        ``"cpu"`` or ``"cuda[:i]"``; default CUDA when available, else CPU.
    threads : int, optional
        Intra-op threads the ops run with (default ``torch.get_num_threads()``).

    Raises
    ------
    InputError
        For another device type, CUDA without a GPU, or ``threads < 1``.
    """
    dev = _device(device)
    if threads is None:
        threads = torch.get_num_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InputError(f"threads must be an integer >= 1, got {threads!r}")
    name = f"cuda: {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else f"cpu: {_cpu_name()}"
    return DeviceInfo(device=name, torch=str(torch.__version__), threads=int(threads))


def base_hardware(info: DeviceInfo) -> HardwareSpec:
    """The datasheet spec whose roofline the calibration of ``info``'s device corrects.

    CPU -> ``"cpu"``; a CUDA device by name: H200 -> ``"h200"``, H100 -> ``"h100-sxm"``,
    A100 -> ``"a100-80gb"``, any other GPU -> ``"h100-sxm"`` (the calibration absorbs the
    difference in peaks).
    """
    name = info.device.lower()
    if not info.is_cuda:
        return HARDWARE["cpu"]
    for needle, spec in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80gb")):
        if needle in name:
            return HARDWARE[spec]
    return HARDWARE["h100-sxm"]


# ----------------------------------------------------------------------------- timers
#: CPU clocks of the profiler: ``"wall"`` (``time.perf_counter_ns``) and ``"cpu"`` (the calling
#: thread's CPU time, ``time.thread_time_ns``: blind to time-slicing by other processes, valid
#: only when the op runs on the calling thread, i.e. one intra-op thread).
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def _null_interval_ns(clock: Callable[[], int], n: int = 2001) -> float:
    """Median interval between two back-to-back reads of ``clock`` (its own cost, ns)."""
    ts = []
    for _ in range(n):
        a = clock()
        ts.append(clock() - a)
    return float(statistics.median(ts))


class CpuTimer:
    """Timer of a callable on CPU: a clock read around every call, median kept by the caller.

    Parameters
    ----------
    clock : callable() -> int
        Nanosecond clock (default :func:`time.perf_counter_ns`; see :data:`CLOCKS`; tests inject
        a fake one).
    subtract_null : bool
        Subtract the clock's own cost from every interval (see :class:`CpuStopwatch`).
    """

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns, subtract_null: bool = True):
        self.clock = clock
        self.null_ns = _null_interval_ns(clock) if subtract_null else 0.0

    def __call__(self, fn: Callable[[], Any], *, warmup: int = 2, min_repeats: int = 5, max_repeats: int = 50,
                 min_time_s: float = 0.01) -> list[float]:
        """Run ``fn`` ``warmup`` times, then time it; returns every timed call's seconds.

        Calls are repeated until ``min_time_s`` of timed calls have passed, at least
        ``min_repeats`` and at most ``max_repeats`` times.
        """
        _check_repeats(warmup, min_repeats, max_repeats)
        for _ in range(warmup):
            fn()
        times: list[float] = []
        enabled = gc.isenabled()
        gc.disable()
        try:
            total = 0.0
            while len(times) < max_repeats and (len(times) < min_repeats or total < min_time_s):
                t0 = self.clock()
                fn()
                dt = max(self.clock() - t0 - self.null_ns, 0.0) * 1e-9
                times.append(dt)
                total += dt
        finally:
            if enabled:
                gc.enable()
        return times


class CudaEventTimer:
    """GPU-side timer: a pair of CUDA events around every call, one synchronisation at the end.

    Parameters
    ----------
    event_factory : callable() -> event, optional
        Creates an event with ``record()`` and ``elapsed_time(other) -> ms`` (default
        ``torch.cuda.Event(enable_timing=True)``).
    synchronize : callable(), optional
        Waits for the device (default ``torch.cuda.synchronize``).

    Notes
    -----
    The number of timed calls is chosen from one synchronised probe call: ``min_time_s /
    probe`` clamped to ``[min_repeats, max_repeats]``, so the loop never synchronises between
    calls (which would add the launch latency to every sample).
    """

    def __init__(self, event_factory: Callable[[], Any] | None = None, synchronize: Callable[[], None] | None = None):
        self.event_factory = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self.synchronize = synchronize or torch.cuda.synchronize

    def __call__(self, fn: Callable[[], Any], *, warmup: int = 2, min_repeats: int = 5, max_repeats: int = 50,
                 min_time_s: float = 0.01) -> list[float]:
        _check_repeats(warmup, min_repeats, max_repeats)
        for _ in range(warmup):
            fn()
        self.synchronize()
        start, end = self.event_factory(), self.event_factory()
        start.record()
        fn()
        end.record()
        self.synchronize()
        probe_s = max(start.elapsed_time(end) * 1e-3, 1e-9)
        n = int(min(max_repeats, max(min_repeats, round(min_time_s / probe_s))))
        pairs = [(self.event_factory(), self.event_factory()) for _ in range(n)]
        for s, e in pairs:
            s.record()
            fn()
            e.record()
        self.synchronize()
        return [s.elapsed_time(e) * 1e-3 for s, e in pairs]


class CpuStopwatch:
    """Per-call timing inside a sequence of calls on CPU (graph mode).

    Parameters
    ----------
    clock : callable() -> int
        Nanosecond clock (default ``time.perf_counter_ns``).
    subtract_null : bool
        Subtract the clock's own cost (the median of back-to-back reads; ~0.1 us for
        ``perf_counter_ns``, ~0.5 us for ``thread_time_ns``) from every interval.
    """

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns, subtract_null: bool = True):
        self.clock = clock
        self.null_ns = _null_interval_ns(clock) if subtract_null else 0.0

    def start(self) -> Any:
        return self.clock()

    def stop(self, token: Any) -> Any:
        return max(self.clock() - token - self.null_ns, 0.0) * 1e-9

    def synchronize(self) -> None:
        pass

    def seconds(self, handle: Any) -> float:
        return float(handle)


class CudaStopwatch:
    """Per-call timing inside a sequence of calls on CUDA: an event pair per call, resolved
    after one synchronisation (so the sequence runs without host stalls).

    Parameters
    ----------
    event_factory, synchronize :
        As in :class:`CudaEventTimer` (tests inject fakes).
    """

    def __init__(self, event_factory: Callable[[], Any] | None = None, synchronize: Callable[[], None] | None = None):
        self.event_factory = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self.synchronize = synchronize or torch.cuda.synchronize

    def start(self) -> Any:
        e = self.event_factory()
        e.record()
        return e

    def stop(self, token: Any) -> Any:
        e = self.event_factory()
        e.record()
        return (token, e)

    def seconds(self, handle: Any) -> float:
        start, end = handle
        return float(start.elapsed_time(end)) * 1e-3


def _check_repeats(warmup: int, min_repeats: int, max_repeats: int) -> None:
    if warmup < 0 or min_repeats < 1 or max_repeats < min_repeats:
        raise InputError(f"need warmup >= 0 and 1 <= min_repeats <= max_repeats, got {warmup}, {min_repeats}, {max_repeats}")


def _median_spread(times: Sequence[float]) -> tuple[float, float]:
    """Median and inter-quartile range / median of a list of times."""
    med = float(statistics.median(times))
    if len(times) < 4 or med <= 0:
        return med, 0.0
    q = statistics.quantiles(times, n=4)
    return med, float((q[2] - q[0]) / med)


def _timer_for(dev: torch.device) -> Callable[..., list[float]]:
    return CudaEventTimer() if dev.type == "cuda" else CpuTimer()


def measure_autograd_overhead(device: str | torch.device | None = None, *, timer: Callable[..., list[float]] | None = None,
                              chain: int = 8) -> tuple[float, float]:
    """Fixed cost of one ``torch.autograd.grad`` call and the cost of one tiny backward node.

    Times ``grad`` through a chain of 1 and of ``1 + chain`` scalar multiplications of a
    1-element tensor: ``t(n) = call + n * node``.

    Returns
    -------
    (call_s, node_s) : tuple of float, both >= 0
    """
    dev = _device(device)
    timer = timer or _timer_for(dev)
    x = torch.rand(1, device=dev, requires_grad=True)

    def chain_of(n: int):
        y = x
        for _ in range(n):
            y = y * 1.0001
        return y

    y1, yn = chain_of(1), chain_of(1 + chain)
    t1 = statistics.median(timer(lambda: torch.autograd.grad(y1, x, retain_graph=True), min_repeats=20, max_repeats=200, min_time_s=0.02))
    tn = statistics.median(timer(lambda: torch.autograd.grad(yn, x, retain_graph=True), min_repeats=20, max_repeats=200, min_time_s=0.02))
    node = max((tn - t1) / chain, 0.0)
    return max(t1 - node, 0.0), node


# ----------------------------------------------------------------------------- signatures
def _cost(node: torch.fx.Node) -> OpCost | None:
    from fxpipe.passes.annotate import COST_KEY

    c = node.meta.get(COST_KEY)
    return c if isinstance(c, OpCost) else None


def _param_source(node: torch.fx.Node) -> torch.Tensor | None:
    """The parameter behind a ``get_attr`` node or a shape-only view chain of one, else None."""
    from fxpipe.passes.capture import getattr_path

    root = node.graph.owning_module
    seen = 0
    while node.op != "get_attr":
        c = _cost(node)
        if c is None or c.kind != "shape" or not node.all_input_nodes or seen > 64:
            return None
        node = node.all_input_nodes[0]
        seen += 1
    obj = getattr_path(root, node.target) if root is not None else None
    return obj if isinstance(obj, torch.nn.Parameter) else None


def _role(node: torch.fx.Node) -> str:
    """``"w"``: trainable weight; ``"g"``: activation that needs a gradient; ``""``: neither."""
    p = _param_source(node)
    if p is not None:
        return "w" if p.requires_grad else ""
    if node.op in ("placeholder", "get_attr"):
        return ""
    c = _cost(node)
    return "g" if c is not None and c.requires_grad else ""


def _tensor_sig(t: torch.Tensor, dtype: torch.dtype | None) -> str:
    from fxpipe.passes.annotate import _to_int

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
    from fxpipe.passes.annotate import _to_int

    if isinstance(val, torch.Tensor):
        return _tensor_sig(val, dtype)
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        return str(_to_int(val))
    if isinstance(val, (list, tuple)) and not isinstance(val, torch.Size):
        return "(" + ", ".join(_val_sig(v, dtype) for v in val) + ")"
    return repr(val)


def _arg_sig(x: Any, dtype: torch.dtype | None) -> str:
    if isinstance(x, torch.fx.Node):
        return _val_sig(x.meta.get("val"), dtype) + _role(x)
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
    from fxpipe.passes.annotate import _packet

    if node.op != "call_function" or _packet(node.target) is None:
        return None
    parts = [_arg_sig(a, dtype) for a in node.args]
    parts += [f"{k}={_arg_sig(v, dtype)}" for k, v in node.kwargs.items()]
    return str(node.target), ", ".join(parts)


def _needs(node: torch.fx.Node) -> tuple[bool, bool, bool]:
    """(F, B, W): whether the op has a backward-input / backward-weight phase in this graph."""
    c = _cost(node)
    if c is None or not c.requires_grad:
        return True, False, False
    roles = {_role(i) for i in node.all_input_nodes}
    return True, "g" in roles, "w" in roles


def _op_class(node: torch.fx.Node) -> str:
    from fxpipe.passes.annotate import _packet

    pkt = _packet(node.target)
    return str(pkt) if pkt is not None else str(getattr(node.target, "__name__", node.target))


# ----------------------------------------------------------------------------- inputs
@dataclass
class _Inputs:
    args: tuple
    kwargs: dict
    b_leaves: list
    w_leaves: list


def _fill(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.rand(shape, dtype=dtype, device=device).add_(0.5)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.rand(shape, device=device) < 0.5
    return torch.zeros(shape, dtype=dtype, device=device)


def _random_like(val: torch.Tensor, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    from fxpipe.passes.annotate import _to_int

    dt = dtype if (dtype is not None and val.dtype.is_floating_point) else val.dtype
    shape = [_to_int(s) for s in val.shape]
    try:
        contiguous = bool(val.is_contiguous())
        stride = [_to_int(s) for s in val.stride()]
    except Exception:  # noqa: BLE001
        contiguous, stride = True, []
    if contiguous or any(s == 0 for s in shape):
        return _fill(shape, dt, device)
    need = 1 + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0)
    return _fill([need], dt, device).as_strided(shape, stride)


def _materialise(node: torch.fx.Node, device: torch.device, dtype: torch.dtype | None,
                 known: Mapping[torch.fx.Node, torch.Tensor]) -> _Inputs:
    from fxpipe.passes.annotate import _to_int
    from fxpipe.passes.capture import getattr_path

    made: dict[torch.fx.Node, Any] = {}
    b_leaves: list[torch.Tensor] = []
    w_leaves: list[torch.Tensor] = []
    root = node.graph.owning_module

    def value(val: Any, inp: torch.fx.Node) -> Any:
        if isinstance(val, torch.Tensor):
            real = known.get(inp)
            if real is None and inp.op == "get_attr" and root is not None:
                obj = getattr_path(root, inp.target)
                if isinstance(obj, torch.Tensor) and obj.device.type != "meta" and not obj.dtype.is_floating_point:
                    real = obj
            if real is not None and tuple(real.shape) == tuple(_to_int(s) for s in val.shape):
                return real.detach().to(device).clone()
            return _random_like(val, dtype, device)
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return _to_int(val) if isinstance(val, torch.SymInt) else val.node.hint
        if isinstance(val, (list, tuple)) and not isinstance(val, torch.Size):
            return type(val)(value(v, inp) for v in val) if isinstance(val, tuple) else [value(v, inp) for v in val]
        return val

    def make(inp: torch.fx.Node) -> Any:
        if inp in made:
            return made[inp]
        v = value(inp.meta.get("val"), inp)
        role = _role(inp)
        if role and isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex):
            v = v.detach().requires_grad_(True)
            (w_leaves if role == "w" else b_leaves).append(v)
        made[inp] = v
        return v

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), make)

    def fix(x: Any) -> Any:
        if isinstance(x, torch.device):
            return device
        if isinstance(x, torch.dtype) and dtype is not None and x.is_floating_point:
            return dtype
        if isinstance(x, torch.SymInt):
            return _to_int(x)
        return x

    args, kwargs = torch.fx.node.map_aggregate((args, kwargs), fix)
    return _Inputs(tuple(args), dict(kwargs), b_leaves, w_leaves)


def _grad_outputs(node: torch.fx.Node, out: Any) -> list[torch.Tensor]:
    """The op's outputs that receive a gradient in this graph."""
    def ok(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)

    if isinstance(out, torch.Tensor):
        return [out] if ok(out) else []
    if isinstance(out, (list, tuple)):
        idx = set()
        direct = False
        for u in node.users:
            c = _cost(u)
            if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int):
                if c is not None and c.requires_grad:
                    idx.add(u.args[1])
            else:
                direct = True
        picked = [out[i] for i in sorted(idx) if i < len(out)] if not direct else list(out)
        return [t for t in picked if ok(t)]
    return []


def _integer_values(gm: torch.fx.GraphModule, example_inputs: tuple[Sequence[Any], Mapping[str, Any]] | None
                    ) -> dict[torch.fx.Node, torch.Tensor]:
    """Integer / bool values of every node, from one forward of ``gm`` on the example inputs.

    Empty when the model has no real weights (``meta``), no example inputs are given, or
    the inputs do not map one-to-one onto the graph's placeholders.
    """
    if example_inputs is None:
        return {}
    args, kwargs = example_inputs
    flat = list(args) + list((kwargs or {}).values())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(flat) != len(placeholders) or not all(isinstance(x, torch.Tensor) for x in flat):
        return {}
    if any(x.device.type == "meta" for x in flat) or any(p.device.type == "meta" for p in gm.parameters()) \
            or any(b.device.type == "meta" for b in gm.buffers()):
        return {}
    vals: dict[torch.fx.Node, torch.Tensor] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n):  # noqa: D401 - fx API
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and not (out.dtype.is_floating_point or out.dtype.is_complex):
                vals[n] = out
            return out

    try:
        with torch.no_grad():
            _Recorder(gm).run(*flat, enable_io_processing=False)
    except Exception:  # noqa: BLE001 - fall back to zero indices; the profile is still valid
        return {}
    return vals


# ----------------------------------------------------------------------------- profiling
@dataclass
class ProfileReport:
    """What :func:`profile_graph` did.

    Attributes
    ----------
    device : DeviceInfo
    keys : dict[str, str]
        fx node name -> database op key, for every profiled node.
    measured : int
        Distinct op signatures measured in this call.
    reused : int
        Distinct op signatures found in the database (not measured again).
    failed : dict[str, str]
        Op key -> error, for ops that could not be run here (costed by the calibration).
    skipped : int
        Nodes that are not profilable (Python operators on sizes, higher-order ops).
    interrupted : bool
        True if Ctrl-C stopped the profiling (what was measured is kept).
    wall_s : float
    autograd_call_overhead_s : float
        Subtracted from every B/W measurement.
    """

    device: DeviceInfo
    keys: dict[str, str] = field(default_factory=dict)
    measured: int = 0
    reused: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    skipped: int = 0
    interrupted: bool = False
    wall_s: float = 0.0
    autograd_call_overhead_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device.to_dict(), "profiled_nodes": len(self.keys), "measured": self.measured,
                "reused": self.reused, "failed": dict(self.failed), "skipped": self.skipped,
                "interrupted": self.interrupted, "wall_s": self.wall_s,
                "autograd_call_overhead_s": self.autograd_call_overhead_s}


def _measure_node(node: torch.fx.Node, op: str, args_sig: str, *, device: torch.device, dtype: torch.dtype | None,
                  known: Mapping[torch.fx.Node, torch.Tensor], timer: Callable[..., list[float]], base: HardwareSpec,
                  call_overhead_s: float, node_floor_s: float, opts: dict) -> Measurement:
    c = _cost(node)
    assert c is not None
    feats = dict(op=op, args=args_sig, op_class=_op_class(node), kind=c.kind, flops=float(c.flops), bytes=float(c.bytes),
                 dtype=c.dtype, roofline_spec=base.name, roofline_s=(c.t_fwd_s, c.t_bwd_input_s, c.t_bwd_weight_s),
                 method="isolated")
    needs = _needs(node)
    try:
        inp = _materialise(node, device, dtype, known)
        fn = node.target

        def fwd():
            return fn(*inp.args, **inp.kwargs)

        spreads = []
        ft = timer(fwd, **opts)
        t_f, sp = _median_spread(ft)
        spreads.append(sp)
        t_b = t_w = 0.0
        reps = len(ft)
        if needs[1] or needs[2]:
            out = fwd()
            outs = _grad_outputs(node, out)
            grads = [torch.rand_like(o) for o in outs]
            for want, leaves, slot in ((needs[1], inp.b_leaves, "b"), (needs[2], inp.w_leaves, "w")):
                if not (want and leaves and outs):
                    continue
                ts = timer(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True), **opts)
                raw, sp = _median_spread(ts)
                spreads.append(sp)
                # one autograd call per stage for B, one per parameter group for W (see module doc)
                t = max(raw - call_overhead_s, node_floor_s, 1e-9) if slot == "b" else max(raw, 1e-9)
                if slot == "b":
                    t_b = t
                else:
                    t_w = t
            del out, outs, grads
        return Measurement(t_fwd_s=t_f, t_bwd_input_s=t_b, t_bwd_weight_s=t_w, repeats=reps, spread=max(spreads), **feats)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - any op may fail on random inputs; record why
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return Measurement(error=msg or type(exc).__name__, **feats)


def _param_node(node: torch.fx.Node) -> torch.fx.Node | None:
    """The ``get_attr`` node of the parameter behind ``node`` (itself or a shape-only view chain)."""
    if _param_source(node) is None:
        return None
    while node.op != "get_attr":
        node = node.all_input_nodes[0]
    return node


def _fix_args(x: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    from fxpipe.passes.annotate import _to_int

    def fix(v: Any) -> Any:
        if isinstance(v, torch.device):
            return device
        if isinstance(v, torch.dtype) and dtype is not None and v.is_floating_point:
            return dtype
        if isinstance(v, torch.SymInt):
            return _to_int(v)
        return v

    return torch.fx.node.map_aggregate(x, fix)


def _graph_values(gm: torch.fx.GraphModule, device: torch.device, dtype: torch.dtype | None,
                  example_inputs: tuple[Sequence[Any], Mapping[str, Any]] | None) -> dict[torch.fx.Node, Any]:
    """Values of the placeholders and ``get_attr`` nodes for a graph-mode run.

    Parameters become fresh leaves of the same shape (uniform values, ``requires_grad`` as the
    parameter; never the model's own tensors, whose ``.grad`` must not change); integer and
    bool buffers keep their real values when the model has them; placeholders take the example
    inputs when they are real and match the placeholders one to one, else random tensors of the
    recorded shapes (zeros for integers).
    """
    from fxpipe.passes.capture import getattr_path

    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    flat: list[Any] | None = None
    if example_inputs is not None:
        args, kwargs = example_inputs
        cand = list(args) + list((kwargs or {}).values())
        if len(cand) == len(placeholders) and all(isinstance(x, torch.Tensor) and x.device.type != "meta" for x in cand):
            flat = cand
    for i, n in enumerate(placeholders):
        val = n.meta.get("val")
        if flat is not None:
            x = flat[i].detach().to(device)
            env[n] = x.to(dtype) if (dtype is not None and x.dtype.is_floating_point) else x
        elif isinstance(val, torch.Tensor):
            env[n] = _random_like(val, dtype, device)
        else:
            env[n] = _materialise_value(val, dtype, device)
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        obj = getattr_path(gm, n.target)
        if isinstance(obj, torch.Tensor):
            if not (obj.dtype.is_floating_point or obj.dtype.is_complex) and obj.device.type != "meta":
                env[n] = obj.detach().to(device).clone()
            else:
                t = _random_like(obj, dtype, device)
                if isinstance(obj, torch.nn.Parameter) and obj.requires_grad:
                    t = t.detach().requires_grad_(True)
                env[n] = t
        else:
            env[n] = obj
    return env


def _materialise_value(val: Any, dtype: torch.dtype | None, device: torch.device) -> Any:
    from fxpipe.passes.annotate import _to_int

    if isinstance(val, torch.Tensor):
        return _random_like(val, dtype, device)
    if isinstance(val, torch.SymInt):
        return _to_int(val)
    if isinstance(val, (torch.SymFloat, torch.SymBool)):
        return val.node.hint
    if isinstance(val, (list, tuple)) and not isinstance(val, torch.Size):
        items = [_materialise_value(v, dtype, device) for v in val]
        return tuple(items) if isinstance(val, tuple) else items
    return val


def _cut(value: Any, role: str) -> Any:
    """An activation input as a fresh autograd leaf (``requires_grad`` iff it needs a gradient).

    Each op then has an autograd graph of its own: ``torch.autograd.grad`` walks every node
    reachable from its outputs (``Engine::compute_dependencies``), so without the cut a B/W
    measurement late in the graph would pay for the whole upstream graph.
    """
    if isinstance(value, torch.Tensor):
        if not (value.requires_grad or value.grad_fn is not None):
            return value
        v = value.detach()
        return v.requires_grad_(True) if role == "g" and (v.dtype.is_floating_point or v.dtype.is_complex) else v
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [_cut(x, role) for x in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _run_node(gm: torch.fx.GraphModule, node: torch.fx.Node, env: Mapping[torch.fx.Node, Any], device: torch.device,
              dtype: torch.dtype | None, inputs: dict | None = None) -> Callable[[], Any]:
    """A no-argument callable that runs ``node`` on the values in ``env``.

    With ``inputs`` (a dict), activation inputs are cut from their producers (:func:`_cut`),
    weights (and views of them) stay attached to the weight leaves; ``inputs`` receives the
    node's input values by input node.
    """
    def get(n: torch.fx.Node) -> Any:
        if inputs is None:
            return env[n]
        if n not in inputs:
            inputs[n] = env[n] if _param_node(n) is not None else _cut(env[n], _role(n))
        return inputs[n]

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), get)
    args, kwargs = _fix_args((args, kwargs), device, dtype)
    if node.op == "call_function":
        fn = node.target
        return lambda: fn(*args, **kwargs)
    if node.op == "call_method":
        return lambda: getattr(args[0], node.target)(*args[1:], **kwargs)
    mod = gm.get_submodule(node.target)
    return lambda: mod(*args, **kwargs)


def _graph_mode(gm: torch.fx.GraphModule, todo: Mapping[str, Any], keys: Mapping[str, str], *, device: torch.device,
                dtype: torch.dtype | None, example_inputs, stopwatch, warmup: int, min_repeats: int, max_repeats: int,
                min_time_s: float, call_s: float, node_s: float, base: HardwareSpec, clock: str = "wall",
                progress: bool = False) -> tuple[list[Measurement], bool]:
    """Run the whole graph forward and backward ``warmup + R`` times, timing every op.

    Returns the measurements of the keys in ``todo`` and whether Ctrl-C stopped the runs.
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    want = {n for n in nodes if keys.get(n.name) in todo}
    plan_b: dict[torch.fx.Node, tuple[list, list]] = {}
    for n in want:
        c = _cost(n)
        f, nb, nw = _needs(n)
        if c is not None and c.kind == "shape":
            nw = False  # a view of a weight: its gradient is part of the consumer's W
        if not (nb or nw):
            continue
        ins = list(dict.fromkeys(n.all_input_nodes))
        b_in = [i for i in ins if _role(i) == "g"] if nb else []
        w_in = list(dict.fromkeys(p for p in (_param_node(i) for i in ins if _role(i) == "w") if p is not None)) if nw else []
        plan_b[n] = (b_in, w_in)
    samples: dict[str, list[list[float]]] = {k: [[], [], []] for k in todo}
    errors: dict[str, str] = {}
    grad_cache: dict[torch.fx.Node, list[torch.Tensor]] = {}
    base_env = _graph_values(gm, device, dtype, example_inputs)
    sw = stopwatch
    interrupted = False

    def err(key: str, exc: BaseException) -> None:
        errors.setdefault(key, " ".join(f"{type(exc).__name__}: {exc}".split())[:300])

    def one_rep(record: bool) -> None:
        env = dict(base_env)
        for p in base_env.values():
            if isinstance(p, torch.Tensor) and p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)  # W accumulates into .grad, as every micro-batch after the first
        fwd: list[tuple[str, Any]] = []
        ins: dict[torch.fx.Node, dict] = {}
        for n in nodes:
            try:
                ins[n] = {}
                call = _run_node(gm, n, env, device, dtype, ins[n])
                h = sw.start()
                out = call()
                t = sw.stop(h)
            except Exception as exc:  # noqa: BLE001 - keep the data flow going with a stand-in value
                if n.name in keys:
                    err(keys[n.name], exc)
                out, t = _materialise_value(n.meta.get("val"), dtype, device), None
            env[n] = out
            if record and t is not None and n in want:
                fwd.append((keys[n.name], t))
        bwd: list[tuple[str, int, Any]] = []
        for n in reversed(nodes):
            if n not in plan_b:
                continue
            key = keys[n.name]
            b_in, w_in = plan_b[n]
            try:
                outs = _grad_outputs(n, env[n])
                if not outs:
                    continue
                grads = grad_cache.get(n)
                if grads is None or len(grads) != len(outs):
                    grads = grad_cache[n] = [torch.rand_like(o) for o in outs]
                bt = [x for x in (ins[n].get(i) for i in b_in) if isinstance(x, torch.Tensor) and x.requires_grad]
                if bt:
                    h = sw.start()
                    torch.autograd.grad(outs, bt, grads, retain_graph=True, allow_unused=True)
                    bwd.append((key, 1, sw.stop(h)))
                wt = [env[i] for i in w_in if isinstance(env[i], torch.Tensor) and env[i].requires_grad]
                if wt:
                    h = sw.start()
                    torch.autograd.backward(outs, grads, inputs=wt, retain_graph=True)
                    bwd.append((key, 2, sw.stop(h)))
            except Exception as exc:  # noqa: BLE001
                err(key, exc)
        sw.synchronize()
        ins.clear()
        if record:
            for key, h in fwd:
                samples[key][0].append(sw.seconds(h))
            for key, p, h in bwd:
                t = sw.seconds(h)
                # one autograd call per stage for B, one per parameter group for W (see module doc)
                samples[key][p].append(max(t - call_s, node_s, 1e-9) if p == 1 else max(t, 1e-9))
        del env

    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(max(warmup, 1)):
            one_rep(False)
        rep_s = (time.perf_counter() - t0) / max(warmup, 1)
        reps = int(min(max_repeats, max(min_repeats, round(min_time_s / max(rep_s, 1e-9)))))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=reps, desc=f"profiling {len(todo)} ops (graph runs)", unit="run")
        try:
            for _ in range(reps):
                one_rep(True)
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if enabled:
            gc.enable()
    out = []
    for key, node in todo.items():
        c = _cost(node)
        feats = dict(op=key.split("(", 1)[0], args=key[key.index("(") + 1:-1], op_class=_op_class(node), kind=c.kind,
                     flops=float(c.flops), bytes=float(c.bytes), dtype=c.dtype, roofline_spec=base.name,
                     roofline_s=(c.t_fwd_s, c.t_bwd_input_s, c.t_bwd_weight_s), method="graph", clock=clock)
        f, b, w = samples[key]
        if key in errors or not f:
            if not interrupted or key in errors:
                out.append(Measurement(error=errors.get(key, "not run"), **feats))
            continue
        stats = [_median_spread(x) if x else (0.0, 0.0) for x in (f, b, w)]
        out.append(Measurement(t_fwd_s=stats[0][0], t_bwd_input_s=stats[1][0], t_bwd_weight_s=stats[2][0], repeats=len(f),
                               spread=max(sp for _, sp in stats), **feats))
    return out, interrupted


def profile_graph(
    gm: torch.fx.GraphModule,
    *,
    db: CostDatabase | str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    threads: int | None = None,
    dtype: torch.dtype | None = None,
    example_inputs: tuple[Sequence[Any], Mapping[str, Any]] | None = None,
    mode: str = "graph",
    clock: str = "wall",
    warmup: int = 2,
    min_repeats: int = 7,
    max_repeats: int = 50,
    min_time_s: float = 0.05,
    remeasure: bool = False,
    timer: Any = None,
    progress: bool = False,
    save: bool = True,
) -> ProfileReport:
    """Measure F, B and W of every op of a captured graph on this device (cached).

    Parameters
    ----------
    gm : torch.fx.GraphModule
        A captured graph (:func:`fxpipe.passes.capture.capture`): every node has
        ``meta["val"]``. Its cost annotation is (re)computed with the device's base spec
        (:func:`base_hardware`), which gives the roofline features stored with each measurement.
    db : CostDatabase, path or None
        Where measurements are looked up and stored (default
        :func:`~fxpipe.cost.database.default_db_path`); saved at the end unless ``save=False``.
    device : str or torch.device, optional
        ``"cpu"`` or ``"cuda[:i]"`` (default: CUDA if available).
    threads : int, optional
        Intra-op threads during measurement (default: the current ``torch.get_num_threads()``);
        restored afterwards.
    dtype : torch.dtype, optional
        Run floating tensors in this dtype (as :class:`~fxpipe.passes.annotate.AnnotateCosts`'s
        ``dtype``).
    example_inputs : (args, kwargs), optional
        One micro-batch of the model's inputs (real values for token ids, masks, ...).
    mode : {"graph", "isolated"}
        ``"graph"`` (default): run the whole graph, forward in program order then B and W of
        every node in reverse order (W accumulating into ``.grad`` as in training), on fresh
        random weights and the example inputs, ``warmup + R`` times, timing every op in the
        context of its neighbours (caches, dispatch paths as in a real step); each op's times
        are the medians over its occurrences and runs. Needs the memory of one training
        forward of the graph. ``"isolated"``: each op signature alone on tensors of its
        recorded shapes, repeated (:class:`CpuTimer`); needs only one op's memory, but runs
        with warm caches, so it under-estimates in-model times (about 2x for small CPU ops).
    clock : {"wall", "cpu"}
        CPU timing clock (:data:`CLOCKS`): ``"wall"`` (default, ``time.perf_counter_ns``) or
        ``"cpu"``, the calling thread's CPU time, which other processes time-slicing the core
        do not inflate (for shared machines; needs ``threads=1``). Ignored on CUDA (events).
    warmup, min_repeats, max_repeats, min_time_s :
        Timing options: runs (graph mode) or calls per phase (isolated mode), see
        :class:`CpuTimer`.
    remeasure : bool
        Measure keys that are already in the database again.
    timer : optional
        Replaces the device's stopwatch (graph mode) or timer (isolated mode); tests.
    progress : bool
        Show a tqdm bar (over the graph runs, or the op signatures in isolated mode).

    Returns
    -------
    ProfileReport

    Raises
    ------
    InputError
        If the graph was not captured by fxpipe (no ``meta["val"]``), or for a bad device /
        thread count / mode / repeat option.

    Notes
    -----
    A database entry is reused only if it was measured by the same ``mode`` under the same
    base roofline. Ctrl-C stops the measurements; what was measured is saved and the report
    says ``interrupted``.
    """
    from fxpipe.passes.annotate import AnnotateCosts

    t_start = time.perf_counter()
    if mode not in ("graph", "isolated"):
        raise InputError(f"mode must be 'graph' or 'isolated', got {mode!r}")
    if clock not in CLOCKS:
        raise InputError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    dev = _device(device)
    info = device_info(dev, threads)
    if clock == "cpu" and dev.type == "cpu" and info.threads != 1:
        raise InputError(f"clock='cpu' times the calling thread only: it needs threads=1, got {info.threads}")
    clock_name = "cuda" if dev.type == "cuda" else clock
    _check_repeats(warmup, min_repeats, max_repeats)
    base = base_hardware(info)
    if not isinstance(db, CostDatabase):
        db = CostDatabase(default_db_path() if db is None else db)
    AnnotateCosts(base, dtype)(gm)
    report = ProfileReport(device=info)
    todo: dict[str, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        sig = op_signature(node, dtype)
        if sig is None:
            report.skipped += 1
            continue
        key = f"{sig[0]}({sig[1]})"
        report.keys[node.name] = key
        if key in todo:
            continue
        have = db.get(info, key)
        if have is not None and not remeasure and have.roofline_spec == base.name and have.method == mode \
                and have.clock == clock_name:
            continue
        todo[key] = node
    report.reused = len(set(report.keys.values())) - len(todo)
    prev_threads = torch.get_num_threads()
    opts = dict(warmup=warmup, min_repeats=min_repeats, max_repeats=max_repeats, min_time_s=min_time_s)
    try:
        torch.set_num_threads(info.threads)
        call_s, node_s = db.autograd_overhead(info)
        if todo:  # measured now, with the clock of this run
            call_s, node_s = measure_autograd_overhead(dev, timer=None if dev.type == "cuda" else CpuTimer(CLOCKS[clock]))
            db.set_autograd_overhead(info, call_s, node_s)
            if mode == "graph":
                sw = timer or (CudaStopwatch() if dev.type == "cuda" else CpuStopwatch(CLOCKS[clock]))
                ms, report.interrupted = _graph_mode(gm, todo, report.keys, device=dev, dtype=dtype, example_inputs=example_inputs,
                                                     stopwatch=sw, call_s=call_s, node_s=node_s, base=base, clock=clock_name,
                                                     progress=progress, **opts)
                db.put_many(info, ms)
                report.measured = len(ms)
            else:
                report.measured, report.interrupted = _isolated_mode(
                    db, info, todo, device=dev, dtype=dtype, example_inputs=(gm, example_inputs),
                    timer=timer or (CudaEventTimer() if dev.type == "cuda" else CpuTimer(CLOCKS[clock])),
                    base=base, call_s=call_s, node_s=node_s, progress=progress, opts=opts, clock=clock_name)
        report.autograd_call_overhead_s = call_s
    finally:
        torch.set_num_threads(prev_threads)
        if save:
            db.save()
    for key in set(report.keys.values()):
        m = db.get(info, key)
        if m is not None and not m.ok:
            report.failed[key] = m.error
    report.wall_s = time.perf_counter() - t_start
    return report


def _isolated_mode(db: CostDatabase, info: DeviceInfo, todo: Mapping[str, torch.fx.Node], *, device: torch.device,
                   dtype: torch.dtype | None, example_inputs, timer, base: HardwareSpec, call_s: float, node_s: float,
                   progress: bool, opts: dict, clock: str = "wall") -> tuple[int, bool]:
    gm, ex = example_inputs
    known = _integer_values(gm, ex)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="profiling ops", unit="op")
    done = 0
    try:
        for key, node in todo.items():
            op, args_sig = key.split("(", 1)[0], key[key.index("(") + 1:-1]
            m = _measure_node(node, op, args_sig, device=device, dtype=dtype, known=known, timer=timer, base=base,
                              call_overhead_s=call_s, node_floor_s=node_s, opts=opts)
            db.put(info, dataclasses.replace(m, clock=clock))
            done += 1
            if bar is not None:
                bar.update(1)
    except KeyboardInterrupt:
        return done, True
    finally:
        if bar is not None:
            bar.close()
    return done, False


# ----------------------------------------------------------------------------- the cost hook
class MeasuredCosts:
    """The per-node cost hook of a measured hardware spec (see :class:`~fxpipe.passes.annotate.AnnotateCosts`).

    ``hook(node, cost) -> cost``: the F/B/W times of ``cost`` (computed by the roofline of
    ``profile.base``) are replaced by the measured times of the node's signature if the
    profile has them, else by the calibrated prediction (:meth:`CostProfile.predict`). Other
    fields (FLOPs, bytes, activation memory) are kept. Python operators on sizes and other
    non-profilable shape-only nodes keep their zero times.

    Parameters
    ----------
    profile : CostProfile
    dtype : torch.dtype, optional
        The cost dtype override of the pass (part of the signature).

    Attributes
    ----------
    sources : dict[str, int]
        How many nodes got ``"measured"``, ``"calibrated"`` and ``"roofline"`` times.
    """

    def __init__(self, profile: CostProfile, dtype: torch.dtype | None = None):
        self.profile = profile
        self.dtype = dtype
        self.sources: dict[str, int] = {"measured": 0, "calibrated": 0, "roofline": 0}

    def __call__(self, node: torch.fx.Node, cost: OpCost) -> OpCost:
        if node.op in ("placeholder", "get_attr", "output") or cost.kind in ("input", "output"):
            return cost
        sig = op_signature(node, self.dtype)
        if sig is None and cost.kind == "shape":
            return cost
        key = None if sig is None else f"{sig[0]}({sig[1]})"
        times, source = self.profile.predict(key, _op_class(node), cost.kind,
                                             (cost.t_fwd_s, cost.t_bwd_input_s, cost.t_bwd_weight_s), _needs(node))
        self.sources[source] += 1
        return dataclasses.replace(cost, t_fwd_s=times[0], t_bwd_input_s=times[1], t_bwd_weight_s=times[2])


# ----------------------------------------------------------------------------- profiles
def measured_profile(db: CostDatabase | str | os.PathLike | None = None, *, device: str | torch.device | None = None,
                     threads: int | None = None, keys: Iterable[str] | None = None, name: str = "measured",
                     min_samples: int = DEFAULT_MIN_SAMPLES, **kwargs: Any) -> CostProfile:
    """A :class:`CostProfile` of this device from the database's measurements.

    Parameters
    ----------
    db : CostDatabase, path or None
        Default :func:`~fxpipe.cost.database.default_db_path`.
    device, threads :
        Which device's measurements (see :func:`device_info`).
    keys : iterable of str, optional
        Keep only these op keys (e.g. the ones a suite run measured); default all.
    name : str
        Name of the hardware spec the profile makes.
    kwargs :
        Passed to :meth:`CostProfile.from_measurements` (``description``, ``made_with``, ...).

    Raises
    ------
    InputError
        If the database has no usable measurement of this device.
    """
    info = device_info(device, threads)
    if not isinstance(db, CostDatabase):
        db = CostDatabase(default_db_path() if db is None else db)
    entries = db.entries(info)
    if keys is not None:
        wanted = set(keys)
        entries = {k: m for k, m in entries.items() if k in wanted}
    kwargs.setdefault("autograd_call_overhead_s", db.autograd_overhead(info)[0])
    return CostProfile.from_measurements(entries.values(), device=info, base=base_hardware(info), name=name,
                                         min_samples=min_samples, **kwargs)


def measured_hardware(db: CostDatabase | str | os.PathLike | None = None, *, device: str | torch.device | None = None,
                      threads: int | None = None, min_measurements: int = 20, progress: bool = True) -> HardwareSpec:
    """The spec of this process's device, calibrated from measured op times (``hardware="measured"``).

    If the database holds fewer than ``min_measurements`` successful measurements of this
    device (name, torch version, thread count), the built-in suite (:func:`run_suite`) is
    profiled first and stored.

    Returns
    -------
    HardwareSpec
        Named ``"measured"``; ``.profile`` holds the :class:`CostProfile`.
    """
    info = device_info(device, threads)
    if not isinstance(db, CostDatabase):
        db = CostDatabase(default_db_path() if db is None else db)
    base = base_hardware(info)
    usable = [m for m in db.entries(info).values() if m.ok and m.roofline_spec == base.name]
    if len(usable) < min_measurements:
        run_suite(db, device=device, threads=info.threads, progress=progress)
    return measured_profile(db, device=device, threads=info.threads, name="measured").hardware()


def trace_measured(model: torch.nn.Module, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
                   hardware: str | os.PathLike | HardwareSpec | None = None, dtype: torch.dtype | None = None,
                   name: str | None = None, db: CostDatabase | str | os.PathLike | None = None,
                   device: str | torch.device | None = None, threads: int | None = None, progress: bool = False,
                   **profile_opts: Any):
    """Capture a model and cost it with times measured on this device (``costs="measured"``).

    Captures and annotates with the device's base roofline (:func:`base_hardware`), profiles
    every op not yet in the database (:func:`profile_graph`), fits a :class:`CostProfile` to
    all measurements of this device (plus those of ``hardware``'s profile, if given) and
    re-annotates: profiled ops get their measured times, the others (ops that could not be
    run) the calibrated prediction.

    Parameters
    ----------
    model, args, kwargs, dtype, name :
        As in :func:`fxpipe.passes.trace_model` (one micro-batch of example inputs).
    hardware : None, "measured", path or HardwareSpec
        ``None`` / ``"measured"``: this device. A profile (file or spec with ``.profile``) of
        this same device adds its measurements and its link figures; a datasheet spec of
        another device is refused.
    db : CostDatabase, path or None
        The cost database (default :func:`~fxpipe.cost.database.default_db_path`).
    device, threads :
        Profiling device and intra-op threads (default: CUDA if available; the given profile's
        thread count, else ``torch.get_num_threads()``).
    progress : bool
        tqdm bar while measuring.
    profile_opts :
        Timing options of :func:`profile_graph`.

    Returns
    -------
    (TracedModel, ProfileReport)
        ``traced.hardware`` is the measured spec (``.profile`` set), ``traced.graph`` carries
        the measured costs.

    Raises
    ------
    InputError
        If ``hardware`` is a datasheet spec or a profile of another device.
    CaptureError
        If the model cannot be captured.
    """
    from fxpipe.cost.hardware import get_hardware
    from fxpipe.passes.annotate import AnnotateCosts
    from fxpipe.passes.to_opgraph import to_opgraph, trace_model

    given = None
    if hardware is not None and not (isinstance(hardware, str) and hardware.strip().lower() == "measured"):
        given = get_hardware(hardware)
        if given.profile is None:
            raise InputError(
                f"costs='measured' measures the ops on this machine, but hardware={given.name!r} is a datasheet spec: "
                "pass hardware='measured' (or leave it unset), a hardware profile of this machine, or use costs='roofline'"
            )
        if threads is None:
            threads = given.profile.device.threads
    info = device_info(device, threads)
    if given is not None and given.profile.device.device != info.device:
        raise InputError(
            f"the hardware profile {given.name!r} was measured on {given.profile.device.device!r}, this machine profiles on "
            f"{info.device!r}: use costs='roofline' with that profile, or hardware='measured'"
        )
    if not isinstance(db, CostDatabase):
        db = CostDatabase(default_db_path() if db is None else db)
    base = base_hardware(info)
    traced = trace_model(model, args, kwargs, hardware=base, dtype=dtype, name=name)
    cap = traced.captured
    report = profile_graph(traced.gm, db=db, device=device, threads=info.threads, dtype=dtype,
                           example_inputs=(cap.example_args, cap.example_kwargs), progress=progress, **profile_opts)
    t0 = time.perf_counter()
    measurements = dict(given.profile.measurements) if given is not None else {}
    measurements.update(db.entries(info))
    extra: dict[str, Any] = {}
    if given is not None:
        extra = dict(d2d_bytes_per_s=given.profile.d2d_bytes_per_s, p2p_latency_s=given.profile.p2p_latency_s,
                     link=given.profile.link, description=given.profile.description,
                     min_samples=given.profile.calibration.min_samples)
    prof = CostProfile.from_measurements(measurements.values(), device=info, base=base,
                                         name=given.name if given is not None else "measured",
                                         autograd_call_overhead_s=report.autograd_call_overhead_s, **extra)
    spec = prof.hardware()
    AnnotateCosts(spec, dtype)(traced.gm)
    graph, names = to_opgraph(traced.gm, spec, name=traced.graph.name)
    cost_s = traced.cost_s + report.wall_s + (time.perf_counter() - t0)
    traced = dataclasses.replace(traced, graph=graph, node_names=names, hardware=spec, cost_s=cost_s,
                                 timings={**traced.timings, "profile_s": report.wall_s, "cost_s": cost_s})
    return traced, report


class _LossOf(torch.nn.Module):
    """``loss_fn(pred, target)`` with the prediction as a parameter, so that the profiler times
    the loss's backward (its gradient w.r.t. the prediction) as well as its forward."""

    def __init__(self, loss_fn: Callable, pred: torch.Tensor):
        super().__init__()
        self.loss_fn = loss_fn
        self.pred = torch.nn.Parameter(pred)

    def forward(self, target):
        return self.loss_fn(self.pred, target)


def measure_loss(loss_fn: Callable, output: torch.Tensor, target: torch.Tensor, *,
                 db: CostDatabase | str | os.PathLike | None = None, device: str | torch.device | None = None,
                 threads: int | None = None, **profile_opts: Any) -> tuple[float, float]:
    """Forward and backward time of a training loss on one micro-batch's output (cached).

    The loss runs on the last pipeline stage after the model's output; it is not part of the
    captured model, so :func:`add_loss_costs` adds it to the graph's output node.

    Parameters
    ----------
    loss_fn : callable(output, target) -> scalar tensor
    output : torch.Tensor
        A tensor of the model output's shape and dtype (values do not matter).
    target : torch.Tensor
        One micro-batch's target.
    db, device, threads, profile_opts :
        As in :func:`profile_graph`.

    Returns
    -------
    (t_fwd_s, t_bwd_s) : tuple of float
        Summed over the loss's ops (measured in graph mode).

    Raises
    ------
    CaptureError
        If the loss cannot be captured with torch.export.
    """
    from fxpipe.passes.capture import capture

    if not isinstance(db, CostDatabase):
        db = CostDatabase(default_db_path() if db is None else db)
    mod = _LossOf(loss_fn, torch.rand(output.shape, dtype=output.dtype))
    cap = capture(mod, (target,))
    rep = profile_graph(cap.gm, db=db, device=device, threads=threads, example_inputs=((target,), {}), **profile_opts)
    t_f = t_b = 0.0
    for key in rep.keys.values():
        m = db.get(rep.device, key)
        if m is not None and m.ok:
            t_f += m.t_fwd_s
            t_b += m.t_bwd_input_s + m.t_bwd_weight_s
    return t_f, t_b


def add_loss_costs(graph, t_fwd_s: float, t_bwd_s: float):
    """The OpGraph with a loss's forward / backward time added to its ``"output"`` node.

    The output node is always on the last stage, where the pipeline runtime applies the loss
    to every micro-batch; ``graph.meta["loss_costs_s"]`` records what was added.

    Raises
    ------
    InputError
        If the graph has no ``"output"`` node or a time is negative.
    """
    import numpy as np

    from fxpipe.ir import OpGraph

    if t_fwd_s < 0 or t_bwd_s < 0:
        raise InputError(f"loss times must be >= 0, got {t_fwd_s}, {t_bwd_s}")
    outs = [i for i, op in enumerate(graph.ops) if op == "output"]
    if not outs:
        raise InputError("the graph has no 'output' node to carry the loss")
    doc = graph.to_dict()
    node = doc["nodes"][outs[-1]]
    node["t_fwd_s"] = float(node.get("t_fwd_s", 0.0)) + float(t_fwd_s)
    node["t_bwd_input_s"] = float(node.get("t_bwd_input_s", 0.0)) + float(t_bwd_s)
    doc["loss_costs_s"] = [float(t_fwd_s), float(t_bwd_s)]
    out = OpGraph.from_dict(doc, source="graph with loss")
    assert np.isclose(out.t_fwd_s.sum(), graph.t_fwd_s.sum() + t_fwd_s)
    return out


# ----------------------------------------------------------------------------- links
#: Message sizes (bytes) of :func:`p2p_times`.
P2P_SIZES = (1024, 4096, 16384, 32768, 49152, 65536, 131072, 262144, 1 << 20, 4 << 20, 16 << 20)


def p2p_times(peer: int, *, sizes_bytes: Sequence[int] = P2P_SIZES, repeats: int = 15, warmup: int = 3,
              group: Any = None, device: str | torch.device = "cpu") -> dict[int, float]:
    """One-way time of a point-to-point message of each size between this rank and ``peer``.

    Call on both ranks of an initialised ``torch.distributed`` process group (any backend);
    the rank with the smaller number sends first. Each sample is half a ping-pong, timed
    with ``time.perf_counter``; the median of ``repeats`` samples after ``warmup`` is kept.

    Returns
    -------
    dict[int, float]
        Message size (bytes) -> seconds.
    """
    import torch.distributed as dist

    me = dist.get_rank(group)
    first = me < peer
    out: dict[int, float] = {}
    for n in sizes_bytes:
        buf = torch.zeros(max(int(n) // 4, 1), dtype=torch.float32, device=device)
        ts = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            if first:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            if i >= warmup:
                ts.append((time.perf_counter() - t0) / 2)
        out[int(buf.numel() * 4)] = float(statistics.median(ts))
    return out


def fit_link(times: Mapping[int, float]) -> tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of ``t = latency + bytes / bandwidth`` fitted to message times.

    The same non-negative relative least squares as the op calibration
    (:func:`fxpipe.cost.calibrate.fit_phase`, with bytes in place of the roofline time).

    Raises
    ------
    InputError
        With fewer than two message sizes.
    """
    from fxpipe.cost.calibrate import fit_phase

    if len(times) < 2:
        raise InputError("fit_link needs the times of at least two message sizes")
    sizes = sorted(times)
    fit = fit_phase([float(n) for n in sizes], [times[n] for n in sizes])
    bw = 1.0 / fit.scale if fit.scale > 0 else float("inf")
    return fit.overhead_s, bw


def _p2p_worker(rank: int, init_method: str, world: int, cpus: tuple, out: str, sizes: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        t = p2p_times(1 - rank, sizes_bytes=sizes)
        if rank == 0:
            with open(out, "w", encoding="utf-8") as fh:
                json.dump({str(k): v for k, v in t.items()}, fh)
    finally:
        dist.destroy_process_group()


def measure_p2p(*, sizes_bytes: Sequence[int] = P2P_SIZES, pin: bool = True) -> tuple[float, float, dict[int, float]]:
    """Stage-to-stage link of local CPU pipeline ranks: two gloo processes, ping-pong.

    Each process runs one intra-op thread and (with ``pin``) is pinned to its own core, as
    the ranks of :func:`fxpipe.codegen.launch.spawn_train`.

    Returns
    -------
    (latency_s, bytes_per_s, times)
        The :func:`fit_link` of the measured one-way ``times`` (size in bytes -> seconds).
    """
    import socket
    import tempfile

    import torch.multiprocessing as mp

    cpus: tuple = ()
    if pin and hasattr(os, "sched_getaffinity"):
        cpus = tuple(sorted(os.sched_getaffinity(0)))[:2]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="fxpipe-p2p-") as tmp:
        out = os.path.join(tmp, "p2p.json")
        mp.start_processes(_p2p_worker, args=(f"tcp://127.0.0.1:{port}", 2, cpus, out, tuple(sizes_bytes)), nprocs=2,
                           start_method="spawn")
        with open(out, encoding="utf-8") as fh:
            times = {int(k): float(v) for k, v in json.load(fh).items()}
    lat, bw = fit_link(times)
    return lat, bw, times


# ----------------------------------------------------------------------------- calibration suite
class _SuiteTransformer(torch.nn.Module):
    """A pre-norm transformer block with embedding and head: the ops of decoder LMs."""

    def __init__(self, d: int, heads: int, vocab: int, ff: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, ff)
        self.fc2 = torch.nn.Linear(ff, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.heads = heads

    def forward(self, ids):
        b, s = ids.shape
        x = self.emb(ids)
        h = self.ln1(x)
        q, k, v = self.qkv(h).split(x.shape[-1], dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(y)
        y2 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + y2 * 0.5
        h = self.ln2(x)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        x = x + torch.nn.functional.silu(x) * torch.tanh(x)
        return self.head(x)


class _SuiteConv(torch.nn.Module):
    """Conv / group-norm / up-sampling ops of a UNet level."""

    def __init__(self, ch: int):
        super().__init__()
        self.c1 = torch.nn.Conv2d(ch, ch, 3, padding=1)
        self.n1 = torch.nn.GroupNorm(min(8, ch), ch)
        self.down = torch.nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1)
        self.up = torch.nn.ConvTranspose2d(2 * ch, ch, 2, stride=2)
        self.c2 = torch.nn.Conv2d(2 * ch, ch, 1)

    def forward(self, x):
        h = torch.nn.functional.silu(self.n1(self.c1(x)))
        d = torch.relu(self.down(h))
        u = self.up(d)
        u2 = torch.nn.functional.interpolate(torch.nn.functional.avg_pool2d(h, 2), scale_factor=2.0, mode="nearest")
        return self.c2(torch.cat([u + u2, x], dim=1))


#: (kind, sizes) of the built-in suite: transformer (d_model, heads, seq, batch) and conv (channels, side, batch).
SUITE = (
    ("transformer", (64, 2, 32, 1)), ("transformer", (128, 4, 64, 1)), ("transformer", (256, 4, 64, 2)),
    ("transformer", (384, 6, 128, 1)), ("transformer", (512, 8, 128, 2)),
    ("conv", (8, 32, 1)), ("conv", (16, 32, 2)), ("conv", (32, 16, 2)), ("conv", (64, 16, 1)),
)
SUITE_QUICK = (("transformer", (32, 2, 16, 1)), ("transformer", (64, 2, 32, 1)), ("conv", (8, 16, 1)), ("conv", (16, 8, 1)))


def _suite_model(kind: str, size: tuple) -> tuple[torch.nn.Module, tuple]:
    g = torch.Generator().manual_seed(0)
    if kind == "transformer":
        d, heads, seq, batch = size
        vocab = 4 * d
        return _SuiteTransformer(d, heads, vocab, 4 * d), (torch.randint(0, vocab, (batch, seq), generator=g),)
    ch, side, batch = size
    return _SuiteConv(ch), (torch.rand(batch, ch, side, side, generator=g),)


def run_suite(db: CostDatabase | str | os.PathLike | None = None, *, device: str | torch.device | None = None,
              threads: int | None = None, quick: bool = False, progress: bool = False, **opts: Any) -> list[str]:
    """Profile the built-in calibration suite (transformer and conv blocks at several sizes).

    Returns
    -------
    list[str]
        The op keys the suite covers (measured now or found in the database).
    """
    from fxpipe.passes.capture import capture

    keys: list[str] = []
    if not isinstance(db, CostDatabase):
        db = CostDatabase(default_db_path() if db is None else db)
    suite = SUITE_QUICK if quick else SUITE
    it: Iterable = suite
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(suite, desc="calibration suite", unit="model")
    for kind, size in it:
        with torch.random.fork_rng(devices=[]):
            model, args = _suite_model(kind, size)
        cap = capture(model, args)
        rep = profile_graph(cap.gm, db=db, device=device, threads=threads, example_inputs=(args, {}), save=False, **opts)
        keys.extend(rep.keys.values())
        if rep.interrupted:
            break
    db.save()
    return sorted(set(keys))


# ----------------------------------------------------------------------------- command line
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fxpipe.cost.profile``: profile the calibration suite, write a hardware profile."""
    ap = argparse.ArgumentParser(prog="python -m fxpipe.cost.profile", description=main.__doc__)
    ap.add_argument("--suite", action="store_true", help="profile the built-in calibration suite")
    ap.add_argument("--quick", action="store_true", help="a smaller suite (seconds)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's current setting)")
    ap.add_argument("--mode", choices=("graph", "isolated"), default="graph", help="profiling mode (default graph)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="CPU clock: wall (perf_counter_ns, default) or cpu (thread CPU time; for shared machines, needs --threads 1)")
    ap.add_argument("--db", default=None, help=f"cost database (default {default_db_path()})")
    ap.add_argument("--out", default=None, metavar="PROFILE.json", help="write the hardware profile (fxpipe.hwprofile/1)")
    ap.add_argument("--name", default=None, help="name of the profile's hardware spec (default <base>-measured)")
    ap.add_argument("--p2p", action="store_true",
                    help="also measure the link between two local gloo ranks (latency, bandwidth) into the profile")
    ap.add_argument("--all", action="store_true", help="put every measurement of this device in the profile, not only the suite's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        db = CostDatabase(default_db_path() if args.db is None else args.db)
        info = device_info(args.device, args.threads)
        keys = None
        if args.suite:
            keys = run_suite(db, device=args.device, threads=info.threads, quick=args.quick, progress=not args.json,
                             mode=args.mode, clock=args.clock)
        if args.all:
            keys = None
        base = base_hardware(info)
        cmd = "python -m fxpipe.cost.profile " + " ".join(sys.argv[1:] if argv is None else argv)
        if keys is not None:  # the suite's measurements of this mode and clock only
            mine = db.entries(info)
            keys = [k for k in keys if k in mine and mine[k].method == args.mode and mine[k].clock == args.clock]
        link: dict[str, Any] = {}
        if args.p2p:
            from fxpipe.cost.calibrate import LinkModel

            lat, bw, times = measure_p2p()
            link = {"p2p_latency_s": lat, "d2d_bytes_per_s": bw, "link": LinkModel.from_times(times)}
        prof = measured_profile(db, device=args.device, threads=info.threads, keys=keys,
                                name=args.name or f"{base.name}-measured", made_with=cmd,
                                description=f"op times measured on {info.device} with {info.threads} intra-op threads",
                                **link)
        cv = cross_validate(list(prof.measurements.values()), prof.base)
        if args.out:
            prof.save(args.out)
    except InputError as exc:
        print(f"fxpipe profile: error: {exc}", file=sys.stderr)
        return 2
    doc = {"device": info.to_dict(), "measurements": len(prof.measurements), "profile": args.out,
           "p2p_latency_s": prof.p2p_latency_s, "d2d_bytes_per_s": prof.d2d_bytes_per_s,
           "autograd_call_overhead_s": prof.autograd_call_overhead_s, "cross_validated_error": cv}
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"{len(prof.measurements)} measurements on {info.key}" + (f"; profile written to {args.out}" if args.out else ""))
    print(f"{'op class':<36} {'n':>4} {'roofline err':>13} {'calibrated err':>15}")
    for cls_name, e in cv.items():
        print(f"{cls_name:<36} {int(e['n']):>4} {e['roofline_median_rel_err']:>12.1%} {e['calibrated_median_rel_err']:>14.1%}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
