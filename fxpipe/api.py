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

The :class:`~fxpipe.plan.Plan` it returns lives in :mod:`fxpipe.plan`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph, Schedule, ScheduleProblem
from fxpipe.memory import MemoryModel
from fxpipe.partition.objective import Partition
from fxpipe.plan import PLAN_FORMAT, DeviceStats, Plan, StageStats, graph_signature, load_plan  # noqa: F401 (public re-exports)
import fxpipe.schedule.registry as _schedule_registry

#: every schedule method (= :data:`fxpipe.schedule.dispatch.METHODS`); which ones a placement
#: admits: :func:`fxpipe.schedule.dispatch.methods_for_placement`.
SCHEDULES = _schedule_registry.names()
#: placements of ``stages_per_device`` stages on every device (``"auto"``: the best by predicted step time).
PLACEMENTS = ("looped", "v", "auto")
#: MILP budget (seconds) when ``schedule_time_limit_s`` is not given: ``schedule="milp"`` /
#: ``schedule="auto"`` (whose MILP only tries to improve a feasible heuristic schedule).
DEFAULT_MILP_TIME_LIMIT_S = 60.0
DEFAULT_AUTO_MILP_TIME_LIMIT_S = 5.0
#: smallest share of :data:`DEFAULT_AUTO_MILP_TIME_LIMIT_S` :func:`auto_milp_budget_s` gives a small problem.
AUTO_MILP_MIN_SHARE = 0.2


def auto_milp_budget_s(problem: ScheduleProblem) -> float:
    """MILP budget (seconds) of ``schedule="auto"`` when none is given, scaled to the problem.

    :data:`DEFAULT_AUTO_MILP_TIME_LIMIT_S` times the problem's share of the largest problem
    the auto MILP takes (``3 S m`` compute ops against
    :data:`fxpipe.schedule.auto.AUTO_MILP_MAX_OPS`), at least :data:`AUTO_MILP_MIN_SHARE` of
    it: a toy of 2 stages and 4 micro-batches gets 1 s, a problem of 240 compute ops the full
    5 s. (Larger problems skip the MILP.)
    """
    from fxpipe.schedule.auto import AUTO_MILP_MAX_OPS

    n_ops = 3 * problem.num_stages * problem.num_microbatches
    share = min(1.0, max(AUTO_MILP_MIN_SHARE, n_ops / AUTO_MILP_MAX_OPS))
    return DEFAULT_AUTO_MILP_TIME_LIMIT_S * share


#: stages per device tried by ``stages_per_device="auto"``.
AUTO_STAGES_PER_DEVICE = (1, 2)

def _check_count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{what} must be an integer, got {value!r}")
    if value < 1:
        raise InputError(f"{what} must be >= 1, got {value}")
    return int(value)


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


def resolve_memory(graph: OpGraph | None, memory: MemoryModel | None = None, memory_bytes: float | None = None,
                   hardware=None) -> MemoryModel:
    """The :class:`~fxpipe.memory.MemoryModel` a plan is made with.

    ``memory`` (precision policy, ZeRO sharding, reserved fraction; default: the module's
    defaults) with the capacity ``memory_bytes`` if given (``inf``: no limit), else the
    capacity of ``memory`` if it has one, else the ``memory_bytes`` of the hardware profile
    (``hardware``, a :class:`~fxpipe.cost.hardware.HardwareSpec`, or the datasheet spec named
    by ``graph.meta["hardware"]``), else unlimited.

    Raises
    ------
    InputError
        On a non-positive capacity or a ``memory`` that is not a MemoryModel.
    """
    if memory is not None and not isinstance(memory, MemoryModel):
        raise InputError(f"memory must be a fxpipe.memory.MemoryModel, got {type(memory).__name__}")
    base = memory if memory is not None else MemoryModel()
    if memory_bytes is not None:
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, float, np.integer, np.floating)):
            raise InputError(f"memory_bytes must be a number of bytes, got {memory_bytes!r}")
        return dataclasses.replace(base, capacity_bytes=float(memory_bytes))
    if memory is not None and math.isfinite(memory.capacity_bytes):
        return memory
    cap = getattr(hardware, "memory_bytes", None)
    if cap is None and graph is not None:
        from fxpipe.cost.hardware import HARDWARE

        spec = HARDWARE.get(str(graph.meta.get("hardware", "")))
        cap = None if spec is None else spec.memory_bytes
    return base if cap is None else dataclasses.replace(base, capacity_bytes=float(cap))


