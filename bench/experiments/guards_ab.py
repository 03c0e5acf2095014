"""The compiled steps as shipped, dynamo checking only the inputs' guards before each call
(``compile_guarding_inputs``), against the same functions compiled with every guard, and
(``--cpp-wrapper``) against inductor's C++ wrapper in place of its Python one (decode and
flat step); the arms alternated call by call in one process, on one engine's model and pool:

    python bench/experiments/guards_ab.py --model checkpoints/qwen2.5-0.5b-random \\
        --rows 1,8,32 --pairs 30 --prefill 128 --prefill-pairs 30 [--cpp-wrapper]

Prints the guards each compile keeps and drops, then per shape the median time of each arm
and the median of the paired differences. The decode arms run ``decode_logits`` on rows at
context 160; the prefill arm runs one fresh prompt through the flat step (both halves of
every layer). A first call of each arm compiles it (the C++ wrapper's compile time is
printed: minutes on an empty inductor cache, seconds from a warm one). Compare only arms of
one shape. Cited in docs/decisions.md (issue 30, fifteenth and sixteenth parts).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from matvec_ab import alternate  # bench/experiments/ is on the path of a script run from it

from minivllm import LLM
from minivllm.compile import after_attention, before_attention, decode_logits, flat_hidden
from minivllm.kv_cache import AttentionMetadata

SHIPPED = "inputs' guards (shipped)"


def counting(counts: dict, name: str):
    """A guard_filter_fn that keeps every guard and counts them per compiled graph."""
    def keep_all(entries):
        counts.setdefault(name, []).append(len(entries))
        return [True] * len(entries)
    return keep_all


def report(shape: str, times: dict[str, list[float]]) -> None:
    base = times[SHIPPED]
    for name, values in times.items():
        saved = "" if name == SHIPPED else (
            f", {SHIPPED} faster by {statistics.median(v - b for v, b in zip(values, base)) * 1e3:+.2f}"
            " ms (median of pairs)")
        print(f"{shape}: {name}: {statistics.median(values) * 1e3:.2f} ms{saved}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    ap.add_argument("--rows", default="1,8,32", help="decode rows to time, comma-separated")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--prefill", type=int, default=128, help="prompt tokens (0: none)")
    ap.add_argument("--prefill-pairs", type=int, default=30)
    ap.add_argument("--cpp-wrapper", action="store_true",
                    help="a third arm: the shipped guards with inductor's cpp_wrapper")
    args = ap.parse_args()

    runner = LLM(args.model, compile_in_background=False).engine.runner
    decoder, kv = runner.decoder, runner.pool.kv
    model, block_size = decoder.model, decoder.block_size
    counts: dict[str, list[int]] = {}
    every = {"dynamic": True, "isolate_recompiles": True}
    decode_arms = {SHIPPED: decoder._logits,
                   "every guard": torch.compile(decode_logits, **every, options={
                       "guard_filter_fn": counting(counts, "decode_logits")})}
    flat_arms = {SHIPPED: (decoder.flat._before, decoder.flat._after),
                 "every guard": tuple(torch.compile(fn, **every, options={
                     "guard_filter_fn": counting(counts, fn.__name__)})
                     for fn in (before_attention, after_attention))}
    if args.cpp_wrapper:
        from minivllm.compile import guards_on_inputs

        cpp = {"guard_filter_fn": guards_on_inputs, "cpp_wrapper": True}
        decode_arms["cpp_wrapper"] = torch.compile(decode_logits, **every, options=cpp)
        flat_arms["cpp_wrapper"] = tuple(torch.compile(fn, **every, options=cpp)
                                         for fn in (before_attention, after_attention))

    def decode_inputs(rows: int):
        return (torch.arange(1000, 1000 + rows), torch.full((rows,), 160),
                torch.arange(rows * 10).view(rows, 10))

    def prefill(halves) -> torch.Tensor:
        tokens = args.prefill
        table = list(range(20, 20 + -(-tokens // block_size)))
        metadata = AttentionMetadata.build([table], [0], [tokens], block_size, kv.device,
                                           pad_block=runner.num_blocks)
        return flat_hidden(model, torch.arange(2000, 2000 + tokens), torch.arange(tokens),
                           runner._flat_attention()(metadata), *halves,
                           torch.tensor([tokens - 1]))

    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",") if r]:
            want = None
            for name, step in decode_arms.items():  # compile, and check: the same logits
                start = time.perf_counter()
                got = step(model, kv, *decode_inputs(rows), block_size)
                if name == "cpp_wrapper":
                    print(f"cpp_wrapper, {rows} row(s): first call (compiles where no graph "
                          f"covers it yet) {time.perf_counter() - start:.1f} s", flush=True)
                want = got if want is None else want
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            report(f"decode, {rows} row(s)", alternate(
                decode_arms, lambda step, rows=rows: step(model, kv, *decode_inputs(rows), block_size),
                args.pairs))
        if args.prefill:
            want = prefill(flat_arms[SHIPPED])
            for name, halves in flat_arms.items():  # compile, and check: the same hidden states
                start = time.perf_counter()
                torch.testing.assert_close(prefill(halves), want, rtol=0, atol=0)
                if name == "cpp_wrapper":
                    print(f"cpp_wrapper, the flat step: first call (compile) "
                          f"{time.perf_counter() - start:.1f} s", flush=True)
            report(f"prefill, {args.prefill} tokens", alternate(flat_arms, prefill, args.prefill_pairs))
    for name, per_graph in counts.items():
        print(f"guards of {name}, every guard, per graph: {per_graph}")


if __name__ == "__main__":
    main()
