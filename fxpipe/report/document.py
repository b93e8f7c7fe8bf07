"""Offline reports: one self-contained HTML file (and optional Markdown) per partition.

A report holds the graph statistics, the partition as a stage table, a stage-cost bar chart
(work and io stacked, the best lower bound drawn across), the certificate hierarchy of
:mod:`fxpipe.partition.bounds` with each bound's ratio to the partition, any extra sections
the caller adds (a model report adds its capture / schedule facts), and the exact command
that reproduces it. Charts are matplotlib figures embedded as base64 PNG
(:mod:`fxpipe.report.charts`), so the HTML file needs nothing else. No torch import: a model
report passes plain sections in.

Example
-------
>>> report = compute_bounds(graph, 4, time_limit_s=30)            # doctest: +SKIP
>>> write_report(graph, report.partition, report, "out.html",     # doctest: +SKIP
...              out_md="out.md", command="fxpipe report g.json -k 4 -o out.html")
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.io import format_bytes, write_text_atomic
from fxpipe.ir import OpGraph
from fxpipe.partition.objective import Partition, block_costs, io_bytes
from fxpipe.report.charts import bounds_chart, stage_chart
from fxpipe.report.format import column_unit, fixed, format_bandwidth, format_ms, format_ratio, ms_column

__all__ = ["BOUND_METHOD_TEXT", "ReportSection", "write_report", "stage_table", "render_html", "render_markdown"]


@dataclass
class ReportSection:
    """An extra section of a report (e.g. capture facts or a schedule's Gantt chart).

    Attributes
    ----------
    title : str
    markdown : str
        Body as Markdown (also shown, escaped in a ``<pre>``, in HTML when ``html`` is empty).
    html : str
        Body as an HTML fragment (trusted: written as is).
    figures : list of (caption, PNG bytes)
        Images embedded after the body.
    """

    title: str
    markdown: str = ""
    html: str = ""
    figures: list = field(default_factory=list)



def stage_table(graph: OpGraph, partition: Partition) -> list[dict[str, Any]]:
    """One row per stage: ops, work, io bytes in/out, io time, cost, parameter bytes.

    Costs are recomputed from scratch with the Contract-2 objective of the partition.
    """
    k = partition.k
    a = np.asarray(partition.assignment, dtype=np.int64)
    in_b, out_b = io_bytes(graph, a, k, partition.comm)
    work = np.bincount(a, weights=graph.work_s(partition.objective), minlength=k)
    costs = block_costs(graph, a, k, partition.objective, partition.comm)
    params = np.bincount(a, weights=graph.size_param_bytes, minlength=k)
    nops = np.bincount(a, minlength=k)
    bn = float(costs.max()) if k else 0.0
    rows = []
    for s in range(k):
        rows.append(
            {
                "stage": s,
                "ops": int(nops[s]),
                "work_s": float(work[s]),
                "in_bytes": float(in_b[s]),
                "out_bytes": float(out_b[s]),
                "io_s": float(costs[s] - work[s]),
                "cost_s": float(costs[s]),
                "param_bytes": float(params[s]),
                "bottleneck": bool(k and costs[s] >= bn * (1 - 1e-12)),
            }
        )
    return rows


def _graph_stats(graph: OpGraph, objective: str) -> list[tuple[str, str]]:
    kinds: dict[str, int] = {}
    for op in graph.ops:
        kinds[op] = kinds.get(op, 0) + 1
    top = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:8])
    return [
        ("name", graph.name),
        ("nodes (ops)", str(graph.n)),
        ("edges", str(graph.m)),
        ("op kinds", top or "-"),
        (f"total work per micro-batch ({objective})", format_ms(float(np.sum(graph.work_s(objective))))),
        ("total forward time per micro-batch", format_ms(float(np.sum(graph.t_fwd_s)))),
        ("total output bytes (graph dtype)", format_bytes(float(np.sum(graph.size_out_bytes)), 2)),
        ("total parameter bytes (graph dtype)", format_bytes(float(np.sum(graph.size_param_bytes)), 2)),
        ("link bandwidth between devices", format_bandwidth(graph.bandwidth_bytes_per_s)),
    ]


#: One sentence per certificate method and the result of Archer et al. (2024) it cites.
BOUND_METHOD_TEXT = {
    "simple": "Lemma 3.3: some stage holds the most expensive op and some stage holds at least the average work, "
              "so the bottleneck is at least the larger of the two (closed form, no solver).",
    "chain": "a dynamic program over the graph's chain of gates (ops that come before or after every other op) "
             "that bounds every relay-communication partition and, on chain-structured models, finds an optimal one.",
    "lp": "the linear-programming relaxation of the exact MIP, a quick but weaker bound.",
    "bottleneck": "Eq. 14, a MIP that models only the bottleneck stage and what lies before and after it "
                  "(three superblocks), smaller than the exact MIP.",
    "guess": "Section 3.3, one three-superblock MIP per position of the bottleneck stage; the smallest of their "
             "bounds holds.",
    "exact": "Figure 3, the MIP of the whole partition problem; its dual bound holds even when it stops at the "
             "time limit.",
}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.6em 0}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f0f0f0}td.l,th.l{text-align:left}tr.bn td{background:#fff3d6;font-weight:600}
code,pre{background:#f6f6f6;padding:2px 4px}pre{padding:8px;overflow-x:auto}img{max-width:100%}
"""


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1, row_classes: Sequence[str] | None = None) -> str:
    out = ["<table>", "<tr>" + "".join(f'<th class="l">{html.escape(h)}</th>' if i < left else f"<th>{html.escape(h)}</th>" for i, h in enumerate(header)) + "</tr>"]
    for j, row in enumerate(rows):
        cls = f' class="{row_classes[j]}"' if row_classes and row_classes[j] else ""
        out.append(f"<tr{cls}>" + "".join(f'<td class="l">{html.escape(c)}</td>' if i < left else f"<td>{html.escape(c)}</td>" for i, c in enumerate(row)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(c: str) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _img_html(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def _img_md(png: bytes, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"


def _content(graph: OpGraph, partition: Partition | None, bounds_report, command: str | None, extra_sections: Sequence[ReportSection], title: str | None, charts: bool,
             stage_params_bytes: Sequence[float] | None = None, params_label: str = "", capacity_note: str = ""):
    """Everything both renderers need, as plain strings and images."""
    objective = partition.objective if partition is not None else (bounds_report.objective if bounds_report is not None else "inference")
    comm = partition.comm if partition is not None else (bounds_report.comm if bounds_report is not None else "dag")
    k = partition.k if partition is not None else (bounds_report.k if bounds_report is not None else None)
    c: dict[str, Any] = {
        "title": title or f"fxpipe report: {graph.name}, k={k}, {objective}/{comm}",
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "stats": _graph_stats(graph, objective),
        "command": command,
        "extra": list(extra_sections),
    }
    lb = None if bounds_report is None else bounds_report.best_lower_bound
    if partition is not None:
        rows = stage_table(graph, partition)
        if stage_params_bytes is not None:
            for r, b in zip(rows, stage_params_bytes):
                r["param_bytes"] = float(b)
        bn = partition.bottleneck
        io_unit, io_div = column_unit([r[key] for r in rows for key in ("in_bytes", "out_bytes")])
        p_unit, p_div = column_unit([r["param_bytes"] for r in rows])
        c["stage_header"] = ["stage", "ops", "work ms", "io ms", "cost ms", f"in {io_unit}", f"out {io_unit}",
                             f"params {p_unit}" + (f" ({params_label})" if params_label else ""), "cost / bottleneck"]
        cols = {key: ms_column([r[key] for r in rows]) for key in ("work_s", "io_s", "cost_s")}
        c["stage_rows"] = [
            [
                str(r["stage"]),
                str(r["ops"]),
                cols["work_s"][i],
                cols["io_s"][i],
                cols["cost_s"][i],
                f"{r['in_bytes'] / io_div:.2f}",
                f"{r['out_bytes'] / io_div:.2f}",
                f"{r['param_bytes'] / p_div:.2f}",
                format_ratio(r["cost_s"] / bn if bn else None),
            ]
            for i, r in enumerate(rows)
        ]
        c["stage_bn"] = ["bn" if r["bottleneck"] else "" for r in rows]
        c["partition_facts"] = [
            ("bottleneck", format_ms(bn)),
            ("found by", str(partition.meta.get("method", "-"))),
            ("objective / comm", f"{objective} / {comm}"),
        ]
        c["stage_png"] = stage_chart(rows, lb) if charts else None
    if bounds_report is not None:
        brows = bounds_report.table_rows()
        c["bounds_header"] = ["method", "lower bound ms", "ratio to partition", "status", "time s", "B&B nodes"]
        reasons = {m: cert.details.get("reason", "") for m, cert in bounds_report.certificates.items()}
        c["bounds_rows"] = [
            [r["method"], "-", "-", "skipped: " + (reasons.get(r["method"]) or "not needed"), "-", "-"]
            if r["status"] == "skipped" else
            [r["method"], fixed(r["lower_bound_s"] * 1e3), format_ratio(r["ratio"]), r["status"], f"{r['wall_time_s']:.2f}",
             str(r["nodes"])]
            for r in brows
        ]
        solver = bounds_report.to_dict()["solver"]
        cap = bounds_report.capacity_bytes
        c["bounds_facts"] = [
            ("best lower bound", format_ms(bounds_report.best_lower_bound)),
            ("ratio (best bound / partition)", format_ratio(bounds_report.ratio)),
            ("solver", str(solver.get("version"))),
            ("memory capacity of the bounds", format_bytes(cap, 2) if cap is not None and np.isfinite(cap) else
             "none: each bound holds for every partition, memory or not" + (f" (the plan's device capacity is {capacity_note})"
                                                                          if capacity_note else "")),
        ]
        c["bounds_png"] = bounds_chart(brows) if charts and brows else None
    return c


def _cited(content: dict) -> list[tuple[str, str]]:
    """(method, sentence) for the methods in the report's certificate table, in its order."""
    return [(row[0], BOUND_METHOD_TEXT[row[0]]) for row in content.get("bounds_rows", []) if row[0] in BOUND_METHOD_TEXT]


def render_html(content: dict) -> str:
    """HTML text of a report from :func:`_content`."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(content['title'])}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{e(content['title'])}</h1>",
        f"<p>Generated {e(content['generated'])} by fxpipe.</p>",
        "<h2>Graph</h2>",
        _html_table(["property", "value"], [list(r) for r in content["stats"]], left=2),
    ]
    if "stage_rows" in content:
        parts += ["<h2>Partition</h2>", _html_table(["property", "value"], [list(r) for r in content["partition_facts"]], left=2)]
        parts.append(_html_table(content["stage_header"], content["stage_rows"], row_classes=content["stage_bn"]))
        if content.get("stage_png"):
            parts.append(_img_html(content["stage_png"], "stage-cost bar chart"))
    if "bounds_rows" in content:
        parts += [
            "<h2>Lower-bound certificates</h2>",
            "<p>Each bound is a proven lower bound on the bottleneck (the costliest stage) of every acyclic "
            "partition of the graph into k stages (Archer et al. 2024, Section 3). A ratio of 1 proves the partition "
            "optimal; a method marked skipped was not run because an earlier one had already proved that.</p>",
            "<ul>" + "".join(f"<li><b>{e(m)}</b>: {e(t)}</li>" for m, t in _cited(content)) + "</ul>",
            _html_table(["property", "value"], [list(r) for r in content["bounds_facts"]], left=2),
            _html_table(content["bounds_header"], content["bounds_rows"], left=1),
        ]
        if content.get("bounds_png"):
            parts.append(_img_html(content["bounds_png"], "certificate hierarchy chart"))
    for sec in content["extra"]:
        parts.append(f"<h2>{e(sec.title)}</h2>")
        parts.append(sec.html if sec.html else f"<pre>{e(sec.markdown)}</pre>")
        for cap, png in sec.figures:
            parts.append(_img_html(png, cap))
    if content.get("command"):
        parts += ["<h2>Reproduce</h2>", f"<pre>{e(content['command'])}</pre>"]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def render_markdown(content: dict) -> str:
    """Markdown text of a report from :func:`_content`."""
    parts = [f"# {content['title']}", "", f"Generated {content['generated']} by fxpipe.", "", "## Graph", "", _md_table(["property", "value"], content["stats"]), ""]
    if "stage_rows" in content:
        parts += ["## Partition", "", _md_table(["property", "value"], content["partition_facts"]), "", _md_table(content["stage_header"], content["stage_rows"]), ""]
        if content.get("stage_png"):
            parts += [_img_md(content["stage_png"], "stage costs"), ""]
    if "bounds_rows" in content:
        parts += ["## Lower-bound certificates", "",
                  "Each bound is a proven lower bound on the bottleneck of every acyclic partition into k stages "
                  "(Archer et al. 2024, Section 3); a ratio of 1 proves the partition optimal.", ""]
        parts += [f"- **{m}**: {t}" for m, t in _cited(content)] + [""]
        parts += [_md_table(["property", "value"], content["bounds_facts"]), "", _md_table(content["bounds_header"], content["bounds_rows"]), ""]
        if content.get("bounds_png"):
            parts += [_img_md(content["bounds_png"], "certificate hierarchy"), ""]
    for sec in content["extra"]:
        parts += [f"## {sec.title}", "", sec.markdown or "", ""]
        for cap, png in sec.figures:
            parts += [_img_md(png, cap), ""]
    if content.get("command"):
        parts += ["## Reproduce", "", "```", content["command"], "```", ""]
    return "\n".join(parts)


def write_report(
    graph: OpGraph,
    partition: Partition | None,
    bounds_report=None,
    out_html: str | os.PathLike | None = None,
    out_md: str | os.PathLike | None = None,
    *,
    command: str | None = None,
    extra_sections: Sequence[ReportSection] = (),
    title: str | None = None,
    charts: bool = True,
    stage_params_bytes: Sequence[float] | None = None,
    params_label: str = "",
    capacity_note: str = "",
) -> dict[str, Path]:
    """Write a self-contained HTML report (and optionally Markdown) for a partition.

    Parameters
    ----------
    graph : OpGraph
    partition : Partition or None
        The partition shown as the stage table (None: no stage table).
    bounds_report : fxpipe.partition.bounds.BoundsReport, optional
        Certificates to show; their ratios are to ``bounds_report.partition``.
    out_html, out_md : path, optional
        Files to write (atomically). At least one is required.
    command : str, optional
        The command that reproduces the report (shown verbatim).
    extra_sections : sequence of ReportSection
        Added after the certificates (e.g. a model report's capture and schedule facts).
    title : str, optional
    charts : bool
        Embed matplotlib charts (base64 PNG).
    stage_params_bytes : sequence of float, optional
        Per-stage parameter bytes shown in the stage table instead of the graph's (e.g. a
        plan's memory-model figure in its precision), labelled ``params_label``.
    capacity_note : str, optional
        The device capacity to mention beside bounds computed without one.

    Returns
    -------
    dict {"html": Path, "markdown": Path} of the files written.

    Raises
    ------
    InputError
        If neither output is given or a section is not a :class:`ReportSection`.
    """
    if out_html is None and out_md is None:
        raise InputError("write_report needs out_html or out_md")
    for sec in extra_sections:
        if not isinstance(sec, ReportSection):
            raise InputError(f"extra_sections must be ReportSection objects, got {type(sec).__name__}")
    content = _content(graph, partition, bounds_report, command, extra_sections, title, charts, stage_params_bytes,
                       params_label, capacity_note)
    written: dict[str, Path] = {}
    if out_html is not None:
        written["html"] = write_text_atomic(out_html, render_html(content))
    if out_md is not None:
        written["markdown"] = write_text_atomic(out_md, render_markdown(content))
    return written
