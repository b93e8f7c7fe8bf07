"""Numbers in reports: positional notation (never ``1e-05``), one unit per column.

Times are written by the one formatter in :mod:`fxpipe.io` (:func:`~fxpipe.io.fixed`,
:func:`~fxpipe.io.format_ms`, :func:`~fxpipe.io.ms_column`, re-exported here), which the plan's
summary and the mesh search table use too.

Byte counts are written by the one byte formatter, :func:`fxpipe.io.format_bytes` (reports
use two decimals), and a column of them shares the unit of :func:`fxpipe.io.binary_unit`.
"""

from __future__ import annotations

from typing import Sequence


from fxpipe.io import binary_unit, fixed, format_ms, ms_column  # noqa: F401 (the one formatter, re-exported)

__all__ = ["fixed", "format_ms", "format_bandwidth", "column_unit", "ms_column", "format_ratio"]


def format_bandwidth(x: float) -> str:
    """Bytes per second as GB/s (decimal, as datasheets give it)."""
    return f"{fixed(float(x) / 1e9, 1)} GB/s"


def column_unit(values: Sequence[float]) -> tuple[str, float]:
    """One binary unit for a column of byte counts (the largest value's): ``(name, bytes per unit)``."""
    return binary_unit(max([abs(float(v)) for v in values] + [0.0]))


def format_ratio(x: float | None) -> str:
    """A ratio with four decimals (``"-"`` for None)."""
    return "-" if x is None else f"{x:.4f}"
