"""What the compiled decode step's warm-up costs, by route (issue 31).

Each start runs in a fresh interpreter (dynamo's in-memory caches empty, as in a new server
process) and times ``CompiledDecoder.warmup`` alone, after the weights and the pool exist:

* ``cold``: an empty ``TORCHINDUCTOR_CACHE_DIR``: dynamo traces, inductor generates and
  builds C++ for every graph. The start then saves ``torch.compiler.save_cache_artifacts()``
  (inductor's and AOTAutograd's cache entries in one blob, PyTorch's "mega-cache");
* ``warm``: the same cache directory again (what a second server start finds on disk);
* ``megacache``: another empty directory, filled by ``load_cache_artifacts`` with the blob
  before compiling (what a container image or a copied cache could ship);
* ``regional`` (``--regional``): a cold start with ``DecoderLayer.forward`` wrapped in
  ``torch.compiler.nested_compile_region``, so that dynamo could trace one layer and stamp
  it out for the rest; then ``regional-warm`` on its cache directory.

    python bench/experiments/compile_cost.py [--model CKPT] [--regional]

Run it alone: on 2 cores anything else running slows compiling many times over.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _worker(model: str | None, blob_in: str | None, blob_out: str | None, regional: bool) -> None:
    """One start: build the engine eagerly, then time the compiled step's warm-up."""
    import torch

    from minivllm.compile import CompiledDecoder
    from minivllm.config import EngineConfig
    from minivllm.engine import LLMEngine
    from minivllm.model import DecoderLayer

    loaded_bytes = 0
    if blob_in:
        started = time.perf_counter()
        blob = Path(blob_in).read_bytes()
        torch.compiler.load_cache_artifacts(blob)
        loaded_bytes, load_s = len(blob), time.perf_counter() - started
    if regional:
        DecoderLayer.forward = torch.compiler.nested_compile_region(DecoderLayer.forward)
    options = {"model": model} if model else {}
    engine = LLMEngine(EngineConfig(**options, compile=False, merge_projections=True))
    runner = engine.runner
    decoder = CompiledDecoder(runner.model, runner.pool.kv, engine.config.block_size,
                              runner.num_blocks, runner.device)
    record = {"warmup_s": decoder.warmup(runner.model_config.vocab_size)}
    if blob_in:
        record.update(loaded_bytes=loaded_bytes, load_s=load_s)
    if blob_out:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is not None:
            Path(blob_out).write_bytes(artifacts[0])
            record["saved_bytes"] = len(artifacts[0])
    print("RESULT " + json.dumps(record), flush=True)


def _start(model: str | None, cache_dir: str, blob_in=None, blob_out=None, regional=False) -> dict:
    cmd = [sys.executable, __file__, "--worker", *(["--model", model] if model else []),
           *(["--blob-in", blob_in] if blob_in else []),
           *(["--blob-out", blob_out] if blob_out else []), *(["--regional"] if regional else [])]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    results = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not results:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        return {"error": f"exit {done.returncode}: {tail}", "process_s": wall}
    return {**json.loads(results[-1]), "process_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint (default: the bundled tiny model)")
    p.add_argument("--regional", action="store_true", help="also the nested_compile_region route")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--blob-in", help=argparse.SUPPRESS)
    p.add_argument("--blob-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker(args.model, args.blob_in, args.blob_out, args.regional)
    sys.path.insert(0, str(ROOT))
    from minivllm.bench.env import cpu_features

    print(f"cpu: {cpu_features()}  load average: {os.getloadavg()}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="compile-cost-") as tmp:
        blob = str(Path(tmp) / "megacache.bin")
        results["cold"] = _start(args.model, f"{tmp}/a", blob_out=blob)
        results["warm"] = _start(args.model, f"{tmp}/a")
        if Path(blob).is_file():
            results["megacache"] = _start(args.model, f"{tmp}/b", blob_in=blob)
        if args.regional:
            results["regional"] = _start(args.model, f"{tmp}/c", regional=True)
            if "error" not in results["regional"]:
                results["regional-warm"] = _start(args.model, f"{tmp}/c", regional=True)
    for route, record in results.items():
        print(f"{route:>14}: " + json.dumps(record))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
