"""Plain-data intermediate representations shared by every part of fxpipe.

No torch here: these are the objects the partitioner and scheduler see (DESIGN.md,
"Data flow"). Three contracts of DESIGN.md live in this module:

* :class:`OpGraph` is Contract 1, the ``fxpipe.opgraph/1`` JSON file: a DAG of ops with
  per-op times in seconds and sizes in bytes, stored as frozen numpy arrays plus CSR
  adjacency.
* :class:`ScheduleProblem` is the problem half of Contract 3 (``fxpipe.schedproblem/1``).
* :class:`Schedule` / :class:`ScheduledOp` are the result half (``fxpipe.schedule/1``).

Files are JSON, written atomically (:func:`write_json_atomic`), never pickle.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError

OPGRAPH_FORMAT = "fxpipe.opgraph/1"
SCHEDPROBLEM_FORMAT = "fxpipe.schedproblem/1"
SCHEDULE_FORMAT = "fxpipe.schedule/1"

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
# JSON helpers
# --------------------------------------------------------------------------------------


def write_text_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write text (UTF-8) or bytes to ``path`` atomically: temp file in the same folder, fsync, rename.

    A reader never sees a half-written file and a crash leaves the old file intact. The
    file gets the usual permissions (``0666`` less the umask), not ``mkstemp``'s ``0600``.

    Raises
    ------
    OSError
        If the folder cannot be created or written (the CLI reports it without a traceback).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_json_atomic(path: str | os.PathLike, data: Any, *, indent: int | None = 1) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (see :func:`write_text_atomic`).

    Parameters
    ----------
    path : str or PathLike
        Destination file. Its parent folder is created if missing.
    data : JSON-serialisable object
        numpy scalars and arrays are converted to Python numbers and lists; NaN and
        infinity are refused (``ValueError``) since they are not JSON.

    Returns
    -------
    Path
        The path written.
    """
    text = json.dumps(data, indent=indent, default=_json_default, allow_nan=False)
    return write_text_atomic(path, text + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serialisable")


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """Read a JSON file, turning every failure into an :class:`InputError` that names the file.

    Raises
    ------
    InputError
        If the file is missing, unreadable or not valid JSON.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} {str(path)!r} does not exist: check the path")
    if path.is_dir():
        raise InputError(f"{what} {str(path)!r} is a directory, expected a JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {what} {str(path)!r}: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{what} {str(path)!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}); fix or regenerate the file"
        ) from None


def _as_float_array(values: Sequence[float] | np.ndarray, name: str, length: int | None = None) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a list of numbers, got {values!r:.200}") from None
    if arr.ndim != 1:
        raise InputError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise InputError(f"{name} must have {length} entries, got {arr.shape[0]}")
    return arr


def _check_finite_nonneg(arr: np.ndarray, name: str, labels: Sequence[str] | None = None) -> None:
    bad = ~np.isfinite(arr)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        where = f" ({labels[i]!r})" if labels is not None else ""
        raise InputError(f"{name}[{i}]{where} is {arr[i]}: costs must be finite numbers")
    neg = arr < 0
    if neg.any():
        i = int(np.flatnonzero(neg)[0])
        where = f" ({labels[i]!r})" if labels is not None else ""
        raise InputError(f"{name}[{i}]{where} is {arr[i]}: costs must be >= 0")


def _as_count(value: Any, name: str) -> int:
    """An integer from JSON (``3`` or ``3.0``), else :class:`InputError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(f"{name} must be an integer, got {value!r}")
    if not float(value).is_integer():
        raise InputError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _as_index(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not float(value).is_integer():
        raise ValueError(value)
    return int(value)


def _freeze(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr)
    arr.setflags(write=False)
    return arr


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
            If lengths disagree, a cost is negative or not finite, the bandwidth is not
            positive, an edge names a node outside ``0..n-1``, or the edges contain a cycle.
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
            _check_finite_nonneg(arr, key, labels)
        try:
            bw = float(bandwidth_bytes_per_s)
        except (TypeError, ValueError):
            raise InputError(f"bandwidth_bytes_per_s must be a number, got {bandwidth_bytes_per_s!r}") from None
        if not math.isfinite(bw) or bw <= 0:
            raise InputError(f"bandwidth_bytes_per_s must be a positive finite number, got {bw}")

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


# --------------------------------------------------------------------------------------
# Schedule problem and schedule (Contract 3)
# --------------------------------------------------------------------------------------

OP_TYPES = ("F", "B", "W", "O", "R")
OBJECTIVES = ("stage_span", "makespan")


@dataclass(frozen=True, eq=False)
class ScheduleProblem:
    """A pipeline scheduling problem: Contract 3 of DESIGN.md (``fxpipe.schedproblem/1``).

    S stages (one per device), m micro-batches. Times in seconds (or any consistent unit),
    memory in bytes (or any consistent unit).

    Attributes
    ----------
    num_stages : int
        S >= 1.
    num_microbatches : int
        m >= 1.
    t_f, t_b, t_w : float64 array (S,)
        Forward, backward-input and backward-weight time of one micro-batch on stage s.
    t_comm : float64 array (S-1,)
        ``t_comm[s]`` is the one-way transfer time between stage s and s+1 (activations
        forward, gradients backward). A scalar in JSON means the same for every boundary.
    t_offload : float64 array (S,)
        One-way D2H (or H2D) time of one micro-batch's offloadable stash on stage s.
    mem_f, mem_b, mem_w : float64 array (S,)
        Memory deltas of F (> 0), B (<= 0) and W (<= 0); ``mem_f + mem_b + mem_w == 0``.
    offload_bytes : float64 array (S,)
        Bytes freed by an offload, ``0 <= offload_bytes <= mem_f``.
    mem_limit : float64 array (S,)
        Memory available for activations on stage s (``inf`` = unlimited).
    pcie_groups : tuple[tuple[int, ...], ...]
        Stages whose host transfers (O/R) must not overlap.
    objective : str
        ``"stage_span"`` (default, OptPipe Eq. 3) or ``"makespan"`` (OptPipe Eq. 4).
    name : str
        Free-form label.
    """

    num_stages: int
    num_microbatches: int
    t_f: np.ndarray
    t_b: np.ndarray
    t_w: np.ndarray
    t_comm: np.ndarray
    t_offload: np.ndarray
    mem_f: np.ndarray
    mem_b: np.ndarray
    mem_w: np.ndarray
    offload_bytes: np.ndarray
    mem_limit: np.ndarray
    pcie_groups: tuple[tuple[int, ...], ...] = ()
    objective: str = "stage_span"
    name: str = "problem"

    @classmethod
    def create(
        cls,
        *,
        num_stages: int,
        num_microbatches: int,
        t_f: float | Sequence[float],
        t_b: float | Sequence[float],
        t_w: float | Sequence[float],
        t_comm: float | Sequence[float] = 0.0,
        t_offload: float | Sequence[float] = 0.0,
        mem_f: float | Sequence[float] = 1.0,
        mem_b: float | Sequence[float] | None = None,
        mem_w: float | Sequence[float] | None = None,
        offload_bytes: float | Sequence[float] | None = None,
        mem_limit: float | Sequence[float] = math.inf,
        pcie_groups: Sequence[Sequence[int]] = (),
        objective: str = "stage_span",
        name: str = "problem",
    ) -> "ScheduleProblem":
        """Build and validate a problem; scalars are broadcast to every stage.

        Defaults: ``mem_b = -mem_f / 2``, ``mem_w = -mem_f - mem_b`` when not given (half of
        the stash freed by B, the rest by W), ``offload_bytes = mem_f``.

        Raises
        ------
        InputError
            On a negative or non-finite time, ``mem_f <= 0``, positive ``mem_b``/``mem_w``,
            deltas that do not sum to zero, ``offload_bytes`` outside ``[0, mem_f]``, a
            non-positive limit, a bad pcie group or an unknown objective.
        """
        S = _as_count(num_stages, "num_stages")
        M = _as_count(num_microbatches, "num_microbatches")
        if S < 1:
            raise InputError(f"num_stages must be >= 1, got {S}")
        if M < 1:
            raise InputError(f"num_microbatches must be >= 1, got {M}")

        def vec(val, key, length=S):
            if val is None:
                raise InputError(f"{key} is null: give a number or a list of {length} numbers")
            if np.ndim(val) == 0:
                try:
                    return np.full(length, float(val))
                except (TypeError, ValueError):
                    raise InputError(f"{key} must be a number or a list of numbers, got {val!r}") from None
            return _as_float_array(val, key, length)

        t_f_a, t_b_a, t_w_a = vec(t_f, "t_f"), vec(t_b, "t_b"), vec(t_w, "t_w")
        t_comm_a = vec(t_comm, "t_comm", max(S - 1, 0))
        t_off_a = vec(t_offload, "t_offload")
        mem_f_a = vec(mem_f, "mem_f")
        for key, arr in (("t_f", t_f_a), ("t_b", t_b_a), ("t_w", t_w_a), ("mem_f", mem_f_a)):
            if np.any(np.isnan(arr)):
                raise InputError(f"{key} contains NaN: give finite numbers")
        mem_b_a = vec(mem_b, "mem_b") if mem_b is not None else -mem_f_a / 2.0
        mem_w_a = vec(mem_w, "mem_w") if mem_w is not None else -mem_f_a - mem_b_a
        off_a = vec(offload_bytes, "offload_bytes") if offload_bytes is not None else mem_f_a.copy()
        lim_a = vec(mem_limit, "mem_limit")
        for key, arr in (("t_f", t_f_a), ("t_b", t_b_a), ("t_w", t_w_a), ("t_comm", t_comm_a), ("t_offload", t_off_a)):
            _check_finite_nonneg(arr, key)
        for key, arr in (("mem_f", mem_f_a), ("mem_b", mem_b_a), ("mem_w", mem_w_a), ("offload_bytes", off_a)):
            if not np.all(np.isfinite(arr)):
                raise InputError(f"{key} must be finite, got {arr.tolist()}")
        if np.any(mem_f_a <= 0):
            raise InputError(f"mem_f must be > 0 on every stage (F allocates its stash), got {mem_f_a.tolist()}")
        if np.any(mem_b_a > 0) or np.any(mem_w_a > 0):
            raise InputError("mem_b and mem_w must be <= 0 (B and W free memory)")
        total = mem_f_a + mem_b_a + mem_w_a
        if np.any(np.abs(total) > 1e-9 * np.maximum(1.0, np.abs(mem_f_a))):
            s = int(np.argmax(np.abs(total)))
            raise InputError(
                f"stage {s}: mem_f + mem_b + mem_w = {total[s]:g}, must be 0 "
                "(everything F allocates is freed by B and W)"
            )
        if np.any(off_a < 0) or np.any(off_a > mem_f_a * (1 + 1e-12)):
            raise InputError("offload_bytes must lie in [0, mem_f] on every stage")
        if np.any(np.isnan(lim_a)) or np.any(lim_a <= 0):
            raise InputError(f"mem_limit must be > 0 on every stage, got {lim_a.tolist()}")
        groups = []
        if pcie_groups is None or isinstance(pcie_groups, (str, bytes)):
            raise InputError("pcie_groups must be a list of lists of stage indices")
        for g in pcie_groups:
            try:
                grp = tuple(_as_index(s) for s in g)
            except (TypeError, ValueError):
                raise InputError(f"pcie group {g!r} must be a list of integer stage indices") from None
            if any(not 0 <= s < S for s in grp):
                raise InputError(f"pcie group {list(grp)} names a stage outside 0..{S - 1}")
            groups.append(grp)
        if objective not in OBJECTIVES:
            raise InputError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        return cls(
            num_stages=S,
            num_microbatches=M,
            t_f=_freeze(t_f_a),
            t_b=_freeze(t_b_a),
            t_w=_freeze(t_w_a),
            t_comm=_freeze(t_comm_a),
            t_offload=_freeze(t_off_a),
            mem_f=_freeze(mem_f_a),
            mem_b=_freeze(mem_b_a),
            mem_w=_freeze(mem_w_a),
            offload_bytes=_freeze(off_a),
            mem_limit=_freeze(lim_a),
            pcie_groups=tuple(groups),
            objective=objective,
            name=str(name),
        )

    def duration(self, stage: int, op_type: str) -> float:
        """Duration of one op of ``op_type`` (F, B, W, O or R) on ``stage``."""
        if op_type == "F":
            return float(self.t_f[stage])
        if op_type == "B":
            return float(self.t_b[stage])
        if op_type == "W":
            return float(self.t_w[stage])
        if op_type in ("O", "R"):
            return float(self.t_offload[stage])
        raise InputError(f"unknown op type {op_type!r}; expected one of {OP_TYPES}")

    def comm(self, boundary: int) -> float:
        """Transfer time between stage ``boundary`` and ``boundary + 1``."""
        return float(self.t_comm[boundary])

    def with_objective(self, objective: str) -> "ScheduleProblem":
        """A copy with another objective."""
        return ScheduleProblem.create(**{**self._create_kwargs(), "objective": objective})

    def _create_kwargs(self) -> dict[str, Any]:
        return dict(
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            t_f=self.t_f,
            t_b=self.t_b,
            t_w=self.t_w,
            t_comm=self.t_comm,
            t_offload=self.t_offload,
            mem_f=self.mem_f,
            mem_b=self.mem_b,
            mem_w=self.mem_w,
            offload_bytes=self.offload_bytes,
            mem_limit=self.mem_limit,
            pcie_groups=self.pcie_groups,
            objective=self.objective,
            name=self.name,
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``fxpipe.schedproblem/1`` document; an infinite limit is written as null."""
        doc: dict[str, Any] = {"format": SCHEDPROBLEM_FORMAT}
        for key, val in self._create_kwargs().items():
            if isinstance(val, np.ndarray):
                val = val.tolist()
            doc[key] = val
        doc["mem_limit"] = [None if math.isinf(x) else x for x in self.mem_limit.tolist()]
        doc["pcie_groups"] = [list(g) for g in self.pcie_groups]
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str = "problem") -> "ScheduleProblem":
        """Parse a ``fxpipe.schedproblem/1`` document (null limits mean unlimited).

        Raises
        ------
        InputError
            If a key is missing or a value is invalid (message names the key).
        """
        if not isinstance(doc, Mapping):
            raise InputError(f"{source}: expected a JSON object")
        fmt = doc.get("format", SCHEDPROBLEM_FORMAT)
        if fmt != SCHEDPROBLEM_FORMAT:
            raise InputError(f"{source}: format is {fmt!r}, expected {SCHEDPROBLEM_FORMAT!r}")
        kwargs = {k: v for k, v in doc.items() if k != "format"}
        for key in ("num_stages", "num_microbatches", "t_f", "t_b", "t_w"):
            if key not in kwargs:
                raise InputError(f"{source}: missing required key {key!r}")
        lim = kwargs.get("mem_limit", math.inf)
        if lim is None:
            lim = math.inf
        elif isinstance(lim, list):
            lim = [math.inf if x is None else x for x in lim]
        kwargs["mem_limit"] = lim
        known = {
            "num_stages", "num_microbatches", "t_f", "t_b", "t_w", "t_comm", "t_offload", "mem_f",
            "mem_b", "mem_w", "offload_bytes", "mem_limit", "pcie_groups", "objective", "name",
        }
        kwargs = {k: v for k, v in kwargs.items() if k in known}  # unknown keys are ignored
        try:
            return cls.create(**kwargs)
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ScheduleProblem":
        """Read a ``fxpipe.schedproblem/1`` JSON file (raises InputError on bad input)."""
        return cls.from_dict(read_json(path, "problem file"), source=str(path))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the problem as JSON, atomically."""
        return write_json_atomic(path, self.to_dict())


@dataclass(frozen=True)
class ScheduledOp:
    """One timed op of a schedule: ``type`` in F, B, W, O, R on ``stage`` for ``microbatch``."""

    stage: int
    microbatch: int
    type: str
    start_s: float
    end_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "microbatch": self.microbatch,
            "type": self.type,
            "start_s": self.start_s,
            "end_s": self.end_s,
        }

    def __str__(self) -> str:  # torch's action vocabulary: "2F0" = stage 2, forward, micro-batch 0
        return f"{self.stage}{self.type}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """A timed schedule: Contract 3 result half (``fxpipe.schedule/1``).

    Attributes
    ----------
    ops : tuple[ScheduledOp, ...]
        Every op, sorted by (start_s, stage, type, microbatch).
    makespan : float
        Latest end minus earliest start (OptPipe Eq. 4).
    stage_span : float
        Largest per-stage span, first F start to last W end (OptPipe Eq. 3).
    lower_bound_s : float
        Best proven lower bound on the problem's objective (0 when none is known).
    status : str
        ``"heuristic"``, ``"optimal"``, ``"timelimit"``, ``"feasible"``, ...
    solver_time_s : float
        Wall time spent producing the schedule.
    method : str
        Generator name (``"1f1b"``, ``"zb-h1"``, ``"milp"``, ...).
    objective : str
        The objective ``lower_bound_s`` refers to.
    meta : dict
        Extra facts (gap, nodes, incumbents, ...).
    """

    ops: tuple[ScheduledOp, ...]
    makespan: float
    stage_span: float
    lower_bound_s: float = 0.0
    status: str = "heuristic"
    solver_time_s: float = 0.0
    method: str = ""
    objective: str = "stage_span"
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def value(self) -> float:
        """The value of the schedule's objective."""
        return self.stage_span if self.objective == "stage_span" else self.makespan

    def ops_of_stage(self, stage: int) -> list[ScheduledOp]:
        """Ops of one stage in start-time order."""
        return sorted(
            (o for o in self.ops if o.stage == stage), key=lambda o: (o.start_s, _TYPE_RANK.get(o.type, 9), o.microbatch)
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``fxpipe.schedule/1`` document."""
        return {
            "format": SCHEDULE_FORMAT,
            "method": self.method,
            "objective": self.objective,
            "makespan": self.makespan,
            "stage_span": self.stage_span,
            "lower_bound_s": self.lower_bound_s,
            "status": self.status,
            "solver_time_s": self.solver_time_s,
            "meta": self.meta,
            "ops": [o.to_dict() for o in self.ops],
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str = "schedule") -> "Schedule":
        """Parse a ``fxpipe.schedule/1`` document.

        Raises
        ------
        InputError
            If keys are missing or an op is malformed.
        """
        if not isinstance(doc, Mapping) or "ops" not in doc:
            raise InputError(f"{source}: expected a JSON object with 'ops'")
        if not isinstance(doc["ops"], list):
            raise InputError(f"{source}: 'ops' must be a list of ops")
        ops = []
        for i, o in enumerate(doc["ops"]):
            try:
                op = ScheduledOp(int(o["stage"]), int(o["microbatch"]), str(o["type"]), float(o["start_s"]), float(o["end_s"]))
            except (KeyError, TypeError, ValueError):
                raise InputError(f"{source}: ops[{i}] is malformed: {o!r:.200}") from None
            if op.type not in OP_TYPES:
                raise InputError(f"{source}: ops[{i}] has type {op.type!r}; expected one of {OP_TYPES}")
            ops.append(op)
        if not isinstance(doc.get("meta", {}), Mapping):
            raise InputError(f"{source}: 'meta' must be an object")
        try:
            figures = {k: float(doc.get(k) or 0.0) for k in ("makespan", "stage_span", "lower_bound_s", "solver_time_s")}
        except (TypeError, ValueError):
            raise InputError(f"{source}: makespan, stage_span, lower_bound_s and solver_time_s must be numbers") from None
        return cls(
            ops=tuple(sort_ops(ops)),
            makespan=figures["makespan"],
            stage_span=figures["stage_span"],
            lower_bound_s=figures["lower_bound_s"],
            status=str(doc.get("status", "")),
            solver_time_s=figures["solver_time_s"],
            method=str(doc.get("method", "")),
            objective=str(doc.get("objective", "stage_span")),
            meta=dict(doc.get("meta", {})),
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Schedule":
        """Read a ``fxpipe.schedule/1`` JSON file."""
        return cls.from_dict(read_json(path, "schedule file"), source=str(path))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the schedule as JSON, atomically."""
        return write_json_atomic(path, self.to_dict())


_TYPE_RANK = {t: i for i, t in enumerate(OP_TYPES)}


def sort_ops(ops: Iterable[ScheduledOp]) -> list[ScheduledOp]:
    """Ops sorted by (start_s, stage, type F<B<W<O<R, microbatch): the canonical order."""
    return sorted(ops, key=lambda o: (o.start_s, o.stage, _TYPE_RANK.get(o.type, 9), o.microbatch))
