# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The harness: run every engine through every level, and write one JSON line per level.

Built in notebook 05_benchmark. ``bench_engine`` starts one engine (``engines``), warms it
up, and runs each (workload, concurrency) level, plus the optional concurrency ramp, under a
``Monitor`` (``env``) that records peak memory and the machine's *other* load, because a
benchmark on a shared CPU measures the neighbours as much as the engine; with ``--roofline``
also the machine's matmul rate just before and after the level, and the result as a
fraction of the roofline that rate gives (``roofline``). ``run_benchmark`` runs the engine
list ``repeat`` times, interleaved, each in-process engine in a fresh process (so each
engine's RSS is its own), and appends each record to ``bench/results/*.jsonl``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from minivllm.bench.engines import BenchOptions, Session, open_engine, parse_engine_spec
from minivllm.bench.env import Monitor, environment, regular_vocab_size
from minivllm.bench.metrics import BenchRequest, RequestResult, make_workload, summarize
from minivllm.bench.roofline import RooflineProbe


def run_level(session: Session, requests: list[BenchRequest], concurrency: int, desc: str,
              root_pid: int | None = None) -> dict:
    """Run one (workload, concurrency) level under a Monitor: metrics, memory, load."""
    from tqdm.auto import tqdm

    cuda = session.memory_kind == "cuda_reserved"
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
    bar = tqdm(total=len(requests), desc=desc, unit="req", leave=False)
    error = None
    with Monitor(session.memory_pid, root_pid, None if cuda else session.memory_kind) as mon:
        t0 = time.perf_counter()
        try:
            results = session.run(requests, concurrency, lambda: bar.update(1))
        except Exception as e:  # noqa: BLE001 (e.g. out of memory: the whole level failed)
            error = f"{type(e).__name__}: {e}"[:300]
            results = [RequestResult(len(r.prompt_token_ids), error=error) for r in requests]
        duration = time.perf_counter() - t0
    bar.close()
    peak = torch.cuda.max_memory_reserved() if cuda else mon.peak_memory_bytes
    errors = list(dict.fromkeys(r.error for r in results if r.error))[:3]
    return {**summarize(results, duration), "peak_memory_bytes": peak,
            "peak_memory_kind": session.memory_kind, "load": mon.load(), "errors": errors}


def roofline_probe(name: str, opts: BenchOptions, device: str) -> RooflineProbe | None:
    """With ``--roofline``: a probe of this machine's matmul rate for the checkpoint, or None
    (with the reason) where the engine runs elsewhere or the checkpoint is not on disk."""
    from minivllm.config import ModelConfig, resolve_dtype, resolve_model_path

    if not opts.roofline:
        return None
    if name == "openai":
        print("no roofline for the openai engine: its server may run on another machine")
        return None
    try:
        mc = ModelConfig.from_pretrained(resolve_model_path(opts.model))
    except (FileNotFoundError, OSError, ValueError) as e:
        print(f"no roofline: {e}")
        return None
    return RooflineProbe(mc, resolve_dtype(opts.dtype, device, mc), device)


def stats_delta(before: dict, after: dict) -> dict:
    """The engine's counters over one level: steps, tokens, preemptions, and speculative
    decoding's proposals, acceptance rate and mean accepted length (Milestone 8)."""
    from minivllm.engine import EngineStats

    counters = {f.name for f in dataclasses.fields(EngineStats) if f.type == "int"}
    delta = {k: v - before.get(k, 0) for k, v in after.items()
             if k in counters and not k.startswith("max_")}  # not gauges (a server's /stats)
    proposed, verified = delta.get("num_spec_proposed_tokens", 0), delta.get("num_spec_verifications", 0)
    delta["spec_acceptance_rate"] = (delta.get("num_spec_accepted_tokens", 0) / proposed
                                     if proposed else None)
    delta["spec_mean_accepted_length"] = (
        (delta.get("num_spec_accepted_tokens", 0) + verified) / verified if verified else None)
    return delta


def bench_engine(spec: str, opts: BenchOptions, emit: Callable[[dict], None],
                 root_pid: int | None = None, repeat: int = 0) -> None:
    """Start one engine, warm it up, run every level (and the ramp), ``emit`` each record.
    ``spec`` is an engine name, optionally with its own options: ``minivllm[compile=False]``."""
    from minivllm.config import resolve_device, resolve_model_path

    name, variant, options = parse_engine_spec(spec)
    # dtype and device are options of every engine, so a variant may set them too
    # (``minivllm[dtype=float32],minivllm`` compares fp32 with what "auto" picks)
    own = {key: str(options.pop(key)) for key in ("dtype", "device") if key in options}
    opts = dataclasses.replace(opts, **own, engine_options={**opts.engine_options, **options})

    vocab = 151643  # Qwen's regular tokens, when the checkpoint is elsewhere (openai)
    with contextlib.suppress(FileNotFoundError):
        vocab = regular_vocab_size(resolve_model_path(opts.model))
    with open_engine(name, opts) as session:
        if session is None:
            return
        env = environment(opts.model, str(resolve_device(opts.device)), opts.dtype)
        env |= session.info
        probe = roofline_probe(name, opts, env["device"])
        common = {"schema": 1, "label": opts.label, "engine": name, "variant": variant,
                  "repeat": repeat, "input_len": opts.input_len, "output_len": opts.output_len,
                  "range_ratio": opts.range_ratio, "seed": opts.seed}

        def level(kind: str, concurrency: int, num_requests: int, salt: int,
                  ramp: bool) -> dict:
            requests = make_workload(kind, num_requests, opts.input_len, opts.output_len,
                                     seed=opts.seed, vocab_size=vocab,
                                     range_ratio=opts.range_ratio, salt=salt)
            desc = f"{spec} {kind} c={concurrency}" + (" ramp" if ramp else "")
            shapes = [(len(r.prompt_token_ids), r.output_len) for r in requests]
            before_stats = session.stats() if session.stats is not None else None
            if probe:  # the machine's matmul rate just before the level ...
                rows = probe.rows(shapes, concurrency)
                before = probe.measure(rows)
            record = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      **common, "workload": kind, "concurrency": concurrency, "ramp": ramp,
                      "num_requests": num_requests,
                      **run_level(session, requests, concurrency, desc, root_pid), "env": env}
            if session.stats is not None:  # this level's share of the engine's counters
                record["engine_stats"] = stats_delta(before_stats, session.stats())
            if probe:  # ... and just after it
                record["roofline"] = probe.record(shapes, rows, before, probe.measure(rows),
                                                  record["output_throughput"])
            emit(record)
            return record

        if opts.warmup:  # first calls allocate, pick kernels, fill caches: not measured
            warm = make_workload("fixed", 2, opts.input_len, 4, seed=opts.seed,
                                 vocab_size=vocab, salt=-1)
            session.run(warm, 2, None)
        for kind in opts.workloads:
            for c in opts.concurrency:
                level(kind, c, opts.num_requests or max(2 * c, 8), c, False)
        for c in range(opts.ramp_step, opts.ramp_cap + 1, opts.ramp_step) if opts.ramp else ():
            if level(opts.workloads[0], c, c, 100_000 + c, True)["failures"]:
                break


