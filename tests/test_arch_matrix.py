"""The real-architecture matrix (issue 8, item 4): every zoo model, planned by ``fxpipe.compile``,
trained on 2 and 4 local gloo ranks with every schedule (GPipe, 1F1B, ZB-H1, ZB-H2, the
schedule MILP's), equals single-process training: losses within rtol 1e-4; gradients,
parameters after the steps and buffers within 1e-5 of the largest reference value.

One spawned job per pipeline size runs all models and schedules (each worker captures a model
once and reuses it for every schedule); ``python benchmarks/arch_matrix.py`` prints the table.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fxpipe.testing import zoo  # noqa: E402
from fxpipe.testing.matrix import SCHEDULES, run_matrix  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_zoo_covers_the_families():
    names = zoo.names(group="core")
    hf = [n for n in names if zoo.get(n).family != "dag"]
    assert len(hf) >= 20
    for fam in zoo.FAMILIES:
        assert zoo.names(fam), f"no {fam} model in the zoo"
    assert zoo.names() == zoo.names(group="core") + zoo.names(group="second") + zoo.names(group="third")


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_architecture_and_schedule_equals_single_process_training(ranks):
    res = run_matrix(zoo.names(group="core"), ranks=(ranks,))  # the second round: tests/test_arch_matrix2.py
    assert len(res.cells) == len(zoo.names(group="core")) * len(SCHEDULES)
    failures = [f"{c.model} {c.schedule}: {c.error or c.problems or c.to_dict()}" for c in res.failures()]
    assert not failures, "\n\n".join(failures)
    # the hard cases were really exercised
    cells = {(c.model, c.schedule): c for c in res.cells}
    # Whether a zoo model gets a split-backward-blind stage (T5, CLIP, ...) depends on where its
    # time-limited partition cuts, so it is not asserted here (a CI run once cut none at 4 ranks):
    # tests/test_codegen_pipeline.py::test_t5_relay_four_ranks trains a pinned blind cut, and
    # tests/test_codegen_split.py checks the detection itself
    assert cells[("batchnorm", "zb-h1")].max_buffer_rel_diff >= 0.0
