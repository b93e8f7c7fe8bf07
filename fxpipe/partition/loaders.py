"""Loaders that turn other projects' costed graphs into :class:`~fxpipe.ir.OpGraph` (Contract 1).

Two public formats are supported:

* **dnn-partitioning** (Tarnawski et al., "Efficient Algorithms for Device Placement of DNN
  Graph Operators", NeurIPS 2020; github.com/msr-fiddle/dnn-partitioning,
  ``throughput-inputs/{LayerGraphs,OperatorGraphs}/*.json``), read by
  :func:`load_dnn_partitioning`.
* **PipeDream profiles** (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for
  DNN Training", SOSP 2019; ``profiler/*/*.graph.txt``), read by :func:`load_pipedream`.

Both loaders validate their input and raise :class:`~fxpipe.errors.InputError` with a
message naming the file, the line or node and what is wrong. Neither imports torch.

How a dnn-partitioning graph maps onto Contract 2
-------------------------------------------------
Their throughput objective (``computeLoadForResultOrg`` in ``throughput-dp/dp.cpp``) is, for
the set S of original nodes placed on one accelerator,
``sum_{v in S} fpgaLatency(v) + sum_{u in S, u has a consumer outside S} cost(u)
+ sum_{u outside S, u has a consumer in S} cost(u)``, every producer counted once per
device, with all nodes of one ``colorClass`` on the same device. That is Archer et al.'s
Eq. 3 with ``size_out = cost`` and bandwidth 1, so the loader builds:

1. **Colour classes** (nodes without ``colorClass`` get a class of their own, as dp.cpp does)
   are contracted into one node, forward and backward nodes of a class *together*: the
   node's ``t_fwd_s`` is the total ``fpgaLatency`` of the class and ``t_bwd_input_s =
   t_bwd_weight_s = 0``. Evaluate these graphs with ``objective="inference"`` and
   ``comm="dag"``: that is their objective (``"training"`` would double the io).
2. **Precedence** comes from the forward pass, as in dp.cpp where only forward nodes span the
   ideals and backward nodes follow their class: a forward-to-forward edge ``u -> v`` gives
   ``class(u) -> class(v)``. Classes that only have backward nodes (dp.cpp's "orphaned
   backward" nodes) are tied in as dp.cpp does, by mirroring the backward edges that touch
   them (``u_b -> v_b`` gives ``class(v_b) -> class(u_b)``). A backward-to-forward edge is
   rejected (dp.cpp rejects it too).
3. **Cycles** created by the contraction are merged: every strongly connected component of
   the contracted precedence graph becomes one node (dp.cpp's
   ``fuseStronglyConnectedComponentsInForward``). Node ids are a topological order of the
   components, smallest original id first.
4. **io**: ``bandwidth_bytes_per_s = 1`` and ``size_out_bytes`` holds transfer *times* (the
   file's ``cost``). Contract 2 needs every edge to point forward, but gradients flow
   backward (and the LayerGraphs list gradient edges in forward direction), so each producer
   ``u`` of group ``g`` with consumers in other groups is oriented along the node order: its
   cost goes to ``g`` with edges to the later consumer groups, and to every earlier consumer
   group ``h`` with an edge ``h -> g``. Either way both ends of a cut pay the cost once, as in
   their objective. This is exact when every producer yields one such "virtual tensor" and
   all virtual tensors of a group have the same consumer groups; otherwise the OpGraph cost
   can only over-count theirs (an upper bound). ``meta["io_exact"]`` says which case a file is
   in (every LayerGraph and the ResNet-50 inference OperatorGraph are exact). The extra
   edges follow the node order, so they never create a cycle, but they do forbid placing an
   io-connected but forward-independent class before its partner (dp.cpp would allow it).

Per-source ``cost`` must be the same on every out-edge of a source (dp.cpp fails otherwise);
the loader takes the largest (the conservative choice) and records the number of
inconsistent sources in ``meta["inconsistent_edge_costs"]``.

Units: the file's latencies and costs are kept unchanged in the ``*_s`` fields: the files do not state
their time unit (the values look like milliseconds), so the loader does not rescale, and
``meta["time_unit"]`` says so. Ratios (bottleneck / lower bound) are unit-free.
"""

from __future__ import annotations

