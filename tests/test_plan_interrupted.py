"""Issue 30, item 10: an interrupted plan says so, and fxpipe's warnings travel with the plan.

* Ctrl-C during ``fxpipe plan``'s mesh search: the plan is the best mesh so far; the command
  exits 130 (not 0), the summary's first line says it was interrupted, ``--json`` has
  ``"interrupted": true`` and the search's warning in ``"warnings"``.
* A capture on meta that took a device branch (``DeviceBranchWarning``): the warning is in the
  plan's warnings (``--json`` ``"warnings"``, the summary), worded for a meta-only capture
  (how to capture on CPU with ``fxpipe plan``), not a raw Python warning on stderr.
"""

from __future__ import annotations

import json
import signal

import pytest

torch = pytest.importorskip("torch")

import fxpipe.mesh.search as search_mod  # noqa: E402
from fxpipe.cli import main  # noqa: E402

import _meta_models as mm  # noqa: E402


def mlp_model():
    """``--model test_plan_interrupted:mlp_model``: an MLP and one micro-batch."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(32, 32), torch.nn.ReLU())]
    return torch.nn.Sequential(*layers), (torch.randn(2, 32),), {}


def device_branch_on_meta():
    """``--model test_plan_interrupted:device_branch_on_meta``: a router built on meta whose device branch
    picks an int32 ``histc`` (no CPU kernel), as transformers' MoE layers do."""
    with torch.device("meta"):
        return mm.DeviceBranchRouter(), (torch.randn(4, 8),), {}


@pytest.fixture
def default_sigint():
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def press_at_second_candidate(monkeypatch):
    """Ctrl-C (a real SIGINT to this process) as the mesh search starts planning its second candidate."""
    real = search_mod._plan_or_reuse
    calls = []

    def planning(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(search_mod, "_plan_or_reuse", planning)
    return calls


COMMAND = ["plan", "--model", "test_plan_interrupted:mlp_model", "--devices", "4", "--microbatches", "8",
           "--time-limit", "0.5"]


def test_ctrl_c_in_the_mesh_search_exits_130_and_says_so_in_json(default_sigint, press_at_second_candidate, capsys):
    code = main([*COMMAND, "--json"])
    out = capsys.readouterr().out
    assert len(press_at_second_candidate) >= 2
    assert code == 130
    doc = json.loads(out)
    assert doc["interrupted"] is True and doc["plan"]["options"]["interrupted"] is True
    assert any("the mesh search was stopped (Ctrl-C)" in w for w in doc["warnings"]), doc["warnings"]


def test_ctrl_c_in_the_mesh_search_heads_the_summary(default_sigint, press_at_second_candidate, capsys):
    code = main(COMMAND)
    out = capsys.readouterr().out
    assert code == 130
    assert out.splitlines()[0].startswith("interrupted (Ctrl-C): this plan is the best found before the search was "
                                          "stopped"), out[:300]
    assert "warning: the mesh search was stopped (Ctrl-C)" in out


def test_an_uninterrupted_plan_says_so_too(capsys):
    assert main([*COMMAND, "--mesh", "pipeline", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["interrupted"] is False


def test_device_branch_warning_is_one_of_the_plans_warnings(capsys):
    code = main(["plan", "--model", "test_plan_interrupted:device_branch_on_meta", "--devices", "2", "--mesh",
                 "pipeline", "--microbatches", "2", "--time-limit", "0.5", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    found = [w for w in json.loads(captured.out)["warnings"] if "histc" in w]
    assert len(found) == 1, json.loads(captured.out)["warnings"]
    assert found[0].startswith("the model was captured on the meta device (shapes only, no weights)")
    assert "aten.histc.default on int32" in found[0] and "--run or --checkpoint build it on CPU" in found[0]
    assert "DeviceBranchWarning" not in captured.err and "warnings.warn" not in captured.err
