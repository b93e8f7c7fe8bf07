"""The chain DP's shortcuts against the plain constructions they replace (kept here as oracles).

* :func:`fxpipe.partition.chain._points` (what does not depend on k built once, popcounts
  vectorised) equals the per-segment construction with Python popcounts, array for array;
* the staircase DP (:func:`~fxpipe.partition.chain._within_transitions`) answers "at most k
  transitions?" as the Fenwick DP over every point does, and the bracketed bisection
  (:func:`~fxpipe.partition.chain._relaxed_min_bottleneck`) returns the plain bisection's
  ``(lo, hi, iterations)`` bit for bit;
* the exact DP with its same-segment prune gives the same fewest transitions and parents;
* a decomposition that reuses a structure (:func:`~fxpipe.partition.chain.cached_decomposition`)
  equals a fresh :func:`~fxpipe.partition.chain.decompose` field for field.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.partition import chain as ch

from test_partition_chain import _graph

# --------------------------------------------------------------------------------------
# the plain constructions (fxpipe.partition.chain before the shortcuts), oracles only
# --------------------------------------------------------------------------------------


def _points_plain(dec: ch.ChainDecomposition, k: int, *, exact_only: bool) -> ch._Points:
    S = dec.num_segments
    total = float(dec.seg_work_s.sum())
    width = total / (max(k, 1) * ch.BINS_PER_BLOCK) if total > 0 else 0.0
    chunks: list[tuple] = []

    def add(j, lo, hi, cut, mask, flag, exact):
        chunks.append((j, lo, hi, cut, mask, flag, exact))

    w_before = 0.0
    for j in range(S):
        ms = dec.masks[j]
        w_after = w_before + float(dec.seg_work_s[j])
        if ms is not None and (dec.complete[j] or exact_only):
            pw, pc, pf = dec.point_work_s[j], dec.point_cut_bytes[j], dec.point_flag[j]
            size = np.array([bin(int(x) & 0xFFFFFFFFFFFFFFFF).count("1") for x in ms.tolist()], dtype=np.int64)
            order = np.lexsort((size, pw))
            if j > 0:
                order = order[size[order] != 0]
            n = order.shape[0]
            add(np.full(n, j), pw[order], pw[order], pc[order], ms[order], pf[order], np.ones(n, dtype=bool))
        else:
            if j == 0:
                add(0, 0.0, 0.0, 0.0, 0, False, True)
            if not exact_only and width > 0 and j in dec.binned:
                bw, bc = dec.binned[j]
                idx = np.minimum(((bw - w_before) / width).astype(np.int64), 4 * ch.BINS_PER_BLOCK * max(k, 1))
                starts = np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]])
                ends = np.r_[starts[1:], bw.shape[0]]
                cmin = np.minimum.reduceat(bc, starts)
                n = starts.shape[0]
                add(np.full(n, j), bw[starts], bw[ends - 1], cmin, np.full(n, -1), np.zeros(n, dtype=bool),
                    np.zeros(n, dtype=bool))
            elif not exact_only and width > 0:
                nb = int(math.ceil((w_after - w_before) / width)) if w_after > w_before else 1
                nb = max(1, min(nb, 4 * ch.BINS_PER_BLOCK))
                edges = np.linspace(w_before, w_after, nb + 1)
                add(np.full(nb, j), edges[:-1], edges[1:], np.full(nb, float(dec.mandatory_cut_bytes[j])),
                    np.full(nb, -1), np.zeros(nb, dtype=bool), np.zeros(nb, dtype=bool))
            add(j, w_after, w_after, float(dec.gate_cut_bytes[j]), -1, dec.inputs_entry <= j, True)
        w_before = w_after
    dtypes = (np.int64, np.float64, np.float64, np.float64, np.int64, np.bool_, np.bool_)
    cols = [np.concatenate([np.atleast_1d(np.asarray(c[i], dtype=dt)) for c in chunks]) if chunks
            else np.zeros(0, dtype=dt) for i, dt in enumerate(dtypes)]
    return ch._Points(*cols)


def _min_transitions_plain(wlo, whi, io, rank, keys_desc, start, end, T, slack):
    """The Fenwick DP over every point (fewest transitions, cost <= T)."""
    P = wlo.shape[0]
    tree_v = np.full(P, np.inf)
    tree_i = np.full(P, -1, dtype=np.int64)
    f = np.full(P, np.inf)
    f[start] = 0.0
    ch._fen_update(tree_v, tree_i, rank[start], 0.0, start)
    for q in range(start + 1, end + 1):
        thr = wlo[q] + io[q] - T - slack
        cnt = ch._count_ge(keys_desc, thr)
        best, _bi = ch._fen_query(tree_v, tree_i, cnt)
        if best < np.inf:
            f[q] = best + 1.0
            ch._fen_update(tree_v, tree_i, rank[q], f[q], q)
    return f[end]


def _bisection_plain(pts, io_scale, k, rel_tol=1e-10, out_scale=None):
    io_in = pts.cut * io_scale
    io_out = io_in if out_scale is None else pts.cut * out_scale
    rank, keys_desc = ch._keys(pts.whi, io_in)
    end = pts.seg.shape[0] - 1
    hi = float(pts.whi[end] - pts.wlo[0]) + float(io_in.max(initial=0.0)) + float(io_out.max(initial=0.0)) + 1e-300
    lo = 0.0
    it = 0
    while hi - lo > rel_tol * hi and it < 200:
        mid = 0.5 * (lo + hi)
        f = _min_transitions_plain(pts.wlo, pts.whi, io_out, rank, keys_desc, 0, end, mid, 1e-9 * mid)
        if f <= k:
            hi = mid
        else:
            lo = mid
        it += 1
    return lo, hi, it


def _exact_dp_plain(seg, w, io, masks, flag, rank, keys_desc, seg_first, T, slack):
    """The exact DP without the same-segment prune."""
    P = w.shape[0]
    tree_v = np.full(P, np.inf)
    tree_i = np.full(P, -1, dtype=np.int64)
    f = np.full(P, np.inf)
    parent = np.full(P, -1, dtype=np.int64)
    f[0] = 0.0
    ptr = 1
    for q in range(1, P):
        while ptr < q and seg[ptr] < seg[q] and w[ptr] < w[q]:
            if f[ptr] < np.inf:
                ch._fen_update(tree_v, tree_i, rank[ptr], f[ptr], ptr)
            ptr += 1
        thr = w[q] + io[q] - T - slack
        best = np.inf
        bp = -1
        if flag[q] and w[q] > w[0] and (w[q] - w[0]) + io[0] + io[q] <= T + slack:
            best = 1.0
            bp = 0
        v, i = ch._fen_query(tree_v, tree_i, ch._count_ge(keys_desc, thr))
        if v + 1.0 < best:
            best = v + 1.0
            bp = i
        for p in range(seg_first[seg[q]], q):
            if p == 0 or f[p] + 1.0 >= best:
                continue
            if w[p] >= w[q] or (masks[p] & masks[q]) != masks[p] or masks[p] == masks[q]:
                continue
            if (w[q] - w[p]) + io[p] + io[q] <= T + slack:
                best = f[p] + 1.0
                bp = p
        f[q] = best
        parent[q] = bp
    return f, parent


def _seg_first_plain(seg: np.ndarray, S: int) -> np.ndarray:
    out = np.zeros(S + 1, dtype=np.int64)
    for j in range(S - 1, -1, -1):
        idx = np.flatnonzero(seg == j)
        out[j] = idx[0] if idx.size else out[j + 1]
    return out


# --------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------

graphs = st.tuples(st.integers(0, 10**6), st.integers(3, 12), st.sampled_from(["inference", "training"]),
                   st.sampled_from([ch.MAX_IDEALS, 2, 1]), st.sampled_from([0, 10**6]))


def _decomposition(params) -> tuple:
    seed, n, objective, max_ideals, max_binned = params
    g = _graph(seed, n, p_edge=0.3)
    return g, ch.decompose(g, objective, max_ideals=max_ideals, max_binned=max_binned)


def _assert_points_equal(got: ch._Points, want: ch._Points) -> None:
    for name in ch._POINT_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs, st.lists(st.integers(1, 6), min_size=1, max_size=3))
def test_points_equal_the_plain_construction(params, ks):
    """For several k on one decomposition (the k-free part is built once, then reused)."""
    _, dec = _decomposition(params)
    for k in ks:
        for exact_only in (False, True):
            _assert_points_equal(ch._points(dec, k, exact_only=exact_only), _points_plain(dec, k, exact_only=exact_only))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs, st.integers(1, 6), st.sampled_from([(None, None), (0.5, 0.5), (0.0, 0.0), (0.1, 2.0), (3.0, 0.0)]))
def test_bisection_equals_the_plain_bisection(params, k, scales):
    """Same lower bound, feasible threshold and iterations, bit for bit (io scales: the graph's
    bandwidth, equal, zero and unequal weights of the two boundaries)."""
    g, dec = _decomposition(params)
    pts = ch._points(dec, k, exact_only=False)
    io_scale, out_scale = scales
    if io_scale is None:
        io_scale = 1.0 / g.bandwidth_bytes_per_s
    got = ch._relaxed_min_bottleneck(pts, io_scale, k, out_scale=out_scale)
    assert got[:3] == _bisection_plain(pts, io_scale, k, out_scale=out_scale)


point_sets = st.tuples(st.integers(0, 10**6), st.integers(2, 120), st.integers(1, 10), st.booleans())


@settings(max_examples=150, deadline=None)
@given(point_sets)
def test_staircase_dp_answers_as_the_fenwick_dp(params):
    """Random chains of points (keys not monotone, io large or nil) at thresholds around the answer:
    the same "at most k transitions" answer, and a feasible path's largest cost is within T + slack."""
    seed, P, k, with_io = params
    rng = np.random.default_rng(seed)
    wlo = np.cumsum(rng.uniform(0.0, 1.0, P) * (rng.random(P) < 0.8))
    wlo[0] = 0.0
    whi = wlo + rng.uniform(0.0, 0.3, P) * (rng.random(P) < 0.3)
    io_in = rng.uniform(0.0, 2.0, P) if with_io else np.zeros(P)
    io_out = rng.uniform(0.0, 2.0, P) if with_io else np.zeros(P)
    rank, keys_desc = ch._keys(whi, io_in)
    key = whi - io_in
    end = P - 1
    for T in np.concatenate([rng.uniform(0.0, 1.5, 8) * (wlo[end] / k + 2.0), [0.0, 1e-9]]):
        want = _min_transitions_plain(wlo, whi, io_out, rank, keys_desc, 0, end, T, 1e-9 * T) <= k
        ok, worst = ch._within_transitions(wlo, key, io_out, end, k, T, 1e-9 * T)
        assert ok == want, (T, k)
        if ok:
            assert worst <= T + 1e-9 * T + 1e-12 * max(1.0, wlo[end])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.integers(3, 12), st.sampled_from([0.15, 0.3]), st.integers(1, 5))
