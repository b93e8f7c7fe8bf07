"""The typed schedule IR: Action text form, per-device Orders, the one schedule-to-orders
function, placements in the problem file, and torch's CSV schedule format (round trip
against torch's own ``_load_csv`` / ``_dump_csv``)."""

from __future__ import annotations

import json

from _torch_actions import torch_action_names
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import InputError
from fxpipe.ir import (
    Action,
    Orders,
    Schedule,
    ScheduledOp,
    ScheduleProblem,
    looped_placement,
    orders_from_torch_csv,
    orders_to_torch_csv,
    program_order,
    schedule_to_orders,
    v_placement,
)
from fxpipe.ir.torch_csv import read_torch_csv, write_torch_csv


# ------------------------------------------------------------------------------ Action
@given(st.integers(0, 10_000), st.sampled_from("FBWOR"), st.integers(0, 10_000))
def test_action_text_round_trip(stage, kind, mb):
    a = Action(stage, kind, mb)
    assert Action.parse(str(a)) == a
    assert str(a) == f"{stage}{kind}{mb}"


@pytest.mark.parametrize("text", ["", "F0", "2F", "2X0", "-1F0", "2I0", "2F0x", "2 F 0 1", None, 3])
def test_action_parse_rejects_bad_text(text):
    with pytest.raises(InputError, match="action"):
        Action.parse(text)


def test_action_is_immutable_and_validated():
    a = Action(2, "F", 0)
    with pytest.raises(AttributeError):
        a.stage = 3  # type: ignore[misc]
    with pytest.raises(InputError):
        Action(-1, "F", 0)
    with pytest.raises(InputError):
        Action(0, "X", 0)
    with pytest.raises(InputError):
        Action(0, "F", 1.5)  # type: ignore[arg-type]
    assert not Action(0, "O", 1).is_compute and Action(0, "W", 1).is_compute


# ------------------------------------------------------------------------------ Orders
def _v_orders():
    return Orders(v_placement(2), (
        tuple(map(Action.parse, ["0F0", "3F0", "3B0", "3W0", "0B0", "0W0"])),
        tuple(map(Action.parse, ["1F0", "2F0", "2B0", "1B0", "2W0", "1W0"])),
    ))


def test_orders_views_and_json_round_trip():
    o = _v_orders()
    assert o.num_devices == 2 and o.num_stages == 4
    assert o.of_stage(3) == [Action(3, "F", 0), Action(3, "B", 0), Action(3, "W", 0)]
    assert o.stage_orders()[2] == [("F", 0), ("B", 0), ("W", 0)]
    assert o.check(1) == []
    assert "missing" in " ".join(o.check(2))
    doc = json.loads(json.dumps(o.to_dict()))
    assert Orders.from_dict(doc) == o
    assert o.to_text().splitlines()[0] == "device 0: 0F0 3F0 3B0 3W0 0B0 0W0"


def test_orders_reject_actions_on_the_wrong_device():
    with pytest.raises(InputError, match="on device 1"):
        Orders((0, 1), ((Action(1, "F", 0),), (Action(0, "F", 0),)))
    with pytest.raises(InputError, match="twice"):
        Orders((0,), ((Action(0, "F", 0), Action(0, "F", 0)),))
    with pytest.raises(InputError, match="interleaves"):
        Orders.from_stage_orders({0: [("F", 0)], 1: [("F", 0)]}, (0, 0))


