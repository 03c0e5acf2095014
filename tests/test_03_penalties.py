"""Milestone 3, OpenAI sampling parameters (issue 19): penalties, logit_bias,
allowed_token_ids, bad_words in the batched sampler, and prompt logprobs.

The oracle is transformers' own ``generate`` with its logits processors where they exist
(``repetition_penalty``, ``sequence_bias``, ``bad_words_ids``, ``suppress_tokens``), and a
plain-Python reference processor run inside ``generate`` where they don't (presence and
frequency penalties). Every case checks that the parameter changed the output, so a
sampler that ignores it fails. The bundled model is used: trained, it repeats itself, so
penalties bite.
"""

from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_generate, hf_greedy, hf_logprobs

from minivllm import LLM, SamplingParams
from minivllm.sampling import bad_word_bans, process_logits, token_counts

PROMPTS = ["def main():\n", "class Config:\n    "]
N = 20
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": N}


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), block_size=16, num_blocks=64, max_model_len=256,
               max_num_batched_tokens=64, compile=False)


def _ids(llm, text):
    return llm.get_tokenizer().encode(text)


def _generate(llm, params):
    """Every prompt under ``params`` plus a neutral request in the same batch."""
    prompts = PROMPTS + PROMPTS[:1]
    outs = llm.generate(prompts, [params] * len(PROMPTS) + [SamplingParams(**GREEDY)],
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs[:-1]], outs[-1].outputs[0].token_ids


