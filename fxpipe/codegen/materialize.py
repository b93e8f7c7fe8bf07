"""Each rank holds only its stage: materialize a stage's parameters and buffers from ``meta``.

A model built on the ``meta`` device (``with torch.device("meta"): model = ...``) is captured and
split without allocating anything (:func:`fxpipe.passes.capture.capture`,
:func:`fxpipe.codegen.split.split_stages`); every stage module then holds ``meta`` tensors.
:func:`materialize_stage` gives one stage real tensors, on its device, from a
:class:`StateSource`: a checkpoint (loaded by fully qualified name, only the tensors the stage
needs) and/or the model's own initializers. Nothing of the other stages, of the captured graph
module or of the model is allocated: :func:`real_state_bytes` counts what a rank holds.

Initializers and "the same seed"
    The state of the unsplit model under seed ``s`` is defined by :func:`initialize` (what
    :func:`materialize_model` and :class:`MetaInit` apply to a whole model, the single-process
    reference), and a stage gets exactly the values of its tensors in that state:

    1. *Which initializer.* For a module ``M``: ``init_fn(M)`` when one is given (like FSDP's
       ``param_init_fn``); else, when ``M`` lies inside a Hugging Face ``PreTrainedModel``,
       ``P._init_weights(M)`` of the nearest such ``P`` (``M`` itself if it is one; the dispatch
       of ``PreTrainedModel.initialize_weights``); else ``M.reset_parameters()`` (torch's
       convention, as FSDP uses for meta-device modules); else none.
    2. *Which modules, in which order.* Every module that holds one of the requested tensors
       directly (under any alias; a tied weight is held by two modules), and all their
       ancestors, in post-order (children before parents, ``torch.nn.Module.apply``'s and
       ``initialize_weights``' order). Ancestors run because initializers may write their
       descendants' tensors (GPT-2 rescales ``c_proj.weight`` from its attention block).
    3. *Which random numbers.* Before each initializer the global CPU generator is seeded
       with ``H(s, "module", qualified name of M)``; every random fill of a requested tensor
       ``T`` (an in-place ``normal_``, ``uniform_``, ... or any ``torch.nn.init`` function called
       on ``T`` or a view of it) draws from a generator seeded with ``H(s, "tensor", fqn(T), k)``,
       ``k`` counting the earlier random fills of ``T``. ``H`` is the first 63 bits of SHA-256 of
       the parts. A tensor's value therefore depends only on the seed, its name and the
       initializers that write it, not on which other tensors are materialized, which rank
       runs it, or the order: a rank that materializes a subset gets bit-identical values.
    4. Tensors that are not requested stay on ``meta`` during the procedure (writes to them
       vanish); initializers run on CPU (values do not depend on the device), then the stage's
       tensors move to its device.

    A requested tensor that no initializer writes (a module without ``reset_parameters`` whose
    parameter was set in ``__init__``, a buffer computed in ``__init__``) raises
    :class:`~fxpipe.errors.InputError` naming it: pass ``init_fn``, a checkpoint holding it,
    or build the model for real. Exactness assumes that an initializer writes only tensors of
    its module's subtree (or aliases it holds) and that its random draws fill the tensors they
    initialize (true of every ``torch.nn.init`` function but ``orthogonal_``/``sparse_``, whose
    draws go through temporaries and the per-module generator).

Checkpoints (``StateSource(checkpoint=...)``)
    A ``.safetensors`` file, a sharded set (its ``*.safetensors.index.json``, whose
    ``weight_map`` names the file of every key, inside the index's folder), a directory holding
    either, a training-state checkpoint of :func:`fxpipe.codegen.checkpoint.save_training_state`
    (its committed version's ``model/``), a torch state dict
    file (``torch.load(weights_only=True, mmap=True)``: memory-mapped, only the needed tensors
    are read), or an in-memory mapping. Keys are the model's fully qualified names
    (``model.state_dict()``); a tied tensor may appear under any of its aliases. safetensors
    files are read key by key with ``safe_open`` and only the shards holding needed keys are
    opened (:mod:`fxpipe.codegen.safetensors_files` checks every file first). Values are cast to
    the stage tensor's dtype within a kind (float16 to float32); a shape mismatch, a value of
    another kind (int64 for a float parameter) or a parameter missing from the checkpoint raises
    :class:`~fxpipe.errors.InputError` (:func:`checkpoint_mismatches`, the check the Hugging Face
    folders of ``fxpipe plan --hf FOLDER`` go through too); buffers missing from it
    (non-persistent buffers are never saved) come from the initializers.

References
----------
PyTorch FSDP meta-device initialization (``param_init_fn``, ``reset_parameters``); Hugging Face
``PreTrainedModel.initialize_weights``; safetensors ``safe_open``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode

from fxpipe.codegen.runtime import get_tensor_slot, module_tensor_slots, set_tensor_slot
from fxpipe.codegen.safetensors_files import dtype_kind, open_safetensors, safetensors_header, safetensors_index
from fxpipe.errors import InputError

__all__ = [
    "StateSource",
    "MaterializeReport",
    "derive_seed",
    "initialize",
    "load_tensors",
    "checkpoint_mismatches",
    "materialize_stage",
    "materialize_model",
    "MetaInit",
    "holds_meta",
    "real_state_bytes",
    "retarget_meta_devices",
]

#: random fills whose generator the initialization procedure sets (Tensor methods and torch.nn.init)
_RANDOM_FILLS = frozenset({
    "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_",
    "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_", "orthogonal_",
    "sparse_",
})
#: in-place methods that do not write values
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "__set__", "__get__"})


@dataclass(frozen=True)
class StateSource:
    """Where a stage's parameters and buffers come from when the model is on ``meta``.

    Attributes
    ----------
    seed : int
        Seed of the initialization procedure (see the module docstring).
    checkpoint : str, os.PathLike or Mapping[str, Tensor], optional
        Checkpoint read by fully qualified name (see the module docstring); tensors it lacks come
        from the initializers (parameters must be present).
    init_fn : callable(module) -> None, optional
        Initializer of every module (replaces the model's own).
    model : torch.nn.Module, optional
        The original model (any device, usually ``meta``): its modules carry the initializers.
        Required unless the checkpoint holds every tensor the stage needs.
    """

    seed: int = 0
    checkpoint: Any = None
    init_fn: Callable[[torch.nn.Module], None] | None = None
    model: torch.nn.Module | None = field(default=None, compare=False)


@dataclass
class MaterializeReport:
    """What one rank materialized.

    Attributes
    ----------
    stage : int
    param_bytes, buffer_bytes : int
        Bytes of the stage's parameters and buffers now on its device (tied aliases once).
    from_checkpoint, initialized : list[str]
        Canonical names read from the checkpoint / produced by the initializers.
    checkpoint_files : list[str]
        Files opened (safetensors shards, a state dict file).
    retargeted_nodes : int
        Graph nodes whose ``meta`` device literal now names the stage's device
        (:func:`retarget_meta_devices`).
    """

    stage: int
    param_bytes: int = 0
    buffer_bytes: int = 0
    from_checkpoint: list[str] = field(default_factory=list)
    initialized: list[str] = field(default_factory=list)
    checkpoint_files: list[str] = field(default_factory=list)
    retargeted_nodes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def derive_seed(seed: int, *parts: Any) -> int:
    """``H(seed, *parts)``: the first 63 bits of SHA-256 of the parts joined by NUL (a torch seed)."""
    h = hashlib.sha256("\x00".join(str(p) for p in (seed,) + parts).encode())
    return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


def holds_meta(module: torch.nn.Module) -> bool:
    """True when any parameter or buffer of ``module`` is on the ``meta`` device."""
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def real_state_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the distinct non-``meta`` parameters and buffers held by ``modules`` (storages counted once)."""
    seen: dict[tuple, int] = {}
    for mod in modules:
        for t in list(mod.parameters()) + list(mod.buffers()):
            if t.is_meta:
                continue
            st = t.untyped_storage()
            seen[(t.device.type, t.device.index, st.data_ptr())] = st.nbytes()
    return int(sum(seen.values()))


# ----------------------------------------------------------------------------- names
def _alias_groups(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, torch.Tensor], dict[str, bool]]:
    """alias -> canonical name, canonical -> tensor, canonical -> is parameter (tied aliases collapse)."""
    canon: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    is_param: dict[str, bool] = {}
    alias: dict[str, str] = {}
    for kind, named in (("p", model.named_parameters(remove_duplicate=False)), ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            c = canon.setdefault(id(t), name)
            alias[name] = c
            tensors.setdefault(c, t)
            is_param.setdefault(c, kind == "p")
    return alias, tensors, is_param


def _is_pretrained(m: torch.nn.Module) -> bool:
    return callable(getattr(m, "_init_weights", None)) and any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__)