import heapq
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from fxpipe.errors import InputError
from fxpipe.io import read_text
from fxpipe.ir import OpGraph, read_json
from fxpipe.ir.opgraph import check_bandwidth

__all__ = ["load_dnn_partitioning", "load_pipedream", "PIPEDREAM_DEFAULT_BANDWIDTH_BYTES_PER_S"]

#: Default device-to-device bandwidth for PipeDream graphs: 10 GB/s, about the effective rate
#: of a PCIe 3.0 x16 link, the intra-server interconnect of PipeDream's Cluster-A
#: (Narayanan et al. 2019, Table 2). Override with ``bandwidth_bytes_per_s=``.
PIPEDREAM_DEFAULT_BANDWIDTH_BYTES_PER_S = 10.0e9

_DNN_TIME_UNIT = "dnn-partitioning file units, not rescaled (they look like milliseconds; the files do not say)"


# --------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------


def _number(val: Any, what: str, source: str) -> float:
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise InputError(f"{source}: {what} is {val!r:.80}, expected a number")
    x = float(val)
    if not math.isfinite(x) or x < 0:
        raise InputError(f"{source}: {what} is {x}, expected a finite number >= 0")
    return x


def _integer(val: Any, what: str, source: str) -> int:
    if isinstance(val, bool):
        return int(val)
    if isinstance(val, int):
        return val
    if isinstance(val, float) and val.is_integer():
        return int(val)
    raise InputError(f"{source}: {what} is {val!r:.80}, expected an integer")


def _kahn_by_priority(n: int, edges: list[tuple[int, int]], key: list[Any]) -> list[int] | None:
    """Topological order, smallest ``key`` first among ready nodes; None if cyclic."""
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for u, v in edges:
        succ[u].append(v)
        indeg[v] += 1
    heap = [(key[v], v) for v in range(n) if indeg[v] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (key[v], v))
    return order if len(order) == n else None


def _strongly_connected_components(n: int, edges: list[tuple[int, int]]) -> list[int]:
    """Component id of every node (iterative Tarjan, O(n + m))."""
    succ: list[list[int]] = [[] for _ in range(n)]
    for u, v in edges:
        succ[u].append(v)
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    comp = [-1] * n
    stack: list[int] = []
    counter = 0
    ncomp = 0
    for root in range(n):
        if index[root] != -1:
            continue
        work = [(root, 0)]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        while work:
            v, i = work[-1]
            if i < len(succ[v]):
                work[-1] = (v, i + 1)
                w = succ[v][i]
                if index[w] == -1:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
                if low[v] == index[v]:
                    while True:
                        w = stack.pop()
                        on_stack[w] = False
                        comp[w] = ncomp
                        if w == v:
                            break
                    ncomp += 1
    return comp


# --------------------------------------------------------------------------------------
# dnn-partitioning
# --------------------------------------------------------------------------------------


