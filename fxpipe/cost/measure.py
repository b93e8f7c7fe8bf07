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

Modes. ``mode="graph"`` (default) runs the whole captured graph on fresh random weights, forward
in program order then B and W of every node in reverse order, ``warmup + R`` times, timing
each op where it runs (caches and dispatch paths as in a training step; an op's activation
inputs are cut from their producers so that its B and W run on its own autograd graph; W
accumulates into ``.grad``). ``mode="isolated"`` times each op signature alone, repeated, on
tensors of its recorded shapes, dtypes and strides (one op's memory, but warm caches).

Timing (:mod:`fxpipe.cost.timers`). On CPU a clock read around every call, Python's garbage
collector off, the clock's own cost subtracted, the median kept: ``time.perf_counter_ns``
(``clock="wall"``) or the thread's CPU time (``clock="cpu"``, for shared machines; one
intra-op thread). The intra-op thread count is part of the key. On CUDA a pair of CUDA events
around every call and one synchronisation per run (the ``triton.testing.do_bench`` recipe,
without its L2 flush).

Inputs. Floating tensors are uniform in [0.5, 1.5) (no NaN, no denormals); model inputs are the
example inputs when given (graph mode computes every integer/bool intermediate from them:
position ids, masks); in isolated mode integer and bool tensors take the values of one forward
under :class:`torch.fx.Interpreter` when the model has real weights, else zeros (always valid
indices) and random bits. A model on the ``meta`` device is profiled without its weights.

Database. Every measurement goes into a :class:`~fxpipe.cost.database.CostDatabase` keyed by
(op signature, device, torch version, threads); a key already there is not measured again,
so the second profile of a model measures nothing.

The cost hook. :class:`MeasuredCosts` is what :class:`fxpipe.passes.annotate.AnnotateCosts`
calls on every node when its hardware spec carries a profile
(:attr:`fxpipe.cost.hardware.HardwareSpec.profile`): the node's F/B/W times become the
measured ones if its signature was profiled, else the calibrated prediction
(:mod:`fxpipe.cost.calibrate`).

Modules: :mod:`fxpipe.cost.signature` (database keys, gradient roles), :mod:`fxpipe.cost.replay`
(running ops), :mod:`fxpipe.cost.timers`; this module measures a graph and holds the cost hook.
Above it: :mod:`fxpipe.cost.suite` (the calibration suite and ``hardware="measured"``) and
:mod:`fxpipe.cost.profile` (the front end: capture + measure + re-annotate, the command line),
which re-exports this module's public names. This module runs the roofline costing
(:class:`fxpipe.passes.costing.RooflineCosts`) with a datasheet spec and never resolves a
hardware name, so :mod:`fxpipe.cost.hardware` can measure ``"measured"`` through it without
an import cycle.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx

from fxpipe.cost.calibrate import DEFAULT_MIN_SAMPLES, CostProfile
from fxpipe.cost.database import CostDatabase, DeviceInfo, default_db_path
from fxpipe.cost.replay import run_graph_mode, run_isolated_mode
from fxpipe.cost.roofline import OpCost
from fxpipe.cost.signature import op_class_of, op_signature, phases_of
from fxpipe.cost.specs import HARDWARE, HardwareSpec
from fxpipe.cost.timers import CLOCKS, CpuStopwatch, CpuTimer, CudaEventTimer, CudaStopwatch, check_repeats, timer_for
from fxpipe.errors import InputError
from fxpipe.passes.costing import RooflineCosts

__all__ = [
    "MeasuredCosts",
    "ProfileReport",
    "base_hardware",
    "device_info",
    "device_memory_bytes",
    "measure_autograd_overhead",
    "measured_profile",
    "profile_graph",
    "recorded_clock",
]


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


