"""Random weights with real Qwen shapes: what the tests, the graders and
``tools/make_random_checkpoint.py`` share (hand-written course tooling, not built by a notebook).

Model weights cannot be downloaded on the machines this course is built and graded on, so
every parity check runs on seeded random weights instead: speed and correctness do not depend
on the values, only on every parameter mattering (a skipped bias or norm must change the
output). The chat template is Qwen2.5-Instruct's, written out so that a checkpoint built here
chats like the real one.
"""

from __future__ import annotations

import torch

# Qwen2.5-Instruct's ChatML template (tool calling left out): a default system prompt when
# the conversation has none.
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- set rest = messages %}"
    "{%- endif %}"
    "{%- for message in rest %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

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
