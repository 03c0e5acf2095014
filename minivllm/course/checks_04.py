"""Graders for notebook 04_openai_server (the OpenAI-compatible server).

* :func:`check_sse_event` — Exercise 4.1: one Server-Sent Event per chunk, ``data: ...``
  and a blank line, the JSON on one line so that a newline in the text cannot end the event.
* :func:`check_merge_outputs` — Exercise 4.2: a backlog of step outputs folded into one,
  with every step's text and token deltas kept (including steps whose token completed no
  character yet, whose delta_text is empty).
* :func:`check_apply_token_bitmask` — Exercise 4.3: a grammar's token bitmask applied to the
  rows of a batch of logits, against a reference that reads the bits one token at a time.

Each raises an AssertionError that says what differs, or prints one pass line.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import torch

from minivllm.engine import CompletionOutput, RequestOutput

from .grading import assert_equal, passed


def _call(fn: Callable, *args, exercise: str):
    """Run the learner's function; a stub's NotImplementedError becomes an AssertionError."""
    try:
        return fn(*args)
    except NotImplementedError as e:
        raise AssertionError(f"{exercise} is not implemented yet ({e})") from None


def _parse_sse(stream: str) -> list[str]:
    """The data fields of an SSE stream, as an EventSource would read them."""
    assert stream.endswith("\n\n"), (
        f"an event must end with a blank line ('\\n\\n'), got {stream[-12:]!r}: without it the "
        "client waits for the rest of the event and shows nothing")
    events = []
    for block in stream[:-2].split("\n\n"):
        lines = block.split("\n")
        assert all(line.startswith("data: ") for line in lines), (
            f"every line of an event must start with 'data: ', got {block!r}")
        events.append("\n".join(line[len("data: "):] for line in lines))
    return events


def check_sse_event(sse_event: Callable[[dict | str], str]) -> None:
    """Exercise 4.1: sse_event(payload) -> 'data: <one line of JSON>\\n\\n'."""
    exercise = "Exercise 4.1 (sse_event)"
    payloads = [
        {"id": "cmpl-1", "choices": [{"index": 0, "text": "Hello"}]},
        {"choices": [{"index": 1, "text": "line one\nline two\n\n"}]},  # newlines in the text
        {"choices": [{"index": 0, "text": "héllo 👋 世界"}], "usage": None},
    ]
    for payload in payloads:
        event = _call(sse_event, copy.deepcopy(payload), exercise=exercise)
        assert isinstance(event, str), f"sse_event must return a str, got {type(event).__name__}"
        data = _parse_sse(event)
        assert len(data) == 1, (
            f"one payload must be one event, got {len(data)} from {event!r}: is the JSON on one "
            "line? (json.dumps without indent escapes the newlines inside strings)")
        assert "\n" not in data[0], f"the JSON must be on one line, got {data[0]!r}"
        try:
            decoded = json.loads(data[0])
        except json.JSONDecodeError as e:
            raise AssertionError(f"the data of {event!r} is not JSON ({e})") from None
        assert_equal(decoded, payload, what=f"{exercise}: the JSON sent for {payload}")
    done = _call(sse_event, "[DONE]", exercise=exercise)
    assert_equal(done, "data: [DONE]\n\n", what=f"{exercise}: the last event",
                 hint="a str payload is sent as it is, not as JSON (no quotes)")
    passed(exercise, "one line of JSON per event, a blank line after each, [DONE] last")


def _output(texts: list[str], deltas: list[str], ids: list[list[int]],
            new_ids: list[list[int]], finished: bool) -> RequestOutput:
    completions = [
        CompletionOutput(index=i, text=texts[i], token_ids=ids[i],
                         finish_reason="length" if finished else None,
                         delta_text=deltas[i], delta_token_ids=new_ids[i])
        for i in range(len(texts))]
    return RequestOutput("req-0", "Hi", [1, 2, 3], completions, finished)


def _backlog() -> list[RequestOutput]:
    """Three steps of a request with n=2. Completion 0 receives the two tokens of one
    emoji: the first step's token completes no character, so its delta_text is ""."""
    steps = [
        (["", " a"], ["", " a"], [[240], [5]], [[240], [5]], False),
        (["👋", " a b"], ["👋", " b"], [[240, 241], [5, 6]], [[241], [6]], False),
        (["👋!", " a b c"], ["!", " c"], [[240, 241, 7], [5, 6, 8]], [[7], [8]], True),
    ]
    return [_output(*step) for step in steps]


