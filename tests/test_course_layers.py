"""The course's layering rule, checked on the source text.

    A module built in notebook NN imports only modules of notebooks <= NN, and there is no
    import cycle; the learner notebook NN contains no code of a later milestone.

Why: the milestones *add*, they don't rewrite. A learner who has finished notebook NN has
exactly the modules of notebooks 01..NN, and notebook NN must show milestone NN: if
``engine.py`` (notebook 03) imported ``compile.py`` (notebook 07), the learner's notebook 03
would contain code they only write four notebooks later, and the package would not import
for a learner who stopped at notebook 03. Later milestones plug into earlier code through
explicit extension points instead (a table of ``"module:attr"`` strings resolved with
``importlib`` at run time, the way vLLM names its ``worker_cls``): that is not an ``import``
statement, so this checker does not see it, on purpose.

Everything here is read with :mod:`ast`; no module of the package is imported.

* The notebook of a generated module is read from its first line,
  ``# Generated from solutions/NN_topic.ipynb by ...``.
* ``minivllm/course/checks_NN.py`` grades notebook NN, so it belongs to notebook NN.
* Infrastructure: ``minivllm/__init__.py``, ``minivllm/__main__.py`` and the other hand-written
  files of ``minivllm/course/`` (``grading.py``, ``notebooks.py``, ...). They belong to no
  notebook: importing them is always allowed, and their own imports are not checked (the
  package ``__init__`` re-exports ``LLM`` etc. lazily for every notebook's convenience).
  Hence ``from minivllm import LLM`` counts as an import of the package ``__init__``,
  while ``from minivllm import kv_cache`` (a submodule) counts as an import of ``kv_cache``.
* Every ``import`` statement counts: module level, inside functions, under ``if``/``try``
  (``TYPE_CHECKING`` included), absolute or relative. Nothing is exempted; an import of a
  ``minivllm`` module that does not exist is reported too, since the rule cannot be checked
  for it.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "minivllm"

GENERATED_RE = re.compile(r"^# Generated from solutions/(\d+)_\S*\.ipynb\b")
CHECKS_RE = re.compile(r"^checks_(\d+)\.py$")
NOTEBOOK_RE = re.compile(r"^(\d+)_\S*\.ipynb$")

INFRASTRUCTURE = "infrastructure"  # the "notebook" of a hand-written, course-wide module


@dataclass(frozen=True)
class Import:
    """One ``import`` statement's effect: ``where`` (file:line or cell) imports ``target``.

    ``target`` is the dotted name of the ``minivllm`` module it loads, or ``None`` when the
    name written (``written``) is no module of the package.
    """

    where: str
    target: str | None
    written: str


# --- which module, which notebook ------------------------------------------------------------


def module_name(path: Path, package_root: Path) -> str:
    """``minivllm/server/app.py`` -> ``minivllm.server.app``; a package's ``__init__.py`` is
    the package itself (``minivllm/bench/__init__.py`` -> ``minivllm.bench``)."""
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def notebook_of_module(path: Path, package_root: Path) -> int | str | None:
    """The notebook number a module belongs to, ``INFRASTRUCTURE``, or ``None`` (unclassified).

    Generated modules name their notebook in the header; ``course/checks_NN.py`` belongs to
    notebook NN; the package's ``__init__``/``__main__`` and the rest of ``course/`` are
    infrastructure. Anything else is ``None``: a hand-written module nobody placed.
    """
    with path.open(encoding="utf-8") as f:
        first = f.readline()
    match = GENERATED_RE.match(first)
    if match:
        return int(match.group(1))
    relative = path.relative_to(package_root)
    if relative.parts[0] == "course":
        checks = CHECKS_RE.match(relative.name)
        return int(checks.group(1)) if checks else INFRASTRUCTURE
    if relative.as_posix() in ("__init__.py", "__main__.py"):
        return INFRASTRUCTURE
    return None


def notebook_of_file(path: Path) -> int:
    """``notebooks/03_continuous_batching.ipynb`` -> 3."""
    match = NOTEBOOK_RE.match(path.name)
    assert match, f"{path}: a course notebook is named NN_topic.ipynb"
    return int(match.group(1))


def label(notebook: int | str | None) -> str:
    """How a notebook is printed: ``notebook 03``, ``infrastructure``, ``unclassified``."""
    if isinstance(notebook, int):
        return f"notebook {notebook:02d}"
    return notebook or "unclassified"


# --- which imports -----------------------------------------------------------------------------


def absolute_base(node: ast.ImportFrom, current: str, is_package: bool) -> str:
    """The absolute dotted name ``from <here> import ...`` starts from.

    For ``from .grading import x`` in ``minivllm.course.checks_02`` that is
    ``minivllm.course.grading``; ``from . import x`` is ``minivllm.course``.
    """
    if node.level == 0:
        return node.module or ""
    package = current.split(".") if is_package else current.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def resolve(name: str, modules: set[str]) -> str | None:
    """The module ``import <name>`` loads, or ``None`` if ``name`` is no module we have."""
    return name if name in modules else None


def imports_of(
    tree: ast.AST, current: str, is_package: bool, modules: set[str], where: str
) -> list[Import]:
    """Every import of a ``minivllm`` module anywhere in ``tree`` (functions included).

    ``import minivllm.x.y`` loads ``minivllm.x.y``; ``from minivllm.x import y`` loads
    ``minivllm.x.y`` when that is a module and ``minivllm.x`` otherwise (``y`` is then a name
    defined in it). A statement importing several names of one module counts once.
    ``where`` says where the statement is, with ``{line}`` for its line
    number, e.g. ``"minivllm/engine.py:{line}"``.
    """
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    target = resolve(alias.name, modules)
                    found.append(Import(where.format(line=node.lineno), target, alias.name))
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(node, current, is_package)
            if base != PACKAGE and not base.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.append(Import(where.format(line=node.lineno), sub, sub))
                else:
                    found.append(
                        Import(where.format(line=node.lineno), resolve(base, modules), base)
                    )
    return list(dict.fromkeys(found))  # ``from m import a, b`` is one import of ``m``


def cell_source(source: str) -> str:
    """A notebook code cell as Python: IPython lines (``%magic``, ``!shell``) become blank,
    so that line numbers stay those of the cell."""
    return "\n".join(
        "" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()
    )


def parse_cell(source: str, where: str) -> ast.AST:
    """Parse one code cell; top-level ``await`` is allowed, as IPython allows it."""
    flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    return compile(cell_source(source), where, "exec", flags=flags, dont_inherit=True)


# --- the rule ----------------------------------------------------------------------------------


def forward_imports(
    imports: dict[str, list[Import]], notebook_of: dict[str, int | str | None]
) -> list[str]:
    """The violations of "notebook NN imports only notebooks <= NN", one line each.

    ``imports`` maps an importing module (or notebook) to its imports and ``notebook_of``
    gives every module's (and importer's) notebook. Importers that are infrastructure are
    not checked; importing infrastructure is always allowed; importing a name that is no
    module of the package is reported, as it cannot be checked.
    """
    problems = []
    for source, found in imports.items():
        mine = notebook_of[source]
        if not isinstance(mine, int):
            continue
        for imp in found:
            if imp.target is None:
                problems.append(
                    f"{imp.where} ({label(mine)}) imports {imp.written} (no such module)"
                )
                continue
            theirs = notebook_of[imp.target]
            if theirs is None or (isinstance(theirs, int) and theirs > mine):
                problems.append(
                    f"{imp.where} ({label(mine)}) imports {imp.target} ({label(theirs)})"
                )
    return problems


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the strongly connected components of ``graph`` (node -> successors).

    Iterative, so a long chain of imports cannot overflow Python's recursion limit.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def shortest_cycle_through(start: str, graph: dict[str, set[str]], within: set[str]) -> list[str]:
    """The shortest import chain ``start -> ... -> start`` inside ``within`` (breadth first)."""
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, ())):
            if nxt not in within:
                continue
            if nxt == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(previous[chain[-1]])
                return [start, *reversed(chain[:-1]), start] if node != start else [start, start]
            if nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    return []


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles of ``graph``, each a chain ``[a, b, ..., a]``.

    For every strongly connected component with a cycle, the shortest cycle through each of
    its members (the same cycle found from two members is listed once).
    """
    cycles, seen = [], set()
    for component in strongly_connected(graph):
        members = set(component)
        if len(component) == 1 and component[0] not in graph.get(component[0], ()):
            continue
        for node in component:
            cycle = shortest_cycle_through(node, graph, members)
            key = frozenset(itertools.pairwise(cycle))
            if cycle and key not in seen:
                seen.add(key)
                cycles.append(cycle)
    return cycles


