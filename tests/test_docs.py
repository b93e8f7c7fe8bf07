"""README.md and docs/ (issue 32): a front door of at most 300 lines, and claims that cannot rot.

``python -m fxpipe.testing.docs --check`` reruns the cheap output blocks and compares their
structure, parses every command with the CLI's parser and checks every path, link and figure.
These tests run it on the repository (it must pass) and on hand-edited copies (it must fail).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fxpipe.testing import docs

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def runner():
    """One runner for the module: every block runs once, the edited copies reuse the outputs."""
    return docs.Runner(ROOT)


@pytest.fixture(scope="module")
def checked(runner):
    return docs.check(ROOT, runner=runner)


def _block_after(text: str, marker_start: str) -> str:
    """The body of the fenced block right after the marker line that starts with ``marker_start``."""
    page = docs.parse_page("README.md", text)
    mk = next(m for m in page.markers if text.splitlines()[m.line - 1].startswith(marker_start))
    return mk.target.body


# ------------------------------------------------------------------------------------- the front door


def test_readme_is_a_front_door():
    lines = README.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300; aim for 250)"
    first = "\n".join(lines[:40])
    assert "Python 3.10" in first  # requirements
    assert 'pip install -e ".[dev]" -c constraints.txt' in first and "python -m pytest -q" in first  # set up, tests
    main_job = next(x for x in lines[:40] if x.startswith("fxpipe plan "))
    assert "--mesh pipeline" in main_job and "--run" in main_job  # the main job plans a pipeline and trains it
    assert re.search(r"^pipelined vs single-process training: equal:", first, re.M)  # ... equal to one process
    assert re.search(r"^fxpipe plan for 'gpt2': 4 devices,", first, re.M)  # a pipeline of 4 devices
    for page in ("api", "capture", "memory", "mesh", "costs", "schedules", "checkpoints", "cli", "results", "design"):
        assert (ROOT / "docs" / f"{page}.md").is_file() and f"docs/{page}.md" in README


def test_readme_quick_starts_show_a_pipeline_and_data_parallelism():
    """Each quick start has a model that pipelines and one that picks data parallelism (a `no pipeline:` line)."""
    python_out = docs.parse_page("README.md", README)
    mk = next(m for m in python_out.markers if m.kind == "python")
    py = mk.code.body
    facts = docs.structure(mk.target.body)
    assert any(re.match(r"'\w+': [2-9] devices,", p) for p in facts["plan"]), facts  # a pipeline (of tp ranks)
    assert any("data-parallel replicas" in p for p in facts["plan"]) and facts["no_pipeline"], facts
    assert "fxpipe.compile" in py
    cli = [docs.structure(m.target.body) for m in python_out.markers if m.kind == "output" and "--run" not in m.attrs["cmd"]]
    assert any(str(f.get("chosen", "")).startswith("pp=") for f in cli)  # Llama-2-7B: a pipeline
    assert any(f.get("no_pipeline") for f in cli)


# ------------------------------------------------------------------------------------- the check


def test_docs_check_passes(checked):
    assert not checked, "\n".join(map(str, checked))


@pytest.mark.slow
def test_docs_check_with_the_slow_blocks_passes(runner, checked):
    """``--check --slow``: the main job trains on 4 gloo ranks and its verdict is still "equal" (about a minute)."""
    problems = docs.check(ROOT, slow=True, runner=runner)
    assert not problems, "\n".join(map(str, problems))
    main_job = next(k for k in runner.outputs if k[0] == "cmd" and k[1].endswith(" --run"))
    assert docs.structure(runner.outputs[main_job])["training"] == ["equal"]


def test_a_hand_edited_output_block_fails_the_check(runner, checked):
    """Edits a reader could make by hand (another mesh chosen, a stage row gone, another model planned) fail; the
    timings of a block (every number) may differ freely."""
    assert not checked
    dp = _block_after(README, '<!-- fxpipe-docs: output cmd="fxpipe plan --hf gpt2 --config n_layer=8 n_embd=256 '
                              'n_head=4 --seq-len 64 --devices 4" ')
    chosen = next(x for x in dp.splitlines() if x.endswith("(chosen)"))
    pure = next(x for x in dp.splitlines() if x.startswith("  pp=4 "))
    edited = dp.replace(chosen, chosen[: -len(" (chosen)")]).replace(pure, pure + " (chosen)")
    problems = docs.check(ROOT, texts={"README.md": README.replace(dp, edited)}, runner=runner)
    assert [p for p in problems if p.path == "README.md" and "chosen: the block says 'pp=4', a fresh run 'dp_shard=2 x dp_replicate=2, FSDP2 unit per block'" in p.what], problems

    llama = _block_after(README, '<!-- fxpipe-docs: output cmd="fxpipe plan --hf llama-2-7b --devices 4"')
    row = next(x for x in llama.splitlines() if re.match(r"^\s+1\s+1\s", x))
    problems = docs.check(ROOT, texts={"README.md": README.replace(llama, llama.replace(row + "\n", ""))},
                          runner=runner)
    assert [p for p in problems if "stage_rows: the block says 1, a fresh run 2" in p.what], problems

    page = docs.parse_page("README.md", README)
    out = next(m for m in page.markers if m.kind == "python").target.body
    problems = docs.check(ROOT, texts={"README.md": README.replace(out, out.replace("'LlamaForCausalLM': 2 devices",
                                                                                     "'LlamaForCausalLM': 8 devices"))},
                          runner=runner)
    assert [p for p in problems if "plan: the block says" in p.what and "8 devices" in p.what], problems

    # every number changed (timings, memory, bounds): the structure is the same, nothing to report
    renumbered = re.sub(r"\d\.\d{3}", "9.999", dp)
    assert renumbered != dp
    assert not docs.check(ROOT, texts={"README.md": README.replace(dp, renumbered)}, runner=runner)


def test_update_rewrites_a_block_from_a_fresh_run(tmp_path):
    code = "print(\"fxpipe plan for 'm': 2 devices, 4 micro-batches, schedule zb-h1\")"
    page = (f"# t\n\n<!-- fxpipe-docs: python -->\n```python\n{code}\n```\n\n```text\n"
            "fxpipe plan for 'm': 2 devices, 4 micro-batches, schedule gpipe\n```\n")
    (tmp_path / "README.md").write_text(page)
    runner = docs.Runner(tmp_path)
    problems = docs.check(tmp_path, runner=runner)
    assert [p.line for p in problems] == [8] and "schedule: the block says ['gpipe'], a fresh run ['zb-h1']" in \
        problems[0].what
    assert docs.update(tmp_path, runner=runner) == ["README.md:8"]
    assert "schedule zb-h1" in (tmp_path / "README.md").read_text()
    assert docs.check(tmp_path, runner=runner) == []


def test_static_checks_catch_rotten_commands_paths_links_and_figures():
    bad = README + """
