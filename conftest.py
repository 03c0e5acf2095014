"""Repository-wide pytest setup.

* Notebooks executed under pytest (nbval) must not start a nested pytest run from their last
  cell (``export_and_grade``): the test files are collected separately by the same run.
* Compiling the decode step takes tens of seconds per new model shape; the suite runs eager
  by default and the compiled parity tests ask for ``compile=True`` explicitly.
* ``LLM.generate`` shows a progress bar by default (as vLLM's does); tests turn it off.

Kernels started by nbval inherit this process's environment, so setting both here is enough.
"""

import os

os.environ.setdefault("MINIVLLM_NB_SKIP_PYTEST", "1")
os.environ.setdefault("MINIVLLM_COMPILE", "0")
os.environ.setdefault("TQDM_DISABLE", "1")
