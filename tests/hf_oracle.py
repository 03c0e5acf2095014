"""The correctness oracle shared by the milestone tests: Hugging Face transformers, fp32, CPU.

Greedy decoding is done with an explicit loop (not ``generate``) so that ``ignore_eos``
semantics match minivllm exactly: the loop never masks or stops on EOS, it just takes the
argmax ``max_new_tokens`` times.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str | Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.inference_mode()
def hf_greedy(path: str | Path, prompt_ids: list[int], max_new_tokens: int,
              eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation of ``prompt_ids`` by transformers (stops after an EOS if given)."""
    model = hf_model(str(path))
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    past, tokens = out.past_key_values, []
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if token in eos_token_ids:
            break
        out = model(torch.tensor([[token]]), use_cache=True, **{cache_arg: past})
        past = out.past_key_values
    return tokens


@torch.inference_mode()
def hf_logprobs(path: str | Path, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position: (len, vocab)."""
    logits = hf_model(str(path))(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)



@torch.inference_mode()
def hf_generate(path: str | Path, prompt_ids: list[int], max_new_tokens: int, **processors) -> list[int]:
    """transformers' own greedy ``generate`` with its logits processors (``repetition_penalty=``,
    ``sequence_bias=``, ``bad_words_ids=``, ``suppress_tokens=``, ``logits_processor=``): the
    oracle for penalties and biases. Never stops on EOS (minivllm's ``ignore_eos``)."""
    model = hf_model(str(path))
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=None, pad_token_id=0, **processors)
    return out[0, len(prompt_ids):].tolist()
