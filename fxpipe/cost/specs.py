"""Hardware specifications as data: :class:`HardwareSpec` and the datasheet table.

The leaf of :mod:`fxpipe.cost`: the roofline, the calibration, the cost pass and the profiler
read specs from here; :mod:`fxpipe.cost.hardware` resolves the names users pass (datasheet
names, shipped and measured profiles) and re-exports everything of this module. Units and
sources: see :mod:`fxpipe.cost.hardware`.

Two kinds of spec per GPU. ``"<gpu>-datasheet"`` (e.g. ``"h100-sxm-datasheet"``) is the plain
datasheet roofline: every rate as printed, no efficiency; what lower bounds use (no real kernel
beats it). ``"<gpu>"`` (``"h100-sxm"``, ``"h200"``, ``"a100-80gb"``) is the same device with the
*achieved* efficiency of each op family and link (:attr:`HardwareSpec.efficiency`): the fraction
of the datasheet rate measured kernels and NCCL collectives reach, each number with its source
(:attr:`HardwareSpec.efficiency_sources`); what predictions use. How each factor was derived:
:data:`EFFICIENCY_DERIVATION`.
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

#: Op families with an achieved efficiency: the cost pass divides an op's roofline time by its
#: family's (:func:`fxpipe.passes.op_families.efficiency_family` sorts ops into them).
COMPUTE_FAMILIES = ("matmul", "attention", "elementwise", "reduction", "embedding")
#: Collective kinds inside a node (NVLink); ``p2p`` is a pipeline stage's send / receive.
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "p2p")
#: Every key :attr:`HardwareSpec.efficiency` may hold: compute families, intra-node collectives,
#: ``inter_node`` (every collective over the network, per NIC) and ``host_copy`` (pinned PCIe copies).
EFFICIENCY_FAMILIES = COMPUTE_FAMILIES + COLLECTIVES + ("inter_node", "host_copy")
#: The largest achieved efficiency a spec may state (an efficiency lies in (0, EFFICIENCY_MAX]).
EFFICIENCY_MAX = 1.5

#: The project's H100 run: README "On a real GPU", ``benchmarks/bench_gpu_profile.py``, 2026-11-26,
#: torch 2.11.0+cu130; its figures are recorded in ``benchmarks/data/h100_llama_steps.json``.
_RUN = "fxpipe's H100 80GB HBM3 run (benchmarks/bench_gpu_profile.py, 2026-11-26; benchmarks/data/h100_llama_steps.json)"
_NCCL_212 = "S. Jeaugey (NCCL), github.com/NVIDIA/nccl-tests/issues/212 (2024-05-06)"
_MAMF = ("S. Bekman, Machine Learning Engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS "
         "comparison table' (github.com/stas00/ml-engineering)")
_CARRIED = "carried over from the H100 (no measurement on this device yet): "

#: Derivation of every achieved efficiency of the H100 SXM (the other GPUs say what they carry over).
_H100_EFFICIENCY = {
    # 760 / 989.5
    "matmul": (0.768, f"{_RUN}: a bf16 8192^3 matmul sustains 760 of 989.5 TFLOP/s (back to back, as in a step). "
                      f"Cross-check: {_MAMF}: H100 SXM 794.5 of 989 TFLOP/s (80.3%), the best shape of a sweep. The "
                      "same run's per-op profiler timed the Llama layers' matmuls at 1.17x the roofline (0.855), each "
                      "op alone between synchronisations, where clocks recover"),
    # 1 / 3.4
    "attention": (0.294, f"{_RUN}: torch SDPA of the captured Llama layers (explicit causal mask: the memory-efficient "
                         "kernel over the full S x S), forward + backward, 4096 tokens, head dim 128: 3.4x the "
                         "roofline. Cross-check: FlashAttention-3 paper (Shah et al., arXiv 2407.08608) Fig. 5-6: "
                         "FlashAttention-2 on H100 SXM5, head dim 128, 4k, non-causal: 368 TFLOP/s forward, 310 "
                         "backward, i.e. 0.328 for F + 2.5 F (FlashAttention-2 paper, Dao 2023, Sec. 4.1: up to 335 "
                         "TFLOP/s forward + backward on H100, Fig. 7)"),
    # 1 / 1.44
    "elementwise": (0.694, f"{_RUN}: the Llama layers' elementwise ops (mul, add, casts, silu, rotary), forward + "
                           "backward, per-op CUDA events: 1.44x the roofline; a 4 GiB device copy reaches 2.99 of "
                           "3.35 TB/s (0.89), smaller and strided kernels less"),
    "reduction": (0.694, f"{_RUN}: no figure of its own (RMS-norm means and the loss' sum were timed with the "
                         "elementwise ops); taken equal to elementwise, one memory-bound pass over the input"),
    # 1 / 2.7
    "embedding": (0.370, f"{_RUN}: the token embedding (gather forward, sort + index-add weight gradient): 2.7x the "
                         "roofline"),
    # 370 / 450
    "p2p": (0.822, f"{_NCCL_212}: NVLink 4's 450 GB/s line rate less NCCL's ~20% protocol overhead: ~370 GB/s, the bus "
                   "bandwidth of every collective but all-reduce"),
    "all_gather": (0.822, f"{_NCCL_212}: ~370 of 450 GB/s bus bandwidth"),
    "reduce_scatter": (0.822, f"{_NCCL_212}: ~370 of 450 GB/s bus bandwidth"),
    # 370 / 450 (NCCL_ALGO=Ring); NVLink SHARP's 480 holds on 8 GPUs only
    "all_reduce": (0.822, f"{_NCCL_212}: ~370 of 450 GB/s bus bandwidth, as the other collectives (all-reduce "
                          "with NCCL_ALGO=RING). All-reduce on NVLink SHARP (NVLS) reaches a peak bus bandwidth of "
                          "~480 GB/s (1.067) on 8 GPUs with messages of 1 GB and more (256 MB is too small), its algorithm "
                          "bandwidth ~275 GB/s. That does not grow with the group (each GPU sends and receives the whole "
                          "message through the switch), so under the ring formula 2 (k-1)/k that fxpipe prices every "
                          "group with, NVLS gives ~275 GB/s of bus bandwidth on 2 GPUs (below the ring's 370: NCCL takes "
                          "the ring), ~412 on 4, ~481 on 8 (derived, not measured). The ring's figure holds on every "
                          "group size; on 8 GPUs with large messages the prediction is up to 1.3x pessimistic"),
    # 47 / 50
    "inter_node": (0.940, "NVIDIA, github.com/NVIDIA/nccl-tests/issues/290 (2025-03-03): NDR 400 Gb/s: 46-48 GB/s "
                          "bus bandwidth per NIC"),
    # 54.5 / 64
    "host_copy": (0.852, f"{_RUN}: pinned host -> device 54.5 GB/s, device -> host 54.9 GB/s of PCIe Gen5 x16's 64"),
}


def _efficiency(table, **overrides) -> dict:
    """``efficiency=`` and ``efficiency_sources=`` of a spec from ``{family: (value, source)}`` (``overrides`` replace entries)."""
    table = {**table, **overrides}
    return {"efficiency": {k: v for k, (v, _) in table.items()}, "efficiency_sources": {k: s for k, (_, s) in table.items()}}


_H200_EFFICIENCY = {
    **{k: (v, _CARRIED + src) for k, (v, src) in _H100_EFFICIENCY.items()},
    # the H100's ring figure (the same NVLink 4); NVLS's 475 holds on 8 GPUs only
    "all_reduce": (0.822, _CARRIED + _H100_EFFICIENCY["all_reduce"][1] + ". On the H200: github.com/NVIDIA/nccl-tests/"
                          "issues/272 (2024-11-27), all_reduce_perf on 8 H200 over NVLink 4 (NVLS): peak bus bandwidth "
                          "475 GB/s at 4 GB messages (1.056), the same 8-GPU NVLS peak"),
}
_A100_NVLINK = ("S. Jeaugey (NCCL), github.com/NVIDIA/nccl-tests/issues/149 (2023-07-05): A100's 12 NVLinks of 25 GB/s "
                "per direction give ~20 GB/s each with NCCL's 128 B payloads, 240 GB/s, and other bottlenecks of the "
                "GPU limit it to ~230 GB/s bus bandwidth (at 8 GB messages): 230 / 300 = 0.767 (users of that issue "
                "and of issue 178 measured 200-208 GB/s, 0.67-0.69). No NVLink SHARP on the A100: all-reduce the "
                "same")
_A100_EFFICIENCY = {
    **{k: (v, _CARRIED + src) for k, (v, src) in _H100_EFFICIENCY.items()
       if k in ("elementwise", "reduction", "embedding", "host_copy")},
    # 271.2 / 312
    "matmul": (0.869, f"{_MAMF}: A100 SXM 271.2 of 312 TFLOP/s (86.9%, torch 2.6.0+cu126), the best shape of a sweep "
                      "(on the H100 the project's sustained 8192^3 product ran 4% below that table's figure)"),
    "attention": (0.330, "FlashAttention-2 paper (Dao 2023, arXiv 2307.08691) Sec. 1 and 4.1, Fig. 4-6 (A100 80GB "
                         "SXM4): FlashAttention-2 reaches up to 73% of peak forward and 63% backward, i.e. 0.655 for "
                         "F + 2.5 F, and is ~2x faster than xformers' cutlass kernel, which is torch SDPA's "
                         "memory-efficient kernel that the captured graphs' explicit masks select: 0.33"),
    # 230 / 300
    "p2p": (0.767, _A100_NVLINK), "all_gather": (0.767, _A100_NVLINK), "reduce_scatter": (0.767, _A100_NVLINK),
    "all_reduce": (0.767, _A100_NVLINK),
    # 24 / 25
    "inter_node": (0.96, "S. Jeaugey (NCCL), github.com/NVIDIA/nccl/issues/412 (2023-04-24): 24 GB/s bus bandwidth "
                         "inter-node on 200 Gb/s HDR"),
}

#: How the achieved efficiencies were derived, per GPU and family: ``{spec name: {family: source}}``.
EFFICIENCY_DERIVATION = {
    "h100-sxm": {k: src for k, (_, src) in _H100_EFFICIENCY.items()},
    "h200": {k: src for k, (_, src) in _H200_EFFICIENCY.items()},
    "a100-80gb": {k: src for k, (_, src) in _A100_EFFICIENCY.items()},
}


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
    efficiency : Mapping[str, float]
        Achieved fraction of the datasheet rate per op family and link (:data:`EFFICIENCY_FAMILIES`),
        in (0, 1.5]: the roofline time of an op of family ``f`` is divided by ``efficiency[f]``, a
        collective's or copy's bandwidth multiplied by it. A family missing here runs at the
        datasheet rate (1.0); an empty mapping is the plain datasheet roofline.
    efficiency_sources : Mapping[str, str]
        Where each efficiency comes from (measurement, paper and table, issue thread).
    memory_datasheet_bytes : float
        The datasheet's capacity ("80GB" = 80e9 bytes), for the record; ``memory_bytes`` is what
        CUDA exposes (``torch.cuda.get_device_properties().total_memory``), which plans use.
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
    efficiency: Mapping[str, float] = field(default_factory=dict, repr=False)
    efficiency_sources: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    memory_datasheet_bytes: float = field(default=0.0, repr=False)
    profile: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        eff = {str(k): float(v) for k, v in dict(self.efficiency).items()}
        bad = {k: v for k, v in eff.items() if k not in EFFICIENCY_FAMILIES or not 0.0 < v <= EFFICIENCY_MAX}
        if bad:
            raise InputError(f"hardware {self.name!r}: efficiency {bad} is not a family of {', '.join(EFFICIENCY_FAMILIES)} "
                             f"with a value in (0, {EFFICIENCY_MAX:g}]")
        object.__setattr__(self, "efficiency", MappingProxyType(eff))
        object.__setattr__(self, "efficiency_sources", MappingProxyType(dict(self.efficiency_sources)))

    def peak(self, dtype_name: str) -> float:
        """Dense peak FLOP/s for a compute dtype name (falls back to ``"fp32"``)."""
        return float(self.peak_flops.get(dtype_name, self.peak_flops["fp32"]))

    def efficiency_of(self, family: str) -> float:
        """Achieved fraction of the datasheet rate of one op family or link (1.0 when the spec names none).

        Raises
        ------
        KeyError
            If ``family`` is not in :data:`EFFICIENCY_FAMILIES`.
        """
        if family not in EFFICIENCY_FAMILIES:
            raise KeyError(f"unknown efficiency family {family!r}; families: {', '.join(EFFICIENCY_FAMILIES)}")
        return float(self.efficiency.get(family, 1.0))

    @property
    def p2p_bytes_per_s(self) -> float:
        """Achieved stage-to-stage (NCCL send/recv over ``d2d``) bandwidth, bytes/s: ``d2d x efficiency["p2p"]``."""
        return float(self.d2d_bytes_per_s) * self.efficiency_of("p2p")

    @property
    def host_copy_bytes_per_s(self) -> float:
        """Achieved pinned host <-> device copy bandwidth (offload / reload), bytes/s: ``host x efficiency["host_copy"]``."""
        return float(self.host_bytes_per_s) * self.efficiency_of("host_copy")

    def datasheet(self) -> "HardwareSpec":
        """This spec as the plain datasheet roofline: no efficiency (every family at 1.0), name ``<name>-datasheet``.

        The capacity stays ``memory_bytes`` (what the device exposes): a lower bound must not assume
        less memory than there is.
        """
        if not self.efficiency:
            return self
        return dataclasses.replace(self, name=f"{self.name}-datasheet", efficiency={}, efficiency_sources={},
                                   description=f"{self.description} (datasheet roofline)", profile=None)

    def topology(self) -> dict[str, Any]:
        """The links of a cluster of these devices as plain data (:class:`fxpipe.mesh.Topology`'s fields):
        ``devices_per_node``, ``intra_node_bytes_per_s`` (= ``d2d_bytes_per_s``),
        ``inter_node_bytes_per_s`` (0: unknown, taken as intra-node), the two latencies, and the
        achieved fraction of each link's rate per collective kind (``intra_node_efficiency``:
        ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``p2p``; ``inter_node_efficiency``: one
        figure, NCCL's bus bandwidth per NIC); the datasheet spec has none (every kind at the line rate)."""
        doc: dict[str, Any] = {"devices_per_node": int(self.devices_per_node),
                               "intra_node_bytes_per_s": float(self.d2d_bytes_per_s),
                               "inter_node_bytes_per_s": float(self.inter_node_bytes_per_s or self.d2d_bytes_per_s),
                               "intra_node_latency_s": float(self.intra_node_latency_s),
                               "inter_node_latency_s": float(self.inter_node_latency_s)}
        intra = {k: float(self.efficiency[k]) for k in COLLECTIVES if k in self.efficiency}
        if intra:
            doc["intra_node_efficiency"] = intra
        if "inter_node" in self.efficiency and self.inter_node_bytes_per_s > 0:
            doc["inter_node_efficiency"] = float(self.efficiency["inter_node"])
        return doc

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
            **({"efficiency": dict(self.efficiency), "efficiency_sources": dict(self.efficiency_sources)}
               if self.efficiency else {}),
            **({"memory_datasheet_bytes": self.memory_datasheet_bytes} if self.memory_datasheet_bytes else {}),
            **({"profile": self.profile.name} if self.profile is not None else {}),
        }


