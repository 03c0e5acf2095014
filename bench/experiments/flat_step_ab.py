"""Prefill and mixed engine steps with each layer compiled around attention
(``CompiledFlatStep``, notebook 07) against the eager model, alternated in one process.

One engine, compiled as the server compiles it; each arm is one whole ``engine.step()`` of
the same shape: fresh prompts (``--prompts``, e.g. ``128`` or ``128,128,128,128``) beside
``--decodes`` sequences that are decoding. Between rounds the flat step is switched off
and on again (``runner.decoder.flat``), so both arms run on the same weights, pool and
machine minute. Run it alone on a quiet machine:

    python bench/experiments/flat_step_ab.py --model checkpoints/qwen2.5-0.5b-random \\
        --shapes "0:128;0:128,128,128,128;31:128;31:481;7:128"

A shape is ``DECODES:PROMPT,PROMPT,...``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.sampling import SamplingParams

ARMS = ("eager", "flat step")


def use_flat_step(engine: LLMEngine) -> Callable[[str], None]:
    """This experiment's switch: the arm "flat step" runs the compiled flat step, "eager" not."""
    flat = engine.runner.decoder.flat

    def use(arm: str) -> None:
        engine.runner.decoder.flat = flat if arm == "flat step" else None
    return use


def step_times(engine: LLMEngine, decodes: int, prompts: list[int], rounds: int,
               rng: random.Random, arms: tuple[str, str] = ARMS,
               use: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Per arm, ``rounds`` times one step that prefills ``prompts`` beside ``decodes``
    decoding sequences (the decoders are kept running; each step gets fresh prompts).
    ``use(arm)`` switches the engine to an arm (default: ``use_flat_step``); the last arm
    is left on at the end."""
    use = use_flat_step(engine) if use is None else use
    budget = engine.scheduler.max_num_batched_tokens
    if decodes + sum(prompts) > budget:
        raise SystemExit(f"{decodes} decodes + {sum(prompts)} prompt tokens do not fit one "
                         f"step of {budget} tokens")
    long_run = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    one_token = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    for i in range(decodes):
        engine.add_request(f"d{i}", [rng.randrange(1000) for _ in range(64)], long_run)
    while engine.scheduler.waiting:  # prefill the decoders, then let them decode
        engine.step()
    engine.step()
    times = {arm: [] for arm in arms}
    for k in range(2 * rounds):
        arm = arms[(k + k // 2) % 2]  # A B B A A B ...
        use(arm)
        for j, n in enumerate(prompts):
            engine.add_request(f"p{k}-{j}", [rng.randrange(1000) for _ in range(n)], one_token)
        start = time.perf_counter()
        engine.step()
        times[arm].append(time.perf_counter() - start)
        while engine.scheduler.waiting or any(s.request_id.startswith("p")
                                              for s in engine.scheduler.running):
            engine.step()  # finish the prompts (their one token) before the next round
    use(arms[-1])
    for i in range(decodes):
        engine.abort_request(f"d{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return times


def parse_shape(text: str) -> tuple[int, list[int]]:
    decodes, _, prompts = text.partition(":")
    return int(decodes), [int(n) for n in prompts.split(",") if n]


def shapes_parser(description: str, shapes: str, rounds: int = 6) -> argparse.ArgumentParser:
    """The options of every A/B built on ``run_shapes``: model, dtype, step shapes, rounds."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--shapes", default=shapes,
                    help="DECODES:PROMPT,PROMPT,...; several separated by ';'")
    ap.add_argument("--rounds", type=int, default=rounds)
    return ap


def compiled_engine(model: str, dtype: str) -> LLMEngine:
    """One engine compiled as the server compiles it, in the foreground; exits where its flat
    step did not compile (the A/Bs here switch parts of that step)."""
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, compile=True,
                                    compile_in_background=False))
    if engine.runner.decoder is None or engine.runner.decoder.flat is None:
        raise SystemExit("the flat step did not compile here")
    return engine


def main() -> None:
    args = shapes_parser(__doc__.splitlines()[0],
                         "0:128;0:128,128,128,128;31:128;31:481;7:128").parse_args()
    run_shapes(compiled_engine(args.model, args.dtype), args.shapes, args.rounds)


def run_shapes(engine: LLMEngine, shapes: str, rounds: int, arms: tuple[str, str] = ARMS,
               use: Callable[[str], None] | None = None) -> None:
    """``step_times`` for every shape of ``shapes`` (``;``-separated), printed with each
    arm's median and the first arm's time over the second's."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {engine.dtype}, "
          f"step budget {engine.scheduler.max_num_batched_tokens} tokens")
    rng = random.Random(0)
    for shape in shapes.split(";"):
        decodes, prompts = parse_shape(shape)
        times = step_times(engine, decodes, prompts, rounds, rng, arms, use)
        medians = {arm: statistics.median(v) for arm, v in times.items()}
        detail = "  ".join(f"{arm} {medians[arm] * 1e3:6.1f} ms "
                           f"({' '.join(f'{v * 1e3:.0f}' for v in times[arm])})" for arm in arms)
        print(f"{decodes:2d} decodes + prompts {prompts}: {detail}  "
              f"-> {medians[arms[0]] / medians[arms[1]]:.2f}x")


if __name__ == "__main__":
    main()
