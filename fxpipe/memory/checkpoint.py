"""Activation checkpointing as the field runs it: per-block and selective policies and their costs (torch-free).

A pipeline stage may keep fewer activations from its forward (F) to its backward (B) and replay
part of its forward during B instead. This module finds the repeated blocks of a costed
:class:`~fxpipe.ir.OpGraph`, derives for a stage (a set of its nodes) a small *menu* of
checkpoint policies with their costs, and is the one place that counts them; the schedule
problem (:class:`fxpipe.ir.CheckpointOption`, :meth:`~fxpipe.ir.ScheduleProblem.with_checkpoint`),
the partitioner's memory rule (:func:`partition_floor`), the planner and the plan file read
its figures.

Policies (:data:`CHECKPOINT_KINDS`)
-----------------------------------
``"none"``
    Stash everything (the stage as built: ``kept_bytes`` is the sum of its ``act_bytes``).
``"full"``
    One segment per block (the stage's part of each repeated block, split into runs that are
    contiguous in program order); B replays each segment as one unit (non-reentrant
    ``torch.utils.checkpoint``), F keeps only the segments' inputs. torchtitan's ``full`` AC,
    Megatron's full recomputation per layer (Korthikanti et al. 2022, Sec. 4).
``"selective"``
    The same segments, keeping the outputs of matmul and attention ops (torchtitan's op-level
    selective AC, ``_save_list``: ``mm`` and the SDPA kernels, with its rule of saving every
    other matmul: within a segment the 1st, 3rd, ... matmul-class op is kept, the 2nd, 4th, ...
    replayed; every attention op is kept). Korthikanti et al. 2022, Sec. 5. No policy keeps an
    output that a later in-place op may write (its replay would read the written value).
``"budget"``
    The same segments, the kept set chosen for a memory budget: the outputs whose replay costs
    most per byte kept, exactly (a 0/1 knapsack by dynamic programming over the stage's ops,
    their bytes rounded up to :data:`BUDGET_BUCKETS` buckets of the budget, as
    ``torch._functorch``'s ``activation_memory_budget`` solver ``dp_knapsack`` does; exact for
    bytes that are multiples of the bucket). Sources: Checkmate (Jain et al., MLSys 2020:
    the optimal rematerialization trade-off), AdaPipe (Sun et al., ASPLOS 2024: per-stage
    recomputation chosen with the pipeline), Mist (Zhu et al., EuroSys 2025: the memory /
    time knob co-optimised with parallelism).
``"stage"``
    The whole stage's forward is one segment: what plans before issue 28 called recompute.

Costs (per micro-batch; bytes from the same tensor sizes the memory model uses)
--------------------------------------------------------------------------------
Every node ``v`` saves some tensors for its backward: its ``act_bytes``, which the capture
attributes to the first node that saves a tensor, and (``graph.extra[v]["saved"]``, written by
:func:`fxpipe.passes.to_opgraph.to_opgraph`) the producers of every tensor it saves; bytes it
saves that are not the output of a node (a matmul's fresh copy of an operand) are its
*private* bytes. A graph without ``saved`` (a loaded OpGraph file, a hand-made graph) treats
every node's ``act_bytes`` as private. For a policy with segments ``S_i`` and kept sets ``K_i``:

* a tensor ``u`` (a node's output) is *kept* when a node outside every segment saves it, it is
  an input of a segment (produced outside it, in the stage, not a placeholder: the stage's
  received inputs are its pooled receive buffers, counted by the memory model, and model inputs
  are resident), or it is in a kept set; ``kept_bytes`` is the sum of the kept tensors'
  ``size_out_bytes`` (each once) plus the private bytes of the nodes outside every segment;
* ``replay_s = sum_i sum_{v in S_i \\ K_i} t_fwd_s[v]`` (SAC reruns every op not kept);
* segment i replays ``R_i``: the tensors its nodes save that are not kept (each once) plus its
  nodes' private bytes; ``replay_peak_bytes = max_i R_i``, the contract's figure (what a
  fused B holds beyond the kept stash while it replays the largest segment; gradients are not
  counted, as nowhere else in the memory model: the reserved fraction covers temporaries);
* ``w_bytes``: what a split backward holds from the end of B to W, the tensors saved by nodes
  that own parameters (their weight gradient needs them) plus those nodes' private bytes;
* the schedule's peak of B beyond the kept stash (:class:`fxpipe.ir.CheckpointOption`
  ``peak_bytes``): B walks the stage backwards; while it replays segment i it holds the kept
  tensors a node at or before ``S_i`` still needs, every kept tensor a W needs, the W inputs
  replayed by the segments after ``S_i`` and ``R_i``; the largest such sum (and at least
  ``w_bytes``) minus ``kept_bytes``.

``"none"`` has ``replay_s = 0``, ``replay_peak_bytes = 0`` and keeps everything; no policy
keeps more (every kept tensor is saved by someone or is an input of a segment, which the
segment's own savers... see :func:`stage_menu`; a tested property on random DAGs).

Blocks (:func:`find_blocks`)
----------------------------
Found on the graph, not by a model's names: every node's module path
(``graph.extra[i]["module"]``, e.g. ``model.layers.3.mlp.up_proj``,
``encoder.block.2.layer.1.DenseReluDense.wo``, ``vit.layers.5.attention``) is read as a chain
of containers and indices; a container (the path before an integer component) with at least
two indices holding compute (a matmul-class or attention op) is a stack of repeated blocks,
and every node belongs to the outermost such container's block on its path (so the experts of
an MoE layer or the sub-layers of a T5 block stay inside their layer). Decoders, encoders,
both stacks of an encoder-decoder, ViTs and two-tower models are found alike.

References
----------
Chen, Xu, Zhang, Guestrin 2016, "Training Deep Nets with Sublinear Memory Cost" (segment
checkpointing); Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (full and selective recomputation); Jain et al. 2020, "Checkmate"; Sun et
al. 2024, "AdaPipe"; Zhu et al. 2025, "Mist"; torchtitan ``torchtitan/models/llama3/
parallelize.py`` (``_apply_ac_to_transformer_block``, ``_save_list``); PyTorch
``torch/_functorch/partitioners.py`` (``activation_memory_budget``, ``dp_knapsack``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import CheckpointOption, OpGraph

__all__ = [
    "CHECKPOINT_KINDS",
    "CHECKPOINT_REQUESTS",
    "BUDGET_LEVELS",
    "BUDGET_BUCKETS",
    "CheckpointPolicy",
    "MenuEntry",
    "GraphBlocks",
    "find_blocks",
    "StageCheckpoint",
    "stage_menu",
    "menu_for_request",
    "check_request",
    "partition_floor",
    "knapsack_keep",
    "kind_of",
    "plan_policies",
    "policies_match",
    "predict_checkpoint_bytes",
]

#: Policy kinds: "none" (stash everything), "full" (per-block segments, replay all of a block),
#: "selective" (per-block segments keeping matmul / attention outputs, torchtitan's op SAC with
#: its every-other-matmul rule), "budget" (per-block segments, the kept set chosen for a memory
#: budget), "stage" (the whole stage's forward is one segment: what plans before issue 28 called
#: recompute; an old plan file's recompute stages load as this).
CHECKPOINT_KINDS = ("none", "full", "selective", "budget", "stage")

#: What ``fxpipe.compile(activation_checkpointing=...)`` and ``fxpipe plan --activation-checkpointing``
#: take: ``"auto"`` (the planner picks per stage from every kind, ``"budget"`` included), or one kind
#: for every stage.
CHECKPOINT_REQUESTS = ("auto", "none", "full", "selective")

#: Budget options of a menu: the kept bytes above ``"full"``'s, as fractions of the way from
#: ``"full"`` to ``"none"``.
BUDGET_LEVELS = (0.25, 0.5, 0.75)

#: Buckets the knapsack of ``"budget"`` rounds the bytes into (per stage and budget).
BUDGET_BUCKETS = 512

_MATMUL_KINDS = frozenset({"matmul", "matmul_param"})
_ATTENTION_KINDS = frozenset({"attention"})


# ----------------------------------------------------------------------------- the policy (plan data)
@dataclass(frozen=True)
class CheckpointPolicy:
    """The activation-checkpoint policy of one pipeline stage (plain data, saved in the plan file).

    Attributes
    ----------
    kind : str
        One of :data:`CHECKPOINT_KINDS`.
    segments : tuple[tuple[str, ...], ...]
        OpGraph node names (the plan's fx node names) of the stage; each segment is replayed as
        one unit during B (non-reentrant ``torch.utils.checkpoint``); segments are disjoint,
        each listed in the stage's program order; ops in no segment are stashed as without
        checkpointing. Empty for ``"none"``.
    save : tuple[str, ...]
        Nodes inside segments whose outputs are kept from F to B (not replayed): empty for
        ``"full"`` and ``"stage"``; the planned keep set for ``"selective"`` / ``"budget"``.
    replay_s : float
        Forward time B replays per micro-batch (seconds, sum over segments).
    kept_bytes : float
        What F keeps per micro-batch under this policy (the stash, bytes).
    replay_peak_bytes : float
        What a B holds on top of the kept stash while it replays (the largest segment's
        replayed activations, bytes).

    Raises
    ------
    InputError
        On an unknown kind, segments that are not tuples of names or overlap, a kept node
        outside every segment, or a negative or non-finite figure.
    """

    kind: str
    segments: tuple[tuple[str, ...], ...] = ()
    save: tuple[str, ...] = ()
    replay_s: float = 0.0
    kept_bytes: float = 0.0
    replay_peak_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in CHECKPOINT_KINDS:
            raise InputError(f"checkpoint policy kind must be one of {CHECKPOINT_KINDS}, got {self.kind!r}")
        if isinstance(self.segments, (str, bytes)) or not isinstance(self.segments, Iterable):
            raise InputError(f"segments must be a list of lists of node names, got {self.segments!r:.200}")
        segs = []
        for seg in self.segments:
            if isinstance(seg, (str, bytes)) or not isinstance(seg, Iterable):
                raise InputError(f"each segment must be a list of node names, got {seg!r:.200}")
            seg = tuple(seg)
            if not seg or not all(isinstance(x, str) and x for x in seg):
                raise InputError(f"each segment must be a non-empty list of node names, got {list(seg)!r:.200}")
            segs.append(seg)
        names = [x for seg in segs for x in seg]
        if len(set(names)) != len(names):
            raise InputError("checkpoint segments must be disjoint: a node is listed twice")
        if isinstance(self.save, (str, bytes)) or not isinstance(self.save, Iterable):
            raise InputError(f"save must be a list of node names, got {self.save!r:.200}")
        save = tuple(self.save)
        inside = set(names)
        bad = [x for x in save if not isinstance(x, str) or x not in inside]
        if bad:
            raise InputError(f"save lists {bad[0]!r}, which is in no segment: kept nodes must be inside segments")
        if self.kind == "none" and segs:
            raise InputError("a 'none' policy has no segments")
        for key in ("replay_s", "kept_bytes", "replay_peak_bytes"):
            val = getattr(self, key)
            try:
                val = float(val)
            except (TypeError, ValueError):
                raise InputError(f"checkpoint policy {key} must be a number, got {val!r}") from None
            if not (math.isfinite(val) and val >= 0):
                raise InputError(f"checkpoint policy {key} must be finite and >= 0, got {val!r}")
            object.__setattr__(self, key, val)
        object.__setattr__(self, "segments", tuple(segs))
        object.__setattr__(self, "save", save)

    @property
    def nodes(self) -> frozenset:
        """Every node of every segment."""
        return frozenset(x for seg in self.segments for x in seg)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (one entry of a plan file's ``"activation_checkpointing"``)."""
        return {"kind": self.kind, "segments": [list(s) for s in self.segments], "save": list(self.save),
                "replay_s": self.replay_s, "kept_bytes": self.kept_bytes,
                "replay_peak_bytes": self.replay_peak_bytes}

    @classmethod
    def from_dict(cls, doc: Any, *, source: str = "plan") -> "CheckpointPolicy":
        """Parse :meth:`to_dict`'s document.

        Raises
        ------
        InputError
            Naming ``source`` and the field, on a missing kind or a bad value.
        """
        if not isinstance(doc, Mapping):
            raise InputError(f"{source}: a checkpoint policy must be an object with 'kind', 'segments', 'save', "
                             f"'replay_s', 'kept_bytes', 'replay_peak_bytes'; got {doc!r:.200}")
        if "kind" not in doc:
            raise InputError(f"{source}: checkpoint policy field 'kind' is missing (one of {CHECKPOINT_KINDS})")
        known = ("kind", "segments", "save", "replay_s", "kept_bytes", "replay_peak_bytes")
        try:
            return cls(**{k: doc[k] for k in known if k in doc})
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None
        except TypeError as exc:
            raise InputError(f"{source}: malformed checkpoint policy ({exc})") from None

    def describe(self) -> str:
        """A few words for tables: the kind, its segments and kept outputs."""
        if self.kind == "none":
            return "none"
        keep = f", {len(self.save)} kept" if self.save else ""
        return f"{self.kind} ({len(self.segments)} segment{'s' * (len(self.segments) != 1)}{keep})"


@dataclass(frozen=True)
class MenuEntry:
    """One option of a stage's menu: its policy (plan data) and its schedule figures.

    Attributes
    ----------
    name : str
        Unique in the menu (``"none"``, ``"full"``, ``"selective"``, ``"stage"``, ``"budget-1"``, ...).
    policy : CheckpointPolicy
    peak_bytes : float
        The schedule's peak of a B beyond ``kept_bytes`` (module docstring).
    w_bytes : float
        What the stage holds from the end of B to W (0 for a fused option).
    fused_w_s : float
        > 0 for a *fused* option (name ending ``-fused``): B and W run as one full backward right
        after each other (the W inputs are never held), the stage's weight-gradient time moved into
        B; this is it.
    """

    name: str
    policy: CheckpointPolicy
    peak_bytes: float
    w_bytes: float
    fused_w_s: float = 0.0

    def option(self) -> CheckpointOption:
        """The schedule problem's view (:class:`fxpipe.ir.CheckpointOption`)."""
        p = self.policy
        return CheckpointOption(self.name, p.replay_s, p.kept_bytes, self.peak_bytes, self.w_bytes, self.fused_w_s)


# ----------------------------------------------------------------------------- blocks
@dataclass(frozen=True)
class GraphBlocks:
    """The repeated blocks of a graph (:func:`find_blocks`).

    Attributes
    ----------
    block_of : int64 array (n,)
        Block of every node, ``-1`` outside every block; blocks numbered in program order.
    names : tuple[str, ...]
        Module path of every block (``"model.layers.3"``).
    """

    block_of: np.ndarray
    names: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.names)


