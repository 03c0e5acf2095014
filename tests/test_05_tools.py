"""The benchmark's tools (notebook 05): tools/roofline.py, the stand-alone roofline report, on
the bundled tiny model; tools/weight_bandwidth.py; tools/startup_time.py; tools/cuda_session.sh;
and the experiments bench/experiments/omp_threads.py, ttft_timeline.py, sampler_ab.py and
schedule_sim.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from notebook_helpers import load_module

from minivllm.bench.roofline import request_flops
from minivllm.config import ModelConfig

REPO = Path(__file__).resolve().parent.parent


def test_roofline_report_on_the_tiny_model(tiny_model):
    tool = load_module(REPO / "tools" / "roofline.py", "roofline")
    report = tool.roofline(str(tiny_model), torch.float32, 4, repeats=3, input_len=8,
                           output_len=4)
    mc = ModelConfig.from_pretrained(tiny_model)
    assert report["sustained_gflops"] > 0 and report["prefill_gflops"] > 0
    per_token = report["gflop_per_token"] * 1e9
    assert report["roofline_tokens_per_s"] == pytest.approx(
        report["sustained_gflops"] * 1e9 / per_token, rel=0.01)
    workload = sum(request_flops(mc, 8, 4)) / 4
    assert report["workload_gflop_per_output_token"] == pytest.approx(workload / 1e9, rel=1e-3)
    assert set(report["hot_gflops_by_layer"]) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj", "lm_head"}


def test_weight_bandwidth_from_a_concurrency_1_record():
    tool = load_module(REPO / "tools" / "weight_bandwidth.py", "weight_bandwidth")
    record = {"concurrency": 1, "median_tpot_ms": 2.0,
              "env": {"dtype": "bfloat16", "device_name": "NVIDIA H200",
                      "model_shape": {"num_params": 494_000_000}}}
    found = tool.weight_bandwidth(record)
    # 0.988 GB read 500 times a second: 494 GB/s of the H200's 4800
    assert found == {"weight_gb": 0.988, "steps_per_s": 500.0, "achieved_gbs": 494.0,
                     "peak_gbs": 4800.0, "fraction_of_peak": round(494 / 4800, 4)}
    assert tool.peak_for("NVIDIA H100 NVL") == 3900.0  # the longest matching name wins
    assert tool.weight_bandwidth(record, peak_gbs=1000.0)["fraction_of_peak"] == 0.494
    assert tool.weight_bandwidth({**record, "concurrency": 8}) is None  # c=1 only
    unknown = {**record, "env": {**record["env"], "device_name": "Some GPU"}}
    assert tool.weight_bandwidth(unknown)["fraction_of_peak"] is None


def test_cuda_session_script_is_ready(tmp_path):
    """The prepared GPU run parses, names files that exist, and refuses to run without CUDA."""
    import subprocess
    import sys

    script = REPO / "tools" / "cuda_session.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    text = script.read_text()
    for path in ("tests/test_cuda.py", "tools/make_random_checkpoint.py",
                 "tools/weight_bandwidth.py"):
        assert path in text and (REPO / path).is_file()
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would really run")
    proc = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True,
                          env={"OUT": str(tmp_path),
                               "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                               "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 1 and "no CUDA device" in proc.stderr


def test_omp_threads_measures_both_sides(tiny_model):
    """Guards: the thread experiment behind AsyncEngine's build-in-thread rule rotting."""
    tool = load_module(REPO / "bench" / "experiments" / "omp_threads.py", "omp_threads")
    result = tool.main(["--model", str(tiny_model), "--no-compile", "--rounds", "1",
                        "--tokens", "4"])
    assert result["loading_thread_tok_s"] > 0 and result["other_thread_tok_s"] > 0
    assert result["other_over_loading"] == pytest.approx(
        result["other_thread_tok_s"] / result["loading_thread_tok_s"])