class PresenceFrequency:
    """The OpenAI definition, written plainly: logit[t] -= f * count(t) + p * (count(t) > 0),
    counting the generated tokens only (transformers' input_ids also hold the prompt)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        counts: dict[int, int] = {}
        for t in input_ids[0, self.prompt_len:].tolist():
            counts[t] = counts.get(t, 0) + 1
        for t, c in counts.items():
            scores[0, t] -= self.frequency * c + self.presence
        return scores


def test_neutral_values_keep_parity_and_take_the_fast_path(llm, tiny_model):
    """Explicit neutral values are the defaults: same tokens as transformers, and
    process_logits hands back the very same tensor (no copy, no work)."""
    neutral = SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                             logit_bias={}, bad_words=[], **GREEDY)
    assert not neutral.adjusts_logits
    got, _ = _generate(llm, neutral)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == hf_greedy(tiny_model, _ids(llm, prompt), N)
    logits = torch.randn(2, 10)
    assert process_logits(logits, [neutral, SamplingParams()], [[1, 2], [3]], [1, 1],
                          [[], []]) is logits


@pytest.mark.parametrize("penalty", [1.5, 0.8])
def test_repetition_penalty_matches_transformers(llm, tiny_model, penalty):
    got, neutral = _generate(llm, SamplingParams(repetition_penalty=penalty, **GREEDY))
    for prompt, tokens in zip(PROMPTS, got):
        ids = _ids(llm, prompt)
        assert tokens == hf_generate(tiny_model, ids, N, repetition_penalty=penalty), prompt
    assert got[0] != neutral, "the penalty changed nothing: the test would prove nothing"


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (-0.5, 1.2)])
def test_presence_and_frequency_match_a_reference(llm, tiny_model, presence, frequency):
    got, neutral = _generate(llm, SamplingParams(presence_penalty=presence,
                                                 frequency_penalty=frequency, **GREEDY))
    for prompt, tokens in zip(PROMPTS, got):
        ids = _ids(llm, prompt)
        ref = hf_generate(tiny_model, ids, N,
                          logits_processor=[PresenceFrequency(len(ids), presence, frequency)])
        assert tokens == ref, prompt
    assert got[0] != neutral


def test_logit_bias_matches_sequence_bias(llm, tiny_model):
    """Single-token sequence_bias is logit_bias; biases that push the greedy path elsewhere."""
    _, neutral = _generate(llm, SamplingParams(**GREEDY))
    bias = {neutral[0]: -5.0, neutral[3]: -100.0, 13: 3.5}
    got, _ = _generate(llm, SamplingParams(logit_bias=bias, **GREEDY))
    for prompt, tokens in zip(PROMPTS, got):
        ref = hf_generate(tiny_model, _ids(llm, prompt), N,
                          sequence_bias=[[[t], b] for t, b in bias.items()])
        assert tokens == ref, prompt
    assert got[0] != neutral and neutral[3] not in got[0]


def test_allowed_token_ids_match_suppress_tokens(llm, tiny_model):
    _, neutral = _generate(llm, SamplingParams(**GREEDY))
    allowed = sorted(set(neutral[::2]) | {13, 198, 262})
    vocab = llm.engine.model_config.vocab_size
    got, _ = _generate(llm, SamplingParams(allowed_token_ids=allowed, **GREEDY))
    others = [t for t in range(vocab) if t not in allowed]
    for prompt, tokens in zip(PROMPTS, got):
        assert set(tokens) <= set(allowed)
        assert tokens == hf_generate(tiny_model, _ids(llm, prompt), N, suppress_tokens=others)
    assert got[0] != neutral


def test_bad_words_match_no_bad_words_processor(llm, tiny_model):
    """A one-token word is banned everywhere; a two-token word only loses its last token
    right after its first. The words are decoded from the neutral output, so they bite."""
    tok = llm.get_tokenizer()
    _, neutral = _generate(llm, SamplingParams(**GREEDY))

    def word(ids):  # a word that tokenizes back into exactly these ids
        text = tok.decode(ids)
        return text if text[:1].strip() and tok.encode(text) == ids else None

    single = next(w for t in neutral if (w := word([t])))
    pair = next(w for i in range(1, N - 1) if (w := word(neutral[i:i + 2])))
    params = SamplingParams(bad_words=[single, pair], **GREEDY)
    got, _ = _generate(llm, params)
    words = params.bad_words_token_ids  # what add_request tokenized them into
    assert words[0] == tok.encode(single) and tok.encode(pair) in words
    for prompt, tokens in zip(PROMPTS, got):
        ids = _ids(llm, prompt)
        assert all(ids[-len(w) + 1:] != w[:-1] for w in words if len(w) > 1)  # see vLLM's rule
        assert tokens == hf_generate(tiny_model, ids, N, bad_words_ids=words), prompt
        for w in words:
            assert all(tokens[i:i + len(w)] != w for i in range(len(tokens)))
    assert got[0] != neutral


def test_bad_word_rule_and_tokenization():
    """vLLM's rule on hand-written cases: only the output counts; the word's last token is
    banned when the output ends with the rest of it."""
    words = [[5], [1, 2, 3], [7, 8]]
    assert bad_word_bans(words, []) == [5]
    assert bad_word_bans(words, [9, 1, 2]) == [5, 3]
    assert bad_word_bans(words, [1, 2, 9]) == [5]
    assert bad_word_bans(words, [7]) == [5, 8]

    table = {"foo": [1], " foo": [2], "foo bar": [1, 3], " foo bar": [2, 3], "x": [4],
             " x": [5, 4]}  # " foo" is another token, " foo bar" two: both spellings banned

    class Tok:
        def encode(self, text):
            return table[text]

    p = SamplingParams(bad_words=["foo", " foo bar", "x"])
    p.update_from_tokenizer(Tok(), vocab_size=10)
    assert p.bad_words_token_ids == [[1], [2], [1, 3], [2, 3], [4]]
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["foo"]).update_from_tokenizer(Tok(), vocab_size=2)


def test_token_counts():
    counts = token_counts([[1, 1, 3], [], [0]], vocab=4)
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_penalties_and_masks_on_hand_built_logits():
    """Every processor on one row each, in vLLM's order, against numbers worked by hand."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]] * 5)
    rows = [SamplingParams(repetition_penalty=2.0), SamplingParams(presence_penalty=0.5),
            SamplingParams(frequency_penalty=0.5), SamplingParams(logit_bias={3: -1.5}),
            SamplingParams(allowed_token_ids=[1, 2], logit_bias={2: 1.0})]
    history = [[1, 0, 0]] * 5  # prompt [1], output [0, 0]
    out = process_logits(logits, rows, history, [1] * 5, [[], [], [], [], [2]])
    inf = float("-inf")
    assert out.tolist() == [[1.0, -2.0, 0.5, 1.0], [1.5, -1.0, 0.5, 1.0], [1.0, -1.0, 0.5, 1.0],
                            [2.0, -1.0, 0.5, -0.5], [inf, -1.0, inf, inf]]


