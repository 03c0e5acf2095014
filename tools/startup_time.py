"""Cold and warm start of ``python -m minivllm.serve``, as a user meets them.

Starts the server twice on a fresh inductor cache directory (the first start compiles the
decode step from nothing; the second finds inductor's kernels on disk) and times, from the
moment the process is spawned:

* ``health``: the first 200 on ``/health`` (the server accepts requests);
* ``first token``: the first streamed token of a completion sent right then;
* ``compiled``: ``/stats`` no longer says ``"decode_step": "compiling"`` (the compiled step
  took over; with ``--no-compile-in-background`` that is before ``/health``).

It prints the stage lines of each start-up log (weights, KV pool, compile) with the
machine's CPU and load beside them, and appends a JSON record per start to ``--out``.

    python tools/startup_time.py                     # the bundled model
    python tools/startup_time.py --model CKPT_DIR    # another checkpoint
    python tools/startup_time.py --out bench/results/startup/DATE-CPU.jsonl  # keep records
    python tools/startup_time.py -- --no-compile-in-background   # server flags after --

Run it alone: on 2 cores anything else running slows the compile 10x.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_token_seconds(url: str, model: str, start: float) -> float:
    """Seconds since ``start`` until a streamed completion's first token arrives."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    return time.monotonic() - start
    raise RuntimeError("the completion streamed no text")


def one_start(model: str | None, cache_dir: str, log_path: Path, server_args: list[str],
              compiled_timeout_s: float = 1800.0) -> dict:
    """Seconds from spawning the server to /health, to a first token, to the compiled step."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "minivllm.serve", "--port", str(port),
           *(["--model", model] if model else []), *server_args]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    env.pop("MINIVLLM_COMPILE", None)  # as shipped: compiled
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        times = {"health_s": time.monotonic() - start}
        name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        times["first_token_s"] = _first_token_seconds(url, name, start)
        while (step := httpx.get(f"{url}/stats", timeout=10).json().get("decode_step")) \
                == "compiling" and time.monotonic() - start < compiled_timeout_s:
            time.sleep(0.2)
        times["compiled_s"] = time.monotonic() - start if step == "compiled" else None
        times["decode_step"] = step
        return times
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint (default: the bundled tiny model)")
    p.add_argument("--out", help="JSONL file to append a record per start to")
    p.add_argument("server_args", nargs="*", help="flags for minivllm.serve (after --)")
    args = p.parse_args()
    from minivllm.bench.env import cpu_features  # the harness's own record of the machine

    cpu = cpu_features()
    print(f"cpu: {cpu}  load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache, \
            tempfile.TemporaryDirectory() as logs:
        for kind, name in (("cold", "first start (empty inductor cache)"),
                           ("warm", "second start (cache on disk)")):
            log = Path(logs) / "server.log"
            times = one_start(args.model, cache, log, args.server_args)
            compiled = (f"{times['compiled_s']:.1f} s" if times["compiled_s"] is not None
                        else f"never ({times['decode_step']})")
            print(f"\n{name}: /health {times['health_s']:.1f} s, first token "
                  f"{times['first_token_s']:.1f} s, compiled step {compiled}")
            for line in log.read_text().splitlines():
                if any(k in line for k in ("minivllm.engine", "minivllm.compile")):
                    print("   ", line)
            if args.out:
                record = {"tool": "startup_time", "start": kind, "model": args.model or "bundled",
                          "server_args": args.server_args, "cpu": cpu,
                          "date": time.strftime("%Y-%m-%dT%H:%M:%S"), **times}
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
