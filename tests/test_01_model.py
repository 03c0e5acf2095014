"""M1: the model, layer by layer and end to end, against transformers (fp32, CPU, eager).

Each test's docstring names the bug it guards against.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config
from transformers.models.qwen2 import modeling_qwen2 as hf2
from transformers.models.qwen3 import modeling_qwen3 as hf3

from checkpoints import TINY_COMMON, randomize_
from minivllm.config import ModelConfig, read_eos_token_ids
from minivllm.model import (
    MLP,
    Attention,
    ContiguousKVCache,
    DecoderLayer,
    RMSNorm,
    apply_rope,
    causal_attention,
    greedy_generate,
    load_model,
    rope_cos_sin,
)
from minivllm.tokenizer import Tokenizer

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "The capital of France is",
    "for i in range(10):\n    print(",
]


def hf_config(model_type: str, **overrides):
    kwargs = {**TINY_COMMON, **overrides}
    if model_type == "qwen3":
        return Qwen3Config(head_dim=16, attention_bias=True, **kwargs)
    return Qwen2Config(**kwargs)


def ours_config(hf_cfg) -> ModelConfig:
    return ModelConfig.from_dict(hf_cfg.to_dict(), source="test config")


def causal_mask(t: int) -> torch.Tensor:
    """The additive (1, 1, T, T) mask transformers' eager attention expects."""
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
    return mask[None, None]


def hf_rope(hf_cfg, x: torch.Tensor, positions: torch.Tensor):
    return hf2.Qwen2RotaryEmbedding(hf_cfg)(x, positions[None])  # each (1, T, D)


def hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )
    return out[0, len(prompt_ids) :].tolist()


def load_hf(path):
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


# ---------------------------------------------------------------- layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype):
    """Guards: statistics computed in bf16, or the weight applied before casting back."""
    torch.manual_seed(0)
    ours, ref = RMSNorm(64, 1e-6).to(dtype), hf2.Qwen2RMSNorm(64, eps=1e-6)
    ref.weight.data = torch.randn(64).to(dtype)
    ours.load_state_dict(ref.state_dict())
    x = (torch.randn(5, 64) * 3).to(dtype)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)


