"""Where a one-row bf16 decode step could go faster on a CPU without AMX, and what a prefill's
attention costs (issue 30, eighth part). Four parts, each alternating its routes in one
process (run it alone; on 2 cores anything else running changes the answer):

* ``linears``: the 0.5B model's 97 linears at one row, weights streamed from memory (every
  layer its own weights, as in the model), by route: the packed oneDNN linear (what the
  engine runs), ``F.linear``, ``torch.mv``, and ``torch.mv`` compiled by inductor (its own
  reduction loop). Prints ms for the whole set and the GB/s it implies.
* ``step``: the compiled one-row decode step (``CompiledDecoder.logits``) as the engine builds
  it, against a copy whose lm_head reads its tied plain weight (the embedding's) through
  inductor's loop at one row instead of the packed copy.
* ``engine``: two engines, the default (packed weights) and one with plain weights and
  inductor's loop for one row (``pack_linear_weights=False, matvec_kernel="inductor"``),
  alternating whole greedy requests; the compiled call inside each is timed too.
* ``fusion``: the lm_head's weight at one row through inductor's loop, its input the final
  RMSNorm computed in the same graph (inductor inlines the norm into the loop, as in the
  engine's step) against an input computed beforehand, and the packed oneDNN linear.
* ``materialised``: the compiled one-row step as the engine builds it (packed weights)
  against a second engine's model with plain weights whose every linear, at one row, runs
  inductor's loop on an input first materialised by an opaque op (so that no producer is
  inlined into the loop), alternated step by step.
* ``sdpa``: SDPA on a fresh prompt's shape (14 query heads, 2 kv heads, 64 dims), causal
  with ``enable_gqa``, with the kv heads repeated, and with a boolean mask.

    python bench/experiments/one_row_routes.py --model checkpoints/qwen2.5-0.5b-random \\
        --parts linears,step,engine,fusion,materialised,sdpa
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from matvec_ab import alternate

LAYERS = 24
SHAPES = [(896, 1152), (896, 896), (896, 9728), (4864, 896)]  # (in, out): qkv, o, gate_up, down
VOCAB = 151936


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def part_linears(rounds: int) -> None:
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02
               for _ in range(LAYERS) for k, n in SHAPES]
    weights.append(torch.randn(VOCAB, 896, dtype=torch.bfloat16) * 0.02)  # the lm_head
    gbytes = sum(w.numel() * 2 for w in weights) / 1e9
    rows = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in (896, 4864)}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]

    def mv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mv(w, x[0]).unsqueeze(0)
    compiled_mv = torch.compile(mv, dynamic=False)
    routes = {
        "packed oneDNN": lambda: [torch.ops.mkldnn._linear_pointwise(
            rows[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, packed)],
        "F.linear": lambda: [F.linear(rows[w.shape[1]], w) for w in weights],
        "torch.mv": lambda: [mv(rows[w.shape[1]], w) for w in weights],
        "inductor's mv loop": lambda: [compiled_mv(rows[w.shape[1]], w) for w in weights],
    }
    times = {name: [] for name in routes}
    with torch.inference_mode():
        for route in routes.values():
            route()
        for _ in range(rounds):
            for name, route in routes.items():
                times[name].append(_median_ms(route, 1))
    for name, ms in times.items():
        m = statistics.median(ms)
        print(f"linears, one row, {gbytes:.2f} GB: {name:20s} {m:6.1f} ms  {gbytes / m * 1e3:5.1f} GB/s")


def compare_one_row_steps(engine, model: torch.nn.Module, names: tuple[str, str],
                          pairs: int) -> None:
    """The engine's compiled one-row step (``names[0]``) against ``model`` compiled the same
    way over the same pool (``names[1]``), context 160, alternated step by step."""
    from minivllm.compile import CompiledDecoder, DecodeInputs

    variant = CompiledDecoder(model, engine.runner.pool.kv, engine.config.block_size,
                              engine.num_blocks, engine.device)
    variant.warmup(engine.model_config.vocab_size)
    blocks = -(-160 // engine.config.block_size)
    batch = DecodeInputs([5], [160], [list(range(blocks))])
    sides = dict(zip(names, (engine.runner.decoder, variant)))
    with torch.inference_mode():
        a, b = (side.logits(batch) for side in sides.values())
        print(f"max |logits difference| {float((a - b).abs().max()):.3g}, same argmax: "
              f"{bool((a.argmax(-1) == b.argmax(-1)).all())}")
        times = alternate(sides, lambda d: d.logits(batch), pairs)
    ratios = [b / a for a, b in zip(times[names[0]], times[names[1]])]
    print("one-row compiled step, context 160: " + ", ".join(
        f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in times.items())
        + f"; per pair {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")


def part_step(model_path: str, pairs: int) -> None:
    from minivllm import LLM

    engine = LLM(model_path, compile_in_background=False).engine
    model = copy.deepcopy(engine.runner.model)
    tied, head = model.model.embed_tokens.weight, model.lm_head
    packed_forward = head.forward

    def head_forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and torch.compiler.is_compiling():
            return torch.mv(tied, x[0]).unsqueeze(0)  # (1, V): inductor's loop, plain weight
        return packed_forward(x)
    head.forward = head_forward
    compare_one_row_steps(engine, model, ("packed lm_head", "tied lm_head, mv loop"), pairs)


def part_engine(model_path: str, pairs: int) -> None:
    from minivllm import LLM, SamplingParams

    llms = {"packed": LLM(model_path, compile_in_background=False),
            "plain + mv loop": LLM(model_path, compile_in_background=False,
                                   pack_linear_weights=False, matvec_kernel="inductor")}
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    calls: dict[str, list[float]] = {name: [] for name in llms}
    for name, llm in llms.items():
        llm.generate([prompt], params, use_tqdm=False)
        decoder = llm.engine.runner.decoder
        untimed = decoder.logits

        def timed(batch, untimed=untimed, name=name):
            start = time.perf_counter()
            out = untimed(batch)
            calls[name].append(time.perf_counter() - start)
            return out
        decoder.logits = timed
    times = alternate(llms, lambda llm: llm.generate([prompt], params, use_tqdm=False), pairs)
    for name in llms:
        print(f"engine, 128-token prompt + 48 tokens: {name}: request "
              f"{statistics.median(times[name]):.2f} s, compiled one-row step "
              f"{statistics.median(calls[name]) * 1e3:.1f} ms")


def part_fusion(rounds: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, 896, dtype=torch.bfloat16) * 0.02
    gain = torch.ones(896, dtype=torch.bfloat16)
    x = torch.randn(1, 896, dtype=torch.bfloat16)

    def rms_norm(x: torch.Tensor) -> torch.Tensor:  # (1, 896), as the model's final norm
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * gain

    norm_then_mv = torch.compile(lambda x: torch.mv(weight, rms_norm(x)[0]), dynamic=False)
    mv_only = torch.compile(lambda xn: torch.mv(weight, xn[0]), dynamic=False)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    with torch.inference_mode():
        xn = rms_norm(x)
        routes = {"norm inlined into inductor's loop": lambda: norm_then_mv(x),
                  "inductor's loop, input ready": lambda: mv_only(xn),
                  "packed oneDNN, input ready": lambda: torch.ops.mkldnn._linear_pointwise(
                      xn, packed, None, "none", [], "")}
        times = {name: [] for name in routes}
        for _ in range(rounds):  # round by round, so that a drift falls on every route
            for name, route in routes.items():
                times[name].append(_median_ms(route, 5))
    for name, ms in times.items():
        print(f"lm_head, one row: {name:34s} {statistics.median(ms):6.2f} ms")


@torch.library.custom_op("experiment::materialise", mutates_args=())
def materialise(x: torch.Tensor) -> torch.Tensor:
    """A copy inductor cannot see into: its input is computed into a buffer first."""
    return x.clone()


@materialise.register_fake
def _materialise_shape(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def part_materialised(model_path: str, pairs: int) -> None:
    from minivllm import LLM
    from minivllm.compile import SingleRowLinear, use_matvec_for_single_rows

    class MaterialisedRowLinear(SingleRowLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 2 and x.shape[0] == 1 and torch.compiler.is_compiling():
                out = torch.mv(self.weight, materialise(x)[0]).unsqueeze(0)  # (1, out)
                return out if self.bias is None else out + self.bias
            return super().forward(x)

    engine = LLM(model_path, compile_in_background=False).engine
    model = LLM(model_path, compile=False, pack_linear_weights=False).engine.runner.model
    use_matvec_for_single_rows(model, "inductor")
    for module in model.modules():
        if type(module) is SingleRowLinear:
            module.__class__ = MaterialisedRowLinear
    compare_one_row_steps(engine, model, ("packed", "plain, materialised inputs"), pairs)


def sdpa_routes(t: int) -> dict:
    """SDPA's routes for one fresh prompt of ``t`` tokens: (1, 14, t, 64) queries, 2 kv heads."""
    q = torch.randn(1, 14, t, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, t, 64, dtype=torch.bfloat16) for _ in range(2))
    k_rep, v_rep = k.repeat_interleave(7, 1), v.repeat_interleave(7, 1)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    sdpa = F.scaled_dot_product_attention
    return {"causal, enable_gqa": lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True),
            "causal, kv repeated": lambda: sdpa(q, k_rep, v_rep, is_causal=True),
            "bool mask, enable_gqa": lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True)}


def part_sdpa(rounds: int) -> None:
    for t in (128, 512):
        routes = sdpa_routes(t)
        flops = 2 * 2 * 14 * t * t * 64 / 2  # q.k and p.v over the causal half
        times = {name: [] for name in routes}
        for _ in range(rounds):
            for name, route in routes.items():
                times[name].append(_median_ms(route, 20))
        for name in routes:
            ms = statistics.median(times[name])
            print(f"sdpa, {t} tokens, bf16: {name:22s} {ms * 1e3:7.0f} us  "
                  f"{flops / ms / 1e6:5.0f} GFLOP/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    p.add_argument("--parts", default="linears,step,engine,fusion,materialised,sdpa")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--pairs", type=int, default=20)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for part in args.parts.split(","):
        if part == "linears":
            part_linears(args.rounds)
        elif part == "step":
            part_step(args.model, args.pairs)
        elif part == "engine":
            part_engine(args.model, max(2, args.pairs // 4))
        elif part == "fusion":
            part_fusion(args.rounds)
        elif part == "materialised":
            part_materialised(args.model, args.pairs)
        elif part == "sdpa":
            part_sdpa(args.rounds)
        else:
            raise SystemExit(f"unknown part {part!r}")


if __name__ == "__main__":
    main()
