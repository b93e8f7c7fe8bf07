"""Tensor parallelism of a plan at a degree ``tp``: what is sharded, how, and why not (torch-free).

The capture finds, once and for every degree, where a graph's matmuls can be split
(:mod:`fxpipe.passes.tensor_parallel`: Megatron-LM's column-then-row parallel pairs, Shoeybi et
al. 2019, Sec. 3; vocab-parallel embedding and output projection; Korthikanti et al. 2022's
sequence parallelism for the token-wise ops between them) and records it in the OpGraph:
``extra[i]["tp_role"]`` / ``extra[i]["tp_region"]`` per node and ``graph.meta["tensor_parallel"]``.
:func:`resolve_tensor_parallel` decides for one degree:

* a region (an attention block, an MLP, an embedding, an output projection) is split when
  ``tp`` divides every unit its shards carry: output features, heads (the count a reshape splits
  the width into), the vocabulary. Grouped-query attention whose k / v projections have fewer
  heads than ``tp`` (``tp`` a multiple of the kv heads) keeps those two replicated, as
  Megatron-LM does, and splits the query heads;
* otherwise the region stays replicated (every tensor-parallel rank computes it whole) and the
  reason is kept: for an attention block or an MLP it is a *refusal* (a pinned ``tp`` that does
  not divide the heads or widths of the model's blocks is an error, :func:`check_tensor_parallel`);
  for an embedding or output projection (an odd vocabulary) a *note*;
* a parameter used by two regions (a tied embedding and output projection) is split only if
  both are, with the same placement;
* sequence parallelism is on when some region is split and ``tp`` divides the size of dim 1 of
  every sequence-parallel value; stage boundaries then carry the sequence shard.

:func:`stage_tensor_parallel` says per pipeline stage which share of its work is split and, for
a stage with none (convolutions, a MoE's experts, a rejected fused projection), why: tensor
parallelism is not offered for it, its ranks replicate it.

:func:`tensor_parallel_graph` is what one tensor-parallel rank computes, holds and sends: the
OpGraph with the split ops' compute, activations, outputs and parameters divided by ``tp`` and
every split region's collectives (forward and backward) added to the op that starts or ends it.
:func:`fxpipe.mesh.pipeline_graph` applies it, so the partition, the schedule, the memory model
and the predicted step of a ``tp > 1`` mesh all read one rank's figures.

The runtime (:mod:`fxpipe.codegen.tensor_parallel`) resolves the same record of its own capture
with this function, so what runs is what was planned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.memory.checkpoint import RESULT_BYTES_KEY, TP_COSTS_META

__all__ = [
    "REPLICATE",
    "TensorParallelLayout",
    "resolve_tensor_parallel",
    "graph_tensor_parallel",
    "node_domains",
    "stage_tensor_parallel",
    "check_tensor_parallel",
    "tensor_parallel_graph",
    "tp_collective_s",
    "tensor_parallel_options",
    "TP_COSTS_KEY",
]

#: The placement text of a replicated parameter (DTensor's ``repr`` of ``Replicate()``).
REPLICATE = "Replicate()"
#: ``graph.meta`` key of a graph :func:`tensor_parallel_graph` made (its degree and collective times).
TP_COSTS_KEY = TP_COSTS_META  # (defined with the checkpoint model, which reads it: mesh imports memory)

_BLOCKS = ("attention", "mlp")


def _shard(dim: int) -> str:
    return f"Shard({int(dim)})"


@dataclass(frozen=True)
class TensorParallelLayout:
    """The tensor parallelism of a graph at degree ``tp`` (plain data).

    Attributes
    ----------
    tp : int
        The degree.
    params : dict[str, str]
        Every parameter of a split region -> its placement on the ``tp`` sub-mesh
        (``"Shard(0)"``, ``"Shard(1)"``, ``"Replicate()"``); parameters left out are replicated.
    regions : tuple[int, ...]
        Ids of the split regions (``graph.meta["tensor_parallel"]["regions"]``).
    replicated_columns : dict[int, tuple[int, ...]]
        Region id -> its columns kept replicated (k / v of grouped-query attention with fewer
        kv heads than ``tp``).
    sequence_parallel : bool
        Whether the ``sequence`` nodes run on the sequence shard.
    notes : tuple[str, ...]
        Why a region or sequence parallelism is not used (odd vocabulary, sequence length).
    refusals : tuple[str, ...]
        Attention blocks and MLPs ``tp`` does not divide (a pinned mesh with this ``tp`` is refused).
    """

    tp: int
    params: dict = field(default_factory=dict)
    regions: tuple = ()
    replicated_columns: dict = field(default_factory=dict)
    sequence_parallel: bool = False
    notes: tuple = ()
    refusals: tuple = ()

    def domain(self, role: str | None, region: int | None) -> str:
        """Where a node runs: ``"tp"`` (a split region, on DTensor), ``"sp"`` (sequence shard) or ``"plain"``."""
        if region is not None and int(region) in self.regions:
            return "tp"
        if role == "sequence" and self.sequence_parallel:
            return "sp"
        return "plain"

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the plan file's ``tensor_parallel``)."""
        return {"tp": self.tp, "params": dict(sorted(self.params.items())), "regions": list(self.regions),
                "replicated_columns": {str(k): list(v) for k, v in sorted(self.replicated_columns.items())},
                "sequence_parallel": self.sequence_parallel, "notes": list(self.notes), "refusals": list(self.refusals)}


