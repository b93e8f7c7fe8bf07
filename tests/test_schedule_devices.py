"""Several stages per device (Contract 3 with ``device_of_stage``): the validator's device
rules (one compute stream, one copy stream, memory summed per device, free comm on one
device, per-device span), and the simulator on placements."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fxpipe.errors import InputError
from fxpipe.ir import Action, Orders, ScheduledOp, ScheduleProblem, v_placement
from fxpipe.schedule.simulate import simulate
from fxpipe.schedule.validate import (
    check_schedule,
    device_busy_s,
    device_memory_profile,
    device_spans,
    objective_values,
    peak_memory,
)


def _two_on_one(**kw) -> ScheduleProblem:
    """Stages 0 and 1, one micro-batch; ``device_of_stage`` from kw (default: both on device 0)."""
    base = dict(num_stages=2, num_microbatches=1, t_f=1.0, t_b=1.0, t_w=1.0, t_comm=5.0, mem_f=1.0,
                device_of_stage=[0, 0])
    base.update(kw)
    return ScheduleProblem.create(**base)


def _chain(p: ScheduleProblem, gap: float) -> list[ScheduledOp]:
    """F0 F1 B1 B0 W1 W0 back to back, ``gap`` between the two stages' F and B."""
    return [
        ScheduledOp(0, 0, "F", 0.0, 1.0),
        ScheduledOp(1, 0, "F", 1.0 + gap, 2.0 + gap),
        ScheduledOp(1, 0, "B", 2.0 + gap, 3.0 + gap),
        ScheduledOp(0, 0, "B", 3.0 + 2 * gap, 4.0 + 2 * gap),
        ScheduledOp(1, 0, "W", 4.0 + 2 * gap, 5.0 + 2 * gap),
        ScheduledOp(0, 0, "W", 5.0 + 2 * gap, 6.0 + 2 * gap),
    ]


def test_comm_is_free_between_stages_on_one_device():
    same = _two_on_one()
    assert check_schedule(same, _chain(same, 0.0)) == []
    apart = _two_on_one(device_of_stage=[0, 1])
    errs = check_schedule(apart, _chain(apart, 0.0))
    assert errs and all(e.startswith("rule 2") for e in errs)
    assert check_schedule(apart, _chain(apart, 5.0)) == []


def test_compute_ops_of_one_device_never_overlap():
    same = _two_on_one()
    apart = _two_on_one(device_of_stage=[0, 1], t_comm=0.0)
    # stage 1's W runs while stage 0's B runs: fine on two devices, not on one
    ops = _chain(same, 0.0)
    ops[4] = ScheduledOp(1, 0, "W", 3.0, 4.0)
    assert check_schedule(apart, ops) == []
    errs = check_schedule(same, ops)
    assert any("rule 3" in e and "device 0" in e for e in errs)


def test_copy_ops_of_one_device_never_overlap():
    kw = dict(num_microbatches=1, t_offload=1.0, t_comm=0.0, t_f=1.0, t_b=1.0, t_w=1.0)
    ops = [
        ScheduledOp(0, 0, "F", 0.0, 1.0), ScheduledOp(1, 0, "F", 1.0, 2.0),
        ScheduledOp(0, 0, "O", 1.0, 2.0), ScheduledOp(1, 0, "O", 2.0, 3.0),
        ScheduledOp(1, 0, "R", 4.0, 5.0), ScheduledOp(0, 0, "R", 4.5, 5.5),
        ScheduledOp(1, 0, "B", 5.0, 6.0), ScheduledOp(0, 0, "B", 6.0, 7.0),
        ScheduledOp(1, 0, "W", 7.0, 8.0), ScheduledOp(0, 0, "W", 8.0, 9.0),
    ]
    same = _two_on_one(**kw)
    assert any("copy stream of device 0" in e for e in check_schedule(same, ops))
    assert check_schedule(_two_on_one(device_of_stage=[0, 1], **kw), ops) == []


def test_memory_is_summed_over_a_device_and_limited_per_device():
    # each stage keeps its stash until its B: both stashes live at t = 1 .. 3
    ops = _chain(_two_on_one(), 0.0)
    tight = _two_on_one(mem_limit=1.5)
    errs = check_schedule(tight, ops)
    assert any(e.startswith("rule 5: device 0") for e in errs)
    assert check_schedule(_two_on_one(mem_limit=2.0), ops) == []
    # on two devices each holds one stash: 1.5 is plenty per device
    apart = _two_on_one(device_of_stage=[0, 1], t_comm=0.0, mem_limit=1.5)
    assert check_schedule(apart, ops) == []
    t, mem = device_memory_profile(_two_on_one(), ops, 0)
    assert mem.max() == pytest.approx(2.0)
    assert peak_memory(_two_on_one(), ops).tolist() == [2.0]
    assert peak_memory(apart, ops).tolist() == [1.0, 1.0]


