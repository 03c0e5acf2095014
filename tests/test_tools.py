"""The roofline tool's arithmetic (tools/roofline.py), on the real Qwen2.5-0.5B shape."""

from __future__ import annotations

from pathlib import Path

import pytest
from notebook_helpers import load_module

from minivllm.config import ModelConfig
from tests.checkpoints import QWEN25_05B

REPO = Path(__file__).resolve().parent.parent


def _roofline_module():
    return load_module(REPO / "tools" / "roofline.py", "roofline")


def test_workload_flops_charge_the_prompt_to_the_output_tokens():
    roofline = _roofline_module()
    mc = ModelConfig.from_dict({**QWEN25_05B, "model_type": "qwen2"})
    shapes = roofline.linear_shapes(mc)
    params = sum(o * i * n for _, o, i, n in shapes)
    assert params == pytest.approx(494e6, rel=0.01)  # Qwen2.5-0.5B's parameters, biases aside
    decode = 2.0 * params  # FLOPs per decode token, attention aside
    # a 1-token prompt and 1 output token: one pass through everything, no attention to speak of
    assert roofline.workload_flops_per_output_token(mc, 1, 1) == pytest.approx(decode, rel=1e-3)
    # 32 + 64: 95 tokens through the layers, 64 through the lm_head, per 64 outputs
    lm_head = 2.0 * mc.vocab_size * mc.hidden_size
    expected = (95 * (decode - lm_head) + 64 * lm_head) / 64
    got = roofline.workload_flops_per_output_token(mc, 32, 64)
    assert got == pytest.approx(expected, rel=0.02) and got > expected  # + attention, small
