# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""``python -m minivllm.serve``: start the OpenAI-compatible server (``--help`` for the flags).

Built in notebook 04_openai_server. The server is the package ``minivllm.server``; this
module is its entry point, named as vLLM names its own (``python -m vllm.entrypoints...``
became ``vllm serve``; ours stays a module).
"""

import sys

from minivllm.server.cli import main

if __name__ == "__main__" and "get_ipython" not in globals():  # not in the notebook
    sys.exit(main())
