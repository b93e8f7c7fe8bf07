"""The install is reproducible: every declared dependency has a tested version in
constraints.txt, which the README's install command and CI use (issue 17, item 1)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def test_every_dependency_has_a_tested_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        declared |= {_name(r) for r in extra if not r.startswith("fxpipe")}
    pinned = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pinned[_name(name)] = version
    missing = sorted(declared - set(pinned))
    assert not missing, f"declared in pyproject.toml but without a tested version in constraints.txt: {missing}"


def test_readme_and_ci_install_with_the_constraints():
    cmd = 'pip install -e ".[dev]" -c constraints.txt'
    assert cmd in (ROOT / "README.md").read_text()
    assert 'install --quiet --disable-pip-version-check -e ".[dev]" -c constraints.txt' in (ROOT / ".ci" / "run").read_text()
