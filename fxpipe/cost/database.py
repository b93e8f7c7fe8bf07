"""The measured-cost database: one JSON file of per-op timings, reused across runs.

A :class:`Measurement` is what the profiler (:mod:`fxpipe.cost.profile`) measured for one op
signature on one device: median forward, backward-input (B) and backward-weight (W) times,
plus the roofline features of the same op (FLOPs, bytes, the analytic times under the base
hardware spec) that the calibration (:mod:`fxpipe.cost.calibrate`) fits against.

Keys. A measurement is keyed by *(op, input shapes and dtypes, device name, torch version)*
and the intra-op thread count: the device part is a :class:`DeviceInfo` (``device``,
``torch``, ``threads``), the op part the op's overload name plus its argument signature, e.g.
``aten.addmm.default(f32[48], f32[64,32]g, f32[32,48]{1,32}w)`` (see
:func:`fxpipe.cost.signature.op_signature`: ``g`` marks an activation input that needs a
gradient, ``w`` a trainable weight, ``{...}`` non-contiguous strides; non-tensor arguments
appear as Python literals).

File format ``fxpipe.costdb/1`` (JSON)::

    {"format": "fxpipe.costdb/1",
     "devices": {
       "cpu: Intel(R) Xeon(R) ... | torch 2.13.0+cpu | 1 threads": {
         "device": "cpu: Intel(R) Xeon(R) ...", "torch": "2.13.0+cpu", "threads": 1,
         "autograd_call_overhead_s": 1.2e-05, "autograd_node_s": 1.5e-06,
         "entries": {
           "aten.mm.default(f32[64,128]g, f32[128,256]w)": {
             "op": "aten.mm.default", "args": "f32[64,128]g, f32[128,256]w",
             "op_class": "aten.mm", "kind": "matmul_param",
             "t_fwd_s": 3.1e-05, "t_bwd_input_s": 2.9e-05, "t_bwd_weight_s": 3.3e-05,
             "repeats": 25, "spread": 0.04,
             "flops": 4194304.0, "bytes": 196608.0, "dtype": "fp32",
             "roofline_spec": "cpu", "roofline_s": [1.5e-05, 1.5e-05, 1.5e-05],
             "error": "", "method": "graph", "clock": "wall"}}}}}

``spread`` is the largest inter-quartile range / median over the three phases (a noise
indicator); ``roofline_s`` are the analytic F/B/W times (launch overhead included) under the
hardware spec named ``roofline_spec``; a non-empty ``error`` means the op could not be run
on this device (the times are then 0 and the cost model falls back to its calibration).

Writes are atomic (:func:`fxpipe.ir.write_json_atomic`) and merge with what is on disk at
that moment, so two processes that profile different models into the same file keep both
sets of entries (if both measure the same key, the last writer's value is kept).

This module is torch-free.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from fxpipe.errors import InputError
from fxpipe.io import MAX_BYTES, MAX_FLOPS, MAX_TIME_S, check_number, read_json, write_json_atomic

__all__ = ["COSTDB_FORMAT", "DeviceInfo", "Measurement", "CostDatabase", "default_db_path", "PHASES"]

COSTDB_FORMAT = "fxpipe.costdb/1"

#: The three timed phases of an op, in the order of ``Measurement.times`` and ``roofline_s``.
PHASES = ("fwd", "bwd_input", "bwd_weight")


def default_db_path() -> Path:
    """Where measurements are kept unless a path is given.

    ``$FXPIPE_COST_DB`` if set, else ``$XDG_CACHE_HOME/fxpipe/costdb.json`` (``~/.cache`` when
    ``XDG_CACHE_HOME`` is unset).
    """
    env = os.environ.get("FXPIPE_COST_DB")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fxpipe" / "costdb.json"


@dataclass(frozen=True)
class DeviceInfo:
    """Where a measurement was made.

    Attributes
    ----------
    device : str
        Device name, ``"cpu: <CPU model name>"`` or ``"cuda: <GPU name>"``.
    torch : str
        ``torch.__version__`` of the measuring process.
    threads : int
        Intra-op threads (``torch.get_num_threads()``) the ops ran with.
    """

    device: str
    torch: str
    threads: int

    @property
    def key(self) -> str:
        """The database key of this device: ``"<device> | torch <version> | <threads> threads"``."""
        return f"{self.device} | torch {self.torch} | {self.threads} threads"

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "torch": self.torch, "threads": self.threads}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "device record") -> "DeviceInfo":
        """Rebuild from :meth:`to_dict` output.

        Raises
        ------
        InputError
            When ``device`` or ``torch`` is missing or not a string, or ``threads`` is not an integer in
            [1, 4096]; the message names ``source`` and the field.
        """
        if not isinstance(d, Mapping):
            raise InputError(f"{source}: a device record must be an object with device, torch and threads")
        for key in ("device", "torch"):
            if not isinstance(d.get(key), str):
                raise InputError(f"{source}: field {key!r} is {d.get(key)!r:.80}, allowed: a string")
        threads = check_number(d.get("threads"), "threads", low=1, high=4096, where=source)
        if not threads.is_integer():
            raise InputError(f"{source}: field 'threads' is {threads:g}, allowed: an integer in [1, 4096]")
        return cls(device=d["device"], torch=d["torch"], threads=int(threads))


@dataclass(frozen=True)
class Measurement:
    """Measured times of one op signature on one device, with its roofline features.

    Attributes
    ----------
    op : str
        Op overload name, e.g. ``"aten.addmm.default"``.
    args : str
        Argument signature (shapes, dtypes, strides, grad flags, literals).
    op_class : str
        Calibration class: the op packet name (``"aten.addmm"``).
    kind : str
        Roofline kind of the op (:data:`fxpipe.cost.roofline.KINDS`).
    t_fwd_s, t_bwd_input_s, t_bwd_weight_s : float
        Median measured times (s); 0 for a phase the op does not have.
    repeats : int
        Timed repetitions per phase (after warm-up).
    spread : float
        Largest inter-quartile range / median over the measured phases.
    flops, bytes : float
        Forward FLOPs and bytes moved (from :class:`fxpipe.passes.annotate.AnnotateCosts`).
    dtype : str
        Compute dtype name (``"fp32"``, ``"bf16"``, ...), ``""`` for none.
    roofline_spec : str
        Name of the hardware spec ``roofline_s`` was computed with.
    roofline_s : tuple[float, float, float]
        Analytic F/B/W times under ``roofline_spec`` (launch overhead included).
    error : str
        Why the op could not be run ("" when it was measured).
    method : str
        How it was measured: ``"graph"`` (inside a run of the whole captured graph) or
        ``"isolated"`` (the op alone, repeated); see :func:`fxpipe.cost.profile.profile_graph`.
    clock : str
        ``"wall"``, ``"cpu"`` (thread CPU time) or ``"cuda"`` (CUDA events).
    """

    op: str
    args: str
    op_class: str
    kind: str
    t_fwd_s: float = 0.0
    t_bwd_input_s: float = 0.0
    t_bwd_weight_s: float = 0.0
    repeats: int = 0
    spread: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    dtype: str = ""
    roofline_spec: str = ""
    roofline_s: tuple = (0.0, 0.0, 0.0)
    error: str = ""
    method: str = "graph"
    clock: str = "wall"

    @property
    def key(self) -> str:
        """The op part of the database key: ``"<op>(<args>)"``."""
        return f"{self.op}({self.args})"

    @property
    def times(self) -> tuple[float, float, float]:
        """``(t_fwd_s, t_bwd_input_s, t_bwd_weight_s)``."""
        return (self.t_fwd_s, self.t_bwd_input_s, self.t_bwd_weight_s)

    @property
    def ok(self) -> bool:
        """True when the op was measured (no error)."""
        return not self.error

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["roofline_s"] = [float(x) for x in self.roofline_s]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "measurement") -> "Measurement":
        """Rebuild from :meth:`to_dict` output (unknown keys are ignored).

        Raises
        ------
        InputError
            On a missing field, a field of another type, or a number outside its range (times in
            [0, 1e6] s, FLOPs up to 1e21, bytes up to 1e18, :func:`fxpipe.io.check_number`); the
            message names ``source`` (the file and the entry) and the field.
        """
        names = {f.name for f in fields(cls)}
        source = f"{source}: malformed measurement"
        if not isinstance(d, Mapping):
            raise InputError(f"{source}: a measurement must be an object of fields, got {type(d).__name__}")
        for key in ("op", "args", "op_class", "kind"):
            if not isinstance(d.get(key), str):
                raise InputError(f"{source}: field {key!r} is {d.get(key)!r:.80}, allowed: a string; delete the entry "
                                 "or re-profile")
        kw = {k: v for k, v in d.items() if k in names}
        for name, high in _MEASUREMENT_RANGES.items():  # times, FLOPs, bytes: finite, >= 0, within their unit's range
            if name in kw:
                kw[name] = check_number(kw[name], name, high=high, where=source)
        if "repeats" in kw:
            kw["repeats"] = int(check_number(kw["repeats"], "repeats", high=1e9, where=source))
        roofline = kw.get("roofline_s", (0.0, 0.0, 0.0))
        if not isinstance(roofline, (list, tuple)) or len(roofline) != 3:
            raise InputError(f"{source}: field 'roofline_s' is {roofline!r:.80}, allowed: 3 times in seconds (F, B, W)")
        kw["roofline_s"] = tuple(check_number(x, "roofline_s", where=source) for x in roofline)
        for key in ("dtype", "roofline_spec", "error", "method", "clock"):
            if key in kw and not isinstance(kw[key], str):
                raise InputError(f"{source}: field {key!r} is {kw[key]!r:.80}, allowed: a string")
        return cls(**kw)


#: Numeric fields of a measurement and their upper bounds (all >= 0).
_MEASUREMENT_RANGES = {"t_fwd_s": MAX_TIME_S, "t_bwd_input_s": MAX_TIME_S, "t_bwd_weight_s": MAX_TIME_S,
                       "spread": 1e6, "flops": MAX_FLOPS, "bytes": MAX_BYTES}


@dataclass
class _DeviceSection:
    info: DeviceInfo
    entries: dict[str, Measurement] = field(default_factory=dict)
    autograd_call_overhead_s: float = 0.0
    autograd_node_s: float = 0.0


class CostDatabase:
    """Measured op times of any number of devices, backed by one JSON file.

    Parameters
    ----------
    path : str or Path, optional
        The file (``fxpipe.costdb/1``); ``None`` keeps the database in memory only. A missing
        file is an empty database.

    Raises
    ------
    InputError
        If the file exists but is not a cost database.

    Examples
    --------
    >>> db = CostDatabase("/tmp/costdb.json")          # doctest: +SKIP
    >>> db.get(device, "aten.mm.default(f32[4,4]g, f32[4,4]w)")  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = None if path is None else Path(path).expanduser()
        self._devices: dict[str, _DeviceSection] = {}
        self._dirty: set[tuple[str, str]] = set()
        if self.path is not None and self.path.exists():
            self._devices = self._read(self.path)

    # ------------------------------------------------------------------ reading
    @staticmethod
    def _read(path: Path) -> dict[str, _DeviceSection]:
        doc = read_json(path, "cost database")
        if not isinstance(doc, Mapping) or doc.get("format") != COSTDB_FORMAT:
            raise InputError(f"{str(path)!r} is not an {COSTDB_FORMAT} file: pass another --cost-db path or delete it")
        out: dict[str, _DeviceSection] = {}
        devices = doc.get("devices", {})
        if not isinstance(devices, Mapping):
            raise InputError(f"{str(path)!r}: 'devices' must be an object")
        for key, sec in devices.items():
            where = f"{path}: devices[{key!r}]"
            if not isinstance(sec, Mapping):
                raise InputError(f"{where} must be an object")
            info = DeviceInfo.from_dict(sec, source=where)
            raw = sec.get("entries", {})
            if not isinstance(raw, Mapping):
                raise InputError(f"{where}: field 'entries' is a {type(raw).__name__}, allowed: an object of op key -> "
                                 "measurement (fxpipe.costdb/1)")
            entries = {}
            for op_key, e in raw.items():
                m = Measurement.from_dict(e, source=f"{where}.entries[{op_key!r}]")
                entries[m.key] = m
            overhead = {k: check_number(sec.get(k, 0.0), k, high=1.0, where=where)
                        for k in ("autograd_call_overhead_s", "autograd_node_s")}
            out[info.key] = _DeviceSection(info, entries, overhead["autograd_call_overhead_s"], overhead["autograd_node_s"])
        return out

    # ------------------------------------------------------------------ queries
    def devices(self) -> list[DeviceInfo]:
        """The devices with measurements, in insertion order."""
        return [s.info for s in self._devices.values()]

    def get(self, device: DeviceInfo, op_key: str) -> Measurement | None:
        """The measurement of ``op_key`` on ``device``, or None."""
        sec = self._devices.get(device.key)
        return None if sec is None else sec.entries.get(op_key)

    def entries(self, device: DeviceInfo) -> dict[str, Measurement]:
        """All measurements of ``device`` (op key -> measurement); a copy."""
        sec = self._devices.get(device.key)
        return {} if sec is None else dict(sec.entries)

    def __contains__(self, item: tuple[DeviceInfo, str]) -> bool:
        device, op_key = item
        return self.get(device, op_key) is not None

    def __len__(self) -> int:
        return sum(len(s.entries) for s in self._devices.values())

    def __iter__(self) -> Iterator[tuple[DeviceInfo, Measurement]]:
        for sec in self._devices.values():
            for m in sec.entries.values():
                yield sec.info, m

    def autograd_overhead(self, device: DeviceInfo) -> tuple[float, float]:
        """``(call_s, node_s)``: fixed cost of one ``torch.autograd.grad`` call and of one tiny
        backward node, measured on ``device`` (zeros if unknown)."""
        sec = self._devices.get(device.key)
        return (0.0, 0.0) if sec is None else (sec.autograd_call_overhead_s, sec.autograd_node_s)

    # ------------------------------------------------------------------ updates
    def put(self, device: DeviceInfo, m: Measurement) -> None:
        """Add or replace a measurement."""
        sec = self._devices.setdefault(device.key, _DeviceSection(device))
        sec.entries[m.key] = m
        self._dirty.add((device.key, m.key))

    def put_many(self, device: DeviceInfo, ms: Iterable[Measurement]) -> None:
        for m in ms:
            self.put(device, m)

    def set_autograd_overhead(self, device: DeviceInfo, call_s: float, node_s: float) -> None:
        """Record :meth:`autograd_overhead` of ``device``."""
        sec = self._devices.setdefault(device.key, _DeviceSection(device))
        sec.autograd_call_overhead_s = float(call_s)
        sec.autograd_node_s = float(node_s)
        self._dirty.add((device.key, ""))

    # ------------------------------------------------------------------ writing
    def to_dict(self) -> dict[str, Any]:
        """The ``fxpipe.costdb/1`` document."""
        return {
            "format": COSTDB_FORMAT,
            "devices": {
                key: {
                    **sec.info.to_dict(),
                    "autograd_call_overhead_s": sec.autograd_call_overhead_s,
                    "autograd_node_s": sec.autograd_node_s,
                    "entries": {k: m.to_dict() for k, m in sorted(sec.entries.items())},
                }
                for key, sec in self._devices.items()
            },
        }

    def save(self, path: str | os.PathLike | None = None) -> Path | None:
        """Write the database atomically, merged with the entries on disk at this moment.

        Entries this object added or replaced since it was loaded win over the file's; every
        other entry in the file is kept. Returns the path written (None for an in-memory
        database without ``path``).
        """
        target = Path(path).expanduser() if path is not None else self.path
        if target is None:
            return None
        if target.exists():
            on_disk = self._read(target)
            for key, sec in self._devices.items():
                disk = on_disk.setdefault(key, _DeviceSection(sec.info))
                for op_key, m in sec.entries.items():
                    if (key, op_key) in self._dirty or op_key not in disk.entries:
                        disk.entries[op_key] = m
                if (key, "") in self._dirty or not disk.autograd_call_overhead_s:
                    disk.autograd_call_overhead_s = sec.autograd_call_overhead_s
                    disk.autograd_node_s = sec.autograd_node_s
            self._devices = on_disk
        write_json_atomic(target, self.to_dict(), indent=None)
        self._dirty.clear()
        return target