```bash
fxpipe plan --hf gpt2 --no-such-option 3
python benchmarks/bench_nothing.py
python benchmarks/bench_mesh.py --no-such-flag
python -m fxpipe.no_such_module
torchrun --nproc-per-node 2 examples/no_such_example.py
```

See `fxpipe/plan_io.py`, `fxpipe.mesh.no_such_name`, [a page](docs/no_such_page.md) and [a section](docs/mesh.md#no-such-section).

![a figure](docs/no_such_figure.png)
"""
    found = [p.what for p in docs.check(ROOT, texts={"README.md": bad}, run=False)]
    expected = ["`fxpipe plan --hf gpt2 --no-such-option 3` does not parse",
                "benchmarks/bench_nothing.py does not exist",
                "benchmarks/bench_mesh.py has no option --no-such-flag",
                "no module fxpipe.no_such_module",
                "names examples/no_such_example.py, which does not exist",
                "names fxpipe/plan_io.py, which does not exist",
                "fxpipe.mesh.no_such_name is not a module or attribute of fxpipe",
                "names docs/no_such_page.md, which does not exist",
                "docs/mesh.md has no heading #no-such-section",
                "the image docs/no_such_figure.png has no `fxpipe-docs: figure` marker"]
    for text in expected:
        assert any(text in f for f in found), (text, found)
    assert len(found) == len(expected) + 1  # + the missing figure file itself


def test_output_commands_must_be_shown_and_ci_steps_must_be_the_readmes():
    # an output block whose command the page does not show
    hidden = README.replace("fxpipe plan --hf llama-2-7b --devices 4\n", "", 1)
    found = [p.what for p in docs.check(ROOT, texts={"README.md": hidden}, run=False)]
    assert any("`fxpipe plan --hf llama-2-7b --devices 4` is not shown" in f for f in found), found
    # .ci/run's set-up steps are the README's
    other = README.replace('pip install -e ".[dev]" -c constraints.txt', 'pip install -e .')
    found = [p.what for p in docs.check(ROOT, texts={"README.md": other}, run=False)]
    assert any('runs `pip install -e ".[dev]" -c constraints.txt` (set-up step 1)' in f for f in found), found


def test_structure_compares_facts_not_timings():
    a = ("fxpipe plan for 'gpt2': 4 devices, 8 micro-batches, hardware h100-sxm, objective training, schedule zb-h2\n"
         "stage device    ops     params\n    0      0    113   27.6 MiB\n    1      1     86    3.0 MiB\n"
         "pipelined vs single-process training: equal: loss rel 3.3e-08")
    assert docs.compare(a, a.replace("27.6", "31.2").replace("113", "120").replace("3.3e-08", "1.0e-07")) == []
    assert docs.compare(a, a.replace("equal:", "DIFFERENT:")) == \
        ["training: the block says ['equal'], a fresh run ['DIFFERENT']"]
    assert docs.compare(a, a.replace("zb-h2", "milp"), ignore=["schedule"]) == []
    assert docs.compare(a, a.replace("zb-h2", "milp")) == ["schedule: the block says ['zb-h2'], a fresh run ['milp']"]
    # text without plan facts: line by line, numbers masked
    assert docs.compare("presets: 7\nllama-3-8b 32", "presets: 9\nllama-3-8b 40") == []
    assert docs.compare("presets: 7\nllama-3-8b 32", "presets: 7") != []


def test_a_malformed_marker_is_a_problem_not_a_crash():
    bad = README + "\n<!-- fxpipe-docs: output -->\n"
    found = docs.check(ROOT, texts={"README.md": bad}, run=False)
    assert len(found) == 1 and "an output marker needs cmd=" in found[0].what
    assert (found[0].path, found[0].line) == ("README.md", len(README.splitlines()) + 2)
