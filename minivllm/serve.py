# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""``python -m minivllm.serve``: start the OpenAI-compatible server (``--help`` for the flags).

Built in notebook 04_openai_server. The server is the package ``minivllm.server``; this
module is its entry point, named as vLLM names its own (``python -m vllm.entrypoints...``
became ``vllm serve``; ours stays a module).
"""

import sys

# the names serve.py used to define, for code that imports them from here
from minivllm.server.app import build_app
from minivllm.server.cli import engine_config, main, parse_args
from minivllm.server.engine_thread import AsyncEngine
from minivllm.server.guard import ServerOptions

__all__ = ["AsyncEngine", "ServerOptions", "build_app", "engine_config", "main", "parse_args"]

if __name__ == "__main__" and "get_ipython" not in globals():  # not in the notebook
    sys.exit(main())
