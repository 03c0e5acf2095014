"""Milestone 3: continuous batching, sampling and the offline LLM API
(minivllm/scheduler.py, sampling.py, engine.py; notebook 03_continuous_batching).
"""

from __future__ import annotations

import random
import resource
import sys
import threading
from collections import Counter

import pytest
import torch
from frame_room import under_frame_room
from hf_oracle import hf_greedy, hf_logprobs

from minivllm import LLM, SamplingParams
from minivllm.engine import FRAME_ROOM_SLOTS, call_with_frame_room
from minivllm.kv_cache import BlockManager
from minivllm.sampling import Sampler, greedy_tokens
from minivllm.scheduler import RunnerOutput, Scheduler, Sequence, SequenceStatus

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _random_prompts(seed: int, count: int, max_len: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def _all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == llm.engine.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_many_prompts_with_preemption_and_chunking_match_transformers(random_engine_model):
    """24 prompts, at most 4 running, a 9-block pool and a 24-token step budget: prompts are
    chunked, sequences are preempted and recomputed, and every output must still equal
    transformers' greedy decode, prompt by prompt."""
    prompts = _random_prompts(0, 24, 60)
    llm = LLM(str(random_engine_model), block_size=8, num_blocks=12, max_model_len=96,
              max_num_seqs=4, max_num_batched_tokens=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=20, **GREEDY))
    stats = llm.engine.stats
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert any(len(p) > 24 for p in prompts) and stats.max_batched_tokens == 24
    assert stats.max_batch_size <= 4
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == hf_greedy(random_engine_model, prompt, 20), f"prompt {i}"
        assert out.outputs[0].finish_reason == "length"
    assert _all_blocks_free(llm)


def test_call_with_frame_room_calls_through_one_large_frame():
    def fn(a, b):
        caller = sys._getframe(1).f_code
        return a + b, caller.co_nlocals, caller.co_code

    total, nlocals, bytecode = call_with_frame_room(fn, 2, 3)
    assert total == 5 and nlocals >= FRAME_ROOM_SLOTS
    assert len(bytecode) < 100  # the slots are declared, never assigned: nothing runs per call
    with pytest.raises(KeyError, match="raised inside"):
        call_with_frame_room(lambda: {}["raised inside"])


def _faults_per_round(loop_depth: int, rounds: int = 200) -> float:
    """Minor page faults per call of a callee two frames deep, made ``rounds`` times by a loop that
    sits ``loop_depth`` small frames above where it started (this thread's faults only)."""
    def leaf():
        return 1

    def middle():
        return leaf() + leaf()

    def loop():
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(rounds):
            middle()
        return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / rounds

    def down(n):
        return loop() if n == 0 else down(n - 1)

    return down(loop_depth)


@pytest.mark.skipif(sys.version_info < (3, 11) or not sys.platform.startswith("linux"),
                    reason="CPython keeps frames in mapped chunks from 3.11; RUSAGE_THREAD is Linux")
def test_a_loop_started_from_the_frame_room_maps_no_frame_chunks():
    """Guards the cost ``call_with_frame_room`` removes: a loop whose callees straddle the end
    of a chunk of CPython's frame stack maps, faults in and unmaps a chunk on every call (an
    8-row decode step took ~100 such faults). Scanned over the loop's depth in a fresh
    thread, some depth straddles the end of the thread's first chunk; from the frame room no
    depth does. Page faults are counted, not timed."""
    depths = range(0, 400, 3)
    found: dict[str, list[float]] = {}

    def scan():
        found["bare"] = [_faults_per_round(d) for d in depths]
        found["room"] = call_with_frame_room(lambda: [_faults_per_round(d) for d in depths])

    thread = threading.Thread(target=scan)
    thread.start()
    thread.join()
    assert max(found["bare"]) >= 1.0, "no depth straddled a chunk: nothing to compare with"
    assert max(found["room"]) < 0.1, found["room"]


def test_generate_steps_from_the_frame_room(tiny_model):
    llm = LLM(str(tiny_model), num_blocks=64, max_model_len=128, compile=False)
    seen = []
    real_step = llm.engine.step

    def step():
        seen.append(under_frame_room())
        return real_step()

    llm.engine.step = step
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert seen and all(seen)