# --- the repository ----------------------------------------------------------------------------


def package_modules(package_root: Path) -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {module_name(path, package_root): path for path in sorted(package_root.rglob("*.py"))}


def module_imports(modules: dict[str, Path], package_root: Path) -> dict[str, list[Import]]:
    """For each module of the package, its imports of ``minivllm`` modules."""
    names = set(modules)
    found = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        where = path.relative_to(package_root.parent).as_posix() + ":{line}"
        found[name] = imports_of(tree, name, path.name == "__init__.py", names, where)
    return found


def notebook_imports(path: Path, modules: set[str]) -> tuple[list[Import], list[str]]:
    """A notebook's imports of ``minivllm`` modules, from all its code cells, and the cells
    that do not parse (reported, not skipped). Cells are numbered from 0, as in the file."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found, unparsable = [], []
    for number, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = cell["source"]
        source = "".join(source) if isinstance(source, list) else source
        cell_name = f"{path.relative_to(REPO).as_posix()} cell {number}"
        try:
            tree = parse_cell(source, cell_name)
        except SyntaxError as error:
            unparsable.append(f"{cell_name}: does not parse ({error.msg}, line {error.lineno})")
            continue
        found += imports_of(tree, "__main__", False, modules, cell_name + " line {line}")
    return found, unparsable


PACKAGE_ROOT = REPO / PACKAGE
MODULES = package_modules(PACKAGE_ROOT)
NOTEBOOK_OF = {name: notebook_of_module(path, PACKAGE_ROOT) for name, path in MODULES.items()}
IMPORTS = module_imports(MODULES, PACKAGE_ROOT)


def report(title: str, lines: list[str]) -> str:
    """An assertion message: a title and one violation per line."""
    return f"{title} ({len(lines)}):\n" + "\n".join(f"  {line}" for line in lines)


# --- the tests ---------------------------------------------------------------------------------


def test_every_module_belongs_to_a_notebook_or_is_infrastructure():
    unclassified = [
        MODULES[name].relative_to(REPO).as_posix()
        for name, notebook in NOTEBOOK_OF.items()
        if notebook is None
    ]
    assert not unclassified, report(
        "modules with no '# Generated from solutions/NN_...' header that are not course "
        "infrastructure",
        unclassified,
    )


def test_no_module_imports_a_later_notebook():
    problems = forward_imports(IMPORTS, NOTEBOOK_OF)
    assert not problems, report("imports of a later notebook's module", problems)


def test_no_import_cycles():
    graph = {
        name: {
            imp.target
            for imp in found
            if imp.target is not None and NOTEBOOK_OF[imp.target] != INFRASTRUCTURE
        }
        for name, found in IMPORTS.items()
        if NOTEBOOK_OF[name] != INFRASTRUCTURE
    }
    cycles = import_cycles(graph)
    lines = []
    for cycle in cycles:
        lines.append(" -> ".join(cycle))
        for a, b in itertools.pairwise(cycle):
            at = sorted({imp.where for imp in IMPORTS[a] if imp.target == b})
            lines.append(f"    {a} -> {b}: {', '.join(at)}")
    assert not cycles, report("import cycles between minivllm modules", lines)


def test_notebooks_contain_no_later_milestone():
    imports: dict[str, list[Import]] = {}
    notebook_of: dict[str, int | str | None] = dict(NOTEBOOK_OF)
    unparsable = []
    notebooks = sorted((REPO / "notebooks").glob("[0-9]*.ipynb"))
    solutions = sorted((REPO / "solutions").glob("[0-9]*.ipynb"))
    assert notebooks and solutions, "no course notebooks found"
    for path in notebooks + solutions:
        key = path.relative_to(REPO).as_posix()
        imports[key], bad = notebook_imports(path, set(MODULES))
        notebook_of[key] = notebook_of_file(path)
        unparsable += bad
    problems = forward_imports(imports, notebook_of)
    assert not (problems or unparsable), report(
        "notebook cells that import a later notebook's module (or cannot be checked)",
        unparsable + problems,
    )


def test_the_checker_finds_forward_imports_and_cycles():
    """The rule's helpers on a tiny made-up package, so the tests above are not vacuous."""
    names = {
        "minivllm",
        "minivllm.a",
        "minivllm.b",
        "minivllm.c",
        "minivllm.pkg",
        "minivllm.pkg.sub",
    }
    source_a = "import minivllm\n\ndef f():\n    from minivllm import b, TINY\n"
    source_b = "from minivllm.c import x\n"
    source_c = "from .b import y\nfrom minivllm.nope import z\n"
    source_sub = "from . import sub\nfrom .. import a\n"
    imports = {
        "minivllm.a": imports_of(ast.parse(source_a), "minivllm.a", False, names, "a.py:{line}"),
        "minivllm.b": imports_of(ast.parse(source_b), "minivllm.b", False, names, "b.py:{line}"),
        "minivllm.c": imports_of(ast.parse(source_c), "minivllm.c", False, names, "c.py:{line}"),
        "minivllm.pkg": imports_of(
            ast.parse(source_sub), "minivllm.pkg", True, names, "pkg/__init__.py:{line}"
        ),
    }
    assert [i.target for i in imports["minivllm.a"]] == ["minivllm", "minivllm.b", "minivllm"]
    assert [i.target for i in imports["minivllm.pkg"]] == ["minivllm.pkg.sub", "minivllm.a"]
    notebook_of = {
        "minivllm": INFRASTRUCTURE,
        "minivllm.a": 1,
        "minivllm.b": 2,
        "minivllm.c": 2,
        "minivllm.pkg": 3,
        "minivllm.pkg.sub": 3,
    }
    assert forward_imports(imports, notebook_of) == [
        "a.py:4 (notebook 01) imports minivllm.b (notebook 02)",
        "c.py:2 (notebook 02) imports minivllm.nope (no such module)",
    ]
    graph = {
        name: {i.target for i in found if i.target and i.target != "minivllm"}
        for name, found in imports.items()
    }
    assert import_cycles(graph) == [["minivllm.b", "minivllm.c", "minivllm.b"]]
    assert import_cycles({"x": {"x"}}) == [["x", "x"]]
    assert import_cycles({"x": {"y"}, "y": {"z"}, "z": {"x", "w"}, "w": set()}) == [
        ["x", "y", "z", "x"]
    ]
    assert cell_source("%matplotlib inline\n!ls\nx = 1") == "\n\nx = 1"
    assert parse_cell("await f()", "cell").body
    cell = parse_cell("%matplotlib inline\nfrom minivllm.course.checks_03 import check", "nb")
    names = {"minivllm.course", "minivllm.course.checks_03"}
    found = {"nb": imports_of(cell, "__main__", False, names, "nb line {line}")}
    assert forward_imports(found, {"nb": 1, "minivllm.course.checks_03": 3}) == [
        "nb line 2 (notebook 01) imports minivllm.course.checks_03 (notebook 03)"
    ]
