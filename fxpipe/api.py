"""The public entry point: ``fxpipe.compile(model, ...) -> Plan``.

The pass runs the whole data flow of DESIGN.md once:

1. capture with ``torch.export`` and cost every op (:mod:`fxpipe.passes`, :mod:`fxpipe.cost`);
2. partition the op DAG into ``v * devices`` acyclic pipeline stages minimising the bottleneck
   stage (:func:`fxpipe.partition.search.partition`, SliceGraph + BRKGA, Archer et al. 2024)
   and place them on the devices: one stage per device (v = 1), looped (stage s on device
   s mod p) or V-shaped (stages s and 2p-1-s on device s), or the best of these by predicted
   step time (``placement="auto"``), the per-device cost of :mod:`fxpipe.partition.placement`;
3. build the scheduling problem (per stage, with the placement) and schedule F / B / W for
   every micro-batch with a generator valid for the placement (:mod:`fxpipe.schedule`);
4. keep everything needed to emit the ``torch.distributed.pipelining`` program
   (:meth:`Plan.build`) and to train it on local ranks (:meth:`Plan.train_local`).

Steps 2 and 3 are :func:`plan_graph` (:mod:`fxpipe.planner`, torch-free); both functions take
the planning options of :class:`fxpipe.options.PlanOptions` as keywords. The
:class:`~fxpipe.plan.Plan` it returns lives in :mod:`fxpipe.plan`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Mapping, Sequence

from fxpipe.errors import FxpipeWarning, InfeasibleError, InputError, PlanWarning
from fxpipe.memory import MemoryModel
from fxpipe.mesh import format_mesh, mesh_memory, mesh_tp, microbatches_per_replica, normalize_mesh, pipeline_graph
from fxpipe.mesh.limits import mesh_runtime_limit, record_runtime_limits, runtime_limits
from fxpipe.mesh.search import block_units_allowed, search_mesh
from fxpipe.mesh.tensor_parallel import check_tensor_parallel, tensor_parallel_options
from fxpipe.options import (  # noqa: F401 (public re-exports)
    AUTO_MILP_MIN_SHARE,
    AUTO_STAGES_PER_DEVICE,
    DEFAULT_AUTO_MILP_TIME_LIMIT_S,
    DEFAULT_MILP_TIME_LIMIT_S,
    DEFAULTS,
    PLACEMENTS,
    SCHEDULES,
    PlanOptions,
    check_count,
)
from fxpipe.plan import PLAN_FORMAT, CaptureCell, DeviceStats, Plan, StageStats, graph_signature, load_plan  # noqa: F401
from fxpipe.plan.tables import device_stats, stage_stats  # noqa: F401 (public re-exports)
from fxpipe.planner import auto_milp_budget_s, fill_empty_stages, plan_graph, plan_with_options, resolve_memory  # noqa: F401
from fxpipe.progress import Search, phase
from fxpipe.schedule.dispatch import default_method


def check_call_inputs(args: Any, kwargs: Any) -> tuple[tuple, dict]:
    """Validate example inputs given as ``(args, kwargs)``; returns them as ``(tuple, dict)``.

    ``args`` must be a tuple (or list) of the model's positional inputs and ``kwargs`` a mapping
    of its keyword inputs (or None). A bare tensor as ``args`` would otherwise be iterated
    along its first dimension into several positional inputs (and fail in the capture with an
    error about the model's signature).

    Raises
    ------
    InputError
        ``args`` not a tuple / list (the message says how to wrap it), ``kwargs`` not a mapping
        with string keys.
    """
    if not isinstance(args, (tuple, list)):
        kind = type(args).__module__ + "." + type(args).__qualname__ if type(args).__module__ != "builtins" \
            else type(args).__name__
        if hasattr(args, "shape") and hasattr(args, "dtype"):  # a tensor (torch is not imported here)
            hint = f"wrap it: args=(x,) for one tensor of shape {tuple(args.shape)}"
        elif isinstance(args, Mapping):
            hint = "pass keyword inputs as kwargs={...} (args=() or the positional inputs as a tuple)"
        else:
            hint = "wrap a single input: args=(x,)"
        raise InputError(f"args must be a tuple of the model's positional inputs, got a {kind}: {hint}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise InputError(
            f"kwargs must be a dict of the model's keyword inputs (name -> value), got a {type(kwargs).__name__}: "
            "pass positional inputs as args=(...)"
        )
    bad = [k for k in kwargs if not isinstance(k, str)]
    if bad:
        raise InputError(f"kwargs keys must be argument names (str), got {bad[:3]!r}")
    return tuple(args), dict(kwargs)


def _searches(mesh: Any, memory: Any) -> bool:
    """Whether the mesh request is resolved by the joint search (:func:`fxpipe.mesh.search.search_mesh`):
    ``"search"``, and ``"auto"`` unless ``memory`` already names a data-parallel degree (the user's own data
    parallelism around the pipeline: ``devices`` are then the pipeline ranks, as before meshes)."""
    if not isinstance(mesh, str):
        return False
    if mesh == "auto":
        return not (isinstance(memory, MemoryModel) and memory.data_parallel != 1)
    return mesh == "search"


def _check_mesh(mesh: Any, devices: int, microbatches: int, memory: Any) -> None:
    """Bad mesh requests fail before the capture: degrees that do not multiply to ``devices``, replicas that
    do not divide ``microbatches``, a ZeRO degree of ``memory`` the mesh contradicts (:mod:`fxpipe.mesh`)."""
    if isinstance(mesh, str) and mesh == "search":  # fxpipe.mesh.search: chosen after the capture
        if isinstance(memory, MemoryModel) and memory.data_parallel != 1:
            raise InputError("mesh='search' sets the data-parallel degree of the memory model: leave data_parallel at 1 "
                             "(or pin the mesh, e.g. mesh={'pp': 2, 'dp_shard': 2})")
        return
    if isinstance(memory, MemoryModel) and memory.fsdp_units == "block" and memory.offload_optimizer is True:
        raise InputError("memory: fsdp_units='block' (per-block FSDP2 units) does not run with offload_optimizer=True "
                         "yet: use fsdp_units='stage' to keep the optimizer on the host")
    if _searches(mesh, memory):
        return
    degrees = normalize_mesh(mesh, devices)  # "pipeline", and "auto" not searched: the pure pipeline
    microbatches_per_replica(microbatches, degrees)
    if isinstance(memory, MemoryModel):
        mesh_memory(memory, degrees)


def _capture(model, args: tuple, kwargs: dict, *, costs: str, hardware, dtype, name, cost_db, profile_threads,
             replicate: str, progress: bool):
    """Capture ``model`` with ``torch.export`` and cost every op (``costs="measured"``: time them on this
    machine first; ``hardware`` None: the default of ``costs``). Returns the
    :class:`~fxpipe.passes.to_opgraph.TracedModel`, the hardware's name and the extra phase timings."""
    from fxpipe.codegen.devicecheck import warn_meta_kernel_gaps  # lazy: torch
    from fxpipe.codegen.mesh import block_units_limit, data_parallel_limit  # lazy: torch

    if costs not in ("roofline", "measured"):
        raise InputError(f"costs must be 'roofline' or 'measured', got {costs!r}")
    if hardware is None:
        hardware = "measured" if costs == "measured" else "h100-sxm"
    timings: dict[str, float] = {}
    if costs == "measured":
        from fxpipe.cost.profile import trace_measured  # lazy: torch

        with phase("capture with torch.export and time every op on this machine", on=progress):
            traced, report = trace_measured(model, args, kwargs, hardware=hardware, dtype=dtype, name=name, db=cost_db,
                                            threads=profile_threads, progress=progress)
        timings["profile"] = report.wall_s
    else:
        from fxpipe.passes import trace_model  # lazy: torch

        with phase("capture with torch.export and cost every op", on=progress):
            traced = trace_model(model, args, kwargs, hardware=hardware, dtype=dtype, name=name, replicate=replicate)
    # a capture on meta may have taken a device branch's non-CPU path (issue 17): say so now, not on a rank
    warn_meta_kernel_gaps(traced.gm, stacklevel=4)  # the caller of fxpipe.compile
    # what the runtime cannot run for this model, for the mesh search (fxpipe.mesh.limits)
    record_runtime_limits(traced.graph, data_parallel=data_parallel_limit(traced.gm),
                          fsdp_blocks=block_units_limit(traced.gm))
    return traced, getattr(hardware, "name", None) or str(hardware), timings


@contextlib.contextmanager
def recording_warnings():
    """Collect the messages of fxpipe's own warnings (:class:`~fxpipe.errors.FxpipeWarning`) raised inside.

    Yields a list that holds them, each once, when the block ends. fxpipe's warnings are recorded
    even where the caller's filters hide them (``fxpipe plan`` hides them on stderr and prints them
    with the plan instead), then warned again at their own file and line through those filters;
    other warnings, which passed the filters already, are shown as they would have been.
    """
    said: list[str] = []
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always", FxpipeWarning)
            try:
                yield said
            finally:
                caught = list(rec)
    finally:  # also when the block raised: nothing warned is lost
        for w in caught:
            if not issubclass(w.category, FxpipeWarning):
                warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
                continue
            if str(w.message) not in said:
                said.append(str(w.message))
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _check_block_units(graph, degrees) -> None:
    """Refuse per-block FSDP2 units where they do not run (several parameter dtypes)."""
    why = runtime_limits(graph).get("fsdp_blocks")
    if why:
        raise InputError(f"mesh {format_mesh(degrees)}: memory fsdp_units='block': {why}; use fsdp_units='stage'")


def _block_units_instead(graph, degrees, memory: MemoryModel, options: PlanOptions) -> PlanOptions | None:
    """The options to plan a pinned mesh with per-block FSDP2 units when whole-stage units do not fit, or None
    (the user chose the units, no ``dp_shard > 1``, the optimizer pinned to the host, or they cannot run here)."""
    if memory.offload_optimizer is True or not block_units_allowed(graph, memory, degrees, options.objective,
                                                                   runtime_limits(graph)):
        return None
    return dataclasses.replace(options, host_bandwidth_bytes_per_s=None)


def _plan_mesh(graph, mesh: Any, devices: int, microbatches: int, memory: MemoryModel, options: PlanOptions):
    """Plan the pipeline of ``mesh`` (``"auto"`` and ``"search"``: of the best mesh,
    :func:`fxpipe.mesh.search.search_mesh`; ``"auto"`` with a memory model that already shards over
    ``data_parallel > 1``: the pure pipeline over ``devices``).

    Returns ``(mesh_degrees, memory_model, (partition, problem, schedule, timings), mesh_table or None)``.
    """
    if _searches(mesh, memory):
        return search_mesh(graph, devices=devices, microbatches=microbatches, memory=memory, options=options)
    degrees = normalize_mesh(mesh, devices)
    model = mesh_memory(memory, degrees)
    why = mesh_runtime_limit(degrees, bool(model.offload_optimizer), runtime_limits(graph))
    if why is not None:  # a pinned mesh the runtime cannot run for this model: say so now, not on every rank
        raise InputError(f"mesh {format_mesh(degrees)}: {why}; plan with mesh='pipeline' or mesh='auto'")
    if model.block_units:  # per-block FSDP2 units (fxpipe.codegen.fsdp_blocks): what they run with
        _check_block_units(graph, degrees)
        options = dataclasses.replace(options, host_bandwidth_bytes_per_s=None)  # no activation offload yet
    tp = mesh_tp(degrees)
    if tp > 1:  # tensor parallelism (fxpipe.mesh.tensor_parallel): refuse what it cannot split or run
        check_tensor_parallel(graph, tp)
        options = tensor_parallel_options(options)
    # one tensor-parallel rank's costs and memory (fxpipe.mesh.tensor_parallel.tensor_parallel_graph)
    plan_args = dict(devices=degrees["pp"], microbatches=microbatches_per_replica(microbatches, degrees))
    try:
        planned = plan_with_options(pipeline_graph(graph, degrees), options=options, memory=model,
                                    memory_bytes=model.capacity_bytes, **plan_args)  # resolved already
    except InfeasibleError:
        blocks = _block_units_instead(graph, degrees, memory, options)
        if blocks is None:
            raise
        model = mesh_memory(dataclasses.replace(memory, fsdp_units="block"), degrees)
        planned = plan_with_options(pipeline_graph(graph, degrees), options=blocks, memory=model,
                                    memory_bytes=model.capacity_bytes, **plan_args)
    return degrees, model, planned, None


def _make_plan(traced, hardware_name: str, microbatches: int, options: PlanOptions, planned, recorded: dict[str, Any],
               timings: dict[str, float]) -> Plan:
    """The :class:`Plan` of ``_plan_mesh``'s result ``planned`` for the capture ``traced`` (``microbatches``:
    the global number); ``recorded``: the compile options kept in ``plan.options`` besides the seed, the
    time limit, the resolved schedule and the mesh search."""
    mesh_degrees, model, (part, problem, sched, plan_timings), mesh_table = planned
    graph, pp = pipeline_graph(traced.graph, mesh_degrees), mesh_degrees["pp"]  # the link its pipelines span
    resolved = options.schedule if options.schedule is not None else default_method(problem.device_of_stage, pp)
    tables = (graph, part, problem, sched, options.objective, model)
    return Plan(
        name=graph.name, devices=pp, microbatches=microbatches_per_replica(microbatches, mesh_degrees),
        mesh=mesh_degrees, hardware=hardware_name, objective=options.objective, comm="relay", graph=graph,
        partition=part, stage_of={graph.names[i]: int(part.assignment[i]) for i in range(graph.n)}, problem=problem,
        schedule=sched, stages=stage_stats(*tables), device_table=device_stats(*tables), memory=model,
        timings_s={"capture": traced.capture_s, "cost": traced.cost_s, "export": traced.export_s, **timings,
                   **plan_timings},
        graph_signature=graph_signature(graph),
        options={"seed": options.seed, "time_limit_s": options.time_limit_s, "schedule": resolved, **recorded,
                 "mesh": recorded["mesh"] if isinstance(recorded["mesh"], str) else dict(mesh_degrees),
                 **({"mesh_search": mesh_table} if mesh_table is not None else {})},
        capture=CaptureCell(traced),
    )


def compile(  # noqa: A001 - the public name mirrors torch.compile
    model, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *, devices: int = 4,
    microbatches: int = 8, hardware=None, costs: str = "roofline", cost_db=None, profile_threads: int | None = None,
    objective: str = DEFAULTS.objective, schedule: str | None = DEFAULTS.schedule,
    stages_per_device: int | str = DEFAULTS.stages_per_device, placement: str = DEFAULTS.placement, dtype=None,
    time_limit_s: float = DEFAULTS.time_limit_s, schedule_time_limit_s: float | None = DEFAULTS.schedule_time_limit_s,
    seed: int = DEFAULTS.seed, mem_limit_bytes: float | None = DEFAULTS.mem_limit_bytes, name: str | None = None,
    progress: bool = DEFAULTS.progress, replicate: str = "auto", memory_bytes: float | None = None,
    memory: MemoryModel | None = None, mesh: Any = "auto",
    activation_checkpointing: str = DEFAULTS.activation_checkpointing,
) -> Plan:
    """Plan pipeline parallelism for ``model``: capture, cost, partition, schedule.

    Parameters
    ----------
    model : torch.nn.Module
        The model; may live on the ``meta`` device (nothing is allocated).
    args, kwargs : tuple, dict
        Example inputs of ONE micro-batch (costs are per micro-batch): a tuple of the
        positional inputs (one tensor ``x`` is ``(x,)``) and a dict of the keyword inputs.
    devices : int
        All devices, >= 1: ``pp * dp_shard * dp_replicate * tp`` of the mesh (the default
        ``mesh="auto"`` chooses the degrees); ``stages_per_device * pp`` must not exceed the
        number of ops.
    microbatches : int
        Micro-batches per optimizer step (global: divided among the data-parallel replicas
        of ``mesh``), >= 1.
    hardware : str, path or HardwareSpec, optional
        What the costs are for: a datasheet spec name (``"a100-80gb"``, ``"h100-sxm"``,
        ``"h200"``, ``"cpu"``), ``"measured"`` (this machine's device, calibrated from measured
        op times), ``"profile:<name>"`` (a shipped profile, e.g. ``"profile:cpu"``) or the path
        of an ``fxpipe.hwprofile/1`` file (see :func:`fxpipe.cost.hardware.get_hardware`).
        Default: ``"h100-sxm"``, or ``"measured"`` with ``costs="measured"``.
    costs : {"roofline", "measured"}
        ``"roofline"``: each op's time comes from ``hardware``'s model (the datasheet roofline,
        or, for a measured spec, the measured / calibrated time). ``"measured"``: every op of
        this model is first run on this machine's device and timed (forward, backward-input,
        backward-weight; cached in the cost database, so a second compile measures nothing)
        and those times are used (:func:`fxpipe.cost.profile.trace_measured`).
    cost_db : str or path, optional
        Cost database for ``costs="measured"`` (default ``$FXPIPE_COST_DB`` or
        ``~/.cache/fxpipe/costdb.json``).
    profile_threads : int, optional
        Intra-op threads the ops are timed with for ``costs="measured"`` (default: the given
        profile's, else ``torch.get_num_threads()``); use the thread count of the training ranks.
    objective : {"training", "inference"}
        Contract-2 objective the partition minimises.
    schedule : str, optional
        A method valid for the placement (:func:`fxpipe.schedule.dispatch.methods_for_placement`;
        every method and the placements it admits: :data:`fxpipe.schedule.registry.REGISTRY`),
        or ``"auto"`` (default; the fastest that fits memory, see :func:`plan_graph`).
        ``None``: the placement's default (``zb-h1`` with one stage per device,
        ``interleaved-1f1b`` looped, ``zb-v`` V-shaped).
    stages_per_device : int or "auto"
        v: the model is cut into ``v * devices`` stages, v on every device (default 1).
        ``"auto"``: try v = 1 and v = 2 and keep the best predicted step time.
    placement : {"looped", "v", "auto"}
        Placement of the stages on the devices when v > 1: ``"looped"`` (interleaved 1F1B,
        stage s on device s mod p), ``"v"`` (ZB-V / DualPipe-V, stages s and 2p-1-s on device
        s) or ``"auto"`` (both, the best predicted step time kept). The partition minimises the
        per-stage bottleneck; the plan reports the per-device bottleneck (a device's stages'
        work plus its transfers to other devices; transfers between stages of one device are
        free). See :func:`plan_graph`.
    dtype : torch.dtype, optional
        Compute dtype the costs assume (default: the model's parameter dtype).
    time_limit_s : float
        Partition search budget (seconds): an upper limit; the search stops as soon as its
        partition is proven optimal (``plan.partition.meta["proven_optimal"]``, e.g. by the
        chain DP on transformer stacks) or stops improving (``meta["stop_reason"]``).
    schedule_time_limit_s : float, optional
        MILP budget in seconds (default 60 s for ``schedule="milp"``; for ``"auto"``, whose MILP
        only tries to improve a feasible heuristic schedule, 5 s scaled down to the problem's
        size, at least 1 s: :func:`auto_milp_budget_s`).
    seed : int
        Seed of the partition search.
    mem_limit_bytes : float, optional
        An extra cap on every device's activation memory (bytes).
    memory_bytes : float, optional
        Device capacity in bytes (default: the hardware profile's ``memory_bytes``; ``inf``:
        no limit). See :func:`plan_graph` for how it bounds the partition and the schedule.
    memory : MemoryModel, optional
        Precision policy, ZeRO sharding, reserved fraction, the optimizer's place (:mod:`fxpipe.memory`).
    name : str, optional
        Model name for reports (default: the class name).
    progress : bool
        tqdm progress bars.
    replicate : {"auto", "always", "never"}
        Capture a deep stack of identical layers by exporting three and replicating one
        (:func:`fxpipe.passes.capture.capture`; same graph as a full export, much faster for
        70B-class models). ``"never"`` forces a full ``torch.export``.
    mesh : "auto", "search", "pipeline" or dict
        Pipeline x data x tensor parallelism (:mod:`fxpipe.mesh`), torchtitan's names: ``{"pp": a,
        "dp_shard": b, "dp_replicate": c, "tp": t}`` (missing = 1, ``a * b * c * t == devices``;
        ``b * c`` divides ``microbatches``; ``t`` devices share every stage's matmuls, Megatron's
        column / row split found on the graph, :mod:`fxpipe.mesh.tensor_parallel`, run on DTensor,
        :mod:`fxpipe.codegen.tensor_parallel`; planned on one tensor-parallel rank's costs and memory,
        :func:`fxpipe.mesh.tensor_parallel.tensor_parallel_graph`, activation checkpointing, recomputation
        and offload included, run on the local shards): ``b * c`` replicas of a pipeline over ``a`` devices, each
        planned for ``microbatches / (b * c)`` micro-batches, its stages wrapped by FSDP2
        ``fully_shard`` over ``dp_shard`` (HSDP with ``dp_replicate``) or ``replicate``
        (:mod:`fxpipe.codegen.mesh`), the optimizer state sharded over ``dp_shard``
        (:func:`fxpipe.mesh.mesh_memory`); an ``"order"`` entry (e.g. torchtitan's ``["pp",
        "dp_replicate", "dp_shard"]``) places the ranks (``plan.rank_order``). ``"auto"``
        (default): the joint search (:func:`fxpipe.mesh.search.search_mesh`; ``"search"``
        forces it): every such mesh (``t`` in 1, 2, 4, 8 where the model's blocks and the node admit
        it, :func:`fxpipe.mesh.search.tensor_parallel_degrees`; and rank order, on hardware with
        nodes) planned, the
        smallest predicted step that fits kept, so a small model may get pure data parallelism
        (``pp = 1``); ``plan.options["mesh_search"]`` and the summary list the candidates. With
        a ``memory`` model already sharding over ``data_parallel > 1`` (your own data
        parallelism), ``"auto"`` is ``"pipeline"``: the pure pipeline over all devices.
    activation_checkpointing : {"auto", "none", "full", "selective"}
        Activation checkpointing (issue 28, :mod:`fxpipe.memory.checkpoint`; training only).
        ``"auto"`` (default): the planner chooses per stage, where memory forces it, among none,
        per-block ``"selective"`` (torchtitan's op-level SAC: matmul and attention outputs kept,
        every other matmul replayed), ``"budget"`` (the kept set that replays least for a memory
        budget), per-block ``"full"`` and whole-stage ``"stage"`` recomputation, jointly with the
        partition, the schedule and the mesh. ``"full"`` / ``"selective"``: that per-block policy
        on every stage (torchtitan's ``activation_checkpoint.mode``); ``"none"``: never.
        ``plan.activation_checkpointing`` lists every stage's policy.

    Returns
    -------
    Plan

    Warns
    -----
    PlanWarning
        For a plan that wastes devices (:meth:`Plan.waste_warnings`: fewer micro-batches than
        devices, stages with almost no work), naming the better choice; with ``tp > 1`` what
        tensor parallelism does not split (odd vocabularies, the stages it is not offered for), with the
        reason (:meth:`Plan.tensor_parallel_warnings`).
    DeviceBranchWarning
        A model captured on ``meta`` holds an op that this process's CPU (or CUDA) backend
        cannot run with its traced dtypes, e.g. a dtype picked by a branch on the device
        (:mod:`fxpipe.codegen.devicecheck` says what is and is not detected).

    Raises
    ------
    InputError
        ``args`` not a tuple (e.g. a bare tensor: wrap it, ``(x,)``), ``kwargs`` not a dict,
        devices < 1, microbatches < 1, more stages than ops, unknown hardware/schedule/costs/
        placement/activation_checkpointing, a schedule the placement does not admit, ``costs="measured"`` with the
        datasheet spec or profile of another device, a mesh whose degrees do not multiply to
        ``devices`` or whose replicas do not divide ``microbatches``, a ``tp`` that does not
        divide the heads or widths of the model's attention blocks and MLPs, or finds nothing
        to split (:func:`fxpipe.mesh.tensor_parallel.check_tensor_parallel`).
    CaptureError
        The model cannot be exported (the message says which node and what to try).
    InfeasibleError
        Nothing fits the device memory: the message gives the overflow, the smallest device
        count that fits and which of offload, recomputation, ZeRO sharding or more devices
        would help (see :func:`plan_graph`).
    """
    devices, microbatches = check_count(devices, "devices"), check_count(microbatches, "microbatches")
    args, kwargs = check_call_inputs(args, kwargs)
    _check_mesh(mesh, devices, microbatches, memory)
    options = PlanOptions.from_keywords(locals())  # validates objective, schedule, placement
    with recording_warnings() as said:  # fxpipe's warnings go into the plan too (plan.all_warnings())
        traced, hardware_name, timings = _capture(model, args, kwargs, costs=costs, hardware=hardware, dtype=dtype,
                                                  name=name, cost_db=cost_db, profile_threads=profile_threads,
                                                  replicate=replicate, progress=progress)
        options = dataclasses.replace(options, host_bandwidth_bytes_per_s=traced.hardware.host_copy_bytes_per_s)
        base_memory = resolve_memory(traced.graph, memory, memory_bytes, traced.hardware)
        planned = None
        # Ctrl-C during any search of planning (mesh, partition, schedule) stops them all; the plan is the
        # best found so far and says so (plan.interrupted)
        with Search("planning") as run:
            planned = _plan_mesh(traced.graph, mesh, devices, microbatches, base_memory, options)
        if planned is None:  # interrupted before any result (outside a search's own handler)
            raise KeyboardInterrupt
    recorded = {"dtype": str(dtype) if dtype else None, "costs": costs, "stages_per_device": stages_per_device,
                "placement": placement, "mesh": mesh, "activation_checkpointing": activation_checkpointing,
                **({"interrupted": True} if run.interrupted else {}), **({"warnings": list(said)} if said else {})}
    plan = _make_plan(traced, hardware_name, microbatches, options, planned, recorded, timings)
    for message in plan.waste_warnings() + plan.tensor_parallel_warnings():
        warnings.warn(message, PlanWarning, stacklevel=2)
    return plan
