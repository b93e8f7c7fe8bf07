"""Partition, place and schedule an OpGraph: the torch-free half of :func:`fxpipe.compile`.

:func:`plan_graph` (also :func:`fxpipe.api.plan_graph`) tries every ``(stages per device,
placement)`` candidate of its :class:`~fxpipe.options.PlanOptions`: it partitions the graph
into ``v * devices`` stages (:func:`fxpipe.partition.search.partition`), places them
(:func:`fxpipe.partition.placement.placement_of`), builds the scheduling problem with the
placement and the memory limit of the memory model, schedules it, and keeps the candidate
with the smallest predicted step time. :func:`plan_with_options` is the same with the options
already built (used by :func:`fxpipe.compile` and :func:`fxpipe.mesh.search.search_mesh`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from fxpipe.cost.hardware import HARDWARE
from fxpipe.errors import FxpipeError, InfeasibleError, InputError
from fxpipe.ir import OpGraph, Schedule, ScheduleProblem
from fxpipe.memory import MemoryModel
from fxpipe.memory.checkpoint import menu_for_request
from fxpipe.memory.plan_view import schedule_mem_limit, stage_static
from fxpipe.mesh import host_links, optimizer_host_step_s
from fxpipe.options import (
    AUTO_MILP_MIN_SHARE,
    DEFAULT_AUTO_MILP_TIME_LIMIT_S,
    DEFAULT_MILP_TIME_LIMIT_S,
    DEFAULTS,
    PlanOptions,
    check_count,
)
from fxpipe.partition.colocate import check_no_forbidden_cuts, colocation_groups
from fxpipe.partition.memory import PartitionMemory, stage_memory_bytes
from fxpipe.partition.objective import Partition, block_costs
from fxpipe.partition.placement import device_costs, placement_of
from fxpipe.progress import phase
from fxpipe.schedule.auto import AUTO_MILP_MAX_OPS, ScheduleCannotBeat, auto_schedule
from fxpipe.schedule.bounds import recompute_lower_bound, round_trip_lower_bound
from fxpipe.schedule.dispatch import default_method, make_schedule, methods_for_placement
from fxpipe.schedule.from_partition import problem_from_partition
from fxpipe.schedule.validate import place_fused_w

__all__ = ["plan_graph", "plan_with_options", "resolve_memory", "auto_milp_budget_s", "fill_empty_stages"]

#: How far above its lower bound a mesh-search candidate's partition search may stop (relative).
QUICK_GAP_RTOL = 0.01


class CandidatePruned(FxpipeError):
    """Raised by :func:`plan_with_options` with ``beat_s``: every placement candidate's schedule lower bound
    (:func:`fxpipe.schedule.bounds.recompute_lower_bound` of its partition's problem, valid for every schedule
    under every checkpoint choice and offload) is at least ``beat_s``, so none was scheduled.

    Attributes
    ----------
    lower_bound_s : float
        The smallest of those bounds (seconds).
    while_scheduling : bool
        Some candidate's bound was below ``beat_s`` but its schedule search
        (:func:`~fxpipe.schedule.auto.auto_schedule` with ``beat_s``) ran only the methods whose own
        bounds are below ``beat_s`` and they found no schedule (:class:`~fxpipe.schedule.auto.ScheduleCannotBeat`):
        no schedule of it beats ``beat_s`` that the planner would have found.
    """

    def __init__(self, message: str, lower_bound_s: float, while_scheduling: bool = False):
        super().__init__(message)
        self.lower_bound_s = float(lower_bound_s)
        self.while_scheduling = bool(while_scheduling)

    def __reduce__(self):  # raised in the mesh search's worker processes, pickled back
        return CandidatePruned, (str(self), self.lower_bound_s, self.while_scheduling)

#: What :func:`plan_graph` returns: the kept candidate's partition, problem, schedule and phase timings (seconds).
PlanResult = tuple[Partition, ScheduleProblem, Schedule, dict[str, float]]


def auto_milp_budget_s(problem: ScheduleProblem) -> float:
    """MILP budget (seconds) of ``schedule="auto"`` when none is given, scaled to the problem.

    :data:`DEFAULT_AUTO_MILP_TIME_LIMIT_S` times the problem's share of the largest problem
    the auto MILP takes (``3 S m`` compute ops against
    :data:`fxpipe.schedule.auto.AUTO_MILP_MAX_OPS`), at least :data:`AUTO_MILP_MIN_SHARE` of
    it: a toy of 2 stages and 4 micro-batches gets 1 s, a problem of 240 compute ops the full
    5 s. (Larger problems skip the MILP.)
    """
    n_ops = 3 * problem.num_stages * problem.num_microbatches
    share = min(1.0, max(AUTO_MILP_MIN_SHARE, n_ops / AUTO_MILP_MAX_OPS))
    return DEFAULT_AUTO_MILP_TIME_LIMIT_S * share


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
        spec = HARDWARE.get(str(graph.meta.get("hardware", "")))
        cap = None if spec is None else spec.memory_bytes
    return base if cap is None else dataclasses.replace(base, capacity_bytes=float(cap))


def _ops_reachable_from_output(graph: OpGraph) -> np.ndarray:
    """Mask of the ops that must share the output's stage (data-dependent sizes) and all they feed."""
    out = [i for i, op in enumerate(graph.ops) if op == "output"]
    moved = np.zeros(graph.n, dtype=bool)
    moved[out] = True
    if graph.data_dependent.any():
        # the output may consume a data-dependent-size tensor: move the ops that must share
        # its stage (fxpipe.partition.colocate) and everything they feed (stays monotone)
        group = colocation_groups(graph)
        if group is not None:
            moved = np.isin(group, group[out])
            stack = np.flatnonzero(moved).tolist()
            while stack:
                for w in graph.successors(stack.pop()).tolist():
                    if not moved[w]:
                        moved[w] = True
                        stack.append(w)
    return moved


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
    if used.size >= 2:
        a2[a == int(used.max())] = k - 1
    else:
        a2[_ops_reachable_from_output(graph)] = k - 1
    costs = block_costs(graph, a2, k, partition.objective, partition.comm)
    empty = sorted(set(range(k)) - set(np.unique(a2).tolist()))
    meta = {**partition.meta, "empty_stages": empty, "bottleneck_before_filling_s": partition.bottleneck}
    if memory is not None and "stage_memory_bytes" in meta:
        meta["stage_memory_bytes"] = stage_memory_bytes(graph, a2, k, partition.objective, memory, partition.comm).tolist()
    return Partition(k=k, assignment=a2, block_costs=costs, bottleneck=float(costs.max()), objective=partition.objective,
                     comm=partition.comm, order=partition.order, meta=meta)


