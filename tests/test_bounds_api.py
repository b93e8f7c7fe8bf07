"""compute_bounds API: time limits, certificates, JSON shapes, bad input."""

import json
import math

import numpy as np
import pytest

from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition.bounds import (
    Certificate,
    compute_bounds,
    make_mip_data,
    read_certificate,
    write_certificate,
)
from fxpipe.partition.bounds.models import build_exact, build_guess
from fxpipe.partition.objective import block_costs


def layered_dag(n_layers: int = 12, width: int = 6, seed: int = 0) -> OpGraph:
    rng = np.random.default_rng(seed)
    n = n_layers * width
    edges = []
    for layer in range(n_layers - 1):
        for i in range(width):
            u = layer * width + i
            for j in rng.choice(width, size=2, replace=False):
                edges.append((u, (layer + 1) * width + int(j)))
    return OpGraph.from_arrays(
        t_fwd_s=rng.uniform(1.0, 2.0, n), size_out_bytes=rng.uniform(0.5, 2.0, n), edges=edges, bandwidth_bytes_per_s=1.0, name="layered"
    )


def test_time_limit_returns_best_dual_bound_and_says_so():
    g = layered_dag()
    k = 8
    rep = compute_bounds(g, k, methods=("simple", "exact"), time_limit_s=1.0, warm_start=np.zeros(g.n, dtype=np.int64))
    cert = rep.certificates["exact"]
    assert cert.status == "timelimit"
    assert cert.wall_time_s < 30
    # the best dual bound reached: at least Lemma 3.3 (a valid cut of the model), at most the incumbent
    assert rep.certificates["simple"].lower_bound <= cert.lower_bound <= rep.partition.bottleneck * (1 + 1e-9)
    assert cert.gap is not None and cert.gap >= 0
    assert rep.to_dict()["solver"]["certificates"]["exact"]["status"] == "timelimit"


def test_guess_time_limit_status():
    g = layered_dag(16, 6, seed=1)
    rep = compute_bounds(g, 4, methods=("guess",), time_limit_s=0.6, workers=1, warm_start=np.zeros(g.n, dtype=np.int64))
    cert = rep.certificates["guess"]
    assert cert.status in ("timelimit", "optimal")
    per = cert.details["per_guess"]
    assert len(per) == 4
    assert cert.lower_bound == pytest.approx(min(v["lower_bound"] for v in per.values()))
    if any(v["status"] == "timelimit" for v in per.values()):
        assert cert.status == "timelimit"


def test_contract4_shape_and_certificate_round_trip(tmp_path):
    g = layered_dag(4, 3)
    rep = compute_bounds(g, 2, methods=("simple", "lp", "bottleneck", "exact"), time_limit_s=10, search_time_limit_s=0.2,
                         stop_when_proven=False)
    doc = rep.to_dict()
    assert {"k", "solution", "lower_bounds", "best_lower_bound", "ratio", "solver"} <= set(doc)
    assert set(doc["solution"]) >= {"bottleneck", "assignment"}
    assert list(doc["lower_bounds"]) == ["simple", "lp", "bottleneck", "exact"]
    assert doc["best_lower_bound"] == max(doc["lower_bounds"].values())
    assert doc["ratio"] == pytest.approx(doc["best_lower_bound"] / doc["solution"]["bottleneck"])
    json.dumps(doc, allow_nan=False)
    for c in rep.certificates.values():
        assert Certificate.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    path = write_certificate(tmp_path / "cert.json", rep, g)
    back = read_certificate(path)
    assert back["format"] == "fxpipe.certificate/1"
    assert len(back["graph"]["sha256"]) == 64
    assert back["certificates"]["exact"].lower_bound == rep.certificates["exact"].lower_bound
    # a third party re-scores the partition with the reference objective
    a = np.array(back["partition"]["assignment"])
    assert block_costs(g, a, 2).max() == pytest.approx(back["partition"]["bottleneck"])
    assert back["certificates"]["exact"].solver.startswith("SCIP")
    assert "limits/time" in back["certificates"]["exact"].params


