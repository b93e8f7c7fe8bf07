"""Fault tests (issue 30, items 7 and 8): every failure of a pipeline rank names its cause.

* An exception inside a stage: the user's exception (not torch's "[Stage 1] failed to run
  forward: args: ..."), the op that raised it and the model's source line, with the rank,
  stage, micro-batch and action; under ``train_local`` (2 gloo ranks) and ``plan.build`` in
  the user's own process (what torchrun runs).
* SIGKILL of a rank: named with the action its heartbeat says it was in.
* A stuck rank: stops after ``action_timeout_s`` (seconds, not the 600 s of the whole run),
  naming the late rank and its action; ``fxpipe plan --run --timeout`` fails with the late
  rank, exit 2, and no "check the path" (a ``TimeoutError`` is an ``OSError``).

The faults are custom ops whose real kernels raise, hang or kill the process
(``tests/_fault_models.py``): capture sees only their fake kernels.
"""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.errors import FxpipeError, WorkerError, WorkerTimeoutError  # noqa: E402

from _fault_models import MICROBATCHES, Faulty, FaultyBatch, FaultyFactory  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _plan(kind: str, devices: int = 2):
    model, inputs = FaultyFactory(kind)()
    mb = tuple(t[: t.shape[0] // MICROBATCHES] for t in inputs)
    return fxpipe.compile(model, mb, devices=devices, microbatches=MICROBATCHES, mesh="pipeline")


def _line_of(text: str) -> int:
    """The line of ``Faulty.forward`` that holds ``text`` (the model's source line a message must name)."""
    lines, start = inspect.getsourcelines(Faulty.forward)
    return start + next(i for i, ln in enumerate(lines) if text in ln)


def _where(plan, node: str) -> tuple[int, int]:
    """(stage, rank) of the graph node ``node`` in the plan."""
    stage = plan.stage_of[node]
    return stage, plan.device_of_stage[stage]


def test_an_exception_in_a_stage_names_the_users_exception_its_op_and_line():
    """train_local on 2 gloo ranks: the user's ValueError from a custom op on the last stage leads,
    with rank, stage, micro-batch, action, the op and the model's line; torch's wrapper does not."""
    plan = _plan("reject")
    stage, rank = _where(plan, "reject")
    with pytest.raises(WorkerError) as info:
        plan.train_local(FaultyFactory("reject"), FaultyBatch(), steps=1, loss="mse", reference=False, timeout_s=300)
    err = info.value
    first = err.summary.splitlines()[0]
    assert first.startswith(f"pipeline worker rank {rank} (stage {stage}, forward of micro-batch 0, action {stage}F0, "
                            "training step 0"), first
    assert first.endswith("failed: ValueError: activation rejected by the user's check (on purpose)"), first
    line = _line_of("getattr(torch.ops.fxpipe_faults, self.kind)(h)")
    assert (f"in the model's code: File \"{inspect.getsourcefile(Faulty)}\", line {line}, in forward: "
            "h = getattr(torch.ops.fxpipe_faults, self.kind)(h)") in err.summary, err.summary
    assert "op: reject (fxpipe_faults.reject.default)" in err.summary
    assert 'raised at: File "' in err.summary and "in reject: raise ValueError(" in err.summary
    assert "failed to run forward" not in err.summary and "traceback" not in err.summary
    assert (err.rank, err.action, err.microbatch, err.cause_type) == (rank, f"{stage}F0", 0, "ValueError")
    assert err.frame and err.op == "reject (fxpipe_faults.reject.default)"


def test_an_aten_error_under_plan_build_names_the_op_and_line(single_rank_group):
    """plan.build in the user's own process (what torchrun runs): an embedding lookup out of range
    raises a WorkerError naming rank 0, stage 0, the micro-batch, the action, IndexError, the aten op
    and the model's line (not nn.Embedding's), raised from the IndexError itself."""
    plan = _plan("index", devices=1)
    _, sched = plan.build(0, loss_fn=torch.nn.functional.mse_loss)
    (x, ids), target = FaultyBatch()(0)  # ids 7 of a 4-row table
    with pytest.raises(WorkerError) as info:
        sched.step(x, ids, target=target, losses=[], return_outputs=False)
    err = info.value
    first = str(err).splitlines()[0]
    assert first == "rank 0 (stage 0, forward of micro-batch 0, action 0F0) failed: IndexError: index out of range in self"
    assert f"line {_line_of('self.emb(ids)')}, in forward: h = h + self.emb(ids)" in err.frame, err.frame
    assert err.op == "embedding (aten.embedding.default)"
    assert isinstance(err.__cause__, IndexError) and isinstance(err, FxpipeError)


@pytest.mark.slow
def test_a_killed_rank_is_named_with_the_action_it_was_in():
    """SIGKILL inside a forward: no error report, the rank's heartbeat names its stage and action."""
    plan = _plan("die")
    stage, rank = _where(plan, "die")
    with pytest.raises(WorkerError) as info:
        plan.train_local(FaultyFactory("die"), FaultyBatch(), steps=1, loss="mse", reference=False, timeout_s=300)
    err = info.value
    assert str(err).startswith(f"pipeline worker rank {rank} (stage {stage}, forward of micro-batch 0, action "
                               f"{stage}F0, training step 0, run 0) failed: killed by signal SIGKILL"), str(err)
    assert (err.rank, err.action) == (rank, f"{stage}F0")


def test_a_stuck_rank_fails_after_the_action_timeout_naming_its_action():
    """A forward that never returns stops at the 2 s action time-out (not the run's 300 s), naming the
    late rank, its action and how long it has been in it, and what the other rank was doing."""
    plan = _plan("stall")
    stage, rank = _where(plan, "stall")
    with pytest.raises(WorkerTimeoutError) as info:
        plan.train_local(FaultyFactory("stall"), FaultyBatch(), steps=1, loss="mse", reference=False, timeout_s=300,
                         action_timeout_s=2)
    err = info.value
    first = err.summary.splitlines()[0]
    assert isinstance(err, TimeoutError) and isinstance(err, WorkerError)
    assert first.startswith("pipeline run with 2 ranks stopped: a rank spent more than the action time-out of 2 s in "
                            f"one action: pipeline worker rank {rank} (stage {stage}, forward of micro-batch 0, action "
                            f"{stage}F0, training step 0, run 0) is late: in that action for "), first
    assert f"other ranks: rank {1 - rank} (" in err.summary
    assert (err.rank, err.action) == (rank, f"{stage}F0") and err.idle_s >= 2


def test_the_late_rank_is_the_one_in_an_action_or_not_started(tmp_path):
    """From the heartbeats alone (no processes): a rank inside an action is late before a rank that waits
    longer after its last action; a rank without a heartbeat (still starting) is later still."""
    import json
    import time

    from fxpipe.launcher import timeout_error

    now = time.time()
    beats = {0: {"rank": 0, "phase": "training step 1", "stages": [0], "run": 0, "running": None,
                 "last_action": "0W3", "since": now - 9.0},
             1: {"rank": 1, "phase": "training step 1", "stages": [1], "run": 0, "running": "1B2", "since": now - 4.0}}
    for r, b in beats.items():
        (tmp_path / f"rank{r}.beat").write_text(json.dumps(b) + "   ")
    err = timeout_error(str(tmp_path), 2, "pipeline run with 2 ranks did not finish within 5 s", "pipeline")
    assert err.summary.startswith("pipeline run with 2 ranks did not finish within 5 s: pipeline worker rank 1 (stage 1, "
                                  "backward of micro-batch 2, action 1B2, training step 1, run 0) is late: in that action "
                                  "for 4."), err.summary
    assert "other ranks: rank 0 (stage 0, training step 1, run 0), no progress for 9." in err.summary
    assert ", after action 0W3" in err.summary and (err.rank, err.action) == (1, "1B2") and err.idle_s >= 4
    err = timeout_error(str(tmp_path), 3, "pipeline run with 3 ranks did not finish within 5 s", "pipeline")
    assert "pipeline worker rank 2 (starting: importing torch, joining the process group) is late: no heartbeat yet" \
        in err.summary and err.rank == 2 and err.idle_s is None


@pytest.mark.slow
def test_cli_timeout_names_the_late_rank(capsys):
    """`fxpipe plan --run --timeout S`: a stuck rank ends the run after S seconds with exit 2 and a message
    naming the late rank (which phase it is in depends on the machine's speed: at 4 s it may still be
    starting), not "check the path"."""
    from fxpipe.cli import main

    code = main(["plan", "--model", "_fault_models:stall_model", "--devices", "2", "--mesh", "pipeline",
                 "--microbatches", str(MICROBATCHES), "--run", "--timeout", "4", "--time-limit", "2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "did not finish within 4 s: pipeline worker rank " in err and " is late: " in err, err
    assert "check the path" not in err


def test_cli_timeout_must_be_positive(capsys):
    from fxpipe.cli import main

    assert main(["plan", "--model", "_fault_models:stall_model", "--devices", "2", "--run", "--timeout", "0"]) == 2
    assert "--timeout must be a positive number of seconds, got 0.0" in capsys.readouterr().err
