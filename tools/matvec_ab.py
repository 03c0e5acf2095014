"""The compiled decode step with and without `single_row_matvec`, alternated in one process.

    python tools/matvec_ab.py [--model M] [--rows 1] [--context 160] [--pairs 20]

Why this exists: on a CPU, a bf16 decode step of one row is as fast as the kernel that reads
the weights, and ``torch.mv`` reads them faster than ATen's ``mm`` (notebook 07, "One bf16 row
on a CPU"). Two servers started one after the other differ by ±15-35 % on a shared 2-core
machine, more than the effect, so this tool builds both compiled steps over one model
(copied) and one KV pool in one process and times them alternately, A B B A A B ..., so that
the machine's drift falls on both. It prints each side's median time per step and the median
of the per-pair ratios (with matvec / without). Needs a bf16 model on a CPU (a float32 model
is never swapped, and the tool says so).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from minivllm import LLM
from minivllm.compile import CompiledDecoder, DecodeInputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=1, help="decode rows per step")
    p.add_argument("--context", type=int, default=160, help="context tokens per row")
    p.add_argument("--pairs", type=int, default=20, help="timed steps of each side")
    args = p.parse_args()

    llm = LLM(args.model, dtype=args.dtype, single_row_matvec=False)  # side A: F.linear
    engine = llm.engine
    plain = engine.decoder
    if plain is None:
        raise SystemExit("this needs the compiled decode step (MINIVLLM_COMPILE is off)")
    model = copy.deepcopy(engine.model)  # side B: the same weights, linears swapped
    with_matvec = CompiledDecoder(model, engine.pool.kv, engine.config.block_size,
                                  engine.num_blocks, engine.device, single_row_matvec=True)
    if with_matvec.matvec_linears == 0:
        raise SystemExit(f"nothing to compare: a {args.dtype} model on {engine.device} keeps "
                         "F.linear (only bf16 models on a CPU are swapped)")
    compile_s = with_matvec.warmup(engine.model_config.vocab_size)
    print(f"swapped {with_matvec.matvec_linears} linears; compiled side B in {compile_s:.0f} s")

    bs = engine.config.block_size
    blocks = -(-args.context // bs)
    tables = [[row * blocks + i for i in range(blocks)] for row in range(args.rows)]
    batch = DecodeInputs([5] * args.rows, [args.context] * args.rows, tables)
    times: dict[str, list[float]] = {"without": [], "with": []}
    sides = {"without": plain, "with": with_matvec}
    with torch.inference_mode():
        a, b = plain.logits(batch), with_matvec.logits(batch)
        print(f"max |logits A - B| {float((a - b).abs().max()):.3g}, same argmax: "
              f"{bool((a.argmax(-1) == b.argmax(-1)).all())}")
        for i in range(args.pairs):
            order = ("without", "with") if i % 2 else ("with", "without")
            for name in order:
                start = time.perf_counter()
                sides[name].logits(batch)
                times[name].append(time.perf_counter() - start)
    ratios = [w / wo for w, wo in zip(times["with"], times["without"])]
    print(f"rows={args.rows} context={args.context}: without matvec "
          f"{statistics.median(times['without']) * 1e3:.1f} ms, with "
          f"{statistics.median(times['with']) * 1e3:.1f} ms per step; with/without per pair: "
          f"median {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
