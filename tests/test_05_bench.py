"""Milestone 5: the benchmark harness (minivllm/bench/, notebook 05_benchmark).

The metrics must be right on streams whose timings are known exactly (hand-computed
below), the workloads must be identical for every engine and every call, and a short real
run must produce a well-formed record for every engine that can run here.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
from notebook_helpers import load_module

from minivllm.bench.cli import main, parse_args
from minivllm.bench.engines import (
    BenchOptions,
    parse_engine_options,
    parse_engine_spec,
    split_engine_specs,
)
from minivllm.bench.env import cpu_features, machine_line
from minivllm.bench.harness import run_benchmark
from minivllm.bench.metrics import (
    BenchRequest,
    RequestResult,
    format_table,
    make_workload,
    median_runs,
    percentile,
    request_latency,
    summarize,
)
from minivllm.bench.servers import (
    minivllm_server_command,
    serve_flags,
    transformers_serve_command,
    transformers_serve_missing,
)

REPO = Path(__file__).resolve().parent.parent
METRIC_KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
               for s in ("mean", "median", "p99")]
RECORD_KEYS = ["schema", "time", "label", "engine", "variant", "repeat", "workload", "concurrency", "ramp",
               "num_requests", "completed", "failures", "duration_s", "total_input_tokens",
               "total_output_tokens", "request_throughput", "output_throughput",
               "total_token_throughput", *METRIC_KEYS, "peak_memory_bytes",
               "peak_memory_kind", "load", "errors", "env"]
ENV_KEYS = ["device", "device_name", "cpu", "dtype", "dtype_requested", "torch", "model",
            "model_shape", "git_commit", "cpu_count", "torch_threads"]


# --- metrics on a synthetic stream -----------------------------------------------------------


def test_percentile_interpolates_between_ranks():
    """Guards nearest-rank percentiles: vLLM (numpy) interpolates, and the p99 of a short
    run differs a lot between the two."""
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([4, 1, 3, 2], 99) == pytest.approx(3.97)
    assert percentile([15, 20, 35, 40, 50], 40) == pytest.approx(29.0)
    assert percentile([7], 99) == 7
    with pytest.raises(ValueError):
        percentile([], 50)


def test_request_latency_from_known_timestamps():
    """Guards TTFT measured from the first token (always 0) or from admission instead of
    from when the request was sent, and TPOT divided by all tokens instead of n - 1."""
    lat = request_latency(RequestResult(8, start=10.0, chunk_times=[10.5, 10.6, 10.8, 11.1],
                                        end=11.1, output_tokens=4))
    assert lat.ttft == pytest.approx(0.5)
    assert lat.itls == pytest.approx([0.1, 0.2, 0.3])
    assert lat.tpot == pytest.approx(0.2)
    assert lat.e2el == pytest.approx(1.1)
    one = request_latency(RequestResult(8, start=0.0, chunk_times=[0.3], end=0.35,
                                        output_tokens=1))
    assert (one.tpot, one.itls) == (None, [])


def test_summarize_known_run():
    """Two requests and one failure over 2 s, every number computed by hand; the failure
    is counted and left out of every average."""
    results = [
        RequestResult(10, 0.0, [0.5, 0.6, 0.8, 1.1], 1.1, 4),  # ttft .5 tpot .2 e2el 1.1
        RequestResult(20, 0.5, [1.5, 1.6, 2.0], 2.0, 3),  # ttft 1.0 tpot .25 e2el 1.5
        RequestResult(30, 0.0, error="HTTP 500"),
    ]
    m = summarize(results, duration=2.0)
    assert (m["completed"], m["failures"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 7)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(18.5)
    assert m["mean_ttft_ms"] == pytest.approx(750)
    assert m["median_ttft_ms"] == pytest.approx(750)
    assert m["p99_ttft_ms"] == pytest.approx(995)  # 500 + 0.99 * 500
    assert m["mean_tpot_ms"] == pytest.approx(225)
    assert m["mean_e2el_ms"] == pytest.approx(1300)
    itls = [100, 200, 300, 100, 400]  # pooled over both requests
    assert m["mean_itl_ms"] == pytest.approx(sum(itls) / 5)
    assert m["median_itl_ms"] == pytest.approx(200)
    assert m["p99_itl_ms"] == pytest.approx(396)  # rank 3.96 of [100,100,200,300,400]
    empty = summarize([RequestResult(1, error="x")], duration=1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None


def test_table_flags_busy_machine_and_quotes_ratios():
    base = {"workload": "fixed", "concurrency": 8, "completed": 1, "failures": 0}
    records = [{**base, "engine": "transformers", "output_throughput": 100.0,
                "load": {"busy": False, "other_cpu_percent": 1.0}},
               {**base, "engine": "minivllm", "output_throughput": 250.0,
                "peak_memory_bytes": 2**30, "load": {"busy": True, "other_cpu_percent": 40.0}}]
    table = format_table(records)
    assert "minivllm / transformers output throughput, fixed c=8: 2.50x" in table
    assert "not valid" in table and "1024" in table


def test_repeats_report_the_median_run_and_paired_ratios():
    """With --repeat, one noisy run must not decide a result: the table shows each level's
    median run and the ratio pairs the runs that ran back to back (same repeat)."""
    def rec(engine, variant, repeat, thr):
        return {"engine": engine, "variant": variant, "repeat": repeat, "label": "x",
                "workload": "fixed", "concurrency": 1, "output_throughput": thr,
                "completed": 1, "failures": 0, "load": {"busy": False}}
    eager = [rec("minivllm", "compile=False", i, t) for i, t in enumerate([100.0, 50.0, 110.0])]
    compiled = [rec("minivllm", "", i, t) for i, t in enumerate([160.0, 70.0, 150.0])]
    (row_e, row_c) = median_runs(eager + compiled)
    assert (row_e["output_throughput"], row_e["repeats"]) == (100.0, 3)  # the median run
    assert row_c["output_throughput"] == 150.0
    assert row_e["output_throughput_runs"] == [100.0, 50.0, 110.0]
    table = format_table(eager + compiled, baseline="minivllm[compile=False]")
    # per-repeat ratios 1.6, 1.4, 1.364 -> median 1.40, not 150/100
    assert ("minivllm / minivllm[compile=False] output throughput, fixed c=1: 1.40x "
            "(median of 3 paired runs, 1.36-1.60x)") in table
    assert "minivllm[compile=False]" in table.splitlines()[1]
    # runs of another label are a different row, never pooled with these
    other = [{**r, "label": "y", "output_throughput": 1.0} for r in eager]
    assert len(median_runs(eager + other)) == 2


def test_engine_specs_carry_their_own_options():
    assert split_engine_specs("minivllm[compile=False,attention_backend=loop], transformers") \
        == ["minivllm[compile=False,attention_backend=loop]", "transformers"]
    assert parse_engine_spec("minivllm[compile=False,attention_backend=loop]") == (
        "minivllm", "compile=False,attention_backend=loop",
        {"compile": False, "attention_backend": "loop"})
    assert parse_engine_spec("transformers") == ("transformers", "", {})
    for bad in ("nope", "minivllm[no_such_field=1]", "minivllm[compile]"):
        with pytest.raises(SystemExit):
            parse_engine_spec(bad)
    opts, _ = parse_args(["--engines", "minivllm[compile=False],minivllm", "--repeat", "3",
                          "--baseline", "minivllm[compile=False]"])
    assert (opts.engines, opts.repeat, opts.baseline) == (
        ["minivllm[compile=False]", "minivllm"], 3, "minivllm[compile=False]")
    with pytest.raises(SystemExit):
        parse_args(["--repeat", "0"])


# --- workloads ---------------------------------------------------------------------------


def test_workloads_are_seeded_and_identical_across_calls():
    """Every engine must see the same requests: same arguments, same workload."""
    for kind in ("fixed", "mixed"):
        a = make_workload(kind, 20, 64, 32, seed=3, vocab_size=1000, salt=8)
        assert a == make_workload(kind, 20, 64, 32, seed=3, vocab_size=1000, salt=8)
        assert a != make_workload(kind, 20, 64, 32, seed=4, vocab_size=1000, salt=8)
        assert a != make_workload(kind, 20, 64, 32, seed=3, vocab_size=1000, salt=16)
        assert all(0 <= t < 1000 for r in a for t in r.prompt_token_ids)
    fixed = make_workload("fixed", 20, 64, 32)
    assert {len(r.prompt_token_ids) for r in fixed} == {64}
    assert {r.output_len for r in fixed} == {32}
    mixed = make_workload("mixed", 200, 64, 32, range_ratio=0.5)
    lens = [r.output_len for r in mixed]
    assert min(lens) >= 16 and max(lens) <= 48 and len(set(lens)) > 10
    assert all(32 <= len(r.prompt_token_ids) <= 96 for r in mixed)
    with pytest.raises(ValueError):
        make_workload("bursty", 1, 1, 1)


# --- options ----------------------------------------------------------------------------


def test_engine_options_parse_by_field_type_and_map_to_serve_flags():
    opts = parse_engine_options(["attention_backend=loop", "max_num_seqs=128",
                                 "enable_prefix_caching=false", "max_model_len=None",
                                 "gpu_memory_utilization=0.5"])
    assert opts == {"attention_backend": "loop", "max_num_seqs": 128,
                    "enable_prefix_caching": False, "max_model_len": None,
                    "gpu_memory_utilization": 0.5}
    assert serve_flags(opts) == ["--attention-backend", "loop", "--max-num-seqs", "128",
                                 "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5"]
    # compile's default is on: the server must be told explicitly either way
    assert serve_flags({"compile": False}) == ["--no-compile"]
    assert serve_flags({"compile": True}) == ["--compile"]
    assert serve_flags({"single_row_matvec": False}) == ["--no-single-row-matvec"]

    with pytest.raises(SystemExit):
        parse_engine_options(["no_such_field=1"])
    parsed, out = parse_args(["--concurrency", "1,8,32", "--ramp", "--ramp-cap", "128"])
    assert parsed.engine_options["max_num_seqs"] == 128  # the engine must admit the ramp
    assert out.parent == Path("bench/results") and out.suffix == ".jsonl"
    assert parse_args(["--concurrency", "1,8,32"])[0].engine_options == {}  # 64 admits 32


def test_every_boolean_engine_option_reaches_the_server_both_ways():
    """Guards: a default-on option (single_row_matvec) turned off by the bench becoming no
    flag at all, so the server ran its default and the record said otherwise."""
    import dataclasses

    from minivllm.config import EngineConfig
    from minivllm.server.cli import engine_config
    from minivllm.server.cli import parse_args as serve_args

    booleans = [f.name for f in dataclasses.fields(EngineConfig) if f.type.startswith("bool")]
    assert {"enable_prefix_caching", "compile", "single_row_matvec"} <= set(booleans)
    for name in booleans:
        for value in (True, False):
            config = engine_config(serve_args(["--port", "8000", *serve_flags({name: value})]))
            assert getattr(config, name) is value, (name, value)


def test_cli_defaults_are_engine_config_defaults():
    """Guards defaults that live in two places and drift (issue 15: the server defaulted to
    the loop backend while EngineConfig said batched): every bench flag that mirrors an
    EngineConfig field takes that field's default."""
    import dataclasses

    from minivllm.bench.cli import build_parser
    from minivllm.config import EngineConfig

    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    mirrored = {a.dest: a.default for a in build_parser()._actions
                if a.dest in fields and a.dest != "seed"}  # --seed seeds the workload
    assert set(mirrored) >= {"model", "dtype", "device"}
    assert mirrored == {k: fields[k] for k in mirrored}
    opts, _ = parse_args([])
    assert (opts.model, opts.dtype, opts.device) == tuple(fields[k] for k in
                                                          ("model", "dtype", "device"))
    assert BenchOptions("m", [], [], []).dtype == fields["dtype"]  # the notebook's defaults


