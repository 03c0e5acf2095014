"""Export and strip: the two transformations that keep the course in sync.

``solutions/NN_topic.ipynb`` is the single source. From it we generate

* ``minivllm/<module>.py`` — every code cell whose first line is ``# export: <module>``,
  in notebook order (*export*); a dotted name is a file in a subpackage
  (``# export: bench.metrics`` -> ``minivllm/bench/metrics.py``, ``bench.__init__`` ->
  ``minivllm/bench/__init__.py``), and

* ``notebooks/NN_topic.ipynb`` — the learner's copy, with each ``### BEGIN SOLUTION`` …
  ``### END SOLUTION`` region replaced by a ``raise NotImplementedError(...)`` stub and all
  outputs cleared (*strip*).

Both are pure functions of the solution notebooks and byte-stable, so a ``--check`` run can
prove that the committed package and learner notebooks are exactly what the solutions say.
Every generated module starts with ``HEADER``, so a module that no notebook exports any more
(renamed, moved into a subpackage) is recognisable: ``export`` deletes it and ``check`` reports
it, and a hand-written file (no header) is never touched.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from collections.abc import Callable
from pathlib import Path

import nbformat

EXPORT_RE = re.compile(r"^#\s*export:\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*$")
BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION(?:[ \t]+(?P<label>.*?))?[ \t]*$")
END_RE = re.compile(r"^[ \t]*### END SOLUTION[ \t]*$")
DEFAULT_LABEL = "Exercise: replace this line with your solution"
KEEP_CELL_METADATA = ("tags", "editable", "deletable")
RESERVED_MODULES = frozenset({"__init__", "__main__", "course"})  # hand-written, never exported
PACKAGE_FILES = frozenset({"__init__", "__main__"})  # may only end a dotted module name
HEADER = (
    "# Generated from {source} by `python -m minivllm.course export`.\n"
    "# Edit the notebook, not this file.\n\n"
)

GENERATED_RE = re.compile(r"^# Generated from \S+ by `python -m minivllm\.course export`\.$")

Echo = Callable[[str], None]


class CourseError(ValueError):
    """A solution or learner notebook breaks the course conventions (the message says where)."""


# --- locations -------------------------------------------------------------------------------


def package_dir() -> Path:
    """The directory of the installed ``minivllm`` package (where modules are exported to)."""
    import minivllm

    return Path(minivllm.__file__).parent


def repo_root() -> Path:
    """The repository root: the parent of the package directory (holds solutions/, tests/)."""
    return package_dir().resolve().parent


def _display(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` in POSIX form when inside it, else its file name."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.name


# --- reading and writing notebooks ------------------------------------------------------------


def read_notebook(path: Path) -> nbformat.NotebookNode:
    """Read a v4 notebook, giving id-less cells deterministic ids (nbformat would pick random
    ones, which would make the stripped copy differ on every run)."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if (raw.get("nbformat"), raw.get("nbformat_minor", 0)) >= (4, 5):
        for i, cell in enumerate(raw.get("cells", [])):
            cell.setdefault("id", f"{Path(path).stem[:48]}-{i}")
    return nbformat.reads(json.dumps(raw), as_version=4)


def notebook_text(nb: nbformat.NotebookNode) -> str:
    """Serialise exactly as ``nbformat.write`` does (v4, indent 1, trailing newline)."""
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


# --- solution regions -------------------------------------------------------------------------


def _solution_regions(lines: list[str], where: str) -> list[tuple[int, int, str, str]]:
    """Find ``(begin, end, indent, label)`` for every BEGIN/END SOLUTION pair in ``lines``."""
    regions, open_at = [], None
    for i, line in enumerate(lines):
        begin, end = BEGIN_RE.match(line), END_RE.match(line)
        if begin and open_at is not None:
            raise CourseError(
                f"{where}: `### BEGIN SOLUTION` on line {i + 1} inside the region opened on "
                f"line {open_at[0] + 1} (regions cannot nest)"
            )
        if begin:
            open_at = (i, begin["indent"], begin["label"] or DEFAULT_LABEL)
        elif end and open_at is None:
            raise CourseError(f"{where}: `### END SOLUTION` on line {i + 1} has no BEGIN")
        elif end:
            regions.append((open_at[0], i, open_at[1], open_at[2]))
            open_at = None
    if open_at is not None:
        raise CourseError(f"{where}: `### BEGIN SOLUTION` on line {open_at[0] + 1} has no END")
    return regions


