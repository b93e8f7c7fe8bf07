"""``mesh="search"``: pick pp x dp_shard by predicted step time under the device memory (torch-free).

A first, simple joint search (issue 18 item 3): every mesh of :func:`fxpipe.mesh.candidate_meshes`
(``pp * dp_shard = devices``, ``dp_shard`` dividing the global micro-batches; ``dp_replicate``
is left out because with one link bandwidth it moves as many bytes as ``dp_shard`` and shards
nothing) is planned as a pipeline over ``pp`` devices with ``microbatches / dp_shard``
micro-batches (:func:`fxpipe.planner.plan_with_options`, with the memory model of the mesh,
:func:`fxpipe.mesh.mesh_memory`), and scored by

    predicted step = the schedule's objective value (its step time) + data-parallel sync

(:func:`fxpipe.mesh.pipeline_dp_sync_s`, ring collectives at the graph's bandwidth, not
overlapped). Candidates that do not fit the memory or have more stages than ops are skipped
with the reason. The smallest predicted step wins (ties: more pipeline stages, i.e. the order
of the candidates).

Not yet: a topology (intra- / inter-node bandwidths and rank placement), overlap of the
gradient sync with the pipeline, ``dp_replicate`` / HSDP candidates, pruning by bounds, and
reusing partitions across candidates (each ``pp`` is a separate partition search).
"""

from __future__ import annotations

from typing import Any

from fxpipe.errors import FxpipeError, InputError
from fxpipe.mesh import candidate_meshes, format_mesh, mesh_dp, mesh_memory, pipeline_dp_sync_s
from fxpipe.options import PlanOptions
from fxpipe.planner import plan_with_options

__all__ = ["search_mesh"]


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
        and one row per candidate: ``mesh``, ``mesh_text``, ``step_time_s`` (the schedule's),
        ``dp_sync_s``, ``predicted_step_s`` or ``skipped`` (the reason), ``chosen``.

    Raises
    ------
    FxpipeError
        The first candidate's error when no candidate could be planned (usually an
        ``InfeasibleError`` of the pure pipeline, with its remedies).
    """
    if options is None:
        options = PlanOptions(**plan_kwargs)
    elif plan_kwargs:
        raise InputError(f"search_mesh takes options or plan_graph keywords, not both: got {sorted(plan_kwargs)}")
    table: list[dict[str, Any]] = []
    best = None
    first_error: Exception | None = None
    timings: dict[str, float] = {}
    for mesh in candidate_meshes(devices, microbatches):
        row: dict[str, Any] = {"mesh": dict(mesh), "mesh_text": format_mesh(mesh)}
        table.append(row)
        mem = mesh_memory(memory, mesh)
        try:
            part, problem, sched, t = plan_with_options(graph, devices=mesh["pp"],
                                                        microbatches=microbatches // mesh_dp(mesh), options=options,
                                                        memory=mem, memory_bytes=mem.capacity_bytes)
        except (FxpipeError, InputError) as exc:
            first_error = first_error or exc
            row["skipped"] = str(exc).split("\n")[0]
            continue
        for k, v in t.items():
            timings[k] = timings.get(k, 0.0) + v
        sync = pipeline_dp_sync_s(graph, part.assignment, problem.device_of_stage, mesh)
        row.update(step_time_s=float(sched.value), dp_sync_s=sync, predicted_step_s=float(sched.value) + sync)
        if best is None or row["predicted_step_s"] < best[0]["predicted_step_s"] * (1 - 1e-9):
            best = (row, mesh, mem, (part, problem, sched))
    if best is None:
        raise first_error if first_error is not None else InputError(
            f"no mesh of {devices} devices divides {microbatches} micro-batches")
    row, mesh, mem, (part, problem, sched) = best
    row["chosen"] = True
    return mesh, mem, (part, problem, sched, timings), table
