"""The plan file: ``Plan.to_dict`` / ``Plan.from_dict`` documents (``fxpipe.plan/2``, reads ``/1``).

Compatibility rule (``docs/design.md``, "The plan"): ``fxpipe.plan/2`` keeps every field of
``fxpipe.plan/1`` with its name and meaning and only adds fields (``fxpipe_version``,
``memory_model``, ``rank_order``, ``activation_checkpointing``, and ``tensor_parallel`` in a plan
with ``mesh["tp"] > 1``), so a reader of ``/1`` files reads ``/2`` files once it accepts the new
format string. A ``/2`` file always has the complete layout (``mesh``, ``device_of_stage``, the
device table, the memory model, the stages' ``device``); the ``/1`` files of older layouts may lack
them and are filled in on load (:func:`plan_fields_from_dict`): a pure-pipeline mesh (no ``tp``: 1),
the default rank order (pipeline rank innermost, :data:`fxpipe.mesh.MESH_DIMS`), one stage per
device, the activation checkpoint policies (``"stage"`` for a recomputing stage, ``"none"`` elsewhere),
and the stage / device tables recomputed from the graph, partition and schedule. A plan saved
under an older version of the memory model (``memory_model`` missing or below
:data:`MEMORY_MODEL_VERSION`) keeps its saved tables, which that model counted more
conservatively (one receive buffer per micro-batch for every relayed tensor), with a
:class:`~fxpipe.errors.PlanWarning`: its tables cannot be recomputed from its schedule problem.

Nothing here imports :mod:`fxpipe.plan`: the functions take the plan (or its fields) as
arguments, and ``Plan.from_dict`` constructs the plan.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any, Mapping

import numpy as np

from fxpipe import __version__
from fxpipe.errors import InputError, PlanWarning
from fxpipe.ir import OpGraph, Schedule, ScheduleProblem
from fxpipe.memory import MemoryModel
from fxpipe.memory.checkpoint import CheckpointPolicy, policies_match
from fxpipe.mesh import MESH_DIMS, mesh_degrees, normalize_mesh, normalize_rank_order, pure_pipeline
from fxpipe.mesh.tensor_parallel import check_tensor_parallel
from fxpipe.partition.objective import Partition, validate_partition
from fxpipe.partition.placement import placement_name
from fxpipe.plan.tables import DeviceStats, StageStats, device_stats, stage_stats
from fxpipe.schedule.validate import check_schedule

__all__ = ["MEMORY_MODEL_VERSION", "PLAN_FORMAT", "PLAN_FORMATS_READ", "graph_signature", "plan_to_dict", "plan_fields_from_dict"]

#: The format :meth:`fxpipe.plan.Plan.to_dict` writes.
PLAN_FORMAT = "fxpipe.plan/2"

#: Version of the memory model a plan's tables and schedule problem were counted with: 2 counts
#: the receive buffers as fxpipe's runtime holds them (pooled activation buffers carried by each
#: micro-batch's stash, ``ScheduleProblem.pooled_bytes``; gradient buffers only for tensors that
#: carry a gradient); plans without the field were counted by version 1 (one buffer per
#: micro-batch for every relayed tensor, each way).
MEMORY_MODEL_VERSION = 2
#: The formats :meth:`fxpipe.plan.Plan.from_dict` reads (``/1``: every layout fxpipe has written).
PLAN_FORMATS_READ = ("fxpipe.plan/1", PLAN_FORMAT)


def graph_signature(graph: OpGraph) -> str:
    """A short hash of the graph's structure; costs are not included.

    For a graph exported by :func:`fxpipe.passes.to_opgraph.to_opgraph` (every node has a
    structural key, ``extra[i]["skey"]``): :func:`fxpipe.passes.structure.structure_signature`,
    independent of node names, of the order of independent nodes (``PYTHONHASHSEED``) and of ops
    that do no work (a ``contiguous`` a meta trace adds). Otherwise (plans saved before the keys,
    hand-made graphs) a hash of the names, kinds and edges.
    """
    from fxpipe.passes.structure import SKEY, graph_preds, structure_signature  # lazy: torch

    ext = graph.extra or ()
    if len(ext) == graph.n and all(SKEY in e for e in ext):
        return structure_signature([str(e[SKEY]) for e in ext], graph_preds(graph))
    h = hashlib.sha256()
    h.update("\x00".join(graph.names).encode())
    h.update("\x00".join(graph.ops).encode())
    h.update(np.ascontiguousarray(graph.edges, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def plan_to_dict(plan) -> dict[str, Any]:
    """The ``fxpipe.plan/2`` document of ``plan`` (every ``/1`` field, plus ``fxpipe_version``)."""
    extra: dict[str, Any] = {}
    if plan.tp > 1:  # what tensor parallelism splits (fxpipe.mesh.tensor_parallel), checked on load
        extra["tensor_parallel"] = plan.tensor_parallel.to_dict()
    return {
        "format": PLAN_FORMAT,
        "fxpipe_version": __version__,
        "memory_model": MEMORY_MODEL_VERSION,
        "name": plan.name,
        "devices": plan.devices,
        "mesh": dict(plan.mesh),
        "rank_order": list(plan.rank_order),
        "activation_checkpointing": [p.to_dict() for p in plan.activation_checkpointing],
        "dp_sync_s": plan.dp_sync_s,
        "num_stages": plan.num_stages,
        "stages_per_device": plan.stages_per_device,
        "placement": plan.placement,
        "device_of_stage": list(plan.device_of_stage),
        "microbatches": plan.microbatches,
        "hardware": plan.hardware,
        "objective": plan.objective,
        "comm": plan.comm,
        "graph_signature": plan.graph_signature,
        "options": plan.options,
        "bottleneck_s": plan.bottleneck_s,
        "makespan_s": plan.makespan_s,
        "bubble_ratio": plan.bubble_ratio,
        "optimality": plan.optimality(),
        "timings_s": plan.timings_s,
        "stages": [s.to_dict() for s in plan.stages],
        "device_table": [d.to_dict() for d in plan.device_table],
        "memory": plan.memory.to_dict(),
        "stage_of": plan.stage_of,
        "partition": plan.partition.to_dict(),
        "problem": plan.problem.to_dict(),
        "schedule": plan.schedule.to_dict(),
        "graph": plan.graph.to_dict(),
        **extra,
    }


def _mesh_from_doc(doc: Mapping[str, Any], source: str) -> dict:
    """The plan's mesh (a pure pipeline for files saved before meshes)."""
    if doc.get("mesh") is None:
        return pure_pipeline(int(doc["devices"]))
    try:
        mesh = normalize_mesh(doc["mesh"])
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None
    if mesh["pp"] != int(doc["devices"]):
        raise InputError(f"{source}: mesh {mesh} disagrees with the plan's {doc['devices']} pipeline devices (pp)")
    return mesh_degrees(mesh)