def test_cpu_engine_steps_512_tokens_by_default(tiny_model):
    """Guards: the step's token budget that EngineConfig leaves to the device not reaching the
    scheduler (None there would admit nothing), and a CPU engine taking a GPU's 2048-token
    step: a wave of 4 prompts of 300 tokens is prefilled 512 tokens a step, so the first
    prompts get their first token steps before the last. (Prompts pack as a GPU packs them,
    ``step_overhead_tokens=0``: this is the budget's test; the next ones weigh packing.)"""
    llm = LLM(str(tiny_model), device="cpu", compile=False, max_model_len=512,
              step_overhead_tokens=0)
    engine = llm.engine
    assert engine.config.max_num_batched_tokens == 512
    assert engine.scheduler.max_num_batched_tokens == 512
    for i, prompt in enumerate(_random_prompts(1, 4, 1)):
        engine.add_request(str(i), {"prompt_token_ids": (prompt * 300)[:300]},
                           SamplingParams(max_tokens=4, **GREEDY))
    first_token_step, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        planned = engine.scheduler.max_num_batched_tokens
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_token_step.setdefault(out.request_id, step)
        assert engine.stats.max_batched_tokens <= planned
    assert engine.stats.max_batched_tokens == 512  # 1200 prompt tokens: full 512-token steps
    # step 1: prompt 0 and 212 tokens of 1; step 2: a decode, 1's 88, 2's 300, 123 of 3
    assert sorted(first_token_step.values()) == [1, 2, 2, 3], first_token_step


def _first_plans(lengths: list[int], overhead: int, budget: int = 512,
                 cached: int = 0) -> list[list[tuple[int, int]]]:
    """The plans ([(seq id, new tokens)]) of a scheduler until every prompt of ``lengths``
    (arriving together) has started, a stand-in model sampling token 7; with ``cached`` > 0 the
    prompts share their first ``cached`` tokens, which a finished request put in the cache."""
    bm = BlockManager(num_blocks=1024, block_size=16, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=64, max_num_batched_tokens=budget,
                      max_model_len=4096, step_overhead_tokens=overhead)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def step() -> list[tuple[int, int]]:  # schedule, then "sample" 7 where a row samples
        plan = sched.schedule()
        sched.update(plan, RunnerOutput(token_ids={
            s.seq_id: [7] for s, n in plan.scheduled if s.num_computed_tokens + n == s.num_tokens}))
        return [(s.seq_id, n) for s, n in plan.scheduled]

    shared = list(range(1000, 1000 + cached))
    if cached:  # one request computes the shared prefix and finishes
        sched.add(Sequence(999, "warm", shared + [5], params))
        while sched.has_unfinished():
            step()
    seqs = [Sequence(i, f"r{i}", shared + [i * 100 + j for j in range(n - cached)], params)
            for i, n in enumerate(lengths)]
    for seq in seqs:
        sched.add(seq)
    plans = []
    while sched.waiting:
        plans.append(step())
    return plans


def test_prompts_pack_into_a_step_only_where_it_shortens_first_token_waits():
    """Guards: a CPU scheduler packing every waiting prompt into one step, so that each waits
    for all of them before its first token (two 128-token prompts: both at the end of one
    1.3 s step, instead of 0.64 and 1.3 s), and the opposite mistake: short prompts, a long
    queue, or a cached prefix each deserve to share a step. Counts worked by hand from the
    rule ``m * n <= (1 + k) * (overhead + rows)`` (``Scheduler._joins_step``)."""
    # 0 (a GPU's default): everything packs up to the budget, as before the rule
    assert _first_plans([128, 128], overhead=0) == [[(0, 128), (1, 128)]]
    # two long prompts: 128 > 1 x (16 + 1) -> one after the other
    assert _first_plans([128, 128], overhead=16) == [[(0, 128)], [(0, 1), (1, 128)]]
    # eight: the second would cost 128 against 7 x 17 = 119 -> one at a time
    plans = _first_plans([128] * 8, overhead=16)
    assert [sum(n > 1 for _, n in p) for p in plans] == [1] * 8
    # thirty-two: packed to the budget while the queue is long (step 1: 128 <= 31 x 17,
    # 256 <= 30 x 18, 384 <= 29 x 19, then the budget), one at a time once it is short
    plans = _first_plans([128] * 32, overhead=16)
    assert [sum(n for _, n in p) for p in plans[:5]] == [512] * 5
    assert [sum(n > 1 for _, n in p) for p in plans[-3:]] == [1, 1, 1]
    # short prompts pack: 8 <= 3 x 17, 16 <= 2 x 18, 24 <= 1 x 19 fails -> three, then one
    assert _first_plans([8, 8, 8, 8], overhead=16) == [[(0, 8), (1, 8), (2, 8)],
                                                       [(0, 1), (1, 1), (2, 1), (3, 8)]]
    # a prompt counts only its tokens to compute: 128 tokens of which 112 are cached -> 16
    # (1 x 16 <= 1 x 17), where uncached it waits
    assert _first_plans([128, 128], overhead=16, cached=112) == [[(0, 16), (1, 16)]]