def plan_graph(
    graph: OpGraph,
    *,
    devices: int,
    microbatches: int,
    objective: str = DEFAULTS.objective,
    schedule: str | None = DEFAULTS.schedule,
    stages_per_device: int | str = DEFAULTS.stages_per_device,
    placement: str = DEFAULTS.placement,
    time_limit_s: float = DEFAULTS.time_limit_s,
    schedule_time_limit_s: float | None = DEFAULTS.schedule_time_limit_s,
    seed: int = DEFAULTS.seed,
    mem_limit_bytes: float | None = DEFAULTS.mem_limit_bytes,
    host_bandwidth_bytes_per_s: float | None = DEFAULTS.host_bandwidth_bytes_per_s,
    progress: bool = DEFAULTS.progress,
    memory_bytes: float | None = None,
    memory: MemoryModel | None = None,
    activation_checkpointing: str = DEFAULTS.activation_checkpointing,
) -> PlanResult:
    """Partition, place and schedule an OpGraph (the torch-free half of :func:`fxpipe.compile`).

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
        A method of :data:`fxpipe.options.SCHEDULES` valid for the placement
        (:func:`fxpipe.schedule.dispatch.methods_for_placement`); with ``placement="auto"``
        only placements it schedules are candidates. ``"auto"`` (default): the fastest
        schedule that fits memory among the heuristics and, within ``schedule_time_limit_s``,
        the MILP, offloading and (in training) recomputing activations only where memory
        forces it (:func:`fxpipe.schedule.auto.auto_schedule`; the returned problem carries
        the recomputing stages). ``None``: :func:`fxpipe.schedule.dispatch.default_method`.
    stages_per_device : int or "auto"
        v >= 1 stages on every device, or ``"auto"``: try :data:`fxpipe.options.AUTO_STAGES_PER_DEVICE`.
    placement : {"looped", "v", "auto"}
        How the ``v * p`` stages are placed (ignored when v = 1).
    time_limit_s, seed, host_bandwidth_bytes_per_s, progress :
        Partition search budget (per stage count), seed, device-host bandwidth (enables
        offload), progress bars.
    schedule_time_limit_s : float, optional
        MILP budget per candidate in seconds (default :data:`fxpipe.options.DEFAULT_MILP_TIME_LIMIT_S`
        for ``"milp"``, :func:`auto_milp_budget_s` for ``"auto"``: up to
        :data:`fxpipe.options.DEFAULT_AUTO_MILP_TIME_LIMIT_S`, less for small problems; 0:
        ``"auto"`` without the MILP).
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
        - static state`` per device (:func:`fxpipe.memory.plan_view.schedule_mem_limit`).
    activation_checkpointing : {"auto", "none", "full", "selective"}
        Training only. ``"auto"`` (default): every stage gets a menu of checkpoint policies
        (:func:`fxpipe.memory.checkpoint.stage_menu`: none, per-block selective, budgeted and full
        checkpointing, whole-stage recomputation, each with its replay time and memory) and the
        schedule (``"auto"``) picks one per stage where memory forces it, the partition admitting
        a stage that fits only with one (:class:`fxpipe.partition.memory.PartitionMemory`
        ``checkpointing``); ``"full"`` / ``"selective"``: that per-block policy on every stage
        that has blocks; ``"none"``: no checkpointing at all. The chosen options are
        ``problem.checkpoint`` (:meth:`fxpipe.plan.Plan.activation_checkpointing` their policies).

    Returns
    -------
    (partition, problem, schedule, timings_s)
        The kept candidate's; ``problem.device_of_stage`` is its placement.

    Raises
    ------
    InputError
        On bad counts, an unknown objective, schedule or placement, a schedule the placement
        does not admit, or more stages than ops.
    InfeasibleError
        When nothing fits the device memory (the first candidate's error): from the
        partitioner (:func:`fxpipe.partition.memory.infeasible_error`: the overflow, the
        smallest device count that fits, and whether offload, recomputation or ZeRO sharding
        would help), from the static state of a device with several stages, or from the
        schedule (:func:`fxpipe.schedule.auto.auto_schedule`).
    """
    options = PlanOptions.from_keywords(locals())
    return plan_with_options(graph, devices=devices, microbatches=microbatches, options=options, memory=memory,
                             memory_bytes=memory_bytes)


