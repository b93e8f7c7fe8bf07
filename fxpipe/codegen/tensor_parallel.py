"""Tensor parallelism at run time: a rank's stage modules on DTensor over its ``tp`` sub-mesh.

The plan's sharding (:mod:`fxpipe.mesh.tensor_parallel`, found on the graph by
:mod:`fxpipe.passes.tensor_parallel`) is applied to each stage's ``GraphModule`` in place,
before FSDP2 / ``replicate`` wrap it (:mod:`fxpipe.codegen.mesh`):

* **parameters** become ``DTensor`` parameters on the ``tp`` sub-mesh with their planned
  placements (``distribute_tensor`` of the full value every rank holds, no communication):
  column weights ``Shard`` along their output features, row weights along their input
  features, vocab-parallel tables along the vocabulary, everything else ``Replicate``;
* **every node runs in one of three domains**: a split region (attention, MLP, embedding,
  output projection) on DTensor, where DTensor's sharding propagation computes each op on the
  local shards and inserts no collective (the rules of the finder are exactly those ops); the
  sequence-parallel ops on DTensor ``Shard(1)``; the rest on plain tensors, replicated (every
  tensor-parallel rank computes it whole);
* **between domains values travel as local tensors** of a known layout: whole (``R``) or the
  sequence shard (``S1``). A region's input is ``DTensor.from_local(x, [Replicate()])`` (from a
  sequence shard: ``from_local(x, [Shard(1)]).redistribute([Replicate()])``, the all-gather
  whose backward is a reduce-scatter); its output is ``redistribute`` d to ``Replicate`` (the
  row's all-reduce) or to ``Shard(1)`` (the reduce-scatter of sequence parallelism) and
  ``to_local`` ed. ``from_local``'s backward turns every gradient into its forward placement,
  so a gradient never reaches a region's boundary as a partial sum of another kind (DTensor
  cannot turn a partial sum back into the vocab-parallel embedding's masked one);
* **shape-only reads** (role ``shape``: a static empty vector, the anchor that ties a layer's
  copy of a constant to the layer, :mod:`fxpipe.passes.duplicate_constants`) take every input
  as its local tensor, sharded or not (``to_local``, no communication): the value read is the
  same empty vector on every rank;
* **stage inputs and outputs** are local tensors in the layout of their value: the sequence
  shard for sequence-parallel values (the pipeline sends ``1 / tp`` of them), whole otherwise;
  the model's outputs whole. :meth:`TensorParallelRank.local_io` gives torch's
  ``PipelineStage`` the local shapes.

Gradients: a ``Replicate`` parameter read by sharded activations (a norm's weight under
sequence parallelism, k / v replicated for grouped-query attention) gets a partial-sum DTensor
gradient; :meth:`TensorParallelRank.reduce_grads` redistributes every gradient to its
parameter's placement once per step (FSDP2 does the same for its stages in ``REDUCE_GRAD``).

Activation checkpointing, recomputation and offload/reload run under tensor parallelism: the
stash (:mod:`fxpipe.codegen.stash`) keeps what autograd saves as DTensor by its local shard (counted,
moved and replayed as the shard, wrapped again when the backward reads it), and a stage's
checkpoint segments are carved again into the rewritten program
(:func:`fxpipe.codegen.checkpointing.rewrite_under_checkpoint`), so the layout conversions inside a
block (its all-gather and reduce-scatter) replay with it. Not yet with tensor parallelism (a clear
error before any process group is touched): ``compile_stages`` (Inductor sees plain tensors).

Sources: Shoeybi et al. 2019 (Megatron-LM, Sec. 3: column / row parallel matmuls);
Korthikanti et al. 2022 (sequence parallelism, Sec. 4.2.2); torch's DTensor
(``torch.distributed.tensor``: ``distribute_tensor``, ``DTensor.from_local`` / ``to_local`` /
``redistribute``) and torchtitan's ``parallelize_module`` plans (``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``), whose layouts these are, applied to exported graphs
whose module structure is gone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from fxpipe.codegen.shapes import StageIO
from fxpipe.codegen.split import last_stage_output, stage_input, stage_output
from fxpipe.errors import InputError
from fxpipe.mesh.tensor_parallel import REPLICATE, TensorParallelLayout, resolve_tensor_parallel

__all__ = ["TensorParallelRank", "check_tensor_parallel_run"]

_R, _S1 = "R", "S1"  # local layouts: whole, or the sequence shard (dim 1)


class _Convert:
    """A layout conversion, an fx ``call_function`` target bound to the ``tp`` sub-mesh."""

    def __init__(self, name: str, fn: Callable, mesh):
        self.__name__ = self.__qualname__ = f"tp_{name}"
        self.__module__ = __name__
        self._fn, self._mesh = fn, mesh

    def __call__(self, x):
        return self._fn(x, self._mesh)

    def __repr__(self) -> str:
        return self.__name__


class _LocalAttention:
    """``scaled_dot_product_attention`` of head-sharded DTensors, computed on the local heads.

    DTensor has no sharding rule for every backend's attention backward (torch 2.13 on CPU lacks
    ``_scaled_dot_product_flash_attention_for_cpu_backward``); attention over a head shard is
    exactly the attention of those heads, so q / k / v (and a mask with a head dim) are taken as
    their ``Shard(1)`` local tensors (a replicated k / v is sliced locally, no communication), the
    op runs on plain tensors and its output is the ``Shard(1)`` DTensor of the result (what
    ``torch.distributed.tensor.experimental.local_map`` does).
    """

    def __init__(self, mesh):
        self.__name__ = self.__qualname__ = "tp_local_attention"  # an fx call_function target's name
        self._mesh = mesh

    def __call__(self, q, k, v, attn_mask=None, *args, **kwargs):
        from torch.distributed.tensor import DTensor

        _, seq = _placements()
        local = [x.redistribute(self._mesh, seq).to_local() for x in (q, k, v)]
        if isinstance(attn_mask, DTensor):
            attn_mask = _redistribute_local(attn_mask, self._mesh, _S1 if attn_mask.shape[1] > 1 else _R)
        out = torch.ops.aten.scaled_dot_product_attention.default(*local, attn_mask, *args, **kwargs)
        return DTensor.from_local(out, self._mesh, seq, run_check=False)

    def __repr__(self) -> str:
        return self.__name__


def _placements():
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate()], [Shard(1)]


def _from_local(x, mesh, layout: str):
    from torch.distributed.tensor import DTensor

    rep, seq = _placements()
    return DTensor.from_local(x, mesh, rep if layout == _R else seq, run_check=False)


def _redistribute_local(x, mesh, layout: str):
    """A DTensor's value in ``layout``, as a local tensor."""
    rep, seq = _placements()
    return x.redistribute(mesh, rep if layout == _R else seq).to_local()


