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
from minivllm.sampling import SamplingParams
from minivllm.server.faults import FAULT_POINTS, inject_faults

MARKER = "POISON"
GOOD = [
    ("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=24)),
    ("import os\nimport", SamplingParams(temperature=0.8, seed=7, max_tokens=20, n=2)),
    ("The capital of France is", SamplingParams(temperature=0, max_tokens=30, stop=["\n\n"])),
    ("class Node:\n", SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=16)),
]
BAD = (f"{MARKER} the rest of this prompt", SamplingParams(temperature=0, max_tokens=40,
                                                            ignore_eos=True))


def _engine(model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_blocks=48, block_size=8,
                                  max_model_len=256, compile=False, seed=0))


def _run(engine: LLMEngine, with_bad: bool, bad_at: int = 1) -> dict[str, object]:
    """Run the good requests (and the poisoned one at ``bad_at``: it shares every step)."""
    requests = [(f"good-{i}", p, s) for i, (p, s) in enumerate(GOOD)]
    if with_bad:
        requests.insert(bad_at, ("bad", *BAD))
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


@pytest.fixture(scope="module")
def clean(tiny_model):
    final = _run(_engine(tiny_model), with_bad=False)
    return {rid: [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]
            for rid, out in final.items()}


def _assert_alone(engine: LLMEngine, final: dict, clean: dict, error: str) -> None:
    bad = final.pop("bad")
    assert bad.error is not None and error in bad.error, bad.error
    assert bad.finished and [c.finish_reason for c in bad.outputs] == ["abort"]
    got = {rid: [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]
           for rid, out in final.items()}
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


def test_nan_inside_the_model_is_scrubbed_from_the_pool(tiny_model, clean):
    """NaN born in the model reaches the poisoned request's keys and values. A masked key
    still enters attention's sum as 0 x value (0 x NaN = NaN): padding must never point at a
    live block, and the failed request's blocks are zeroed before they are reused."""
    engine = _engine(tiny_model)
    poison_id = engine.tokenizer.encode(BAD[0])[0]
    assert all(poison_id not in engine.tokenizer.encode(p) for p, _ in GOOD)

    def poison(_, inputs, hidden):  # (T, hidden): NaN wherever the marker token is
        return hidden.masked_fill((inputs[0] == poison_id).unsqueeze(-1), float("nan"))

    engine.model.model.embed_tokens.register_forward_hook(poison)
    final = _run(engine, with_bad=True, bad_at=0)  # admitted first: it owns block 0, where
    # the others' padded block-table entries used to point
    _assert_alone(engine, final, clean, "NaN or infinite")
    assert torch.isfinite(engine.pool.kv).all()
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