def _unit_text(what: str, count: int, params: Sequence[str]) -> str:
    owner = ", ".join(sorted(params)) or "it"
    if what == "vocabulary":
        return f"the vocabulary of {count} rows of {owner}"
    return f"the {count} {what} of {owner}"


def _region_placements(region: Mapping[str, Any], replicated: set[int]) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, col in enumerate(region["columns"]):
        for fqn, dim in col["params"].items():
            out[fqn] = REPLICATE if i in replicated else _shard(dim)
    for row in region["rows"]:
        for fqn, dim in row["params"].items():
            out[fqn] = REPLICATE if dim is None else _shard(dim)
    return out


def _split_region(region: Mapping[str, Any], tp: int) -> tuple[set[int] | None, str]:
    """``(replicated columns, "")`` when ``tp`` splits the region, else ``(None, reason)``."""
    failing: dict[int, list] = {}
    for i, col in enumerate(region["columns"]):
        bad = [(str(w), int(c)) for w, c in col["units"] if int(c) % tp]
        if bad:
            failing[i] = bad
    if not failing:
        return set(), ""
    first = min(failing)
    what, count = failing[first][0]
    reason = (f"tp={tp} does not divide {_unit_text(what, count, region['columns'][first]['params'])} "
              f"({region['kind']} {region['module'] or 'at top level'})")
    passing = set(range(len(region["columns"]))) - set(failing)
    gqa = (region["kind"] == "attention" and passing and all(tp % c == 0 for bad in failing.values() for _, c in bad)
           and all(set(row["columns"]) & passing for row in region["rows"]))
    return (set(failing), "") if gqa else (None, reason)


