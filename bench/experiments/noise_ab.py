"""Exp(1) noise for the exponential race: ``Tensor.exponential_`` against ``-log(u)`` of
float64 uniforms (``minivllm.sampling.exponential_noise``), alternated in one process.

Two levels: the draw alone (``rows x vocab``), and whole compiled decode steps of ``rows``
sequences sampling at temperature 1 (the OpenAI default), where the noise is drawn beside
the compiled graph. Run it alone on a quiet machine:

    python bench/experiments/noise_ab.py --model checkpoints/qwen2.5-0.5b-random --rows 32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import minivllm.compile
import minivllm.sampling
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.sampling import SamplingParams

PACKAGE_NOISE = minivllm.sampling.exponential_noise


def exponential_noise_exponential_(rows: int, vocab: int, generators, device="cpu") -> torch.Tensor:
    """The noise as ``Tensor.exponential_`` draws it (the package before issue 30's change)."""
    q = torch.empty(rows, vocab, device=device).exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            q[row] = torch.empty(vocab).exponential_(generator=gen).to(device)
    return q


ARMS = {"exponential_": exponential_noise_exponential_, "-log(u) float64": PACKAGE_NOISE}


def use(noise) -> None:
    """Point both callers (notebook 03's Sampler, notebook 07's compiled sampler) at ``noise``."""
    minivllm.sampling.exponential_noise = minivllm.compile.exponential_noise = noise


def time_draws(rows: int, vocab: int, rounds: int) -> dict[str, list[float]]:
    times = {name: [] for name in ARMS}
    for k in range(rounds * len(ARMS)):
        name = list(ARMS)[k % len(ARMS)]
        start = time.perf_counter()
        ARMS[name](rows, vocab, [None] * rows)
        times[name].append(time.perf_counter() - start)
    return times


def time_steps(model: str, rows: int, rounds: int) -> dict[str, list[float]]:
    engine = LLMEngine(EngineConfig(model=model, dtype="auto"))
    engine.runner.wait_until_compiled()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=1.0)
    for i in range(rows):
        engine.add_request(str(i), [rng.randrange(1000) for _ in range(128)], params)
    while engine.scheduler.waiting:  # prefill everyone, then time pure decode steps
        engine.step()
    for _ in range(3):
        engine.step()
    times = {name: [] for name in ARMS}
    for k in range(rounds * len(ARMS)):
        name = list(ARMS)[k % len(ARMS)]
        use(ARMS[name])
        start = time.perf_counter()
        engine.step()
        times[name].append(time.perf_counter() - start)
    use(PACKAGE_NOISE)
    return times


def report(what: str, times: dict[str, list[float]]) -> None:
    for name, values in times.items():
        print(f"{what}, {name:>16}: median {statistics.median(values) * 1e3:6.1f} ms "
              f"({' '.join(f'{v * 1e3:.0f}' for v in values)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint for the step level (omit: draws only)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=151936, help="the draw level's vocabulary")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    report(f"draw {args.rows} x {args.vocab}", time_draws(args.rows, args.vocab, args.rounds))
    if args.model:
        report(f"decode step, {args.rows} sampled rows", time_steps(args.model, args.rows, args.rounds))


if __name__ == "__main__":
    main()