def _memory_fields(row) -> dict[str, Any]:
    """The memory columns of a stage / device row from a :class:`fxpipe.memory.DeviceMemory`."""
    return dict(
        params_bytes=row.params_bytes, grads_bytes=row.grads_bytes, optimizer_bytes=row.optimizer_bytes,
        activation_peak_bytes=row.activation_peak_bytes, comm_buffer_bytes=row.comm_buffer_bytes,
        reserved_bytes=row.reserved_bytes, offloaded_peak_bytes=row.offloaded_peak_bytes,
        memory_bytes=row.total_bytes,
        capacity_bytes=None if not math.isfinite(row.capacity_bytes) else row.capacity_bytes,
    )


def stage_stats(graph: OpGraph, partition: Partition, problem: ScheduleProblem, schedule: Schedule, objective: str,
                memory: MemoryModel | None = None) -> list[StageStats]:
    """Per-stage figures: ops, parameter bytes, F/B/W times, cost, and memory by kind.

    Memory comes from the one memory model (:func:`fxpipe.plan_memory.stage_memory`, each
    stage as if alone on a device; ``memory`` default: :class:`~fxpipe.memory.MemoryModel`'s
    defaults without a capacity): parameters, gradients, optimizer state, the activation peak
    of the stage's curve in ``schedule``, receive buffers, the reserved fraction, and the
    stashes offloaded at once.
    """
    from fxpipe.plan_memory import stage_memory

    model = memory if memory is not None else MemoryModel()
    a = partition.assignment
    k = partition.k
    rows = stage_memory(graph, a, problem, schedule, model, objective)
    out = []
    for s in range(k):
        mask = a == s
        out.append(
            StageStats(
                stage=s,
                device=int(problem.device_of_stage[s]),
                num_ops=int(mask.sum()),
                param_bytes=float(graph.size_param_bytes[mask].sum()),
                t_fwd_s=float(graph.t_fwd_s[mask].sum()),
                t_bwd_input_s=float(graph.t_bwd_input_s[mask].sum()),
                t_bwd_weight_s=float(graph.t_bwd_weight_s[mask].sum()),
                cost_s=float(partition.block_costs[s]),
                recompute=bool(problem.recompute[s]),
                **_memory_fields(rows[s]),
            )
        )
    return out


def device_stats(graph: OpGraph, partition: Partition, problem: ScheduleProblem, schedule: Schedule,
                 objective: str, memory: MemoryModel | None = None) -> list[DeviceStats]:
    """Per-device figures: the device's stages, ops, parameter bytes, F/B/W times, the per-device
    cost (:func:`fxpipe.partition.placement.device_costs`: its stages' work plus the transfers to
    other devices), its compute time per step and span in the schedule, and memory by kind
    (:func:`fxpipe.plan_memory.device_memory`)."""
    from fxpipe.partition.placement import device_costs
    from fxpipe.plan_memory import device_memory
    from fxpipe.schedule.validate import device_busy_s, device_spans

    model = memory if memory is not None else MemoryModel()
    dev_of_node = np.asarray(problem.device_of_stage, dtype=np.int64)[partition.assignment]
    costs = device_costs(graph, partition.assignment, problem.device_of_stage, objective, partition.comm,
                         num_devices=problem.num_devices)
    busy = device_busy_s(problem)
    spans = device_spans(problem, schedule.ops)
    rows = device_memory(graph, partition.assignment, problem, schedule, model, objective)
    out = []
    for d in range(problem.num_devices):
        mask = dev_of_node == d
        out.append(
            DeviceStats(
                device=d,
                stages=list(problem.stages_of_device(d)),
                num_ops=int(mask.sum()),
                param_bytes=float(graph.size_param_bytes[mask].sum()),
                t_fwd_s=float(graph.t_fwd_s[mask].sum()),
                t_bwd_input_s=float(graph.t_bwd_input_s[mask].sum()),
                t_bwd_weight_s=float(graph.t_bwd_weight_s[mask].sum()),
                cost_s=float(costs[d]),
                busy_s=float(busy[d]),
                span_s=float(spans[d]),
                **_memory_fields(rows[d]),
            )
        )
    return out