def test_minivllm_server_is_started_as_a_user_starts_it():
    """Guards a benchmark of flags no user passes: with the bench's defaults the server gets
    ``--model`` and ``--port`` only; explicit choices of the run, and only those, follow."""
    opts, _ = parse_args(["--engines", "minivllm-server", "--model", "/m"])
    cmd = minivllm_server_command(opts.model, 8123, opts.dtype, opts.device,
                                  opts.engine_options)
    assert cmd == [sys.executable, "-m", "minivllm.serve", "--model", "/m", "--port", "8123"]
    opts, _ = parse_args(["--engines", "minivllm-server[attention_backend=loop]", "--model",
                          "/m", "--dtype", "bfloat16", "--engine-option", "compile=false"])
    _, _, own = parse_engine_spec(opts.engines[0])
    cmd = minivllm_server_command(opts.model, 8123, opts.dtype, opts.device,
                                  {**opts.engine_options, **own})
    assert cmd[3:] == ["--model", "/m", "--port", "8123", "--dtype", "bfloat16",
                       "--no-compile", "--attention-backend", "loop"]


def test_transformers_serve_command_sizes_its_kv_cache(tiny_model):
    """Guards ``transformers serve`` left to take ~60% of free RAM for its KV cache: on a CPU
    it gets the same budget in bytes as our engine, in pages of its own default size."""
    import torch

    from minivllm.bench.servers import TRANSFORMERS_PAGE_SIZE, kv_blocks_for_budget
    from minivllm.config import ModelConfig

    mc = ModelConfig.from_pretrained(tiny_model)
    per_page = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4 * 256
    assert kv_blocks_for_budget(mc, torch.float32, 2 * 2**30, 256) == 2 * 2**30 // per_page
    cmd = transformers_serve_command("/m", 8123, "float32", "cpu", 42)
    assert cmd[cmd.index("serve"):] == [
        "serve", "/m", "--continuous-batching", "--host", "127.0.0.1", "--port", "8123",
        "--dtype", "float32", "--device", "cpu", "--cb-block-size",
        str(TRANSFORMERS_PAGE_SIZE), "--cb-num-blocks", "42"]


