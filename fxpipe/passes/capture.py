"""Capture an ``nn.Module`` as an fx graph with ``torch.export`` (non-strict).

:func:`capture` is the first step of fxpipe's data flow (DESIGN.md): it runs
``torch.export.export(model, args, kwargs, strict=False)`` and keeps two views of the result:

* ``Captured.exported``: the :class:`torch.export.ExportedProgram` (lifted parameters,
  input/output specs, range constraints), and
* ``Captured.gm``: the *unlifted* :class:`torch.fx.GraphModule` from
  ``exported.module(check_guards=False)``: parameters and buffers are real attributes read
  by ``get_attr`` nodes, every node carries ``node.meta["val"]`` (a FakeTensor with the
  node's shape/dtype) and ``node.meta["nn_module_stack"]``; it runs and trains like the
  original model (autograd flows to ``gm``'s parameters, which for a CPU model are the
  original model's parameter tensors). Its node names are stable: later passes only add
  ``node.meta`` entries, never rename or reorder nodes. (The capture itself gives each layer
  its own copy of cheap constant tensors such as a causal mask,
  :mod:`fxpipe.passes.duplicate_constants`: the copies are new nodes, the original names stay.)

Preconditions: the example inputs are ONE micro-batch (the cost model costs exactly these
shapes). A model on the ``meta`` device is captured without allocating weight memory.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from fxpipe.errors import CaptureError
from fxpipe.passes.fx_util import (  # noqa: F401 (re-exported: their home before the duplication pass)
    _leaves,
    _packet,
    _to_int,
    getattr_path,
    has_data_dependent_size,
    remove_dead_code,
)
from fxpipe.passes.replicate import (
    TEMPLATE_LAYERS,
    ReplicationError,
    find_layer_stack,
    per_layer_settings_vary,
    replicate_layers,
    truncated_layers,
)

#: ``gm.meta`` key holding the module-path prefix added by a wrapper (e.g. ``"model."`` for
#: :class:`fxpipe.models.LogitsOnly`); :func:`fxpipe.passes.to_opgraph.to_opgraph` strips it.
MODULE_PREFIX_KEY = "fxpipe_module_prefix"


@dataclass
class Captured:
    """A captured model.

    Attributes
    ----------
    exported : torch.export.ExportedProgram
        The exported program (parameters lifted to inputs).
    gm : torch.fx.GraphModule
        The unlifted, trainable module (``exported.module(check_guards=False)``); every
        node has ``meta["val"]``; parameters and buffers are ``get_attr`` nodes.
    example_args : tuple
        Positional example inputs (one micro-batch).
    example_kwargs : dict
        Keyword example inputs.
    capture_s : float
        Wall time of the export, seconds.
    replication : dict or None
        When the graph was built by replicating one layer (:mod:`fxpipe.passes.replicate`):
        ``{"path", "layers", "exported_layers", "export_s", "replicate_s"}``; ``exported``
        is then the program of the truncated three-layer model. None for a full export.
    module_prefix : str
        Module-path prefix of a thin wrapper (a root with one child and no parameters of
        its own, e.g. ``"model."`` for ``fxpipe.models.LogitsOnly``), else ``""``;
        :func:`~fxpipe.passes.to_opgraph.to_opgraph` strips it from module paths.
    """

    exported: Any
    gm: torch.fx.GraphModule
    example_args: tuple = ()
    example_kwargs: dict = field(default_factory=dict)
    capture_s: float = 0.0
    module_prefix: str = ""
    replication: dict | None = None

    @property
    def graph(self) -> torch.fx.Graph:
        """``gm.graph``."""
        return self.gm.graph


def _is_wrapper(model: torch.nn.Module) -> str:
    """Module-path prefix of a thin wrapper: a root module with exactly one child and no
    parameters or buffers of its own (``fxpipe.models.LogitsOnly`` -> ``"model."``)."""
    children = list(model.named_children())
    own = list(model.named_parameters(recurse=False)) + list(model.named_buffers(recurse=False))
    if len(children) == 1 and not own:
        return children[0][0] + "."
    return ""


def _user_frame(text: str) -> str:
    m = re.search(r"The following call raised this error:\s*\n(.*?)(?:\n\s*\n|\Z)", text, re.S)
    if m:
        return " ".join(line.strip() for line in m.group(1).strip().splitlines())
    return ""


def _frame_from_traceback(exc: BaseException) -> str:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        fn = fr.filename.replace("\\", "/")
        if "/torch/" in fn or "/fxpipe/passes/" in fn or "/site-packages/torch" in fn:
            continue
        return f'File "{fr.filename}", line {fr.lineno}, in {fr.name}: {(fr.line or "").strip()}'
    return ""


#: what to do about a tensor on a fixed device in a capture on meta
_PLAN_ON_CPU = "plan the model on CPU instead: build it there (not under torch.device('meta'); fxpipe plan: --no-meta)"


def _fixed_device_state(model: torch.nn.Module) -> str | None:
    """Parameters and buffers of a model otherwise on meta that are on another device, as a sentence."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    stray = [(n, t) for n, t in named if t.device.type != "meta"]
    if not stray or len(stray) == len(named):
        return None
    owners = []
    for name, _ in stray:
        mod = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        owner = f"{type(mod).__name__}.{name.rpartition('.')[2]}"
        if owner not in owners:
            owners.append(owner)
    dev = stray[0][1].device.type
    shown = ", ".join(n for n, _ in stray[:3]) + (f" and {len(stray) - 3} more" if len(stray) > 3 else "")
    return (f"{len(stray)} of the model's {len(named)} parameters and buffers are on {dev} while the others are on "
            f"meta ({shown}; made by {', '.join(owners[:4])}): their module's __init__ created them on a fixed "
            f"device, which torch.device('meta') does not change (a legacy constructor such as torch.FloatTensor(...), "
            f"or an explicit device=), and the first op that meets both fails. Move them to meta (model.to('meta'): "
            f"a model built on meta holds no trained weights), or {_PLAN_ON_CPU}")


