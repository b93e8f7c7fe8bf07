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
parallelism is not offered for it, its ranks replicate it. The costs of tensor parallelism are
not modelled yet (a plan with ``tp > 1`` is costed as ``tp = 1`` and says so).

The runtime (:mod:`fxpipe.codegen.tensor_parallel`) resolves the same record of its own capture
with this function, so what runs is what was planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from fxpipe.errors import InputError
from fxpipe.mesh.costs import Topology

__all__ = [
    "REPLICATE",
    "TensorParallelLayout",
    "resolve_tensor_parallel",
    "graph_tensor_parallel",
    "node_domains",
    "stage_tensor_parallel",
    "check_tensor_parallel",
    "TP_COSTS_WARNING",
]

#: The placement text of a replicated parameter (DTensor's ``repr`` of ``Replicate()``).
REPLICATE = "Replicate()"
#: The warning every plan with ``tp > 1`` carries until the costs are modelled (issue 29, items 3 and 4).
TP_COSTS_WARNING = ("tp costs not modelled yet: the partition, schedule, memory and predicted step are those of "
                    "tp=1 (no 1/tp compute, no tensor-parallel collectives, no 1/tp parameters)")

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
    topology = Topology.of_graph(graph)
    if topology is not None and not topology.in_node(1, tp, tp * topology.devices_per_node):  # every group of a job
        raise InputError(f"{what} tp={tp}: tensor parallelism runs inside a node (its collectives in every layer need "
                         f"the node's links) and {tp} consecutive ranks do not fit in the nodes of "
                         f"{topology.devices_per_node} devices of {getattr(graph, 'meta', {}).get('hardware', 'this hardware')}: "
                         f"use a tp that divides {topology.devices_per_node}")
    return layout
