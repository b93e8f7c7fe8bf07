"""Numbers in reports: positional notation (never ``1e-05``), one unit per column.

Byte counts are written by the one byte formatter, :func:`fxpipe.io.format_bytes` (reports
use two decimals), and a column of them shares the unit of :func:`fxpipe.io.binary_unit`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fxpipe.io import binary_unit

__all__ = ["fixed", "format_ms", "format_bandwidth", "column_unit", "ms_column", "format_ratio"]


def fixed(x: float, digits: int = 3) -> str:
    """``x`` in positional notation (never ``1e-05``): ``digits`` decimals, more for small values
    so that about four significant digits show."""
    x = float(x)
    if not np.isfinite(x):
        return "unlimited" if x > 0 else "-"
    if x != 0 and abs(x) < 1:
        digits = max(digits, min(12, 3 - int(np.floor(np.log10(abs(x))))))
    return f"{x:,.{digits}f}".replace(",", " ") if abs(x) >= 1e4 else f"{x:.{digits}f}"


def format_ms(x: float | None) -> str:
    """Seconds as milliseconds, positional notation (``0.570 ms``, ``12.345 ms``)."""
    if x is None:
        return "-"
    return f"{fixed(float(x) * 1e3)} ms"


def format_bandwidth(x: float) -> str:
    """Bytes per second as GB/s (decimal, as datasheets give it)."""
    return f"{fixed(float(x) / 1e9, 1)} GB/s"


def column_unit(values: Sequence[float]) -> tuple[str, float]:
    """One binary unit for a column of byte counts (the largest value's): ``(name, bytes per unit)``."""
    return binary_unit(max([abs(float(v)) for v in values] + [0.0]))


def ms_column(values_s: Sequence[float]) -> list[str]:
    """A column of seconds as milliseconds with one number of decimals for all its rows."""
    most = max([abs(float(v)) for v in values_s] + [0.0]) * 1e3
    digits = 3 if most >= 0.1 or most == 0 else min(9, 3 - int(np.floor(np.log10(most))))
    return [f"{float(v) * 1e3:.{digits}f}" for v in values_s]


def format_ratio(x: float | None) -> str:
    """A ratio with four decimals (``"-"`` for None)."""
    return "-" if x is None else f"{x:.4f}"
