"""Save and resume the sharded training state of a pipeline x data-parallel job (DCP, safetensors).

Every rank of a job built by ``plan.build(rank, ...)`` holds the parameters of its stages,
wrapped by FSDP2 (``dp_shard``: each rank a shard), ``replicate`` (``dp_replicate``) or neither
(a pure pipeline), and its optimizer's state for them. :func:`save_training_state` writes all
ranks' state into one directory with ``torch.distributed.checkpoint`` (DCP) and its
Hugging Face storage layer, so the files are ``safetensors`` and JSON (never pickle).

The directory ``path`` holds versions and a pointer to the committed one:

``latest.json``
    ``{"format": "fxpipe.trainstate-latest/1", "version": NAME, "step": ...}``: the committed
    version. Writing it (a temporary file, fsync, rename) is the one atomic step that commits a
    save; :func:`latest_state_dir` reads it.
``NAME/`` (``step<step>-<time ns>-<pid>``), one version, complete before ``latest.json`` names it:

    ``model/``
        The model's parameters and buffers as full tensors, keyed by the fully qualified names in
        the module given to ``fxpipe.compile`` (a wrapper's prefix included, e.g.
        ``model.transformer.h.0.attn.c_attn.weight``), consolidated into
        ``model-00001-of-00001.safetensors`` with a ``model.safetensors.index.json``: the layout
        of a Hugging Face checkpoint, readable by ``safetensors`` and by
        ``plan.build(rank, checkpoint=path)`` (meta-built models; ``path`` itself or
        ``path/NAME/model``); its buffers include non-persistent ones (rotary tables, masks),
        which a ``state_dict`` leaves out.
    ``optimizer/``
        The optimizer's tensor state (``exp_avg``, ``momentum_buffer``, ``step``, ...), one
        ``safetensors`` file per rank holding its shards, keyed ``<fqn>.<state name>``.
    ``fxpipe_state.json``
        ``{"format": "fxpipe.trainstate/1", "step": ..., "mesh": ..., "param_groups": {fqn:
        hyper-parameters}, "optimizer_state": [fqns with optimizer state]}``.

A save writes a new version next to the committed one, then commits it by replacing ``latest.json``,
then deletes the versions that started before it (the superseded one and those of interrupted
saves). A process killed at any point of a save therefore leaves ``latest.json`` naming a complete
version: the previous one before the commit, the new one after; the next save collects what
the killed one left. One job saves into a ``path`` at a time. Directories of the first layout
(``model/``, ``optimizer/`` and ``fxpipe_state.json`` directly in ``path``, without ``latest.json``)
still load, and the next save into them replaces them.

Names being the original model's, a checkpoint does not depend on the partition or the mesh it
was saved from: :func:`load_training_state` reads it into any plan of the same model (another
mesh, other stages), DCP reading each rank's shard of each tensor (resharding). Loading checks
the files first (the JSON record's fields and ranges, every safetensors header, the tensors and
shapes this rank needs) and turns every failure, DCP's ``CheckpointException`` (a
``BaseException``) included, into an :class:`~fxpipe.errors.InputError` naming the file and the
cause.

Sources: torch ``torch.distributed.checkpoint`` (``save`` / ``load``, ``HuggingFaceStorageWriter``
with ``save_distributed`` and consolidation, ``HuggingFaceStorageReader``); the layout follows
torchtitan's checkpoints (model and optimizer state keyed by fully qualified names, so that a
checkpoint reshards across parallelisms); the commit by an atomically replaced pointer file follows
TensorFlow's ``tf.train.CheckpointManager`` (its ``checkpoint`` state file names the latest
checkpoint) and POSIX ``rename(2)``, which replaces a file in one step.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fxpipe.codegen.safetensors_files import dtype_kind, safetensors_header
from fxpipe.errors import InputError
from fxpipe.io import read_json, write_json_atomic

__all__ = ["save_training_state", "load_training_state", "latest_state_dir", "rank_state", "TRAINSTATE_FORMAT",
           "LATEST_FORMAT"]

TRAINSTATE_FORMAT = "fxpipe.trainstate/1"
_STATE_FILE = "fxpipe_state.json"


def _named_state(schedule) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers by the original model's names (tied ones once)."""
    named = getattr(schedule, "fxpipe_named_state", None)
    if named is None:
        raise InputError(
            "this schedule carries no stage state names: pass the schedule returned by plan.build(rank, ...) "
            "(or fxpipe.codegen.build_rank / build_mesh_rank)"
        )
    out: dict[str, torch.Tensor] = {}
    for _stage, (module, param_targets, buffer_targets) in sorted(named.items()):
        for fqn, target in param_targets.items():
            out.setdefault(fqn, module.get_parameter(target))
        for fqn, target in buffer_targets.items():
            out.setdefault(fqn, module.get_buffer(target))
    return out