@pytest.mark.parametrize("options", [{}, {"kv_cache_memory_bytes": 2**24},
                                     {"num_blocks": 512, "block_size": 8}])
def test_transformers_serve_gets_the_kv_token_slots_of_our_pool(tiny_model, options):
    """Guards a comparison of unequal caches: transformers serve's pages hold as many tokens
    as the pool our engine builds for the same options (to one page)."""
    import torch

    from minivllm.bench.servers import TRANSFORMERS_PAGE_SIZE, transformers_serve_kv
    from minivllm.config import EngineConfig, ModelConfig
    from minivllm.engine import LLMEngine

    config = EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", compile=False,
                          **options)
    engine = LLMEngine(config)
    pages, step_tokens = transformers_serve_kv(ModelConfig.from_pretrained(tiny_model),
                                               torch.float32, config)
    ours = engine.num_blocks * config.block_size
    assert ours - TRANSFORMERS_PAGE_SIZE < pages * TRANSFORMERS_PAGE_SIZE <= ours
    assert step_tokens == config.max_num_batched_tokens


# --- the machine -------------------------------------------------------------------------------

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC 9R45 (Zen 5)
stepping\t: 1
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 avx512_vnni avx512vl

processor\t: 1
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC 9R45 (Zen 5)
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 avx512_vnni avx512vl
"""


def test_cpu_features_name_the_cpu_and_its_bf16():
    """Guards a record that cannot say why bf16 was fast or slow: the CPU's name and the ISA
    flags that decide it travel with every result."""
    cpu = cpu_features(CPUINFO)
    assert cpu == {"model_name": "AMD EPYC 9R45 (Zen 5)",
                   "generation": "family 26 model 2 stepping 1",
                   "flags": ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"],
                   "native_bf16": True}
    avx2 = cpu_features("model name : Some CPU\nflags : sse2 avx2 fma\n")
    assert avx2["flags"] == ["avx2", "fma"] and not avx2["native_bf16"]
    assert avx2["generation"] is None  # no family/model lines
    lscpu = cpu_features("Model name:  AMD EPYC\nCPU family:  25\nModel:  17\nThread(s) per "
                         "core:  1\nStepping:  1\nFlags:  sse2 avx2 avx512_bf16\n")
    assert lscpu["generation"] == "family 25 model 17 stepping 1"  # lscpu's words: a Zen 4
    assert lscpu["model_name"] == "AMD EPYC" and lscpu["native_bf16"]
    arm = cpu_features("processor : 0\nFeatures : fp asimd sve bf16\nCPU part : 0xd40\n\n"
                       "processor : 1\nFeatures : fp\n")
    assert arm["flags"] == ["asimd", "sve", "bf16"] and arm["generation"] is None  # the first CPU's
    zen5 = cpu_features("model name : AMD EPYC\nflags : avx2 avx512_vnni avx_vnni avx512_bf16\n")
    assert zen5["flags"] == ["avx2", "avx512_vnni", "avx_vnni", "avx512_bf16"]  # not a Zen 4
    line = machine_line({"cpu": cpu, "cpu_count": 2, "torch_threads": 2, "device": "cpu"})
    assert line == ("CPU: AMD EPYC 9R45 (Zen 5) (2 CPUs, family 26 model 2 stepping 1, "
                    "2 torch threads); bf16 native (avx512_bf16)")
    assert "bf16 not native (avx2, fma)" in machine_line({"cpu": avx2})
    capped = {"cpu": cpu, "isa_caps": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}
    assert machine_line(capped).endswith("bf16 native (avx512_bf16); capped: ONEDNN_MAX_CPU_ISA=AVX2")
    here = cpu_features()  # this machine: whatever it is, a name and a verdict
    assert here["model_name"] and isinstance(here["native_bf16"], bool)


# --- the HTTP client -----------------------------------------------------------------------------


def _sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + \
        b"data: [DONE]\n\n"


@pytest.mark.parametrize("closing", ["usage_with_empty_choice", "usage_alone"])
def test_stream_client_counts_tokens_not_the_closing_usage_event(closing):
    """Guards counting ``transformers serve``'s closing event (an empty-text choice carrying
    the usage) as a token arrival, and losing its usage because the event has choices."""
    import asyncio

    import httpx

    from minivllm.bench.clients import stream_completion

    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    last = ({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
            if closing == "usage_with_empty_choice" else {"choices": [], "usage": usage})
    body = _sse(*({"choices": [{"index": 0, "text": t}]} for t in ("a", "", "c")), last)
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, content=body)

    result = RequestResult(prompt_len=5)

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await stream_completion(client, "http://x/v1/completions", {"prompt": "hi"},
                                    result, iter(range(100)).__next__)

    asyncio.run(go())
    assert sent == [{"prompt": "hi"}]
    assert len(result.chunk_times) == 3  # "a", an empty-text token (a partial character), "c"
    assert (result.output_tokens, result.prompt_len, result.error) == (3, 7, None)


def test_text_payload_switches_eos_off_in_the_fields_transformers_serve_accepts():
    from minivllm.bench.clients import completion_payload, text_completion_payload

    body = text_completion_payload("/m", "some text", 5)
    assert "ignore_eos" not in body and body["prompt"] == "some text"
    assert json.loads(body["generation_config"]) == {"eos_token_id": -1}
    assert (body["max_tokens"], body["temperature"], body["stream"]) == (5, 0.0, True)
    assert completion_payload("/m", BenchRequest([1, 2], 5))["ignore_eos"] is True


# --- short real runs on the bundled model ------------------------------------------------------


def _options(model: Path, engines: list[str], **kw) -> BenchOptions:
    defaults = {"workloads": ["fixed", "mixed"], "concurrency": [2], "num_requests": 3,
                "input_len": 8, "output_len": 4, "isolate": False, "label": "test",
                "warmup": False, "engine_options": {"compile": False}}
    return BenchOptions(model=str(model), engines=engines, **(defaults | kw))


def _check_records(records: list[dict], engine: str, workloads: list[str]) -> None:
    mine = [r for r in records if r["engine"] == engine]
    assert [r["workload"] for r in mine] == workloads
    for r in mine:
        assert all(k in r for k in RECORD_KEYS), [k for k in RECORD_KEYS if k not in r]
        assert all(k in r["env"] for k in ENV_KEYS)
        assert (r["completed"], r["failures"], r["errors"]) == (3, 0, [])
        expected = sum(q.output_len for q in make_workload(
            r["workload"], 3, 8, 4, vocab_size=151643, salt=2))
        assert r["total_output_tokens"] == expected  # only each request's own tokens
        assert r["output_throughput"] > 0 and r["peak_memory_bytes"] > 0
        assert all(r[k] is not None and r[k] >= 0 for k in METRIC_KEYS)
        assert r["p99_ttft_ms"] >= r["median_ttft_ms"] > 0
        assert set(r["load"]) >= {"loadavg_start", "other_cpu_percent", "busy"}


def test_short_run_minivllm_and_transformers(tiny_model, tmp_path):
    out = tmp_path / "results.jsonl"
    opts = _options(tiny_model, ["minivllm", "transformers"], workloads=["mixed"],
                    engine_options={"block_size": 8, "compile": False})
    records = run_benchmark(opts, out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == json.loads(json.dumps(records))  # each record appended as one line
    _check_records(records, "minivllm", ["mixed"])
    _check_records(records, "transformers", ["mixed"])
    env = records[0]["env"]
    assert env["engine_options"]["block_size"] == 8  # --engine-option reached the engine
    assert env["attention_backend"] == env["engine_options"]["attention_backend"]
    assert env["model_shape"]["num_hidden_layers"] > 0 and records[0]["label"] == "test"


@pytest.mark.skipif(not (REPO / "minivllm" / "serve.py").is_file(),
                    reason="minivllm/serve.py (Milestone 4) is not there yet")
def test_short_run_minivllm_server(tiny_model, tmp_path):
    records = run_benchmark(_options(tiny_model, ["minivllm-server"], workloads=["mixed"]),
                            tmp_path / "r.jsonl")
    _check_records(records, "minivllm-server", ["mixed"])
    assert records[0]["peak_memory_kind"] == "rss"  # the server process's RSS
    # as a user starts it, plus the one option this run gave (compile off)
    assert records[0]["env"]["command"][1:] == ["-m", "minivllm.serve", "--model",
                                                str(tiny_model), "--port",
                                                records[0]["env"]["command"][6], "--no-compile"]
    # how long it took to answer /health, measured by the harness that started it
    assert 0 < records[0]["env"]["ready_after_s"] < 900


@pytest.mark.skipif(bool(transformers_serve_missing()),
                    reason=f"transformers serve needs {transformers_serve_missing()}")
def test_short_run_transformers_serve(tiny_model, tmp_path):
    """``transformers serve --continuous-batching`` started by the harness: every request
    completes with exactly the tokens asked for (EOS off), its RSS is the row's memory."""
    small_kv = {"compile": False, "kv_cache_memory_bytes": 2**26}  # its masks grow with it
    records = run_benchmark(_options(tiny_model, ["transformers-serve"], workloads=["mixed"],
                                     engine_options=small_kv), tmp_path / "r.jsonl")
    _check_records(records, "transformers-serve", ["mixed"])
    env = records[0]["env"]
    assert env["command"][env["command"].index("--dtype") + 1] == env["dtype"]
    assert env["kv_cache"]["num_blocks"] > 0
    assert records[0]["peak_memory_kind"] == "rss"


