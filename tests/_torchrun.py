"""The command line and torchrun run as subprocesses in tests, and the JSON lines ranks print."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_EXAMPLE = ROOT / "examples" / "train_torchrun.py"


def fxpipe_cli(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """``python -m fxpipe.cli ARGS``, its output captured as text."""
    return subprocess.run([sys.executable, "-m", "fxpipe.cli", *args], capture_output=True, text=True, timeout=timeout_s)


def torchrun(nproc: int, script: Path, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC SCRIPT ARGS``, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script), *args],
        capture_output=True, text=True, timeout=timeout_s,
    )


def json_lines(stdout: str) -> list[dict]:
    """The JSON objects among the lines of ``stdout`` (a rank prints one a line)."""
    return [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]


def train_example_from_checkpoint(nproc: int, plan_file: Path, model, tmp_path: Path, *args: str) -> list[dict]:
    """``examples/train_torchrun.py --plan PLAN_FILE ARGS`` on ``nproc`` ranks, every rank loading
    its stages from a safetensors checkpoint of ``model`` (written under ``tmp_path``): the JSON
    lines the ranks print. Asserts that the run succeeds."""
    from safetensors.torch import save_model  # noqa: PLC0415 (optional: only the tests that take a checkpoint need it)

    ckpt = tmp_path / "model.safetensors"
    save_model(model, str(ckpt))
    run = torchrun(nproc, TRAIN_EXAMPLE, "--plan", str(plan_file), *args, "--checkpoint", str(ckpt), timeout_s=400)
    assert run.returncode == 0, run.stderr[-4000:]
    return json_lines(run.stdout)
