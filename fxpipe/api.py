"""The public entry point: ``fxpipe.compile(model, ...) -> Plan``.

The pass runs the whole data flow of DESIGN.md once:

1. capture with ``torch.export`` and cost every op (:mod:`fxpipe.passes`, :mod:`fxpipe.cost`);
2. partition the op DAG into ``devices`` acyclic pipeline stages minimising the bottleneck
   stage (:func:`fxpipe.partition.search.partition`, SliceGraph + BRKGA, Archer et al. 2024);
3. build the per-stage scheduling problem and schedule F / B / W for every micro-batch
   (:mod:`fxpipe.schedule`);
4. keep everything needed to emit the ``torch.distributed.pipelining`` program
   (:meth:`Plan.build`) and to train it on local ranks (:meth:`Plan.train_local`).

The :class:`~fxpipe.plan.Plan` it returns lives in :mod:`fxpipe.plan`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph, Schedule, ScheduleProblem
from fxpipe.partition.objective import Partition
from fxpipe.plan import PLAN_FORMAT, Plan, StageStats, graph_signature, load_plan  # noqa: F401 (public re-exports)

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "greedy", "pipeoffload", "adaoffload", "milp")  # = schedule.dispatch.METHODS

#: bytes per parameter byte held by a training stage besides the parameters themselves:
#: gradients (1x) and Adam's two moments (2x), all in the parameters' dtype. Used only for
#: the per-stage memory column of the plan; the memory-aware partitioner has its own model.
_TRAINING_STATE_FACTOR = 3.0


def _check_count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{what} must be an integer, got {value!r}")
    if value < 1:
        raise InputError(f"{what} must be >= 1, got {value}")
    return int(value)


def stage_stats(graph: OpGraph, partition: Partition, problem: ScheduleProblem, schedule: Schedule, objective: str) -> list[StageStats]:
    """Per-stage figures: ops, parameter bytes, F/B/W times, cost, activation peak, total memory."""
    from fxpipe.schedule.validate import memory_profile

    a = partition.assignment
    k = partition.k
    out = []
    for s in range(k):
        mask = a == s
        _, mem = memory_profile(problem, schedule.ops, s)
        act_peak = float(np.max(mem)) if len(mem) else 0.0
        params = float(graph.size_param_bytes[mask].sum())
        state = params * (1.0 + _TRAINING_STATE_FACTOR) if objective == "training" else params
        out.append(
            StageStats(
                stage=s,
                num_ops=int(mask.sum()),
                param_bytes=params,
                t_fwd_s=float(graph.t_fwd_s[mask].sum()),
                t_bwd_input_s=float(graph.t_bwd_input_s[mask].sum()),
                t_bwd_weight_s=float(graph.t_bwd_weight_s[mask].sum()),
                cost_s=float(partition.block_costs[s]),
                activation_peak_bytes=act_peak,
                memory_bytes=state + act_peak,
            )
        )
    return out


def fill_empty_stages(graph: OpGraph, partition: Partition) -> Partition:
    """Make a partition runnable on exactly ``k`` ranks when the optimum leaves stages empty.

    The partitioner minimises the bottleneck over *at most* k blocks and leaves unused blocks
    at the end; but the runtime needs model inputs on stage 0 and the output on stage k-1.
    The last used block is renumbered k-1 (or, if only one block is used, just the output
    node moves there), so the empty stages in between relay tensors. Costs are recomputed
    (relayed tensors count in the empty stages' io) and ``meta["empty_stages"]`` lists them.
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
    from fxpipe.partition.objective import block_costs

    costs = block_costs(graph, a2, k, partition.objective, partition.comm)
    empty = sorted(set(range(k)) - set(np.unique(a2).tolist()))
    return Partition(
        k=k,
        assignment=a2,
        block_costs=costs,
        bottleneck=float(costs.max()),
        objective=partition.objective,
        comm=partition.comm,
        order=partition.order,
        meta={**partition.meta, "empty_stages": empty, "bottleneck_before_filling_s": partition.bottleneck},
    )


def plan_graph(
    graph: OpGraph,
    *,
    devices: int,
    microbatches: int,
    objective: str = "training",
    schedule: str = "zb-h1",
    time_limit_s: float = 10.0,
    schedule_time_limit_s: float = 60.0,
    seed: int = 0,
    mem_limit_bytes: float | None = None,
    host_bandwidth_bytes_per_s: float | None = None,
    progress: bool = False,
) -> tuple[Partition, ScheduleProblem, Schedule, dict[str, float]]:
    """Partition and schedule an OpGraph (the torch-free half of :func:`compile`).

    Returns
    -------
    (partition, problem, schedule, timings_s)

    Raises
    ------
    InputError
        On bad counts, an unknown schedule, or more devices than ops.
    InfeasibleError
        When the schedule cannot fit the memory limit.
    """
    devices = _check_count(devices, "devices")
    microbatches = _check_count(microbatches, "microbatches")
    if schedule not in SCHEDULES:
        raise InputError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if devices > graph.n:
        raise InputError(
            f"devices={devices} is more than the {graph.n} ops of the graph: every stage needs at least one op; "
            "use fewer devices"
        )
    from fxpipe.partition.search import partition as run_partition
    from fxpipe.schedule.dispatch import make_schedule
    from fxpipe.schedule.from_partition import problem_from_partition

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    part = run_partition(graph, devices, objective=objective, comm="relay", time_limit_s=time_limit_s, seed=seed, progress=progress)
    part = fill_empty_stages(graph, part)
    timings["partition"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    problem = problem_from_partition(
        graph,
        part,
        num_microbatches=microbatches,
        mem_limit_bytes=math.inf if mem_limit_bytes is None else mem_limit_bytes,
        host_bandwidth_bytes_per_s=host_bandwidth_bytes_per_s,
    )
    sched = make_schedule(problem, schedule, time_limit_s=schedule_time_limit_s, progress=progress)
    timings["schedule"] = time.perf_counter() - t0
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
    schedule: str = "zb-h1",
    dtype=None,
    time_limit_s: float = 10.0,
    schedule_time_limit_s: float = 60.0,
    seed: int = 0,
    mem_limit_bytes: float | None = None,
    name: str | None = None,
    progress: bool = False,
    replicate: str = "auto",
) -> Plan:
    """Plan pipeline parallelism for ``model``: capture, cost, partition, schedule.

    Parameters
    ----------
    model : torch.nn.Module
        The model; may live on the ``meta`` device (nothing is allocated).
    args, kwargs :
        Example inputs of ONE micro-batch (costs are per micro-batch).
    devices : int
        Pipeline stages (one per device), >= 1 and <= number of ops.
    microbatches : int
        Micro-batches per step, >= 1.
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
    schedule : str
        One of ``gpipe``, ``1f1b``, ``zb-h1`` (default), ``zb-h2``, ``greedy``,
        ``pipeoffload``, ``adaoffload``, ``milp``.
    dtype : torch.dtype, optional
        Compute dtype the costs assume (default: the model's parameter dtype).
    time_limit_s : float
        Partition search budget (seconds): an upper limit; the search stops as soon as its
        partition is proven optimal (``plan.partition.meta["proven_optimal"]``, e.g. by the
        chain DP on transformer stacks) or stops improving (``meta["stop_reason"]``).
    schedule_time_limit_s : float
        MILP budget when ``schedule="milp"``.
    seed : int
        Seed of the partition search.
    mem_limit_bytes : float, optional
        Per-device memory available for activations (schedule constraint).
    name : str, optional
        Model name for reports (default: the class name).
    progress : bool
        tqdm progress bars.
    replicate : {"auto", "always", "never"}
        Capture a deep stack of identical layers by exporting three and replicating one
        (:func:`fxpipe.passes.capture.capture`; same graph as a full export, much faster for
        70B-class models). ``"never"`` forces a full ``torch.export``.

    Returns
    -------
    Plan

    Raises
    ------
    InputError
        devices < 1, microbatches < 1, more devices than ops, unknown hardware/schedule/costs,
        ``costs="measured"`` with the datasheet spec or profile of another device.
    CaptureError
        The model cannot be exported (the message says which node and what to try).
    InfeasibleError
        The schedule cannot fit the memory limit.
    """
    devices = _check_count(devices, "devices")
    microbatches = _check_count(microbatches, "microbatches")
    if objective not in ("training", "inference"):
        raise InputError(f"objective must be 'training' or 'inference', got {objective!r}")
    if schedule not in SCHEDULES:
        raise InputError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if costs not in ("roofline", "measured"):
        raise InputError(f"costs must be 'roofline' or 'measured', got {costs!r}")
    if hardware is None:
        hardware = "measured" if costs == "measured" else "h100-sxm"
    hardware_name = getattr(hardware, "name", None) or str(hardware)
    timings_extra: dict[str, float] = {}
    if costs == "measured":
        from fxpipe.cost.profile import trace_measured

        traced, report = trace_measured(model, tuple(args), dict(kwargs or {}), hardware=hardware, dtype=dtype, name=name,
                                        db=cost_db, threads=profile_threads, progress=progress)
        timings_extra["profile"] = report.wall_s
    else:
        from fxpipe.passes import trace_model

        traced = trace_model(model, tuple(args), dict(kwargs or {}), hardware=hardware, dtype=dtype, name=name, replicate=replicate)
    graph = traced.graph
    part, problem, sched, timings = plan_graph(
        graph,
        devices=devices,
        microbatches=microbatches,
        objective=objective,
        schedule=schedule,
        time_limit_s=time_limit_s,
        schedule_time_limit_s=schedule_time_limit_s,
        seed=seed,
        mem_limit_bytes=mem_limit_bytes,
        host_bandwidth_bytes_per_s=traced.hardware.host_bytes_per_s,
        progress=progress,
    )
    stage_of = {graph.names[i]: int(part.assignment[i]) for i in range(graph.n)}
    plan = Plan(
        name=graph.name,
        devices=devices,
        microbatches=microbatches,
        hardware=hardware_name,
        objective=objective,
        comm="relay",
        graph=graph,
        partition=part,
        stage_of=stage_of,
        problem=problem,
        schedule=sched,
        stages=stage_stats(graph, part, problem, sched, objective),
        timings_s={"capture": traced.capture_s, "cost": traced.cost_s, "export": traced.export_s, **timings_extra, **timings},
        graph_signature=graph_signature(graph),
        options={"seed": seed, "time_limit_s": time_limit_s, "schedule": schedule, "dtype": str(dtype) if dtype else None,
                 "costs": costs},
        _captured=traced,
    )
    return plan
