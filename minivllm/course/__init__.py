"""The course tool: notebook export/strip and the graders used by the notebooks' check cells.

``solutions/NN_topic.ipynb`` is the source of both ``minivllm/<module>.py`` (export) and
``notebooks/NN_topic.ipynb`` (strip); ``python -m minivllm.course check`` proves they agree.
See docs/decisions.md, "Course mechanics".
"""

from .grading import (
    assert_close,
    assert_equal,
    export_and_grade,
    passed,
    run_milestone_tests,
)
from .notebooks import (
    CourseError,
    export_all,
    export_notebook,
    package_dir,
    repo_root,
    strip_all,
    strip_notebook,
)

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
