"""The compiled decode step's warm-up and its steps, for two versions of the package side by
side (issue 30, twenty-sixth part: the one-row graph compiled once).

Builds the engine as ``python -m minivllm.serve`` builds it, with the compiled step warmed up
in the foreground (``compile_in_background=False``), prints the warm-up's time (its per-shape
lines, with the graphs each compiled, come from notebook 07's logger), then the medians of
``CompiledDecoder.logits`` for one row and for 32 rows (one 128-token sequence's block table
repeated) and the line ``RESULT <label> ...``. Run it under another checkout's package with
``PYTHONPATH`` (a ``git worktree`` of the commit before), alternating the two, and with an
empty ``TORCHINDUCTOR_CACHE_DIR`` for a cold start:

    git worktree add /tmp/before <commit>
    (cd /tmp/before && PYTHONPATH=/tmp/before python $OLDPWD/bench/experiments/warmup_ab.py \\
        --model $OLDPWD/checkpoints/qwen2.5-0.5b-random --label before)
    python bench/experiments/warmup_ab.py --model checkpoints/qwen2.5-0.5b-random --label after

Run it alone: on 2 cores anything else running slows compiling many times over.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

import torch

from minivllm.compile import DecodeInputs
from minivllm.engine import LLMEngine
from minivllm.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the bundled tiny model)")
    parser.add_argument("--label", default="this", help="the name the RESULT line carries")
    parser.add_argument("--calls", type=int, default=60, help="timed one-row calls (32 rows: a quarter)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    start = time.perf_counter()
    engine = LLMEngine.from_options(args.model, compile_in_background=False)
    built = time.perf_counter() - start
    decoder = engine.runner.decoder
    if decoder is None:
        raise SystemExit("the decode step did not compile (see the warning above)")
    rng = random.Random(0)
    vocab = min(engine.model_config.vocab_size, 100_000)
    engine.add_request("warmup-ab", [rng.randrange(vocab) for _ in range(128)],
                       SamplingParams(max_tokens=args.calls + 16, ignore_eos=True))
    for _ in range(5):  # the prompt's step, then a few decode steps
        engine.step()
    seq = engine.scheduler.running[0]
    medians = {}
    with torch.inference_mode():
        for rows, calls in ((1, args.calls), (32, max(args.calls // 4, 3))):
            batch = DecodeInputs([seq.token_ids[-1]] * rows, [seq.num_tokens] * rows,
                                 [list(seq.block_table)] * rows)
            decoder.logits(batch)  # untimed
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                decoder.logits(batch)
                times.append(time.perf_counter() - t)
            medians[rows] = statistics.median(times) * 1e3
    print(f"RESULT {args.label}: engine built in {built:.1f} s, warm-up {decoder.compile_seconds:.1f} s, "
          f"1 row {medians[1]:.1f} ms, 32 rows {medians[32]:.1f} ms")


if __name__ == "__main__":
    main()