def test_transformers_serve_row_is_skipped_when_it_cannot_start(tiny_model, capsys,
                                                                  monkeypatch):
    """Without its extras (accelerate, fastapi, ...) the row is absent, and says why."""
    monkeypatch.setattr("minivllm.bench.engines.transformers_serve_missing",
                        lambda: ["accelerate"])
    assert run_benchmark(_options(tiny_model, ["transformers-serve"]), None) == []
    assert "skipping transformers-serve: `transformers serve` needs accelerate" in \
        capsys.readouterr().out


def test_peer_rows_are_skipped_not_faked(tiny_model, capsys, monkeypatch, tmp_path):
    """With no peer set up (a fresh clone: nothing under bench/peers/ but the scripts) the
    vllm and llama-server rows are absent, each with the command that sets it up."""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available():
        pytest.skip("vLLM and CUDA are present: the row would really run")
    monkeypatch.setenv("MINIVLLM_PEERS_DIR", str(tmp_path))
    assert run_benchmark(_options(tiny_model, ["vllm", "llama-server", "openai"]), None) == []
    out = capsys.readouterr().out
    assert "skipping vllm: not set up" in out and "bench/peers/setup_vllm.sh" in out
    assert "skipping llama-server: not set up" in out and "setup_llama_cpp.sh" in out
    assert "skipping openai: no --base-url" in out