def resolve_tensor_parallel(record: Mapping[str, Any] | None, tp: int) -> TensorParallelLayout:
    """What is split at degree ``tp`` (see the module docstring).

    Parameters
    ----------
    record : Mapping or None
        ``graph.meta["tensor_parallel"]`` (:meth:`fxpipe.passes.tensor_parallel.TensorParallelStructure.meta`);
        None: a graph captured before tensor parallelism (nothing is split).
    tp : int
        The degree, >= 1.

    Returns
    -------
    TensorParallelLayout
    """
    tp = int(tp)
    if tp < 1:
        raise InputError(f"tp must be an integer >= 1, got {tp}")
    if tp == 1 or not record:
        return TensorParallelLayout(tp, notes=() if record or tp == 1 else
                                    ("the graph carries no tensor-parallel record (captured before fxpipe found "
                                     "tensor-parallel patterns): nothing is split",))
    regions = list(record.get("regions") or [])
    notes: list[str] = []
    refusals: list[str] = []
    split: dict[int, set[int]] = {}
    for r in regions:
        replicated, reason = _split_region(r, tp)
        if replicated is None:
            (refusals if r["kind"] in _BLOCKS else notes).append(reason)
        else:
            split[int(r["id"])] = replicated
    while True:  # a parameter split one way must be split that way everywhere it is used
        seen: dict[str, tuple[str, int]] = {}
        conflict = None
        for r in regions:
            mine = _region_placements(r, split.get(int(r["id"]), set()))
            for fqn, pl in mine.items():
                if int(r["id"]) not in split:
                    pl = REPLICATE
                if fqn in seen and seen[fqn][0] != pl:
                    conflict = (fqn, seen[fqn][1], int(r["id"]))
                    break
                seen.setdefault(fqn, (pl, int(r["id"])))
            if conflict:
                break
        if conflict is None:
            break
        fqn, a, b = conflict
        for rid in (a, b):
            if split.pop(rid, None) is not None:
                notes.append(f"{fqn} is shared by {regions[a]['kind']} {regions[a]['module'] or 'at top level'} and "
                             f"{regions[b]['kind']} {regions[b]['module'] or 'at top level'}, which tp={tp} does not "
                             "split alike: both stay replicated")
    params: dict[str, str] = {}
    for r in regions:
        if int(r["id"]) in split:
            params.update(_region_placements(r, split[int(r["id"])]))
    sizes = [int(s) for s in record.get("sequence_sizes") or []]
    seq = bool(split) and bool(sizes) and all(s % tp == 0 for s in sizes)
    if split and sizes and not seq:
        notes.append(f"sequence parallelism off: tp={tp} does not divide the sequence length "
                     f"{next(s for s in sizes if s % tp)} (the norms and residual stream stay replicated)")
    return TensorParallelLayout(tp, params, tuple(sorted(split)),
                                {k: tuple(sorted(v)) for k, v in split.items() if v}, seq, tuple(notes),
                                tuple(refusals))


def graph_tensor_parallel(graph, tp: int) -> TensorParallelLayout:
    """:func:`resolve_tensor_parallel` of an :class:`~fxpipe.ir.OpGraph`'s record (``graph.meta``)."""
    return resolve_tensor_parallel((getattr(graph, "meta", None) or {}).get("tensor_parallel"), tp)


def node_domains(graph, layout: TensorParallelLayout) -> list[str]:
    """:meth:`TensorParallelLayout.domain` of every OpGraph node (``extra[i]["tp_role"]`` / ``["tp_region"]``)."""
    ext = graph.extra or ({},) * graph.n
    return [layout.domain(e.get("tp_role"), e.get("tp_region")) for e in ext]


def stage_tensor_parallel(graph, assignment: Sequence[int], num_stages: int, layout: TensorParallelLayout) -> list[dict]:
    """Per pipeline stage: the share of its FLOPs split over ``tp`` and, when none is, why.

    Returns
    -------
    list[dict]
        ``{"stage", "split_flops_share" (0..1), "sequence_parallel_ops", "reason" (empty when
        something is split)}`` per stage; the reason names the rejected patterns in the stage,
        else its heaviest ops (e.g. convolutions) that no tensor-parallel pattern covers.
    """
    record = (getattr(graph, "meta", None) or {}).get("tensor_parallel") or {}
    rejected: dict[str, str] = {r["node"]: r["reason"] for r in record.get("rejected") or []}
    dom = node_domains(graph, layout)
    ext = graph.extra or ({},) * graph.n
    out = []
    for s in range(int(num_stages)):
        idx = [i for i in range(graph.n) if int(assignment[i]) == s]
        flops = [float(ext[i].get("flops", 0.0)) for i in idx]
        total = sum(flops)
        split = sum(f for i, f in zip(idx, flops) if dom[i] == "tp")
        reason = ""
        if split <= 0:
            why = [f"{graph.names[i]}: {rejected[graph.names[i]]}" for i in idx if graph.names[i] in rejected]
            if why:
                reason = "; ".join(why[:2]) + (f" (and {len(why) - 2} more)" if len(why) > 2 else "")
            else:
                heavy = sorted(((f, str(ext[i].get("target", graph.names[i]))) for i, f in zip(idx, flops) if f > 0),
                               reverse=True)
                kinds = []
                for _, t in heavy:
                    if t not in kinds:
                        kinds.append(t)
                reason = ("no matmul with a parameter weight to split"
                          + (f" (its work: {', '.join(kinds[:3])})" if kinds else " (no compute)"))
        out.append({"stage": s, "split_flops_share": split / total if total > 0 else 0.0,
                    "sequence_parallel_ops": sum(1 for i in idx if dom[i] == "sp"), "reason": reason})
    return out


