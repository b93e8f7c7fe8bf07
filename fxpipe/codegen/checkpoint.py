"""Save and resume the sharded training state of a pipeline x data-parallel job (DCP, safetensors).

Every rank of a job built by ``plan.build(rank, ...)`` holds the parameters of its stages,
wrapped by FSDP2 (``dp_shard``: each rank a shard), ``replicate`` (``dp_replicate``) or neither
(a pure pipeline), and its optimizer's state for them. :func:`save_training_state` writes all
ranks' state into one directory with ``torch.distributed.checkpoint`` (DCP) and its
Hugging Face storage layer, so the files are ``safetensors`` and JSON (never pickle):

``model/``
    The model's parameters and buffers as full tensors, keyed by the fully qualified names in
    the module given to ``fxpipe.compile`` (a wrapper's prefix included, e.g.
    ``model.transformer.h.0.attn.c_attn.weight``), consolidated into
    ``model-00001-of-00001.safetensors`` with a ``model.safetensors.index.json``: the layout
    of a Hugging Face checkpoint, readable by ``safetensors`` and by
    ``plan.build(rank, checkpoint=...)`` (meta-built models); its buffers include
    non-persistent ones (rotary tables, masks), which a ``state_dict`` leaves out.
``optimizer/``
    The optimizer's tensor state (``exp_avg``, ``momentum_buffer``, ``step``, ...), one
    ``safetensors`` file per rank holding its shards, keyed ``<fqn>.<state name>``.
``fxpipe_state.json``
    ``{"format": "fxpipe.trainstate/1", "step": ..., "mesh": ..., "param_groups": {fqn:
    hyper-parameters}, "optimizer_state": [fqns with optimizer state]}``.

Names being the original model's, a checkpoint does not depend on the partition or the mesh it
was saved from: :func:`load_training_state` reads it into any plan of the same model (another
mesh, other stages), DCP reading each rank's shard of each tensor (resharding). The directory
is written under a temporary name and renamed when every rank has finished, so a crash never
leaves a half-written checkpoint under the final name.

Sources: torch ``torch.distributed.checkpoint`` (``save`` / ``load``, ``HuggingFaceStorageWriter``
with ``save_distributed`` and consolidation, ``HuggingFaceStorageReader``); the layout follows
torchtitan's checkpoints (model and optimizer state keyed by fully qualified names, so that a
checkpoint reshards across parallelisms).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fxpipe.errors import InputError
from fxpipe.io import read_json, write_json_atomic

__all__ = ["save_training_state", "load_training_state", "rank_state", "TRAINSTATE_FORMAT"]

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
    in a later collective); the first failing rank's message."""
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else str(error))
    first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if first is not None:
        raise InputError(f"rank {first[0]}: {first[1]}") from error


def _require_safetensors() -> None:
    """DCP's Hugging Face storage writes safetensors (the ``checkpoint`` extra); InputError without it."""
    try:
        import safetensors  # noqa: F401 - only checks that it is installed
    except ImportError as exc:
        raise InputError("training-state checkpoints are safetensors files: pip install 'fxpipe[checkpoint]'") from exc