def test_certificate_inf_round_trip():
    c = Certificate(method="guess", lower_bound=1.5, primal_value=math.inf, gap=math.nan, status="timelimit",
                    details={"per_guess": {"1": {"lower_bound": math.inf}}})
    d = json.loads(json.dumps(c.to_dict(), allow_nan=False))
    assert d["details"]["per_guess"]["1"]["lower_bound"] == "inf"
    back = Certificate.from_dict(d)
    assert back.primal_value == math.inf and math.isnan(back.gap)


def test_bad_input_is_an_input_error():
    g = layered_dag(3, 2)
    with pytest.raises(InputError, match="unknown bound method"):
        compute_bounds(g, 2, methods=("simple", "magic"))
    with pytest.raises(InputError, match="objective"):
        compute_bounds(g, 2, objective="serving")
    with pytest.raises(InputError, match="k must be"):
        compute_bounds(g, 0)
    with pytest.raises(InputError, match="time limit"):
        compute_bounds(g, 2, time_limit_s=0)
    with pytest.raises(InputError, match="guessed block"):
        build_guess(make_mip_data(g, 2), 3)


def test_builders_name_every_variable_and_constraint():
    g = layered_dag(3, 2)
    for comm in ("dag", "relay"):
        data = make_mip_data(g, 3, comm=comm)
        model, mv = build_exact(data)
        names = [v.name for v in model.getVars()] + [c.name for c in model.getConss()]
        assert len(names) == len(set(names))
        assert all("[" in nm or nm == "bottleneck" for nm in names)
        assert set(mv.y) == {(v, b) for v in range(g.n) for b in (1, 2)}


def test_k1_is_the_total_work():
    g = layered_dag(3, 2)
    rep = compute_bounds(g, 1, methods=("simple", "lp", "bottleneck", "guess", "exact"), time_limit_s=5, workers=1)
    total = float(np.sum(g.t_fwd_s))
    for c in rep.certificates.values():
        assert c.lower_bound == pytest.approx(total)


def test_timed_out_mip_keeps_the_bound_it_started_from():
    """A MIP stopped before SCIP has a dual bound reports at least the valid bound it started from."""
    from fxpipe.partition.bounds import bound, make_mip_data

    rng = np.random.default_rng(3)
    n = 60
    edges = [[i, j] for i in range(n) for j in range(i + 1, min(n, i + 4))]
    g = OpGraph.from_arrays(t_fwd_s=rng.uniform(0.5, 2.0, n), size_out_bytes=rng.uniform(0.1, 3.0, n), edges=edges)
    data = make_mip_data(g, 4, "inference", "dag")
    start = 1.1 * float(g.t_fwd_s.sum()) / 4  # a made-up start above Lemma 3.3, as exact receives from earlier tiers
    for method in ("exact", "guess"):
        cert, _ = bound(method, data, time_limit_s=0.01, known_lower_bound_s=start, workers=1)
        assert cert.lower_bound >= start * (1 - 1e-12), (method, cert.lower_bound, start)


def test_mips_are_skipped_once_the_partition_is_proven_optimal():
    """"Stop when done": after a bound that meets the best partition, no MIP runs; each
    skipped method reports the (valid) bound it would have started from."""
    g = layered_dag(4, 3)
    rep = compute_bounds(g, 2, methods=("simple", "bottleneck", "guess", "exact"), time_limit_s=10, search_time_limit_s=0.2, workers=1)
    certs = rep.certificates
    assert certs["bottleneck"].status == "optimal"
    assert certs["bottleneck"].lower_bound == pytest.approx(rep.partition.bottleneck, rel=1e-6)
    for m in ("guess", "exact"):
        assert certs[m].status == "skipped" and certs[m].wall_time_s == 0.0
        assert certs[m].lower_bound == pytest.approx(certs["bottleneck"].lower_bound)
        assert "proven optimal by bottleneck" in certs[m].details["reason"]
    assert rep.ratio == pytest.approx(1.0, rel=1e-6)