def _is_index(part: str) -> bool:
    return part.isdigit()


def find_blocks(graph: OpGraph) -> GraphBlocks:
    """The repeated blocks of ``graph`` found from its module paths (module docstring, "Blocks").

    Parameters
    ----------
    graph : OpGraph
        Its ``extra[i]["module"]`` and ``extra[i]["kind"]`` are read; a graph without them has no
        blocks.

    Returns
    -------
    GraphBlocks
    """
    n = graph.n
    extra = graph.extra if graph.extra and len(graph.extra) == n else [{}] * n
    paths: list[list[tuple[str, str]]] = []  # per node: (container, index) along its module path, outermost first
    compute: dict[str, set[str]] = {}
    for i in range(n):
        parts = str(extra[i].get("module", "") or "").split(".") if extra[i].get("module") else []
        chain = []
        for d, part in enumerate(parts):
            if _is_index(part):
                chain.append((".".join(parts[:d]), part))
        paths.append(chain)
        if str(extra[i].get("kind", "")) in _MATMUL_KINDS | _ATTENTION_KINDS:
            for container, index in chain:
                compute.setdefault(container, set()).add(index)
    stacks = {c for c, idx in compute.items() if len(idx) >= 2}
    block_of = np.full(n, -1, dtype=np.int64)
    ids: dict[str, int] = {}
    for i, chain in enumerate(paths):
        for container, index in chain:  # the outermost stack on the path
            if container in stacks:
                key = f"{container}.{index}" if container else index
                block_of[i] = ids.setdefault(key, len(ids))
                break
    _absorb_interleaved(graph, block_of, len(ids))
    return GraphBlocks(block_of=block_of, names=tuple(ids))


