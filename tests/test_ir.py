"""OpGraph / ScheduleProblem / Schedule: contract parsing, validation and JSON round trips."""

import json
import math

import numpy as np
import pytest

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph, Schedule, ScheduledOp, ScheduleProblem, write_json_atomic


def _doc(**over):
    doc = {
        "format": "fxpipe.opgraph/1",
        "name": "toy",
        "bandwidth_bytes_per_s": 2.0,
        "nodes": [
            {"id": 1, "t_fwd_s": 2.0, "size_out_bytes": 4, "custom": "kept"},
            {"id": 0, "name": "in", "op": "placeholder", "t_fwd_s": 0.0, "size_out_bytes": 8},
            {"id": 2, "t_fwd_s": 1.0, "size_out_bytes": 1, "t_bwd_input_s": 0.5, "act_bytes": 3},
        ],
        "edges": [[0, 1], [1, 2], [0, 2], [0, 1]],
        "source": "test",
    }
    doc.update(over)
    return doc


def test_opgraph_from_dict_defaults_and_roundtrip(tmp_path):
    g = OpGraph.from_dict(_doc())
    assert g.n == 3 and g.m == 3  # duplicate edge removed
    assert g.names[0] == "in" and g.ops[0] == "placeholder"
    assert g.t_bwd_weight_s.tolist() == [0.0, 0.0, 0.0]
    assert g.successors(0).tolist() == [1, 2]
    assert g.predecessors(2).tolist() == [0, 1]
    assert g.extra[1] == {"custom": "kept"} and g.meta == {"source": "test"}
    path = g.save(tmp_path / "g.json")
    g2 = OpGraph.load(path)
    assert g2.to_dict() == g.to_dict()
    assert json.loads(path.read_text())["format"] == "fxpipe.opgraph/1"
    with pytest.raises(ValueError):
        g.t_fwd_s[0] = 1.0  # frozen arrays


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["nodes"][0].update(t_fwd_s=-1.0), ">= 0"),
        (lambda d: d["nodes"][0].update(t_fwd_s=float("nan")), "finite"),
        (lambda d: d["nodes"][0].pop("size_out_bytes"), "size_out_bytes"),
        (lambda d: d["nodes"][0].update(id=7), "ids must be"),
        (lambda d: d["edges"].append([2, 0]), "cycle"),
        (lambda d: d["edges"].append([2, 2]), "self-loop"),
        (lambda d: d["edges"].append([0, 9]), "outside"),
        (lambda d: d.update(bandwidth_bytes_per_s=0), "bandwidth"),
        (lambda d: d.update(format="other/1"), "format"),
        (lambda d: d.update(nodes=[]), "non-empty"),
        (lambda d: d["nodes"][1].update(t_fwd_s="fast"), "expected a number"),
    ],
)
def test_opgraph_bad_input(mutate, message):
    doc = _doc()
    mutate(doc)
    with pytest.raises(InputError, match=message):
        OpGraph.from_dict(doc)


def test_opgraph_load_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        OpGraph.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        OpGraph.load(bad)


def test_atomic_write_leaves_no_temp(tmp_path):
    write_json_atomic(tmp_path / "a.json", {"x": np.arange(3), "y": np.float64(1.5)})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": [0, 1, 2], "y": 1.5}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    with pytest.raises(ValueError):
        write_json_atomic(tmp_path / "b.json", {"x": float("nan")})
    assert not (tmp_path / "b.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_schedule_problem_defaults_and_roundtrip(tmp_path):
    p = ScheduleProblem.create(num_stages=3, num_microbatches=4, t_f=1, t_b=[1, 2, 3], t_w=1, t_comm=0.5, mem_limit=[2, math.inf, 3])
    assert p.t_comm.tolist() == [0.5, 0.5]
    assert p.mem_b.tolist() == [-0.5] * 3 and p.mem_w.tolist() == [-0.5] * 3
    q = ScheduleProblem.load(p.save(tmp_path / "p.json"))
    assert q.to_dict() == p.to_dict()
    assert math.isinf(q.mem_limit[1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(t_f=-1), ">= 0"),
        (dict(mem_f=1, mem_b=-0.5, mem_w=-0.2), "must be 0"),
        (dict(mem_f=0), "mem_f must be > 0"),
        (dict(mem_b=0.5, mem_w=-1.5), "<= 0"),
        (dict(offload_bytes=2.0), "offload_bytes"),
        (dict(mem_limit=0), "mem_limit"),
        (dict(pcie_groups=[[0, 5]]), "pcie group"),
        (dict(objective="fastest"), "objective"),
        (dict(num_microbatches=0), "num_microbatches"),
        (dict(t_b=[1, 2]), "entries"),
    ],
)
def test_schedule_problem_bad_input(kwargs, message):
    base = dict(num_stages=3, num_microbatches=2, t_f=1, t_b=1, t_w=1)
    base.update(kwargs)
    with pytest.raises(InputError, match=message):
        ScheduleProblem.create(**base)


def test_schedule_roundtrip(tmp_path):
    ops = (ScheduledOp(0, 0, "F", 0.0, 1.0), ScheduledOp(0, 0, "B", 1.0, 2.0), ScheduledOp(0, 0, "W", 2.0, 3.0))
    s = Schedule(ops=ops, makespan=3.0, stage_span=3.0, method="1f1b")
    t = Schedule.load(s.save(tmp_path / "s.json"))
    assert t == s and str(t.ops[0]) == "0F0"
    with pytest.raises(InputError, match="type"):
        Schedule.from_dict({"ops": [{"stage": 0, "microbatch": 0, "type": "X", "start_s": 0, "end_s": 1}]})


def test_pooled_bytes_validated_round_tripped_and_kept_by_recomputation():
    """pooled_bytes: bytes of mem_f no offload moves and a recomputing stage keeps as its inputs."""
    kw = dict(num_stages=2, num_microbatches=2, t_f=1.0, t_b=1.0, t_w=1.0, mem_f=[10.0, 10.0], mem_b=[-4.0, -4.0],
              mem_w=[-6.0, -6.0], offload_bytes=[0.0, 6.0], recompute_mem_f=[3.0, 4.0])
    p = ScheduleProblem.create(**kw, pooled_bytes=[3.0, 4.0])
    assert ScheduleProblem.from_dict(p.to_dict()).pooled_bytes.tolist() == [3.0, 4.0]
    assert "pooled_bytes" not in ScheduleProblem.create(**kw).to_dict()  # written only when not 0
    r = p.with_recompute([0])
    # F keeps the 3 pooled bytes; B holds them and the replayed 7 (not 3 + 10); W frees what is left
    assert r.mem_f[0] == 3.0 and r.mem_b[0] + r.mem_b_transient[0] == 7.0 and r.pooled_bytes[0] == 3.0
    with pytest.raises(InputError, match="no offload moves them"):
        ScheduleProblem.create(**kw, pooled_bytes=[3.0, 5.0])  # 6 offloaded + 5 pooled > 10
    with pytest.raises(InputError, match="a recomputing stage keeps them"):
        ScheduleProblem.create(**{**kw, "recompute_mem_f": [2.0, 4.0]}, pooled_bytes=[3.0, 4.0])