def test_vllm_cpu_is_started_as_its_cpu_guide_says(tmp_path):
    """``vllm serve X`` with the run's dtype and seed; its KV space is our budget in GiB,
    its OpenMP threads get every core we have (not one less), tcmalloc when installed."""
    from minivllm.bench.peers import vllm_cpu_command, vllm_cpu_env

    cmd = vllm_cpu_command(tmp_path / "vllm", "ckpt", 8123, "bfloat16", 7, {"max_num_seqs": 64})
    assert cmd[1:3] == ["serve", "ckpt"] and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--seed") + 1] == "7" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "64" and "--max-model-len" not in cmd
    env = vllm_cpu_env(2 * 2**30, cpus=[0, 1])
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert vllm_cpu_env(2**29, cpus=[0, 2, 3])["VLLM_CPU_OMP_THREADS_BIND"] == "0,2,3"
    assert vllm_cpu_env(2**29, cpus=[3])["VLLM_CPU_KVCACHE_SPACE"] == "1"  # at least 1 GiB
    import ctypes.util

    if ctypes.util.find_library("tcmalloc_minimal"):
        assert "tcmalloc" in env["LD_PRELOAD"]


def test_llama_server_gets_a_slot_per_client_and_our_kv_tokens(tiny_model, tmp_path,
                                                                monkeypatch):
    """``llama-server`` with every core, a slot per client and a context of our pool's
    tokens; requests say ``cache_prompt: false`` and carry the prompt's token ids; each
    checkpoint (by path, not only by name) and dtype has its own GGUF file."""
    import torch

    from minivllm.bench.peers import gguf_path, llama_server_command, llama_server_payload
    from minivllm.bench.servers import kv_pool_tokens, transformers_serve_kv
    from minivllm.config import EngineConfig, ModelConfig

    cmd = llama_server_command(tmp_path / "llama-server", tmp_path / "m.gguf", 8124, 32,
                               174_752, 2)
    for flag, value in (("-t", "2"), ("--parallel", "32"), ("-c", "174752"), ("--port", "8124")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--cont-batching" in cmd
    body = llama_server_payload("m", BenchRequest([1, 2, 3], 5))
    assert body["cache_prompt"] is False and body["prompt"] == [1, 2, 3]
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True
    monkeypatch.setenv("MINIVLLM_PEERS_DIR", str(tmp_path))
    (tmp_path / "a" / "ckpt").mkdir(parents=True)
    (tmp_path / "b" / "ckpt").mkdir(parents=True)
    paths = {gguf_path(tmp_path / d / "ckpt", t) for d in "ab" for t in ("bfloat16", "float32")}
    assert len(paths) == 4 and all(p.parent == tmp_path / "llama.cpp" / "models" for p in paths)
    # the pool's tokens, which transformers-serve gets in pages of 256
    mc, config = ModelConfig.from_pretrained(tiny_model), EngineConfig(model=str(tiny_model))
    tokens = kv_pool_tokens(mc, torch.float32, config)
    assert tokens > 0 and tokens % config.block_size == 0
    assert transformers_serve_kv(mc, torch.float32, config)[0] == max(1, tokens // 256)


def test_an_avx2_capped_run_starts_llama_cpp_built_for_avx2(tiny_model, tmp_path, monkeypatch,
                                                             capsys):
    """``ONEDNN_MAX_CPU_ISA=AVX2`` (README's approximated AVX2-only machine) holds llama.cpp to
    AVX2 too: its own build, ``build-avx2``; missing, the row is skipped with the command that
    builds it, even where the native build exists."""
    from minivllm.bench.peers import llama_server_build, llama_server_executable

    monkeypatch.setenv("MINIVLLM_PEERS_DIR", str(tmp_path))
    native = tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"
    native.parent.mkdir(parents=True)
    native.touch()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert llama_server_build() == "build" and llama_server_executable() == native
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert llama_server_build() == "build-avx2" and llama_server_executable() is None
    assert run_benchmark(_options(tiny_model, ["llama-server"]), None) == []
    assert "setup_llama_cpp.sh avx2" in capsys.readouterr().out
    capped = tmp_path / "llama.cpp" / "build-avx2" / "bin" / "llama-server"
    capped.parent.mkdir(parents=True)
    capped.touch()
    assert llama_server_executable() == capped


def test_monitor_sums_a_server_process_tree_for_rss_tree():
    """vLLM serves from two processes (front end, engine core): ``rss_tree`` counts both."""
    from minivllm.bench.env import Monitor

    hold = ("import subprocess, sys, time\nb = bytearray(200 * 2**20)\n"
            "c = subprocess.Popen([sys.executable, '-c', "
            "'import time; b = bytearray(200 * 2**20); time.sleep(30)'])\ntime.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", hold])
    try:
        deadline = time.monotonic() + 20
        import psutil

        while time.monotonic() < deadline:  # until the child holds its memory too
            kids = psutil.Process(parent.pid).children()
            if kids and kids[0].memory_info().rss > 200 * 2**20:
                break
            time.sleep(0.1)
        with Monitor(parent.pid, memory_kind="rss") as one:
            time.sleep(0.5)
        with Monitor(parent.pid, memory_kind="rss_tree") as tree:
            time.sleep(0.5)
    finally:
        for kid in psutil.Process(parent.pid).children(recursive=True):
            kid.kill()
        parent.kill()
        parent.wait()
    assert one.peak_memory_bytes > 200 * 2**20
    assert tree.peak_memory_bytes > one.peak_memory_bytes + 190 * 2**20


def test_cli_isolated_run_prints_table(tiny_model, tmp_path):
    """The command line, with the engine in its own process (the default)."""
    out = tmp_path / "cli.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "minivllm.bench", "--model", str(tiny_model), "--engines",
         "minivllm", "--workloads", "fixed", "--concurrency", "2", "--num-requests", "2",
         "--input-len", "8", "--output-len", "4", "--label", "cli", "--out", str(out),
         "--engine-option", "compile=false", "--roofline"],
        check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "out tok/s" in proc.stdout and f"appended 1 record(s) to {out}" in proc.stdout
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["label"] == "cli" and record["completed"] == 2
    assert record["peak_memory_bytes"] > 0 and not math.isnan(record["output_throughput"])
    # --roofline: the machine's matmul rate before and after, the result as a fraction of it
    roof = record["roofline"]
    assert roof["rows"] == {"decode": 2, "prefill": 16}  # both 8-token prompts in one step
    assert all(roof[k][p] > 0 for k in ("gflops_before", "gflops_after") for p in roof["rows"])
    low, high = roof["fraction"]
    assert 0 < low <= high and roof["tokens_per_s"][0] <= roof["tokens_per_s"][1]
    assert high == pytest.approx(record["output_throughput"] / roof["tokens_per_s"][0], rel=1e-3)
    assert "of the workload roofline" in proc.stdout


