"""Multi-process (gloo) end-to-end tests: pipeline training == single-process training.

Every parameter's gradient, the losses and the parameters after 2 SGD steps must match the
eager model trained in one process with the same micro-batch loss averaging. Worker start-up
dominates the run time, so all runs of one world size share one set of processes.
"""

from __future__ import annotations

import functools

import pytest
import torch

from fxpipe.codegen.launch import TrainResult, reference_train, spawn_train, spawn_train_many

from _codegen_models import (
    MICROBATCHES,
    make_batch_gpt2,
    make_batch_t5,
    make_batch_t5_kw,
    make_batch_mlp,
    make_gpt2,
    make_mlp,
    make_t5,
    make_t5_kw,
    orders_1f1b,
    orders_zbh1,
    stage_of_by_blocks,
    stage_of_by_fraction,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 2
LR = 0.5
RTOL = 1e-4


def _gpt2_run(world, orders, by_ops=False, starts=None):
    starts = starts or {2: [2], 4: [1, 2, 3]}[world]
    stage_of = (
        functools.partial(stage_of_by_fraction, num_stages=world) if by_ops
        else functools.partial(stage_of_by_blocks, starts=starts)
    )
    return dict(
        make_model=make_gpt2, stage_of=stage_of, orders=orders,
        num_microbatches=MICROBATCHES, make_batch=make_batch_gpt2, steps=STEPS, lr=LR,
    )


def _t5_relay_run(orders):
    # encoder block 0 | encoder block 1 (+ decoder embedding) | decoder block 0 | decoder block 1
    # + head: the encoder output skips stage 2 (relayed), decoder_input_ids is relayed 0 -> 1
    # keyword inputs (given in a different order than forward's signature)
    return dict(
        make_model=make_t5_kw, stage_of=functools.partial(stage_of_by_blocks, starts=[1, 1000, 1001]),
        orders=orders, num_microbatches=MICROBATCHES, make_batch=make_batch_t5_kw, steps=STEPS, lr=LR,
    )


def _heuristic_orders(world, method):
    try:
        from fxpipe.ir import ScheduleProblem, schedule_to_orders
        from fxpipe.schedule.heuristics import generate
    except ImportError:  # pragma: no cover - the schedule package is optional here
        return None
    prob = ScheduleProblem.create(
        num_stages=world, num_microbatches=MICROBATCHES, t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.1,
    )
    return schedule_to_orders(generate(prob, method), prob)


@pytest.fixture(scope="module")
def ref_gpt2():
    return reference_train(make_gpt2, make_batch_gpt2, num_microbatches=MICROBATCHES, steps=STEPS, lr=LR)


@pytest.fixture(scope="module")
def ref_t5():
    return reference_train(make_t5, make_batch_t5, num_microbatches=MICROBATCHES, steps=STEPS, lr=LR)  # positional


@pytest.fixture(scope="module")
def two_ranks():
    runs = {"1f1b": _gpt2_run(2, orders_1f1b(2, MICROBATCHES)), "zb-h1": _gpt2_run(2, orders_zbh1(2, MICROBATCHES))}
    heur = _heuristic_orders(2, "zb-h1")
    if heur is not None:
        runs["heuristics-zb-h1"] = _gpt2_run(2, heur)
    res = spawn_train_many(list(runs.values()), world_size=2, timeout_s=400)
    return dict(zip(runs, res))


@pytest.fixture(scope="module")
def four_ranks():
    runs = {
        "1f1b": _gpt2_run(4, orders_1f1b(4, MICROBATCHES)),
        "zb-h1": _gpt2_run(4, orders_zbh1(4, MICROBATCHES)),
        "t5-zb-h1": _t5_relay_run(orders_zbh1(4, MICROBATCHES)),
        # cuts inside transformer blocks: stage outputs are also saved for backward by ops of
        # the stage (residual streams, activations), which torch's split backward must survive
        "zb-h1-opcut": _gpt2_run(4, orders_zbh1(4, MICROBATCHES), by_ops=True),
        # stage 1 holds no op at all: it only relays (and has no parameters)
        "zb-h1-empty-stage": _gpt2_run(4, orders_zbh1(4, MICROBATCHES), starts=[2, 2, 3]),
    }
    res = spawn_train_many(list(runs.values()), world_size=4, timeout_s=500)
    return dict(zip(runs, res))


def _assert_same_training(res, ref):
    assert len(res.losses) == STEPS
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref.losses), rtol=RTOL, atol=1e-6)
    assert set(res.grads) == set(ref.grads), set(res.grads) ^ set(ref.grads)
    for k, g in ref.grads.items():
        assert g.abs().max() > 0 or k.endswith("bias"), f"{k}: reference gradient is zero"
        torch.testing.assert_close(res.grads[k], g, rtol=RTOL, atol=1e-6, msg=lambda m, k=k: f"grad {k}: {m}")
    for k, p in ref.params.items():
        torch.testing.assert_close(res.params[k], p, rtol=RTOL, atol=1e-6, msg=lambda m, k=k: f"param {k}: {m}")
    # the update actually moved the weights (the test can fail)
    assert res.losses[1] != res.losses[0]


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "heuristics-zb-h1"])
def test_gpt2_two_ranks(two_ranks, ref_gpt2, name):
    if name not in two_ranks:
        pytest.skip("fxpipe.schedule.heuristics not available")
    res = two_ranks[name]
    _assert_same_training(res, ref_gpt2)
    wte = "m.transformer.wte.weight"
    assert res.meta["shared_params"] == {wte: [0, 1]}
    if name == "zb-h1":
        acts = res.meta["actions"]
        assert any("I" in a for a in acts[0]) and any("W" in a for a in acts[0])


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h1-opcut", "zb-h1-empty-stage"])
def test_gpt2_four_ranks(four_ranks, ref_gpt2, name):
    res = four_ranks[name]
    _assert_same_training(res, ref_gpt2)
    if name == "zb-h1-opcut":
        assert any(a.startswith("1I") for a in res.meta["actions"][1])
        return
    if name == "zb-h1-empty-stage":
        assert res.meta["stage_params"][1] == [] and res.meta["relayed"][1]
        return
    # received activations' buffers are reused across micro-batches: a middle stage holds one buffer
    # per micro-batch in flight, not one per micro-batch (torch's default); the last stage keeps its
    # own (its outputs, returned by step(), may be views of what it received)
    rb = res.meta["recv_buffers"]
    assert rb[0]["fwd"] == 0 and rb[3]["bwd"] == 0 and rb[3]["fwd"] == MICROBATCHES, rb
    if name == "1f1b":  # in flight at stage s of 4: 4 - s micro-batches, plus the receive posted early: what
        # the memory model counts (fxpipe.memory.MemoryModel.comm_buffer_factors)
        from fxpipe.memory import MemoryModel

        counted = MemoryModel().comm_buffer_factors(4, MICROBATCHES, "training")[0]
        assert [rb[s]["fwd"] for s in (1, 2)] == [int(counted[1]), int(counted[2])] == [4, 3], rb
    # tied embedding / LM head held by the first and the last stage, gradients summed
    assert res.meta["shared_params"] == {"m.transformer.wte.weight": [0, 3]}
    acts = res.meta["actions"]
    if name == "zb-h1":  # split backward really ran on the middle stages
        assert any(a.startswith("1I") for a in acts[1]) and any(a.startswith("2W") for a in acts[2])
    else:
        assert not any("I" in a or "W" in a for r in acts for a in acts[r])


