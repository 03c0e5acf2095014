# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""``python -m minivllm.bench``: the command line of the benchmark harness.

Built in notebook 05_benchmark. Every flag that mirrors an engine setting (``--dtype``,
``--device``) takes its default from ``EngineConfig``'s field, so the benchmark runs what a
user gets; ``--engine-option key=value`` and ``engine[key=value]`` set any other field.
The table at the end shows each level's median run, the ratios against ``--baseline`` and
the machine it ran on (``env.machine_line``).
"""

from __future__ import annotations

import argparse
import dataclasses
from datetime import datetime
from pathlib import Path

from minivllm.bench.engines import (
    ENGINES,
    HTTP_SAMPLING_FIELDS,
    SAMPLING_FIELDS,
    BenchOptions,
    csv_list,
    parse_engine_options,
    parse_engine_spec,
    parse_sampling_options,
    split_engine_specs,
)
from minivllm.bench.env import device_name, machine_line
from minivllm.bench.harness import run_benchmark
from minivllm.bench.metrics import WORKLOADS, engine_label, format_table
from minivllm.config import EngineConfig

# EngineConfig's field defaults: the one source of the default of every flag that mirrors an
# engine setting (--model, --dtype, --device); a test fails when one of them differs.
ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)
                   if f.default is not dataclasses.MISSING}


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m minivllm.bench``."""
    p = argparse.ArgumentParser(prog="python -m minivllm.bench",
                                description="Benchmark minivllm against transformers and vLLM "
                                            "on one seeded workload (see bench/README.md).")
    p.add_argument("--model", default=ENGINE_DEFAULTS["model"], help="checkpoint directory "
                   "or hub id (default: EngineConfig's, the bundled tiny model)")
    p.add_argument("--engines", default="minivllm,transformers",
                   help=f"comma-separated, from {', '.join(ENGINES)}; an engine may carry its "
                        "own options: 'minivllm[compile=False],minivllm[compile=True]'")
    p.add_argument("--workloads", default="fixed,mixed", help="comma-separated: fixed, mixed, repetitive")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    p.add_argument("--num-requests", type=int, help="per level (default max(2*c, 8))")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean for mixed)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (mean for mixed)")
    p.add_argument("--range-ratio", type=float, default=0.9,
                   help="mixed: lengths uniform in mean*(1-r) .. mean*(1+r)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=ENGINE_DEFAULTS["dtype"],
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="as EngineConfig.dtype (default %(default)s); passed to the servers "
                        "only when given")
    p.add_argument("--device", default=ENGINE_DEFAULTS["device"],
                   help="as EngineConfig.device (default %(default)s)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig field for minivllm and minivllm-server, e.g. "
                        "attention_backend=loop (repeatable); kv_cache_memory_bytes also sizes "
                        "transformers-serve's KV cache")
    p.add_argument("--sampling-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a SamplingParams field (JSON value) for every request, e.g. "
                        "temperature=1 (sampled, not greedy) or repetition_penalty=1.1 "
                        "(repeatable); the servers take temperature, top_p, top_k, min_p, "
                        "seed and the presence/frequency penalties, the in-process minivllm "
                        "engine any field")
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
    p.add_argument("--interleave", action="store_true", help="start every engine at once "
                   "and run each level by every engine in turn (A B C, then C B A), so that "
                   "engines compared on a level ran minutes apart, not a whole run apart; "
                   "needs the memory of all the engines at once")
    p.add_argument("--baseline", help="engine label the ratios divide by (default "
                   "transformers), e.g. 'minivllm[compile=False]'")
    p.add_argument("--roofline", action="store_true", help="measure this machine's matmul "
                   "rate at the level's shapes before and after every level, and report each "
                   "result as a fraction of the workload's roofline (minivllm/bench/roofline.py)")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[BenchOptions, Path]:
    """The flags -> the run's options and the JSONL file its records are appended to."""
    p = build_parser()
    a = p.parse_args(argv)
    engines, workloads = split_engine_specs(a.engines), csv_list(a.workloads)
    for engine in engines:
        parse_engine_spec(engine)  # exits with a clear message on an unknown name or option
    if a.repeat < 1:
        p.error("--repeat must be at least 1")
    for workload in workloads:
        if workload not in WORKLOADS:
            p.error(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    concurrency = [int(c) for c in csv_list(a.concurrency)]
    options = parse_engine_options(a.engine_option)
    most = max([*concurrency, a.ramp_cap if a.ramp else 0])
    if most > ENGINE_DEFAULTS["max_num_seqs"]:  # the engine must admit every request
        options.setdefault("max_num_seqs", most)
    opts = BenchOptions(a.model, engines, workloads, concurrency, a.num_requests, a.input_len,
                        a.output_len, a.range_ratio, a.seed, a.dtype, a.device, options,
                        a.base_url, a.label, a.ramp, a.ramp_step, a.ramp_cap,
                        not a.no_isolate, a.request_timeout, not a.no_warmup, a.repeat,
                        a.interleave, a.baseline, a.roofline,
                        parse_sampling_options(a.sampling_option))
    for spec in engines if opts.sampling else ():
        name = parse_engine_spec(spec)[0]
        allowed = SAMPLING_FIELDS.get(name, ())
        if allowed is not None and (refused := sorted(set(opts.sampling) - set(allowed))):
            p.error(f"--sampling-option {', '.join(refused)}: not for {name} (the in-process "
                    f"minivllm engine takes any SamplingParams field; minivllm-server, vllm, "
                    f"llama-server and openai {', '.join(HTTP_SAMPLING_FIELDS)})")
    return opts, a.out or default_results_path(a.device)


def default_results_path(device: str = "auto") -> Path:
    from minivllm.config import resolve_device

    name = device_name(str(resolve_device(device))).split(" (")[0]
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return Path("bench/results") / f"{datetime.now():%Y-%m-%d}-{slug}.jsonl"


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run the benchmark, print the machine, the table and the ramp."""
    opts, out = parse_args(argv)
    records = run_benchmark(opts, out)
    labels = [engine_label(r) for r in records]
    baseline = opts.baseline or ("transformers" if "transformers" in labels or not labels
                                 else labels[0])
    if records:
        print(machine_line(records[0]["env"]))
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
