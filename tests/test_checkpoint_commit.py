"""Training-state checkpoints that a crash cannot lose, and damaged ones named (issue 30, items 5 and 6).

``tests/_ckpt_kill_worker.py`` runs a 2-stage pipeline on 2 gloo ranks (forked from one process, so a
trial costs no interpreter start) and SIGKILLs the saving ranks just before a chosen file-system write
of ``save_training_state``; the peer is killed at once. After every kill the directory must hold a
committed version that loads (on 2 fresh ranks) to exactly the state of the last committed save (step 1
before the pointer's rename, step 2 after), with at most the killed save's folder beside it; the next
save collects it, the first layout's files and its ``.NAME.partial-*`` / ``.NAME.old-*`` leftovers.
Damaged checkpoints must raise InputError on every rank, naming the file or folder and the cause.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

WORKER = Path(__file__).with_name("_ckpt_kill_worker.py")


def _harness(tmp_path: Path, kills: str, cases: bool) -> dict:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"dir": str(tmp_path / "work"), "kills": kills, "cases": cases}))
    run = subprocess.run([sys.executable, str(WORKER), str(spec), str(tmp_path / "report.json")],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((tmp_path / "report.json").read_text())


def _check_trials(report: dict, every_write_killed: bool) -> None:
    first, *trials = report["trials"]
    assert first["first_layout"] and first["loaded"] and first["equal"], first  # today's layout still loads
    assert trials
    for t in trials:
        assert t["killed"] or (not every_write_killed and t["write"].startswith("os.mkdir")), t  # mkdir races
        assert t["committed_step"] == t["expect_step"], t
        assert t["loaded"] and t["equal"], t  # loads on 2 fresh ranks, every tensor as last committed
        assert len(t["versions"]) <= 2, t  # the committed one and the killed save's, older ones collected
    assert {t["committed_step"] for t in trials} == {1, 2}  # kills before and after the commit
    assert report["first_layout_left"] == ["latest.json"]  # the first layout's model/, optimizer/, record gone
    assert report["leftovers_next_to_it"] == []  # .ckpt.partial-* / .ckpt.old-* collected


def test_a_save_killed_in_every_phase_leaves_the_last_committed_state(tmp_path):
    """A kill while rank 1 writes its model shard, while rank 0 consolidates, while rank 1 writes its
    optimizer shard, when the shards are dropped, when the record is written, between the pointer's
    write and its rename, when collection begins and at the last write; then damaged checkpoints."""
    report = _harness(tmp_path, "phases", cases=True)
    _check_trials(report, every_write_killed=True)
    phases = {t["write"].split("/")[-1] for t in report["trials"][1:]}
    assert {".latest.json.TMP.tmp", ".fxpipe_state.json.TMP.tmp", "model-00001-of-00001.safetensors"} <= phases
    cases = report["cases"]
    assert cases["ended"] == {"0": "exit 0", "1": "exit 0"}, cases  # no rank hung or died
    for name, words in cases["expected"].items():
        for kind, message in cases["got"][name]:  # both ranks
            assert kind == "InputError" and all(w in message for w in words), (name, kind, message)


@pytest.mark.slow
def test_a_save_killed_before_any_of_its_writes_leaves_the_last_committed_state(tmp_path):
    """Every file-system write of both ranks' save (about 35), one kill each."""
    _check_trials(_harness(tmp_path, "all", cases=False), every_write_killed=False)


def test_save_refuses_early_what_load_would_refuse(tmp_path, single_rank_group):
    """One rank: a ``path`` that is a file (or inside one), a negative ``step`` and a ``mesh`` that is no record of mesh degrees are
    refused by ``save_training_state`` itself (on every rank, before any collective write), naming the argument;
    a mesh with its rank ``order`` or numpy degrees (as a plan's may hold) saves and loads back, the record JSON;
    a save never leaves a checkpoint that ``load_training_state`` then refuses."""
    import numpy as np
    import torch

    import fxpipe
    from fxpipe.codegen.checkpoint import load_training_state, save_training_state
    from fxpipe.errors import InputError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    plan = fxpipe.compile(model, (torch.randn(1, 4),), devices=1, microbatches=1, mesh="pipeline", time_limit_s=0.2)
    _, schedule = plan.build(0, loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.SGD(schedule.parameters(), lr=0.1, momentum=0.9)
    schedule.step(torch.randn(1, 4), target=torch.randn(1, 2), losses=[])
    opt.step()
    afile = tmp_path / "a-file"
    afile.write_text("")
    for kwargs, words in (({"path": afile}, [f"checkpoint path {afile} is a file"]),
                          ({"path": afile / "sub"}, [f"cannot create the checkpoint directory {afile / 'sub'}"]),
                          ({"step": -1}, ["step must be an integer >= 0", "-1"]),
                          ({"mesh": {"pp": 0}}, ["mesh", "integer >= 1", "'pp'"]),
                          ({"mesh": {"pp": 1, "order": "pp"}}, ["mesh", "'order'"]),
                          ({"mesh": [1, 1, 1]}, ["mesh"])):
        call = {"path": tmp_path / "refused", "step": 1, **kwargs}
        with pytest.raises(InputError) as info:
            save_training_state(call.pop("path"), schedule, opt, **call)
        assert all(w in str(info.value) for w in words), (kwargs, str(info.value))
    assert not (tmp_path / "refused").exists()
    mesh = {"pp": np.int64(1), "dp_shard": 1, "dp_replicate": 1, "order": ("dp_replicate", "dp_shard", "pp")}
    save_training_state(tmp_path / "ok", schedule, opt, step=1, mesh=mesh)
    doc = load_training_state(tmp_path / "ok", schedule, opt)
    assert doc["step"] == 1 and doc["mesh"] == {"pp": 1, "dp_shard": 1, "dp_replicate": 1,
                                                "order": ["dp_replicate", "dp_shard", "pp"]}
