"""The course tool: notebook export/strip and the graders used by the notebooks' check cells.

``solutions/NN_topic.ipynb`` is the source of both ``minivllm/<module>.py`` (export) and
``notebooks/NN_topic.ipynb`` (strip); ``python -m minivllm.course check`` proves they agree.
See docs/decisions.md, "Course mechanics".
"""

# Imported on first use (PEP 562): ``random_weights`` (the random-weight checkpoints of the
# tests and tools) needs torch alone, not nbformat and the notebook machinery, so a GPU box
# with only the package's own dependencies can still make a checkpoint.
_LAZY = {
    "assert_close": "grading",
    "assert_equal": "grading",
    "export_and_grade": "grading",
    "passed": "grading",
    "run_milestone_tests": "grading",
    "CourseError": "notebooks",
    "export_all": "notebooks",
    "export_notebook": "notebooks",
    "package_dir": "notebooks",
    "repo_root": "notebooks",
    "strip_all": "notebooks",
    "strip_notebook": "notebooks",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'minivllm.course' has no attribute {name!r}")


__all__ = [
    "CourseError",
    "assert_close",
    "assert_equal",
    "export_all",
    "export_and_grade",
    "export_notebook",
    "package_dir",
    "passed",
    "repo_root",
    "run_milestone_tests",
    "strip_all",
    "strip_notebook",
]