_H100 = HardwareSpec(
    name="h100-sxm",
    description="NVIDIA H100 SXM5 80GB",
    peak_flops={"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12, "fp8": 1979e12},
    hbm_bytes_per_s=3.35e12,  # HBM3
    d2d_bytes_per_s=450e9,  # NVLink 4: 900 GB/s bidirectional
    host_bytes_per_s=64e9,  # PCIe Gen5 x16: 128 GB/s bidirectional
    # what CUDA exposes (torch.cuda.get_device_properties().total_memory), measured by fxpipe's H100 run;
    # the datasheet's "80GB" is 80e9 bytes
    memory_bytes=85.02 * _GB,
    memory_datasheet_bytes=80 * _GB,
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
        "host memory bandwidth: Intel ARK, Xeon Platinum 8480+ (8 channels of DDR5-4800); capacity: total_memory "
        "85.02 GB measured by fxpipe's H100 run (datasheet 80GB); achieved efficiencies: efficiency_sources"
    ),
    **_efficiency(_H100_EFFICIENCY),
)

_SPECS = (
        HardwareSpec(
            name="a100-80gb",
            description="NVIDIA A100 80GB SXM4",
            peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
            hbm_bytes_per_s=2.039e12,  # HBM2e
            d2d_bytes_per_s=300e9,  # NVLink 3: 600 GB/s bidirectional
            host_bytes_per_s=32e9,  # PCIe Gen4 x16: 64 GB/s bidirectional
            # what CUDA exposes: 81049 MiB (a published A100 80GB report, github.com/ekondis/mixbench/issues/47;
            # the PCIe card, the same 80 GB of HBM2e); the datasheet's "80GB" is 80e9 bytes
            memory_bytes=81049 * 2 ** 20,
            memory_datasheet_bytes=80 * _GB,
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
                "product page (8 channels of DDR4-3200); capacity: total_memory 81049 MiB as reported for an A100 "
                "80GB (github.com/ekondis/mixbench/issues/47; datasheet 80GB); achieved efficiencies: efficiency_sources"
            ),
            **_efficiency(_A100_EFFICIENCY),
        ),
        _H100,
        # the same Hopper compute, links and launch cost as the H100 SXM; more and faster memory
        dataclasses.replace(
            _H100,
            name="h200",
            description="NVIDIA H200 SXM 141GB",
            hbm_bytes_per_s=4.8e12,  # HBM3e
            # what CUDA exposes, measured by fxpipe's H200 run; the datasheet's "141GB" is 141e9 bytes
            memory_bytes=150.11 * _GB,
            memory_datasheet_bytes=141 * _GB,
            source=(
                "NVIDIA H200 Tensor Core GPU datasheet / product page (H200 SXM column; dense = "
                "half the with-sparsity figures), https://www.nvidia.com/en-us/data-center/h200/; node and host "
                "as the DGX H100 (the DGX H200 has the same 2 x Xeon Platinum 8480C and 2 TB); capacity: "
                "total_memory 150.11 GB measured by fxpipe's H200 run (datasheet 141GB); achieved efficiencies: "
                "efficiency_sources"
            ),
            **_efficiency(_H200_EFFICIENCY),
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

#: Every known spec by name: each GPU with its achieved efficiencies (``"h100-sxm"``, what predictions
#: use) and as the plain datasheet roofline (``"h100-sxm-datasheet"``, what bounds use); ``"cpu"``.
HARDWARE: Mapping[str, HardwareSpec] = MappingProxyType({
    s.name: s for spec in _SPECS for s in ((spec, spec.datasheet()) if spec.efficiency else (spec,))
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
    "efficiency": (0.0, EFFICIENCY_MAX, True),
})
_TEXT_FIELDS = ("name", "description", "source")


def spec_from_dict(doc: Mapping[str, Any], *, source: str = "hardware spec") -> HardwareSpec:
    """A :class:`HardwareSpec` from its :meth:`HardwareSpec.to_dict` form, every field checked by unit and range.

    The one validation of hardware specs read from files (the ``base`` of an ``fxpipe.hwprofile/1``
    profile). Bandwidths, the memory capacity and the peaks must be finite and > 0 (peaks up to
    1e21 FLOP/s, bandwidths and capacities up to 1e18), the launch overhead and latencies in
    [0, 1] s, ``devices_per_node`` an integer >= 1, each ``efficiency`` in (0, 1.5] and of a family
    of :data:`EFFICIENCY_FAMILIES`; ``peak_flops`` must hold ``"fp32"`` (the fallback of every
    other dtype). Fields added later are checked by their unit suffix
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
    try:
        return HardwareSpec(**kw)
    except InputError as exc:  # a field checked by the spec itself (an efficiency of an unknown family)
        raise InputError(f"{source}: {exc}") from None