def load_dnn_partitioning(path: str | os.PathLike, *, name: str | None = None) -> OpGraph:
    """Load a dnn-partitioning throughput input (LayerGraph or OperatorGraph JSON).

    Colour classes are contracted (forward and backward nodes of a class together), cycles
    created by the contraction are merged, and transfer costs become ``size_out_bytes`` with
    ``bandwidth_bytes_per_s = 1``; see the module docstring for the exact rules. Evaluate the
    result with ``objective="inference", comm="dag"`` to get their objective.

    Parameters
    ----------
    path : str or PathLike
        A ``*.json`` file with keys ``nodes`` (``id``, ``fpgaLatency``, ``isBackwardNode``;
        optional ``colorClass``, ``size``, ``cpuLatency``, ``supportedOnFpga``, ``name``,
        ``layerId``) and ``edges`` (``sourceId``, ``destId``, ``cost``).
    name : str, optional
        Graph name (default: the file name without ``.json``).

    Returns
    -------
    OpGraph
        Node ``i`` is one contracted group, ids in a topological order that follows the
        smallest original id. Per node: ``t_fwd_s`` = total ``fpgaLatency`` of the group
        (file units), ``size_out_bytes`` = transfer cost attributed to the group (file time
        units; bandwidth 1), ``size_param_bytes`` = total ``size`` (bytes).
        ``extra[i]`` holds ``members`` (original ids), ``color_classes``,
        ``backward_members`` and ``cpu_latency``. ``meta`` holds the file's
        ``maxSizePerFPGA``/``maxFPGAs``/``maxCPUs``, ``time_unit``, ``io_exact``, counts of
        original nodes/edges/classes and merged components, and ``training``.

    Raises
    ------
    InputError
        If the file is missing or not JSON, a required key is missing, a number is negative
        or not finite, an edge names an unknown node, a backward node feeds a forward node,
        or ids repeat.

    References
    ----------
    Tarnawski et al. 2020, Section 3 and ``throughput-dp/dp.cpp`` (``contractColorClasses``,
    ``fuseStronglyConnectedComponentsInForward``, ``computeLoadForResultOrg``); Archer et al.
    2024, Eq. 1 and Eq. 3.
    """
    src = str(path)
    doc = read_json(path, "dnn-partitioning file")
    if not isinstance(doc, Mapping):
        raise InputError(f"{src}: expected a JSON object with 'nodes' and 'edges'")
    nodes = doc.get("nodes")
    edges = doc.get("edges")
    if not isinstance(nodes, list) or not nodes:
        raise InputError(f"{src}: 'nodes' must be a non-empty list (is this a dnn-partitioning file?)")
    if not isinstance(edges, list):
        raise InputError(f"{src}: 'edges' must be a list of {{sourceId, destId, cost}} objects")

    nd = _dnn_nodes(nodes, src)
    cost, inconsistent, orig_edges = _dnn_edges(edges, src, nd)
    ncls, ncomp, gid = _dnn_groups(nd, orig_edges, src)
    n = ncomp
    n0 = len(nd.ids)
    t, par, cpu_g, members, bwd_count, classes = _dnn_group_weights(nd, gid, n)
    size_out, out_edges, exact = _dnn_io(n0, n, orig_edges, gid, cost)
    names_out = []
    for g in range(n):
        fwd = [nd.names[nd.pos_of[i]] for i in members[g] if not nd.backward[nd.pos_of[i]]] \
            or [nd.names[nd.pos_of[i]] for i in members[g]]
        names_out.append(fwd[0] if len(members[g]) == 1 else f"{fwd[0]}+{len(members[g]) - 1}")
    extra = [
        {
            "members": sorted(members[g]),
            "color_classes": sorted(classes[g], key=str),
            "backward_members": bwd_count[g],
            "cpu_latency": float(cpu_g[g]),
        }
        for g in range(n)
    ]
    meta = {
        "source": src,
        "source_format": "dnn-partitioning",
        "time_unit": _DNN_TIME_UNIT,
        "size_out_unit": "transfer time in the file's time units (bandwidth_bytes_per_s = 1)",
        "objective_note": "forward and backward work of a colour class are both in t_fwd_s; "
        "evaluate with objective='inference', comm='dag' to reproduce dnn-partitioning's throughput objective",
        "training": any(nd.backward),
        "io_exact": exact,
        "original_nodes": n0,
        "original_edges": len(orig_edges),
        "color_classes": ncls,
        "merged_components": ncls - ncomp,
        "inconsistent_edge_costs": inconsistent,
    }
    for key in ("maxSizePerFPGA", "maxFPGAs", "maxCPUs"):
        if key in doc:
            meta[key] = doc[key]
    try:
        return OpGraph.from_arrays(
            t_fwd_s=t,
            size_out_bytes=size_out,
            size_param_bytes=par,
            edges=sorted(out_edges) if out_edges else np.zeros((0, 2), dtype=np.int64),
            bandwidth_bytes_per_s=1.0,
            names=names_out,
            ops=["call_function"] * n,
            name=name or Path(src).name.removesuffix(".json"),
            extra=extra,
            meta=meta,
        )
    except InputError as exc:  # pragma: no cover - guarded above
        raise InputError(f"{src}: {exc}") from None


@dataclass
class _DnnNodes:
    """The nodes of a dnn-partitioning file, by position in its ``nodes`` list."""

    pos_of: dict[int, int] = field(default_factory=dict)  # file id -> position
    ids: list[int] = field(default_factory=list)
    fpga: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    size: list[float] = field(default_factory=list)
    backward: list[bool] = field(default_factory=list)
    cls_raw: list[Any] = field(default_factory=list)  # ("c", colorClass) or ("own", id)
    names: list[str] = field(default_factory=list)


