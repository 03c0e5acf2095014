"""Where one decode step's time goes: ``torch.profiler`` over one engine step of N decoding
sequences, by operator (self CPU time and call counts).

Prefills N requests (``--input-len`` random prompt tokens each), runs a few decode steps to
warm up, times four more, then profiles one. Run it alone on a quiet machine. Used for the
Amdahl argument of docs/decisions.md (Milestone 6): how much of a batched decode step is
matmuls, how much attention.

    python tools/profile_decode_step.py --model checkpoints/qwen2.5-0.5b-random \\
        --attention-backend batched --batch 32
    python tools/profile_decode_step.py --model checkpoints/qwen2.5-0.5b-random \\
        --dtype auto --batch 32 --compile --decode-attention group   # before notebook 06's regrouping
"""

from __future__ import annotations

import argparse
import random
import time

from torch.profiler import profile

from minivllm import TINY_MODEL
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=TINY_MODEL, help="checkpoint (default: the bundled tiny model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attention-backend", default="batched", choices=["loop", "batched"])
    ap.add_argument("--compile", action="store_true", help="the compiled decode step (M7)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--rows", type=int, default=18, help="operators to list")
    ap.add_argument("--phase", default="decode", choices=["decode", "prefill"],
                    help="profile a decode step, or the step that prefills all --batch "
                         "prompts at once (after a warm-up prefill of other prompts)")
    ap.add_argument("--decode-attention", default="decode", choices=["decode", "group"],
                    help="decode groups through attend_decode (the default: each kv head's "
                         "query heads as its queries) or attend_group (one SDPA item per "
                         "query head), to see what notebook 06's regrouping saves")
    args = ap.parse_args()
    if args.decode_attention == "group":  # before the engine exists: both paths read the name
        import minivllm.attention
        import minivllm.compile

        minivllm.attention.attend_decode = minivllm.compile.attend_decode = minivllm.attention.attend_group
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, compile=args.compile,
                                    attention_backend=args.attention_backend,
                                    max_num_seqs=max(64, args.batch)))
    wait_until_compiled = getattr(engine.runner, "wait_until_compiled", None)
    if wait_until_compiled is not None:  # M7 compiles in the background: profile its step
        wait_until_compiled()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    if args.phase == "prefill":
        profile_prefill(engine, args, rng)
        return
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(1000) for _ in range(args.input_len)], params)
    while engine.scheduler.waiting:  # prefill everyone (possibly over several steps)
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(4):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"{args.attention_backend}{' compiled' if args.compile else ''}, batch {args.batch}: "
          f"decode step {', '.join(f'{t * 1e3:.0f}' for t in times)} ms")
    with profile() as prof:
        engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


def profile_prefill(engine: LLMEngine, args, rng: random.Random) -> None:
    """Time three steps that each prefill ``--batch`` fresh prompts of ``--input-len`` tokens
    at once (one flat batch; notebook 03), then profile a fourth."""
    tokens = args.batch * args.input_len
    if tokens > engine.config.max_num_batched_tokens:  # else the "step" is only a chunk
        raise SystemExit(f"--batch x --input-len = {tokens} tokens is more than one step holds "
                         f"(max_num_batched_tokens {engine.config.max_num_batched_tokens})")
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    def prefill_step(tag: str) -> float:
        for i in range(args.batch):  # fresh tokens each time: no prefix-cache hits
            engine.add_request(f"{tag}-{i}", [rng.randrange(1000) for _ in range(args.input_len)],
                               params)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed

    times = [prefill_step(f"warm{k}") for k in range(3)]
    print(f"{args.attention_backend}, {args.batch} prompts x {args.input_len} tokens: prefill "
          f"step {', '.join(f'{t * 1e3:.0f}' for t in times)} ms "
          f"({tokens / min(times):.0f} tokens/s at best)")
    with profile() as prof:
        prefill_step("profiled")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