def test_exact_dp_equals_the_unpruned_one(seed, n, p_edge, k):
    """Same fewest transitions and parents at thresholds from a fifth of the work per stage upwards
    (small thresholds need transitions inside segments); the first point of each segment by
    searchsorted equals the backwards scan."""
    g = _graph(seed, n, p_edge=p_edge)
    dec = ch.decompose(g, "training")
    ex = ch._points(dec, k, exact_only=True)
    io = ex.cut * (2.0 / g.bandwidth_bytes_per_s)
    rank, keys_desc = ch._keys(ex.wlo, io)
    seg_first = _seg_first_plain(ex.seg, dec.num_segments)
    got_first = np.searchsorted(ex.seg, np.arange(dec.num_segments + 1), side="left")
    got_first[got_first == ex.seg.shape[0]] = 0
    assert np.array_equal(got_first, seg_first)
    for scale in (0.2, 0.4, 0.7, 1.0, 1.5):
        T = scale * (float(ex.wlo[-1]) / k + 2 * float(io.max(initial=0.0))) + 1e-300
        f, parent = ch._exact_dp(ex.seg, ex.wlo, io, ex.mask, ex.flag, rank, keys_desc, seg_first, T, 1e-9 * T)
        f0, parent0 = _exact_dp_plain(ex.seg, ex.wlo, io, ex.mask, ex.flag, rank, keys_desc, seg_first, T, 1e-9 * T)
        assert np.array_equal(f, f0) and np.array_equal(parent, parent0)


