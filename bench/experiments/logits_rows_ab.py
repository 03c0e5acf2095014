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

from flat_step_ab import (  # bench/experiments/ is on the path of a script run from it
    compiled_engine,
    run_shapes,
    shapes_parser,
)

from minivllm.compile import CompiledRunner

ARMS = ("every row", "logits rows")
SHIPPED = CompiledRunner.hidden_states


def every_row(runner: CompiledRunner, input_ids, positions, attn, rows):
    """The flat step as it was: all T rows through the whole model, then the logits rows."""
    flat = runner.decoder.flat if runner.decoder is not None else None
    if flat is None or input_ids.shape[0] < 2:
        return SHIPPED(runner, input_ids, positions, attn, rows)
    return flat.hidden(input_ids, positions, attn)[rows]


def main() -> None:
    args = shapes_parser(__doc__.splitlines()[0], "0:128;0:128,128,128,128;28:484",
                         rounds=8).parse_args()
    engine = compiled_engine(args.model, args.dtype)

    def use(arm: str) -> None:  # read per step by notebook 03's forward
        CompiledRunner.hidden_states = every_row if arm == "every row" else SHIPPED

    try:
        run_shapes(engine, args.shapes, args.rounds, ARMS, use)
    finally:
        CompiledRunner.hidden_states = SHIPPED


if __name__ == "__main__":
    main()
