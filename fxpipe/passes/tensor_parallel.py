"""Tensor-parallel sharding found on the captured graph, structurally (not by module names).

:func:`find_tensor_parallel` walks an exported graph once, in program order, and finds the
patterns of Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", Sec. 3) and of sequence parallelism (Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.2.2):

* **column then row parallel matmuls.** A matmul whose weight is a parameter (``aten.linear``,
  ``aten.addmm`` / ``aten.mm`` / ``aten.matmul`` with a 2-D parameter) and whose input is not
  sharded is a *column* candidate: its weight is split along its output features
  (``Shard(0)`` of a ``[out, in]`` linear weight, ``Shard(1)`` of an ``[in, out]`` one, the bias
  along its only dim), so its output is sharded along the last dim. That shard is propagated
  through the ops that follow (elementwise ops, views and reshapes, transposes, batched matmuls,
  softmax over another dim, slices and concatenations along other dims, ...; see
  :func:`_sharded_rule`) until it reaches the input features of another parameter matmul: the
  *row* (weight ``Shard(1)`` of ``[out, in]``, ``Shard(0)`` of ``[in, out]``, bias replicated)
  whose output is a partial sum, reduced where it leaves the block. Columns whose shards meet
  (``q @ k^T``, ``silu(gate) * up``) form one *region*; attention is such a region (the
  softmax inside), an MLP another. Reshapes that split the sharded width into ``(heads,
  head_dim)`` record the head count, the unit the shard must not cut (``units``); grouped-query
  attention records its kv heads on the k / v columns.
* **vocab-parallel embedding** (``aten.embedding`` with a parameter table: ``Shard(0)`` over the
  vocabulary, a partial sum reduced at once) and **output projection** (a column whose shard
  reaches the model's output: all-gathered there, the vocabulary again the unit).
* **sequence parallelism**: the ops outside the regions that work token by token (norms,
  dropout, residual additions, dtype casts: every op the same rules keep sharded along dim 1)
  and are reached from a region's reduced output (the residual stream) run on the sequence
  shard (``Shard(1)``, torchtitan's ``SequenceParallel``); a region's partial output is then
  reduce-scattered instead of all-reduced, and its input all-gathered.

* **shape-only reads**: an op whose value is a static empty vector (shape ``(0,)``) reads no
  element of its inputs, only their dtype and device, so it is the same on every rank whatever
  their placement. :mod:`fxpipe.passes.duplicate_constants` ties each layer's copy of a constant
  to the layer through one (``as_strided(h, [0], [1], 0)`` of an input ``h`` of the layer's first
  reader, in an attention layer the head-sharded query): such a node gets the role ``shape``, is
  replicated without cutting the region it reads from, and the runtime computes it on the local
  tensor of its input (no communication, no cost change).

Everything else stays replicated (every tensor-parallel rank computes it whole). A column
whose shard reaches an op the rules do not know (a layer norm over the sharded dim, a
``topk``, a custom op such as transformers' ``grouped_mm_fallback``), or that leaves its block
other than through a row matmul or the model output, is *rejected* with the reason
(:attr:`TensorParallelStructure.rejected`), and its whole region stays replicated:
convolutions, MoE experts and routers, fused QKV projections split along the sharded width.

The result is torch-free plain data, independent of the degree: per node a role (``column``,
``row``, ``sharded``, ``sequence``, ``shape``; other replicated nodes have none) and region, per region its
columns and rows (each parameter's shard dim) and units. :mod:`fxpipe.mesh.tensor_parallel`
resolves it for a degree ``tp`` (which regions divide evenly, grouped-query attention with
fewer kv heads than ``tp`` replicating k and v, the placements of every parameter), for the
planner and the plan file; :mod:`fxpipe.codegen.tensor_parallel` runs it on DTensor. The
OpGraph carries it: ``extra[i]["tp_role"]`` / ``extra[i]["tp_region"]`` and
``graph.meta["tensor_parallel"]`` (:func:`fxpipe.passes.to_opgraph.to_opgraph`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx

from fxpipe.passes.structure import module_path

__all__ = ["TP_FORMAT", "ROLE_KEY", "REGION_KEY", "META_KEY", "TensorParallelStructure", "find_tensor_parallel",
           "reads_no_value"]

#: Version of the plain-data record (``graph.meta["tensor_parallel"]["format"]``).
TP_FORMAT = 1
#: OpGraph ``extra`` keys of a node's role and region; ``graph.meta`` key of the record.
ROLE_KEY, REGION_KEY, META_KEY = "tp_role", "tp_region", "tensor_parallel"

# ----------------------------------------------------------------------------- op tables (aten names)
_UNARY = frozenset("""
abs neg relu silu gelu tanh sigmoid exp log sqrt rsqrt sin cos erf reciprocal square sign softplus hardtanh
leaky_relu elu mish hardswish hardsigmoid log_sigmoid clone contiguous alias detach lift_fresh_copy to
_to_copy type_as dropout native_dropout clamp clamp_min clamp_max pow relu_ silu_ gelu_ tanh_ sigmoid_
mul_ div_ add_ sub_ neg_ clamp_ dropout_ feature_dropout alpha_dropout _assert_tensor_metadata
""".split())
_BINARY = frozenset("""
add sub mul div where maximum minimum masked_fill eq ne gt lt ge le logical_and logical_or bitwise_and
__and__ __or__ rsub true_divide floor_divide remainder fmod atan2 copysign pow
""".split())
_VIEWS = frozenset("view reshape _unsafe_view view_as reshape_as".split())
_NORMS = frozenset("native_layer_norm layer_norm rms_norm _fused_rms_norm".split())


def _opname(node: torch.fx.Node) -> str:
    """The aten op name of a node (``"linear"``, ``"add_"``), ``"getitem"``, or ``""``."""
    t = node.target
    if t is operator.getitem:
        return "getitem"
    name = getattr(t, "name", None)
    if callable(name):
        try:
            text = name()
        except TypeError:
            text = ""
        if "::" in text:
            return text.split("::", 1)[1].split(".")[0]
    return ""


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    v = _val(node)
    if not isinstance(v, torch.Tensor):
        return None
    if not all(isinstance(d, int) for d in v.shape):
        return None  # symbolic or data-dependent sizes: no static sharding decision (int() would guard)
    return tuple(v.shape)


# ----------------------------------------------------------------------------- propagation states
@dataclass(frozen=True)
class _Sh:
    """A tensor sharded along ``dim`` into ``units`` equal atoms, derived from the columns ``origins``."""

    dim: int
    units: int
    origins: frozenset


@dataclass(frozen=True)
class _Partial:
    """A row's (or vocab-parallel embedding's) partial sum: reduced where it is used."""

    origins: frozenset


@dataclass(frozen=True)
class _Fail:
    origins: frozenset


@dataclass
class _Column:
    node: str
    params: dict  # fqn -> shard dim
    units: list = field(default_factory=list)  # [what, count]
    embedding: bool = False
    failure: str = ""


@dataclass(frozen=True)
class TensorParallelStructure:
    """Where a graph's ops can be split across tensor-parallel ranks (plain data; see the module docstring).

    Attributes
    ----------
    roles : dict[str, str]
        fx node name -> ``"column"``, ``"row"``, ``"sharded"`` (inside a column / row region),
        ``"sequence"`` (sequence parallel) or ``"shape"`` (replicated, a static empty vector read
        from its inputs' local tensors: :func:`reads_no_value`); nodes left out are replicated.
    node_region : dict[str, int]
        Node name -> region id, for the nodes of a region.
    regions : list[dict]
        ``{"id", "kind" ("attention", "mlp", "embedding", "output"), "module", "columns": [{"node",
        "params": {fqn: shard dim}, "units": [[what, count], ...]}], "rows": [{"node", "params":
        {fqn: shard dim or None (replicated bias)}, "columns": [indices of the columns feeding
        it]}], "gathered": bool}``: shard dims of the parameters in their own layout.
    rejected : list[dict]
        ``{"node", "module", "reason"}``: column candidates that stay replicated, and why.
    sequence_sizes : list[int]
        The sizes of dim 1 of the sequence-parallel values (each must divide by ``tp``).
    """

    roles: dict = field(default_factory=dict)
    node_region: dict = field(default_factory=dict)
    regions: list = field(default_factory=list)
    rejected: list = field(default_factory=list)
    sequence_sizes: list = field(default_factory=list)

    def meta(self) -> dict[str, Any]:
        """The graph-level record (``graph.meta["tensor_parallel"]``): format, regions, rejections, sequence sizes."""
        return {"format": TP_FORMAT, "regions": self.regions, "rejected": self.rejected,
                "sequence_sizes": self.sequence_sizes}


class _Finder:
    """One program-order walk (see :func:`find_tensor_parallel`)."""

    def __init__(self, gm: torch.fx.GraphModule, banned: Mapping[str, str] | None = None):
        self.gm = gm
        self.banned = dict(banned or {})  # column node -> why its region was rejected in an earlier walk
        self.prefix = gm.meta.get("fxpipe_module_prefix", "")
        canon: dict[int, str] = {}
        for fqn, p in gm.named_parameters():
            canon.setdefault(id(p), fqn)
        self.param_fqn: dict[str, str] = {}
        for fqn, p in gm.named_parameters(remove_duplicate=False):
            self.param_fqn[fqn] = canon[id(p)]
        self.state: dict[torch.fx.Node, Any] = {}
        self.columns: list[_Column] = []
        self.rows: list[dict] = []
        self.parent: list[int] = []
        self.gathered: set[int] = set()
        self.plain_param_use: dict[str, str] = {}  # fqn -> a node using it outside a matmul weight slot

    # ---- union-find over columns
    def _find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def _union(self, origins) -> None:
        roots = sorted({self._find(i) for i in origins})
        for r in roots[1:]:
            self.parent[r] = roots[0]

    def _param(self, node: Any) -> str | None:
        if isinstance(node, torch.fx.Node) and node.op == "get_attr":
            return self.param_fqn.get(str(node.target))
        return None

    def _new_column(self, node: torch.fx.Node, params: dict, units: list, embedding: bool = False) -> int:
        self.columns.append(_Column(node.name, params, units, embedding))
        self.parent.append(len(self.parent))
        return len(self.columns) - 1

    def _fail(self, origins, node: torch.fx.Node, why: str) -> _Fail:
        for c in origins:
            if not self.columns[c].failure:
                self.columns[c].failure = f"{why} (node {node.name}, {module_path(node, self.prefix) or 'top level'})"
        self._union(origins)
        return _Fail(frozenset(origins))

    def _add_units(self, st: _Sh) -> None:
        for c in st.origins:
            entry = ["heads", int(st.units)]
            if all(int(u[1]) != st.units for u in self.columns[c].units):
                self.columns[c].units.append(entry)

    # ---- parameter matmuls
    def _matmul_weight(self, node: torch.fx.Node) -> tuple[Any, str, int, int, Any] | None:
        """``(x, weight fqn, out dim, in dim, bias fqn or None)`` of a matmul with a 2-D parameter weight."""
        op, args = _opname(node), node.args
        if op == "linear" and len(args) >= 2:
            w = self._param(args[1])
            b = self._param(args[2]) if len(args) > 2 else None
            if w is not None and _shape(args[1]) is not None and len(_shape(args[1])) == 2:
                return args[0], w, 0, 1, b
        if op == "addmm" and len(args) >= 3:
            w = self._param(args[2])
            if w is not None and len(_shape(args[2]) or ()) == 2:
                return args[1], w, 1, 0, self._param(args[0])
        if op in ("mm", "matmul") and len(args) >= 2:
            w = self._param(args[1])
            if w is not None and len(_shape(args[1]) or ()) == 2:
                return args[0], w, 1, 0, None
        return None

    def _matmul(self, node: torch.fx.Node, mm) -> Any:
        x, w, out_dim, in_dim, b = mm
        sx = self.state.get(x) if isinstance(x, torch.fx.Node) else None
        out = _shape(node)
        if sx is None or isinstance(sx, (_Partial, _Fail)):  # a rejected shard is replicated in the next walk
            if out is None or not out or node.name in self.banned:
                return None
            params = {w: out_dim, **({b: 0} if b else {})}
            c = self._new_column(node, params, [["output features", int(out[-1])]])
            return _Sh(len(out) - 1, int(out[-1]), frozenset([c]))
        xs = _shape(x)
        if xs is None or sx.dim != len(xs) - 1:
            return self._fail(sx.origins, node, "a parameter matmul takes a tensor sharded along another dim than "
                                                "its input features")
        self.rows.append({"node": node.name, "params": {w: in_dim, **({b: None} if b else {})},
                          "columns": sorted(sx.origins)})
        self._union(sx.origins)
        return _Partial(sx.origins)

    # ---- the walk
    def run(self) -> None:
        for node in self.gm.graph.nodes:
            if node.op == "output":
                self._output(node)
                continue
            if node.op != "call_function":
                continue
            self._note_param_uses(node)
            if _opname(node) == "embedding" and self._param(node.args[0]) is not None and \
                    len(_shape(node.args[0]) or ()) == 2 and node.name not in self.banned:
                ids = self.state.get(node.args[1])
                if ids is None or isinstance(ids, _Partial):
                    vocab = int(_shape(node.args[0])[0])
                    c = self._new_column(node, {self._param(node.args[0]): 0}, [["vocabulary", vocab]], embedding=True)
                    self.state[node] = _Partial(frozenset([c]))
                    continue
            mm = self._matmul_weight(node)
            if mm is not None:
                self.state[node] = self._matmul(node, mm)
                continue
            if reads_no_value(node):
                continue  # replicated, whatever its inputs' placement (a layer's anchor: module docstring)
            # a rejected shard (_Fail) is read as replicated: the next walk, without its columns, makes it so
            ins = [self.state.get(a) for a in node.all_input_nodes]
            if not any(isinstance(s, (_Sh, tuple)) for s in ins):
                continue  # replicated (a partial sum is reduced before it is used)
            st = _sharded_rule(node, self.state)
            if st is None:
                origins = frozenset().union(*(_origins(s) for s in ins if isinstance(s, (_Sh, tuple))))
                st = self._fail(origins, node, f"{_opname(node) or node.target} on a sharded tensor has no "
                                               "tensor-parallel rule")
            elif isinstance(st, _Sh):
                self._union(st.origins)
                self._add_units(st)
            elif isinstance(st, tuple):
                self._union(frozenset().union(*(_origins(s) for s in st)))
            self.state[node] = st

    def _note_param_uses(self, node: torch.fx.Node) -> None:
        """Parameters read outside a matmul's weight slot (a tied weight used raw) cannot be sharded."""
        mm = self._matmul_weight(node)
        emb = _opname(node) == "embedding"
        for i, a in enumerate(node.args):
            fqn = self._param(a)
            if fqn is None:
                continue
            weight_slot = (emb and i == 0) or (mm is not None and fqn in (mm[1], mm[4]))
            if not weight_slot:
                self.plain_param_use.setdefault(fqn, node.name)

    def _output(self, node: torch.fx.Node) -> None:
        for a in node.all_input_nodes:
            st = self.state.get(a)
            if isinstance(st, _Sh):
                self.gathered |= {self._find(c) for c in st.origins}

    # ---- results
    def regions(self) -> tuple[list[dict], list[dict], dict[int, int]]:
        groups: dict[int, list[int]] = {}
        for c in range(len(self.columns)):
            groups.setdefault(self._find(c), []).append(c)
        rows_of: dict[int, list[dict]] = {}
        for r in self.rows:
            rows_of.setdefault(self._find(r["columns"][0]), []).append(r)
        gathered = {self._find(c) for c in self.gathered}
        regions, rejected, region_of_root = [], [], {}
        for root, cols in sorted(groups.items(), key=lambda kv: min(kv[1])):
            why = next((self.columns[c].failure for c in cols if self.columns[c].failure), "")
            rows = rows_of.get(root, [])
            embedding = any(self.columns[c].embedding for c in cols)
            if not why and not rows and not embedding and root not in gathered:
                why = "its shard reaches no row-parallel matmul and no model output"
            params = {f for c in cols for f in self.columns[c].params} | {f for r in rows for f in r["params"]}
            used = next((f"parameter {f} is also read by node {self.plain_param_use[f]}" for f in sorted(params)
                         if f in self.plain_param_use), "")
            why = why or used
            first = self.columns[cols[0]].node
            if why:
                rejected.append({"node": first, "module": self._module_of(first), "reason": why})
                continue
            index = {c: i for i, c in enumerate(cols)}
            kind = "embedding" if embedding else ("attention" if self._has_softmax(root) else
                                                  ("mlp" if rows else "output"))
            region_of_root[root] = len(regions)
            paths = [self._module_of(self.columns[c].node) for c in cols] + [self._module_of(r["node"]) for r in rows]
            regions.append({
                "id": len(regions), "kind": kind, "module": _common_module(paths),
                "columns": [{"node": self.columns[c].node, "params": dict(self.columns[c].params),
                             "units": [list(u) for u in self.columns[c].units]} for c in cols],
                "rows": [{"node": r["node"], "params": dict(r["params"]),
                          "columns": sorted({index[c] for c in r["columns"] if c in index})} for r in rows],
                "gathered": root in gathered,
            })
        return regions, rejected, region_of_root

    def _module_of(self, name: str) -> str:
        node = self._nodes_by_name().get(name)
        return module_path(node, self.prefix) if node is not None else ""

    def _nodes_by_name(self) -> dict[str, torch.fx.Node]:
        if not hasattr(self, "_by_name"):
            self._by_name = {n.name: n for n in self.gm.graph.nodes}
        return self._by_name

    def _has_softmax(self, root: int) -> bool:
        return any(_opname(n) in ("softmax", "_softmax", "_safe_softmax", "scaled_dot_product_attention")
                   for n, st in self.state.items() if isinstance(st, _Sh) and self._find(next(iter(st.origins))) == root)


def _common_module(paths: list[str]) -> str:
    """The longest dotted prefix of module paths (``model.layers.0.self_attn`` of its q / k / v / o projections)."""
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) or parts[0][0]