def _absorb_interleaved(graph: OpGraph, block_of: np.ndarray, count: int) -> None:
    """Nodes of no block that lie inside a block's span of ids (program order) and feed only that block (a
    per-layer copy of the attention mask made by the capture's constant duplication, module ``model``) join
    it, in place, so the block stays one contiguous segment. Placeholders, the output and nodes that own
    parameters never join."""
    if count == 0:
        return
    first = np.full(count, graph.n, dtype=np.int64)
    last = np.full(count, -1, dtype=np.int64)
    for b in range(count):
        ids = np.flatnonzero(block_of == b)
        first[b], last[b] = ids[0], ids[-1]
    fixed = np.array([op in ("placeholder", "output") for op in graph.ops], dtype=bool) | \
        (np.asarray(graph.size_param_bytes) > 0)
    for v in range(graph.n - 1, -1, -1):  # consumers first (ids are a topological order)
        if block_of[v] >= 0 or fixed[v]:
            continue
        succ = block_of[graph.successors(v)]
        if succ.size and succ[0] >= 0 and np.all(succ == succ[0]) and first[succ[0]] < v < last[succ[0]]:
            block_of[v] = succ[0]


#: ``graph.meta`` key of one tensor-parallel rank's costs (:func:`fxpipe.mesh.tensor_parallel.tensor_parallel_graph`)
TP_COSTS_META = "tp_costs"
#: in ``graph.meta[TP_COSTS_META]``: node name -> bytes of the op's own result on one tensor-parallel rank where
#: they differ from its output (``size_out_bytes``, after its region's collective): a row's partial sum and the
#: vocab-parallel embedding's are whole, the output projection's logits before their all-gather ``1 / tp``. A
#: kept op result (``save``) is that result, so a policy keeps these bytes of such a node.
RESULT_BYTES_KEY = "result_bytes"


