"""The matmul roofline next to each benchmark result (minivllm/bench/roofline.py, notebook 05).

The FLOP counts are checked by hand on the real Qwen2.5-0.5B shape, the roofline arithmetic
against known rates, the streamed weights against the model's layer order and a memory
bound, and the measured rate on the bundled tiny model.
"""

from __future__ import annotations

import math

import pytest
import torch

from minivllm.bench.roofline import (
    RooflineProbe,
    _streamed_weights,
    linear_shapes,
    matmul_rate,
    request_flops,
    workload_roofline,
)
from minivllm.config import ModelConfig
from tests.checkpoints import QWEN25_05B

QWEN = ModelConfig.from_dict({**QWEN25_05B, "model_type": "qwen2"})
LM_HEAD = 2.0 * QWEN.vocab_size * QWEN.hidden_size
PER_KEY = 4.0 * QWEN.num_attention_heads * QWEN.head_dim * QWEN.num_hidden_layers


def _layer_flops(mc: ModelConfig) -> float:
    return sum(2.0 * o * i * n for name, o, i, n in linear_shapes(mc) if name != "lm_head")


def test_linear_shapes_are_qwen25_05b_parameters():
    params = sum(o * i * n for _, o, i, n in linear_shapes(QWEN))
    assert params == pytest.approx(494e6, rel=0.01)  # Qwen2.5-0.5B's parameters, biases aside


def test_request_flops_by_hand():
    layers = _layer_flops(QWEN)
    # a 1-token prompt and 1 output token: the prompt's pass and one lm_head, attending to 1 key
    assert request_flops(QWEN, 1, 1) == (layers + LM_HEAD + PER_KEY, 0.0)
    # 32 + 64: 32 prompt tokens (keys 1..32), then 63 tokens (keys 33..95) each with an lm_head
    prefill, decode = request_flops(QWEN, 32, 64)
    assert prefill == pytest.approx(32 * layers + LM_HEAD + 528 * PER_KEY)
    assert decode == pytest.approx(63 * (layers + LM_HEAD) + (4560 - 528) * PER_KEY)
    # 95 tokens through the layers, 64 through the lm_head, per 64 outputs, attention small
    per_output = (prefill + decode) / 64
    assert per_output == pytest.approx((95 * layers + 64 * LM_HEAD) / 64, rel=0.02)


def test_workload_roofline_charges_each_phase_at_its_rate():
    requests = [(32, 64), (10, 5)]
    flops = [request_flops(QWEN, p, o) for p, o in requests]
    total = sum(a + b for a, b in flops)
    # one rate for both phases: output tokens over total FLOPs at that rate
    assert workload_roofline(requests, 50e9, 50e9, QWEN) == pytest.approx(69 * 50e9 / total)
    # a faster prefill only shortens the prefill part
    seconds = sum(a for a, _ in flops) / 200e9 + sum(b for _, b in flops) / 50e9
    assert workload_roofline(requests, 200e9, 50e9, QWEN) == pytest.approx(69 / seconds)


def test_streamed_weights_follow_the_model_and_stay_bounded(monkeypatch):
    mc = ModelConfig.from_dict({**QWEN25_05B, "model_type": "qwen2", "num_hidden_layers": 3,
                                "vocab_size": 1000})
    flat, order = _streamed_weights(mc, torch.float32, torch.device("cpu"))
    shapes = linear_shapes(mc)
    expected = [(o, i) for _ in range(3) for _, o, i, _ in shapes[:7]] + [shapes[7][1:3]]
    assert [tuple(w.shape) for w in order] == expected  # model order, lm_head last
    assert len({w.data_ptr() for w in order[0:21:7]}) == 3  # each layer its own q_proj
    assert all(bool(torch.all(w == 0.01)) for w in order)  # no uninitialised memory
    # a cap of two gate_proj copies: layers cycle through them and the buffer stays small
    gate_bytes = QWEN25_05B["intermediate_size"] * QWEN25_05B["hidden_size"] * 4
    monkeypatch.setattr("minivllm.bench.roofline.STREAM_BYTES", 2 * gate_bytes)
    flat, order = _streamed_weights(mc, torch.float32, torch.device("cpu"))
    gates = [w.data_ptr() for w in order[4:21:7]]
    assert gates[0] == gates[2] != gates[1]
    assert flat.numel() * 4 <= 8 * 2 * gate_bytes + 1000 * mc.hidden_size * 4
    # a pass over fewer layers than the model's (prefill shapes) has no lm_head
    _, order = _streamed_weights(mc, torch.float32, torch.device("cpu"), layers=1)
    assert [tuple(w.shape) for w in order] == expected[:7]