def _assert_decompositions_equal(got: ch.ChainDecomposition, want: ch.ChainDecomposition) -> None:
    for fld in dataclasses.fields(ch.ChainDecomposition):
        if fld.name in ("seconds", "_memo"):
            continue
        a, b = getattr(got, fld.name), getattr(want, fld.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), fld.name
        elif isinstance(b, list):
            assert len(a) == len(b), fld.name
            for x, y in zip(a, b):
                assert (x is None and y is None) or np.array_equal(x, y), fld.name
        elif isinstance(b, dict):
            assert a.keys() == b.keys(), fld.name
            for j in b:
                assert all(np.array_equal(x, y) for x, y in zip(a[j], b[j])), fld.name
        else:
            assert a == b, fld.name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.integers(3, 12), st.booleans())
def test_reused_structure_gives_the_fresh_decomposition(seed, n, same_zeros):
    """Graphs that share edges, ops and sizes but not works (the zero-work nodes the same or not):
    the cached decomposition of each equals its own fresh one, before and after the others."""
    g = _graph(seed, n, p_edge=0.3)
    rng = np.random.default_rng(seed + 1)
    scale = rng.uniform(0.1, 10.0, g.n)
    t_fwd = g.t_fwd_s * scale
    if not same_zeros:
        t_fwd = np.where(rng.random(g.n) < 0.3, 0.0, t_fwd + 0.5)
    others = [dataclasses.replace(g, t_fwd_s=t_fwd), dataclasses.replace(g, bandwidth_bytes_per_s=7.0),
              dataclasses.replace(g, t_bwd_input_s=g.t_bwd_input_s * 2)]
    for graph in [g, *others, g]:
        for objective in ("inference", "training"):
            _assert_decompositions_equal(ch.cached_decomposition(graph, objective), ch.decompose(graph, objective))
    # the same works under another graph object and objective: the same points
    a = ch.cached_decomposition(others[1], "training")
    b = ch.cached_decomposition(dataclasses.replace(g, t_fwd_s=g.t_train_s, t_bwd_input_s=np.zeros(g.n),
                                                    t_bwd_weight_s=np.zeros(g.n)), "inference")
    assert b.objective == "inference" and a.objective == "training"
    assert ch._points(a, 3, exact_only=False) is not None and b._memo is a._memo


