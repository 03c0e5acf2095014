"""Load test for ``python -m minivllm.serve``: many clients, nothing lost, nothing leaked.

    python bench/load_test.py                                   # 1,000 requests, 64 at once
    python bench/load_test.py --requests 1000 --concurrency 64 --rounds 2   # the soak
    python bench/load_test.py --base-url http://127.0.0.1:8000  # an already running server

Loopback only, bounded (a fixed number of requests, a timeout on each), exits by itself.
Unless ``--base-url`` is given it starts its own server on a free port with a deliberately
small KV pool (so the pool fills and requests wait) and stops it with SIGTERM at the end.

The workload is seeded: completions and chat, streamed and not, greedy and seeded sampling,
mixed prompt and output lengths. Each round checks

* every request answered 200 with a complete body or stream (``[DONE]``, a finish reason
  for every choice, usage that adds up; ``length`` means exactly ``max_tokens`` tokens);
* every greedy response (and every seeded one) equal to the offline ``minivllm.LLM`` output
  for the same prompt and params, computed here with the same engine options;
* afterwards every KV block is back in the pool and no request is in flight (``/stats``);
* the server's resident memory (psutil) after each round; from round 2 on it must not grow
  more than ``--max-rss-growth`` over round 1.

Prints a summary and exits 1 on any failure. The functions are reused by
tests/test_04_server_reliability.py with small numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil

import minivllm

if TYPE_CHECKING:  # an annotation only: nothing imports typing_extensions at run time
    from typing_extensions import Self

# Small on purpose: 64 blocks of 16 tokens hold ~12 of these sequences, so at concurrency 64
# most requests wait for blocks (and some are preempted): back-pressure is exercised.
ENGINE = {"num_blocks": 64, "block_size": 16, "max_model_len": 256, "max_num_seqs": 32,
          "max_num_batched_tokens": 512}

WORDS = ["the", "data", "of", "a", "function", "returns", "list", "value", "import", "class",
         "self", "print", "string", "file", "error", "number", "index", "key", "dictionary",
         "module", "test", "path", "open", "read", "write", "line"]
STARTS = ["def main():", "import os\nimport", "The capital of France is", "class Parser:",
          "Once upon a time", "# compute the mean of", "for i in range(", "return {"]


@dataclass
class Spec:
    """One request of the workload."""

    index: int
    chat: bool
    stream: bool
    prompt: str  # the prompt text, or the user message for chat
    params: dict  # sampling fields as sent (temperature, max_tokens, seed, ignore_eos)

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self) -> dict:
        body = {**self.params, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            return {**body, "messages": [{"role": "user", "content": self.prompt}]}
        return {**body, "prompt": self.prompt}


def workload(num_requests: int, seed: int = 0) -> list[Spec]:
    """A seeded mix: half chat, half streamed, 80% greedy, output 1..48 tokens."""
    rng = random.Random(seed)
    specs = []
    for i in range(num_requests):
        prompt = rng.choice(STARTS) + " " + " ".join(rng.choices(WORDS, k=rng.randint(0, 24)))
        params = {"max_tokens": rng.choice([1, 2, 4, 8, 16, 24, 32, 48]),
                  "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.8:
            params["temperature"] = 0
        else:
            params.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
        specs.append(Spec(i, rng.random() < 0.5, rng.random() < 0.5, prompt, params))
    return specs


def expected_outputs(specs: list[Spec], engine_options: dict = ENGINE,
                     model: str = minivllm.TINY_MODEL) -> dict[int, str]:
    """What the offline LLM answers, with the same engine options: spec index -> text.
    Only deterministic requests (greedy, or seeded) are included."""
    import torch

    from minivllm import LLM, SamplingParams

    # the server runs eager unless --compile is given; one thread keeps this process from
    # fighting the server (and other work) for the cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(model, **{"compile": False, **engine_options})
        tok = llm.get_tokenizer()
        chosen = [s for s in specs if s.params.get("temperature") == 0 or "seed" in s.params]
        prompts = [tok.apply_chat_template([{"role": "user", "content": s.prompt}], True)
                   if s.chat else s.prompt for s in chosen]
        outs = llm.generate(prompts, [SamplingParams(**s.params) for s in chosen])
    finally:
        torch.set_num_threads(threads)
    return {s.index: out.outputs[0].text for s, out in zip(chosen, outs)}


@dataclass
class Result:
    spec: Spec
    ok: bool = False
    error: str = ""
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    seconds: float = 0.0


def _check_complete(result: Result) -> None:
    """Fill result.ok/error: complete and self-consistent (not compared to offline yet)."""
    max_tokens = result.spec.params["max_tokens"]
    if result.finish_reason not in ("stop", "length"):
        result.error = f"finish_reason {result.finish_reason!r}"
    elif result.completion_tokens is None:
        result.error = "no usage"
    elif result.finish_reason == "length" and result.completion_tokens != max_tokens:
        result.error = f"length after {result.completion_tokens} of {max_tokens} tokens"
    elif result.completion_tokens > max_tokens:
        result.error = f"{result.completion_tokens} tokens > max_tokens {max_tokens}"
    else:
        result.ok = True


async def send(client: httpx.AsyncClient, base_url: str, spec: Spec,
               headers: dict | None = None) -> Result:
    """One request, streamed or not; never raises (errors land in the Result)."""
    result, start = Result(spec), time.perf_counter()
    url = base_url + spec.endpoint
    try:
        if not spec.stream:
            r = await client.post(url, json=spec.body(), headers=headers)
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return result
            body = r.json()
            choice = body["choices"][0]
            result.text = choice["message"]["content"] if spec.chat else choice["text"]
            result.finish_reason = choice["finish_reason"]
            result.completion_tokens = body["usage"]["completion_tokens"]
        else:
            done, pieces = False, []
            async with client.stream("POST", url, json=spec.body(), headers=headers) as r:
                if r.status_code != 200:
                    result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return result
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        result.error = f"stream error: {event['error']['message']}"
                        return result
                    for c in event["choices"]:
                        pieces.append((c.get("delta") or {}).get("content") or ""
                                      if spec.chat else c.get("text", ""))
                        result.finish_reason = c.get("finish_reason") or result.finish_reason
                    if event.get("usage"):
                        result.completion_tokens = event["usage"]["completion_tokens"]
            if not done:
                result.error = "stream ended without [DONE]"
                return result
            result.text = "".join(pieces)
        _check_complete(result)
    except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.seconds = time.perf_counter() - start
    return result


async def run_round(base_url: str, specs: list[Spec], concurrency: int,
                    timeout: float = 300.0, headers: dict | None = None) -> list[Result]:
    """Send every spec, ``concurrency`` at a time (one worker per connection)."""
    pending = list(reversed(specs))
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def worker() -> None:
            while pending:
                results.append(await send(client, base_url, pending.pop(), headers))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.spec.index)


def compare(results: list[Result], expected: dict[int, str]) -> list[str]:
    """Every failure, one line each: errors and texts that differ from the offline LLM."""
    problems = []
    for r in results:
        if not r.ok:
            problems.append(f"request {r.spec.index} failed: {r.error}")
        elif r.spec.index in expected and r.text != expected[r.spec.index]:
            problems.append(f"request {r.spec.index} ({r.spec.endpoint}, stream={r.spec.stream}"
                            f", {r.spec.params}): {r.text!r} != offline "
                            f"{expected[r.spec.index]!r}")
    return problems


def wait_idle(base_url: str, timeout: float = 15.0, headers: dict | None = None) -> dict:
    """Poll /stats until no request is in flight and every block is free; the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{base_url}/stats", timeout=10, headers=headers).json()
        idle = stats["num_requests_in_flight"] == 0 and stats["num_running"] == 0 \
            and stats["num_waiting"] == 0
        if idle and stats["num_free_blocks"] == stats["num_blocks"]:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_cli(options: dict) -> list[str]:
    return [arg for key, value in options.items()
            for arg in (f"--{key.replace('_', '-')}", str(value))]


