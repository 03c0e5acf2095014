# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The machine's ceiling for a workload: a matmul roofline measured next to each result.

Built in notebook 05_benchmark. Decoding a dense model is, to first order, matrix
multiplies: every token goes through every linear layer once. So the best output
throughput this machine allows for a workload is

    roofline tokens/s = sustained matmul rate (FLOP/s) / FLOPs per output token

and a benchmark result can be quoted as a fraction of it, which says far more than tokens/s
alone on a machine whose speed drifts. Both halves are measured, not looked up:

* ``matmul_rate`` runs the model's own linear layers — its real shapes and dtype, in their
  order, with weights too many for the caches, so they stream from memory as in a real step
  — at a given number of rows and times the pass. A decode step at concurrency c is c rows.
  A prefill is as many rows as the prompt tokens an engine can batch into one step: all the
  prompts in flight, up to one step of the engine on that device
  (``default_max_num_batched_tokens``: 512 tokens on a CPU, 2048 on a GPU). Big
  matmuls run several times faster per FLOP than decode-sized ones (on the 2-core CPU of
  this project: ~155 GFLOP/s at 1024 rows against ~60 at 32), so charging prompts at the
  decode rate would understate the ceiling.
* ``request_flops`` counts one request: the linear layers for every token that goes
  through the model (the prompt, then every output token but the last), the ``lm_head`` for
  every sampled position and attention (QKᵀ and PV) over each token's context.

The roofline for a level charges the prompt tokens at the prefill-shape rate and the decode
tokens at the decode-shape rate (``workload_roofline``). The rates are measured just before
and just after the level (``python -m minivllm.bench --roofline``), so each record carries
the fraction against both: a machine that slowed down mid-run shows as a wider range.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from minivllm.config import ModelConfig, default_max_num_batched_tokens

STREAM_BYTES = 256 * 2**20  # per weight shape: far beyond any CPU cache, so weights stream
PASS_FLOPS = 4e10  # a timed pass covers as many layers as fit in this (all, for decode shapes)


