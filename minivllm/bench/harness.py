# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The harness: run every engine through every level, and write one JSON line per level.

Built in notebook 05_benchmark. ``started_engine`` starts one engine (``engines``), warms it
up, and hands back a ``Runner`` whose ``level`` runs one (workload, concurrency) level under
a ``Monitor`` (``env``) that records peak memory and the machine's *other* load, because a
benchmark on a shared CPU measures the neighbours as much as the engine; with ``--roofline``
also the machine's matmul rate just before and after the level, and the result as a
fraction of the roofline that rate gives (``roofline``). ``run_benchmark`` runs the engines
one after another (``bench_engine``: every level of one engine, then the next), or with
``--interleave`` all at once, each level by every engine in turn, so that two engines
compared on a level ran minutes apart rather than a whole run apart. Each in-process engine
runs in a fresh process (so its RSS is its own), and each record is appended to
``bench/results/*.jsonl``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

from minivllm.bench.engines import (
    BenchOptions,
    Session,
    apply_engine_spec,
    open_engine,
    parse_engine_spec,
)
from minivllm.bench.env import Monitor, environment, regular_vocab_size
from minivllm.bench.metrics import BenchRequest, RequestResult, make_workload, summarize
from minivllm.bench.roofline import RooflineProbe


def run_level(session: Session, requests: list[BenchRequest], concurrency: int, desc: str,
              root_pid: int | None = None, idle_pids: tuple[int, ...] = ()) -> dict:
    """Run one (workload, concurrency) level under a Monitor: metrics, memory, load.
    ``idle_pids``: engines of this benchmark that wait meanwhile (``--interleave``); what
    CPU they use counts as the machine's other load."""
    from tqdm.auto import tqdm

    cuda = session.memory_kind == "cuda_reserved"
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
    bar = tqdm(total=len(requests), desc=desc, unit="req", leave=False)
    error = None
    with Monitor(session.memory_pid, root_pid, None if cuda else session.memory_kind,
                 idle_pids=idle_pids) as mon:
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


@dataclasses.dataclass
class Runner:
    """A started, warmed-up engine. ``level(kind, concurrency, num_requests, salt, ramp,
    repeat, idle_pids)`` runs one level and returns its record (or None, if it failed)."""

    spec: str
    pid: int | None  # the process (tree) that is the engine, if not this one: a server's
    level: Callable[..., dict | None]


def level_plan(opts: BenchOptions) -> list[tuple[str, int, int, int]]:
    """The run's levels in order: (workload, concurrency, requests, workload salt)."""
    return [(kind, c, opts.num_requests or max(2 * c, 8), c)
            for kind in opts.workloads for c in opts.concurrency]


def ramp_plan(opts: BenchOptions) -> list[tuple[str, int, int, int]]:
    """``--ramp``: concurrency step, 2*step, ... up to the cap, one request per slot."""
    steps = range(opts.ramp_step, opts.ramp_cap + 1, opts.ramp_step) if opts.ramp else ()
    return [(opts.workloads[0], c, c, 100_000 + c) for c in steps]


@contextlib.contextmanager
def started_engine(spec: str, opts: BenchOptions,
                   root_pid: int | None = None) -> Iterator[Runner | None]:
    """Start one engine and warm it up; yields its ``Runner``, or None where it cannot run
    here. ``spec`` is an engine name, optionally with its own options:
    ``minivllm[compile=False]``."""
    from minivllm.config import resolve_device, resolve_model_path

    name, variant, opts = apply_engine_spec(spec, opts)

    vocab = 151643  # Qwen's regular tokens, when the checkpoint is elsewhere (openai)
    with contextlib.suppress(FileNotFoundError):
        vocab = regular_vocab_size(resolve_model_path(opts.model))
    with open_engine(name, opts) as session:
        if session is None:
            yield None
            return
        env = environment(opts.model, str(resolve_device(opts.device)), opts.dtype)
        env |= session.info
        probe = roofline_probe(name, opts, env["device"])
        common = {"schema": 1, "label": opts.label, "engine": name, "variant": variant,
                  "input_len": opts.input_len, "output_len": opts.output_len,
                  "range_ratio": opts.range_ratio, "seed": opts.seed,
                  "interleaved": opts.interleave}

        def level(kind: str, concurrency: int, num_requests: int, salt: int, ramp: bool,
                  repeat: int = 0, idle_pids: tuple[int, ...] = ()) -> dict:
            requests = make_workload(kind, num_requests, opts.input_len, opts.output_len,
                                     seed=opts.seed, vocab_size=vocab,
                                     range_ratio=opts.range_ratio, salt=salt, repeat=repeat)
            desc = f"{spec} {kind} c={concurrency}" + (" ramp" if ramp else "")
            shapes = [(len(r.prompt_token_ids), r.output_len) for r in requests]
            before_stats = session.stats() if session.stats is not None else None
            if probe:  # the machine's matmul rate just before the level ...
                rows = probe.rows(shapes, concurrency)
                before = probe.measure(rows)
            record = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      **common, "repeat": repeat, "workload": kind, "concurrency": concurrency,
                      "ramp": ramp, "num_requests": num_requests,
                      **run_level(session, requests, concurrency, desc, root_pid, idle_pids),
                      "env": env}
            if session.stats is not None:  # this level's share of the engine's counters
                record["engine_stats"] = stats_delta(before_stats, session.stats())
            if probe:  # ... and just after it
                record["roofline"] = probe.record(shapes, rows, before, probe.measure(rows),
                                                  record["output_throughput"])
            return record

        if opts.warmup:  # first calls allocate, pick kernels, fill caches: not measured
            warm = make_workload("fixed", 2, opts.input_len, 4, seed=opts.seed,
                                 vocab_size=vocab, salt=-1)
            session.run(warm, 2, None)
        pid = session.memory_pid if session.memory_pid != os.getpid() else None
        yield Runner(spec, pid, level)


def bench_engine(spec: str, opts: BenchOptions, emit: Callable[[dict], None],
                 root_pid: int | None = None, repeat: int = 0) -> None:
    """Start one engine, warm it up, run every level (and the ramp), ``emit`` each record."""
    with started_engine(spec, opts, root_pid) as runner:
        if runner is None:
            return
        for plan in level_plan(opts):
            emit(runner.level(*plan, False, repeat))
        for plan in ramp_plan(opts):
            record = runner.level(*plan, True, repeat)
            emit(record)
            if record["failures"]:
                break


def _worker(spec: str, opts: BenchOptions, root_pid: int, repeat: int, conn) -> None:
    """Entry point of an isolated engine process: send every record, then None."""
    try:
        bench_engine(spec, opts, conn.send, root_pid, repeat)
    except Exception as e:  # noqa: BLE001 (reported by the parent, which carries on)
        conn.send({"worker_error": f"{type(e).__name__}: {e}"})
    conn.send(None)


def _spawn(target: Callable, args: tuple, duplex: bool):
    """A fresh Python process running ``target(*args, child_end)``; returns (process, our end)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=duplex)
    # not daemonic: a daemonic process may not start processes, and a tensor-parallel engine
    # (Milestone 9) starts its workers; the worker ends with its run and is joined
    proc = ctx.Process(target=target, args=(*args, child), daemon=False)
    proc.start()
    child.close()
    return proc, parent


def run_isolated(name: str, opts: BenchOptions, emit: Callable[[dict], None],
                 repeat: int = 0) -> None:
    """``bench_engine`` in a fresh process, so each engine's RSS is its own."""
    proc, parent = _spawn(_worker, (name, opts, os.getpid(), repeat), duplex=False)
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


def _level_worker(spec: str, opts: BenchOptions, root_pid: int, conn) -> None:
    """Entry point of an isolated engine that runs levels on command (``--interleave``):
    says "ready" (or why not), then answers each level's arguments with its record, until
    it receives None."""
    try:
        with started_engine(spec, opts, root_pid) as runner:
            conn.send("ready" if runner is not None else "skipped")  # open_engine said why
            while runner is not None and (args := conn.recv()) is not None:
                try:
                    conn.send(runner.level(*args))
                except Exception as e:  # noqa: BLE001 (this level fails; the engine stays)
                    conn.send({"worker_error": f"{type(e).__name__}: {e}"})
    except Exception as e:  # noqa: BLE001 (reported by the parent, which carries on)
        conn.send({"worker_error": f"{type(e).__name__}: {e}"})


@contextlib.contextmanager
def isolated_engine(spec: str, opts: BenchOptions) -> Iterator[Runner | None]:
    """``started_engine`` in a fresh process that stays up between levels: its ``Runner``
    sends each level over a pipe and waits for the record."""
    proc, conn = _spawn(_level_worker, (spec, opts, os.getpid()), duplex=True)

    def answer() -> dict | str | None:
        try:
            message = conn.recv()
        except EOFError:  # the worker died (e.g. killed for memory) without a word
            print(f"{spec}: the benchmark process exited with status {proc.exitcode}")
            return None
        if isinstance(message, dict) and "worker_error" in message:
            print(f"{spec} failed: {message['worker_error']}")
            return None
        return message

    def level(*args) -> dict | None:
        if not proc.is_alive():
            return None
        conn.send(args)
        return answer()

    try:
        yield Runner(spec, proc.pid, level) if answer() == "ready" else None
    finally:
        with contextlib.suppress(BrokenPipeError, OSError):
            conn.send(None)
        proc.join()


def run_interleaved(opts: BenchOptions, emit: Callable[[dict], None]) -> None:
    """``--interleave``: start every engine, then run each level by every engine in turn,
    the order reversed each time (A B C, C B A, ...: a trend in the machine's speed falls on
    every engine alike); with ``--repeat N`` each level goes round N times before the next.
    All engines are resident at once, so the machine needs the memory of all of them."""
    with contextlib.ExitStack() as stack:
        runners: list[Runner] = []
        for spec in opts.engines:
            isolate = opts.isolate and parse_engine_spec(spec)[0] in ("minivllm", "transformers")
            try:
                runner = stack.enter_context(isolated_engine(spec, opts) if isolate
                                             else started_engine(spec, opts))
            except RuntimeError as e:  # a server that did not start
                print(f"{spec} failed: {e}")
                continue
            if runner is not None:
                runners.append(runner)
        turn = 0

        def one_round(plan: tuple, ramp: bool, repeat: int, alive: list[Runner]) -> list[Runner]:
            """Every engine in ``alive`` runs the level; returns those that served it."""
            nonlocal turn
            order, turn = (alive if turn % 2 == 0 else alive[::-1]), turn + 1
            served = []
            for runner in order:
                idle = tuple(r.pid for r in runners if r is not runner and r.pid is not None)
                record = runner.level(*plan, ramp, repeat, idle)
                if record is not None:
                    emit(record)
                    if not record["failures"]:
                        served.append(runner)
            return [r for r in alive if r in served]

        for plan in level_plan(opts):
            for repeat in range(opts.repeat):
                one_round(plan, False, repeat, runners)
        alive = list(runners)
        for plan in ramp_plan(opts):  # each engine ramps until a request of its own fails
            alive = one_round(plan, True, 0, alive)


def run_benchmark(opts: BenchOptions, out: Path | None) -> list[dict]:
    """Every engine in turn, ``opts.repeat`` times round (A B A B: a slow spell of the machine
    hits both), or with ``opts.interleave`` every engine at each level in turn; each record
    is appended to ``out`` as soon as it exists."""
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")

    if opts.interleave:
        run_interleaved(opts, emit)
        return records
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