def device_memory_bytes(device: str | torch.device | None = None) -> float | None:
    """Memory of the profiling device in bytes, read from the machine (None if unknown).

    CUDA: ``torch.cuda.get_device_properties(device).total_memory``. CPU: the physical
    memory (``SC_PAGE_SIZE * SC_PHYS_PAGES``), or the process's cgroup memory limit
    (``/sys/fs/cgroup/memory.max``, v1 ``memory.limit_in_bytes``) where that is smaller.
    """
    dev = _device(device)
    if dev.type == "cuda":
        return float(torch.cuda.get_device_properties(dev).total_memory)
    sizes = []
    try:
        sizes.append(float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")))
    except (ValueError, OSError, AttributeError):  # not POSIX
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < 2**60:  # "max" or a huge number: no limit
            sizes.append(float(text))
    return min(sizes) if sizes else None


def _with_device_memory(spec: HardwareSpec, device: str | torch.device | None) -> HardwareSpec:
    """``spec`` with the capacity of this machine's device (never more than it physically has)."""
    mem = device_memory_bytes(device)
    if mem is None:
        return spec
    return dataclasses.replace(spec, memory_bytes=float(mem))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def recorded_clock(info: DeviceInfo, clock: str) -> str:
    """The clock a measurement of ``info``'s device records: ``"cuda"`` (event pairs) on a GPU, whatever CPU
    clock was asked for; else ``clock`` (``"wall"`` or ``"cpu"``). Lookups of measurements compare with it."""
    return "cuda" if info.is_cuda else clock


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

    CPU -> ``"cpu"``; a CUDA device by name: H200 -> ``"h200-datasheet"``, H100 ->
    ``"h100-sxm-datasheet"``, A100 -> ``"a100-80gb-datasheet"``, any other GPU ->
    ``"h100-sxm-datasheet"``: the plain datasheet roofline (no achieved efficiencies; the
    calibration fits its own, and absorbs the difference in peaks of another GPU).
    """
    name = info.device.lower()
    if not info.is_cuda:
        return HARDWARE["cpu"]
    for needle, spec in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80gb")):
        if needle in name:
            return HARDWARE[f"{spec}-datasheet"]
    return HARDWARE["h100-sxm-datasheet"]

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
    timer = timer or timer_for(dev)
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
    t_start = time.perf_counter()
    if mode not in ("graph", "isolated"):
        raise InputError(f"mode must be 'graph' or 'isolated', got {mode!r}")
    if clock not in CLOCKS:
        raise InputError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    dev = _device(device)
    info = device_info(dev, threads)
    if clock == "cpu" and dev.type == "cpu" and info.threads != 1:
        raise InputError(f"clock='cpu' times the calling thread only: it needs threads=1, got {info.threads}")
    clock_name = recorded_clock(info, clock)
    check_repeats(warmup, min_repeats, max_repeats)
    base = base_hardware(info)
    if not isinstance(db, CostDatabase):
        db = CostDatabase(default_db_path() if db is None else db)
    RooflineCosts(base, dtype)(gm)
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
    prev_threads, prev_grad = torch.get_num_threads(), torch.is_grad_enabled()
    opts = dict(warmup=warmup, min_repeats=min_repeats, max_repeats=max_repeats, min_time_s=min_time_s)
    try:
        torch.set_num_threads(info.threads)
        call_s, node_s = db.autograd_overhead(info)
        if todo:  # measured now, with the clock of this run
            call_s, node_s = measure_autograd_overhead(dev, timer=None if dev.type == "cuda" else CpuTimer(CLOCKS[clock]))
            db.set_autograd_overhead(info, call_s, node_s)
            if mode == "graph":
                sw = timer or (CudaStopwatch() if dev.type == "cuda" else CpuStopwatch(CLOCKS[clock]))
                ms, report.interrupted = run_graph_mode(gm, todo, report.keys, device=dev, dtype=dtype, example_inputs=example_inputs,
                                                     stopwatch=sw, call_s=call_s, node_s=node_s, base=base, clock=clock_name,
                                                     progress=progress, **opts)
                db.put_many(info, ms)
                report.measured = len(ms)
            else:
                report.measured, report.interrupted = run_isolated_mode(
                    db, info, todo, device=dev, dtype=dtype, example_inputs=(gm, example_inputs),
                    timer=timer or (CudaEventTimer() if dev.type == "cuda" else CpuTimer(CLOCKS[clock])),
                    base=base, call_s=call_s, node_s=node_s, progress=progress, opts=opts, clock=clock_name)
        report.autograd_call_overhead_s = call_s
    finally:
        torch.set_num_threads(prev_threads)
        torch.set_grad_enabled(prev_grad)  # whatever the graph's no_grad bodies did
        if save:
            db.save()
    for key in set(report.keys.values()):
        m = db.get(info, key)
        if m is not None and not m.ok:
            report.failed[key] = m.error
    report.wall_s = time.perf_counter() - t_start
    return report

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
        times, source = self.profile.predict(key, op_class_of(node), cost.kind,
                                             (cost.t_fwd_s, cost.t_bwd_input_s, cost.t_bwd_weight_s), phases_of(node))
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