def linear_shapes(mc: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(name, out_features, in_features, count) of every matmul one token goes through."""
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


def request_flops(mc: ModelConfig, prompt_len: int, output_len: int) -> tuple[float, float]:
    """(prefill FLOPs, decode FLOPs) of one request of ``prompt_len`` + ``output_len`` tokens.

    Prefill: the prompt through the layers, the ``lm_head`` once (the first output token).
    Decode: the other ``output_len - 1`` tokens through the layers and the ``lm_head``.
    Attention is 4 · context · heads · head_dim FLOPs per token and layer (token p attends to
    p + 1 keys); it goes with the phase its token belongs to.
    """
    shapes = linear_shapes(mc)
    layer_flops = sum(2.0 * o * i * n for name, o, i, n in shapes if name != "lm_head")
    lm_head = 2.0 * mc.vocab_size * mc.hidden_size
    per_key = 4.0 * mc.num_attention_heads * mc.head_dim * mc.num_hidden_layers
    through = prompt_len + output_len - 1  # tokens that run through the layers

    def keys(n: int) -> float:  # sum of (p + 1) for p < n
        return n * (n + 1) / 2

    prefill = prompt_len * layer_flops + lm_head + keys(prompt_len) * per_key
    decode = ((through - prompt_len) * (layer_flops + lm_head)
              + (keys(through) - keys(prompt_len)) * per_key)
    return prefill, decode


def _streamed_weights(mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                      layers: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat buffer (a single allocation, handed back to the OS when freed, so it cannot
    inflate an engine's measured memory) and, for one step in model order, the weight view
    each matmul uses: up to ``STREAM_BYTES`` of distinct copies per shape, cycled. With
    ``layers`` below the model's, the pass covers that many layers and no ``lm_head``."""
    layers = mc.num_hidden_layers if layers is None else min(layers, mc.num_hidden_layers)
    shapes = linear_shapes(mc)
    if layers < mc.num_hidden_layers:
        shapes = shapes[:7]
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan = []  # (out_f, in_f, copies, count)
    for _, out_f, in_f, count in shapes:
        count = min(count, layers)
        copies = max(1, min(count, STREAM_BYTES // (out_f * in_f * itemsize)))
        plan.append((out_f, in_f, copies, count))
    flat = torch.empty(sum(o * i * c for o, i, c, _ in plan), dtype=dtype, device=device)
    flat.fill_(0.01)  # no NaNs or denormals from uninitialised memory: they change the speed
    views, offset = [], 0
    for out_f, in_f, copies, _ in plan:
        size = out_f * in_f
        views.append([flat[offset + k * size: offset + (k + 1) * size].view(out_f, in_f)
                      for k in range(copies)])
        offset += size * copies
    order = [views[s][layer % len(views[s])] for layer in range(layers) for s in range(7)]
    if len(views) == 8:  # the whole model: the lm_head ends the step
        order.append(views[7][0])
    return flat, order


@torch.inference_mode()
def matmul_rate(mc: ModelConfig, rows: int, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", repeats: int = 3) -> float:
    """Sustained FLOP/s of one step's matmuls at ``rows`` rows: the median of ``repeats``
    timed passes through every linear layer of the model, in order, weights streaming. For
    prefill-sized ``rows`` a pass covers only as many layers as ``PASS_FLOPS`` allows (the
    matmuls are then compute-bound and every layer runs alike), so it stays ~1 s."""
    device = torch.device(device)
    layer_params = sum(o * i for name, o, i, _ in linear_shapes(mc) if name != "lm_head")
    layers = max(1, int(PASS_FLOPS // (2.0 * rows * layer_params)))
    _buffer, weights = _streamed_weights(mc, dtype, device, layers)  # the views keep it alive
    inputs = {w.shape[1]: torch.full((rows, w.shape[1]), 0.01, dtype=dtype, device=device)
              for w in weights}
    flops = sum(2.0 * rows * w.numel() for w in weights)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def one_pass() -> float:
        sync()
        start = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)
        sync()
        return time.perf_counter() - start

    one_pass()  # warm-up: first calls pick kernels and fault the pages in
    seconds = statistics.median(one_pass() for _ in range(repeats))
    return flops / seconds  # (the buffer is freed on return, back to the OS in one piece)


def workload_roofline(requests: list[tuple[int, int]], prefill_rate: float,
                      decode_rate: float, mc: ModelConfig) -> float:
    """Output tokens/s if every FLOP of these (prompt_len, output_len) requests ran at the
    measured rates: prefill FLOPs at ``prefill_rate``, decode FLOPs at ``decode_rate``."""
    seconds = outputs = 0.0
    for prompt_len, output_len in requests:
        prefill, decode = request_flops(mc, prompt_len, output_len)
        seconds += prefill / prefill_rate + decode / decode_rate
        outputs += output_len
    return outputs / seconds


class RooflineProbe:
    """Measures the rates for one benchmark level, before and after it runs, and turns them
    into the ``roofline`` entry of the level's record."""

    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device: str):
        self.mc, self.dtype, self.device = mc, dtype, device

    def rows(self, requests: list[tuple[int, int]], concurrency: int) -> dict[str, int]:
        """The decode shape is the concurrency; the prefill shape the prompt tokens of all
        the requests in flight (``concurrency`` × the mean prompt), up to one engine step."""
        prompts = round(statistics.fmean(p for p, _ in requests) * min(concurrency, len(requests)))
        step = default_max_num_batched_tokens(self.device)
        return {"decode": max(1, concurrency), "prefill": max(1, min(prompts, step))}

    def measure(self, rows: dict[str, int]) -> dict[str, float]:
        """GFLOP/s at each shape (one measurement when both shapes are the same)."""
        rates = {n: matmul_rate(self.mc, n, self.dtype, self.device) / 1e9
                 for n in sorted(set(rows.values()))}
        return {phase: rates[n] for phase, n in rows.items()}

    def record(self, requests: list[tuple[int, int]], rows: dict[str, int],
               before: dict[str, float], after: dict[str, float],
               output_throughput: float | None) -> dict:
        """Rates before/after, the roofline tokens/s at each, and the achieved fraction."""
        lo, hi = sorted(workload_roofline(requests, r["prefill"] * 1e9, r["decode"] * 1e9,
                                          self.mc) for r in (before, after))
        flops = sum(sum(request_flops(self.mc, p, o)) for p, o in requests)
        entry = {"rows": rows, "gflops_before": _rounded(before), "gflops_after": _rounded(after),
                 "gflop_per_output_token": round(flops / sum(o for _, o in requests) / 1e9, 4),
                 "tokens_per_s": [round(lo, 2), round(hi, 2)]}
        if output_throughput and math.isfinite(output_throughput):
            entry["fraction"] = [round(output_throughput / hi, 4), round(output_throughput / lo, 4)]
        return entry


def _rounded(rates: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in rates.items()}
