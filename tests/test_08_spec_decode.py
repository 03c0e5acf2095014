"""Milestone 8: speculative decoding keeps the engine's output exact and its cache consistent.

Greedy parity (token for token) with the same engine without speculation and with
transformers, for both proposers, k in {1, 3, 5}, block size 4 (rollbacks cross block
boundaries), under preemption; stops, max_tokens, n, logprobs, min_tokens, seeds and
streaming deltas; the prefix cache never serves a rejected token's keys; bad configs fail at
start-up; non-speculating steps still take the ordinary path. The rejection rule's
statistics are in checks_08 (chi-square), graded on the reference here and on planted wrong
rules in tests/test_08_notebook.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_oracle import hf_greedy

from checkpoints import build_checkpoint
from minivllm import LLM, TINY_MODEL, SamplingParams
from minivllm.course import checks_08
from minivllm.kv_cache import BlockManager
from minivllm.spec_decode import (
    SpeculativeConfig,
    SpeculativeRunner,
    greedy_accept,
    ngram_propose,
    rejection_sample,
    rollback,
    sample_from,
)

PROMPTS = [
    "def fibonacci(n):\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
OPTIONS = {"max_model_len": 256, "compile": False, "block_size": 4, "seed": 0}


def ngram(k: int, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, **extra}


def token_ids(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def baseline() -> LLM:
    return LLM(TINY_MODEL, **OPTIONS)


@pytest.fixture(scope="module")
def baseline_ids(baseline) -> list[list[int]]:
    return token_ids(baseline)


@pytest.fixture(scope="module")
def layer_skip_draft(tmp_path_factory) -> Path:
    """The bundled model's first two of four layers (and its head): a draft that agrees with
    the target only sometimes (about 40% of its greedy proposals are accepted)."""
    from safetensors.torch import load_file, save_file

    src, out = Path(TINY_MODEL), tmp_path_factory.mktemp("tiny-layer-skip")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(src / name, out / name)
    weights = load_file(src / "model.safetensors")
    dropped = ("model.layers.2.", "model.layers.3.")
    save_file({k: v for k, v in weights.items() if not k.startswith(dropped)},
              out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 2
    config["layer_types"] = config.get("layer_types", ["full_attention"] * 4)[:2]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def seeded_draft(tmp_path_factory) -> Path:
    """A 2-layer random checkpoint with the bundled model's vocabulary and tokenizer: a draft
    that (almost) never agrees with the target."""
    config = json.loads((Path(TINY_MODEL) / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "bos_token_id", "eos_token_id")
    kwargs = {k: config[k] for k in keep if k in config} | {"num_hidden_layers": 2}
    out = build_checkpoint(tmp_path_factory.mktemp("tiny-draft"), "qwen2", kwargs, seed=7,
                           std=0.05)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(Path(TINY_MODEL) / name, out / name)
    return out


# ----------------------------------------------------------------------------- the pieces


def test_a_fixed_proposal_and_fixed_logits_give_a_known_accepted_length():
    assert greedy_accept([3, 4, 5], [3, 4, 9, 1]) == [3, 4, 9]
    assert ngram_propose([1, 2, 3, 1, 2], 2, 2, 1) == [3, 1]
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_sample([1], p, None) == [1, 2]  # p(d) = 1: always kept, bonus certain
    assert rejection_sample([0], p, None) == [1]  # p(d) = 0: always replaced


def test_a_draw_never_lands_on_a_token_of_probability_zero(monkeypatch):
    """sample_from at the ends of [0, 1): u = 0 takes the first token that has probability
    (not token 0, which has none), and a u above the running sum's rounded total (a float32
    distribution whose sum falls just short of 1) takes the last token that has any, not the
    zero-probability tail (a top-k filtered row). Before: token 0, and the vocabulary's last."""
    import minivllm.spec_decode as sd

    probs = torch.tensor([0.0, 0.3, 0.0, 0.7 - 1e-7, 0.0, 0.0])  # sums to just under 1
    for u, want in ((0.0, 1), (0.31, 3), (1 - 2**-53, 3)):
        monkeypatch.setattr(sd.torch, "rand", lambda *a, u=u, **k: torch.tensor(u, dtype=torch.float64))
        assert sample_from(probs, None) == want, u


