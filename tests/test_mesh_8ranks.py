"""Pipeline x data parallelism on 8 gloo ranks (issue 18's "one 8-rank case in CI").

A tiny GPT-2 (tied embedding on the first and last stage) as pp=2 x dp_shard=4 (FSDP2 over four
ranks, ZB-H1) and as pp=4 x dp_shard=2 (1F1B) trains to the losses, gradients and parameters of
one process on the same global batch of 8 micro-batches (2 or 4 per replica). Both runs share
one set of 8 worker processes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fxpipe  # noqa: E402
from fxpipe.cli.plan_cmd import HFFactory, _BatchFn  # noqa: E402
from fxpipe.codegen.compare import compare_training  # noqa: E402
from fxpipe.mesh import format_mesh  # noqa: E402
from fxpipe.plan.core import _PlanStageOf  # noqa: E402

GPT2 = {"n_layer": 3, "n_embd": 16, "n_head": 2, "vocab_size": 32, "n_positions": 16}
GLOBAL_MB = 8


@pytest.mark.slow
def test_two_meshes_of_8_ranks_match_single_process():
    from fxpipe.codegen.launch import reference_train, spawn_train_many

    fac = HFFactory("gpt2", GPT2, microbatches=GLOBAL_MB, microbatch_size=1, seq_len=4, seed=0)
    model, args, kwargs = fac.one_microbatch()
    runs, names = [], []
    for mesh, schedule in (({"pp": 2, "dp_shard": 4}, "zb-h1"), ({"pp": 4, "dp_shard": 2}, "1f1b")):
        plan = fxpipe.compile(model, args, kwargs, devices=8, microbatches=GLOBAL_MB, mesh=mesh, schedule=schedule,
                              time_limit_s=0.5, seed=0)
        assert plan.world_size == 8 and plan.microbatches == GLOBAL_MB // plan.dp
        names.append(f"{format_mesh(plan.mesh)} {schedule}")
        runs.append(dict(make_model=fac, stage_of=_PlanStageOf(plan.stage_of), orders=plan.orders(),
                         num_microbatches=plan.global_microbatches, make_batch=_BatchFn(fac), steps=2, lr=0.05,
                         mesh=plan.mesh, model_key="gpt2"))
    results = spawn_train_many(runs, world_size=8, timeout_s=900)
    ref = reference_train(fac, _BatchFn(fac), num_microbatches=GLOBAL_MB, steps=2, lr=0.05)
    assert ref.losses[1] != ref.losses[0]
    for res, what in zip(results, names):
        cmp = compare_training(res, ref)
        assert cmp.ok, f"{what}: {cmp}"