def check_tensor_parallel(graph, tp: int, what: str = "mesh") -> TensorParallelLayout:
    """The layout of a pinned ``tp``, refused when it cannot split the model as asked.

    Raises
    ------
    InputError
        When ``tp`` does not divide the heads or widths of an attention block or MLP (the
        message names them and the degrees that would); when nothing in the model can be split
        (no column / row pattern: the reasons of the rejected candidates); when the hardware's
        nodes are known (``graph.meta["topology"]``) and ``tp`` consecutive ranks do not fit in
        one (tensor parallelism's per-layer collectives run on the node's links: ``tp`` divides
        ``devices_per_node``).
    """
    layout = graph_tensor_parallel(graph, tp)
    if tp == 1:
        return layout
    record = (getattr(graph, "meta", None) or {}).get("tensor_parallel")
    if layout.refusals:
        units = sorted({int(c) for r in (record or {}).get("regions", []) if r["kind"] in _BLOCKS
                        for col in r["columns"] for _, c in col["units"]})
        ok = [t for t in (2, 4, 8, 16) if t != tp and all(u % t == 0 for u in units)]
        raise InputError(f"{what} tp={tp}: {layout.refusals[0]}"
                         + (f" (and {len(layout.refusals) - 1} more blocks)" if len(layout.refusals) > 1 else "")
                         + (f"; degrees that divide every block: {ok}" if ok else "; no degree above 1 divides every block"))
    if not layout.regions:
        why = [r["reason"] for r in (record or {}).get("rejected", [])][:2]
        raise InputError(f"{what} tp={tp}: nothing in the model can be split across tensor-parallel ranks "
                         + ("(" + "; ".join(why) + ")" if why else
                            "(no matmul with a parameter weight: convolutions and other ops have no tensor-parallel "
                            "pattern)")
                         + "; use tp=1")
    per_node = _devices_per_node(graph)
    if per_node is not None and per_node % tp:  # tp consecutive ranks (innermost) share a node in every group
        raise InputError(f"{what} tp={tp}: tensor parallelism runs inside a node (its collectives in every layer need "
                         f"the node's links) and {tp} consecutive ranks do not fit in the nodes of "
                         f"{per_node} devices of {getattr(graph, 'meta', {}).get('hardware', 'this hardware')}: "
                         f"use a tp that divides {per_node}")
    return layout


def tensor_parallel_options(options):
    """The planning options (:class:`fxpipe.options.PlanOptions`) of a ``tp > 1`` mesh: ``options`` as they are.

    The runtime runs every activation-checkpoint policy (per-block ``full``, ``selective``,
    ``budget``, whole-stage ``stage``) and activation offload/reload under tensor parallelism
    (:func:`fxpipe.codegen.tensor_parallel.check_tensor_parallel_run`: the stash keeps DTensor
    activations by their local shards), so nothing is taken away; their costs are one rank's
    (:func:`tensor_parallel_graph`: kept bytes of sharded values at ``1 / tp``, replayed ops at
    ``1 / tp`` of their compute, and a replayed block's forward collectives, which
    ``tensor_parallel_graph`` puts on its first column and its rows, replayed with it). The one
    place that says what a ``tp > 1`` plan may use, for :func:`fxpipe.api.compile` and the mesh
    search alike."""
    return options


