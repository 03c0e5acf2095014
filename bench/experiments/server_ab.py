"""Two `python -m minivllm.serve` processes, side by side, measured in alternating rounds.

    python bench/experiments/server_ab.py --model M --b-flags=--no-single-row-matvec \\
        [--a-flags ""] [--concurrency 1] [--rounds 8] [--input-len 128] [--output-len 64]

Why this exists: on a shared 2-core machine the speed of the same server drifts by 10-35 %
from one minute to the next, and ``python -m minivllm.bench`` measures one engine after the
other, minutes apart. A change worth 10-20 % cannot be told from that drift. This tool
starts both servers first (an idle server sleeps in its event loop and costs nothing), waits
until each has swapped its compiled step in (``/stats``), then runs rounds of
``--concurrency`` streamed greedy requests (``ignore_eos``, the harness's client and payload)
against A and B in turn, A B B A A B ..., so that each pair of rounds
meets the same machine. It prints each side's median output tokens/s and ITL p50, and the
median (and range) of the per-pair throughput ratios B / A.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics

from minivllm.bench.clients import run_openai_client, served_model_name
from minivllm.bench.engines import wait_for_compiled_step
from minivllm.bench.metrics import BenchRequest
from minivllm.bench.servers import free_port, minivllm_server_command, running_server


def measure(base_url: str, model: str, requests: list[BenchRequest],
            concurrency: int) -> tuple[float, float]:
    """(output tokens/s, ITL p50 in ms) of one closed-loop round."""
    results = run_openai_client(base_url, model, requests, concurrency)
    failed = [r.error for r in results if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} request(s) failed, e.g. {failed[0]}")
    start = min(r.start for r in results)
    end = max(r.end for r in results)
    gaps = [b - a for r in results for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return sum(r.output_tokens for r in results) / (end - start), statistics.median(gaps) * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    p.add_argument("--a-flags", default="", help="server A's flags beyond --model/--port")
    p.add_argument("--b-flags", default="", help="server B's flags beyond --model/--port")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8, help="rounds per side")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args(argv)

    rng = random.Random(0)
    requests = [BenchRequest([rng.randrange(1000, 20000) for _ in range(args.input_len)],
                             args.output_len) for _ in range(args.concurrency)]
    ports = {"A": free_port(), "B": free_port()}
    while ports["B"] == ports["A"]:  # both are free now; neither is bound until its server is
        ports["B"] = free_port()
    commands = {side: minivllm_server_command(args.model, ports[side])
                + shlex.split(getattr(args, f"{side.lower()}_flags")) for side in ports}
    for side, cmd in commands.items():
        print(f"{side}: {shlex.join(cmd[1:])}", flush=True)
    results: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
    with running_server(commands["A"], f"http://127.0.0.1:{ports['A']}", "server-A"), \
            running_server(commands["B"], f"http://127.0.0.1:{ports['B']}", "server-B"):
        urls = {side: f"http://127.0.0.1:{port}/v1" for side, port in ports.items()}
        names = {side: served_model_name(url, args.model) for side, url in urls.items()}
        for side, port in ports.items():  # both measured on the step they settle on
            waited = wait_for_compiled_step(f"http://127.0.0.1:{port}/stats")
            print(f"{side}: compiled step in place after {waited:.0f} s more", flush=True)
        for side in ("A", "B"):  # one unmeasured round each: first-request costs
            measure(urls[side], names[side], requests, args.concurrency)
        for i in range(args.rounds):
            for side in (("A", "B") if i % 2 == 0 else ("B", "A")):
                results[side].append(measure(urls[side], names[side], requests,
                                             args.concurrency))
    ratios = [b[0] / a[0] for a, b in zip(results["A"], results["B"])]
    summary = {side: {"tok_s": statistics.median(r[0] for r in rows),
                      "itl_p50_ms": statistics.median(r[1] for r in rows)}
               for side, rows in results.items()}
    for side, s in summary.items():
        print(f"{side}: {s['tok_s']:.2f} output tok/s, ITL p50 {s['itl_p50_ms']:.1f} ms "
              f"(median of {args.rounds} rounds at concurrency {args.concurrency})")
    print(f"B / A throughput per pair: median {statistics.median(ratios):.3f} "
          f"({min(ratios):.2f}-{max(ratios):.2f})")
    return {"summary": summary, "ratios": ratios}


if __name__ == "__main__":
    main()
