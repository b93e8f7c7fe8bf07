"""Export a cost-annotated fx graph as an :class:`~fxpipe.ir.OpGraph` (Contract 1), and the
one-call front end :func:`trace_model` (capture + annotate + export).

Node mapping (what codegen and the partition baselines rely on):

* OpGraph nodes are, in fx program order, the fx ``placeholder`` nodes (model inputs, op
  ``"placeholder"``), every ``call_function`` / ``call_module`` / ``call_method`` node, and
  the ``output`` node (op ``"output"``, zero cost). ``get_attr`` nodes are not OpGraph
  nodes: a parameter's bytes are folded into its first consumer (``size_param_bytes``);
  codegen places the ``get_attr`` on every stage that uses it.
* Ids follow program order, so ``0..n-1`` is a topological order; placeholders come first
  (torch.export puts them before any computation) and the output last.
* ``OpGraph.names[i]`` is the fx node name (``node.name``), unique in the graph; the
  returned ``node_names`` list is the same thing, so ``id = node_names.index(node.name)``.
* Edges ``(u, v)``: ``v`` uses the value of ``u`` (``u in v.all_input_nodes``), for every
  pair of OpGraph nodes; dependencies through ``get_attr`` are not edges.
* ``extra[i]``: ``{"module": innermost nn_module_stack path with the wrapper prefix
  stripped (e.g. "transformer.h.3.mlp.c_fc"), "target": str(node.target), "flops": float,
  "kind": OpCost.kind, "num_params": int, "skey": str, "sop": str}``; ``num_params`` counts the
  parameters whose bytes are in ``size_param_bytes`` (what :mod:`fxpipe.memory` charges bytes per
  parameter for); ``skey`` and ``sop`` are the node's structural key and op key
  (:func:`fxpipe.passes.structure.structural_keys`, ``""`` for an op that does no work): the
  graph's identity independent of node names, and what names the ops that differ.
  A node whose output size depends on the data (an unbacked symbolic size: ``x[mask]``,
  ``nonzero``, ``unique``, ...; :func:`~fxpipe.passes.capture.has_data_dependent_size`) also
  has ``"data_dependent": True`` and ``"source"`` (the user's source line); the partitioner
  never cuts its output edges (:mod:`fxpipe.partition.colocate`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from fxpipe.cost.hardware import HardwareSpec, get_hardware
from fxpipe.cost.roofline import OpCost
from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.passes.annotate import COST_KEY, AnnotateCosts
from fxpipe.passes.costing import SAVES_KEY
from fxpipe.passes.capture import (
    MODULE_PREFIX_KEY,
    Captured,
    capture,
    getattr_path,
    has_data_dependent_size,
    user_source_line,
)
from fxpipe.passes.structure import OPKEY, SKEY, module_path, structural_keys

#: fx ops that become OpGraph nodes.
OPGRAPH_FX_OPS = ("placeholder", "call_function", "call_module", "call_method", "output")


def to_opgraph(gm: torch.fx.GraphModule, hardware: str | HardwareSpec = "h100-sxm", *, name: str = "model",
               module_prefix: str | None = None) -> tuple[OpGraph, list[str]]:
    """Build the Contract-1 :class:`OpGraph` of a cost-annotated graph module.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        Annotated by :class:`~fxpipe.passes.annotate.AnnotateCosts` (every node has
        ``meta["fxpipe_cost"]``).
    hardware : str or HardwareSpec
        Its device-to-device bandwidth (NVLink, per direction) as a stage's send achieves it
        (:attr:`~fxpipe.cost.specs.HardwareSpec.p2p_bytes_per_s`) becomes ``bandwidth_bytes_per_s``.
    name : str
        Graph name.
    module_prefix : str, optional
        Prefix stripped from module paths; default ``gm.meta["fxpipe_module_prefix"]``
        (set by :func:`~fxpipe.passes.capture.capture` for fxpipe's wrapper), else none.

    Returns
    -------
    graph : OpGraph
        n nodes (see the module docstring for the mapping), ids in program order.
    node_names : list[str]
        ``node_names[i]`` is the fx node name of OpGraph node ``i``.

    Raises
    ------
    InputError
        If a node has no cost annotation (run AnnotateCosts first).
    """
    hw = get_hardware(hardware)
    prefix = gm.meta.get(MODULE_PREFIX_KEY, "") if module_prefix is None else module_prefix
    kept = [n for n in gm.graph.nodes if n.op in OPGRAPH_FX_OPS
            and not (n.op == "call_module" and n.target == "_guards_fn")]  # export's input guard
    # placeholders first and the output last (torch.export already orders them so; a stable
    # sort keeps every other node in program order, which stays a topological order)
    rank = {"placeholder": 0, "output": 2}
    nodes = sorted(kept, key=lambda n: rank.get(n.op, 1))
    index: dict[torch.fx.Node, int] = {n: i for i, n in enumerate(nodes)}
    cols: dict[str, list[float]] = {k: [] for k in ("t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s",
                                                    "size_out_bytes", "size_param_bytes", "act_bytes")}
    extra: list[dict[str, Any]] = []
    edges: list[tuple[int, int]] = []
    numel = gm.meta.get("fxpipe_param_numel", {})
    skeys = structural_keys(gm)
    for node in nodes:
        cost = node.meta.get(COST_KEY)
        if not isinstance(cost, OpCost):
            raise InputError(f"fx node {node.name!r} has no cost: run AnnotateCosts on the graph first")
        if node.op == "output":  # zero time; keeps the bytes of a parameter returned as is
            cost = OpCost(kind="output", size_param_bytes=cost.size_param_bytes)
        for key in cols:
            cols[key].append(float(getattr(cost, key)))
        extra.append({"module": module_path(node, prefix), "target": str(node.target),
                      "flops": float(cost.flops), "kind": cost.kind, "num_params": int(numel.get(node.name, 0)),
                      SKEY: skeys[node.name][0], OPKEY: skeys[node.name][1]})
        if node.meta.get(SAVES_KEY):  # the bases its backward reads (activation checkpointing, issue 28)
            extra[-1]["saves"] = list(node.meta[SAVES_KEY])
        if has_data_dependent_size(node):  # must not cross a stage boundary (fxpipe.partition.colocate)
            extra[-1].update(data_dependent=True, source=user_source_line(node))
        v = index[node]
        for inp in node.all_input_nodes:
            u = index.get(inp)
            if u is not None:
                edges.append((u, v))
    # get_attr bytes owned by a get_attr that has no OpGraph consumer are impossible: the
    # owner is always a consumer; check the totals agree
    total_param = sum(float(n.meta[COST_KEY].size_param_bytes) for n in gm.graph.nodes if COST_KEY in n.meta)
    if abs(total_param - sum(cols["size_param_bytes"])) > 1e-6 * max(1.0, total_param):
        raise AssertionError("parameter bytes were assigned to a node outside the OpGraph; this is a bug in fxpipe")
    names = [n.name for n in nodes]
    graph = OpGraph.from_arrays(
        **cols, edges=edges if edges else [], bandwidth_bytes_per_s=hw.p2p_bytes_per_s, names=names,
        ops=[n.op for n in nodes], name=name, extra=extra,
        meta={"hardware": hw.name, "source": "fxpipe.passes.to_opgraph",
              **({"topology": hw.topology()} if hw.inter_node_bytes_per_s > 0 else {}),
              "host": {"host_bytes_per_s": float(hw.host_copy_bytes_per_s),
                       "host_memory_bytes_per_s": float(hw.host_memory_bytes_per_s),
                       "host_memory_bytes": float(hw.host_memory_bytes)}},
    )
    return graph, names


@dataclass
class TracedModel:
    """Result of :func:`trace_model`.

    Attributes
    ----------
    captured : Captured
        ``.exported`` and ``.gm`` (unlifted, trainable; every node has
        ``meta["val"]`` and ``meta["fxpipe_cost"]``).
    graph : OpGraph
        The Contract-1 graph.
    node_names : list[str]
        ``node_names[i]`` = fx node name of OpGraph node ``i``.
    hardware : HardwareSpec
    dtype : torch.dtype or None
        Cost dtype override used (None: tensors' own dtypes).
    capture_s, cost_s, export_s : float
        Wall time of capture, cost annotation, OpGraph export (seconds).
    """

    captured: Captured
    graph: OpGraph
    node_names: list[str]
    hardware: HardwareSpec
    dtype: Any = None
    capture_s: float = 0.0
    cost_s: float = 0.0
    export_s: float = 0.0
    timings: dict = field(default_factory=dict)

    @property
    def gm(self) -> torch.fx.GraphModule:
        return self.captured.gm

    @property
    def exported(self):
        return self.captured.exported

    def node_id(self, fx_name: str) -> int:
        """OpGraph id of an fx node name (raises InputError if it is not an OpGraph node)."""
        try:
            return self._ids[fx_name]
        except AttributeError:
            self._ids = {nm: i for i, nm in enumerate(self.node_names)}
            return self.node_id(fx_name)
        except KeyError:
            raise InputError(f"fx node {fx_name!r} is not an OpGraph node (get_attr nodes are not)") from None


def trace_model(model: torch.nn.Module, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
                hardware: str | HardwareSpec = "h100-sxm", dtype: torch.dtype | None = None,
                name: str | None = None, dynamic: bool = False, allow_tf32: bool = False,
                replicate: str = "auto") -> TracedModel:
    """Capture, cost and export a model in one call.

    Parameters
    ----------
    model : torch.nn.Module
        Any device, including ``meta``.
    args, kwargs
        Example inputs of ONE micro-batch.
    hardware : str or HardwareSpec
        Device to cost for.
    dtype : torch.dtype, optional
        Cost floating-point tensors as this dtype (see :class:`AnnotateCosts`).
    name : str, optional
        Graph name (default: the model class name).
    dynamic : bool
        Export with dynamic dimensions (see :func:`~fxpipe.passes.capture.capture`).
    allow_tf32 : bool
        Cost float32 matmuls at the TF32 peak.
    replicate : {"auto", "always", "never"}
        Layer replication of deep models (:func:`~fxpipe.passes.capture.capture`); the
        graph is the same as a full export's, ``timings["replication"]`` says whether it
        was used.

    Raises
    ------
    CaptureError
        If torch.export fails.
    InputError
        For unknown hardware or a bad dtype.
    """
    hw = get_hardware(hardware)
    annot = AnnotateCosts(hw, dtype, allow_tf32=allow_tf32)  # validate before the slow part
    cap = capture(model, args, kwargs, dynamic=dynamic, replicate=replicate)
    t0 = time.perf_counter()
    annot(cap.gm)
    t1 = time.perf_counter()
    if name is None:
        # a thin wrapper (e.g. fxpipe.models.LogitsOnly) is named after the model it wraps
        inner = getattr_path(model, cap.module_prefix.rstrip(".")) if cap.module_prefix else None
        name = type(inner if isinstance(inner, torch.nn.Module) else model).__name__
    graph, names = to_opgraph(cap.gm, hw, name=name)
    t2 = time.perf_counter()
    return TracedModel(captured=cap, graph=graph, node_names=names, hardware=hw, dtype=dtype,
                       capture_s=cap.capture_s, cost_s=t1 - t0, export_s=t2 - t1,
                       timings={"capture_s": cap.capture_s, "cost_s": t1 - t0, "export_s": t2 - t1,
                                "replication": cap.replication})