# ----------------------------------------------------------------------------- one stage
class _SavedModel:
    """What every node of a graph saves: producers (by node id) and private bytes (module docstring)."""

    def __init__(self, graph: OpGraph):
        n = graph.n
        self.size = np.asarray(graph.size_out_bytes, dtype=np.float64)
        act = np.asarray(graph.act_bytes, dtype=np.float64)
        extra = graph.extra if graph.extra and len(graph.extra) == n else [{}] * n
        index = {name: i for i, name in enumerate(graph.names)}
        self.result = self.size.copy()  # what keeping a node's op result holds (tensor parallelism: RESULT_BYTES_KEY)
        for name, nbytes in (((graph.meta or {}).get(TP_COSTS_META) or {}).get(RESULT_BYTES_KEY) or {}).items():
            if name in index:
                self.result[index[name]] = float(nbytes)
        self.saves: list[tuple[int, ...]] = []
        self.identity = any("saved" in e for e in extra)
        first: dict[int, int] = {}
        for v in range(n):
            got = tuple(dict.fromkeys(index[x] for x in (extra[v].get("saved") or ()) if x in index))
            self.saves.append(got)
            for u in got:
                first.setdefault(u, v)
        counted = np.zeros(n)
        for u, v in first.items():
            counted[v] += self.size[u]
        self.first_saver = first
        self.private = np.maximum(act - counted, 0.0)
        self.act = act
        self.placeholder = np.array([op == "placeholder" for op in graph.ops], dtype=bool)
        self.output = np.array([op == "output" for op in graph.ops], dtype=bool)
        self.param = np.asarray(graph.t_bwd_weight_s, dtype=np.float64) > 0
        self.t_fwd = np.asarray(graph.t_fwd_s, dtype=np.float64)
        kinds = [str(e.get("kind", "")) for e in extra]
        self.matmul = np.array([k in _MATMUL_KINDS for k in kinds], dtype=bool)
        self.attention = np.array([k in _ATTENTION_KINDS for k in kinds], dtype=bool)
        self.graph = graph
        self.keepable = ~_mutated(graph, extra)
        # the same figures as Python lists, and every node's predecessors, for _evaluate's loops
        self.lists = _SavedLists(self.size.tolist(), self.result.tolist(), self.private.tolist(), self.t_fwd.tolist(),
                                 self.param.tolist(), self.placeholder.tolist(),
                                 [graph.predecessors(v).tolist() for v in range(n)])


@dataclass(frozen=True)
class _SavedLists:
    """:class:`_SavedModel`'s per-node figures as lists (indexing a list is several times cheaper than a numpy
    scalar; the values and so the sums are the same)."""

    size: list[float]
    result: list[float]
    private: list[float]
    t_fwd: list[float]
    param: list[bool]
    placeholder: list[bool]
    preds: list[list[int]]


