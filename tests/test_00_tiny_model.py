"""The bundled tiny Qwen2 checkpoint (minivllm/assets/tiny-qwen2-stdlib) loads offline with
transformers, has Qwen2.5's structural features, renders ChatML, and is stable.

Retrain with ``python tools/train_tiny_model.py --out minivllm/assets/tiny-qwen2-stdlib``
(see docs/tiny_model.md), then update ``GOLDEN_IDS`` below.
"""

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from minivllm import TINY_MODEL

PATH = Path(TINY_MODEL)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Greedy continuation of GOLDEN_PROMPT, recorded from the shipped checkpoint with
# transformers.generate(do_sample=False) in float32 on CPU.
GOLDEN_PROMPT = "import os\n"
GOLDEN_NEW_TOKENS = 24
GOLDEN_IDS = [789, 775, 198] * 8  # "import sys\n" x 8 (smallest top-1 margin 0.6 logits)


@pytest.fixture(scope="module")
def config():
    return json.loads((PATH / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(PATH)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32)
    m.eval()
    return m


def test_files_present_and_small():
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "training_report.json"]:
        assert (PATH / name).is_file(), name
    total = sum(f.stat().st_size for f in PATH.rglob("*") if f.is_file())
    assert total <= 10 * 1024 * 1024, f"{total / 1e6:.2f} MB"


def test_config_has_qwen2_structure(config):
    assert config["model_type"] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    # grouped-query attention: more query heads than kv heads, evenly grouped
    assert config["num_attention_heads"] > config["num_key_value_heads"] >= 1
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 1000000.0
    assert config["rope_parameters"]["rope_theta"] == 1000000.0
    assert config["rms_norm_eps"] == 1e-06
    assert config["hidden_act"] == "silu"
    assert config["max_position_embeddings"] == 4096
    assert config["use_sliding_window"] is False
    assert config["vocab_size"] % 64 == 0
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"


def test_weights_qkv_bias_tied_bf16(config):
    from safetensors import safe_open

    with safe_open(PATH / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in keys}
        emb = f.get_tensor("model.embed_tokens.weight")
    assert dtypes == {torch.bfloat16}
    assert "lm_head.weight" not in keys  # tied to the embedding
    assert emb.shape == (config["vocab_size"], config["hidden_size"])
    kv = config["num_key_value_heads"] * config["head_dim"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert p + proj + ".bias" in keys  # Qwen2 always has q/k/v biases
        assert p + "o_proj.bias" not in keys
    with safe_open(PATH / "model.safetensors", framework="pt") as f:
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [kv, config["hidden_size"]]


def test_model_loads_tied_fp32(model, config):
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.lm_head.weight.dtype == torch.float32
    assert model.config.num_key_value_heads == config["num_key_value_heads"]


def test_tokenizer_specials_and_roundtrip(tokenizer, config):
    from tokenizers import Tokenizer

    n = len(tokenizer)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIALS]
    assert ids == [n - 3, n - 2, n - 1]  # after the BPE vocab, as in Qwen
    assert config["vocab_size"] > n  # padded like Qwen (151,665 tokens -> 151,936 rows)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    raw = Tokenizer.from_file(str(PATH / "tokenizer.json"))
    for text in ["def f(x):\n\treturn x ** 2  # ünïcödé ✓\r\n", "日本語 🐍 \x00\x7f", "   \n\n  x",
                 "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]:
        enc = tokenizer.encode(text)
        assert enc == raw.encode(text).ids  # transformers and tokenizers agree
        assert tokenizer.decode(enc) == text == raw.decode(enc, skip_special_tokens=False)
    assert tokenizer.encode("<|im_end|>") == [ids[2]]


def test_chat_template_renders_chatml(tokenizer):
    user = [{"role": "user", "content": "What does `textwrap.dedent` do?"}]
    text = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWhat does `textwrap.dedent` do?<|im_end|>\n<|im_start|>assistant\n")
    conv = [{"role": "system", "content": "Be brief."}, *user, {"role": "assistant", "content": "Dedent."}]
    text = tokenizer.apply_chat_template(conv, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat does "
                    "`textwrap.dedent` do?<|im_end|>\n<|im_start|>assistant\nDedent.<|im_end|>\n")
    ids = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_generation_config():
    gen = json.loads((PATH / "generation_config.json").read_text())
    tok_cfg = json.loads((PATH / "tokenizer_config.json").read_text())
    by_content = {v["content"]: int(k) for k, v in tok_cfg["added_tokens_decoder"].items()}
    assert gen["eos_token_id"] == [by_content["<|im_end|>"], by_content["<|endoftext|>"]]
    assert gen["pad_token_id"] == by_content["<|endoftext|>"]


def test_training_report():
    rep = json.loads((PATH / "training_report.json").read_text())
    for key in ["steps", "seed", "tokens_seen", "train_loss_ema_final", "heldout_code_loss",
                "train_wall_time_s", "data_source"]:
        assert key in rep
    assert rep["heldout_code_loss"] < 5.0  # it actually learned (uniform would be ln(4003) ~ 8.3)


def test_greedy_golden(model, tokenizer):
    ids = tokenizer(GOLDEN_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=GOLDEN_NEW_TOKENS)
    new = out[0, ids.shape[1]:].tolist()
    assert new == GOLDEN_IDS, f"greedy continuation changed: {new} = {tokenizer.decode(new)!r}"