def test_cpu_engine_weighs_packing_by_default(tiny_model):
    """Guards: the device's default overhead not reaching the scheduler. Two long prompts sent
    together to a CPU engine get their first tokens in different steps, and the same tokens
    as when they share one."""
    prompts = [(p * 100)[:100] for p in _random_prompts(3, 2, 1)]
    tokens = {}
    for overhead in (None, 0):
        llm = LLM(str(tiny_model), device="cpu", compile=False, step_overhead_tokens=overhead)
        engine = llm.engine
        assert engine.scheduler.step_overhead_tokens == (16 if overhead is None else 0)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=4, **GREEDY))
        first_token_step, step, out_tokens = {}, 0, {}
        while engine.has_unfinished_requests():
            step += 1
            for out in engine.step():
                if out.outputs[0].token_ids:
                    first_token_step.setdefault(out.request_id, step)
                out_tokens[out.request_id] = list(out.outputs[0].token_ids)
        assert sorted(first_token_step.values()) == ([1, 2] if overhead is None else [1, 1])
        tokens[overhead] = out_tokens
    assert tokens[None] == tokens[0]


def test_bundled_model_batch_matches_transformers(tiny_model):
    from minivllm.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_model)
    texts = ["import sys\n", "def main():\n", "for i in range(10):\n    ", "x = [", "# Copyright",
             "class Config:\n    \"\"\"", "return", "if __name__ == '__main__':\n"]
    llm = LLM(str(tiny_model), block_size=16, num_blocks=64, max_num_seqs=3,
              max_num_batched_tokens=8, max_model_len=512)
    outs = llm.generate(texts, SamplingParams(max_tokens=16, temperature=0.0))
    for text, out in zip(texts, outs):
        expected = hf_greedy(tiny_model, tok.encode(text), 16, llm.engine.eos_token_ids)
        assert out.outputs[0].token_ids == expected, text
    assert _all_blocks_free(llm)


def test_seeded_sampling_is_independent_of_the_batch(random_engine_model):
    llm = LLM(str(random_engine_model), block_size=4, num_blocks=400, max_model_len=128)
    prompt = {"prompt_token_ids": [5, 17, 300, 42, 7]}
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=24,
                            ignore_eos=True)
    alone = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    noise = [{"prompt_token_ids": p} for p in _random_prompts(1, 7, 30)]
    busy = llm.generate(noise[:4] + [prompt] + noise[4:],
                        [SamplingParams(temperature=1.0, max_tokens=30)] * 4 + [seeded]
                        + [SamplingParams(temperature=0.5, max_tokens=10)] * 3)
    assert busy[4].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=99, max_tokens=24,
                                ignore_eos=True)
    assert llm.generate(prompt, other_seed)[0].outputs[0].token_ids != alone


