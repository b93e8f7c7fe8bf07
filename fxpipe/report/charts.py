"""The report's charts as PNG bytes: stage costs, the certificate hierarchy, memory by kind.

matplotlib figures on the Agg canvas (no display, no pyplot state); imported only when a
chart is drawn.
"""

from __future__ import annotations

import io
from typing import Any, Mapping, Sequence

import numpy as np

from fxpipe.io import binary_unit
from fxpipe.memory.model import KIND_LABELS, KINDS

__all__ = ["MEMORY_CHART_KINDS", "png_bytes", "stage_chart", "bounds_chart", "memory_chart"]


def png_bytes(fig) -> bytes:
    """A matplotlib figure as PNG bytes (Agg canvas, 110 dpi, tight box)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def stage_chart(rows: list[dict], lower_bound: float | None) -> bytes:
    """Stage costs (work and communication stacked, ms) with the best lower bound across; a PNG.

    ``rows``: :func:`fxpipe.report.document.stage_table`.
    """
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
    return png_bytes(fig)


def bounds_chart(rows: list[dict]) -> bytes:
    """Each certificate's ratio to the best partition as a bar (skipped methods marked); a PNG.

    ``rows``: :meth:`fxpipe.partition.bounds.BoundsReport.table_rows`.
    """
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
    return png_bytes(fig)


#: Device-memory kinds stacked in :func:`memory_chart` (names of :mod:`fxpipe.memory`), with colours.
MEMORY_CHART_KINDS = tuple(
    (kind, KIND_LABELS[kind], colour)
    for kind, colour in zip(KINDS, ("#4c72b0", "#55a868", "#c44e52", "#dd8452", "#8172b3", "#b0b0b0"))
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
    unit, gib = binary_unit(most, largest="GiB")
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
    return png_bytes(fig)
