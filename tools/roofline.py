"""This machine's compute roofline for decoding a model: the best tokens/s its matmuls allow.

Times every linear layer of one decode step at the decode shape (``batch`` rows, the model's
real weight shapes and dtype), sums their FLOPs and time, and reports

    sustained matmul rate  = FLOPs of one step / time of its matmuls alone
    FLOPs per token        = 2 × (parameters touched per token) (+ attention, negligible here)
    roofline tokens/s      = sustained rate / FLOPs per token

so that a benchmark's output tokens/s at that concurrency can be quoted as a fraction of it.

That is the roofline of *decode steps*. A benchmark's output throughput also pays for every
prompt: with ``--input-len I --output-len O`` it reports the roofline **for the workload**,
where each request runs I + O - 1 tokens through the layers (the prompt, then every output
token but the last), O through the ``lm_head`` and attention over the growing context, all
charged at the same sustained rate, divided by the O output tokens it delivers:

    workload roofline tokens/s = sustained rate / (workload FLOPs per request / O)

Run it alone on a quiet machine, like the benchmark.

    python tools/roofline.py --model checkpoints/qwen2.5-0.5b-random --dtype float32 --batch 32 \
        --input-len 32 --output-len 64
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


def workload_flops_per_output_token(mc: ModelConfig, input_len: int, output_len: int) -> float:
    """FLOPs a request of ``input_len`` prompt and ``output_len`` output tokens costs, per
    output token: linear layers for the I + O - 1 tokens that go through the model, the
    lm_head for the O positions that are sampled, attention (QK^T and PV, 4 * context * H * D
    per layer) for every token over its context."""
    shapes = linear_shapes(mc)
    layer_flops = sum(2.0 * out_f * in_f * count for name, out_f, in_f, count in shapes
                      if name != "lm_head")
    lm_head_flops = 2.0 * mc.vocab_size * mc.hidden_size
    through = input_len + output_len - 1
    attention_per_key = 4.0 * mc.num_attention_heads * mc.head_dim * mc.num_hidden_layers
    contexts = through * (through + 1) / 2  # token p attends to p + 1 keys
    total = through * layer_flops + output_len * lm_head_flops + contexts * attention_per_key
    return total / output_len


def roofline(model: str, dtype: torch.dtype, batch: int, repeats: int = 15,
             input_len: int | None = None, output_len: int | None = None) -> dict:
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
            "gflops_by_layer": per_layer} | _workload(mc, rate, input_len, output_len)


def _workload(mc: ModelConfig, rate: float, input_len: int | None, output_len: int | None) -> dict:
    if not (input_len and output_len):
        return {}
    per_token = workload_flops_per_output_token(mc, input_len, output_len)
    return {"input_len": input_len, "output_len": output_len,
            "workload_gflop_per_output_token": round(per_token / 1e9, 4),
            "workload_roofline_tokens_per_s": round(rate / per_token, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--input-len", type=int, help="the benchmark's prompt length (fixed workload)")
    ap.add_argument("--output-len", type=int, help="the benchmark's output length")
    args = ap.parse_args()
    result = roofline(args.model, getattr(torch, args.dtype), args.batch, args.repeats,
                      args.input_len, args.output_len)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