def _temp_name(path: Path) -> Path:
    token = [f"{time.time_ns()}-{os.getpid()}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return path.parent / f".{path.name}.partial-{token[0]}"


def save_training_state(path: str | os.PathLike, schedule, optimizer: torch.optim.Optimizer | None = None, *,
                        step: int = 0, mesh: Mapping[str, int] | None = None) -> Path:
    """Write every rank's parameters, buffers and optimizer state to the directory ``path``.

    Collective: every rank of the job calls it with its own ``schedule`` and ``optimizer``
    (the default process group). See the module docstring for the layout.

    Parameters
    ----------
    path : str or PathLike
        The checkpoint directory (replaced when it exists).
    schedule : FxpipeScheduleRuntime
        This rank's runtime from ``plan.build(rank, ...)``.
    optimizer : torch.optim.Optimizer, optional
        Built over ``schedule.parameters()``; its per-parameter state must be tensors (SGD,
        Adam, AdamW, ...).
    step : int
        Optimizer steps taken so far (stored, returned by :func:`load_training_state`).
    mesh : dict, optional
        The plan's mesh, stored for the record.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    InputError
        For a schedule fxpipe did not build or an optimizer over other parameters.
    """
    if not dist.is_initialized():
        raise InputError("save_training_state is collective: call torch.distributed.init_process_group first")
    path = Path(path)
    error = None
    try:
        _require_safetensors()
        model_state = _named_state(schedule)
        optim_tensors, hyper, stateful = _optimizer_state(schedule, optimizer) if optimizer is not None else ({}, {}, [])
    except InputError as exc:
        error = exc
    _agree(error)
    tmp = _temp_name(path)
    writer = dcp.HuggingFaceStorageWriter(str(tmp / "model"), save_distributed=True, enable_consolidation=True)
    dcp.save({k: v.detach() for k, v in model_state.items()}, storage_writer=writer)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (hyper, stateful, bool(optim_tensors)))
    if any(g[2] for g in gathered):
        dcp.save({k: v.detach() for k, v in optim_tensors.items()},
                 storage_writer=dcp.HuggingFaceStorageWriter(str(tmp / "optimizer"), save_distributed=True))
    error = None
    if dist.get_rank() == 0:  # the others learn of a failure below instead of waiting in a barrier
        try:
            shutil.rmtree(tmp / "model" / "sharded", ignore_errors=True)  # consolidated above it
            doc = {"format": TRAINSTATE_FORMAT, "step": int(step), "mesh": dict(mesh) if mesh else None,
                   "world_size": dist.get_world_size(),
                   "param_groups": {k: v for g in gathered for k, v in g[0].items()},
                   "optimizer_state": sorted({f for g in gathered for f in g[1]})}
            write_json_atomic(tmp / _STATE_FILE, doc)
            old = None
            if path.exists():
                old = path.parent / f".{path.name}.old-{tmp.name.rsplit('-', 2)[-2]}"
                os.replace(path, old)
            os.replace(tmp, path)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            error = exc
    _agree(error)
    return path


def _read_doc(path: Path) -> dict:
    state_file = path / _STATE_FILE
    if not state_file.is_file():
        if path.is_dir() and any(path.glob("*.safetensors")):
            return {"format": TRAINSTATE_FORMAT, "step": 0, "param_groups": {}, "optimizer_state": [], "_model_dir": "."}
        raise InputError(
            f"{path} is not a training-state checkpoint (no {_STATE_FILE}) nor a directory of .safetensors files: "
            "pass a directory written by fxpipe.codegen.checkpoint.save_training_state"
        )
    doc = read_json(state_file, "training-state file")
    if doc.get("format") != TRAINSTATE_FORMAT:
        raise InputError(f"{state_file} has format {doc.get('format')!r}, expected {TRAINSTATE_FORMAT!r}")
    return doc


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


def _load(state: dict[str, torch.Tensor], directory: Path, what: str) -> None:
    try:
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(directory)))
    except Exception as e:  # noqa: BLE001 - DCP wraps every rank's failure in CheckpointException
        msg = str(e)
        missing = [k for k in state if k in msg][:3]
        hint = f" (e.g. {', '.join(missing)})" if missing else ""
        raise InputError(
            f"cannot load the {what} from {directory}{hint}: the checkpoint does not hold every tensor of this rank's "
            f"stages with these shapes; was it saved from the same model? ({type(e).__name__}: {msg.splitlines()[0][:300]})"
        ) from e


def load_training_state(path: str | os.PathLike, schedule, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Read a checkpoint of :func:`save_training_state` into this rank's stages and optimizer, in place.

    Collective: every rank of the job calls it. The checkpoint may come from another mesh or
    another partition of the same model (each rank reads the slices it holds). A directory of
    ``.safetensors`` files without ``fxpipe_state.json`` (e.g. a Hugging Face model directory)
    loads the model's tensors only.

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
        For a directory that is no checkpoint, or a checkpoint that lacks a tensor of this
        rank's stages or holds it with another shape.
    """
    if not dist.is_initialized():
        raise InputError("load_training_state is collective: call torch.distributed.init_process_group first")
    path = Path(path)
    error = None
    try:
        _require_safetensors()
        doc = _read_doc(path)
        named = _named_state(schedule)
        if optimizer is not None:
            _fqn_of_params(schedule, optimizer)
    except InputError as exc:
        error = exc
    _agree(error)
    model_dir = path / doc.get("_model_dir", "model")
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
            _load({k: v.detach() for k, v in tensors.items()}, path / "optimizer", "optimizer state")
    dist.barrier()
    return {k: v for k, v in doc.items() if not k.startswith("_")}
