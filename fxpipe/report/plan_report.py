"""The report of a :class:`fxpipe.Plan`: the partition report plus its plan, schedule
(Gantt chart, Chrome/Perfetto trace) and memory sections."""

from __future__ import annotations

import html
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from fxpipe.io import format_bytes
from fxpipe.mesh import format_mesh
from fxpipe.plan.core import _objective_lines
from fxpipe.report.charts import memory_chart
from fxpipe.report.document import ReportSection, write_report
from fxpipe.report.gantt import gantt
from fxpipe.report.trace import chrome_trace

__all__ = ["plan_memory_section", "write_plan_report"]


def plan_memory_section(plan) -> ReportSection:
    """The report's memory section of a :class:`fxpipe.Plan`: its memory table and a chart of every
    device's memory by kind against the capacity."""
    text = plan.memory_summary()
    chart = memory_chart([d.to_dict() for d in plan.device_table],
                         title=f"{plan.name}: memory per device ({plan.memory.precision.name})")
    return ReportSection("Memory", markdown=f"```\n{text}\n```", html=f"<pre>{html.escape(text)}</pre>",
                         figures=[("Memory per device by kind against the capacity (offloaded stashes in host memory "
                                   "beside)", chart)])


def write_plan_report(plan, out_html: str | os.PathLike, *, bounds_time_limit_s: float = 60.0,
                      command: str | None = None, trace: str | os.PathLike | None = None) -> dict[str, Any]:
    """HTML + Markdown report of a :class:`fxpipe.Plan`: its stage table, lower-bound certificates
    for its partition (simple, chain, bottleneck and exact MIP bounds), what its schedule
    minimises beside each figure's bound, its Gantt chart, a link to its Chrome/Perfetto trace,
    and its memory by kind (:func:`plan_memory_section`).

    Parameters
    ----------
    plan : fxpipe.Plan
    out_html : path
        The HTML file; the Markdown twin is written next to it (``.md``).
    bounds_time_limit_s : float
        Time limit of each lower-bound MIP (seconds).
    command : str, optional
        The command (or call) that reproduces the report, shown in it.
    trace : path, optional
        Where to write the schedule's Chrome/Perfetto trace
        (:func:`fxpipe.report.trace.chrome_trace`); default: next to the report,
        ``<report>.trace.json``. The report links to it.

    Returns
    -------
    dict
        ``html``, ``markdown`` and ``trace`` (paths written) and ``bounds`` (best lower bound,
        ratio, every bound, and ``rows``: one per method as
        :meth:`fxpipe.partition.bounds.BoundsReport.table_rows`).
    """
    from fxpipe.partition.bounds import compute_bounds  # lazy: the bounds package loads SCIP

    bounds = compute_bounds(  # certificates of the per-stage bottleneck of the plan's num_stages stages
        plan.graph,
        plan.num_stages,
        objective=plan.objective,
        comm=plan.comm,
        methods=("simple", "chain", "bottleneck", "exact"),
        time_limit_s=bounds_time_limit_s,
        warm_start=plan.partition,
        progress=False,  # the caller shows the phase (fxpipe.progress)
    )
    html_path = Path(out_html)
    trace_path = Path(trace) if trace is not None else html_path.with_name(html_path.stem + ".trace.json")
    chrome_trace(plan.schedule, trace_path, plan.problem)
    with tempfile.TemporaryDirectory() as tmp:
        png = gantt(plan.problem, plan.schedule, Path(tmp) / "gantt.png",
                    title=f"{plan.name}: {plan.schedule.method} schedule").read_bytes()

    objective_text = "\n".join(_objective_lines(plan.optimality()))
    try:
        link = os.path.relpath(trace_path.resolve(), html_path.resolve().parent)
    except ValueError:  # another drive (Windows)
        link = str(trace_path.resolve())
    link = link.replace(os.sep, "/")
    trace_sentence = ("The schedule as an interactive timeline (F/B/W compute and O/R copy streams per device): "
                      "open the trace file in ui.perfetto.dev (Open trace file) or chrome://tracing.")
    sched_md = (f"{plan.schedule.method}, {plan.microbatches} micro-batches.\n\n```\n{objective_text}\n```\n\n"
                f"{trace_sentence} Trace: [{link}]({link})")
    sched_html = (f"<p>{html.escape(plan.schedule.method)}, {plan.microbatches} micro-batches.</p>"
                  f"<pre>{html.escape(objective_text)}</pre>"
                  f'<p>{html.escape(trace_sentence)} Trace: <a href="{html.escape(link)}">{html.escape(link)}</a></p>')
    sections = [
        ReportSection("Plan", markdown=f"```\n{plan.summary()}\n```", html=f"<pre>{html.escape(plan.summary())}</pre>"),
        ReportSection("Schedule", markdown=sched_md, html=sched_html,
                      figures=[("Gantt chart (compute and copy streams) with per-device activation memory", png)]),
        plan_memory_section(plan),
    ]
    cap = plan.memory.capacity_bytes
    written = write_report(
        plan.graph,
        plan.partition,
        bounds,
        out_html=html_path,
        out_md=html_path.with_suffix(".md"),
        command=command,
        extra_sections=sections,
        title=f"fxpipe plan: {plan.name} on {plan.world_size} x {plan.hardware}"
        + (f", mesh {format_mesh(plan.mesh)}" if plan.dp > 1 or plan.tp > 1 else "")
        + (f" ({plan.num_stages} stages, {plan.placement} placement)" if plan.stages_per_device > 1 else ""),
        stage_params_bytes=[s.params_bytes for s in plan.stages],
        params_label=f"{plan.memory.precision.name} weights",
        capacity_note=format_bytes(cap) if math.isfinite(cap) else "",
    )
    out_bounds = {k: v for k, v in bounds.to_dict().items() if k in ("best_lower_bound", "ratio", "lower_bounds")}
    out_bounds["rows"] = bounds.table_rows()
    return {
        "html": str(written["html"]),
        "markdown": str(written["markdown"]),
        "trace": str(trace_path),
        "bounds": out_bounds,
    }
