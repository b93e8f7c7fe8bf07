"""What a mesh costs: its links (:class:`Topology`), data-parallel synchronisation, the host's
optimizer step, and a pipeline's predicted step on the mesh (torch-free, plain data).

The mesh itself (dimensions, rank order, :func:`~fxpipe.mesh.layout.rank_coords`) is
:mod:`fxpipe.mesh.layout`; every cost here reads the rank order from there, so the groups it
prices are exactly the ones the runtime (:mod:`fxpipe.codegen.mesh`) builds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from fxpipe.errors import InputError
from fxpipe.mesh.tensor_parallel import tensor_parallel_graph
from fxpipe.mesh.layout import dim_span, dim_strides, format_mesh, mesh_dp, mesh_rank_order, mesh_tp, normalize_rank_order

__all__ = [
    "pipeline_hops",
    "pipeline_link",
    "pipeline_graph",
    "mesh_memory",
    "dp_sync_time_s",
    "dp_sync_parts_s",
    "block_fsdp_parts_s",
    "pipeline_dp_sync_s",
    "pipeline_step_s",
    "host_links",
    "optimizer_host_step_s",
    "device_host_step_s",
    "device_num_params",
    "dp_links",
    "Topology",
    "COLLECTIVE_KINDS",
]

#: Collective kinds a :class:`Topology` has an achieved efficiency for (:data:`fxpipe.cost.specs.COLLECTIVES`).
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "p2p")


def mesh_memory(memory, mesh: Mapping[str, int]):
    """The :class:`~fxpipe.memory.MemoryModel` of one device of a mesh plan.

    By default (``memory.fsdp_units`` ``None`` or ``"stage"``) fxpipe wraps every pipeline stage as
    one FSDP2 unit and torch's pipelining runtime keeps a
    stage's parameters unsharded from its first compute action of the step to its
    ``REDUCE_GRAD`` (gradient sync is deferred to the step's end, so the unsharded gradients
    accumulate too): during the step a device holds its stages' full parameters and gradients
    and only the optimizer state is sharded over ``dp_shard``, i.e. ZeRO-1's memory. So a mesh
    with ``dp_shard > 1`` gives a memory model with ``zero_stage=1, data_parallel=dp_shard``
    unless ``memory`` already names ``data_parallel == dp_shard`` (kept as given). With
    ``memory.fsdp_units == "block"`` (one FSDP2 unit per repeated block, the rest of a stage its
    root unit, :mod:`fxpipe.memory.fsdp`; the runtime: :mod:`fxpipe.codegen.fsdp_blocks`) it is
    ``zero_stage=3``: weights, gradients and optimizer state sharded, plus the unsharded working set of
    the root and two blocks per stage. (The mesh search and a pinned mesh turn to them when
    ``fsdp_units`` is None and whole-stage units do not fit: :func:`fxpipe.mesh.search.block_units_allowed`.)
    ``dp_replicate`` shards nothing. (Not counted yet: the sharded copies of parameters and
    gradients, ``1 / dp_shard`` of each.) ``memory.offload_optimizer`` is kept: with ``True`` the
    sharded optimizer state is on the host, not the device.

    Raises
    ------
    InputError
        If ``memory.data_parallel`` is neither 1 nor ``dp_shard``.
    """
    ds = int(mesh.get("dp_shard", 1))
    if ds == 1:
        return memory
    if memory.data_parallel == ds:
        return memory
    if memory.data_parallel != 1:
        raise InputError(
            f"the memory model shards over data_parallel={memory.data_parallel} but mesh {format_mesh(mesh)} shards "
            f"over dp_shard={ds}: leave data_parallel at 1 (the mesh sets it) or make them equal"
        )
    return dataclasses.replace(memory, zero_stage=3 if memory.fsdp_units == "block" else 1, data_parallel=ds)


@dataclass(frozen=True)
class Topology:
    """The links data-parallel collectives run on: nodes of ``devices_per_node`` devices.

    Inside a node devices talk over ``intra_node_bytes_per_s`` links (NVLink), between nodes
    over ``inter_node_bytes_per_s`` per device (one InfiniBand NIC per GPU), each collective
    step costing the matching latency. Built from a hardware spec
    (:meth:`fxpipe.cost.specs.HardwareSpec.topology`, recorded in ``graph.meta["topology"]`` by
    the capture) or by hand; bandwidths in bytes/s per device and direction (line rates), latencies in s.

    ``intra_node_efficiency`` holds the fraction of the intra-node line rate NCCL achieves per
    collective kind (``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ``"p2p"``: the bus
    bandwidth of ``nccl-tests`` over the line rate; a missing kind: 1.0), ``inter_node_efficiency``
    the fraction of the inter-node rate (every kind; NCCL's bus bandwidth per NIC). The spec's
    sources: :data:`fxpipe.cost.specs.EFFICIENCY_DERIVATION`.
    """

    devices_per_node: int
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    intra_node_latency_s: float = 0.0
    inter_node_latency_s: float = 0.0
    intra_node_efficiency: Mapping[str, float] = field(default_factory=dict)
    inter_node_efficiency: float = 1.0

    def __post_init__(self) -> None:
        if int(self.devices_per_node) < 1:
            raise InputError(f"devices_per_node must be >= 1, got {self.devices_per_node!r}")
        for name in ("intra_node_bytes_per_s", "inter_node_bytes_per_s"):
            if not float(getattr(self, name)) > 0:
                raise InputError(f"{name} must be > 0, got {getattr(self, name)!r}")
        eff = {str(k): float(v) for k, v in dict(self.intra_node_efficiency or {}).items()}
        bad = {k: v for k, v in eff.items() if k not in COLLECTIVE_KINDS or not 0.0 < v <= 1.5}
        if bad or not 0.0 < float(self.inter_node_efficiency) <= 1.5:
            raise InputError(f"topology efficiencies must be in (0, 1.5] for the kinds {', '.join(COLLECTIVE_KINDS)}; got "
                             f"intra_node_efficiency={eff}, inter_node_efficiency={self.inter_node_efficiency!r}")
        object.__setattr__(self, "intra_node_efficiency", MappingProxyType(eff))

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "Topology":
        """From :meth:`to_dict`'s plain data (e.g. ``graph.meta["topology"]``)."""
        return cls(int(doc["devices_per_node"]), float(doc["intra_node_bytes_per_s"]),
                   float(doc["inter_node_bytes_per_s"]), float(doc.get("intra_node_latency_s", 0.0)),
                   float(doc.get("inter_node_latency_s", 0.0)), dict(doc.get("intra_node_efficiency") or {}),
                   float(doc.get("inter_node_efficiency", 1.0)))

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "devices_per_node": int(self.devices_per_node), "intra_node_bytes_per_s": float(self.intra_node_bytes_per_s),
            "inter_node_bytes_per_s": float(self.inter_node_bytes_per_s),
            "intra_node_latency_s": float(self.intra_node_latency_s),
            "inter_node_latency_s": float(self.inter_node_latency_s)}
        if self.intra_node_efficiency:
            doc["intra_node_efficiency"] = dict(self.intra_node_efficiency)
        if self.inter_node_efficiency != 1.0:
            doc["inter_node_efficiency"] = float(self.inter_node_efficiency)
        return doc

    def achieved(self, kind: str | None, *, inter_node: bool) -> float:
        """Fraction of the line rate a collective of ``kind`` achieves on the intra- or inter-node link (1.0 for ``None``)."""
        if kind is None:
            return 1.0
        return float(self.inter_node_efficiency) if inter_node else float(self.intra_node_efficiency.get(kind, 1.0))

    @classmethod
    def of_graph(cls, graph) -> "Topology | None":
        """The topology recorded with a captured graph, or ``None`` (one bandwidth: the graph's)."""
        doc = (getattr(graph, "meta", None) or {}).get("topology")
        return None if not doc else cls.from_dict(doc)

    def in_node(self, stride: int, size: int, world: int | None = None) -> bool:
        """Whether every group of ``size`` ranks ``stride`` apart lies inside one node.

        Ranks are numbered node by node (``rank // devices_per_node`` is the node). A mesh
        dimension's groups are the arithmetic progressions ``base, base + stride, ...`` of
        ``size`` ranks (row-major numbering, :func:`rank_coords`), each inside one node when its
        first and last rank share it. ``world``: the job's ranks (default: ``stride * size``
        rounded up to whole nodes); a job smaller than a node has all its groups inside it.
        """
        stride, size = int(stride), int(size)
        if size <= 1:
            return True
        g = int(self.devices_per_node)
        span = stride * size
        world = int(world) if world is not None else -(-span // g) * g
        for base in range(world):
            if (base // stride) % size:  # not the first member of its group
                continue
            last = base + (size - 1) * stride
            if last >= world:
                break
            if base // g != last // g:
                return False
        return True

    def link(self, stride: int, size: int, world: int | None = None, kind: str | None = None) -> tuple[float, float]:
        """``(bandwidth_bytes_per_s, latency_s)`` of a collective over a mesh dimension's groups.

        Parameters
        ----------
        stride, size : int
            The dimension's groups: ``size`` ranks ``stride`` apart.
        world : int, optional
            The job's ranks (see :meth:`in_node`).
        kind : str, optional
            The collective (:data:`COLLECTIVE_KINDS`): its achieved bandwidth (line rate x
            :meth:`achieved`); ``None``: the line rate.

        Returns
        -------
        (float, float)
            The intra-node link when every group stays inside a node, else the inter-node one
            (a ring runs at its slowest link).
        """
        if self.in_node(stride, size, world):
            return (float(self.intra_node_bytes_per_s) * self.achieved(kind, inter_node=False),
                    float(self.intra_node_latency_s))
        return float(self.inter_node_bytes_per_s) * self.achieved(kind, inter_node=True), float(self.inter_node_latency_s)


def dp_links(mesh: Mapping[str, int], bandwidth_bytes_per_s: float, latency_s: float = 0.0,
             topology: Topology | None = None, order: Any = None, kind: str | None = None) -> dict[str, tuple[float, float]]:
    """``{"dp_shard": (bandwidth, latency), "dp_replicate": (...)}`` the data-parallel groups use.

    Parameters
    ----------
    mesh : Mapping[str, int]
        The plan's mesh (``pp``, ``dp_shard``, ``dp_replicate``).
    bandwidth_bytes_per_s, latency_s : float
        The one link (bytes/s per rank, seconds per step) without a topology.
    topology : Topology, optional
        With one, a dimension's groups are :func:`dim_span` of the rank order apart (default
        order: ``pp`` ranks for ``dp_shard``, ``pp * dp_shard`` for ``dp_replicate``) in a job of
        ``pp * dp_shard * dp_replicate`` ranks and use :meth:`Topology.link`.
    order : sequence of str, optional
        The rank order (:func:`normalize_rank_order`; default the mesh's ``"order"``, else
        :data:`MESH_DIMS`).
    kind : str, optional
        The collective (:data:`COLLECTIVE_KINDS`) whose achieved bandwidth a topology gives
        (:meth:`Topology.link`); ``None``: the line rates.

    Returns
    -------
    dict[str, tuple[float, float]]
        ``(bandwidth_bytes_per_s, latency_s)`` per data-parallel dimension.
    """
    pp, s, r = int(mesh.get("pp", 1)), int(mesh.get("dp_shard", 1)), int(mesh.get("dp_replicate", 1))
    if topology is None:
        return {"dp_shard": (float(bandwidth_bytes_per_s), float(latency_s)),
                "dp_replicate": (float(bandwidth_bytes_per_s), float(latency_s))}
    order = mesh_rank_order(mesh) if order is None else order
    world = pp * s * r * mesh_tp(mesh)  # tensor parallelism innermost: the data-parallel groups are tp times wider apart
    return {d: topology.link(*dim_span(mesh, d, order), world, kind) for d in ("dp_shard", "dp_replicate")}


def pipeline_hops(mesh: Mapping[str, int], topology: Topology, order: Any = None) -> tuple[int, int]:
    """``(crossing, total)``: the pipelines' hops between consecutive pipeline ranks, and how many cross nodes.

    Every replica's pipeline rank ``k`` sends to ``k + 1`` (:func:`~fxpipe.mesh.layout.rank_of`); a hop crosses
    nodes when the two ranks' nodes (``rank // devices_per_node``) differ. Pipeline rank
    innermost (the default order) keeps a pipeline of at most ``devices_per_node`` ranks inside a
    node; ``pp`` outermost puts consecutive pipeline ranks ``dp`` ranks apart, every hop across
    nodes once ``dp >= devices_per_node``. (The wrap-around hop of an interleaved or V
    placement, last device to first, is not counted.)
    """
    order = mesh_rank_order(mesh) if order is None else order
    g, pp = int(topology.devices_per_node), int(mesh["pp"])
    strides, ds = dim_strides(mesh, order), int(mesh.get("dp_shard", 1))
    crossing = total = 0
    for replica in range(mesh_dp(mesh)):
        i, j = divmod(replica, ds)  # rank_of's arithmetic, its strides taken once
        base = j * strides["dp_shard"] + i * strides["dp_replicate"]
        nodes = [(base + k * strides["pp"]) // g for k in range(pp)]
        total += pp - 1
        crossing += sum(a != b for a, b in zip(nodes, nodes[1:]))
    return crossing, total


def pipeline_link(mesh: Mapping[str, int], bandwidth_bytes_per_s: float, topology: Topology | None,
                  order: Any = None) -> float:
    """The bandwidth (bytes/s) the pipeline's point-to-point sends are costed at for this rank order.

    The partition and schedule cost every stage boundary at one bandwidth (the graph's, the
    intra-node link of a captured hardware). Without a topology, or when at most half of the
    pipelines' hops cross nodes (:func:`pipeline_hops`; e.g. pipeline rank innermost with ``pp``
    over ``devices_per_node``: one hop in ``devices_per_node`` crosses), that bandwidth; when
    most hops cross nodes (``pp`` outermost over ``dp >= devices_per_node`` ranks), the
    inter-node bandwidth as NCCL achieves it (the smaller of the two). A majority rule: a pipeline
    whose hops are mixed is costed at the link most of them use.
    """
    if topology is None or int(mesh["pp"]) < 2:
        return float(bandwidth_bytes_per_s)
    crossing, total = pipeline_hops(mesh, topology, order)
    if 2 * crossing <= total:
        return float(bandwidth_bytes_per_s)
    return min(float(bandwidth_bytes_per_s), float(topology.inter_node_bytes_per_s) * topology.achieved("p2p", inter_node=True))


def pipeline_graph(graph, mesh: Mapping[str, Any], order: Any = None):
    """The graph a mesh's pipeline is planned on: one tensor-parallel rank's costs, on the link its pipelines span.

    With ``tp > 1`` (:func:`fxpipe.mesh.layout.mesh_tp`) the graph of one tensor-parallel rank
    (:func:`fxpipe.mesh.tensor_parallel.tensor_parallel_graph`: the split ops' compute, activations,
    outputs and parameters divided by ``tp``, every split region's collectives on the node's links).
    The partition and the schedule cost every stage boundary at ``graph.bandwidth_bytes_per_s``
    (the intra-node link of a captured hardware). When the rank order makes most of the
    pipelines' hops cross nodes (:func:`pipeline_link`, e.g. ``pp`` outermost over
    ``dp >= devices_per_node`` ranks) that is the inter-node bandwidth; otherwise, and without a
    :class:`Topology`, the bandwidth is kept (and with ``tp = 1`` ``graph`` itself is returned). Plan a mesh's
    pipeline on this graph and keep it as the plan's graph (the partition's costs are checked against it on load).

    ``order``: the rank order (default the mesh's ``"order"`` entry, else pipeline rank innermost).
    """
    order = mesh_rank_order(mesh) if order is None else normalize_rank_order(order)
    graph = tensor_parallel_graph(graph, mesh_tp(mesh), Topology.of_graph(graph))
    bw = pipeline_link(mesh, graph.bandwidth_bytes_per_s, Topology.of_graph(graph), order)
    if bw == float(graph.bandwidth_bytes_per_s):
        return graph
    return dataclasses.replace(graph, bandwidth_bytes_per_s=bw)


def dp_sync_time_s(param_bytes: float, mesh: Mapping[str, int], bandwidth_bytes_per_s: float,
                   latency_s: float = 0.0, *, topology: Topology | None = None, order: Any = None) -> float:
    """Data-parallel communication of one device per optimizer step (seconds), not overlapped.

    What fxpipe's runtime does per step for a device whose stages hold ``param_bytes`` of
    parameters (gradients in the same dtype): with ``dp_shard = s > 1`` one all-gather of the
    parameters (a stage is unsharded once per step) and one reduce-scatter of the gradients
    over ``s`` ranks; with ``dp_replicate = r > 1`` one all-reduce over ``r`` ranks of the
    gradients (of their ``1 / s`` shard under HSDP). Ring collectives (Thakur, Rabenseifner and
    Gropp 2005): all-gather and reduce-scatter of ``n`` bytes over ``k`` ranks move
    ``(k - 1) / k * n`` bytes per rank, all-reduce twice that; each adds ``(k - 1) * latency``.
    With a topology each collective runs at the bandwidth NCCL achieves for its kind on the link
    (:meth:`Topology.link`: the bus bandwidth of ``nccl-tests``, which is defined so that these
    formulas hold).

    Parameters
    ----------
    param_bytes : float
        Parameter bytes of the device's stages.
    mesh : Mapping[str, int]
        The plan's mesh.
    bandwidth_bytes_per_s : float
        Per-rank link bandwidth of the data-parallel groups without a topology.
    latency_s : float
        Per-hop latency without a topology.
    topology : Topology, optional
        Nodes and their links: each dimension's groups run at the link they span
        (:func:`dp_links`; e.g. ``dp_shard`` inside a node on NVLink, ``dp_replicate`` across
        nodes on InfiniBand).
    order : sequence of str, optional
        The rank order (default the mesh's ``"order"``, else :data:`MESH_DIMS`).

    Returns
    -------
    float
        0 without data parallelism.
    """
    return sum(dp_sync_parts_s(param_bytes, mesh, bandwidth_bytes_per_s, latency_s, topology=topology, order=order))


def dp_sync_parts_s(param_bytes: float, mesh: Mapping[str, int], bandwidth_bytes_per_s: float,
                    latency_s: float = 0.0, *, topology: Topology | None = None,
                    order: Any = None) -> tuple[float, float]:
    """:func:`dp_sync_time_s` split into ``(gather_s, reduce_s)``: the parameters' all-gather before the
    step's first compute, and the gradients' reduce-scatter (+ all-reduce over ``dp_replicate``) after
    the last backward (same arguments and formulas)."""
    if topology is None and not bandwidth_bytes_per_s > 0:
        raise InputError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s!r}")
    def link(dim: str, kind: str) -> tuple[float, float]:
        return dp_links(mesh, bandwidth_bytes_per_s, latency_s, topology, order, kind)[dim]

    s, r = int(mesh.get("dp_shard", 1)), int(mesh.get("dp_replicate", 1))
    gather = reduce = 0.0
    if s > 1:  # all-gather of the parameters, reduce-scatter of the gradients
        bw, lat = link("dp_shard", "all_gather")
        gather = (s - 1) / s * param_bytes / bw + (s - 1) * lat
        bw, lat = link("dp_shard", "reduce_scatter")
        reduce = (s - 1) / s * param_bytes / bw + (s - 1) * lat
    if r > 1:  # all-reduce of the gradients (their shard under HSDP)
        bw, lat = link("dp_replicate", "all_reduce")
        reduce += 2 * (r - 1) / r * (param_bytes / s) / bw + 2 * (r - 1) * lat
    return gather, reduce


def _per_device(assignment, device_of_stage, pp: int, per_node):
    """The sum of ``per_node`` (one value per graph node) over every pipeline device's stages (numpy array of ``pp``)."""
    import numpy as np

    dev = np.asarray(device_of_stage, dtype=np.int64)[np.asarray(assignment, dtype=np.int64)]
    return np.bincount(dev, weights=per_node, minlength=int(pp))


def _device_param_bytes(graph, assignment, device_of_stage, pp: int):
    """Parameter bytes of every pipeline device's stages (numpy array of ``pp``)."""
    return _per_device(assignment, device_of_stage, pp, graph.size_param_bytes)


def _block_units_of(memory, mesh: Mapping[str, int]) -> bool:
    """Whether ``memory`` (a device's :class:`~fxpipe.memory.MemoryModel`, or None) runs per-block FSDP2 units on ``mesh``."""
    return bool(getattr(memory, "block_units", False)) and int(mesh.get("dp_shard", 1)) > 1


def pipeline_dp_sync_s(graph, assignment, device_of_stage, mesh: Mapping[str, int], order: Any = None,
                       memory=None, num_microbatches: int = 1) -> float:
    """:func:`dp_sync_time_s` of the busiest device of a partitioned, placed pipeline (seconds).

    ``graph`` is the :class:`~fxpipe.ir.OpGraph` (its ``size_param_bytes``, and the links: its
    recorded :class:`Topology` if the capture knew the hardware's nodes, else its
    ``bandwidth_bytes_per_s`` for every group), ``assignment`` the stage of every node,
    ``device_of_stage`` the placement, ``order`` the rank order (default the mesh's ``"order"``,
    else :data:`MESH_DIMS`). With per-block FSDP2 units (``memory.fsdp_units == "block"``) every collective
    of the step (:func:`block_fsdp_parts_s`' ``total_s``, ``num_microbatches`` per replica).
    """
    if mesh_dp(mesh) == 1:
        return 0.0
    if _block_units_of(memory, mesh):
        return float(max(t for *_, t in block_fsdp_parts_s(graph, assignment, device_of_stage, mesh,
                                                           num_microbatches, order)))
    per_device = _device_param_bytes(graph, assignment, device_of_stage, mesh["pp"])
    topology = Topology.of_graph(graph)
    return float(max(dp_sync_time_s(float(b), mesh, graph.bandwidth_bytes_per_s, topology=topology, order=order)
                     for b in per_device))


def _dp_shard_collective_s(nbytes, mesh: Mapping[str, int], graph, topology: Topology | None, order: Any,
                           kind: str):
    """Seconds of one ring all-gather / reduce-scatter of ``nbytes`` (float or array) over ``dp_shard``
    (:func:`dp_sync_parts_s`' formula)."""
    s = int(mesh.get("dp_shard", 1))
    if s == 1:
        return 0.0 * nbytes
    bw, lat = dp_links(mesh, graph.bandwidth_bytes_per_s, 0.0, topology, order, kind)["dp_shard"]
    return (s - 1) / s * nbytes / bw + (s - 1) * lat


def _replicate_all_reduce_s(nbytes, mesh: Mapping[str, int], graph, topology: Topology | None, order: Any):
    """Seconds of the ring all-reduce over ``dp_replicate`` of the ``1 / dp_shard`` shard of ``nbytes`` (HSDP)."""
    r, s = int(mesh.get("dp_replicate", 1)), int(mesh.get("dp_shard", 1))
    if r == 1:
        return 0.0 * nbytes
    bw, lat = dp_links(mesh, graph.bandwidth_bytes_per_s, 0.0, topology, order, "all_reduce")["dp_replicate"]
    return 2 * (r - 1) / r * (nbytes / s) / bw + 2 * (r - 1) * lat


def block_fsdp_parts_s(graph, assignment, device_of_stage, mesh: Mapping[str, int], num_microbatches: int,
                       order: Any = None) -> list[tuple[float, float, float, float]]:
    """Data-parallel communication of every pipeline device with per-block FSDP2 units (seconds):
    ``(gather_s, reduce_s, exposed_s, total_s)`` per device.

    With ``fsdp_units="block"`` (:mod:`fxpipe.memory.fsdp`: one FSDP2 unit per repeated block of a stage,
    the stage's other ops its root unit) FSDP2 all-gathers a block's parameters before its forward and
    again before its backward in every micro-batch, and reduce-scatters its gradients after every
    micro-batch's backward (Zhao et al., "PyTorch FSDP", VLDB 2023, Sec. 3.2 and 4.2). It prefetches the
    next block's all-gather while the current block computes, so per block and micro-batch this model
    takes as exposed (assumptions):

    * forward: ``max(0, AG_b - F_b)``; backward: ``max(0, AG_b + RS_b - (B_b + W_b))`` (the block's
      re-gather and the previous block's reduce-scatter run behind its backward; F, B, W are the
      summed op times of the block's nodes on the stage; a checkpointed block's replay, which would
      hide more, is not counted);
    * the root unit (the stage's ops outside every block: embeddings, final norm, head) stays
      unsharded for the step: it is gathered once at the step's start and its gradients reduced once
      at the end, like a whole-stage unit (:func:`pipeline_step_s`' ``G_d`` / ``R_d``), and so are the
      first block's all-gather (nothing computes before it);
    * under HSDP (``dp_replicate > 1``) a block's reduce-scatter is followed by the all-reduce of its
      gradient shard over ``dp_replicate`` in every micro-batch (what the runtime does: FSDP2 reduces a
      unit whenever its gradients sync), counted with the reduce-scatter; the root's once per step.

    Collectives are ring all-gathers / reduce-scatters over ``dp_shard`` on its link
    (:func:`dp_links`, the formulas of :func:`dp_sync_parts_s`), of the blocks' parameter bytes in the
    graph's dtype (gradients in the same dtype).

    Parameters
    ----------
    graph : OpGraph
        Op times, parameter bytes and blocks (:func:`fxpipe.memory.fsdp.block_units`), and the links.
    assignment : int array (n,)
        Stage of every node.
    device_of_stage : sequence of int
        The placement.
    mesh, order :
        The mesh and its rank order.
    num_microbatches : int
        Micro-batches per replica and step.

    Returns
    -------
    list of (gather_s, reduce_s, exposed_s, total_s), one per pipeline device
        ``gather_s`` / ``reduce_s`` at the step's start / end, ``exposed_s`` over all micro-batches,
        ``total_s`` all of the device's collectives of the step, overlapped or not.
    """
    import numpy as np

    from fxpipe.memory.fsdp import block_units  # noqa: PLC0415 - torch-free

    pp = int(mesh["pp"])
    topology = Topology.of_graph(graph)
    a = np.asarray(assignment, dtype=np.int64)
    unit = block_units(graph)
    pbytes = np.asarray(graph.size_param_bytes, dtype=np.float64)
    root = unit < 0
    dev = np.asarray(device_of_stage, dtype=np.int64)[a]
    root_bytes = np.bincount(dev[root], weights=pbytes[root], minlength=pp)
    exposed = np.zeros(pp)
    total = np.zeros(pp)
    first = np.zeros(pp)
    last = np.zeros(pp)
    if not root.all():
        nb = int(unit.max()) + 1
        key = a[~root] * nb + unit[~root]  # a (stage, block) pair is one unit
        size = int(a.max() + 1) * nb if a.size else 0
        ub = np.bincount(key, weights=pbytes[~root], minlength=size)
        uf = np.bincount(key, weights=np.asarray(graph.t_fwd_s, dtype=np.float64)[~root], minlength=size)
        ubw = np.bincount(key, weights=(np.asarray(graph.t_bwd_input_s, dtype=np.float64)
                                        + np.asarray(graph.t_bwd_weight_s, dtype=np.float64))[~root], minlength=size)
        used = np.flatnonzero(ub > 0)
        ag = _dp_shard_collective_s(ub[used], mesh, graph, topology, order, "all_gather")
        rs = _dp_shard_collective_s(ub[used], mesh, graph, topology, order, "reduce_scatter") + \
            _replicate_all_reduce_s(ub[used], mesh, graph, topology, order)
        per_mb = np.maximum(0.0, ag - uf[used]) + np.maximum(0.0, ag + rs - ubw[used])
        udev = np.asarray(device_of_stage, dtype=np.int64)[used // nb]
        exposed = np.bincount(udev, weights=per_mb, minlength=pp) * float(num_microbatches)
        total = np.bincount(udev, weights=2 * ag + rs, minlength=pp) * float(num_microbatches)
        np.maximum.at(first, udev, ag)
        np.maximum.at(last, udev, rs)
    out = []
    for d in range(pp):
        root_ag = float(_dp_shard_collective_s(root_bytes[d], mesh, graph, topology, order, "all_gather"))
        root_rs = float(_dp_shard_collective_s(root_bytes[d], mesh, graph, topology, order, "reduce_scatter"))
        replicate = float(_replicate_all_reduce_s(root_bytes[d], mesh, graph, topology, order))  # the root's, once
        out.append((root_ag + first[d], root_rs + last[d] + replicate, float(exposed[d]),
                    root_ag + root_rs + replicate + float(total[d])))
    return out


#: Stages a device may hold for :func:`pipeline_step_s`'s overlap: torch's ``_add_unshard_reshard``
#: prefetches (all-gathers at the step's start) this many stages and reshards none of them before the end.
MAX_PREFETCHED_STAGES = 3


def host_links(graph) -> dict[str, float] | None:
    """The host link and host memory of the hardware a captured graph was costed for, or ``None``.

    ``graph.meta["host"]`` (recorded by the capture from the hardware spec,
    :class:`fxpipe.cost.specs.HardwareSpec`): ``host_bytes_per_s`` (the device-host link per
    direction), ``host_memory_bytes_per_s`` and ``host_memory_bytes`` (one device's share of
    the node's DRAM bandwidth and capacity; 0: unknown).
    """
    doc = (getattr(graph, "meta", None) or {}).get("host")
    if not doc:
        return None
    return {k: float(doc.get(k, 0.0)) for k in ("host_bytes_per_s", "host_memory_bytes_per_s", "host_memory_bytes")}


def optimizer_host_step_s(num_params: float, memory, host: Mapping[str, float] | None) -> float:
    """Seconds a device spends per step on an optimizer offloaded to the host (0 without offload).

    Under :attr:`fxpipe.memory.MemoryModel.offload_optimizer` (ZeRO-Offload, Ren et al. 2021,
    Sec. 4: the optimizer state and its update on the host; here FSDP2's ``CPUOffloadPolicy``)
    each step a device moves its shard of the gradients to the host, the host updates the shard
    and the next step moves the updated weights back. Per parameter of the device's shard
    (``num_params / data_parallel``):

    * over the host link (``host_bytes_per_s``, each direction once): ``grad_bytes`` down and
      ``weight_bytes`` up;
    * the update streams the weights and optimizer state in and out and the gradients in,
      ``2 * (weight_bytes + optimizer_bytes) + grad_bytes`` bytes at the host memory bandwidth
      (``host_memory_bytes_per_s``; Adam's update is memory-bound: a few flops per 30 bytes);
      a roofline: torch's CPU ``AdamW`` reaches a fraction of it, measured by
      ``benchmarks/bench_optimizer_offload.py``.

    Not overlapped with the pipeline (torch's ``optimizer.step()`` runs after the schedule).

    Parameters
    ----------
    num_params : float
        Parameters of the device's stages.
    memory : MemoryModel
        Its precision policy, ``data_parallel`` (the shard) and ``offload_optimizer``.
    host : Mapping[str, float] or None
        :func:`host_links` of the graph.

    Raises
    ------
    InputError
        With offload but no known host link or host memory bandwidth (a graph not captured
        from a hardware spec that gives them).
    """
    if getattr(memory, "offload_optimizer", None) is not True:
        return 0.0
    if not host or not host.get("host_bytes_per_s", 0) > 0 or not host.get("host_memory_bytes_per_s", 0) > 0:
        raise InputError("offload_optimizer needs the host link and host memory bandwidth of the hardware: capture "
                         "the model for a hardware spec that gives them (h100-sxm, h200, a100-80gb, cpu), or set "
                         "graph.meta['host'] = {'host_bytes_per_s': ..., 'host_memory_bytes_per_s': ...}")
    p = memory.precision
    shard = float(num_params) / float(memory.data_parallel)
    link = shard * (p.grad_bytes + p.weight_bytes) / host["host_bytes_per_s"]
    update = shard * (2.0 * (p.weight_bytes + p.optimizer_bytes) + p.grad_bytes) / host["host_memory_bytes_per_s"]
    return link + update


def device_num_params(graph, assignment, device_of_stage, pp: int):
    """Parameters of every pipeline device's stages (numpy array of ``pp``)."""
    from fxpipe.partition.memory import num_params

    return _per_device(assignment, device_of_stage, pp, num_params(graph))


def device_host_step_s(graph, assignment, device_of_stage, pp: int, memory) -> list[float]:
    """:func:`optimizer_host_step_s` of every pipeline device of a partitioned, placed graph (seconds)."""
    if getattr(memory, "offload_optimizer", None) is not True:
        return [0.0] * int(pp)
    host = host_links(graph)
    return [optimizer_host_step_s(float(c), memory, host)
            for c in device_num_params(graph, assignment, device_of_stage, pp)]


def pipeline_step_s(graph, assignment, device_of_stage, schedule, mesh: Mapping[str, int],
                    order: Any = None, memory=None) -> float:
    """Predicted step time (seconds) of one pipeline of a mesh with its data-parallel sync, as the runtime overlaps it.

    What torch's pipelining runtime (``torch.distributed.pipelining.schedules``, on which
    fxpipe's :class:`~fxpipe.codegen.runtime.FxpipeScheduleRuntime` is built) does with FSDP2
    stages, read from torch 2.13's source:

    * ``_add_unshard_reshard`` (``max_active_stages=3``) puts an ``UNSHARD`` of every stage a
      device holds (up to 3) before its first action: ``FSDPModule.unshard(async_op=True)``,
      waited (``_assert_unsharded``) before the stage's first compute. So device ``d``'s
      all-gather ``G_d`` of all its parameters starts with the step and its first compute
      waits for it: it hides behind the time ``first_d`` the device waits for its first input
      anyway.
    * ``_add_reduce_grad`` puts one ``REDUCE_GRAD`` right after a stage's last backward;
      ``PipelineStage.perform_reduce_grad`` runs FSDP's ``post_backward`` (the reduce-scatter,
      the all-reduce over ``dp_replicate``) and makes the compute stream wait for it. So device
      ``d``'s reduction ``R_d`` starts when its last backward ends (``end_d``) and overlaps the
      other devices' cool-down; a device with several stages serialises a reduction into its
      remaining compute.

    The model (every time from the schedule, :func:`dp_sync_parts_s` for ``G_d`` and ``R_d``):

    * one stage per device, objective ``makespan`` (one step from a common start): shifting the whole schedule by ``delay = max_d max(0, G_d - first_d)``
      satisfies every all-gather, and the step ends with the last reduction:
      ``delay + max_d (end_d + R_d)``;
    * one stage per device, objective ``stage_span`` (back-to-back steps; the schedule's value
      is the largest device span ``end_d - first_d``): each device's cycle holds its span, its reduction and the next
      step's all-gather, which cannot start before the reduction's optimizer step:
      ``max_d (end_d - first_d + G_d + R_d)``;
    * several stages on a device (a stage's reduction mid-step delays the device's later
      compute and, through it, other devices'; more than :data:`MAX_PREFETCHED_STAGES` are
      re-gathered mid-step): not overlapped, ``value + max_d (G_d + R_d)`` (what the search
      assumed before; not a proven upper bound for those placements).

    With per-block FSDP2 units (``memory.fsdp_units == "block"``, ``dp_shard > 1``) ``G_d`` and ``R_d`` are
    the root unit's all-gather (and the first block's) and reduction (and the last block's, and the
    all-reduce over ``dp_replicate``), and each device's compute is stretched by what its blocks'
    per-micro-batch collectives do not hide (:func:`block_fsdp_parts_s`' ``exposed_s``, added after
    its last compute, before ``R_d``).

    With the optimizer offloaded to the host (``memory.offload_optimizer``), each device's host
    step (:func:`optimizer_host_step_s`) follows its reduction, like the reduction itself.

    Every case is at least the average device's compute plus the sync (and host step) of the
    average device's parameters, so :func:`fxpipe.mesh.search.mesh_lower_bound_s` stays a lower
    bound.

    Parameters
    ----------
    graph : OpGraph
        Parameter bytes per op and the links (:func:`pipeline_dp_sync_s`).
    assignment : array of int
        Stage of every graph node.
    device_of_stage : sequence of int
        The placement.
    schedule : Schedule
        The timed schedule of one replica (``ops``, ``makespan`` / ``stage_span``, ``objective``).
    mesh, order :
        The mesh and its rank order (default the mesh's ``"order"``, else :data:`MESH_DIMS`).
    memory : MemoryModel, optional
        The device's memory model; its ``offload_optimizer`` and ``fsdp_units`` matter here.

    Returns
    -------
    float
        Seconds; ``schedule.value`` without data parallelism and optimizer offload.
    """
    value = float(schedule.value)
    host = device_host_step_s(graph, assignment, device_of_stage, mesh["pp"], memory)
    if mesh_dp(mesh) == 1 and not any(host):
        return value
    blocks = _block_units_of(memory, mesh)
    if blocks:  # per-block FSDP2 units: their per-micro-batch collectives stretch each device's compute
        m = len({op.microbatch for op in schedule.ops}) or 1
        parts4 = block_fsdp_parts_s(graph, assignment, device_of_stage, mesh, m, order)
        parts = [(g, r) for g, r, _, _ in parts4]
        stretch = [e for _, _, e, _ in parts4]
    else:
        per_device = _device_param_bytes(graph, assignment, device_of_stage, mesh["pp"])
        topology = Topology.of_graph(graph)
        parts = [dp_sync_parts_s(float(b), mesh, graph.bandwidth_bytes_per_s, topology=topology, order=order)
                 for b in per_device]
        stretch = [0.0] * len(parts)
    parts = [(g, r + h + e) for (g, r), h, e in zip(parts, host, stretch)]  # the host step follows the reduction
    stages_per_device = max(list(device_of_stage).count(d) for d in range(int(mesh["pp"])))
    first: dict[int, float] = {}
    end: dict[int, float] = {}
    for op in schedule.ops:
        if op.type not in ("F", "B", "W"):
            continue
        d = int(device_of_stage[op.stage])
        first[d] = min(first.get(d, op.start_s), op.start_s)
        end[d] = max(end.get(d, op.end_s), op.end_s)
    if not first or len(first) < int(mesh["pp"]):
        return value + max(g + r for g, r in parts)
    if stages_per_device == 1 and schedule.objective == "stage_span":
        return max(value, max(end[d] - first[d] + g + r for d, (g, r) in enumerate(parts)))
    if stages_per_device == 1:
        t0 = min(first.values())
        delay = max(0.0, max(g - (first[d] - t0) for d, (g, _) in enumerate(parts)))
        return max(value, delay + max(end[d] - t0 + r for d, (_, r) in enumerate(parts)))
    return value + max(g + r for g, r in parts)