def _worker(spec: str, opts: BenchOptions, root_pid: int, repeat: int, conn) -> None:
    """Entry point of an isolated engine process: send every record, then None."""
    try:
        bench_engine(spec, opts, conn.send, root_pid, repeat)
    except Exception as e:  # noqa: BLE001 (reported by the parent, which carries on)
        conn.send({"worker_error": f"{type(e).__name__}: {e}"})
    conn.send(None)


def run_isolated(name: str, opts: BenchOptions, emit: Callable[[dict], None],
                 repeat: int = 0) -> None:
    """``bench_engine`` in a fresh process, so each engine's RSS is its own."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    # not daemonic: a daemonic process may not start processes, and a tensor-parallel engine
    # (Milestone 9) starts its workers; the worker ends with its run and is joined below
    proc = ctx.Process(target=_worker, args=(name, opts, os.getpid(), repeat, child),
                       daemon=False)
    proc.start()
    child.close()
    while True:
        try:
            message = parent.recv()
        except EOFError:  # the worker died (e.g. killed for memory) without a word
            print(f"{name}: the benchmark process exited with status {proc.exitcode}")
            break
        if message is None:
            break
        if "worker_error" in message:
            print(f"{name} failed: {message['worker_error']}")
        else:
            emit(message)
    proc.join()


def run_benchmark(opts: BenchOptions, out: Path | None) -> list[dict]:
    """Every engine in turn, ``opts.repeat`` times round (A B A B: a slow spell of the machine
    hits both); each record is appended to ``out`` as soon as it exists."""
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")

    for repeat in range(opts.repeat):
        for spec in opts.engines:
            if opts.isolate and parse_engine_spec(spec)[0] in ("minivllm", "transformers"):
                run_isolated(spec, opts, emit, repeat)
            else:
                try:
                    bench_engine(spec, opts, emit, repeat=repeat)
                except RuntimeError as e:  # a server that did not start
                    print(f"{spec} failed: {e}")
    return records
