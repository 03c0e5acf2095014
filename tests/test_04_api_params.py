"""Milestone 4, OpenAI sampling parameters on the server (issue 19): penalties, logit_bias,
vLLM's extras, ``echo`` with prompt logprobs on /v1/completions, and lm-evaluation-harness
(a real third-party client) scoring a local task through ``local-completions``.

The server and the offline ``LLM`` of tests/test_04_server.py (same engine options) are
started once more for this module; every answer is compared with the offline engine.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import httpx
import pytest
import test_04_server as base

from minivllm import SamplingParams

# test_04_server's fixtures: this module gets a server (and offline LLM) of its own
started, server, llm, client = base.started, base.server, base.llm, base.client
MODEL, NAME, _assert_error = base.MODEL, base.NAME, base._assert_error

PROMPT = "def fibonacci(n):"
GREEDY = {"temperature": 0, "max_tokens": 12}
TASK_DIR = Path(__file__).parent / "data" / "lm_eval_task"


def _offline(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def test_penalties_and_logit_bias_on_completions_and_chat(client, llm):
    """OpenAI's names, vLLM's extras (extra_body), OpenAI's string-keyed logit_bias: the
    server's text equals the offline engine's under the same SamplingParams, and differs
    from the unpenalized text (so the fields really reach the sampler)."""
    plain = client.completions.create(model=NAME, prompt=PROMPT, **GREEDY).choices[0].text
    tok = llm.get_tokenizer()
    first = tok.encode(plain)[0]
    fields = {"presence_penalty": 0.8, "frequency_penalty": 0.4, "logit_bias": {str(first): -100}}
    extra = {"repetition_penalty": 1.3, "bad_words": ["return"],
             "allowed_token_ids": list(range(2000))}
    out = client.completions.create(model=NAME, prompt=PROMPT, **GREEDY, **fields,
                                    extra_body=extra)
    want = _offline(llm, PROMPT, **GREEDY, presence_penalty=0.8, frequency_penalty=0.4,
                    logit_bias={first: -100}, **extra).outputs[0]
    assert out.choices[0].text == want.text != plain
    assert first not in want.token_ids and all(t < 2000 for t in want.token_ids)
    messages = [{"role": "user", "content": "Write a loop."}]
    chat = client.chat.completions.create(model=NAME, messages=messages, **GREEDY,
                                          presence_penalty=1.5, logit_bias={"13": 5})
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    want = _offline(llm, {"prompt_token_ids": ids}, **GREEDY, presence_penalty=1.5,
                    logit_bias={13: 5.0}).outputs[0]
    assert chat.choices[0].message.content == want.text


def _check_prompt_part(lp, llm, ids: list[int], k: int) -> None:
    """The prompt's share of an echoed logprobs object, against offline prompt_logprobs."""
    offline = _offline(llm, {"prompt_token_ids": ids}, max_tokens=1,
                       prompt_logprobs=k).prompt_logprobs
    tok = llm.get_tokenizer()
    assert lp["tokens"][:len(ids)] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert math.isclose(lp["token_logprobs"][i], offline[i][ids[i]], abs_tol=1e-5)
        assert len(lp["top_logprobs"][i]) <= k + 1
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(max(offline[i].values()))
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(offsets[i + 1] - offsets[i] == len(lp["tokens"][i])
                                   for i in range(len(offsets) - 1))


def test_echo_with_logprobs(server, llm):
    """echo + logprobs: prompt tokens first (None for the first), then the completion's,
    in OpenAI's legacy shape; streamed chunks add up to the same object."""
    ids = llm.get_tokenizer().encode(PROMPT)
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, **GREEDY}
    out = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    choice = out["choices"][0]
    offline = _offline(llm, PROMPT, **GREEDY, logprobs=2).outputs[0]
    assert choice["text"] == PROMPT + offline.text
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + len(offline.token_ids)
    _check_prompt_part(lp, llm, ids, 2)
    for i, t in enumerate(offline.token_ids):
        assert math.isclose(lp["token_logprobs"][len(ids) + i], offline.logprobs[i][t],
                            abs_tol=1e-5)
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    import json

    merged = {key: [] for key in lp}
    text = ""
    for chunk in map(json.loads, chunks):
        c = chunk["choices"][0]
        text += c["text"]
        for key in merged:
            merged[key] += c["logprobs"][key]
    assert text == choice["text"]
    assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
    assert merged["token_logprobs"][0] is None
    assert all(math.isclose(a, b, abs_tol=1e-5)
               for a, b in zip(merged["token_logprobs"][1:], lp["token_logprobs"][1:]))


def test_echo_with_max_tokens_zero_scores_the_prompt_only(client, llm):
    """vLLM allows max_tokens=0 with echo: the prompt and its logprobs, nothing generated."""
    ids = llm.get_tokenizer().encode(PROMPT)
    out = client.completions.create(model=NAME, prompt=ids, echo=True, max_tokens=0, logprobs=1,
                                    temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    _check_prompt_part(choice.logprobs.model_dump(), llm, ids, 1)
    plain = client.completions.create(model=NAME, prompt=PROMPT, echo=True, max_tokens=0)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"999999": 1}}, "vocabulary"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -3},
     "frequency_penalty"),
])
def test_bad_sampling_fields_get_400(server, body, needle):
    endpoint = "chat/completions" if "messages" in body else "completions"
    _assert_error(httpx.post(f"{server}/v1/{endpoint}", json=body), 400, needle)


def _expected_loglikelihood(llm, context: str, continuation: str) -> float:
    """lm_eval's own tokens (trailing spaces of the context move to the continuation; the
    continuation is the whole pair's tokens past the context's count, appended to the
    context's tokens), scored by the offline engine's prompt logprobs."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    tok = llm.get_tokenizer()
    ctx = tok.encode(context)
    ids = ctx + tok.encode(context + continuation)[len(ctx):]
    lp = _offline(llm, {"prompt_token_ids": ids}, max_tokens=1, prompt_logprobs=0).prompt_logprobs
    return sum(lp[i][ids[i]] for i in range(len(ctx), len(ids)))


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                    reason="lm-evaluation-harness is not installed (pip install -e '.[dev]')")
def test_lm_eval_local_completions_loglikelihoods_equal_the_engine(server, llm, monkeypatch):
    """lm-evaluation-harness, model local-completions, on the repository's own task file
    (tests/data/lm_eval_task): every choice's log-likelihood equals the offline engine's."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(TASK_DIR)  # the task's data_files path is relative
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": NAME, "base_url": f"{server}/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": str(MODEL),
                    "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True},
        tasks=["minivllm_stdlib"], task_manager=TaskManager(include_path=str(TASK_DIR)),
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    samples = results["samples"]["minivllm_stdlib"]
    assert len(samples) == 4
    for sample in samples:  # the (context, continuation) strings lm_eval asked about
        assert len(sample["arguments"]) == len(sample["doc"]["choices"])
        got = [resp[0][0] for resp in sample["resps"]]
        want = [_expected_loglikelihood(llm, *args) for args in sample["arguments"]]
        assert got == pytest.approx(want, abs=1e-4), sample["arguments"]
    assert 0.0 <= results["results"]["minivllm_stdlib"]["acc,none"] <= 1.0
