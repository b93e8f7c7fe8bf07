"""Architecture rules of the source tree (issue 20), checked statically on ``fxpipe/``'s AST.

* No import cycle between fxpipe modules, module-level and function-local imports both counted
  (the same edges as the project's structure figures): ``from fxpipe.pkg import name`` is an edge
  to ``fxpipe.pkg`` and, when ``name`` is a submodule, to ``fxpipe.pkg.name``; a package's
  ``__init__`` importing its submodules counts.
* Module-level imports form no cycle either once each import also runs the ``__init__`` of the
  packages it enters: such a cycle fails with "partially initialized module" when one of its
  modules is imported first, although every module imports fine after the others.
* The planning side stays torch-free: ``fxpipe/partition``, ``schedule``, ``mip`` and ``ir`` never
  import torch, not even inside a function, nor any fxpipe module that does; the other torch-free
  modules import none of torch, numba, pyscipopt, matplotlib or transformers when imported (their
  module-level imports, followed through fxpipe). ``test_schedule_multistage`` checks the
  first at run time for module-level imports of a few packages; this covers every module.
* At most :data:`MAX_LONG_FUNCTIONS` functions longer than 150 lines.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fxpipe"

#: Packages and modules that plan without torch: they never import torch, directly or through fxpipe.
NEVER_TORCH = ("fxpipe.partition", "fxpipe.schedule", "fxpipe.mip", "fxpipe.ir")
#: Modules (and packages) whose import loads none of :data:`HEAVY` (they may import them inside functions).
LIGHT = NEVER_TORCH + ("fxpipe.memory", "fxpipe.mesh", "fxpipe.planner", "fxpipe.options",
                       "fxpipe.progress", "fxpipe.io", "fxpipe.errors", "fxpipe.report", "fxpipe.cost.specs")
HEAVY = ("torch", "numba", "pyscipopt", "matplotlib", "transformers")
#: Heavy packages that some LIGHT modules may load when imported: the partitioner's numba kernels and the
#: MIP solver are what those modules are for.
LIGHT_EXCEPT = {"fxpipe.partition": ("numba", "pyscipopt"), "fxpipe.mip": ("pyscipopt",)}
MAX_LONG_FUNCTIONS = 5
LONG_LINES = 150


@dataclass
class _Module:
    path: Path
    fxpipe_module_level: set[str] = field(default_factory=set)   # fxpipe import targets, module level
    fxpipe_local: set[str] = field(default_factory=set)          # fxpipe import targets inside functions
    third_module_level: dict[str, int] = field(default_factory=dict)  # top-level package -> line
    third_local: dict[str, int] = field(default_factory=dict)
    long_functions: list[tuple[str, int]] = field(default_factory=list)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


@lru_cache(maxsize=1)
def _modules() -> dict[str, _Module]:
    """Every module of the package with its imports (fxpipe targets unresolved) and long functions."""
    mods: dict[str, _Module] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        mod = mods[name] = _Module(path)
        is_pkg = path.name == "__init__.py"

        def visit(node: ast.AST, local: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    for c in child.orelse:
                        visit_one(c, local)
                    continue
                visit_one(child, local)

        def visit_one(child: ast.AST, local: bool) -> None:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n_lines = child.end_lineno - child.lineno + 1
                if n_lines > LONG_LINES:
                    mod.long_functions.append((child.name, n_lines))
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = name.split(".")
                    keep = len(parts) - child.level + (1 if is_pkg else 0)
                    base = ".".join(parts[:keep] + ([child.module] if child.module else []))
                if base == "fxpipe" or base.startswith("fxpipe."):
                    targets = {base} | {f"{base}.{a.name}" for a in child.names}
                    (mod.fxpipe_local if local else mod.fxpipe_module_level).update(targets)
                else:
                    (mod.third_local if local else mod.third_module_level).setdefault(base.split(".")[0], child.lineno)
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name == "fxpipe" or a.name.startswith("fxpipe."):
                        (mod.fxpipe_local if local else mod.fxpipe_module_level).add(a.name)
                    else:
                        (mod.third_local if local else mod.third_module_level).setdefault(a.name.split(".")[0],
                                                                                          child.lineno)
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text(), filename=str(path)), False)
    return mods


def _resolve(target: str, mods) -> str | None:
    """The module an import target names: itself, else its longest prefix that is a module."""
    while target and target not in mods:
        target = target.rpartition(".")[0]
    return target or None


def _graph(*, local: bool, packages_run: bool) -> nx.DiGraph:
    """Import graph between fxpipe modules (the root package ``fxpipe`` left out: it imports lazily).

    ``local``: count function-local imports too. ``packages_run``: an import of ``fxpipe.a.b``
    from outside ``fxpipe.a`` is also an edge to ``fxpipe.a`` (Python runs its ``__init__`` first).
    """
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, mod in mods.items():
        targets = mod.fxpipe_module_level | (mod.fxpipe_local if local else set())
        for t in targets:
            t = _resolve(t, mods)
            if t is None or t == name or t == "fxpipe":
                continue
            g.add_edge(name, t)
            if packages_run:
                parent = t.rpartition(".")[0]
                while parent not in ("", "fxpipe"):
                    if not (name == parent or name.startswith(parent + ".")):
                        g.add_edge(name, parent)
                    parent = parent.rpartition(".")[0]
    return g


def _cycles(g: nx.DiGraph) -> list[str]:
    """One cycle of every strongly connected component of more than one module, as text."""
    found = []
    for comp in nx.strongly_connected_components(g):
        if len(comp) > 1:
            cycle = nx.find_cycle(g.subgraph(comp))
            found.append(" -> ".join([u for u, _ in cycle] + [cycle[0][0]]))
    return sorted(found)


def _within(name: str, roots) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def test_no_import_cycle_between_fxpipe_modules():
    cycles = _cycles(_graph(local=True, packages_run=False))
    assert not cycles, ("import cycles between fxpipe modules (module-level and function-local imports; "
                        "import from the defining submodule, or move the shared code down a layer):\n  "
                        + "\n  ".join(cycles))


def test_module_level_imports_have_no_cycle_through_package_inits():
    cycles = _cycles(_graph(local=False, packages_run=True))
    assert not cycles, ("module-level imports form a cycle once package __init__ files are counted (importing "
                        "one of these modules first fails with 'partially initialized module'):\n  "
                        + "\n  ".join(cycles))


def test_planning_packages_never_import_torch():
    mods = _modules()
    g = _graph(local=True, packages_run=True)
    direct = {n for n, m in mods.items() if "torch" in m.third_module_level or "torch" in m.third_local}
    bad = []
    for name in mods:
        if not _within(name, NEVER_TORCH):
            continue
        paths = nx.single_source_shortest_path(g, name)
        culprits = sorted(paths.keys() & direct, key=lambda c: (len(paths[c]), c))
        if culprits:  # the shortest of its ways to torch
            bad.append(" -> ".join(paths[culprits[0]]) + " (imports torch)")
    assert not bad, "fxpipe/partition, schedule, mip and ir must never import torch:\n  " + "\n  ".join(bad)


def test_torch_free_modules_load_no_heavy_package_when_imported():
    mods = _modules()
    g = _graph(local=False, packages_run=True)
    bad = []
    for name in mods:
        if not _within(name, LIGHT):
            continue
        allowed = next((v for k, v in LIGHT_EXCEPT.items() if _within(name, (k,))), ())
        for dep in sorted(nx.descendants(g, name) | {name}):
            for pkg, line in sorted(mods[dep].third_module_level.items()):
                if pkg in HEAVY and pkg not in allowed:
                    chain = " -> ".join(nx.shortest_path(g, name, dep))
                    bad.append(f"{chain}: {mods[dep].path.relative_to(ROOT)}:{line} imports {pkg}")
    assert not bad, ("torch-free modules must import heavy packages inside the functions that need them:\n  "
                     + "\n  ".join(bad))


def test_few_functions_over_150_lines():
    long = sorted(((n, m.path.relative_to(ROOT).as_posix(), f) for m in _modules().values()
                   for f, n in m.long_functions), reverse=True)
    assert len(long) <= MAX_LONG_FUNCTIONS, (
        f"{len(long)} functions over {LONG_LINES} lines (at most {MAX_LONG_FUNCTIONS}: split them into named "
        "steps):\n  " + "\n  ".join(f"{path} {fn}: {n} lines" for n, path, fn in long))


#: Modules allowed at the package's top level besides these (issue 32): one package per concept below.
TOP_LEVEL_FREE = ("__init__", "errors", "api")
MAX_TOP_LEVEL_MODULES = 8


def test_top_level_holds_few_modules():
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in TOP_LEVEL_FREE)
    assert len(loose) <= MAX_TOP_LEVEL_MODULES, (
        f"fxpipe/ has {len(loose)} top-level modules besides {', '.join(TOP_LEVEL_FREE)} ({', '.join(loose)}); "
        f"at most {MAX_TOP_LEVEL_MODULES}: put modules of one concept into its package (fxpipe/plan/, fxpipe/mesh/, ...)")
