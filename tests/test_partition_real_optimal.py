"""On real layer graphs (dnn-partitioning bert24, gnmt, resnet50; inference) the partitioner
reaches the optimum that the exact MIP proves, for k = 2, 4, 8."""

from pathlib import Path

import pytest

from fxpipe.partition.bounds import compute_bounds
from fxpipe.partition.loaders import load_dnn_partitioning
from fxpipe.partition.objective import validate_partition
from fxpipe.partition.search import partition

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "dnn-partitioning" / "throughput-inputs" / "LayerGraphs"


@pytest.mark.skipif(not DATA.exists(), reason="../shared/data is not beside the checkout")
@pytest.mark.parametrize("name", ["bert24", "gnmt", "resnet50"])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_partition_reaches_proven_optimum(name, k):
    graph = load_dnn_partitioning(DATA / f"{name}_inference.json")
    part = partition(graph, k, objective="inference", comm="dag", time_limit_s=10.0, seed=0)
    validate_partition(graph, part)
    report = compute_bounds(graph, k, objective="inference", comm="dag", methods=("exact",), time_limit_s=120.0)
    cert = report.to_dict()["solver"]["certificates"]["exact"]
    assert cert["status"] == "optimal"
    lower = report.to_dict()["lower_bounds"]["exact"]
    assert part.bottleneck <= lower * (1 + 1e-9), (part.bottleneck, lower)