def rank_state(schedule) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers, keyed by the original model's fully qualified names.

    Parameters
    ----------
    schedule : FxpipeScheduleRuntime
        As returned by ``plan.build(rank, ...)``.

    Returns
    -------
    dict[str, torch.Tensor]
        The live tensors (FSDP2: ``DTensor`` shards; ``replicate`` and pure pipelines: plain
        tensors); a parameter tied across this rank's stages appears once.

    Raises
    ------
    InputError
        For a schedule fxpipe did not build.
    """
    return dict(_named_state(schedule))


def _fqn_of_params(schedule, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    fqn_of = {id(t): fqn for fqn, t in _named_state(schedule).items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in fqn_of:
                raise InputError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of this rank's stage "
                    "parameters: build the optimizer from schedule.parameters()"
                )
    return fqn_of


def _json_value(v: Any) -> bool:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return True
    return isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float)) for x in v)


def _optimizer_state(schedule, optimizer) -> tuple[dict[str, torch.Tensor], dict[str, dict], list[str]]:
    """(tensor state by ``<fqn>.<name>``, hyper-parameters by fqn, fqns that have state)."""
    fqn_of = _fqn_of_params(schedule, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    hyper: dict[str, dict] = {}
    stateful: list[str] = []
    for group in optimizer.param_groups:
        params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                  if k != "params" and _json_value(v)}
        for p in group["params"]:
            fqn = fqn_of[id(p)]
            hyper[fqn] = params
            state = optimizer.state.get(p)
            if not state:
                continue
            stateful.append(fqn)
            for name, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise InputError(
                        f"optimizer state {name!r} of {fqn} is a {type(value).__name__}, not a tensor: "
                        "only optimizers whose per-parameter state is tensors can be checkpointed"
                    )
                tensors[f"{fqn}.{name}"] = value
    return tensors, hyper, stateful


def _is_number_setting(v: Any) -> bool:
    """A numeric hyper-parameter (lr, eps, weight decay, momentum, betas), not a flag or a tensor."""
    if isinstance(v, bool) or v is None:
        return False
    if isinstance(v, (int, float)):
        return True
    return isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


def _agree(error: Exception | None) -> None:
    """Collective: raise on every rank when any rank failed its local checks (no rank waits alone
    in a later collective); the first failing rank's message, as an InputError (an OSError when
    that rank's failure was one: a file that could not be written)."""
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else (isinstance(error, OSError), str(error)))
    first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if first is not None:
        rank, (os_error, text) = first
        raise (OSError if os_error else InputError)(f"rank {rank}: {text}") from error


def _require_safetensors() -> None:
    """DCP's Hugging Face storage writes safetensors (the ``checkpoint`` extra); InputError without it."""
    try:
        import safetensors  # noqa: F401 - only checks that it is installed
    except ImportError as exc:
        raise InputError("training-state checkpoints are safetensors files: pip install 'fxpipe[checkpoint]'") from exc


