"""``fxpipe bounds`` command line: --json shape (Contract 4), table, errors."""

import json

import numpy as np
import pytest

from fxpipe.cli import main
from fxpipe.ir import OpGraph


@pytest.fixture
def graph_file(tmp_path):
    rng = np.random.default_rng(0)
    n = 8
    edges = [(i, i + 1) for i in range(n - 1)] + [(0, 4), (2, 6)]
    g = OpGraph.from_arrays(
        t_fwd_s=rng.uniform(1, 2, n), size_out_bytes=rng.uniform(0, 1, n), size_param_bytes=np.full(n, 4.0), edges=edges, name="chain8"
    )
    return str(g.save(tmp_path / "g.json"))


def test_bounds_json_shape(graph_file, capsys, tmp_path):
    cert = tmp_path / "c.json"
    rc = main(["bounds", graph_file, "-k", "2", "--methods", "simple,bottleneck,guess,exact", "--time-limit", "10",
               "--search-time-limit", "0.2", "--workers", "1", "--certificate", str(cert), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["k"] == 2
    assert set(doc["solution"]) >= {"bottleneck", "assignment"} and len(doc["solution"]["assignment"]) == 8
    assert set(doc["lower_bounds"]) == {"simple", "bottleneck", "guess", "exact"}
    assert doc["best_lower_bound"] == max(doc["lower_bounds"].values())
    assert 0 < doc["ratio"] <= 1 + 1e-9
    assert "version" in doc["solver"]
    assert json.loads(cert.read_text())["format"] == "fxpipe.certificate/1"


def test_bounds_table(graph_file, capsys):
    rc = main(["bounds", graph_file, "-k", "3", "--methods", "simple,lp", "--time-limit", "5", "--search-time-limit", "0.2"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "method" in out and "simple" in out and "lp" in out and "ratio" in out


def test_bounds_errors_exit_2(graph_file, capsys):
    assert main(["bounds", graph_file, "-k", "2", "--methods", "simple,nope"]) == 2
    assert "unknown method" in capsys.readouterr().err
    assert main(["bounds", graph_file, "-k", "2", "--methods", "exact", "--memory-capacity", "1B"]) == 2
    err = capsys.readouterr().err
    assert "device holds" in err and "Traceback" not in err
    assert main(["bounds", graph_file + ".missing", "-k", "2"]) == 2