def replace_solutions(source: str, where: str = "cell") -> str:
    """Replace each solution region in ``source`` by a one-line NotImplementedError stub."""
    lines = source.split("\n")
    for begin, end, indent, label in reversed(_solution_regions(lines, where)):
        stub = f"{indent}raise NotImplementedError({json.dumps(label, ensure_ascii=False)})"
        lines[begin : end + 1] = [stub]
    return "\n".join(lines)


def drop_solution_markers(source: str, where: str = "cell") -> str:
    """Keep the solution code but drop the BEGIN/END marker lines (for the exported package)."""
    lines = source.split("\n")
    marks = {i for b, e, _, _ in _solution_regions(lines, where) for i in (b, e)}
    return "\n".join(line for i, line in enumerate(lines) if i not in marks)


# --- strip ------------------------------------------------------------------------------------


def strip_notebook(nb: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """Return the learner's copy of a solved notebook: stubs instead of solutions, no outputs,
    no execution counts, cell metadata reduced to tags/editable/deletable; ids kept."""
    out = copy.deepcopy(nb)
    for i, cell in enumerate(out.cells):
        cell.metadata = nbformat.NotebookNode(
            {k: v for k, v in cell.metadata.items() if k in KEEP_CELL_METADATA}
        )
        if cell.cell_type == "code":
            cell.source = replace_solutions(cell.source, f"{name}, cell {i}")
            cell.outputs = []
            cell.execution_count = None
    return out


# --- export -----------------------------------------------------------------------------------


def exported_cells(nb: nbformat.NotebookNode, name: str = "notebook") -> dict[str, list[str]]:
    """Map module name -> the bodies of its ``# export: <module>`` cells, in notebook order."""
    modules: dict[str, list[str]] = {}
    for i, cell in enumerate(nb.cells):
        first, _, rest = cell.source.partition("\n")
        match = EXPORT_RE.match(first) if cell.cell_type == "code" else None
        if not match:
            continue
        module = match[1]
        check_module_name(module, f"{name}, cell {i}")
        body = drop_solution_markers(rest, f"{name}, cell {i}").lstrip("\n").rstrip()
        if body:
            modules.setdefault(module, []).append(body)
    return modules


def check_module_name(module: str, where: str) -> None:
    """Refuse a module the package writes by hand (``minivllm/__init__.py``, ``course/``) and
    a dotted name with ``__init__`` / ``__main__`` anywhere but at its end."""
    parts = module.split(".")
    if parts[0] in RESERVED_MODULES:
        raise CourseError(f"{where}: `{module}` is hand-written, not exported")
    if any(part in PACKAGE_FILES for part in parts[:-1]):
        raise CourseError(f"{where}: `{module}`: `__init__` / `__main__` can only end a name")


def module_path(out_dir: Path, module: str) -> Path:
    """Where module ``a.b`` is written: ``out_dir/a/b.py`` (``a.__init__`` -> ``a/__init__.py``)."""
    return out_dir.joinpath(*module.split(".")).with_suffix(".py")


def _check_packages(owners: dict[str, str]) -> None:
    """Every subpackage of an exported module has an exported ``__init__`` (so that the whole
    subpackage, docstring included, comes from a notebook and ``check`` proves all of it)."""
    for module, owner in owners.items():
        parts = module.split(".")
        for depth in range(1, len(parts)):
            package = ".".join(parts[:depth])
            if f"{package}.__init__" not in owners:
                raise CourseError(f"{owner} exports `{module}`, but no notebook exports "
                                  f"`{package}.__init__` (add a `# export: {package}.__init__` "
                                  "cell with the subpackage's docstring)")


def generated_modules(out_dir: Path) -> list[Path]:
    """The files under ``out_dir`` that the export wrote (their first line is ``HEADER``'s),
    outside the hand-written ``course/``."""
    if not out_dir.is_dir():
        return []
    found = []
    for path in sorted(out_dir.rglob("*.py")):
        if path.relative_to(out_dir).parts[0] in RESERVED_MODULES:
            continue
        with path.open(encoding="utf-8") as f:
            if GENERATED_RE.match(f.readline()):
                found.append(path)
    return found


def module_text(source: str, cells: list[str]) -> str:
    """The full text of a generated module: header, then cells two blank lines apart."""
    return HEADER.format(source=source) + "\n\n\n".join(cells) + "\n"


def plan_export(notebooks: list[Path], root: Path, out_dir: Path) -> dict[Path, str]:
    """Target path -> text for every module the given notebooks export; one owner per module."""
    plan: dict[Path, str] = {}
    owners: dict[str, str] = {}
    for path in notebooks:
        name = _display(path, root)
        for module, cells in exported_cells(read_notebook(path), name).items():
            if module in owners:
                raise CourseError(f"module `{module}` is exported by both {owners[module]} "
                                  f"and {name}; one notebook must own each module")
            owners[module] = name
            plan[module_path(out_dir, module)] = module_text(name, cells)
    _check_packages(owners)
    return plan


def plan_strip(notebooks: list[Path], root: Path, notebooks_dir: Path) -> dict[Path, str]:
    """Target path -> text of the stripped learner copy of each solution notebook."""
    return {
        notebooks_dir / path.name: notebook_text(
            strip_notebook(read_notebook(path), _display(path, root))
        )
        for path in notebooks
    }


# --- applying a plan --------------------------------------------------------------------------


def sync(plan: dict[Path, str], check: bool, root: Path, echo: Echo = print) -> list[Path]:
    """Write the plan (returns every target) or, with ``check``, write nothing and return the
    targets that are missing or differ, echoing each with the head of a unified diff."""
    if not check:
        for path, text in plan.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8", newline="\n")
        return list(plan)
    stale = []
    for path, text in plan.items():
        shown = _display(path, root)
        if not path.exists():
            echo(f"missing: {shown}")
        elif (old := path.read_text(encoding="utf-8")) != text:
            echo(f"stale: {shown}")
            diff = difflib.unified_diff(old.splitlines(), text.splitlines(),
                                        f"{shown} (on disk)", f"{shown} (expected)", lineterm="")
            for line in list(diff)[:20]:
                echo(f"    {line}")
        else:
            continue
        stale.append(path)
    return stale


def solution_notebooks(solutions_dir: Path) -> list[Path]:
    """The solution notebooks, sorted by name (empty when the folder is absent)."""
    return sorted(solutions_dir.glob("*.ipynb")) if solutions_dir.is_dir() else []


def export_notebook(path: str | Path, out_dir: str | Path | None = None, *,
                    root: Path | None = None, check: bool = False,
                    echo: Echo = print) -> list[Path]:
    """Export the modules of one notebook (a solution, or a learner's own notebook) into
    ``out_dir`` (default: the package). Returns the files written (or, with ``check``, the
    stale ones)."""
    out = Path(out_dir) if out_dir else (Path(root) / "minivllm" if root else package_dir())
    root = Path(root) if root else repo_root()
    path = Path(path)
    if not path.is_file():
        raise CourseError(f"no such notebook: {path}")
    return sync(plan_export([path], root, out), check, root, echo)


def export_all(check: bool = False, *, root: Path | None = None,
               solutions_dir: Path | None = None, package_dir: Path | None = None,
               echo: Echo = print) -> list[Path]:
    """Export every solution notebook into the package (see :func:`sync` for the result)."""
    root = Path(root) if root else repo_root()
    notebooks = solution_notebooks(Path(solutions_dir) if solutions_dir else root / "solutions")
    if not notebooks:
        echo("export: no solution notebooks found, nothing to do")
    out = Path(package_dir) if package_dir else root / "minivllm"
    plan = plan_export(notebooks, root, out)
    return sync(plan, check, root, echo) + remove_orphans(plan, out, check, root, echo)


def remove_orphans(plan: dict[Path, str], out_dir: Path, check: bool, root: Path,
                   echo: Echo = print) -> list[Path]:
    """Generated modules under ``out_dir`` that ``plan`` no longer produces (a module renamed
    or moved into a subpackage): deleted, or with ``check`` only reported. Returns them."""
    orphans = [path for path in generated_modules(out_dir) if path not in plan]
    for path in orphans:
        shown = _display(path, root)
        if check:
            echo(f"orphan: {shown} (generated, but no notebook exports it now)")
        else:
            path.unlink()
            echo(f"removed {shown} (no notebook exports it now)")
    return [] if not check else orphans


def strip_all(check: bool = False, *, root: Path | None = None,
              solutions_dir: Path | None = None, notebooks_dir: Path | None = None,
              echo: Echo = print) -> list[Path]:
    """Write (or check) ``notebooks/`` as the stripped copy of every solution notebook."""
    root = Path(root) if root else repo_root()
    notebooks = solution_notebooks(Path(solutions_dir) if solutions_dir else root / "solutions")
    if not notebooks:
        echo("strip: no solution notebooks found, nothing to do")
    out = Path(notebooks_dir) if notebooks_dir else root / "notebooks"
    return sync(plan_strip(notebooks, root, out), check, root, echo)