# ----------------------------------------------------------------------------- layout: versions and a pointer
LATEST_FILE = "latest.json"
LATEST_FORMAT = "fxpipe.trainstate-latest/1"
_VERSION = re.compile(r"^step(\d+)-(\d+)-(\d+)$")  # step, start time (ns), pid of rank 0


def _version_name(step: int) -> str:
    """A new version's folder name, the same on every rank (rank 0's clock and pid)."""
    token = [f"step{int(step)}-{time.time_ns()}-{os.getpid()}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return token[0]


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def latest_state_dir(path: str | os.PathLike) -> Path | None:
    """The folder of ``path``'s committed training state: ``path/NAME`` named by ``path/latest.json``.

    Parameters
    ----------
    path : str or PathLike
        A checkpoint directory of :func:`save_training_state`.

    Returns
    -------
    Path or None
        ``path/NAME`` (the committed version); ``path`` itself for a directory of the first
        layout (``fxpipe_state.json`` directly in it); None when ``path`` holds neither (no save
        was ever committed there).

    Raises
    ------
    InputError
        When ``latest.json`` is not the pointer :func:`save_training_state` writes (its ``format``
        and ``version`` fields), or names a version that is not a complete folder.
    """
    path = Path(path)
    pointer = path / LATEST_FILE
    if not pointer.exists():
        return path if (path / _STATE_FILE).is_file() else None
    doc = read_json(pointer, "training-state pointer")
    if not isinstance(doc, dict) or doc.get("format") != LATEST_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise InputError(f"training-state pointer {pointer}: field 'format' is {got!r}, expected {LATEST_FORMAT!r}")
    version = doc.get("version")
    if not isinstance(version, str) or not _VERSION.match(version):
        raise InputError(f"training-state pointer {pointer}: field 'version' is {version!r}, expected a folder name "
                         "step<N>-<time ns>-<pid> of this directory")
    folder = path / version
    if not (folder / _STATE_FILE).is_file():
        raise InputError(f"training-state pointer {pointer} names version {version!r}, but {folder / _STATE_FILE} does "
                         "not exist: the committed version was deleted or moved")
    return folder


def _collect(path: Path, keep: str) -> None:
    """Delete what the commit of ``keep`` superseded: versions started before it (the previous
    one, interrupted saves), pointers of interrupted saves not yet renamed, the first layout's
    entries, and the first layout's leftovers next to ``path`` (``.NAME.partial-*``,
    ``.NAME.old-*``). Versions started after ``keep`` stay."""
    started = int(_VERSION.match(keep).group(2))
    for entry in path.iterdir():
        m = _VERSION.match(entry.name)
        if m and entry.name != keep and int(m.group(2)) <= started and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    first = path / _STATE_FILE  # the first layout: its record last, so that it stays loadable meanwhile
    if first.is_file():
        for name in ("model", "optimizer"):
            shutil.rmtree(path / name, ignore_errors=True)
        first.unlink(missing_ok=True)
    for pattern in (f".{path.name}.partial-*", f".{path.name}.old-*"):
        for entry in path.parent.glob(pattern):
            shutil.rmtree(entry, ignore_errors=True)
    for entry in path.glob(f".{LATEST_FILE}.*.tmp"):  # a pointer written by a save killed before its rename
        entry.unlink(missing_ok=True)


def _prepare(path: Path) -> None:
    """Rank 0: ``path`` exists as a directory (created), or InputError."""
    if path.exists() and not path.is_dir():
        raise InputError(f"checkpoint path {path} is a file: save_training_state writes a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the checkpoint directory {path}: {exc.strerror or exc}") from None


def _dcp_cause(exc: BaseException) -> str:
    """The first line of each rank's failure inside DCP's ``CheckpointException`` (or the exception's own)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, pair in sorted(failures.items()):
            inner = pair[0] if isinstance(pair, tuple) and pair else pair
            text = str(inner).strip().splitlines()
            parts.append(f"rank {rank}: {type(inner).__name__}: {text[0][:300] if text else ''}")
        return "; ".join(parts)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _dcp_save(state: dict[str, torch.Tensor], directory: Path, **writer_kw) -> None:
    """Collective ``dcp.save``; DCP's failure (a ``BaseException``) becomes an OSError naming the folder."""
    try:
        dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(directory), **writer_kw))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP gathers every rank's failure
        raise OSError(f"cannot write the training state to {directory}: {_dcp_cause(exc)}") from None


