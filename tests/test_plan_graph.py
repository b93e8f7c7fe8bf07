"""plan_graph: the torch-free half of fxpipe.compile (partition + schedule of an OpGraph)."""

import pytest

from fxpipe.api import fill_empty_stages, plan_graph
from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition.objective import Partition, validate_partition
from fxpipe.schedule.validate import validate_schedule


def _chain(t_fwd, size=1.0, bw=1.0):
    n = len(t_fwd)
    ops = ["placeholder"] + ["call_function"] * (n - 2) + ["output"]
    return OpGraph.from_arrays(
        t_fwd_s=t_fwd, t_bwd_input_s=t_fwd, size_out_bytes=[size] * n, act_bytes=[1.0] * n,
        edges=[[i, i + 1] for i in range(n - 1)], ops=ops, bandwidth_bytes_per_s=bw,
    )


def test_dominant_op_leaves_stages_empty_but_plan_still_runs_on_k_ranks():
    # one op dominates and transfers are expensive: the optimum uses fewer than 3 stages
    g = _chain([0.0, 1.0, 100.0, 1.0, 1.0, 0.0], size=50.0)
    part, problem, sched, _ = plan_graph(g, devices=3, microbatches=2, time_limit_s=0.5)
    validate_partition(g, part)
    validate_schedule(problem, sched)
    a = part.assignment
    assert a[0] == 0 and a[-1] == 2, "inputs on stage 0, output on the last stage"
    assert part.meta["empty_stages"], "expected an empty relay stage"
    assert part.bottleneck >= part.meta["bottleneck_before_filling_s"]


def test_fill_empty_stages_single_block_moves_only_the_output():
    g = _chain([0.0, 1.0, 1.0, 0.0])
    p = Partition.from_assignment(g, [0, 0, 0, 0], 3, "training", "relay")
    q = fill_empty_stages(g, p)
    assert q.assignment.tolist() == [0, 0, 0, 2]
    assert q.meta["empty_stages"] == [1]
    validate_partition(g, q)
    assert fill_empty_stages(g, q) is q  # nothing left to fill


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(devices=0), "devices"), (dict(devices=7), "more than the 6 ops"), (dict(microbatches=0), "microbatches"),
     (dict(schedule="fast"), "schedule")],
)
def test_plan_graph_bad_arguments(kwargs, message):
    g = _chain([0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    with pytest.raises(InputError, match=message):
        plan_graph(g, **{"devices": 2, "microbatches": 2, **kwargs})
