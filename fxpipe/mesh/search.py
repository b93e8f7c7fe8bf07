"""``mesh="search"``: pick pp x dp_shard x dp_replicate x tp by predicted step time under the device memory (torch-free).

A joint search (issue 18 item 3): every mesh of :func:`fxpipe.mesh.candidate_meshes`
(``pp * dp = devices``, ``dp`` dividing the global micro-batches; the splits of ``dp`` into
``dp_shard * dp_replicate`` (HSDP) too when the graph carries a :class:`fxpipe.mesh.Topology`:
with one link bandwidth replication moves as many bytes as sharding and shards nothing) is
planned as a pipeline over ``pp`` devices with ``microbatches / dp``
micro-batches (:func:`fxpipe.planner.plan_with_options`, with the memory model of the mesh,
:func:`fxpipe.mesh.mesh_memory`), and scored by

    predicted step = the schedule's objective value (its step time) + the data-parallel sync
    the pipeline does not hide

(:func:`fxpipe.mesh.pipeline_step_s`: ring collectives on the links each data-parallel
dimension spans, NVLink inside a node and InfiniBand between nodes when the hardware's
topology is known, else the graph's one bandwidth; with one stage per device a device's
all-gather hides behind its wait for the first input and its reduction behind the others'
cool-down, as torch's pipelining runtime issues them; with several, not overlapped). The
smallest predicted step wins (ties: more pipeline stages).

Tensor parallelism (issue 29 item 4): every degree ``tp`` of :data:`TP_DEGREES` (1, 2, 4, 8) that
divides the devices and that the graph admits (:func:`tensor_parallel_degrees`: it divides every
attention block's heads and MLP's widths, something is split, ``tp`` consecutive ranks share a node)
multiplies the meshes: ``pp * dp_shard * dp_replicate * tp = devices``. A ``tp > 1`` candidate is
planned, bounded and checked for static fit on one tensor-parallel rank's graph
(:func:`fxpipe.mesh.tensor_parallel.tensor_parallel_graph`: 1/tp of the split ops' compute,
activations and parameters, the regions' collectives on the node's links), with the options
:func:`fxpipe.mesh.tensor_parallel.tensor_parallel_options` gives (checkpointing, recomputation and
offload included: the runtime runs them on the local shards) and the optimizer state on the device.
An optimizer pinned on the host keeps the search at ``tp = 1``.

Rank placement (issue 18 item 2, "the most talkative dimension inside the node"): with a
topology every mesh is costed under each rank order that places it differently
(:func:`rank_orders_to_try` of :data:`fxpipe.mesh.RANK_ORDERS`: pipeline rank innermost, fxpipe's
default, or outermost, torchtitan's, or between ``dp_replicate`` and ``dp_shard``). The order
sets which data-parallel groups stay inside a node (their sync, above) and which links the
pipeline's point-to-point sends cross: a candidate whose pipeline hops mostly cross nodes is
planned on the graph with the inter-node bandwidth (:func:`fxpipe.mesh.pipeline_graph`,
:func:`fxpipe.mesh.pipeline_link`); orders with the same pipeline link share one plan. The
order with the smaller predicted step is the mesh's (ties: the one planned first, the default on
equal bounds), recorded in its row
(``rank_order``, and every order's figures under ``by_order``) and in the returned mesh.

Kept fast by bounds: every candidate has a lower bound that needs no partition
(:func:`mesh_lower_bound_s`: perfectly balanced work without bubbles plus the sync of the average
device's parameters; when a best exists and the bound alone does not prune, refined with the busiest
stage's work over every partition, :func:`stage_work_bound_s`), and a candidate whose bound is no
better than the best predicted step so far is pruned without planning (none can win). A candidate
that passes is partitioned, and is pruned before scheduling when its schedule's lower bound
(:func:`fxpipe.schedule.bounds.recompute_lower_bound`: every valid schedule of its problem under every
checkpoint choice and offload; the predicted step is at least the schedule's value) is no better than
the best so far (:func:`fxpipe.planner.plan_with_options` ``beat_s``; its row says "pruned after
partitioning" with that bound, and its optimizer-on-host and per-block twins are tried as when its memory
binds). Candidates are planned in the order of :func:`planning_key_s` (the bound stretched by the
1F1B bubble, an estimate): a good best comes early and prunes the deep pipelines, whose bubble the
partition-free bound leaves out; what is pruned is decided by the bounds alone. A candidate whose average static state (parameters, gradients, optimizer state under the
mesh's memory model), with the least activations every device holds (one micro-batch,
checkpointed where allowed), already exceeds the usable memory is skipped without planning; so
is one the planner finds infeasible, with its reason (the partitioner refuses at once a stage
count whose memory chain bound overflows, :func:`fxpipe.partition.search.memory_lower_bound`);
so is one the runtime cannot run for this model (:mod:`fxpipe.mesh.limits`). Every candidate
is a row of the returned table. Activation checkpointing (issue 28) is chosen per stage by each
candidate's planner, so FSDP-heavy meshes are priced with per-block checkpointing; a sibling's
partition proven optimal that fits a candidate's memory is reused whatever the optimizer's
place.

Optimizer state on the host (ZeRO-Offload, Ren et al. 2021; :attr:`fxpipe.memory.MemoryModel.offload_optimizer`):
when the memory model leaves it to the search (``offload_optimizer=None``, the default) and the graph
records the hardware's host link and host memory bandwidth (:func:`fxpipe.mesh.host_links`), a
mesh whose memory binds with the optimizer state on the device (its static state does not fit,
the planner finds it infeasible, or its schedule recomputes or offloads activations) gets a
second row, ``"<mesh>, optimizer on host"``: the same mesh with only weights and gradients on
the device, its host step (:func:`fxpipe.mesh.optimizer_host_step_s`) in its bound and its
predicted step, skipped when its host state exceeds the host memory. It is planned in bound
order like every candidate, so it wins only on a faster predicted step.

Plans are reused across sibling candidates: meshes of one ``pp`` and ``tp`` (so one ``dp`` and the same
micro-batches per replica, one rank's graph) on one pipeline link, with the optimizer in the same place, differ
only in their memory (ZeRO-1 over ``dp_shard``) and sync; a plan made under memory at least as
loose is taken for a sibling when its schedule satisfies every rule of Contract 3 under the
sibling's activation limits (:func:`_reuse`; the sibling's feasible plans are a subset of the
looser one's, so the bounds stay valid), else the sibling is planned afresh.

Not yet: overlap of the sync with several stages per device, per-hop pipeline links (a pipeline is
costed at the link most of its hops use, one bandwidth for every stage boundary), reuse from a
tighter sibling to a looser one. Candidates may be planned ahead in worker processes
(:mod:`fxpipe.mesh.prefetch`, four cores or more).

Long searches (Llama-3-70B on 256 devices plans 35 candidates in 8 minutes on 2 cores) show a
progress line with ``progress=True`` (candidates planned, the best so far) and stop at Ctrl-C
(:class:`fxpipe.progress.Search`): the candidate being planned ends with its planner's best so
far, the rest are marked not planned, and the best mesh so far is returned with a
:class:`~fxpipe.errors.PlanWarning`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
import warnings
from typing import Any, Mapping

import numpy as np

from fxpipe.errors import FxpipeError, InfeasibleError, InputError, PlanWarning
from fxpipe.io import format_bytes, format_ms
from fxpipe.mesh import (
    MESH_DIMS,
    RANK_ORDERS,
    Topology,
    candidate_meshes,
    device_host_step_s,
    dp_sync_time_s,
    format_mesh,
    host_links,
    mesh_dp,
    mesh_tp,
    mesh_memory,
    optimizer_host_step_s,
    pipeline_dp_sync_s,
    pipeline_graph,
    pipeline_hops,
    pipeline_link,
    pipeline_step_s,
)
from fxpipe.memory.plan_view import schedule_mem_limit
from fxpipe.mesh.prefetch import PlanPrefetch, search_workers
from fxpipe.mesh.limits import mesh_runtime_limit, runtime_limits
from fxpipe.mesh.tensor_parallel import check_tensor_parallel, tensor_parallel_graph, tensor_parallel_options
from fxpipe.options import PlanOptions
from fxpipe.partition.memory import num_params
from fxpipe.planner import CandidatePruned, plan_with_options
from fxpipe.progress import Search
from fxpipe.schedule.validate import check_schedule

__all__ = ["search_mesh", "mesh_lower_bound_s", "planning_key_s", "rank_orders_to_try", "optimizer_placements", "block_units_allowed",
           "tensor_parallel_degrees", "TP_DEGREES", "OFFLOAD_SUFFIX", "BLOCK_UNITS_SUFFIX", "BLOCK_UNITS_SYNC_SHARE"]

#: A candidate with whole-stage FSDP2 units whose exposed data-parallel sync is above this share of its
#: predicted step, and whose step without that sync would beat the best so far, is also planned with
#: per-block units (which hide the sync behind each block's compute but gather and reduce every
#: micro-batch); where whole-stage units do not fit or bind memory they are tried anyway. Which
#: candidates are planned, not how one is judged: the search keeps the fastest.
BLOCK_UNITS_SYNC_SHARE = 0.05

#: Appended to a candidate's ``mesh_text`` when its optimizer state lives on the host.
OFFLOAD_SUFFIX = ", optimizer on host"
#: How a mesh with per-block FSDP2 units is named in the search's table.
BLOCK_UNITS_SUFFIX = ", FSDP2 unit per block"


def optimizer_placements(memory, mesh: Mapping[str, Any], host: Mapping[str, float] | None,
                         objective: str = "training") -> list[bool]:
    """Where the search may keep the optimizer state of ``mesh``, in the order it tries them: ``[False]``
    (on the device), then ``True`` (offloaded to the host, :attr:`fxpipe.memory.MemoryModel.offload_optimizer`)
    in training when the hardware's host link and host memory bandwidth are known and ``memory`` leaves the
    choice to the search (``offload_optimizer=None``); the user's choice alone when it is ``True`` or
    ``False``. :func:`search_mesh` plans the second only for a mesh whose memory binds on the device."""
    if memory.offload_optimizer is not None:
        return [bool(memory.offload_optimizer)]
    if getattr(memory, "fsdp_units", None) == "block" and int(mesh.get("dp_shard", 1)) > 1:
        return [False]  # per-block FSDP2 units do not run with optimizer offload yet
    if mesh_tp(mesh) > 1:  # tensor parallelism with the optimizer on the host is not run (nor tested) yet
        return [False]
    if objective != "training" or not host or not host["host_bytes_per_s"] > 0 \
            or not host["host_memory_bytes_per_s"] > 0:
        return [False]
    return [False, True]


#: The tensor-parallel degrees the search tries (torchtitan's and Megatron-LM's: powers of two inside a node).
TP_DEGREES = (1, 2, 4, 8)


def tensor_parallel_degrees(graph, devices: int, memory, options: PlanOptions) -> list[int]:
    """The degrees of :data:`TP_DEGREES` the search plans: those dividing ``devices`` that the graph admits
    (:func:`fxpipe.mesh.tensor_parallel.check_tensor_parallel`: they divide the heads and widths of every
    attention block and MLP, something is split, and with a known topology ``tp`` consecutive ranks share a
    node), and only 1 when the optimizer state is pinned on the host (not run with tensor parallelism yet).
    A ``tp > 1`` candidate is planned with the options :func:`tensor_parallel_options` gives (activation
    checkpointing, recomputation and offload included: the runtime runs them on the local shards)."""
    if memory.offload_optimizer is True:
        return [1]
    out = [1]
    for tp in TP_DEGREES[1:]:
        if int(devices) % tp:
            continue
        try:
            check_tensor_parallel(graph, tp)
        except InputError:
            continue
        out.append(tp)
    return out


class _RankView:
    """One tensor-parallel rank of degree ``tp``: its graph (:func:`fxpipe.mesh.tensor_parallel.tensor_parallel_graph`),
    its planning options, its parameters and its least activations (:func:`_activation_floor`)."""

    def __init__(self, graph, tp: int, options: PlanOptions, topology) -> None:
        self.graph = tensor_parallel_graph(graph, tp, topology)
        self.options = tensor_parallel_options(options) if tp > 1 else options
        self.params = float(np.sum(num_params(self.graph)))
        self.act_floor = _activation_floor(self.graph, self.options)


def rank_orders_to_try(mesh: Mapping[str, Any], topology: Topology | None) -> list[tuple[str, str, str]]:
    """The rank orders that place ``mesh`` differently, the default first (only it without a topology:
    with one link every order costs the same)."""
    if topology is None or mesh_dp(mesh) == 1:
        return [MESH_DIMS]
    out, seen = [], set()
    for order in RANK_ORDERS:
        eff = tuple(d for d in order if int(mesh.get(d, 1)) > 1)
        if eff not in seen:
            seen.add(eff)
            out.append(order)
    return out


def search_mesh(graph, *, devices: int, microbatches: int, memory, options: PlanOptions | None = None,
                **plan_kwargs: Any):
    """Plan every candidate mesh and rank order and keep the one with the smallest predicted step time.

    Parameters
    ----------
    graph : OpGraph
        The costed graph (one micro-batch).
    devices, microbatches : int
        All devices and the global micro-batches per step.
    memory : MemoryModel
        The memory model of a device without data parallelism (each candidate's comes from
        :func:`fxpipe.mesh.mesh_memory`).
    options : PlanOptions, optional
        The planning options of every candidate (default: built from ``plan_kwargs``).
    plan_kwargs :
        The options as keyword arguments of :func:`fxpipe.api.plan_graph` (without ``options``).

    Returns
    -------
    (mesh, memory, (partition, problem, schedule, timings), table)
        The chosen mesh (its degrees and, under ``"order"``, its rank order, outermost first,
        when it is not the default :data:`fxpipe.mesh.MESH_DIMS`),
        its memory model, :func:`~fxpipe.planner.plan_with_options`'s result for it (planned on
        :func:`fxpipe.mesh.pipeline_graph` of the mesh: keep that graph in the plan), and one row per
        candidate mesh and optimizer placement (in decreasing ``pp``, a mesh's "optimizer on host"
        row right after its own): ``mesh``, ``mesh_text``, ``offload_optimizer``, ``lower_bound_s`` (the
        smallest over its orders), then for its best order ``rank_order``, ``step_time_s`` (the
        schedule's), ``dp_sync_s`` (the busiest device's, whole), ``optimizer_host_step_s`` (the
        busiest device's host step, 0 without offload), ``exposed_sync_s`` (what of the sync and the
        host step the pipeline does not hide) and ``predicted_step_s`` (the schedule's plus that), or
        ``skipped`` (why: pruned by its bound, static state over the memory, or the planner's error);
        ``by_order``: one entry per rank order tried (``rank_order``, ``pipeline_bytes_per_s``,
        ``pipeline_hops_across_nodes`` ``[crossing, total]`` of :func:`fxpipe.mesh.pipeline_hops`,
        ``lower_bound_s`` and the times, ``reused`` when it took a sibling's plan, or ``skipped``);
        ``chosen`` on the winner.

    Raises
    ------
    FxpipeError
        When no candidate could be planned: a planner error that is not about memory as it is;
        else one ``InfeasibleError`` listing why each mesh was skipped, the training state
        against all devices' usable memory and the pure pipeline's remedies (its
        ``tried["meshes"]`` is the table).
    """
    if options is None:
        options = PlanOptions(**plan_kwargs)
    elif plan_kwargs:
        raise InputError(f"search_mesh takes options or plan_graph keywords, not both: got {sorted(plan_kwargs)}")
    topology = Topology.of_graph(graph)
    host = host_links(graph)
    limits = runtime_limits(graph)
    views = {tp: _RankView(graph, tp, options, topology) for tp in tensor_parallel_degrees(graph, devices, memory, options)}
    heap: list = []  # (lower bound, sequence, row, order entry, mesh, memory model, order)
    work_bounds: dict[tuple[int, int], float | None] = {}

    def view(mesh) -> "_RankView":
        """One tensor-parallel rank's graph and planning options of ``mesh``."""
        return views[mesh_tp(mesh)]

    def stage_work(mesh) -> float | None:
        """:func:`stage_work_bound_s` of ``pp`` stages (one per device; None with several per device)."""
        if options.placement_candidates() != [(1, "looped")]:
            return None
        key = (int(mesh["pp"]), mesh_tp(mesh))
        if key not in work_bounds:
            work_bounds[key] = stage_work_bound_s(view(mesh).graph, key[0], options.objective)
        return work_bounds[key]

    table = []
    seq = itertools.count()  # equal bounds: more stages first, the default order first, the device before the host

    def add_row(mesh, offload: bool, after: dict | None = None, units: str | None = None) -> None:
        """The row of ``mesh`` with the optimizer on the host or not (and per-block FSDP2 units with
        ``units="block"``), and a candidate per rank order."""
        mem = mesh_memory(dataclasses.replace(memory, offload_optimizer=offload,
                                              fsdp_units=units or memory.fsdp_units), mesh)
        row = {"mesh": dict(mesh), "mesh_text": format_mesh(mesh) + (OFFLOAD_SUFFIX if offload else "")
               + (BLOCK_UNITS_SUFFIX if mem.block_units else ""),
               "offload_optimizer": offload, "fsdp_units": "block" if mem.block_units else "stage", "by_order": []}
        for order in rank_orders_to_try(mesh, topology):
            entry = {"rank_order": list(order),
                     "pipeline_bytes_per_s": pipeline_link(mesh, graph.bandwidth_bytes_per_s, topology, order),
                     "pipeline_hops_across_nodes": list(pipeline_hops(mesh, topology, order)) if topology else [0, 0],
                     "lower_bound_s": mesh_lower_bound_s(view(mesh).graph, mesh, microbatches, options.objective, order,
                                                         memory=mem)}
            row["by_order"].append(entry)
            heapq.heappush(heap, (planning_key_s(entry["lower_bound_s"], mesh, microbatches), next(seq), row, entry,
                                  mesh, mem, order))
        row["lower_bound_s"] = min(e["lower_bound_s"] for e in row["by_order"])
        table.insert(table.index(after) + 1 if after is not None else len(table), row)

    offload_next: dict[str, bool] = {}  # mesh_text -> whether its optimizer may still move to the host
    # HSDP (dp_shard x dp_replicate) only pays off on a topology: with one bandwidth it moves as
    # many bytes as dp_shard alone and shards less
    for mesh in candidate_meshes(devices, microbatches, replicate=topology is not None, tp_degrees=tuple(views)):
        placements = optimizer_placements(memory, mesh, host, options.objective)
        add_row(mesh, placements[0])
        offload_next[format_mesh(mesh)] = len(placements) > 1
    best = None
    errors: dict[str, Exception] = {}  # mesh_text -> the planner's error
    timings: dict[str, float] = {}
    planned: dict[tuple, Any] = {}  # (mesh, pipeline bandwidth) -> the planner's result or error
    siblings: dict[tuple, list] = {}  # (pp, pipeline bandwidth, optimizer on host) -> [(memory, planner's result)]
    graphs: dict[tuple, Any] = {}  # (pipeline bandwidth, tp) -> the one graph planned on it

    blocks_next = {format_mesh(mesh) for mesh in candidate_meshes(devices, microbatches, replicate=topology is not None)
                   if block_units_allowed(graph, memory, mesh, options.objective, limits)}

    def sync_exposed(row: dict, mesh, entry: dict) -> None:
        """Whole-stage FSDP2 units of ``mesh`` leave a share of the step to the data-parallel sync: try per-block
        units too (once), whose collectives run per block under its compute (:data:`BLOCK_UNITS_SYNC_SHARE`),
        where the step without that sync would beat the best so far."""
        if row.get("fsdp_units") == "block" or format_mesh(mesh) not in blocks_next:
            return
        to_beat = entry["predicted_step_s"] if best is None else min(entry["predicted_step_s"],
                                                                     best[1]["predicted_step_s"])
        if entry["exposed_sync_s"] > BLOCK_UNITS_SYNC_SHARE * entry["predicted_step_s"] and \
                entry["predicted_step_s"] - entry["exposed_sync_s"] < to_beat:
            blocks_next.discard(format_mesh(mesh))
            add_row(mesh, False, after=row, units="block")

    def needs_host(row: dict, mesh) -> None:
        """The optimizer state of ``mesh`` binds its memory on the device: try it on the host too (once), and
        per-block FSDP2 units (once, with the optimizer on the device: they shard the weights and gradients too)."""
        if row.get("fsdp_units") == "block":
            return
        if format_mesh(mesh) in blocks_next:
            blocks_next.discard(format_mesh(mesh))
            add_row(mesh, False, after=row, units="block")
        if offload_next.pop(format_mesh(mesh), False) and not row["offload_optimizer"]:
            add_row(mesh, True, after=row)

    prefetch = PlanPrefetch(search_workers(graph))

    def ahead_args(cand):
        """``(key, plan arguments)`` of a candidate the search will plan unless a better mesh prunes it first, or
        None (pruned or skipped now, planned or in the works, or a sibling's plan it may reuse)."""
        _, _, row, entry, mesh, mem, order = cand
        key = (row["mesh_text"], entry["pipeline_bytes_per_s"])
        if key in planned or key in prefetch.jobs:
            return None
        bound = entry["lower_bound_s"]
        v = view(mesh)
        if best is not None and bound < best[1]["predicted_step_s"]:
            work = stage_work(mesh)
            if work is not None:
                bound = max(bound, mesh_lower_bound_s(v.graph, mesh, microbatches, options.objective, order, memory=mem,
                                                      stage_work_s=work))
        if best is not None and bound >= best[1]["predicted_step_s"]:
            return None
        if mesh_runtime_limit(mesh, row["offload_optimizer"], limits) is not None or \
                _static_misfit(mem, v.params / mesh["pp"], host, options.objective, v.act_floor / mesh["pp"])[0]:
            return None
        g, looser = _sibling_plan(v.graph, row, entry, mesh, mem, order, v.options, siblings, graphs, check=False)
        if looser is not None:
            return None
        return key, _plan_kwargs(g, row, entry, mesh, mem, microbatches, v.options, siblings, mesh["pp"] == devices,
                                 beat_s=None if best is None else best[1]["predicted_step_s"])

    # Ctrl-C: the best mesh so far (a candidate being planned ends with its planner's best so far)
    with Search("mesh search", unit="candidate", progress=options.progress) as run, prefetch:
        while heap and not run.stopped:
            _, _, row, entry, mesh, mem, order = heapq.heappop(heap)
            v = view(mesh)
            # refined only where it may prune
            work = stage_work(mesh) if best is not None and entry["lower_bound_s"] < best[1]["predicted_step_s"] else None
            if work is not None:
                entry["lower_bound_s"] = max(entry["lower_bound_s"], mesh_lower_bound_s(
                    v.graph, mesh, microbatches, options.objective, order, memory=mem, stage_work_s=work))
                row["lower_bound_s"] = min(e["lower_bound_s"] for e in row["by_order"])
            if best is not None and entry["lower_bound_s"] >= best[1]["predicted_step_s"]:
                entry["skipped"] = (f"pruned: its lower bound {format_ms(entry['lower_bound_s'])} is no better than "
                                    f"{best[0]['mesh_text']}'s predicted {format_ms(best[1]['predicted_step_s'])}")
                continue
            unrunnable = mesh_runtime_limit(mesh, row["offload_optimizer"], limits)  # fxpipe.mesh.limits
            if unrunnable is not None:
                entry["skipped"] = unrunnable
                continue
            misfit, on_device = _static_misfit(mem, v.params / mesh["pp"], host, options.objective,
                                               v.act_floor / mesh["pp"])
            if misfit is not None:
                entry["skipped"] = misfit
                if on_device:
                    needs_host(row, mesh)
                continue
            key = (row["mesh_text"], entry["pipeline_bytes_per_s"])  # the orders of one mesh on the same link share it
            if key not in planned:
                if prefetch.on and best is not None:  # the next candidates the search would plan, in worker processes
                    # (only once a best exists: before, they would be planned whole where its bound prunes them)
                    prefetch.ahead([(entry["lower_bound_s"], 0, row, entry, mesh, mem, order)]
                                   + heapq.nsmallest(4 * prefetch.workers, heap), ahead_args)
                t_plan = time.perf_counter()
                planned[key] = _plan_or_reuse(v.graph, row, entry, mesh, mem, order, microbatches, v.options,
                                              siblings, timings, graphs, explain=mesh["pp"] == devices,
                                              prefetch=prefetch, key=key,
                                              beat_s=None if best is None else best[1]["predicted_step_s"])
                entry["plan_s"] = time.perf_counter() - t_plan  # wall seconds this candidate took the search
            run.update(1, mesh=row["mesh_text"])
            if isinstance(planned[key], CandidatePruned):  # partitioned, but no schedule of it can beat the best
                if planned[key].while_scheduling:  # auto_schedule ran only the methods its bounds let beat the best
                    entry["skipped"] = (f"pruned while scheduling: no schedule found that may beat "
                                        f"{best[0]['mesh_text']}'s predicted {format_ms(best[1]['predicted_step_s'])} "
                                        f"(its schedule lower bound {format_ms(planned[key].lower_bound_s)})")
                else:
                    entry["skipped"] = (f"pruned after partitioning: its schedule lower bound "
                                        f"{format_ms(planned[key].lower_bound_s)} is no better than "
                                        f"{best[0]['mesh_text']}'s predicted {format_ms(best[1]['predicted_step_s'])}")
                entry["lower_bound_s"] = max(entry["lower_bound_s"], planned[key].lower_bound_s)
                needs_host(row, mesh)  # as if its memory bound: its twins are tried (and bounded) all the same
                continue
            if isinstance(planned[key], Exception):
                errors[row["mesh_text"]] = planned[key]
                entry["skipped"] = _first_sentence(str(planned[key]))
                if isinstance(planned[key], InfeasibleError):
                    needs_host(row, mesh)
                continue
            g, (part, problem, sched, _) = planned[key]
            if _memory_binds(problem, sched):  # recomputation or activation offload: more room may be faster
                needs_host(row, mesh)
            sync = pipeline_dp_sync_s(g, part.assignment, problem.device_of_stage, mesh, order, memory=mem,
                                      num_microbatches=problem.num_microbatches)
            step = pipeline_step_s(g, part.assignment, problem.device_of_stage, sched, mesh, order, memory=mem)
            host_s = max(device_host_step_s(g, part.assignment, problem.device_of_stage, mesh["pp"], mem))
            entry.update(step_time_s=float(sched.value), dp_sync_s=sync, exposed_sync_s=step - float(sched.value),
                         optimizer_host_step_s=host_s, predicted_step_s=step)
            if not row["offload_optimizer"]:
                sync_exposed(row, mesh, entry)
            if best is None or _better(entry, mesh, best[1], best[2]):
                best = (row, entry, mesh, mem, order, (part, problem, sched))
                run.update(0, best=f"{row['mesh_text']} {format_ms(step)}")
    left = [e for r in table for e in r["by_order"] if "predicted_step_s" not in e and "skipped" not in e]
    for entry in left:  # the search was stopped before (or while) planning them
        entry["skipped"] = "not planned: the search was stopped (Ctrl-C) before it"
    if run.interrupted and best is not None:
        warnings.warn(PlanWarning(
            f"the mesh search was stopped (Ctrl-C) with {len(left)} candidate(s) not planned: the plan is the best "
            f"mesh so far, {best[0]['mesh_text']} (its planning may have been cut short too)"), stacklevel=2)
    for row in table:  # each mesh's row: its best planned order, else why its orders were skipped
        done = [e for e in row["by_order"] if "predicted_step_s" in e]
        if done:
            _copy_figures(row, min(done, key=lambda e: e["predicted_step_s"]))
        else:
            row["skipped"] = row["by_order"][0]["skipped"]
    if best is None and run.interrupted:
        raise FxpipeError("the mesh search was stopped (Ctrl-C) before any mesh was planned: run it again, or pin a "
                          "mesh (mesh={'pp': ..., 'dp_shard': ...})")
    if best is None:
        raise _no_mesh_fits(graph, devices, microbatches, memory, options.objective, table, errors)
    row, entry, mesh, mem, order, (part, problem, sched) = best
    _copy_figures(row, entry)
    row["chosen"] = entry["chosen"] = True
    return ({**mesh, "order": tuple(order)} if tuple(order) != MESH_DIMS else dict(mesh)), mem, \
        (part, problem, sched, timings), table


def planning_key_s(lower_bound_s: float, mesh: Mapping[str, Any], microbatches: int) -> float:
    """The order in which the search plans its candidates (seconds; smallest first): the lower bound stretched by
    a 1F1B pipeline's bubble, ``(m + pp - 1) / m`` with ``m = microbatches / dp`` micro-batches per replica (Huang
    et al. 2019, GPipe Section 2.2; Narayanan et al. 2021, PipeDream-Flush). An estimate, not a bound: it only
    decides which candidates are planned first, so that a good best-so-far prunes the deep pipelines (whose
    bubble the lower bound leaves out) by their bounds; what is pruned is decided by the bounds alone."""
    pp = int(mesh["pp"])
    m = max(1, int(microbatches) // max(1, mesh_dp(mesh)))
    return float(lower_bound_s) * (m + pp - 1) / m


def _activation_floor(graph, options: PlanOptions) -> float:
    """The least activation bytes all the stages of any pipeline of ``graph`` hold together (training):
    every stage keeps one micro-batch's stash, or with checkpointing at least what per-block
    checkpointing keeps (:func:`fxpipe.memory.checkpoint.partition_floor`), so per node the smaller
    of the two (a sum of minima is at most the minimum of the sums, stage by stage). 0 in inference."""
    if options.objective != "training":
        return 0.0
    act = np.asarray(graph.act_bytes, dtype=np.float64)
    if options.activation_checkpointing == "none":
        return float(act.sum())
    from fxpipe.memory.checkpoint import partition_floor  # noqa: PLC0415

    return float(np.minimum(act, partition_floor(graph)[0]).sum())


def _static_misfit(mem, params_per_device: float, host: Mapping[str, float] | None,
                   objective: str, act_per_device: float = 0.0) -> tuple[str | None, bool]:
    """``(why, on the device)``: why a candidate cannot fit before any partition (its average
    device's static state, with ``act_per_device`` the least activations it holds on average, over
    the usable memory, or its optimizer state over the host memory), else ``(None, False)``."""
    static = mem.static_bytes_per_param(objective) * params_per_device
    if static > mem.usable_bytes:
        return (f"cannot fit: the static state alone needs {format_bytes(static)} per device on "
                f"average, over the usable {format_bytes(mem.usable_bytes)}"), True
    if static + act_per_device > mem.usable_bytes:
        return (f"cannot fit: the static state and the least activations (one micro-batch, checkpointed where "
                f"allowed) need {format_bytes(static + act_per_device)} per device on average, over the usable "
                f"{format_bytes(mem.usable_bytes)}"), True
    on_host = mem.host_bytes_per_param(objective) * params_per_device
    if host and host["host_memory_bytes"] > 0 and on_host > host["host_memory_bytes"]:
        return (f"cannot fit: the optimizer state on the host needs {format_bytes(on_host)} per device "
                f"on average, over its {format_bytes(host['host_memory_bytes'])} of host memory"), False
    return None, False


def _copy_figures(row: dict, entry: dict) -> None:
    """A rank order's figures (``entry``) as its mesh's (``row``)."""
    for k in ("rank_order", "step_time_s", "dp_sync_s", "exposed_sync_s", "optimizer_host_step_s", "predicted_step_s"):
        row[k] = entry[k]


def _plan_or_reuse(graph, row: dict, entry: dict, mesh, mem, order, microbatches: int, options: PlanOptions,
                   siblings: dict, timings: dict, graphs: dict, explain: bool = True, prefetch=None, key=None,
                   beat_s: float | None = None):
    """``(pipeline graph, planner's result)`` of a candidate, or the planner's error.

    Meshes of one pp (so one dp and the same micro-batches per replica) on one pipeline link, with
    the optimizer in the same place, differ only in their memory (ZeRO-1 over dp_shard) and sync:
    a sibling's plan made under memory at least as loose is taken when it fits here (:func:`_reuse`;
    this mesh's feasible plans are a subset of the sibling's), marked ``reused`` in ``entry``;
    else the pipeline is planned (or its plan taken from ``prefetch``, :class:`fxpipe.mesh.prefetch.PlanPrefetch`,
    when made with the same arguments, under ``key``) and kept in ``siblings``, its phase times added to
    ``timings``. With ``beat_s`` (the best predicted step so far) the planner stops after partitioning when no
    schedule can beat it, and the :class:`~fxpipe.planner.CandidatePruned` it raises is returned.
    """
    g, reused = _sibling_plan(graph, row, entry, mesh, mem, order, options, siblings, graphs)
    if reused is not None:
        entry["reused"] = True
        return g, reused
    kwargs = _plan_kwargs(g, row, entry, mesh, mem, microbatches, options, siblings, explain, beat_s=beat_s)
    got, result = prefetch.take(key, kwargs) if prefetch is not None else (False, None)
    if not got:
        try:
            result = plan_with_options(**kwargs)
        except (FxpipeError, InputError) as exc:
            result = exc
    if isinstance(result, Exception):
        return result
    siblings.setdefault(_group(row, entry, mesh), []).append((mem, result))
    for k, v in result[3].items():
        timings[k] = timings.get(k, 0.0) + v
    return g, result


def _group(row: dict, entry: dict, mesh) -> tuple:
    """The sibling group of a candidate: its pp, tp (the graph of one tensor-parallel rank), pipeline link,
    optimizer place and FSDP2 units."""
    return (int(mesh["pp"]), mesh_tp(mesh), entry["pipeline_bytes_per_s"], bool(row["offload_optimizer"]),
            row.get("fsdp_units"))


def block_units_allowed(graph, memory, mesh, objective: str, limits: Mapping[str, str]) -> bool:
    """Whether the search tries per-block FSDP2 units for ``mesh`` (when its whole-stage units bind memory):
    training, ``memory`` leaves the units to it (``fsdp_units=None``) with the optimizer not pinned to the
    host, ``dp_shard > 1`` (with tensor parallelism too: 2-D ``fully_shard`` per block), a graph with repeated
    blocks and nothing recorded against them (:data:`fxpipe.mesh.limits`, ``"fsdp_blocks"``: parameters of
    several dtypes)."""
    if objective != "training" or memory.fsdp_units is not None or memory.offload_optimizer is True:
        return False
    if int(mesh.get("dp_shard", 1)) < 2 or "fsdp_blocks" in limits:
        return False
    from fxpipe.memory.fsdp import block_units  # noqa: PLC0415 - torch-free

    return bool(np.any(block_units(graph) >= 0))


def _sibling_plan(graph, row: dict, entry: dict, mesh, mem, order, options: PlanOptions, siblings: dict,
                  graphs: dict, check: bool = True):
    """``(pipeline graph, a sibling's plan that fits here or None)``; with ``check=False`` the plan of any
    looser sibling, not checked (whether one may be reused)."""
    g = pipeline_graph(graph, mesh, order)
    g = graphs.setdefault((float(g.bandwidth_bytes_per_s), mesh_tp(mesh)), g)  # one graph object per link and tp
    for looser, result in siblings.get(_group(row, entry, mesh), ()):
        if looser.static_bytes_per_param(options.objective) <= mem.static_bytes_per_param(options.objective):
            reused = _reuse(g, result, mem, options) if check else result
            if reused is not None:
                return g, reused
    return g, None


def _plan_kwargs(g, row: dict, entry: dict, mesh, mem, microbatches: int, options: PlanOptions, siblings: dict,
                 explain: bool, beat_s: float | None = None) -> dict:
    """The arguments :func:`~fxpipe.planner.plan_with_options` plans a candidate with (``beat_s``: the best
    predicted step so far, which the candidate's schedule must beat; every predicted step is at least its
    schedule's value, :func:`fxpipe.mesh.pipeline_step_s`)."""
    m = microbatches // mesh_dp(mesh)
    if mem.block_units:  # per-block FSDP2 units run without activation offload yet (fxpipe.codegen.mesh)
        options = dataclasses.replace(options, host_bandwidth_bytes_per_s=None)
    return dict(graph=g, devices=int(mesh["pp"]), microbatches=m, options=options, memory=mem,
                memory_bytes=mem.capacity_bytes, explain=explain, beat_s=beat_s,
                partitions=_proven_partition(g, siblings, _group(row, entry, mesh), mem, options, m))


def _proven_partition(graph, siblings: dict, group: tuple, memory, options: PlanOptions, microbatches: int) -> dict:
    """``{k: partition}`` of a plan made for the same ``pp``, ``tp`` and pipeline link (the optimizer anywhere) whose
    partition is proven optimal (its bottleneck meets a bound that ignores memory) and fits ``memory`` by the
    partitioner's rule: the partition the planner would find here too, so it is not searched again."""
    from fxpipe.partition.memory import PartitionMemory, stage_memory_bytes  # noqa: PLC0415

    pm = PartitionMemory(memory, microbatches, "floor", checkpointing=options.objective == "training"
                         and options.activation_checkpointing != "none")
    for (pp, tp, link, *_), results in siblings.items():
        if (pp, tp, link) != group[:3]:
            continue
        for _, (part, *_rest) in results:
            if not part.meta.get("proven_optimal"):
                continue
            need = stage_memory_bytes(graph, part.assignment, part.k, options.objective, pm, "relay")
            if float(need.max()) <= pm.usable_bytes * (1 + 1e-12):
                return {part.k: part}
    return {}


def _reuse(graph, result, memory, options: PlanOptions):
    """``result`` (a :func:`~fxpipe.planner.plan_with_options` result for another memory model) as the plan under
    ``memory``: its problem with ``memory``'s activation limits, when its schedule still satisfies every rule
    there (so every device fits); else None. The schedule's bounds stay valid: a tighter problem's optimum is
    no smaller."""
    part, problem, sched, _ = result
    try:
        limit = schedule_mem_limit(graph, part.assignment, part.k, problem.device_of_stage, memory,
                                   problem.num_microbatches, options.objective)
    except InfeasibleError:
        return None
    if options.mem_limit_bytes is not None:
        limit = np.minimum(limit, float(options.mem_limit_bytes))
    there = dataclasses.replace(problem, mem_limit=np.asarray(limit, dtype=np.float64))
    if check_schedule(there, sched):
        return None
    return part, there, sched, {}


def _memory_binds(problem, schedule) -> bool:
    """Whether a planned pipeline recomputes activations or offloads them: its device memory binds."""
    return bool(np.any(np.asarray(getattr(problem, "recompute", None) or (), dtype=bool))) or \
        any(op.type in ("O", "R") for op in schedule.ops)


def _first_sentence(text: str) -> str:
    """The first sentence of an error message (the reason; the remedies follow it)."""
    line = text.split("\n")[0]
    cut = line.find(". ")
    return line if cut < 0 else line[: cut + 1]


def _no_mesh_fits(graph, devices: int, microbatches: int, memory, objective: str, table: list[dict],
                  errors: dict[str, Exception]) -> Exception:
    """The error when no candidate mesh could be planned: why each was skipped, what the whole
    training state needs against all devices' usable memory, and the pure pipeline's remedies
    (``errors``: the planner's error of each mesh it tried, by ``mesh_text``)."""
    if not table:
        return InfeasibleError(f"no mesh of {devices} devices divides {microbatches} micro-batches: "
                               "use a micro-batch count that the data-parallel degrees divide")
    for exc in errors.values():
        if not isinstance(exc, InfeasibleError):
            return exc  # a bad option, not memory: the planner's own message
    pure = next((r["mesh_text"] for r in table if r["mesh"]["pp"] == devices), None)
    first_error = errors.get(pure) if pure in errors else next(iter(errors.values()), None)
    params = float(np.sum(num_params(graph)))
    total = memory.static_bytes_per_param(objective) * params
    usable = memory.usable_bytes * devices
    lines = [f"no mesh of {devices} devices fits {format_bytes(memory.capacity_bytes)} per device:"]
    lines += [f"  {r['mesh_text']}: {r['skipped']}" for r in table]
    if objective == "training" and total > 0:
        lines.append(
            f"The training state alone ({params / 1e9:.3g}B parameters x {memory.static_bytes_per_param(objective):g} "
            f"bytes under {memory.precision.name}) is {format_bytes(total)}, {100 * total / usable:.0f}% of the "
            f"{format_bytes(usable)} all {devices} devices can use; whatever the mesh, the rest must hold the "
            "activations, receive buffers and the largest stage's imbalance.")
    remedies = getattr(first_error, "remedies", None) or {}
    if remedies.get("devices") and pure in errors:  # the device count that fits, as a pure pipeline
        lines.append(remedies["devices"])
    tried_host = any(r.get("offload_optimizer") for r in table)
    lines.append("Or: a precision policy with less state per parameter (MemoryModel(policy='bf16-adam'): 8 bytes), "
                 + ("" if tried_host or memory.offload_optimizer is True else
                    "the optimizer state on the host (MemoryModel(offload_optimizer=True), on hardware whose host "
                    "link and memory bandwidth fxpipe knows), ")
                 + "devices with more memory, or fewer micro-batches per step.")
    return InfeasibleError("\n".join(lines), overflow_bytes=getattr(first_error, "overflow_bytes", None),
                           required_capacity_bytes=getattr(first_error, "required_capacity_bytes", None),
                           min_devices=getattr(first_error, "min_devices", None), remedies=remedies,
                           tried={"meshes": [dict(r) for r in table]})


def _better(entry: dict, mesh: dict, best: dict, best_mesh: dict) -> bool:
    """Smaller predicted step; on a tie (1e-9 relative) more pipeline stages (the pure pipeline first), then
    the candidate planned first (smaller :func:`planning_key_s`; on equal keys the default rank order)."""
    a, b = entry["predicted_step_s"], best["predicted_step_s"]
    if a < b * (1 - 1e-9):
        return True
    return a <= b * (1 + 1e-9) and mesh["pp"] > best_mesh["pp"]


def stage_work_bound_s(graph, k: int, objective: str = "training") -> float:
    """A lower bound on the work (seconds per micro-batch, F + B + W in training) of the busiest of ``k``
    stages over every partition of ``graph``: the chain bound (:func:`fxpipe.partition.chain.solve_chain`,
    valid for every partition) of the graph with free communication: above ``work / k`` where the ops do
    not split evenly (Llama-3-70B into 64 stages: 10 % above). The mesh search refines a candidate's
    bound with it when it pops one it might prune."""
    from fxpipe.partition.chain import solve_chain  # noqa: PLC0415 - lazy: numba kernels

    if int(k) < 2 or graph.n < 2:
        return float(np.sum(graph.work_s(objective))) if int(k) == 1 else 0.0
    surrogate = _WORK_GRAPHS.get((id(graph), objective))
    if surrogate is None or surrogate[0] is not graph:
        free = dataclasses.replace(graph, t_fwd_s=np.asarray(graph.work_s(objective), dtype=np.float64),
                                   t_bwd_input_s=np.zeros(graph.n), t_bwd_weight_s=np.zeros(graph.n),
                                   bandwidth_bytes_per_s=1e300)
        if len(_WORK_GRAPHS) > 8:
            _WORK_GRAPHS.clear()
        surrogate = _WORK_GRAPHS[(id(graph), objective)] = (graph, free)
    return float(solve_chain(surrogate[1], int(k), "inference", "relay", partition=False).lower_bound_s)


#: The free-communication copy of a graph :func:`stage_work_bound_s` bounds (one per graph: its chain
#: decomposition is reused for every stage count).
_WORK_GRAPHS: dict = {}


def mesh_lower_bound_s(graph, mesh, microbatches: int, objective: str = "training", order: Any = None,
                       memory=None, stage_work_s: float | None = None) -> float:
    """A lower bound on the predicted step of ``mesh`` that needs no partition (seconds).

    Every replica runs ``microbatches / dp`` micro-batches over ``pp`` devices, so its busiest
    device computes at least ``microbatches / dp * W / pp`` (``W`` the work of one micro-batch:
    F + B + W of every op for training, F for inference), and the step time of any schedule
    (makespan or per-device span) is at least that; every device's compute and data-parallel
    sync lie end to end in :func:`fxpipe.mesh.pipeline_step_s`'s prediction, whose maximum over
    the devices is at least their mean, the average compute plus
    :func:`fxpipe.mesh.dp_sync_time_s` of ``sum(size_param_bytes) / pp`` (affine in the bytes).
    Ops are atomic (a partition assigns each graph node to one stage), so the busiest device also
    holds at least the largest op, and one device holds two of the ``pp + 1`` largest: the
    classic lower bounds of makespan scheduling on identical machines, ``max(sum / P, p_1,
    p_P + p_(P+1))`` for jobs ``p_1 >= p_2 >= ...`` on ``P`` machines (Graham 1969; Dell'Amico and
    Martello 1995, bound L1 and its pigeonhole companion), each with that device's sync (at
    least the sync of the largest op's parameters, resp. of none). Every device's compute and sync
    lie end to end in :func:`fxpipe.mesh.pipeline_step_s` (see there), so each is a lower bound;
    the bound is their maximum. For a long pipeline of a model with a large op (an 8B decoder's
    ``lm_head`` is about 6 % of its work) the atomic-op terms dominate: that is what lets the
    search skip 256-stage pipelines without planning them.
    Communication between stages, bubbles and recomputation only add to all of them.

    And the round trip of one micro-batch (Contract 3 chains the stages: ``F(s, j)`` follows
    ``F(s - 1, j)``, ``B(s, j)`` follows ``B(s + 1, j)``): the first stage's span, from its first
    forward to the backward of that micro-batch, holds every op's forward and backward-input time,
    ``sum(t_fwd_s + t_bwd_input_s)`` (the forward alone in inference), whatever the partition; a
    makespan holds it too. It is what a deep pipeline with few micro-batches per stage pays (the
    round-trip term of :func:`fxpipe.schedule.bounds.stage_span_bounds` with the stage's own work
    left out), and what lets the search skip 256-stage pipelines of a 405B model without planning them.

    Parameters
    ----------
    graph : OpGraph
        The costed graph of one micro-batch (times in seconds, parameter bytes, its topology).
    mesh : Mapping[str, int]
        ``pp``, ``dp_shard``, ``dp_replicate``.
    microbatches : int
        Global micro-batches per step (divided among the ``dp`` replicas).
    objective : {"training", "inference"}
    order : sequence of str, optional
        The rank order the data-parallel groups' links follow (default: the mesh's ``"order"``,
        else pipeline rank innermost).
    memory : MemoryModel, optional
        The mesh's memory model: with ``offload_optimizer`` every device's host step
        (:func:`fxpipe.mesh.optimizer_host_step_s`, linear in its parameters) joins its sync; with per-block
        FSDP2 units (``fsdp_units="block"``) the sync counts its latencies only (its transfers may hide behind
        the blocks' compute, :func:`fxpipe.mesh.costs.block_fsdp_parts_s`).
    stage_work_s : float, optional
        A lower bound on the busiest stage's work per micro-batch over every partition into ``pp``
        stages (:func:`stage_work_bound_s`): with one stage per device that device computes at
        least ``microbatches / dp`` times it, so the bound is at least that (plus the sync of no
        parameters).

    Returns
    -------
    float
        Seconds.
    """
    work_per_op = np.asarray(graph.t_fwd_s, dtype=np.float64)
    if objective == "training":
        work_per_op = work_per_op + np.asarray(graph.t_bwd_input_s) + np.asarray(graph.t_bwd_weight_s)
    pp = int(mesh["pp"])
    per_replica = microbatches // mesh_dp(mesh)
    topology = Topology.of_graph(graph)
    param_bytes = np.asarray(graph.size_param_bytes, dtype=np.float64)

    params = num_params(graph) if getattr(memory, "offload_optimizer", False) else np.zeros_like(param_bytes)
    host = host_links(graph)

    blocks = bool(getattr(memory, "block_units", False))  # per-block units hide their collectives but the latency

    def sync(b: float, n: float = 0.0) -> float:  # the sync of b parameter bytes and the host step of n parameters
        return (dp_sync_time_s(0.0 if blocks else b, mesh, graph.bandwidth_bytes_per_s, topology=topology, order=order)
                + (optimizer_host_step_s(n, memory, host) if n > 0 else 0.0))

    # the average device: its compute and the sync of its parameters (affine in the bytes)
    bound = per_replica * float(work_per_op.sum()) / pp + sync(float(param_bytes.sum()) / pp, float(params.sum()) / pp)
    if work_per_op.size:  # ops are atomic: the device holding the largest one, and two of the pp + 1 largest
        top = np.argsort(-work_per_op, kind="stable")
        bound = max(bound, per_replica * float(work_per_op[top[0]]) + sync(float(param_bytes[top[0]]),
                                                                             float(params[top[0]])))
        if work_per_op.size > pp:
            bound = max(bound, per_replica * float(work_per_op[top[pp - 1]] + work_per_op[top[pp]]) + sync(0.0))
    if stage_work_s is not None:  # the busiest stage of any partition (one stage per device)
        bound = max(bound, per_replica * float(stage_work_s) + sync(0.0))
    # one micro-batch's round trip: forward through every stage, backward through every stage
    trip = float(np.sum(graph.t_fwd_s)) + (float(np.sum(graph.t_bwd_input_s)) if objective == "training" else 0.0)
    return max(bound, trip + sync(0.0))
