"""Notebook 07_compiled_decode: every check cell fails on the learner's stubs and on planted
wrong answers, and passes on the reference package objects.

Nothing here compiles: the graders run the learner's plain functions eagerly (the padding
grader replaces the compiled function by a recorder). The learner's module is exported from
notebooks/07_compiled_decode.ipynb into a temporary folder and imported from there. Planted
wrong answers are "mutants": minivllm/compile.py with one line changed (each mutation asserts
that its target text exists, so a refactor that removes it fails here loudly instead of
testing nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from notebook_helpers import export_learner, grader_tests

import minivllm.compile as ref
from minivllm.course import checks_07 as checks

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "07_compiled_decode.ipynb"


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """The stubbed module a learner starts from, exported from the learner's notebook."""
    return export_learner(NOTEBOOK, tmp_path_factory.mktemp("nb07"), ["compile"], "nb07")["compile"]


def _graders(m):
    return {
        "slots": lambda: checks.check_decode_slots(m.decode_slots),
        "attention": lambda: checks.check_decode_attention(m.DecodeAttention),
        "padding": lambda: checks.check_bucket_padding(m.CompiledDecoder, m.DecodeInputs),
        "sample": lambda: checks.check_sample_logits(m.sample_logits),
    }


def test_every_exercise_is_a_stub(learner):
    kv = torch.zeros(2, 1, 8, 1, 2)
    one = torch.ones(2, dtype=torch.long)
    decoder = learner.CompiledDecoder.__new__(learner.CompiledDecoder)
    decoder.on_cuda, decoder.scratch_block = False, 3
    calls = {
        "Exercise 7.1: decode_slots": lambda: learner.decode_slots(torch.zeros(2, 1, dtype=torch.long),
                                                                   one, 4),
        "Exercise 7.2: the decode mask": lambda: learner.DecodeAttention(
            kv, one, torch.zeros(2, 1, dtype=torch.long), one, 4),
        "Exercise 7.2: pad the batch": lambda: decoder.logits(learner.DecodeInputs([1], [1], [[0]])),
        "Exercise 7.3: sample_logits": lambda: learner.sample_logits(
            torch.zeros(2, 4), torch.ones(2), one, torch.ones(2), torch.zeros(2), torch.ones(2, 4),
            False),
    }
    for label, call in calls.items():
        with pytest.raises(NotImplementedError, match=label):
            call()


MUTANTS = {
    # 7.1 decode_slots
    "slot of the next position (seq_lens, not seq_lens - 1)": (
        "slots", [("block = block_tables.gather(1, (positions // block_size)",
                   "positions = positions + 1\n    block = block_tables.gather(1, (positions // block_size)")]),
    "offset without the modulo": (
        "slots", [("return block * block_size + positions % block_size",
                   "return block * block_size + positions")]),
    "one block for the whole batch (row 0's table)": (
        "slots", [("block = block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)",
                   "block = block_tables[0, positions // block_size]")]),
    # 7.2 the decode mask
    "mask <= seq_lens: one key of garbage": (
        "attention", [("(key_pos < seq_lens.unsqueeze(1))", "(key_pos <= seq_lens.unsqueeze(1))")]),
    "mask hides the new token (< seq_lens - 1)": (
        "attention", [("(key_pos < seq_lens.unsqueeze(1))", "(key_pos < seq_lens.unsqueeze(1) - 1)")]),
    # 7.2 bucket padding
    "padding rows point at block 0, a real block": (
        "padding", [("tables += [[scratch] * width] * (padded_rows - rows)",
                     "tables += [[0] * width] * (padded_rows - rows)")]),
    "table columns padded with block 0": (
        "padding", [("tables = [t + [scratch] * (width - len(t))", "tables = [t + [0] * (width - len(t))")]),
    "padding rows with seq_len 0 (all keys masked: NaN)": (
        "padding", [("batch.seq_lens + [1] * (padded_rows - rows)",
                     "batch.seq_lens + [0] * (padded_rows - rows)")]),
    "padding rows' logits returned": ("padding", [("return logits[:rows]", "return logits")]),
    "no bucket for the rows (a batch of 1 stays 1)": (
        "padding", [("padded_rows = bucket(rows, self.on_cuda, self.min_rows)", "padded_rows = rows")]),
    # 7.3 sample_logits
    "temperature-0 rows sampled instead of argmax": (
        "sample", [("return torch.where(temperature < GREEDY_EPS, greedy, sampled)", "return sampled")]),
    "the draw from the raw logits' distribution": (
        "sample", [("inverse_cdf(scaled.softmax(dim=-1), u)", "inverse_cdf(logits.softmax(dim=-1), u)")]),
    "the uniforms reversed": (
        "sample", [("inverse_cdf(scaled.softmax(dim=-1), u)", "inverse_cdf(scaled.softmax(dim=-1), 1 - u)")]),
    "filters before the temperature": (
        "sample", [(("    scaled = logits / temperature.clamp(min=GREEDY_EPS).unsqueeze(-1)\n"
                     "    if use_filters:\n"
                     "        scaled = mask_min_p(mask_top_p(mask_top_k(scaled, top_k), top_p), min_p)"),
                    ("    scaled = logits\n"
                     "    if use_filters:\n"
                     "        scaled = mask_min_p(mask_top_p(mask_top_k(scaled, top_k), top_p), min_p)\n"
                     "    scaled = scaled / temperature.clamp(min=GREEDY_EPS).unsqueeze(-1)"))]),
    "filters ignored": ("sample", [("    if use_filters:\n        scaled", "    if False:\n        scaled")]),
}


(test_check_fails_on_the_stub, test_check_passes_on_the_reference,
 test_check_fails_on_a_planted_wrong_answer) = grader_tests(_graders, ref, MUTANTS)