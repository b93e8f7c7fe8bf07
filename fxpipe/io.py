"""Atomic file writing, JSON reading, number conversion and byte formatting shared by every part of fxpipe.

Files fxpipe writes are JSON (or text/bytes for reports and charts), written atomically:
a temporary file in the same folder, fsync, rename (:func:`write_text_atomic`,
:func:`write_json_atomic`), never pickle. :func:`read_json` turns every failure into an
:class:`~fxpipe.errors.InputError` that names the file. The ``_as_*`` helpers convert
numbers read from JSON into validated numpy arrays and integers; :func:`check_number` checks one
number against its allowed range (by default the bound of its unit suffix: :data:`MAX_TIME_S`,
:data:`MAX_BYTES`, :data:`MAX_BYTES_PER_S`, :data:`MAX_FLOPS`), the range check every file loader
uses. Numbers for people: :func:`fixed` (positional notation), :func:`format_ms` (a time) and
:func:`ms_column` (a column of times) are the one way fxpipe writes times (summaries, the mesh
search table, reports); :func:`format_bytes` is
the one way fxpipe writes a byte count for people (binary units), :func:`binary_unit` the
unit of a column or an axis of byte counts.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fxpipe.errors import InputError

__all__ = ["write_text_atomic", "write_json_atomic", "read_json", "read_text", "format_bytes", "binary_unit",
           "BINARY_UNITS", "fixed", "format_ms", "ms_column", "check_number", "MAX_TIME_S", "MAX_BYTES", "MAX_BYTES_PER_S", "MAX_FLOPS"]

#: The largest time a file may give one op (or one stage) of one micro-batch, seconds (11.6 days): beyond it a
#: time is no measurement, and sums of such times lose every other op to rounding or overflow.
MAX_TIME_S = 1e6
#: The largest byte count a file may give (a tensor, a parameter set, a memory capacity): 1 EB.
MAX_BYTES = 1e18
#: The largest bandwidth a file may give, bytes/s (1 EB/s).
MAX_BYTES_PER_S = 1e18
#: The largest FLOP count or FLOP rate a file may give (1e21: a zettaFLOP).
MAX_FLOPS = 1e21
_UNIT_MAX = {"s": MAX_TIME_S, "bytes": MAX_BYTES, "bytes_per_s": MAX_BYTES_PER_S, "flops": MAX_FLOPS}
_RANGE_WHY = {"s": "seconds; a longer time is no measurement", "bytes": "bytes; 1 EB at most",
              "bytes_per_s": "bytes/s; 1 EB/s at most", "flops": "FLOP or FLOP/s; 1e21 at most", "": "out of range"}

#: Binary units of byte counts, smallest first, with their size in bytes.
BINARY_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40))


def binary_unit(most_bytes: float, *, largest: str = "TiB") -> tuple[str, float]:
    """The binary unit to show byte counts up to ``most_bytes`` in: ``(name, bytes per unit)``.

    The largest unit of :data:`BINARY_UNITS` (up to ``largest``) that ``|most_bytes|`` reaches;
    ``("B", 1.0)`` below 1 KiB. Used for a table column or a chart axis, so that every value
    of it shares one unit.

    Raises
    ------
    InputError
        If ``largest`` is not a unit of :data:`BINARY_UNITS`.
    """
    names = [u for u, _ in BINARY_UNITS]
    if largest not in names:
        raise InputError(f"largest must be one of {names}, got {largest!r}")
    most = abs(float(most_bytes))
    units = BINARY_UNITS[: names.index(largest) + 1]
    return next(((u, float(d)) for u, d in reversed(units) if most >= d), ("B", 1.0))


def format_bytes(n: float, digits: int = 1) -> str:
    """A byte count for people, in binary units: ``1536 -> '1.5 KiB'``, ``512 -> '512 B'``.

    Parameters
    ----------
    n : float
        Bytes (may be negative, e.g. an overflow; ``inf`` for an unlimited capacity gives ``'inf'``).
    digits : int
        Decimals shown in KiB and above (bytes are whole); never scientific notation.
    """
    if not math.isfinite(n):
        return "inf" if n > 0 else ("-inf" if n < 0 else "nan")
    unit, div = binary_unit(n)
    return f"{n:.0f} B" if unit == "B" else f"{n / div:.{digits}f} {unit}"


#: Beyond this magnitude a number for people is written in scientific notation (positional notation
#: would print up to 300 digits); validated inputs never get there.
_POSITIONAL_MAX = 1e15


def fixed(x: float, digits: int = 3) -> str:
    """``x`` for people in positional notation (never ``1e-05``, never ``1.363e+04``).

    ``digits`` decimals, more for values below 1 so that about four significant digits show;
    thousands grouped by spaces from 10 000 on (``13 630.000``); ``"unlimited"`` for ``+inf`` and
    ``"-"`` for ``-inf`` / NaN. Magnitudes of 1e15 and more (no validated input gets there) are
    written as ``1.000e+15`` rather than in hundreds of digits.
    """
    x = float(x)
    if not math.isfinite(x):
        return "unlimited" if x > 0 else "-"
    if abs(x) >= _POSITIONAL_MAX:
        return f"{x:.3e}"
    if x != 0 and abs(x) < 1:
        digits = max(digits, min(12, 3 - int(math.floor(math.log10(abs(x))))))
    return f"{x:,.{digits}f}".replace(",", " ") if abs(x) >= 1e4 else f"{x:.{digits}f}"


def format_ms(x_s: float | None) -> str:
    """Seconds as milliseconds for people (``0.5700 ms``, ``13 630.000 ms``; :func:`fixed`); ``"-"`` for None.

    The one way fxpipe writes a time in a summary, a table or a report."""
    if x_s is None:
        return "-"
    return f"{fixed(float(x_s) * 1e3)} ms"


def ms_column(values_s: Sequence[float]) -> list[str]:
    """A column of seconds as milliseconds, one number of decimals for all its rows (no unit, no grouping).

    Three decimals, more when the largest value is below 0.1 ms; a value of 1e15 ms or more in
    scientific notation, like :func:`fixed`."""
    finite = [abs(float(v)) for v in values_s if math.isfinite(float(v))]
    most = max(finite + [0.0]) * 1e3
    digits = 3 if most >= 0.1 or most == 0 else min(9, 3 - int(math.floor(math.log10(most))))

    def one(v: float) -> str:
        ms = float(v) * 1e3
        if not math.isfinite(ms):
            return "unlimited" if ms > 0 else "-"
        return f"{ms:.3e}" if abs(ms) >= _POSITIONAL_MAX else f"{ms:.{digits}f}"

    return [one(v) for v in values_s]


def write_text_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write text (UTF-8) or bytes to ``path`` atomically: temp file in the same folder, fsync, rename.

    A reader never sees a half-written file and a crash leaves the old file intact. The
    file gets the usual permissions (``0666`` less the umask), not ``mkstemp``'s ``0600``.

    Raises
    ------
    OSError
        If the folder cannot be created or written (the CLI reports it without a traceback).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_json_atomic(path: str | os.PathLike, data: Any, *, indent: int | None = 1) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (see :func:`write_text_atomic`).

    Parameters
    ----------
    path : str or PathLike
        Destination file. Its parent folder is created if missing.
    data : JSON-serialisable object
        numpy scalars and arrays are converted to Python numbers and lists; NaN and
        infinity are refused (``ValueError``) since they are not JSON.

    Returns
    -------
    Path
        The path written.
    """
    text = json.dumps(data, indent=indent, default=_json_default, allow_nan=False)
    return write_text_atomic(path, text + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serialisable")


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """Read a UTF-8 text file, turning every failure into an :class:`InputError` naming it.

    Raises
    ------
    InputError
        If the file is missing, a directory, unreadable or not UTF-8.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} {str(path)!r} does not exist: check the path")
    if path.is_dir():
        raise InputError(f"{what} {str(path)!r} is a directory, expected a file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {what} {str(path)!r}: {exc}") from None


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """Read a JSON file, turning every failure into an :class:`InputError` that names the file.

    Raises
    ------
    InputError
        If the file is missing, unreadable or not valid JSON.
    """
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{what} {str(path)!r} is a directory, expected a JSON file")
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{what} {str(path)!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}); fix or regenerate the file"
        ) from None


def _as_float_array(values: Sequence[float] | np.ndarray, name: str, length: int | None = None) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a list of numbers, got {values!r:.200}") from None
    if arr.ndim != 1:
        raise InputError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise InputError(f"{name} must have {length} entries, got {arr.shape[0]}")
    return arr


def _check_finite_nonneg(arr: np.ndarray, name: str, labels: Sequence[str] | None = None,
                         high: float | None = None) -> None:
    """Every entry finite, >= 0 and (when ``high`` is given) <= ``high``, else InputError naming the first bad one
    and the allowed range."""
    allowed = f"[0, {high:g}]" if high is not None else ">= 0"
    bad = ~np.isfinite(arr)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        where = f" ({labels[i]!r})" if labels is not None else ""
        raise InputError(f"{name}[{i}]{where} is {arr[i]}: costs must be finite numbers" + (f" in {allowed}" if high else ""))
    neg = arr < 0
    if neg.any():
        i = int(np.flatnonzero(neg)[0])
        where = f" ({labels[i]!r})" if labels is not None else ""
        raise InputError(f"{name}[{i}]{where} is {arr[i]}: costs must be >= 0" + (f" (allowed {allowed})" if high else ""))
    if high is not None:
        over = arr > high
        if over.any():
            i = int(np.flatnonzero(over)[0])
            where = f" ({labels[i]!r})" if labels is not None else ""
            raise InputError(f"{name}[{i}]{where} is {arr[i]:g}: allowed {allowed} ({_RANGE_WHY[_unit_of(name)]})")


def _unit_of(name: str) -> str:
    """The unit a field's name ends in: ``"bytes_per_s"``, ``"bytes"``, ``"flops"``, ``"s"`` or ``""``."""
    for unit in ("bytes_per_s", "bytes", "flops", "s"):
        if name == unit or name.endswith("_" + unit):
            return unit
    return ""


def check_number(value: Any, name: str, *, low: float = 0.0, high: float | None = None, low_open: bool = False,
                 where: str = "") -> float:
    """A number read from a file, checked against its allowed range; the one range check of the file loaders.

    Parameters
    ----------
    value : Any
        The value as read (JSON number).
    name : str
        The field, as the message names it (its unit suffix picks the default upper bound:
        :data:`MAX_TIME_S` for ``*_s``, :data:`MAX_BYTES` for ``*_bytes``,
        :data:`MAX_BYTES_PER_S` for ``*_bytes_per_s``, :data:`MAX_FLOPS` for ``*_flops``).
    low, high : float
        The allowed range; ``high=None``: the unit's bound (none for a name without a unit).
    low_open : bool
        ``low`` itself is not allowed (``> low``).
    where : str
        The file (and record) the value comes from, prefixed to the message.

    Returns
    -------
    float

    Raises
    ------
    InputError
        For a non-number, NaN, infinity or a value outside the range; the message names ``where``, the
        field and the allowed range.
    """
    if high is None:
        high = _UNIT_MAX.get(_unit_of(name), math.inf)
    allowed = f"{'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high) else \
        f"{'>' if low_open else '>='} {low:g}"
    prefix = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(f"{prefix}field {name!r} is {value!r:.80}, allowed: a number in {allowed}")
    x = float(value)
    if not math.isfinite(x) or x < low or (low_open and x == low) or x > high:
        why = f" ({_RANGE_WHY[_unit_of(name)]})" if x > high and math.isfinite(x) else ""
        raise InputError(f"{prefix}field {name!r} is {x:g}, allowed: a finite number in {allowed}{why}")
    return x


def _as_count(value: Any, name: str) -> int:
    """An integer from JSON (``3`` or ``3.0``), else :class:`InputError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(f"{name} must be an integer, got {value!r}")
    if not float(value).is_integer():
        raise InputError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _as_index(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not float(value).is_integer():
        raise ValueError(value)
    return int(value)


def _freeze(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr)
    arr.setflags(write=False)
    return arr
