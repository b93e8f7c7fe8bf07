"""Soundness of the lower-bound hierarchy against brute force on tiny random DAGs.

Every bound must be <= the optimum of the Contract-2 objective (brute force over all
monotone assignments), ``exact`` must equal it when SCIP says optimal, and the hierarchy
must be ordered (simple <= bottleneck <= guess, every bound <= exact when exact is optimal).
"""

import itertools
import json

import numpy as np
import pytest

from fxpipe.errors import InfeasibleError
from fxpipe.ir import OpGraph
from fxpipe.memory import MemoryModel
from fxpipe.partition.bounds import compute_bounds
from fxpipe.partition.memory import PartitionMemory, stage_memory_bytes
from fxpipe.partition.objective import Partition, block_costs, io_bytes, validate_partition

from naive import brute_force_partition

RTOL = 1e-6
COMBOS = [(o, c) for o in ("inference", "training") for c in ("dag", "relay")]


def random_dag(seed: int, n: int | None = None, density: float = 0.35) -> OpGraph:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 9)) if n is None else n
    edges = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < density]
    # a few heavy tensors and a few free ones, so communication matters
    size = rng.choice([0.0, 1.0, 5.0, 20.0], size=n) * rng.uniform(0.5, 1.5, size=n)
    return OpGraph.from_arrays(
        t_fwd_s=rng.uniform(0.5, 10.0, n),
        t_bwd_input_s=rng.uniform(0.5, 10.0, n),
        t_bwd_weight_s=rng.uniform(0.0, 5.0, n),
        size_out_bytes=size,
        size_param_bytes=rng.uniform(1.0, 10.0, n),
        act_bytes=rng.uniform(0.0, 3.0, n),
        edges=edges,
        bandwidth_bytes_per_s=2.0,
        name=f"rand{seed}",
    )


def _le(a: float, b: float) -> bool:
    return a <= b * (1 + RTOL) + 1e-12


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [2, 3])
def test_bounds_below_brute_force_optimum(seed, k):
    g = random_dag(seed)
    for objective, comm in COMBOS:
        opt, _ = brute_force_partition(g, k, objective, comm)
        # guess before bottleneck: each method's own bound is checked, not one inherited
        # from the methods run before it (exact alone is checked below)
        rep = compute_bounds(
            g, k, objective=objective, comm=comm, methods=("simple", "guess", "lp", "bottleneck", "chain", "exact"),
            time_limit_s=20, workers=1, search_time_limit_s=0.2, stop_when_proven=False,
        )
        lb = {m: c.lower_bound for m, c in rep.certificates.items()}
        where = f"seed={seed} k={k} {objective}/{comm} opt={opt} bounds={lb}"
        for m, v in lb.items():
            assert _le(v, opt), f"{m} bound above the optimum: {where}"
        assert _le(lb["simple"], lb["bottleneck"]), where
        assert _le(lb["simple"], lb["lp"]), where
        if rep.certificates["bottleneck"].status == "optimal" and rep.certificates["guess"].status == "optimal":
            assert _le(lb["bottleneck"], lb["guess"]), where
        assert rep.certificates["exact"].status == "optimal", where
        assert lb["exact"] == pytest.approx(opt, rel=RTOL), where
        for m, v in lb.items():
            assert _le(v, lb["exact"]), f"{m} above exact: {where}"
        # the reported partition is a real, validated partition no better than the optimum
        validate_partition(g, rep.partition)
        assert rep.partition.bottleneck == pytest.approx(opt, rel=RTOL), where
        assert rep.ratio == pytest.approx(1.0, rel=RTOL)


def test_guess_in_worker_processes_matches_in_process():
    g = random_dag(7, n=8)
    a = compute_bounds(g, 3, methods=("guess",), time_limit_s=20, workers=2, search_time_limit_s=0.2)
    b = compute_bounds(g, 3, methods=("guess",), time_limit_s=20, workers=1, search_time_limit_s=0.2)
    assert a.certificates["guess"].lower_bound == pytest.approx(b.certificates["guess"].lower_bound, rel=1e-9)
    assert set(a.certificates["guess"].details["per_guess"]) == {"1", "2", "3"}


def _pm(cap: float) -> PartitionMemory:
    return PartitionMemory(MemoryModel(capacity_bytes=cap, reserved_fraction=0.0), num_microbatches=3, activation="1f1b")


