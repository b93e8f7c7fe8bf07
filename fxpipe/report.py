"""Offline reports: one self-contained HTML file (and optional Markdown) per partition.

A report holds the graph statistics, the partition as a stage table, a stage-cost bar chart
(work and io stacked, the best lower bound drawn across), the certificate hierarchy of
:mod:`fxpipe.partition.bounds` with each bound's ratio to the partition, any extra sections
the caller adds (a model report adds its capture / schedule facts), and the exact command
that reproduces it. Charts are matplotlib figures embedded as base64 PNG, so the HTML file
needs nothing else. No torch import: a model report passes plain sections in.

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
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph, write_text_atomic
from fxpipe.partition.objective import Partition, block_costs, io_bytes

__all__ = ["ReportSection", "write_report", "write_plan_report", "plan_memory_section", "stage_table", "render_html",
           "render_markdown"]


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


# --------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------


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
        (f"total work per micro-batch ({objective})", _fmt_s(float(np.sum(graph.work_s(objective))))),
        ("total forward time per micro-batch", _fmt_s(float(np.sum(graph.t_fwd_s)))),
        ("total output bytes (graph dtype)", _fmt_bytes(float(np.sum(graph.size_out_bytes)))),
        ("total parameter bytes (graph dtype)", _fmt_bytes(float(np.sum(graph.size_param_bytes)))),
        ("link bandwidth between devices", _fmt_bandwidth(graph.bandwidth_bytes_per_s)),
    ]


def _fixed(x: float, digits: int = 3) -> str:
    """``x`` in positional notation (never ``1e-05``): ``digits`` decimals, more for small values
    so that about four significant digits show."""
    x = float(x)
    if not np.isfinite(x):
        return "unlimited" if x > 0 else "-"
    if x != 0 and abs(x) < 1:
        digits = max(digits, min(12, 3 - int(np.floor(np.log10(abs(x))))))
    return f"{x:,.{digits}f}".replace(",", " ") if abs(x) >= 1e4 else f"{x:.{digits}f}"


def _fmt_s(x: float | None) -> str:
    """Seconds as milliseconds, positional notation (``0.570 ms``, ``12.345 ms``)."""
    if x is None:
        return "-"
    return f"{_fixed(float(x) * 1e3)} ms"


def _fmt_bytes(x: float) -> str:
    """Bytes in binary units with two decimals (``1.50 GiB``), never scientific notation."""
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def _fmt_bandwidth(x: float) -> str:
    """Bytes per second as GB/s (decimal, as datasheets give it)."""
    return f"{_fixed(float(x) / 1e9, 1)} GB/s"


def _bytes_unit(values: Sequence[float]) -> tuple[str, float]:
    """One binary unit for a column of byte counts (the largest value's)."""
    most = max([abs(float(v)) for v in values] + [0.0])
    return next(((u, float(d)) for u, d in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                 if most >= d), ("B", 1.0))


def _ms_column(values_s: Sequence[float]) -> list[str]:
    """A column of seconds as milliseconds with one number of decimals for all its rows."""
    most = max([abs(float(v)) for v in values_s] + [0.0]) * 1e3
    digits = 3 if most >= 0.1 or most == 0 else min(9, 3 - int(np.floor(np.log10(most))))
    return [f"{float(v) * 1e3:.{digits}f}" for v in values_s]


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


# --------------------------------------------------------------------------------------
# charts
# --------------------------------------------------------------------------------------


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def _stage_chart(rows: list[dict], lower_bound: float | None) -> bytes:
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(max(4.0, 0.5 * len(rows) + 2.5), 3.2))
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(rows))
    work = np.array([r["work_s"] for r in rows]) * 1e3  # ms
    iot = np.array([r["io_s"] for r in rows]) * 1e3
    ax.bar(x, work, color="#4c72b0", label="work")
    ax.bar(x, iot, bottom=work, color="#dd8452", label="communication")
    if lower_bound is not None and np.isfinite(lower_bound):
        ax.axhline(lower_bound * 1e3, color="#2ca02c", linestyle="--", label="best lower bound")
    ax.set_xticks(x)
    ax.set_xticklabels([str(r["stage"]) for r in rows])
    ax.set_xlabel("stage")
    ax.set_ylabel("cost per micro-batch (ms)")
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    ax.set_title("stage costs")
    top = float(np.max(work + iot)) if len(rows) else 1.0
    ax.set_ylim(0, top * 1.3 if top > 0 else 1.0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    return _png(fig)


def _bounds_chart(rows: list[dict]) -> bytes:
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(5.0, 0.45 * len(rows) + 1.2))
    ax = fig.add_subplot(1, 1, 1)
    names = [r["method"] for r in rows]
    skipped = [r["status"] == "skipped" or r["ratio"] is None for r in rows]
    ratios = [0.0 if sk else float(r["ratio"]) for r, sk in zip(rows, skipped)]
    y = np.arange(len(rows))
    ax.barh(y, ratios, color=["none" if sk else "#55a868" for sk in skipped])  # skipped methods: no bar
    for yi, r, sk in zip(y, ratios, skipped):
        ax.text(r, yi, " skipped (not run)" if sk else f" {r:.4f}", va="center", fontsize=8,
                color="#777777" if sk else "black")
    ax.set_yticks(y)
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(0, max(1.2, max(ratios, default=1.0) * 1.2))
    ax.set_xlabel("lower bound / best partition")
    ax.set_title("certificate hierarchy")
    return _png(fig)


