# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The benchmark harness: ``python -m minivllm.bench``.

Built in notebook 05_benchmark. It runs one seeded workload (``bench_metrics``) against
several engines, side by side on one machine, and appends one JSON line per (engine,
workload, concurrency) to ``bench/results/*.jsonl``:

* ``minivllm``: our ``LLMEngine`` driven directly as a closed loop that keeps
  ``concurrency`` requests in flight and timestamps each step's new tokens;
* ``minivllm-server``: ``python -m minivllm.serve`` in a subprocess, over HTTP;
* ``transformers``: ``generate`` on static, left-padded batches (the naive floor): each
  batch runs to its longest request, and the next batch waits for it;
* ``openai``: any OpenAI-compatible server at ``--base-url`` (vLLM, or minivllm elsewhere);
* ``vllm``: ``vllm serve`` started by the harness, when vLLM and CUDA are both present.

Every HTTP engine is measured by the same streaming client as ``vllm bench serve`` would
measure it. Each result records the environment (device, dtype, versions, model shape, git
commit, engine options) and the machine's *other* load, because a benchmark on a shared
CPU measures the neighbours as much as the engine; with ``--roofline`` also the machine's
matmul rate just before and after the level, and the result as a fraction of the roofline
that rate gives (``bench_roofline``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

from minivllm.bench_clients import (
    Progress,
    drive_closed_loop,
    free_port,
    generate_static_batches,
    run_openai_client,
    running_server,
    served_model_name,
)
from minivllm.bench_env import Monitor, device_name, environment, regular_vocab_size
from minivllm.bench_metrics import (
    WORKLOADS,
    BenchRequest,
    RequestResult,
    engine_label,
    format_table,
    make_workload,
    summarize,
)
from minivllm.bench_roofline import RooflineProbe

ENGINES = ("minivllm", "minivllm-server", "transformers", "openai", "vllm")


@dataclasses.dataclass
class BenchOptions:
    """Everything one benchmark invocation needs (picklable: it crosses into workers)."""

    model: str
    engines: list[str]
    workloads: list[str]
    concurrency: list[int]
    num_requests: int | None = None  # per level; None -> max(2 * concurrency, 8)
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.9  # mixed workload: lengths uniform in mean * (1 +- ratio)
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    engine_options: dict = dataclasses.field(default_factory=dict)  # EngineConfig fields
    base_url: str | None = None  # the "openai" engine's server, e.g. http://host:8000/v1
    label: str = ""
    ramp: bool = False
    ramp_step: int = 8
    ramp_cap: int = 256
    isolate: bool = True  # in-process engines each run in a fresh process (honest RSS)
    request_timeout: float = 3600.0
    warmup: bool = True
    repeat: int = 1  # run the whole engine list this many times, interleaved
    baseline: str | None = None  # engine label the table divides by (default transformers)
    roofline: bool = False  # measure the matmul roofline before and after every level


@dataclasses.dataclass
class Session:
    """A started engine: how to run a list of requests at a concurrency, what to monitor."""

    run: Callable[[list[BenchRequest], int, Progress | None], list[RequestResult]]
    memory_pid: int | None  # the process whose RSS is the engine's memory
    memory_kind: str | None  # "rss", "cuda_reserved", "cuda_device_used", or None
    info: dict  # engine-specific environment: device, dtype, options, backend


def serve_flags(options: dict) -> list[str]:
    """EngineConfig options as ``python -m minivllm.serve`` flags."""
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if key == "enable_prefix_caching":
            flags += [] if value else ["--no-prefix-caching"]
        elif key == "compile":
            flags += ["--compile" if value else "--no-compile"]
        elif isinstance(value, bool):
            flags += [flag] if value else []
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _http_session(base_url: str, model: str, opts: BenchOptions, memory_pid, memory_kind,
                  info: dict) -> Session:
    name = served_model_name(base_url, model)

    def run(requests, concurrency, on_finish):
        return run_openai_client(base_url, name, requests, concurrency, on_finish=on_finish,
                                 timeout_s=opts.request_timeout)

    return Session(run, memory_pid, memory_kind, {**info, "served_model_name": name})


@contextlib.contextmanager
def open_engine(name: str, opts: BenchOptions) -> Iterator[Session | None]:
    """Start engine ``name``; yields None (after saying why) when it cannot run here."""
    import torch

    from minivllm.config import EngineConfig, resolve_device

    device = str(resolve_device(opts.device))
    memory_kind = "cuda_reserved" if device.startswith("cuda") else "rss"
    if name == "minivllm":
        from minivllm.engine import LLMEngine

        engine = LLMEngine(EngineConfig(model=opts.model, dtype=opts.dtype, device=opts.device,
                                        **opts.engine_options))
        info = {"device": device, "dtype": str(engine.dtype).removeprefix("torch."),
                "engine_options": dataclasses.asdict(engine.config),
                "attention_backend": engine.config.attention_backend,
                "compile": getattr(engine, "decoder", None) is not None,  # as resolved (M7)
                "compile_seconds": getattr(engine, "compile_seconds", 0.0),
                "num_kv_blocks": engine.num_blocks}
        yield Session(lambda reqs, c, cb: drive_closed_loop(engine, reqs, c, on_finish=cb),
                      os.getpid(), memory_kind, info)
    elif name == "transformers":
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        from minivllm.config import ModelConfig, resolve_dtype, resolve_model_path

        logging.set_verbosity_error()  # generate() warns about sampling fields we turn off
        path = resolve_model_path(opts.model)
        dtype = resolve_dtype(opts.dtype, device, ModelConfig.from_pretrained(path).torch_dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        pad = model.generation_config.pad_token_id or model.config.eos_token_id or 0
        pad = pad[0] if isinstance(pad, list) else pad
        info = {"device": device, "dtype": str(dtype).removeprefix("torch."),
                "attn_implementation": model.config._attn_implementation,
                "batching": "static, left-padded"}
        yield Session(lambda reqs, c, cb: generate_static_batches(model, reqs, c, pad,
                                                                  on_finish=cb),
                      os.getpid(), memory_kind, info)
    elif name == "minivllm-server":
        port = free_port()
        cmd = [sys.executable, "-m", "minivllm.serve", "--model", opts.model, "--port",
               str(port), "--dtype", opts.dtype, "--device", opts.device, "--log-level",
               "warning", *serve_flags(opts.engine_options)]
        kind = "cuda_device_used" if device.startswith("cuda") else "rss"
        with running_server(cmd, f"http://127.0.0.1:{port}", name) as proc:
            yield _http_session(f"http://127.0.0.1:{port}/v1", opts.model, opts, proc.pid, kind,
                                {"device": device, "dtype": opts.dtype, "command": cmd,
                                 "engine_options": opts.engine_options})
    elif name == "openai":
        if not opts.base_url:
            print("skipping openai: no --base-url given")
            yield None
        else:
            yield _http_session(opts.base_url, opts.model, opts, None, None,
                                {"base_url": opts.base_url})
    elif name == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
            print("skipping vllm: it needs the vllm package and a CUDA GPU "
                  f"(vllm importable: {importlib.util.find_spec('vllm') is not None}, "
                  f"CUDA: {torch.cuda.is_available()})")
            yield None
            return
        port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               opts.model, "--port", str(port), "--dtype", opts.dtype, "--seed",
               str(opts.seed), "--max-num-seqs", str(opts.engine_options["max_num_seqs"])]
        if opts.engine_options.get("max_model_len"):
            cmd += ["--max-model-len", str(opts.engine_options["max_model_len"])]
        with running_server(cmd, f"http://127.0.0.1:{port}", name) as proc:
            yield _http_session(f"http://127.0.0.1:{port}/v1", opts.model, opts, proc.pid,
                                "cuda_device_used", {"device": "cuda", "dtype": opts.dtype,
                                                     "command": cmd})
    else:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")


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
    return RooflineProbe(mc, resolve_dtype(opts.dtype, device, mc.torch_dtype), device)


def bench_engine(spec: str, opts: BenchOptions, emit: Callable[[dict], None],
                 root_pid: int | None = None, repeat: int = 0) -> None:
    """Start one engine, warm it up, run every level (and the ramp), ``emit`` each record.
    ``spec`` is an engine name, optionally with its own options: ``minivllm[compile=False]``."""
    from minivllm.config import resolve_device, resolve_model_path

    name, variant, options = parse_engine_spec(spec)
    opts = dataclasses.replace(opts, engine_options={**opts.engine_options, **options})

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
            if probe:  # the machine's matmul rate just before the level ...
                rows = probe.rows(shapes, concurrency)
                before = probe.measure(rows)
            record = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      **common, "workload": kind, "concurrency": concurrency, "ramp": ramp,
                      "num_requests": num_requests,
                      **run_level(session, requests, concurrency, desc, root_pid), "env": env}
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


def parse_engine_options(pairs: list[str]) -> dict:
    """``key=value`` strings -> EngineConfig options, each value parsed by its field's type."""
    from minivllm.config import EngineConfig

    types = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
    options: dict = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key not in types or key == "model":
            raise SystemExit(f"--engine-option {pair!r}: expected key=value with key one of "
                             f"{', '.join(k for k in types if k != 'model')}")
        kind = types[key]
        if text.lower() == "none" and "None" in kind:
            value = None
        elif kind.startswith("bool"):
            value = text.lower() in ("1", "true", "yes", "on")
        elif kind.startswith("int"):
            value = int(text)
        elif kind.startswith("float"):
            value = float(text)
        else:
            value = text
        options[key] = value
    return options


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def split_engine_specs(text: str) -> list[str]:
    """``"minivllm[compile=False,attention_backend=loop],transformers"`` -> the two specs
    (commas inside brackets separate options, not engines)."""
    return [s.strip() for s in re.findall(r"[^,\[\]]+(?:\[[^\]]*\])?", text) if s.strip()]


def parse_engine_spec(spec: str) -> tuple[str, str, dict]:
    """``minivllm[compile=False]`` -> ("minivllm", "compile=False", {"compile": False}): an
    engine run with options of its own on top of ``--engine-option``, so that two variants of
    one engine can run side by side, in one invocation."""
    match = re.fullmatch(r"\s*([\w-]+)\s*(?:\[(.*)\])?\s*", spec)
    if match is None or match.group(1) not in ENGINES:
        raise SystemExit(f"unknown engine {spec!r}; choose from {', '.join(ENGINES)}, "
                         "optionally with options: minivllm[compile=False,attention_backend=loop]")
    variant = (match.group(2) or "").strip()
    return match.group(1), variant, parse_engine_options(_csv(variant))


def parse_args(argv: list[str] | None = None) -> tuple[BenchOptions, Path]:
    from minivllm import TINY_MODEL

    p = argparse.ArgumentParser(prog="python -m minivllm.bench",
                                description="Benchmark minivllm against transformers and vLLM "
                                            "on one seeded workload (see bench/README.md).")
    p.add_argument("--model", default=TINY_MODEL, help="checkpoint directory or hub id "
                   "(default: the bundled tiny model)")
    p.add_argument("--engines", default="minivllm,transformers",
                   help=f"comma-separated, from {', '.join(ENGINES)}; an engine may carry its "
                        "own options: 'minivllm[compile=False],minivllm[compile=True]'")
    p.add_argument("--workloads", default="fixed,mixed", help="comma-separated: fixed, mixed")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    p.add_argument("--num-requests", type=int, help="per level (default max(2*c, 8))")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean for mixed)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (mean for mixed)")
    p.add_argument("--range-ratio", type=float, default=0.9,
                   help="mixed: lengths uniform in mean*(1-r) .. mean*(1+r)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig field for minivllm and minivllm-server, e.g. "
                        "attention_backend=loop (repeatable)")
    p.add_argument("--base-url", help="the openai engine's server, e.g. http://host:8000/v1")
    p.add_argument("--label", default="", help="free-form tag, e.g. before/after a change")
    p.add_argument("--ramp", action="store_true",
                   help="also ramp concurrency 8, 16, ... until a request fails")
    p.add_argument("--ramp-step", type=int, default=8)
    p.add_argument("--ramp-cap", type=int, default=256)
    p.add_argument("--out", type=Path, help="JSONL file to append to (default "
                   "bench/results/<date>-<device>.jsonl)")
    p.add_argument("--no-isolate", action="store_true", help="run in-process engines in this "
                   "process instead of a fresh one each (faster start, shared RSS)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--repeat", type=int, default=1, help="run the engine list N times, "
                   "interleaved (A B A B ...); the table shows each level's median run and "
                   "the ratios pair runs of the same repeat")
    p.add_argument("--baseline", help="engine label the ratios divide by (default "
                   "transformers), e.g. 'minivllm[compile=False]'")
    p.add_argument("--roofline", action="store_true", help="measure this machine's matmul "
                   "rate at the level's shapes before and after every level, and report each "
                   "result as a fraction of the workload's roofline (bench_roofline)")
    a = p.parse_args(argv)
    engines, workloads = split_engine_specs(a.engines), _csv(a.workloads)
    for engine in engines:
        parse_engine_spec(engine)  # exits with a clear message on an unknown name or option
    if a.repeat < 1:
        p.error("--repeat must be at least 1")
    for workload in workloads:
        if workload not in WORKLOADS:
            p.error(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    concurrency = [int(c) for c in _csv(a.concurrency)]
    options = parse_engine_options(a.engine_option)
    most = max([*concurrency, a.ramp_cap if a.ramp else 0])
    options.setdefault("max_num_seqs", max(64, most))  # the engine must admit every request
    opts = BenchOptions(a.model, engines, workloads, concurrency, a.num_requests, a.input_len,
                        a.output_len, a.range_ratio, a.seed, a.dtype, a.device, options,
                        a.base_url, a.label, a.ramp, a.ramp_step, a.ramp_cap,
                        not a.no_isolate, a.request_timeout, not a.no_warmup, a.repeat,
                        a.baseline, a.roofline)
    return opts, a.out or default_results_path(a.device)


def default_results_path(device: str = "auto") -> Path:
    from minivllm.config import resolve_device

    name = device_name(str(resolve_device(device))).split(" (")[0]
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return Path("bench/results") / f"{datetime.now():%Y-%m-%d}-{slug}.jsonl"


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
    proc = ctx.Process(target=_worker, args=(name, opts, os.getpid(), repeat, child),
                       daemon=True)
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


def main(argv: list[str] | None = None) -> int:
    opts, out = parse_args(argv)
    records = run_benchmark(opts, out)
    labels = [engine_label(r) for r in records]
    baseline = opts.baseline or ("transformers" if "transformers" in labels or not labels
                                 else labels[0])
    print(format_table([r for r in records if not r["ramp"]], baseline))
    for engine in dict.fromkeys(engine_label(r) for r in records if r["ramp"]):
        ramp = [r for r in records if r["ramp"] and engine_label(r) == engine]
        served = [r["concurrency"] for r in ramp if not r["failures"]]
        capped = " (the cap: at least this)" if not ramp[-1]["failures"] else ""
        print(f"{engine}: max concurrency served without a failure: "
              f"{max(served) if served else 'none'}{capped}")
    if out is not None and records:
        print(f"appended {len(records)} record(s) to {out}")
    return 0 if records else 1


if __name__ == "__main__" and "get_ipython" not in globals():  # not in the notebook
    sys.exit(main())
