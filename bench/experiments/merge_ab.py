"""The model with and without merged projections (q/k/v and gate/up as one matmul each),
alternated in one process.

    python bench/experiments/merge_ab.py [--model M] [--rows 1,8,32] [--context 160] [--pairs 40]
    python bench/experiments/merge_ab.py --level prefill [--model M] [--prompts 16,1] [--pairs 8]

Why this exists: ``EngineConfig.merge_projections`` (notebook 07) changes every layer's
matmuls, and two engines measured minutes apart on a shared 2-core machine differ by more
than the effect. ``--level step`` builds both compiled decode steps over one KV pool in one
process (the merged side over a merged copy of the model) and times them alternately,
A B B A ..., at each row count. ``--level prefill`` alternates eager prefill steps of the
engine (``--prompts`` prompts of ``--prompt-len`` tokens, one step each), swapping the
engine's model between the two. Both print each side's median and the median (and range)
of the per-pair time ratios merged / separate, and check that the two sides agree.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import threading

import torch
from matvec_ab import alternate

from minivllm import LLM, SamplingParams
from minivllm.compile import CompiledDecoder, DecodeInputs, merge_projections


def summary(label: str, times: dict[str, list[float]]) -> str:
    ratios = [m / s for m, s in zip(times["merged"], times["separate"])]
    return (f"{label}: separate {statistics.median(times['separate']) * 1e3:.1f} ms, merged "
            f"{statistics.median(times['merged']) * 1e3:.1f} ms; merged/separate per pair: median "
            f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")


def step_level(args: argparse.Namespace) -> None:
    llm = LLM(args.model, dtype=args.dtype, merge_projections=False)  # side A: separate
    engine = llm.engine
    separate = engine.runner.decoder
    if separate is None:
        raise SystemExit("this needs the compiled decode step (MINIVLLM_COMPILE is off)")
    model = copy.deepcopy(engine.runner.model)
    saved = merge_projections(model)
    merged = CompiledDecoder(model, engine.runner.pool.kv, engine.config.block_size,
                             engine.num_blocks, engine.device, engine.config.single_row_matvec)
    print(f"merged side: {saved} fewer matmuls per step; compiled in "
          f"{merged.warmup(engine.model_config.vocab_size):.0f} s", flush=True)
    bs = engine.config.block_size
    blocks = -(-args.context // bs)
    for rows in args.rows:
        tables = [[row * blocks + i for i in range(blocks)] for row in range(rows)]
        batch = DecodeInputs([5 + row for row in range(rows)], [args.context] * rows, tables)
        with torch.inference_mode():
            a, b = separate.logits(batch), merged.logits(batch)
            agree = bool((a.argmax(-1) == b.argmax(-1)).all())
            times = alternate({"separate": separate, "merged": merged},
                              lambda side, batch=batch: side.logits(batch), args.pairs)
        print(summary(f"rows={rows} context={args.context}", times)
              + f"; max |logits A - B| {float((a - b).abs().max()):.3g}, same argmax: {agree}",
              flush=True)


def prefill_level(args: argparse.Namespace) -> None:
    llm = LLM(args.model, dtype=args.dtype, compile=False, enable_prefix_caching=False,
              merge_projections=False)
    engine = llm.engine
    models = {"separate": engine.runner.model, "merged": copy.deepcopy(engine.runner.model)}
    merge_projections(models["merged"])
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    calls = iter(range(1, 10**9))
    for n in args.prompts:
        if n * args.prompt_len > engine.config.max_num_batched_tokens:
            raise SystemExit(f"{n} prompts of {args.prompt_len} tokens need more than one step")

        def run(model, n=n, k=None):  # n prompts, fresh each call unless k is given
            engine.runner.model = model
            k = next(calls) if k is None else k
            prompts = [{"prompt_token_ids": [100 + (13 * k + 7 * i + j) % 5000
                                             for j in range(args.prompt_len)]} for i in range(n)]
            return llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids

        first = {name: run(model, k=0) for name, model in models.items()}  # warm both
        times = alternate(models, run, args.pairs)
        print(summary(f"prefill of {n} x {args.prompt_len} tokens", times)
              + f"; same first token: {first['separate'] == first['merged']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--level", choices=["step", "prefill"], default="step")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32],
                   help="step level: decode rows per step, comma-separated")
    p.add_argument("--context", type=int, default=160, help="step level: context tokens per row")
    p.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[16, 1],
                   help="prefill level: prompts per step, comma-separated")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--pairs", type=int, default=None,
                   help="timed calls of each side per setting (step: 40, prefill: 8)")
    args = p.parse_args()
    args.pairs = args.pairs or (40 if args.level == "step" else 8)
    # The engine thread of `python -m minivllm.serve` runs the model; so does this thread
    # (the main thread's allocator returns big freed blocks to the OS, a page fault each time).
    level = step_level if args.level == "step" else prefill_level
    errors: list[BaseException] = []

    def run() -> None:
        try:
            level(args)
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the main thread
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if errors:
        raise errors[0]


if __name__ == "__main__":
    main()
