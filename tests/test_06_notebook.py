"""Notebook 06_batched_attention: every check cell fails on the learner's stubs and on
planted wrong answers, and passes on the reference package objects.

The learner's module is exported from notebooks/06_batched_attention.ipynb into a temporary
folder and imported from there. Planted wrong answers are "mutants": minivllm/attention.py's
source with one line changed (each mutation asserts that its target text exists, so a
refactor that removes it fails here loudly instead of testing nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from notebook_helpers import export_learner, grader_tests

import minivllm.attention as ref
from minivllm.course import checks_06 as checks
from minivllm.kv_cache import AttentionMetadata

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_batched_attention.ipynb"


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """The stubbed module a learner starts from, exported from the learner's notebook."""
    return export_learner(NOTEBOOK, tmp_path_factory.mktemp("nb06"), ["attention"], "nb06")["attention"]


def _graders(m):
    return {
        "build_group": lambda: checks.check_build_group(m.build_group),
        "gather_blocks": lambda: checks.check_gather_blocks(m.gather_blocks),
        "attend_group": lambda: checks.check_attend_group(m.attend_group),
        "batched_attention": lambda: checks.check_batched_attention(m.BatchedAttention),
    }


def test_every_exercise_is_a_stub(learner):
    md = AttentionMetadata.build([[0, 1]], [5], [3], block_size=4)
    calls = {
        "Exercise 6.1": lambda: learner.build_group(md, [0], torch.device("cpu")),
        "Exercise 6.2": lambda: learner.gather_blocks(torch.zeros(8, 1, 2), torch.tensor([[1]]), 4),
        "Exercise 6.3": lambda: learner.attend_group(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 3, 4),
                                                     torch.zeros(1, 1, 3, 4),
                                                     torch.ones(1, 1, 1, 3, dtype=torch.bool)),
    }
    for label, call in calls.items():
        with pytest.raises(NotImplementedError, match=label):
            call()
    assert {"BatchedAttention", "build_group", "attend_group"} <= set(vars(learner))


QUERY_POS = "query_pos = (seq_len - q_len).unsqueeze(1) + torch.arange(max_q)"
MUTANTS = {
    # 6.1: the mask
    "top-left causal mask (is_causal's alignment)": (
        ["build_group", "batched_attention"],
        [(QUERY_POS, "query_pos = torch.arange(max_q).expand(len(members), max_q)")]),
    "query positions without the cached offset (seq_len instead of seq_len - q_len)": (
        ["build_group", "batched_attention"],
        [(QUERY_POS, "query_pos = seq_len.unsqueeze(1) + torch.arange(max_q)")]),
    "a query does not see its own key (< instead of <=)": (
        ["build_group", "batched_attention"],
        [("mask = key_pos.view(1, 1, -1) <= query_pos", "mask = key_pos.view(1, 1, -1) < query_pos")]),
    "padded queries see no key (NaN rows)": (
        ["build_group"], [("mask[~valid] = key_pos == 0", "mask[~valid] = False")]),
    "padded queries count as valid": (
        ["build_group"], [("valid = torch.arange(max_q) < q_len.unsqueeze(1)",
                           "valid = torch.arange(max_q) <= q_len.unsqueeze(1)")]),
    # 6.2: the gather
    "blocks gathered in sorted order, not table order": (
        ["gather_blocks", "batched_attention"],
        [("gathered = blocks[block_tables]", "gathered = blocks[block_tables.sort(dim=1).values]")]),
    "keys laid out offset-major (block and offset dims swapped)": (
        ["gather_blocks", "batched_attention"],
        [("return gathered.flatten(1, 2).transpose(1, 2)",
          "return gathered.transpose(1, 2).flatten(1, 2).transpose(1, 2)")]),
    "cache viewed as (block_size, num_blocks, ...)": (
        ["gather_blocks", "batched_attention"],
        [("blocks = cache.view(-1, block_size, *cache.shape[1:])",
          "blocks = cache.view(block_size, -1, *cache.shape[1:]).transpose(0, 1)")]),
    # 6.3: attention
    "tiled GQA (repeat instead of repeat_interleave)": (
        ["attend_group", "batched_attention"],
        [("keys, values, attn_mask=mask,",
          ("keys.repeat(1, q.shape[2] // keys.shape[1], 1, 1), "
           "values.repeat(1, q.shape[2] // values.shape[1], 1, 1), attn_mask=mask,"))]),
    "is_causal instead of the mask": (
        ["attend_group", "batched_attention"],
        [("attn_mask=mask,", "is_causal=True,")]),
    "mask ignored": (["attend_group", "batched_attention"], [("attn_mask=mask,", "")]),
    # the backend
    "new k/v not written to the pool": (
        ["batched_attention"],
        [("self.pool.write(layer_idx, self.metadata.slot_mapping, k, v)", "pass")]),
    "padded outputs scattered back too": (
        ["batched_attention"],
        [("out[g.rows[g.valid]] = o[g.valid]", "out[g.rows.flatten()] = o.flatten(0, 1)")]),
    "decodes and prefill chunks in one group, decodes only": (
        ["batched_attention"], [("for members in (decodes, chunks) if members]",
                                 "for members in (decodes,) if members]")]),
    # the fresh-prompt path
    "fresh prompts attended without the causal mask": (
        ["batched_attention"], [("attn_mask=mask)", "attn_mask=None)")]),
    "each block of a fresh prompt's queries masked as if it started at position 0": (
        ["batched_attention"], [(".triu(keys - rows + 1)", ".triu(1)")]),
    "a block of a fresh prompt's queries against only its own keys": (
        ["batched_attention"], [("k[:, :, :end], v[:, :, :end]", "k[:, :, start:end], v[:, :, start:end]")]),
    "a fresh prompt's heads put back in the wrong order": (
        ["batched_attention"], [("out.permute(2, 0, 1, 3)", "out.permute(2, 1, 0, 3)")]),
    "a chunk after cached tokens taken for a fresh prompt (its cached keys ignored)": (
        ["batched_attention"], [("n > 1 and metadata.seq_lens[b] == n]",
                                 "n > 1 and metadata.seq_lens[b] >= n]")]),
}


(test_check_fails_on_the_stub, test_check_passes_on_the_reference,
 test_check_fails_on_a_planted_wrong_answer) = grader_tests(_graders, ref, MUTANTS, absent="✅")


def test_engine_parity_check(learner, random_engine_model, capsys):
    """The end-to-end check passes on the reference class (mixing chunks with decodes) and
    fails on the stub. (Planted wrong answers are caught by the graders above, faster.)"""
    result = checks.check_engine_parity(ref.BatchedAttention, random_engine_model, (1, 40, 5, 26))
    assert result["mixed_steps"] > 0
    assert "✅" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="not implemented yet"):
        checks.check_engine_parity(learner.BatchedAttention, random_engine_model)
    assert "✅" not in capsys.readouterr().out