def _gathered(x, mesh):  # a fresh sequence-shard DTensor, all-gathered (backward: reduce-scatter)
    rep, _ = _placements()
    return _from_local(x, mesh, _S1).redistribute(mesh, rep)


#: (produced, needed) -> conversion (None: nothing to do); kinds: "R"/"S1" local tensors, "param",
#: "dsp" a sequence-parallel DTensor, "dt" a region's DTensor; needed adds "out:R"/"out:S1" (stage outputs)
_CONVERSIONS: dict[tuple[str, str], tuple[str, Callable] | None] = {
    (_R, _R): None, (_R, "out:R"): None,
    # a whole value read by a sequence-parallel op: its local sequence shard when it has the op's sequence dim (a
    # residual), else replicated, broadcast by DTensor (a norm's weight, a mask with a size-1 dim)
    (_R, "dsp"): ("r_to_sp", lambda x, m: _from_local(x, m, _R).redistribute(m, _placements()[1])),
    (_R, "dsp:broadcast"): ("r_to_sp_broadcast", lambda x, m: _from_local(x, m, _R)),
    (_R, "dt"): ("r_to_dt", lambda x, m: _from_local(x, m, _R)),
    (_S1, "dsp"): ("s1_to_sp", lambda x, m: _from_local(x, m, _S1)),
    (_S1, "dt"): ("s1_to_dt", _gathered),
    (_S1, _R): ("s1_to_r", lambda x, m: _gathered(x, m).to_local()),
    (_S1, "out:R"): ("s1_to_r", lambda x, m: _gathered(x, m).to_local()),
    (_S1, "out:S1"): None,
    (_R, "out:S1"): ("r_to_s1", lambda x, m: _from_local(x, m, _R).redistribute(m, _placements()[1]).to_local()),
    ("dt", "out:S1"): ("dt_to_s1", lambda x, m: _redistribute_local(x, m, _S1)),
    ("dsp", "dsp"): None,
    # (a sequence-parallel value is normally Shard(1) already; redistributing to it first is then free, and keeps the
    # sends and the gathers right for one DTensor left replicated, e.g. by an in-place op on a replicated tensor)
    ("dsp", "dt"): ("sp_to_dt", lambda x, m: _gathered(_redistribute_local(x, m, _S1), m)),
    ("dsp", _R): ("sp_to_r", lambda x, m: _redistribute_local(x, m, _R)),
    ("dsp", "out:R"): ("sp_to_r", lambda x, m: _redistribute_local(x, m, _R)),
    ("dsp", "out:S1"): ("sp_to_s1", lambda x, m: _redistribute_local(x, m, _S1)),
    ("dt", _R): ("dt_to_r", lambda x, m: _redistribute_local(x, m, _R)),
    ("dt", "out:R"): ("dt_to_r", lambda x, m: _redistribute_local(x, m, _R)),
    ("dt", "dsp"): ("dt_to_sp", lambda x, m: _from_local(_redistribute_local(x, m, _S1), m, _S1)),
    ("dt", "dt:other"): ("dt_to_dt", lambda x, m: _from_local(_redistribute_local(x, m, _R), m, _R)),
    ("param", "dt"): None, ("param", "dsp"): None,
    ("param", _R): ("param_to_local", lambda x, m: x.to_local()),
    ("param", "out:R"): ("param_to_local", lambda x, m: x.to_local()),
    # a shape-only read ("local"): any value as the tensor this rank holds, no communication
    (_R, "local"): None, (_S1, "local"): None,
    ("dt", "local"): ("dt_local", lambda x, m: x.to_local()), ("dsp", "local"): ("sp_local", lambda x, m: x.to_local()),
    ("param", "local"): ("param_local", lambda x, m: x.to_local()),
}


