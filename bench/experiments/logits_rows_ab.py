"""Prefill steps with the last layer past its attention run for every row, against for the
logits rows only (notebook 07's ``flat_hidden(..., rows)``, as shipped), alternated step by
step in one compiled engine.

    python bench/experiments/logits_rows_ab.py --model checkpoints/qwen2.5-0.5b-random \\
        --prompts 1,4 --input-len 128 --rounds 10

Each step prefills ``P`` fresh prompts of ``--input-len`` tokens (one per ``--prompts``
entry) and samples one token for each, so it wants P logits rows out of P x input-len. The
"every row" arm is the flat step before this change: every row through the last layer's out
projection and MLP, then the logits rows picked. Compare only the two arms of one shape: the
machine's speed drifts between minutes. Cited in docs/decisions.md (issue 30, thirteenth part).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from minivllm.compile import CompiledRunner
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.sampling import SamplingParams

SHIPPED = CompiledRunner.hidden_states


def every_row(runner: CompiledRunner, input_ids, positions, attn, rows):
    """The flat step as it was: all T rows through the whole model, then the logits rows."""
    flat = runner.decoder.flat if runner.decoder is not None else None
    if flat is None or input_ids.shape[0] < 2:
        return SHIPPED(runner, input_ids, positions, attn, rows)
    return flat.hidden(input_ids, positions, attn)[rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    ap.add_argument("--prompts", default="1,4", help="prompts per step, one shape each")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    shapes = [int(p) for p in args.prompts.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=max(64, *shapes),
                                    max_num_batched_tokens=max(shapes) * args.input_len))
    engine.runner.wait_until_compiled()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    request_ids = iter(range(10**9))

    def prefill_step(prompts: int) -> float:
        for _ in range(prompts):  # fresh tokens: no prefix-cache hits
            engine.add_request(str(next(request_ids)),
                               [rng.randrange(1000, 20000) for _ in range(args.input_len)], params)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed

    arms = {"every row": every_row, "logits rows": SHIPPED}
    times = {(arm, p): [] for arm in arms for p in shapes}
    try:
        for r in range(args.rounds + 1):  # round 0 warms both arms up, unrecorded
            order = list(arms.items()) if r % 2 else list(reversed(arms.items()))
            for p in shapes:
                for arm, hidden_states in order:
                    CompiledRunner.hidden_states = hidden_states
                    elapsed = prefill_step(p)
                    if r:
                        times[(arm, p)].append(elapsed)
    finally:
        CompiledRunner.hidden_states = SHIPPED
    for p in shapes:
        before, after = times[("every row", p)], times[("logits rows", p)]
        pairs = [a / b for a, b in zip(after, before)]
        print(f"{p} x {args.input_len} tokens: every row {statistics.median(before) * 1e3:.1f} ms, "
              f"logits rows {statistics.median(after) * 1e3:.1f} ms, "
              f"{statistics.median(after) / statistics.median(before):.3f}x "
              f"(pairs {min(pairs):.3f}-{max(pairs):.3f})")


if __name__ == "__main__":
    main()
