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
    """Import the Python file at ``path`` as module ``name`` (e.g. a learner's export), its
    custom ops under a namespace of its own (``_own_custom_ops``)."""
    return _exec_module(name, path, path.read_text())


def _own_custom_ops(source: str, name: str) -> str:
    """``source`` with its ``torch.library.custom_op("minivllm::...")`` ops renamed into the
    namespace ``name``: defining an op again replaces its kernel for the whole process, and
    the package's engines built by later tests would then run this copy's code (a learner's
    stub, a mutant, their own packed-weight table)."""
    return source.replace('"minivllm::', f'"{name}::')


def _exec_module(name: str, path: Path, source: str) -> ModuleType:
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__file__ = str(path)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    exec(compile(_own_custom_ops(source, name), module.__file__, "exec"),  # noqa: S102
         module.__dict__)
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
    mutation's target fails loudly instead of testing nothing. Its custom ops live under a
    namespace of its own (``_own_custom_ops``)."""
    source = Path(module.__file__).read_text()
    for old, new in edits:
        assert old in source, f"mutation target {old!r} is no longer in {module.__name__}"
        source = source.replace(old, new)
    name = f"mutant_{next(_mutant_ids)}_{module.__name__.rpartition('.')[2]}"
    return _exec_module(name, Path(module.__file__).with_name(f"_{name}.py"), source)


def grader_tests(graders, reference: ModuleType, mutants: dict, absent: str = "passed"):
    """The three tests every graded notebook of one module shares, made once here.

    ``graders(module)`` maps a grader's name to a call that grades ``module``; ``mutants``
    maps a planted wrong answer's name to ``(grader or [graders], [(old, new), ...])``.
    The tests: each grader fails on the learner's stub (fixture ``learner``) and passes on the
    reference, and the graders named by each mutant fail on it; a failing grader never prints
    ``absent`` (its success line). Assign the returned functions to ``test_*`` names.
    """
    import pytest

    names = list(graders(reference))

    @pytest.mark.parametrize("grader", names)
    def fails_on_the_stub(learner, grader, capsys):
        with pytest.raises(AssertionError, match="not implemented yet"):
            graders(learner)[grader]()
        assert absent not in capsys.readouterr().out

    @pytest.mark.parametrize("grader", names)
    def passes_on_the_reference(grader, capsys):
        graders(reference)[grader]()
        assert "✅" in capsys.readouterr().out

    @pytest.mark.parametrize("name", list(mutants))
    def fails_on_a_planted_wrong_answer(name, capsys):
        targets, edits = mutants[name]
        mutant = mutate(reference, *edits)
        assert mutant is not reference
        for grader in [targets] if isinstance(targets, str) else targets:
            with pytest.raises(AssertionError):
                graders(mutant)[grader]()
        assert absent not in capsys.readouterr().out

    return fails_on_the_stub, passes_on_the_reference, fails_on_a_planted_wrong_answer