class Server:
    """``python -m minivllm.serve`` on a free loopback port, as a context manager."""

    def __init__(self, engine_options: dict = ENGINE, extra_args: tuple[str, ...] = (),
                 env: dict | None = None, log_path: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "minivllm.serve", "--port", str(self.port),
                    "--log-level", "warning", *engine_cli(engine_options), *extra_args]
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="minivllm-serve-",
                                                          suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env)
        return self

    def wait_ready(self, timeout: float = 180.0) -> Server:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; the exit status (killed and -9 if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9

    def __enter__(self) -> Self:
        self.start().wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class RoundReport:
    round: int
    requests: int
    seconds: float
    failures: list[str] = field(default_factory=list)
    compared: int = 0
    stats: dict = field(default_factory=dict)
    rss_bytes: int | None = None
    p50_s: float = 0.0
    p99_s: float = 0.0

    @property
    def blocks_back(self) -> bool:
        s = self.stats
        return (s.get("num_free_blocks") == s.get("num_blocks")
                and s.get("num_requests_in_flight") == 0)


def load_test(base_url: str, num_requests: int, concurrency: int, rounds: int,
              expected: dict[int, str], specs: list[Spec], server: Server | None = None,
              headers: dict | None = None, log=print) -> list[RoundReport]:
    reports = []
    for n in range(1, rounds + 1):
        start = time.perf_counter()
        results = asyncio.run(run_round(base_url, specs, concurrency, headers=headers))
        report = RoundReport(n, len(results), time.perf_counter() - start)
        report.failures = compare(results, expected)
        report.compared = sum(1 for r in results if r.spec.index in expected)
        report.stats = wait_idle(base_url, headers=headers)
        if not report.blocks_back:
            report.failures.append(f"not idle after the round: {report.stats}")
        if server is not None:
            report.rss_bytes = server.rss()
        latencies = sorted(r.seconds for r in results)
        report.p50_s = latencies[len(latencies) // 2]
        report.p99_s = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        log(f"round {n}: {report.requests} requests at concurrency {concurrency} in "
            f"{report.seconds:.1f} s ({report.requests / report.seconds:.1f} req/s), latency "
            f"p50 {report.p50_s:.2f} s p99 {report.p99_s:.2f} s; failed "
            f"{len(report.failures)}; {report.compared} compared with offline; blocks free "
            f"{report.stats.get('num_free_blocks')}/{report.stats.get('num_blocks')}, in flight "
            f"{report.stats.get('num_requests_in_flight')}, preemptions "
            f"{report.stats.get('num_preemptions')}"
            + (f"; server RSS {report.rss_bytes / 2**20:.1f} MiB" if report.rss_bytes else ""))
        for line in report.failures[:10]:
            log("  " + line)
        reports.append(report)
    return reports


def rss_growth(reports: list[RoundReport]) -> float | None:
    """Largest relative RSS growth of a later round over round 1 (None without figures)."""
    if len(reports) < 2 or reports[0].rss_bytes is None:
        return None
    return max(r.rss_bytes for r in reports[1:]) / reports[0].rss_bytes - 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/load_test.py", description=__doc__.split(
        "\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-url", help="an already running server (loopback); default: start one")
    p.add_argument("--server-pid", type=int, help="with --base-url: its pid, for the RSS check")
    p.add_argument("--api-key", default=os.environ.get("MINIVLLM_API_KEY"))
    p.add_argument("--max-rss-growth", type=float, default=0.05,
                   help="allowed RSS growth of later rounds over round 1 (default 0.05 = 5%%)")
    args = p.parse_args(argv)
    if args.base_url and httpx.URL(args.base_url).host not in ("127.0.0.1", "localhost", "::1"):
        p.error("--base-url must be a loopback address")

    specs = workload(args.requests, args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    server = None
    if args.base_url is None:
        extra = ("--api-key", args.api_key) if args.api_key else ()
        server = Server(ENGINE, extra).start()  # loads while the offline reference runs
    t0 = time.perf_counter()
    expected = expected_outputs(specs)
    print(f"offline reference: {len(expected)} deterministic requests of {len(specs)} in "
          f"{time.perf_counter() - t0:.1f} s (engine options {ENGINE})")
    try:
        if server is not None:
            server.wait_ready()
            base_url = server.url
        else:
            base_url = args.base_url.rstrip("/")
            if args.server_pid:
                server = Server.__new__(Server)
                server.proc = psutil.Process(args.server_pid)
        reports = load_test(base_url, args.requests, args.concurrency, args.rounds, expected,
                            specs, server, headers)
    finally:
        status = server.stop() if server is not None and args.base_url is None else 0
    failed = [f for r in reports for f in r.failures]
    growth = rss_growth(reports)
    summary = {"requests_per_round": args.requests, "concurrency": args.concurrency,
               "rounds": args.rounds, "failures": len(failed),
               "compared_with_offline": reports[0].compared,
               "rss_mib": [round(r.rss_bytes / 2**20, 1) if r.rss_bytes else None
                           for r in reports],
               "rss_growth": None if growth is None else round(growth, 4),
               "seconds": [round(r.seconds, 1) for r in reports],
               "server_exit_status": status}
    print("summary:", json.dumps(summary))
    ok = not failed and status == 0
    if growth is not None and growth > args.max_rss_growth:
        print(f"FAIL: server RSS grew {growth:.1%} > {args.max_rss_growth:.0%} between rounds")
        ok = False
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
