"""Every file kind fxpipe reads refuses bad input naming the file, the field and the allowed range (issue 30, item 9).

One table per file kind: a valid document, edited one field at a time, written to a file and read
with the kind's public loader. Each edit must raise :class:`~fxpipe.errors.InputError` whose message
holds the file's path and the words that name the field (and the range, where there is one); never a
``KeyError``, ``AttributeError``, a raw ``SafetensorError`` or an accepted absurd value. Kinds: hardware
profiles, the cost database, OpGraph files, schedule problems, safetensors checkpoints (and their
index), plan files and the training-state record. The training-state record is also loaded on 2 gloo
ranks by ``tests/test_checkpoint_commit.py``.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest

from fxpipe.errors import InputError

NAN, INF = float("nan"), float("inf")


def _set(*path: Any, value: Any) -> Callable[[dict], None]:
    """An edit that sets ``doc[path[0]][path[1]]... = value``."""
    def edit(doc: dict) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


def _drop(*path: Any) -> Callable[[dict], None]:
    def edit(doc: dict) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return edit


def _refused(tmp_path: Path, base: dict, edit: Callable[[dict], None], load: Callable[[Path], Any],
             words: list[str], name: str = "file.json") -> str:
    doc = copy.deepcopy(base)
    edit(doc)
    path = tmp_path / name
    path.write_text(json.dumps(doc))  # NaN and Infinity written as a hand edit could (Python's JSON reads them)
    with pytest.raises(InputError) as info:
        load(path)
    message = str(info.value)
    assert str(path) in message and all(w in message for w in words), message
    return message


# ----------------------------------------------------------------------------- hardware profiles
def _profile_doc() -> dict:
    from fxpipe.cost.specs import HARDWARE

    measurement = {"op": "aten.mm.default", "args": "f32[4,4]g, f32[4,4]w", "op_class": "aten.mm", "kind": "matmul_param",
                   "t_fwd_s": 1e-5, "t_bwd_input_s": 1e-5, "t_bwd_weight_s": 1e-5, "repeats": 5, "flops": 128.0,
                   "bytes": 192.0, "dtype": "fp32", "roofline_spec": "cpu", "roofline_s": [1e-5, 1e-5, 1e-5]}
    return {"format": "fxpipe.hwprofile/1", "name": "tiny", "device": {"device": "cpu: test", "torch": "2", "threads": 1},
            "base": HARDWARE["cpu"].to_dict(), "d2d_bytes_per_s": None, "p2p_latency_s": None,
            "autograd_call_overhead_s": 1e-5, "measurements": {"aten.mm.default(f32[4,4]g, f32[4,4]w)": measurement}}


PROFILE_CASES = {
    "bandwidth NaN": (_set("base", "hbm_bytes_per_s", value=NAN), ["'hbm_bytes_per_s' is nan", "(0, 1e+18]"]),
    "bandwidth inf": (_set("base", "d2d_bytes_per_s", value=INF), ["'d2d_bytes_per_s' is inf"]),
    "bandwidth negative": (_set("base", "host_bytes_per_s", value=-1.0), ["'host_bytes_per_s' is -1", "(0, 1e+18]"]),
    "launch overhead negative": (_set("base", "launch_overhead_s", value=-1), ["'launch_overhead_s' is -1", "[0, 1]"]),
    "latency NaN": (_set("base", "intra_node_latency_s", value=NAN), ["'intra_node_latency_s' is nan"]),
    "devices_per_node 0": (_set("base", "devices_per_node", value=0), ["'devices_per_node' is 0", "[1, 1e+06]"]),
    "zero peak": (_set("base", "peak_flops", "fp32", value=0), ["peak_flops['fp32']", "is 0", "(0, 1e+21]"]),
    "no fp32 peak": (_drop("base", "peak_flops", "fp32"), ["'peak_flops' has no 'fp32' entry"]),
    "missing capacity": (_drop("base", "memory_bytes"), ["lacks the required field 'memory_bytes'"]),
    "host memory negative": (_set("base", "host_memory_bytes", value=-5), ["'host_memory_bytes' is -5"]),
    "measured link negative": (_set("d2d_bytes_per_s", value=-5), ["'d2d_bytes_per_s' is -5"]),
    "autograd overhead NaN": (_set("autograd_call_overhead_s", value=NAN), ["'autograd_call_overhead_s' is nan"]),
    "measurements a list": (_set("measurements", value=[]), ["'measurements' is a list"]),
    "op time 1e308": (_set("measurements", "aten.mm.default(f32[4,4]g, f32[4,4]w)", "t_fwd_s", value=1e308),
                      ["'t_fwd_s' is 1e+308", "[0, 1e+06]", "aten.mm.default"]),
    "threads 0": (_set("device", "threads", value=0), ["'threads' is 0"]),
    "efficiency above its range": (_set("base", "efficiency", value={"matmul": 2.0}),
                                   ["efficiency['matmul']", "is 2", "(0, 1.5]"]),
    "efficiency of no family": (_set("base", "efficiency", value={"matmull": 0.5}), ["efficiency", "'matmull'"]),
}


@pytest.mark.parametrize("case", list(PROFILE_CASES))
def test_hardware_profile_bad_fields(tmp_path, case):
    from fxpipe.cost.hardware import get_hardware

    edit, words = PROFILE_CASES[case]
    _refused(tmp_path, _profile_doc(), edit, get_hardware, words, name="profile.json")


def test_a_valid_profile_loads_and_the_shipped_one_still_does(tmp_path):
    from fxpipe.cost.hardware import get_hardware

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile_doc()))
    assert get_hardware(path).peak("fp32") > 0 and get_hardware("profile:cpu").peak("fp32") > 0


# ----------------------------------------------------------------------------- the cost database
def _costdb_doc() -> dict:
    entry = _profile_doc()["measurements"]["aten.mm.default(f32[4,4]g, f32[4,4]w)"]
    return {"format": "fxpipe.costdb/1", "devices": {"cpu: test | torch 2 | 1 threads": {
        "device": "cpu: test", "torch": "2", "threads": 1, "autograd_call_overhead_s": 1e-5, "autograd_node_s": 1e-6,
        "entries": {"aten.mm.default(f32[4,4]g, f32[4,4]w)": entry}}}}


_DEV = "cpu: test | torch 2 | 1 threads"
_OP = "aten.mm.default(f32[4,4]g, f32[4,4]w)"
COSTDB_CASES = {
    "entries a list": (_set("devices", _DEV, "entries", value=[]), ["'entries' is a list", "object of op key"]),
    "devices a list": (_set("devices", value=[]), ["'devices' must be an object"]),
    "time 1e300": (_set("devices", _DEV, "entries", _OP, "t_fwd_s", value=1e300), ["'t_fwd_s' is 1e+300", "[0, 1e+06]"]),
    "time negative": (_set("devices", _DEV, "entries", _OP, "t_bwd_input_s", value=-1), ["'t_bwd_input_s' is -1"]),
    "time text": (_set("devices", _DEV, "entries", _OP, "t_bwd_weight_s", value="fast"), ["'t_bwd_weight_s' is 'fast'"]),
    "flops NaN": (_set("devices", _DEV, "entries", _OP, "flops", value=NAN), ["'flops' is nan"]),
    "roofline of 2 phases": (_set("devices", _DEV, "entries", _OP, "roofline_s", value=[1, 2]), ["'roofline_s'"]),
    "entry a number": (_set("devices", _DEV, "entries", _OP, value=3), ["a measurement must be an object"]),
    "no op name": (_drop("devices", _DEV, "entries", _OP, "op"), ["field 'op' is None"]),
    "threads text": (_set("devices", _DEV, "threads", value="one"), ["'threads' is 'one'"]),
    "overhead inf": (_set("devices", _DEV, "autograd_node_s", value=INF), ["'autograd_node_s' is inf"]),
}


@pytest.mark.parametrize("case", list(COSTDB_CASES))
def test_cost_database_bad_fields(tmp_path, case):
    from fxpipe.cost.database import CostDatabase

    edit, words = COSTDB_CASES[case]
    _refused(tmp_path, _costdb_doc(), edit, CostDatabase, words, name="costdb.json")


# ----------------------------------------------------------------------------- OpGraph files
def _graph_doc() -> dict:
    nodes = [{"id": i, "name": f"op{i}", "t_fwd_s": 1e-3, "t_bwd_input_s": 1e-3, "size_out_bytes": 64.0,
              "act_bytes": 64.0} for i in range(4)]
    return {"format": "fxpipe.opgraph/1", "name": "g", "bandwidth_bytes_per_s": 1e10, "nodes": nodes,
            "edges": [[0, 1], [1, 2], [2, 3]]}


GRAPH_CASES = {
    "time 1e308": (_set("nodes", 2, "t_fwd_s", value=1e308), ["t_fwd_s[2] ('op2') is 1e+308", "[0, 1e+06]"]),
    "time NaN": (_set("nodes", 1, "t_bwd_input_s", value=NAN), ["t_bwd_input_s[1]", "nan"]),
    "bytes 1e30": (_set("nodes", 0, "act_bytes", value=1e30), ["act_bytes[0] ('op0') is 1e+30", "[0, 1e+18]"]),
    "bytes negative": (_set("nodes", 3, "size_out_bytes", value=-1), ["size_out_bytes[3]", "-1"]),
    "bandwidth 0": (_set("bandwidth_bytes_per_s", value=0), ["bandwidth_bytes_per_s", "(0, 1e+18]"]),
    "bandwidth 1e30": (_set("bandwidth_bytes_per_s", value=1e30), ["bandwidth_bytes_per_s", "1e+30"]),
    "time text": (_set("nodes", 0, "t_fwd_s", value="1 ms"), ["t_fwd_s='1 ms'"]),
}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_opgraph_bad_fields(tmp_path, case):
    from fxpipe.ir import OpGraph

    edit, words = GRAPH_CASES[case]
    _refused(tmp_path, _graph_doc(), edit, OpGraph.load, words, name="graph.json")


# ----------------------------------------------------------------------------- schedule problems
def _problem_doc() -> dict:
    return {"format": "fxpipe.schedproblem/1", "num_stages": 2, "num_microbatches": 4, "t_f": 1.0, "t_b": 1.0,
            "t_w": 1.0, "t_comm": 0.1, "mem_f": 1.0, "mem_limit": 10.0}


PROBLEM_CASES = {
    "a million micro-batches": (_set("num_microbatches", value=1_000_000), ["num_microbatches is 1000000", "1..4096"]),
    "ten thousand stages": (_set("num_stages", value=10_000), ["num_stages is 10000", "1..4096"]),
    "too many operations": (lambda d: d.update(num_stages=1024, num_microbatches=2048),
                            ["1024 x 2048", "at most 3145728"]),
    "time 1e30": (_set("t_f", value=1e30), ["t_f[0] is 1e+30", "[0, 1e+06]"]),
    "comm NaN": (_set("t_comm", value=NAN), ["t_comm[0]", "nan"]),
    "memory 1e30": (_set("mem_f", value=1e30), ["mem_f must lie in", "1e+18"]),
}


@pytest.mark.parametrize("case", list(PROBLEM_CASES))
def test_schedule_problem_bad_fields(tmp_path, case):
    from fxpipe.ir import ScheduleProblem

    edit, words = PROBLEM_CASES[case]
    _refused(tmp_path, _problem_doc(), edit, ScheduleProblem.load, words, name="problem.json")


# ----------------------------------------------------------------------------- plan files
@pytest.fixture(scope="module")
def plan_doc() -> dict:
    from test_plan_format import _chain_plan  # a torch-free plan of a 6-op chain on 2 devices

    return json.loads(json.dumps(_chain_plan().to_dict()))


PLAN_CASES = {
    "microbatches edited": (_set("microbatches", value=3), ["field 'microbatches' is 3", "allowed: 4"]),
    "num_stages edited": (_set("num_stages", value=4), ["field 'num_stages' is 4", "allowed: 2"]),
    "placement edited": (_set("placement", value="v"), ["field 'placement' is 'v'", "allowed: 'looped'"]),
    "makespan edited": (_set("makespan_s", value=0.5), ["field 'makespan_s' is 0.5"]),
    "devices text": (_set("devices", value="two"), ["malformed plan"]),
    "objective unknown": (_set("objective", value="speed"), ["field 'objective' is 'speed'", "'training' or 'inference'"]),
    "graph time 1e308": (_set("graph", "nodes", 2, "t_fwd_s", value=1e308), ["graph", "t_fwd_s[2]", "1e+308"]),
    "problem micro-batches": (_set("problem", "num_microbatches", value=10_000), ["problem", "num_microbatches is 10000"]),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_plan_file_bad_fields(tmp_path, plan_doc, case):
    from fxpipe import load_plan

    edit, words = PLAN_CASES[case]
    _refused(tmp_path, plan_doc, edit, load_plan, words, name="plan.json")


def test_the_unedited_plan_file_loads(tmp_path, plan_doc):
    from fxpipe import load_plan

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_doc))
    assert load_plan(path).microbatches == 4


# ----------------------------------------------------------------------------- the training-state record
def _state_doc() -> dict:
    return {"format": "fxpipe.trainstate/1", "step": 2, "mesh": {"pp": 2, "dp_shard": 1, "dp_replicate": 1},
            "world_size": 2, "param_groups": {"0.weight": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
                                                           "weight_decay": 0.1, "foreach": None, "amsgrad": False}},
            "optimizer_state": ["0.weight"]}


STATE_CASES = {
    "lr NaN": (_set("param_groups", "0.weight", "lr", value=NAN), ["'param_groups['0.weight'].lr' is nan", "[0, 100]"]),
    "lr -1": (_set("param_groups", "0.weight", "lr", value=-1), ["'param_groups['0.weight'].lr' is -1"]),
    "lr 1e30": (_set("param_groups", "0.weight", "lr", value=1e30), ["lr' is 1e+30"]),
    "beta above 1": (_set("param_groups", "0.weight", "betas", value=[0.9, 2.0]), ["betas' is [0.9, 2.0]"]),
    "step -5": (_set("step", value=-5), ["field 'step' is -5", "integer >= 0"]),
    "step text": (_set("step", value="two"), ["field 'step' is 'two'"]),
    "step NaN": (_set("step", value=NAN), ["field 'step' is nan"]),
    "param_groups a list": (_set("param_groups", value=[{"lr": 0.01}]), ["field 'param_groups' is [", "an object"]),
    "optimizer_state text": (_set("optimizer_state", value="all"), ["field 'optimizer_state' is 'all'"]),
    "mesh degree 0": (_set("mesh", "pp", value=0), ["field 'mesh'"]),
    "format other": (_set("format", value="other/1"), ["field 'format' is 'other/1'"]),
}


@pytest.mark.parametrize("case", list(STATE_CASES))
def test_training_state_record_bad_fields(tmp_path, case):
    pytest.importorskip("torch")
    from fxpipe.codegen.checkpoint import _read_state

    edit, words = STATE_CASES[case]
    _refused(tmp_path, _state_doc(), edit, lambda path: _read_state(path.parent), words, name="fxpipe_state.json")


# ----------------------------------------------------------------------------- safetensors files
def _weights(tmp_path: Path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    good = tmp_path / "good.safetensors"
    save_file(state, str(good))
    return torch, model, state, good


SAFETENSORS_CASES = {
    "empty": (lambda good: b"", ["header too small"]),
    "truncated": (lambda good: good.read_bytes()[:-10], ["cannot be read"]),
    "garbage": (lambda good: bytes(range(256)) * 4, ["cannot be read"]),
    "header not JSON": (lambda good: (64).to_bytes(8, "little") + b"{" * 64, ["cannot be read"]),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_safetensors_files_unreadable_are_named(tmp_path, case):
    from fxpipe.codegen.materialize import load_tensors

    _, _, _, good = _weights(tmp_path)
    bad = tmp_path / "model.safetensors"
    data, words = SAFETENSORS_CASES[case]
    bad.write_bytes(data(good))
    with pytest.raises(InputError) as info:
        load_tensors(bad, {"0.weight": ["0.weight"]})
    message = str(info.value)
    assert f"safetensors file {bad}" in message and all(w in message for w in words), message
    assert "empty, truncated or not a safetensors file" in message


def test_safetensors_index_must_stay_inside_its_folder(tmp_path):
    from fxpipe.codegen.materialize import load_tensors

    _, _, _, good = _weights(tmp_path)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for weight_map, words in (({"0.weight": "../good.safetensors"}, ["weight_map['0.weight'] = '../good.safetensors'",
                                                                    "points outside"]),
                              ({"0.weight": str(good)}, ["points outside"]),
                              ([["0.weight", "good.safetensors"]], ["field 'weight_map' must be an object"]),
                              ({"0.weight": 7}, ["weight_map['0.weight'] must be a file name"])):
        index = folder / "model.safetensors.index.json"
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(InputError) as info:
            load_tensors(folder, {"0.weight": ["0.weight"]})
        assert str(index) in str(info.value) and all(w in str(info.value) for w in words), str(info.value)


def test_a_hub_snapshot_whose_shards_are_symlinks_loads(tmp_path):
    """A Hugging Face hub cache snapshot (``snapshots/REV/`` whose index and shards are symlinks into ``../../blobs``)
    is a folder of its own shards: the index's names stay inside it, wherever the links lead."""
    import os

    from fxpipe.codegen.materialize import load_tensors

    torch, _, state, good = _weights(tmp_path)
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    good.rename(blobs / "sha-shard")
    (blobs / "sha-index").write_text(json.dumps({"weight_map": {k: "model-00001-of-00001.safetensors" for k in state}}))
    os.symlink("../../blobs/sha-shard", snapshot / "model-00001-of-00001.safetensors")
    os.symlink("../../blobs/sha-index", snapshot / "model.safetensors.index.json")
    out, files = load_tensors(snapshot, {"1.weight": ["1.weight"]})
    assert torch.equal(out["1.weight"], state["1.weight"]) and files == [str(snapshot / "model-00001-of-00001.safetensors")]