def test_matmul_rate_on_the_tiny_model(tiny_model, monkeypatch):
    mc = ModelConfig.from_pretrained(tiny_model)
    one, many = matmul_rate(mc, 1), matmul_rate(mc, 16)
    assert math.isfinite(one) and math.isfinite(many) and 0 < one < many < 1e13
    # more rows per weight byte: a 16-row matmul does 16x the work for the same weights
    monkeypatch.setattr("minivllm.bench.roofline.PASS_FLOPS", 1.0)  # one layer per pass
    assert 0 < matmul_rate(mc, 64) < 1e13


def test_probe_record_gives_the_fraction_against_both_rates(tiny_model):
    probe = RooflineProbe(ModelConfig.from_pretrained(tiny_model), torch.float32, "cpu")
    requests = [(8, 4), (12, 6)]
    assert probe.rows(requests, 2) == {"decode": 2, "prefill": 20}  # both prompts in one step
    # at most one step's tokens: the engine's default step on that device (512 on a CPU)
    assert probe.rows(requests * 200, 400)["prefill"] == 512
    cuda = RooflineProbe(ModelConfig.from_pretrained(tiny_model), torch.float32, "cuda")
    assert cuda.rows(requests * 200, 400)["prefill"] == 2048
    before, after = {"prefill": 20.0, "decode": 5.0}, {"prefill": 10.0, "decode": 4.0}
    entry = probe.record(requests, {"decode": 2, "prefill": 10}, before, after, 100.0)
    slow = workload_roofline(requests, 10e9, 4e9, probe.mc)
    fast = workload_roofline(requests, 20e9, 5e9, probe.mc)
    assert entry["tokens_per_s"] == [round(slow, 2), round(fast, 2)]
    assert entry["fraction"] == [round(100 / fast, 4), round(100 / slow, 4)]
    assert entry["gflops_before"] == before and entry["gflops_after"] == after
    assert "fraction" not in probe.record(requests, {"decode": 2, "prefill": 10}, before,
                                          after, None)


def test_table_quotes_the_roofline_and_remote_servers_get_none(tiny_model, capsys):
    from minivllm.bench.engines import BenchOptions
    from minivllm.bench.harness import roofline_probe
    from minivllm.bench.metrics import format_table, roofline_fraction

    record = {"engine": "minivllm", "variant": "", "workload": "fixed", "concurrency": 32,
              "label": "x", "output_throughput": 49.3, "completed": 64, "failures": 0,
              "roofline": {"rows": {"decode": 32, "prefill": 32},
                           "gflops_before": {"decode": 75.3, "prefill": 75.3},
                           "gflops_after": {"decode": 84.8, "prefill": 84.8},
                           "gflop_per_output_token": 1.34, "tokens_per_s": [56.1, 63.3],
                           "fraction": [0.7788, 0.8788]}}
    assert ("minivllm fixed c=32: 83% (78-88) of the workload roofline (56.1-63.3 tok/s; matmul "
            "GFLOP/s before->after: prefill 75.3->84.8, decode 75.3->84.8; 1.340 GFLOP per "
            "output token)") in format_table([record])
    # three repeats: the median of the runs' fractions against their mean roofline, every end
    runs = [record | {"repeat": i, "roofline": record["roofline"] | {"fraction": f}}
            for i, f in enumerate([[0.5, 0.5], [0.9, 1.1], [0.7, 0.8]])]
    assert roofline_fraction(runs, "minivllm", "fixed", 32) == pytest.approx(
        (2 / (1 / 0.7 + 1 / 0.8), 0.5, 1.1))
    assert "75% (50-110) of the workload roofline" in format_table(runs)
    assert roofline_fraction(runs, "minivllm", "mixed", 32) is None
    opts = BenchOptions(model=str(tiny_model), engines=["openai"], workloads=["fixed"],
                        concurrency=[1], roofline=True)
    assert roofline_probe("openai", opts, "cpu") is None
    assert "another machine" in capsys.readouterr().out
    assert isinstance(roofline_probe("minivllm", opts, "cpu"), RooflineProbe)
    assert roofline_probe("minivllm", BenchOptions(model=str(tiny_model), engines=["minivllm"],
                                                   workloads=["fixed"], concurrency=[1]),
                          "cpu") is None  # off unless asked for
