"""What the compiled decode step's warm-up costs, by route (issue 31), and, with ``--steps``,
what its steps then take (issue 30, twenty-sixth part).

Each start runs in a fresh interpreter (dynamo's in-memory caches empty, as in a new server
process), builds the engine as ``python -m minivllm.serve`` builds it, its compiled step
warmed up in the foreground (``compile_in_background=False``), and records the warm-up's
time (``CompiledDecoder.compile_seconds``; its per-shape log lines count the graphs each
compiled):

* ``cold``: an empty ``TORCHINDUCTOR_CACHE_DIR``: dynamo traces, inductor generates and
  builds C++ for every graph. The start then saves ``torch.compiler.save_cache_artifacts()``
  (inductor's and AOTAutograd's cache entries in one blob, PyTorch's "mega-cache");
* ``warm``: the same cache directory again (what a second server start finds on disk);
* ``megacache``: another empty directory, filled by ``load_cache_artifacts`` with the blob
  before compiling (what a container image or a copied cache could ship);
* ``regional`` (``--regional``): a cold start with ``DecoderLayer.forward`` wrapped in
  ``torch.compiler.nested_compile_region``, so that dynamo could trace one layer and stamp
  it out for the rest; then ``regional-warm`` on its cache directory.

``--steps`` also times ``CompiledDecoder.logits`` after the warm-up: one row and 32 rows (one
128-token sequence's block table repeated), medians. ``--package DIR`` runs the starts on
another checkout's package (``PYTHONPATH``, e.g. a ``git worktree`` of the commit before), so
two versions can be compared start by start; ``--cache-dir DIR`` puts the ``cold``/``warm``
starts on that inductor cache instead of a new empty one (then ``cold`` is cold only if the
directory is empty):

    python bench/experiments/compile_cost.py [--model CKPT] [--regional]
    git worktree add /tmp/before <commit>
    for pkg in /tmp/before . /tmp/before .; do   # warm starts of two versions, alternated
      python bench/experiments/compile_cost.py --model CKPT --routes warm --cache-dir \\
          /tmp/torchinductor_$USER --steps --package $pkg
    done

Run it alone: on 2 cores anything else running slows compiling many times over.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUTES = ("cold", "warm", "megacache")


def _time_steps(engine, calls: int) -> dict[str, float]:
    """Medians of the compiled step's logits: one row, and 32 rows (a quarter of the calls)."""
    import torch

    from minivllm.compile import DecodeInputs
    from minivllm.sampling import SamplingParams

    rng = random.Random(0)
    vocab = min(engine.model_config.vocab_size, 100_000)
    engine.add_request("steps", [rng.randrange(vocab) for _ in range(128)],
                       SamplingParams(max_tokens=calls + 16, ignore_eos=True, temperature=0.0))
    for _ in range(5):  # the prompt's step, then a few decode steps
        engine.step()
    seq, decoder = engine.scheduler.running[0], engine.runner.decoder
    medians = {}
    with torch.inference_mode():
        for rows, n in ((1, calls), (32, max(calls // 4, 3))):
            batch = DecodeInputs([seq.token_ids[-1]] * rows, [seq.num_tokens] * rows,
                                 [list(seq.block_table)] * rows)
            decoder.logits(batch)  # untimed
            times = []
            for _ in range(n):
                start = time.perf_counter()
                decoder.logits(batch)
                times.append(time.perf_counter() - start)
            medians[f"rows{rows}_ms"] = round(statistics.median(times) * 1e3, 2)
    return medians


def _worker(model: str | None, blob_in: str | None, blob_out: str | None, regional: bool,
            steps: int) -> None:
    """One start: build the engine as the server does, its compiled step warmed up."""
    import torch

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
    started = time.perf_counter()
    engine = LLMEngine.from_options(model, compile=True, compile_in_background=False)
    built_s = time.perf_counter() - started
    decoder = engine.runner.decoder
    if decoder is None:
        raise SystemExit("the decode step did not compile (see the warning above)")
    record = {"warmup_s": round(decoder.compile_seconds, 1), "engine_built_s": round(built_s, 1)}
    if blob_in:
        record.update(loaded_bytes=loaded_bytes, load_s=round(load_s, 2))
    if blob_out:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is not None:
            Path(blob_out).write_bytes(artifacts[0])
            record["saved_bytes"] = len(artifacts[0])
    if steps:
        record.update(_time_steps(engine, steps))
    print("RESULT " + json.dumps(record), flush=True)


def _start(args, cache_dir: str, blob_in=None, blob_out=None, regional=False) -> dict:
    cmd = [sys.executable, __file__, "--worker", *(["--model", args.model] if args.model else []),
           *(["--blob-in", blob_in] if blob_in else []),
           *(["--blob-out", blob_out] if blob_out else []), *(["--regional"] if regional else []),
           "--steps-calls", str(args.steps_calls if args.steps else 0)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONPATH": args.package}
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                          cwd=args.package)
    wall = time.perf_counter() - started
    results = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not results:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        return {"error": f"exit {done.returncode}: {tail}", "process_s": wall}
    return {**json.loads(results[-1]), "process_s": round(wall, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint (default: the bundled tiny model)")
    p.add_argument("--routes", default=",".join(ROUTES),
                   help=f"comma-separated, of {', '.join(ROUTES)} (warm follows cold's cache)")
    p.add_argument("--regional", action="store_true", help="also the nested_compile_region route")
    p.add_argument("--steps", action="store_true", help="also time the compiled step's logits")
    p.add_argument("--steps-calls", type=int, default=60, help="timed one-row calls (32 rows: "
                   "a quarter)")
    p.add_argument("--package", default=str(ROOT), help="the checkout whose package the starts "
                   "run (default: this one)")
    p.add_argument("--cache-dir", help="the inductor cache of the cold/warm starts (default: a "
                   "new empty directory)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--blob-in", help=argparse.SUPPRESS)
    p.add_argument("--blob-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker(args.model, args.blob_in, args.blob_out, args.regional, args.steps_calls)
    routes = [r for r in args.routes.split(",") if r]
    if unknown := set(routes) - set(ROUTES):
        p.error(f"unknown routes {sorted(unknown)}; choose from {', '.join(ROUTES)}")
    args.package = str(Path(args.package).resolve())
    if args.model:
        args.model = str(Path(args.model).resolve())
    sys.path.insert(0, str(ROOT))
    from minivllm.bench.env import cpu_features

    print(f"cpu: {cpu_features()}  package: {args.package}  load average: {os.getloadavg()}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="compile-cost-") as tmp:
        blob, cache = str(Path(tmp) / "megacache.bin"), args.cache_dir or f"{tmp}/a"
        if "cold" in routes:
            results["cold"] = _start(args, cache, blob_out=blob)
        if "warm" in routes:
            results["warm"] = _start(args, cache)
        if "megacache" in routes and Path(blob).is_file():
            results["megacache"] = _start(args, f"{tmp}/b", blob_in=blob)
        if args.regional:
            results["regional"] = _start(args, f"{tmp}/c", regional=True)
            if "error" not in results["regional"]:
                results["regional-warm"] = _start(args, f"{tmp}/c", regional=True)
    for route, record in results.items():
        print(f"{route:>14}: " + json.dumps(record))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
