"""Prefill steps with notebook 06's fresh-prompt path (``attend_fresh``: each prompt with
nothing cached attends over its own new keys, SDPA ``is_causal``, no pool read, no mask, no
padding) against the same backend with fresh prompts sent through the gathered, masked,
padded prefill group as before, alternated in one process. ``--arms "one call,fresh path"``
compares instead the fresh path as it was before its CPU blocks (one ``is_causal`` SDPA call
over all heads) with today's (each kv head's query heads stacked, 128 queries at a time).

One engine, compiled as the server compiles it (the flat step calls the attention backend
eagerly between its compiled halves, so switching ``runner.attention_cls`` switches the arm
for the next step). Shapes and rounds as in ``flat_step_ab.py``. Run it alone:

    python bench/experiments/fresh_prompt_ab.py --model checkpoints/qwen2.5-0.5b-random \\
        --shapes "0:128;0:512;0:128,128,128,128;0:13,243,40,120;31:128;7:481"
    python bench/experiments/fresh_prompt_ab.py --model checkpoints/qwen2.5-0.5b-random \
        --arms "one call,fresh path" --shapes "0:128;0:256;0:512;0:128,128,128,128;7:481"
"""

from __future__ import annotations

import torch
from flat_step_ab import compiled_engine, run_shapes, shapes_parser

from minivllm import attention
from minivllm.attention import BatchedAttention, build_group

ARMS = ("gathered", "one call", "fresh path")
SHIPPED_ATTEND_FRESH = attention.attend_fresh


def attend_fresh_one_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          masks: dict | None = None) -> torch.Tensor:
    """The fresh path before its CPU blocks, with ``attend_fresh``'s signature."""
    return attention.attend_fresh_in_one_call(q, k, v)


class GatheredFreshPrompts(BatchedAttention):
    """The backend before the fresh-prompt group: every prompt chunk in one gathered group."""

    def __init__(self, pool, metadata):
        self.pool, self.metadata = pool, metadata
        q_lens = [metadata.query_start_loc[b + 1] - metadata.query_start_loc[b]
                  for b in range(metadata.num_seqs)]
        members = ([b for b, n in enumerate(q_lens) if n == 1],
                   [b for b, n in enumerate(q_lens) if n > 1])
        self.groups = [build_group(metadata, m, metadata.slot_mapping.device)
                       for m in members if m]
        self.fresh = []


def main() -> None:
    ap = shapes_parser(__doc__.splitlines()[0],
                       "0:128;0:512;0:128,128,128,128;0:13,243,40,120;31:128;7:481")
    ap.add_argument("--arms", default="gathered,fresh path",
                    help=f"two of {', '.join(ARMS)}, comma-separated")
    args = ap.parse_args()
    engine = compiled_engine(args.model, args.dtype)
    runner = engine.runner
    if runner.attention_cls is not BatchedAttention:
        raise SystemExit("this engine does not run notebook 06's BatchedAttention")

    arms = tuple(args.arms.split(","))
    if len(arms) != 2 or not set(arms) <= set(ARMS):
        raise SystemExit(f"--arms: two of {ARMS}")

    def use(arm: str) -> None:  # the backend is built per step, attend_fresh read per call
        runner.attention_cls = GatheredFreshPrompts if arm == "gathered" else BatchedAttention
        attention.attend_fresh = attend_fresh_one_call if arm == "one call" else SHIPPED_ATTEND_FRESH

    run_shapes(engine, args.shapes, args.rounds, arms, use)


if __name__ == "__main__":
    main()
