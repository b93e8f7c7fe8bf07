"""Calibrated cost model: roofline efficiency factors fitted to measured op times.

The analytic roofline (:mod:`fxpipe.cost.roofline`) predicts ``t = core + launch_overhead``
with ``core = max(flops / peak, bytes / bandwidth)`` from datasheet peaks. Real kernels reach
a class-dependent fraction of those peaks and pay a class-dependent fixed cost (dispatch,
autograd bookkeeping, kernel launch), so the calibrated model is, for every op class ``c``
and phase ``p`` (forward F, backward-input B, backward-weight W)::

    t_p = overhead[c, p] + scale[c, p] * core_p          (scale = 1 / efficiency)

where ``core_p`` is the roofline's own F/B/W time without launch overhead (Zero Bubble's F/B/W
split, :func:`fxpipe.cost.roofline.backward_times`). The two non-negative parameters are fitted
by least squares on *relative* residuals, ``sum_i ((overhead + scale core_i) / t_i - 1)^2``
(a two-variable non-negative least-squares problem solved exactly by enumerating its active
sets, Lawson & Hanson, "Solving Least Squares Problems", 1974, Ch. 23), so a 10 us op and a
10 ms op weigh the same.

Op classes form a hierarchy: the op packet (``"aten.addmm"``), then its roofline kind
(``"kind:matmul_param"``), then everything (``"*"``). A shape never profiled is predicted by
the most specific level with at least ``min_samples`` measurements of at least two distinct
roofline times; a shape that was profiled uses its measurement.

A :class:`CostProfile` bundles the base hardware spec, the measurements and the fitted
:class:`Calibration`; it is the "profile" part of a :class:`~fxpipe.cost.hardware.HardwareSpec`
(``HardwareSpec.profile``), saved as ``fxpipe.hwprofile/1`` JSON::

    {"format": "fxpipe.hwprofile/1", "name": "cpu-measured", "description": "...",
     "device": {"device": "cpu: ...", "torch": "2.13.0+cpu", "threads": 1},
     "base": {<HardwareSpec.to_dict() of the roofline spec>},
     "d2d_bytes_per_s": null, "p2p_latency_s": null, "p2p_times_s": null,
     "autograd_call_overhead_s": 1.1e-05,
     "min_samples": 3, "made_with": "python -m fxpipe.cost.profile ...", "created": "2025-...",
     "calibration": {"fwd": {"aten.addmm": {"overhead_s": 4e-06, "scale": 9.1, "n": 6,
                                            "distinct": 6, "median_rel_err": 0.05}, ...},
                     "bwd_input": {...}, "bwd_weight": {...}},
     "measurements": {"<op key>": {<fxpipe.costdb/1 entry>}, ...}}

The calibration is refitted from the measurements when a profile is loaded, so the stored
``calibration`` is a readable summary and a check, not a second source of truth.

This module is torch-free.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from fxpipe.cost.database import PHASES, DeviceInfo, Measurement
from fxpipe.cost.specs import COMPUTE_FAMILIES, HARDWARE, HardwareSpec, datasheet_spec, spec_from_dict
from fxpipe.errors import InputError
from fxpipe.io import check_number, read_json, write_json_atomic
from fxpipe.ir.opgraph import OpGraph

__all__ = [
    "PROFILE_FORMAT",
    "LinkModel",
    "with_link_bandwidth",
    "PhaseFit",
    "Calibration",
    "CostProfile",
    "fit_phase",
    "fit_calibration",
    "class_levels",
    "cross_validate",
    "load_profile",
    "roofline_cores",
]

PROFILE_FORMAT = "fxpipe.hwprofile/1"

#: Measurements a class needs before it gets its own fit (else its parent level is used).
DEFAULT_MIN_SAMPLES = 3


@dataclass(frozen=True)
class PhaseFit:
    """``t = overhead_s + scale * core_s`` for one op class and phase.

    Attributes
    ----------
    overhead_s : float
        Fixed time per op (s), >= 0.
    scale : float
        Multiplier of the roofline core time (1 / efficiency), >= 0.
    n : int
        Measurements fitted.
    distinct : int
        Distinct roofline core times among them (a 2-parameter fit needs >= 2).
    median_rel_err : float
        In-sample median of ``|predicted - measured| / measured``.
    """

    overhead_s: float
    scale: float
    n: int
    distinct: int
    median_rel_err: float

    def predict(self, core_s: float) -> float:
        """Predicted time (s) of an op whose roofline core time is ``core_s``."""
        return self.overhead_s + self.scale * max(float(core_s), 0.0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _distinct(x: np.ndarray, rtol: float = 1e-3) -> int:
    if x.size == 0:
        return 0
    s = np.sort(x)
    return int(1 + np.sum(np.diff(s) > rtol * np.maximum(np.abs(s[1:]), 1e-30)))


def fit_phase(cores_s: Sequence[float], times_s: Sequence[float]) -> PhaseFit:
    """Fit ``t = overhead + scale * core`` (both >= 0) minimising squared relative errors.

    Parameters
    ----------
    cores_s : float array (n,)
        Roofline core times (s), >= 0.
    times_s : float array (n,)
        Measured times (s), > 0.

    Returns
    -------
    PhaseFit

    Raises
    ------
    ValueError
        On empty input, mismatched lengths, a negative core or a non-positive time.

    Notes
    -----
    With rows ``a_i = (1/t_i, c_i/t_i)`` the problem is ``min ||A x - 1||`` over ``x >= 0``.
    For two variables the non-negative optimum is the best of: the unconstrained solution (if
    non-negative and the cores take >= 2 distinct values), overhead only, scale only
    (Lawson & Hanson 1974, Ch. 23: the optimum has some active set; there are three).
    """
    c = np.asarray(cores_s, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if c.ndim != 1 or c.shape != t.shape or c.size == 0:
        raise ValueError("cores_s and times_s must be non-empty 1-d arrays of equal length")
    if np.any(~np.isfinite(c)) or np.any(c < 0):
        raise ValueError("roofline core times must be finite and >= 0")
    if np.any(~np.isfinite(t)) or np.any(t <= 0):
        raise ValueError("measured times must be finite and > 0")
    w = 1.0 / t
    cw = c * w
    A = np.stack([w, cw], axis=1)
    ones = np.ones_like(t)
    distinct = _distinct(c)
    cands: list[np.ndarray] = [np.array([w.sum() / (w @ w), 0.0])]
    if cw @ cw > 0:
        cands.append(np.array([0.0, cw.sum() / (cw @ cw)]))
    if distinct >= 2 and np.any(c > 0):
        sol, *_ = np.linalg.lstsq(A, ones, rcond=None)
        if np.all(sol >= 0):
            cands.append(sol)
    best = min(cands, key=lambda x: float(np.sum((A @ x - ones) ** 2)))
    pred = best[0] + best[1] * c
    rel = np.abs(pred - t) / t
    return PhaseFit(float(best[0]), float(best[1]), int(c.size), distinct, float(np.median(rel)))


@dataclass(frozen=True)
class LinkModel:
    """Measured one-way time of a stage-to-stage message as a function of its size.

    Piecewise-linear interpolation of measured ``(bytes, seconds)`` points (the ping-pong of
    :func:`fxpipe.cost.profile.p2p_times`), extrapolated with the last segment's slope above
    the largest size and flat below the smallest. Real links are not affine: gloo over
    loopback TCP on the development machine takes ~40 us up to 48 KiB and ~1.9 ms from 64 KiB
    on, so one latency + bandwidth pair would be wrong by 40x for mid-sized tensors.

    Attributes
    ----------
    sizes_bytes, times_s : tuple of float
        The measured points, sizes increasing.
    """

    sizes_bytes: tuple
    times_s: tuple

    @classmethod
    def from_times(cls, times: Mapping[Any, float]) -> "LinkModel":
        """From ``{size_bytes: seconds}`` (keys may be strings, as in JSON).

        Raises
        ------
        InputError
            With no point, a negative size or a non-positive time.
        """
        pts = sorted((float(k), float(v)) for k, v in times.items())
        if not pts or any(n < 0 or not (t > 0 and np.isfinite(t)) for n, t in pts):
            raise InputError(f"a link model needs message sizes >= 0 and times > 0, got {dict(times)!r}")
        return cls(tuple(n for n, _ in pts), tuple(t for _, t in pts))

    def time_s(self, nbytes: float) -> float:
        """One-way time (s) of a message of ``nbytes`` bytes (0 for an empty message)."""
        if nbytes <= 0:
            return 0.0
        x, y = self.sizes_bytes, self.times_s
        if len(x) == 1 or nbytes <= x[0]:
            return y[0]
        if nbytes >= x[-1]:
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2]) if x[-1] > x[-2] else 0.0
            return y[-1] + max(slope, 0.0) * (nbytes - x[-1])
        return float(np.interp(nbytes, x, y))

    def effective_bytes_per_s(self, nbytes: float) -> float:
        """``nbytes / time_s(nbytes)``: the bandwidth a linear model should use for messages of
        about this size (Contract 2's ``io = bytes / B`` has no per-message term)."""
        return float(nbytes) / self.time_s(nbytes) if nbytes > 0 else float("inf")

    def to_dict(self) -> dict[str, float]:
        return {str(int(n)): t for n, t in zip(self.sizes_bytes, self.times_s)}


def with_link_bandwidth(graph, link: LinkModel, *, size_bytes: float | None = None):
    """The OpGraph with its bandwidth set to the link's effective bandwidth for its tensors.

    Contract 2 prices a transfer at ``bytes / B``; a measured link also has a cost per message
    (:class:`LinkModel`). ``B`` is taken as ``link.effective_bytes_per_s(size)`` at ``size`` =
    the bytes-weighted median output size of the graph's call nodes (the tensors a cut can send), so that
    cuts are priced right for typical tensors. ``graph.meta["link_bandwidth"]`` records it.

    Raises
    ------
    InputError
        If the graph has no tensor-producing call node and ``size_bytes`` is not given.
    """
    if size_bytes is None:
        sizes = [float(graph.size_out_bytes[i]) for i in range(graph.n)
                 if graph.ops[i].startswith("call_") and graph.size_out_bytes[i] > 0]
        if not sizes:
            raise InputError("the graph has no tensor-producing node: pass size_bytes")
        # bytes-weighted median: half of all bytes a cut could send are in tensors at least
        # this large. A cut's time is dominated by its large tensors; the plain median sits
        # on the many small ones (views, scalars), whose per-message latency made every byte
        # look slow (gloo loopback: GPT-2 priced at 0.017 GB/s, a UNet at 0.13 GB/s, and the
        # UNet's cuts avoided although its equal-layer split trained 24% faster). The price
        # one bandwidth can give: a cut of many small tensors is underpriced by their latency
        order = np.sort(np.asarray(sizes))
        cum = np.cumsum(order)
        size_bytes = float(order[int(np.searchsorted(cum, 0.5 * cum[-1]))])
    bw = link.effective_bytes_per_s(size_bytes)
    doc = graph.to_dict()
    doc["bandwidth_bytes_per_s"] = bw
    doc["link_bandwidth"] = {"message_bytes": size_bytes, "bytes_per_s": bw}
    return OpGraph.from_dict(doc, source="graph with link bandwidth")


def class_levels(op_class: str, kind: str) -> list[str]:
    """Calibration levels of an op, most specific first: op class, ``kind:<kind>``, ``*``."""
    out = [op_class] if op_class else []
    if kind:
        out.append(f"kind:{kind}")
    out.append("*")
    return out


def roofline_cores(roofline_s: Sequence[float], launch_overhead_s: float) -> tuple[float, float, float]:
    """Roofline F/B/W times without the launch overhead (0 stays 0)."""
    return tuple(max(float(t) - launch_overhead_s, 0.0) if t > 0 else 0.0 for t in roofline_s)  # type: ignore[return-value]


@dataclass
class Calibration:
    """Fitted :class:`PhaseFit` per phase and class level.

    Attributes
    ----------
    fits : dict[str, dict[str, PhaseFit]]
        ``fits[phase][level]`` for phase in ``("fwd", "bwd_input", "bwd_weight")``.
    min_samples : int
        Measurements a non-root level needs to be used.
    """

    fits: dict[str, dict[str, PhaseFit]] = field(default_factory=lambda: {p: {} for p in PHASES})
    min_samples: int = DEFAULT_MIN_SAMPLES

    def usable(self, phase: str, level: str) -> PhaseFit | None:
        """The fit of ``level`` for ``phase`` if it is trustworthy enough to predict with."""
        f = self.fits.get(phase, {}).get(level)
        if f is None:
            return None
        if level == "*":
            return f
        if f.n < self.min_samples:
            return None
        if f.distinct < 2 and f.scale > 0:  # a single shape cannot tell overhead from scale
            return None
        return f

    def predict_phase(self, phase: str, op_class: str, kind: str, core_s: float) -> tuple[float, str] | None:
        """``(time_s, level)`` from the most specific usable level, or None without any fit."""
        for level in class_levels(op_class, kind):
            f = self.usable(phase, level)
            if f is not None:
                return f.predict(core_s), level
        return None

    def to_dict(self) -> dict[str, Any]:
        return {p: {lvl: f.to_dict() for lvl, f in sorted(self.fits[p].items())} for p in PHASES}


def fit_calibration(measurements: Iterable[Measurement], launch_overhead_s: float, *,
                    min_samples: int = DEFAULT_MIN_SAMPLES) -> Calibration:
    """Fit every class level and phase to the measurements.

    Parameters
    ----------
    measurements : iterable of Measurement
        Successful measurements (``error`` empty); others are skipped. Their ``roofline_s``
        must come from one base spec, whose launch overhead is ``launch_overhead_s``.
    launch_overhead_s : float
        Launch overhead of that base spec (removed from ``roofline_s`` to get core times).
    min_samples : int
        See :class:`Calibration`.

    Returns
    -------
    Calibration
        A phase with no measurement at all has no fits (predictions then fall back to the
        roofline, see :meth:`CostProfile.predict`).
    """
    if min_samples < 1:
        raise InputError(f"min_samples must be >= 1, got {min_samples}")
    groups: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for m in measurements:
        if not m.ok:
            continue
        cores = roofline_cores(m.roofline_s, launch_overhead_s)
        for p, phase in enumerate(PHASES):
            t = m.times[p]
            if t <= 0:
                continue
            for level in class_levels(m.op_class, m.kind):
                cs, ts = groups.setdefault((phase, level), ([], []))
                cs.append(cores[p])
                ts.append(t)
    cal = Calibration(min_samples=min_samples)
    for (phase, level), (cs, ts) in groups.items():
        cal.fits[phase][level] = fit_phase(cs, ts)
    return cal


@dataclass
class CostProfile:
    """Measured costs of one device: base spec, measurements, calibration.

    Attributes
    ----------
    name : str
        Name of the hardware spec this profile makes (``HardwareSpec.name``).
    device : DeviceInfo
        Where the measurements were made.
    base : HardwareSpec
        The datasheet / derived spec whose roofline the calibration corrects.
    measurements : dict[str, Measurement]
        Op key -> measurement (exact matches are used as measured).
    calibration : Calibration
        Fitted from ``measurements`` (see :func:`fit_calibration`).
    d2d_bytes_per_s : float, optional
        Measured stage-to-stage bandwidth replacing the base spec's (bytes/s).
    p2p_latency_s : float, optional
        Measured fixed cost of one stage-to-stage message (informational).
    link : LinkModel, optional
        Measured one-way message times by size (``p2p_times_s`` in the file).
    autograd_call_overhead_s : float
        Fixed cost of one ``torch.autograd.grad`` call, subtracted from every B/W measurement.
    description, made_with, created : str
        Free text: what this is, the command that made it, when.
    """

    name: str
    device: DeviceInfo
    base: HardwareSpec
    measurements: dict[str, Measurement]
    calibration: Calibration
    d2d_bytes_per_s: float | None = None
    p2p_latency_s: float | None = None
    link: LinkModel | None = None
    autograd_call_overhead_s: float = 0.0
    description: str = ""
    made_with: str = ""
    created: str = ""

    @classmethod
    def from_measurements(cls, measurements: Iterable[Measurement], *, device: DeviceInfo, base: HardwareSpec | str,
                          name: str | None = None, min_samples: int = DEFAULT_MIN_SAMPLES, **kwargs: Any) -> "CostProfile":
        """Build a profile (and fit its calibration) from measurements of one device.

        Measurements whose ``roofline_spec`` is not ``base``'s name are dropped (their
        features are under another roofline).

        Raises
        ------
        InputError
            If no successful measurement is left.
        """
        base = datasheet_spec(base)
        if base.profile is not None:
            base = base.profile.base
        kept = {m.key: m for m in measurements if m.roofline_spec == base.name}
        if not any(m.ok for m in kept.values()):
            raise InputError(
                f"no usable measurement for device {device.key!r} under the {base.name!r} roofline: "
                "profile a model (costs='measured') or run `python -m fxpipe.cost.profile --suite` first"
            )
        cal = fit_calibration(kept.values(), base.launch_overhead_s, min_samples=min_samples)
        kwargs.setdefault("created", time.strftime("%Y-%m-%d"))
        return cls(name=name or f"{base.name}-measured", device=device, base=base, measurements=kept,
                   calibration=cal, **kwargs)

    # ------------------------------------------------------------------ prediction
    def predict(self, op_key: str | None, op_class: str, kind: str, roofline_s: Sequence[float],
                needs: Sequence[bool]) -> tuple[tuple[float, float, float], str]:
        """F/B/W times of one op: measured if profiled, else calibrated, else roofline.

        Parameters
        ----------
        op_key : str or None
            The op's database key (:func:`fxpipe.cost.signature.op_signature`), None if the op
            cannot be profiled.
        op_class, kind : str
            Calibration class (op packet name) and roofline kind.
        roofline_s : 3 floats
            The base spec's F/B/W times of the op (launch overhead included).
        needs : 3 bools
            Whether the op has each phase in this graph (F; B: an activation input needs a
            gradient; W: a trainable weight input). A phase it does not have is 0.

        Returns
        -------
        (times, source)
            ``times`` = (t_fwd_s, t_bwd_input_s, t_bwd_weight_s); ``source`` is
            ``"measured"``, ``"calibrated"`` (some phase from a fit) or ``"roofline"``.
        """
        m = self.measurements.get(op_key) if op_key is not None else None
        if m is not None and m.ok:
            return tuple(m.times[p] if needs[p] else 0.0 for p in range(3)), "measured"  # type: ignore[return-value]
        cores = roofline_cores(roofline_s, self.base.launch_overhead_s)
        out = []
        source = "roofline"
        for p, phase in enumerate(PHASES):
            if not needs[p]:
                out.append(0.0)
                continue
            pred = self.calibration.predict_phase(phase, op_class, kind, cores[p])
            if pred is None:
                out.append(float(roofline_s[p]))
            else:
                out.append(pred[0])
                source = "calibrated"
        return tuple(out), source  # type: ignore[return-value]

    # ------------------------------------------------------------------ hardware spec
    def hardware(self) -> HardwareSpec:
        """The :class:`HardwareSpec` carrying this profile (base peaks, measured links).

        The op times are the profile's; the links' achieved efficiencies (collectives, the
        inter-node network, host copies; not compute) are those of the base's achieved twin
        (``"h100-sxm"`` for a ``"h100-sxm-datasheet"`` base), except a measured stage-to-stage
        bandwidth, which replaces ``p2p``'s.
        """
        changes: dict[str, Any] = {"name": self.name, "profile": self,
                                   "description": f"{self.device.device}, {self.device.threads} threads, "
                                                  f"torch {self.device.torch} (measured; roofline base {self.base.name})"}
        if self.d2d_bytes_per_s:
            changes["d2d_bytes_per_s"] = float(self.d2d_bytes_per_s)
        twin = HARDWARE.get(self.base.name[: -len("-datasheet")]) if self.base.name.endswith("-datasheet") else None
        if twin is not None and not self.base.efficiency:
            links = [k for k in twin.efficiency if k not in COMPUTE_FAMILIES and not (k == "p2p" and self.d2d_bytes_per_s)]
            changes["efficiency"] = {k: twin.efficiency[k] for k in links}
            changes["efficiency_sources"] = {k: twin.efficiency_sources.get(k, "") for k in links}
        return dataclasses.replace(self.base, **changes)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The ``fxpipe.hwprofile/1`` document."""
        return {
            "format": PROFILE_FORMAT,
            "name": self.name,
            "description": self.description,
            "device": self.device.to_dict(),
            "base": self.base.to_dict(),
            "d2d_bytes_per_s": self.d2d_bytes_per_s,
            "p2p_latency_s": self.p2p_latency_s,
            "p2p_times_s": self.link.to_dict() if self.link is not None else None,
            "autograd_call_overhead_s": self.autograd_call_overhead_s,
            "min_samples": self.calibration.min_samples,
            "made_with": self.made_with,
            "created": self.created,
            "calibration": self.calibration.to_dict(),
            "measurements": {k: m.to_dict() for k, m in sorted(self.measurements.items())},
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str = "profile") -> "CostProfile":
        """Rebuild a profile (refitting its calibration from the measurements).

        Raises
        ------
        InputError
            If the document is not an ``fxpipe.hwprofile/1`` profile or is malformed: its ``base``
            spec is checked by :func:`fxpipe.cost.specs.spec_from_dict` (units and ranges), its
            measurements by :meth:`fxpipe.cost.database.Measurement.from_dict`, the measured links
            and overheads by range; the message names the file and the field.
        """
        if not isinstance(doc, Mapping) or doc.get("format") != PROFILE_FORMAT:
            raise InputError(f"{source}: not an {PROFILE_FORMAT} document (make one with `python -m fxpipe.cost.profile`)")
        for key in ("base", "measurements", "device", "name"):
            if key not in doc:
                raise InputError(f"{source}: malformed hardware profile: it lacks the required field {key!r}; regenerate it with "
                                 "`python -m fxpipe.cost.profile`")
        base = spec_from_dict(doc["base"], source=f"{source}: base")
        if not isinstance(doc["measurements"], Mapping):
            raise InputError(f"{source}: field 'measurements' is a {type(doc['measurements']).__name__}, allowed: an "
                             "object of op key -> measurement")
        limits = {"d2d_bytes_per_s": (0.0, None, True), "p2p_latency_s": (0.0, 1.0, False)}  # (low, high, low excluded)

        def opt(key):  # optional measured links: null, or in range
            if doc.get(key) is None:
                return None
            low, high, low_open = limits[key]
            return check_number(doc[key], key, low=low, high=high, low_open=low_open, where=source)

        min_samples = check_number(doc.get("min_samples", DEFAULT_MIN_SAMPLES), "min_samples", low=1, high=1e6, where=source)
        overhead = check_number(doc.get("autograd_call_overhead_s", 0.0), "autograd_call_overhead_s", high=1.0, where=source)
        try:
            ms = [Measurement.from_dict(e, source=f"{source}: measurements[{k!r}]") for k, e in doc["measurements"].items()]
            device = DeviceInfo.from_dict(doc["device"], source=f"{source}: device")
            return cls.from_measurements(
                ms, device=device, base=base, name=str(doc["name"]), min_samples=int(min_samples),
                d2d_bytes_per_s=opt("d2d_bytes_per_s"), p2p_latency_s=opt("p2p_latency_s"),
                link=LinkModel.from_times(doc["p2p_times_s"]) if doc.get("p2p_times_s") else None,
                autograd_call_overhead_s=overhead,
                description=str(doc.get("description", "")), made_with=str(doc.get("made_with", "")),
                created=str(doc.get("created", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InputError):
                raise
            raise InputError(f"{source}: malformed hardware profile ({exc!r}); regenerate it with `python -m fxpipe.cost.profile`") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON (atomically)."""
        return write_json_atomic(path, self.to_dict(), indent=1)


def load_profile(path: str | os.PathLike) -> CostProfile:
    """Read an ``fxpipe.hwprofile/1`` file.

    Raises
    ------
    InputError
        If the file is missing, not JSON, or not a valid profile.
    """
    return CostProfile.from_dict(read_json(path, "hardware profile"), source=str(path))


def _rel_errors(pred: Sequence[float], meas: Sequence[float]) -> list[float]:
    return [abs(p - m) / m for p, m in zip(pred, meas) if m > 0]


def cross_validate(measurements: Sequence[Measurement], base: HardwareSpec | str, *, folds: int = 5, seed: int = 0,
                   min_samples: int = DEFAULT_MIN_SAMPLES) -> dict[str, dict[str, float]]:
    """Prediction error on held-out shapes: calibrated model vs the base spec's roofline.

    The measurements are split into ``folds`` random folds; each fold is predicted by a
    calibration fitted on the others (without the exact measurements, so every prediction
    is for a shape the model never saw), and by the base spec's roofline.

    Parameters
    ----------
    measurements : sequence of Measurement
        Successful measurements under the ``base`` roofline (others are skipped).
    base : HardwareSpec or str
    folds, seed, min_samples :
        K-fold split (``folds`` is capped at the number of measurements) and calibration option.

    Returns
    -------
    dict[str, dict[str, float]]
        Per op class and ``"all"``: ``n`` (phase samples), ``roofline_median_rel_err``,
        ``calibrated_median_rel_err`` (medians over every measured phase of every held-out
        op of |predicted - measured| / measured).

    Raises
    ------
    InputError
        With fewer than 2 usable measurements.
    """
    base = datasheet_spec(base)
    ms = sorted((m for m in measurements if m.ok and m.roofline_spec == base.name and any(t > 0 for t in m.times)),
                key=lambda m: m.key)  # folds independent of the input order
    if len(ms) < 2:
        raise InputError(f"cross-validation needs at least 2 measurements, got {len(ms)}")
    rng = np.random.default_rng(seed)
    k = max(2, min(int(folds), len(ms)))
    fold = rng.permutation(len(ms)) % k
    lo = base.launch_overhead_s
    errs: dict[str, dict[str, list[float]]] = {}
    for f in range(k):
        train = [m for m, g in zip(ms, fold) if g != f]
        cal = fit_calibration(train, lo, min_samples=min_samples)
        for m, g in zip(ms, fold):
            if g != f:
                continue
            cores = roofline_cores(m.roofline_s, lo)
            meas, roof, calib = [], [], []
            for p, phase in enumerate(PHASES):
                if m.times[p] <= 0:
                    continue
                pred = cal.predict_phase(phase, m.op_class, m.kind, cores[p])
                meas.append(m.times[p])
                roof.append(m.roofline_s[p])
                calib.append(m.roofline_s[p] if pred is None else pred[0])
            for cls_name in (m.op_class, "all"):
                e = errs.setdefault(cls_name, {"roofline": [], "calibrated": []})
                e["roofline"] += _rel_errors(roof, meas)
                e["calibrated"] += _rel_errors(calib, meas)
    return {
        c: {"n": float(len(e["roofline"])), "roofline_median_rel_err": float(np.median(e["roofline"])),
            "calibrated_median_rel_err": float(np.median(e["calibrated"]))}
        for c, e in sorted(errs.items())
    }
