"""The third round of real architectures (issue 30) and the mixed-dtype row under ``mesh="auto"``.

``fxpipe.testing.zoo``'s group ``"third"``: MobileBERT (its word embedding tied to the MLM decoder, used
as ``cat([decoder.weight.t(), dense.weight])``), BEiT (a relative position bias per layer: its index
tensor is built in ``forward``), data2vec-vision (4 layers sharing one relative position bias) and T5 as
transformers loads it in bfloat16 (the feed-forward output projections ``wo`` kept in float32,
``_keep_in_fp32_modules``), each planned by ``fxpipe.compile`` with its default schedule and trained on 2
local gloo ranks (data2vec-vision on 4 too), equal to single-process training.

The mixed-dtype row: the bf16 + fp32 models (``mixed_dtype``, ``t5_mixed``) planned with fxpipe's default
mesh (``mesh="auto"``: the search may choose FSDP2 data parallelism, which now wraps one unit per
parameter dtype) train like one process; at 2 devices the search picks ``dp_shard=2`` for
``mixed_dtype`` (the mesh that used to fail with "FSDP expects uniform original parameter dtype").
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from fxpipe.testing import zoo  # noqa: E402
from fxpipe.testing.matrix import run_matrix  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

THIRD = zoo.names(group="third")
MIXED = ("mixed_dtype", "t5_mixed")
SCHEDULE = "auto"


@functools.lru_cache(maxsize=None)
def _matrix(models: tuple, ranks: int, mesh: str):
    res = run_matrix(list(models), ranks=(ranks,), schedules=(SCHEDULE,), mesh=mesh)
    return {c.model: c for c in res.cells}


def _check(cell):
    assert cell.ok, f"{cell.model} {cell.ranks} ranks {cell.mesh}: {cell.error or cell.problems or cell.to_dict()}"


def test_third_round_is_in_the_zoo():
    assert {"mobilebert", "beit", "data2vec_vision", "t5_mixed"} <= set(THIRD)
    assert not set(THIRD) & (set(zoo.names(group="core")) | set(zoo.names(group="second")))


@pytest.mark.parametrize("model", THIRD)
def test_two_ranks_default_schedule_equals_single_process(model):
    _check(_matrix(tuple(THIRD), 2, "pipeline")[model])


def test_data2vec_vision_four_ranks_equals_single_process():
    _check(_matrix(("data2vec_vision",), 4, "pipeline")["data2vec_vision"])


@pytest.mark.parametrize("model", MIXED)
def test_mixed_dtype_models_on_the_default_mesh_equal_single_process(model):
    cells = _matrix(MIXED, 2, "auto")
    _check(cells[model])
    if model == "mixed_dtype":
        assert "dp_shard=2" in cells[model].mesh, cells[model].mesh  # the FSDP2 mesh that used to fail