def test_logprobs_stay_those_of_the_raw_logits(llm, tiny_model):
    """vLLM's default logprobs_mode is raw_logprobs: a +100 bias forces a token, but its
    reported logprob is the model's own."""
    ids = _ids(llm, PROMPTS[0])
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        logit_bias={13: 100.0}, logprobs=1, **{**GREEDY, "max_tokens": 3}), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.token_ids == [13, 13, 13]
    ref = hf_logprobs(tiny_model, ids + c.token_ids)
    for i, entry in enumerate(c.logprobs):
        assert abs(entry[13] - float(ref[len(ids) - 1 + i, 13])) < 1e-4
    assert entry[13] < -1.0


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logit_bias": {1: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_invalid_values_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"logit_bias": {4032: 1.0}}, {"allowed_token_ids": [1, 5000]}])
def test_token_ids_outside_the_vocabulary_are_refused_when_added(llm, kwargs):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate("x", SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ----------------------------------------------------------------------------- prompt logprobs


def test_prompt_logprobs_match_transformers_chunked_and_with_the_prefix_cache(tiny_model):
    """Prompt logprobs come from the prompt positions' logits, across chunked-prefill steps;
    a request that wants them skips the prefix cache (as vLLM), so they stay exact when an
    earlier request has cached the same prefix."""
    llm = LLM(str(tiny_model), block_size=4, num_blocks=64, max_model_len=256,
              max_num_batched_tokens=8, enable_prefix_caching=True, compile=False)
    tok = llm.get_tokenizer()
    ids = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    return os.path.join(argv)\n")
    assert len(ids) > 16
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain[0].num_cached_tokens > 0 and out.num_cached_tokens == 0
    assert plain[0].prompt_logprobs is None
    ref = hf_logprobs(tiny_model, ids)
    lp = out.prompt_logprobs
    assert len(lp) == len(ids) and lp[0] is None
    for i in range(1, len(ids)):
        entry, row = lp[i], ref[i - 1]
        assert abs(entry[ids[i]] - float(row[ids[i]])) < 1e-4, i
        top = row.topk(3)
        assert set(top.indices.tolist()) <= set(entry) and len(entry) <= 4
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) < 1e-4


def test_prompt_logprobs_zero_and_n_and_preemption(tiny_model):
    """k = 0: only the prompt token itself; n = 2 records them once; a preempted request
    recomputes its prompt without adding entries twice."""
    llm = LLM(str(tiny_model), block_size=4, num_blocks=14, max_model_len=48, max_num_seqs=4,
              max_num_batched_tokens=16, compile=False)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ["def f(x):\n    return x\n", "import re\nimport os\n",
                                       "class A:\n    pass\n", "for i in range(3):\n"]]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, prompt_logprobs=0, n=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [params] * 3 + [
        SamplingParams(max_tokens=4, n=2, prompt_logprobs=1)], use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    for p, out in zip(prompts, outs):
        ref = hf_logprobs(tiny_model, p)
        assert len(out.prompt_logprobs) == len(p)
        for i in range(1, len(p)):
            assert abs(out.prompt_logprobs[i][p[i]] - float(ref[i - 1, p[i]])) < 1e-4
    assert all(len(e) == 1 for e in outs[0].prompt_logprobs[1:])
