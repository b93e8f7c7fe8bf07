"""fxpipe.memory: the one memory model (precision policies, ZeRO sharding, budgets, breakdown)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fxpipe.errors import InputError
from fxpipe.memory import POLICIES, MemoryModel, PrecisionPolicy, format_bytes


def test_mixed_precision_adam_is_16_bytes_per_parameter():
    # ZeRO Sec. 3.1: 2 (fp16 weights) + 2 (fp16 grads) + 12 (fp32 master, momentum, variance)
    m = MemoryModel()
    assert m.bytes_per_param("training") == (2.0, 2.0, 12.0)
    assert m.static_bytes_per_param("training") == 16.0
    assert m.static_bytes_per_param("inference") == 2.0
    assert POLICIES["fp32-adam"].training_bytes == 16.0
    assert POLICIES["bf16-adam"].training_bytes == 8.0


@pytest.mark.parametrize("stage, expected", [(0, 16.0), (1, 2 + 2 + 12 / 8), (2, 2 + 2 / 8 + 12 / 8), (3, 16 / 8)])
def test_zero_stages_shard_over_data_parallel(stage, expected):
    m = MemoryModel(data_parallel=8, zero_stage=stage)
    assert m.static_bytes_per_param("training") == pytest.approx(expected)
    # inference keeps full weights whatever the training sharding
    assert m.static_bytes_per_param("inference") == 2.0


def test_activation_budget_per_device_sums_its_stages():
    cap = 80e9
    m = MemoryModel(capacity_bytes=cap, reserved_fraction=0.1)
    params = np.array([1e9, 2e9, 3e9, 4e9])
    comm = np.array([0.0, 1e8, 1e8, 0.0])
    # one stage per device
    b = m.activation_budget_bytes(params, comm, "training")
    np.testing.assert_allclose(b, 0.9 * cap - (16 * params + comm))
    # V-shape: stages 0 and 3 on device 0, 1 and 2 on device 1
    b2 = m.activation_budget_bytes(params, comm, "training", device_of_stage=[0, 1, 1, 0])
    np.testing.assert_allclose(b2, [0.9 * cap - 16 * 5e9, 0.9 * cap - (16 * 5e9 + 2e8)])
    # unlimited capacity: unlimited budget, nothing reserved
    inf = MemoryModel().activation_budget_bytes(params, comm, "training")
    assert np.all(np.isinf(inf)) and MemoryModel().reserved_bytes == 0.0


def test_comm_buffers_are_one_per_microbatch_except_pooled_activations():
    m = MemoryModel()
    inp, out = np.array([0.0, 64.0, 32.0]), np.array([64.0, 32.0, 0.0])
    # training: gradient buffers one per micro-batch; activation buffers only on the last stage
    # (the others are pooled: one per micro-batch in flight, counted with the stash)
    # (plus, on a pooled stage, the one buffer the next receive fills)
    np.testing.assert_allclose(m.comm_buffer_bytes(inp, out, 8, "training"), [8 * 64.0, 64.0 + 8 * 32.0, 8 * 32.0])
    np.testing.assert_allclose(m.pooled_buffer_bytes(inp, "training"), [0.0, 64.0, 0.0])
    np.testing.assert_allclose(m.comm_buffer_bytes(inp, out, 8, "inference"), 8 * inp)
    np.testing.assert_allclose(m.pooled_buffer_bytes(inp, "inference"), 0.0)
    # the partitioner's factors: one pooled buffer per micro-batch 1F1B keeps in flight and one more, m elsewhere
    f_in, f_out = m.comm_buffer_factors(3, 8, "training")
    np.testing.assert_allclose(f_in, [4.0, 3.0, 8.0])
    assert f_out == 8.0
    np.testing.assert_allclose(m.comm_buffer_factors(3, 2, "training")[0], [3.0, 3.0, 2.0])
    f_in, f_out = m.comm_buffer_factors(3, 8, "inference")
    np.testing.assert_allclose(f_in, 8.0)
    assert f_out == 0.0


def test_breakdown_totals_and_overflow():
    m = MemoryModel(capacity_bytes=100.0, policy="fp32-sgd", reserved_fraction=0.1)
    rows = m.breakdown([2.0, 8.0], [1.0, 1.0], [20.0, 30.0], "training", offloaded_peak_bytes=[0.0, 7.0])
    assert [r.params_bytes for r in rows] == [8.0, 32.0]
    assert [r.grads_bytes for r in rows] == [8.0, 32.0]
    assert [r.optimizer_bytes for r in rows] == [0.0, 0.0]
    assert rows[0].total_bytes == pytest.approx(8 + 8 + 1 + 20 + 10)
    assert rows[0].fits and rows[0].overflow_bytes == 0
    assert rows[1].total_bytes == pytest.approx(32 + 32 + 1 + 30 + 10)
    assert not rows[1].fits and rows[1].overflow_bytes == pytest.approx(5.0)
    d = rows[1].to_dict()
    assert d["offloaded_peak_bytes"] == 7.0 and d["capacity_bytes"] == 100.0 and d["fits"] is False


def test_round_trip_and_custom_policy():
    pol = PrecisionPolicy("fp8-adam", 1.0, 2.0, 12.0)
    m = MemoryModel(capacity_bytes=8e10, policy=pol, data_parallel=4, zero_stage=1, reserved_fraction=0.05)
    m2 = MemoryModel.from_dict(m.to_dict())
    assert m2.bytes_per_param("training") == m.bytes_per_param("training")
    assert m2.capacity_bytes == 8e10 and m2.reserved_fraction == 0.05
    assert math.isinf(MemoryModel.from_dict(MemoryModel().to_dict()).capacity_bytes)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(capacity_bytes=0), "positive"),
        (dict(capacity_bytes="lots"), "number of bytes"),
        (dict(policy="fp4-magic"), "unknown precision policy"),
        (dict(data_parallel=0), "data_parallel"),
        (dict(zero_stage=4), "zero_stage"),
        (dict(reserved_fraction=1.0), "reserved_fraction"),
        (dict(policy=PrecisionPolicy("bad", -1.0, 0.0, 0.0)), "weight_bytes"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, needle):
    with pytest.raises(InputError, match=needle):
        MemoryModel(**kwargs)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(80 * 2**30) == "80.0 GiB"
    assert format_bytes(math.inf) == "inf"
