"""The costed op graph: Contract 1 of DESIGN.md (``fxpipe.opgraph/1``).

No torch here: :class:`OpGraph` is what the partitioner sees, a DAG of ops with per-op
times in seconds and sizes in bytes, stored as frozen numpy arrays plus CSR adjacency.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.io import (MAX_BYTES, MAX_BYTES_PER_S, MAX_TIME_S, _as_float_array, _check_finite_nonneg, _freeze,
                       read_json, write_json_atomic)

__all__ = ["OPGRAPH_FORMAT", "NODE_FLOAT_FIELDS", "OpGraph"]

OPGRAPH_FORMAT = "fxpipe.opgraph/1"

#: Per-node float fields of Contract 1, in file order. Only ``t_fwd_s`` and
#: ``size_out_bytes`` are required; the others default to 0.
NODE_FLOAT_FIELDS = (
    "t_fwd_s",
    "t_bwd_input_s",
    "t_bwd_weight_s",
    "size_out_bytes",
    "size_param_bytes",
    "act_bytes",
)
_REQUIRED_NODE_FIELDS = ("id", "t_fwd_s", "size_out_bytes")
_KNOWN_NODE_KEYS = frozenset(("id", "name", "op", *NODE_FLOAT_FIELDS))



# --------------------------------------------------------------------------------------
# OpGraph (Contract 1)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class OpGraph:
    """A costed op DAG: Contract 1 of DESIGN.md as frozen numpy arrays.

    Node ``i`` is row ``i`` of every per-node array. An edge ``(u, v)`` means ``v``
    consumes the single output tensor of ``u`` (Archer et al. 2024, Section 2.1); a tensor
    with several consumers is transferred once per consuming block (Archer Eq. 1).

    Attributes
    ----------
    name : str
        Graph name (model name).
    names : tuple[str, ...], length n
        Node names (fx node names for traced models).
    ops : tuple[str, ...], length n
        Node kinds (``"placeholder"``, ``"call_function"``, ``"output"``, ...). Nodes of
        kind ``"placeholder"`` are model inputs and ``"output"`` is the model output: every
        order generator puts placeholders first and the output last, so that they land in
        the first and last pipeline stage, where the runtime feeds inputs and reads outputs.
    t_fwd_s, t_bwd_input_s, t_bwd_weight_s : float64 array (n,)
        Forward, backward-input (B) and backward-weight (W) time of one micro-batch, seconds.
    size_out_bytes : float64 array (n,)
        Bytes of the node's output tensor (of one micro-batch).
    size_param_bytes : float64 array (n,)
        Bytes of parameters owned by the node (each parameter owned by exactly one node).
    act_bytes : float64 array (n,)
        Bytes one micro-batch's forward keeps alive for the backward.
    edges : int64 array (m, 2)
        Deduplicated edges ``(u, v)``, sorted.
    bandwidth_bytes_per_s : float
        Device-to-device bandwidth B of Contract 2 (``io = bytes / B``).
    extra : tuple[dict, ...]
        Unknown per-node keys from the file, kept and written back.
    meta : dict
        Unknown top-level keys, kept and written back.

    Use :meth:`from_arrays` or :meth:`from_dict` to build one; both validate (DAG,
    finite and non-negative costs) and raise :class:`~fxpipe.errors.InputError`.
    """

    name: str
    names: tuple[str, ...]
    ops: tuple[str, ...]
    t_fwd_s: np.ndarray
    t_bwd_input_s: np.ndarray
    t_bwd_weight_s: np.ndarray
    size_out_bytes: np.ndarray
    size_param_bytes: np.ndarray
    act_bytes: np.ndarray
    edges: np.ndarray
    bandwidth_bytes_per_s: float
    succ_ptr: np.ndarray = field(repr=False)
    succ_idx: np.ndarray = field(repr=False)
    pred_ptr: np.ndarray = field(repr=False)
    pred_idx: np.ndarray = field(repr=False)
    extra: tuple[dict, ...] = field(default=(), repr=False)
    meta: dict = field(default_factory=dict, repr=False)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_arrays(
        cls,
        *,
        t_fwd_s: Sequence[float] | np.ndarray,
        size_out_bytes: Sequence[float] | np.ndarray,
        edges: Iterable[Sequence[int]] | np.ndarray,
        t_bwd_input_s: Sequence[float] | np.ndarray | None = None,
        t_bwd_weight_s: Sequence[float] | np.ndarray | None = None,
        size_param_bytes: Sequence[float] | np.ndarray | None = None,
        act_bytes: Sequence[float] | np.ndarray | None = None,
        bandwidth_bytes_per_s: float = 1.0,
        names: Sequence[str] | None = None,
        ops: Sequence[str] | None = None,
        name: str = "graph",
        extra: Sequence[dict] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> "OpGraph":
        """Build and validate an OpGraph from per-node arrays (length n) and an edge list.

        Raises
        ------
        InputError
            If lengths disagree, a cost is negative, not finite or above its range (a time
            above :data:`fxpipe.io.MAX_TIME_S` = 1e6 s, a size above :data:`fxpipe.io.MAX_BYTES`
            = 1e18 bytes), the bandwidth is not in (0, 1e18] bytes/s, an edge names a node
            outside ``0..n-1``, or the edges contain a cycle.
        """
        t_fwd = _as_float_array(t_fwd_s, "t_fwd_s")
        n = int(t_fwd.shape[0])
        if n < 1:
            raise InputError("the graph has no nodes: an OpGraph needs at least one node")
        arrays = {"t_fwd_s": t_fwd}
        given = {
            "t_bwd_input_s": t_bwd_input_s,
            "t_bwd_weight_s": t_bwd_weight_s,
            "size_out_bytes": size_out_bytes,
            "size_param_bytes": size_param_bytes,
            "act_bytes": act_bytes,
        }
        for key, val in given.items():
            arrays[key] = np.zeros(n) if val is None else _as_float_array(val, key, n)
        labels = list(names) if names is not None else [f"n{i}" for i in range(n)]
        if len(labels) != n:
            raise InputError(f"names must have {n} entries, got {len(labels)}")
        kinds = list(ops) if ops is not None else ["call_function"] * n
        if len(kinds) != n:
            raise InputError(f"ops must have {n} entries, got {len(kinds)}")
        for key, arr in arrays.items():
            _check_finite_nonneg(arr, key, labels, high=MAX_BYTES if key.endswith("_bytes") else MAX_TIME_S)
        bw = check_bandwidth(bandwidth_bytes_per_s)

        edge_arr = _edge_array(edges, n)
        succ_ptr, succ_idx = _csr(edge_arr[:, 0], edge_arr[:, 1], n)
        pred_ptr, pred_idx = _csr(edge_arr[:, 1], edge_arr[:, 0], n)
        cycle = _find_cycle(n, succ_ptr, succ_idx, pred_ptr, pred_idx)
        if cycle is not None:
            path = " -> ".join(f"{v} ({labels[v]})" for v in cycle[:8])
            raise InputError(
                f"the edges contain a cycle ({path}{' -> ...' if len(cycle) > 8 else ''}): "
                "an OpGraph must be a DAG"
            )
        ext = tuple(dict(e) for e in extra) if extra is not None else tuple({} for _ in range(n))
        if len(ext) != n:
            raise InputError(f"extra must have {n} entries, got {len(ext)}")
        return cls(
            name=str(name),
            names=tuple(str(x) for x in labels),
            ops=tuple(str(x) for x in kinds),
            t_fwd_s=_freeze(arrays["t_fwd_s"]),
            t_bwd_input_s=_freeze(arrays["t_bwd_input_s"]),
            t_bwd_weight_s=_freeze(arrays["t_bwd_weight_s"]),
            size_out_bytes=_freeze(arrays["size_out_bytes"]),
            size_param_bytes=_freeze(arrays["size_param_bytes"]),
            act_bytes=_freeze(arrays["act_bytes"]),
            edges=_freeze(edge_arr),
            bandwidth_bytes_per_s=bw,
            succ_ptr=_freeze(succ_ptr),
            succ_idx=_freeze(succ_idx),
            pred_ptr=_freeze(pred_ptr),
            pred_idx=_freeze(pred_idx),
            extra=ext,
            meta=dict(meta or {}),
        )

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str = "graph") -> "OpGraph":
        """Build an OpGraph from a parsed ``fxpipe.opgraph/1`` document.

        Node ``id`` values must be exactly 0..n-1 (in any order in the file).

        Raises
        ------
        InputError
            If the document does not follow Contract 1; the message names the bad node/key.
        """
        if not isinstance(doc, Mapping):
            raise InputError(f"{source}: expected a JSON object with 'nodes' and 'edges'")
        fmt = doc.get("format", OPGRAPH_FORMAT)
        if fmt != OPGRAPH_FORMAT:
            raise InputError(
                f"{source}: format is {fmt!r}, expected {OPGRAPH_FORMAT!r} "
                "(for other projects' graphs pass --format)"
            )
        nodes = doc.get("nodes")
        if not isinstance(nodes, list) or not nodes:
            raise InputError(f"{source}: 'nodes' must be a non-empty list")
        if "edges" not in doc or not isinstance(doc["edges"], list):
            raise InputError(f"{source}: 'edges' must be a list of [u, v] pairs")
        n = len(nodes)
        rows: list[Mapping[str, Any] | None] = [None] * n
        for pos, node in enumerate(nodes):
            if not isinstance(node, Mapping):
                raise InputError(f"{source}: nodes[{pos}] is not an object")
            for key in _REQUIRED_NODE_FIELDS:
                if key not in node:
                    raise InputError(f"{source}: nodes[{pos}] lacks the required key {key!r}")
            nid = node["id"]
            if isinstance(nid, bool) or not isinstance(nid, int) or not 0 <= nid < n:
                raise InputError(f"{source}: nodes[{pos}] has id {nid!r}; ids must be the integers 0..{n - 1}")
            if rows[nid] is not None:
                raise InputError(f"{source}: node id {nid} appears twice")
            rows[nid] = node
        cols: dict[str, list[float]] = {k: [] for k in NODE_FLOAT_FIELDS}
        names, kinds, extra = [], [], []
        for nid, node in enumerate(rows):
            assert node is not None
            for key in NODE_FLOAT_FIELDS:
                val = node.get(key, 0.0)
                if val is None or isinstance(val, bool) or not isinstance(val, (int, float)):
                    raise InputError(f"{source}: node {nid} has {key}={val!r}; expected a number")
                cols[key].append(float(val))
            names.append(str(node.get("name", f"n{nid}")))
            kinds.append(str(node.get("op", "call_function")))
            extra.append({k: v for k, v in node.items() if k not in _KNOWN_NODE_KEYS})
        meta = {k: v for k, v in doc.items() if k not in ("format", "name", "nodes", "edges", "bandwidth_bytes_per_s")}
        bw = doc.get("bandwidth_bytes_per_s", 1.0)
        try:
            return cls.from_arrays(
                **cols,
                edges=doc["edges"],
                bandwidth_bytes_per_s=bw,
                names=names,
                ops=kinds,
                name=str(doc.get("name", "graph")),
                extra=extra,
                meta=meta,
            )
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "OpGraph":
        """Read an ``fxpipe.opgraph/1`` JSON file.

        Raises
        ------
        InputError
            If the file is missing, not JSON, or violates Contract 1.
        """
        return cls.from_dict(read_json(path, "graph file"), source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """The ``fxpipe.opgraph/1`` document (JSON-ready; unknown keys written back)."""
        nodes = []
        for i in range(self.n):
            node: dict[str, Any] = {"id": i, "name": self.names[i], "op": self.ops[i]}
            for key in NODE_FLOAT_FIELDS:
                node[key] = float(getattr(self, key)[i])
            node.update(self.extra[i] if self.extra else {})
            nodes.append(node)
        doc: dict[str, Any] = {
            "format": OPGRAPH_FORMAT,
            "name": self.name,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
        }
        doc.update(self.meta)
        doc["nodes"] = nodes
        doc["edges"] = self.edges.tolist()
        return doc

    def save(self, path: str | os.PathLike) -> Path:
        """Write the graph as ``fxpipe.opgraph/1`` JSON, atomically."""
        return write_json_atomic(path, self.to_dict(), indent=None)

    # ---------------------------------------------------------------- views
    @property
    def n(self) -> int:
        """Number of nodes."""
        return len(self.names)

    @property
    def m(self) -> int:
        """Number of (deduplicated) edges."""
        return int(self.edges.shape[0])

    @property
    def t_train_s(self) -> np.ndarray:
        """Per-node training work ``t_fwd + t_bwd_input + t_bwd_weight`` (seconds), shape (n,)."""
        return self.t_fwd_s + self.t_bwd_input_s + self.t_bwd_weight_s

    def work_s(self, objective: str) -> np.ndarray:
        """Per-node work of Contract 2: ``t_fwd_s`` for ``"inference"``, F+B+W for ``"training"``.

        Raises
        ------
        InputError
            For an unknown objective.
        """
        if objective == "inference":
            return self.t_fwd_s
        if objective == "training":
            return self.t_train_s
        raise InputError(f"objective must be 'inference' or 'training', got {objective!r}")

    @property
    def data_dependent(self) -> np.ndarray:
        """Bool array (n,): nodes whose output size depends on the data (``extra[i]["data_dependent"]``,
        set by :func:`fxpipe.passes.to_opgraph.to_opgraph` for ``x[mask]``, ``nonzero``, ...); their
        tensors must not cross a stage boundary (:mod:`fxpipe.partition.colocate`)."""
        if not self.extra:
            return np.zeros(self.n, dtype=bool)
        return np.array([bool(e.get("data_dependent", False)) for e in self.extra], dtype=bool)

    def successors(self, v: int) -> np.ndarray:
        """Consumers of node ``v`` (int64 array)."""
        return self.succ_idx[self.succ_ptr[v] : self.succ_ptr[v + 1]]

    def predecessors(self, v: int) -> np.ndarray:
        """Producers node ``v`` consumes (int64 array)."""
        return self.pred_idx[self.pred_ptr[v] : self.pred_ptr[v + 1]]

    def to_networkx(self):
        """A ``networkx.DiGraph`` with node attributes (for oracles and utilities)."""
        import networkx as nx

        g = nx.DiGraph()
        for i in range(self.n):
            g.add_node(
                i,
                name=self.names[i],
                op=self.ops[i],
                **{k: float(getattr(self, k)[i]) for k in NODE_FLOAT_FIELDS},
            )
        g.add_edges_from(map(tuple, self.edges.tolist()))
        return g

    def __repr__(self) -> str:  # short: arrays can be huge
        return f"OpGraph(name={self.name!r}, n={self.n}, m={self.m}, bandwidth_bytes_per_s={self.bandwidth_bytes_per_s:g})"


def check_bandwidth(bandwidth_bytes_per_s: Any) -> float:
    """The inter-device bandwidth of an OpGraph (bytes/s) as a float.

    Raises
    ------
    InputError
        If it is not a number in (0, 1e18] bytes/s (:data:`fxpipe.io.MAX_BYTES_PER_S`).
    """
    try:
        bw = float(bandwidth_bytes_per_s)
    except (TypeError, ValueError):
        raise InputError(f"bandwidth_bytes_per_s must be a number, got {bandwidth_bytes_per_s!r}") from None
    if not math.isfinite(bw) or bw <= 0 or bw > MAX_BYTES_PER_S:
        raise InputError(f"bandwidth_bytes_per_s must be a finite number in (0, {MAX_BYTES_PER_S:g}] bytes/s, got {bw:g}")
    return bw


def _edge_array(edges: Iterable[Sequence[int]] | np.ndarray, n: int) -> np.ndarray:
    try:
        raw = np.asarray(edges if isinstance(edges, np.ndarray) else list(edges))
    except (TypeError, ValueError):
        raise InputError("edges must be a list of [u, v] integer pairs") from None
    if raw.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if raw.ndim != 2 or raw.shape[1] != 2:
        raise InputError(f"edges must be a list of [u, v] pairs, got an array of shape {raw.shape}")
    if raw.dtype.kind not in "iu":
        if raw.dtype.kind == "f" and np.all(np.isfinite(raw)) and np.all(raw == np.round(raw)):
            raw = raw.astype(np.int64)
        else:
            raise InputError("edges must contain integer node ids")
    arr = raw.astype(np.int64)
    bad = (arr < 0) | (arr >= n)
    if bad.any():
        i = int(np.flatnonzero(bad.any(axis=1))[0])
        raise InputError(f"edge {arr[i].tolist()} names a node outside 0..{n - 1}")
    loops = arr[:, 0] == arr[:, 1]
    if loops.any():
        i = int(np.flatnonzero(loops)[0])
        raise InputError(f"edge {arr[i].tolist()} is a self-loop: the graph must be a DAG")
    return np.unique(arr, axis=0)


def _csr(src: np.ndarray, dst: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((dst, src))
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.add.at(ptr, src + 1, 1)
    np.cumsum(ptr, out=ptr)
    return ptr, dst[order].astype(np.int64)


def _find_cycle(
    n: int, succ_ptr: np.ndarray, succ_idx: np.ndarray, pred_ptr: np.ndarray, pred_idx: np.ndarray
) -> list[int] | None:
    """Kahn's algorithm; if some nodes remain, walk back along remaining edges to a cycle."""
    indeg = np.diff(pred_ptr).copy()
    stack = list(np.flatnonzero(indeg == 0))
    seen = 0
    while stack:
        u = stack.pop()
        seen += 1
        for v in succ_idx[succ_ptr[u] : succ_ptr[u + 1]]:
            indeg[v] -= 1
            if indeg[v] == 0:
                stack.append(v)
    if seen == n:
        return None
    remaining = set(np.flatnonzero(indeg > 0).tolist())
    # every leftover node has a leftover predecessor (its in-degree never reached 0):
    # walk predecessors until a node repeats, then reverse to get the cycle in edge order
    v = min(remaining)
    path: list[int] = []
    pos: dict[int, int] = {}
    while v not in pos:
        pos[v] = len(path)
        path.append(v)
        v = next(int(u) for u in pred_idx[pred_ptr[v] : pred_ptr[v + 1]] if int(u) in remaining)
    cyc = path[pos[v] :][::-1]
    return cyc + [cyc[0]]
