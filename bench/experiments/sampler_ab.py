"""Drawing a sampled token: the exponential race (one Exp(1) number a token, the package's
way before issue 30's twenty-seventh part) against the inverse CDF (one uniform a row,
``minivllm.sampling.inverse_cdf``), alternated in one process.

Two levels: the draw alone from ``rows x vocab`` probabilities, and whole compiled decode
steps of ``rows`` sequences sampling at temperature 1 (the OpenAI default), each arm's
sampler in the compiled step's own graph, with the uniforms or the noise drawn beside it.
The step level also times the step's logits alone, so the sampler's share shows. Run it
alone on a quiet machine:

    python bench/experiments/sampler_ab.py --model checkpoints/qwen2.5-0.5b-random --rows 1,8,32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import minivllm.compile
from minivllm.compile import DecodeInputs
from minivllm.engine import LLMEngine
from minivllm.sampling import (
    GREEDY_EPS,
    SamplingParams,
    greedy_tokens,
    inverse_cdf,
    mask_min_p,
    mask_top_k,
    mask_top_p,
    uniform_draws,
)


def race_noise(rows: int, vocab: int, generators, device="cpu") -> torch.Tensor:
    """q ~ Exp(1), (rows, vocab), as -log(u) of float64 uniforms: the package's noise before."""
    q = torch.rand(rows, vocab, dtype=torch.float64, device=device).log_().neg_().float()
    for row, gen in enumerate(generators):
        if gen is not None:
            q[row] = torch.rand(vocab, dtype=torch.float64, generator=gen).log_().neg_().float()
    return q


def race_draw(probs: torch.Tensor, generators) -> torch.Tensor:
    """argmax(p / q): the exponential race, (B, V) -> (B,)."""
    return (probs / race_noise(*probs.shape, generators, probs.device)).argmax(dim=-1)


def inverse_cdf_draw(probs: torch.Tensor, generators) -> torch.Tensor:
    """The package's draw, (B, V) -> (B,)."""
    return inverse_cdf(probs, uniform_draws(probs.shape[0], generators, probs.device))


DRAWS = {"race": race_draw, "inverse CDF": inverse_cdf_draw}


def race_sample_logits(logits, temperature, top_k, top_p, min_p, noise, use_filters):
    """Notebook 07's compiled sampler as it was with the race: (B, V) noise passed in."""
    greedy = greedy_tokens(logits)
    scaled = logits / temperature.clamp(min=GREEDY_EPS).unsqueeze(-1)
    if use_filters:
        scaled = mask_min_p(mask_top_p(mask_top_k(scaled, top_k), top_p), min_p)
    sampled = (scaled.softmax(dim=-1) / noise).argmax(dim=-1)
    return torch.where(temperature < GREEDY_EPS, greedy, sampled)


def time_draws(rows: int, vocab: int, rounds: int) -> dict[str, list[float]]:
    probs = torch.softmax(torch.randn(rows, vocab) * 3, dim=-1)
    times = {name: [] for name in DRAWS}
    for k in range(rounds * len(DRAWS)):
        name = list(DRAWS)[k % len(DRAWS)]
        start = time.perf_counter()
        DRAWS[name](probs, [None] * rows)
        times[name].append(time.perf_counter() - start)
    return times


def use_arm(decoder, name: str, graphs: dict) -> None:
    """Point the compiled step at one arm: its compiled sampler, and what the runner draws
    beside it (notebook 07's ``_sample_compiled`` calls ``minivllm.compile.uniform_draws``).
    The race's (B, V) noise rides in the uniforms' place: the batches here are never padded."""
    decoder._sample = graphs[name]
    minivllm.compile.uniform_draws = uniform_draws if name == "inverse CDF" else (
        lambda rows, generators, device: race_noise(rows, graphs["vocab"], generators, device))


def time_steps(model: str | None, rows: int, rounds: int) -> dict[str, list[float]]:
    """Compiled decode steps of ``rows`` sequences at temperature 1, the arms alternated
    step by step (A B B A ...), and the logits alone between them."""
    engine = LLMEngine.from_options(model, compile=True, compile_in_background=False)
    decoder = engine.runner.decoder
    if decoder is None:
        raise SystemExit("the decode step did not compile (see the warning above)")
    graphs = {"inverse CDF": decoder._sample, "vocab": engine.model_config.vocab_size,
              "race": torch.compile(race_sample_logits, dynamic=True)}
    rng = random.Random(0)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=1.0)
    for i in range(rows):
        engine.add_request(str(i), [rng.randrange(1000) for _ in range(128)], params)
    while engine.scheduler.waiting:  # prefill everyone, then time pure decode steps
        engine.step()
    times = {name: [] for name in DRAWS} | {"logits alone": []}
    try:
        for name in ("race", "inverse CDF"):  # untimed: each arm's graph compiles here
            use_arm(decoder, name, graphs)
            engine.step()
        for k in range(rounds * len(DRAWS)):
            name = list(DRAWS)[(k + k // 2) % len(DRAWS)]  # A B B A A B ...
            use_arm(decoder, name, graphs)
            start = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - start)
            seqs = engine.scheduler.running
            batch = DecodeInputs([s.token_ids[-2] for s in seqs], [s.num_tokens - 1 for s in seqs],
                                 [list(s.block_table) for s in seqs])  # a step again, logits only
            with torch.inference_mode():
                start = time.perf_counter()
                decoder.logits(batch)
                times["logits alone"].append(time.perf_counter() - start)
    finally:
        use_arm(decoder, "inverse CDF", graphs)
    return times


def report(what: str, times: dict[str, list[float]]) -> None:
    for name, values in times.items():
        print(f"{what}, {name:>12}: median {statistics.median(values) * 1e3:7.2f} ms "
              f"({' '.join(f'{v * 1e3:.1f}' for v in values)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint for the step level (omit: draws only)")
    ap.add_argument("--rows", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--vocab", type=int, default=151936, help="the draw level's vocabulary")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for rows in [int(r) for r in args.rows.split(",")]:
        report(f"draw {rows} x {args.vocab}", time_draws(rows, args.vocab, args.rounds))
        if args.model:
            report(f"decode step, {rows} sampled rows", time_steps(args.model, rows, args.rounds))


if __name__ == "__main__":
    main()