def _mesh_record(mesh: Any) -> dict | None:
    """The training-state record's ``mesh``: None, or mesh dimension -> integer >= 1 with an optional rank
    ``"order"`` (a list of dimension names); numpy integers and an order tuple become JSON's. The one rule for
    what :func:`save_training_state` records and :func:`load_training_state` reads back.

    Raises
    ------
    ValueError
        Naming the entry that breaks it (the callers turn it into an InputError naming the argument or the file).
    """
    if mesh is None:
        return None
    if not isinstance(mesh, Mapping):
        raise ValueError(f"a {type(mesh).__name__}, not an object")
    out: dict[str, Any] = {}
    for k, v in mesh.items():
        if not isinstance(k, str):
            raise ValueError(f"key {k!r} is no mesh dimension name")
        if k == "order":
            if isinstance(v, str) or not isinstance(v, (list, tuple)) or not all(isinstance(d, str) for d in v):
                raise ValueError(f"'order' is {v!r:.80}, not a list of mesh dimension names")
            out[k] = list(v)
        elif isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) < 1:
            raise ValueError(f"{k!r} is {v!r:.80}, not an integer >= 1")
        else:
            out[k] = int(v)
    return out


def save_training_state(path: str | os.PathLike, schedule, optimizer: torch.optim.Optimizer | None = None, *,
                        step: int = 0, mesh: Mapping[str, int] | None = None) -> Path:
    """Write every rank's parameters, buffers and optimizer state as a new version of the directory ``path``.

    Collective: every rank of the job calls it with its own ``schedule`` and ``optimizer``
    (the default process group). See the module docstring for the layout: the new version is
    committed in one atomic step (the ``latest.json`` pointer), then the versions it supersedes are
    deleted; a save killed at any point leaves the last committed version loadable.

    Parameters
    ----------
    path : str or PathLike
        The checkpoint directory (created when missing; a directory of the first layout is
        replaced by the new version once it is committed).
    schedule : FxpipeScheduleRuntime
        This rank's runtime from ``plan.build(rank, ...)``.
    optimizer : torch.optim.Optimizer, optional
        Built over ``schedule.parameters()``; its per-parameter state must be tensors (SGD,
        Adam, AdamW, ...).
    step : int
        Optimizer steps taken so far, >= 0 (stored, returned by :func:`load_training_state`).
    mesh : dict, optional
        The plan's mesh (``plan.mesh``: dimension -> degree, an optional rank ``"order"``), stored for
        the record.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    InputError
        For a schedule fxpipe did not build, an optimizer over other parameters, a negative
        ``step``, a ``mesh`` that is no mapping of dimensions to integers >= 1, or a ``path`` that
        is a file (every rank raises it, before anything is written).
    OSError
        When the files cannot be written (every rank raises it).
    """
    if not dist.is_initialized():
        raise InputError("save_training_state is collective: call torch.distributed.init_process_group first")
    path = Path(path)
    error = None
    try:
        _require_safetensors()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InputError(f"step must be an integer >= 0 (optimizer steps taken), got {step!r}")
        try:
            mesh_doc = _mesh_record(mesh or None)
        except ValueError as exc:
            raise InputError(f"mesh must be None or mesh dimension -> integer >= 1 (plan.mesh), with an optional "
                             f"rank 'order': {exc}") from None
        model_state = _named_state(schedule)
        optim_tensors, hyper, stateful = _optimizer_state(schedule, optimizer) if optimizer is not None else ({}, {}, [])
        if dist.get_rank() == 0:
            _prepare(path)
    except InputError as exc:
        error = exc
    _agree(error)
    version = _version_name(step)
    folder = path / version
    _dcp_save({k: v.detach() for k, v in model_state.items()}, folder / "model", save_distributed=True,
              enable_consolidation=True)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (hyper, stateful, bool(optim_tensors)))
    if any(g[2] for g in gathered):
        _dcp_save({k: v.detach() for k, v in optim_tensors.items()}, folder / "optimizer", save_distributed=True)
    error = None
    if dist.get_rank() == 0:  # the others learn of a failure below instead of waiting in a barrier
        try:
            shutil.rmtree(folder / "model" / "sharded", ignore_errors=True)  # consolidated above it
            doc = {"format": TRAINSTATE_FORMAT, "step": int(step), "mesh": mesh_doc,
                   "world_size": dist.get_world_size(),
                   "param_groups": {k: v for g in gathered for k, v in g[0].items()},
                   "optimizer_state": sorted({f for g in gathered for f in g[1]})}
            write_json_atomic(folder / _STATE_FILE, doc)
            _fsync_dir(folder)
            # the commit: one atomic rename of the pointer file
            write_json_atomic(path / LATEST_FILE, {"format": LATEST_FORMAT, "version": version, "step": int(step)})
            _fsync_dir(path)
            _collect(path, version)
        except OSError as exc:
            error = exc
    _agree(error)
    return path


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state tensors with one step of zero gradients at learning rate 0."""
    saved_grads = []
    saved_lr = []
    for group in optimizer.param_groups:
        saved_lr.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else torch.zeros_like(group["lr"])
        for p in group["params"]:
            saved_grads.append(p.grad)
            p.grad = torch.zeros_like(p)
    optimizer.step()
    k = 0
    for group, lr in zip(optimizer.param_groups, saved_lr):
        if lr is not None:
            group["lr"] = lr
        for p in group["params"]:
            p.grad = saved_grads[k]
            k += 1


# ----------------------------------------------------------------------------- loading: the files checked first
#: numeric optimizer settings with a range (name -> (low, high)); any other number must be finite
_SETTING_RANGES = {"lr": (0.0, 100.0), "momentum": (0.0, 1.0), "dampening": (0.0, 1.0), "betas": (0.0, 1.0),
                   "eps": (0.0, 1.0), "weight_decay": (0.0, 100.0)}


def _check_setting(state_file: Path, where: str, name: str, value: Any) -> None:
    if value is None or isinstance(value, (bool, str)):
        return
    numbers = value if isinstance(value, list) else [value]
    low, high = _SETTING_RANGES.get(name, (-math.inf, math.inf))
    allowed = f"a finite number in [{low:g}, {high:g}]" if name in _SETTING_RANGES else "a finite number"
    for x in numbers:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not low <= x <= high:
            raise InputError(f"training-state file {state_file}: field '{where}.{name}' is {value!r}, allowed: {allowed}"
                             + (" each" if isinstance(value, list) else ""))


def _check_doc(doc: Any, state_file: Path) -> dict:
    """The training-state record's fields, types and ranges (the one check of this file kind)."""
    def bad(field: str, value: Any, allowed: str) -> InputError:
        return InputError(f"training-state file {state_file}: field '{field}' is {value!r:.200}, allowed: {allowed}")

    if not isinstance(doc, dict):
        raise bad("(top level)", type(doc).__name__, "a JSON object")
    if doc.get("format") != TRAINSTATE_FORMAT:
        raise bad("format", doc.get("format"), repr(TRAINSTATE_FORMAT))
    step = doc.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise bad("step", step, "an integer >= 0 (optimizer steps taken)")
    try:
        _mesh_record(doc.get("mesh"))
    except ValueError as exc:
        raise bad("mesh", doc.get("mesh"), f"null or an object of mesh dimension -> integer >= 1, with an optional "
                  f"rank 'order' (here {exc})") from None
    world = doc.get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise bad("world_size", world, "an integer >= 1")
    groups = doc.get("param_groups")
    if not isinstance(groups, dict):
        raise bad("param_groups", groups, "an object of parameter name -> its optimizer settings")
    for fqn, settings in groups.items():
        if not isinstance(settings, dict):
            raise bad(f"param_groups[{fqn!r}]", settings, "an object of setting name -> value")
        for name, value in settings.items():
            _check_setting(state_file, f"param_groups[{fqn!r}]", name, value)
    stateful = doc.get("optimizer_state")
    if not isinstance(stateful, list) or not all(isinstance(f, str) for f in stateful):
        raise bad("optimizer_state", stateful, "a list of parameter names")
    return doc


