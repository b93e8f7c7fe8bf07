"""Hardware specifications as data: :class:`HardwareSpec` and the datasheet table.

The leaf of :mod:`fxpipe.cost`: the roofline, the calibration, the cost pass and the profiler
read specs from here; :mod:`fxpipe.cost.hardware` resolves the names users pass (datasheet
names, shipped and measured profiles) and re-exports everything of this module. Units and
sources: see :mod:`fxpipe.cost.hardware`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from fxpipe.errors import InputError
from fxpipe.io import check_number

#: One decimal gigabyte, the datasheets' unit for capacity and bandwidth (bytes).
_GB = 1e9


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (or CPU socket) as seen by the cost model.

    Attributes
    ----------
    name : str
        Registry key, e.g. ``"h100-sxm"``.
    description : str
        Human-readable part name.
    peak_flops : Mapping[str, float]
        Dense peak FLOP/s per compute dtype name (``"fp32"``, ``"tf32"``, ``"bf16"``,
        ``"fp16"``, ``"fp8"``); a dtype missing here falls back to ``"fp32"``.
    hbm_bytes_per_s : float
        Device memory bandwidth, bytes/s.
    d2d_bytes_per_s : float
        Device-to-device bandwidth per direction (NVLink), bytes/s; Contract 2's ``B``.
    host_bytes_per_s : float
        Host link (PCIe) bandwidth per direction, bytes/s; used for offload/reload.
    memory_bytes : float
        Device memory capacity, bytes (datasheet GB x 1e9).
    launch_overhead_s : float
        Fixed cost added to every op that launches a kernel, seconds.
    devices_per_node : int
        Devices joined by ``d2d_bytes_per_s`` links in one node (a DGX / HGX board: 8); the
        topology of data-parallel collectives (:class:`fxpipe.mesh.Topology`).
    inter_node_bytes_per_s : float
        Network bandwidth per device and direction between nodes (one InfiniBand NIC per
        GPU), bytes/s; 0: unknown (one node, or every link at ``d2d_bytes_per_s``).
    intra_node_latency_s, inter_node_latency_s : float
        Per-hop latency of a collective step inside a node / between nodes, seconds.
    host_memory_bytes_per_s : float
        The host (CPU) memory bandwidth one device's share of the node gets, bytes/s: the
        node's DRAM channels x their rate / ``devices_per_node``; what an optimizer step on the
        host streams its state at (``MemoryModel(offload_optimizer=True)``). 0: unknown.
    host_memory_bytes : float
        Host memory per device (the node's DRAM / ``devices_per_node``), bytes; 0: unknown.
    source : str
        Datasheet (document name and URL) the numbers come from.
    profile : fxpipe.cost.calibrate.CostProfile, optional
        Measured op times and the calibration fitted to them; when set, the cost pass
        (:class:`fxpipe.passes.annotate.AnnotateCosts`) replaces the roofline times by measured
        or calibrated ones. The peak and bandwidth fields are then the roofline base the
        calibration corrects.
    """

    name: str
    description: str
    peak_flops: Mapping[str, float]
    hbm_bytes_per_s: float
    d2d_bytes_per_s: float
    host_bytes_per_s: float
    memory_bytes: float
    launch_overhead_s: float
    devices_per_node: int = 1
    inter_node_bytes_per_s: float = 0.0
    intra_node_latency_s: float = 0.0
    inter_node_latency_s: float = 0.0
    host_memory_bytes_per_s: float = 0.0
    host_memory_bytes: float = 0.0
    source: str = field(default="", repr=False)
    profile: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))

    def peak(self, dtype_name: str) -> float:
        """Dense peak FLOP/s for a compute dtype name (falls back to ``"fp32"``)."""
        return float(self.peak_flops.get(dtype_name, self.peak_flops["fp32"]))

    def topology(self) -> dict[str, float]:
        """The links of a cluster of these devices as plain data (:class:`fxpipe.mesh.Topology`'s fields):
        ``devices_per_node``, ``intra_node_bytes_per_s`` (= ``d2d_bytes_per_s``),
        ``inter_node_bytes_per_s`` (0: unknown, taken as intra-node), and the two latencies."""
        return {"devices_per_node": int(self.devices_per_node), "intra_node_bytes_per_s": float(self.d2d_bytes_per_s),
                "inter_node_bytes_per_s": float(self.inter_node_bytes_per_s or self.d2d_bytes_per_s),
                "intra_node_latency_s": float(self.intra_node_latency_s),
                "inter_node_latency_s": float(self.inter_node_latency_s)}

    def to_dict(self) -> dict:
        """Plain-data form (JSON-ready)."""
        return {
            "name": self.name,
            "description": self.description,
            "peak_flops": dict(self.peak_flops),
            "hbm_bytes_per_s": self.hbm_bytes_per_s,
            "d2d_bytes_per_s": self.d2d_bytes_per_s,
            "host_bytes_per_s": self.host_bytes_per_s,
            "memory_bytes": self.memory_bytes,
            "launch_overhead_s": self.launch_overhead_s,
            "devices_per_node": self.devices_per_node,
            "inter_node_bytes_per_s": self.inter_node_bytes_per_s,
            "intra_node_latency_s": self.intra_node_latency_s,
            "inter_node_latency_s": self.inter_node_latency_s,
            "host_memory_bytes_per_s": self.host_memory_bytes_per_s,
            "host_memory_bytes": self.host_memory_bytes,
            "source": self.source,
            **({"profile": self.profile.name} if self.profile is not None else {}),
        }