#: Device-memory kinds stacked in :func:`memory_chart` (names of :mod:`fxpipe.memory`), with colours.
MEMORY_CHART_KINDS = (
    ("params_bytes", "params", "#4c72b0"),
    ("grads_bytes", "grads", "#55a868"),
    ("optimizer_bytes", "optimizer", "#c44e52"),
    ("activation_peak_bytes", "activation peak", "#dd8452"),
    ("comm_buffer_bytes", "comm buffers", "#8172b3"),
    ("reserved_bytes", "reserved", "#b0b0b0"),
)


def memory_chart(rows: Sequence[Mapping[str, Any]], *, label: str = "device", title: str = "device memory") -> bytes:
    """Stacked bars of memory by kind per device (or stage), the capacity as a line, the
    offloaded peak (host memory) as a hatched bar beside each; a PNG.

    Parameters
    ----------
    rows : sequence of mappings
        One per device: the keys of :data:`MEMORY_CHART_KINDS`, ``offloaded_peak_bytes``,
        ``capacity_bytes`` (None: unlimited) and ``label`` (``"device"`` / ``"stage"``) as
        the x label; e.g. ``DeviceStats.to_dict()`` of a plan (:mod:`fxpipe.plan`).
    """
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(max(4.5, 0.55 * len(rows) + 3.0), 3.4))
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(rows))
    most = max([sum(float(r.get(k, 0.0)) for k, _, _ in MEMORY_CHART_KINDS) for r in rows] + [1.0])
    unit, gib = next((u, float(d)) for u, d in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                     if most >= d)
    bottom = np.zeros(len(rows))
    for key, name, colour in MEMORY_CHART_KINDS:
        vals = np.array([float(r.get(key, 0.0)) for r in rows]) / gib
        ax.bar(x - 0.15, vals, width=0.6, bottom=bottom, color=colour, label=name)
        bottom += vals
    off = np.array([float(r.get("offloaded_peak_bytes", 0.0)) for r in rows]) / gib
    if off.any():
        ax.bar(x + 0.3, off, width=0.25, color="white", edgecolor="#dd8452", hatch="///", label="offloaded (host)")
    caps = [r.get("capacity_bytes") for r in rows]
    top = float(max(bottom.max(initial=0.0), off.max(initial=0.0)))
    if caps and all(c is not None for c in caps):
        cap = float(caps[0]) / gib
        ax.axhline(cap, color="black", linestyle="--", linewidth=1.0, label="capacity")
        top = max(top, cap)
    ax.set_xticks(x)
    ax.set_xticklabels([str(r.get(label, i)) for i, r in enumerate(rows)])
    ax.set_xlabel(label)
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0.0)  # beside: covers no bar
    return _png(fig)


# --------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------

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
        io_unit, io_div = _bytes_unit([r[key] for r in rows for key in ("in_bytes", "out_bytes")])
        p_unit, p_div = _bytes_unit([r["param_bytes"] for r in rows])
        c["stage_header"] = ["stage", "ops", "work ms", "io ms", "cost ms", f"in {io_unit}", f"out {io_unit}",
                             f"params {p_unit}" + (f" ({params_label})" if params_label else ""), "cost / bottleneck"]
        cols = {key: _ms_column([r[key] for r in rows]) for key in ("work_s", "io_s", "cost_s")}
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
                _fmt_ratio(r["cost_s"] / bn if bn else None),
            ]
            for i, r in enumerate(rows)
        ]
        c["stage_bn"] = ["bn" if r["bottleneck"] else "" for r in rows]
        c["partition_facts"] = [
            ("bottleneck", _fmt_s(bn)),
            ("found by", str(partition.meta.get("method", "-"))),
            ("objective / comm", f"{objective} / {comm}"),
        ]
        c["stage_png"] = _stage_chart(rows, lb) if charts else None
    if bounds_report is not None:
        brows = bounds_report.table_rows()
        c["bounds_header"] = ["method", "lower bound ms", "ratio to partition", "status", "time s", "B&B nodes"]
        reasons = {m: cert.details.get("reason", "") for m, cert in bounds_report.certificates.items()}
        c["bounds_rows"] = [
            [r["method"], "-", "-", "skipped: " + (reasons.get(r["method"]) or "not needed"), "-", "-"]
            if r["status"] == "skipped" else
            [r["method"], _fixed(r["lower_bound_s"] * 1e3), _fmt_ratio(r["ratio"]), r["status"], f"{r['wall_time_s']:.2f}",
             str(r["nodes"])]
            for r in brows
        ]
        solver = bounds_report.to_dict()["solver"]
        cap = bounds_report.capacity_bytes
        c["bounds_facts"] = [
            ("best lower bound", _fmt_s(bounds_report.best_lower_bound)),
            ("ratio (best bound / partition)", _fmt_ratio(bounds_report.ratio)),
            ("solver", str(solver.get("version"))),
            ("memory capacity of the bounds", _fmt_bytes(cap) if cap is not None and np.isfinite(cap) else
             "none: each bound holds for every partition, memory or not" + (f" (the plan's device capacity is {capacity_note})"
                                                                          if capacity_note else "")),
        ]
        c["bounds_png"] = _bounds_chart(brows) if charts and brows else None
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
        (:func:`fxpipe.schedule.plot.chrome_trace`); default: next to the report,
        ``<report>.trace.json``. The report links to it.

    Returns
    -------
    dict
        ``html``, ``markdown`` and ``trace`` (paths written) and ``bounds`` (best lower bound,
        ratio, every bound, and ``rows``: one per method as
        :meth:`fxpipe.partition.bounds.BoundsReport.table_rows`).
    """
    import math
    import tempfile

    from fxpipe.memory import format_bytes
    from fxpipe.partition.bounds import compute_bounds
    from fxpipe.schedule.plot import chrome_trace, gantt

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
    from fxpipe.plan import _objective_lines

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
        title=f"fxpipe plan: {plan.name} on {plan.devices} x {plan.hardware}"
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
