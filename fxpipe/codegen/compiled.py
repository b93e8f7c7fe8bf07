"""Inductor per pipeline stage, with split backward (zero-bubble schedules) intact.

``torch.distributed.pipelining`` splits a stage's backward into backward-input (I: gradients of
the stage inputs, sent upstream at once) and backward-weight (W: parameter gradients, run later
to fill bubbles) by walking the stage's eager autograd graph. A ``torch.compile``-d stage has a
single opaque autograd node, so torch's zero-bubble schedules refuse compiled stage modules. This
module compiles a stage so that the split happens *inside* the compiled code instead:

1. :class:`CompiledStageModule` compiles the stage module with Inductor's ``compile_fx``
   (AOTAutograd: functionalisation, decompositions, the min-cut forward/backward partition,
   input-mutation and aliasing handling; Inductor code generation for every graph) at its first
   call, per input signature (shapes, dtypes, ``requires_grad``, grad mode);
2. AOTAutograd's backward graph (outputs: gradients of the parameters, buffers and inputs, in
   that order) is cut by :func:`split_backward_graph` into a **B graph** (everything the input
   gradients need) and a **W graph** (what only the parameter gradients need); the values W
   needs from B or from the saved activations form the W stash. Both graphs are compiled by
   Inductor. This is the backward split of Zero Bubble (Qi et al., "Zero Bubble Pipeline
   Parallelism", ICLR 2024, Sec. 2: B computes the input gradient, W the weight gradient; W
   depends on B's intermediate, the gradient of the op's output) done on the compiled graph;
3. the compiled backward runs B, then either W at once (``backward_mode="full"``: an ordinary
   ``loss.backward()``, a fused ``B`` action, stage 0's ``W`` under torch's runtime) or stashes
   W's inputs (``"split"``) and returns no parameter gradients; :class:`CompiledPipelineStage`
   runs the stash at the stage's ``W`` action and accumulates the gradients into ``.grad``.

Compared with eager stages, split backward on a compiled stage has no blind parameters
(:mod:`fxpipe.codegen.shapes`): the W graph computes every parameter gradient, whatever the
autograd paths look like, so no stage falls back to full backwards for that reason.

When the split cannot be done soundly the stage runs fused backwards and says why
(:attr:`CompiledStageModule.report`): AOTAutograd deduplicated aliased inputs (the same
parameter registered twice in one stage) so backward outputs no longer map one-to-one onto
parameters. Numerics equal eager stages up to Inductor's reassociation and fusion (float32:
about 1e-6 relative).

The Inductor and AOTAutograd entry points are private torch APIs reached through
:mod:`fxpipe.codegen.runtime`.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx

from fxpipe.codegen.runtime import (
    FxpipePipelineStage,
    boxed_callable,
    copy_graph_codegen,
    donated_backward_inputs,
    inductor_compile,
    inductor_compile_graph,
)

__all__ = ["BackwardSplit", "split_backward_graph", "CompiledStageModule", "CompiledPipelineStage", "compile_stage"]

logger = logging.getLogger(__name__)


@dataclass
class BackwardSplit:
    """A backward graph cut into backward-input (B) and backward-weight (W) graphs.

    Attributes
    ----------
    b_graph : torch.fx.GraphModule
        Takes every placeholder of the backward graph (same calling convention); returns the
        input gradients (the backward outputs from ``first_input_output`` on, ``None`` kept) and
        then the W stash values it computes.
    w_graph : torch.fx.GraphModule
        Takes the W stash (``stash_names`` order); returns the backward outputs before
        ``first_input_output`` (the parameter and buffer gradients).
    stash_names : tuple[str, ...]
        Backward-graph nodes W reads: placeholders (saved activations, tangents) and B
        intermediates, in graph order.
    stash_from_placeholder : tuple[int | None, ...]
        Per stash entry, the index of the backward placeholder it is (None: a B output).
    num_input_grads : int
        How many leading outputs of ``b_graph`` are input gradients.
    b_nodes, w_nodes : int
        Compute nodes in each graph (W-only nodes are not recomputed in B and vice versa).
    """

    b_graph: fx.GraphModule
    w_graph: fx.GraphModule
    stash_names: tuple[str, ...]
    stash_from_placeholder: tuple[int | None, ...]
    num_input_grads: int
    b_nodes: int
    w_nodes: int


def _ancestors(roots: Sequence[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def split_backward_graph(bw: fx.GraphModule, first_input_output: int) -> BackwardSplit:
    """Cut AOTAutograd's backward graph into a backward-input graph and a backward-weight graph.

    Parameters
    ----------
    bw : torch.fx.GraphModule
        Backward graph: placeholders (saved values, then tangents) and one output per forward
        input (``None`` for inputs without a gradient); outputs ``[0, first_input_output)`` are
        the gradients of the parameters and buffers, the rest those of the stage inputs.
    first_input_output : int
        Index of the first input-gradient output.

    Returns
    -------
    BackwardSplit
        B = the ancestors of the input-gradient outputs; W = the ancestors of the parameter
        gradients that B does not compute. W's inputs (the stash) are the B nodes and
        placeholders W reads. Running B then W on the stash gives exactly the outputs of ``bw``
        (every node runs once, in the original order within each graph).

    Raises
    ------
    ValueError
        If ``first_input_output`` is outside the output list.
    """
    out_node = next(n for n in bw.graph.nodes if n.op == "output")
    outs = list(out_node.args[0]) if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    if not 0 <= first_input_output <= len(outs):
        raise ValueError(f"first_input_output={first_input_output} outside the {len(outs)} backward outputs")
    weight_outs, input_outs = outs[:first_input_output], outs[first_input_output:]
    b_set = _ancestors(input_outs)
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    w_set = _ancestors(weight_outs) - b_set - set(placeholders)
    # only tensors cross from B to W: a getitem that W takes from a multi-output B node (the
    # weight gradient of native_layer_norm_backward / convolution_backward) runs in B
    for n in list(bw.graph.nodes):
        if n in w_set and n.target is operator.getitem and n.args[0] not in w_set:
            w_set.discard(n)
            b_set.add(n)
    ph_index = {n: i for i, n in enumerate(placeholders)}
    stash = [n for n in bw.graph.nodes
             if n.op != "output" and n not in w_set and any(u in w_set for u in n.users)]
    # W outputs that are B values or placeholders directly (e.g. a bias gradient equal to a
    # tangent) travel through the stash too
    for o in weight_outs:
        if isinstance(o, fx.Node) and o not in w_set and o not in stash:
            stash.append(o)
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    stash.sort(key=order.__getitem__)

    gb = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in bw.graph.nodes:
        if n.op == "placeholder" or (n in b_set and n.op != "output"):
            env[n] = gb.node_copy(n, lambda a: env[a])
    b_stash = [s for s in stash if s.op != "placeholder"]
    gb.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in input_outs) + tuple(env[s] for s in b_stash))

    gw = fx.Graph()
    envw: dict[fx.Node, fx.Node] = {}
    for s in stash:
        p = gw.placeholder(s.name)
        p.meta = dict(s.meta)
        envw[s] = p
    for n in bw.graph.nodes:
        if n in w_set and n.op not in ("placeholder", "output"):
            envw[n] = gw.node_copy(n, lambda a: envw[a])
    gw.output(tuple(envw[o] if isinstance(o, fx.Node) else o for o in weight_outs))
    compute = ("call_function", "call_method", "call_module")
    return BackwardSplit(
        b_graph=fx.GraphModule(bw, gb),
        w_graph=fx.GraphModule(bw, gw),
        stash_names=tuple(s.name for s in stash),
        stash_from_placeholder=tuple(ph_index.get(s) for s in stash),
        num_input_grads=len(input_outs),
        b_nodes=sum(1 for n in b_set if n.op in compute),
        w_nodes=sum(1 for n in w_set if n.op in compute),
    )


def _signature(args: Sequence[Any]) -> tuple:
    sig = [torch.is_grad_enabled()]
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), a.dtype, a.device, a.requires_grad))
        else:
            sig.append(("const", repr(a)))
    return tuple(sig)


def _copy_module(module: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``module``'s graph, sharing its parameters and buffers
    (Inductor takes ownership of and may rewrite the graph it compiles)."""
    g = fx.Graph()
    copy_graph_codegen(g, module.graph)  # keep the calling convention (pytree codegen)
    env: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(module.graph, env)
    g.output(out)
    return fx.GraphModule(module, g)


