"""Planning guards a newcomer hits first (issue 8, item 5): bad inputs give one clear line on
stderr, exit 2, no traceback and no output file; sensible defaults (meta device without --run,
repeated --config flags merge)."""

from __future__ import annotations

import json

import pytest

from fxpipe.cli import main
from fxpipe.errors import InputError
from fxpipe.ir import OpGraph

TINY = ["n_layer=2", "n_embd=32", "n_head=2", "vocab_size=64", "n_positions=32"]


def _run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture()
def three_ops(tmp_path):
    g = OpGraph.from_arrays(t_fwd_s=[1.0, 2.0, 3.0], size_out_bytes=[1.0, 1.0, 1.0], edges=[[0, 1], [1, 2]], name="chain3")
    return str(g.save(tmp_path / "g.json"))


@pytest.mark.parametrize("cmd", ["partition", "bounds", "report"])
def test_more_stages_than_ops_is_rejected(cmd, three_ops, tmp_path, capsys):
    out_html = tmp_path / "r.html"
    argv = [cmd, three_ops, "-k", "4"] + (["-o", str(out_html)] if cmd == "report" else [])
    code, out, err = _run(argv, capsys)
    assert code == 2
    assert "-k 4 is more stages than the 3 ops" in err and "Traceback" not in err
    assert not out_html.exists()


def test_k_equal_to_op_count_is_fine(three_ops, capsys):
    code, out, _ = _run(["partition", three_ops, "-k", "3", "--json"], capsys)
    assert code == 0 and json.loads(out)["k"] == 3


@pytest.mark.parametrize(
    "override, needle",
    [
        ("n_layer=-1", "n_layer must be >= 1"),
        ("n_layer=0", "n_layer must be >= 1"),
        ("n_head=2.5", "n_head must be an integer"),
        ("resid_pdrop=1.5", "probability"),
        ("n_layer=two", "n_layer must be an integer"),
    ],
)
def test_nonsense_config_overrides_are_rejected(override, needle, tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    code, out, err = _run(["plan", "--hf", "gpt2", "--config", *TINY, override, "--devices", "2", "--mesh", "pipeline", "--out", str(plan_file)], capsys)
    assert code == 2, err
    assert needle in err and "Traceback" not in err
    assert not plan_file.exists() and out == ""


def test_nonsense_overrides_rejected_in_the_library_too():
    from fxpipe.models import build_hf_model

    with pytest.raises(InputError, match="num_local_experts must be >= 1"):
        build_hf_model("mixtral", {"num_local_experts": 0}, device="meta")


def test_repeated_config_flags_merge(capsys):
    argv = ["plan", "--hf", "gpt2", "--config", "n_layer=2", "n_embd=32", "--config", "n_head=2", "vocab_size=64",
            "--config", "n_positions=32", "n_layer=1", "--seq-len", "8", "--devices", "2", "--mesh", "pipeline", "--time-limit", "0.3", "--json"]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    doc = json.loads(out)
    # every flag contributes; a later value of the same key wins
    assert doc["config"] == {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32}


def test_plan_without_run_builds_on_meta(monkeypatch, capsys):
    """Planning needs no weights: without --run the model is built on the meta device."""
    from fxpipe.cli import plan_cmd

    devices = []
    real = plan_cmd.HFFactory.one_microbatch

    def spy(self, device="cpu"):
        devices.append(device)
        return real(self, device)

    monkeypatch.setattr(plan_cmd.HFFactory, "one_microbatch", spy)
    code, _, err = _run(["plan", "--hf", "gpt2", "--config", *TINY, "--seq-len", "8", "--devices", "2", "--mesh", "pipeline", "--time-limit", "0.3"], capsys)
    assert code == 0, err
    assert devices == ["meta"]


def test_unwritable_plan_output_fails_before_planning(tmp_path, capsys, monkeypatch):
    import fxpipe.api

    def boom(*a, **k):  # pragma: no cover - must not be reached
        raise AssertionError("planned although the output path is unwritable")

    monkeypatch.setattr(fxpipe.api, "compile", boom)
    code, _, err = _run(["plan", "--hf", "gpt2", "--config", *TINY, "--devices", "2", "--mesh", "pipeline", "--out", str(tmp_path)], capsys)
    assert code == 2 and "is a directory" in err


def test_plan_with_edited_stage_table_is_rejected(tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    code, _, err = _run(["plan", "--hf", "gpt2", "--config", *TINY, "--seq-len", "8", "--devices", "2", "--mesh", "pipeline",
                         "--time-limit", "0.3", "--out", str(plan_file)], capsys)
    assert code == 0, err
    import fxpipe

    fxpipe.load_plan(plan_file)  # the untouched file loads
    doc = json.loads(plan_file.read_text())
    doc["stages"][0]["memory_bytes"] = doc["stages"][0]["memory_bytes"] / 2  # "it fits now"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="stage table was edited"):
        fxpipe.load_plan(edited)


def test_missing_hf_extra_names_the_extra(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    code, out, err = _run(["plan", "--hf", "gpt2", "--devices", "2", "--mesh", "pipeline"], capsys)
    assert code == 2
    assert 'pip install -e ".[hf]"' in err and "Traceback" not in err


# ----------------------------------------------------------------------------- Ctrl-C and --json
def _random_dag(n=400, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    edges = [(int(u), v) for v in range(1, n) for u in rng.choice(v, size=min(v, 2), replace=False)]
    return OpGraph.from_arrays(
        t_fwd_s=rng.uniform(1, 10, n), t_bwd_input_s=rng.uniform(1, 10, n), t_bwd_weight_s=rng.uniform(1, 10, n),
        size_out_bytes=rng.uniform(1, 30, n), edges=edges, name="rand400",
    )


@pytest.mark.slow
def test_ctrl_c_in_cli_keeps_stdout_pure_json(tmp_path):
    """`fxpipe bounds --json` + Ctrl-C: exit 130, stdout is exactly one JSON document (SCIP's
    "pressed CTRL-C" line goes to stderr), the methods after the interrupted one never run.

    SCIP holds the GIL while it solves, so the signal must come from outside the process (as
    a terminal's Ctrl-C does): SCIP's own handler catches it and stops with a valid bound."""
    import signal
    import subprocess
    import sys
    import time

    path = _random_dag().save(tmp_path / "g.json")
    argv = ["fxpipe", "bounds", str(path), "-k", "16", "--objective", "training",
            "--methods", "simple,exact,guess", "--time-limit", "60", "--search-time-limit", "0.5", "--json"]
    # a terminal's Ctrl-C reaches a process whose SIGINT is not ignored; a test run started in
    # the background by a non-interactive shell inherits SIGINT ignored (bash does that to
    # `cmd &`) and Python then keeps it ignored, so the child restores Python's handler first
    boot = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"sys.argv = {argv!r}; runpy.run_module('fxpipe.cli', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", boot], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(15.0)  # imports, numba compile, search and simple bound done: inside the 60 s exact solve
    proc.send_signal(signal.SIGINT)
    t0 = time.perf_counter()
    out, err = proc.communicate(timeout=120)
    assert time.perf_counter() - t0 < 40, "the run went on after Ctrl-C"
    assert proc.returncode == 130, err
    doc = json.loads(out)  # nothing but JSON on stdout
    assert doc["solver"]["interrupted"] is True
    assert "guess" not in doc["lower_bounds"]
    assert "Traceback" not in err
