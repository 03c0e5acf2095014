"""Decode speed of one engine stepped from the thread that loaded it vs from another thread.

    python bench/experiments/omp_threads.py [--model M] [--compile] [--rounds 3] [--tokens 300]

Why this exists: torch runs its intra-op parallelism on OpenMP, and libgomp keeps one pool
of worker threads per *initial* thread that ran a parallel region. An engine loaded (and
warmed up) in the main thread and then stepped by a server's engine thread leaves two pools
on the machine's cores; with more OpenMP threads than cores libgomp throttles its spinning,
so workers sleep between ops and must be woken for every one of the hundreds of ops in a
decode step. The server therefore builds its engine inside the engine thread
(``AsyncEngine(lambda: LLMEngine(config))``). This tool measures the difference, rounds
interleaved (main, other thread, main, ...), one greedy request at a time, and prints the
median tokens/s of each side and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from minivllm import LLM, TINY_MODEL, SamplingParams


def decode_rate(llm: LLM, tokens: int) -> float:
    """Output tokens/s of one greedy request of ``tokens`` tokens (a 32-token prompt)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(range(100, 132))}], params, use_tqdm=False)
    return tokens / (time.perf_counter() - start)


def in_thread(fn, *args) -> float:
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()
    thread.join()
    return result[0]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=TINY_MODEL)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=300)
    args = p.parse_args(argv)
    llm = LLM(args.model, compile=args.compile, num_blocks=256, max_model_len=512)
    decode_rate(llm, args.tokens)  # warm-up
    same, other = [], []
    for _ in range(args.rounds):
        same.append(decode_rate(llm, args.tokens))
        other.append(in_thread(decode_rate, llm, args.tokens))
    result = {"loading_thread_tok_s": statistics.median(same),
              "other_thread_tok_s": statistics.median(other)}
    result["other_over_loading"] = result["other_thread_tok_s"] / result["loading_thread_tok_s"]
    print(f"stepped in the loading thread: {result['loading_thread_tok_s']:.0f} tok/s, "
          f"in another thread: {result['other_thread_tok_s']:.0f} tok/s "
          f"({result['other_over_loading']:.2f}x; medians of {args.rounds} interleaved rounds)")
    return result


if __name__ == "__main__":
    main()
