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
  what no decode attention could save beyond), against RoPE's cos/sin computed once a
  step (``materialise``d: inductor otherwise recomputes them inside every layer's kernel),
  against RoPE's cos/sin read from a table of every position (vLLM's ``cos_sin_cache``), and
  against the gather and SDPA as one opaque op (eager inside the graph); compiled steps
  alternated step by step over one engine's pool, the blocks of each row drawn at random.
* ``logits``: a lone prompt's step (30 and 128 tokens, one logits row) with its logits
  through the flat step's compiled one-row graph (``CompiledFlatStep.logits``, shipped)
  against the eager packed lm_head, alternated, and the lm_head alone either way.

    python bench/experiments/step_ceilings.py --model checkpoints/qwen2.5-0.5b-random \\
        --parts loop,gemm,step,logits
"""

from __future__ import annotations

import argparse
import random
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

    config = engine.runner.model.config
    table = torch.stack(rope_cos_sin(torch.arange(config.max_position_embeddings),
                                     config.head_dim, config.rope_theta))  # (2, P, D)

    def rope_from_table(positions, head_dim, theta):
        return table[0][positions], table[1][positions]  # (T, D) each

    def opaque_attention(self, layer_idx, q, k, v):  # the write inline, the rest one op
        pool_write_only(self, layer_idx, q, k, v)
        return gather_and_attend(self.kv, layer_idx, self.block_tables, q, self.mask,
                                 self.block_size)

    attention = DecodeAttention.__call__
    variants = {"attention left out": (pool_write_only, rope_cos_sin),
                "RoPE once a step": (attention, rope_once),
                "RoPE from a table": (attention, rope_from_table),
                "attention one opaque op": (opaque_attention, rope_cos_sin)}
    sides = {"as shipped": shipped}
    for name, (attend, rope) in variants.items():
        DecodeAttention.__call__, model_module.rope_cos_sin = attend, rope
        try:  # dynamo traces while these are swapped in: each variant is its own graph
            sides[name] = variant_decoder(engine, engine.runner.model)
        finally:
            DecodeAttention.__call__, model_module.rope_cos_sin = attention, rope_cos_sin
    blocks = -(-160 // engine.config.block_size)
    draw = random.Random(0)
    for rows in (32, 8, 1):
        tables = [draw.sample(range(engine.num_blocks), blocks) for _ in range(rows)]
        batch = DecodeInputs([5] * rows, [160] * rows, tables)
        with torch.inference_mode():
            reference = shipped.logits(batch)
            diffs = {name: float((side.logits(batch) - reference).abs().max())
                     for name, side in sides.items() if name != "attention left out"}
            times = alternate(sides, lambda side, batch=batch: side.logits(batch), pairs)
        base = times["as shipped"]
        print(f"{rows}-row compiled step, context 160: " + "; ".join(
            f"{name} {statistics.median(t) * 1e3:.1f} ms"
            + ("" if name == "as shipped" else
               f" ({statistics.median([a / b for a, b in zip(t, base)]):.3f}x by pair)")
            for name, t in times.items()))
        print("  largest logit difference from the shipped step: " + ", ".join(
            f"{name} {d:.1e}" for name, d in diffs.items() if name != "as shipped"))


@torch.library.custom_op("step_ceilings::gather_and_attend", mutates_args=())
def gather_and_attend(kv: torch.Tensor, layer_idx: int, block_tables: torch.Tensor,
                      q: torch.Tensor, mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """DecodeAttention's gather and SDPA, eagerly, as one op inductor calls as it is."""
    from minivllm.attention import attend_decode, gather_blocks

    keys = gather_blocks(kv[0, layer_idx], block_tables, block_size)  # (B, n_kv, K, D)
    values = gather_blocks(kv[1, layer_idx], block_tables, block_size)
    return attend_decode(q.unsqueeze(1), keys, values, mask).squeeze(1)  # (B, H, D)


@gather_and_attend.register_fake
def _gather_and_attend_shape(kv, layer_idx, block_tables, q, mask, block_size):
    return torch.empty_like(q)


def part_logits(model_path: str, pairs: int) -> None:
    from minivllm import LLM, SamplingParams

    llm = LLM(model_path, compile_in_background=False)
    flat = llm.engine.runner.decoder.flat
    compiled_logits = flat._one_row_logits
    hidden = torch.randn(1, llm.engine.model_config.hidden_size)
    model = llm.engine.runner.model
    with torch.inference_mode():
        eager = model.compute_logits(hidden)
        difference = float((flat.logits(hidden) - eager).abs().max())
        times = alternate({"compiled one row (shipped)": lambda: flat.logits(hidden),
                           "eager packed": lambda: model.compute_logits(hidden)},
                          lambda side: side(), pairs * 2)
    print("the lm_head on one row: " + "; ".join(
        f"{name} {statistics.median(t) * 1e3:.2f} ms" for name, t in times.items())
        + f"; largest logit difference {difference:.1e}")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    draw = random.Random(0)
    sides = {"compiled one row (shipped)": compiled_logits, "eager packed": None}

    def lone_prompt(side, n: int) -> None:  # one step: the prefill and its one logits row
        flat._one_row_logits = side
        prompt = {"prompt_token_ids": [draw.randrange(1000, 100000) for _ in range(n)]}
        llm.generate(prompt, params, use_tqdm=False)

    try:
        for n in (30, 128):
            times = alternate(sides, lambda side, n=n: lone_prompt(side, n), pairs)
            base = times["eager packed"]
            print(f"a lone {n}-token prompt's step: " + "; ".join(
                f"{name} {statistics.median(t) * 1e3:.1f} ms" for name, t in times.items())
                + f"; shipped - eager by pair "
                  f"{statistics.median([a - b for a, b in zip(times[next(iter(sides))], base)]) * 1e3:+.1f} ms")
    finally:
        flat._one_row_logits = compiled_logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    p.add_argument("--parts", default="loop,gemm,step,logits")
    p.add_argument("--pairs", type=int, default=16, help="step, logits: timed steps of each side")
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
        elif part == "logits":
            part_logits(args.model, args.pairs)
        else:
            raise SystemExit(f"unknown part {part!r}")


if __name__ == "__main__":
    main()