def _rank_order_from_doc(doc: Mapping[str, Any], source: str) -> tuple:
    """The plan's rank order (the default, pipeline rank innermost, for files saved without one)."""
    if doc.get("rank_order") is None:
        return MESH_DIMS
    try:
        return normalize_rank_order(doc["rank_order"])
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None


def _parse(doc: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The plan's fields from the document, each part validated on its own (older layouts filled in)."""
    graph = OpGraph.from_dict(doc["graph"], source=f"{source}: graph")
    p = doc["partition"]
    partition = Partition(
        k=int(p["k"]), assignment=np.asarray(p["assignment"], dtype=np.int64),
        block_costs=np.asarray(p["block_costs"], dtype=np.float64), bottleneck=float(p["bottleneck"]),
        objective=str(p["objective"]), comm=str(p["comm"]), meta=dict(p.get("meta", {})),
    )
    return dict(
        name=doc["name"],
        devices=int(doc["devices"]),
        microbatches=int(doc["microbatches"]),
        hardware=doc["hardware"],
        objective=doc["objective"],
        comm=doc["comm"],
        graph=graph,
        partition=partition,
        stage_of={str(k): int(v) for k, v in doc["stage_of"].items()},
        problem=ScheduleProblem.from_dict(doc["problem"], source=f"{source}: problem"),
        schedule=Schedule.from_dict(doc["schedule"], source=f"{source}: schedule"),
        stages=[StageStats(**{"device": s["stage"], **s}) for s in doc["stages"]],  # /1 before placements: no device
        device_table=[DeviceStats(**d) for d in doc.get("device_table", [])],  # /1 before the device table: none
        timings_s=dict(doc.get("timings_s", {})),
        graph_signature=str(doc.get("graph_signature", "")),
        options=dict(doc.get("options", {})),
        memory=MemoryModel.from_dict(doc["memory"]) if "memory" in doc else MemoryModel(),
        mesh=_mesh_from_doc(doc, source),  # /1 before meshes: a pure pipeline
        rank_order=_rank_order_from_doc(doc, source),  # before rank orders: pipeline rank innermost
        activation_checkpointing=_policies_from_doc(doc, source),  # before issue 28: derived from the problem
    )


def _policies_from_doc(doc: Mapping[str, Any], source: str) -> tuple:
    """The plan's per-stage checkpoint policies (empty for files saved before them: the plan derives them,
    ``"stage"`` for the problem's recomputing stages and ``"none"`` for the others)."""
    raw = doc.get("activation_checkpointing")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise InputError(f"{source}: activation_checkpointing must be a list with one policy per stage")
    return tuple(CheckpointPolicy.from_dict(p, source=f"{source}: activation_checkpointing[{i}]")
                 for i, p in enumerate(raw))


def _check_parts(f: Mapping[str, Any], source: str) -> None:
    """The graph, partition, stage map, placement and schedule agree with each other (InputError otherwise)."""
    graph, partition, problem = f["graph"], f["partition"], f["problem"]
    if f["graph_signature"] != graph_signature(graph):
        raise InputError(f"{source}: the graph signature does not match the graph: the file was edited or corrupted")
    if not partition.k == problem.num_stages == len(f["stages"]):
        raise InputError(
            f"{source}: partition blocks ({partition.k}), schedule stages ({problem.num_stages}) and "
            f"stage table ({len(f['stages'])}) disagree"
        )
    if f["devices"] != problem.num_devices or partition.k % f["devices"]:
        raise InputError(
            f"{source}: devices ({f['devices']}) disagree with the schedule problem's placement "
            f"({problem.num_devices} devices for {problem.num_stages} stages)"
        )
    try:
        validate_partition(graph, partition, rtol=1e-6)
    except AssertionError as exc:
        raise InputError(f"{source}: the partition is invalid: {exc}") from None
    expected = {graph.names[i]: int(partition.assignment[i]) for i in range(graph.n)}
    if f["stage_of"] != expected:
        raise InputError(f"{source}: stage_of disagrees with the partition's assignment")
    policies = f.get("activation_checkpointing") or ()
    if policies and not policies_match(policies, problem):
        raise InputError(f"{source}: activation_checkpointing disagrees with the schedule problem's checkpoint options "
                         f"{list(problem.checkpoint)} (one policy per stage, of the kind and replay time of its option): "
                         "the file was edited or corrupted; regenerate it with fxpipe.compile")
    violations = check_schedule(problem, f["schedule"].ops)
    if violations:
        raise InputError(f"{source}: the schedule breaks Contract 3: {violations[0]} ({len(violations)} violations)")


def _derived_fields(f: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """Plan fields a file states that its other parts determine: name -> (the value those parts give, what gives it)."""
    problem, k = f["problem"], f["partition"].k
    return {
        "microbatches": (problem.num_microbatches, "the schedule problem's micro-batches per replica"),
        "num_stages": (k, "the partition's blocks"),
        "stages_per_device": (k // f["devices"], "the partition's blocks / devices"),
        "placement": (placement_name(problem.device_of_stage, f["devices"]), "the schedule problem's device_of_stage"),
        "makespan_s": (float(f["schedule"].makespan), "the schedule"),
        "objective": (f["partition"].objective, "the partition's objective"),
        "comm": (f["partition"].comm, "the partition's comm"),
    }


def _check_fields(doc: Mapping[str, Any], f: Mapping[str, Any], source: str) -> None:
    """The plan's scalar fields: types and ranges, and the fields the graph, partition, problem and
    schedule determine equal to what they give (an edit of ``microbatches`` is named here, not at build)."""
    for key in ("name", "hardware"):
        if not isinstance(doc.get(key), str):
            raise InputError(f"{source}: field {key!r} is {doc.get(key)!r:.80}, allowed: a string")
    for key in ("devices", "microbatches"):
        v = doc.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{source}: field {key!r} is {v!r:.80}, allowed: an integer >= 1")
    if doc["objective"] not in ("training", "inference"):
        raise InputError(f"{source}: field 'objective' is {doc['objective']!r:.80}, allowed: 'training' or 'inference'")
    if doc["comm"] not in ("relay", "dag"):
        raise InputError(f"{source}: field 'comm' is {doc['comm']!r:.80}, allowed: 'relay' or 'dag'")
    for key, (want, why) in _derived_fields(f).items():
        if key not in doc:
            continue
        got = doc[key]
        same = (isinstance(got, (int, float)) and not isinstance(got, bool) and np.isclose(float(got), want, rtol=1e-9,
                                                                                            atol=0.0)) \
            if isinstance(want, float) else got == want
        if not same:
            raise InputError(f"{source}: field {key!r} is {got!r:.80}, but {why} give {want!r}; allowed: {want!r}. The "
                             "file was edited: regenerate the plan with fxpipe.compile (e.g. with other microbatches=)")


def _check_table(kind: str, got_rows, want_rows, source: str) -> None:
    """Every column of the saved ``kind`` table equals its recomputation (InputError naming the first that does not)."""
    for got_row, want_row in zip(got_rows, want_rows):
        got, want = got_row.to_dict(), want_row.to_dict()
        for key, val in want.items():
            mine = got[key]
            if isinstance(val, (list, bool)) or val is None or mine is None:
                same = mine == val
            else:
                same = np.isclose(float(mine), float(val), rtol=1e-9, atol=0.0)
            if not same:
                raise InputError(
                    f"{source}: {kind} {want[kind]} {key} is {mine!r} but the plan's graph, partition and schedule give "
                    f"{val!r}: the {kind} table was edited or the file is corrupted; regenerate it with fxpipe.compile"
                )


def plan_fields_from_dict(doc: Mapping[str, Any], source: str = "plan") -> dict[str, Any]:
    """The constructor arguments of the plan of a ``fxpipe.plan/1`` or ``/2`` document, every part re-validated.

    Tables missing from older ``/1`` layouts are recomputed; the saved tables must equal their
    recomputation from the graph, partition, schedule problem, schedule and memory model.

    Raises
    ------
    InputError
        If the document is not a plan, is malformed, or its parts are inconsistent (the message
        names the file and the part or field: an edited ``microbatches``, ``num_stages``,
        ``placement``, ... disagrees with what the saved problem and schedule give; regenerate
        the plan with :func:`fxpipe.compile`).
    """
    if not isinstance(doc, Mapping) or doc.get("format") not in PLAN_FORMATS_READ:
        raise InputError(f"{source}: not an {PLAN_FORMAT} (or {PLAN_FORMATS_READ[0]}) document")
    try:
        f = _parse(doc, source)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InputError(f"{source}: malformed plan ({exc!r}); regenerate it with fxpipe.compile") from None
    if "device_of_stage" in doc and list(doc["device_of_stage"]) != list(f["problem"].device_of_stage):
        raise InputError(f"{source}: device_of_stage disagrees with the schedule problem's placement")
    _check_parts(f, source)
    _check_fields(doc, f, source)
    parts = (f["graph"], f["partition"], f["problem"], f["schedule"], f["objective"], f["memory"])
    want_stages, want_devices = stage_stats(*parts), device_stats(*parts)
    if not f["device_table"]:  # /1 before the device table: recompute it
        f["device_table"] = want_devices
    if "memory" not in doc:  # /1 before the memory model: recompute the memory columns
        f["stages"], f["device_table"] = want_stages, want_devices
    if len(f["device_table"]) != len(want_devices):
        raise InputError(f"{source}: the device table has {len(f['device_table'])} rows for {f['devices']} devices")
    if "memory" in doc and int(doc.get("memory_model", 1)) < MEMORY_MODEL_VERSION:
        warnings.warn(
            f"{source}: saved by fxpipe {doc.get('fxpipe_version', 'before 0.2')} under memory model "
            f"{int(doc.get('memory_model', 1))}, which counted one receive buffer per micro-batch for every relayed "
            f"tensor: its memory tables are kept as saved (conservative) and not checked; regenerate the plan with "
            f"fxpipe.compile to count the buffers as the runtime holds them (model {MEMORY_MODEL_VERSION})",
            PlanWarning, stacklevel=3)
        return f
    _check_table("stage", f["stages"], want_stages, source)
    _check_table("device", f["device_table"], want_devices, source)
    _check_tensor_parallel(doc, f, source)
    return f


def _check_tensor_parallel(doc: Mapping[str, Any], f: Mapping[str, Any], source: str) -> None:
    """A plan with ``tp > 1`` splits what its graph's record resolves to at that degree (InputError otherwise)."""
    tp = int(f["mesh"].get("tp", 1))
    if tp == 1:
        if doc.get("tensor_parallel") is not None:
            raise InputError(f"{source}: tensor_parallel is given but the mesh has no tp: the file was edited")
        return
    try:
        layout = check_tensor_parallel(f["graph"], tp, what=f"{source}: mesh")
    except InputError as exc:
        raise InputError(f"{exc}: the plan's graph does not support its own tensor parallelism (edited file?)") from None
    saved = doc.get("tensor_parallel")
    if saved is not None and saved != layout.to_dict():
        raise InputError(f"{source}: tensor_parallel differs from what the plan's graph gives at tp={tp}: the file was "
                         "edited or corrupted; regenerate it with fxpipe.compile")
