"""This machine's compute roofline for decoding a model: the best tokens/s its matmuls allow.

Times every linear layer of one decode step at the decode shape (``batch`` rows, the model's
real weight shapes and dtype), sums their FLOPs and time, and reports

    sustained matmul rate  = FLOPs of one step / time of its matmuls alone
    FLOPs per token        = 2 × (parameters touched per token) (+ attention, negligible here)
    roofline tokens/s      = sustained rate / FLOPs per token

so that a benchmark's output tokens/s at that concurrency can be quoted as a fraction of it.
Run it alone on a quiet machine, like the benchmark.

    python tools/roofline.py --model checkpoints/qwen2.5-0.5b-random --dtype float32 --batch 32
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from minivllm.config import ModelConfig, resolve_model_path


def linear_shapes(mc: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(name, out_features, in_features, count) of every matmul in one decode step."""
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    layers = mc.num_hidden_layers
    return [
        ("q_proj", q, mc.hidden_size, layers), ("k_proj", kv, mc.hidden_size, layers),
        ("v_proj", kv, mc.hidden_size, layers), ("o_proj", mc.hidden_size, q, layers),
        ("gate_proj", mc.intermediate_size, mc.hidden_size, layers),
        ("up_proj", mc.intermediate_size, mc.hidden_size, layers),
        ("down_proj", mc.hidden_size, mc.intermediate_size, layers),
        ("lm_head", mc.vocab_size, mc.hidden_size, 1),
    ]


def time_linear(rows: int, out_f: int, in_f: int, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of one ``rows × in_f @ in_f × out_f`` matmul."""
    x, w = torch.randn(rows, in_f, dtype=dtype), torch.randn(out_f, in_f, dtype=dtype)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def roofline(model: str, dtype: torch.dtype, batch: int, repeats: int = 15) -> dict:
    mc = ModelConfig.from_pretrained(resolve_model_path(model))
    step_seconds = step_flops = 0.0
    per_layer = {}
    for name, out_f, in_f, count in linear_shapes(mc):
        seconds = time_linear(batch, out_f, in_f, dtype, repeats)
        flops = 2.0 * batch * out_f * in_f
        per_layer[name] = round(flops / seconds / 1e9, 1)
        step_seconds += count * seconds
        step_flops += count * flops
    rate = step_flops / step_seconds
    flops_per_token = step_flops / batch
    return {"model": model, "dtype": str(dtype).removeprefix("torch."), "batch": batch,
            "threads": torch.get_num_threads(), "sustained_gflops": round(rate / 1e9, 2),
            "gflop_per_token": round(flops_per_token / 1e9, 4),
            "roofline_tokens_per_s": round(rate / flops_per_token, 2),
            "gflops_by_layer": per_layer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    result = roofline(args.model, getattr(torch, args.dtype), args.batch, args.repeats)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
