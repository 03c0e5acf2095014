"""Steps with the last layer past its attention run for every row, against for the logits
rows only (notebook 07's ``flat_hidden(..., rows)``, as shipped), alternated in one compiled
engine. Shapes and rounds as in ``flat_step_ab.py`` (``DECODES:PROMPT,PROMPT,...``; each
prompt samples one token, so a step wants one logits row per prompt and per decode):

    python bench/experiments/logits_rows_ab.py --model checkpoints/qwen2.5-0.5b-random \\
        --shapes "0:128;0:128,128,128,128;28:484" --rounds 8

The "every row" arm is the flat step before this change: all T rows through the last
layer's out projection and MLP, then the logits rows picked. Compare only the two arms of
one shape: the machine's speed drifts between minutes. Cited in docs/decisions.md (issue 30,
thirteenth part).
"""

from __future__ import annotations

import argparse

from flat_step_ab import run_shapes  # bench/experiments/ is on the path of a script run from it

from minivllm.compile import CompiledRunner
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine

ARMS = ("every row", "logits rows")
SHIPPED = CompiledRunner.hidden_states


def every_row(runner: CompiledRunner, input_ids, positions, attn, rows):
    """The flat step as it was: all T rows through the whole model, then the logits rows."""
    flat = runner.decoder.flat if runner.decoder is not None else None
    if flat is None or input_ids.shape[0] < 2:
        return SHIPPED(runner, input_ids, positions, attn, rows)
    return flat.hidden(input_ids, positions, attn)[rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--shapes", default="0:128;0:128,128,128,128;28:484")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, compile=True,
                                    compile_in_background=False))
    if not isinstance(engine.runner, CompiledRunner) or engine.runner.decoder.flat is None:
        raise SystemExit("the flat step did not compile here")

    def use(arm: str) -> None:  # read per step by notebook 03's forward
        CompiledRunner.hidden_states = every_row if arm == "every row" else SHIPPED

    try:
        run_shapes(engine, args.shapes, args.rounds, ARMS, use)
    finally:
        CompiledRunner.hidden_states = SHIPPED


if __name__ == "__main__":
    main()