def test_rollback_frees_only_the_blocks_past_the_computed_tokens():
    bm = BlockManager(num_blocks=6, block_size=4)
    table, _ = bm.allocate(list(range(11)))  # 3 blocks
    rollback(bm, table, 8)  # exactly two full blocks stay
    assert len(table) == 2 and bm.num_free_blocks == 4


def test_the_rejection_rule_follows_the_target_distribution():
    checks_08.check_rejection_sample(rejection_sample)


@pytest.mark.parametrize("spec", [
    {"method": "medusa", "num_speculative_tokens": 2},
    {"method": "ngram", "num_speculative_tokens": 0},
    {"method": "ngram", "num_speculative_tokens": 100},
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
     "prompt_lookup_max": 2},
    {"method": "ngram"},
    {"method": "draft_model", "num_speculative_tokens": 2},
    {"method": "ngram", "num_speculative_tokens": 2, "typo": 1},
    "{not json",
])
def test_a_bad_config_is_refused_at_start_up(spec):
    with pytest.raises(ValueError):
        LLM(TINY_MODEL, speculative_config=spec, **OPTIONS)


def test_ngram_bounds_follow_vllm():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 2)


def test_a_draft_with_another_vocabulary_is_refused(random_engine_model):
    with pytest.raises(ValueError, match="vocab"):
        LLM(TINY_MODEL, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                            "model": str(random_engine_model)}, **OPTIONS)


def test_a_draft_too_short_for_max_model_len_is_refused(seeded_draft, tmp_path):
    short = tmp_path / "short"
    shutil.copytree(seeded_draft, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(TINY_MODEL, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                            "model": str(short)}, **OPTIONS)


# ----------------------------------------------------------------------------- greedy parity


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_equals_the_engine_without_speculation(k, baseline_ids):
    llm = LLM(TINY_MODEL, speculative_config=ngram(k), **OPTIONS)
    assert token_ids(llm) == baseline_ids
    stats = llm.engine.stats
    assert stats.num_spec_proposed_tokens > 0 and 0 < stats.spec_acceptance_rate <= 1
    assert stats.num_steps < 48  # several tokens per step: fewer steps than tokens
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks  # nothing leaked


def test_greedy_equals_transformers(baseline_ids):
    prompt = PROMPTS[1]
    llm = LLM(TINY_MODEL, speculative_config=ngram(3), **OPTIONS)
    ids = llm.get_tokenizer().encode(prompt)
    assert token_ids(llm, [prompt])[0] == hf_greedy(TINY_MODEL, ids, 48)


def test_greedy_under_preemption_equals_the_engine_without_it(baseline_ids):
    """A pool of 40 blocks of 4 tokens cannot hold four 60-token sequences: preemption. (The
    four prompts share their first step, as a GPU packs them, ``step_overhead_tokens=0``: on
    a CPU's default they start one after another, and the pool is then just enough.)"""
    options = OPTIONS | {"num_blocks": 40, "max_model_len": 128, "step_overhead_tokens": 0}
    llm = LLM(TINY_MODEL, speculative_config=ngram(3), **options)
    assert token_ids(llm) == baseline_ids
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 40


def test_draft_model_equal_to_the_target_accepts_everything(baseline_ids):
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": TINY_MODEL}
    llm = LLM(TINY_MODEL, speculative_config=spec, **OPTIONS)
    assert token_ids(llm) == baseline_ids
    stats = llm.engine.stats
    assert stats.spec_acceptance_rate == 1.0 and stats.spec_mean_accepted_length > 3
    runner = llm.engine.runner
    assert isinstance(runner, SpeculativeRunner) and runner.model is runner.runner.model
    assert runner.proposer.states == {}  # draft blocks freed with the sequences
    assert runner.proposer.block_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("k", [1, 5])
def test_a_partly_right_draft_model_keeps_greedy_exact(k, layer_skip_draft, baseline_ids):
    spec = {"method": "draft_model", "num_speculative_tokens": k, "model": str(layer_skip_draft),
            "min_acceptance_rate": 0.0}
    llm = LLM(TINY_MODEL, speculative_config=spec, **OPTIONS)
    assert token_ids(llm) == baseline_ids
    assert 0 < llm.engine.stats.spec_acceptance_rate < 1