@dataclass
class _WeightStash:
    """What one micro-batch's backward-weight needs: the compiled W graph, the parameters its
    outputs belong to (AOTAutograd's order), and the stashed values."""

    w_fn: Any
    params: list
    values: list


@dataclass
class _Compiled:
    fn: Any
    split: bool = False
    reason: str = ""
    graphs: dict = field(default_factory=dict)


class CompiledStageModule(torch.nn.Module):
    """A stage module run by Inductor, its backward split into B and W graphs (module docstring).

    Parameters
    ----------
    module : torch.fx.GraphModule
        A stage module from :func:`fxpipe.codegen.split.split_stages` (or any GraphModule whose
        state is parameters and buffers). It stays registered as ``inner``: ``parameters()``,
        ``named_buffers()`` and ``get_parameter`` are the stage's own objects.

    Attributes
    ----------
    backward_mode : {"full", "split"}
        How the next backward runs: ``"full"`` computes every gradient (parameter gradients
        accumulate into ``.grad`` as usual); ``"split"`` computes the input gradients only and
        leaves the W stash in :meth:`pop_stash`.
    report : dict
        Per compiled signature: whether the backward is split, why not, node counts of the B/W
        graphs; ``compile_s`` total Inductor time.
    """

    def __init__(self, module: fx.GraphModule):
        super().__init__()
        self.inner = module
        self.backward_mode = "full"
        self._compiled: dict[tuple, _Compiled] = {}
        self._stash: list[list] = []
        self.report: dict[str, Any] = {"signatures": [], "compile_s": 0.0}

    # ------------------------------------------------------------------ compile
    def _compile(self, args: Sequence[Any]) -> _Compiled:
        import time

        t0 = time.perf_counter()
        copy = _copy_module(self.inner)
        params = list(dict(copy.named_parameters(remove_duplicate=False)).values())
        n_state = len(params) + len(dict(copy.named_buffers(remove_duplicate=False)))
        entry = _Compiled(fn=None)
        n_inputs = len(args)

        def inner_compile(gm: fx.GraphModule, example_inputs, **kwargs):
            if not kwargs.get("is_backward"):
                return inductor_compile_graph(gm, example_inputs, **kwargs)
            return self._compile_backward(gm, example_inputs, kwargs, params, n_state, n_inputs, entry)

        entry.fn = inductor_compile(copy, list(args), inner_compile=inner_compile)
        self.report["compile_s"] += time.perf_counter() - t0
        return entry

    def _compile_backward(self, bw: fx.GraphModule, example_inputs, kwargs: dict, params: list, n_state: int,
                          n_inputs: int, entry: _Compiled):
        out_node = next(n for n in bw.graph.nodes if n.op == "output")
        outs = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
        if len(outs) != n_state + n_inputs:
            entry.reason = (f"AOTAutograd's backward has {len(outs)} outputs for {n_state} parameters/buffers and "
                            f"{n_inputs} inputs (aliased inputs were deduplicated): fused backward on this stage")
            logger.warning("compiled stage: %s", entry.reason)
            self.report["signatures"].append({"split": False, "reason": entry.reason})
            return inductor_compile_graph(bw, example_inputs, **kwargs)
        sp = split_backward_graph(bw, n_state)
        w_kwargs = dict(kwargs)
        w_kwargs["static_input_idxs"] = ()
        w_reads = {i for i in sp.stash_from_placeholder if i is not None}
        with donated_backward_inputs(lambda i: i not in w_reads):  # B must not overwrite what W reads
            b_fn = inductor_compile_graph(sp.b_graph, example_inputs, **kwargs)
        w_example = []
        for name, idx in zip(sp.stash_names, sp.stash_from_placeholder):
            w_example.append(example_inputs[idx] if idx is not None
                             else next(n for n in sp.w_graph.graph.nodes if n.op == "placeholder" and n.name == name).meta["val"])
        with donated_backward_inputs(lambda i: False):  # indices of the backward graph, not W's
            w_fn = inductor_compile_graph(sp.w_graph, w_example, **w_kwargs) if sp.w_nodes or sp.stash_names else None
        entry.split = True
        entry.graphs = {"b_nodes": sp.b_nodes, "w_nodes": sp.w_nodes, "stash": len(sp.stash_names)}
        self.report["signatures"].append({"split": True, **entry.graphs})
        n_w_outs = n_state
        n_in = sp.num_input_grads
        from_ph = sp.stash_from_placeholder
        module = self

        def backward(args: list):
            saved = [args[i] if i is not None else None for i in from_ph]
            out_b = b_fn(list(args))
            args.clear()  # boxed convention: the inputs are ours to free
            input_grads = list(out_b[:n_in])
            produced = iter(out_b[n_in:])
            stash = [s if i is not None else next(produced) for s, i in zip(saved, from_ph)]
            if module.backward_mode == "split":
                module._stash.append(_WeightStash(w_fn, params, stash))
                return [None] * n_w_outs + input_grads
            weight_grads = list(w_fn(stash)) if w_fn is not None else [None] * n_w_outs
            return weight_grads + input_grads

        return boxed_callable(backward)

    # ------------------------------------------------------------------ run
    def forward(self, *args):
        key = _signature(args)
        entry = self._compiled.get(key)
        if entry is None:
            entry = self._compiled[key] = self._compile(args)
        return entry.fn(*args)

    def pop_stash(self) -> "_WeightStash | None":
        """The W stash of the backward that just ran in ``"split"`` mode (None if it ran none)."""
        return self._stash.pop() if self._stash else None

    def run_weight(self, stash: "_WeightStash") -> None:
        """Backward-weight of one micro-batch: run the W graph on ``stash``, accumulate into ``.grad``."""
        if stash.w_fn is None:
            return
        # a backward runs without grad mode (the autograd engine's rule); W runs outside the engine,
        # where a stashed stage input that requires grad makes Inductor's out= kernels refuse
        with torch.no_grad():
            grads = stash.w_fn(list(stash.values))
        stash.values.clear()
        with torch.no_grad():
            for p, g in zip(stash.params, grads):
                if g is None or not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = g if g.stride() == p.stride() else g.contiguous()
                else:
                    p.grad.add_(g)

    @property
    def split_backward(self) -> bool:
        """True when every compiled signature with a backward has it split into B and W."""
        sigs = self.report["signatures"]
        return bool(sigs) and all(s["split"] for s in sigs)