def test_rope_cos_sin_matches_hf():
    """Guards: inv_freq over the wrong range, or cos/sin laid out (f0, f0, f1, f1, ...)."""
    cfg = hf_config("qwen2", rope_theta=1e6)
    positions = torch.tensor([0, 1, 7, 300, 5])  # non-contiguous: positions, not arange
    cos, sin = rope_cos_sin(positions, 8, 1e6)
    ref_cos, ref_sin = hf_rope(cfg, torch.zeros(1, 5, 64), positions)
    torch.testing.assert_close(cos, ref_cos[0])
    torch.testing.assert_close(sin, ref_sin[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_is_half_split(dtype):
    """Guards: interleaved RoPE (pairs 2i, 2i+1) instead of half-split (pairs i, i + D/2)."""
    cfg = hf_config("qwen2")
    torch.manual_seed(0)
    q = torch.randn(6, 8, 8).to(dtype)  # (T, H, D)
    positions = torch.arange(3, 9)
    cos, sin = rope_cos_sin(positions, 8, cfg.rope_parameters["rope_theta"])
    ref_cos, ref_sin = hf_rope(cfg, q, positions)  # HF casts cos/sin to x.dtype
    q_hf = q.transpose(0, 1)[None]  # (1, H, T, D)
    ref_q, _ = hf2.apply_rotary_pos_emb(q_hf, q_hf, ref_cos, ref_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q[0].transpose(0, 1), rtol=0, atol=0)


def naive_attention(q, k, v):
    """Per-head loops, explicit bottom-right causal mask: the textbook definition."""
    tq, n_heads, d = q.shape
    tk, n_kv, _ = k.shape
    out = torch.empty_like(q)
    for h in range(n_heads):
        kv = h // (n_heads // n_kv)
        scores = q[:, h] @ k[:, kv].T / d**0.5  # (Tq, Tk)
        for i in range(tq):
            scores[i, tk - tq + i + 1 :] = float("-inf")
        out[:, h] = scores.softmax(-1) @ v[:, kv]
    return out


@pytest.mark.parametrize("tq", [7, 3, 1])
def test_causal_attention_gqa_and_offset(tq):
    """Guards: tiled GQA heads instead of repeat_interleave, and SDPA is_causal top-left
    alignment with cached keys (Tq < Tk): query i must see keys 0 .. i + Tk - Tq."""
    torch.manual_seed(0)
    q, k, v = torch.randn(tq, 8, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    torch.testing.assert_close(causal_attention(q, k, v), naive_attention(q, k, v))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_attention_layer_matches_hf(model_type):
    """Guards: missing q/k/v bias (Qwen2), q/k-norm missing or applied after RoPE (Qwen3),
    a bias on o_proj, and head_dim assumed to be hidden_size // heads (Qwen3)."""
    cfg = hf_config(model_type)
    cfg._attn_implementation = "eager"
    ref_cls = hf3.Qwen3Attention if model_type == "qwen3" else hf2.Qwen2Attention
    ref = ref_cls(cfg, layer_idx=0).eval()
    randomize_(ref, seed=0, std=0.2)
    ours = Attention(ours_config(cfg), layer_idx=0)
    ours.load_state_dict(ref.state_dict())  # strict: the parameter names match HF's
    x, positions = torch.randn(9, 64), torch.arange(9)
    cos, sin = hf_rope(cfg, x[None], positions)
    with torch.no_grad():
        want, _ = ref(x[None], (cos, sin), attention_mask=causal_mask(9))
        got = ours(x, cos[0], sin[0], lambda i, q, k, v: causal_attention(q, k, v))
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


def test_mlp_matches_hf():
    """Guards: silu on the up projection instead of the gate, or gate/up swapped."""
    cfg = hf_config("qwen2")
    ref = hf2.Qwen2MLP(cfg)
    randomize_(ref, seed=0, std=0.2)
    ours = MLP(ours_config(cfg))
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_decoder_layer_matches_hf(model_type):
    """Guards: post-norm instead of pre-norm, or a residual added to the normed input."""
    cfg = hf_config(model_type)
    cfg._attn_implementation = "eager"
    ref_cls = hf3.Qwen3DecoderLayer if model_type == "qwen3" else hf2.Qwen2DecoderLayer
    ref = ref_cls(cfg, layer_idx=0).eval()
    randomize_(ref, seed=1, std=0.2)
    ours = DecoderLayer(ours_config(cfg), layer_idx=0)
    ours.load_state_dict(ref.state_dict())
    x, positions = torch.randn(6, 64), torch.arange(6)
    cos, sin = hf_rope(cfg, x[None], positions)
    with torch.no_grad():
        want = ref(x[None], attention_mask=causal_mask(6), position_embeddings=(cos, sin))
        got = ours(x, cos[0], sin[0], lambda i, q, k, v: causal_attention(q, k, v))
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- whole model, tiny random


@pytest.fixture(params=["qwen2", "qwen3"])
def tiny_pair(request):
    path = request.getfixturevalue(f"tiny_random_{request.param}")
    return load_model(path), load_hf(path)


def test_state_dict_keys_match_checkpoint(tiny_pair):
    """Guards: renamed parameters (the checkpoint would need a translation table)."""
    ours, ref = tiny_pair
    assert set(ours.state_dict()) == set(ref.state_dict())


def test_logits_match_hf(tiny_pair):
    """Guards: any numerics drift in the full forward (prefill of 20 tokens)."""
    ours, ref = tiny_pair
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
        hidden = ours(
            ids, torch.arange(20), ContiguousKVCache(ours.config, 20, torch.float32, "cpu")
        )
    torch.testing.assert_close(ours.compute_logits(hidden), want, rtol=0, atol=1e-4)


def test_chunked_prefill_matches_one_shot(tiny_pair):
    """Guards: positions restarting at 0 for a later chunk, or a top-left causal mask when
    the second chunk's queries sit after cached keys."""
    ours, _ = tiny_pair
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(1))
    one = ours(ids, torch.arange(20), ContiguousKVCache(ours.config, 20, torch.float32, "cpu"))
    cache = ContiguousKVCache(ours.config, 20, torch.float32, "cpu")
    first = ours(ids[:13], torch.arange(13), cache)
    second = ours(ids[13:], torch.arange(13, 20), cache)
    assert cache.length == 20
    torch.testing.assert_close(torch.cat([first, second]), one, rtol=1e-5, atol=1e-5)


def test_greedy_matches_hf_generate(tiny_pair):
    """Guards: decode steps that forget the cache, reuse a position, or cast logits late."""
    ours, ref = tiny_pair
    gen = torch.Generator().manual_seed(2)
    for length in (1, 5, 17):
        prompt = torch.randint(3, 512, (length,), generator=gen).tolist()
        assert greedy_generate(ours, prompt, 24) == hf_greedy(ref, prompt, 24, eos=[])


def test_greedy_stops_on_eos_and_includes_it(tiny_pair):
    """Guards: generating past EOS, or dropping the EOS token transformers keeps."""
    ours, ref = tiny_pair
    prompt = [5, 17, 42, 99]
    free = greedy_generate(ours, prompt, 12)
    eos = free[6]  # pretend the 7th token is EOS: generation must stop at its first use
    stop = free.index(eos) + 1
    assert greedy_generate(ours, prompt, 12, eos_token_ids=[eos]) == free[:stop]
    assert hf_greedy(ref, prompt, 12, eos=[eos]) == free[:stop]


# ---------------------------------------------------------------- real shapes, random weights


def check_real_shaped(path, prompt: str, new_tokens: int = 4, margin: float = 1e-3):
    """Logits within tolerance, and greedy tokens equal wherever the top-1 margin is clear.

    The rule: HF runs once over prompt + our greedy tokens (teacher forcing). At every
    generated position where HF's top-1 beats its top-2 by more than `margin` (far above
    the ~1e-5 fp32 noise) our token must be HF's argmax; at a near tie it must be HF's
    top-1 or top-2. Random weights make near ties likely, real weights rarely have them.
    """
    prompt_ids = Tokenizer.from_pretrained(path).encode(prompt)
    ours = load_model(path)
    out = greedy_generate(ours, prompt_ids, new_tokens)
    ids = torch.tensor(prompt_ids + out)
    with torch.no_grad():
        cache = ContiguousKVCache(ours.config, len(ids), torch.float32, "cpu")
        got = ours.compute_logits(ours(ids, torch.arange(len(ids)), cache))
    del ours
    ref = load_hf(path)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    del ref
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    top = want[len(prompt_ids) - 1 : -1].topk(2, dim=-1)  # the positions that chose `out`
    clear = 0
    for token, (v1, v2), (i1, i2) in zip(out, top.values.tolist(), top.indices.tolist()):
        if v1 - v2 > margin:
            assert token == i1
            clear += 1
        else:
            assert token in (i1, i2)
    assert clear >= new_tokens // 2, "too many near ties to say anything about greedy parity"


@pytest.mark.slow
def test_qwen25_05b_shapes_match_hf(qwen25_05b_random):
    """Guards: anything that only shows at real size: 14 heads over 2 kv heads (n_rep 7),
    rope_theta 1e6, tied lm_head, bf16 shards loaded as fp32."""
    check_real_shaped(qwen25_05b_random, "<|im_start|>user\nWrite a haiku about the sea.")


@pytest.mark.slow
def test_qwen3_06b_shapes_match_hf(qwen3_06b_random):
    """Guards: head_dim 128 != hidden / heads (1024 / 16 = 64), q/k-norm, no qkv bias."""
    check_real_shaped(qwen3_06b_random, "<|im_start|>user\nExplain recursion briefly.")


# ---------------------------------------------------------------- trained checkpoints


def check_greedy_parity(path, prompts: list[str], new_tokens: int = 32) -> None:
    tok = Tokenizer.from_pretrained(path)
    eos = list(read_eos_token_ids(path))
    ours, ref = load_model(path), load_hf(path)
    for prompt in prompts:
        ids = tok.encode(prompt)
        got = greedy_generate(ours, ids, new_tokens, eos_token_ids=eos)
        want = hf_greedy(ref, ids, new_tokens, eos=eos)
        assert got == want, (
            f"greedy differs for {prompt!r}:\n{tok.decode(got)!r}\n{tok.decode(want)!r}"
        )


def test_tiny_model_greedy_matches_hf(tiny_model):
    """Guards: a trained model's greedy text diverging from transformers (the course's bar)."""
    check_greedy_parity(tiny_model, PROMPTS, new_tokens=40)


def test_real_model_greedy_matches_hf(test_model):
    """Guards: parity on the real checkpoint named by MINIVLLM_TEST_MODEL."""
    tok = Tokenizer.from_pretrained(test_model)
    chats = [[{"role": "user", "content": p}] for p in ("What is 2 + 2?", "Name three colors.")]
    prompts = [tok.apply_chat_template(c) for c in chats] + PROMPTS[:2]
    check_greedy_parity(test_model, prompts, new_tokens=32)


def test_load_model_skips_init_and_leaves_dynamo_unimported(tiny_model):
    """Building the model on meta skips the random init: Embedding's normal_ on meta would
    import torch._dynamo (1.7 s of every server start-up). A fresh interpreter tells."""
    import subprocess
    import sys

    code = ("import sys, torch.nn as nn; from minivllm.model import load_model; "
            f"m = load_model({str(tiny_model)!r}); "
            "assert 'torch._dynamo' not in sys.modules, 'load_model imported torch._dynamo'; "
            "assert nn.Embedding.reset_parameters.__name__ == 'reset_parameters'; "
            "assert nn.Linear(2, 2).weight.abs().sum() > 0  # init is back after the build")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