def test_draft_model_under_preemption(layer_skip_draft, baseline_ids):
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(layer_skip_draft),
            "min_acceptance_rate": 0.0}
    llm = LLM(TINY_MODEL, speculative_config=spec, **OPTIONS | {"num_blocks": 40, "max_model_len": 128})
    assert token_ids(llm) == baseline_ids
    assert llm.engine.stats.num_preemptions > 0


# ----------------------------------------------------------------------------- everything else


def _completions(llm: LLM, prompts, params):
    return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
             for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, stop=["\n"]),
    SamplingParams(temperature=0, max_tokens=40, stop=["(", "range"], include_stop_str_in_output=True),
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[198]),
    SamplingParams(temperature=0, max_tokens=20, min_tokens=8, n=2, logprobs=2),
], ids=["stop-newline", "stop-included", "max-tokens", "stop-token", "n-logprobs-min-tokens"])
def test_stops_lengths_n_and_logprobs_equal_the_engine_without_speculation(params, baseline):
    llm = LLM(TINY_MODEL, speculative_config=ngram(4), **OPTIONS)
    got, want = _completions(llm, PROMPTS[:3], params), _completions(baseline, PROMPTS[:3], params)
    for g, w in zip(got, want):
        for (gt, gi, gf, gs, gl), (wt, wi, wf, ws, wl) in zip(g, w):
            assert (gt, gi, gf, gs) == (wt, wi, wf, ws)
            if wl is not None:
                assert [list(e) for e in gl] == [list(e) for e in wl]
                flat = lambda entries: [v for e in entries for v in e.values()]
                assert flat(gl) == pytest.approx(flat(wl), abs=1e-4)


def test_a_seeded_sampled_request_repeats_run_after_run():
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=32, seed=11, ignore_eos=True)
    runs = [token_ids(LLM(TINY_MODEL, speculative_config=ngram(3), **OPTIONS), PROMPTS[:2], params)
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_sampling_with_top_k_1_through_the_rejection_rule_is_greedy(baseline_ids):
    """top_k=1 makes the target distribution one-hot: the rejection rule must then emit
    exactly the greedy tokens (a wrong residual or acceptance would not)."""
    llm = LLM(TINY_MODEL, speculative_config=ngram(3), **OPTIONS)
    params = SamplingParams(temperature=0.7, top_k=1, max_tokens=48, ignore_eos=True, seed=3)
    assert token_ids(llm, PROMPTS[:2], params) == baseline_ids[:2]
    assert llm.engine.stats.num_spec_accepted_tokens > 0


def test_streaming_deltas_add_up_and_may_carry_several_tokens():
    llm = LLM(TINY_MODEL, speculative_config=ngram(5), **OPTIONS)
    engine = llm.engine
    engine.add_request("s", PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, stop=["):"]))
    text, ids, widest = "", [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            text, ids = text + c.delta_text, ids + c.delta_token_ids
            widest = max(widest, len(c.delta_token_ids))
    assert (text, ids) == (c.text, c.token_ids) and widest > 1


def test_prompt_logprobs_of_a_prefill_in_a_verification_step(baseline):
    """A prompt chunk that runs in the same pass as a verification keeps its prompt
    logprobs (the draft rows spliced in before it shift its rows)."""
    llm = LLM(TINY_MODEL, speculative_config=ngram(3), **OPTIONS)
    engine, stats = llm.engine, llm.engine.stats
    engine.add_request("a", PROMPTS[1], GREEDY)
    engine.step()  # a's prefill
    a = engine.requests["a"].seqs[0]
    while not ngram_propose(a.token_ids, 3, 4, 1):  # until a proposes in the next step
        engine.step()
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    engine.add_request("b", PROMPTS[3], params)
    before = stats.num_spec_verifications
    final = {out.request_id: out for out in engine.step() if out.finished}  # b's prefill
    assert stats.num_spec_verifications > before, "b's prefill ran without a verification"
    while engine.has_unfinished_requests():
        final |= {out.request_id: out for out in engine.step() if out.finished}
    want = baseline.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    got = final["b"]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt_logprobs[0] is None and want.prompt_logprobs[0] is None
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
    for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert list(g) == list(w) and list(g.values()) == pytest.approx(list(w.values()), abs=1e-4)


def test_the_prefix_cache_never_serves_a_rejected_tokens_keys(baseline):
    """Continue each finished sequence (prompt + output as a new prompt): its blocks are
    prefix hits, and a block registered with a rejected token's keys would change the text."""
    llm = LLM(TINY_MODEL, speculative_config=ngram(5), **OPTIONS)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    again = [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids} for o in first]
    hits_before = llm.engine.stats.num_prefix_cached_tokens
    assert token_ids(llm, again) == token_ids(baseline, again)
    assert llm.engine.stats.num_prefix_cached_tokens > hits_before