def test_main_without_runnable_engine_fails(capsys):
    assert main(["--engines", "openai", "--workloads", "fixed", "--concurrency", "1"]) == 1
    assert "no --base-url" in capsys.readouterr().out


def test_bench_request_is_a_plain_value():
    assert BenchRequest([1, 2], 3) == BenchRequest([1, 2], 3)


def test_variants_run_side_by_side_interleaved(tiny_model):
    """Two variants of one engine in one invocation, A B A B, each with its own options."""
    opts = _options(tiny_model, ["minivllm[attention_backend=loop]", "minivllm"],
                    workloads=["fixed"], repeat=2)
    records = run_benchmark(opts, None)
    assert [(r["variant"], r["repeat"]) for r in records] == [
        ("attention_backend=loop", 0), ("", 0), ("attention_backend=loop", 1), ("", 1)]
    assert [r["env"]["attention_backend"] for r in records] == ["loop", "batched"] * 2
    assert all(r["env"]["engine_options"]["compile"] is False for r in records)  # shared option


def test_each_interleaved_repeat_sends_fresh_prompts(tiny_model):
    """With --interleave --repeat N every engine stays up across the repeats: were a level's
    prompts the same each time, every repeat after the first would time prefix-cache hits
    (it did: TTFT fell from ~340 to ~95 ms on the 0.5B shape), not prefill."""
    assert make_workload("fixed", 4, 64, 8, repeat=0) == make_workload("fixed", 4, 64, 8)
    assert make_workload("fixed", 4, 64, 8, repeat=1) != make_workload("fixed", 4, 64, 8)
    opts = _options(tiny_model, ["minivllm"], workloads=["fixed"], interleave=True,
                    repeat=2, input_len=64)
    records = run_benchmark(opts, None)
    assert [r["repeat"] for r in records] == [0, 1]
    stats = [r["engine_stats"] for r in records]
    assert all(s["num_prefix_queried_tokens"] > 0 for s in stats)  # the cache was looked up
    assert [s["num_prefix_cached_tokens"] for s in stats] == [0, 0]


def test_ramp_runs_one_wave_per_level_until_the_cap(tiny_model):
    """The ramp: concurrency step, 2*step, ... up to the cap, one request per slot."""
    opts = _options(tiny_model, ["minivllm"], workloads=["fixed"], concurrency=[], ramp=True,
                    ramp_step=2, ramp_cap=4)
    records = run_benchmark(opts, None)
    assert [(r["ramp"], r["concurrency"], r["num_requests"]) for r in records] == [
        (True, 2, 2), (True, 4, 4)]
    assert all(r["failures"] == 0 for r in records)