def _devices_per_node(graph) -> int | None:
    """``devices_per_node`` of the topology the capture recorded (``graph.meta["topology"]``), or None."""
    doc = (getattr(graph, "meta", None) or {}).get("topology")
    return int(doc["devices_per_node"]) if doc else None


def tp_collective_s(kind: str, nbytes: float, tp: int, topology=None, bandwidth_bytes_per_s: float = 1.0) -> float:
    """Seconds of one tensor-parallel collective of a ``nbytes`` tensor (its full size) over ``tp`` ranks.

    Ring collectives (Thakur, Rabenseifner and Gropp 2005), as :func:`fxpipe.mesh.dp_sync_parts_s`
    prices the data-parallel ones: an all-gather or reduce-scatter moves ``(tp - 1) / tp * nbytes``
    per rank, an all-reduce twice that, each step costing the link's latency. Tensor parallelism
    is innermost (``tp`` consecutive ranks, inside a node: :func:`check_tensor_parallel`), so with a
    :class:`~fxpipe.mesh.Topology` the link is the node's (NVLink) at the bandwidth NCCL achieves for
    ``kind`` (:meth:`~fxpipe.mesh.Topology.achieved`, ``inter_node=False``); without one,
    ``bandwidth_bytes_per_s`` (the graph's link) and no latency.

    Parameters
    ----------
    kind : {"all_gather", "reduce_scatter", "all_reduce"}
    nbytes : float
        Bytes of the whole (unsharded) tensor.
    tp : int
        The degree.
    topology : Topology, optional
    bandwidth_bytes_per_s : float
        The link without a topology.

    Returns
    -------
    float
        Seconds; 0 for ``tp = 1``.
    """
    tp = int(tp)
    if tp <= 1 or nbytes <= 0:
        return 0.0
    if topology is not None:
        bw = float(topology.intra_node_bytes_per_s) * topology.achieved(kind, inter_node=False)
        lat = float(topology.intra_node_latency_s)
    else:
        bw, lat = float(bandwidth_bytes_per_s), 0.0
    steps = 2 if kind == "all_reduce" else 1
    return steps * ((tp - 1) / tp * float(nbytes) / bw + (tp - 1) * lat)


def _region_collectives(kind: str, sp: bool) -> tuple[tuple, tuple]:
    """``(forward, backward)`` collectives of a split region: ``(collective kind, tensor, where)`` each.

    ``tensor``: ``"in"`` (the columns' input), ``"out"`` (a row's or the embedding's output) or
    ``"logits"`` (the output projection's whole output); ``where``: ``"first"`` (the region's first
    column, the op that starts it) or ``"end"`` (the op that ends it: each row, the embedding, the
    output projection). Megatron-LM's ``f`` / ``g`` operators (Shoeybi et al. 2019, Sec. 3, Fig. 3),
    with sequence parallelism ``g`` / ``g-bar`` (Korthikanti et al. 2022, Sec. 4.2.2, Fig. 6): an
    all-gather before the columns and a reduce-scatter after the row in the forward, the reverse in the
    backward; without it one all-reduce each way."""
    if kind == "embedding":  # vocab-parallel: a partial sum reduced at once
        return ((("reduce_scatter" if sp else "all_reduce"), "out", "end"),), \
            (((("all_gather", "out", "end"),) if sp else ()))
    if kind == "output":  # a column whose output (the logits) is all-gathered at the model's output
        fwd = ((("all_gather", "in", "first"),) if sp else ()) + (("all_gather", "logits", "end"),)
        return fwd, ((("reduce_scatter" if sp else "all_reduce"), "in", "first"),)
    if sp:
        return ((("all_gather", "in", "first"), ("reduce_scatter", "out", "end")),
                (("all_gather", "out", "end"), ("reduce_scatter", "in", "first")))
    return ((("all_reduce", "out", "end"),), (("all_reduce", "in", "first"),))