def fill_empty_stages(graph: OpGraph, partition: Partition, memory=None) -> Partition:
    """Make a partition runnable on exactly ``k`` ranks when the optimum leaves stages empty.

    The partitioner minimises the bottleneck over *at most* k blocks and leaves unused blocks
    at the end; but the runtime needs model inputs on stage 0 and the output on stage k-1.
    The last used block is renumbered k-1 (or, if only one block is used, just the output
    node moves there, with the ops whose data-dependent-size tensors it consumes and all
    they feed), so the empty stages in between relay tensors. Costs are recomputed
    (relayed tensors count in the empty stages' io) and ``meta["empty_stages"]`` lists them;
    with ``memory`` (the partitioner's :class:`~fxpipe.partition.memory.PartitionMemory`) so is
    ``meta["stage_memory_bytes"]`` (an empty stage holds the receive buffers of what it relays).
    """
    a = np.asarray(partition.assignment)
    k = partition.k
    used = np.unique(a)
    if used.max() == k - 1:  # the last stage holds ops: the pipeline already spans k ranks
        return partition
    a2 = a.copy()
    last = int(used.max())
    if used.size >= 2:
        a2[a == last] = k - 1
    else:
        for i, op in enumerate(graph.ops):
            if op == "output":
                a2[i] = k - 1
        if graph.data_dependent.any():
            # the output may consume a data-dependent-size tensor: move the ops that must share
            # its stage (fxpipe.partition.colocate) and everything they feed (stays monotone)
            from fxpipe.partition.colocate import colocation_groups

            group = colocation_groups(graph)
            if group is not None:
                out = [i for i, op in enumerate(graph.ops) if op == "output"]
                moved = np.isin(group, group[out])
                stack = np.flatnonzero(moved).tolist()
                while stack:
                    for w in graph.successors(stack.pop()).tolist():
                        if not moved[w]:
                            moved[w] = True
                            stack.append(w)
                a2[moved] = k - 1
    from fxpipe.partition.objective import block_costs

    costs = block_costs(graph, a2, k, partition.objective, partition.comm)
    empty = sorted(set(range(k)) - set(np.unique(a2).tolist()))
    meta = {**partition.meta, "empty_stages": empty, "bottleneck_before_filling_s": partition.bottleneck}
    if memory is not None and "stage_memory_bytes" in meta:
        from fxpipe.partition.memory import stage_memory_bytes

        meta["stage_memory_bytes"] = stage_memory_bytes(graph, a2, k, partition.objective, memory, partition.comm).tolist()
    return Partition(
        k=k,
        assignment=a2,
        block_costs=costs,
        bottleneck=float(costs.max()),
        objective=partition.objective,
        comm=partition.comm,
        order=partition.order,
        meta=meta,
    )


def _stages_per_device_candidates(stages_per_device: Any) -> tuple[int, ...]:
    if isinstance(stages_per_device, str):
        if stages_per_device != "auto":
            raise InputError(f"stages_per_device must be an integer >= 1 or 'auto', got {stages_per_device!r}")
        return AUTO_STAGES_PER_DEVICE
    return (_check_count(stages_per_device, "stages_per_device"),)


def _placement_candidates(stages_per_device: Any, placement: Any) -> list[tuple[int, str]]:
    """(v, placement) pairs to try, in the order of preference on equal predicted step time."""
    if placement not in PLACEMENTS:
        raise InputError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    out = []
    for v in _stages_per_device_candidates(stages_per_device):
        names = ("looped", "v") if placement == "auto" else (placement,)
        for name in names:
            if v == 1 and out and out[-1][0] == 1:
                continue  # with one stage per device every placement is the same
            out.append((v, name))
    return out


