"""One byte formatter (fxpipe.io), one memory row (fxpipe.memory.model) and the matrix's schedule
lists read from the registry (fxpipe.testing.matrix)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from fxpipe.errors import InputError
from fxpipe.io import binary_unit, format_bytes
from fxpipe.memory import KINDS, ROW_FIELDS, MemoryModel, MemoryRow, fits_capacity
from fxpipe.schedule import registry


def test_format_bytes_units_digits_and_limits():
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1.0 KiB"
    assert format_bytes(1.5 * 2**30, 2) == "1.50 GiB"
    assert format_bytes(-3 * 2**20) == "-3.0 MiB"
    assert format_bytes(5 * 2**50) == "5120.0 TiB"  # no unit beyond TiB, never scientific notation
    assert format_bytes(math.inf) == "inf"
    assert binary_unit(3 * 2**40, largest="GiB") == ("GiB", 2.0**30)
    assert binary_unit(10) == ("B", 1.0)
    with pytest.raises(InputError, match="largest"):
        binary_unit(1, largest="PiB")


@dataclass
class _Row(MemoryRow):
    memory_bytes: float
    capacity_bytes: float | None


def test_one_memory_row_and_capacity_check():
    assert _Row(10.0, None).fits and _Row(10.0, math.inf).fits and _Row(10.0, 10.0).fits
    assert not _Row(10.0, 9.0).fits and _Row(10.0, 9.0).overflow_bytes == 1.0
    assert fits_capacity(100.0 * (1 + 1e-13), 100.0)  # rounding is not an overflow
    rows = MemoryModel(capacity_bytes=100.0, policy="fp32-sgd", reserved_fraction=0.1).breakdown(
        [2.0, 8.0], [1.0, 1.0], [20.0, 30.0], "training", offloaded_peak_bytes=[0.0, 7.0])
    for r in rows:
        row = r.row()
        assert tuple(row) == ROW_FIELDS and ROW_FIELDS[: len(KINDS)] == KINDS
        assert row["memory_bytes"] == r.total_bytes == r.memory_bytes
        assert r.fits == _Row(row["memory_bytes"], row["capacity_bytes"]).fits
    assert [r.fits for r in rows] == [True, False]
    assert rows[1].overflow_bytes == pytest.approx(rows[1].total_bytes - 100.0)
    assert MemoryModel().breakdown([1.0], [0.0], [5.0], "training")[0].row()["capacity_bytes"] is None


def test_matrix_schedule_lists_come_from_the_registry():
    from fxpipe.testing.matrix import MULTI_STAGE_SCHEDULES, SCHEDULES

    assert SCHEDULES == ("gpipe", "1f1b", "zb-h1", "zb-h2", "milp")
    for name in SCHEDULES:
        m = registry.get(name)
        assert not m.offloads and m.admits({"one"})
    assert MULTI_STAGE_SCHEDULES == {"greedy": "v", "interleaved-1f1b": "looped", "zb-v": "v", "dualpipe-v": "v",
                                     "milp": "v"}
    for name, placement in MULTI_STAGE_SCHEDULES.items():
        assert registry.get(name).admits({placement})