def test_popcount_of_every_bit():
    rng = np.random.default_rng(0)
    masks = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 500, dtype=np.int64),
                            np.array([0, 1, -1, 2**62, -(2**63), 2**63 - 1], dtype=np.int64)])
    want = np.array([bin(int(x) & 0xFFFFFFFFFFFFFFFF).count("1") for x in masks.tolist()])
    assert np.array_equal(ch._popcount(masks), want)
    assert np.array_equal(ch._popcount_swar(masks.view(np.uint64)), want)


def test_layered_chain_needs_fewer_dp_runs_than_bisection_steps():
    """A transformer-like chain of 40 blocks: the bracket decides most bisection steps."""
    L = 40
    t, size, edges, ops = [0.0], [1.0], [], ["placeholder"]
    prev = 0
    for i in range(L):
        base = len(t)
        t += [0.0, 1.0 + 0.01 * i, 1.5, 0.2]
        size += [1.0, 2.0, 2.0, 1.0]
        ops += ["call_function"] * 4
        edges += [(prev, base), (base, base + 1), (base, base + 2), (base + 1, base + 3), (base + 2, base + 3)]
        prev = base + 3
    from fxpipe.ir import OpGraph

    g = OpGraph.from_arrays(t_fwd_s=t, size_out_bytes=size, edges=edges, ops=ops, bandwidth_bytes_per_s=4.0)
    for k in (3, 7, 16):
        res = ch.solve_chain(g, k, "inference", "relay", partition=False)
        assert res.details["bisection_dp_runs"] < res.details["bisection_steps"] * 0.75
        pts = ch._points(ch.cached_decomposition(g, "inference"), k, exact_only=False)
        assert (res.lower_bound_s, res.relaxed_value_s) == _bisection_plain(pts, 0.25, k)[:2]