def test_a_checkpoint_tensor_of_another_kind_shape_or_missing_is_refused_not_cast(tmp_path):
    """``plan.build(checkpoint=)``'s loader: an int64 tensor for a float parameter is refused (not cast), as
    are another shape and a missing parameter; float16 for float32 is a cast and loads."""
    from safetensors.torch import save_file

    from fxpipe.codegen.materialize import StateSource, materialize_model

    torch, model, state, _ = _weights(tmp_path)
    for name, edit, words in (
            ("int", lambda sd: sd.__setitem__("0.bias", sd["0.bias"].to(torch.int64)), ["0.bias stored int64",
                                                                                       "the model's is float32"]),
            ("shape", lambda sd: sd.__setitem__("1.weight", torch.zeros(2, 2)), ["1.weight stored (2, 2)", "(2, 3)"]),
            ("missing", lambda sd: sd.pop("1.bias"), ["lacks 1 parameter(s) of the model: 1.bias"])):
        sd = dict(state)
        edit(sd)
        path = tmp_path / f"{name}.safetensors"
        save_file(sd, str(path))
        with torch.device("meta"):
            meta = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        with pytest.raises(InputError) as info:
            materialize_model(meta, StateSource(checkpoint=str(path)))
        assert str(path) in str(info.value) and all(w in str(info.value) for w in words), str(info.value)
    half = tmp_path / "half.safetensors"
    save_file({k: v.half() for k, v in state.items()}, str(half))
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    materialize_model(meta, StateSource(checkpoint=str(half)))
    assert meta[0].weight.dtype == torch.float32 and torch.allclose(meta[0].weight, state["0.weight"], atol=1e-3)
    assert not math.isnan(float(meta[1].bias.detach().sum()))