def check_merge_outputs(merge_outputs: Callable[[list[RequestOutput]], RequestOutput]) -> None:
    """Exercise 4.2: merge_outputs(backlog) keeps the newest state and every step's delta."""
    exercise = "Exercise 4.2 (merge_outputs)"
    backlog = _backlog()
    pristine = copy.deepcopy(backlog)
    merged = _call(merge_outputs, backlog, exercise=exercise)
    assert isinstance(merged, RequestOutput), (
        f"merge_outputs must return a RequestOutput, got {type(merged).__name__}")
    assert backlog == pristine, "merge_outputs must not modify its inputs"
    assert merged.finished and merged.request_id == "req-0", (
        "the merged output must be the newest one (finished, same request id)")
    for i, (want_text, want_ids) in enumerate([("👋!", [240, 241, 7]), (" a b c", [5, 6, 8])]):
        c = merged.outputs[i]
        assert_equal(c.text, want_text, what=f"{exercise}: completion {i} cumulative text")
        assert_equal(c.token_ids, want_ids, what=f"{exercise}: completion {i} token ids")
        assert_equal(c.finish_reason, "length", what=f"{exercise}: completion {i} finish_reason")
        assert_equal(c.delta_text, want_text, what=f"{exercise}: completion {i} delta_text",
                     hint="join the delta_text of every step, oldest first")
        assert_equal(c.delta_token_ids, want_ids,
                     what=f"{exercise}: completion {i} delta_token_ids",
                     hint="concatenate the delta_token_ids of every step, oldest first")
    single = _call(merge_outputs, backlog[1:2], exercise=exercise)
    assert_equal([c.delta_text for c in single.outputs], ["👋", " b"],
                 what=f"{exercise}: a backlog of one output")
    passed(exercise, "newest state, every step's text and token deltas, inputs untouched")


def _reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """apply_token_bitmask the slow, obvious way: token t is bit t % 32 of word t // 32."""
    out = logits.clone()
    words = bitmask.tolist()
    for r, row in enumerate(rows):
        for t in range(out.shape[1]):
            w = t // 32
            if w >= len(words[r]) or not (words[r][w] >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


def check_apply_token_bitmask(apply_token_bitmask: Callable) -> None:
    """Exercise 4.3: apply_token_bitmask(logits, bitmask, rows) masks rows[r] by bitmask[r]."""
    exercise = "Exercise 4.3 (apply_token_bitmask)"
    gen = torch.Generator().manual_seed(0)
    sign_bit = torch.tensor([-2**31], dtype=torch.int32)  # bit 31: the last token of a word
    cases = [  # (what, batch, vocab, words, rows)
        ("every row, vocabulary = 2 words", 2, 64, 2, [0, 1]),
        ("rows 2 and 0 of 4 (bitmask row r is logits row rows[r])", 4, 64, 2, [2, 0]),
        ("a vocabulary that ends inside the last word", 3, 50, 2, [1]),
        ("logits wider than the mask (a padded vocabulary)", 2, 80, 2, [0, 1]),
    ]
    for what, batch, vocab, num_words, rows in cases:
        logits = torch.randn(batch, vocab, generator=gen)
        bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), num_words), generator=gen,
                                dtype=torch.int32)
        bitmask[0, 0] = sign_bit[0] | 1  # tokens 0 and 31 allowed, the rest of word 0 banned
        want = _reference_mask(logits, bitmask, rows)
        got = logits.clone()
        result = _call(apply_token_bitmask, got, bitmask.clone(), list(rows), exercise=exercise)
        assert result is None or result is got, (
            f"{exercise}: mask the logits in place (the engine samples from the same tensor)")
        banned_want, banned_got = torch.isinf(want), torch.isinf(got)
        if not torch.equal(banned_want, banned_got):
            row, token = (banned_want != banned_got).nonzero()[0].tolist()
            raise AssertionError(
                f"{exercise}, {what}: logits[{row}, {token}] should be "
                f"{'-inf' if banned_want[row, token] else 'kept'}, got {got[row, token].item()} "
                f"(token {token} is bit {token % 32} of word {token // 32}, lowest bit first; "
                "rows not listed are untouched; tokens past the last word are banned)")
        assert torch.equal(got[~banned_got], logits[~banned_got]), (
            f"{exercise}, {what}: the allowed logits must keep their values")
    passed(exercise, "bit t % 32 of word t // 32, the listed rows only, padding banned")
