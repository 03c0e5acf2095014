"""Graders for notebook 03_continuous_batching: the scheduler, the sampler and the engine.

Each ``check_*`` takes the object the learner defined in the notebook, runs it on hand-built
cases whose answers are written out below (not computed by the package, which the learner's
export overwrites), checks invariants, prints one ``passed(...)`` line or raises an
``AssertionError`` that says what differs. A stub (``NotImplementedError``) fails too.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import random
from unittest import mock

from .grading import assert_equal, exercise, passed, require

INF = float("inf")


# ----------------------------------------------------------------------------- the scheduler

# Scenario A: 6 prompts (lengths 9, 3, 14, 5, 2, 7), 6 output tokens each, at most 3 running,
# 10 tokens per step, 10 blocks of 4 tokens, no prefix caching. The model is a stand-in that
# always "samples" token 7. Per step: [(seq id, new tokens)], [preempted], [admitted].
_TRACE_A = [
    ([(0, 9), (1, 1)], [], [0, 1]),
    ([(0, 1), (1, 2), (2, 7)], [], [2]),
    ([(0, 1), (1, 1), (2, 7)], [], []),
    ([(0, 1), (1, 1), (2, 1)], [], []),
    ([(0, 1), (1, 1), (2, 1)], [], []),
    ([(0, 1), (1, 1)], [2], []),  # seq 2 needs a 5th block: the newest one is preempted
    ([(1, 1), (2, 9)], [], [2]),  # ... and recomputed (prompt + its 4 outputs) in chunks
    ([(2, 8), (3, 2)], [], [3]),
    ([(2, 1), (3, 3), (4, 2)], [], [4]),
    ([(2, 1), (3, 1), (4, 1)], [], []),
    ([(3, 1), (4, 1), (5, 7)], [], [5]),
    ([(3, 1), (4, 1), (5, 1)], [], []),
    ([(3, 1), (4, 1), (5, 1)], [], []),
    ([(3, 1), (4, 1), (5, 1)], [], []),
    ([(5, 1)], [], []),
    ([(5, 1)], [], []),
]

# Scenario B (prefix caching on, 6 tokens per step): request "a" asks for n=2, so seq 1 is
# seq 0's sibling and waits until seq 0's prompt is in the cache; seq 2 ("c") queues behind
# it (FCFS). Admitted entries are (seq id, prompt tokens found in the prefix cache).
_TRACE_B = [
    ([(0, 6)], [], [(0, 0)]),
    ([(0, 4)], [], []),
    ([(0, 1), (1, 2), (2, 3)], [], [(1, 8), (2, 0)]),
    ([(0, 1), (1, 1), (2, 1)], [], []),
    ([(1, 1), (2, 1)], [], []),
]

# Scenario C (packing prompts, step_overhead_tokens=1, 20 tokens per step): four prompts of
# 8, 8, 2 and 8 tokens arrive together, 2 output tokens each. Seq 1 does not join seq 0's step:
# it would delay seq 0 by 8 token-times, while waiting costs it and the two behind it one step
# of overhead + 1 row each (3 x 2 = 6). In the next step seq 2 (2 tokens) joins seq 1 (2 <= 2 x
# (1 + 2 rows) = 6), seq 3 does not (2 x 8 = 16 > 1 x (1 + 3) = 4).
_TRACE_C = [
    ([(0, 8)], [], [0]),
    ([(0, 1), (1, 8), (2, 2)], [], [1, 2]),
    ([(1, 1), (2, 1), (3, 8)], [], [3]),
    ([(3, 1)], [], []),
]


def _plan_summary(plan, with_cached: bool = False):
    admitted = [(s.seq_id, s.num_cached_tokens) if with_cached else s.seq_id for s in plan.admitted]
    return ([(s.seq_id, n) for s, n in plan.scheduled], [s.seq_id for s in plan.preempted], admitted)


def _run_scheduler(sched, seqs, bm, *, num_blocks: int, sharing: bool, trace, with_cached=False):
    """Drive ``sched`` with a stand-in model, checking the invariants at every step."""
    from minivllm.scheduler import RunnerOutput

    what = "Exercise 3.1 (Scheduler.schedule)"
    first_admitted: list[int] = []
    for step, expected in enumerate(trace + [None] * 3):
        if not sched.has_unfinished():
            break
        require(expected is not None, what, f"still unfinished after {len(trace)} steps "
                f"(running {sched.running}, waiting {list(sched.waiting)})",
                "does every running sequence get its tokens while the budget lasts?")
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        with exercise(what):
            plan = sched.schedule()
        require(plan is not None, what, "schedule() returned None; return the SchedulerOutput")
        where = f"step {step}"
        budget = sched.max_num_batched_tokens
        require(plan.num_batched_tokens <= budget, what,
                f"{where}: {plan.num_batched_tokens} tokens scheduled, budget {budget}",
                "each sequence gets min(tokens left to compute, budget left)")
        require(len(sched.running) <= sched.max_num_seqs, what,
                f"{where}: {len(sched.running)} sequences running, max_num_seqs "
                f"{sched.max_num_seqs}")
        victims = [s.seq_id for s in plan.preempted]
        newest = [s.seq_id for s in reversed(running_before)][:len(victims)]
        require(victims == newest, what,
                f"{where}: preempted {victims}, but the newest running sequences were {newest}",
                "preempt from the end of self.running (the most recently admitted)")
        require(not (plan.preempted and plan.admitted), what,
                f"{where}: admitted {[s.seq_id for s in plan.admitted]} in a step that "
                "preempted — the pool is short, so nothing new may start")
        queue = [s.seq_id for s in plan.preempted[::-1]] + [s.seq_id for s in waiting_before]
        got = [s.seq_id for s in plan.admitted]
        require(got == queue[:len(got)], what,
                f"{where}: admitted {got}, but the queue's head was {queue[:len(got) + 1]}",
                "admit from the front of self.waiting, first come first served")
        first_admitted += [i for i in got if i not in first_admitted]
        for seq, n in plan.scheduled:
            left = seq.num_tokens - seq.num_computed_tokens
            require(1 <= n <= left, what, f"{where}: seq {seq.seq_id} scheduled for {n} "
                    f"tokens but has {left} left to compute")
            require(len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + n, what,
                    f"{where}: seq {seq.seq_id} computes up to token "
                    f"{seq.num_computed_tokens + n} but its block table holds "
                    f"{len(seq.block_table)} blocks of {bm.block_size}",
                    "grow the block table before scheduling (bm.can_grow / bm.grow)")
        if not sharing:
            held = sum(len(s.block_table) for s in sched.running)
            require(held + bm.num_free_blocks == num_blocks, what,
                    f"{where}: blocks held by running sequences ({held}) + free "
                    f"({bm.num_free_blocks}) != pool ({num_blocks})",
                    "a preempted sequence must give its blocks back (self._preempt)")
        assert_equal(_plan_summary(plan, with_cached), expected, what=f"{what}, {where} "
                     "([(seq, new tokens)], [preempted], [admitted])")
        sampled = {s.seq_id: [7] for s, n in plan.scheduled
                   if s.num_computed_tokens + n == s.num_tokens}
        sched.update(plan, RunnerOutput(token_ids=sampled))
    require(first_admitted == sorted(first_admitted), what,
            f"first admissions in the order {first_admitted}: not first-come-first-served")
    require(all(s.is_finished for s in seqs), what, "not every sequence finished")
    require(bm.num_free_blocks == num_blocks, what,
            f"{bm.num_free_blocks} of {num_blocks} blocks free at the end")


def check_schedule(Scheduler, Sequence) -> None:
    """Exercise 3.1: replay two scripted scenarios step by step (budgets, FCFS admission,
    newest-first preemption, blocks held + free == pool, n>1 siblings wait for the cache)."""
    from minivllm.kv_cache import BlockManager
    from minivllm.sampling import SamplingParams

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=10, max_model_len=40)
    seqs = [Sequence(i, f"r{i}", [1] * n, params) for i, n in enumerate([9, 3, 14, 5, 2, 7])]
    for seq in seqs:
        sched.add(seq)
    _run_scheduler(sched, seqs, bm, num_blocks=10, sharing=False, trace=_TRACE_A)

    params = SamplingParams(max_tokens=3, ignore_eos=True)
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=6, max_model_len=40)
    a = Sequence(0, "a", list(range(10, 20)), params, 0)
    seqs = [a, Sequence(1, "a", list(range(10, 20)), params, 1, parent=a),
            Sequence(2, "c", [5, 6, 7], params)]
    for seq in seqs:
        sched.add(seq)
    _run_scheduler(sched, seqs, bm, num_blocks=12, sharing=True, trace=_TRACE_B, with_cached=True)

    params = SamplingParams(max_tokens=2, ignore_eos=True)
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=20, max_model_len=40,
                      step_overhead_tokens=1)
    seqs = [Sequence(i, f"r{i}", [1] * n, params) for i, n in enumerate([8, 8, 2, 8])]
    for seq in seqs:
        sched.add(seq)
    _run_scheduler(sched, seqs, bm, num_blocks=12, sharing=False, trace=_TRACE_C)
    passed("Exercise 3.1 (Scheduler.schedule)", f"{len(_TRACE_A)} + {len(_TRACE_B)} + "
           f"{len(_TRACE_C)} scripted steps: budgets, FCFS, newest-first preemption, chunked "
           "prefill, n>1 siblings, packing prompts")


# ----------------------------------------------------------------------------- retirement

# (description, SamplingParams kwargs, prompt length, earlier outputs, new token, expected).
# EOS is token 2, max_model_len is 12; ``check_stop`` sees the new token already appended.
_STOP_CASES = [
    ("a plain token", {"max_tokens": 5}, 3, [4], 9, None),
    ("EOS", {"max_tokens": 5}, 3, [4], 2, ("stop", None)),
    ("EOS with ignore_eos", {"max_tokens": 5, "ignore_eos": True}, 3, [4], 2, None),
    ("EOS as output token 2 with min_tokens=3", {"max_tokens": 5, "min_tokens": 3}, 3, [4], 2, None),
    ("EOS as output token 2 with min_tokens=2", {"max_tokens": 5, "min_tokens": 2}, 3, [4], 2,
     ("stop", None)),
    ("a stop token id", {"max_tokens": 5, "stop_token_ids": [9]}, 3, [4], 9, ("stop", 9)),
    ("a stop token id with ignore_eos", {"max_tokens": 5, "stop_token_ids": [9], "ignore_eos": True},
     3, [4], 9, ("stop", 9)),
    ("a stop token id before min_tokens", {"max_tokens": 5, "stop_token_ids": [9], "min_tokens": 4},
     3, [4], 9, None),
    ("output token 2 of max_tokens=3", {"max_tokens": 3}, 3, [4], 4, None),
    ("output token 3 of max_tokens=3", {"max_tokens": 3}, 3, [4, 4], 4, ("length", None)),
    ("EOS as the last allowed token", {"max_tokens": 2}, 3, [4], 2, ("stop", None)),
    ("EOS (ignored) as the last allowed token", {"max_tokens": 2, "ignore_eos": True}, 3, [4], 2,
     ("length", None)),
    ("token 12 of max_model_len=12", {"max_tokens": None}, 10, [4], 4, ("length", None)),
    ("token 11 of max_model_len=12", {"max_tokens": None}, 9, [4], 4, None),
    ("no max_tokens", {"max_tokens": None}, 3, [4, 4, 4], 4, None),
]


def check_stop(Scheduler, Sequence) -> None:
    """Exercise 3.2: ``Scheduler.check_stop`` on hand-built cases (EOS, ignore_eos, stop token
    ids, min_tokens, max_tokens, max_model_len)."""
    from minivllm.kv_cache import BlockManager
    from minivllm.sampling import SamplingParams

    what = "Exercise 3.2 (Scheduler.check_stop)"
    sched = Scheduler(BlockManager(8, 4, enable_prefix_caching=False), max_num_seqs=2,
                      max_num_batched_tokens=8, max_model_len=12, eos_token_ids=(2,))
    for i, (case, kwargs, prompt_len, before, token, expected) in enumerate(_STOP_CASES):
        seq = Sequence(i, f"r{i}", [5] * prompt_len, SamplingParams(**kwargs))
        seq.token_ids += [*before, token]
        with exercise(what):
            got = sched.check_stop(seq, token)
        got = tuple(got) if got is not None else None
        require(got == expected, what, f"{case} ({kwargs}, {prompt_len} prompt tokens, "
                f"output {seq.output_token_ids}): got {got}, expected {expected}",
                "EOS and stop ids count only from min_tokens on (ignore_eos skips EOS); "
                "a stop beats the length limit")
    passed(what, f"{len(_STOP_CASES)} cases: EOS, ignore_eos, stop ids, min/max_tokens, "
           "max_model_len")


# ----------------------------------------------------------------------------- the sampler filters


def _mask_case(fn, what: str, logits, arg, kept: list[list[int]], hint: str) -> None:
    import torch

    logits = torch.tensor(logits, dtype=torch.float32)
    before = logits.clone()
    with exercise(what):
        out = fn(logits, arg)
    require(isinstance(out, torch.Tensor) and out.shape == logits.shape, what,
            f"expected a tensor of shape {tuple(logits.shape)}, got "
            f"{getattr(out, 'shape', type(out).__name__)}")
    require(torch.equal(logits, before), what, "the input logits were modified in place")
    for row, keep in enumerate(kept):
        got = [i for i, x in enumerate(out[row].tolist()) if x != -INF]
        require(got == keep, what, f"row {row} (logits {before[row].tolist()}, "
                f"{arg[row].item()}): kept tokens {got}, expected {keep}", hint)
        require(torch.equal(out[row, keep], before[row, keep]), what,
                f"row {row}: kept logits changed: {out[row].tolist()}",
                "mask with -inf, leave the kept logits as they are")


def check_top_k(mask_top_k) -> None:
    """Exercise 3.3: exact top-k masks (ties kept, 0/-1/too large keep all, per-row k)."""
    import torch

    logits = [[3.0, 1.0, 2.0, 0.0, -1.0], [0.5, 0.5, 0.1, 2.0, -3.0], [1.0, 2.0, 3.0, 4.0, 5.0],
              [1.0, 2.0, 3.0, 4.0, 5.0], [-INF, 1.0, 2.0, 0.0, 5.0], [0.0, 1.0, 2.0, 3.0, 4.0]]
    top_k = torch.tensor([2, 2, 0, 9, 1, -1])
    kept = [[0, 2], [0, 1, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [4], [0, 1, 2, 3, 4]]
    _mask_case(mask_top_k, "Exercise 3.3 (mask_top_k)", logits, top_k, kept,
               "keep logits >= the k-th largest of the row; k <= 0 or k >= vocab keeps all")
    passed("Exercise 3.3 (mask_top_k)", "6 rows: per-row k, ties, k=0/-1/k>vocab")


def check_top_p(mask_top_p) -> None:
    """Exercise 3.3: exact nucleus masks (the top token always kept, per-row p, any order)."""
    import math

    import torch

    p = [0.5, 0.3, 0.15, 0.05]
    log = [math.log(x) for x in p]
    perm = [log[3], log[2], log[0], log[1]]  # the same distribution, shuffled
    logits = [log, log, log, log, perm, perm]
    top_p = torch.tensor([0.3, 0.7, 0.9, 1.0, 0.7, 0.97])
    kept = [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [2, 3], [0, 1, 2, 3]]
    _mask_case(mask_top_p, "Exercise 3.3 (mask_top_p)", logits, top_p, kept,
               "keep a token when the mass of the tokens strictly more likely than it is "
               "< top_p (so the top token always stays); sort, then scatter the mask back")
    passed("Exercise 3.3 (mask_top_p)", "6 rows: per-row p, top token kept alone, shuffled vocab")


def check_min_p(mask_min_p) -> None:
    """Exercise 3.3: exact min-p masks (threshold relative to the top probability)."""
    import math

    import torch

    p = [0.5, 0.3, 0.15, 0.05]
    log = [math.log(x) + 1.0 for x in p]  # shifted logits: the softmax must be taken
    perm = [log[2], log[0], log[3], log[1]]
    logits = [log, log, log, log, perm]
    min_p = torch.tensor([0.0, 0.2, 0.5, 1.0, 0.5])
    kept = [[0, 1, 2, 3], [0, 1, 2], [0, 1], [0], [1, 3]]
    _mask_case(mask_min_p, "Exercise 3.3 (mask_min_p)", logits, min_p, kept,
               "drop tokens whose probability is below min_p * (the row's top probability)")
    passed("Exercise 3.3 (mask_min_p)", "5 rows: per-row min_p, relative threshold")


# ----------------------------------------------------------------------------- the draw


def check_uniform_draws(uniform_draws) -> None:
    """Exercise 3.4: (rows,) float64 uniforms in [0, 1); a seeded row depends only on its own
    generator; unseeded rows differ from each other."""
    import torch

    what = "Exercise 3.4 (uniform_draws)"
    seeds = [5, None, 6, None] * 500
    make = lambda: [None if s is None else torch.Generator().manual_seed(s + i)
                    for i, s in enumerate(seeds)]
    with exercise(what):
        u = uniform_draws(len(seeds), make(), "cpu")
    require(isinstance(u, torch.Tensor) and u.shape == (len(seeds),), what,
            f"expected a ({len(seeds)},) tensor, got {getattr(u, 'shape', type(u).__name__)}")
    require(u.dtype == torch.float64, what, f"expected float64 draws, got {u.dtype}",
            "torch.rand(..., dtype=torch.float64): 53 random bits")
    require(bool(((u >= 0) & (u < 1)).all()), what, "uniforms lie in [0, 1)")
    require(abs(u.mean().item() - 0.5) < 0.03 and abs(u.var().item() - 1 / 12) < 0.01, what,
            f"mean {u.mean().item():.3f}, variance {u.var().item():.4f}; Uniform[0, 1) has 0.5 "
            "and 1/12", "draw with torch.rand, not randn")
    unseeded = u[1::2]
    require(unseeded.unique().numel() == unseeded.numel(), what,
            "two unseeded rows got the same draw")
    for row in (0, 2, 1000, 1998):
        alone = uniform_draws(1, [torch.Generator().manual_seed(seeds[row] + row)], "cpu")[0]
        require(torch.equal(alone, u[row]), what,
                f"row {row} (seed {seeds[row] + row}) differs from the same seed drawn alone",
                "draw a seeded row from its own generator only")
    passed(what, "Uniform[0, 1) in float64, seeded rows independent of the batch")


def check_inverse_cdf(inverse_cdf) -> None:
    """Exercise 3.4: the token where u * total lands in the running sum, for hand-worked
    rows (boundaries, zero-probability tokens, unnormalised rows), a vocabulary that is not a
    multiple of any chunk, a float64-precise tail, and 4000 evenly spread draws following p."""
    import torch

    what = "Exercise 3.4 (inverse_cdf)"
    hint = ("the first token whose running sum is greater than u * total "
            "(torch.searchsorted(cdf, target, right=True)), the running sum in float64")
    p = torch.tensor([0.25, 0.0, 0.25, 0.5, 0.0])
    cases = [(0.0, 0), (0.2499, 0), (0.25, 2), (0.4999, 2), (0.5, 3), (0.99, 3),
             (1 - 2**-53, 3)]
    u = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    with exercise(what):
        got = inverse_cdf(p.repeat(len(cases), 1), u)
    require(isinstance(got, torch.Tensor) and got.shape == (len(cases),), what,
            f"expected a ({len(cases)},) tensor of token ids, got {getattr(got, 'shape', got)}")
    require(got.dtype == torch.int64, what, f"token ids must be int64, got {got.dtype}")
    for (ui, want), token in zip(cases, got.tolist()):
        require(token == want, what, f"p = {p.tolist()}, u = {ui}: drew token {token}, expected "
                f"{want} (a token of probability 0 is never drawn)", hint)
    scaled = inverse_cdf(3 * p.repeat(len(cases), 1), u).tolist()
    require(scaled == got.tolist(), what, "a row scaled by 3 drew other tokens: the target is "
            "u times the row's own total", hint)
    lead = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    require(inverse_cdf(lead, torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64)).tolist()
            == [2, 2], what, "a row whose only token is its last: u = 0 and u -> 1 must both "
            "draw it", hint)
    vocab = 3001  # not a multiple of a chunk
    g = torch.Generator().manual_seed(0)
    dist = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)
    dist[vocab - 1] = 0.0
    draws = 4000
    spread = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws  # evenly spread u
    tokens = inverse_cdf(dist.repeat(draws, 1), spread)
    require(int(tokens.max()) < vocab - 1, what, "drew a token of probability 0", hint)
    cdf = dist.double().cumsum(0)
    expected = torch.searchsorted(cdf, spread * cdf[-1], right=True)
    off = int((tokens != expected).sum())  # a boundary within float32's rounding: 1 or 2
    require(off <= 2, what, f"{off} of {draws} evenly spread draws landed on other tokens "
            "than the running sum says", hint)
    # a likely token, then 149,999 of 1e-9 each: ten targets in the middle of ten tail tokens
    # in a row (across 128- and 256-token boundaries) must draw ten tokens in a row, each once
    tail = torch.full((10, 150_000), 1e-9)
    tail[:, 0] = 1.0
    step = float(tail[0, 1])
    total = 1.0 + 149_999 * step
    first = 99_965  # tokens 99,965 ... 99,974 straddle 99,968 = 781 * 128
    aims = torch.tensor([(1.0 + (first - 1 + k + 0.5) * step) / total for k in range(10)],
                        dtype=torch.float64)
    far = inverse_cdf(tail, aims).tolist()
    require(all(b - a == 1 for a, b in itertools.pairwise(far)) and abs(far[0] - first) <= 200, what,
            f"a row of one token of 1.0 and 149,999 of 1e-9: targets in the middle of tokens "
            f"{first} ... {first + 9} drew {far}; expected ten tokens in a row near {first}",
            "a running sum in float32 cannot tell 1.0 + 1e-9 from 1.0: sum in float64")
    passed(what, f"hand-worked boundaries, {draws} evenly spread draws over {vocab} tokens, a "
           "float64-precise tail")


# ----------------------------------------------------------------------------- penalties

# Six rows over a 5-token vocabulary: (logits, tokens in the prompt, output counts,
# (presence, frequency, repetition), expected logits), each worked out by hand.
_PENALTY_CASES = [
    ([2.0, -1.0, -INF, 1.0, -0.5], [1, 2], {0: 2}, (0.0, 0.0, 2.0),
     [1.0, -2.0, -INF, 1.0, -0.5]),  # repetition: positive / 2, negative * 2, -inf stays
    ([2.0, -1.0, 0.5, 1.0, -0.5], [], {0: 2, 3: 1}, (0.5, 0.0, 1.0),
     [1.5, -1.0, 0.5, 0.5, -0.5]),  # presence: once per token present
    ([2.0, -1.0, 0.5, 1.0, -0.5], [], {0: 2, 3: 1}, (0.0, 0.5, 1.0),
     [1.0, -1.0, 0.5, 0.5, -0.5]),  # frequency: times the count
    ([2.0, -1.0, 0.5, 1.0, -0.5], [4], {0: 1}, (0.0, 0.0, 0.5),
     [4.0, -1.0, 0.5, 1.0, -0.25]),  # repetition < 1 encourages, prompt tokens included
    ([2.0, -1.0, 0.5, 1.0, -0.5], [1], {0: 2}, (0.5, 0.25, 2.0),
     [0.0, -2.0, 0.5, 1.0, -0.5]),  # all three: 2 / 2 - 0.25 * 2 - 0.5
    ([2.0, -1.0, 0.5, 1.0, -0.5], [0, 1], {2: 3}, (0.0, 0.0, 1.0),
     [2.0, -1.0, 0.5, 1.0, -0.5]),  # neutral values: untouched
]


def check_penalties(apply_penalties) -> None:
    """Exercise 3.5: repetition (prompt + output, divide positive, multiply negative),
    frequency (times the output count) and presence (once), per row, worked by hand."""
    import torch

    what = "Exercise 3.5 (apply_penalties)"
    vocab = 5
    logits = torch.tensor([c[0] for c in _PENALTY_CASES])
    prompt = torch.zeros(len(_PENALTY_CASES), vocab)
    output = torch.zeros(len(_PENALTY_CASES), vocab)
    for row, (_, prompt_ids, counts, _, _) in enumerate(_PENALTY_CASES):
        prompt[row, prompt_ids] = 1.0
        for token, count in counts.items():
            output[row, token] = float(count)
    presence, frequency, repetition = (torch.tensor([c[3][i] for c in _PENALTY_CASES])
                                       for i in range(3))
    before = logits.clone()
    with exercise(what):
        out = apply_penalties(logits, prompt, output, presence, frequency, repetition)
    require(isinstance(out, torch.Tensor) and out.shape == logits.shape, what,
            f"expected a tensor of shape {tuple(logits.shape)}, got "
            f"{getattr(out, 'shape', type(out).__name__)}")
    require(torch.equal(logits, before), what, "the input logits were modified in place")
    hints = [("repetition: a positive logit is divided by r, a negative one multiplied by r, "
              "for tokens seen in the prompt or the output"),
             "presence: subtract p once for each token whose output count is > 0",
             "frequency: subtract f times the token's output count",
             "repetition applies to prompt tokens too; r < 1 makes seen tokens more likely",
             "the three together: repetition first, then frequency, then presence",
             "neutral values (r = 1, f = p = 0) must leave the row exactly as it was"]
    for row, case in enumerate(_PENALTY_CASES):
        got, want = out[row].tolist(), case[4]
        require(all(g == w or abs(g - w) < 1e-6 for g, w in zip(got, want)), what,
                f"row {row} (logits {case[0]}, prompt tokens {case[1]}, output counts {case[2]}, "
                f"presence/frequency/repetition {case[3]}): got {got}, expected {want}",
                hints[row])
    passed(what, f"{len(_PENALTY_CASES)} rows worked by hand: repetition, frequency, presence")


# ----------------------------------------------------------------------------- end to end


@functools.lru_cache(maxsize=2)
def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, never stopping on EOS (ignore_eos semantics)."""
    return list(_hf_greedy(str(path), tuple(prompt_ids), max_new_tokens))