def test_per_device_span_and_busy_time():
    p = ScheduleProblem.create(num_stages=4, num_microbatches=1, t_f=1, t_b=1, t_w=1, device_of_stage=v_placement(2))
    orders = Orders(p.device_of_stage, (
        tuple(map(Action.parse, ["0F0", "3F0", "3B0", "3W0", "0B0", "0W0"])),
        tuple(map(Action.parse, ["1F0", "2F0", "2B0", "1B0", "2W0", "1W0"])),
    ))
    s = simulate(p, orders)
    assert check_schedule(p, s) == []
    spans = device_spans(p, s)
    # device 0: 0F0 [0,1] 3F0 [3,4] 3B0 3W0 0B0 [7,8] 0W0 [8,9]; device 1: 1F0 [1,2] ... 1W0 [8,9]
    assert spans.tolist() == [9.0, 8.0]
    assert device_busy_s(p).tolist() == [6.0, 6.0]
    ms, span = objective_values(p, s)
    assert (ms, span) == (9.0, 9.0)


def test_identity_placement_keeps_the_old_meaning():
    p = ScheduleProblem.create(num_stages=3, num_microbatches=2, t_f=1, t_b=2, t_w=1, t_comm=0.5)
    from fxpipe.schedule.heuristics import one_f_one_b

    s = one_f_one_b(p)
    first_f = [min(o.start_s for o in s.ops if o.stage == k and o.type == "F") for k in range(3)]
    last_w = [max(o.end_s for o in s.ops if o.stage == k and o.type == "W") for k in range(3)]
    assert objective_values(p, s)[1] == max(w - f for f, w in zip(first_f, last_w))


def test_simulate_on_a_placement_and_deadlock_message():
    p = ScheduleProblem.create(num_stages=4, num_microbatches=1, t_f=1, t_b=1, t_w=1, device_of_stage=v_placement(2))
    # device 0 wants stage 0's backward before stage 3's forward: needs its own later op
    bad = Orders(p.device_of_stage, (
        tuple(map(Action.parse, ["0F0", "0B0", "3F0", "3B0", "3W0", "0W0"])),
        tuple(map(Action.parse, ["1F0", "2F0", "2B0", "1B0", "2W0", "1W0"])),
    ))
    with pytest.raises(InputError, match="deadlock.*device 0: 0B0"):
        simulate(p, bad)
    with pytest.raises(InputError, match="interleaves"):
        simulate(p, {s: [("F", 0), ("B", 0), ("W", 0)] for s in range(4)})
    with pytest.raises(InputError, match="place stages"):
        simulate(p, Orders((0, 1, 2, 3), tuple(() for _ in range(4))))


def test_old_heuristics_refuse_multi_stage_placements():
    from fxpipe.schedule.heuristics import generate

    p = ScheduleProblem.create(num_stages=4, num_microbatches=2, t_f=1, t_b=1, t_w=1, device_of_stage=v_placement(2))
    for method in ("gpipe", "1f1b", "zb-h1", "zb-h2", "pipeoffload", "adaoffload"):
        with pytest.raises(InputError, match="one stage per device"):
            generate(p, method)


def test_one_stage_per_device_permutation_uses_device_limits():
    # stage 0 on device 1 and stage 1 on device 0: limits follow the device
    from fxpipe.schedule.heuristics import one_f_one_b

    p = ScheduleProblem.create(num_stages=2, num_microbatches=4, t_f=1, t_b=1, t_w=1, device_of_stage=[1, 0],
                               mem_limit=[1.0, 2.0])
    s = one_f_one_b(p)  # 1F1B: stage 0 holds 2 stashes (device 1: limit 2), stage 1 one (device 0: limit 1)
    assert check_schedule(p, s) == []
    assert peak_memory(p, s).tolist() == [1.0, 2.0]
    q = p.replace(mem_limit=[2.0, 1.0])
    from fxpipe.errors import InfeasibleError

    with pytest.raises(InfeasibleError):
        one_f_one_b(q)


def test_device_busy_is_the_sum_over_stages():
    p = ScheduleProblem.create(num_stages=4, num_microbatches=3, t_f=[1, 2, 3, 4], t_b=1, t_w=0,
                               device_of_stage=[0, 1, 1, 0])
    assert np.allclose(device_busy_s(p), [3 * (1 + 1 + 4 + 1), 3 * (2 + 1 + 3 + 1)])
    assert math.isinf(p.mem_limit[0])
