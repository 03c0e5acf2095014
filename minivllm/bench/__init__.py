# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The benchmark harness, ``python -m minivllm.bench``: one package, one job per module.

Built in notebook 05_benchmark, in this order:

* ``metrics``: seeded workloads; TTFT, TPOT, ITL, E2EL and throughput, named as
  ``vllm bench serve`` names them, and the end-of-run table (pure arithmetic);
* ``clients``: load generators that keep ``concurrency`` requests in flight in an engine
  and timestamp every token (our engine, ``transformers`` static batches, HTTP);
* ``servers``: server engines started as subprocesses, exactly as a user starts them;
* ``peers``: vLLM for the CPU and llama.cpp, from the environments ``bench/peers/`` sets up;
* ``env``: the machine (device, CPU and its features, versions, git commit) and its load;
* ``roofline``: the machine's matmul ceiling for a workload, measured next to each result;
* ``engines``: every engine the harness runs, and how each one is started;
* ``harness``: levels, warm-up, repeats, one fresh process per in-process engine, JSON lines;
* ``cli``: the command line, which ``__main__`` runs.
"""
