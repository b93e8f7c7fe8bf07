"""Contract 2 reference objective: hand-computed examples and invariants."""

import pytest

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition.objective import Partition, block_costs, io_bytes, quotient_order, validate_partition

from naive import brute_force_partition


@pytest.fixture
def diamond():
    # 0 -> 1, 0 -> 2, 1 -> 3, 2 -> 3, 0 -> 3
    return OpGraph.from_arrays(
        t_fwd_s=[1, 2, 3, 1], t_bwd_input_s=[1, 1, 1, 1], t_bwd_weight_s=[0, 1, 0, 0],
        size_out_bytes=[2, 4, 8, 16], edges=[[0, 1], [0, 2], [1, 3], [2, 3], [0, 3]], bandwidth_bytes_per_s=2.0,
    )


def test_dag_io_counts_each_tensor_once_per_block(diamond):
    in_b, out_b = io_bytes(diamond, [0, 1, 1, 1], 2, "dag")
    # tensor 0 has three consumers in block 1: counted once
    assert in_b.tolist() == [0, 2] and out_b.tolist() == [2, 0]
    assert block_costs(diamond, [0, 1, 1, 1], 2).tolist() == [1 + 1, 6 + 1]


def test_relay_counts_pass_through(diamond):
    a = [0, 1, 1, 2]
    in_b, out_b = io_bytes(diamond, a, 3, "relay")
    # tensor 0 (2 bytes) produced in 0, last consumed in 2: out of 0 and 1, in of 1 and 2
    assert out_b.tolist() == [2, 2 + 4 + 8, 0]
    assert in_b.tolist() == [0, 2, 2 + 4 + 8]
    dag_in, dag_out = io_bytes(diamond, a, 3, "dag")
    assert dag_out.tolist() == [2, 12, 0] and dag_in.tolist() == [0, 2, 14]


def test_training_doubles_io_and_adds_backward(diamond):
    c = block_costs(diamond, [0, 0, 1, 1], 2, "training", "dag")
    # block 0: work (1+1) + (2+1+1) = 6, out tensors 0 and 1 = 6 bytes -> 3 s, doubled = 6
    assert c[0] == pytest.approx(6 + 6)
    # block 1: work (3+1) + (1+1) = 6, in tensors 0, 1 = 6 bytes -> 3 s doubled
    assert c[1] == pytest.approx(6 + 6)


def test_relay_rejects_backward_edges(diamond):
    with pytest.raises(InputError, match="earlier block"):
        io_bytes(diamond, [1, 0, 1, 1], 2, "relay")


def test_partition_renumbers_into_pipeline_order(diamond):
    p = Partition.from_assignment(diamond, [2, 0, 0, 1], 3)
    assert p.assignment.tolist() == [0, 1, 1, 2]
    validate_partition(diamond, p)
    assert quotient_order(diamond, [0, 1, 0, 0], 2) is None
    with pytest.raises(InputError, match="cycle"):
        Partition.from_assignment(diamond, [0, 1, 0, 0], 2)


def test_validator_catches_tampering(diamond):
    p = Partition.from_assignment(diamond, [0, 0, 1, 1], 2)
    bad = Partition(k=2, assignment=p.assignment, block_costs=p.block_costs * 0.5, bottleneck=p.bottleneck)
    with pytest.raises(AssertionError):
        validate_partition(diamond, bad)


def test_brute_force_matches_hand_optimum(diamond):
    # every cut costs more io than it saves work: [0,0,1,1] gives (3 + 3, 4 + 3)
    value, assign = brute_force_partition(diamond, 2)
    assert value == pytest.approx(7.0)
    assert block_costs(diamond, assign, 2).max() == pytest.approx(value)
    one, _ = brute_force_partition(diamond, 1)
    assert one == pytest.approx(7.0)
