"""Helpers shared by the tests/test_NN_notebook.py files (and other tests that import a file)."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

from minivllm.course import export_notebook

_mutant_ids = itertools.count()


def load_module(path: Path, name: str) -> ModuleType:
    """Import the Python file at ``path`` as module ``name`` (e.g. a learner's export)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def export_learner(notebook: Path, out_dir: Path, names: list[str],
                   prefix: str) -> dict[str, ModuleType]:
    """The stubbed modules a learner starts from: ``notebook``'s exports, written to
    ``out_dir`` and imported as ``<prefix>_learner_<name>``."""
    export_notebook(notebook, out_dir=out_dir, echo=lambda _: None)
    return {name: load_module(out_dir / f"{name}.py", f"{prefix}_learner_{name}")
            for name in names}


def mutate(module: ModuleType, *edits: tuple[str, str]) -> ModuleType:
    """A planted wrong answer: ``module`` re-imported from its source with each (old, new)
    replacement applied. Each ``old`` must be in the source, so a refactor that removes a
    mutation's target fails loudly instead of testing nothing."""
    source = Path(module.__file__).read_text()
    for old, new in edits:
        assert old in source, f"mutation target {old!r} is no longer in {module.__name__}"
        source = source.replace(old, new)
    name = f"mutant_{next(_mutant_ids)}_{module.__name__.rpartition('.')[2]}"
    mutant = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    mutant.__file__ = str(Path(module.__file__).with_name(f"_{name}.py"))
    sys.modules[name] = mutant
    exec(compile(source, mutant.__file__, "exec"), mutant.__dict__)  # noqa: S102 (a mutant)
    return mutant
