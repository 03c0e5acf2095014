"""Per-request timelines of one benchmark level, engine beside engine: when each request was
sent, when its first token came, when it finished.

The benchmark's table gives a level's TTFT percentiles; this shows which requests make them.
On the ``mixed`` workload the first ``concurrency`` requests arrive together and the rest
arrive one by one as earlier ones finish, so a median TTFT twice a peer's can mean a slower
first wave, or late arrivals that wait behind something. Each engine is started as the
benchmark starts it (``minivllm.bench``'s ``open_engine``, the same warm-up and workload
seed), runs the level once, and its requests are printed in order of sending and saved as
JSON lines.

    python bench/experiments/ttft_timeline.py --model checkpoints/qwen2.5-0.5b-random \\
        --engines minivllm-server,vllm --workload mixed --concurrency 8 --output-len 64

Cited in docs/decisions.md (issue 30: "Where the mixed workload's TTFT goes").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from minivllm.bench.engines import BenchOptions, apply_engine_spec, open_engine, split_engine_specs
from minivllm.bench.env import regular_vocab_size
from minivllm.bench.harness import stats_delta
from minivllm.bench.metrics import make_workload, request_latency


def timeline(results, requests, t0: float) -> list[dict]:
    """One row per request, times in seconds from the level's start."""
    rows = []
    for i, (req, res) in enumerate(zip(requests, results)):
        row = {"index": i, "prompt_len": len(req.prompt_token_ids), "output_len": req.output_len,
               "sent_s": res.start - t0, "error": res.error}
        if res.success:
            lat = request_latency(res)
            row |= {"ttft_s": lat.ttft, "first_token_s": res.chunk_times[0] - t0,
                    "end_s": res.end - t0, "tpot_s": lat.tpot}
        rows.append(row)
    return sorted(rows, key=lambda r: r["sent_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    p.add_argument("--engines", default="minivllm-server,vllm")
    p.add_argument("--workload", default="mixed")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, help="default max(2*c, 8), as the benchmark")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("ttft_timeline.jsonl"))
    a = p.parse_args()

    from minivllm.config import resolve_model_path

    c = a.concurrency
    vocab = regular_vocab_size(resolve_model_path(a.model))  # no special tokens in prompts
    n = a.num_requests or max(2 * c, 8)
    for spec in split_engine_specs(a.engines):  # "minivllm-server[step_overhead_tokens=0]" too
        name, _, opts = apply_engine_spec(spec, BenchOptions(
            model=a.model, engines=[spec], workloads=[a.workload], concurrency=[c],
            input_len=a.input_len, output_len=a.output_len))
        with open_engine(name, opts) as session:
            if session is None:
                print(f"{spec}: cannot run here")
                continue
            # the benchmark's warm-up and the benchmark's prompts (salt = the concurrency)
            warm = make_workload("fixed", 2, a.input_len, 4, seed=opts.seed, vocab_size=vocab,
                                 salt=-1)
            session.run(warm, 2, None)
            requests = make_workload(a.workload, n, a.input_len, a.output_len, seed=opts.seed,
                                     vocab_size=vocab, range_ratio=opts.range_ratio, salt=c)
            before = session.stats() if session.stats else None
            t0 = time.perf_counter()
            results = session.run(requests, c, None)
            rows = timeline(results, requests, t0)
            stats = stats_delta(before, session.stats()) if session.stats else None
        print(f"\n{spec} {a.workload} c={c}: sent, first token, end (s from start); TTFT")
        for r in rows:
            if r["error"]:
                print(f"  #{r['index']:<3} prompt {r['prompt_len']:4}  failed: {r['error']}")
                continue
            print(f"  #{r['index']:<3} prompt {r['prompt_len']:4} out {r['output_len']:4}  "
                  f"{r['sent_s']:6.2f} {r['first_token_s']:6.2f} {r['end_s']:6.2f}   "
                  f"TTFT {1000 * r['ttft_s']:6.0f} ms")
        if stats:
            print(f"  engine counters: {stats}")
        with a.out.open("a") as f:
            for r in rows:
                f.write(json.dumps({"engine": spec, "workload": a.workload, "concurrency": c,
                                    **r}) + "\n")


if __name__ == "__main__":
    main()