def _fixed_device_origin(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """Where the forward of a model on meta makes the tensor on a fixed device that meets its meta tensors.

    Runs the forward once more, eagerly on meta (no compute), under a ``TorchFunctionMode``
    that remembers for every tensor not on meta the model's source line that made it (a factory
    call without ``device=``, e.g. ``torch.arange(n)``) and passes it on to what is computed from
    it, until an op mixes it with meta tensors and fails. Returns a sentence naming both lines,
    or None when the replay does not fail that way.
    """
    import traceback

    from torch.overrides import TorchFunctionMode

    from fxpipe.codegen.faults import innermost_user_frame

    inputs = {id(t) for t in _leaves((tuple(args), dict(kwargs))) if isinstance(t, torch.Tensor)}
    here = lambda: innermost_user_frame(traceback.extract_stack()) or "an unknown line"  # noqa: E731

    class Origins(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.origin: dict[int, str] = {}
            self.keep: list[torch.Tensor] = []  # ids stay unique while the replay runs
            self.found: str | None = None

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            fixed = [t for t in tensors if t.device.type != "meta"]
            try:
                out = func(*args, **kwargs)
            except Exception:
                if fixed and self.found is None and any(t.device.type == "meta" for t in tensors):
                    t = fixed[0]
                    made = ("the example inputs" if id(t) in inputs else self.origin.get(id(t), "an unknown line"))
                    self.found = (f"its forward makes a tensor on {t.device.type} at {made}, which meets the "
                                  f"model's meta tensors at {here()}")
                raise
            made = [o for o in _leaves(out) if isinstance(o, torch.Tensor) and o.device.type != "meta"]
            if made:
                origin = next((self.origin[id(t)] for t in fixed if id(t) in self.origin), None)
                if origin is None and not fixed:  # a factory: this line made it
                    origin = here()
                for o in made:
                    if origin is not None:
                        self.origin[id(o)] = origin
                        self.keep.append(o)
            return out

    mode = Origins()
    try:
        with torch.no_grad(), mode:
            model(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the replay only looks for where the tensor came from
        pass
    return mode.found


def _meta_device_mismatch(exc: BaseException, model: torch.nn.Module, args: Sequence[Any],
                          kwargs: Mapping[str, Any]) -> str | None:
    """For a capture on meta that fails on tensors of two devices: what put a tensor on a fixed device."""
    if "DeviceMismatch" not in type(exc).__name__ and "found at least two devices" not in str(exc):
        return None
    on_meta = any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers())) or any(
        isinstance(t, torch.Tensor) and t.device.type == "meta" for t in _leaves((tuple(args), dict(kwargs))))
    if not on_meta:
        return None
    state = _fixed_device_state(model)
    if state is not None:
        return state
    found = _fixed_device_origin(model, args, kwargs)
    if found is not None:
        return (f"{found}: a model whose forward creates a tensor on a fixed device (a factory without device=) "
                f"cannot be traced on meta; create it on the device of its inputs (device=x.device), or {_PLAN_ON_CPU}")
    return f"the model mixes tensors on meta and on a fixed device, so it cannot be traced on meta; {_PLAN_ON_CPU}"


def _explain(exc: BaseException, model: torch.nn.Module, args: Sequence[Any] = (),
             kwargs: Mapping[str, Any] | None = None) -> str:
    """Turn a torch.export failure into 'what / where / what to try'."""
    text = str(exc)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    where = _user_frame(text) or _frame_from_traceback(exc)
    kind = type(exc).__name__
    tries: list[str]
    low = text.lower()
    fixed = _meta_device_mismatch(exc, model, args, kwargs or {})
    if fixed is not None:
        return (f"cannot capture {type(model).__name__} with torch.export on the meta device: {fixed}. "
                f"torch says: {first}")
    if "data-dependent" in low or "guardondatadependent" in kind.lower() or "datadependent" in kind.lower():
        what = "data-dependent control flow or shape (a Python branch/int on a tensor value)"
        tries = [
            "replace `if tensor_cond:` with torch.cond / torch.where, or compute the branch from shapes",
            "pass concrete example inputs that take the branch you want and hoist the decision out of forward()",
            "use torch._check / torch._check_is_size to tell export about the value's range",
        ]
    elif "unsupported" in low or "not supported" in low or "no fake impl" in low or "fake" in kind.lower():
        what = "an operator that export cannot trace (no fake/meta kernel or unsupported Python construct)"
        tries = [
            "register a fake kernel (torch.library.register_fake) for the custom op",
            "wrap the offending submodule in a module that calls a traceable equivalent",
        ]
    elif "constraint" in low or "dynamic" in low or "specializ" in low:
        what = "a dynamic-shape constraint violation"
        tries = [
            "capture with dynamic=False (static shapes of one micro-batch)",
            "mark only the dims that really vary as dynamic (torch.export.Dim)",
        ]
    else:
        what = f"torch.export raised {kind}"
        tries = ["check that forward() runs eagerly on these example inputs"]
    tries += [
        "run torch._dynamo.explain(model)(*args) or torch.export.draft_export(...) to list every graph break",
        "(fxpipe already uses strict=False; wrapping the model so forward returns tensors also helps)",
    ]
    msg = f"cannot capture {type(model).__name__} with torch.export: {what}. torch says: {first}"
    if where:
        msg += f" | raised at: {where}"
    msg += " | what to try: " + "; ".join(tries)
    return msg


#: ``replicate="auto"`` replicates layers of models with at least this many identical layers.
REPLICATE_MIN_LAYERS = 16
REPLICATE_MODES = ("auto", "always", "never")


def capture(
    model: torch.nn.Module,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic: bool = False,
    replicate: str = "auto",
    duplicate_constants: bool = True,
) -> Captured:
    """Capture ``model`` with ``torch.export.export(..., strict=False)``.

    Parameters
    ----------
    model : torch.nn.Module
        The model (any device, including ``meta``). It is not modified (a layer list is
        swapped for a shorter one during a replicated capture and put back).
    args, kwargs : tuple, dict
        Example inputs of ONE micro-batch.
    dynamic : bool
        If True, every dimension of every tensor input is exported as dynamic (``Dim.AUTO``),
        so the graph is valid for other shapes; costs are still computed from the example
        (hinted) sizes.
    replicate : {"auto", "always", "never"}
        Export three layers of a stack of identical layers and replicate the middle one
        (:mod:`fxpipe.passes.replicate`): ``"auto"`` for stacks of at least
        :data:`REPLICATE_MIN_LAYERS` layers, ``"always"`` for any stack of four or more,
        ``"never"`` for a plain full export. Whenever replication is not safe (layers that
        differ, a parent that does not iterate over its layer list) it falls back to the full
        export; ``Captured.replication`` says which happened. Never with ``dynamic``.
    duplicate_constants : bool
        Give every layer that reads a tensor computed from constants only (e.g. a causal mask)
        its own copy of the ops making it when that costs less than relaying the tensor, so that
        a pipeline computes it on the layer's stage instead of relaying it
        (:func:`fxpipe.passes.duplicate_constants.duplicate_constants`; its report is
        ``gm.meta["fxpipe_duplicated_constants"]``). Every process that captures the model for
        a plan must use the same setting.

    Returns
    -------
    Captured
        ``.exported`` (ExportedProgram) and ``.gm`` (unlifted, trainable GraphModule whose
        nodes carry ``meta["val"]``).

    Raises
    ------
    CaptureError
        If torch.export fails; the message says why, where (the user source line torch
        reports) and what to try.
    """
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"capture expects a torch.nn.Module, got {type(model).__name__}")
    if replicate not in REPLICATE_MODES:
        raise CaptureError(f"replicate must be one of {REPLICATE_MODES}, got {replicate!r}")
    args = tuple(args) if isinstance(args, (list, tuple)) else (args,)
    kwargs = dict(kwargs or {})
    if replicate != "never" and not dynamic:
        rep = _capture_replicated(model, args, kwargs, min_layers=REPLICATE_MIN_LAYERS if replicate == "auto" else 4)
        if rep is not None:
            drop_layout_contiguous(rep.gm)
            if duplicate_constants:
                _duplicate_constants(rep.gm)
            return rep
    dynamic_shapes = None
    if dynamic:
        from torch.export import Dim

        def spec(x):
            if isinstance(x, torch.Tensor):
                return {i: Dim.AUTO for i in range(x.dim())}
            return None

        import inspect

        try:
            bound = inspect.signature(model.forward).bind(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            raise CaptureError(f"the example inputs do not match {type(model).__name__}.forward: {exc}") from None
        dynamic_shapes = {}
        for pname, val in bound.arguments.items():
            if isinstance(val, tuple):
                dynamic_shapes[pname] = tuple(spec(v) for v in val)
            elif isinstance(val, dict):
                dynamic_shapes[pname] = {k: spec(v) for k, v in val.items()}
            else:
                dynamic_shapes[pname] = spec(val)
    t0 = time.perf_counter()
    try:
        exported = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
    except CaptureError:
        raise
    except Exception as exc:  # torch raises many unrelated types here
        raise CaptureError(_explain(exc, model, args, kwargs)) from exc
    try:
        gm = exported.module(check_guards=False)
    except TypeError:  # older torch without check_guards
        gm = exported.module()
    drop_layout_contiguous(gm)
    remove_dead_code(gm)
    prefix = _is_wrapper(model)
    gm.meta[MODULE_PREFIX_KEY] = prefix
    if duplicate_constants:
        _duplicate_constants(gm)
    capture_s = time.perf_counter() - t0
    missing = [n.name for n in gm.graph.nodes if n.op == "placeholder" and "val" not in n.meta]
    if missing:
        raise CaptureError(
            f"torch.export produced nodes without shape metadata (meta['val']): {missing[:5]}; "
            "this torch version is not supported by fxpipe's cost model"
        )
    return Captured(exported=exported, gm=gm, example_args=args, example_kwargs=kwargs,
                    capture_s=capture_s, module_prefix=prefix)


def _duplicate_constants(gm: torch.fx.GraphModule) -> None:
    from fxpipe.passes.duplicate_constants import duplicate_constants  # lazy: imports fxpipe.codegen

    duplicate_constants(gm)




_VIEW_TARGETS = ("aten.reshape.default", "aten.view.default", "aten.transpose.int", "aten.permute.default")


def drop_layout_contiguous(gm: torch.fx.GraphModule) -> int:
    """Remove ``contiguous`` calls on attention outputs that exist only on some devices.

    ``F.scaled_dot_product_attention`` returns its output in the layout of the kernel that
    runs: the CPU and CUDA flash kernels write ``(batch, seq, heads, dim)`` memory, so Hugging
    Face's ``out.transpose(1, 2).contiguous()`` is a no-op that torch.export leaves out, while
    on ``meta`` (the math layout) the same line exports a copy. A plan made on meta would then
    name one node more per layer than the graph a CPU or GPU worker captures. The copy is
    removed where its input is a view chain of an attention output and every user reshapes it
    (``reshape`` copies when it must, so values and shapes are unchanged); the graph is then the
    same on every device. Returns the number of nodes removed.
    """
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or str(node.target) != "aten.contiguous.default":
            continue
        if not node.users or not all(u.op == "call_function" and str(u.target) == "aten.reshape.default" for u in node.users):
            continue
        src = node.args[0] if node.args else None
        while isinstance(src, torch.fx.Node) and src.op == "call_function" and str(src.target) in _VIEW_TARGETS:
            src = src.args[0]
        if not (isinstance(src, torch.fx.Node) and src.op == "call_function"
                and "scaled_dot_product" in str(src.target)):
            continue
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        removed += 1
    if removed:
        gm.graph.lint()
        gm.recompile()
    return removed


def _capture_replicated(model: torch.nn.Module, args: tuple, kwargs: dict, *, min_layers: int) -> Captured | None:
    """Export three layers and replicate (see :mod:`fxpipe.passes.replicate`); None if not applicable."""

    found = find_layer_stack(model, min_layers)
    if found is None:
        return None
    path, layers = found
    parent_path, _, attr = path.rpartition(".")
    parent = getattr_path(model, parent_path) if parent_path else model
    if parent is None or getattr(parent, attr, None) is not layers:
        return None
    configs = [getattr(m, "config", None) for m in (model, parent, *[mod for _, mod in model.named_children()])]
    if per_layer_settings_vary([parent, *configs], len(layers)) is not None:
        return None
    t0 = time.perf_counter()
    setattr(parent, attr, torch.nn.ModuleList(truncated_layers(layers)))
    try:
        small = capture(model, args, kwargs, replicate="never", duplicate_constants=False)
    except CaptureError:
        return None  # the full export will report the error (or succeed where the cut model failed)
    finally:
        setattr(parent, attr, layers)
    t1 = time.perf_counter()
    try:
        gm = replicate_layers(small.gm, model, path, len(layers))
    except ReplicationError:
        return None
    t2 = time.perf_counter()
    return Captured(
        exported=small.exported, gm=gm, example_args=args, example_kwargs=kwargs, capture_s=t2 - t0,
        module_prefix=small.module_prefix,
        replication={"path": path, "layers": len(layers), "exported_layers": TEMPLATE_LAYERS,
                     "export_s": t1 - t0, "replicate_s": t2 - t1},
    )












def user_source_line(node: torch.fx.Node) -> str:
    """The user's source line of a node from ``meta["stack_trace"]``: its innermost frame
    outside torch (a call of ``nn.Linear`` names the user's line, not torch's
    ``F.linear``), e.g. ``'File "model.py", line 30, in forward: sel = h[mask]'``; ``""`` when
    unknown."""
    import os

    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n[ \t]*(.*)', str(trace))
    if not frames:
        return ""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    user = [f for f in frames if not os.path.abspath(f[0]).startswith(torch_dir)]
    fn, line, func, code = (user or frames)[-1]
    return f'File "{fn}", line {line}, in {func}: {code.strip()}'
