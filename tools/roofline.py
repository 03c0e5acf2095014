"""This machine's compute roofline for decoding a model: the best tokens/s its matmuls allow.

The measurement itself lives in ``minivllm/bench/roofline.py`` (notebook 05), where
``python -m minivllm.bench --roofline`` takes it before and after every benchmark level.
This tool prints it on its own, with a per-layer breakdown:

    sustained matmul rate  = FLOPs of one decode step's matmuls / their time, streamed
                             (every linear layer in model order, weights from memory)
    FLOPs per token        = 2 × (parameters touched per token) (+ attention, negligible here)
    roofline tokens/s      = sustained rate / FLOPs per token

and, per layer shape, the rate of that matmul repeated back to back (``hot_gflops_by_layer``:
its weights then sit in the caches, an upper bound a real step cannot reach).

With ``--input-len I --output-len O`` it also reports the roofline **for the workload**: each
request runs its prompt through the layers (charged at the rate of a prefill of every prompt
in flight, batch × I rows up to one engine step) and every further token through the layers
and the ``lm_head`` (charged at the decode rate).

Run it alone on a quiet machine, like the benchmark.

    python tools/roofline.py --model checkpoints/qwen2.5-0.5b-random --dtype float32 --batch 32 \
        --input-len 32 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minivllm.bench.roofline import (
    RooflineProbe,
    linear_shapes,
    matmul_rate,
    request_flops,
    workload_roofline,
)
from minivllm.config import ModelConfig, resolve_model_path


def time_linear(rows: int, out_f: int, in_f: int, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of one ``rows × in_f @ in_f × out_f`` matmul, repeated on one weight."""
    x, w = torch.randn(rows, in_f, dtype=dtype), torch.randn(out_f, in_f, dtype=dtype)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def roofline(model: str, dtype: torch.dtype, batch: int, repeats: int = 15,
             input_len: int | None = None, output_len: int | None = None) -> dict:
    mc = ModelConfig.from_pretrained(resolve_model_path(model))
    hot = {name: round(2.0 * batch * out_f * in_f / time_linear(batch, out_f, in_f, dtype,
                                                               repeats) / 1e9, 1)
           for name, out_f, in_f, _ in linear_shapes(mc)}
    rate = matmul_rate(mc, batch, dtype, repeats=max(3, repeats // 3))
    step_flops = sum(2.0 * batch * out_f * in_f * count for _, out_f, in_f, count in linear_shapes(mc))
    flops_per_token = step_flops / batch
    result = {"model": model, "dtype": str(dtype).removeprefix("torch."), "batch": batch,
              "threads": torch.get_num_threads(), "sustained_gflops": round(rate / 1e9, 4),
              "gflop_per_token": round(flops_per_token / 1e9, 6),  # tiny models: ~0.01
              "roofline_tokens_per_s": round(rate / flops_per_token, 2),
              "hot_gflops_by_layer": hot}
    if input_len and output_len:
        # the benchmark's rule: every prompt in flight, up to one engine step
        prefill_rows = RooflineProbe(mc, dtype, "cpu").rows([(input_len, output_len)] * batch,
                                                            batch)["prefill"]
        prefill_rate = matmul_rate(mc, prefill_rows, dtype)
        per_token = sum(request_flops(mc, input_len, output_len)) / output_len
        result |= {"input_len": input_len, "output_len": output_len,
                   "prefill_rows": prefill_rows, "prefill_gflops": round(prefill_rate / 1e9, 2),
                   "workload_gflop_per_output_token": round(per_token / 1e9, 6),
                   "workload_roofline_tokens_per_s": round(workload_roofline(
                       [(input_len, output_len)], prefill_rate, rate, mc), 2)}
    return result


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
