"""The :class:`Plan`: what ``fxpipe.compile`` returns, saved as ``fxpipe.plan/1`` JSON.

A plan is plain data (the costed op graph, the partition into stages, the placement of the
stages on the devices, the schedule problem and the timed schedule, the per-stage and
per-device figures) plus, for a plan made in this process, the captured fx program.
:meth:`Plan.orders` is the typed handoff to code generation (:class:`fxpipe.ir.Orders`, per
device, with the placement). :meth:`Plan.build` emits this rank's
``torch.distributed.pipelining`` stages and runtime, :meth:`Plan.train_local` trains the plan on local gloo ranks next to a
single-process reference. A loaded plan re-captures the model and checks that the graph is
the one the plan was made for (:func:`graph_signature`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph, Orders, Schedule, ScheduleProblem, read_json, schedule_to_orders, write_json_atomic
from fxpipe.memory import MemoryModel
from fxpipe.partition.objective import Partition

__all__ = ["Plan", "StageStats", "DeviceStats", "PLAN_FORMAT", "graph_signature", "load_plan"]

PLAN_FORMAT = "fxpipe.plan/1"


#: A stage whose work is under this share of the bottleneck stage's cost counts as idle
#: (:meth:`Plan.waste_warnings`).
IDLE_STAGE_SHARE = 0.05

#: Memory columns of a stage / device row (bytes; :mod:`fxpipe.memory`'s names).
MEMORY_FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_peak_bytes", "comm_buffer_bytes",
                 "reserved_bytes", "offloaded_peak_bytes", "memory_bytes", "capacity_bytes")


class _MemoryRow:
    """The capacity check shared by stage and device rows (``memory_bytes``, ``capacity_bytes``)."""

    memory_bytes: float
    capacity_bytes: float | None

    @property
    def fits(self) -> bool:
        """``memory_bytes <= capacity_bytes`` (True without a capacity)."""
        return self.capacity_bytes is None or self.memory_bytes <= self.capacity_bytes * (1 + 1e-12)


@dataclass
class StageStats(_MemoryRow):
    """Per-stage figures of a plan (times in seconds, sizes in bytes); ``device`` holds the stage.

    ``param_bytes`` are the stage's parameters in the captured graph's dtype. The memory
    columns come from the plan's :class:`fxpipe.memory.MemoryModel`, the stage counted as if
    alone on its device (:func:`fxpipe.plan_memory.stage_memory`): ``params_bytes``,
    ``grads_bytes``, ``optimizer_bytes`` (precision policy, ZeRO), ``activation_peak_bytes``
    (the peak of the stage's curve in the schedule, net of offloaded stashes),
    ``comm_buffer_bytes`` (receive buffers), ``reserved_bytes``, ``offloaded_peak_bytes``
    (host memory), ``memory_bytes`` (their total on the device) and ``capacity_bytes`` (None:
    unlimited). ``recompute``: the stage replays its forward during B.
    """

    stage: int
    device: int
    num_ops: int
    param_bytes: float
    t_fwd_s: float
    t_bwd_input_s: float
    t_bwd_weight_s: float
    cost_s: float
    activation_peak_bytes: float
    memory_bytes: float
    params_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    comm_buffer_bytes: float = 0.0
    reserved_bytes: float = 0.0
    offloaded_peak_bytes: float = 0.0
    capacity_bytes: float | None = None
    recompute: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class DeviceStats(_MemoryRow):
    """Per-device figures of a plan (times in seconds, sizes in bytes).

    Attributes
    ----------
    device : int
    stages : list[int]
        The stages the device holds.
    num_ops, param_bytes, t_fwd_s, t_bwd_input_s, t_bwd_weight_s :
        Sums over the device's stages.
    cost_s : float
        Per-device cost (:func:`fxpipe.partition.placement.device_costs`): the stages' work plus
        the transfers to and from other devices (free between stages of the device).
    busy_s : float
        Compute time of one step in the schedule problem (m times the stages' F + B + W).
    span_s : float
        First F to last W of the device in the schedule.
    activation_peak_bytes, memory_bytes, params_bytes, grads_bytes, optimizer_bytes, comm_buffer_bytes,
    reserved_bytes, offloaded_peak_bytes, capacity_bytes :
        Memory by kind (:func:`fxpipe.plan_memory.device_memory`, names of :mod:`fxpipe.memory`):
        the activation peak of the device's curve in the schedule, the static state of its
        stages, receive buffers, the reserved fraction, stashes in host memory at once, the
        total ``memory_bytes`` and the capacity (None: unlimited).
    """

    device: int
    stages: list[int]
    num_ops: int
    param_bytes: float
    t_fwd_s: float
    t_bwd_input_s: float
    t_bwd_weight_s: float
    cost_s: float
    busy_s: float
    span_s: float
    activation_peak_bytes: float
    memory_bytes: float
    params_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    comm_buffer_bytes: float = 0.0
    reserved_bytes: float = 0.0
    offloaded_peak_bytes: float = 0.0
    capacity_bytes: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "stages": list(self.stages)}


@dataclass
class Plan:
    """A pipeline plan: the partition of every op into stages and the schedule.

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
        data-parallel replicas of this pipeline; default (and plans saved before meshes) the
        pure pipeline ``{"pp": devices, "dp_shard": 1, "dp_replicate": 1}``.
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
    _captured: Any = field(default=None, repr=False, compare=False)
    _captured_stage_of: Any = field(default=None, repr=False, compare=False)  # stage map by _captured's names
    mesh: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from fxpipe.mesh import normalize_mesh, pure_pipeline

        self.mesh = pure_pipeline(self.devices) if not self.mesh else normalize_mesh(self.mesh)
        if self.mesh["pp"] != self.devices:
            raise InputError(f"plan mesh {self.mesh} disagrees with its {self.devices} pipeline devices (pp)")

    # ------------------------------------------------------------------ mesh (fxpipe.mesh)
    @property
    def dp(self) -> int:
        """Data-parallel replicas of the pipeline (``dp_shard * dp_replicate``)."""
        from fxpipe.mesh import mesh_dp

        return mesh_dp(self.mesh)

    @property
    def world_size(self) -> int:
        """All devices of the plan: ``pp * dp_shard * dp_replicate`` (= ``devices`` for a pure pipeline)."""
        return self.devices * self.dp

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
        from fxpipe.mesh import pipeline_dp_sync_s

        return pipeline_dp_sync_s(self.graph, self.partition.assignment, self.device_of_stage, self.mesh)

    def mesh_summary(self) -> list[str]:
        """Summary lines for a plan with data parallelism (none for a pure pipeline)."""
        from fxpipe.mesh import format_mesh

        search = self.options.get("mesh_search") or []
        lines = []
        if search:
            parts = [f"{c['mesh_text']}: " + (f"{c['predicted_step_s'] * 1e3:.3f} ms" if "predicted_step_s" in c else "skipped")
                     + (" (chosen)" if c.get("chosen") else "") for c in search]
            lines.append("mesh search (predicted step = schedule + data-parallel sync): " + "; ".join(parts))
        if self.dp == 1:
            return lines
        ds, dr = self.mesh["dp_shard"], self.mesh["dp_replicate"]
        how = ("FSDP2 fully_shard over dp_shard" + (", HSDP with dp_replicate" if dr > 1 else "")) if ds > 1 else \
            "replicate (DDP) over dp_replicate"
        coll = ("all-gather + reduce-scatter" if ds > 1 else "") + (" + " if ds > 1 and dr > 1 else "") + \
            ("all-reduce" if dr > 1 else "")
        return [f"mesh {format_mesh(self.mesh)} on {self.world_size} devices: {self.dp} data-parallel replicas of this "
                f"pipeline, {self.global_microbatches} micro-batches per step ({self.microbatches} per replica); {how}",
                f"data-parallel sync per step: {self.dp_sync_s * 1e3:.3f} ms on the busiest device ({coll} at "
                f"{self.graph.bandwidth_bytes_per_s / 1e9:g} GB/s, not overlapped, not in the makespan)", *lines]

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
        from fxpipe.partition.placement import placement_name

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
        from fxpipe.schedule.bounds import combinatorial_lower_bound, device_span_bounds
        from fxpipe.schedule.validate import device_spans

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
            out.append(f"the stages hold on average {share:.0%} of the bottleneck stage's {bottleneck * 1e3:.3f} ms"
                       + (f", {len(idle)} of {self.num_stages} almost none (under {IDLE_STAGE_SHARE:.0%}: stages {shown})"
                          if idle else "")
                       + f"; the bottleneck is set by a few large ops, so the other devices idle: the work would fill "
                       f"about {fill_devices} devices at this bottleneck: plan for {fill_devices} devices instead of {p}")
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
        lines = [
            f"fxpipe plan for {self.name!r}: {where}, {self.microbatches} micro-batches, "
            f"hardware {self.hardware}, objective {self.objective}, schedule {self.schedule.method}",
            *self.mesh_summary(),
            f"{'stage':>5} {'device':>6} {'ops':>6} {'params':>10} {'F ms':>9} {'B ms':>9} {'W ms':>9} {'cost ms':>9} "
            f"{'memory':>10}",
        ]
        worst = int(np.argmax([s.cost_s for s in self.stages])) if self.stages and v == 1 else -1
        for s in self.stages:
            mark = " <- bottleneck" if s.stage == worst else ""
            lines.append(
                f"{s.stage:>5} {s.device:>6} {s.num_ops:>6} {_fmt_bytes(s.params_bytes):>10} {s.t_fwd_s * 1e3:>9.3f} "
                f"{s.t_bwd_input_s * 1e3:>9.3f} {s.t_bwd_weight_s * 1e3:>9.3f} {s.cost_s * 1e3:>9.3f} "
                f"{_fmt_bytes(s.memory_bytes):>10}{mark}"
            )
        opt = self.optimality()
        if v > 1 and self.device_table:
            lines.append(f"{'device':>6} {'stages':>10} {'ops':>6} {'params':>10} {'cost ms':>9} {'busy ms':>9} "
                         f"{'span ms':>9} {'span LB ms':>10} {'act peak':>10} {'memory':>10}")
            worst_d = int(np.argmax([d.cost_s for d in self.device_table]))
            for d, dv in zip(self.device_table, opt["devices"]):
                mark = " <- bottleneck" if d.device == worst_d else ""
                lines.append(
                    f"{d.device:>6} {','.join(map(str, d.stages)):>10} {d.num_ops:>6} {_fmt_bytes(d.params_bytes):>10} "
                    f"{d.cost_s * 1e3:>9.3f} {d.busy_s * 1e3:>9.3f} {d.span_s * 1e3:>9.3f} "
                    f"{dv['span_lower_bound_s'] * 1e3:>10.3f} "
                    f"{_fmt_bytes(d.activation_peak_bytes):>10} {_fmt_bytes(d.memory_bytes):>10}{mark}"
                )
        lines += self.memory_summary().splitlines()
        what = "bottleneck" if v == 1 else "device bottleneck"
        lines += _objective_lines(opt)
        how = ("the partition's objective" if v == 1 else "a device's stages' work and transfers")
        lines.append(f"{what} {self.bottleneck_s * 1e3:.3f} ms ({how}, per micro-batch) | "
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
                fig = f"span {span * 1e3:.3f} ms" + (f", makespan {c['makespan_s'] * 1e3:.3f} ms" if "makespan_s" in c else "")
                parts.append(f"{label}: {fig}" + (" (chosen)" if c.get("chosen") else ""))
            lines.append("placement search (largest per-device span, what the schedule minimises; makespan beside): "
                         + "; ".join(parts))
        empty = self.partition.meta.get("empty_stages") or []
        if empty:
            lines.append(
                f"note: stages {empty} hold no ops and only relay tensors: the best partition found uses "
                f"{self.num_stages - len(empty)} stages; fewer would do as well"
            )
        lines += [f"warning: {w}" for w in self.waste_warnings()]
        if self.timings_s:
            lines.append("time: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timings_s.items()))
        return "\n".join(lines)

    def memory_summary(self) -> str:
        """The memory table as text (lines joined by newlines, like :meth:`summary`): every
        device's memory by kind against its capacity."""
        from fxpipe.memory import format_bytes

        m = self.memory
        cap = format_bytes(m.capacity_bytes)
        head = (f"memory per device ({m.precision.name}, {m.precision.training_bytes:g} B/param"
                + (f", ZeRO-{m.zero_stage} over {m.data_parallel}" if m.zero_stage else "")
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
        if rec or n_off:
            rows.append(f"memory binds: {n_off} stashes offloaded" + (f", stages {rec} recompute their forward" if rec else ""))
        return "\n".join(rows)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The ``fxpipe.plan/1`` document."""
        return {
            "format": PLAN_FORMAT,
            "name": self.name,
            "devices": self.devices,
            "mesh": dict(self.mesh),
            "dp_sync_s": self.dp_sync_s,
            "num_stages": self.num_stages,
            "stages_per_device": self.stages_per_device,
            "placement": self.placement,
            "device_of_stage": list(self.device_of_stage),
            "microbatches": self.microbatches,
            "hardware": self.hardware,
            "objective": self.objective,
            "comm": self.comm,
            "graph_signature": self.graph_signature,
            "options": self.options,
            "bottleneck_s": self.bottleneck_s,
            "makespan_s": self.makespan_s,
            "bubble_ratio": self.bubble_ratio,
            "optimality": self.optimality(),
            "timings_s": self.timings_s,
            "stages": [s.to_dict() for s in self.stages],
            "device_table": [d.to_dict() for d in self.device_table],
            "memory": self.memory.to_dict(),
            "stage_of": self.stage_of,
            "partition": self.partition.to_dict(),
            "problem": self.problem.to_dict(),
            "schedule": self.schedule.to_dict(),
            "graph": self.graph.to_dict(),
        }

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON (atomically)."""
        return write_json_atomic(path, self.to_dict(), indent=None)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, source: str = "plan") -> "Plan":
        """Rebuild a plan from its ``fxpipe.plan/1`` document (re-validating every part).

        Raises
        ------
        InputError
            If the document is not a plan or its parts are inconsistent.
        """
        if not isinstance(doc, Mapping) or doc.get("format") != PLAN_FORMAT:
            raise InputError(f"{source}: not an {PLAN_FORMAT} document")
        try:
            graph = OpGraph.from_dict(doc["graph"], source=f"{source}: graph")
            p = doc["partition"]
            partition = Partition(
                k=int(p["k"]),
                assignment=np.asarray(p["assignment"], dtype=np.int64),
                block_costs=np.asarray(p["block_costs"], dtype=np.float64),
                bottleneck=float(p["bottleneck"]),
                objective=str(p["objective"]),
                comm=str(p["comm"]),
                meta=dict(p.get("meta", {})),
            )
            problem = ScheduleProblem.from_dict(doc["problem"], source=f"{source}: problem")
            schedule = Schedule.from_dict(doc["schedule"], source=f"{source}: schedule")
            stages = [StageStats(**{"device": s["stage"], **s}) for s in doc["stages"]]  # plans before placements
            device_table = [DeviceStats(**d) for d in doc.get("device_table", [])]
            plan = cls(
                name=doc["name"],
                devices=int(doc["devices"]),
                microbatches=int(doc["microbatches"]),
                hardware=doc["hardware"],
                objective=doc["objective"],
                comm=doc["comm"],
                graph=graph,
                partition=partition,
                stage_of={str(k): int(v) for k, v in doc["stage_of"].items()},
                problem=problem,
                schedule=schedule,
                stages=stages,
                timings_s=dict(doc.get("timings_s", {})),
                graph_signature=str(doc.get("graph_signature", "")),
                options=dict(doc.get("options", {})),
                device_table=device_table,
                memory=MemoryModel.from_dict(doc["memory"]) if "memory" in doc else MemoryModel(),
                mesh=_mesh_from_doc(doc, source),  # plans saved before meshes: a pure pipeline
            )
            plan._memory_columns = "memory" in doc
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"{source}: malformed plan ({exc!r}); regenerate it with fxpipe.compile") from None
        if "device_of_stage" in doc and list(doc["device_of_stage"]) != list(plan.device_of_stage):
            raise InputError(f"{source}: device_of_stage disagrees with the schedule problem's placement")
        plan._check_consistent(source)
        return plan

    def _check_consistent(self, source: str) -> None:
        """Every part of a loaded plan agrees with the others (raises InputError otherwise)."""
        from fxpipe.partition.objective import validate_partition
        from fxpipe.schedule.validate import check_schedule

        if self.graph_signature != graph_signature(self.graph):
            raise InputError(f"{source}: the graph signature does not match the graph: the file was edited or corrupted")
        if not self.partition.k == self.problem.num_stages == len(self.stages):
            raise InputError(
                f"{source}: partition blocks ({self.partition.k}), schedule stages ({self.problem.num_stages}) and "
                f"stage table ({len(self.stages)}) disagree"
            )
        if self.devices != self.problem.num_devices or self.num_stages % self.devices:
            raise InputError(
                f"{source}: devices ({self.devices}) disagree with the schedule problem's placement "
                f"({self.problem.num_devices} devices for {self.problem.num_stages} stages)"
            )
        try:
            validate_partition(self.graph, self.partition, rtol=1e-6)
        except AssertionError as exc:
            raise InputError(f"{source}: the partition is invalid: {exc}") from None
        expected = {self.graph.names[i]: int(self.partition.assignment[i]) for i in range(self.graph.n)}
        if self.stage_of != expected:
            raise InputError(f"{source}: stage_of disagrees with the partition's assignment")
        violations = check_schedule(self.problem, self.schedule.ops)
        if violations:
            raise InputError(f"{source}: the schedule breaks Contract 3: {violations[0]} ({len(violations)} violations)")
        from fxpipe.api import device_stats, stage_stats  # noqa: PLC0415 (api imports this module)

        expected_stages = stage_stats(self.graph, self.partition, self.problem, self.schedule, self.objective, self.memory)
        expected_devices = device_stats(self.graph, self.partition, self.problem, self.schedule, self.objective,
                                        self.memory)
        if not self.device_table:  # plans saved before the device table: recompute it
            self.device_table = expected_devices
        if not getattr(self, "_memory_columns", True):  # plans saved before the memory model: recompute memory
            self.stages, self.device_table = expected_stages, expected_devices
        if len(self.device_table) != len(expected_devices):
            raise InputError(f"{source}: the device table has {len(self.device_table)} rows for {self.devices} devices")
        tables = [("stage", got.to_dict(), want.to_dict()) for got, want in zip(self.stages, expected_stages)]
        tables += [("device", got.to_dict(), want.to_dict()) for got, want in zip(self.device_table, expected_devices)]
        for kind, got, want in tables:
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

    # ------------------------------------------------------------------ runtime
    def orders(self) -> Orders:
        """The per-device programs of the schedule, with the placement: codegen's input.

        :func:`fxpipe.ir.schedule_to_orders` of the timed schedule (every device's actions of
        all its stages in start order).
        """
        return schedule_to_orders(self.schedule, self.problem)

    def captured(self, model=None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None):
        """The captured fx program; re-captures ``model`` for a loaded plan and checks it matches."""
        if self._captured is not None:
            return self._captured
        if model is None:
            raise InputError("this plan was loaded from a file: pass the model and its example args to rebuild it")
        from fxpipe.passes import trace_model

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
        from fxpipe.passes.structure import PlanStructure, map_stage_of

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
        self._captured = traced
        self._captured_stage_of = stage_map

    def captured_stage_of(self) -> dict[str, int]:
        """The stage map keyed by the node names of :meth:`captured` (``stage_of`` for the plan's own capture)."""
        return dict(self._captured_stage_of) if self._captured_stage_of is not None else dict(self.stage_of)

    def worker_stage_of(self) -> "_PlanStageOf":
        """A picklable ``gm -> stage map`` for worker processes that capture the model themselves.

        Matches each worker's capture to the plan by structure (:meth:`adopt_capture`), so every
        worker runs exactly the planned partition whatever its hash seed or device; use it as the
        ``stage_of`` of :func:`fxpipe.codegen.launch.spawn_train_many` runs.
        """
        from fxpipe.passes.structure import PlanStructure

        return _PlanStageOf(dict(self.stage_of), PlanStructure.from_graph(self.graph))

    def recompute_stages(self) -> tuple[int, ...]:
        """Stages the schedule problem marks for activation recomputation (``problem.recompute``)."""
        return tuple(s for s, r in enumerate(getattr(self.problem, "recompute", ()) or ()) if r)

    def build(self, rank: int, *, model=None, args=(), kwargs=None, loss_fn: Callable | None = None, group=None,
              device="cpu", checkpoint=None, seed: int | None = None, init_fn: Callable | None = None,
              compile_stages: bool | None = None):
        """This rank's ``PipelineStage`` s and schedule runtime, inside an initialised process group.

        Call from every worker of ``torchrun`` / ``torch.multiprocessing`` after
        ``torch.distributed.init_process_group`` with ``world_size == plan.world_size``
        (``plan.devices`` for a pure pipeline).

        With data parallelism (``plan.dp > 1``) the ranks form the mesh of
        :func:`fxpipe.mesh.rank_coords` (``rank = replica * pp + pipeline rank``); the call is
        collective (it creates the ``DeviceMesh`` and process groups), every stage module is
        wrapped by ``fully_shard`` / ``replicate`` over its data-parallel sub-mesh
        (:mod:`fxpipe.codegen.mesh`), and ``schedule.step`` takes this rank's replica slice of
        the global batch (:meth:`replica_batch`); ``schedule.fxpipe_mesh_rank`` holds the rank's
        coordinates. Gradients are those of the mean loss over all ``global_microbatches``.

        Parameters
        ----------
        rank : int
            Global rank, 0..world_size-1; its pipeline rank (= ``rank`` for a pure pipeline)
            runs the stages ``plan.device_of_stage`` puts on it.
        model : nn.Module, optional
            Needed only for a plan loaded from a file (it is re-captured and checked).
        args, kwargs :
            One micro-batch of example inputs (only for re-capture).
        loss_fn : callable(output, target) -> scalar tensor
            Applied on the last stage to every micro-batch.
        checkpoint : str, os.PathLike or Mapping[str, Tensor], optional
            Load this rank's stage parameters and buffers by fully qualified name from a
            ``.safetensors`` file, a sharded safetensors index, a directory holding either, a
            torch state dict file or a mapping (only the tensors this rank needs are read;
            :mod:`fxpipe.codegen.materialize`). Buffers it lacks come from the initializers.
        seed : int, optional
            Materialize this rank's stages from the model's initializers under this seed
            (same values as :class:`fxpipe.codegen.materialize.MetaInit` gives the whole model).
            Needed (or ``checkpoint``) when the model was captured on ``meta``.
        init_fn : callable(module) -> None, optional
            Initializer of every module, replacing the model's own (with ``seed``).
        compile_stages : bool, optional
            Run every stage with Inductor, its backward split into backward-input and
            backward-weight graphs (:mod:`fxpipe.codegen.compiled`). Default: the
            ``compile_stages`` option of the ``torch.compile`` backend that made the plan, else False.

        The stages the schedule problem marks for recomputation (:meth:`recompute_stages`) replay
        their forward during the backward; the schedule's offload/reload actions are executed
        (:mod:`fxpipe.codegen.stash`; ``schedule.fxpipe_stash.stats()`` reports the measured
        activation peaks).

        Returns
        -------
        (stages, schedule)
            ``stages``: this rank's ``torch.distributed.pipelining.PipelineStage`` s (a tuple
            in stage order, one entry per stage on this device); ``schedule``: the runtime whose
            ``step(*inputs, target=..., losses=[])`` runs one training step (inputs read on the
            rank of stage 0, ``schedule.has_first_stage``; the target on the rank of the last
            stage, ``schedule.has_last_stage``); ``schedule.parameters()`` lists the rank's
            parameters once each (for the optimizer).

        Raises
        ------
        InputError
            On a rank outside 0..world_size-1, a model that does not match the plan, or (with
            data parallelism) what :func:`fxpipe.codegen.mesh.build_mesh_rank` does not support yet.
        """
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= int(rank) < self.world_size:
            raise InputError(f"rank must be an integer in 0..{self.world_size - 1}, got {rank!r}")
        from fxpipe.codegen import build_pipeline_rank

        traced = self.captured(model, args, kwargs)
        source = None
        if checkpoint is not None or seed is not None or init_fn is not None:
            from fxpipe.codegen.materialize import StateSource

            source = StateSource(seed=0 if seed is None else int(seed), checkpoint=checkpoint, init_fn=init_fn,
                                 model=model if model is not None else getattr(traced, "model", None))
        if self.dp > 1:  # ---- mesh (fxpipe.codegen.mesh): pipeline x data parallelism
            from fxpipe.codegen.mesh import build_mesh_rank
            from fxpipe.codegen.rank import example_inputs_from_gm
            from fxpipe.codegen.split import split_stages

            stages, sched, _ = build_mesh_rank(
                split_stages(traced.gm, self.captured_stage_of(), self.num_stages), int(rank), self.orders(), mesh=self.mesh,
                num_microbatches=self.microbatches, loss_fn=loss_fn, device=device,
                example_microbatch_inputs=example_inputs_from_gm(traced.gm), recompute_stages=self.recompute_stages(),
                state_source=source, compile_stages=self._compile_stages(compile_stages),
            )
            return stages, sched
        return build_pipeline_rank(
            traced.gm,
            self.captured_stage_of(),
            int(rank),
            self.orders(),
            num_microbatches=self.microbatches,
            loss_fn=loss_fn,
            group=group,
            device=device,
            recompute_stages=self.recompute_stages(),
            state_source=source,
            compile_stages=self._compile_stages(compile_stages),
        )

    def replica_batch(self, rank: int, inputs: Any, target: Any = None) -> tuple[Any, Any]:
        """Global rank ``rank``'s part of a global batch: its replica's slice (all of it without data parallelism).

        ``inputs`` (a tuple of positional inputs, a dict of keywords or
        :class:`~fxpipe.codegen.interface.ModelInputs`) and ``target`` hold
        :attr:`global_microbatches` micro-batches along dim 0; replica ``r`` gets the ``r``-th
        of ``dp`` equal slices (:func:`fxpipe.codegen.mesh.replica_slice`), i.e. the global
        micro-batches ``r * microbatches .. (r + 1) * microbatches - 1``. Returns
        ``(inputs, target)`` in the same forms.
        """
        from fxpipe.mesh import rank_coords

        replica = rank_coords(int(rank), self.mesh)["replica"]
        if self.dp == 1:
            return inputs, target
        from fxpipe.codegen.mesh import replica_slice

        return replica_slice(inputs, replica, self.dp), replica_slice(target, replica, self.dp, "target")

    def _compile_stages(self, compile_stages: bool | None) -> bool:
        if compile_stages is None:
            return bool((self.options.get("backend") or {}).get("compile_stages", False))
        if not isinstance(compile_stages, bool):
            raise InputError(f"compile_stages must be True, False or None, got {compile_stages!r}")
        return compile_stages

    def reschedule(self, schedule: str, *, time_limit_s: float = 60.0, progress: bool = False) -> "Plan":
        """The same partition and placement with another schedule (``"1f1b"``, ``"zb-h2"``, ``"zb-v"``, ``"milp"``, ...).

        Parameters
        ----------
        schedule : str
            A method of :func:`fxpipe.schedule.dispatch.make_schedule` valid for the plan's
            placement (:func:`fxpipe.schedule.dispatch.methods_for_placement`). ``"auto"``
            is :func:`fxpipe.schedule.auto.auto_schedule` with recomputation in training, as
            in :func:`fxpipe.compile` (the new plan's problem carries the recomputing stages).
        time_limit_s : float
            MILP budget in seconds (``schedule="milp"``).

        Returns
        -------
        Plan
            A new plan sharing this plan's graph, partition, problem and capture.

        Raises
        ------
        InputError
            For an unknown schedule method or one the placement does not admit.
        InfeasibleError
            When the schedule cannot fit the problem's memory limit.
        """
        from fxpipe.api import SCHEDULES, device_stats, stage_stats
        from fxpipe.schedule.dispatch import make_schedule, methods_for_placement

        if schedule not in SCHEDULES:
            raise InputError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        valid = methods_for_placement(self.device_of_stage, self.devices)
        if schedule not in valid:
            raise InputError(
                f"schedule {schedule!r} does not schedule this plan's {self.placement} placement with "
                f"{self.stages_per_device} stages per device; use one of {', '.join(valid)}"
            )
        t0 = time.perf_counter()
        problem = self.problem
        if schedule == "auto":  # as in compile: recomputation where memory forces it
            from fxpipe.schedule.auto import auto_schedule

            chosen = auto_schedule(problem, recompute=self.objective == "training", time_limit_s=time_limit_s,
                                   progress=progress)
            problem, sched = chosen.problem, chosen.schedule
        else:
            sched = make_schedule(problem, schedule, time_limit_s=time_limit_s, progress=progress)
        return Plan(
            name=self.name, devices=self.devices, microbatches=self.microbatches, hardware=self.hardware,
            objective=self.objective, comm=self.comm, graph=self.graph, partition=self.partition,
            stage_of=dict(self.stage_of), problem=problem, schedule=sched,
            stages=stage_stats(self.graph, self.partition, problem, sched, self.objective, self.memory),
            device_table=device_stats(self.graph, self.partition, problem, sched, self.objective, self.memory),
            timings_s={**self.timings_s, "schedule": time.perf_counter() - t0},
            graph_signature=self.graph_signature, options={**self.options, "schedule": schedule},
            memory=self.memory, _captured=self._captured, _captured_stage_of=self._captured_stage_of, mesh=dict(self.mesh),
        )

    def train_local(
        self,
        make_model: Callable,
        make_batch: Callable,
        *,
        steps: int = 2,
        lr: float = 0.01,
        loss: str | Callable = "cross_entropy",
        seed: int = 0,
        reference: bool = True,
        timeout_s: float = 600.0,
        loss_rtol: float = 1e-4,
        rtol: float = 1e-5,
        compile_stages: bool | None = None,
        progress: bool | None = None,
    ) -> dict[str, Any]:
        """Train this plan for a few steps on ``world_size`` local gloo processes (CPU) and compare.

        Every worker builds the model with ``make_model()`` under the same seed, captures
        its first micro-batch, checks the graph against this plan, and runs its stages of the
        plan's placement and schedule through ``torch.distributed.pipelining``; with ``reference=True`` the same
        steps run in this process without pipelining and
        :func:`fxpipe.codegen.compare.compare_training` compares losses, every gradient, every
        parameter after the steps and every buffer.

        Parameters
        ----------
        make_model : picklable callable() -> (model, full_batch_inputs)
            Inputs in the model's calling form: a tuple (positional), a dict (keywords) or
            :class:`fxpipe.codegen.interface.ModelInputs`, of any pytree structure.
        make_batch : picklable callable(step) -> (inputs, target)
            The full batch (``global_microbatches`` micro-batches along dim 0) of each step;
            with data parallelism every replica trains on its slice (:meth:`replica_batch`) and
            the reference on the whole batch.
        steps, lr, loss, seed :
            SGD steps and learning rate, loss (``"cross_entropy"``, ``"mse"`` or a picklable
            callable(output, target) receiving the model's output structure), weight/data seed.
        loss_rtol, rtol : float
            Tolerances of the verdict ``ok``: relative loss difference, and gradient /
            parameter / buffer difference relative to the largest reference value of its kind.
        compile_stages : bool, optional
            Run the stages with Inductor (:meth:`build`); Inductor reassociates float sums, so
            compare with ``rtol`` about 1e-4 then.
        progress : bool or None
            A tqdm bar of the pipelined training steps on stderr (None: when stderr is a terminal).

        Returns
        -------
        dict
            ``pipeline_losses``, ``pipeline_wall_s`` and, with a reference, ``reference_losses``,
            ``ok``, ``comparison`` (:meth:`TrainingComparison.to_dict`), ``max_grad_abs_diff``,
            ``max_grad_rel_diff`` (the largest gradient difference relative to the largest
            reference gradient of the model: the verdict), ``worst_param_grad_rel_diff`` and
            ``worst_param`` (per-parameter, reported beside it), ``max_param_rel_diff``,
            ``max_buffer_rel_diff``, ``num_params``, ``num_buffers``, ``random_ops``; the
            :class:`~fxpipe.codegen.launch.TrainResult` objects under ``"results"`` (not JSON).

        Warns
        -----
        RandomOpsWarning
            When the model draws random numbers in training mode (active dropout): bitwise
            equality with the reference cannot hold; compare in eval mode or with p = 0.
        """
        from fxpipe.codegen.compare import compare_training, random_ops_warning
        from fxpipe.codegen.launch import reference_train, spawn_train_many

        rnd: list[str] | None = None
        if self._captured is not None:
            from fxpipe.codegen.effects import random_ops

            rnd = [str(o) for o in random_ops(self._captured.gm)]
            random_ops_warning(rnd)
        t0 = time.perf_counter()
        run = dict(make_model=make_model, stage_of=self.worker_stage_of(), orders=self.orders(),
                   num_microbatches=self.global_microbatches, make_batch=make_batch, steps=steps, lr=lr, loss=loss,
                   seed=seed, recompute_stages=self.recompute_stages(), compile_stages=self._compile_stages(compile_stages),
                   mesh=dict(self.mesh))
        res = spawn_train_many([run], world_size=self.world_size, timeout_s=timeout_s, warn_random=rnd is None,
                               progress=progress)[0]
        out: dict[str, Any] = {"pipeline_losses": list(res.losses), "pipeline_wall_s": time.perf_counter() - t0}
        if rnd is None:
            rnd = list(res.meta.get("random_ops", []))
        out["random_ops"] = rnd
        if reference:
            ref = reference_train(make_model, make_batch, num_microbatches=self.global_microbatches, steps=steps, lr=lr,
                                  loss=loss, seed=seed)
            cmp = compare_training(res, ref, loss_rtol=loss_rtol, rtol=rtol, random_ops=rnd)
            out["reference_losses"] = list(ref.losses)
            out.update(
                ok=cmp.ok, comparison=cmp.to_dict(), max_grad_abs_diff=cmp.max_grad_abs_diff,
                max_grad_rel_diff=cmp.max_grad_rel_diff, worst_param_grad_rel_diff=cmp.worst_param_grad_rel_diff,
                worst_param=cmp.worst_param, max_param_rel_diff=cmp.max_param_rel_diff,
                max_buffer_rel_diff=cmp.max_buffer_rel_diff, num_params=cmp.num_params, num_buffers=cmp.num_buffers,
            )
            out["results"] = (res, ref)
        else:
            out["results"] = (res,)
        return out


@dataclass(frozen=True)
class _PlanStageOf:
    """Picklable ``gm -> stage_of`` for workers: the plan's stage map for the worker's own capture.

    With the plan's structure (:meth:`Plan.worker_stage_of`), the worker's nodes are matched to
    the plan's by structure (:func:`fxpipe.passes.structure.map_stage_of`): node names and the
    order of independent nodes may differ between processes (``PYTHONHASHSEED``). Without it,
    the names must agree.
    """

    stage_of: dict
    structure: Any = None

    def __call__(self, gm) -> dict:
        if self.structure is not None:
            from fxpipe.passes.structure import map_stage_of

            return map_stage_of(self.structure, self.stage_of, gm)
        names = {n.name for n in gm.graph.nodes if n.op != "get_attr"}
        missing = sorted(set(self.stage_of) - names)
        extra = sorted(names - set(self.stage_of))
        if missing or extra:
            raise InputError(
                "the worker's captured graph differs from the plan's "
                f"(plan nodes missing: {missing[:5]}, unplanned nodes: {extra[:5]}): "
                "make_model must build the model the plan was compiled for, with the same micro-batch shapes"
            )
        return self.stage_of


def graph_signature(graph: OpGraph) -> str:
    """A short hash of the graph's structure; costs are not included.

    For a graph exported by :func:`fxpipe.passes.to_opgraph.to_opgraph` (every node has a
    structural key, ``extra[i]["skey"]``): :func:`fxpipe.passes.structure.structure_signature`,
    independent of node names, of the order of independent nodes (``PYTHONHASHSEED``) and of ops
    that do no work (a ``contiguous`` a meta trace adds). Otherwise (plans saved before the keys,
    hand-made graphs) a hash of the names, kinds and edges.
    """
    from fxpipe.passes.structure import SKEY, graph_preds, structure_signature

    ext = graph.extra or ()
    if len(ext) == graph.n and all(SKEY in e for e in ext):
        return structure_signature([str(e[SKEY]) for e in ext], graph_preds(graph))
    h = hashlib.sha256()
    h.update("\x00".join(graph.names).encode())
    h.update("\x00".join(graph.ops).encode())
    h.update(np.ascontiguousarray(graph.edges, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def _mesh_from_doc(doc: Mapping[str, Any], source: str) -> dict:
    from fxpipe.mesh import normalize_mesh, pure_pipeline

    if doc.get("mesh") is None:
        return pure_pipeline(int(doc["devices"]))
    try:
        mesh = normalize_mesh(doc["mesh"])
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None
    if mesh["pp"] != int(doc["devices"]):
        raise InputError(f"{source}: mesh {mesh} disagrees with the plan's {doc['devices']} pipeline devices (pp)")
    return mesh


def load_plan(path: str | Path) -> Plan:
    """Read a plan saved with :meth:`Plan.save`.

    Raises
    ------
    InputError
        If the file is missing, not JSON, or not a valid plan.
    """
    return Plan.from_dict(read_json(path, "plan file"), source=str(path))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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
        lines.append(f"  {_FIGURE_TEXT[name][0]:<15} {f['value_s'] * 1e3:9.3f} ms | lower bound "
                     f"{f['lower_bound_s'] * 1e3:9.3f} ms | {verdict}")
    return lines