def plan_graph(
    graph: OpGraph,
    *,
    devices: int,
    microbatches: int,
    objective: str = "training",
    schedule: str | None = "auto",
    stages_per_device: int | str = 1,
    placement: str = "looped",
    time_limit_s: float = 10.0,
    schedule_time_limit_s: float | None = None,
    seed: int = 0,
    mem_limit_bytes: float | None = None,
    host_bandwidth_bytes_per_s: float | None = None,
    progress: bool = False,
    memory_bytes: float | None = None,
    memory: MemoryModel | None = None,
) -> tuple[Partition, ScheduleProblem, Schedule, dict[str, float]]:
    """Partition, place and schedule an OpGraph (the torch-free half of :func:`compile`).

    For every candidate ``(v, placement)`` the graph is partitioned into ``v * devices``
    stages (one search per stage count, :func:`fxpipe.partition.search.partition`, which
    minimises the per-*stage* bottleneck), the stages are placed on the devices
    (:func:`fxpipe.partition.placement.placement_of`), the scheduling problem is built with
    that placement (communication between stages of one device is free) and scheduled by
    ``schedule`` (default: :func:`fxpipe.schedule.dispatch.default_method` of the placement).
    With several candidates (``stages_per_device="auto"`` and/or ``placement="auto"``) the one
    whose schedule has the smallest value of the problem's objective (the predicted step time;
    ties: fewer stages per device, looped before V) is kept; the schedule's
    ``meta["placement_search"]`` lists every candidate with its predicted step time,
    per-device bottleneck, or why it was skipped.

    Parameters
    ----------
    graph : OpGraph
    devices : int
        Number of devices p (pipeline ranks).
    microbatches : int
        m >= 1.
    objective : {"training", "inference"}
    schedule : str, optional
        A method of :data:`SCHEDULES` valid for the placement
        (:func:`fxpipe.schedule.dispatch.methods_for_placement`); with ``placement="auto"``
        only placements it schedules are candidates. ``"auto"`` (default): the fastest
        schedule that fits memory among the heuristics and, within ``schedule_time_limit_s``,
        the MILP, offloading and (in training) recomputing activations only where memory
        forces it (:func:`fxpipe.schedule.auto.auto_schedule`; the returned problem carries
        the recomputing stages). ``None``: :func:`fxpipe.schedule.dispatch.default_method`.
    stages_per_device : int or "auto"
        v >= 1 stages on every device, or ``"auto"``: try :data:`AUTO_STAGES_PER_DEVICE`.
    placement : {"looped", "v", "auto"}
        How the ``v * p`` stages are placed (ignored when v = 1).
    time_limit_s, seed, host_bandwidth_bytes_per_s, progress :
        Partition search budget (per stage count), seed, device-host bandwidth (enables
        offload), progress bars.
    schedule_time_limit_s : float, optional
        MILP budget per candidate in seconds (default :data:`DEFAULT_MILP_TIME_LIMIT_S` for
        ``"milp"``, :func:`auto_milp_budget_s` for ``"auto"``: up to
        :data:`DEFAULT_AUTO_MILP_TIME_LIMIT_S`, less for small problems; 0: ``"auto"`` without
        the MILP).
    mem_limit_bytes : float, optional
        An extra cap on every device's activation memory (bytes), on top of the capacity's.
    memory_bytes : float, optional
        Capacity of one device in bytes (overrides ``memory``'s and the hardware's; ``inf``:
        no limit). Default: the capacity of the datasheet spec named by
        ``graph.meta["hardware"]`` (:func:`resolve_memory`), else unlimited.
    memory : MemoryModel, optional
        Precision policy, ZeRO sharding, reserved fraction (and capacity) of
        :mod:`fxpipe.memory` (default mixed-precision Adam, 16 B/param, 10 % reserved).
        With a finite capacity the partition is memory-aware (every stage's static state
        plus one micro-batch's stash fits, :class:`fxpipe.partition.memory.PartitionMemory`
        with the ``"floor"`` rule) and the schedule gets ``mem_limit = capacity - reserved
        - static state`` per device (:func:`fxpipe.plan_memory.schedule_mem_limit`).

    Returns
    -------
    (partition, problem, schedule, timings_s)
        The kept candidate's; ``problem.device_of_stage`` is its placement.

    Raises
    ------
    InputError
        On bad counts, an unknown schedule or placement, a schedule the placement does not
        admit, or more stages than ops.
    InfeasibleError
        When nothing fits the device memory (the first candidate's error): from the
        partitioner (:func:`fxpipe.partition.memory.infeasible_error`: the overflow, the
        smallest device count that fits, and whether offload, recomputation or ZeRO sharding
        would help), from the static state of a device with several stages, or from the
        schedule (:func:`fxpipe.schedule.auto.auto_schedule`).
    """
    from fxpipe.errors import InfeasibleError
    from fxpipe.partition.colocate import check_no_forbidden_cuts
    from fxpipe.partition.placement import device_costs, placement_of
    from fxpipe.partition.search import partition as run_partition
    from fxpipe.schedule.dispatch import default_method, make_schedule, methods_for_placement
    from fxpipe.schedule.from_partition import problem_from_partition

    from fxpipe.partition.memory import PartitionMemory
    from fxpipe.plan_memory import schedule_mem_limit
    from fxpipe.progress import phase
    from fxpipe.schedule.auto import auto_schedule

    devices = _check_count(devices, "devices")
    microbatches = _check_count(microbatches, "microbatches")
    model = resolve_memory(graph, memory, memory_bytes)
    pmem = PartitionMemory(model, microbatches, "floor") if math.isfinite(model.capacity_bytes) else None
    if schedule is not None and schedule not in SCHEDULES:
        raise InputError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    cands = _placement_candidates(stages_per_device, placement)
    several = len(cands) > 1
    timings: dict[str, float] = {"partition": 0.0, "schedule": 0.0}
    parts: dict[int, Partition] = {}
    tried: list[dict[str, Any]] = []
    best = None
    first_error: Exception | None = None
    for v, name in cands:
        k = v * devices
        dev = placement_of(name, devices, v)
        record: dict[str, Any] = {"stages_per_device": v, "placement": name if v > 1 else "looped"}
        tried.append(record)
        if k > graph.n:
            msg = (f"{v * devices} stages ({v} per device on {devices} devices) is more than the {graph.n} ops of "
                   "the graph: every stage needs at least one op; use fewer devices or stages per device")
            if not several:
                raise InputError(f"devices={devices} x stages_per_device={v}: {msg}" if v > 1 else
                                 f"devices={devices} is more than the {graph.n} ops of the graph: every stage needs "
                                 "at least one op; use fewer devices")
            record["skipped"] = msg
            continue
        valid = methods_for_placement(dev, devices)
        method = schedule if schedule is not None else default_method(dev, devices)
        record["schedule"] = method
        if method not in valid:
            msg = (f"schedule {method!r} does not schedule the {record['placement']} placement with {v} stages per "
                   f"device; use one of {', '.join(valid)}")
            if not several:
                raise InputError(msg)
            record["skipped"] = msg
            continue
        if k not in parts:
            t0 = time.perf_counter()
            try:
                with phase(f"partition into {k} stages (up to {time_limit_s:g} s)", on=progress):
                    part = run_partition(graph, k, objective=objective, comm="relay", time_limit_s=time_limit_s,
                                         seed=seed, progress=progress, memory=pmem)
                part = fill_empty_stages(graph, part, pmem)
                # data-dependent sizes never cross stages (the search honours it; filling may not)
                check_no_forbidden_cuts(graph, part.assignment, what=f"the partition into {k} stages")
            except InfeasibleError as exc:
                if not several:
                    raise
                parts[k] = exc
            else:
                parts[k] = part
            finally:
                timings["partition"] += time.perf_counter() - t0
        part = parts[k]
        if isinstance(part, Exception):
            first_error = first_error or part
            record["skipped"] = str(part)
            continue
        t0 = time.perf_counter()
        try:
            limit = schedule_mem_limit(graph, part.assignment, k, dev, model, microbatches, objective)
        except InfeasibleError as exc:
            if not several:
                raise
            first_error = first_error or exc
            record["skipped"] = str(exc)
            continue
        if mem_limit_bytes is not None:
            limit = np.minimum(limit, float(mem_limit_bytes))
        problem = problem_from_partition(
            graph, part, num_microbatches=microbatches, mem_limit_bytes=limit,
            host_bandwidth_bytes_per_s=host_bandwidth_bytes_per_s, device_of_stage=dev,
        )
        record["device_bottleneck_s"] = float(device_costs(graph, part.assignment, dev, objective, "relay").max())
        record["stage_bottleneck_s"] = float(part.bottleneck)
        try:
            if method == "auto":
                budget = auto_milp_budget_s(problem) if schedule_time_limit_s is None else schedule_time_limit_s
                with phase(f"schedule {k} stages x {microbatches} micro-batches (auto, MILP up to {budget:g} s)", on=progress):
                    chosen = auto_schedule(problem, recompute=objective == "training", time_limit_s=budget,
                                           progress=progress)
                problem, sched = chosen.problem, chosen.schedule
            else:
                budget = DEFAULT_MILP_TIME_LIMIT_S if schedule_time_limit_s is None else schedule_time_limit_s
                with phase(f"schedule {k} stages x {microbatches} micro-batches ({method})", on=progress):
                    sched = make_schedule(problem, method, time_limit_s=budget, progress=progress)
        except InfeasibleError as exc:
            if not several:
                raise
            first_error = first_error or exc
            record["skipped"] = str(exc)
            continue
        finally:
            timings["schedule"] += time.perf_counter() - t0
        record["step_time_s"] = float(sched.value)  # the schedule objective's value (stage_span: largest device span)
        record["stage_span_s"], record["makespan_s"] = float(sched.stage_span), float(sched.makespan)
        if best is None or sched.value < best[2].value * (1 - 1e-9):
            best = (part, problem, sched, record)
    if best is None:
        if first_error is not None:
            raise first_error
        raise InputError("no placement candidate could be planned: " + "; ".join(r["skipped"] for r in tried))
    part, problem, sched, record = best
    if several:
        record["chosen"] = True
        sched = dataclasses.replace(sched, meta={**sched.meta, "placement_search": tried})
    return part, problem, sched, timings