def _initializer(qual: str, mod: torch.nn.Module, modules: Mapping[str, torch.nn.Module],
                 init_fn: Callable | None) -> Callable[[], None] | None:
    if init_fn is not None:
        return lambda: init_fn(mod)
    parts = qual.split(".") if qual else []
    for n in range(len(parts), -1, -1):  # the nearest enclosing PreTrainedModel (M itself first)
        p = modules.get(".".join(parts[:n]))
        if p is not None and _is_pretrained(p):
            return lambda: p._init_weights(mod)
    reset = getattr(mod, "reset_parameters", None)
    if callable(reset):
        return reset
    return None


class _SeededFills(TorchFunctionMode):
    """Seeds every random fill of a tracked tensor by the tensor's name; records writes."""

    def __init__(self, seed: int, names_by_ptr: Mapping[int, str]):
        super().__init__()
        self.seed = seed
        self.names_by_ptr = names_by_ptr
        self.fills: dict[str, int] = {}
        self.written: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        target = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("tensor")
        if name.endswith("_") and name not in _NOT_WRITES and isinstance(target, torch.Tensor) and not target.is_meta:
            fqn = self.names_by_ptr.get(target.untyped_storage().data_ptr())
            if fqn is not None:
                self.written.add(fqn)
                if name in _RANDOM_FILLS and kwargs.get("generator") is None:
                    k = self.fills.get(fqn, 0)
                    self.fills[fqn] = k + 1
                    kwargs["generator"] = torch.Generator(device=target.device).manual_seed(
                        derive_seed(self.seed, "tensor", fqn, k))
        return func(*args, **kwargs)


