"""First and second start of ``python -m minivllm.serve``, as a user meets them.

Starts the server twice on a fresh inductor cache directory (the first start compiles the
decode step; the second finds the compiled kernels on disk), each time timing the moment
``/health`` first answers 200, and prints the stage lines of each start-up log (weights,
KV pool, compile warm-up) with the machine's CPU and load beside them.

    python tools/startup_time.py                     # the bundled model
    python tools/startup_time.py --model CKPT_DIR    # another checkpoint

Run it alone: on 2 cores anything else running slows the compile 10x.
"""

from __future__ import annotations

import argparse
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


def one_start(model: str | None, cache_dir: str, log_path: Path) -> float:
    """Seconds from spawning the server to its first 200 on /health; then stop it."""
    port = _free_port()
    cmd = [sys.executable, "-m", "minivllm.serve", "--port", str(port),
           *(["--model", model] if model else [])]
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
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint (default: the bundled tiny model)")
    args = p.parse_args()
    from minivllm.bench.env import cpu_features  # the harness's own record of the machine

    print(f"cpu: {cpu_features()}  load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache, \
            tempfile.TemporaryDirectory() as logs:
        for name in ("first start (empty inductor cache)", "second start (cache on disk)"):
            log = Path(logs) / "server.log"
            seconds = one_start(args.model, cache, log)
            print(f"\n{name}: {seconds:.1f} s to the first 200 on /health")
            for line in log.read_text().splitlines():
                if any(k in line for k in ("minivllm.engine", "minivllm.compile")):
                    print("   ", line)
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
