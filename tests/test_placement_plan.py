"""Placement in the plan (issue 11 item 1): ``fxpipe.compile(stages_per_device=, placement=)``,
the per-stage and per-device tables, save/load, reschedule and the ``fxpipe plan`` flags."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.cli import main  # noqa: E402
from fxpipe.errors import InputError  # noqa: E402
from fxpipe.ir import Orders, v_placement  # noqa: E402
from fxpipe.models import build_hf_model  # noqa: E402
from fxpipe.partition.placement import device_costs  # noqa: E402
from fxpipe.schedule.validate import validate_schedule  # noqa: E402

TINY_GPT2 = {"n_layer": 4, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32, "batch_size": 2, "seq_len": 8}
CLI_TINY = ["n_layer=2", "n_embd=32", "n_head=2", "vocab_size=64", "n_positions=32"]


@pytest.fixture(scope="module")
def v_plan():
    model, args, kwargs = build_hf_model("gpt2", TINY_GPT2)
    return fxpipe.compile(model, args, kwargs, devices=2, microbatches=4, stages_per_device=2, placement="v",
                          time_limit_s=0.5, mesh="pipeline")


def test_v_plan_has_placement_tables_and_orders(v_plan):
    plan = v_plan
    assert (plan.devices, plan.num_stages, plan.stages_per_device, plan.placement) == (2, 4, 2, "v")
    assert plan.device_of_stage == v_placement(2) and plan.options["schedule"] == "auto"  # the default
    assert plan.schedule.method in ("zb-v", "dualpipe-v", "greedy", "milp")  # the fastest that fits
    validate_schedule(plan.problem, plan.schedule)
    assert [s.device for s in plan.stages] == [0, 1, 1, 0]
    assert [d.stages for d in plan.device_table] == [[0, 3], [1, 2]]
    costs = device_costs(plan.graph, plan.partition.assignment, plan.device_of_stage, "training", "relay")
    np.testing.assert_allclose([d.cost_s for d in plan.device_table], costs)
    assert plan.bottleneck_s == pytest.approx(costs.max())
    # the device table adds up its stages; same-device transfers make a device cheaper than its stages
    for d in plan.device_table:
        assert d.num_ops == sum(plan.stages[s].num_ops for s in d.stages)
        assert d.t_fwd_s == pytest.approx(sum(plan.stages[s].t_fwd_s for s in d.stages))
        assert d.cost_s <= sum(plan.stages[s].cost_s for s in d.stages) * (1 + 1e-12)
        assert d.busy_s <= d.span_s * (1 + 1e-9)
    orders = plan.orders()
    assert isinstance(orders, Orders) and orders.device_of_stage == v_placement(2)
    assert orders.check(plan.microbatches) == []
    text = plan.summary()
    assert "4 stages on 2 devices (2 per device, v placement)" in text and "device bottleneck" in text


def test_v_plan_save_load_and_tampering(v_plan, tmp_path):
    path = v_plan.save(tmp_path / "plan.json")
    doc = json.loads(path.read_text())
    assert (doc["devices"], doc["num_stages"], doc["stages_per_device"], doc["placement"]) == (2, 4, 2, "v")
    assert doc["device_of_stage"] == [0, 1, 1, 0] and len(doc["device_table"]) == 2
    loaded = fxpipe.load_plan(path)
    assert loaded.orders() == v_plan.orders() and loaded.device_of_stage == v_plan.device_of_stage
    assert loaded.bottleneck_s == pytest.approx(v_plan.bottleneck_s)
    edited = dict(doc, device_table=[dict(doc["device_table"][0], cost_s=0.0), doc["device_table"][1]])
    (tmp_path / "e1.json").write_text(json.dumps(edited))
    with pytest.raises(InputError, match="device 0 cost_s.*device table was edited"):
        fxpipe.load_plan(tmp_path / "e1.json")
    (tmp_path / "e2.json").write_text(json.dumps(dict(doc, device_of_stage=[0, 1, 0, 1])))
    with pytest.raises(InputError, match="device_of_stage disagrees"):
        fxpipe.load_plan(tmp_path / "e2.json")
    with pytest.raises(InputError, match="rank must be an integer in 0..1"):
        loaded.build(2)


def test_plan_files_from_before_placements_still_load(tmp_path):
    model, args, kwargs = build_hf_model("gpt2", {**TINY_GPT2, "n_layer": 2})
    plan = fxpipe.compile(model, args, kwargs, devices=2, microbatches=2, time_limit_s=0.3, mesh="pipeline")
    doc = plan.to_dict()
    for key in ("num_stages", "stages_per_device", "placement", "device_of_stage", "device_table"):
        del doc[key]
    for s in doc["stages"]:
        del s["device"]
    old = fxpipe.plan.Plan.from_dict(json.loads(json.dumps(doc)))
    assert old.placement == "looped" and old.stages_per_device == 1 and [s.device for s in old.stages] == [0, 1]
    assert old.bottleneck_s == pytest.approx(plan.partition.bottleneck) == pytest.approx(plan.bottleneck_s)


def test_reschedule_keeps_the_placement_and_refuses_other_generators(v_plan):
    dp = v_plan.reschedule("dualpipe-v")
    assert dp.schedule.method == "dualpipe-v" and dp.device_of_stage == v_plan.device_of_stage
    assert len(dp.device_table) == 2
    with pytest.raises(InputError, match="'zb-h1' does not schedule this plan's v placement.*zb-v"):
        v_plan.reschedule("zb-h1")


def test_compile_placement_errors():
    model, args, kwargs = build_hf_model("gpt2", {**TINY_GPT2, "n_layer": 1})
    with pytest.raises(InputError, match="placement must be one of"):
        fxpipe.compile(model, args, kwargs, devices=2, stages_per_device=2, placement="zigzag", mesh="pipeline")
    with pytest.raises(InputError, match="'zb-v' does not schedule the looped placement"):
        fxpipe.compile(model, args, kwargs, devices=2, microbatches=4, stages_per_device=2, schedule="zb-v",
                       time_limit_s=0.2, mesh="pipeline")


def test_cli_plan_stages_per_device_and_placement(capsys):
    code = main(["plan", "--hf", "gpt2", "--config", *CLI_TINY, "--seq-len", "8", "--devices", "2", "--mesh", "pipeline", "--microbatches", "4",
                 "--stages-per-device", "auto", "--placement", "auto", "--time-limit", "0.3", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    plan = json.loads(out.out)["plan"]
    assert plan["devices"] == 2 and plan["num_stages"] == 2 * plan["stages_per_device"]
    assert len(plan["stages"]) == plan["num_stages"] and len(plan["device_table"]) == 2
    assert plan["options"]["stages_per_device"] == "auto" and plan["options"]["placement"] == "auto"
    with pytest.raises(SystemExit) as info:  # argparse: usage and exit 2
        main(["plan", "--hf", "gpt2", "--config", *CLI_TINY, "--devices", "2", "--mesh", "pipeline", "--stages-per-device", "two"])
    assert info.value.code == 2 and "expected an integer or 'auto', got 'two'" in capsys.readouterr().err
    for argv, needle in ((["--stages-per-device", "0"], "--stages-per-device must be >= 1"),
                         (["--stages-per-device", "2", "--schedule", "zb-h1"], "use one of greedy, interleaved-1f1b, milp")):
        code = main(["plan", "--hf", "gpt2", "--config", *CLI_TINY, "--seq-len", "8", "--devices", "2", "--mesh", "pipeline",
                     "--time-limit", "0.2", *argv])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and "Traceback" not in err, err
