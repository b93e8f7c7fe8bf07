"""Claims in README.md and docs/ that cannot rot (issue 32): ``python -m fxpipe.testing.docs --check``.

Every output block of the Markdown pages comes from a command, and every command, path and figure
the pages name exists. The pages mark what produced a block with an HTML comment (invisible when
rendered) on the line before it::

    <!-- fxpipe-docs: output cmd="fxpipe plan --hf gpt2 --devices 4" -->
    <!-- fxpipe-docs: python -->            (the next fenced block is Python; the block after it its output)
    <!-- fxpipe-docs: recorded cmd="python benchmarks/bench_mesh.py" date=2026-11-26 -->
    <!-- fxpipe-docs: figure script="python benchmarks/x.py --plot x.png" -->

* ``output``: the next fenced block is the standard output of ``cmd``, a command shown in an
  earlier fenced block of the same page. ``--check`` reruns it and compares the *structure* of
  the fresh output with the block's (:func:`structure`: the planned model and mesh, the schedule's
  name, the rows of the stage, memory and mesh-search tables, the chosen mesh, the training
  verdict "equal", the warnings; other text line by line with every number masked), never the
  timings. Options: ``slow`` (rerun only with ``--slow``; ``fast="CMD"`` names a cheaper command
  whose structure the fast check compares instead, e.g. the plan without ``--run``),
  ``fast-ignore=KEY`` (facts the fast command cannot share), ``ignore=KEY,KEY`` (facts that may differ between runs, e.g. ``schedule`` where ``auto``
  picks by a time-limited MILP), ``head=N`` (the block shows the first N lines) and
  ``omit=memory-table`` (the block leaves the memory table out, shown as ``...``) and
  ``drop=REGEX`` (the block leaves out the lines it matches).
* ``python``: the next fenced block is a Python program and the fenced block after it its
  output (``slow`` as above).
* ``recorded``: a measured result too expensive to rerun (a benchmark's table): only its
  command is checked, like every command in a fenced block.
* ``figure``: the next image is produced by ``script``, which must exist, as the image must.

Checked everywhere, without running anything: every ``fxpipe ...`` command in a fenced shell
block parses with the CLI's own parser (:func:`fxpipe.cli.build_parser`); every ``python X.py``
names an existing script whose source defines each ``--flag`` given; every ``python -m M`` names
an importable module; every repository path in a command, in inline code (`` `fxpipe/plan/core.py` ``)
or in a link exists, and a link's ``#anchor`` names a heading of its page; every ``fxpipe.a.b``
in inline code resolves to a module or an attribute; every image has a ``figure`` marker; the
README's set-up commands are the ones ``.ci/run`` marks ``# README: set up, step N``.

``--update`` rewrites every rerun block from a fresh run (``--slow`` included: all of them), so
pages follow behaviour changes; the lead reruns it after merges. Exit status 0 when everything
holds, 1 with one line per problem (``page:line: what``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

ROOT = Path(__file__).resolve().parents[2]
#: The marker comment's prefix.
MARK = "fxpipe-docs:"
#: Shell-like fence languages whose commands are checked.
SHELL = ("bash", "sh", "shell", "console")
#: Output blocks are rerun with this time limit (seconds).
RUN_TIMEOUT_S = 900
_NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?\d+(?:[.,]\d+)*(?:[eE][-+]?\d+)?")
_MESH_TEXT = (r"(?:pp|dp_shard|dp_replicate|tp)=\d+(?: x (?:pp|dp_shard|dp_replicate|tp)=\d+)*(?:, optimizer on host)?"
              r"(?:, FSDP2 unit per block)?")


@dataclass
class Fence:
    """A fenced code block: ``line`` is the 1-based line of its opening fence, ``body`` its text."""

    line: int
    lang: str
    body: str
    first: int  # index (0-based) of the first body line in the page's lines
    last: int  # index of the closing fence


@dataclass
class Marker:
    """A ``<!-- fxpipe-docs: ... -->`` comment and the fenced blocks it names."""

    line: int
    kind: str
    attrs: dict[str, str]
    flags: set[str]
    target: Fence | None = None  # the output block (output, python) or None
    code: Fence | None = None  # python: the program


@dataclass
class Page:
    """A Markdown page: its path relative to the repository (``"docs/mesh.md"``), text, blocks and markers."""

    path: str
    text: str
    fences: list[Fence] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)


@dataclass(frozen=True)
class Problem:
    """One claim that does not hold: the page (relative path), its 1-based line, and what is wrong."""

    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


# ---------------------------------------------------------------------------------------------- parsing


class MarkerError(ValueError):
    """A malformed ``fxpipe-docs`` marker: ``path`` and ``line`` say where, the message what is wrong."""

    def __init__(self, path: str, line: int, what: str):
        super().__init__(f"{path}:{line}: {what}")
        self.path, self.line, self.what = path, line, what


def parse_page(path: str, text: str) -> Page:
    """The fenced blocks and markers of one Markdown page.

    Parameters
    ----------
    path : str
        The page's path relative to the repository (for messages).
    text : str
        The page's Markdown.

    Returns
    -------
    Page
        Its fenced blocks (opening line, language, body) and its markers with the blocks they name.

    Raises
    ------
    MarkerError
        A marker without the block it names, with unbalanced quotes or of an unknown kind.
    """
    page = Page(path, text)
    lines = text.splitlines()
    i = 0
    pending: list[tuple[int, str]] = []
    while i < len(lines):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if m:
            fence, start = m.group(1), i
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            page.fences.append(Fence(start + 1, m.group(2).lower(), "\n".join(lines[start + 1:j]), start + 1, j))
            i = j + 1
            continue
        c = re.match(rf"^\s*<!--\s*{re.escape(MARK)}(.*?)-->\s*$", lines[i])
        if c:
            pending.append((i + 1, c.group(1)))
        i += 1
    for line, body in pending:
        try:
            tokens = shlex.split(body)
        except ValueError as exc:
            raise MarkerError(path, line, f"the {MARK} marker does not split into words: {exc}") from None
        if not tokens:
            raise MarkerError(path, line, f"an empty {MARK} marker")
        kind, attrs, flags = tokens[0], {}, set()
        for t in tokens[1:]:
            key, eq, value = t.partition("=")
            if eq:
                attrs[key] = value
            else:
                flags.add(t)
        mk = Marker(line, kind, attrs, flags)
        after = [f for f in page.fences if f.line > line]
        if kind == "output":
            if "cmd" not in attrs or not after:
                raise MarkerError(path, line, "an output marker needs cmd=\"...\" and a fenced block after it")
            mk.target = after[0]
        elif kind == "python":
            if len(after) < 2 or after[0].lang != "python":
                raise MarkerError(path, line, "a python marker needs a python block and an output block after it")
            mk.code, mk.target = after[0], after[1]
        elif kind in ("recorded", "figure"):
            key = "cmd" if kind == "recorded" else "script"
            if key not in attrs:
                raise MarkerError(path, line, f"a {kind} marker needs {key}=\"...\"")
        else:
            raise MarkerError(path, line, f"unknown {MARK} marker {kind!r} (output, python, recorded, figure)")
        page.markers.append(mk)
    return page


def doc_pages(root: Path = ROOT, texts: Mapping[str, str] | None = None) -> list[Page]:
    """README.md and every docs/*.md under ``root`` (``texts`` replaces a page's text by its relative path)."""
    paths = ["README.md"] + sorted(str(p.relative_to(root)) for p in (root / "docs").glob("*.md"))
    texts = dict(texts or {})
    return [parse_page(p, texts[p] if p in texts else (root / p).read_text()) for p in paths]


# ---------------------------------------------------------------------------------------------- structure


def mask_numbers(line: str) -> str:
    """``line`` with every number replaced by ``#`` and runs of spaces collapsed."""
    return re.sub(r"\s+", " ", _NUMBER.sub("#", line)).strip()


def _table_rows(lines: list[str], header: str) -> int | None:
    """How many rows (lines starting with spaces and a digit) follow the first line starting with ``header``."""
    for i, line in enumerate(lines):
        if line.strip().startswith(header):
            n = 0
            for row in lines[i + 1:]:
                if not re.match(r"^\s*\d", row):
                    break
                n += 1
            return n
    return None


def structure(text: str) -> dict[str, object]:
    """The facts of an output block that do not depend on timing.

    Of a plan summary (``fxpipe plan``, :meth:`fxpipe.Plan.summary`): ``model`` (the model
    line), ``plan`` (model, devices or mesh, micro-batches, hardware, objective), ``schedule``
    (the method), ``mesh`` (the mesh line of a plan with data parallelism), ``search`` and
    ``chosen`` (the mesh-search table's candidates and the one chosen), ``no_pipeline`` (why no
    pipeline, numbers masked), ``stage_rows`` / ``device_rows`` / ``memory_rows`` (table sizes),
    ``training`` (the verdict of ``--run``: ``equal`` or what differs) and ``warnings`` (numbers
    masked). Text without any of them: ``lines``, every non-blank line with its numbers masked.
    """
    lines = [x.rstrip() for x in text.splitlines() if x.strip() and x.strip() != "..."]
    facts: dict[str, object] = {}

    def put(key: str, value: str) -> None:  # a list per fact: an output may hold several plans
        facts.setdefault(key, []).append(value)

    for line in lines:
        if m := re.match(r"^model: (.*)$", line):
            put("model", m.group(1))
        elif m := re.match(r"^fxpipe plan for (.*), schedule (\S+)$", line):
            put("plan", m.group(1))
            put("schedule", m.group(2))
        elif m := re.match(rf"^mesh ({_MESH_TEXT}) on (\d+) devices", line):
            put("mesh", f"{m.group(1)} on {m.group(2)} devices")
        elif line.startswith("no pipeline:"):
            put("no_pipeline", mask_numbers(line))
        elif m := re.match(r"^pipelined vs single-process training: ([^:]+)", line):
            put("training", m.group(1).strip())
    search = [(m.group(1), "(chosen)" in line) for line in lines
              if (m := re.match(rf"^  ({_MESH_TEXT})\s+(?:[\d.]+|-)\s", line))]
    if search:
        facts["search"] = [s for s, _ in search]
        facts["chosen"] = next((s for s, c in search if c), None)
    for key, header in (("stage_rows", "stage device"), ("device_rows", "device     stages"),
                        ("memory_rows", "device     params")):
        n = _table_rows(lines, header)
        if n is not None:
            facts[key] = n
    warns = [mask_numbers(x) for x in lines if x.startswith("warning:")]
    if warns:
        facts["warnings"] = warns
    if not facts:
        facts["lines"] = [mask_numbers(x) for x in lines]
    return facts


def compare(shown: str, fresh: str, ignore: Iterable[str] = ()) -> list[str]:
    """What differs between the structure of a block (``shown``) and of a fresh run's output, one
    sentence per fact (``ignore``: facts not compared)."""
    a, b = structure(shown), structure(fresh)
    out = []
    for key in sorted((set(a) | set(b)) - set(ignore)):
        if a.get(key) != b.get(key):
            if key == "lines":
                diff = next(((x, y) for x, y in zip(a[key], b[key]) if x != y), None) if key in a and key in b else None
                detail = (f"first difference: the block has {diff[0]!r}, a fresh run {diff[1]!r}" if diff else
                          f"the block has {len(a.get(key) or [])} lines, a fresh run {len(b.get(key) or [])}")
                out.append(f"the text differs ({detail})")
            else:
                out.append(f"{key}: the block says {a.get(key)!r}, a fresh run {b.get(key)!r}")
    return out


def shape_output(text: str, marker: Marker) -> str:
    """A fresh run's output as the block shows it: trailing spaces stripped, the memory table left
    out (``omit=memory-table``), the lines ``drop=REGEX`` matches left out, the first ``head=N``
    lines (then ``...``)."""
    lines = [x.rstrip() for x in text.strip("\n").splitlines()]
    if "memory-table" in marker.attrs.get("omit", "").split(","):
        keep, skip = [], False
        for line in lines:
            if line.startswith("memory per device"):
                skip = True
                continue
            if skip and (line.strip().startswith("device ") or re.match(r"^\s*\d", line)):
                continue
            skip = False
            keep.append(line)
        lines = keep
    if marker.attrs.get("drop"):
        lines = [x for x in lines if not re.search(marker.attrs["drop"], x)]
    head = int(marker.attrs.get("head", 0) or 0)
    if head and len(lines) > head:
        lines = lines[:head] + ["..."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- running


class Runner:
    """Runs the commands and programs of output blocks, remembering every output so that several
    checks of one session run each once.

    All the blocks a check needs run in ONE fresh process (``python -m fxpipe.testing.docs
    --run-batch``; ``PYTHONPATH``: the checked tree first): torch and transformers are imported
    once, not once per block. Each block runs in its own temporary working directory, an
    ``fxpipe`` command through :func:`fxpipe.cli.main`, a Python block as ``__main__``, any
    other command as a child process; its standard output is the block's text.
    """

    def __init__(self, root: Path = ROOT, timeout_s: float = RUN_TIMEOUT_S):
        self.root, self.timeout_s = Path(root), timeout_s
        self.outputs: dict[tuple[str, str], str | RuntimeError] = {}

    def prefetch(self, jobs: Iterable[tuple[str, str]]) -> None:
        """Run every ``(kind, text)`` job (``kind``: ``"cmd"`` or ``"python"``) not run yet, in one process."""
        todo = list(dict.fromkeys(j for j in jobs if j not in self.outputs))
        if not todo:
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.root), *filter(None, [os.environ.get("PYTHONPATH")])])}
        with tempfile.TemporaryDirectory(prefix="fxpipe-docs-") as tmp:
            jobs_file, out_file = Path(tmp) / "jobs.json", Path(tmp) / "outputs.json"
            jobs_file.write_text(json.dumps([list(j) for j in todo]))
            argv = [sys.executable, "-m", "fxpipe.testing.docs", "--run-batch", str(jobs_file), str(out_file),
                    "--root", str(self.root)]
            proc = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True,
                                  timeout=self.timeout_s * len(todo))
            if not out_file.is_file():
                tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
                raise RuntimeError(f"the batch of {len(todo)} block(s) exited with {proc.returncode}: {tail}")
            for job, res in zip(todo, json.loads(out_file.read_text())):
                self.outputs[job] = res["stdout"] if res["ok"] else RuntimeError(res["error"])

    def _get(self, job: tuple[str, str]) -> str:
        self.prefetch([job])
        out = self.outputs[job]
        if isinstance(out, RuntimeError):
            raise out
        return out

    def command(self, cmd: str) -> str:
        return self._get(("cmd", cmd))

    def python(self, code: str) -> str:
        return self._get(("python", code))


def _run_job(kind: str, text: str, root: Path) -> str:
    """One block in this process (``--run-batch``): its standard output; raises on failure."""
    buf = io.StringIO()
    if kind == "python":
        with contextlib.redirect_stdout(buf):
            exec(compile(text, "<docs block>", "exec"), {"__name__": "__main__"})  # noqa: S102 - our own pages
        return buf.getvalue()
    tokens = shlex.split(text)
    if tokens[0] == "fxpipe":
        from fxpipe.cli import main as cli_main

        with contextlib.redirect_stdout(buf):
            code = cli_main(tokens[1:])
        if code != 0:
            raise RuntimeError(f"`{text}` exited with {code}")
        return buf.getvalue()
    if tokens[0] in ("python", "python3"):
        tokens = [sys.executable, *tokens[1:]]
    # scripts named relative to the repository run from it whatever the working directory
    argv = [str(root / t) if not os.path.isabs(t) and t.endswith(".py") and (root / t).is_file() else t for t in tokens]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{text}` exited with {proc.returncode}: " + " ".join(proc.stderr.strip().splitlines()[-3:]))
    return proc.stdout


def _run_batch(jobs_file: Path, out_file: Path, root: Path) -> None:
    """``--run-batch``: run the jobs of ``jobs_file`` one after the other, each in a fresh working directory,
    and write ``[{"ok", "stdout" | "error"}]`` to ``out_file``."""
    results = []
    home = os.getcwd()
    for kind, text in json.loads(Path(jobs_file).read_text()):
        with tempfile.TemporaryDirectory(prefix="fxpipe-docs-block-") as cwd:
            os.chdir(cwd)
            try:
                results.append({"ok": True, "stdout": _run_job(kind, text, root)})
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported as the block's failure
                results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            finally:
                os.chdir(home)
    Path(out_file).write_text(json.dumps(results))


def _job(marker: Marker, slow: bool) -> tuple[str, str] | None:
    """The ``(kind, text)`` job that reruns ``marker``'s block in this mode, or None."""
    if marker.kind not in ("output", "python"):
        return None
    if "slow" in marker.flags and not slow:
        return ("cmd", marker.attrs["fast"]) if marker.kind == "output" and "fast" in marker.attrs else None
    return ("python", marker.code.body) if marker.kind == "python" else ("cmd", marker.attrs["cmd"])


def _rerun(marker: Marker, runner: Runner, slow: bool) -> tuple[str | None, bool]:
    """``(fresh output or None when not rerun in this mode, whether it is the displayed command's)``."""
    if "slow" in marker.flags and not slow:
        if marker.kind == "output" and "fast" in marker.attrs:
            return runner.command(marker.attrs["fast"]), False
        return None, False
    if marker.kind == "python":
        return runner.python(marker.code.body), True
    return runner.command(marker.attrs["cmd"]), True


# ---------------------------------------------------------------------------------------------- static checks


def _flat(text: str) -> str:
    """Shell text with continuation lines joined and spaces collapsed."""
    return re.sub(r"[ \t]+", " ", text.replace("\\\n", " "))


def _top_level(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if not p.name.startswith(".") or p.name == ".ci"} - {".git"}


def _repo_path(token: str, tops: set[str]) -> str | None:
    """The repository path a token names (``tests/test_x.py::name`` -> ``tests/test_x.py``), or None."""
    token = token.split("::", 1)[0].rstrip(".,;:)")
    token = re.sub(r":\d+$", "", token)
    if "/" not in token or token.startswith(("/", "http", "~")) or any(c in token for c in "*<>{}|$"):
        return None
    return token if token.split("/", 1)[0] in tops else None


def _commands(body: str) -> list[tuple[int, list[str]]]:
    """``(line offset in the block, tokens)`` of the simple commands of a shell block: continuations
    joined, ``$`` prompts and comments dropped, split at ``&&``, ``||``, ``;`` and ``|``."""
    out = []
    offset = 0
    for line in body.replace("\\\n", "\\ \0").splitlines():
        at, offset = offset, offset + 1 + line.count("\0")
        line = re.sub(r"^\s*\$\s+", "", line.replace("\\ \0", " "))
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        cmd: list[str] = []
        for t in tokens + [";"]:
            if t in ("&&", "||", ";", "|"):
                if cmd:
                    out.append((at, cmd))
                cmd = []
            else:
                cmd.append(t)
    return out


@contextlib.contextmanager
def _quiet():
    err, outp = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(outp):
        yield err


def _parse_fxpipe(args: list[str]) -> str | None:
    """Why ``fxpipe ARGS`` does not parse with the CLI's parser, or None."""
    from fxpipe.cli import build_parser

    with _quiet() as err:
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            if exc.code not in (0, None):
                msg = err.getvalue().strip().splitlines()
                return msg[-1] if msg else f"exit {exc.code}"
    return None


def _script_flags(script: Path) -> str:
    """The source of ``script`` and of the sibling modules it imports (where its flags may be declared)."""
    text = script.read_text()
    for name in re.findall(r"^\s*(?:from|import)\s+(_?\w+)", text, re.M):
        sib = script.parent / f"{name}.py"
        if sib.is_file() and sib != script:
            text += sib.read_text()
    return text


def check_command(tokens: list[str], root: Path, tops: set[str]) -> list[str]:
    """Why one simple command of a page would fail before it runs (empty: nothing found)."""
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):  # VAR=value prefixes
        tokens = tokens[1:]
    if not tokens:
        return []
    out = []
    head = tokens[0]
    if head == "fxpipe":
        why = _parse_fxpipe(tokens[1:])
        if why:
            out.append(f"`{shlex.join(tokens)}` does not parse: {why}")
    elif head in ("python", "python3") and len(tokens) > 1:
        if tokens[1] == "-m" and len(tokens) > 2:
            mod = tokens[2]
            try:
                found = importlib.util.find_spec(mod) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                out.append(f"`python -m {mod}`: no module {mod}")
        elif tokens[1].endswith(".py"):
            script = root / tokens[1]
            if not script.is_file():
                out.append(f"`{shlex.join(tokens)}`: {tokens[1]} does not exist")
            else:
                source = _script_flags(script)
                for t in tokens[2:]:
                    flag = t.split("=", 1)[0]
                    if re.match(r"^--[a-z][\w-]*$", flag) and f'"{flag}"' not in source and f"'{flag}'" not in source:
                        out.append(f"`{shlex.join(tokens)}`: {tokens[1]} has no option {flag}")
    script = tokens[1] if head in ("python", "python3") and len(tokens) > 1 else None
    for t in tokens[1:]:
        if t == script:
            continue  # reported above
        for piece in t.split("=", 1)[-1:] + ([t] if "=" in t else []):
            path = _repo_path(piece, tops)
            if path and not (root / path).exists():
                out.append(f"`{shlex.join(tokens)}` names {path}, which does not exist")
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(text: str) -> set[str]:
    out, seen = set(), {}
    in_fence = False
    for line in text.splitlines():
        if re.match(r"^ {0,3}(```|~~~)", line):
            in_fence = not in_fence
        if in_fence:
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = _slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def _resolve_dotted(name: str) -> bool:
    """Whether ``fxpipe.a.b.c`` is a module or an attribute reachable from one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        mod_name = ".".join(parts[:i])
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        obj = mod
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _prose(page: Page) -> list[tuple[int, str]]:
    """(line number, text) of every line outside fenced blocks."""
    inside = set()
    for f in page.fences:
        inside.update(range(f.first - 1, f.last + 1))
    return [(i + 1, line) for i, line in enumerate(page.text.splitlines()) if i not in inside]


def static_problems(pages: list[Page], root: Path = ROOT) -> list[Problem]:
    """Every problem found without running a command (see the module's docstring)."""
    tops = _top_level(root)
    anchors = {p.path: _anchors(p.text) for p in pages}
    out: list[Problem] = []
    for page in pages:
        shell_text = _flat("\n".join(f.body for f in page.fences if f.lang in SHELL))
        for fence in page.fences:
            if fence.lang in SHELL:
                for at, cmd in _commands(fence.body):
                    out += [Problem(page.path, fence.line + 1 + at, w) for w in check_command(cmd, root, tops)]
        for mk in page.markers:
            for key in ("cmd", "fast", "script"):
                if key in mk.attrs:
                    for _, cmd in _commands(mk.attrs[key]):
                        out += [Problem(page.path, mk.line, w) for w in check_command(cmd, root, tops)]
            if mk.kind == "output" and _flat(mk.attrs["cmd"]) not in shell_text:
                out.append(Problem(page.path, mk.line, f"the output block's command `{mk.attrs['cmd']}` is not shown "
                                                       "in a shell block of the page"))
        images = []
        for n, line in _prose(page):
            for code in re.findall(r"`([^`]+)`", line):
                path = _repo_path(code.strip(), tops) if " " not in code.strip() else None
                if path and not (root / path).exists():
                    out.append(Problem(page.path, n, f"`{code}` names {path}, which does not exist"))
                m = re.match(r"^(fxpipe(?:\.\w+)+)(?:\(.*)?$", code.strip())
                if m and not _resolve_dotted(m.group(1)):
                    out.append(Problem(page.path, n, f"`{code}`: {m.group(1)} is not a module or attribute of fxpipe"))
            for is_image, target in re.findall(r"(!?)\[[^\]]*\]\(([^)\s]+)[^)]*\)", line):
                if re.match(r"^[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(page.path), file)) if file else page.path
                if file and not (root / dest).exists():
                    out.append(Problem(page.path, n, f"the link {target} names {dest}, which does not exist"))
                elif anchor and dest.endswith(".md"):
                    known = anchors.get(dest) if dest in anchors else _anchors((root / dest).read_text())
                    if anchor not in known:
                        out.append(Problem(page.path, n, f"the link {target}: {dest} has no heading #{anchor}"))
                if is_image:
                    images.append((n, dest))
        figures = sorted(mk.line for mk in page.markers if mk.kind == "figure")
        for n, dest in images:
            if not any(f < n and not any(f < m < n for m, _ in images) for f in figures):
                out.append(Problem(page.path, n, f"the image {dest} has no `{MARK} figure` marker naming the script "
                                                 "that produces it"))
    out += _ci_in_step(pages, root)
    return out


def _ci_in_step(pages: list[Page], root: Path) -> list[Problem]:
    """The README shows the set-up commands ``.ci/run`` runs (its lines marked ``# README: set up, step N``)."""
    ci = root / ".ci" / "run"
    readme = next((p for p in pages if p.path == "README.md"), None)
    if not ci.is_file() or readme is None:
        return []
    shown = "\n".join(re.sub(r"\bpython3\b", "python", f.body) for f in readme.fences if f.lang in SHELL)
    out = []
    for n, line in enumerate(ci.read_text().splitlines(), 1):
        m = re.match(r"^(.*?)#\s*README: set up, step (\d+)", line)
        if m:
            cmd = re.sub(r"\s+--(quiet|disable-pip-version-check)\b", "", m.group(1)).strip()
            cmd = re.sub(r"\bpython3\b", "python", cmd)
            if cmd not in shown:
                out.append(Problem("README.md", 1, f".ci/run:{n} runs `{cmd}` (set-up step {m.group(2)}), which the "
                                                   "README's shell blocks do not show"))
    return out


# ---------------------------------------------------------------------------------------------- check / update


def check(root: Path = ROOT, *, texts: Mapping[str, str] | None = None, slow: bool = False,
          runner: Runner | None = None, run: bool = True) -> list[Problem]:
    """Every problem of README.md and docs/*.md under ``root``.

    Parameters
    ----------
    root : Path
        The repository (its pages, the paths they name, the ``fxpipe`` the commands run).
    texts : mapping of str to str, optional
        Page texts by relative path, in place of the files (a test edits a block this way).
    slow : bool
        Rerun the ``slow`` output blocks too (else their ``fast`` command, if any).
    runner : Runner, optional
        Runs the commands (and remembers their outputs: pass one runner to several checks).
    run : bool
        False: the static checks only.

    Returns
    -------
    list of Problem
        Empty when every claim holds.
    """
    root = Path(root)
    try:
        pages = doc_pages(root, texts)
    except MarkerError as exc:
        return [Problem(exc.path, exc.line, exc.what)]
    out = static_problems(pages, root)
    if not run:
        return out
    runner = runner or Runner(root)
    try:
        runner.prefetch(j for page in pages for mk in page.markers if (j := _job(mk, slow)) is not None)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return out + [Problem("docs", 0, f"rerunning the output blocks failed: {exc}")]
    for page in pages:
        for mk in page.markers:
            if mk.kind not in ("output", "python"):
                continue
            try:
                fresh, displayed = _rerun(mk, runner, slow)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                out.append(Problem(page.path, mk.line, f"rerunning the block failed: {exc}"))
                continue
            if fresh is None:
                continue
            ignore = set(filter(None, mk.attrs.get("ignore", "").split(",")))
            if not displayed:  # the fast command: compare what it shares with the displayed one
                ignore |= set(structure(mk.target.body)) - set(structure(fresh))
                ignore |= set(filter(None, mk.attrs.get("fast-ignore", "").split(",")))
            for what in compare(mk.target.body, shape_output(fresh, mk), ignore):
                how = "" if displayed else f" (checked with its fast command `{mk.attrs['fast']}`)"
                out.append(Problem(page.path, mk.target.line, f"output block{how}: {what}; `python -m "
                                                              "fxpipe.testing.docs --update` rewrites it"))
    return out


def update(root: Path = ROOT, *, slow: bool = False, runner: Runner | None = None,
           write: Callable[[Path, str], None] | None = None) -> list[str]:
    """Rewrite every rerun output block (``slow`` ones only with ``slow``) from a fresh run; returns
    ``page:line`` of each block changed."""
    root = Path(root)
    runner = runner or Runner(root)
    changed = []
    pages = doc_pages(root)
    runner.prefetch(j for page in pages for mk in page.markers if (j := _job(mk, True)) is not None and
                    ("slow" not in mk.flags or slow))
    for page in pages:
        lines = page.text.splitlines()
        edits = []
        for mk in page.markers:
            if mk.kind not in ("output", "python") or ("slow" in mk.flags and not slow):
                continue
            fresh, _ = _rerun(mk, runner, True)
            new = shape_output(fresh, mk)
            if new != mk.target.body.rstrip("\n"):
                edits.append((mk.target.first, mk.target.last, new))
                changed.append(f"{page.path}:{mk.target.line}")
        for first, last, new in sorted(edits, reverse=True):
            lines[first:last] = new.splitlines()
        if edits:
            text = "\n".join(lines) + ("\n" if page.text.endswith("\n") else "")
            (write or _write_atomic)(root / page.path, text)
    return changed


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m fxpipe.testing.docs --check | --update [--slow] [--static] [--root DIR]``."""
    ap = argparse.ArgumentParser(prog="python -m fxpipe.testing.docs", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="check every claim; exit 1 with the problems")
    mode.add_argument("--update", action="store_true", help="rewrite the rerun output blocks from fresh runs")
    ap.add_argument("--slow", action="store_true", help="rerun the slow blocks too (the main job's training, ...)")
    ap.add_argument("--static", action="store_true", help="with --check: run nothing (commands, paths, links only)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (default: the one this module is in)")
    mode.add_argument("--run-batch", nargs=2, metavar=("JOBS", "OUT"), type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_batch:
        _run_batch(*args.run_batch, args.root)
        return 0
    if args.update:
        for where in update(args.root, slow=args.slow):
            print(f"updated {where}")
        return 0
    problems = check(args.root, slow=args.slow, run=not args.static)
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s) in README.md and docs/" if problems else "README.md and docs/: every claim holds")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
