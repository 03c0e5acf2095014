"""The compiled decode step with and without `single_row_matvec`, alternated in one process.

    python bench/experiments/matvec_ab.py [--model M] [--rows 1] [--context 160] [--pairs 20]
    python bench/experiments/matvec_ab.py --level engine [--model M] [--pairs 6] [--output-len 48]
    python bench/experiments/matvec_ab.py --kernel inductor --against mv    # the two matvec kernels

Why this exists: on a CPU, a bf16 decode step of one row is as fast as the kernel that reads
the weights, and ``torch.mv`` reads them faster than ATen's ``mm`` (notebook 07, "One bf16 row
on a CPU"). Two servers started one after the other differ by ±15-35 % on a shared 2-core
machine, more than the effect, so this tool builds both compiled steps over one model
(copied) and one KV pool in one process and times them alternately, A B B A A B ..., so that
the machine's drift falls on both. It prints each side's median time per step and the median
of the per-pair ratios (with matvec / without). Needs a bf16 model on a CPU (a float32 model
is never swapped, and the tool says so).

``--kernel`` is the matvec kernel of the "with" side (``auto``: what this CPU gets by default;
``mv``: torch.mv whole; ``inductor``: inductor's own loop), and ``--against`` what the other
side runs (``linear``: F.linear, no matvec; or a kernel), so the tool also compares the two
kernels with each other on a new CPU.

``--level engine`` measures one level up: two ``LLM``s in one process, one with the option and
one without, alternate one greedy request each (a 128-token prompt, ``--output-len`` tokens
out), so the scheduler, the sampler and the detokeniser are in the timing too. It prints the
per-pair ratio of the request times and each side's median compiled call inside the engine.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from minivllm import LLM
from minivllm.compile import CompiledDecoder, DecodeInputs, choose_matvec_kernel


def alternate(sides: dict, run, pairs: int) -> dict[str, list[float]]:
    """Seconds of ``run(side)`` for each side, ``pairs`` times each, in the order A B B A A B
    ... (A B C C B A ... for three), so that the machine's drift falls on every side alike."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(pairs):
        for name in (names[::-1] if i % 2 else names):
            start = time.perf_counter()
            run(sides[name])
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=1, help="decode rows per step")
    p.add_argument("--context", type=int, default=160, help="context tokens per row")
    p.add_argument("--pairs", type=int, default=20, help="timed steps (engine: requests) of each side")
    p.add_argument("--level", choices=["step", "engine"], default="step",
                   help="step: the compiled decode step alone; engine: whole requests")
    p.add_argument("--output-len", type=int, default=48, help="engine level: tokens per request")
    p.add_argument("--kernel", default="auto", choices=["auto", "mv", "inductor"],
                   help="the matvec kernel of the 'with' side (auto: this CPU's default)")
    p.add_argument("--against", default="linear", choices=["linear", "mv", "inductor"],
                   help="what the 'without' side runs: F.linear, or another matvec kernel")
    args = p.parse_args()
    print(f"with: matvec kernel {choose_matvec_kernel(args.kernel)[0]} ({args.kernel}); "
          f"without: {args.against}")
    if args.level == "engine":
        return engine_level(args)

    llm = LLM(args.model, dtype=args.dtype, **side_a_options(args))  # side A: F.linear
    engine = llm.engine
    plain = engine.runner.decoder
    if plain is None:
        raise SystemExit("this needs the compiled decode step (MINIVLLM_COMPILE is off)")
    model = copy.deepcopy(engine.runner.model)  # side B: the same weights, linears swapped
    with_matvec = CompiledDecoder(model, engine.runner.pool.kv, engine.config.block_size,
                                  engine.num_blocks, engine.device, single_row_matvec=True,
                                  matvec_kernel=args.kernel)
    if with_matvec.matvec_linears == 0:
        raise SystemExit(f"nothing to compare: a {args.dtype} model on {engine.device} keeps "
                         "F.linear (only bf16 models on a CPU are swapped)")
    compile_s = with_matvec.warmup(engine.model_config.vocab_size)
    print(f"swapped {with_matvec.matvec_linears} linears; compiled side B in {compile_s:.0f} s")

    bs = engine.config.block_size
    blocks = -(-args.context // bs)
    tables = [[row * blocks + i for i in range(blocks)] for row in range(args.rows)]
    batch = DecodeInputs([5] * args.rows, [args.context] * args.rows, tables)
    sides = {"without": plain, "with": with_matvec}
    with torch.inference_mode():
        a, b = plain.logits(batch), with_matvec.logits(batch)
        print(f"max |logits A - B| {float((a - b).abs().max()):.3g}, same argmax: "
              f"{bool((a.argmax(-1) == b.argmax(-1)).all())}")
        times = alternate(sides, lambda side: side.logits(batch), args.pairs)
    ratios = [w / wo for w, wo in zip(times["with"], times["without"])]
    print(f"rows={args.rows} context={args.context}: without ({args.against}) "
          f"{statistics.median(times['without']) * 1e3:.1f} ms, with "
          f"{statistics.median(times['with']) * 1e3:.1f} ms per step; with/without per pair: "
          f"median {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")



def side_a_options(args: argparse.Namespace) -> dict:
    """The "without" side's engine options: F.linear (no matvec), or the other kernel."""
    if args.against == "linear":
        return {"single_row_matvec": False}
    return {"single_row_matvec": True, "matvec_kernel": args.against}


def engine_level(args: argparse.Namespace) -> None:
    """Two engines in one process, alternating whole greedy requests (A B B A ...)."""
    from minivllm import SamplingParams

    llms = {"with": LLM(args.model, dtype=args.dtype, matvec_kernel=args.kernel),
            "without": LLM(args.model, dtype=args.dtype, **side_a_options(args))}
    decoder = llms["with"].engine.runner.decoder
    if decoder is None or decoder.matvec_linears == 0:
        raise SystemExit(f"nothing to compare: a compiled {args.dtype} model on a CPU is needed")
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    calls: dict[str, list[float]] = {"with": [], "without": []}
    for name, llm in llms.items():
        llm.generate([prompt], params, use_tqdm=False)  # warm: first request of each engine
        decoder = llm.engine.runner.decoder
        untimed = decoder.logits

        def timed(batch, untimed=untimed, name=name):  # the compiled call inside the engine
            start = time.perf_counter()
            out = untimed(batch)
            calls[name].append(time.perf_counter() - start)
            return out
        decoder.logits = timed
    times = alternate(llms, lambda llm: llm.generate([prompt], params, use_tqdm=False), args.pairs)
    ratios = [w / wo for w, wo in zip(times["with"], times["without"])]
    print(f"engine, {args.output_len} tokens per request: without ({args.against}) "
          f"{statistics.median(times['without']):.2f} s, with {statistics.median(times['with']):.2f} s "
          f"per request; with/without per pair: median {statistics.median(ratios):.3f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}); compiled call inside the engine: without "
          f"{statistics.median(calls['without']) * 1e3:.1f} ms, with "
          f"{statistics.median(calls['with']) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