def initialize(model: torch.nn.Module, names: Iterable[str] | None = None, *, seed: int = 0,
               init_fn: Callable[[torch.nn.Module], None] | None = None) -> dict[str, torch.Tensor]:
    """Values of ``model``'s parameters and buffers ``names`` from its initializers (see the module docstring).

    ``model`` is not modified (its tensors may be on ``meta``; they are swapped for CPU
    tensors during the procedure and put back after).

    Parameters
    ----------
    model : torch.nn.Module
    names : iterable of str, optional
        Fully qualified names (any alias of a tied tensor); default: every parameter and buffer.
    seed : int
    init_fn : callable(module) -> None, optional
        Initializer of every module instead of the model's own.

    Returns
    -------
    dict[str, torch.Tensor]
        Requested name (as given) -> CPU tensor (a ``Parameter`` for parameters, with the
        original's ``requires_grad``).

    Raises
    ------
    InputError
        For an unknown name, or a requested tensor no initializer writes.
    """
    alias, tensors, is_param = _alias_groups(model)
    if names is None:
        names = list(tensors)
    names = list(names)
    unknown = [n for n in names if n not in alias]
    if unknown:
        raise InputError(f"the model has no parameter or buffer named {unknown[:5]}")
    wanted = {alias[n] for n in names}
    real: dict[str, torch.Tensor] = {}
    for c in wanted:
        t = tensors[c]
        empty = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        real[c] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) if is_param[c] else empty
    modules = dict(model.named_modules())
    first_name = {id(m): q for q, m in modules.items()}
    by_id = {id(tensors[c]): c for c in tensors}
    swaps = []
    holders: set[str] = set()
    for qual, mod, kind, k, t in module_tensor_slots(model):
        c = by_id.get(id(t))
        if c in wanted:
            swaps.append((mod, kind, k, t))
            holders.add(first_name[id(mod)])
    running = set()
    for q in holders:
        parts = q.split(".") if q else []
        for n in range(len(parts) + 1):
            running.add(".".join(parts[:n]))
    order: list[str] = []

    def visit(q: str, mod: torch.nn.Module) -> None:
        for child_name, child in mod.named_children():
            cq = f"{q}.{child_name}" if q else child_name
            if first_name.get(id(child)) == cq and any(r == cq or r.startswith(cq + ".") for r in running):
                visit(cq, child)
        if q in running:
            order.append(q)

    visit("", model)
    ptrs = {real[c].untyped_storage().data_ptr(): c for c in wanted}
    mode = _SeededFills(seed, ptrs)
    with torch.random.fork_rng(devices=[]):
        try:
            for mod, kind, k, t in swaps:
                set_tensor_slot(mod, kind, k, real[by_id[id(t)]])
            with torch.no_grad():
                for q in order:
                    fn = _initializer(q, modules[q], modules, init_fn)
                    if fn is None:
                        continue
                    torch.default_generator.manual_seed(derive_seed(seed, "module", q))
                    with mode:
                        fn()
            values = {}
            for mod, kind, k, t in swaps:  # an initializer may have replaced the tensor object
                c = by_id[id(t)]
                now = get_tensor_slot(mod, kind, k)
                if now is not real[c] and now is not None and not now.is_meta:
                    values[c] = now
                    mode.written.add(c)
                elif now is real[c] and now.untyped_storage().data_ptr() not in ptrs:  # .data = ... assignment
                    values[c] = now
                    mode.written.add(c)
        finally:
            for mod, kind, k, t in swaps:
                set_tensor_slot(mod, kind, k, t)
    missing = sorted(wanted - mode.written)
    if missing:
        owners = []
        for c in missing[:5]:
            q = c.rsplit(".", 1)[0] if "." in c else ""
            owners.append(f"{c} ({type(modules.get(q, model)).__name__})")
        raise InputError(
            f"no initializer writes {len(missing)} tensor(s) of the meta model: {', '.join(owners)}"
            f"{' ...' if len(missing) > 5 else ''}. Give their modules a reset_parameters() that initializes their own "
            "parameters and buffers, pass init_fn=, load them from a checkpoint, or build the model on a real device"
        )
    out = {}
    for n in names:
        c = alias[n]
        out[n] = values.get(c, real[c])
    return out