def compile(  # noqa: A001 - the public name mirrors torch.compile
    model,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    devices: int = 4,
    microbatches: int = 8,
    hardware=None,
    costs: str = "roofline",
    cost_db=None,
    profile_threads: int | None = None,
    objective: str = "training",
    schedule: str | None = "auto",
    stages_per_device: int | str = 1,
    placement: str = "looped",
    dtype=None,
    time_limit_s: float = 10.0,
    schedule_time_limit_s: float | None = None,
    seed: int = 0,
    mem_limit_bytes: float | None = None,
    name: str | None = None,
    progress: bool = False,
    replicate: str = "auto",
    memory_bytes: float | None = None,
    memory: MemoryModel | None = None,
    mesh: Any = "auto",
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
        Devices, >= 1: with a pure pipeline (the default mesh) the pipeline ranks p;
        ``stages_per_device * p`` must not exceed the number of ops.
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
        A method valid for the placement (:func:`fxpipe.schedule.dispatch.methods_for_placement`):
        one stage per device: ``gpipe``, ``1f1b``, ``zb-h1``, ``zb-h2``, ``greedy``,
        ``pipeoffload``, ``adaoffload``, ``interleaved-1f1b`` (= 1F1B), ``milp``; looped:
        ``interleaved-1f1b``, ``greedy``, ``milp``; V-shape with 2 stages per device: ``zb-v``,
        ``dualpipe-v`` (m >= 2 devices), ``greedy``, ``milp``; any placement: ``auto``
        (default; the fastest that fits memory, see :func:`plan_graph`). ``None``: ``zb-h1``
        with one stage per device, ``interleaved-1f1b`` looped, ``zb-v`` V-shaped.
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
        Precision policy, ZeRO sharding and reserved fraction (:mod:`fxpipe.memory`).
    name : str, optional
        Model name for reports (default: the class name).
    progress : bool
        tqdm progress bars.
    replicate : {"auto", "always", "never"}
        Capture a deep stack of identical layers by exporting three and replicating one
        (:func:`fxpipe.passes.capture.capture`; same graph as a full export, much faster for
        70B-class models). ``"never"`` forces a full ``torch.export``.
    mesh : "auto", "search" or dict
        Pipeline x data parallelism, torchtitan's names: ``{"pp": a, "dp_shard": b,
        "dp_replicate": c}`` (missing = 1, ``a * b * c == devices``): ``b * c`` replicas of a
        pipeline over ``a`` devices, each stage wrapped by FSDP2 ``fully_shard`` over
        ``dp_shard`` (HSDP with ``dp_replicate``) or ``replicate`` over ``dp_replicate``
        (:mod:`fxpipe.codegen.mesh`). ``b * c`` must divide ``microbatches``; the pipeline is
        planned for ``a`` devices and ``microbatches / (b * c)`` micro-batches (``plan.devices``
        and ``plan.microbatches`` are those of one pipeline; ``plan.mesh`` the mesh,
        ``plan.world_size`` all devices). With ``dp_shard > 1`` the memory model shards the
        optimizer state over it (:func:`fxpipe.mesh.mesh_memory`). ``"auto"`` (default): for now
        the pure pipeline ``{"pp": devices}``. ``"search"``: a first joint search
        (:func:`fxpipe.mesh_search.search_mesh`): every ``pp x dp_shard`` of ``devices`` whose
        replicas divide ``microbatches`` is planned and the smallest predicted step (schedule +
        data-parallel sync) that fits memory kept; ``plan.options["mesh_search"]`` and the
        summary list the candidates. (Making it the default, a topology and overlap are later
        steps.)

    Returns
    -------
    Plan

    Warns
    -----
    PlanWarning
        For a plan that wastes devices (:meth:`Plan.waste_warnings`: fewer micro-batches than
        devices, stages with almost no work), naming the better choice.

    Raises
    ------
    InputError
        ``args`` not a tuple (e.g. a bare tensor: wrap it, ``(x,)``), ``kwargs`` not a dict,
        devices < 1, microbatches < 1, more stages than ops, unknown hardware/schedule/costs/
        placement, a schedule the placement does not admit, ``costs="measured"`` with the
        datasheet spec or profile of another device, a mesh whose degrees do not multiply to
        ``devices`` or whose replicas do not divide ``microbatches``.
    CaptureError
        The model cannot be exported (the message says which node and what to try).
    InfeasibleError
        Nothing fits the device memory: the message gives the overflow, the smallest device
        count that fits and which of offload, recomputation, ZeRO sharding or more devices
        would help (see :func:`plan_graph`).

    Warns
    -----
    DeviceBranchWarning
        A model captured on ``meta`` holds an op that this process's CPU (or CUDA) backend
        cannot run with its traced dtypes, e.g. a dtype picked by a branch on the device
        (:mod:`fxpipe.codegen.devicecheck` says what is and is not detected).
    """
    devices = _check_count(devices, "devices")
    microbatches = _check_count(microbatches, "microbatches")
    args, kwargs = check_call_inputs(args, kwargs)
    from fxpipe.mesh import mesh_memory, microbatches_per_replica, normalize_mesh

    searching = isinstance(mesh, str) and mesh == "search"
    if searching:  # fxpipe.mesh_search: chosen after the capture
        if isinstance(memory, MemoryModel) and memory.data_parallel != 1:
            raise InputError("mesh='search' sets the data-parallel degree of the memory model: leave data_parallel at 1")
        mesh_degrees = None
    else:
        mesh_degrees = normalize_mesh(mesh, devices)
        pipe_devices, pipe_microbatches = mesh_degrees["pp"], microbatches_per_replica(microbatches, mesh_degrees)
        if isinstance(memory, MemoryModel):
            mesh_memory(memory, mesh_degrees)  # a conflicting ZeRO degree fails before the capture
    if objective not in ("training", "inference"):
        raise InputError(f"objective must be 'training' or 'inference', got {objective!r}")
    if schedule is not None and schedule not in SCHEDULES:
        raise InputError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    _placement_candidates(stages_per_device, placement)  # bad values fail before the capture
    if costs not in ("roofline", "measured"):
        raise InputError(f"costs must be 'roofline' or 'measured', got {costs!r}")
    if hardware is None:
        hardware = "measured" if costs == "measured" else "h100-sxm"
    hardware_name = getattr(hardware, "name", None) or str(hardware)
    timings_extra: dict[str, float] = {}
    from fxpipe.progress import phase

    if costs == "measured":
        from fxpipe.cost.profile import trace_measured

        with phase("capture with torch.export and time every op on this machine", on=progress):
            traced, report = trace_measured(model, tuple(args), dict(kwargs or {}), hardware=hardware, dtype=dtype,
                                            name=name, db=cost_db, threads=profile_threads, progress=progress)
        timings_extra["profile"] = report.wall_s
    else:
        from fxpipe.passes import trace_model

        with phase("capture with torch.export and cost every op", on=progress):
            traced = trace_model(model, tuple(args), dict(kwargs or {}), hardware=hardware, dtype=dtype, name=name,
                                 replicate=replicate)
    # a capture on meta may have taken a device branch's non-CPU path (issue 17): say so now, not on a rank
    from fxpipe.codegen.devicecheck import warn_meta_kernel_gaps

    warn_meta_kernel_gaps(traced.gm, stacklevel=3)
    graph = traced.graph
    plan_kwargs = dict(
        objective=objective,
        schedule=schedule,
        stages_per_device=stages_per_device,
        placement=placement,
        time_limit_s=time_limit_s,
        schedule_time_limit_s=schedule_time_limit_s,
        seed=seed,
        mem_limit_bytes=mem_limit_bytes,
        host_bandwidth_bytes_per_s=traced.hardware.host_bytes_per_s,
        progress=progress,
    )
    base_memory = resolve_memory(graph, memory, memory_bytes, traced.hardware)
    mesh_table = None
    if searching:
        from fxpipe.mesh_search import search_mesh

        mesh_degrees, model, (part, problem, sched, timings), mesh_table = search_mesh(
            graph, devices=devices, microbatches=microbatches, memory=base_memory, **plan_kwargs)
        pipe_devices, pipe_microbatches = mesh_degrees["pp"], microbatches_per_replica(microbatches, mesh_degrees)
    else:
        model = mesh_memory(base_memory, mesh_degrees)
        part, problem, sched, timings = plan_graph(graph, devices=pipe_devices, microbatches=pipe_microbatches,
                                                   memory=model, **plan_kwargs)
    stage_of = {graph.names[i]: int(part.assignment[i]) for i in range(graph.n)}
    from fxpipe.schedule.dispatch import default_method

    resolved = schedule if schedule is not None else default_method(problem.device_of_stage, pipe_devices)
    plan = Plan(
        name=graph.name,
        devices=pipe_devices,
        microbatches=pipe_microbatches,
        mesh=mesh_degrees,
        hardware=hardware_name,
        objective=objective,
        comm="relay",
        graph=graph,
        partition=part,
        stage_of=stage_of,
        problem=problem,
        schedule=sched,
        stages=stage_stats(graph, part, problem, sched, objective, model),
        device_table=device_stats(graph, part, problem, sched, objective, model),
        memory=model,
        timings_s={"capture": traced.capture_s, "cost": traced.cost_s, "export": traced.export_s, **timings_extra, **timings},
        graph_signature=graph_signature(graph),
        options={"seed": seed, "time_limit_s": time_limit_s, "schedule": resolved, "dtype": str(dtype) if dtype else None,
                 "costs": costs, "stages_per_device": stages_per_device, "placement": placement,
                 "mesh": mesh if isinstance(mesh, str) else dict(mesh_degrees),
                 **({"mesh_search": mesh_table} if mesh_table is not None else {})},
        _captured=traced,
    )
    import warnings

    from fxpipe.errors import PlanWarning

    for message in plan.waste_warnings():
        warnings.warn(message, PlanWarning, stacklevel=2)
    return plan