def _read_state(path: Path) -> tuple[Path, dict]:
    """(the folder holding ``model/`` and ``optimizer/``, the checked record) of a checkpoint directory."""
    folder = latest_state_dir(path)
    if folder is None:
        if path.is_dir() and any(path.glob("*.safetensors")):  # a model directory: its tensors only
            return path, {"format": TRAINSTATE_FORMAT, "step": 0, "param_groups": {}, "optimizer_state": [],
                          "_model_dir": "."}
        started = sorted(p.name for p in path.iterdir() if _VERSION.match(p.name)) if path.is_dir() else []
        raise InputError(
            f"{path} is not a training-state checkpoint (no {LATEST_FILE}, no {_STATE_FILE}) nor a directory of "
            ".safetensors files" + (f"; it holds {len(started)} save(s) that were never committed ({started[0]}, ...)"
                                    if started else "")
            + ": pass a directory written by fxpipe.codegen.checkpoint.save_training_state"
        )
    state_file = folder / _STATE_FILE
    return folder, _check_doc(read_json(state_file, "training-state file"), state_file)


def _stored(directory: Path, what: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Key -> (dtype code, shape) over the safetensors files of ``directory``, every header checked."""
    if not directory.is_dir():
        raise InputError(f"the {what} folder {directory} does not exist: the checkpoint is incomplete (it was "
                         "copied in part or edited); save it again")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InputError(f"the {what} folder {directory} holds no .safetensors file: the checkpoint is incomplete")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        out.update(safetensors_header(f))
    return out


def _check_tensors(state: Mapping[str, torch.Tensor], directory: Path, what: str, full_shapes: bool) -> None:
    """This rank's tensors are in ``directory``'s files (with their shapes and dtype kinds when the
    files hold full tensors), or InputError naming the folder and the keys."""
    stored = _stored(directory, what)
    missing = sorted(k for k in state if k not in stored)
    shapes, dtypes = [], []
    for k, t in state.items():
        if k not in stored:
            continue
        code, shape = stored[k]
        if full_shapes and shape != tuple(t.shape):
            shapes.append(f"{k} stored {shape}, this rank's is {tuple(t.shape)}")
        elif dtype_kind(code) != dtype_kind(t.dtype):
            dtypes.append(f"{k} stored {code}, this rank's is {str(t.dtype).replace('torch.', '')}")
    problems = []
    if missing:
        problems.append(f"lacks {len(missing)} tensor(s) of this rank's stages: {', '.join(missing[:5])}"
                        f"{' ...' if len(missing) > 5 else ''}")
    for kind, rows in (("shape", shapes), ("dtype", dtypes)):
        if rows:
            problems.append(f"holds {len(rows)} tensor(s) with another {kind}: {'; '.join(rows[:5])}")
    if problems:
        raise InputError(f"the {what} in {directory} " + "; it ".join(problems)
                         + ": was it saved from the same model (and optimizer)?")


def _load(state: dict[str, torch.Tensor], directory: Path, what: str) -> None:
    """Collective ``dcp.load``; every failure, DCP's ``CheckpointException`` (a ``BaseException``) too, is an
    InputError naming the folder and each failing rank's cause."""
    try:
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(directory)))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP gathers every rank's failure
        raise InputError(f"cannot load the {what} from {directory}: {_dcp_cause(exc)}") from None