def test_sampling_options_reach_the_in_process_engine(tiny_model):
    """--sampling-option (issue 19): extra SamplingParams fields for the minivllm engine, so
    the cost of penalties can be measured; refused for other engines and for bad values."""
    from minivllm.bench.clients import drive_closed_loop
    from minivllm.bench.metrics import BenchRequest
    from minivllm.engine import LLMEngine

    opts, _ = parse_args(["--engines", "minivllm", "--sampling-option", "repetition_penalty=1.3",
                          "--sampling-option", 'logit_bias={"13": -100}'])
    assert opts.sampling == {"repetition_penalty": 1.3, "logit_bias": {13: -100}}
    for bad in (["--sampling-option", "max_tokens=3"], ["--sampling-option", "top_p=7"],
                ["--engines", "transformers", "--sampling-option", "presence_penalty=1"],
                ["--engines", "transformers-serve", "--sampling-option", "temperature=1"],
                ["--engines", "vllm", "--sampling-option", "repetition_penalty=1.1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    engine = LLMEngine.from_options(str(tiny_model), num_blocks=16, max_model_len=64,
                                    compile=False)
    requests = [BenchRequest([13, 13, 13, 42], 6)]
    plain = drive_closed_loop(engine, requests, 1)
    assert plain[0].output_tokens == 6
    seen = []
    add = engine.add_request
    engine.add_request = lambda rid, prompt, params: (seen.append(params), add(rid, prompt, params))
    drive_closed_loop(engine, requests, 1, sampling=opts.sampling)
    assert seen[0].repetition_penalty == 1.3 and seen[0].logit_bias == {13: -100.0}
    assert seen[0].max_tokens == 6 and seen[0].ignore_eos and seen[0].temperature == 0.0
    sampled, _ = parse_args(["--engines", "minivllm", "--sampling-option", "temperature=1"])
    drive_closed_loop(engine, requests, 1, sampling=sampled.sampling)
    assert seen[1].temperature == 1.0 and seen[1].max_tokens == 6 and seen[1].ignore_eos


def test_sampling_options_reach_the_servers_bodies():
    """--sampling-option temperature=1 (the OpenAI default) for the servers: the fields go
    on top of each request body (the greedy 0 replaced, max_tokens and ignore_eos kept), and
    the plots leave sampled runs out of their greedy figures; llama-server's body switches
    its default filters off in a sampled run only."""
    import functools

    from minivllm.bench.clients import completion_payload
    from minivllm.bench.engines import with_sampling
    from minivllm.bench.metrics import BenchRequest
    from minivllm.bench.peers import llama_server_payload

    opts, _ = parse_args(["--engines", "minivllm-server,vllm,llama-server", "--sampling-option",
                          "temperature=1", "--sampling-option", "seed=5"])
    request = BenchRequest([1, 2, 3], 7)
    body = with_sampling(completion_payload, opts.sampling)("m", request)
    assert body["temperature"] == 1 and body["seed"] == 5
    assert body["max_tokens"] == 7 and body["ignore_eos"] and body["prompt"] == [1, 2, 3]
    assert with_sampling(completion_payload, {})("m", request)["temperature"] == 0.0
    sampled = functools.partial(llama_server_payload, sampled=True)
    llama = with_sampling(sampled, opts.sampling)("m", request)
    assert (llama["top_k"], llama["top_p"], llama["min_p"], llama["temperature"]) == (0, 1.0, 0.0, 1)
    assert "top_k" not in llama_server_payload("m", request)  # greedy: its defaults, as measured
    plotting = load_module(REPO / "bench" / "plotting.py", "plotting_sampled")
    greedy = {"env": {"device": "cpu"}, "ramp": False}
    assert not plotting.is_sampled(greedy)
    assert plotting.is_sampled({**greedy, "env": {"device": "cpu", "sampling": {"temperature": 1}}})


def test_the_environment_records_instruction_set_caps_and_ignores_its_own_results(
        monkeypatch, tmp_path):
    """Guards: an AVX2-capped run on an AMX machine recorded as an ordinary one; and every
    engine after the first of a run marked git_dirty because the run appended to the
    committed results file."""
    from minivllm.bench import env as bench_env

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    calls = []
    monkeypatch.setattr(bench_env, "_git", lambda *args: calls.append(args) or "")
    record = bench_env.environment("m", "cpu", "auto")
    assert record["isa_caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert record["aten_cpu_capability"]  # what ATen's kernels picked in this process
    status = next(args for args in calls if args[0] == "status")
    assert ":(exclude)bench/results" in status and record["git_dirty"] is False



# --- --interleave: every engine up at once, each level by every engine in turn ------------


def _fake_engines(monkeypatch, fail_ramp_at: dict[str, int]) -> list[tuple]:
    """Replace engine start-up by runners that log each call; ``fail_ramp_at[spec]`` is the
    ramp concurrency at which that engine's level reports a failure."""
    import contextlib

    from minivllm.bench import harness

    calls: list[tuple] = []

    @contextlib.contextmanager
    def fake_started(spec, opts, root_pid=None):
        def level(kind, c, n, salt, ramp, repeat=0, idle_pids=()):
            calls.append((spec, kind, c, ramp, repeat, idle_pids))
            failed = ramp and c >= fail_ramp_at.get(spec, 10**9)
            return {"engine": spec, "workload": kind, "concurrency": c, "ramp": ramp,
                    "repeat": repeat, "failures": int(failed)}
        yield harness.Runner(spec, {"a": 101, "b": 102, "c": None}[spec], level)

    monkeypatch.setattr(harness, "started_engine", fake_started)
    return calls


def test_interleave_runs_each_level_by_every_engine_in_alternating_order(monkeypatch):
    calls = _fake_engines(monkeypatch, {"a": 16})
    opts = BenchOptions(model="m", engines=["a", "b", "c"], workloads=["fixed", "mixed"],
                        concurrency=[1, 8], interleave=True, isolate=False, repeat=2,
                        ramp=True, ramp_step=8, ramp_cap=24)
    records = run_benchmark(opts, None)
    levels = [(s, k, c, rep) for s, k, c, ramp, rep, _ in calls if not ramp]
    forward, backward = ["a", "b", "c"], ["c", "b", "a"]
    expected = []
    for turn, (kind, c, rep) in enumerate((k, c, r) for k in ("fixed", "mixed")
                                          for c in (1, 8) for r in (0, 1)):
        expected += [(s, kind, c, rep) for s in (forward if turn % 2 == 0 else backward)]
    assert levels == expected  # A B C, C B A, ... and each level's repeats back to back
    # while one engine runs, the others (with a process of their own) are idle, and say so
    assert {idle for s, *_, idle in calls if s == "a"} == {(102,)}
    assert {idle for s, *_, idle in calls if s == "c"} == {(101, 102)}
    ramp = [(s, c) for s, _, c, r, *_ in calls if r]
    assert [c for s, c in ramp if s == "a"] == [8, 16]  # stops at its own first failure
    assert [c for s, c in ramp if s == "b"] == [8, 16, 24]  # the others go on to the cap
    assert len(records) == len(calls)  # every level's record was emitted


def test_monitor_counts_an_idle_engine_of_ours_as_other_load():
    """An engine of this benchmark that should be waiting but uses the CPU is the machine's
    other load (``idle_pids``), not the measured engine's."""
    from minivllm.bench.env import Monitor

    spin = "import time\nt = time.time()\nwhile time.time() - t < 30: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)
        with Monitor(None, idle_pids=(busy.pid,)) as idle:
            time.sleep(1.0)
        with Monitor(None) as ours:
            time.sleep(1.0)
    finally:
        busy.kill()
        busy.wait()
    # the spinning child takes one core (of psutil.cpu_count()): counted only when idle
    cores = os.cpu_count() or 1
    assert idle.other_cpu_percent > 50 / cores
    assert idle.other_cpu_percent > ours.other_cpu_percent + 25 / cores


def test_interleaved_short_run_with_an_isolated_engine(tiny_model, tmp_path):
    """A real run: the in-process engine in its own process answering level by level over a
    pipe, beside the server; both engines' records for each level, the order alternating."""
    opts = _options(tiny_model, ["minivllm", "minivllm-server"], isolate=True,
                    interleave=True)
    records = run_benchmark(opts, tmp_path / "r.jsonl")
    assert [(r["engine"], r["workload"]) for r in records] == [
        ("minivllm", "fixed"), ("minivllm-server", "fixed"),
        ("minivllm-server", "mixed"), ("minivllm", "mixed")]
    _check_records(records, "minivllm", ["fixed", "mixed"])
    assert all(r["interleaved"] for r in records)
    assert records[0]["peak_memory_kind"] == "rss" and records[0]["peak_memory_bytes"] > 0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's heap and malloc_trim")
def test_the_memory_probe_leaves_nothing_resident_where_the_heap_had_room_for_it():
    """Guards: the probe's buffer placed in a hole that earlier frees left in the heap (as
    an in-process engine's warm-up leaves) staying resident once freed, so that the process
    grows by the probe and an in-process engine's recorded peak with it (CI caught it late
    in the suite, where the heap had such a hole)."""
    import psutil
    import torch

    from minivllm.bench.env import memory_read_gbs
    from minivllm.config import release_freed_memory

    probe = 512 * 2**20
    torch.ones(24 * 2**20 // 4)  # a 24 MiB mapping, freed at once: raises glibc's mmap threshold
    chunks = [torch.ones(8 * 2**20 // 4) for _ in range(80)]  # 640 MiB, now inside the heap
    keep = torch.ones(8 * 2**20 // 4)  # above them: their space is a hole, not the heap's top
    del chunks
    release_freed_memory()  # the hole's pages handed back, as compile.py's engines do
    before = psutil.Process().memory_info().rss
    assert memory_read_gbs(probe, repeats=1) > 0
    assert psutil.Process().memory_info().rss < before + probe // 4
    del keep


def test_monitor_times_the_memory_read_outside_the_run():
    """Each level's record carries the machine's memory read rate just before and just after
    it, taken outside the run: the probe's buffer is never in the engine's peak memory."""
    import psutil

    from minivllm.bench.env import Monitor, memory_read_gbs

    assert memory_read_gbs(8 * 2**20, repeats=2) > 0
    probe = 512 * 2**20  # in this process, as for an in-process engine
    before = psutil.Process().memory_info().rss
    with Monitor(os.getpid(), memory_probe_bytes=probe) as mon:
        time.sleep(0.3)
    rates = mon.load()["memory_read_gbs"]
    assert len(rates) == 2 and all(r > 0 for r in rates)
    assert mon.peak_memory_bytes < before + probe // 2  # the buffer came and went outside
    with Monitor(None, memory_probe_bytes=0) as off:
        pass
    assert off.load()["memory_read_gbs"] == []


def test_table_shows_the_memory_read_rate_before_and_after():
    base = {"engine": "minivllm", "workload": "fixed", "completed": 1, "failures": 0,
            "output_throughput": 10.0}
    records = [{**base, "concurrency": 1, "load": {"memory_read_gbs": [47.2, 30.4]}},
               {**base, "concurrency": 8, "load": {}}]  # a record from before the probe
    header, one, eight = format_table(records).splitlines()[:3]
    assert "mem GB/s" in header
    assert one.split()[-2] == "47/30" and eight.split()[-2] == "-"
