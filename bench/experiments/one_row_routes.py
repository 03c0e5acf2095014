"""Where a one-row bf16 decode step could go faster on a CPU without AMX, and what a prefill's
attention costs (issue 30, eighth and ninth parts). Each part alternates its routes in one
process (run it alone; on 2 cores anything else running changes the answer):

* ``linears``: the 0.5B model's 97 linears at one row, weights streamed from memory (every
  layer its own weights, as in the model), by route: the packed oneDNN linear, ``F.linear``,
  ``torch.mv`` (each called eagerly), and in one compiled graph of all 97 (as in the decode
  step): ``torch.mv`` (inductor's loop, converting bf16 to float32) and ``loop_matvec`` (the
  engine's: the weight read as int32 lanes), each on weights in 4 KiB pages and on copies
  moved into huge pages (``move_to_huge_pages``). Routes alternate round by round; prints ms
  for the whole set, the GB/s it implies, and the per-round ratio to inductor's mv loop.
* ``shipped``: the compiled decode step as the engine builds it (on a CPU without AMX: packed
  weights, and at one row the plain weights through inductor's loop on a materialised input,
  ``loop_matvec``) against the same step with packed weights only (``single_row_matvec=False``,
  the engine before the ninth part), alternated step by step, at 1 and 8 rows.
* ``engine``: three engines, as shipped, packed only, and plain weights only
  (``pack_linear_weights=False``), alternating whole greedy requests; the compiled call inside
  each is timed too.
* ``fusion``: the lm_head's weight at one row through inductor's loop, its input the final
  RMSNorm computed in the same graph (inductor inlines the norm into the loop) against an
  input computed beforehand, and the packed oneDNN linear: why ``loop_matvec`` materialises.
* ``wide``: the compiled decode step as shipped against an engine that keeps the plain
  weights (for the one-row loop) only of the wide linears, out features > 4 x in (gate/up
  and the tied lm_head), the others going through oneDNN's packed kernel at one row too;
  two engines, alternated step by step, at 1 and 8 rows (issue 30, fourteenth part).
* ``float32``: the same 97 linears in float32 (what an AVX2-only CPU serves in) at 1, 8 and
  32 rows: packed oneDNN, oneDNN on the plain weight, ``F.linear``, plain weights in huge
  pages, and at one row inductor's loops for ``torch.mv`` and for ``loop_matvec`` (issue 30,
  seventeenth part, the Zen 3).
* ``narrow``: a float32 engine as shipped, whose one-row loop reads bf16 copies of weights
  that are bf16 numbers, against one keeping float32 copies; compiled steps alternated at 1
  and 8 rows (issue 30, eighteenth part, the Zen 3).
* ``few``: a float32 engine as shipped, whose decode batches of 2-8 rows go through the
  few-rows graph (every row through the loop), against a decoder of the same model with
  ``few_rows_loop`` off; compiled steps alternated at 2, 3, 4, 6, 8 and 16 rows; then 2 rows
  through their own graph against 2 rows padded to 4 (issue 30, twenty-second and
  twenty-third parts, the Zen 3; twenty-eighth, the Zen 2).
* ``sdpa``: SDPA on a fresh prompt's shape (14 query heads, 2 kv heads, 64 dims), causal
  with ``enable_gqa``, with the kv heads repeated, and with a boolean mask.

    python bench/experiments/one_row_routes.py --model checkpoints/qwen2.5-0.5b-random \\
        --parts linears,shipped,engine,fusion,sdpa
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


def median_ms(fn, reps: int = 3) -> float:
    """Median milliseconds of ``reps`` calls of ``fn``, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def part_linears(rounds: int) -> None:
    from minivllm.compile import loop_matvec, move_to_huge_pages

    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02
               for _ in range(LAYERS) for k, n in SHAPES]
    weights.append(torch.randn(VOCAB, 896, dtype=torch.bfloat16) * 0.02)  # the lm_head
    gbytes = sum(w.numel() * 2 for w in weights) / 1e9
    rows = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in (896, 4864)}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    in_huge_pages = [w.clone() for w in weights]
    if not move_to_huge_pages(in_huge_pages):
        print("no transparent huge pages on this kernel: the 'huge pages' routes use 4 KiB ones")

    def mv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mv(w, x[0]).unsqueeze(0)

    def graph_of(matvec):  # all 97 in one compiled graph, as in the decode step
        return torch.compile(lambda ws, x896, x4864: [
            matvec(x896 if w.shape[1] == 896 else x4864, w) for w in ws], dynamic=False)
    mv_loop, lane_loop = graph_of(mv), graph_of(loop_matvec)
    routes = {
        "packed oneDNN": lambda: [torch.ops.mkldnn._linear_pointwise(
            rows[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, packed)],
        "F.linear": lambda: [F.linear(rows[w.shape[1]], w) for w in weights],
        "torch.mv": lambda: [mv(rows[w.shape[1]], w) for w in weights],
        "inductor's mv loop": lambda: mv_loop(weights, rows[896], rows[4864]),
        "loop_matvec (lanes)": lambda: lane_loop(weights, rows[896], rows[4864]),
        "mv loop, huge pages": lambda: mv_loop(in_huge_pages, rows[896], rows[4864]),
        "lanes, huge pages": lambda: lane_loop(in_huge_pages, rows[896], rows[4864]),
    }
    with torch.inference_mode():
        for route in routes.values():
            route()
        times = alternate(routes, lambda route: route(), rounds)
    print_routes(times, "inductor's mv loop", f"linears, one row, {gbytes:.2f} GB", gbytes)


def print_routes(times: dict[str, list[float]], base: str, label: str, gbytes: float) -> None:
    """Each route's median ms, the GB/s of weights it implies, and its ratio to ``base``
    round by round (median and range)."""
    for name, seconds in times.items():
        m = statistics.median(seconds) * 1e3
        ratios = [t / b for t, b in zip(seconds, times[base])]
        print(f"{label}: {name:20s} {m:7.1f} ms  {gbytes / m * 1e3:5.1f} GB/s  "
              f"{statistics.median(ratios):.3f}x {base} per round "
              f"({min(ratios):.2f}-{max(ratios):.2f})")


def part_float32(rounds: int, rows_list: tuple[int, ...] = (1, 8, 32)) -> None:
    """The 0.5B model's 97 linears in float32 (the dtype an AVX2-only CPU serves in), by
    route, at 1, 8 and 32 rows: oneDNN on the packed weight (what the engine ships), oneDNN
    on the plain weight (``_linear_pointwise`` takes a dense weight too: no second copy), the
    same on plain weights moved into huge pages, ``F.linear`` (MKL's sgemm), and at one row
    inductor's loops on the huge-page weights: for ``torch.mv``, for ``loop_matvec`` (8
    partial sums a row, what the engine shipped on CPUs without AMX before the eighteenth
    part), and for ``loop_matvec`` on bf16 copies of the weights (what it ships where the
    weights are bf16 numbers, as a checkpoint saved in bf16 gives them: ``narrow_plain_weights``).
    At 8 and 32 rows, the same widened loop with the rows inside each weight row's loop
    (nineteenth part: 2.6x and 4.5x slower than packed oneDNN). The weights here are such
    numbers, so every route multiplies the same ones."""
    from minivllm.compile import BF16_WEIGHT_LANES, loop_matvec, move_to_huge_pages

    torch.manual_seed(0)
    weights = [(torch.randn(n, k) * 0.02).bfloat16().float()
               for _ in range(LAYERS) for k, n in SHAPES]
    weights.append((torch.randn(VOCAB, 896) * 0.02).bfloat16().float())  # the lm_head
    gbytes = sum(w.numel() * 4 for w in weights) / 1e9
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    in_huge_pages = [w.clone() for w in weights]
    in_bf16 = [w.bfloat16() for w in weights]  # the same numbers, half the bytes
    if not move_to_huge_pages(in_huge_pages) or not move_to_huge_pages(in_bf16):
        print("no transparent huge pages on this kernel: the 'huge pages' routes use 4 KiB ones")

    def graph_of(matvec):  # all 97 in one compiled graph, as in the decode step
        return torch.compile(lambda ws, x896, x4864: [
            matvec(x896 if w.shape[1] == 896 else x4864, w) for w in ws], dynamic=False)
    mv_loop = graph_of(lambda x, w: torch.mv(w, x[0]).unsqueeze(0))
    partial_sums = graph_of(loop_matvec)

    def rows_widened(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """(M, K) rows times a bf16 (N, K) weight -> (M, N): loop_matvec's widened partial
        sums with the rows inside each weight row's loop, so the weight is read once."""
        n, lanes = w.shape[0], BF16_WEIGHT_LANES
        products = w.view(n, 1, -1, lanes).float() * x.view(1, x.shape[0], -1, lanes)
        return products.sum(2).sum(-1).t()  # (N, M, K/L, L) -> (N, M) -> (M, N)
    widened_rows = graph_of(rows_widened)

    def routes_at(x: dict[int, torch.Tensor]) -> dict:  # x: the (rows, in) input by in
        by_packed = [(x[w.shape[1]], p) for w, p in zip(weights, packed)]
        routes = {
            "packed oneDNN": lambda: [torch.ops.mkldnn._linear_pointwise(
                xi, p, None, "none", [], "") for xi, p in by_packed],
            "oneDNN, plain": lambda: [torch.ops.mkldnn._linear_pointwise(
                x[w.shape[1]], w, None, "none", [], "") for w in weights],
            "oneDNN, plain, huge": lambda: [torch.ops.mkldnn._linear_pointwise(
                x[w.shape[1]], w, None, "none", [], "") for w in in_huge_pages],
            "F.linear": lambda: [F.linear(x[w.shape[1]], w) for w in weights],
            "F.linear, huge": lambda: [F.linear(x[w.shape[1]], w) for w in in_huge_pages],
        }
        if x[896].shape[0] == 1:
            routes["mv loop, huge"] = lambda: mv_loop(in_huge_pages, x[896], x[4864])
            routes["loop_matvec, huge"] = lambda: partial_sums(in_huge_pages, x[896], x[4864])
            routes["loop_matvec, bf16 copies, huge"] = lambda: partial_sums(
                in_bf16, x[896], x[4864])
        else:
            routes["rows widened, bf16 copies, huge"] = lambda: widened_rows(
                in_bf16, x[896], x[4864])
        return routes

    for rows in rows_list:
        routes = routes_at({k: torch.randn(rows, k) for k in (896, 4864)})
        with torch.inference_mode():
            ref = routes["F.linear"]()
            for name, route in routes.items():
                err = max(float((a.view(b.shape) - b).abs().max()) for a, b in zip(route(), ref))
                assert err < 1e-3, f"{name}: {err}"
            times = alternate(routes, lambda route: route(), rounds)
        print_routes(times, "packed oneDNN", f"float32 linears, {rows} row(s), {gbytes:.2f} GB",
                     gbytes)


def compare_one_row_steps(sides: dict, pairs: int, rows: int = 1) -> None:
    """Compiled decode steps (``CompiledDecoder``s over one pool, keyed by name) of ``rows``
    rows at context 160, alternated step by step; the ratio is the second's over the first's."""
    from minivllm.compile import DecodeInputs

    names = list(sides)
    block_size = next(iter(sides.values())).block_size
    blocks = -(-160 // block_size)
    batch = DecodeInputs([5] * rows, [160] * rows, [list(range(blocks))] * rows)
    with torch.inference_mode():
        a, b = (side.logits(batch) for side in sides.values())
        print(f"max |logits difference| {float((a - b).abs().max()):.3g}, same argmax: "
              f"{bool((a.argmax(-1) == b.argmax(-1)).all())}")
        times = alternate(sides, lambda d: d.logits(batch), pairs)
    ratios = [b / a for a, b in zip(times[names[0]], times[names[1]])]
    print(f"{rows}-row compiled step, context 160: " + ", ".join(
        f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in times.items())
        + f"; per pair {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")


def variant_decoder(engine, model: torch.nn.Module, **options):
    """``model`` compiled the way the engine compiles its own, over the engine's pool
    (``options``: ``CompiledDecoder``'s keyword arguments, e.g. ``few_rows_loop=False``)."""
    from minivllm.compile import CompiledDecoder

    variant = CompiledDecoder(model, engine.runner.pool.kv, engine.config.block_size,
                              engine.num_blocks, engine.device, **options)
    variant.warmup(engine.model_config.vocab_size)
    return variant


def part_few(model_path: str, pairs: int) -> None:
    """Decode steps of 2, 3, 4, 6, 8 and 16 rows as shipped (a float32 batch of 2 rows, of 3-4
    padded to 4 or 5-8 padded to 8, through its few-rows graph, every row through the loop;
    16 rows through oneDNN's packed kernel on both sides) against a decoder of
    the same model and pool with ``few_rows_loop`` off (oneDNN's packed kernel), alternated;
    then 2 rows as shipped against 2 rows padded to 4."""
    from minivllm import LLM
    engine = LLM(model_path, compile_in_background=False).engine
    packed = variant_decoder(engine, engine.runner.model, few_rows_loop=False)
    for rows in (2, 3, 4, 6, 8, 16):
        compare_one_row_steps({"packed": packed, "as shipped": engine.runner.decoder}, pairs, rows)
    # 2 rows through their own graph (shipped) against 2 rows padded to 4 (the twenty-second
    # part's form): the same decoder, its 4-row graph, a copy routing by one bucket only
    shipped = engine.runner.decoder
    padded = copy.copy(shipped)
    padded.few_rows_buckets = (4,)
    padded._logits = padded._few_or_many_rows  # bound to the copy: routes by its buckets
    compare_one_row_steps({"padded to 4": padded, "as shipped": shipped}, pairs, 2)


# The engines compared by ``shipped`` and ``engine``: EngineConfig options by name
ENGINES = {"as shipped": {},
           "packed only": {"single_row_matvec": False},
           "plain + loop": {"pack_linear_weights": False, "matvec_kernel": "inductor"}}


def part_shipped(model_path: str, pairs: int) -> None:
    from minivllm import LLM

    shipped = LLM(model_path, compile_in_background=False).engine
    packed = LLM(model_path, compile=False, **ENGINES["packed only"]).engine.runner.model
    for rows in (1, 8):
        compare_one_row_steps({"packed only": variant_decoder(shipped, packed),
                               "as shipped": shipped.runner.decoder}, pairs, rows)


def part_wide(model_path: str, pairs: int) -> None:
    from minivllm import LLM
    from minivllm.compile import PackedLinear

    shipped = LLM(model_path, compile_in_background=False).engine
    packed_init = PackedLinear.__init__

    def wide_only(self, linear, keep_plain_weight=False):
        packed_init(self, linear, keep_plain_weight
                    and linear.out_features > 4 * linear.in_features)
    PackedLinear.__init__ = wide_only
    try:
        wide = LLM(model_path, compile_in_background=False).engine
    finally:
        PackedLinear.__init__ = packed_init
    print(f"plain weights in huge pages: as shipped {shipped.runner.huge_page_bytes / 2**30:.2f}"
          f" GiB, wide only {wide.runner.huge_page_bytes / 2**30:.2f} GiB")
    for rows in (1, 8):
        compare_one_row_steps({"as shipped": shipped.runner.decoder,
                               "plain weights of the wide linears only": wide.runner.decoder},
                              pairs, rows)


def part_narrow(model_path: str, pairs: int) -> None:
    """A float32 engine as shipped (where its weights are bf16 numbers, the one-row loop
    reads bf16 copies: ``narrow_plain_weights``) against the same engine keeping float32
    copies, compiled steps alternated at 1 and 8 rows (eighteenth part)."""
    import minivllm.compile as compile_module
    from minivllm import LLM

    shipped = LLM(model_path, dtype="float32", compile_in_background=False).engine
    narrow = compile_module.narrow_plain_weights
    compile_module.narrow_plain_weights = lambda modules: 0
    try:
        kept = LLM(model_path, dtype="float32", compile_in_background=False).engine
    finally:
        compile_module.narrow_plain_weights = narrow
    print(f"one-row loop's weights: as shipped {shipped.runner.huge_page_bytes / 2**30:.2f} GiB"
          f" ({shipped.runner.narrowed_bytes / 2**30:.2f} of them bf16 copies), float32 copies"
          f" {kept.runner.huge_page_bytes / 2**30:.2f} GiB")
    for rows in (1, 8):
        compare_one_row_steps({"float32 copies": kept.runner.decoder,
                               "as shipped": shipped.runner.decoder}, pairs, rows)


def part_engine(model_path: str, pairs: int) -> None:
    from minivllm import LLM, SamplingParams

    llms = {name: LLM(model_path, compile_in_background=False, **options)
            for name, options in ENGINES.items()}
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
                times[name].append(median_ms(route, 5))
    for name, ms in times.items():
        print(f"lm_head, one row: {name:34s} {statistics.median(ms):6.2f} ms")


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
                times[name].append(median_ms(route, 20))
        for name in routes:
            ms = statistics.median(times[name])
            print(f"sdpa, {t} tokens, bf16: {name:22s} {ms * 1e3:7.0f} us  "
                  f"{flops / ms / 1e6:5.0f} GFLOP/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    p.add_argument("--parts", default="linears,shipped,engine,fusion,sdpa")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--pairs", type=int, default=20)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for part in args.parts.split(","):
        if part == "linears":
            part_linears(args.rounds)
        elif part == "float32":
            part_float32(args.rounds)
        elif part == "shipped":
            part_shipped(args.model, args.pairs)
        elif part == "wide":
            part_wide(args.model, args.pairs)
        elif part == "narrow":
            part_narrow(args.model, args.pairs)
        elif part == "few":
            part_few(args.model, args.pairs)
        elif part == "engine":
            part_engine(args.model, max(2, args.pairs // 4))
        elif part == "fusion":
            part_fusion(args.rounds)
        elif part == "sdpa":
            part_sdpa(args.rounds)
        else:
            raise SystemExit(f"unknown part {part!r}")


if __name__ == "__main__":
    main()