def _mutated(graph: OpGraph, extra: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Nodes whose output an in-place op (``aten.add_``, ...) may write after it is made, through views too.

    A kept output is the forward's tensor object: an in-place op after it would change what the
    replay reads (T5's relative-position buckets are built with ``+=``), so such a node is never
    kept. Conservative: every input of an in-place op, the base of each through shape-only ops
    (``kind == "shape"``), and every shape-only node on top of those bases.
    """
    n = graph.n
    out = np.zeros(n, dtype=bool)
    inplace = []
    for v in range(n):
        target = str(extra[v].get("target", ""))
        parts = target.split(".")
        if len(parts) >= 2 and parts[0] == "aten" and parts[1].endswith("_") and not parts[1].startswith("_"):
            inplace.append(v)
    if not inplace:
        return out
    shape = np.array([extra[v].get("kind") == "shape" for v in range(n)], dtype=bool)
    stack = [u for v in inplace for u in graph.predecessors(v).tolist()]
    while stack:  # down to the bases
        u = stack.pop()
        if out[u]:
            continue
        out[u] = True
        if shape[u]:
            stack.extend(graph.predecessors(u).tolist())
    stack = [u for u in np.flatnonzero(out).tolist()]
    while stack:  # up to the views of those bases
        u = stack.pop()
        for w in graph.successors(u).tolist():
            if shape[w] and not out[w]:
                out[w] = True
                stack.append(w)
    return out


_CACHE: dict[int, tuple[Any, _SavedModel, GraphBlocks]] = {}


def _graph_model(graph: OpGraph) -> tuple[_SavedModel, GraphBlocks]:
    """The saved-tensor model and the blocks of ``graph`` (cached per graph object)."""
    key = id(graph)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is graph:
        return hit[1], hit[2]
    out = (_SavedModel(graph), find_blocks(graph))
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[key] = (graph, *out)
    return out


@dataclass(frozen=True)
class StageCheckpoint:
    """Figures of one policy on one stage (internal to :func:`stage_menu`, exposed for tests).

    Attributes
    ----------
    kept_bytes, replay_s, replay_peak_bytes, peak_bytes, w_bytes : float
        See the module docstring.
    segment_replay_bytes : tuple[float, ...]
        ``R_i`` of every segment.
    fused_peak_bytes : float
        The peak beyond ``kept_bytes`` of a fused backward (B and W in one pass, nothing held for W).
    """

    kept_bytes: float
    replay_s: float
    replay_peak_bytes: float
    peak_bytes: float
    w_bytes: float
    segment_replay_bytes: tuple[float, ...]
    fused_peak_bytes: float = 0.0


def _evaluate(sm: _SavedModel, nodes: np.ndarray, segments: Sequence[np.ndarray], keep: set[int]) -> StageCheckpoint:
    """The figures of the policy with ``segments`` (node ids, program order) and kept set ``keep`` on the stage
    ``nodes`` (sorted node ids)."""
    L = sm.lists
    size_of, result_of, private, t_fwd, param, placeholder, preds = (L.size, L.result, L.private, L.t_fwd, L.param,
                                                                     L.placeholder, L.preds)
    saves, first_saver = sm.saves, sm.first_saver
    node_list = nodes.tolist()
    in_stage = set(node_list)
    seg_lists = [seg.tolist() for seg in segments]
    seg_of: dict[int, int] = {}
    for i, seg in enumerate(seg_lists):
        for v in seg:
            seg_of[v] = i
    first_need: dict[int, int] = {}  # kept tensor -> earliest position (node id) that needs it

    def need(u: int, pos: int) -> None:
        if pos < first_need.get(u, 1 << 62):
            first_need[u] = pos

    private_out = 0.0
    for v in node_list:  # nodes outside every segment: what they save is kept
        if v in seg_of:
            continue
        private_out += private[v]
        for u in saves[v]:
            if u in in_stage:
                need(u, v)
            elif first_saver.get(u) == v:  # a received tensor this stage's act_bytes count (as "none" does)
                private_out += size_of[u]
    starts = [seg[0] for seg in seg_lists]
    for i, seg in enumerate(seg_lists):
        members = set(seg)
        for v in seg:
            for u in preds[v]:
                if u not in members and u in in_stage and not placeholder[u]:
                    need(u, starts[i])  # an input of the segment
        for v in seg:
            if v in keep:
                need(v, starts[i])
    kept_set = set(first_need)
    # a kept op result is the op's own (under tensor parallelism a row's partial sum, whole), a segment input the
    # value it reads (the row's reduced shard)
    size = {u: float(result_of[u] if u in keep else size_of[u]) for u in kept_set}
    kept = float(sum(size.values())) + private_out
    # what each segment replays, and the W inputs it recreates
    replay = []
    w_of_seg = []
    replay_s = 0.0
    for seg in seg_lists:
        got: set[int] = set()
        wset: set[int] = set()
        priv = w_priv = 0.0
        for v in seg:
            if v not in keep:
                replay_s += t_fwd[v]
            priv += private[v]
            if param[v]:
                w_priv += private[v]
            for u in saves[v]:
                if u in kept_set or u not in in_stage:
                    continue
                got.add(u)
                if param[v]:
                    wset.add(u)
        replay.append(float(sum(size_of[u] for u in got)) + priv)
        w_of_seg.append(float(sum(size_of[u] for u in wset)) + w_priv)
    # W inputs of the whole stage: the tensors nodes with parameters save (each once) and their private bytes
    w_tensors: set[int] = set()
    w_private = 0.0
    for v in node_list:
        if param[v]:
            w_private += private[v]
            w_tensors.update(saves[v])
    w_bytes = float(sum(size_of[u] for u in w_tensors)) + w_private
    # the B's level while it replays segment i (walking the stage backwards): split, the W inputs of the
    # segments done are held for W; fused (B and W as one backward), they are not
    level = max(kept, w_bytes)
    fused = kept
    if seg_lists:
        kept_w = {u for u in kept_set if u in w_tensors}
        for i, seg in enumerate(seg_lists):
            last = seg[-1]
            live = sum(size[u] for u in kept_set if first_need[u] <= last) + private_out
            held = live + sum(size[u] for u in kept_w if first_need[u] > last)
            done_w = sum(w_of_seg[j] for j in range(i + 1, len(seg_lists)))
            level = max(level, held + done_w + replay[i])
            fused = max(fused, live + replay[i])
    return StageCheckpoint(kept_bytes=kept, replay_s=float(replay_s), replay_peak_bytes=max(replay, default=0.0),
                           peak_bytes=max(level - kept, 0.0), w_bytes=w_bytes, segment_replay_bytes=tuple(replay),
                           fused_peak_bytes=max(fused - kept, 0.0))


def _runs(ids: np.ndarray, nodes: np.ndarray) -> list[np.ndarray]:
    """``ids`` (a subset of the sorted ``nodes``) split into runs that are contiguous in ``nodes``."""
    if ids.size == 0:
        return []
    pos = np.searchsorted(nodes, ids)
    cut = np.flatnonzero(np.diff(pos) != 1) + 1
    return [r for r in np.split(ids, cut)]


def _block_segments(sm: _SavedModel, blocks: GraphBlocks, nodes: np.ndarray) -> list[np.ndarray]:
    """The stage's part of every block, in contiguous runs, without placeholders / the output and runs that
    neither compute nor save anything."""
    segs = []
    body = nodes[~(sm.placeholder[nodes] | sm.output[nodes])]
    b = blocks.block_of[body]
    for blk in np.unique(b[b >= 0]):
        for run in _runs(body[b == blk], nodes):
            if float(sm.t_fwd[run].sum()) > 0 or float(sm.act[run].sum()) > 0:
                segs.append(run)
    segs.sort(key=lambda r: int(r[0]))
    return segs


def _selective_keep(sm: _SavedModel, segments: Sequence[np.ndarray]) -> set[int]:
    """torchtitan's op-level selective AC: in each segment every attention op and the 1st, 3rd, ... matmul."""
    keep: set[int] = set()
    for seg in segments:
        count = 0
        for v in seg:
            v = int(v)
            if sm.attention[v]:
                if sm.keepable[v]:
                    keep.add(v)
            elif sm.matmul[v]:
                count += 1
                if count % 2 == 1 and sm.keepable[v]:
                    keep.add(v)
    return keep


def knapsack_keep(values: Sequence[float], weights: Sequence[float], capacity: float,
                  buckets: int = BUDGET_BUCKETS) -> tuple[list[int], float]:
    """The items of largest total value whose total weight fits ``capacity`` (0/1 knapsack by DP).

    Weights are rounded *up* to multiples of ``capacity / buckets`` (a bucket of 1 when every weight
    is an integer and the capacity at most ``buckets``), so the chosen items always
    fit; the answer is optimal for the rounded weights (exact for weights that are multiples of the
    bucket). Items of weight 0 are always taken. Dynamic programming over the capacity (Bellman
    1957; the ``dp_knapsack`` of PyTorch's ``activation_memory_budget``).

    Parameters
    ----------
    values, weights : sequences of float >= 0 (same length)
    capacity : float >= 0
    buckets : int

    Returns
    -------
    (chosen indices in increasing order, their total value)
    """
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if v.shape != w.shape or v.ndim != 1:
        raise InputError("values and weights must be 1-d of equal length")
    if np.any(w < 0) or np.any(v < 0) or not math.isfinite(capacity) or capacity < 0:
        raise InputError("knapsack weights, values and capacity must be finite and >= 0")
    free = np.flatnonzero(w <= 0)
    items = np.flatnonzero(w > 0)
    integer = bool(np.all(w == np.round(w))) and math.floor(capacity) <= buckets
    q = 1.0 if integer else (capacity / buckets if capacity > 0 else 1.0)
    Q = int(math.floor(capacity / q + 1e-9))
    wq = np.ceil(w[items] / q - 1e-9).astype(np.int64)
    best = np.zeros(Q + 1)
    take = np.zeros((items.size, Q + 1), dtype=bool)
    for k, (val, wt) in enumerate(zip(v[items], wq)):
        if wt > Q or val <= 0:
            continue
        cand = best[: Q + 1 - wt] + val
        better = cand > best[wt:] + 1e-15
        take[k, wt:] = better
        best[wt:] = np.where(better, cand, best[wt:])
    chosen = []
    c = Q
    for k in range(items.size - 1, -1, -1):
        if c >= 0 and take[k, c]:
            chosen.append(int(items[k]))
            c -= int(wq[k])
    chosen = sorted(chosen + free.tolist())
    return chosen, float(v[chosen].sum()) if chosen else 0.0


def _policy(graph: OpGraph, kind: str, segments: Sequence[np.ndarray], keep: set[int], fig: StageCheckpoint) -> CheckpointPolicy:
    names = graph.names
    return CheckpointPolicy(kind=kind, segments=tuple(tuple(names[int(v)] for v in seg) for seg in segments),
                            save=tuple(names[v] for v in sorted(keep)), replay_s=fig.replay_s,
                            kept_bytes=fig.kept_bytes, replay_peak_bytes=fig.replay_peak_bytes)


def stage_menu(graph: OpGraph, nodes: Sequence[int] | np.ndarray, *, kinds: Sequence[str] = CHECKPOINT_KINDS,
               budget_levels: Sequence[float] = BUDGET_LEVELS, blocks: GraphBlocks | None = None,
               fused: bool = True) -> list[MenuEntry]:
    """The checkpoint options of a stage: its policies with their costs (module docstring).

    Parameters
    ----------
    graph : OpGraph
        The costed graph (one micro-batch).
    nodes : int array
        The stage's nodes (OpGraph ids).
    kinds : sequence of str
        The kinds to offer (default all of :data:`CHECKPOINT_KINDS`; ``"none"`` is always there).
    budget_levels : sequence of float in (0, 1)
        ``"budget"`` options at these fractions of the way from ``"full"``'s kept bytes to ``"none"``'s.
    blocks : GraphBlocks, optional
        Default :func:`find_blocks` of the graph.
    fused : bool
        Offer each option also *fused* (``"<name>-fused"``: B and W of a micro-batch run as one full
        backward, so the W inputs replayed by a segment are freed with it instead of held until W;
        the stage gives up the B/W split's freedom), where that lowers the B's level.

    Returns
    -------
    list of MenuEntry
        ``"none"`` first; then the other kinds that differ from every option before them (a stage
        without blocks has no ``"full"``, ``"selective"`` or ``"budget"``), each with a unique name
        (``"budget-1"``, ``"budget-2"``, ... for the budget levels), each followed by its fused
        variant where that holds less.

    Raises
    ------
    InputError
        On an unknown kind or a node id outside the graph.
    """
    bad = [k for k in kinds if k not in CHECKPOINT_KINDS]
    if bad:
        raise InputError(f"unknown checkpoint kind {bad[0]!r}; choose from {CHECKPOINT_KINDS}")
    nodes = np.unique(np.asarray(nodes, dtype=np.int64))
    if nodes.size and (nodes[0] < 0 or nodes[-1] >= graph.n):
        raise InputError(f"stage nodes must be ids in 0..{graph.n - 1}")
    sm, found = _graph_model(graph)
    blocks = found if blocks is None else blocks
    none_fig = _evaluate(sm, nodes, [], set())
    stash = float(sm.act[nodes].sum())  # "none" keeps the stage's act_bytes, as the memory model counts them
    none_fig = StageCheckpoint(stash, 0.0, 0.0, 0.0, none_fig.w_bytes, ())
    out = [MenuEntry("none", _policy(graph, "none", [], set(), none_fig), 0.0, none_fig.w_bytes)]
    seen = {(0.0, round(stash, 3))}

    t_w = float(np.asarray(graph.t_bwd_weight_s)[nodes].sum())

    def add(name: str, kind: str, segments, keep: set[int]) -> StageCheckpoint | None:
        if not segments:
            return None
        fig = _evaluate(sm, nodes, segments, keep)
        sig = (round(fig.replay_s, 15), round(fig.kept_bytes, 3))
        if sig in seen or fig.kept_bytes >= stash * (1 - 1e-12):  # keeps no less than "none": never worth it
            return fig
        seen.add(sig)
        policy = _policy(graph, kind, segments, keep, fig)
        out.append(MenuEntry(name, policy, fig.peak_bytes, fig.w_bytes))
        split_level = max(fig.kept_bytes + fig.peak_bytes, fig.w_bytes)
        if fused and t_w > 0 and fig.kept_bytes + fig.fused_peak_bytes < split_level * (1 - 1e-9):
            out.append(MenuEntry(f"{name}-fused", policy, fig.fused_peak_bytes, 0.0, t_w))
        return fig

    segs = _block_segments(sm, blocks, nodes)
    if "selective" in kinds:
        add("selective", "selective", segs, _selective_keep(sm, segs))
    full = add("full", "full", segs, set()) if ("full" in kinds or "budget" in kinds) else None
    if "full" not in kinds and full is not None:
        out = [e for e in out if e.policy.kind != "full"]
    if "budget" in kinds and full is not None and segs:
        cand = np.concatenate(segs)
        cand = cand[(sm.t_fwd[cand] > 0) & sm.keepable[cand]]
        base_kept = full  # _evaluate(sm, nodes, segs, set()): "full"'s figures
        kept_already = _kept_tensors(sm, nodes, segs)
        weights = np.where(np.isin(cand, list(kept_already)), 0.0, sm.size[cand])
        span = none_fig.kept_bytes - base_kept.kept_bytes
        for i, frac in enumerate(budget_levels, start=1):
            if not 0 < frac < 1 or span <= 0:
                continue
            chosen, _ = knapsack_keep(sm.t_fwd[cand], weights, frac * span)
            add(f"budget-{i}", "budget", segs, {int(cand[j]) for j in chosen})
    if "stage" in kinds:
        body = nodes[~(sm.placeholder[nodes] | sm.output[nodes])]
        if body.size:
            add("stage", "stage", [body], set())
    return out


def _kept_tensors(sm: _SavedModel, nodes: np.ndarray, segments: Sequence[np.ndarray]) -> set[int]:
    """The tensors ``"full"`` keeps: inputs of segments, and what nodes outside every segment save."""
    inside = set(int(v) for seg in segments for v in seg)
    in_stage = set(int(v) for v in nodes)
    out: set[int] = set()
    for v in nodes:
        if int(v) not in inside:
            out.update(sm.saves[int(v)])
    for seg in segments:
        members = set(int(v) for v in seg)
        for v in seg:
            for u in sm.graph.predecessors(int(v)).tolist():
                if u not in members and u in in_stage and not sm.placeholder[u]:
                    out.add(u)
    return out


def check_request(value: Any, what: str = "activation_checkpointing") -> str:
    """``value`` if it is one of :data:`CHECKPOINT_REQUESTS`; InputError naming ``what`` otherwise."""
    if not isinstance(value, str) or value not in CHECKPOINT_REQUESTS:
        raise InputError(f"{what} must be one of {', '.join(repr(x) for x in CHECKPOINT_REQUESTS)}, got {value!r}")
    return value


def menu_for_request(graph: OpGraph, nodes, request: str, *, blocks: GraphBlocks | None = None) -> list[MenuEntry]:
    """The menu a stage offers under ``activation_checkpointing=request``.

    ``"auto"``: every kind (:func:`stage_menu`); ``"none"``: only ``"none"``; ``"full"`` /
    ``"selective"``: ``"none"`` and that kind (a stage without blocks keeps ``"none"``; the
    planner then runs the requested kind wherever the stage has one).
    """
    check_request(request)
    nodes = np.unique(np.asarray(nodes, dtype=np.int64))
    key = (id(graph), request, nodes.tobytes()) if blocks is None else None
    hit = _MENUS.get(key) if key is not None else None
    if hit is not None and hit[0] is graph:
        return list(hit[1])
    kinds = CHECKPOINT_KINDS if request == "auto" else ("none",) if request == "none" else ("none", request)
    menu = stage_menu(graph, nodes, kinds=kinds, blocks=blocks)
    if key is not None:  # the mesh search plans the same stages under several memory models
        if len(_MENUS) > 4096:
            _MENUS.clear()
        _MENUS[key] = (graph, tuple(menu))
    return menu


#: :func:`menu_for_request` per (graph object, request, stage nodes).
_MENUS: dict = {}


def partition_floor(graph: OpGraph, blocks: GraphBlocks | None = None) -> tuple[np.ndarray, float]:
    """Per-node stash bytes under per-block ``"full"`` checkpointing, and the largest block's replay.

    What the partitioner's memory rule (:class:`fxpipe.partition.memory.PartitionMemory` with
    ``checkpointing=True``) counts for a stage that may checkpoint: a node outside every block
    keeps its ``act_bytes``; a node's output that feeds another block (a residual stream between
    blocks, a rotary table used by every block) is kept as that block's input; and one block is
    replayed at a time, so a stage also needs the largest block's replay (``R`` of the module
    docstring; a fused backward holds nothing more for W). Additive per node, so the SliceGraph DP
    can sum it.

    Returns
    -------
    (float64 (n,), float)
        Bytes per node; the replay allowance in bytes (0 without blocks).
    """
    sm, found = _graph_model(graph)
    cached = blocks is None and _FLOOR.get(id(graph))
    if cached and cached[0] is graph:
        return cached[1].copy(), cached[2]
    own = blocks is None
    blocks = found if blocks is None else blocks
    b = blocks.block_of
    out = np.where(b < 0, sm.act, 0.0)
    dst_block = b[graph.edges[:, 1]] if graph.m else np.zeros(0, dtype=np.int64)
    src = graph.edges[:, 0] if graph.m else np.zeros(0, dtype=np.int64)
    feeds = np.zeros(graph.n, dtype=bool)
    cross = (dst_block >= 0) & (dst_block != b[src]) & ~sm.placeholder[src]
    feeds[src[cross]] = True
    out = out + np.where(feeds, sm.size, 0.0)
    peak = 0.0
    all_nodes = np.arange(graph.n)
    for blk in range(blocks.count):
        seg = all_nodes[b == blk]
        if seg.size:
            fig = _evaluate(sm, seg, [seg], set())
            peak = max(peak, fig.replay_peak_bytes)
    if own:
        if len(_FLOOR) > 16:
            _FLOOR.clear()
        _FLOOR[id(graph)] = (graph, out.copy(), float(peak))
    return out, float(peak)


_FLOOR: dict[int, tuple] = {}


def kind_of(option_name: str) -> str:
    """The policy kind of a menu option's name (``"budget-2"`` -> ``"budget"``, ``"full-fused"`` -> ``"full"``)."""
    base = option_name[: -len("-fused")] if option_name.endswith("-fused") else option_name
    kind = "budget" if base.startswith("budget-") else base
    if kind not in CHECKPOINT_KINDS:
        raise InputError(f"checkpoint option {option_name!r} names no kind of {CHECKPOINT_KINDS}")
    return kind


def plan_policies(graph: OpGraph, assignment, problem) -> tuple[CheckpointPolicy, ...]:
    """The policy of every stage of a plan: the option ``problem.checkpoint[s]`` names, on the stage's nodes.

    Derived again from the graph (:func:`stage_menu` of the option's kind, deterministic), so a plan
    carries, for each stage, the segments (node names) and kept outputs its schedule problem was costed
    with. ``"none"`` keeps the problem's stash.

    Parameters
    ----------
    graph : OpGraph
    assignment : int array (n,)
        Stage of every node.
    problem : ScheduleProblem
        With ``checkpoint`` and ``checkpoint_menu``.

    Raises
    ------
    InputError
        When a stage's option cannot be derived from the graph (the plan's graph and problem disagree).
    """
    a = np.asarray(assignment, dtype=np.int64)
    out = []
    for s, name in enumerate(problem.checkpoint):
        opt = problem.checkpoint_option(s)
        if name == "none":
            out.append(CheckpointPolicy("none", kept_bytes=opt.kept_bytes))
            continue
        nodes = np.flatnonzero(a == s)
        found = [e for e in stage_menu(graph, nodes, kinds=("none", kind_of(name))) if e.name == name]
        if not found and name == "stage":  # a recomputing stage of an old plan whose stage keeps nothing to replay
            found = [MenuEntry(name, CheckpointPolicy("stage", replay_s=opt.replay_s, kept_bytes=opt.kept_bytes,
                                                      replay_peak_bytes=opt.peak_bytes), opt.peak_bytes, opt.w_bytes)]
        if not found:
            raise InputError(f"stage {s}: its checkpoint option {name!r} cannot be derived from the plan's graph "
                             "(no blocks there): the plan's graph and schedule problem disagree")
        out.append(found[0].policy)
    return tuple(out)


def policies_match(policies: Sequence[CheckpointPolicy], problem) -> bool:
    """Whether ``policies`` are one per stage of ``problem`` with the kind and replay time of the option it runs."""
    if len(policies) != problem.num_stages:
        return False
    for s, p in enumerate(policies):
        opt = problem.checkpoint_option(s)
        if p.kind != kind_of(opt.name) or abs(p.replay_s - opt.replay_s) > 1e-6 * max(1e-12, opt.replay_s):
            return False
    return True


def predict_checkpoint_bytes(graph: OpGraph, stage_nodes: Sequence[int] | np.ndarray,
                             policy: CheckpointPolicy | None) -> tuple[float, float]:
    """Kept bytes and replay peak of one micro-batch of a stage under ``policy``, as the saved-tensor hooks count them.

    The figures :func:`stage_menu` gives the policy (module docstring, "Costs"), recomputed for a
    policy given by node names: what the runtime's measurement (:mod:`fxpipe.codegen.stash`)
    is checked against.

    Parameters
    ----------
    graph : fxpipe.ir.OpGraph
        The costed graph the policy's node names belong to.
    stage_nodes : sequence of int
        OpGraph ids of the stage's nodes.
    policy : CheckpointPolicy or None
        The stage's policy; None or ``"none"``: stash everything. Node names not in the stage
        are ignored; a ``"stage"`` policy without segments replays the whole stage.

    Returns
    -------
    (kept_bytes, replay_peak_bytes) : tuple[float, float]
        Bytes per micro-batch: what F keeps for B, and the largest segment's replayed tensors
        beyond it (gradients not counted). Unlike the menu's ``kept_bytes``, a received tensor
        (the stage's input, held by its receive buffer) that the stage saves is not counted: the
        hooks see it as the buffer, and the memory model counts it twice (its buffers and the
        stash), which this leaves out.
    """
    sm, _ = _graph_model(graph)
    nodes = np.unique(np.asarray(stage_nodes, dtype=np.int64))
    in_stage = set(nodes.tolist())
    index = {name: i for i, name in enumerate(graph.names)}
    kind = "none" if policy is None else policy.kind
    segments: list[np.ndarray] = []
    keep: set[int] = set()
    if kind == "stage" and not policy.segments:
        body = nodes[~(sm.placeholder[nodes] | sm.output[nodes])]
        segments = [body] if body.size else []
    elif kind != "none":
        for seg in policy.segments:
            ids = sorted(index[x] for x in seg if x in index and index[x] in in_stage)
            if ids:
                segments.append(np.asarray(ids, dtype=np.int64))
        keep = {index[x] for x in policy.save if x in index}
    fig = _evaluate(sm, nodes, segments, keep)
    # a received tensor (made on an earlier stage) that a node outside every segment saves is the stage's
    # receive buffer: the memory model counts it in the stash too (conservative), the hooks do not
    inside = {int(v) for seg in segments for v in seg}
    received = sum(sm.size[u] for v in nodes.tolist() if v not in inside
                   for u in sm.saves[v] if u not in in_stage and sm.first_saver.get(u) == v)
    return max(float(fig.kept_bytes) - float(received), 0.0), float(fig.replay_peak_bytes)
