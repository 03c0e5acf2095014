"""A fault in one request fails that request alone (issue 18).

Faults are planted with the server's test hook (``minivllm.server.faults.inject_faults``) at
each point of ``LLMEngine.step`` where one request's processing can go wrong — sampling its
row, checking its stops, detokenizing it, NaN logits — and, deeper, NaN born inside the
model (its keys and values poisoned too). The poisoned request must end with ``error`` set
and its blocks back in the pool; every other request of the same steps must produce exactly
what it produces in a clean run (greedy, seeded sampling, n=2, stop strings).
"""

from __future__ import annotations

import pytest
import torch

from minivllm.config import EngineConfig
from minivllm.engine import LLM, LLMEngine
from minivllm.sampling import SamplingParams, inverse_cdf
from minivllm.server.faults import FAULT_POINTS, InjectedFault, inject_faults

MARKER = "POISON"
GOOD = [
    ("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=24)),
    ("import os\nimport", SamplingParams(temperature=0.8, seed=7, max_tokens=20, n=2)),
    ("The capital of France is", SamplingParams(temperature=0, max_tokens=30, stop=["\n\n"])),
    ("class Node:\n", SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=16)),
]
BAD = (f"{MARKER} the rest of this prompt", SamplingParams(temperature=0, max_tokens=40,
                                                            ignore_eos=True))


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def _engine(model, speculative: bool = False) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_blocks=48, block_size=8,
                                  max_model_len=256, compile=False, seed=0,
                                  speculative_config=SPEC if speculative else None))


def _run(engine: LLMEngine, with_bad: bool, bad_at: int = 1, bad=BAD) -> dict[str, object]:
    """Run the good requests (and the poisoned one at ``bad_at``: it shares every step)."""
    requests = [(f"good-{i}", p, s) for i, (p, s) in enumerate(GOOD)]
    if with_bad:
        requests.insert(bad_at, ("bad", *bad))
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _texts(final: dict) -> dict:
    return {rid: [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]
            for rid, out in final.items()}


@pytest.fixture(scope="module")
def clean(tiny_model):
    return _texts(_run(_engine(tiny_model), with_bad=False))


@pytest.fixture(scope="module")
def clean_speculative(tiny_model):
    engine = _engine(tiny_model, speculative=True)
    final = _run(engine, with_bad=False)
    assert engine.stats.num_spec_accepted_tokens > 0  # it did speculate
    return _texts(final)


def _assert_alone(engine: LLMEngine, final: dict, clean: dict, error: str,
                  greedy_only: bool = False) -> None:
    """``greedy_only``: with speculation a seeded request's draws depend on which steps it
    speculated in (exact in distribution, not draw for draw), so only greedy ones compare."""
    bad = final.pop("bad")
    assert bad.error is not None and error in bad.error, bad.error
    assert bad.finished and [c.finish_reason for c in bad.outputs] == ["abort"]
    got = _texts(final)
    if greedy_only:
        greedy = {f"good-{i}" for i, (_, p) in enumerate(GOOD) if p.is_greedy}
        got = {rid: v for rid, v in got.items() if rid in greedy}
        clean = {rid: v for rid, v in clean.items() if rid in greedy}
    assert got == clean  # the others: token for token, text for text
    assert all(out.error is None for out in final.values())
    assert not engine.requests and not engine.scheduler.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.num_blocks  # nothing leaked


@pytest.mark.parametrize("point", [p for p in FAULT_POINTS if p != "model"])
def test_a_planted_fault_fails_only_its_request(tiny_model, clean, point):
    engine = _engine(tiny_model)
    inject_faults(engine, f"{point}:{MARKER}")
    final = _run(engine, with_bad=True)
    _assert_alone(engine, final, clean, "NaN or infinite" if point == "nan" else "injected fault")


