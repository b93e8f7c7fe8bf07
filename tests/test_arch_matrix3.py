"""The third round of real architectures (issue 30) and the mixed-dtype row of the matrix under ``mesh="auto"``.

``fxpipe.testing.zoo``'s group ``"third"``: MobileBERT (its word embedding tied to the MLM decoder, used
as ``cat([decoder.weight.t(), dense.weight])``; ``tests/test_training_checks.py`` trains it under ZB-H1 and
ZB-H2 with the tie across the ranks), BEiT (a relative position bias per layer whose index tensor is built
in ``forward``; ``tests/test_meta_build.py`` builds it on meta), data2vec-vision (4 layers sharing one
relative position bias; ``tests/test_runtime_fixes.py`` cuts its index construction) and T5 as
transformers loads it in bfloat16 (the feed-forward output projections ``wo`` kept in float32,
``_keep_in_fp32_modules``). ``python benchmarks/arch_matrix.py --group third`` trains them all.

The mixed-dtype row: the bf16 + fp32 models (``mixed_dtype``, a hand-written DAG, and ``t5_mixed``) planned
with fxpipe's default mesh (``mesh="auto"``: at 2 devices the search picks FSDP2 data parallelism,
``dp_shard=2``, the mesh that failed with "FSDP expects uniform original parameter dtype") train on 2
local gloo ranks like one process (issue 30 item 2: every stage is wrapped as one FSDP2 unit per
parameter dtype).

One SGD step: the gradients of a bf16 model depend on the order in which its micro-batches' gradients
are summed in bf16, and a bf16 weight update turns those 1-ulp differences into many ulps one step
later. Measured on ``t5_mixed`` (2 ranks, pipeline and ``dp_shard=2`` alike): step 1 within 1.1 ulps of
bf16 at each gradient's own scale (0.0048 of the largest gradient), step 2 up to 16 ulps; one process
that backpropagates its 4 micro-batches one at a time (in order, as a pipeline does) instead of in one
backward differs from itself by the same 0.0048 at step 1 and 0.026 at step 2 (what the pipeline
shows at step 2), so that is summation order, not fxpipe.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fxpipe.testing import zoo  # noqa: E402
from fxpipe.testing.matrix import run_matrix  # noqa: E402

MIXED = ("mixed_dtype", "t5_mixed")


def test_third_round_is_in_the_zoo():
    third = zoo.names(group="third")
    assert {"mobilebert", "beit", "data2vec_vision", "t5_mixed"} <= set(third)
    assert not set(third) & (set(zoo.names(group="core")) | set(zoo.names(group="second")))


@pytest.fixture(scope="module")
def mixed_row():
    res = run_matrix(list(MIXED), ranks=(2,), schedules=("auto",), mesh="auto", steps=1)
    return {c.model: c for c in res.cells}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", MIXED)
def test_mixed_dtype_models_on_the_default_mesh_equal_single_process(mixed_row, model):
    cell = mixed_row[model]
    assert cell.ok, f"{model} {cell.mesh}: {cell.error or cell.problems or cell.to_dict()}"
    assert "dp_shard" in cell.mesh or "dp_replicate" in cell.mesh, cell.mesh  # the search chose FSDP2 / DDP
