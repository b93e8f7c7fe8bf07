"""The :class:`Plan`: what ``fxpipe.compile`` returns, saved as ``fxpipe.plan/2`` JSON.

A plan is frozen plain data (the costed op graph, the partition into stages, the placement of
the stages on the devices, the schedule problem and the timed schedule, the per-stage and
per-device figures) plus, for a plan made in this process, the captured fx program (runtime
state in :attr:`Plan.capture`, not plan data). :meth:`Plan.orders` is the typed handoff to code
generation (:class:`fxpipe.ir.Orders`, per device, with the placement). The operations on a
plan live in their own modules, and ``Plan`` keeps thin methods for them:
:meth:`Plan.to_dict` / :meth:`Plan.from_dict` (:mod:`fxpipe.plan.file`, the file format and the
loader of older files), :meth:`Plan.build` (:mod:`fxpipe.plan.build`: this rank's
``torch.distributed.pipelining`` stages and runtime), :meth:`Plan.reschedule`
(:mod:`fxpipe.plan.reschedule`) and :meth:`Plan.train_local` (:mod:`fxpipe.plan.train`: local gloo
ranks next to a single-process reference). The stage and device tables are
:mod:`fxpipe.plan.tables`'s. A loaded plan re-captures the model and checks that the graph is
the one the plan was made for (:func:`graph_signature`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.io import format_bytes, format_ms, ms_column
from fxpipe.ir import OpGraph, Orders, Schedule, ScheduleProblem, read_json, schedule_to_orders, write_json_atomic
from fxpipe.memory import MemoryModel
from fxpipe.memory.checkpoint import plan_policies, policies_match
from fxpipe.mesh import (MESH_DIMS, Topology, device_host_step_s, device_num_params, dim_span, dp_links, format_mesh,
                         format_rank_order, mesh_degrees, mesh_dp, mesh_tp, normalize_mesh, normalize_rank_order,
                         pipeline_dp_sync_s, pipeline_step_s, pure_pipeline)
from fxpipe.mesh.tensor_parallel import TP_COSTS_KEY, TensorParallelLayout, graph_tensor_parallel, stage_tensor_parallel
from fxpipe.partition.objective import Partition
from fxpipe.partition.placement import placement_name
from fxpipe.plan.build import PlanStageOf, build_rank, compile_stages_option
from fxpipe.plan.build import replica_batch as _replica_batch
from fxpipe.plan.build import worker_stage_of as _worker_stage_of
from fxpipe.plan.file import PLAN_FORMAT, graph_signature, plan_fields_from_dict, plan_to_dict
from fxpipe.plan.tables import MEMORY_FIELDS, DeviceStats, StageStats  # noqa: F401 (public re-exports)
from fxpipe.plan.reschedule import reschedule as _reschedule
from fxpipe.schedule.bounds import combinatorial_lower_bound, device_span_bounds
from fxpipe.schedule.validate import device_spans
from fxpipe.plan.train import train_local as _train_local

__all__ = ["Plan", "StageStats", "DeviceStats", "PLAN_FORMAT", "graph_signature", "load_plan"]

#: The plan's stage map for worker processes (:func:`fxpipe.plan.build.worker_stage_of`); old name.
_PlanStageOf = PlanStageOf

#: A stage whose work is under this share of the bottleneck stage's cost counts as idle
#: (:meth:`Plan.waste_warnings`).
IDLE_STAGE_SHARE = 0.05


@dataclass(eq=False)
class CaptureCell:
    """The captured fx program a plan builds its ranks from: runtime state beside the frozen plan data.

    ``traced`` is the capture (:class:`fxpipe.passes.TracedModel`; None for a plan loaded from
    a file until :meth:`Plan.captured` or :meth:`Plan.adopt_capture`), ``stage_of`` the stage
    map keyed by its node names (None: the plan's own ``stage_of``). Plans made from one
    another (:meth:`Plan.reschedule`) share the cell.
    """

    traced: Any = None
    stage_of: dict | None = None


@dataclass(frozen=True)
class Plan:
    """A pipeline plan: the partition of every op into stages and the schedule (frozen data).

    Derive a changed plan with :func:`dataclasses.replace` (or :meth:`replace`); the JSON
    document is :meth:`to_dict` / :meth:`from_dict` (``fxpipe.plan/2``, reads ``/1``).

    Attributes
    ----------
    name : str
        Model name.
    devices : int
        Number of devices p of the pipeline (pipeline ranks, ``mesh["pp"]``); the plan has
        ``num_stages = v * p`` stages, ``stages_per_device`` = v on each, placed by
        ``problem.device_of_stage``. A mesh plan runs on :attr:`world_size` devices.
    microbatches : int
        Micro-batches per training step of the pipeline (of one data-parallel replica; the
        global number per optimizer step is :attr:`global_microbatches`).
    hardware : str
        Hardware profile the costs are for (see :mod:`fxpipe.cost.hardware`).
    objective, comm : str
        Contract-2 objective the partition minimises; comm is ``"relay"`` because the
        ``torch.distributed.pipelining`` runtime only talks to adjacent stages.
    graph : OpGraph
        The costed op graph.
    partition : Partition
        Stage of every OpGraph node and per-stage costs.
    stage_of : dict[str, int]
        Stage of every fx node (by node name) that is an OpGraph node.
    problem : ScheduleProblem
        The scheduling problem built from the partition, with the placement
        (``device_of_stage``, ``num_devices``).
    schedule : Schedule
        The timed F / B / W (/ O / R) schedule.
    stages : list[StageStats]
        Per-stage figures (the stage table).
    device_table : list[DeviceStats]
        Per-device figures (filled by ``fxpipe.compile`` and on load).
    memory : MemoryModel
        The memory model the plan was made with (capacity, precision policy, ZeRO, reserved
        fraction); its activation budget is the schedule problem's ``mem_limit``.
    timings_s : dict[str, float]
        Wall time of each phase (capture, cost, partition, schedule).
    graph_signature : str
        Hash of the op graph's structure, checked when a loaded plan is rebuilt.
    mesh : dict
        ``{"pp": p, "dp_shard": b, "dp_replicate": c}`` (:mod:`fxpipe.mesh`): ``b * c``
        data-parallel replicas of this pipeline; with ``"tp": t`` (tensor parallelism, only
        when t > 1) every pipeline rank is ``t`` devices sharing each stage's matmuls
        (:mod:`fxpipe.mesh.tensor_parallel`); default (and plans saved before meshes) the
        pure pipeline ``{"pp": devices, "dp_shard": 1, "dp_replicate": 1}``. An ``"order"``
        entry given here becomes :attr:`rank_order`.
    rank_order : tuple[str, str, str]
        The mesh dimensions outermost first, how global ranks map to mesh coordinates
        (:func:`fxpipe.mesh.rank_coords`); default (and plans saved without it) the pipeline rank
        innermost, :data:`fxpipe.mesh.MESH_DIMS`.
    activation_checkpointing : tuple[CheckpointPolicy, ...]
        The activation-checkpoint policy of every stage (:class:`fxpipe.memory.checkpoint.CheckpointPolicy`:
        its kind, the segments B replays by node name, the outputs F keeps, replay time and
        bytes), the option ``problem.checkpoint`` names; derived from the graph and the problem
        when not given (or given for another problem), so a plan saved before issue 28 has
        ``"stage"`` for its recomputing stages and ``"none"`` elsewhere.
    options : dict
        The options the plan was made with (seed, time limit, resolved schedule, ...; the
        ``torch.compile`` backend adds its own), and what happened while it was made:
        ``interrupted`` (true when Ctrl-C stopped its searches, :attr:`interrupted`) and
        ``warnings`` (fxpipe's warnings raised meanwhile, :meth:`all_warnings`).
    capture : CaptureCell
        The captured fx program (runtime state, not saved, not compared).
    """

    name: str
    devices: int
    microbatches: int
    hardware: str
    objective: str
    comm: str
    graph: OpGraph
    partition: Partition
    stage_of: dict[str, int]
    problem: ScheduleProblem
    schedule: Schedule
    stages: list[StageStats]
    timings_s: dict[str, float] = field(default_factory=dict)
    graph_signature: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    device_table: list[DeviceStats] = field(default_factory=list)
    memory: MemoryModel = field(default_factory=MemoryModel)
    mesh: dict = field(default_factory=dict)
    rank_order: tuple = MESH_DIMS
    activation_checkpointing: tuple = ()
    capture: CaptureCell = field(default_factory=CaptureCell, repr=False, compare=False)

    def __post_init__(self) -> None:
        mesh = pure_pipeline(self.devices) if not self.mesh else normalize_mesh(self.mesh)
        order = normalize_rank_order(mesh.get("order", self.rank_order))
        mesh = mesh_degrees(mesh)
        object.__setattr__(self, "mesh", mesh)  # frozen: the one normalisation on construction
        object.__setattr__(self, "rank_order", order)
        if mesh["pp"] != self.devices:
            raise InputError(f"plan mesh {mesh} disagrees with its {self.devices} pipeline devices (pp)")
        policies = tuple(self.activation_checkpointing or ())
        if not policies_match(policies, self.problem):  # not given, or of another problem (a replaced one)
            policies = plan_policies(self.graph, self.partition.assignment, self.problem)
        object.__setattr__(self, "activation_checkpointing", policies)

    def replace(self, **changes: Any) -> "Plan":
        """A copy with ``changes`` (:func:`dataclasses.replace`; the capture is shared)."""
        return dataclasses.replace(self, **changes)

    @property
    def _captured(self):
        """The captured fx program or None (``capture.traced``)."""
        return self.capture.traced

    # ------------------------------------------------------------------ mesh (fxpipe.mesh)
    @property
    def dp(self) -> int:
        """Data-parallel replicas of the pipeline (``dp_shard * dp_replicate``)."""
        return mesh_dp(self.mesh)

    @property
    def tp(self) -> int:
        """Tensor-parallel degree (devices per pipeline rank; 1 without tensor parallelism)."""
        return mesh_tp(self.mesh)

    @property
    def world_size(self) -> int:
        """All devices of the plan: ``pp * dp_shard * dp_replicate * tp`` (= ``devices`` for a pure pipeline)."""
        return self.devices * self.dp * self.tp

    @property
    def tensor_parallel(self) -> TensorParallelLayout:
        """What tensor parallelism splits at this plan's ``tp`` (:func:`fxpipe.mesh.tensor_parallel.resolve_tensor_parallel`
        of the graph's record): every split parameter's placement, sequence parallelism, notes."""
        cached = self.__dict__.get("_tensor_parallel")
        if cached is None or cached.tp != self.tp:
            cached = graph_tensor_parallel(self.graph, self.tp)
            self.__dict__["_tensor_parallel"] = cached
        return cached

    def tensor_parallel_stages(self) -> list[dict]:
        """Per stage, the share of its FLOPs tensor parallelism splits and why a stage gets none
        (:func:`fxpipe.mesh.tensor_parallel.stage_tensor_parallel`)."""
        return stage_tensor_parallel(self.graph, self.partition.assignment, self.num_stages, self.tensor_parallel)

    def tensor_parallel_warnings(self) -> list[str]:
        """Sentences about tensor parallelism (none with ``tp = 1``): what it does not split (odd vocabularies,
        the sequence length) and the stages it is not offered for, with the reason."""
        if self.tp == 1:
            return []
        layout = self.tensor_parallel
        out = [f"tensor parallelism: {note}" for note in layout.notes]
        for row in self.tensor_parallel_stages():
            if row["reason"]:
                out.append(f"stage {row['stage']}: tensor parallelism not offered (its tp={self.tp} ranks each compute "
                           f"it whole): {row['reason']}")
        return out

    @property
    def global_microbatches(self) -> int:
        """Micro-batches per optimizer step over all replicas (``microbatches * dp``)."""
        return self.microbatches * self.dp

    @property
    def dp_sync_s(self) -> float:
        """Data-parallel communication per step of the busiest device (seconds; 0 for a pure pipeline).

        :func:`fxpipe.mesh.dp_sync_time_s` of every device's parameter bytes at the graph's
        bandwidth, the largest; not overlapped with the pipeline and not in the schedule.
        """
        return pipeline_dp_sync_s(self.graph, self.partition.assignment, self.device_of_stage, self.mesh,
                                  self.rank_order, memory=self.memory, num_microbatches=self.microbatches)

    @property
    def predicted_step_s(self) -> float:
        """Predicted step time with the data-parallel sync the pipeline does not hide (seconds).

        :func:`fxpipe.mesh.pipeline_step_s`: ``schedule.value`` for a pure pipeline; with one
        stage per device the all-gather hides behind each device's wait for its first input and
        the reductions behind the cool-down, as torch's pipelining runtime issues them.
        """
        return pipeline_step_s(self.graph, self.partition.assignment, self.device_of_stage, self.schedule, self.mesh,
                               self.rank_order, memory=self.memory)

    @property
    def optimizer_host_step_s(self) -> float:
        """The longest per-device optimizer step on the host (seconds; 0 unless ``memory.offload_optimizer``):
        :func:`fxpipe.mesh.optimizer_host_step_s`, part of :attr:`predicted_step_s`."""
        return max(device_host_step_s(self.graph, self.partition.assignment, self.device_of_stage, self.devices,
                                      self.memory), default=0.0)

    def mesh_summary(self) -> list[str]:
        """Summary lines for a plan with data parallelism or a mesh search (none for a pinned pure pipeline):
        the mesh, the links its data-parallel groups use, and the table of the meshes searched."""
        lines = _mesh_search_table(self.options.get("mesh_search") or [])
        why = self.no_pipeline_reason()
        if why:
            lines.insert(0, why)
        if self.memory.offload_optimizer is True:
            max_params = float(device_num_params(self.graph, self.partition.assignment, self.device_of_stage,
                                                 self.devices).max())
            lines.insert(0, f"optimizer state offloaded to the host (FSDP2 CPUOffloadPolicy): "
                            f"{format_bytes(self.memory.host_bytes_per_param('training') * max_params)} "
                            f"of host memory and a {format_ms(self.optimizer_host_step_s)} host step on the busiest "
                            "device, in the predicted step")
        if self.tp > 1:
            lines.insert(0, self._tensor_parallel_line())
        if self.dp == 1:
            return lines
        ds, dr = self.mesh["dp_shard"], self.mesh["dp_replicate"]
        how = ("FSDP2 fully_shard over dp_shard" + (" per block, then the stage" if self.memory.block_units else "")
               + (", HSDP with dp_replicate" if dr > 1 else "")) if ds > 1 else \
            "replicate (DDP) over dp_replicate"
        topology = Topology.of_graph(self.graph)
        used = []
        for dim, degree, coll, kind in (("dp_shard", ds, "all-gather + reduce-scatter", "all_gather"),
                                        ("dp_replicate", dr, "all-reduce", "all_reduce")):
            links = dp_links(self.mesh, self.graph.bandwidth_bytes_per_s, topology=topology, order=self.rank_order,
                             kind=kind)
            if degree > 1:
                where = "" if topology is None else \
                    (" inside a node" if topology.in_node(*dim_span(self.mesh, dim, self.rank_order), self.world_size)
                     else " across nodes")
                used.append(f"{coll} over {dim}={degree}{where} at {links[dim][0] / 1e9:g} GB/s")
        return [f"mesh {format_mesh(self.mesh)} on {self.world_size} devices: {self.dp} data-parallel replicas of this "
                f"pipeline, {self.global_microbatches} micro-batches per step ({self.microbatches} per replica); {how}; "
                f"ranks ordered {format_rank_order(self.rank_order)} (outermost first)",
                f"data-parallel sync per step: {format_ms(self.dp_sync_s)} on the busiest device ({'; '.join(used)}); "
                f"predicted step with it {format_ms(self.predicted_step_s)} "
                f"({format_ms(self.predicted_step_s - self.schedule.value)} not hidden by the pipeline)", *lines]

    def no_pipeline_reason(self) -> str | None:
        """Why the mesh search chose no pipeline: one summary line, or None.

        Only for a plan whose mesh search (``mesh="auto"``, ``plan.options["mesh_search"]``)
        chose pure data parallelism (``pp = 1``) although a pipeline (``pp > 1``) was a
        candidate: the best pipeline's predicted step (or, when none was planned, why the best
        one by its lower bound was skipped) beside the chosen mesh's, and how to force a
        pipeline (``--mesh pipeline``, ``mesh="pipeline"``). Figures are the search table's
        rows (:func:`fxpipe.mesh.search.search_mesh`), in milliseconds.
        """
        rows = self.options.get("mesh_search") or []
        pipes = [r for r in rows if int(r.get("mesh", {}).get("pp", 1)) > 1]
        if self.devices != 1 or not pipes:
            return None
        chosen = next((r for r in rows if r.get("chosen")), None)
        step = chosen["predicted_step_s"] if chosen and "predicted_step_s" in chosen else self.predicted_step_s
        here = f"{chosen['mesh_text'] if chosen else format_mesh(self.mesh)} predicts {step * 1e3:.3f} ms per step"
        force = "--mesh pipeline (mesh=\"pipeline\") forces a pipeline"
        planned = [r for r in pipes if "predicted_step_s" in r]
        if planned:
            best = min(planned, key=lambda r: r["predicted_step_s"])
            return (f"no pipeline: the best pipeline, {best['mesh_text']}, predicts {best['predicted_step_s'] * 1e3:.3f} "
                    f"ms per step; {here}; {force}")
        best = min(pipes, key=lambda r: r.get("lower_bound_s", float("inf")))
        return (f"no pipeline: no pipeline was planned (the best by its lower bound, {best['mesh_text']}, "
                f"{best.get('skipped', 'was not planned')}); {here}; {force}")

    def _tensor_parallel_line(self) -> str:
        """The summary line of tensor parallelism: what is split, sequence parallelism, the collectives' time."""
        layout = self.tensor_parallel
        costs = (self.graph.meta or {}).get(TP_COSTS_KEY)
        regions = (self.graph.meta or {}).get("tensor_parallel", {}).get("regions", [])
        kinds: dict[str, int] = {}
        for r in regions:
            if int(r["id"]) in layout.regions:
                kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
        sharded = sum(1 for v in layout.params.values() if v.startswith("Shard"))
        gqa = sum(len(v) for v in layout.replicated_columns.values())
        return (f"tensor parallelism tp={self.tp} (innermost, consecutive ranks): {len(layout.regions)} of "
                f"{len(regions)} column/row regions split ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), "
                f"{sharded} parameters sharded"
                + (f", {gqa} k/v projections replicated (fewer kv heads than tp)" if gqa else "")
                + f"; sequence parallelism {'on' if layout.sequence_parallel else 'off'}"
                + (f"; collectives per micro-batch {costs['collective_fwd_s'] * 1e3:.3f} ms forward, "
                   f"{costs['collective_bwd_s'] * 1e3:.3f} ms backward (not overlapped)" if costs else
                   "; costs as for tp=1 (a plan file made before tensor parallelism was costed)"))

    # ------------------------------------------------------------------ placement
    @property
    def num_stages(self) -> int:
        """Number of pipeline stages (``stages_per_device * devices``)."""
        return int(self.partition.k)

    @property
    def stages_per_device(self) -> int:
        """v, the stages every device holds."""
        return self.num_stages // self.devices

    @property
    def device_of_stage(self) -> tuple[int, ...]:
        """Device (rank) of every stage."""
        return tuple(self.problem.device_of_stage)

    @property
    def placement(self) -> str:
        """``"looped"`` (also one stage per device), ``"v"`` or ``"custom"`` (:func:`fxpipe.partition.placement.placement_name`)."""
        return placement_name(self.device_of_stage, self.devices)

    # ------------------------------------------------------------------ figures
    @property
    def bottleneck_s(self) -> float:
        """Cost of the bottleneck device under the plan's objective (seconds).

        The largest per-device cost (its stages' work plus its transfers to other devices,
        :func:`fxpipe.partition.placement.device_costs`); with one stage per device, the
        bottleneck stage of the partition.
        """
        if self.device_table:
            return float(max(d.cost_s for d in self.device_table))
        return float(self.partition.bottleneck)

    @property
    def makespan_s(self) -> float:
        """Simulated makespan of one training step's schedule (seconds)."""
        return float(self.schedule.makespan)

    @property
    def bubble_ratio(self) -> float:
        """Idle fraction of the pipeline: ``1 - busy / (devices * makespan)``."""
        busy = self.microbatches * float(np.sum(self.problem.t_f + self.problem.t_b + self.problem.t_w))
        span = self.makespan_s
        return 0.0 if span <= 0 else max(0.0, 1.0 - busy / (self.devices * span))

    def optimality(self) -> dict[str, Any]:
        """What the schedule minimises, and every step-time figure beside its own lower bound.

        The schedule generators minimise the problem's objective (``plan.schedule.objective``,
        normally ``"stage_span"``: the largest per-device span, first F to last W on one device,
        the step time when consecutive steps overlap; OptPipe Eq. 3). The makespan (first op to
        last op of one step, OptPipe Eq. 4) is a different quantity with its own bound
        (:func:`fxpipe.schedule.bounds.combinatorial_lower_bound` of the makespan objective,
        and never below the stage-span bound since every device span lies inside the makespan).

        Returns
        -------
        dict
            ``schedule_objective`` (``"stage_span"`` or ``"makespan"``), ``schedule_method``,
            ``stage_span`` and ``makespan``: each ``{"value_s", "lower_bound_s", "status",
            "above_bound"}`` with ``status`` ``"optimal"`` (meets its bound, or proven by the
            MILP), the schedule's own status (``"heuristic"``, ``"timelimit"``, ...) for the
            minimised figure, or ``"not minimised"``; ``above_bound`` is ``value / bound - 1``
            (None without a bound): the figure is at most that fraction above its optimum.
            ``devices``: per device ``{"device", "span_s", "span_lower_bound_s"}``
            (:func:`fxpipe.schedule.bounds.device_span_bounds`). Times in seconds.
        """
        cached = self.__dict__.get("_optimality")
        if cached is not None and cached[0] is self.schedule:
            return cached[1]

        sched, problem = self.schedule, self.problem
        minimised = sched.objective
        bounds: dict[str, float] = {}
        for name in ("stage_span", "makespan"):
            mine = float(sched.lower_bound_s) if name == minimised else 0.0
            try:
                comb = combinatorial_lower_bound(problem.with_objective(name))
            except Exception:  # noqa: BLE001 - a bound is a courtesy; a figure without one is still shown
                comb = 0.0
            bounds[name] = max(mine, float(comb))
        bounds["makespan"] = max(bounds["makespan"], bounds["stage_span"])  # every device span lies in the makespan
        out: dict[str, Any] = {"schedule_objective": minimised, "schedule_method": sched.method}
        for name, value in (("stage_span", float(sched.stage_span)), ("makespan", float(sched.makespan))):
            lb = bounds[name]
            above = (value / lb - 1.0) if lb > 0 else None
            if lb > 0 and value <= lb * (1 + 1e-6):
                status = "optimal"
            elif name == minimised:
                status = "optimal" if sched.status == "optimal" else (sched.status or "heuristic")
            else:
                status = "not minimised"
            out[name] = {"value_s": value, "lower_bound_s": lb, "status": status,
                         "above_bound": None if above is None else max(0.0, above)}
        try:
            dev_lb = device_span_bounds(problem)
        except Exception:  # noqa: BLE001
            dev_lb = np.zeros(problem.num_devices)
        spans = device_spans(problem, sched.ops)
        out["devices"] = [{"device": d, "span_s": float(spans[d]), "span_lower_bound_s": float(dev_lb[d])}
                          for d in range(problem.num_devices)]
        self.__dict__["_optimality"] = (sched, out)
        return out

    def waste_warnings(self) -> list[str]:
        """Sentences about devices the plan wastes, each with the better choice (empty: none).

        * Fewer micro-batches than devices: the pipeline never fills; use at least ``devices``
          micro-batches (4x amortises the warm-up) or fewer devices.
        * Stages with almost no work (under :data:`IDLE_STAGE_SHARE` of the bottleneck's
          cost) or stages holding on average under half the bottleneck's work, while the work
          would fill fewer devices at the plan's bottleneck: a few large ops set the bottleneck
          and the other devices idle; the device count that the total work fills at this
          bottleneck, ``ceil(total work / bottleneck / v)``, is suggested.
        """
        out = []
        p, m, v = self.devices, self.microbatches, self.stages_per_device
        if m < p:
            out.append(f"{m} micro-batches for {p} devices: the pipeline never fills, so devices idle through most of "
                       f"the step (bubble ratio {self.bubble_ratio:.0%}); use at least {p} micro-batches "
                       f"(e.g. {4 * p}) or at most {m} devices")
        if not self.stages or self.num_stages < 2:
            return out
        work = np.array([s.t_fwd_s + (s.t_bwd_input_s + s.t_bwd_weight_s if self.objective == "training" else 0.0)
                         for s in self.stages])
        bottleneck = float(max(s.cost_s for s in self.stages))
        if bottleneck <= 0:
            return out
        idle = [s.stage for s, w in zip(self.stages, work) if w < IDLE_STAGE_SHARE * bottleneck]
        share = float(work.sum()) / (self.num_stages * bottleneck)  # average stage work / bottleneck
        fill_stages = max(1, int(np.ceil(float(work.sum()) / bottleneck - 1e-9)))
        fill_devices = max(1, int(np.ceil(fill_stages / v)))
        if fill_devices < p and (idle or share < 0.5):
            shown = ", ".join(map(str, idle[:8])) + (", ..." if len(idle) > 8 else "")
            out.append(f"the stages hold on average {share:.0%} of the bottleneck stage's {format_ms(bottleneck)}"
                       + (f", {len(idle)} of {self.num_stages} almost none (under {IDLE_STAGE_SHARE:.0%}: stages {shown})"
                          if idle else "")
                       + f"; the bottleneck is set by a few large ops, so the other devices idle: the work would fill "
                       f"about {fill_devices} devices at this bottleneck: plan for {fill_devices} devices instead of {p}")
        return out

    @property
    def interrupted(self) -> bool:
        """True when Ctrl-C stopped the searches that made this plan (mesh search, partition, schedule):
        it is the best plan found by then, not the result of the whole search."""
        return bool(self.options.get("interrupted"))

    def all_warnings(self) -> list[str]:
        """Every warning about this plan, each once: what fxpipe warned while making it (a capture on
        meta with a device branch, a mesh search stopped by Ctrl-C, ...; ``options["warnings"]``), then
        :meth:`waste_warnings` and :meth:`tensor_parallel_warnings`."""
        out: list[str] = []
        for w in [*(self.options.get("warnings") or []), *self.waste_warnings(), *self.tensor_parallel_warnings()]:
            if str(w) not in out:
                out.append(str(w))
        return out

    def summary(self) -> str:
        """A readable stage table (and device table with several stages per device), the memory
        table, and what the schedule minimises: the per-device span and the makespan, each
        beside its own lower bound and status (:meth:`optimality`), the bottleneck and bubble
        ratio. Parameter sizes are the memory model's (the plan's precision policy)."""
        v = self.stages_per_device
        where = (f"{self.devices} devices" if v == 1 else
                 f"{self.num_stages} stages on {self.devices} devices ({v} per device, {self.placement} placement)")
        if self.dp > 1:  # mesh (fxpipe.mesh): the table is one pipeline of the replicas
            where = f"a pipeline of {where} x {self.dp} data-parallel replicas"
        if self.tp > 1:
            where += f", each pipeline rank {self.tp} tensor-parallel devices ({self.world_size} devices in all)"
        lines = [
            *(["interrupted (Ctrl-C): this plan is the best found before the search was stopped, not the result of "
               "the whole search; run again without interrupting for the full search"] if self.interrupted else []),
            f"fxpipe plan for {self.name!r}: {where}, {self.microbatches} micro-batches, "
            f"hardware {self.hardware}, objective {self.objective}, schedule {self.schedule.method}",
            *self.mesh_summary(),
            f"{'stage':>5} {'device':>6} {'ops':>6} {'params':>10} {'F ms':>9} {'B ms':>9} {'W ms':>9} {'cost ms':>9} "
            f"{'memory':>10} {'checkpoint':>10}",
        ]
        worst = int(np.argmax([s.cost_s for s in self.stages])) if self.stages and v == 1 else -1
        names = self.problem.checkpoint
        times = list(zip(*(ms_column([getattr(s, k) for s in self.stages])
                           for k in ("t_fwd_s", "t_bwd_input_s", "t_bwd_weight_s", "cost_s"))))
        for s, t in zip(self.stages, times):
            mark = " <- bottleneck" if s.stage == worst else ""
            lines.append(
                f"{s.stage:>5} {s.device:>6} {s.num_ops:>6} {format_bytes(s.params_bytes):>10} "
                + " ".join(f"{x:>9}" for x in t) + f" {format_bytes(s.memory_bytes):>10} {names[s.stage]:>10}{mark}"
            )
        opt = self.optimality()
        if v > 1 and self.device_table:
            lines.append(f"{'device':>6} {'stages':>10} {'ops':>6} {'params':>10} {'cost ms':>9} {'busy ms':>9} "
                         f"{'span ms':>9} {'span LB ms':>10} {'act peak':>10} {'memory':>10}")
            worst_d = int(np.argmax([d.cost_s for d in self.device_table]))
            times = list(zip(*(ms_column([getattr(d, k) for d in self.device_table]) for k in ("cost_s", "busy_s", "span_s")),
                             ms_column([dv["span_lower_bound_s"] for dv in opt["devices"]])))
            for d, t in zip(self.device_table, times):
                mark = " <- bottleneck" if d.device == worst_d else ""
                lines.append(
                    f"{d.device:>6} {','.join(map(str, d.stages)):>10} {d.num_ops:>6} {format_bytes(d.params_bytes):>10} "
                    f"{t[0]:>9} {t[1]:>9} {t[2]:>9} {t[3]:>10} "
                    f"{format_bytes(d.activation_peak_bytes):>10} {format_bytes(d.memory_bytes):>10}{mark}"
                )
        lines += self.memory_summary().splitlines()
        what = "bottleneck" if v == 1 else "device bottleneck"
        lines += _objective_lines(opt)
        how = ("the partition's objective" if v == 1 else "a device's stages' work and transfers")
        lines.append(f"{what} {format_ms(self.bottleneck_s)} ({how}, per micro-batch) | "
                     f"bubble ratio {self.bubble_ratio:.1%} (idle share of devices x makespan)")
        search = self.schedule.meta.get("placement_search")
        if search:
            parts = []
            for c in search:
                label = f"v={c['stages_per_device']} {c['placement']}" + (f" {c['schedule']}" if "schedule" in c else "")
                span = c.get("stage_span_s", c.get("step_time_s"))
                if span is None:
                    parts.append(f"{label}: skipped")
                    continue
                fig = f"span {format_ms(span)}" + (f", makespan {format_ms(c['makespan_s'])}" if "makespan_s" in c else "")
                parts.append(f"{label}: {fig}" + (" (chosen)" if c.get("chosen") else ""))
            lines.append("placement search (largest per-device span, what the schedule minimises; makespan beside): "
                         + "; ".join(parts))
        empty = self.partition.meta.get("empty_stages") or []
        if empty:
            lines.append(
                f"note: stages {empty} hold no ops and only relay tensors: the best partition found uses "
                f"{self.num_stages - len(empty)} stages; fewer would do as well"
            )
        lines += [f"warning: {w}" for w in self.all_warnings()]
        if self.timings_s:
            lines.append("time: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timings_s.items()))
        return "\n".join(lines)

    def memory_summary(self) -> str:
        """The memory table as text (lines joined by newlines, like :meth:`summary`): every
        device's memory by kind against its capacity."""
        m = self.memory
        cap = format_bytes(m.capacity_bytes)
        head = (f"memory per device ({m.precision.name}, {m.precision.training_bytes:g} B/param"
                + (f", ZeRO-{m.zero_stage} over {m.data_parallel}" if m.zero_stage else "")
                + (", FSDP2 unit per block: the root and two blocks unsharded" if m.block_units else "")
                + (", optimizer state on the host" if m.offload_optimizer is True else "")
                + f"; capacity {cap}, {m.reserved_fraction:.0%} reserved)")
        rows = [head, f"{'device':>6} {'params':>10} {'grads':>10} {'optimizer':>10} {'act peak':>10} {'offloaded':>10} "
                      f"{'comm buf':>10} {'reserved':>10} {'total':>10} {'capacity':>10}"]
        rec = [s.stage for s in self.stages if s.recompute]
        for d in self.device_table:
            mark = "" if d.fits else f" <- over by {format_bytes(d.memory_bytes - d.capacity_bytes)}"
            rows.append(
                f"{d.device:>6} {format_bytes(d.params_bytes):>10} {format_bytes(d.grads_bytes):>10} "
                f"{format_bytes(d.optimizer_bytes):>10} {format_bytes(d.activation_peak_bytes):>10} "
                f"{format_bytes(d.offloaded_peak_bytes):>10} {format_bytes(d.comm_buffer_bytes):>10} "
                f"{format_bytes(d.reserved_bytes):>10} {format_bytes(d.memory_bytes):>10} {cap:>10}{mark}"
            )
        n_off = sum(1 for o in self.schedule.ops if o.type == "O")
        chosen = self.options.get("activation_checkpointing", "auto") == "auto"  # not pinned by the user
        if n_off or (rec and chosen):
            rows.append(f"memory binds: {n_off} stashes offloaded" + (f", stages {rec} checkpoint activations" if rec else ""))
        rows += self.checkpoint_summary()
        return "\n".join(rows)

    def checkpoint_summary(self) -> list[str]:
        """One line per checkpointing stage: its policy, replay time, kept bytes and replay peak per micro-batch
        (none when no stage checkpoints)."""
        out = []
        for s, (pol, name) in enumerate(zip(self.activation_checkpointing, self.problem.checkpoint)):
            if pol.kind == "none":
                continue
            none = self.problem.checkpoint_option(s, "none")
            out.append(f"  stage {s}: {name} ({pol.describe()}): replays {pol.replay_s * 1e3:.3f} ms of forward, keeps "
                       f"{format_bytes(pol.kept_bytes)} of {format_bytes(none.kept_bytes)} per micro-batch, "
                       f"replay peak {format_bytes(pol.replay_peak_bytes)}")
        if out:
            out.insert(0, "activation checkpointing per stage (per micro-batch):")
        return out

    # ------------------------------------------------------------------ JSON (fxpipe.plan.file)
    def to_dict(self) -> dict[str, Any]:
        """The ``fxpipe.plan/2`` document (:func:`fxpipe.plan.file.plan_to_dict`): every ``/1`` field, plus ``fxpipe_version``."""
        return plan_to_dict(self)

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON (atomically)."""
        return write_json_atomic(path, self.to_dict(), indent=None)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str = "plan") -> "Plan":
        """Rebuild a plan from its ``fxpipe.plan/2`` or ``fxpipe.plan/1`` document, re-validating every part.

        Older ``/1`` layouts are filled in (:func:`fxpipe.plan.file.plan_fields_from_dict`).

        Raises
        ------
        InputError
            If the document is not a plan or its parts are inconsistent.
        """
        return cls(**plan_fields_from_dict(doc, source))

    # ------------------------------------------------------------------ runtime
    def orders(self) -> Orders:
        """The per-device programs of the schedule, with the placement: codegen's input.

        :func:`fxpipe.ir.schedule_to_orders` of the timed schedule (every device's actions of
        all its stages in start order).
        """
        return schedule_to_orders(self.schedule, self.problem)

    def captured(self, model=None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None):
        """The captured fx program; re-captures ``model`` for a loaded plan and checks it matches."""
        if self.capture.traced is not None:
            return self.capture.traced
        if model is None:
            raise InputError("this plan was loaded from a file: pass the model and its example args to rebuild it")
        from fxpipe.passes import trace_model  # lazy: torch

        traced = trace_model(model, tuple(args), dict(kwargs or {}), hardware=self.hardware, name=self.name)
        self.adopt_capture(traced)
        return traced

    def adopt_capture(self, traced) -> None:
        """Use ``traced`` (another process's or device's capture of the model) for :meth:`build`.

        The plan's nodes are matched to ``traced``'s by structure
        (:func:`fxpipe.passes.structure.match_nodes`): node names, the order of independent
        nodes (a model iterating over a ``set``, traced under another ``PYTHONHASHSEED``) and ops
        that do no work (a ``contiguous`` a ``meta`` trace adds) may differ; :meth:`build` then
        runs exactly the planned partition on ``traced``'s nodes.

        Raises
        ------
        InputError
            If ``traced`` is not the graph the plan was made for (another layer count, width,
            input shape...): the message names the ops that differ.
        """
        from fxpipe.passes.structure import PlanStructure, map_stage_of  # lazy: torch

        structure = PlanStructure.from_graph(self.graph)
        if structure is None:  # a plan saved before structural keys: names must agree
            if graph_signature(traced.graph) != self.graph_signature:
                raise InputError(
                    "the model's captured graph differs from the one this plan was made for "
                    "(different model, config or example input shapes): run fxpipe.compile again"
                )
            stage_map = dict(self.stage_of)
        else:
            stage_map = map_stage_of(structure, self.stage_of, traced.gm)
        self.capture.traced, self.capture.stage_of = traced, stage_map

    def captured_stage_of(self) -> dict[str, int]:
        """The stage map keyed by the node names of :meth:`captured`.

        The plan's own capture goes through :meth:`adopt_capture` too, so every process (this
        one, workers, torchrun ranks loading the plan file) splits its capture alike: the same
        node order, trivial ops placed by the split, the same tensors crossing each boundary.
        """
        if self.capture.stage_of is None and self.capture.traced is not None:
            self.adopt_capture(self.capture.traced)
        return dict(self.capture.stage_of) if self.capture.stage_of is not None else dict(self.stage_of)

    def worker_stage_of(self) -> PlanStageOf:
        return _worker_stage_of(self)

    worker_stage_of.__doc__ = _worker_stage_of.__doc__

    def recompute_stages(self) -> tuple[int, ...]:
        """Stages that replay their whole forward during B (policy ``"stage"``, what plans before issue 28
        called recomputation; the runtime's ``recompute_stages``). The per-block policies of the other
        checkpointing stages are :attr:`activation_checkpointing`."""
        return tuple(s for s, p in enumerate(self.activation_checkpointing) if p.kind == "stage")

    # ------------------------------------------------------------------ operations (their own modules)
    def build(self, rank: int, *, model=None, args=(), kwargs=None, loss_fn: Callable | None = None, group=None,
              device="cpu", checkpoint=None, seed: int | None = None, init_fn: Callable | None = None,
              compile_stages: bool | None = None):
        return build_rank(self, rank, model=model, args=args, kwargs=kwargs, loss_fn=loss_fn, group=group, device=device,
                          checkpoint=checkpoint, seed=seed, init_fn=init_fn, compile_stages=compile_stages)

    build.__doc__ = build_rank.__doc__

    def replica_batch(self, rank: int, inputs: Any, target: Any = None) -> tuple[Any, Any]:
        return _replica_batch(self, rank, inputs, target)

    replica_batch.__doc__ = _replica_batch.__doc__

    def _compile_stages(self, compile_stages: bool | None) -> bool:
        return compile_stages_option(self, compile_stages)

    def reschedule(self, schedule: str, *, time_limit_s: float = 60.0, progress: bool = False) -> "Plan":
        return _reschedule(self, schedule, time_limit_s=time_limit_s, progress=progress)

    reschedule.__doc__ = _reschedule.__doc__

    def train_local(self, make_model: Callable, make_batch: Callable, *, steps: int = 2, lr: float = 0.01,
                    loss: str | Callable = "cross_entropy", seed: int = 0, reference: bool = True,
                    timeout_s: float = 600.0, loss_rtol: float = 1e-4, rtol: float = 1e-5,
                    compile_stages: bool | None = None, progress: bool | None = None,
                    action_timeout_s: float | None = None) -> dict[str, Any]:
        return _train_local(self, make_model, make_batch, steps=steps, lr=lr, loss=loss, seed=seed,
                            reference=reference, timeout_s=timeout_s, loss_rtol=loss_rtol, rtol=rtol,
                            compile_stages=compile_stages, progress=progress, action_timeout_s=action_timeout_s)

    train_local.__doc__ = _train_local.__doc__



def load_plan(path: str | Path) -> Plan:
    """Read a plan saved with :meth:`Plan.save`.

    Raises
    ------
    InputError
        If the file is missing, not JSON, or not a valid plan.
    """
    return Plan.from_dict(read_json(path, "plan file"), source=str(path))


#: What each step-time figure of :meth:`Plan.optimality` measures (summary wording).
_FIGURE_TEXT = {
    "stage_span": ("per-device span", "the largest per-device span (first F to last W on one device; the step time "
                                      "when consecutive steps overlap)"),
    "makespan": ("makespan", "the makespan (first op to last op of one step)"),
}


def _objective_lines(opt: Mapping[str, Any]) -> list[str]:
    """Summary lines of :meth:`Plan.optimality`: the minimised figure named, then each figure
    beside its own lower bound and status."""
    minimised = opt["schedule_objective"]
    lines = [f"schedule {opt['schedule_method'] or '?'} minimises {_FIGURE_TEXT.get(minimised, (minimised, minimised))[1]}:"]
    for name in (minimised, *(n for n in ("stage_span", "makespan") if n != minimised)):
        f = opt[name]
        if f["status"] == "optimal":
            verdict = "optimal" + (" (meets its lower bound)" if f["above_bound"] is not None and f["above_bound"] <= 1e-6
                                   else " (proven by the MILP)")
        elif f["above_bound"] is None:
            verdict = f"{f['status']}, no lower bound"
        else:
            verdict = f"{f['status']}: at most {f['above_bound']:.1%} above its optimum"
        lines.append(f"  {_FIGURE_TEXT[name][0]:<15} {format_ms(f['value_s']):>12} | lower bound "
                     f"{format_ms(f['lower_bound_s']):>12} | {verdict}")
    return lines


def _mesh_search_table(rows) -> list[str]:
    """The meshes a search tried, one line each: bound, schedule, sync, predicted step (ms) or why it was skipped."""
    if not rows:
        return []
    def column(key_of: Callable[[Mapping], str]) -> list[str]:  # one number of decimals per column, "-" where absent
        have = [r for r in rows if key_of(r) in r]
        shown = iter(ms_column([r[key_of(r)] for r in have]))
        return [next(shown) if key_of(r) in r else "-" for r in rows]

    cols = [column(lambda r, k=k: k) for k in ("lower_bound_s", "step_time_s")]
    cols.append(column(lambda r: "exposed_sync_s" if "exposed_sync_s" in r else "dp_sync_s"))
    cols.append(column(lambda r: "predicted_step_s"))
    width = max(len(r["mesh_text"]) for r in rows)
    out = ["mesh search (predicted step = schedule + data-parallel sync and host optimizer step the pipeline does "
           "not hide, ms; planned in order of the lower bound):",
           f"  {'mesh':<{width}}  {'bound':>9}  {'schedule':>9}  {'sync':>9}  {'predicted':>9}"]
    for i, r in enumerate(rows):
        tail = " (chosen)" if r.get("chosen") else (f"  skipped: {r['skipped']}" if "skipped" in r else "")
        if r.get("rank_order") and tuple(r["rank_order"]) != MESH_DIMS and "predicted_step_s" in r:
            tail = f"  ranks {format_rank_order(r['rank_order'])}{tail}"
        out.append(f"  {r['mesh_text']:<{width}}  " + "  ".join(f"{c[i]:>9}" for c in cols) + tail)
    return out