def test_nan_logits_of_a_sampled_request_fail_it_alone(tiny_model, clean):
    """The poisoned request sampling (the OpenAI default, temperature 1) rather than greedy:
    its row of NaN goes through the inverse-CDF draw and must still fail it alone."""
    engine = _engine(tiny_model)
    inject_faults(engine, f"nan:{MARKER}")
    sampled = (BAD[0], SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
    final = _run(engine, with_bad=True, bad=sampled)
    _assert_alone(engine, final, clean, "NaN or infinite")


def test_nan_inside_the_model_is_scrubbed_from_the_pool(tiny_model, clean):
    """NaN born in the model reaches the poisoned request's keys and values. A masked key
    still enters attention's sum as 0 x value (0 x NaN = NaN): padding must never point at a
    live block, and the failed request's blocks are zeroed before they are reused."""
    engine = _engine(tiny_model)
    poison_id = engine.tokenizer.encode(BAD[0])[0]
    assert all(poison_id not in engine.tokenizer.encode(p) for p, _ in GOOD)

    def poison(_, inputs, hidden):  # (T, hidden): NaN wherever the marker token is
        return hidden.masked_fill((inputs[0] == poison_id).unsqueeze(-1), float("nan"))

    engine.runner.model.model.embed_tokens.register_forward_hook(poison)
    final = _run(engine, with_bad=True, bad_at=0)  # admitted first: it owns block 0, where
    # the others' padded block-table entries used to point
    _assert_alone(engine, final, clean, "NaN or infinite")
    assert torch.isfinite(engine.runner.pool.kv).all()
    again = _run(engine, with_bad=False)  # the scrubbed blocks are reused: still clean
    assert {rid: [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]
            for rid, out in again.items()} == clean


def test_offline_generate_raises_and_leaves_nothing_behind(tiny_model):
    llm = LLM(str(tiny_model), num_blocks=48, block_size=8, max_model_len=256, compile=False)
    inject_faults(llm.engine, f"detokenize:{MARKER}")
    with pytest.raises(RuntimeError, match="request offline-1 failed: InjectedFault"):
        llm.generate([GOOD[0][0], BAD[0]], SamplingParams(temperature=0, max_tokens=8))
    assert not llm.engine.requests
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    out = llm.generate([GOOD[0][0]], SamplingParams(temperature=0, max_tokens=8))
    assert out[0].outputs[0].token_ids


def _plant_in_speculative_step(engine: LLMEngine, point: str) -> list:
    """A fault for the poisoned request inside Milestone 8's verify step only: its rows'
    acceptance raises ("sample"), its k + 1 rows of logits are NaN ("nan"), or its stop check
    raises while the accepted tokens are appended ("stop"). Returns the list of hits."""
    spec, hits = engine.runner, []
    if point in ("sample", "nan"):
        accept = spec.accept

        def planted_accept(seq, draft, logits):
            if seq.request_id == "bad":
                hits.append(point)
                if point == "sample":
                    raise InjectedFault(seq.request_id)
                logits = logits * float("nan")
            return accept(seq, draft, logits)

        spec.accept = planted_accept
    else:
        execute, check_stop, verified = spec.execute, engine.scheduler.check_stop, set()

        def planted_check(seq, token):
            if seq.request_id == "bad" and seq.seq_id in verified:
                hits.append(point)
                raise InjectedFault(seq.request_id)
            return check_stop(seq, token)

        def flagged_execute(plan):  # the sequences whose verified draft gave several tokens
            out = execute(plan)
            verified.clear()
            verified.update(sid for sid, tokens in out.token_ids.items() if len(tokens) > 1)
            return out

        engine.scheduler.check_stop, spec.execute = planted_check, flagged_execute
    return hits


@pytest.mark.parametrize("point", ["sample", "nan", "stop"])
def test_a_fault_in_the_speculative_step_fails_only_its_request(
        tiny_model, clean_speculative, point):
    """The same isolation in Milestone 8's verify step, where speculating rows are accepted
    by the speculative runner's `accept` and the others sampled by the runner's sampler in
    the same pass."""
    engine = _engine(tiny_model, speculative=True)
    hits = _plant_in_speculative_step(engine, point)
    final = _run(engine, with_bad=True)
    assert hits, "the poisoned request never speculated"
    _assert_alone(engine, final, clean_speculative,
                  "NaN or infinite" if point == "nan" else "injected fault", greedy_only=True)


def test_a_row_that_is_not_finite_still_draws_a_token_id_in_the_vocabulary():
    """The sampler's inverse-CDF draw on a row of NaN, with an infinity, or of zeros returns
    some token id inside the vocabulary: the runner then fails that row by its logits. An id
    past the vocabulary (the search's zero padding) broke the whole batch at the runner's
    gather of the chosen logits, failing every request of the step (the server's fault test
    with a sampled poisoned request)."""
    vocab = 4032  # not a multiple of the search's 128-token chunks: padded
    probs = torch.rand(5, vocab)
    probs[1] = float("nan")
    probs[2, 7] = float("inf")
    probs[3] = 0.0
    probs[4, -1] = float("nan")
    u = torch.tensor([0.0, 0.5, 0.99, 0.3, 1 - 2**-53], dtype=torch.float64)
    tokens = inverse_cdf(probs, u)
    assert tokens.shape == (5,) and bool(((tokens >= 0) & (tokens < vocab)).all()), tokens