def load_training_state(path: str | os.PathLike, schedule, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Read a checkpoint of :func:`save_training_state` into this rank's stages and optimizer, in place.

    Collective: every rank of the job calls it. The checkpoint may come from another mesh or
    another partition of the same model (each rank reads the slices it holds). A directory of
    ``.safetensors`` files without ``fxpipe_state.json`` (e.g. a Hugging Face model directory)
    loads the model's tensors only. The committed version is read (``latest.json``); a directory of the
    first layout (no ``latest.json``) loads as before.

    Parameters
    ----------
    path : str or PathLike
        The checkpoint directory.
    schedule : FxpipeScheduleRuntime
        This rank's runtime from ``plan.build(rank, ...)``.
    optimizer : torch.optim.Optimizer, optional
        Built over ``schedule.parameters()``, of the type that saved the checkpoint; its state
        and hyper-parameters (learning rate, betas, ...) are restored.

    Returns
    -------
    dict
        The checkpoint's ``fxpipe_state.json`` (``step``, ``mesh``, ...).

    Raises
    ------
    InputError
        For a directory that is no checkpoint (or whose saves were never committed), a record
        whose fields are out of range (``step`` a negative or non-integer, ``lr`` not finite or
        outside [0, 100], ``param_groups`` not an object, ...), a missing ``model/`` or
        ``optimizer/`` folder, an empty, truncated or garbage safetensors file, or a checkpoint
        that lacks a tensor of this rank's stages or holds it with another shape or dtype kind;
        the message names the file or folder and the cause. Every rank raises it.
    """
    if not dist.is_initialized():
        raise InputError("load_training_state is collective: call torch.distributed.init_process_group first")
    path = Path(path)
    error = None
    try:
        _require_safetensors()
        folder, doc = _read_state(path)
        named = _named_state(schedule)
        if optimizer is not None:
            _fqn_of_params(schedule, optimizer)
        model_dir = folder / doc.get("_model_dir", "model")
        _check_tensors(named, model_dir, "model state", full_shapes=True)  # consolidated: full tensors
    except InputError as exc:
        error = exc
    _agree(error)
    _load({k: v.detach() for k, v in named.items()}, model_dir, "model state")
    if optimizer is not None and doc.get("optimizer_state") is not None:
        saved = set(doc["optimizer_state"])
        fqn_of = _fqn_of_params(schedule, optimizer)
        if any(fqn_of[id(p)] in saved for g in optimizer.param_groups for p in g["params"]):
            _init_optimizer_state(optimizer)
        for group in optimizer.param_groups:  # hyper-parameters, from the group's first parameter's record
            rec = next((doc["param_groups"][fqn_of[id(p)]] for p in group["params"]
                        if fqn_of[id(p)] in doc["param_groups"]), None)
            for k, v in (rec or {}).items():  # numbers only: flags (foreach, fused, ...) stay the caller's
                if k in group and _is_number_setting(group[k]) and _is_number_setting(v):
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v
            for p in group["params"]:
                if fqn_of[id(p)] not in saved:
                    optimizer.state.pop(p, None)  # no state when saved: none now
        tensors, _, _ = _optimizer_state(schedule, optimizer)
        flags: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(flags, bool(tensors))
        if any(flags):
            error = None
            try:  # per-rank shards: names and dtypes checked here, shapes by DCP
                if tensors:
                    _check_tensors(tensors, folder / "optimizer", "optimizer state", full_shapes=False)
            except InputError as exc:
                error = exc
            _agree(error)
            _load({k: v.detach() for k, v in tensors.items()}, folder / "optimizer", "optimizer state")
    dist.barrier()
    return {k: v for k, v in doc.items() if not k.startswith("_")}
