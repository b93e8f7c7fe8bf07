"""The chain decomposition, the ``chain`` lower bound and the chain partition against brute force.

Each lemma of :mod:`fxpipe.partition.chain` is checked on its own on small random DAGs with
view-like zero-work nodes, zero sinks, model inputs and an ``output`` node:

* Lemmas L and S: the optimum over *canonical* partitions (lazy nodes with their earliest
  consumer, zero sinks with their latest producer) equals the unrestricted optimum;
* Lemma G: every ideal of the reduced core order is ``S_<j u J`` with J inside segment j;
* the enumerated points carry the exact work and cut of their ideals;
* the bound never exceeds the brute-force optimum; the chain partition is valid, never
  below the optimum, and proven optimal on chains.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition import chain as ch
from fxpipe.partition.objective import block_costs, validate_partition

from naive import brute_force_partition

RTOL = 1e-7


def _graph(seed: int, n: int, *, p_edge: float = 0.4, p_zero: float = 0.35, with_ops: bool = True) -> OpGraph:
    """Random DAG in id order with zero-work nodes (views), sometimes zero-size tensors."""
    rng = np.random.default_rng(seed)
    edges = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < p_edge]
    # keep it connected-ish: a chain backbone with probability 1/2
    if rng.random() < 0.5:
        edges += [(i, i + 1) for i in range(n - 1) if (i, i + 1) not in edges]
    zero = rng.random(n) < p_zero
    t_f = np.where(zero, 0.0, rng.uniform(0.5, 5.0, n))
    t_b = np.where(zero, 0.0, rng.uniform(0.0, 5.0, n))
    t_w = np.where(zero, 0.0, rng.uniform(0.0, 2.0, n))
    size = rng.choice([0.0, 1.0, 2.0, 4.0, 8.0], size=n)
    ops = None
    if with_ops:
        ops = ["call_function"] * n
        preds = {v for _, v in edges}
        succs = {u for u, _ in edges}
        if 0 not in preds:
            ops[0] = "placeholder"
            t_f[0] = t_b[0] = t_w[0] = 0.0
        sinks = [v for v in range(n) if v not in succs]
        if sinks and sinks[-1] != 0 and rng.random() < 0.7:
            ops[sinks[-1]] = "output"
            t_f[sinks[-1]] = t_b[sinks[-1]] = t_w[sinks[-1]] = 0.0
    return OpGraph.from_arrays(
        t_fwd_s=t_f, t_bwd_input_s=t_b, t_bwd_weight_s=t_w, size_out_bytes=size, edges=edges,
        bandwidth_bytes_per_s=float(rng.choice([1.0, 4.0])), ops=ops, name=f"chain{seed}",
    )


def _monotone_assignments(g: OpGraph, k: int):
    edges = g.edges.tolist()
    for a in itertools.product(range(k), repeat=g.n):
        if all(a[u] <= a[v] for u, v in edges):
            yield np.array(a, dtype=np.int64)


def _is_canonical(g: OpGraph, dec: ch.ChainDecomposition, a: np.ndarray) -> bool:
    alive = dec.kind != ch.KIND_DETACHED
    for v in range(g.n):
        if dec.kind[v] == ch.KIND_LAZY:
            succ = g.successors(v)
            if a[v] != a[succ[alive[succ]]].min():
                return False
        elif dec.kind[v] == ch.KIND_SINK:
            pred = g.predecessors(v)
            if pred.size and a[v] != a[pred].max():
                return False
    return True


graph_params = st.tuples(st.integers(0, 10**6), st.integers(3, 7), st.sampled_from(["inference", "training"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_params, st.integers(2, 3))
def test_canonical_partitions_keep_the_optimum(params, k):
    seed, n, objective = params
    g = _graph(seed, n, with_ops=False)  # no output node: nothing detached, Lemmas L and S alone
    dec = ch.decompose(g, objective)
    assert not (dec.kind == ch.KIND_DETACHED).any()
    best_all = best_canon = math.inf
    for a in _monotone_assignments(g, k):
        c = float(block_costs(g, a, k, objective, "relay").max())
        best_all = min(best_all, c)
        if _is_canonical(g, dec, a):
            best_canon = min(best_canon, c)
    assert best_canon == pytest.approx(best_all, rel=1e-12), (seed, n, objective, dec.kind.tolist())


def _reduced_ideals(dec: ch.ChainDecomposition, g: OpGraph):
    """Every ideal of the reduced core order (as position sets), by brute force."""
    core, rpred = ch._reduced_core(g, dec.kind, dec.topo)
    m = core.shape[0]
    for bits in range(1 << m):
        if all(((bits >> u) & 1) for v in range(m) if (bits >> v) & 1 for u in rpred[v]):
            yield {p for p in range(m) if (bits >> p) & 1}


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(3, 11))
def test_every_ideal_splits_at_most_one_segment(seed, n):
    g = _graph(seed, n, p_edge=0.3)
    dec = ch.decompose(g, "training")
    S = dec.num_segments
    segs = [set(range(int(dec.seg_ptr[j]), int(dec.seg_ptr[j + 1]))) for j in range(S)]
    for ideal in _reduced_ideals(dec, g):
        touched = [j for j in range(S) if segs[j] & ideal and not segs[j] <= ideal]
        full = [j for j in range(S) if segs[j] <= ideal]
        assert len(touched) <= 1
        # full segments form a prefix, the touched one (if any) comes right after it
        assert full == list(range(len(full)))
        if touched:
            assert touched[0] == len(full)
        elif len(full) < S:
            assert not any(segs[j] & ideal for j in range(len(full), S))


def _canonical_ideal(g: OpGraph, dec: ch.ChainDecomposition, core_in: set[int]) -> np.ndarray:
    mem = np.zeros(g.n, dtype=bool)
    mem[dec.core[sorted(core_in)]] = True
    alive = dec.kind != ch.KIND_DETACHED
    for v in dec.topo[::-1].tolist():
        if dec.kind[v] == ch.KIND_LAZY:
            succ = g.successors(v)
            mem[v] = bool(mem[succ[alive[succ]]].any())
    for v in dec.topo.tolist():
        if dec.kind[v] == ch.KIND_SINK:
            mem[v] = bool(mem[g.predecessors(v)].all())
    return mem


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(3, 10), st.sampled_from(["inference", "training"]))
def test_points_carry_the_work_and_cut_of_their_ideal(seed, n, objective):
    g = _graph(seed, n, p_edge=0.3)
    dec = ch.decompose(g, objective)
    alive = dec.kind != ch.KIND_DETACHED
    work = g.work_s(objective)
    for j in range(dec.num_segments):
        if dec.masks[j] is None:
            continue
        lo = int(dec.seg_ptr[j])
        for mask, w, cut in zip(dec.masks[j].tolist(), dec.point_work_s[j], dec.point_cut_bytes[j]):
            core_in = set(range(lo)) | {lo + b for b in range(63) if (mask >> b) & 1}
            mem = _canonical_ideal(g, dec, core_in)
            want_w = float(work[mem & alive].sum())
            want_c = 0.0
            for u in np.flatnonzero(mem & alive).tolist():
                succ = g.successors(u)
                succ = succ[alive[succ]]
                if succ.size and not mem[succ].all():
                    want_c += float(g.size_out_bytes[u])
            assert w == pytest.approx(want_w, rel=1e-12, abs=1e-12)
            assert cut == pytest.approx(want_c, rel=1e-12, abs=1e-12)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_params, st.integers(1, 4))
def test_bound_below_optimum_and_partition_valid(params, k):
    seed, n, objective = params
    g = _graph(seed, n)
    opt, _ = brute_force_partition(g, k, objective, "relay")
    res = ch.solve_chain(g, k, objective, "relay")
    assert res.lower_bound_s <= opt * (1 + RTOL) + 1e-12, (res.lower_bound_s, opt)
    p = res.partition
    if p is not None:
        validate_partition(g, p)
        assert p.bottleneck >= opt * (1 - RTOL) - 1e-12
        assert res.lower_bound_s <= p.bottleneck * (1 + RTOL) + 1e-12
        ph = [i for i, op in enumerate(g.ops) if op == "placeholder"]
        out = [i for i, op in enumerate(g.ops) if op == "output"]
        if ph:
            assert p.assignment[ph].max() == 0
        if out:
            assert p.assignment[out].min() == p.assignment.max()


def _path(seed: int, n: int) -> OpGraph:
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.5, 3.0, n)
    t[0] = 0.0
    return OpGraph.from_arrays(
        t_fwd_s=t, size_out_bytes=rng.uniform(0.0, 2.0, n), edges=[(i, i + 1) for i in range(n - 1)],
        ops=["placeholder"] + ["call_function"] * (n - 1), bandwidth_bytes_per_s=2.0,
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [2, 3, 4])
def test_chain_is_exact_on_paths(seed, k):
    g = _path(seed, 8)
    opt, _ = brute_force_partition(g, k, "inference", "relay")
    res = ch.solve_chain(g, k, "inference", "relay")
    assert res.lower_bound_s == pytest.approx(opt, rel=1e-8)
    assert res.partition.bottleneck == pytest.approx(opt, rel=1e-8)


def test_layered_model_is_proven_optimal_and_uses_every_stage():
    """A transformer-like chain of identical blocks (two parallel branches per block, a
    broadcast tensor read by every block): bound = partition, k stages all with work."""
    L, k = 12, 5
    t, size, edges, ops = [0.0, 0.1], [1.0, 3.0], [], ["placeholder", "call_function"]  # input x, a mask
    edges.append((0, 1))
    prev = 0
    for _ in range(L):
        base = len(t)
        # a (view of prev) -> b1, b2 (parallel) -> add (gate)
        t += [0.0, 1.0, 1.5, 0.2]
        size += [1.0, 2.0, 2.0, 1.0]
        ops += ["call_function"] * 4
        edges += [(prev, base), (base, base + 1), (base, base + 2), (1, base + 1), (base + 1, base + 3), (base + 2, base + 3)]
        prev = base + 3
    t.append(0.0)
    size.append(0.0)
    ops.append("output")
    edges.append((prev, len(t) - 1))
    g = OpGraph.from_arrays(t_fwd_s=t, size_out_bytes=size, edges=edges, ops=ops, bandwidth_bytes_per_s=4.0)
    res = ch.solve_chain(g, k, "inference", "relay")
    p = res.partition
    validate_partition(g, p)
    assert res.lower_bound_s == pytest.approx(p.bottleneck, rel=1e-8)
    work = np.bincount(p.assignment, weights=g.t_fwd_s, minlength=k)
    assert (work > 0).all()
    summary = res.details["decomposition"]
    assert summary["segments"] >= L and summary["lazy"] >= L


def test_dag_communication_is_refused_clearly():
    g = _path(0, 5)
    with pytest.raises(InputError, match="relay"):
        ch.solve_chain(g, 2, "inference", "dag")
    with pytest.raises(InputError, match="k must be"):
        ch.solve_chain(g, 0, "inference", "relay")


@pytest.mark.parametrize("max_binned", [0, 10**6])
def test_unenumerated_segments_use_bins_and_stay_sound(max_binned):
    """With a tiny ideal cap every non-trivial segment becomes bins (carrying the mandatory
    cut, or each bin's least cut when all its ideals are enumerated): still a valid bound."""
    tight = 0
    for seed in range(8):
        g = _graph(seed, 7, p_edge=0.2, p_zero=0.2)
        dec = ch.decompose(g, "training", max_ideals=1, max_binned=max_binned)
        if max_binned:
            assert set(dec.binned) == {j for j in range(dec.num_segments) if not dec.complete[j] and dec.masks[j] is not None}
        res = ch.solve_chain(g, 3, "training", "relay", decomposition=dec)
        opt, _ = brute_force_partition(g, 3, "training", "relay")
        assert res.lower_bound_s <= opt * (1 + RTOL) + 1e-12
        tight += res.lower_bound_s >= opt * (1 - 1e-6)
        if res.partition is not None:
            validate_partition(g, res.partition)
            assert res.partition.bottleneck >= opt * (1 - RTOL) - 1e-12
    if max_binned:
        assert tight >= 2  # the binned summary is often exact on these graphs


def test_chain_certificate_in_compute_bounds_and_cli(tmp_path, capsys):
    import json

    from fxpipe.cli import main
    from fxpipe.partition.bounds import compute_bounds, read_certificate, write_certificate

    g = _path(1, 12)
    rep = compute_bounds(g, 3, objective="inference", comm="relay", methods=("simple", "chain", "bottleneck", "exact"),
                         time_limit_s=10, workers=1, search_time_limit_s=0.5)
    opt, _ = brute_force_partition(g, 3, "inference", "relay")
    c = rep.certificates["chain"]
    assert c.status == "optimal" and c.lower_bound <= opt * (1 + RTOL)
    assert c.lower_bound == pytest.approx(opt, rel=1e-8)
    assert "Lemmas" in c.details["proof"]
    # every MIP after the chain is skipped: the partition is already proven optimal
    assert rep.certificates["exact"].status == "skipped" and rep.ratio == pytest.approx(1.0, rel=1e-6)
    back = read_certificate(write_certificate(tmp_path / "c.json", rep, g))
    assert back["certificates"]["chain"].lower_bound == c.lower_bound
    # dag: not applicable, Lemma 3.3 reported
    rep = compute_bounds(g, 3, objective="inference", comm="dag", methods=("simple", "chain"), time_limit_s=5, search_time_limit_s=0.2)
    assert rep.certificates["chain"].status == "not_applicable"
    assert rep.certificates["chain"].lower_bound == rep.certificates["simple"].lower_bound
    # the CLI
    path = tmp_path / "g.json"
    g.save(path)
    assert main(["bounds", str(path), "-k", "3", "--comm", "relay", "--methods", "simple,chain", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["lower_bounds"]) == {"simple", "chain"} and doc["ratio"] == pytest.approx(1.0, rel=1e-6)