def plan_with_options(graph: OpGraph, *, devices: int, microbatches: int, options: PlanOptions,
                      memory: MemoryModel | None = None, memory_bytes: float | None = None,
                      explain: bool = True, partitions: dict[int, Partition] | None = None,
                      beat_s: float | None = None) -> PlanResult:
    """:func:`plan_graph` with its options built: the memory model is :func:`resolve_memory` of
    ``memory`` and ``memory_bytes``, and every candidate of ``options.placement_candidates()`` is
    tried. Same returns and errors as :func:`plan_graph`; with ``explain=False`` (the mesh search's
    candidates but the pure pipeline) a partition that does not fit raises a short
    :class:`~fxpipe.errors.InfeasibleError` without the search for the device count and remedies
    (:func:`fxpipe.partition.memory.infeasible_error`), and the partition search stops within
    :data:`QUICK_GAP_RTOL` of its lower bound or after a quarter of its time limit (at least 1 s)
    without improvement (a candidate whose memory admits few partitions, or none, would otherwise
    search to the limit). ``partitions`` (stage count -> partition)
    are taken instead of partitioning: the mesh search passes a sibling's partition that is proven
    optimal and fits this memory too. ``beat_s`` (seconds; the mesh search's best predicted step so far): a
    placement candidate whose schedule lower bound after partitioning
    (:func:`fxpipe.schedule.bounds.recompute_lower_bound`: every valid schedule of its problem, under every
    checkpoint choice, offload included) is at least ``beat_s`` is not scheduled, and when none is left
    :class:`CandidatePruned` is raised; candidates below it are planned exactly as without it."""
    devices = check_count(devices, "devices")
    microbatches = check_count(microbatches, "microbatches")
    memory = resolve_memory(graph, memory, memory_bytes)
    if memory.offload_optimizer is True and options.objective == "training":
        optimizer_host_step_s(1.0, memory, host_links(graph))  # its cost needs the host's links: say so now
    search = _CandidateSearch(graph, devices, microbatches, options, memory)
    search.explain = explain
    search.beat_s = beat_s
    search.parts.update(partitions or {})
    for v, name in options.placement_candidates():
        search.try_candidate(v, name)
    return search.result()