def test_startup_time_commands_for_ours_and_the_peers(tiny_model, tmp_path, monkeypatch):
    """Each engine starts with its compiler caches under the start's directory (fresh for a
    cold start); a peer that is not set up says which script sets it up."""
    tool = load_module(REPO / "tools" / "startup_time.py", "startup_time")
    monkeypatch.setenv("MINIVLLM_COMPILE", "0")  # the test suite's; a start is as shipped
    cmd, env = tool.server_command("minivllm", str(tiny_model), 8123, str(tmp_path), [])
    assert cmd[1:3] == ["-m", "minivllm.serve"] and cmd[cmd.index("--port") + 1] == "8123"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{tmp_path}/inductor"
    assert "MINIVLLM_COMPILE" not in env
    monkeypatch.setenv("MINIVLLM_PEERS_DIR", str(tmp_path / "peers"))
    for engine, script in (("vllm", "setup_vllm.sh"), ("llama-server", "setup_llama_cpp.sh")):
        with pytest.raises(SystemExit, match=script):
            tool.server_command(engine, str(tiny_model), 8123, str(tmp_path), [])
    exe = tmp_path / "peers" / "vllm" / ".venv" / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    exe.touch()
    cmd, env = tool.server_command("vllm", str(tiny_model), 8123, str(tmp_path), ["--x"])
    assert cmd[:2] == [str(exe), "serve"] and cmd[-1] == "--x"
    assert cmd[cmd.index("--dtype") + 1] == "float32"  # what our engine runs this model in
    assert env["VLLM_CACHE_ROOT"] == f"{tmp_path}/vllm" and env["VLLM_TARGET_DEVICE"] == "cpu"


@pytest.mark.skipif(not Path("/usr/bin/fincore").exists(), reason="needs util-linux fincore")
def test_startup_time_drops_a_file_from_the_page_cache(tmp_path):
    """``--drop-page-cache``: the file's pages leave the page cache (fincore counts them)."""
    import os
    import subprocess

    tool = load_module(REPO / "tools" / "startup_time.py", "startup_time")
    file = tmp_path / "weights.bin"
    file.write_bytes(os.urandom(8 * 2**20))
    with open(file, "rb+") as f:
        os.fsync(f.fileno())  # dirty pages cannot be dropped until written back
    file.read_bytes()

    def resident_pages() -> int:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "PAGES",
                              str(file)], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[0])

    if resident_pages() == 0:
        pytest.skip("this filesystem keeps no page cache for the file")
    tool.drop_from_page_cache([file])
    assert resident_pages() == 0


def test_profile_decode_step_profiles_a_prefill_step(tiny_model):
    """tools/profile_decode_step.py --phase prefill: times the step that prefills every
    prompt at once and lists its operators."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "profile_decode_step.py"), "--model",
         str(tiny_model), "--phase", "prefill", "--batch", "3", "--input-len", "12",
         "--rows", "5"], capture_output=True, text=True, timeout=300, check=True)
    assert "3 prompts x 12 tokens: prefill step" in proc.stdout
    assert "tokens/s at best" in proc.stdout and "Self CPU" in proc.stdout


def test_ttft_timeline_orders_requests_by_sending_time():
    """bench/experiments/ttft_timeline.py: one row per request, in order of sending, with
    times from the level's start; a failed request keeps its row and its error."""
    from minivllm.bench.metrics import BenchRequest, RequestResult

    tool = load_module(REPO / "bench" / "experiments" / "ttft_timeline.py", "ttft_timeline")
    requests = [BenchRequest([1, 2, 3], 2), BenchRequest([4], 2), BenchRequest([5, 6], 1)]
    results = [RequestResult(3, start=10.5, chunk_times=[11.0, 11.2], end=11.2, output_tokens=2),
               RequestResult(1, start=10.0, chunk_times=[10.25, 10.5], end=10.5, output_tokens=2),
               RequestResult(2, start=10.6, error="HTTP 400")]
    rows = tool.timeline(results, requests, t0=10.0)
    assert [r["index"] for r in rows] == [1, 0, 2]
    assert rows[0]["ttft_s"] == pytest.approx(0.25) and rows[0]["end_s"] == pytest.approx(0.5)
    assert rows[1]["first_token_s"] == pytest.approx(1.0) and rows[1]["prompt_len"] == 3
    assert rows[2]["error"] == "HTTP 400" and "ttft_s" not in rows[2]


