# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The servers under test, started as subprocesses exactly as a user would start them.

Built in notebook 05_benchmark. A server engine is measured as shipped: the command line
is what its README says to type (``python -m minivllm.serve --model X --port P``, ``transformers
serve X --continuous-batching``, ``vllm serve``), plus only what the run asks for, so the
benchmark measures the defaults a user gets. ``running_server`` starts one on a free
loopback port, waits until ``GET /health`` answers and stops it at the end; the harness
samples the RSS of its process as the engine's memory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(cmd: list[str], root_url: str, name: str, startup_timeout: float = 900.0,
                   env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Start a server subprocess (with ``env`` added to ours), wait until ``GET /health``
    answers 200 (``proc.ready_after_s``: how long that took), stop it after."""
    import httpx

    fd, log_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
    with open(fd, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=None if env is None else {**os.environ, **env})
    try:
        started = time.monotonic()
        deadline = started + startup_timeout
        while True:
            if proc.poll() is not None:
                tail = Path(log_path).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with status {proc.returncode} before it "
                                   f"was ready; log {log_path}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(root_url + "/health", timeout=5).status_code == 200:
                    proc.ready_after_s = time.monotonic() - started  # for the record
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy after {startup_timeout:.0f}s; log "
                                   f"{log_path}")
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_flags(options: dict) -> list[str]:
    """EngineConfig options as ``python -m minivllm.serve`` flags."""
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):  # BooleanOptionalAction: --compile / --no-compile
            flags += [flag if value else "--no-" + flag[2:]]
        elif isinstance(value, dict):  # speculative_config: JSON, as vLLM's flag takes it
            import json

            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def minivllm_server_command(model: str, port: int, dtype: str = "auto", device: str = "auto",
                            options: dict | None = None) -> list[str]:
    """``python -m minivllm.serve --model X --port P``, as a user starts it, plus only what the
    run asks for: ``--dtype`` / ``--device`` when not "auto", and each engine option given on
    the bench's command line (``--engine-option``, ``minivllm-server[...]``) as its flag.
    Everything else is the server's own default, which is what is being measured."""
    cmd = [sys.executable, "-m", "minivllm.serve", "--model", model, "--port", str(port)]
    cmd += ["--dtype", dtype] if dtype != "auto" else []
    cmd += ["--device", device] if device != "auto" else []
    return cmd + serve_flags(options or {})


TRANSFORMERS_SERVE_NEEDS = ("fastapi", "uvicorn", "openai", "accelerate")  # accelerate: device_map
TRANSFORMERS_PAGE_SIZE = 256  # transformers' own default KV page (ContinuousBatchingConfig)


def transformers_serve_missing() -> list[str]:
    """The packages ``transformers serve`` imports that are not installed (it loads the model
    with a ``device_map``, which needs ``accelerate`` even on the CPU)."""
    return [name for name in TRANSFORMERS_SERVE_NEEDS if importlib.util.find_spec(name) is None]


def transformers_serve_command(model: str, port: int, dtype: str, device: str,
                               num_blocks: int | None = None,
                               max_batch_tokens: int | None = None) -> list[str]:
    """``transformers serve MODEL --continuous-batching`` on the loopback port, told the run's
    dtype and device and, on the CPU, the KV cache's size: ``num_blocks`` pages of its
    default ``TRANSFORMERS_PAGE_SIZE`` tokens (left alone it takes ~60% of free RAM) and at
    most ``max_batch_tokens`` tokens per step."""
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", model,
           "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--device", device]
    if num_blocks is not None:
        cmd += ["--cb-block-size", str(TRANSFORMERS_PAGE_SIZE), "--cb-num-blocks", str(num_blocks)]
    if max_batch_tokens is not None:
        cmd += ["--cb-max-batch-tokens", str(max_batch_tokens)]
    return cmd


def kv_pool_tokens(mc, dtype, config) -> int:
    """How many tokens our engine's KV pool holds for ``config`` (an ``EngineConfig``): its
    byte budget, capped, as our engine caps it, at ``max_num_seqs`` sequences of
    ``max_model_len``. Another engine's KV cache is given as many token slots."""
    blocks = config.num_blocks  # given: our engine takes it as it is
    if blocks is None:
        budget = config.kv_cache_memory_bytes
        max_len = config.max_model_len or mc.max_position_embeddings
        blocks = min(kv_blocks_for_budget(mc, dtype, budget, config.block_size),
                     config.max_num_seqs * -(-max_len // config.block_size))
    return blocks * config.block_size


def transformers_serve_kv(mc, dtype, config) -> tuple[int, int]:
    """(pages, tokens per step) for ``transformers serve`` on a CPU: as many KV token slots as
    our engine's pool holds for ``config`` (``kv_pool_tokens``), in pages of
    ``TRANSFORMERS_PAGE_SIZE`` tokens, and our step's token budget. (Its attention masks
    grow with both: that memory is its own design's cost, and shows in its RSS.)"""
    pages = max(1, kv_pool_tokens(mc, dtype, config) // TRANSFORMERS_PAGE_SIZE)
    return pages, config.max_num_batched_tokens


def kv_blocks_for_budget(mc, dtype, budget_bytes: int, block_size: int) -> int:
    """How many KV blocks of ``block_size`` tokens (keys and values of every layer, in
    ``dtype``) fit in ``budget_bytes``: how minivllm sizes its pool on the CPU, applied to
    another engine so that both get the same KV memory."""
    from minivllm.kv_cache import bytes_per_block, num_blocks_for_budget

    block_bytes = bytes_per_block(mc.num_hidden_layers, block_size, mc.num_key_value_heads,
                                  mc.head_dim, dtype)
    return max(1, num_blocks_for_budget(budget_bytes, block_bytes))


def vllm_command(model: str, port: int, dtype: str, seed: int, options: dict) -> list[str]:
    """``vllm serve`` (its OpenAI server module) with the run's dtype, seed and batch limits."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--port", str(port), "--dtype", dtype, "--seed", str(seed)]
    return cmd + vllm_batch_flags(options)


def vllm_batch_flags(options: dict) -> list[str]:
    """vLLM's batch limits, only those the run sets (vLLM's own defaults otherwise)."""
    flags: list[str] = []
    if options.get("max_num_seqs"):
        flags += ["--max-num-seqs", str(options["max_num_seqs"])]
    if options.get("max_model_len"):
        flags += ["--max-model-len", str(options["max_model_len"])]
    return flags