def _origins(st: Any) -> frozenset:
    if isinstance(st, tuple):
        return frozenset().union(*(_origins(s) for s in st))
    return getattr(st, "origins", frozenset())


# ----------------------------------------------------------------------------- rules
def reads_no_value(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value is a static empty vector (a tensor of shape ``(0,)``) computed from tensors.

    Such a value holds no element: the op reads nothing of its inputs but their dtype and device
    (:mod:`fxpipe.passes.duplicate_constants`' anchor ``as_strided(h, [0], [1], 0)`` and its
    ``view(dtype)``), and computing it from a rank's shard of an input gives the same empty
    vector as from the whole. Only the 1-D shape ``(0,)`` counts: a higher-dimensional empty
    tensor may keep a sharded dim's size (``h[:, :0]``), which differs between the whole tensor
    and a rank's shard.
    """
    return node.op == "call_function" and _shape(node) == (0,) and any(
        isinstance(_val(a), torch.Tensor) for a in node.all_input_nodes)


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _view_map(src: tuple[int, ...], dst: tuple[int, ...], d: int) -> tuple[int, int] | None:
    """Where dim ``d`` of ``src`` goes when viewed as ``dst``: ``(out dim, units factor)`` or None.

    The dims are grouped (equal products); the shard must be on the first dim of its group.
    ``units factor`` is the size of the first output dim of a split group (the new atom count),
    0 when the group maps one to one or merges (the units are kept).
    """
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [i], [j]
        a = src[i] if i < len(src) else 1
        b = dst[j] if j < len(dst) else 1
        while a != b:
            if a < b:
                i += 1
                if i >= len(src):
                    return None
                a *= src[i]
                gi.append(i)
            else:
                j += 1
                if j >= len(dst):
                    return None
                b *= dst[j]
                gj.append(j)
        # skip size-1 dims on either side of a one-to-one group
        if d in gi:
            real_i = [k for k in gi if src[k] != 1]
            real_j = [k for k in gj if dst[k] != 1]
            if not real_i or real_i[0] != d:
                return None
            if len(real_i) == 1 and len(real_j) == 1:
                return real_j[0], 0
            if len(real_i) == 1:  # split: the shard lands on the first (outer) output dim
                return real_j[0], dst[real_j[0]]
            if len(real_j) == 1:  # merge: the shard is on the outer input dim
                return real_j[0], 0
            return None
        i, j = gi[-1] + 1, gj[-1] + 1
    return None


def _sharded_rule(node: torch.fx.Node, state: Mapping[torch.fx.Node, Any]) -> Any:
    """The shard of ``node``'s output given its inputs' (at least one sharded), or None (no rule).

    Returns a :class:`_Sh`, a tuple of them (an op with several outputs, read by ``getitem``) or
    None. The rules keep exactly what DTensor computes without communication from a ``Shard``
    input and ``Replicate`` others: a shard along a dim the op does not mix.
    """
    op = _opname(node)
    out = _shape(node)
    args = node.args
    st0 = state.get(args[0]) if args and isinstance(args[0], torch.fx.Node) else None
    if op == "getitem":
        return st0[args[1]] if isinstance(st0, tuple) and isinstance(args[1], int) and args[1] < len(st0) else None
    if op == "_assert_tensor_metadata":
        return st0 if isinstance(st0, _Sh) else None
    if op == "cat":
        return _cat_rule(node, state)
    if op.endswith("_") and not op.startswith("_") and not isinstance(st0, _Sh):
        return None  # an in-place update of a replicated tensor by a shard
    if op == "native_dropout":
        st = _binary(node, state, _shape(args[0]))
        return (st, st) if st is not None else None
    if op in _UNARY or op in _BINARY:
        return _binary(node, state, out)
    if op in ("matmul", "bmm"):
        return _matmul_rule(node, state, out)
    if op == "scaled_dot_product_attention":
        return _attention_rule(node, state, out)
    if not isinstance(st0, _Sh) or any(isinstance(state.get(a), (_Sh, tuple)) for a in node.all_input_nodes[1:]):
        return None
    src = _shape(args[0])
    if src is None:
        return None
    nd = len(src)
    if op in ("split", "split_with_sizes", "chunk"):
        d = _dim(int(args[2]) if len(args) > 2 else int(node.kwargs.get("dim", 0)), nd)
        n = len(_val(node)) if isinstance(_val(node), (list, tuple)) else 0
        return tuple([st0] * n) if n and d != st0.dim else None
    if op in _NORMS:
        norm = args[1] if len(args) > 1 else ()
        k = len(norm) if isinstance(norm, (list, tuple)) else 1
        if st0.dim >= nd - k:
            return None
        return (st0, st0, st0) if op in ("native_layer_norm", "_fused_rms_norm") else st0
    if out is None:
        return None
    return _shape_rule(op, node, st0, src, out)


def _shape_rule(op: str, node: torch.fx.Node, st0: _Sh, src: tuple[int, ...], out: tuple[int, ...]) -> _Sh | None:
    """Views, transposes, slices, reductions and softmax of a sharded tensor (one tensor input)."""
    args, nd = node.args, len(src)
    if op in _VIEWS:
        m = _view_map(src, out, st0.dim)
        if m is None:
            return None
        d, units = m
        return _Sh(d, units or st0.units, st0.origins)
    if op in ("transpose", "swapaxes"):
        a, b = _dim(int(args[1]), nd), _dim(int(args[2]), nd)
        return _Sh(b if st0.dim == a else a if st0.dim == b else st0.dim, st0.units, st0.origins)
    if op == "t":
        return _Sh(1 - st0.dim, st0.units, st0.origins) if nd == 2 else st0
    if op == "permute":
        perm = [_dim(int(p), nd) for p in args[1]]
        return _Sh(perm.index(st0.dim), st0.units, st0.origins)
    if op == "unsqueeze":
        d = _dim(int(args[1]), nd + 1)
        return _Sh(st0.dim + (1 if d <= st0.dim else 0), st0.units, st0.origins)
    if op == "squeeze":
        given = args[1] if len(args) > 1 else list(range(nd))
        dims = [_dim(int(x), nd) for x in (given if isinstance(given, (list, tuple)) else [given])]
        dims = [d for d in dims if src[d] == 1]
        return None if st0.dim in dims else _Sh(st0.dim - sum(1 for d in dims if d < st0.dim), st0.units, st0.origins)
    if op == "expand":
        d = st0.dim + len(out) - nd
        return _Sh(d, st0.units, st0.origins) if out[d] == src[st0.dim] else None
    if op in ("slice", "select", "narrow", "index_select"):
        d = _dim(int(args[1]) if len(args) > 1 else 0, nd)
        if d == st0.dim:
            return None
        return _Sh(st0.dim - (1 if op == "select" and d < st0.dim else 0), st0.units, st0.origins)
    if op in ("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", "cumsum"):
        return st0 if _dim(int(args[1]), nd) != st0.dim else None
    if op in ("sum", "mean", "amax", "amin", "var", "std"):
        if len(args) < 2 or args[1] is None:
            return None
        dims = [_dim(int(x), nd) for x in (args[1] if isinstance(args[1], (list, tuple)) else [args[1]])]
        keep = bool(args[2]) if len(args) > 2 else bool(node.kwargs.get("keepdim", False))
        if st0.dim in dims:
            return None
        return _Sh(st0.dim if keep else st0.dim - sum(1 for d in dims if d < st0.dim), st0.units, st0.origins)
    return None


def _binary(node: torch.fx.Node, state: Mapping[torch.fx.Node, Any], out: tuple[int, ...] | None) -> Any:
    """Broadcasting elementwise op: every sharded operand maps to the same output dim; replicated ones are sliced."""
    if out is None:
        return None
    target = None
    units, origins = [], frozenset()
    for a in node.args:
        st = state.get(a) if isinstance(a, torch.fx.Node) else None
        if isinstance(st, tuple):
            return None
        if not isinstance(st, _Sh):  # replicated (a partial sum is reduced first, a rejected shard replicated)
            continue
        shp = _shape(a)
        if shp is None:
            return None
        d = st.dim + len(out) - len(shp)
        if target is not None and d != target:
            return None
        if out[d] != shp[st.dim]:
            return None
        target = d
        units.append(st.units)
        origins |= st.origins
    if target is None:
        return None
    return _Sh(target, max(units), origins)


def _matmul_rule(node: torch.fx.Node, state: Mapping[torch.fx.Node, Any], out: tuple[int, ...] | None) -> Any:
    """Batched matmul of two activations: the shard must be on a batch dim (both, or one side with the other replicated)."""
    a, b = node.args[0], node.args[1]
    sa, sb = state.get(a), state.get(b)
    sa_shape, sb_shape = _shape(a), _shape(b)
    if out is None or sa_shape is None or sb_shape is None or len(sa_shape) < 3 or len(sb_shape) < 3:
        return None
    dims, origins, units = set(), frozenset(), []
    for st, shp in ((sa, sa_shape), (sb, sb_shape)):
        if isinstance(st, _Sh):
            if st.dim >= len(shp) - 2:
                return None
            dims.add(st.dim + len(out) - len(shp))
            origins |= st.origins
            units.append(st.units)
        elif isinstance(st, tuple):
            return None
    if len(dims) != 1:
        return None
    return _Sh(dims.pop(), max(units), origins)


def _attention_rule(node: torch.fx.Node, state: Mapping[torch.fx.Node, Any], out: tuple[int, ...] | None) -> Any:
    """``scaled_dot_product_attention(q, k, v, mask, ...)`` split over the heads (dim 1 of ``[B, H, S, D]``).

    Every sharded operand (q, k, v, the mask) must be sharded along dim 1; a replicated k / v
    (grouped-query attention with fewer kv heads than ``tp``) or mask is sliced locally.
    """
    if out is None or len(out) != 4:
        return None
    gqa = node.kwargs.get("enable_gqa", node.args[7] if len(node.args) > 7 else False)
    if gqa and (_shape(node.args[1]) or (0, 0))[1] != out[1]:
        return None  # kv heads grouped inside the op: a replicated k / v could not be sliced to the local query heads
    units, origins = [], frozenset()
    for a in list(node.args[:4]) + [node.kwargs.get("attn_mask")]:
        st = state.get(a) if isinstance(a, torch.fx.Node) else None
        if isinstance(st, tuple):
            return None
        if not isinstance(st, _Sh):
            continue
        if st.dim != 1 or len(_shape(a) or ()) != 4:
            return None
        units.append(st.units)
        origins |= st.origins
    if not isinstance(state.get(node.args[0]), _Sh):
        return None  # the query's heads carry the shard
    return _Sh(1, max(units), origins)


def _cat_rule(node: torch.fx.Node, state: Mapping[torch.fx.Node, Any]) -> Any:
    tensors = node.args[0]
    out = _shape(node)
    if out is None or not isinstance(tensors, (list, tuple)):
        return None
    d = _dim(int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0)), len(out))
    sts = [state.get(t) for t in tensors]
    if not all(isinstance(s, _Sh) for s in sts) or len({s.dim for s in sts}) != 1 or sts[0].dim == d:
        return None
    return _Sh(sts[0].dim, max(s.units for s in sts), frozenset().union(*(s.origins for s in sts)))


# ----------------------------------------------------------------------------- sequence parallelism
def _sequence_nodes(gm: torch.fx.GraphModule, finder: _Finder, region_of_root: Mapping[int, int]) -> tuple[dict, list]:
    """Nodes outside the regions that work token by token on dim 1 and are reached from a region's reduced output."""
    in_region = set()
    seeds = []
    for n, st in finder.state.items():
        roots = {finder._find(c) for c in _origins(st)} if not isinstance(st, _Fail) else set()
        if roots and all(r in region_of_root for r in roots):
            if isinstance(st, _Partial):
                seeds.append(n)
            else:
                in_region.add(n)
    seq: dict[torch.fx.Node, Any] = {}
    sizes: set[int] = set()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    frontier = sorted(seeds, key=order.get)
    state: dict[torch.fx.Node, Any] = {}
    for n in frontier:
        shp = _shape(n)
        if shp is not None and len(shp) >= 3:
            state[n] = _Sh(1, shp[1], frozenset())
    for node in gm.graph.nodes:  # program order: inputs before consumers
        if node in state or node.op != "call_function" or node in in_region:
            continue
        if finder._matmul_weight(node) is not None or _opname(node) == "embedding":
            continue
        if not any(isinstance(state.get(a), (_Sh, tuple)) for a in node.all_input_nodes):
            continue
        st = _sharded_rule(node, state)
        ok = isinstance(st, _Sh) and st.dim == 1 or (isinstance(st, tuple) and all(
            isinstance(s, _Sh) and s.dim == 1 for s in st))
        if not ok:
            continue
        shp = _shape(node)
        if isinstance(st, _Sh) and (shp is None or len(shp) < 3):
            continue
        state[node] = st
        seq[node] = st
        if shp is not None and len(shp) >= 2:
            sizes.add(int(shp[1]))
    # an op with no value (an assert) or a getitem follows its input
    return {n.name: "sequence" for n in seq}, sorted(sizes)


def find_tensor_parallel(gm: torch.fx.GraphModule) -> TensorParallelStructure:
    """Find the tensor-parallel patterns of a captured graph (see the module docstring).

    Parameters
    ----------
    gm : torch.fx.GraphModule
        The unlifted exported graph (:func:`fxpipe.passes.capture.capture`): parameters are
        ``get_attr`` nodes, every node has ``meta["val"]``.

    Returns
    -------
    TensorParallelStructure
        Plain data, the same for every capture of the same model (it reads the structure and
        shapes only); node names are ``gm``'s.
    """
    banned: dict[str, str] = {}
    while True:  # a rejected region's values are replicated: walk again without its columns
        finder = _Finder(gm, banned)
        finder.run()
        failed = {c.node: c.failure for c in finder.columns if c.failure}
        if not failed:
            break
        banned.update(failed)
    regions, rejected, region_of_root = finder.regions()
    by_name = {n.name: n for n in gm.graph.nodes}
    rejected = [{"node": n, "module": module_path(by_name[n], finder.prefix), "reason": why}
                for n, why in banned.items()] + rejected
    roles: dict[str, str] = {}
    node_region: dict[str, int] = {}
    column_nodes = {c["node"] for r in regions for c in r["columns"]}
    row_nodes = {w["node"] for r in regions for w in r["rows"]}
    for n, st in finder.state.items():
        if isinstance(st, _Fail):
            continue
        roots = {finder._find(c) for c in _origins(st)}
        if not roots or not all(r in region_of_root for r in roots):
            continue
        rid = region_of_root[next(iter(roots))]
        if isinstance(st, _Partial) and n.name not in row_nodes and n.name not in column_nodes:
            continue
        node_region[n.name] = rid
        roles[n.name] = "column" if n.name in column_nodes else ("row" if n.name in row_nodes else "sharded")
    # asserts of sharded values (no value of their own) run where their input runs
    for node in gm.graph.nodes:
        if _opname(node) == "_assert_tensor_metadata" and node.args and getattr(node.args[0], "name", None) in node_region:
            node_region[node.name] = node_region[node.args[0].name]
            roles[node.name] = "sharded"
    seq, sizes = _sequence_nodes(gm, finder, region_of_root)
    for name in seq:
        roles.setdefault(name, "sequence")
    for node in gm.graph.nodes:
        if node.name not in roles and reads_no_value(node):
            roles[node.name] = "shape"  # computed from the local tensors of its inputs (module docstring)
    for node in gm.graph.nodes:
        if _opname(node) == "_assert_tensor_metadata" and node.args and roles.get(getattr(node.args[0], "name", "")) == "sequence":
            roles[node.name] = "sequence"
    return TensorParallelStructure(roles=roles, node_region=node_region, regions=regions, rejected=rejected,
                                   sequence_sizes=sizes if any(r == "sequence" for r in roles.values()) else [])
