"""tools/roofline.py: the stand-alone roofline report, on the bundled tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from notebook_helpers import load_module

from minivllm.bench_roofline import request_flops
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