def _check_record(item: Any, where: str, keys: tuple[str, ...]) -> None:
    """``item`` must be a JSON object holding every key of ``keys`` (InputError naming ``where``)."""
    if not isinstance(item, Mapping):
        raise InputError(f"{where} is not an object")
    for key in keys:
        if key not in item:
            raise InputError(f"{where} lacks the required key {key!r}")


def _dnn_nodes(nodes: list, src: str) -> _DnnNodes:
    """Read and check the ``nodes`` of a dnn-partitioning file."""
    nd = _DnnNodes()
    for p, node in enumerate(nodes):
        where = f"{src}: nodes[{p}]"
        _check_record(node, where, ("id", "fpgaLatency", "isBackwardNode"))
        nid = _integer(node["id"], "id", where)
        if nid in nd.pos_of:
            raise InputError(f"{src}: node id {nid} appears twice")
        nd.pos_of[nid] = p
        nd.ids.append(nid)
        nd.fpga.append(_number(node["fpgaLatency"], f"node {nid} fpgaLatency", src))
        nd.cpu.append(_number(node.get("cpuLatency", 0.0), f"node {nid} cpuLatency", src))
        nd.size.append(_number(node.get("size", 0.0), f"node {nid} size", src))
        nd.backward.append(bool(_integer(node["isBackwardNode"], f"node {nid} isBackwardNode", src)))
        nd.cls_raw.append(("c", _integer(node["colorClass"], f"node {nid} colorClass", src)) if "colorClass" in node
                          else ("own", nid))
        nd.names.append(str(node.get("name", f"node{nid}")))
    return nd


def _dnn_edges(edges: list, src: str, nd: _DnnNodes) -> tuple[list[float], int, list[tuple[int, int]]]:
    """Read and check the ``edges``: per-source cost (the largest if they differ), the count of
    sources with inconsistent costs, and the edges as position pairs."""
    n0 = len(nd.ids)
    cost = [0.0] * n0
    has_cost = [False] * n0
    inconsistent = 0
    orig_edges: list[tuple[int, int]] = []
    for q, e in enumerate(edges):
        where = f"{src}: edges[{q}]"
        _check_record(e, where, ("sourceId", "destId", "cost"))
        s_id = _integer(e["sourceId"], "sourceId", where)
        d_id = _integer(e["destId"], "destId", where)
        if s_id not in nd.pos_of or d_id not in nd.pos_of:
            bad = s_id if s_id not in nd.pos_of else d_id
            raise InputError(f"{where} names node {bad}, which is not in 'nodes'")
        if s_id == d_id:
            raise InputError(f"{where} is a self-loop on node {s_id}")
        c = _number(e["cost"], f"edges[{q}] cost", src)
        u, v = nd.pos_of[s_id], nd.pos_of[d_id]
        if nd.backward[u] and not nd.backward[v]:
            raise InputError(
                f"{where}: backward node {s_id} feeds forward node {d_id}; a backward pass cannot feed "
                "the forward pass (dnn-partitioning rejects this too)"
            )
        if has_cost[u]:
            if abs(cost[u] - c) > 1e-6 * max(1.0, abs(c)):
                inconsistent += 1
            cost[u] = max(cost[u], c)
        else:
            cost[u], has_cost[u] = c, True
        orig_edges.append((u, v))
    return cost, inconsistent, orig_edges


