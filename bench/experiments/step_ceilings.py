"""How far each kind of step is from what this CPU allows (issue 30, twentieth part). Three
parts, each alternating or repeating its measurements in one process (run it alone; on 2
cores anything else running changes the answer):

* ``loop``: inductor's widened one-row loop (``loop_matvec`` on a bf16 weight beside a float32
  row, what a float32 engine's one-row step streams where its weights are bf16 numbers) on a
  (N, 896) weight: from the caches (N = 9728, the gate/up projection's 17 MB) and from memory
  (N = 151936, the lm_head's 272 MB), the call's own cost (N = 16) taken off; printed as GB/s
  and as nanoseconds of one core per weight row, beside a float32 ``sum`` over 1 GiB in huge
  pages (the rate memory gives a plain read). Also the same loop on 8 and 32 lanes and on a
  row-blocked copy ((N/16, K, 16): the 16 lanes run across rows, not along K).
* ``gemm``: oneDNN's packed float32 linear (what every prefill and batched step multiplies
  by on a CPU without bf16) at M = 1 ... 512 rows for the 0.5B model's gate/up, down and
  q/k/v shapes, in GFLOP/s: how near a batched step's linears run to the cores' peak.
* ``step``: the compiled decode step as shipped at 32, 8 and 1 rows (context 160) against
  the same step with its attention left out (the pool still written, the queries handed on:
  what no decode attention could save beyond) and against RoPE's cos/sin computed once a
  step (``materialise``d: inductor otherwise recomputes them inside every layer's kernel);
  compiled steps alternated step by step over one engine's pool.

    python bench/experiments/step_ceilings.py --model checkpoints/qwen2.5-0.5b-random \\
        --parts loop,gemm,step
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from matvec_ab import alternate

K = 896  # the 0.5B model's hidden size


def best_seconds(fn, reps: int, tries: int = 7) -> float:
    """The fastest of ``tries`` means of ``reps`` calls of ``fn`` (after three untimed)."""
    for _ in range(3):
        fn()
    means = []
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        means.append((time.perf_counter() - start) / reps)
    return min(means)


def part_loop() -> None:
    from minivllm.compile import loop_matvec, materialise, move_to_huge_pages

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    x = torch.randn(1, K)

    def lanes(n_lanes: int):  # loop_matvec's widened form on n_lanes partial sums a row
        def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            row, n = materialise(x)[0], w.shape[0]
            products = w.view(n, -1, n_lanes).float() * row.view(-1, n_lanes)
            return products.sum(1).sum(-1).unsqueeze(0)
        return fn

    def row_blocked(x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        # blocked: (N/16, K, 16), 16 rows' numbers side by side for each k: one sum per row,
        # the lanes across rows (K products each, in order)
        row = materialise(x)[0]
        return (blocked.float() * row.view(1, -1, 1)).sum(1).view(1, -1)

    def timed(compiled, weight: torch.Tensor, reps: int) -> float:
        with torch.inference_mode():
            return best_seconds(lambda: compiled(x, weight), reps)

    overhead = timed(torch.compile(loop_matvec, dynamic=False),
                     (torch.randn(16, K) * 0.02).bfloat16(), 2000)
    print(f"one call on 16 rows (the call's own cost): {overhead * 1e6:.1f} us")
    routes = {"loop_matvec (16 lanes, shipped)": (loop_matvec, False),
              "8 lanes": (lanes(8), False), "32 lanes": (lanes(32), False),
              "row-blocked, 16 rows a vector": (row_blocked, True)}
    for n, reps in ((9728, 200), (151936, 15)):
        weight = (torch.randn(n, K) * 0.02).bfloat16()
        move_to_huge_pages([weight])
        reference = x @ weight.float().t()  # (1, N)
        for name, (fn, blocked) in routes.items():
            w = weight.view(n // 16, 16, K).transpose(1, 2).contiguous() if blocked else weight
            compiled = torch.compile(fn, dynamic=False)
            assert float((compiled(x, w) - reference).abs().max()) < 1e-3, name
            seconds = timed(compiled, w, reps) - overhead
            print(f"N={n:6d} ({n * K * 2 / 1e6:5.1f} MB) {name:32s} {n * K * 2 / seconds / 1e9:5.1f} GB/s"
                  f"  {seconds * threads / n * 1e9:6.1f} ns of a core per row")
    plain = torch.ones(2**28)
    move_to_huge_pages([plain])
    seconds = best_seconds(plain.sum, 3, 5)
    print(f"float32 sum over 1 GiB in huge pages: {plain.numel() * 4 / seconds / 1e9:.1f} GB/s")


def part_gemm() -> None:
    torch.manual_seed(0)
    for k, n, what in ((896, 9728, "gate/up"), (4864, 896, "down"), (896, 1152, "q/k/v")):
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k) * 0.02, 32)
        rates = []
        for m in (1, 8, 16, 32, 64, 128, 512):
            x = torch.randn(m, k)
            seconds = best_seconds(lambda x=x, packed=packed: torch.ops.mkldnn._linear_pointwise(
                x, packed, None, "none", [], ""), max(2, 2048 // m), 5)
            rates.append(f"M={m} {2 * m * k * n / seconds / 1e9:.0f}")
        print(f"packed oneDNN float32, {what} ({k} -> {n}), GFLOP/s: " + ", ".join(rates))


def part_step(model_path: str, pairs: int) -> None:
    from one_row_routes import variant_decoder

    import minivllm.model as model_module
    from minivllm import LLM
    from minivllm.compile import DecodeAttention, DecodeInputs, materialise

    engine = LLM(model_path, compile_in_background=False).engine
    shipped = engine.runner.decoder

    def pool_write_only(self, layer_idx, q, k, v):  # the write, as DecodeAttention does it
        layer = torch.full_like(self.slots, layer_idx)
        self.kv.index_put_((torch.zeros_like(self.slots), layer, self.slots), k)
        self.kv.index_put_((torch.ones_like(self.slots), layer, self.slots), v)
        return q * 1.0  # (B, H, D): a kernel of its own, as attention's output is

    rope_cos_sin = model_module.rope_cos_sin

    def rope_once(positions, head_dim, theta):
        cos, sin = rope_cos_sin(positions, head_dim, theta)
        return materialise(cos), materialise(sin)

    attention = DecodeAttention.__call__
    DecodeAttention.__call__ = pool_write_only
    try:  # dynamo traces while these are swapped in: each variant is its own graph
        no_attention = variant_decoder(engine, engine.runner.model)
    finally:
        DecodeAttention.__call__ = attention
    model_module.rope_cos_sin = rope_once
    try:
        rope_computed_once = variant_decoder(engine, engine.runner.model)
    finally:
        model_module.rope_cos_sin = rope_cos_sin
    sides = {"as shipped": shipped, "attention left out": no_attention,
             "RoPE once a step": rope_computed_once}
    blocks = -(-160 // engine.config.block_size)
    for rows in (32, 8, 1):
        batch = DecodeInputs([5] * rows, [160] * rows, [list(range(blocks))] * rows)
        with torch.inference_mode():
            same = torch.equal(shipped.logits(batch), rope_computed_once.logits(batch))
            times = alternate(sides, lambda side, batch=batch: side.logits(batch), pairs)
        base = times["as shipped"]
        print(f"{rows}-row compiled step, context 160: " + "; ".join(
            f"{name} {statistics.median(t) * 1e3:.1f} ms"
            + ("" if name == "as shipped" else
               f" ({statistics.median([a / b for a, b in zip(t, base)]):.3f}x by pair)")
            for name, t in times.items()) + f"; RoPE once gives the same logits: {same}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    p.add_argument("--parts", default="loop,gemm,step")
    p.add_argument("--pairs", type=int, default=16, help="step: timed steps of each side")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for part in args.parts.split(","):
        if part == "loop":
            part_loop()
        elif part == "gemm":
            part_gemm()
        elif part == "step":
            part_step(args.model, args.pairs)
        else:
            raise SystemExit(f"unknown part {part!r}")


if __name__ == "__main__":
    main()
