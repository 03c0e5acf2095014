"""Repository-wide pytest setup.

Notebooks executed under pytest (nbval) must not start a nested pytest run from their last
cell (``export_and_grade``): the test files are collected separately by the same pytest
run. Kernels inherit this process's environment, so setting the switch here is enough.
"""

import os

os.environ.setdefault("MINIVLLM_NB_SKIP_PYTEST", "1")