def check_tensor_parallel_run(tp: int, recompute_stages=(), offloads: bool = False, compile_stages: bool = False,
                              activation_checkpointing=None) -> None:
    """Refuse, before any process group is touched, what tensor parallelism does not run yet.

    Activation checkpointing of every kind (``activation_checkpointing``: the stages'
    :class:`~fxpipe.memory.checkpoint.CheckpointPolicy`), whole-stage recomputation
    (``recompute_stages``) and offload/reload actions (``offloads``) run with ``tp > 1`` (module
    docstring); the parameters stay for the callers' uniformity.

    Raises
    ------
    InputError
        With ``tp > 1``: ``compile_stages``.
    """
    if int(tp) > 1 and compile_stages:
        raise InputError(f"tensor parallelism (tp={tp}) does not run with compile_stages=True yet: Inductor compiles "
                         "plain tensors, not DTensor shards; use compile_stages=False or tp=1")


class TensorParallelRank:
    """One rank's tensor parallelism: the resolved layout, applied to its stage modules.

    Parameters
    ----------
    structure : fxpipe.passes.tensor_parallel.TensorParallelStructure
        :func:`~fxpipe.passes.tensor_parallel.find_tensor_parallel` of the graph the stages were
        split from (this process's capture: node names are its).
    tp_mesh : DeviceMesh
        The 1-D ``tp`` sub-mesh of this rank.
    expected_params : Mapping[str, str], optional
        The plan's placements (``plan.tensor_parallel.params``): the layout resolved here must
        equal them.

    Raises
    ------
    InputError
        When ``tp`` does not divide the model's blocks, nothing can be split, or the placements
        differ from the plan's.
    """

    def __init__(self, structure, tp_mesh, expected_params: Mapping[str, str] | None = None):
        tp = int(tp_mesh.size())
        self.layout: TensorParallelLayout = resolve_tensor_parallel(structure.meta(), tp)
        if self.layout.refusals:
            raise InputError(f"tp={tp}: {self.layout.refusals[0]}")
        if not self.layout.regions:
            raise InputError(f"tp={tp}: nothing in the model can be split across tensor-parallel ranks")
        if expected_params is not None and dict(expected_params) != self.layout.params:
            diff = sorted(set(expected_params.items()) ^ set(self.layout.params.items()))[:3]
            raise InputError(f"the plan's tensor-parallel placements differ from those found on this capture "
                             f"(e.g. {diff}): the model is not the one the plan was made for; run fxpipe.compile again")
        self.roles, self.node_region = dict(structure.roles), dict(structure.node_region)
        self.mesh = tp_mesh
        self._convert = {k: (None if v is None else _Convert(v[0], v[1], tp_mesh)) for k, v in _CONVERSIONS.items()}
        self._attention = _LocalAttention(tp_mesh)
        self._fresh = _Convert("fresh", lambda x, m: x.clone(), tp_mesh)
        self._distributed: dict[int, torch.nn.Parameter] = {}

    @property
    def tp(self) -> int:
        return self.layout.tp

    def domain(self, name: str) -> tuple[str, int | None]:
        """``("tp", region)``, ``("sp", None)`` or ``("plain", None)`` of a node of the capture."""
        region = self.node_region.get(name)
        d = self.layout.domain(self.roles.get(name), region)
        return d, (region if d == "tp" else None)

    def value_layout(self, name: str) -> str:
        """``"S1"`` for a sequence-parallel value (it crosses a stage boundary as its shard), else ``"R"``."""
        return _S1 if self.domain(name)[0] == "sp" else _R

    # ------------------------------------------------------------------ stage modules
    def shard_stage(self, spec, module: torch.nn.Module) -> None:
        """Make ``module`` (stage ``spec.index``'s, on its device) run tensor-parallel, in place.

        Its parameters become DTensors of their planned placements (a parameter tied across this
        rank's stages stays one object) and its graph gets the layout conversions between
        domains (module docstring).
        """
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        for fqn, target in spec.param_targets.items():
            p = module.get_parameter(target)
            new = self._distributed.get(id(p))
            if new is None:
                text = self.layout.params.get(fqn, REPLICATE)
                pl = Replicate() if text == REPLICATE else Shard(int(text[len("Shard("):-1]))
                new = torch.nn.Parameter(distribute_tensor(p.detach(), self.mesh, [pl], src_data_rank=None),
                                         requires_grad=p.requires_grad)
                self._distributed[id(p)] = new
                self._distributed[id(new)] = new
            owner, _, name = target.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, name, new)
        self._rewrite(spec, module)

    def _rewrite(self, spec, module: fx.GraphModule) -> None:
        """Insert the layout conversions of stage ``spec.index``'s graph (module docstring) and recompile it."""
        graph = module.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        origin: dict[fx.Node, str] = dict(zip(placeholders, spec.input_names))
        produced: dict[fx.Node, tuple[str, Any]] = {}  # node -> (kind of its value, region)
        need: dict[fx.Node, tuple[str, Any]] = {}  # consumer -> (kind it reads, region)
        # what each stage output sends, by the boundary's name (the node computing it may be another: the base
        # tensor of an in-place update)
        out_node = next(n for n in graph.nodes if n.op == "output")
        sent = dict(zip(out_node.args[0], spec.output_names)) if isinstance(out_node.args[0], (tuple, list)) else {}
        for n in list(graph.nodes):
            if n.op == "placeholder":
                produced[n] = (self.value_layout(origin[n]) if spec.index > 0 else _R, None)
            elif n.op == "get_attr":
                produced[n] = ("param" if isinstance(_attr(module, n.target), torch.nn.Parameter) else _R, None)
            elif n.op == "call_function" and n.target is stage_input:
                origin[n] = origin[n.args[0]]
                produced[n] = produced[n.args[0]]
            elif n.op == "call_function" and n.target in (stage_output, last_stage_output):
                name = sent.get(n, origin.get(n.args[0], n.args[0].name))
                need[n] = ("out:R" if n.target is last_stage_output else f"out:{self.value_layout(name)}", None)
            elif n.op in ("call_function", "call_method", "call_module"):
                dom, region = self.domain(n.name)
                kind = {"plain": _R, "sp": "dsp", "tp": "dt"}[dom]
                if kind != _R and str(n.target).endswith("_assert_tensor_metadata.default"):
                    graph.erase_node(n)  # a dtype / device check: DTensor has no rule for it
                    continue
                if kind == _R and self.roles.get(n.name) == "shape":
                    need[n] = ("local", None)  # reads only dtype and device: its inputs' local tensors
                else:
                    need[n] = (kind, region)
                produced[n] = (kind, region)
        # a region's value read by several other domains leaves it once, whole (a vocab-parallel embedding's masked
        # partial sum can be reduced only once), and every other layout is taken from that
        exits: dict[fx.Node, set] = {}
        for c, (kind, region) in need.items():
            for a in c.all_input_nodes:
                pk, pr = produced.get(a, (_R, None))
                if pk == "dt" and not (kind == "dt" and region == pr) and kind != "local" and _is_tensor(a):
                    exits.setdefault(a, set()).add(kind if kind != "dt" else "dt:other")
        whole = {a for a, keys in exits.items() if len(keys - {_R, "out:R"}) + bool(keys & {_R, "out:R"}) > 1}
        cache: dict = {}
        for c, (kind, region) in need.items():
            self._convert_args(graph, c, kind, region, produced, cache, whole)
            if kind == "dt" and c.target is torch.ops.aten.scaled_dot_product_attention.default:
                c.target = self._attention  # on the local heads (DTensor has no CPU backward rule for it)
        graph.lint()
        module.recompile()

    def _convert_args(self, graph: fx.Graph, node: fx.Node, need: str, region, produced: dict, cache: dict,
                      whole: set) -> None:
        """Replace every tensor argument of ``node`` by its conversion to ``need`` (one conversion node per
        value and kind, inserted before its first consumer; a region value in ``whole`` is first made whole)."""

        def insert(fn, a: fx.Node, key) -> fx.Node:
            hit = cache.get((a, key))
            if hit is None:
                with graph.inserting_before(node):
                    hit = graph.call_function(fn, (a,))
                hit.meta = dict(a.meta)
                # the module of the op it feeds: a per-block FSDP2 unit or checkpoint segment takes it with that op
                # (fxpipe.codegen.fsdp_blocks reads module paths), not with the producer's module
                hit.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
                cache[(a, key)] = hit
            return hit

        inplace = _writes_first_argument(node)

        def convert(a: fx.Node):
            kind, where = produced.get(a, (_R, None))
            key = need
            if kind == "dt" and need == "dt":
                if where == region:
                    return a
                key = "dt:other"
            if not _is_tensor(a):
                return a
            if kind == "dt" and (a in whole or (key == "dsp" and not _sequence_operand(a, node))):
                a, kind = insert(self._convert[("dt", _R)], a, "whole"), _R
                key = "dt" if key == "dt:other" else key
            if kind == _R and key == "dsp" and not _sequence_operand(a, node):
                key = "dsp:broadcast"
            if (kind, key) not in self._convert:
                raise InputError(f"tensor parallelism: no conversion of node {a.name} ({kind}) for node {node.name} "
                                 f"({need}); this is a bug in fxpipe")
            fn = self._convert[(kind, key)]
            if fn is not None and inplace and node.args and node.args[0] is a and key in (_R, "out:R", "out:S1"):
                # an in-place op on a region's output: a fresh tensor (to_local's view may not be written in place)
                return insert(self._fresh, insert(fn, a, key), "fresh")
            return a if fn is None else insert(fn, a, key)

        node.args = fx.node.map_arg(node.args, convert)
        node.kwargs = fx.node.map_arg(node.kwargs, convert)

    def local_io(self, spec, io: StageIO, last: bool) -> StageIO:
        """``io`` with the sequence-parallel inputs and outputs of stage ``spec.index`` at their local shard shape
        (``last``: the pipeline's last stage, whose outputs are the model's, whole)."""
        def local(t, name):
            if not isinstance(t, torch.Tensor) or self.value_layout(name) != _S1:
                return t
            shape = list(t.shape)
            shape[1] //= self.tp
            z = torch.zeros(shape, dtype=t.dtype, device=t.device)
            return z.requires_grad_(t.requires_grad) if t.requires_grad else z

        ins = io.inputs if spec.index == 0 else tuple(local(t, n) for t, n in zip(io.inputs, spec.input_names))
        outs = io.outputs if last else tuple(local(t, n) for t, n in zip(io.outputs, spec.output_names))
        return dataclasses.replace(io, inputs=ins, outputs=outs)

    # ------------------------------------------------------------------ gradients
    @staticmethod
    def reduce_grads(params) -> None:
        """Redistribute every DTensor gradient to its parameter's placements (partial sums reduced)."""
        from torch.distributed.tensor import DTensor

        for p in params:
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)


def _sequence_operand(a: fx.Node, node: fx.Node) -> bool:
    """Whether operand ``a`` of the sequence-parallel op ``node`` has the op's sequence dim (dim 1 of its output,
    operands aligned from the right as broadcasting does): it then enters as its sequence shard."""
    x, out = _meta(a), _meta(node)
    if isinstance(out, (tuple, list)):
        out = out[0] if out else None
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or out.dim() < 2:
        return False
    d = 1 - (out.dim() - x.dim())
    return 0 <= d < x.dim() and x.shape[d] == out.shape[1] and x.shape[d] > 1


def _meta(node: fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


def _writes_first_argument(node: fx.Node) -> bool:
    """An aten op that updates its first argument in place (``add_``, ``masked_fill_``, ...)."""
    text = str(node.target)
    parts = text.split(".")
    return node.op == "call_function" and len(parts) >= 2 and parts[0] == "aten" and parts[1].endswith("_") \
        and not parts[1].startswith("_")


def _attr(module: torch.nn.Module, target: str) -> Any:
    obj = module
    for part in str(target).split("."):
        obj = getattr(obj, part)
    return obj


def _is_tensor(node: fx.Node) -> bool:
    v = _meta(node)
    return v is None or isinstance(v, torch.Tensor)