class _CandidateSearch:
    """The state of :func:`plan_with_options`'s loop over ``(v, placement)`` candidates.

    Partitions are cached per stage count; every candidate gets a record (its figures, or
    why it was skipped); with a single candidate its error is raised instead of recorded.
    """

    def __init__(self, graph: OpGraph, devices: int, microbatches: int, options: PlanOptions, memory: MemoryModel):
        self.graph, self.devices, self.microbatches, self.options, self.memory = graph, devices, microbatches, options, memory
        self.checkpointing = options.objective == "training" and options.activation_checkpointing != "none"
        self.pmem = (PartitionMemory(memory, microbatches, "floor", checkpointing=self.checkpointing)
                     if math.isfinite(memory.capacity_bytes) else None)
        self.several = len(options.placement_candidates()) > 1
        self.timings: dict[str, float] = {"partition": 0.0, "schedule": 0.0}
        self.parts: dict[int, Partition | Exception] = {}
        self.tried: list[dict[str, Any]] = []
        self.best: tuple | None = None
        self.first_error: Exception | None = None
        self.menus: dict[tuple, list] = {}
        self.explain = True
        self.beat_s: float | None = None
        self.pruned: list[float] = []  # schedule lower bounds of the candidates not scheduled (>= beat_s)
        self.pruned_scheduling = 0  # of them, those whose schedule search found nothing that may beat beat_s

    def _skip(self, record: dict[str, Any], exc: Exception, *, counts: bool = True) -> None:
        """Record why a candidate is skipped (``counts``: its error may be the one raised when none is
        left); a single candidate raises ``exc`` instead."""
        if not self.several:
            raise exc
        if counts:
            self.first_error = self.first_error or exc
        record["skipped"] = str(exc)

    def try_candidate(self, v: int, name: str) -> None:
        """Partition, place and schedule one candidate, keeping it when its schedule is the fastest so far."""
        graph, devices, options = self.graph, self.devices, self.options
        k = v * devices
        dev = placement_of(name, devices, v)
        record: dict[str, Any] = {"stages_per_device": v, "placement": name if v > 1 else "looped"}
        self.tried.append(record)
        if k > graph.n:
            msg = (f"{v * devices} stages ({v} per device on {devices} devices) is more than the {graph.n} ops of "
                   "the graph: every stage needs at least one op; use fewer devices or stages per device")
            single = (f"devices={devices} x stages_per_device={v}: {msg}" if v > 1 else
                      f"devices={devices} is more than the {graph.n} ops of the graph: every stage needs "
                      "at least one op; use fewer devices")
            return self._skip(record, InputError(msg if self.several else single), counts=False)
        valid = methods_for_placement(dev, devices)
        method = options.schedule if options.schedule is not None else default_method(dev, devices)
        record["schedule"] = method
        if method not in valid:
            return self._skip(record, InputError(
                f"schedule {method!r} does not schedule the {record['placement']} placement with {v} stages per "
                f"device; use one of {', '.join(valid)}"), counts=False)
        part = self._partition(k)
        if isinstance(part, Exception):
            return self._skip(record, part)
        t0 = time.perf_counter()
        try:
            if self.beat_s is not None:  # before the checkpoint menus are built: the memory-blind bound of the
                # problem without them (no replay) is below every schedule under every checkpoint choice
                bound = round_trip_lower_bound(problem_from_partition(
                    graph, part, num_microbatches=self.microbatches, device_of_stage=dev))
                if self._pruned(record, bound):
                    return None
            problem = self._problem(part, dev, record)
            if self.beat_s is not None:  # the mesh search's best so far: no schedule of this problem can beat it
                bound = recompute_lower_bound(problem)
                if self._pruned(record, bound):
                    return None
            problem, sched = self._schedule(problem, method)
        except ScheduleCannotBeat as exc:
            record["skipped"] = f"pruned while scheduling: {exc}"
            self.pruned.append(bound)
            self.pruned_scheduling += 1
            return None
        except InfeasibleError as exc:
            return self._skip(record, exc)
        finally:
            self.timings["schedule"] += time.perf_counter() - t0
        record["step_time_s"] = float(sched.value)  # the schedule objective's value (stage_span: largest device span)
        record["stage_span_s"], record["makespan_s"] = float(sched.stage_span), float(sched.makespan)
        if self.best is None or sched.value < self.best[2].value * (1 - 1e-9):
            self.best = (part, problem, sched, record)

    def _partition(self, k: int) -> Partition | Exception:
        """The partition into ``k`` stages (cached; an InfeasibleError is cached and returned with several
        candidates, raised with one)."""
        from fxpipe.partition.search import partition as run_partition  # lazy: numba kernels

        if k in self.parts:
            return self.parts[k]
        opts, t0 = self.options, time.perf_counter()
        try:
            with phase(f"partition into {k} stages (up to {opts.time_limit_s:g} s)", on=opts.progress):
                quick = None
                if not self.explain:  # a mesh search's candidate: the search stops within 1 % of its bound, and
                    # after a quarter of its time limit without improvement
                    from fxpipe.partition.brkga import BRKGAParams  # noqa: PLC0415 (lazy: numba kernels)
                    from fxpipe.partition.search import STALL_GENERATIONS  # noqa: PLC0415

                    quick = BRKGAParams(stall_generations=STALL_GENERATIONS,
                                        stall_time_s=min(opts.time_limit_s, max(1.0, 0.25 * opts.time_limit_s)))
                part = run_partition(self.graph, k, objective=opts.objective, comm="relay", time_limit_s=opts.time_limit_s,
                                     seed=opts.seed, progress=opts.progress, memory=self.pmem, _explain=self.explain,
                                     brkga_params=quick, **({} if self.explain else {"_gap_rtol": QUICK_GAP_RTOL}))
            part = fill_empty_stages(self.graph, part, self.pmem)
            # data-dependent sizes never cross stages (the search honours it; filling may not)
            check_no_forbidden_cuts(self.graph, part.assignment, what=f"the partition into {k} stages")
        except InfeasibleError as exc:
            if not self.several:
                raise
            part = exc
        finally:
            self.timings["partition"] += time.perf_counter() - t0
        self.parts[k] = part
        return part

    def _pruned(self, record: dict[str, Any], bound: float) -> bool:
        """Whether a schedule lower bound ``bound`` (seconds) of the candidate is no better than ``beat_s``; if so
        the candidate is recorded as pruned with it."""
        if bound < self.beat_s:
            return False
        record["skipped"] = f"pruned: its schedule lower bound {bound:.6g} s is no better than {self.beat_s:.6g} s"
        self.pruned.append(bound)
        return True

    def _problem(self, part: Partition, dev, record: dict[str, Any]) -> ScheduleProblem:
        """The scheduling problem of ``part`` placed by ``dev`` under the memory limit (the user's pinned
        checkpoint policy applied)."""
        graph, opts, m, k = self.graph, self.options, self.microbatches, part.k
        limit = schedule_mem_limit(graph, part.assignment, k, dev, self.memory, m, opts.objective)
        if opts.mem_limit_bytes is not None:
            limit = np.minimum(limit, float(opts.mem_limit_bytes))
        pooled = stage_static(graph, part.assignment, k, self.memory, m, opts.objective, dev).pooled_buffer_bytes
        problem = problem_from_partition(graph, part, num_microbatches=m, mem_limit_bytes=limit,
                                         host_bandwidth_bytes_per_s=opts.host_bandwidth_bytes_per_s, device_of_stage=dev,
                                         pooled_buffer_bytes=pooled, checkpoint_menu=self._menus(part))
        pinned = opts.activation_checkpointing if opts.objective == "training" else "none"
        if pinned in ("full", "selective"):  # the user's policy on every stage that has it
            problem = problem.with_checkpoint({s: pinned for s in range(k)
                                               if any(o.name == pinned for o in problem.checkpoint_menu[s])})
        record["device_bottleneck_s"] = float(device_costs(graph, part.assignment, dev, opts.objective, "relay").max())
        record["stage_bottleneck_s"] = float(part.bottleneck)
        return problem

    def _schedule(self, problem: ScheduleProblem, method: str) -> tuple[ScheduleProblem, Schedule]:
        """The schedule of ``problem`` by ``method`` (``"auto"``: with the checkpoint policies it chooses)."""
        opts, m, k = self.options, self.microbatches, problem.num_stages
        pinned = opts.activation_checkpointing if opts.objective == "training" else "none"
        if method == "auto":
            budget = auto_milp_budget_s(problem) if opts.schedule_time_limit_s is None else opts.schedule_time_limit_s
            with phase(f"schedule {k} stages x {m} micro-batches (auto, MILP up to {budget:g} s)", on=opts.progress):
                chosen = auto_schedule(problem, recompute=pinned != "none", time_limit_s=budget,
                                       progress=opts.progress, beat_s=self.beat_s)
            return chosen.problem, chosen.schedule
        budget = DEFAULT_MILP_TIME_LIMIT_S if opts.schedule_time_limit_s is None else opts.schedule_time_limit_s
        with phase(f"schedule {k} stages x {m} micro-batches ({method})", on=opts.progress):
            try:
                return problem, make_schedule(problem, method, time_limit_s=budget, progress=opts.progress)
            except InfeasibleError:
                # a pinned policy's split backward holds every W input from B to W; its fused variant (B and W as
                # one full backward, as 1F1B runs them) holds one segment's replay: the published per-block
                # checkpointing under a pinned 1F1B-like method
                fused = {s: f"{pinned}-fused" for s in range(k) if problem.checkpoint[s] == pinned
                         and any(o.name == f"{pinned}-fused" for o in problem.checkpoint_menu[s])}
                if pinned not in ("full", "selective") or not fused:
                    raise
                problem = problem.with_checkpoint(fused)
                return problem, place_fused_w(problem, make_schedule(problem, method, time_limit_s=budget,
                                                                     progress=opts.progress))

    def _menus(self, part: Partition) -> list[list] | None:
        """The activation-checkpoint options of every stage of ``part`` besides ``"none"`` (cached per
        partition; :func:`fxpipe.memory.checkpoint.menu_for_request` of the options' request), or None in
        inference, where there is no backward to replay for."""
        if self.options.objective != "training":
            return None
        key = (part.k, part.assignment.tobytes())
        if key not in self.menus:
            a = np.asarray(part.assignment)
            # per-block FSDP2 units run per-block segments, not a whole-stage replay (fxpipe.codegen.mesh.check_block_units_run)
            drop = ("stage",) if getattr(self.memory, "block_units", False) else ()
            self.menus[key] = [[e.option() for e in menu_for_request(self.graph, np.flatnonzero(a == s),
                                                                     self.options.activation_checkpointing)
                                if e.policy.kind not in drop]
                               for s in range(part.k)]
        return self.menus[key]

    def result(self) -> PlanResult:
        """The fastest candidate's (partition, problem, schedule, timings); its schedule's
        ``meta["placement_search"]`` lists every candidate when there were several."""
        if self.best is None:
            if self.first_error is not None:
                raise self.first_error
            if self.pruned and len(self.pruned) == len(self.tried):
                low = min(self.pruned)
                if self.pruned_scheduling:
                    raise CandidatePruned(f"pruned while scheduling: no schedule found that may beat {self.beat_s:.6g} s "
                                          f"(its schedule lower bound {low:.6g} s)", low, while_scheduling=True)
                raise CandidatePruned(f"pruned after partitioning: its schedule lower bound {low:.6g} s is no better "
                                      f"than {self.beat_s:.6g} s", low)
            raise InputError("no placement candidate could be planned: " + "; ".join(r["skipped"] for r in self.tried))
        part, problem, sched, record = self.best
        if self.several:
            record["chosen"] = True
            sched = dataclasses.replace(sched, meta={**sched.meta, "placement_search": self.tried})
        return part, problem, sched, self.timings
