"""The prepared GPU calibration script (``benchmarks/bench_gpu_calibrate.py``, issue 31) in its ``--smoke`` mode:
every section runs on the CPU with a tiny Llama, writes its part of the one JSON document, and the profile is
never written into the package."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_script(name: str):
    """The benchmark script ``benchmarks/<name>.py`` as a module (a script, not an installed package)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_calibration_script_smoke(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench_gpu_calibrate = _load_script("bench_gpu_calibrate")

    profiles = sorted((Path(bench_gpu_calibrate.REPO) / "fxpipe" / "cost" / "profiles").glob("*.json"))
    out, copy = tmp_path / "calibrate.json", tmp_path / "profile.json"
    monkeypatch.setattr(sys, "argv", ["bench_gpu_calibrate.py", "--smoke"])
    assert bench_gpu_calibrate.main(["--smoke", "--out", str(out), "--profile-out", str(copy)]) == 0
    doc = json.loads(out.read_text())
    for section in ("device", "profile", "stages", "saved", "ship"):
        assert section in doc and "error" not in doc[section], (section, doc.get(section))
    assert doc["profile"]["measurements"] > 0 and copy.is_file()
    assert json.loads(copy.read_text())["format"] == "fxpipe.hwprofile/1"
    stages = doc["stages"]["stages"]
    assert set(stages) == {"1", "2"}
    for row in stages.values():
        m = row["measured_graph"]
        assert m["F_s"] > 0 and m["B_s"] > 0 and m["W_s"] >= 0
        assert set(row["predicted"]) == {"datasheet", "profile"}  # the CPU has no achieved twin
        assert row["saved_bytes_graph"] > 0 and 0.5 < row["error"]["datasheet"]["stash_over_saved"] < 2.0
    # two blocks save more than one
    assert stages["2"]["saved_bytes_graph"] > stages["1"]["saved_bytes_graph"]
    assert doc["ship"]["shipped"] is False
    assert sorted((Path(bench_gpu_calibrate.REPO) / "fxpipe" / "cost" / "profiles").glob("*.json")) == profiles