# ----------------------------------------------------------------------------- checkpoints
def _resolve_checkpoint(path: Path) -> tuple[str, Path]:
    """('safetensors' | 'index' | 'torch', file) for a checkpoint path."""
    if path.is_dir() and ((path / "latest.json").exists() or (path / "fxpipe_state.json").is_file()):
        from fxpipe.codegen.checkpoint import latest_state_dir  # a training-state checkpoint: its model folder

        path = latest_state_dir(path) / "model"
    if path.is_dir():
        idx = sorted(path.glob("*.safetensors.index.json"))
        if len(idx) == 1:
            return "index", idx[0]
        files = sorted(path.glob("*.safetensors"))
        if len(files) == 1:
            return "safetensors", files[0]
        raise InputError(
            f"checkpoint directory {path} must hold one *.safetensors.index.json or one *.safetensors file "
            f"(found {len(idx)} index files and {len(files)} safetensors files)"
        )
    if not path.exists():
        raise InputError(f"checkpoint {path} does not exist")
    name = path.name
    if name.endswith(".index.json"):
        return "index", path
    if name.endswith(".safetensors"):
        return "safetensors", path
    return "torch", path


def checkpoint_mismatches(where: str, missing: Sequence[str] = (), shapes: Sequence[tuple[str, Any, Any]] = (),
                          dtypes: Sequence[tuple[str, Any, Any]] = ()) -> None:
    """Refuse a checkpoint that does not fill every parameter of the model as stored (one check, two loaders).

    Used by :func:`materialize_stage` / :func:`materialize_model` (``plan.build(checkpoint=...)``)
    and by ``fxpipe.models`` when a Hugging Face checkpoint folder is loaded with
    ``from_pretrained`` (``fxpipe plan --hf FOLDER --run``), so that neither trains a tensor the
    checkpoint lacks from random values.

    Parameters
    ----------
    where : str
        The checkpoint, as the message names it.
    missing : sequence of str
        Parameters of the model the checkpoint does not hold.
    shapes : sequence of (name, stored shape, model shape)
    dtypes : sequence of (name, stored dtype, model dtype)
        Tensors stored with a dtype of another kind (integer into floating, ...).

    Raises
    ------
    InputError
        When any of the three is not empty, naming the checkpoint and the first five keys of each.
    """
    parts = []
    if missing:
        names = sorted(missing)
        parts.append(f"lacks {len(names)} parameter(s) of the model: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
    for what, rows in (("shape", shapes), ("dtype", dtypes)):
        if rows:
            shown = "; ".join(f"{n} stored {_show(a)}, the model's is {_show(b)}" for n, a, b in sorted(rows, key=str)[:5])
            parts.append(f"holds {len(rows)} tensor(s) with another {what}: {shown}{' ...' if len(rows) > 5 else ''}")
    if parts:
        raise InputError(
            f"checkpoint {where} " + "; it ".join(parts) + ": it was saved from another model (or is incomplete). fxpipe "
            "neither initializes a missing parameter at random nor casts integers into floating-point parameters: "
            "save the checkpoint from this model (save_pretrained, safetensors.torch.save_model)"
        )


def _show(v: Any) -> str:
    if isinstance(v, (tuple, list, torch.Size)):
        return str(tuple(int(x) for x in v))
    return str(v).replace("torch.", "")


def load_tensors(checkpoint: Any, wanted: Mapping[str, Sequence[str]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Read only the ``wanted`` tensors of a checkpoint, by fully qualified name.

    Parameters
    ----------
    checkpoint : str, os.PathLike or Mapping[str, Tensor]
        See the module docstring.
    wanted : Mapping[str, sequence of str]
        Name -> the keys it may be stored under (its aliases), tried in order.

    Returns
    -------
    (dict[str, Tensor], list[str])
        Found tensors (CPU, as stored) by name, and the files opened. Names not in the
        checkpoint are absent.

    Raises
    ------
    InputError
        For a missing or malformed checkpoint (an empty, truncated or garbage safetensors file, an
        index whose ``weight_map`` leaves its folder), naming the file.
    """
    if isinstance(checkpoint, Mapping):
        out = {}
        for n, keys in wanted.items():
            k = next((k for k in keys if k in checkpoint), None)
            if k is not None:
                out[n] = checkpoint[k]
        return out, []
    kind, path = _resolve_checkpoint(Path(os.fspath(checkpoint)))
    if kind == "torch":
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file
            raise InputError(f"cannot read checkpoint {path} as a torch state dict or safetensors file: {exc}") from None
        if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise InputError(f"checkpoint {path} is not a flat state dict (name -> tensor)")
        out, _ = load_tensors(sd, wanted)
        return {n: t.clone() for n, t in out.items()}, [str(path)]
    if kind == "index":
        file_of = safetensors_index(path)
    else:
        file_of = {k: path for k in safetensors_header(path)}
    plan: dict[Path, list[tuple[str, str]]] = {}
    for n, keys in wanted.items():
        k = next((k for k in keys if k in file_of), None)
        if k is not None:
            plan.setdefault(file_of[k], []).append((n, k))
    out = {}
    for fpath, items in sorted(plan.items()):
        if not fpath.exists():
            raise InputError(f"checkpoint shard {fpath} named by {path} does not exist")
        with open_safetensors(fpath) as f:
            for n, k in items:
                try:
                    out[n] = f.get_tensor(k)
                except Exception as exc:  # noqa: BLE001 - a key the index names but the shard lacks, bad bytes
                    raise InputError(f"cannot read tensor {k!r} from safetensors file {fpath} (named by {path}): "
                                     f"{str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}") from None
    return out, [str(p) for p in sorted(plan)]


# ----------------------------------------------------------------------------- stages and models
def _values(names: Mapping[str, tuple[tuple[str, ...], torch.Tensor, bool]], source: StateSource,
            report: MaterializeReport) -> dict[str, torch.Tensor]:
    """canonical -> CPU value, from the checkpoint first and the initializers for the rest."""
    values: dict[str, torch.Tensor] = {}
    if source.checkpoint is not None:
        found, files = load_tensors(source.checkpoint, {c: aliases for c, (aliases, _, _) in names.items()})
        report.checkpoint_files = files
        shapes, dtypes = [], []
        for c, t in found.items():
            like = names[c][1]
            if tuple(t.shape) != tuple(like.shape):
                shapes.append((c, t.shape, like.shape))
            elif dtype_kind(t.dtype) != dtype_kind(like.dtype):
                dtypes.append((c, t.dtype, like.dtype))
            else:
                values[c] = t.to(like.dtype)
        missing_params = [c for c, (_, _, p) in names.items() if p and c not in found]
        checkpoint_mismatches(source.checkpoint if not isinstance(source.checkpoint, Mapping) else "(mapping)",
                              missing_params, shapes, dtypes)
        report.from_checkpoint = sorted(values)
    rest = [c for c in names if c not in values]
    if rest:
        if source.model is None:
            raise InputError(
                f"{len(rest)} tensor(s) of this stage ({rest[:3]}) are on meta and not in the checkpoint: pass the model "
                "(its modules' initializers define them) or a checkpoint that holds them"
            )
        alias_of, _, _ = _alias_groups(source.model)
        lookup = {}
        for c in rest:
            key = next((a for a in names[c][0] if a in alias_of), None)
            if key is None:
                raise InputError(f"the model has no parameter or buffer {c!r} (the captured graph names it)")
            lookup[c] = key
        init = initialize(source.model, list(lookup.values()), seed=source.seed, init_fn=source.init_fn)
        for c, key in lookup.items():
            values[c] = init[key].detach()
        report.initialized = sorted(rest)
    return values


def _replace(module: torch.nn.Module, canon_of: Mapping[int, str], values: Mapping[str, torch.Tensor],
             device: torch.device, made: dict[str, torch.Tensor] | None = None) -> tuple[int, int]:
    """Put the new values in every slot of ``module`` (aliases share one new tensor); returns (param, buffer) bytes
    of the tensors created (``made``, kept by the caller, shares tensors across modules)."""
    made = {} if made is None else made
    pbytes = bbytes = 0
    for _, mod, kind, k, t in module_tensor_slots(module):
        c = canon_of.get(id(t))
        if c is None or (c not in values and c not in made):
            continue
        new = made.get(c)
        if new is None:
            data = values[c].detach().to(device=device, dtype=t.dtype).contiguous()
            if kind == "parameter":
                new = torch.nn.Parameter(data, requires_grad=t.requires_grad)
                pbytes += data.numel() * data.element_size()
            else:
                new = data
                bbytes += data.numel() * data.element_size()
            made[c] = new
        set_tensor_slot(mod, kind, k, new)
    return pbytes, bbytes


def materialize_stage(staged, rank: int, source: StateSource, device: str | torch.device = "cpu",
                      shared: dict[str, torch.Tensor] | None = None) -> MaterializeReport:
    """Give stage ``rank`` of ``staged`` real parameters and buffers on ``device`` (nothing else).

    Parameters
    ----------
    staged : fxpipe.codegen.split.StagedProgram
        Split from a capture (typically of a ``meta`` model).
    rank : int
        The stage to materialize.
    source : StateSource
        Checkpoint and/or initializers (see the module docstring).
    device : str or torch.device
    shared : dict, optional
        Canonical name -> tensor already materialized for another stage of the same rank (kept
        by the caller across the rank's stages): a parameter tied across stages on one rank stays
        one tensor. Filled with this stage's new tensors; their bytes are counted once.

    Returns
    -------
    MaterializeReport

    Raises
    ------
    InputError
        When a value cannot be found (see :func:`load_tensors` and :func:`initialize`) or the
        stage reads a captured constant that is on ``meta``.
    """
    spec = staged.stages[rank]
    mod = spec.module
    dev = torch.device(device)
    canon_of: dict[int, str] = {}
    names: dict[str, tuple[tuple[str, ...], torch.Tensor, bool]] = {}
    aliases: dict[str, list[str]] = {}
    for c, target in spec.param_targets.items():
        t = mod.get_parameter(target)
        canon_of[id(t)] = c
    for c, target in spec.buffer_targets.items():
        t = mod.get_buffer(target)
        canon_of[id(t)] = c
    for name, t in list(mod.named_parameters(remove_duplicate=False)) + list(mod.named_buffers(remove_duplicate=False)):
        c = canon_of.get(id(t))
        if c is None and not t.is_meta:
            # not the model's state: a constant torch.export lifted out of forward (``lifted_tensor_0``,
            # BEiT's relative position index built in forward), which already holds its value
            continue
        if c is None:
            c = canon_of[id(t)] = name
        aliases.setdefault(c, [c])
        if name not in aliases[c]:
            aliases[c].append(name)
        names[c] = (tuple(aliases[c]), t, isinstance(t, torch.nn.Parameter))
    for node in mod.graph.nodes:
        if node.op == "get_attr":
            obj = mod
            for part in str(node.target).split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, torch.Tensor) and obj.is_meta and id(obj) not in canon_of:
                raise InputError(
                    f"stage {rank} reads the captured constant {node.target!r}, which is on meta: build the constant on a "
                    "real device (or register it as a buffer so that it can be initialized or loaded)"
                )
    report = MaterializeReport(stage=int(rank))
    if shared:  # tensors another stage of this rank already materialized are reused, not read again
        names = {c: v for c, v in names.items() if c not in shared}
    values = _values(names, source, report) if names else {}
    made = shared if shared is not None else {}
    report.param_bytes, report.buffer_bytes = _replace(mod, canon_of, values, dev, made)
    report.retargeted_nodes = retarget_meta_devices(mod, dev)
    return report


def retarget_meta_devices(gm: torch.fx.GraphModule, device: str | torch.device) -> int:
    """Replace every ``meta`` device literal in ``gm``'s graph by ``device`` (in place); returns the nodes changed.

    A capture on ``meta`` records the device of the tensors it saw: ``_assert_tensor_metadata``
    checks and factory calls (``arange``, ``full``, ``zeros``, ``_to_copy``) carry
    ``device=meta``. The materialized stage runs on ``device``, so its graph must say so
    (:func:`torch.export.passes.move_to_device_pass` does the same on an ``ExportedProgram``).
    The bodies of higher-order ops (``wrap_with_set_grad_enabled`` of a ``torch.no_grad()``
    block, ``wrap_with_autocast``, ``cond``: submodules that are graphs) are rewritten too.
    """
    dev = torch.device(device)

    def fix(a):
        if isinstance(a, torch.device) and a.type == "meta":
            return dev
        if isinstance(a, str) and a == "meta":
            return str(dev)
        if isinstance(a, (list, tuple)):
            return type(a)(fix(x) for x in a)
        if isinstance(a, dict):
            return {k: fix(v) for k, v in a.items()}
        return a

    changed = 0
    for sub in gm.modules():  # gm first, then the bodies of its higher-order ops
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        here = 0
        for node in sub.graph.nodes:
            args, kwargs = fix(node.args), fix(node.kwargs)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                here += 1
        if here:
            sub.recompile()
        changed += here
    return changed


def materialize_model(model: torch.nn.Module, source: StateSource, device: str | torch.device = "cpu") -> MaterializeReport:
    """Give every parameter and buffer of ``model`` its value from ``source`` (in place): the unsplit reference.

    ``source.model`` defaults to ``model`` itself. Stage values from :func:`materialize_stage`
    with the same source are bit-identical to the values this gives.
    """
    if source.model is None:
        source = StateSource(seed=source.seed, checkpoint=source.checkpoint, init_fn=source.init_fn, model=model)
    alias, tensors, is_param = _alias_groups(model)
    groups: dict[str, list[str]] = {}
    for a, c in alias.items():
        groups.setdefault(c, []).append(a)
    names = {c: (tuple(groups[c]), tensors[c], is_param[c]) for c in tensors}
    report = MaterializeReport(stage=-1)
    values = _values(names, source, report)
    canon_of = {id(t): c for c, t in tensors.items()}
    report.param_bytes, report.buffer_bytes = _replace(model, canon_of, values, torch.device(device))
    return report


@dataclass(frozen=True)
class MetaInit:
    """A picklable ``make_model`` that builds the model on ``meta`` and materializes it whole from a source.

    ``MetaInit(zm, seed=0)()`` is the unsplit reference of a pipeline whose ranks build ``zm()``
    on ``meta`` and materialize their stages with ``StateSource(seed=0)``; with ``checkpoint=`` it
    is the model loaded whole from that checkpoint.

    Attributes
    ----------
    make_model : picklable callable() -> (model, inputs)
    seed : int
    checkpoint : str, optional
    """

    make_model: Callable
    seed: int = 0
    checkpoint: Any = None

    def __call__(self):
        with torch.device("meta"):
            model, inputs = self.make_model()
        materialize_model(model, StateSource(seed=self.seed, checkpoint=self.checkpoint, model=model))
        return model, inputs