def test_sampler_ab_arms_draw_the_same_distribution(tiny_model):
    """bench/experiments/sampler_ab.py: both arms (the exponential race, the package's inverse
    CDF) draw from p, a seeded row follows its generator in each, and the step level runs
    real compiled engine steps with each arm, leaving the package's sampler in place."""
    import minivllm.compile
    import minivllm.sampling

    tool = load_module(REPO / "bench" / "experiments" / "sampler_ab.py", "sampler_ab")
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    for name, draw in tool.DRAWS.items():
        torch.manual_seed(0)
        tokens = draw(p.repeat(8000, 1), [None] * 8000)
        freq = tokens.bincount(minlength=5) / 8000
        assert freq.tolist() == pytest.approx(p.tolist(), abs=0.02), name
        seeded = [torch.Generator().manual_seed(7), None]
        assert draw(p.repeat(2, 1), seeded)[0] == draw(p[None], [torch.Generator().manual_seed(7)])[0]
    draws = tool.time_draws(2, 1000, rounds=2)
    assert {name: len(t) for name, t in draws.items()} == {name: 2 for name in tool.DRAWS}
    steps = tool.time_steps(str(tiny_model), rows=2, rounds=2)
    assert {name: len(t) for name, t in steps.items()} == {"race": 2, "inverse CDF": 2,
                                                          "logits alone": 4}
    assert all(min(t) > 0 for t in steps.values())
    assert minivllm.compile.uniform_draws is minivllm.sampling.uniform_draws


def test_schedule_sim_times_steps_by_its_cost_model():
    """bench/experiments/schedule_sim.py drives the package's scheduler on the benchmark's
    requests; times worked by hand from cost = 30 + 9 per decode row + 4.6 per prompt token
    + 10 for a step with prompt tokens (ms). Fixed workload, prompts of 16 tokens, 4 output
    tokens."""
    tool = load_module(REPO / "bench" / "experiments" / "schedule_sim.py", "schedule_sim")
    kw = {"input_len": 16, "output_len": 4, "num_requests": 2, "cost": (30.0, 9.0, 4.6, 10.0)}
    # one client: prefill (30 + 4.6*16 + 10 = 113.6 ms, the first token), then three decode
    # steps of one row (39 ms each); the second request the same, sent when the first ends
    one = tool.simulate("fixed", 1, **kw)
    assert one["ttft_p50_s"] == pytest.approx(0.1136) and one["ttft_p99_s"] == pytest.approx(0.1136)
    assert one["tpot_p50_ms"] == pytest.approx(39.0) and one["steps"] == 8
    assert one["output_tok_s"] == pytest.approx(8 / (2 * (113.6 + 3 * 39.0)) * 1e3)
    # two clients, prompts always packed: both prompts in one step (30 + 4.6*32 + 10 = 187.2)
    packed = tool.simulate("fixed", 2, step_overhead_tokens=0, **kw)
    assert packed["ttft_mean_s"] == pytest.approx(0.1872) and packed["steps"] == 4
    assert packed["tpot_p50_ms"] == pytest.approx(30.0 + 2 * 9.0)
    # weighed (overhead 16 tokens): 1 * 16 <= (1 + 0) * (16 + 1), so the second joins too;
    # at overhead 8 (16 > 8 + 1) it waits: 113.6 ms, then 30 + 9 + 73.6 + 10 = 122.6 ms later
    assert tool.simulate("fixed", 2, step_overhead_tokens=16, **kw)["steps"] == 4
    apart = tool.simulate("fixed", 2, step_overhead_tokens=8, **kw)
    assert apart["ttft_p50_s"] == pytest.approx((0.1136 + 0.2362) / 2) and apart["steps"] == 5
    # the what-ifs: shortest-first changes nothing on equal prompts; arrivals counts the two
    # that arrived before the first step among those waiting: 16 <= (1 + 0 + 2) * (8 + 1)
    assert tool.simulate("fixed", 2, step_overhead_tokens=8, policy="shortest-first", **kw) == apart
    assert tool.simulate("fixed", 2, step_overhead_tokens=8, policy="arrivals", **kw) == packed


def test_schedule_sim_calibrates_its_cost_model(tiny_model):
    """--calibrate: least squares recovers the coefficients of exact samples, and the timed
    steps are what they claim (their rows and tokens read from the engine's counters)."""
    tool = load_module(REPO / "bench" / "experiments" / "schedule_sim.py", "schedule_sim")
    exact = [(rows, tokens, 30.0 + 9.0 * rows + 4.6 * tokens + (10.0 if tokens else 0.0))
             for rows, tokens in [(0, 16), (0, 128), (0, 512), (1, 0), (8, 0), (32, 0)]]
    assert tool.fit_cost(exact) == pytest.approx((30.0, 9.0, 4.6, 10.0))
    samples = tool.measure_steps(str(tiny_model), prompt_lens=(4, 12), decode_rows=(1, 3),
                                 context=8, repeats=2, compile=False)
    assert [(rows, tokens) for rows, tokens, _ in samples] == [(0, 4), (0, 12), (1, 0), (3, 0)] * 2
    assert all(ms > 0 for _, _, ms in samples)