def test_staircase_step_split_keeps_the_steps_above():
    """A point reached in one transition whose key falls between two higher steps, after a gap in
    the levels opened below them: the staircase splits a step and moves the two steps above it; the
    end is reached only through the highest one (f = 5)."""
    wlo = np.arange(8, dtype=np.float64)
    io_out = np.array([0.0, 0.0, 8.5, 8.5, 8.5, 0.0, 4.5, 6.5])
    key = wlo - np.array([0.0, 0.0, 0.0, 0.0, 0.0, 2.5, 3.3, 0.0])  # 0, 1, 2, 3, 4, 2.5, 2.7, 7
    rank, keys_desc = ch._keys(key, np.zeros(8))
    for k in (4, 5, 6):
        want = _min_transitions_plain(wlo, key, io_out, rank, keys_desc, 0, 7, 10.0, 1e-8) <= k
        assert ch._within_transitions(wlo, key, io_out, 7, k, 10.0, 1e-8)[0] == want == (k >= 5)


@pytest.mark.parametrize("k", [1, 2])
def test_single_point_chain(k):
    """A chain of one point is feasible at every threshold (no transition needed)."""
    z = np.zeros(1)
    assert ch._within_transitions(z, z, z, 0, k, 1.0, 1e-9)[0]


@pytest.mark.parametrize("width", [30, 60])
@pytest.mark.parametrize("max_ideals", [ch.MAX_IDEALS, 10])
def test_points_of_a_wide_segment_keep_every_mask_bit(width, max_ideals):
    """A segment of ``width`` parallel branches (masks up to 2**60, beyond float64's 53 bits), listed
    in full or by its prefixes: the same points as the plain construction, for the bound and the partition."""
    from fxpipe.ir import OpGraph

    t, size, edges, ops = [0.0, 1.0], [1.0, 1.0], [(0, 1)], ["placeholder", "call_function"]
    for i in range(width):
        t.append(1.0 + 0.01 * i)
        size.append(1.0)
        ops.append("call_function")
        edges.append((1, 2 + i))
    join = len(t)
    t += [0.5, 0.0]
    size += [1.0, 0.0]
    ops += ["call_function", "output"]
    edges += [(2 + i, join) for i in range(width)] + [(join, join + 1)]
    g = OpGraph.from_arrays(t_fwd_s=t, size_out_bytes=size, edges=edges, ops=ops, bandwidth_bytes_per_s=4.0)
    dec = ch.decompose(g, "inference", max_ideals=max_ideals, max_binned=0)
    assert max(int(m.max()) for m in dec.masks if m is not None) >= 2 ** (width - 1)
    for k in (2, 5):
        for exact_only in (False, True):
            _assert_points_equal(ch._points(dec, k, exact_only=exact_only), _points_plain(dec, k, exact_only=exact_only))
