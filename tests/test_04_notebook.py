"""Notebook 04's exercises: the learner's stubs fail loudly, and each check cell's grader
fails on the stub and on a plausible wrong answer, and passes on the reference."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from notebook_helpers import export_learner

from minivllm.course import checks_04
from minivllm.protocol import merge_outputs, sse_event
from minivllm.structured import apply_token_bitmask

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "04_openai_server.ipynb"


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """minivllm/protocol.py and structured.py as the learner's stripped notebook exports them."""
    return export_learner(NOTEBOOK, tmp_path_factory.mktemp("learner04"),
                          ["protocol", "structured"], "nb04")


@pytest.fixture(scope="module")
def stub_protocol(learner):
    return learner["protocol"]


@pytest.fixture(scope="module")
def stub_structured(learner):
    return learner["structured"]


def test_stubs_raise_not_implemented(stub_protocol):
    with pytest.raises(NotImplementedError, match="Exercise 4.1"):
        stub_protocol.sse_event({"a": 1})
    with pytest.raises(NotImplementedError, match="Exercise 4.2"):
        stub_protocol.merge_outputs(checks_04._backlog())


def _sse_without_blank_line(payload):
    """Forgets the blank line that ends an event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n"


def _sse_pretty(payload):
    """Pretty-printed JSON: a multi-line event the client cannot parse."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, indent=2)}\n\n"


def _sse_done_as_json(payload):
    """Sends "[DONE]" JSON-quoted."""
    return f"data: {json.dumps(payload)}\n\n"


def _merge_last_only(outputs):
    """Keeps only the newest step's delta: the backlog's text is lost."""
    return outputs[-1]


def _merge_text_only(outputs):
    """Merges the text but not the token ids (logprobs would shift)."""
    merged = merge_outputs(outputs)
    completions = [dataclasses.replace(c, delta_token_ids=list(o.delta_token_ids))
                   for c, o in zip(merged.outputs, outputs[-1].outputs)]
    return dataclasses.replace(merged, outputs=completions)


def _merge_non_empty_text_only(outputs):
    """Drops the steps whose token completed no character yet (delta_text == "")."""
    kept = [o for o in outputs if all(c.delta_text for c in o.outputs)] or outputs[-1:]
    if kept[-1] is not outputs[-1]:
        kept.append(outputs[-1])
    return merge_outputs(kept)


def _merge_in_place(outputs):
    """Right answer, but it overwrites the newest input."""
    merged = merge_outputs(outputs)
    outputs[-1].outputs[:] = merged.outputs
    return outputs[-1]


@pytest.mark.parametrize("wrong", [_sse_without_blank_line, _sse_pretty, _sse_done_as_json])
def test_check_sse_event(stub_protocol, wrong):
    checks_04.check_sse_event(sse_event)
    for bad in (stub_protocol.sse_event, wrong):
        with pytest.raises(AssertionError):
            checks_04.check_sse_event(bad)


@pytest.mark.parametrize("wrong", [_merge_last_only, _merge_text_only,
                                   _merge_non_empty_text_only, _merge_in_place])
def test_check_merge_outputs(stub_protocol, wrong):
    checks_04.check_merge_outputs(merge_outputs)
    for bad in (stub_protocol.merge_outputs, wrong):
        with pytest.raises(AssertionError):
            checks_04.check_merge_outputs(bad)


def _bitmask_big_endian(logits, bitmask, rows):
    """Reads the bits of a word highest first."""
    import numpy as np

    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="big")
    banned = torch.from_numpy(bits[:, :logits.shape[1]] == 0)
    for r, row in enumerate(rows):
        logits[row, :banned.shape[1]].masked_fill_(banned[r], float("-inf"))
        logits[row, banned.shape[1]:] = float("-inf")


def _bitmask_keeps_padding(logits, bitmask, rows):
    """Leaves the logits past the last word alone (a padded vocabulary's tokens sampleable)."""
    wide = logits.shape[1]
    narrow = min(wide, 32 * bitmask.shape[1])
    part = logits[:, :narrow].clone()
    apply_token_bitmask(part, bitmask, rows)
    logits[:, :narrow] = part


def _bitmask_row_r(logits, bitmask, rows):
    """Masks logits row r with bitmask[r], not row rows[r]."""
    apply_token_bitmask(logits, bitmask, list(range(len(rows))))


@pytest.mark.parametrize("wrong", [_bitmask_big_endian, _bitmask_keeps_padding, _bitmask_row_r])
def test_check_apply_token_bitmask(stub_structured, wrong):
    checks_04.check_apply_token_bitmask(apply_token_bitmask)
    with pytest.raises(NotImplementedError, match="Exercise 4.3"):
        stub_structured.apply_token_bitmask(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int32),
                                            [0])
    for bad in (stub_structured.apply_token_bitmask, wrong):
        with pytest.raises(AssertionError):
            checks_04.check_apply_token_bitmask(bad)