def test_t5_relay_four_ranks(four_ranks, ref_t5):
    res = four_ranks["t5-zb-h1"]
    _assert_same_training(res, ref_t5)
    assert res.meta["relayed"][2], "the encoder output must be relayed through stage 2"
    # stages whose parameters torch's split backward cannot reach fall back to full backward
    acts = res.meta["actions"]
    assert any(a.startswith("1B") for a in acts[1])
    assert any(a.startswith("0I") for a in acts[0])
    # stage 1 (decoder embedding) and stage 2 (relative position bias sent on) are the blind ones
    # (tests/test_codegen_split.py::test_split_backward_blind_parameters_detected); the others split
    assert res.meta["fused_full_backward"] == {0: False, 1: True, 2: True, 3: False}, res.meta["fused_full_backward"]


def test_worker_error_is_reported():
    """A bad stage map fails in the workers; the error (not a hang) reaches the caller."""
    with pytest.raises(RuntimeError, match="placeholder 'x' must be on stage 0"):
        spawn_train(
            make_mlp, {"x": 1}, orders_1f1b(2, MICROBATCHES), world_size=2, num_microbatches=MICROBATCHES,
            make_batch=make_batch_mlp, steps=1, loss="mse", timeout_s=200,
        )


def test_rendezvous_is_a_file_of_the_launch_and_environment_untouched(monkeypatch):
    """The ranks meet in a file store of the launch's own folder, never on a port chosen ahead (two launches
    at once could pick the same port and one's ranks join the other's store: a CI run hung 600 s so), and
    the rendezvous address travels in the worker config, not in MASTER_ADDR / MASTER_PORT."""
    import os

    from fxpipe import launcher

    seen: list[dict] = []
    real = launcher._spawn_and_wait

    def spy(spec, *a, **kw):
        seen.append(dict(spec))
        return real(spec, *a, **kw)

    monkeypatch.setattr(launcher, "_spawn_and_wait", spy)
    monkeypatch.setattr(launcher, "free_port", lambda: pytest.fail("launch chose a port"))
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    stage_of = functools.partial(stage_of_by_fraction, num_stages=2)
    res = spawn_train(make_mlp, stage_of, orders_1f1b(2, MICROBATCHES), world_size=2, num_microbatches=MICROBATCHES,
                      make_batch=make_batch_mlp, steps=1, loss="mse", timeout_s=200)
    assert len(seen) == 1
    init = seen[0]["init_method"]
    assert init.startswith("file://" + os.path.abspath(seen[0]["out_dir"]) + os.sep + "rendezvous-")
    assert {k: os.environ.get(k) for k in env} == env
    ref = reference_train(make_mlp, make_batch_mlp, num_microbatches=MICROBATCHES, steps=1, loss="mse")
    assert res.losses == pytest.approx(ref.losses, rel=RTOL)


def test_failing_run_is_recorded_and_the_others_go_on():
    """on_error="record": a run that fails becomes a RunError; the workers restart with the next run."""
    from fxpipe.codegen.launch import RunError

    good = dict(make_model=make_mlp, stage_of=functools.partial(stage_of_by_fraction, num_stages=2), orders=orders_1f1b(2, MICROBATCHES),
                num_microbatches=MICROBATCHES, make_batch=make_batch_mlp, steps=1, loss="mse")
    bad = {**good, "stage_of": {"x": 1}}
    res = spawn_train_many([good, bad, good], world_size=2, on_error="record", run_timeout_s=200)
    assert isinstance(res[0], TrainResult) and isinstance(res[2], TrainResult)
    assert isinstance(res[1], RunError) and "placeholder 'x' must be on stage 0" in res[1].message
    assert res[0].losses == res[2].losses
