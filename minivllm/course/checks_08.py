"""Graders for notebook 08_speculative_decoding (Milestone 8: speculative decoding).

Each ``check_*`` takes the learner's function (the one defined in the notebook). References:

* 8.1 ``ngram_propose``: hand-worked cases (which suffix length wins, which occurrence,
  the continuation that reads on through the proposal, no match, short inputs);
* 8.2 ``greedy_accept``: hand-worked cases (all accepted plus the bonus token, the first
  mismatch replaced by the target's token, nothing accepted, k = 1);
* 8.3 ``rejection_sample``: statistics — 20,000 seeded draws at a speculated position on a
  six-token vocabulary, whose histogram must follow the target distribution p (a chi-square
  test), with a draft distribution q and with a one-hot proposal, plus the bonus token's
  distribution when every draft is accepted;
* 8.4 ``rollback``: Milestone 2's ``BlockManager``: which blocks stay in the table and which
  go back to the pool, at and across block boundaries.

Each prints one ``passed(...)`` line or raises an ``AssertionError`` that says what differs;
a stub's ``NotImplementedError`` becomes an ``AssertionError`` saying "not implemented yet".
"""

from __future__ import annotations

import math

import torch

from .grading import assert_equal, call_learner, passed, require

# ----------------------------------------------------------------------------- 8.1 n-gram

NGRAM_CASES = [  # (token_ids, k, max_n, min_n, expected, why)
    ([1, 2, 3, 9, 1, 2, 3], 2, 3, 1, [9, 1], "the 3-token suffix [1, 2, 3] occurred at 0"),
    ([5, 1, 2, 7, 1, 2, 8, 3, 1, 2], 2, 2, 1, [8, 3],
     "the *latest* earlier occurrence of [1, 2] wins (the one followed by 8)"),
    ([4, 1, 2, 6, 3, 2, 5, 2], 2, 3, 1, [5, 2], "no 3- or 2-gram match: the 1-gram [2] at 5"),
    ([4, 1, 2, 6, 3, 2, 5, 2], 2, 3, 2, [], "min_n = 2 and only a 1-gram matches: nothing"),
    ([1, 2, 1, 2], 5, 2, 1, [1, 2, 1, 2, 1],
     "a match near the end reads on through its own proposal (periodic text)"),
    ([7, 7, 7], 3, 2, 1, [7, 7, 7], "a run of one token"),
    ([3], 2, 2, 1, [], "one token: nothing earlier to match"),
    ([1, 2, 3, 4, 5], 3, 2, 1, [], "every token is new: no proposal"),
    ([8, 1, 2, 3, 8, 1, 2], 1, 4, 1, [3], "k = 1: one token"),
    ([9, 1, 2, 5, 6, 1, 2, 7, 0, 1, 2], 3, 2, 1, [7, 0, 1], "latest occurrence, k = 3"),
    ([1, 2, 3, 7, 5, 3, 8, 1, 2, 3], 1, 3, 1, [7],
     "the longest suffix wins: [1, 2, 3] (followed by 7) beats the later [3] (followed by 8)"),
]

NGRAM_HINT = ("for n from min(max_n, len - 1) down to min_n: take the last n tokens; scan the "
              "earlier start positions from the latest back; at the first match, propose the k "
              "tokens after it, reading on through what you have proposed so far")


def check_ngram_propose(ngram_propose) -> None:
    """Exercise 8.1: prompt lookup on eleven hand-worked cases."""
    what = "Exercise 8.1 (ngram_propose)"
    for token_ids, k, max_n, min_n, expected, why in NGRAM_CASES:
        got = call_learner(what, ngram_propose, list(token_ids), k, max_n, min_n, hint=NGRAM_HINT)
        assert_equal(list(got) if got is not None else got, expected,
                     what=f"{what} on {token_ids}, k={k}, max_n={max_n}, min_n={min_n} ({why})",
                     hint=NGRAM_HINT)
    passed(what, f"{len(NGRAM_CASES)} cases")


# ----------------------------------------------------------------------------- 8.2 greedy

GREEDY_CASES = [  # (draft, target argmax per row, expected emitted, why)
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8], "all accepted, plus the last row's token"),
    ([5, 6, 7], [5, 9, 7, 8], [5, 9], "the 2nd draft differs: the target's 9, then stop"),
    ([5, 6, 7], [4, 6, 7, 8], [4], "the first draft differs: one token, the target's"),
    ([5], [5, 3], [5, 3], "k = 1, accepted"),
    ([5], [2, 3], [2], "k = 1, rejected"),
    ([1, 1, 1, 1, 1], [1, 1, 1, 2, 1, 1], [1, 1, 1, 2], "the rows after a mismatch are ignored"),
]

GREEDY_HINT = ("walk the drafts with the target's argmax beside them: emit the target's token; "
               "stop right after the first mismatch; if all k match, emit target_ids[k] too")


def check_greedy_accept(greedy_accept) -> None:
    """Exercise 8.2: greedy acceptance on six hand-worked cases."""
    what = "Exercise 8.2 (greedy_accept)"
    for draft, target, expected, why in GREEDY_CASES:
        got = call_learner(what, greedy_accept, list(draft), list(target), hint=GREEDY_HINT)
        assert_equal(list(got) if got is not None else got, expected,
                     what=f"{what} draft={draft}, target={target} ({why})", hint=GREEDY_HINT)
    passed(what, f"{len(GREEDY_CASES)} cases")


# ----------------------------------------------------------------------------- 8.3 rejection