def test_looped_and_v_placements():
    assert looped_placement(4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert v_placement(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert v_placement(2, 3) == (0, 1, 1, 0, 0, 1)
    with pytest.raises(InputError):
        looped_placement(0, 2)


# ------------------------------------------------------------------------------ schedule -> orders
def test_program_order_breaks_ties_by_dependencies():
    # zero-length ops at one instant: F(1) after F(0) (forward flows up), B(0) after B(1)
    ops = [ScheduledOp(0, 0, "B", 5.0, 5.0), ScheduledOp(1, 0, "B", 5.0, 5.0), ScheduledOp(1, 0, "F", 5.0, 5.0),
           ScheduledOp(0, 0, "F", 5.0, 5.0), ScheduledOp(0, 0, "W", 5.0, 6.0), ScheduledOp(0, 0, "R", 5.0, 5.0)]
    got = [str(o) for o in program_order(ops)]
    assert got == ["0F0", "1F0", "0R0", "1B0", "0B0", "0W0"]


def test_schedule_to_orders_per_device():
    p = ScheduleProblem.create(num_stages=4, num_microbatches=1, t_f=1, t_b=1, t_w=1, device_of_stage=v_placement(2))
    o = _v_orders()
    from fxpipe.schedule.simulate import simulate

    sched = simulate(p, o)
    assert schedule_to_orders(sched, p) == o
    assert schedule_to_orders(sched, p.device_of_stage) == o
    # one stage per device: the older per-stage form
    q = ScheduleProblem.create(num_stages=2, num_microbatches=2, t_f=1, t_b=1, t_w=1)
    from fxpipe.schedule.heuristics import one_f_one_b, orders_1f1b

    s2 = one_f_one_b(q)
    assert schedule_to_orders(s2).stage_orders() == orders_1f1b(2, 2)
    assert [str(x) for x in s2.ops_of_stage(0)] == [str(a) for a in schedule_to_orders(s2).of_stage(0)]


# ------------------------------------------------------------------------------ problem placement
def test_problem_placement_defaults_and_round_trip(tmp_path):
    old = {"format": "fxpipe.schedproblem/1", "num_stages": 3, "num_microbatches": 2, "t_f": 1, "t_b": 1, "t_w": 1,
           "mem_limit": [2, None, 3]}
    p = ScheduleProblem.from_dict(old)
    assert p.num_devices == 3 and p.device_of_stage == (0, 1, 2) and p.identity_placement
    q = ScheduleProblem.create(num_stages=4, num_microbatches=2, t_f=1, t_b=1, t_w=1, t_comm=[1, 2, 3],
                               device_of_stage=v_placement(2), mem_limit=[5, 6])
    assert q.num_devices == 2 and q.device_stages == ((0, 3), (1, 2))
    assert q.t_comm_effective.tolist() == [1, 0, 3] and q.comm(1) == 0.0
    r = ScheduleProblem.load(q.save(tmp_path / "q.json"))
    assert r.to_dict() == q.to_dict()


@pytest.mark.parametrize("kw, msg", [
    (dict(device_of_stage=[0, 1]), "one entry per stage"),
    (dict(device_of_stage=[0, 0, 2, 2]), "device 1 holds no stage"),
    (dict(device_of_stage=[0, 1, 1, 0], mem_limit=[1, 2, 3]), "mem_limit must have 2 entries"),
    (dict(num_devices=2), "give device_of_stage"),
    (dict(device_of_stage=[0, 1, 1, 5], num_devices=2), "outside"),
    (dict(device_of_stage="0110"), "device_of_stage"),
])
def test_problem_placement_errors(kw, msg):
    with pytest.raises(InputError, match=msg):
        ScheduleProblem.create(num_stages=4, num_microbatches=2, t_f=1, t_b=1, t_w=1, **kw)


# ------------------------------------------------------------------------------ torch CSV
def _torch_runtime(num_ranks: int, num_stages: int, num_microbatches: int):
    """A bare torch schedule runtime: enough state for _load_csv / _dump_csv (test only)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    rt = object.__new__(_PipelineScheduleRuntime)
    rt.pp_group_size = num_ranks
    rt._num_stages = num_stages
    rt._n_microbatches = num_microbatches
    rt._stages = []
    rt.pipeline_order = {}
    rt._defer_pp_recv = False
    return rt


@pytest.mark.parametrize("method, placement", [("zb-v", "v"), ("interleaved-1f1b", "looped"), ("dualpipe-v", "v"),
                                               ("zb-h1", "identity"), ("milp", "v")])
def test_csv_round_trip_through_torch(tmp_path, method, placement):
    from fxpipe.schedule.dispatch import make_schedule

    p_dev, m = 2, 4
    dev = {"v": v_placement(p_dev), "looped": looped_placement(p_dev, 2), "identity": None}[placement]
    S = 2 * p_dev if dev is not None else p_dev
    prob = ScheduleProblem.create(num_stages=S, num_microbatches=m, t_f=1, t_b=1, t_w=1, device_of_stage=dev)
    sched = make_schedule(prob, method, time_limit_s=5)
    orders = schedule_to_orders(sched, prob)
    path = write_torch_csv(tmp_path / "sched.csv", orders)
    rt = _torch_runtime(prob.num_devices, S, m)
    rt._load_csv(str(path))  # torch parses, validates and lowers it (send/recv added)
    assert rt.stage_index_to_group_rank == {s: prob.device_of_stage[s] for s in range(S)}
    # what torch read is what fxpipe wrote: I = fxpipe B, full B = B then W
    back = {r: torch_action_names(acts) for r, acts in rt.pipeline_order.items()}
    assert back == {d: [str(a) for a in row] for d, row in enumerate(orders.actions)}
    # and torch's own dump reads back to the same orders
    rt._dump_csv(str(tmp_path / "dump.csv"), format="compute_only")
    assert read_torch_csv(tmp_path / "dump.csv", prob.device_of_stage) == orders
    # unfused: only I and W cells
    text = orders_to_torch_csv(orders, fuse_backward=False)
    assert "B" not in text and orders_from_torch_csv(text) == orders


def test_csv_reads_torch_generated_overlapped_and_padded_rows():
    text = "0F0,,(0F1;3B0)OVERLAP_F_B,3F0\r\n1F0,2F0\r\n"
    o = orders_from_torch_csv(text)
    assert [str(a) for a in o.of_device(0)] == ["0F0", "0F1", "3B0", "3W0", "3F0"]
    assert o.device_of_stage == (0, 1, 1, 0)


@pytest.mark.parametrize("text, msg", [
    ("0F0,0X1\n", "bad action"),
    ("0F0,0SEND_F0\n", "compute-only"),
    ("0F0\n0F1\n", "stage 0 has actions on rank 0 and on rank 1"),
    ("0F0\n2F0\n", "stage 1 has no action"),
    ("", "no rows"),
])
def test_csv_errors(text, msg):
    with pytest.raises(InputError, match=msg):
        orders_from_torch_csv(text)


def test_csv_offload_is_refused_or_dropped():
    o = Orders((0,), ((Action(0, "F", 0), Action(0, "O", 0), Action(0, "R", 0), Action(0, "B", 0), Action(0, "W", 0)),))
    with pytest.raises(InputError, match="offload"):
        orders_to_torch_csv(o)
    assert orders_to_torch_csv(o, offload="drop") == "0F0,0B0\r\n"
    from fxpipe.ir.torch_csv import torch_action_rows

    assert torch_action_rows(o, offload="drop") == [["0F0", "0B0"]]
    assert torch_action_rows(o, offload="drop", fuse_backward=False) == [["0F0", "0I0", "0W0"]]


def test_schedule_ops_of_device():
    ops = (ScheduledOp(0, 0, "F", 0.0, 1.0), ScheduledOp(1, 0, "F", 1.0, 2.0))
    s = Schedule(ops=ops, makespan=2.0, stage_span=2.0)
    assert [str(o) for o in s.ops_of_device(0, (0, 0))] == ["0F0", "1F0"]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 5), st.booleans())
def test_csv_round_trip_of_generated_orders(p_dev, v, m, fuse):
    # any complete program written by fxpipe reads back identically
    dev = looped_placement(p_dev, v)
    rows = [[] for _ in range(p_dev)]
    for s in range(len(dev)):
        for j in range(m):
            rows[dev[s]] += [Action(s, "F", j), Action(s, "B", j), Action(s, "W", j)]
    o = Orders(dev, tuple(tuple(r) for r in rows))
    assert orders_from_torch_csv(orders_to_torch_csv(o, fuse_backward=fuse)) == o