_H100 = HardwareSpec(
    name="h100-sxm",
    description="NVIDIA H100 SXM5 80GB",
    peak_flops={"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12, "fp8": 1979e12},
    hbm_bytes_per_s=3.35e12,  # HBM3
    d2d_bytes_per_s=450e9,  # NVLink 4: 900 GB/s bidirectional
    host_bytes_per_s=64e9,  # PCIe Gen5 x16: 128 GB/s bidirectional
    memory_bytes=80 * _GB,  # datasheet: 80GB HBM
    launch_overhead_s=5e-6,
    devices_per_node=8,  # DGX / HGX H100: 8 GPUs on NVLink (NVSwitch)
    inter_node_bytes_per_s=50e9,  # one 400 Gb/s NDR InfiniBand ConnectX-7 port per GPU
    intra_node_latency_s=3e-6,  # NCCL ring step over NVLink, modelled
    inter_node_latency_s=8e-6,  # NCCL ring step over InfiniBand, modelled
    # DGX H100: 2 x Xeon Platinum 8480C, 8 channels of DDR5-4800 each (2 x 8 x 38.4 GB/s), 2 TB, for 8 GPUs
    host_memory_bytes_per_s=2 * 8 * 38.4 * _GB / 8,
    host_memory_bytes=2000 * _GB / 8,
    source=(
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column; dense = half the "
        "printed with-sparsity figures), https://resources.nvidia.com/en-us-tensor-core/"
        "nvidia-tensor-core-gpu-datasheet; node: NVIDIA DGX H100 datasheet (8 GPUs, 8 x 400 Gb/s "
        "ConnectX-7, 2 x Intel Xeon Platinum 8480C, 2 TB), https://resources.nvidia.com/en-us-dgx-systems/ai-enterprise-dgx; "
        "host memory bandwidth: Intel ARK, Xeon Platinum 8480+ (8 channels of DDR5-4800)"
    ),
)

HARDWARE: Mapping[str, HardwareSpec] = MappingProxyType({
    spec.name: spec
    for spec in (
        HardwareSpec(
            name="a100-80gb",
            description="NVIDIA A100 80GB SXM4",
            peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
            hbm_bytes_per_s=2.039e12,  # HBM2e
            d2d_bytes_per_s=300e9,  # NVLink 3: 600 GB/s bidirectional
            host_bytes_per_s=32e9,  # PCIe Gen4 x16: 64 GB/s bidirectional
            memory_bytes=80 * _GB,  # datasheet: 80GB HBM
            launch_overhead_s=5e-6,
            devices_per_node=8,  # DGX / HGX A100: 8 GPUs on NVLink (NVSwitch)
            inter_node_bytes_per_s=25e9,  # one 200 Gb/s HDR InfiniBand ConnectX-6 port per GPU
            intra_node_latency_s=3e-6,
            inter_node_latency_s=8e-6,
            # DGX A100: 2 x AMD EPYC 7742, 8 channels of DDR4-3200 each (2 x 8 x 25.6 GB/s), 1 TB, for 8 GPUs
            host_memory_bytes_per_s=2 * 8 * 25.6 * _GB / 8,
            host_memory_bytes=1000 * _GB / 8,
            source=(
                "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4), "
                "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf; node: NVIDIA DGX A100 datasheet "
                "(8 GPUs, 8 x 200 Gb/s ConnectX-6, 2 x AMD EPYC 7742, 1 TB); host memory bandwidth: AMD EPYC 7742 "
                "product page (8 channels of DDR4-3200)"
            ),
        ),
        _H100,
        # the same Hopper compute, links and launch cost as the H100 SXM; more and faster memory
        dataclasses.replace(
            _H100,
            name="h200",
            description="NVIDIA H200 SXM 141GB",
            hbm_bytes_per_s=4.8e12,  # HBM3e
            memory_bytes=141 * _GB,  # datasheet: 141GB HBM3e
            source=(
                "NVIDIA H200 Tensor Core GPU datasheet / product page (H200 SXM column; dense = "
                "half the with-sparsity figures), https://www.nvidia.com/en-us/data-center/h200/; node and host "
                "as the DGX H100 (the DGX H200 has the same 2 x Xeon Platinum 8480C and 2 TB)"
            ),
        ),
        HardwareSpec(
            name="cpu",
            description="generic modest CPU: 8 cores, AVX2 FMA, 3.0 GHz, dual-channel DDR4-3200",
            # 8 cores x 3.0 GHz x 2 FMA units x 8 fp32 lanes x 2 flops/FMA = 768 GFLOP/s;
            # no bf16/fp16 matrix units, so low precision runs at the fp32 rate.
            peak_flops={"fp32": 768e9, "bf16": 768e9, "fp16": 768e9},
            hbm_bytes_per_s=51.2e9,  # 2 channels x 25.6 GB/s (DDR4-3200)
            d2d_bytes_per_s=10e9,  # process-to-process copy through shared memory (gloo), modelled
            host_bytes_per_s=51.2e9,  # host memory is device memory
            memory_bytes=32 * _GB,  # modelled 32 GB of host memory
            launch_overhead_s=10e-6,  # PyTorch eager dispatch per op on CPU
            host_memory_bytes_per_s=51.2e9,  # the host is the device
            host_memory_bytes=32 * _GB,
            source=(
                "derived profile, not a single datasheet: peak = cores x clock x 2 FMA x 8 lanes x 2; "
                "bandwidth = JEDEC DDR4-3200 (25.6 GB/s per channel) x 2 channels"
            ),
        ),
    )
})


def list_hardware() -> list[str]:
    """Known hardware names, sorted (datasheet specs; see :func:`get_hardware` for profiles)."""
    return sorted(HARDWARE)


def datasheet_spec(name: str | HardwareSpec) -> HardwareSpec:
    """The datasheet spec named ``name`` (case-insensitive); a :class:`HardwareSpec` is returned as is.

    Raises
    ------
    InputError
        If ``name`` is not in :data:`HARDWARE` (the message lists the known names).
    """
    if isinstance(name, HardwareSpec):
        return name
    key = str(name).strip().lower()
    if key not in HARDWARE:
        raise InputError(f"unknown datasheet hardware {name!r}; known hardware: {', '.join(sorted(HARDWARE))}")
    return HARDWARE[key]


# ----------------------------------------------------------------------------- loading a spec from a file
#: Ranges of the spec fields read from a file (the ``base`` of an ``fxpipe.hwprofile/1`` profile):
#: name -> (low, high, low excluded). A field not listed is checked by its unit suffix
#: (:func:`fxpipe.io.check_number`: finite, >= 0, at most the unit's bound); a mapping of numbers
#: (``peak_flops``, per-op-family factors) entry by entry.
SPEC_RANGES: Mapping[str, tuple[float, float, bool]] = MappingProxyType({
    "hbm_bytes_per_s": (0.0, 1e18, True), "d2d_bytes_per_s": (0.0, 1e18, True), "host_bytes_per_s": (0.0, 1e18, True),
    "memory_bytes": (0.0, 1e18, True), "launch_overhead_s": (0.0, 1.0, False),
    "intra_node_latency_s": (0.0, 1.0, False), "inter_node_latency_s": (0.0, 1.0, False),
    "devices_per_node": (1.0, 1e6, False), "peak_flops": (0.0, 1e21, True),
})
_TEXT_FIELDS = ("name", "description", "source")


def spec_from_dict(doc: Mapping[str, Any], *, source: str = "hardware spec") -> HardwareSpec:
    """A :class:`HardwareSpec` from its :meth:`HardwareSpec.to_dict` form, every field checked by unit and range.

    The one validation of hardware specs read from files (the ``base`` of an ``fxpipe.hwprofile/1``
    profile). Bandwidths, the memory capacity and the peaks must be finite and > 0 (peaks up to
    1e21 FLOP/s, bandwidths and capacities up to 1e18), the launch overhead and latencies in
    [0, 1] s, ``devices_per_node`` an integer >= 1; ``peak_flops`` must hold ``"fp32"`` (the
    fallback of every other dtype). Fields added later are checked by their unit suffix
    (``*_s``, ``*_bytes``, ``*_bytes_per_s``, ``*_flops``: finite, >= 0, the unit's bound); a
    field of numbers by dtype or op family entry by entry (texts in such a field, e.g. sources,
    are kept). Unknown keys are ignored.

    Parameters
    ----------
    doc : Mapping
        The spec as plain data.
    source : str
        The file (and place in it) named by error messages.

    Returns
    -------
    HardwareSpec

    Raises
    ------
    InputError
        For a missing required field, a value of the wrong type, NaN, infinity or a value outside
        its range; the message names ``source``, the field and the allowed range.
    """
    if not isinstance(doc, Mapping):
        raise InputError(f"{source}: a hardware spec must be an object of fields, got {type(doc).__name__}")
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(HardwareSpec):
        if f.name == "profile" or f.name not in doc:
            if f.name != "profile" and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                if f.name != "description":
                    raise InputError(f"{source}: the hardware spec lacks the required field {f.name!r}")
                kw[f.name] = ""
            continue
        value = doc[f.name]
        low, high, low_open = SPEC_RANGES.get(f.name, (0.0, None, False))
        if f.name in _TEXT_FIELDS:
            if not isinstance(value, str):
                raise InputError(f"{source}: field {f.name!r} is {value!r:.80}, allowed: a string")
            kw[f.name] = value
        elif isinstance(value, Mapping):  # numbers by dtype or op family (checked each), or texts (their sources)
            kw[f.name] = {str(k): v if isinstance(v, str) else
                          check_number(v, f"{f.name}[{k!r}]", low=low, high=high, low_open=low_open, where=source)
                          for k, v in value.items()}
        else:
            x = check_number(value, f.name, low=low, high=high, low_open=low_open, where=source)
            if f.type in (int, "int"):
                if not x.is_integer():
                    raise InputError(f"{source}: field {f.name!r} is {x:g}, allowed: an integer >= {low:g}")
                x = int(x)
            kw[f.name] = x
    if "fp32" not in kw["peak_flops"]:
        raise InputError(f"{source}: field 'peak_flops' has no 'fp32' entry ({sorted(kw['peak_flops'])}), allowed: "
                         "an object of dtype -> FLOP/s holding 'fp32' (every dtype it lacks runs at the fp32 peak)")
    return HardwareSpec(**kw)