def _count_ordinary_steps(monkeypatch, llm: LLM, calls: list) -> None:
    """Count the steps that the wrapped runner's own ``execute`` runs."""
    wrapped = llm.engine.runner.runner
    original = wrapped.execute
    monkeypatch.setattr(wrapped, "execute",
                        lambda plan: calls.append(len(plan.scheduled)) or original(plan))


def test_large_batches_and_no_match_take_the_ordinary_path(monkeypatch):
    """At disable_by_batch_size scheduled sequences, and when no proposal fits, every step
    goes through the wrapped runner's own `execute` (the compiled decode step where compiling
    is on)."""
    llm = LLM(TINY_MODEL, speculative_config=ngram(3, disable_by_batch_size=2), **OPTIONS)
    calls = []
    _count_ordinary_steps(monkeypatch, llm, calls)
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert llm.engine.stats.num_spec_proposed_tokens == 0
    assert len(calls) == llm.engine.stats.num_steps
    # no n-gram match: a prompt of distinct tokens and a 5-token minimum match
    llm = LLM(TINY_MODEL, speculative_config=ngram(3, prompt_lookup_min=5, prompt_lookup_max=5),
              **OPTIONS)
    calls.clear()
    _count_ordinary_steps(monkeypatch, llm, calls)
    llm.generate({"prompt_token_ids": list(range(10, 30))},
                 SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert llm.engine.stats.num_spec_proposed_tokens == 0 and len(calls) == 3


def test_nan_logits_in_a_verification_scrub_the_draft_rows_blocks_too(monkeypatch):
    """A request whose verification logits are NaN fails alone, and every block its table
    held in that step, those grown for its draft rows included (the same pass wrote their
    keys and values), is zeroed before it goes back to the pool."""
    llm = LLM(TINY_MODEL, speculative_config=ngram(5), **OPTIONS)
    engine, runner = llm.engine, llm.engine.runner
    tables, needed, zeroed = [], [], []
    accept, zero_blocks = runner.accept, runner.runner.zero_blocks

    def nan_accept(seq, draft, logits):
        tables.append(list(seq.block_table))
        needed.append(engine.block_manager.blocks_needed(seq.num_computed_tokens + 1))
        return accept(seq, draft, logits * float("nan"))

    monkeypatch.setattr(runner, "accept", nan_accept)
    monkeypatch.setattr(runner.runner, "zero_blocks",
                        lambda ids: zeroed.extend(ids) or zero_blocks(ids))
    engine.add_request("r", PROMPTS[1], GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and "NaN" in outs[-1].error
    assert len(tables) == 1 and len(tables[0]) > needed[0]  # it had draft blocks
    assert set(tables[0]) <= set(zeroed)
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_low_acceptance_pauses_a_sequence(seeded_draft):
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(seeded_draft),
            "min_acceptance_rate": 0.99, "acceptance_window": 2, "pause_steps": 1000}
    llm = LLM(TINY_MODEL, speculative_config=spec, **OPTIONS)
    llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert llm.engine.stats.num_spec_verifications <= 2


# ----------------------------------------------------------------------------- bench and server


def test_the_repetitive_workload_repeats_a_span():
    from minivllm.bench.metrics import make_workload

    requests = make_workload("repetitive", 3, 40, 8, vocab_size=1000)
    for r in requests:
        ids = r.prompt_token_ids
        assert len(ids) == 40 and r.output_len == 8 and ids[:10] * 4 == ids


def test_a_bench_variant_and_the_server_flag_carry_a_speculative_config():
    from minivllm.bench.engines import parse_engine_spec
    from minivllm.bench.harness import stats_delta
    from minivllm.bench.servers import serve_flags
    from minivllm.engine import LLMEngine
    from minivllm.server.cli import engine_config, parse_args

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    name, _, options = parse_engine_spec(f"minivllm[compile=False,speculative_config="
                                         f"{json.dumps(spec)}]")
    assert (name, options) == ("minivllm", {"compile": False, "speculative_config": spec})
    flags = serve_flags({"speculative_config": spec})
    assert engine_config(parse_args(flags)).speculative_config == json.dumps(spec)
    bad = '{"method": "eagle", "num_speculative_tokens": 2}'
    config = engine_config(parse_args(["--speculative-config", bad, "--no-compile"]))
    with pytest.raises(ValueError, match="unknown speculative method"):  # at start-up
        LLMEngine(config)
    delta = stats_delta({"num_spec_proposed_tokens": 4, "num_spec_accepted_tokens": 2,
                         "num_spec_verifications": 2},
                        {"num_spec_proposed_tokens": 14, "num_spec_accepted_tokens": 10,
                         "num_spec_verifications": 4})
    assert delta["spec_acceptance_rate"] == 0.8 and delta["spec_mean_accepted_length"] == 5.0


def test_compiled_verification_is_exact_and_never_recompiles(compiled_random, random_engine_model,
                                                             monkeypatch):
    """With the decode step compiled (Milestone 7), a verification of decodes only runs through
    the compiled decode graph — row i of a speculating sequence as a decode of its own — and
    stays token for token transformers' greedy output, under preemption, without compiling a
    new graph; steps with a prefill chunk keep the eager pass."""
    from torch._dynamo.utils import counters

    engine = compiled_random.engine
    wrapped = engine.runner
    monkeypatch.setattr(engine, "runner", SpeculativeRunner(wrapped, engine.block_manager,
                                                            ngram(3, prompt_lookup_min=1)))
    compiled_rows, eager_passes = [], []
    decoder = engine.runner.decoder
    assert decoder is not None and decoder is wrapped.decoder
    logits, attention = decoder.logits, wrapped.attention_cls
    monkeypatch.setattr(decoder, "logits",
                        lambda batch: compiled_rows.append(len(batch.input_ids)) or logits(batch))
    monkeypatch.setattr(wrapped, "attention_cls",  # built by every eager pass, never compiled
                        lambda *a: eager_passes.append(1) or attention(*a))
    # repeated spans: the random model's greedy text loops, so the n-gram lookup keeps hitting
    prompts = [[11, 12, 13, 14] * 3, [40, 41, 42] * 4 + [40], [300, 301] * 5, [7, 8, 9] * 4]
    graphs_before = counters["stats"]["unique_graphs"]
    stats_before = (engine.stats.num_spec_verifications, engine.stats.num_spec_accepted_tokens,
                    engine.stats.num_preemptions)
    outs = compiled_random.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                    use_tqdm=False)
    assert counters["stats"]["unique_graphs"] == graphs_before, "verification recompiled"
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == hf_greedy(random_engine_model, prompt, 24), f"prompt {i}"
    assert engine.stats.num_spec_verifications > stats_before[0]
    assert engine.stats.num_spec_accepted_tokens > stats_before[1]
    assert engine.stats.num_preemptions > stats_before[2]  # 12 blocks of 8 for four sequences
    assert max(compiled_rows) > len(prompts)  # some compiled step carried draft rows
    assert eager_passes  # the prefills (and any step mixing one in) stay eager
    assert engine.block_manager.num_free_blocks == engine.num_blocks  # nothing leaked


def test_a_grammar_request_beside_a_speculating_one_keeps_its_grammar():
    """A request with structured outputs never speculates, but it can share a verification
    step with one that does: its single row must still get its grammar's token mask."""
    import re

    from minivllm.sampling import StructuredOutputsParams

    llm = LLM(TINY_MODEL, speculative_config=ngram(3, prompt_lookup_min=1), **OPTIONS)
    regex = r"([0-9]{3}-){6}[0-9]{3}"  # long enough to share many steps with the others
    constrained = SamplingParams(temperature=0, max_tokens=48,
                                 structured_outputs=StructuredOutputsParams(regex=regex))
    outs = llm.generate(PROMPTS[:2] * 2, [GREEDY, constrained, GREEDY, constrained],
                        use_tqdm=False)
    assert llm.engine.stats.num_spec_verifications > 0  # the greedy ones did speculate
    for out in outs[1::2]:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