P0 = [0.30, 0.25, 0.20, 0.10, 0.10, 0.05]  # the target at the speculated position
Q0 = [0.05, 0.15, 0.40, 0.10, 0.25, 0.05]  # the proposer's distribution there
P1 = [0.10, 0.10, 0.10, 0.20, 0.20, 0.30]  # the target at the next position (bonus token)
DRAWS = 20_000


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, float]:
    """Pearson's statistic of ``counts`` against ``probs`` and the 1e-4 critical value for
    its degrees of freedom (Wilson–Hilferty; no scipy needed)."""
    total = sum(counts)
    stat = sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))
    df, z = len(probs) - 1, 3.719  # z of the one-sided 1e-4 tail
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def draw_histograms(rejection_sample, draft_probs: bool, draws: int = DRAWS,
                    seed: int = 0) -> tuple[list[int], list[int], int]:
    """Run ``rejection_sample`` with k = 1 ``draws`` times: the histogram of the first emitted
    token, of the second (the bonus, when the draft was accepted), and the accepted count.

    With ``draft_probs`` the draft token is drawn from Q0 and Q0 is passed; without, the
    proposer is deterministic (always token 2, one-hot q) and None is passed."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.tensor([P0, P1])  # (k + 1, V)
    q = torch.tensor([Q0])  # (k, V)
    drafts = (torch.multinomial(q[0], draws, replacement=True, generator=gen).tolist()
              if draft_probs else [2] * draws)
    first, second, accepted = [0] * len(P0), [0] * len(P0), 0
    for draft in drafts:
        out = rejection_sample([draft], target, q if draft_probs else None, gen)
        first[out[0]] += 1
        if len(out) == 2:
            second[out[1]] += 1
            accepted += 1
    return first, second, accepted


REJECTION_HINT = ("keep draft d with probability min(1, p[d] / q[d]) (u * q[d] < p[d] with u "
                  "uniform); on rejection draw from max(0, p - q) divided by its sum and stop; "
                  "if every draft is kept, draw one more token from the last row of p")


def check_rejection_sample(rejection_sample) -> None:
    """Exercise 8.3: the emitted tokens follow the target's distribution (chi-square over
    20,000 draws), for a sampled draft and for a one-hot proposal; the bonus token follows
    the next row."""
    what = "Exercise 8.3 (rejection_sample)"
    details = []
    for draft_probs in (True, False):
        label = "q = Q0" if draft_probs else "one-hot q (token 2)"
        first, second, accepted = call_learner(what, draw_histograms, rejection_sample,
                                               draft_probs, hint=REJECTION_HINT)
        require(sum(first) == DRAWS, what, f"{label}: {sum(first)} first tokens from {DRAWS} "
                "calls (each call must emit at least one token)", REJECTION_HINT)
        stat, critical = chi_square(first, P0)
        freqs = [round(c / DRAWS, 3) for c in first]
        require(stat < critical, what,
                f"{label}: the first emitted token's frequencies {freqs} do not follow the "
                f"target p = {P0} (chi-square {stat:.0f} > {critical:.1f})", REJECTION_HINT)
        expected_accept = sum(min(p, q) for p, q in zip(P0, Q0)) if draft_probs else P0[2]
        require(abs(accepted / DRAWS - expected_accept) < 0.02, what,
                f"{label}: accepted {accepted / DRAWS:.3f} of the drafts, expected "
                f"{expected_accept:.3f} (sum of min(p, q))", REJECTION_HINT)
        stat2, critical2 = chi_square(second, P1)
        require(stat2 < critical2, what,
                f"{label}: the bonus token after an accepted draft does not follow the next "
                f"row p1 = {P1} (chi-square {stat2:.0f} > {critical2:.1f})", REJECTION_HINT)
        details.append(f"{label}: chi2 {stat:.1f} < {critical:.1f}")
    passed(what, f"{DRAWS} draws each; " + "; ".join(details))


# ----------------------------------------------------------------------------- 8.4 rollback


def check_rollback(rollback) -> None:
    """Exercise 8.4: after verifying, the table keeps just the blocks of the computed tokens;
    the others are back in the pool (block size 4, rollbacks within and across blocks)."""
    from minivllm.kv_cache import BlockManager

    what = "Exercise 8.4 (rollback)"
    hint = ("keep blocks_needed(num_computed_tokens) blocks; give the rest back with "
            "free_blocks (on a list of just those), and cut them off the table in place")
    cases = [  # (tokens the table was grown for, tokens computed after verification)
        (12, 9), (12, 8), (12, 12), (9, 5), (9, 4), (16, 13), (5, 5), (8, 1)]
    for grown, computed in cases:
        bm = BlockManager(num_blocks=8, block_size=4)
        table, _ = bm.allocate(list(range(100, 100 + grown)))
        before = list(table)
        call_learner(what, rollback, bm, table, computed, hint=hint)
        keep = -(-computed // 4)
        assert_equal(table, before[:keep],
                     what=f"{what}: table after growing to {grown} tokens and keeping {computed}",
                     hint=hint)
        require(bm.num_free_blocks == 8 - keep, what,
                f"grown to {grown}, kept {computed}: {bm.num_free_blocks} free blocks, expected "
                f"{8 - keep}", hint)
        for block_id in before[keep:]:
            require(bm.blocks[block_id].ref_count == 0, what,
                    f"block {block_id} was rolled back but still has ref_count "
                    f"{bm.blocks[block_id].ref_count}", hint)
    passed(what, f"{len(cases)} cases")