def _dnn_groups(nd: _DnnNodes, orig_edges: list[tuple[int, int]], src: str) -> tuple[int, int, list[int]]:
    """Module docstring steps 1-3: colour classes, their precedence, strongly connected
    components merged, groups in topological order (smallest original id first). Returns the
    number of classes, of groups, and the group (new node id) of every original node."""
    cls_index: dict[Any, int] = {}
    cls_of = [cls_index.setdefault(key, len(cls_index)) for key in nd.cls_raw]
    ncls = len(cls_index)
    # class-level precedence: forward -> forward edges, plus mirrored backward edges that
    # touch a class without forward nodes (dp.cpp's createArtificialForwardNodes)
    has_fwd = [False] * ncls
    for p, bwd in enumerate(nd.backward):
        if not bwd:
            has_fwd[cls_of[p]] = True
    cls_edges: set[tuple[int, int]] = set()
    for u, v in orig_edges:
        cu, cv = cls_of[u], cls_of[v]
        if cu == cv:
            continue
        if not nd.backward[u] and not nd.backward[v]:
            cls_edges.add((cu, cv))
        elif nd.backward[u] and nd.backward[v] and (not has_fwd[cu] or not has_fwd[cv]):
            cls_edges.add((cv, cu))
    comp = _strongly_connected_components(ncls, sorted(cls_edges))
    ncomp = max(comp) + 1
    group_of_node = [comp[c] for c in cls_of]
    min_id = [math.inf] * ncomp
    for p, g in enumerate(group_of_node):
        min_id[g] = min(min_id[g], nd.ids[p])
    comp_edges = sorted({(comp[a], comp[b]) for a, b in cls_edges if comp[a] != comp[b]})
    order = _kahn_by_priority(ncomp, comp_edges, min_id)
    if order is None:  # impossible after SCC condensation; kept as a guard
        raise InputError(f"{src}: the contracted graph still has a cycle after merging components")
    rank = [0] * ncomp
    for i, g in enumerate(order):
        rank[g] = i
    return ncls, ncomp, [rank[g] for g in group_of_node]


def _dnn_group_weights(nd: _DnnNodes, gid: list[int], n: int) -> tuple:
    """Per group: latency, parameter bytes, CPU latency, members (file ids), backward member
    count and colour classes."""
    t = np.zeros(n)
    par = np.zeros(n)
    cpu_g = np.zeros(n)
    members: list[list[int]] = [[] for _ in range(n)]
    bwd_count = [0] * n
    classes: list[set[Any]] = [set() for _ in range(n)]
    for p, g in enumerate(gid):
        t[g] += nd.fpga[p]
        par[g] += nd.size[p]
        cpu_g[g] += nd.cpu[p]
        members[g].append(nd.ids[p])
        bwd_count[g] += int(nd.backward[p])
        key = nd.cls_raw[p]
        classes[g].add(key[1] if key[0] == "c" else f"own:{key[1]}")
    return t, par, cpu_g, members, bwd_count, classes


def _dnn_io(n0: int, n: int, orig_edges: list[tuple[int, int]], gid: list[int],
            cost: list[float]) -> tuple[np.ndarray, set[tuple[int, int]], bool]:
    """Module docstring step 4: ``size_out`` per group, the group edges, and whether the
    OpGraph's io equals the file's.

    Every tensor with consumers in other groups becomes "virtual tensors" oriented along the
    group order (ids are a topological order): (g, later consumers) and, for each earlier
    consumer group h, (h, {g}); both ends of a cut pay its cost either way.
    """
    consumers: list[set[int]] = [set() for _ in range(n0)]
    for u, v in orig_edges:
        if gid[u] != gid[v]:
            consumers[u].add(gid[v])
    size_out = np.zeros(n)
    out_edges: set[tuple[int, int]] = set()
    signature: list[set[frozenset[int]]] = [set() for _ in range(n)]  # consumer sets per group
    exact = True
    for u in range(n0):
        cgs = consumers[u]
        if not cgs:
            continue
        g = gid[u]
        later = frozenset(h for h in cgs if h > g)
        earlier = sorted(h for h in cgs if h < g)
        if later:
            size_out[g] += cost[u]
            out_edges.update((g, h) for h in later)
            signature[g].add(later)
        for h in earlier:
            size_out[h] += cost[u]
            out_edges.add((h, g))
            signature[h].add(frozenset((g,)))
        if len(earlier) + (1 if later else 0) > 1:
            exact = False
    if any(len(s) > 1 for s in signature):
        exact = False
    return size_out, out_edges, exact


# --------------------------------------------------------------------------------------
# PipeDream
# --------------------------------------------------------------------------------------

_PD_NODE = re.compile(r"^(\S+) -- (.*) -- (forward_compute_time=.*)$")
_PD_EDGE = re.compile(r"^(\S+) -- (\S+)$")
_PD_FIELD = re.compile(r"(\w+)=(\[[^\]]*\]|[^,\s]+)")
_PD_KEYS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_MS = 1e-3


