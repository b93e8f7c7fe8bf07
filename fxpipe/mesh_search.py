"""``mesh="search"``: pick pp x dp_shard by predicted step time under the device memory (torch-free).

A joint search (issue 18 item 3): every mesh of :func:`fxpipe.mesh.candidate_meshes`
(``pp * dp = devices``, ``dp`` dividing the global micro-batches; the splits of ``dp`` into
``dp_shard * dp_replicate`` (HSDP) too when the graph carries a :class:`fxpipe.mesh.Topology`:
with one link bandwidth replication moves as many bytes as sharding and shards nothing) is
planned as a pipeline over ``pp`` devices with ``microbatches / dp``
micro-batches (:func:`fxpipe.planner.plan_with_options`, with the memory model of the mesh,
:func:`fxpipe.mesh.mesh_memory`), and scored by

    predicted step = the schedule's objective value (its step time) + data-parallel sync

(:func:`fxpipe.mesh.pipeline_dp_sync_s`: ring collectives on the links each data-parallel
dimension spans, NVLink inside a node and InfiniBand between nodes when the hardware's
topology is known, else the graph's one bandwidth; not overlapped). The smallest predicted step wins (ties: more pipeline stages).

Kept fast by bounds: the candidates are planned in increasing order of a lower bound that needs
no partition (:func:`mesh_lower_bound_s`: perfectly balanced work without bubbles plus the sync
of the average device's parameters), and the search stops at the first candidate whose bound
is no better than the best predicted step so far (the rest are pruned: none can win). A
candidate whose average static state (parameters, gradients, optimizer state under the mesh's
memory model) already exceeds the usable memory is skipped without planning; so is one the
planner finds infeasible, with its reason. Every candidate is a row of the returned table.

Not yet: choosing the rank placement on the topology (ranks are placed pipeline rank innermost,
:func:`fxpipe.mesh.rank_coords`; torchtitan puts the data-parallel dimensions innermost),
overlap of the gradient sync with the pipeline, pipeline links that cross nodes (the partition
costs every stage boundary at the graph's bandwidth), and reusing partitions across
candidates (each ``pp`` is a separate partition search).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fxpipe.errors import FxpipeError, InfeasibleError, InputError
from fxpipe.io import format_bytes
from fxpipe.mesh import (
    Topology,
    candidate_meshes,
    dp_sync_time_s,
    format_mesh,
    mesh_dp,
    mesh_memory,
    pipeline_dp_sync_s,
)
from fxpipe.partition.memory import num_params
from fxpipe.options import PlanOptions
from fxpipe.planner import plan_with_options

__all__ = ["search_mesh", "mesh_lower_bound_s"]


def search_mesh(graph, *, devices: int, microbatches: int, memory, options: PlanOptions | None = None,
                **plan_kwargs: Any):
    """Plan every candidate mesh and keep the one with the smallest predicted step time.

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
        The chosen mesh, its memory model, :func:`~fxpipe.planner.plan_with_options`'s result for it,
        and one row per candidate (in decreasing ``pp``): ``mesh``, ``mesh_text``,
        ``lower_bound_s``, then ``step_time_s`` (the schedule's), ``dp_sync_s`` and
        ``predicted_step_s``, or ``skipped`` (why: pruned by its bound, static state over the
        memory, or the planner's error); ``chosen`` on the winner.

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
    graph_params = float(np.sum(num_params(graph)))
    rows = []
    # HSDP (dp_shard x dp_replicate) only pays off on a topology: with one bandwidth it moves as
    # many bytes as dp_shard alone and shards less
    for mesh in candidate_meshes(devices, microbatches, replicate=Topology.of_graph(graph) is not None):
        mem = mesh_memory(memory, mesh)
        rows.append(({"mesh": dict(mesh), "mesh_text": format_mesh(mesh),
                      "lower_bound_s": mesh_lower_bound_s(graph, mesh, microbatches, options.objective)}, mesh, mem))
    table = [r for r, _, _ in rows]
    rows.sort(key=lambda x: x[0]["lower_bound_s"])  # stable: equal bounds keep more pipeline stages first
    best = None
    errors: dict[str, Exception] = {}  # mesh_text -> the planner's error
    timings: dict[str, float] = {}
    for row, mesh, mem in rows:
        if best is not None and row["lower_bound_s"] >= best[0]["predicted_step_s"]:
            row["skipped"] = (f"pruned: its lower bound {row['lower_bound_s'] * 1e3:.4g} ms is no better than "
                              f"{best[0]['mesh_text']}'s predicted {best[0]['predicted_step_s'] * 1e3:.4g} ms")
            continue
        static = mem.static_bytes_per_param(options.objective) * graph_params / mesh["pp"]
        if static > mem.usable_bytes:
            row["skipped"] = (f"cannot fit: the static state alone needs {format_bytes(static)} per device on average, "
                              f"over the usable {format_bytes(mem.usable_bytes)}")
            continue
        try:
            part, problem, sched, t = plan_with_options(graph, devices=mesh["pp"],
                                                        microbatches=microbatches // mesh_dp(mesh), options=options,
                                                        memory=mem, memory_bytes=mem.capacity_bytes)
        except (FxpipeError, InputError) as exc:
            errors[row["mesh_text"]] = exc
            row["skipped"] = _first_sentence(str(exc))
            continue
        for k, v in t.items():
            timings[k] = timings.get(k, 0.0) + v
        sync = pipeline_dp_sync_s(graph, part.assignment, problem.device_of_stage, mesh)
        row.update(step_time_s=float(sched.value), dp_sync_s=sync, predicted_step_s=float(sched.value) + sync)
        if best is None or _better(row, best[0]):
            best = (row, mesh, mem, (part, problem, sched))
    if best is None:
        raise _no_mesh_fits(graph, devices, microbatches, memory, options.objective, table, errors)
    row, mesh, mem, (part, problem, sched) = best
    row["chosen"] = True
    return mesh, mem, (part, problem, sched, timings), table


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
    lines.append("Or: a precision policy with less state per parameter (MemoryModel(policy='bf16-adam'): 8 bytes), "
                 "devices with more memory, or fewer micro-batches per step.")
    return InfeasibleError("\n".join(lines), overflow_bytes=getattr(first_error, "overflow_bytes", None),
                           required_capacity_bytes=getattr(first_error, "required_capacity_bytes", None),
                           min_devices=getattr(first_error, "min_devices", None), remedies=remedies,
                           tried={"meshes": [dict(r) for r in table]})


def _better(row: dict, best: dict) -> bool:
    """Smaller predicted step; on a tie (1e-9 relative) more pipeline stages (the pure pipeline first)."""
    a, b = row["predicted_step_s"], best["predicted_step_s"]
    if a < b * (1 - 1e-9):
        return True
    return a <= b * (1 + 1e-9) and row["mesh"]["pp"] > best["mesh"]["pp"]


def mesh_lower_bound_s(graph, mesh, microbatches: int, objective: str = "training") -> float:
    """A lower bound on the predicted step of ``mesh`` that needs no partition (seconds).

    Every replica runs ``microbatches / dp`` micro-batches over ``pp`` devices, so its busiest
    device computes at least ``microbatches / dp * W / pp`` (``W`` the work of one micro-batch:
    F + B + W of every op for training, F for inference), and the step time of any schedule
    (makespan or per-device span) is at least that; the busiest device holds at least the
    average parameter bytes, so the data-parallel sync is at least
    :func:`fxpipe.mesh.dp_sync_time_s` of ``sum(size_param_bytes) / pp`` (it grows with the
    bytes). Communication between stages, bubbles and recomputation only add to both.

    Parameters
    ----------
    graph : OpGraph
        The costed graph of one micro-batch (times in seconds, parameter bytes, its topology).
    mesh : Mapping[str, int]
        ``pp``, ``dp_shard``, ``dp_replicate``.
    microbatches : int
        Global micro-batches per step (divided among the ``dp`` replicas).
    objective : {"training", "inference"}

    Returns
    -------
    float
        Seconds.
    """
    work = float(np.sum(graph.t_fwd_s))
    if objective == "training":
        work += float(np.sum(graph.t_bwd_input_s) + np.sum(graph.t_bwd_weight_s))
    pp = int(mesh["pp"])
    per_replica = microbatches // mesh_dp(mesh)
    sync = dp_sync_time_s(float(np.sum(graph.size_param_bytes)) / pp, mesh, graph.bandwidth_bytes_per_s,
                          topology=Topology.of_graph(graph))
    return per_replica * work / pp + sync
