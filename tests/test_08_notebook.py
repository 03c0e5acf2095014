"""Notebook 08_speculative_decoding: every check cell fails on the learner's stubs and on
planted wrong answers, and passes on the reference package objects.

The learner's module is exported from notebooks/08_speculative_decoding.ipynb into a
temporary folder and imported from there. Planted wrong answers are "mutants":
minivllm/spec_decode.py with one line changed (each mutation asserts that its target text
exists, so a refactor that removes it fails here loudly instead of testing nothing). The
rejection-rule mutants are the ones the issue names: accept always, no residual
distribution, residual not renormalised — each fails the chi-square check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from notebook_helpers import export_learner, grader_tests

import minivllm.spec_decode as ref
from minivllm.course import checks_08 as checks
from minivllm.kv_cache import BlockManager

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "08_speculative_decoding.ipynb"


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """The stubbed module a learner starts from, exported from the learner's notebook."""
    return export_learner(NOTEBOOK, tmp_path_factory.mktemp("nb08"), ["spec_decode"],
                          "nb08")["spec_decode"]


def _graders(m):
    return {
        "ngram": lambda: checks.check_ngram_propose(m.ngram_propose),
        "greedy": lambda: checks.check_greedy_accept(m.greedy_accept),
        "rejection": lambda: checks.check_rejection_sample(m.rejection_sample),
        "rollback": lambda: checks.check_rollback(m.rollback),
    }


def test_every_exercise_is_a_stub(learner):
    calls = {
        "Exercise 8.1: ngram_propose": lambda: learner.ngram_propose([1, 2, 1], 2, 2, 1),
        "Exercise 8.2: greedy_accept": lambda: learner.greedy_accept([1], [1, 2]),
        "Exercise 8.3: rejection_sample": lambda: learner.rejection_sample(
            [0], torch.full((2, 3), 1 / 3), None),
        "Exercise 8.4: rollback": lambda: learner.rollback(BlockManager(4, 4), [0], 1),
    }
    for label, call in calls.items():
        with pytest.raises(NotImplementedError, match=label):
            call()


MUTANTS = {
    # 8.1 ngram_propose
    "earliest occurrence instead of the latest": (
        "ngram", [("for start in range(length - n - 1, -1, -1):", "for start in range(length - n):")]),
    "shortest suffix tried first": (
        "ngram", [("for n in range(min(max_n, length - 1), min_n - 1, -1):",
                   "for n in range(min_n, min(max_n, length - 1) + 1):")]),
    "min_n ignored (any 1-gram counts)": (
        "ngram", [("for n in range(min(max_n, length - 1), min_n - 1, -1):",
                   "for n in range(min(max_n, length - 1), 0, -1):")]),
    "the suffix matches itself": (
        "ngram", [("for start in range(length - n - 1, -1, -1):",
                   "for start in range(length - n, -1, -1):")]),
    "no reading on: fewer than k tokens near the end": (
        "ngram", [("return extended[length:]", "return token_ids[start + n:start + n + k]")]),
    # 8.2 greedy_accept
    "no bonus token when every draft matches": (
        "greedy", [("    emitted.append(target_ids[len(draft_ids)])\n", "")]),
    "the draft emitted at the mismatch instead of the target's token": (
        "greedy", [("        emitted.append(target)\n        if draft != target:",
                    "        emitted.append(draft)\n        if draft != target:")]),
    "nothing emitted at a mismatch": (
        "greedy", [("        emitted.append(target)\n        if draft != target:\n            return emitted",
                    "        if draft != target:\n            return emitted\n        emitted.append(target)")]),
    # 8.3 rejection_sample: the three, and two more
    "accept always": (
        "rejection", [("if u * float(q[draft]) < float(p[draft]):", "if True:")]),
    "no residual: on rejection sample from p": (
        "rejection", [("residual = (p - q).clamp(min=0)", "residual = p.clone()")]),
    "residual not renormalised": (
        "rejection", [("residual = residual / total if total > 0 else p", "residual = residual")]),
    "accept with probability p(d), ignoring q": (
        "rejection", [("if u * float(q[draft]) < float(p[draft]):", "if u < float(p[draft]):")]),
    "bonus token from the last draft's row": (
        "rejection", [("[sample_from(target_probs[len(draft_ids)], generator)]",
                       "[sample_from(target_probs[len(draft_ids) - 1], generator)]")]),
    # 8.4 rollback
    "one block too many kept": (
        "rollback", [("keep = block_manager.blocks_needed(num_computed_tokens)",
                      "keep = block_manager.blocks_needed(num_computed_tokens) + 1")]),
    "blocks cut off the table but not freed": (
        "rollback", [("    block_manager.free_blocks(tail)", "    tail.clear()")]),
    "blocks freed but left in the table": (
        "rollback", [("    del block_table[keep:]\n", "")]),
}


(test_check_fails_on_the_stub, test_check_passes_on_the_reference,
 test_check_fails_on_a_planted_wrong_answer) = grader_tests(_graders, ref, MUTANTS)