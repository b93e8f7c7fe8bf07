"""Turn the graph Dynamo hands a backend into a module fxpipe's passes can capture and plan.

With ``inline_inbuilt_nn_modules`` (torch's default) Dynamo lifts every parameter and buffer the
function reads to a graph input: a GPT-2 graph has one input for the token ids and one per
weight. Costed as they are, the weights would be activations: sent between stages, split into
micro-batches, never owned. :class:`LiftedGraph` undoes the lifting: it is an ``nn.Module`` that
registers each parameter (the very ``nn.Parameter`` objects of the user's model, so training
and optimizer updates are shared) and each buffer under its original fully qualified name
(``transformer.h.0.attn.c_attn.weight``, recovered from Dynamo's source of the input), and whose
``forward`` takes only the user inputs and runs Dynamo's graph. ``torch.export`` of this module
(:func:`fxpipe.passes.capture.capture`, non-strict, which fxpipe's cost, partition, split and
runtime passes are built on) then sees parameters as ``get_attr`` state, as for a plain model.

Why export instead of costing Dynamo's graph directly: Dynamo's graph is torch-level (``F.linear``,
``Tensor.view`` methods, in-place methods) with ``example_value`` metadata, while every fxpipe
pass (cost annotation by ATen overload, aliasing and in-place analysis from ATen schemas, the
stage split) works on ATen training IR. Exporting the lifted graph re-traces already flat Python
(no Python-level model code left), which is cheaper than exporting the model itself
(``benchmarks/bench_backend.py``: planning time through the backend vs ``fxpipe.compile``), and
the graph is run through :class:`torch.fx.Interpreter` under ``torch.fx.traceback.preserve_node_meta``
so every exported node keeps Dynamo's ``nn_module_stack`` (module paths for reports) and stack trace.

Which inputs are state: an ``nn.Parameter`` is a parameter; a tensor whose Dynamo source is an
attribute of a module (``L['self']...``, a global module, ``._buffers[...]``/``._parameters[...]``
of any object) is a buffer; everything else (``L['x']``, ``L['args'][0]``, ``L['kwargs']['mask']``,
``L['batch']['ids']``) is a user input, split into micro-batches along dim 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from fxpipe.codegen.runtime import dynamo_frame_owner, dynamo_source_name, graph_break_info
from fxpipe.errors import InputError

__all__ = ["LiftedGraph", "InputKind", "classify_inputs", "fqn_from_source", "graph_name"]

_SOURCE_TOKEN = re.compile(r"""\._(?:modules|parameters|buffers)\[['"]([^'"]*)['"]\]|\.([A-Za-z_][A-Za-z0-9_]*)|\[['"]([^'"]*)['"]\]|\[(\d+)\]""")
_ROOT = re.compile(r"""^(?:L|G)\[['"]([^'"]*)['"]\]""")
_STATE_MARKERS = ("._parameters[", "._buffers[", "._modules[")
_SIZE_SOURCE = re.compile(r"^(?P<base>.*)\.(?:(?P<fn>size|stride)\(\)\[(?P<dim>\d+)\]|(?P<off>storage_offset)\(\))$")


@dataclass(frozen=True)
class InputKind:
    """What one placeholder of Dynamo's graph is.

    Attributes
    ----------
    kind : {"param", "buffer", "input", "size"}
        ``"size"``: a symbolic size Dynamo passes as an input (``L['x'].size()[0]`` with a dynamic
        batch dimension); it is recomputed from the user input it measures.
    name : str
        Fully qualified name of a parameter / buffer; the placeholder name of an input.
    source : str or None
        Dynamo's source (``"L['self']._modules['wte']._parameters['weight']"``).
    of_input : int
        For ``"size"``: index (among the ``"input"`` placeholders) of the tensor it measures.
    method : str
        For ``"size"``: ``"size"``, ``"stride"`` or ``"storage_offset"``.
    dim : int
        For ``"size"``: the dimension measured.
    """

    kind: str
    name: str
    source: str | None
    of_input: int = -1
    method: str = ""
    dim: int = 0


def _is_state_source(src: str | None) -> bool:
    return src is not None and (src.startswith("L['self']") or src.startswith("G[") or any(m in src for m in _STATE_MARKERS))


def _is_size(value: Any, src: str | None) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool) and src is not None \
        and _SIZE_SOURCE.match(src) is not None


def fqn_from_source(source: str) -> str:
    """Fully qualified name of a state tensor from Dynamo's source.

    ``L['self']._modules['h']._modules['0']._parameters['weight']`` -> ``h.0.weight``; a root
    other than ``self`` is kept (``G['model']._modules['fc']._parameters['bias']`` -> ``model.fc.bias``).
    """
    m = _ROOT.match(source)
    parts: list[str] = []
    rest = source
    if m:
        if m.group(1) != "self":
            parts.append(m.group(1))
        rest = source[m.end():]
    for tok in _SOURCE_TOKEN.finditer(rest):
        parts.append(next(g for g in tok.groups() if g is not None))
    clean = [re.sub(r"[^A-Za-z0-9_]", "_", p) or "_" for p in parts]
    return ".".join(clean) or "state"


def classify_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[InputKind]:
    """Kind of every placeholder of ``gm`` (see the module docstring), in placeholder order.

    Raises
    ------
    InputError
        If the number of example inputs differs from the number of placeholders.
    """
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(example_inputs):
        raise InputError(f"Dynamo's graph has {len(phs)} inputs but {len(example_inputs)} example inputs were given")
    sources = [dynamo_source_name(n) for n in phs]

    def state_kind(value: Any, src: str | None) -> str | None:
        if isinstance(value, torch.nn.Parameter):
            return "param"
        if isinstance(value, torch.Tensor) and _is_state_source(src):
            return "buffer"
        return None

    tensor_sources = {src for v, src in zip(example_inputs, sources)
                      if isinstance(v, torch.Tensor) and state_kind(v, src) is None and src is not None}
    pre = []  # (kind, match) in placeholder order
    for value, src in zip(example_inputs, sources):
        m = _SIZE_SOURCE.match(src) if _is_size(value, src) else None
        if m is not None and m.group("base") in tensor_sources:
            pre.append(("size", m))
        else:
            pre.append((state_kind(value, src) or "input", None))
    input_index = {}
    k_input = 0
    for (kind, _), src in zip(pre, sources):
        if kind == "input":
            if src is not None:
                input_index[src] = k_input
            k_input += 1
    out: list[InputKind] = []
    used: set[str] = set()
    for node, (kind, m), src in zip(phs, pre, sources):
        if kind == "size":
            out.append(InputKind("size", node.name, src, of_input=input_index[m.group("base")],
                                 method=m.group("fn") or "storage_offset", dim=int(m.group("dim") or 0)))
        elif kind == "input":
            out.append(InputKind("input", node.name, src))
        else:
            name = fqn_from_source(src) if src is not None else node.name
            base, k = name, 1
            while name in used:  # the same tensor reached through two sources is one input; names stay unique
                k += 1
                name = f"{base}_{k}"
            used.add(name)
            out.append(InputKind(kind, name, src))
    return out


def graph_name(gm: fx.GraphModule) -> str:
    """A readable default name: the class of the compiled module, else ``file.function`` of the frame."""
    owner = dynamo_frame_owner()
    if owner:
        return owner
    for node in gm.graph.nodes:
        for path, typ in (node.meta.get("nn_module_stack") or {}).values():
            if str(path) in ("L['self']", "L__self__"):
                return getattr(typ, "__name__", str(typ))
    info = graph_break_info(gm)
    if info.user_stack:
        first = info.user_stack[-1].splitlines()[0]
        m = re.match(r'File "([^"]+)", line \d+, in (\S+)', first)
        if m:
            stem = m.group(1).replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py")
            fn = m.group(2)
            if fn.startswith("torch_dynamo_resume_in_"):
                fn = fn[len("torch_dynamo_resume_in_"):].rsplit("_at_", 1)[0]
            return f"{stem}.{fn}"
    return "dynamo_graph"


def _strip_self(path: str) -> str:
    for prefix in ("L['self'].", "L['self']", "L__self___", "L__self__"):
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


class LiftedGraph(torch.nn.Module):
    """Dynamo's graph with its lifted parameters and buffers registered as module state.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        The graph Dynamo hands the backend (parameters and buffers as inputs).
    example_inputs : sequence
        Dynamo's example inputs, one per placeholder: the real parameter and buffer tensors
        and the user inputs of the call being compiled.

    Attributes
    ----------
    kinds : list[InputKind]
        Kind of every placeholder.
    state : list[torch.Tensor]
        The registered parameter / buffer objects, in placeholder order.

    Notes
    -----
    ``forward(*user_inputs)`` returns what Dynamo's graph returns: its one output tensor, or the
    tuple of its output tensors (Dynamo flattens the model's output structure). The graph
    runs through :class:`torch.fx.Interpreter` with ``preserve_node_meta``, so tracing this module
    keeps Dynamo's ``nn_module_stack`` on every node (paths without the ``L['self']`` prefix).
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        super().__init__()
        self.kinds = classify_inputs(gm, example_inputs)
        self._graph_module = [gm]  # a list: not registered as a submodule (its state is ours)
        self.state: list[torch.Tensor] = []
        self._state_paths: list[tuple[str, ...]] = []  # attribute path of every state tensor, read at each call
        for kind, value in zip(self.kinds, example_inputs):
            if kind.kind in ("input", "size"):
                continue
            owner, leaf = self._owner(kind.name)
            if kind.kind == "param":
                owner.register_parameter(leaf, value)
            else:
                owner.register_buffer(leaf, value)
            self.state.append(value)
            self._state_paths.append(self._path_of(owner) + (leaf,))
        for node in gm.graph.nodes:  # module paths as torch.export writes them
            stack = node.meta.get("nn_module_stack")
            if stack:
                node.meta["nn_module_stack"] = {k: (_strip_self(str(p)), t) for k, (p, t) in stack.items()}

    def _path_of(self, module: torch.nn.Module) -> tuple[str, ...]:
        for name, mod in self.named_modules():
            if mod is module:
                return tuple(name.split(".")) if name else ()
        raise AssertionError("a state owner outside the lifted module: a bug in fxpipe")

    def _state_now(self):
        """The state tensors as the module holds them *now*: torch.export (and torch.func.functional_call)
        swap module attributes for traced ones, which a list kept since __init__ would bypass (the
        weights would be captured as constants, without gradients)."""
        for path in self._state_paths:
            obj: Any = self
            for p in path:
                obj = getattr(obj, p)
            yield obj

    def _owner(self, fqn: str) -> tuple[torch.nn.Module, str]:
        """The (new or existing) submodule that holds ``fqn`` and the attribute name in it."""
        *path, leaf = fqn.split(".")
        mod: torch.nn.Module = self
        for p in path:
            child = getattr(mod, p, None)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(p, child)
            elif not isinstance(child, torch.nn.Module):  # a tensor of that name already: flatten the name
                return self, fqn.replace(".", "_") + "_"
            mod = child
        if hasattr(mod, leaf):
            return self, fqn.replace(".", "_") + "_"
        return mod, leaf

    @property
    def graph_module(self) -> fx.GraphModule:
        """Dynamo's graph."""
        return self._graph_module[0]

    @property
    def num_user_inputs(self) -> int:
        return sum(1 for k in self.kinds if k.kind == "input")

    def user_inputs(self, flat_inputs: Sequence[Any]) -> tuple:
        """The user inputs among Dynamo's flat inputs (placeholder order; sizes Dynamo derives are not)."""
        return tuple(v for k, v in zip(self.kinds, flat_inputs) if k.kind == "input")

    def state_inputs(self, flat_inputs: Sequence[Any]) -> tuple:
        """The parameter / buffer tensors among Dynamo's flat inputs (placeholder order)."""
        return tuple(v for k, v in zip(self.kinds, flat_inputs) if k.kind in ("param", "buffer"))

    def same_state(self, flat_inputs: Sequence[Any]) -> bool:
        """True when Dynamo passes the very tensors this module registered (no parameter was replaced)."""
        got = self.state_inputs(flat_inputs)
        return len(got) == len(self.state) and all(a is b for a, b in zip(got, self.state))

    def batch_dimension(self) -> tuple[bool, str]:
        """Whether micro-batches may be cut from dim 0 of the user inputs in this graph, and why not.

        Dynamo specialises every size it does not mark dynamic: a graph traced with static shapes
        hard-codes the batch size (``view(8, 8, 96)``) and only runs on that batch. Micro-batches
        need dim 0 of every batched user input to be one free symbol of the graph
        (``torch._dynamo.mark_dynamic(x, 0)``, or a batch size that changed between calls), used by
        no other dimension (duck sizing gives a batch of 8 and a sequence of 8 one symbol).

        Returns
        -------
        (ok, reason)
        """
        vals = [n.meta.get("example_value") for n in self.graph_module.graph.nodes if n.op == "placeholder"]
        batched = [(k, v) for k, v in zip(self.kinds, vals)
                   if k.kind == "input" and isinstance(v, torch.Tensor) and v.dim() >= 1]
        if not batched:
            return False, "no user input has a batch dimension"
        syms = set()
        for k, v in batched:
            d0 = v.shape[0]
            if not isinstance(d0, torch.SymInt) or not re.fullmatch(r"[su]\d+", str(d0)):
                return False, (f"dim 0 of input {k.name!r} is static ({d0}) in Dynamo's graph, which then only runs on "
                               "that batch size; mark the batch dimension dynamic: torch._dynamo.mark_dynamic(x, 0) "
                               "before the first call (or torch.compile(..., dynamic=True) with a batch size unlike the "
                               "other dimensions)")
            syms.add(str(d0))
        for k, v in batched:
            for i, d in enumerate(v.shape[1:], start=1):
                hit = [s_ for s_ in syms if re.search(rf"\b{s_}\b", str(d))]
                if hit:
                    return False, (f"Dynamo gave the batch size the same symbol {hit[0]} as dim {i} of input {k.name!r} "
                                   "(duck sizing: equal sizes share a symbol): micro-batches would change both; mark "
                                   "only the batch dimension dynamic, torch._dynamo.mark_dynamic(x, 0), or use a batch "
                                   "size unlike the other dimensions")
        return True, ""

    def forward(self, *user_inputs):
        state = self._state_now()
        args = []
        k_input = 0
        for k in self.kinds:
            if k.kind == "input":
                args.append(user_inputs[k_input])
                k_input += 1
            elif k.kind == "size":
                t = user_inputs[k.of_input]
                args.append(t.storage_offset() if k.method == "storage_offset" else getattr(t, k.method)(k.dim))
            else:
                args.append(next(state))
        with fx.traceback.preserve_node_meta():
            out = fx.Interpreter(self.graph_module).run(*args)
        if isinstance(out, (tuple, list)) and len(out) == 1 and isinstance(out[0], torch.Tensor):
            return out[0]  # one output: a tensor, as the model returns it (a loss_fn of the plan sees the tensor)
        return tuple(out) if isinstance(out, list) else out