class CompiledPipelineStage(FxpipePipelineStage):
    """A pipeline stage whose module is a :class:`CompiledStageModule`.

    Backward-input (``I``) runs the compiled backward in ``"split"`` mode (input gradients,
    the W stash kept as the micro-batch's state); backward-weight (``W``) runs the W graph on
    that stash; full backward (``B``, and torch's stage-0 ``W``) runs both at once.
    """

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        mod = self.submod
        if not isinstance(mod, CompiledStageModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type == "weight":
            stash = bwd_kwargs.get("param_groups")
            if stash is not None:
                mod.run_weight(stash)
            return (), None
        if backward_type == "input":
            kwargs = dict(bwd_kwargs)
            out = kwargs["stage_output"]
            if kwargs.get("output_grads") is None and isinstance(out, (tuple, list)) and len(out) == 1:
                # the last stage's loss: torch wraps it in a tuple for its own backward-input, but
                # stage_backward skips a tuple without gradients (it would run no backward at all)
                kwargs["stage_output"] = out[0]
            mod.backward_mode = "split"
            try:
                grads, _ = super().backward_maybe_with_nosync("full", kwargs, last_backward)
            finally:
                mod.backward_mode = "full"
            return grads, mod.pop_stash()
        mod.backward_mode = "full"
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def compile_stage(module: fx.GraphModule) -> CompiledStageModule:
    """Wrap a stage module for Inductor (compiled lazily at its first call)."""
    return CompiledStageModule(module)