def tensor_parallel_graph(graph, tp: int, topology=None):
    """What one of ``tp`` tensor-parallel ranks computes, holds and sends: ``graph`` with tp's costs.

    At the layout :func:`graph_tensor_parallel` resolves for ``tp`` (Megatron-LM's column / row
    split, Shoeybi et al. 2019, Sec. 3; sequence parallelism, Korthikanti et al. 2022, Sec. 4.2.2):

    * every op of a split region (``tp_role`` column / row / sharded) and, with sequence
      parallelism, every ``sequence`` op (norms, dropout, residual additions on the sequence
      shard) costs ``1 / tp`` of its compute (``t_fwd_s``, ``t_bwd_input_s``, ``t_bwd_weight_s``),
      keeps ``1 / tp`` of its activations (``act_bytes``) and outputs ``1 / tp`` of its bytes
      (``size_out_bytes``). Exceptions, as the runtime (DTensor) runs them: a column matmul saves
      its whole input (under sequence parallelism the all-gathered one; Megatron-LM would save the
      shard and gather it again in the backward, Korthikanti Sec. 4.2.3, fxpipe's runtime does
      not); a row's output is the reduced sum, whole without sequence parallelism and the sequence
      shard with it, as is the vocab-parallel embedding's; the output projection's logits are
      all-gathered, whole; a k / v projection grouped-query attention keeps replicated (fewer kv
      heads than ``tp``) is computed whole. So pipeline sends carry the sequence shard of a
      sequence-parallel value and the whole tensor otherwise;
    * the parameters of a split region's matmuls are ``1 / tp`` (``size_param_bytes`` and
      ``extra[i]["num_params"]``: gradients and optimizer state follow in the memory model, which
      derives them from the parameters); replicated parameters (norm weights, a replicated k / v,
      every op outside the split regions) stay whole. A row's bias, replicated, is counted as
      split with its weight (``1 / in_features`` of the row's parameters);
    * every split region adds its collectives (:func:`_region_collectives`, priced by
      :func:`tp_collective_s` on the node's links) to the op that starts it (the first column:
      the input's all-gather in the forward, the input gradient's reduction in the backward) or
      ends it (each row: the output's reduction in the forward, the output gradient's all-gather
      in the backward), not overlapped with compute (Megatron-LM without communication overlap,
      torchtitan without async TP); backward collectives go to ``t_bwd_input_s``.

    Everything else (ops of regions ``tp`` does not split, a MoE's experts, convolutions) is
    computed whole by every rank. ``extra[i]["flops"]`` is left as captured (the op's work, not the
    rank's); ``graph.meta[TP_COSTS_KEY]`` records the degree and the collectives' seconds per micro-batch.

    Parameters
    ----------
    graph : OpGraph
        The captured graph (one micro-batch, every rank's view at ``tp = 1``).
    tp : int
        The degree, >= 1.
    topology : Topology, optional
        The hardware's nodes (:meth:`fxpipe.mesh.Topology.of_graph`); without one the collectives run
        at ``graph.bandwidth_bytes_per_s``.

    Returns
    -------
    OpGraph
        ``graph`` itself for ``tp = 1`` or when it already has ``tp``'s costs, else a new graph with
        the same nodes, edges, names and ``extra`` keys (its structure signature is unchanged).

    Raises
    ------
    InputError
        When ``graph`` already carries the costs of another degree.
    """
    tp = int(tp)
    done = (graph.meta or {}).get(TP_COSTS_KEY)
    if done:
        if int(done["tp"]) == tp:
            return graph
        raise InputError(f"the graph already carries the costs of tp={done['tp']}: plan tp={tp} on the captured graph")
    if tp == 1:
        return graph
    layout = graph_tensor_parallel(graph, tp)
    regions = {int(r["id"]): r for r in ((graph.meta or {}).get("tensor_parallel") or {}).get("regions") or []}
    index = {name: i for i, name in enumerate(graph.names)}
    n, sp = graph.n, layout.sequence_parallel
    work = np.ones(n)
    out = np.ones(n)
    act = np.ones(n)
    par = np.ones(n)
    for i, d in enumerate(node_domains(graph, layout)):
        if d != "plain":
            work[i] = out[i] = act[i] = 1.0 / tp
    local = out.copy()  # what the op itself leaves on the rank (a kept op result), before its region's collective
    fwd = np.zeros(n)
    bwd = np.zeros(n)
    size_out = np.asarray(graph.size_out_bytes, dtype=np.float64)
    for rid in layout.regions:
        r = regions[rid]
        kept = set(layout.replicated_columns.get(rid, ()))
        cols = [index[c["node"]] for c in r["columns"]]
        for ci, i in enumerate(cols):
            act[i] = 1.0  # the column's whole input (the all-gathered one under sequence parallelism)
            if ci in kept:
                work[i] = out[i] = 1.0
            else:
                par[i] = 1.0 / tp
        ends = [index[row["node"]] for row in r["rows"]] or cols[:1]
        for i in ends[: len(r["rows"])]:
            par[i] = 1.0 / tp
            out[i] = 1.0 / tp if sp else 1.0  # the reduced sum: reduce-scattered under sequence parallelism
            local[i] = 1.0  # the partial sum, whole
        if r["kind"] == "embedding":
            out[cols[0]] = 1.0 / tp if sp else 1.0
            local[cols[0]] = 1.0  # the masked partial sum, whole
        elif r["kind"] == "output":
            out[cols[0]] = 1.0  # the logits, all-gathered
            local[cols[0]] = 1.0 if 0 in kept else 1.0 / tp  # the logits of its vocabulary shard
        first = min(cols)
        preds = graph.pred_idx[graph.pred_ptr[first]:graph.pred_ptr[first + 1]]
        sizes = {"in": float(size_out[preds].max()) if len(preds) else 0.0}
        fw, bw = _region_collectives(r["kind"], sp)
        for into, ops in ((fwd, fw), (bwd, bw)):
            for kind, tensor, where in ops:
                for i in ([first] if where == "first" else ends):
                    nbytes = sizes["in"] if tensor == "in" else float(size_out[i])
                    into[i] += tp_collective_s(kind, nbytes, tp, topology, graph.bandwidth_bytes_per_s)
    extra = tuple(dict(e, num_params=float(e["num_params"]) * par[i]) if "num_params" in e and par[i] != 1.0 else e
                  for i, e in enumerate(graph.extra or ()))
    meta = dict(graph.meta or {})
    meta[TP_COSTS_KEY] = {"tp": tp, "sequence_parallel": sp, "regions": len(layout.regions),
                          "collective_fwd_s": float(fwd.sum()), "collective_bwd_s": float(bwd.sum()),
                          RESULT_BYTES_KEY: {graph.names[i]: float(size_out[i] * local[i])
                                             for i in np.flatnonzero(local != out).tolist()}}

    def frozen(a) -> np.ndarray:
        a = np.ascontiguousarray(a, dtype=np.float64)
        a.setflags(write=False)
        return a

    return dataclasses.replace(
        graph, t_fwd_s=frozen(graph.t_fwd_s * work + fwd), t_bwd_input_s=frozen(graph.t_bwd_input_s * work + bwd),
        t_bwd_weight_s=frozen(graph.t_bwd_weight_s * work), size_out_bytes=frozen(size_out * out),
        act_bytes=frozen(graph.act_bytes * act), size_param_bytes=frozen(graph.size_param_bytes * par),
        extra=extra or graph.extra, meta=meta)