def _pd_value(text: str, key: str, where: str) -> float:
    parts = text[1:-1].split(";") if text.startswith("[") else [text]
    total = 0.0
    for part in parts:
        part = part.strip()
        try:
            x = float(part)
        except ValueError:
            raise InputError(f"{where}: {key}={text!r} is not a number") from None
        if not math.isfinite(x) or x < 0:
            raise InputError(f"{where}: {key}={text!r} must be finite and >= 0")
        total += x
    return total


def load_pipedream(
    path: str | os.PathLike,
    *,
    bandwidth_bytes_per_s: float = PIPEDREAM_DEFAULT_BANDWIDTH_BYTES_PER_S,
    backward_split: str = "input",
    name: str | None = None,
) -> OpGraph:
    """Load a PipeDream profile (``*.graph.txt``).

    The format (PipeDream's ``graph.py``) is one line per node,
    ``nodeX -- Description -- forward_compute_time=F, backward_compute_time=B,
    activation_size=A, parameter_size=P``, then one line per edge, ``nodeA -- nodeB``.
    ``activation_size`` may be a list ``[a; b; ...]`` (a node with several output tensors);
    its entries are summed.

    Parameters
    ----------
    path : str or PathLike
        The profile.
    bandwidth_bytes_per_s : float
        Device-to-device bandwidth for Contract 2 (default
        :data:`PIPEDREAM_DEFAULT_BANDWIDTH_BYTES_PER_S`, 10 GB/s).
    backward_split : {"input", "even"}
        How PipeDream's single backward time is split: ``"input"`` puts all of it in
        ``t_bwd_input_s`` (``t_bwd_weight_s = 0``); ``"even"`` splits it in half between B and
        W for layers with parameters (Zero Bubble's ``T_B ~= T_W`` for linear and conv layers)
        and keeps it all in B for parameter-free layers. The training objective (F+B+W) is the
        same either way.
    name : str, optional
        Graph name (default: the file name without ``.graph.txt``).

    Returns
    -------
    OpGraph
        Nodes renumbered 0..n-1 in a topological order that prefers PipeDream's node numbers
        (then file order). Times in seconds (PipeDream profiles milliseconds),
        ``size_out_bytes = act_bytes = activation_size`` (bytes of the output activation of
        one mini-batch), ``size_param_bytes = parameter_size`` (bytes: PipeDream's profiler
        sums ``numel * element_size``; e.g. AlexNet's Conv2d(384, 256, 3x3) has 884,992
        float32 parameters and ``parameter_size=3539968``). Nodes described as ``Input<k>``
        get ``op = "placeholder"``. ``extra[i]`` holds the original node id and description.

    Raises
    ------
    InputError
        If a line is neither a node nor an edge, a field is missing or not a number, a node
        is declared twice, an edge names an undeclared node, the edges have a cycle, the
        bandwidth is not positive or ``backward_split`` is unknown.

    References
    ----------
    Narayanan et al. 2019 (PipeDream), Section 3.1 (profiler) and ``graph/graph.py``;
    Qi et al. 2024 (Zero Bubble), Section 2 for the B/W split.
    """
    src = str(path)
    if backward_split not in ("input", "even"):
        raise InputError(f"backward_split must be 'input' or 'even', got {backward_split!r}")
    bw = check_bandwidth(bandwidth_bytes_per_s)
    node_ids, descs, vals, edges = _pd_parse(read_text(path, "PipeDream profile"), src)
    n = len(node_ids)
    new = _pd_renumbering(node_ids, edges, src)
    fwd = np.zeros(n)
    bwd = np.zeros(n)
    act = np.zeros(n)
    par = np.zeros(n)
    names = [""] * n
    ops = [""] * n
    extra: list[dict] = [{} for _ in range(n)]
    for i in range(n):
        j = new[i]
        fwd[j] = vals[i]["forward_compute_time"] * _MS
        bwd[j] = vals[i]["backward_compute_time"] * _MS
        act[j] = vals[i]["activation_size"]
        par[j] = vals[i]["parameter_size"]
        names[j] = node_ids[i]
        ops[j] = "placeholder" if re.fullmatch(r"Input\d*", descs[i]) else "call_module"
        extra[j] = {"pipedream_id": node_ids[i], "description": descs[i]}
    if backward_split == "even":
        w = np.where(par > 0, bwd / 2.0, 0.0)
        b_in = bwd - w
    else:
        w = np.zeros(n)
        b_in = bwd
    meta = {
        "source": src,
        "source_format": "pipedream",
        "time_unit": "s (converted from PipeDream's milliseconds)",
        "backward_split": backward_split,
        "bandwidth_note": "default 10 GB/s (PCIe 3.0 x16, PipeDream Cluster-A intra-server)"
        if bw == PIPEDREAM_DEFAULT_BANDWIDTH_BYTES_PER_S
        else "given by the caller",
    }
    stem = Path(src).name
    for suffix in (".graph.txt", ".txt"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    try:
        return OpGraph.from_arrays(
            t_fwd_s=fwd,
            t_bwd_input_s=b_in,
            t_bwd_weight_s=w,
            size_out_bytes=act,
            size_param_bytes=par,
            act_bytes=act,
            edges=[(new[a], new[b]) for a, b in edges] if edges else np.zeros((0, 2), dtype=np.int64),
            bandwidth_bytes_per_s=bw,
            names=names,
            ops=ops,
            name=name or stem,
            extra=extra,
            meta=meta,
        )
    except InputError as exc:  # pragma: no cover - guarded above
        raise InputError(f"{src}: {exc}") from None


def _pd_parse(text: str, src: str) -> tuple[list[str], list[str], list[dict[str, float]], list[tuple[int, int]]]:
    """Node ids, descriptions and fields (file order) and the edges (file positions) of a
    profile, every line checked."""
    index: dict[str, int] = {}
    node_ids: list[str] = []
    descs: list[str] = []
    vals: list[dict[str, float]] = []
    raw_edges: list[tuple[str, str, int]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        s = line.strip()
        if not s:
            continue
        where = f"{src}:{lineno}"
        m = _PD_NODE.match(s)
        if m:
            nid, desc, fields = m.group(1), m.group(2), m.group(3)
            if nid in index:
                raise InputError(f"{where}: node {nid} is declared twice")
            got = dict(_PD_FIELD.findall(fields))
            row = {}
            for key in _PD_KEYS:
                if key not in got:
                    raise InputError(f"{where}: node {nid} lacks {key}=")
                row[key] = _pd_value(got[key], key, where)
            index[nid] = len(node_ids)
            node_ids.append(nid)
            descs.append(desc.strip())
            vals.append(row)
            continue
        m = _PD_EDGE.match(s)
        if m and "=" not in s:
            raw_edges.append((m.group(1), m.group(2), lineno))
            continue
        raise InputError(
            f"{where}: cannot parse {s[:80]!r}; expected 'nodeX -- Desc -- forward_compute_time=..., "
            "backward_compute_time=..., activation_size=..., parameter_size=...' or 'nodeA -- nodeB'"
        )
    if not node_ids:
        raise InputError(f"{src}: no node lines found; is this a PipeDream *.graph.txt profile?")
    edges: list[tuple[int, int]] = []
    for a, b, lineno in raw_edges:
        for x in (a, b):
            if x not in index:
                raise InputError(f"{src}:{lineno}: edge {a} -- {b} names {x}, which has no node line")
        if a == b:
            raise InputError(f"{src}:{lineno}: edge {a} -- {b} is a self-loop")
        edges.append((index[a], index[b]))
    return node_ids, descs, vals, edges


def _pd_renumbering(node_ids: list[str], edges: list[tuple[int, int]], src: str) -> list[int]:
    """New id of every node: a topological order preferring PipeDream's node numbers, then
    file order. Raises InputError naming the nodes of a cycle."""
    n = len(node_ids)

    def key_of(i: int) -> tuple[float, int]:
        m = re.fullmatch(r"node(\d+)", node_ids[i])
        return (float(m.group(1)) if m else math.inf, i)

    order = _kahn_by_priority(n, edges, [key_of(i) for i in range(n)])
    if order is None:
        comp = _strongly_connected_components(n, edges)
        counts = np.bincount(comp)
        bad = [node_ids[i] for i in range(n) if counts[comp[i]] > 1][:8]
        raise InputError(f"{src}: the edges contain a cycle through {', '.join(bad)}: a PipeDream graph must be a DAG")
    new = [0] * n
    for i, v in enumerate(order):
        new[v] = i
    return new