@functools.lru_cache(maxsize=256)
def _hf_greedy(path: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    import torch

    model = _hf_model(str(path))
    new_api = "cache" in inspect.signature(model.forward).parameters  # transformers >= 5
    cache_arg = "cache" if new_api else "past_key_values"
    with torch.inference_mode():
        out = model(torch.tensor([list(prompt_ids)]), use_cache=True)
        tokens = []
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) == max_new_tokens:
                break
            out = model(torch.tensor([[tokens[-1]]]), use_cache=True,
                        **{cache_arg: out[cache_arg]})
    return tuple(tokens)


def default_model() -> str:
    from minivllm import TINY_MODEL

    return os.environ.get("MINIVLLM_MODEL", TINY_MODEL)


def _drain(engine, requests) -> dict:
    final = {}
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def check_engine(LLMEngine, Scheduler, Sequence, Sampler, model: str | None = None) -> None:
    """End to end: an ``LLMEngine`` running on the learner's Scheduler, Sequence and Sampler,
    with a pool small enough to preempt and a budget small enough to chunk, must equal
    transformers' greedy decode prompt by prompt; a seeded sampled request must give the same
    tokens alone and in a busy batch; every block must come back."""
    from minivllm.config import EngineConfig
    from minivllm.sampling import SamplingParams

    what = "end-to-end engine check"
    model = str(model or default_model())
    config = EngineConfig(model=model, block_size=4, num_blocks=16, max_model_len=64,
                          max_num_seqs=3, max_num_batched_tokens=16, dtype="float32",
                          compile=False)  # the compiled decode step would bypass the Sampler
    engine = LLMEngine(config)
    engine.scheduler = Scheduler(engine.block_manager, config.max_num_seqs,
                                 config.max_num_batched_tokens, engine.max_model_len,
                                 engine.eos_token_ids)
    engine.runner.sampler = Sampler()
    vocab = min(engine.model_config.vocab_size, 1000)
    lengths, rng = [30, 20, 23, 23, 5, 18], random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10)
    seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=123,
                            ignore_eos=True, max_tokens=10)
    busy = [(f"g{i}", {"prompt_token_ids": p}, greedy) for i, p in enumerate(prompts)]
    busy.insert(3, ("s", {"prompt_token_ids": prompts[0]}, seeded))
    with mock.patch.dict(LLMEngine.add_request.__globals__, {"Sequence": Sequence}), \
            exercise(what):
        final = _drain(engine, busy)
        alone = _drain(engine, [("s-alone", {"prompt_token_ids": prompts[0]}, seeded)])
    require(len(final) == len(busy), what, f"{len(final)} of {len(busy)} requests finished")
    stats = engine.stats
    require(stats.num_preemptions > 0, what, "the 16-block pool should have forced preemption")
    require(stats.max_batched_tokens <= 16 and stats.max_batch_size <= 3, what,
            f"a step ran {stats.max_batched_tokens} tokens / {stats.max_batch_size} sequences "
            "(budget 16 / 3)")
    for i, prompt in enumerate(prompts):
        assert_equal(final[f"g{i}"].outputs[0].token_ids, hf_greedy(model, prompt, 10),
                     what=f"{what}: prompt {i} ({len(prompt)} tokens) vs transformers greedy")
    assert_equal(final["s"].outputs[0].token_ids, alone["s-alone"].outputs[0].token_ids,
                 what=f"{what}: seeded request inside the batch vs alone",
                 hint="a seeded row must draw its uniform from its own generator")
    bm = engine.block_manager
    require(bm.num_free_blocks == engine.num_blocks and all(b.ref_count == 0 for b in bm.blocks),
            what, f"{bm.num_free_blocks} of {engine.num_blocks} blocks free at the end")
    passed("Exercises 3.1–3.4 together (the engine on your classes)", f"{len(prompts)} prompts equal transformers greedy "
           f"through {stats.num_preemptions} preemptions and chunked prefills; seeded sample "
           "unchanged by the batch; all blocks back")
