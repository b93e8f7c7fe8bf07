"""Cost profiler front end: capture a model, time its ops on this device, cost it with the times.

:func:`trace_measured` (``costs="measured"``) captures a model, annotates it with the device's
base roofline, profiles every op not yet in the cost database (:func:`profile_graph`), fits a
:class:`~fxpipe.cost.calibrate.CostProfile` to the measurements and re-annotates with the
measured spec; :func:`measure_loss` and :func:`add_loss_costs` time a training loss and add it
to the graph's output node; :func:`main` is the command line.

What is measured and how (F/B/W per op, graph and isolated modes, timing, inputs, the cost
database, the :class:`MeasuredCosts` hook): :mod:`fxpipe.cost.measure`. The calibration suite
and ``hardware="measured"`` (:func:`measured_hardware`): :mod:`fxpipe.cost.suite`. This module
re-exports their public names. Layers, bottom up: ``measure`` (runs the roofline costing of
:mod:`fxpipe.passes.costing`), ``suite``, :mod:`fxpipe.cost.hardware` (resolves ``"measured"``),
:mod:`fxpipe.passes.annotate` and :mod:`fxpipe.passes.to_opgraph`, this module.

Command line (how the shipped CPU profile was made)::

    python -m fxpipe.cost.profile --suite --threads 1 --clock cpu --name cpu-1thread \
        --out fxpipe/cost/profiles/cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from fxpipe.cost.calibrate import CostProfile, LinkModel, cross_validate
from fxpipe.cost.database import CostDatabase, default_db_path
from fxpipe.cost.hardware import HardwareSpec, get_hardware
from fxpipe.cost.links import measure_p2p
from fxpipe.cost.measure import (
    MeasuredCosts,
    ProfileReport,
    _with_device_memory,
    base_hardware,
    device_info,
    device_memory_bytes,
    measure_autograd_overhead,
    measured_profile,
    profile_graph,
    recorded_clock,
)
from fxpipe.cost.suite import measured_hardware, run_suite
from fxpipe.cost.timers import CLOCKS
from fxpipe.errors import InputError
from fxpipe.ir.opgraph import OpGraph
from fxpipe.passes.annotate import AnnotateCosts
from fxpipe.passes.capture import capture
from fxpipe.passes.to_opgraph import to_opgraph, trace_model

__all__ = [
    "MeasuredCosts",
    "ProfileReport",
    "add_loss_costs",
    "base_hardware",
    "device_info",
    "device_memory_bytes",
    "measure_autograd_overhead",
    "measure_loss",
    "measured_hardware",
    "measured_profile",
    "profile_graph",
    "trace_measured",
]


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
    spec = _with_device_memory(prof.hardware(), device)  # this machine's memory, not the base's datasheet figure
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
            clock = recorded_clock(info, args.clock)  # "cuda" on a GPU (event pairs), whatever --clock says
            keys = [k for k in keys if k in mine and mine[k].method == args.mode and mine[k].clock == clock]
        link: dict[str, Any] = {}
        if args.p2p:
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
