"""The model's calling convention on a pipeline: pytree inputs and outputs <-> flat stage tensors.

A captured graph takes the flattened leaves of ``(args, kwargs)`` as placeholders and returns
the flattened leaves of its output; ``torch.export`` records both tree structures (``in_spec``,
``out_spec``). A pipeline moves only tensors: stage 0 takes the tensor leaves of one
micro-batch, the last stage returns the tensor leaves of the output. :class:`ModelInterface`
converts between the two views so that users keep calling the pipeline like the model:

* **Inputs** of any pytree structure (positional dicts, nested lists, keyword arguments,
  registered dataclasses). Tensor leaves go to stage 0; non-tensor leaves (flags, strings,
  numbers) were specialised by ``torch.export`` into the graph, so each call must pass the
  captured value (anything else raises :class:`~fxpipe.errors.InputError`, never a silent
  wrong answer).
* **Micro-batches** (:func:`split_microbatches`): every tensor leaf with at least one dimension
  is split into ``m`` equal chunks along dim 0 (its size must be divisible by ``m``); 0-dim
  tensors and non-tensor leaves are given unchanged to every micro-batch. The same rule splits
  the target and is used by the single-process reference, so both see identical micro-batches.
  A tensor input without a batch dimension must be 0-dim or built inside the model; the check
  against the captured shapes reports it clearly.
* **Outputs** reach ``loss_fn`` in the structure the model returns (tensor, tuple, dict,
  nested, Hugging Face ``ModelOutput``), including 0-dim tensors such as MoE auxiliary losses
  and non-tensor constants. ``loss_fn`` runs once per micro-batch on that micro-batch's output;
  the step's gradient is that of the mean micro-batch loss (``scale_grads``), exactly as the
  single-process reference computes it.
* **Merged outputs** (``schedule.step(..., return_outputs=True)``, :meth:`ModelInterface.merge`):
  a tensor leaf whose dim 0 equals the micro-batch size (the batch dimension) is concatenated
  along dim 0, giving the full batch as ``torch.distributed.pipelining`` does; every other
  tensor leaf (a 0-dim auxiliary loss, per-expert statistics, token-major tensors, any
  non-batch tensor) is stacked along a new leading micro-batch dimension, so no value is lost
  or silently mixed: the step's mean auxiliary loss is ``merged["aux_loss"].mean()``.
  Non-tensor leaves are returned as captured.

The tree functions are ``torch.utils._pytree`` (which also knows Hugging Face ``ModelOutput``
and every type registered with torch's pytree), reached through the private-API module
:mod:`fxpipe.codegen.runtime`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from fxpipe.errors import InputError

__all__ = ["ModelInputs", "ModelInterface", "as_call", "split_microbatches", "call_model"]


@dataclass(frozen=True)
class ModelInputs:
    """Positional and keyword inputs of one call, ``model(*args, **kwargs)``.

    Anywhere fxpipe takes model inputs (``make_model``, ``make_batch``, ``schedule.step`` on
    the first rank), a tuple means positional arguments, a dict keyword arguments, and this
    class carries both. Values may be pytrees (dicts, lists, tuples, registered dataclasses)
    of tensors and constants.
    """

    args: tuple = ()
    kwargs: Any = None

    def __post_init__(self):
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", dict(self.kwargs or {}))


def as_call(inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of model inputs given as :class:`ModelInputs`, a tuple/list (positional)
    or a mapping (keywords).

    Raises
    ------
    InputError
        For any other type (a bare tensor must be wrapped as ``(tensor,)``).
    """
    if isinstance(inputs, ModelInputs):
        return inputs.args, dict(inputs.kwargs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    raise InputError(
        f"model inputs must be a tuple (positional), a dict (keywords) or fxpipe.codegen.interface.ModelInputs, "
        f"got {type(inputs).__name__}; wrap a single tensor as (tensor,)"
    )


def call_model(model, inputs: Any):
    """``model(*args, **kwargs)`` for inputs in any of the forms of :func:`as_call`."""
    args, kwargs = as_call(inputs)
    return model(*args, **kwargs)


def split_microbatches(tree: Any, m: int, what: str = "inputs") -> list:
    """Split a pytree into ``m`` micro-batches (the rule of the module docstring).

    Parameters
    ----------
    tree : pytree
        Model inputs (:class:`ModelInputs`, tuple, dict) or a target; ``None`` gives ``m`` Nones.
    m : int
        Number of micro-batches.
    what : str
        Name used in error messages.

    Returns
    -------
    list
        ``m`` pytrees of the same structure (a :class:`ModelInputs` stays one).

    Raises
    ------
    InputError
        If a tensor's dim 0 is not divisible by ``m``.
    """
    # lazy: torch.distributed.pipelining; planning imports this module
    from fxpipe.codegen.runtime import tree_flatten, tree_unflatten

    if isinstance(tree, ModelInputs):
        parts = split_microbatches((tree.args, tree.kwargs), m, what)
        return [ModelInputs(a, k) for a, k in parts]
    leaves, spec = tree_flatten(tree)
    cols = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            if leaf.shape[0] % m:
                raise InputError(
                    f"{what}: tensor leaf {i} of shape {tuple(leaf.shape)} has dim 0 = {leaf.shape[0]}, not divisible "
                    f"by {m} micro-batches; pass a batch of {m} x micro-batch size along dim 0"
                )
            cols.append(torch.tensor_split(leaf, m, dim=0))
        else:
            cols.append([leaf] * m)
    return [tree_unflatten([c[j] for c in cols], spec) for j in range(m)]


def _fmt(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}"
    return repr(v)


@dataclass(frozen=True)
class _Leaf:
    """One flattened input leaf: a tensor placeholder or a captured constant."""

    name: str
    is_tensor: bool
    shape: tuple[int, ...] = ()
    dtype: Any = None
    value: Any = None


@dataclass(frozen=True)
class ModelInterface:
    """How the model's pytree inputs/outputs map to stage 0's inputs and the last stage's outputs.

    Attributes
    ----------
    in_spec, out_spec : TreeSpec
        Tree structures of ``(args, kwargs)`` and of the output (``torch.utils._pytree``).
    input_leaves : tuple
        Per flattened input leaf (= graph placeholder, in order): a tensor (name, shape,
        dtype) or a constant specialised into the graph.
    output_leaves : tuple[tuple[str, Any], ...]
        Per flattened output leaf: ``("tensor", i)`` (the ``i``-th tensor returned by the
        last stage) or ``("const", value)``.
    microbatch_size : int or None
        Dim 0 of the first tensor input with a dimension (the captured micro-batch size).
    output_shapes : tuple
        Captured shape of each tensor output (for :meth:`merge`); ``-1`` marks a size that
        depends on the data.
    """

    in_spec: Any
    out_spec: Any
    input_leaves: tuple[_Leaf, ...]
    output_leaves: tuple[tuple[str, Any], ...]
    microbatch_size: int | None = None
    output_shapes: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def tensor_input_names(self) -> tuple[str, ...]:
        """Placeholder names of the tensor inputs (stage 0's inputs, in order)."""
        return tuple(x.name for x in self.input_leaves if x.is_tensor)

    @property
    def constant_inputs(self) -> dict[str, Any]:
        """Placeholder name -> value of the non-tensor inputs specialised into the graph."""
        return {x.name: x.value for x in self.input_leaves if not x.is_tensor}

    @property
    def num_tensor_outputs(self) -> int:
        return sum(1 for k, _ in self.output_leaves if k == "tensor")

    # ------------------------------------------------------------------ inputs
    def flatten_inputs(self, inputs: Any, *, check_shapes: bool = True) -> tuple[torch.Tensor, ...]:
        """Stage 0's input tensors for one micro-batch given as the model takes it.

        Parameters
        ----------
        inputs : ModelInputs, tuple or dict
            One micro-batch, structured like the captured example.
        check_shapes : bool
            Compare every tensor's shape and dtype with the captured ones.

        Raises
        ------
        InputError
            If the structure, a constant, or (with ``check_shapes``) a shape/dtype differs from
            the captured example; the message names the input and both values.
        """
        # lazy: torch.distributed.pipelining; planning imports this module
        from fxpipe.codegen.runtime import spec_str, tree_flatten

        args, kwargs = as_call(inputs)
        kwargs = _reorder_kwargs(kwargs, self.in_spec)
        leaves, spec = tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise InputError(
                "the inputs are structured differently from the example the graph was captured with:\n"
                f"  captured: {spec_str(self.in_spec)}\n  given:    {spec_str(spec)}\n"
                "pass the same positional/keyword arguments and containers"
            )
        out = []
        for leaf, ref in zip(leaves, self.input_leaves):
            if not ref.is_tensor:
                if isinstance(leaf, torch.Tensor) or leaf != ref.value:
                    raise InputError(
                        f"input {ref.name!r} was captured as the constant {ref.value!r} (torch.export specialises "
                        f"non-tensor inputs into the graph); got {_fmt(leaf)}: capture the model again for another value"
                    )
                continue
            if not isinstance(leaf, torch.Tensor):
                raise InputError(f"input {ref.name!r} must be a tensor like the captured example, got {_fmt(leaf)}")
            if check_shapes and (tuple(leaf.shape) != ref.shape or leaf.dtype != ref.dtype):
                raise InputError(
                    f"input {ref.name!r}: a micro-batch has {_fmt(leaf)} but the graph was captured with "
                    f"tensor{ref.shape}:{str(ref.dtype).replace('torch.', '')}; every micro-batch must match the "
                    "captured example (tensors with a dimension are split along dim 0 into micro-batches)"
                )
            out.append(leaf)
        return tuple(out)

    def example_inputs(self, inputs: Any) -> tuple[torch.Tensor, ...]:
        """Stage 0's tensors for one micro-batch of *example* inputs: the model's calling form
        (checked like :meth:`flatten_inputs`), or simply the tensor inputs, flattened in order.

        Raises
        ------
        InputError
            If neither form matches the captured example.
        """
        try:
            return self.flatten_inputs(inputs)
        except InputError:
            flat = tuple(inputs) if isinstance(inputs, (tuple, list)) else None
            refs = [x for x in self.input_leaves if x.is_tensor]
            if flat is None or len(flat) != len(refs) or not all(
                    isinstance(t, torch.Tensor) and tuple(t.shape) == r.shape and t.dtype == r.dtype
                    for t, r in zip(flat, refs)):
                raise
            return flat

    def microbatch_inputs(self, inputs: Any, m: int) -> list[tuple[torch.Tensor, ...]]:
        """Split a full batch (model call form) into ``m`` tuples of stage-0 tensors."""
        return [self.flatten_inputs(mb) for mb in split_microbatches(ModelInputs(*as_call(inputs)), m)]

    def call_microbatches(self, args: tuple, kwargs: Mapping[str, Any], m: int) -> list[tuple[torch.Tensor, ...]]:
        """Split the full-batch inputs of one call ``model(*args, **kwargs)`` into ``m`` tuples of stage-0 tensors."""
        return self.microbatch_inputs(ModelInputs(args, kwargs), m)

    @staticmethod
    def target_microbatches(target: Any, m: int) -> list:
        """A full-batch target (any pytree) split into ``m`` micro-batches by the inputs' rule (:func:`split_microbatches`)."""
        return split_microbatches(target, m, "target")

    # ------------------------------------------------------------------ outputs
    def output(self, tensors: Sequence[torch.Tensor] | torch.Tensor) -> Any:
        """The model's output structure from the last stage's returned tensors.

        Parameters
        ----------
        tensors : sequence of tensors
            What the last stage returns (its tensor leaves, in ``out_spec`` order).

        Returns
        -------
        pytree
            The structure the model returns, constants filled in.

        Raises
        ------
        InputError
            If the number of tensors is not the number of tensor leaves.
        """
        from fxpipe.codegen.runtime import tree_unflatten  # lazy: torch.distributed.pipelining; planning imports this module

        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
        tensors = tuple(tensors)
        if len(tensors) != self.num_tensor_outputs:
            raise InputError(f"expected {self.num_tensor_outputs} output tensors from the last stage, got {len(tensors)}")
        leaves = [tensors[v] if k == "tensor" else v for k, v in self.output_leaves]
        return tree_unflatten(leaves, self.out_spec)

    def merge(self, chunks: Sequence[Sequence[torch.Tensor]]) -> Any:
        """Merge the last stage's per-micro-batch outputs into one output of the model's structure.

        Batch tensors (dim 0 = micro-batch size) are concatenated along dim 0; other tensors are
        stacked along a new leading micro-batch dimension (see the module docstring).

        Parameters
        ----------
        chunks : sequence
            Per micro-batch, in order, the last stage's returned tensors.

        Returns
        -------
        pytree
            One output of the model's structure for the whole batch.
        """
        chunks = [tuple(c) if not isinstance(c, torch.Tensor) else (c,) for c in chunks]
        merged = []
        for i in range(self.num_tensor_outputs):
            parts = [c[i] for c in chunks]
            shape = self.output_shapes[i] if i < len(self.output_shapes) else tuple(parts[0].shape)
            # a data-dependent dim 0 (-1: rows selected from the micro-batch) is concatenated too
            batched = self.microbatch_size is not None and len(shape) >= 1 and shape[0] in (self.microbatch_size, -1)
            merged.append(torch.cat(parts, dim=0) if batched else torch.stack(parts, dim=0))
        return self.output(merged)

    @classmethod
    def from_graph(cls, gm: torch.fx.GraphModule) -> "ModelInterface":
        """Read the interface of a captured graph (its pytree specs and placeholder values).

        Parameters
        ----------
        gm : torch.fx.GraphModule
            ``torch.export``-ed (unlifted) module, or any graph module whose placeholders carry
            ``meta["val"]``; without recorded specs the inputs are the placeholders, in order,
            as positional arguments and the output structure is the output node's.

        Returns
        -------
        ModelInterface
        """
        # lazy: torch.distributed.pipelining; planning imports this module
        from fxpipe.codegen.runtime import graph_pytree_specs, tree_flatten

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        in_spec, out_spec = graph_pytree_specs(gm)
        out_leaves, default_out_spec = tree_flatten(out_node.args[0])
        if out_spec is None or out_spec.num_leaves != len(out_leaves):
            out_spec = default_out_spec
        if in_spec is None or in_spec.num_leaves != len(placeholders):
            in_spec = tree_flatten((tuple(range(len(placeholders))), {}))[1]
        leaves = []
        mb_size = None
        for ph in placeholders:
            v = ph.meta.get("val", ph.meta.get("example_value"))
            if isinstance(v, torch.Tensor) or v is None and "val" not in ph.meta:
                shape = tuple(int(d) for d in v.shape) if isinstance(v, torch.Tensor) else ()
                leaves.append(_Leaf(ph.name, True, shape, v.dtype if isinstance(v, torch.Tensor) else None))
                if mb_size is None and len(shape) >= 1:
                    mb_size = shape[0]
            else:
                leaves.append(_Leaf(ph.name, False, value=v))
        outs: list[tuple[str, Any]] = []
        shapes = []
        k = 0
        for leaf in out_leaves:
            if isinstance(leaf, torch.fx.Node) and _tensor_valued(leaf):
                outs.append(("tensor", k))
                v = leaf.meta.get("val", leaf.meta.get("example_value"))
                shapes.append(_static_shape(v) if isinstance(v, torch.Tensor) else ())
                k += 1
            elif isinstance(leaf, torch.fx.Node):
                outs.append(("const", leaf.meta.get("val")))
            else:
                outs.append(("const", leaf))
        return cls(in_spec, out_spec, tuple(leaves), tuple(outs), mb_size, tuple(shapes))


def _static_shape(v: torch.Tensor) -> tuple[int, ...]:
    """Sizes of a captured tensor; ``-1`` for a size that depends on the data (an unbacked
    symbol, e.g. the rows of ``x[mask]``), which ``int()`` could not read without a guard."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return tuple(-1 if isinstance(d, torch.SymInt) and free_unbacked_symbols(d) else int(d) for d in v.shape)


def _tensor_valued(node: torch.fx.Node) -> bool:
    """True unless the node's recorded value says it is not a tensor (unknown -> tensor)."""
    if "val" not in node.meta and "example_value" not in node.meta:
        return True
    return isinstance(node.meta.get("val", node.meta.get("example_value")), torch.Tensor)


def _reorder_kwargs(kwargs: dict, in_spec) -> dict:
    """Keyword arguments in the captured order (pytree dict specs are key-ordered)."""
    from fxpipe.codegen.runtime import spec_children_contexts  # lazy: torch.distributed.pipelining; planning imports this module

    order = spec_children_contexts(in_spec)
    if order is None or set(order) != set(kwargs):
        return kwargs
    return {k: kwargs[k] for k in order}
