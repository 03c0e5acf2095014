"""Grading helpers for the notebooks' check cells.

Every exercise is followed by a check cell that compares the learner's code with a reference
and either prints one clear pass line (:func:`passed`) or raises an ``AssertionError`` that
says *what* differs and *where* (:func:`assert_close`, :func:`assert_equal`). The last cell of
each notebook exports the learner's module into the package and runs the milestone's pytest
file (:func:`export_and_grade`).

torch is imported lazily so that ``python -m minivllm.course`` stays fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SKIP_PYTEST_ENV = "MINIVLLM_NB_SKIP_PYTEST"


def _fail(what: str, message: str, hint: str | None) -> AssertionError:
    """Build the AssertionError every grader raises: what failed, why, and a hint."""
    text = f"{what}: {message}"
    if hint:
        text += f"\n  hint: {hint}"
    return AssertionError(text)


def require(condition: bool, what: str, message: str, hint: str | None = None) -> None:
    """Fail the check with ``what: message`` (and a hint) unless ``condition`` holds."""
    if not condition:
        raise _fail(what, message, hint)


@contextmanager
def exercise(what: str) -> Iterator[None]:
    """Turn a stub's NotImplementedError inside the block into the grader's AssertionError."""
    try:
        yield
    except NotImplementedError as err:
        raise AssertionError(f"{what}: not implemented yet ({err})") from None


def call_learner(what: str, fn: Callable, *args, hint: str | None = None) -> Any:
    """Call the learner's code: a stub, or any other exception it raises, becomes the grader's
    AssertionError (a check's own AssertionError passes through)."""
    try:
        return fn(*args)
    except NotImplementedError as err:
        raise AssertionError(f"{what}: not implemented yet ({err})") from None
    except AssertionError:
        raise
    except Exception as err:
        raise _fail(what, f"raised {type(err).__name__}: {err}", hint) from err


def assert_close(actual: Any, expected: Any, *, what: str, atol: float = 1e-5,
                 rtol: float = 1e-5, hint: str | None = None) -> float:
    """Check that tensor ``actual`` matches ``expected`` in shape, kind of dtype and values.

    Values are compared in float64 on the CPU with ``|a - e| <= atol + rtol * |e|`` (NaNs
    must coincide). On failure the message names ``what``, the shapes, the largest absolute
    difference and its index. Returns the largest absolute difference, for :func:`passed`.
    """
    import torch

    if actual is None or not isinstance(actual, torch.Tensor):
        raise _fail(what, f"expected a torch.Tensor, got {type(actual).__name__} "
                          "(did the function return its result?)", hint)
    expected = torch.as_tensor(expected)
    if tuple(actual.shape) != tuple(expected.shape):
        raise _fail(what, f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}",
                    hint)
    if actual.dtype.is_floating_point != expected.dtype.is_floating_point or (
            actual.dtype.is_complex != expected.dtype.is_complex):
        raise _fail(what, f"dtype {actual.dtype} is not compatible with expected "
                          f"{expected.dtype}", hint)
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return 0.0
    diff = (a - e).abs()
    nan_mismatch = torch.isnan(a) != torch.isnan(e)
    diff = torch.where(nan_mismatch, torch.full_like(diff, float("inf")), diff.nan_to_num(0.0))
    bad = (diff > atol + rtol * e.abs().nan_to_num(0.0)) | nan_mismatch
    worst = float(diff.max())
    if bad.any():
        flat = int(diff.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
        raise _fail(
            what,
            f"values differ (shape {tuple(a.shape)}): max abs diff {worst:.3g} at index "
            f"{index} (got {float(a[index]):.6g}, expected {float(e[index]):.6g}); "
            f"{int(bad.sum())} of {bad.numel()} elements outside atol={atol:g}, rtol={rtol:g}",
            hint,
        )
    return worst


def _as_list(value: Any) -> Any:
    """Tensors and tuples become lists so that token sequences compare by value."""
    if hasattr(value, "tolist") and not isinstance(value, (int, float)):
        value = value.tolist()
    return list(value) if isinstance(value, tuple) else value


def assert_equal(actual: Any, expected: Any, *, what: str, hint: str | None = None) -> None:
    """Check exact equality of ints, strings or lists (e.g. token ids).

    For sequences the message gives the lengths, the first differing index and both
    elements there, which is what one needs to debug a greedy decode that drifts.
    """
    actual, expected = _as_list(actual), _as_list(expected)
    if actual == expected:
        return
    if isinstance(actual, list) and isinstance(expected, list):
        first = next((i for i, (a, e) in enumerate(zip(actual, expected)) if a != e),
                     min(len(actual), len(expected)))
        got = repr(actual[first]) if first < len(actual) else "<end>"
        want = repr(expected[first]) if first < len(expected) else "<end>"
        raise _fail(what, f"first difference at index {first}: got {got}, expected {want} "
                          f"(lengths {len(actual)} vs expected {len(expected)}; "
                          f"common prefix {actual[:first][-8:]!r})", hint)
    raise _fail(what, f"got {actual!r}, expected {expected!r}", hint)


def passed(exercise: str, detail: str = "") -> None:
    """Print the pass line of a check cell, e.g.
    ``✅ Exercise 1.2 (apply_rope) passed — matches transformers to 3e-07``."""
    name = exercise if exercise.lower().startswith("exercise") else f"Exercise {exercise}"
    print(f"✅ {name} passed" + (f" — {detail}" if detail else ""))


def _repo_root() -> Path:
    from .notebooks import repo_root

    return repo_root()


def run_milestone_tests(pattern: str, *, root: Path | None = None, tail: int = 25) -> None:
    """Run ``pytest tests/<pattern> -q -x`` from the repo root in a subprocess; raise
    AssertionError if it fails. Skipped when ``MINIVLLM_NB_SKIP_PYTEST=1`` (CI runs the test
    files on their own, so executing the notebooks must not run them twice)."""
    if os.environ.get(SKIP_PYTEST_ENV) == "1":
        print(f"pytest tests/{pattern}: skipped ({SKIP_PYTEST_ENV}=1)")
        return
    root = Path(root) if root else _repo_root()
    files = sorted(str(p) for p in (root / "tests").glob(pattern))
    if not files:
        raise AssertionError(f"no test file matches tests/{pattern} under {root}")
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-x"]
    result = subprocess.run(cmd, check=False, cwd=root, capture_output=True, text=True)
    lines = (result.stdout + result.stderr).rstrip().splitlines()
    print("\n".join(lines[-tail:]))
    if result.returncode != 0:
        raise AssertionError(f"pytest tests/{pattern} failed (exit {result.returncode}); "
                             "see the output above")
    print(f"✅ tests/{pattern} passed")


def export_and_grade(notebook_name: str, test_pattern: str) -> None:
    """Export the modules of this notebook (path relative to the working directory, i.e. the
    notebook's folder) into the package, then run the milestone's tests against them."""
    from .notebooks import export_notebook

    path = Path(notebook_name)
    if not path.is_file():
        raise AssertionError(f"cannot find {notebook_name} in {Path.cwd()}; pass the "
                             "notebook's file name relative to its folder")
    written = export_notebook(path)
    for file in written:
        print(f"exported {path.name} -> {file}")
    print("Reminder: save the notebook first (the export reads the file on disk); "
          "restore the reference with `git checkout minivllm/`.")
    run_milestone_tests(test_pattern)