def test_abort_frees_blocks_at_once(random_engine_model):
    llm = LLM(str(random_engine_model), block_size=4, num_blocks=64, max_model_len=128)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=50))
    engine.add_request("b", {"prompt_token_ids": list(range(50, 60))}, SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.num_blocks
    assert engine.abort_request("a") and engine.abort_request("b")
    assert not engine.abort_request("a")
    assert not engine.has_unfinished_requests() and _all_blocks_free(llm)
    assert engine.step() == []


def test_n_completions_share_the_prompt_blocks(random_engine_model):
    llm = LLM(str(random_engine_model), block_size=4, num_blocks=128, max_model_len=128)
    prompt = {"prompt_token_ids": list(range(10, 31))}
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12,
                                              ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert llm.engine.stats.num_prefix_cached_tokens == 2 * 20  # siblings reuse 5 full blocks
    assert _all_blocks_free(llm)


def test_stop_conditions(random_engine_model):
    llm = LLM(str(random_engine_model), block_size=4, num_blocks=128, max_model_len=64)
    prompt = {"prompt_token_ids": [11, 22, 33, 44]}
    free_run = llm.generate(prompt, SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    target = free_run.token_ids[5]
    first = free_run.token_ids.index(target)
    by_token = llm.generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=[target],
                                                   **GREEDY))[0].outputs[0]
    assert by_token.token_ids == free_run.token_ids[:first + 1]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", target)
    late = llm.generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=[target],
                                               min_tokens=first + 2, **GREEDY))[0].outputs[0]
    assert len(late.token_ids) > first + 1 and target not in late.token_ids[:first + 2]
    stop_text = free_run.text[len(free_run.text) // 2:][:3]
    if stop_text:
        by_string = llm.generate(prompt, SamplingParams(max_tokens=30, stop=[stop_text],
                                                        **GREEDY))[0].outputs[0]
        assert by_string.finish_reason == "stop" and by_string.stop_reason == stop_text
        assert by_string.text == free_run.text[:free_run.text.index(stop_text)]
    to_limit = llm.generate(prompt, SamplingParams(max_tokens=70, **GREEDY))[0].outputs[0]
    assert to_limit.finish_reason == "length" and len(to_limit.token_ids) == 64 - 4


def test_eos_ends_a_request_unless_ignored(tiny_model):
    llm = LLM(str(tiny_model), num_blocks=64, max_model_len=512)
    chat = [{"role": "user", "content": "What does os.path.join do?"}]
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    assert out.text and "<|im_end|>" not in out.text
    ignored = llm.chat(chat, SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 5,
                                            ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length"


def test_streamed_deltas_add_up_to_the_text(random_engine_model):
    llm = LLM(str(random_engine_model), block_size=4, num_blocks=128, max_model_len=128)
    engine = llm.engine
    engine.add_request("s", {"prompt_token_ids": [100, 200, 300]},
                       SamplingParams(max_tokens=25, stop=["zz"], **GREEDY))
    text, ids, final = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].delta_text
            ids += out.outputs[0].delta_token_ids
            final = out
    assert text == final.outputs[0].text and ids == final.outputs[0].token_ids


def test_logprobs_match_transformers(random_engine_model):
    llm = LLM(str(random_engine_model), block_size=4, num_blocks=128, max_model_len=128)
    prompt = [9, 8, 7, 6, 5]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=4, logprobs=3, **GREEDY))[0].outputs[0]
    ref = hf_logprobs(random_engine_model, prompt + out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[token] - float(row[token])) < 1e-4
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= 4
    assert abs(out.cumulative_logprob - sum(e[t] for t, e in zip(out.token_ids, out.logprobs))) < 1e-4


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"n": 0}, "n must"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"logprobs": 21}, "logprobs"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_invalid_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_invalid_prompts_raise_and_leave_nothing_behind(random_engine_model):
    llm = LLM(str(random_engine_model), block_size=4, num_blocks=64, max_model_len=32)
    for bad in ({"prompt_token_ids": []}, {"prompt_token_ids": [1] * 32},
                {"prompt_token_ids": [10**6]}):
        with pytest.raises(ValueError):
            llm.generate([{"prompt_token_ids": [1, 2]}, bad], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests() and _all_blocks_free(llm)


def test_sampler_filters():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    sampler = Sampler()
    p = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.4),
         SamplingParams(temperature=1.0, min_p=0.9), SamplingParams(temperature=0.0)]
    for _ in range(20):
        assert sampler(logits, p, [None] * 4).token_ids.tolist() == [0, 0, 0, 0]
    two = [SamplingParams(temperature=1.0, top_p=0.7)] * 4  # keeps tokens 0 and 1 only
    seen = {t for _ in range(50) for t in sampler(logits, two, [None] * 4).token_ids.tolist()}
    assert seen == {0, 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tokens_is_argmax_with_its_ties_nan_and_inf(dtype):
    """greedy_tokens reads max(dim=-1) for speed; it must pick argmax's index on every row,
    including ties (the first), NaN (ranked highest) and +/-inf."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(12, 5000, generator=g) * 3).to(dtype)
    top = x[1].max() + 1
    x[1, 10] = x[1, 20] = x[1, 4999] = top  # a three-way tie: the first wins
    x[2] = 0  # all equal: index 0
    x[3, 100] = float("nan")  # NaN is the maximum
    x[4, 7] = x[4, 9] = float("nan")  # the first NaN
    x[5, 200] = x[5, 300] = float("inf")
    x[6] = float("-inf")
    x[7, -1] = 1000  # the last column
    got, want = greedy_tokens(x), x.argmax(dim=-1)
    assert torch.equal(got, want), (got, want)
    assert got[[1, 2, 3, 4, 5, 6, 7]].tolist() == [10, 0, 100, 7, 200, 0, 4999]


def test_sampler_draws_from_the_softmax():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log().repeat(4000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    tokens = Sampler()(logits, [SamplingParams(temperature=1.0)] * 4000, gens).token_ids.tolist()
    freq = Counter(tokens)
    for token, p in enumerate(probs.tolist()):
        assert abs(freq[token] / 4000 - p) < 0.03


# ----------------------------------------------------------------------------- scheduler alone


def test_scheduler_policy_with_a_mock_model():
    """Drive the Scheduler directly, standing in for the model with a fixed next token, and
    check every step's invariants: budgets, FCFS admission, newest-first preemption, and that
    blocks held + blocks free always add up to the pool."""
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=10, max_model_len=40)
    lengths = [9, 3, 14, 5, 2, 7]
    seqs = [Sequence(i, f"r{i}", [1] * n, SamplingParams(max_tokens=6, ignore_eos=True))
            for i, n in enumerate(lengths)]
    for seq in seqs:
        sched.add(seq)
    admitted, preempted_ids, steps = [], [], 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 200, "scheduler livelock"
        running_before = list(sched.running)
        plan = sched.schedule()
        assert plan.num_batched_tokens <= 10 and len(sched.running) <= 3
        for victim in plan.preempted:
            assert victim is running_before[len(running_before) - 1 - plan.preempted.index(victim)]
            preempted_ids.append(victim.seq_id)
        admitted += [s.seq_id for s in plan.admitted if s.num_preemptions == 0]
        held = sum(len(s.block_table) for s in sched.running)
        assert held + bm.num_free_blocks == 10
        sampled = {s.seq_id: [7] for s, n in plan.scheduled
                   if s.num_computed_tokens + n == s.num_tokens}
        sched.update(plan, RunnerOutput(token_ids=sampled))
    assert admitted == sorted(admitted), "admission must be first-come-first-served"
    assert preempted_ids, "a 10-block pool must force preemption here"
    assert all(s.status is SequenceStatus.FINISHED and s.num_output_tokens == 6 for s in seqs)
    assert bm.num_free_blocks == 10


def test_generate_shows_a_progress_bar_by_default(tiny_model, monkeypatch):
    """Guards: offline generation running silently for minutes (vLLM's LLM.generate shows a
    bar unless use_tqdm=False). The suite turns the bars themselves off (TQDM_DISABLE=1,
    which tqdm reads once, at import), so this test watches for the bar being opened."""
    from minivllm import engine

    bars = []
    real = engine._progress
    monkeypatch.setattr(engine, "_progress", lambda total: bars.append(total) or real(total))
    llm = LLM(str(tiny_model), num_blocks=64, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(["import os", "def f("], params)
    assert bars == [2]
    llm.generate(["import os"], params, use_tqdm=False)
    llm.chat([{"role": "user", "content": "hi"}], params)
    assert bars == [2, 1]