def brute_force_with_memory(g: OpGraph, k: int, objective: str, comm: str, capacity: float, buffers: bool = True) -> float:
    """Best partition whose stages fit; ``buffers=False``: the MIPs' model (no receive buffers)."""
    best = np.inf
    pm = _pm(capacity)
    for assign in itertools.product(range(k), repeat=g.n):
        if any(assign[u] > assign[v] for u, v in g.edges.tolist()):
            continue
        p = Partition.from_assignment(g, np.array(assign), k, objective, comm)
        mem = stage_memory_bytes(g, p.assignment, k, objective, pm, comm)
        if not buffers:
            i, o = io_bytes(g, p.assignment, k, comm)
            mem = mem - 3 * i - (3 * o if objective == "training" else 0.0)
        if mem.max() <= capacity:
            best = min(best, p.bottleneck)
    return best


@pytest.mark.parametrize("objective", ["inference", "training"])
def test_memory_capacity_bounds_hold_for_feasible_partitions(objective):
    k = 3
    cap = None
    for seed in (3, 4, 5, 6, 7, 8):
        g = random_dag(seed, n=7)
        free_opt, free_assign = brute_force_partition(g, k, objective, "dag")
        free = Partition.from_assignment(g, free_assign, k, objective, "dag")
        # a capacity the unconstrained optimum violates, but that some partition meets
        need = stage_memory_bytes(g, free.assignment, k, objective, _pm(1.0), "dag").max()
        for frac in (0.9, 0.95, 0.98):
            c = need * frac
            if np.isfinite(brute_force_with_memory(g, k, objective, "dag", c)):
                cap = c
                break
        if cap is not None:
            break
    assert cap is not None
    opt = brute_force_with_memory(g, k, objective, "dag", cap)
    rep = compute_bounds(
        g, k, objective=objective, comm="dag", methods=("simple", "bottleneck", "guess", "exact"),
        time_limit_s=20, workers=1, memory=_pm(cap), search_time_limit_s=0.2, stop_when_proven=False,
    )
    for m, c in rep.certificates.items():
        assert _le(c.lower_bound, opt), (m, c.lower_bound, opt)
    assert rep.partition is not None
    assert stage_memory_bytes(g, rep.partition.assignment, k, objective, _pm(cap), "dag").max() <= cap * (1 + 1e-12)
    assert rep.capacity_model["kind"] == "fxpipe.memory" and rep.capacity_model["inflight"] == ([3, 2, 1] if objective == "training" else [1, 1, 1])
    json.dumps(rep.to_dict(), allow_nan=False)  # infeasible guesses (LB_j = inf) stay JSON-safe
    if objective == "inference":  # one micro-batch everywhere: the MIP is exact for its model (no receive buffers)
        mip_opt = brute_force_with_memory(g, k, objective, "dag", cap, buffers=False)
        assert rep.certificates["exact"].lower_bound == pytest.approx(mip_opt, rel=RTOL)


def test_infeasible_capacity_single_node_is_clear():
    g = random_dag(4, n=6)
    with pytest.raises(InfeasibleError, match="needs .* bytes but a device holds"):
        compute_bounds(g, 2, methods=("simple", "exact"), time_limit_s=5, memory=_pm(0.5))


def test_infeasible_capacity_found_by_the_mip_is_clear():
    # chain a -> b -> c, 6 bytes of state each, 2 devices of 10 bytes: totals fit, no partition does
    g = OpGraph.from_arrays(t_fwd_s=[1, 1, 1], size_out_bytes=[0, 0, 0], size_param_bytes=[6, 6, 6], edges=[[0, 1], [1, 2]],
                            meta={"param_dtype_bytes": 16.0})
    for methods in (("exact",), ("bottleneck", "guess", "exact")):
        with pytest.raises(InfeasibleError, match="no partition into 2 stages fits"):
            compute_bounds(g, 2, objective="training", methods=methods, time_limit_s=5, memory=_pm(10.0), workers=1,
                           search_time_limit_s=0.2)


def test_exact_incumbent_is_scored_by_the_reference_objective():
    g = random_dag(5, n=8)
    rep = compute_bounds(g, 3, methods=("exact",), time_limit_s=20, warm_start=np.zeros(g.n, dtype=np.int64))
    validate_partition(g, rep.partition)
    assert rep.partition.bottleneck == pytest.approx(block_costs(g, rep.partition.assignment, 3).max())
    assert rep.partition.bottleneck < block_costs(g, np.zeros(g.n, dtype=np.int64), 3).max()
    # exact alone (no earlier bound to start from) still proves the brute-force optimum
    opt, _ = brute_force_partition(g, 3)
    assert rep.certificates["exact"].details["start_lower_bound_s"] == 0.0
    assert rep.certificates["exact"].lower_bound == pytest.approx(opt, rel=RTOL)
    assert rep.partition.bottleneck == pytest.approx(opt, rel=RTOL)
