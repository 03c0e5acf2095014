# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""``python -m minivllm.bench`` runs this module: the command line of ``cli``."""

if __name__ == "__main__" and "get_ipython" not in globals():  # not when the notebook runs it
    import sys

    from minivllm.bench.cli import main

    sys.exit(main())
