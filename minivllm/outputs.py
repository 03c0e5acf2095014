# Generated from solutions/03_continuous_batching.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The output processor: sampled tokens in, text and streaming deltas out.

Built in notebook 03_continuous_batching (vLLM's ``OutputProcessor`` and detokenizer). The
scheduler appends tokens and applies the token-level stops (EOS, stop token ids, lengths);
everything about *text* happens here, in one place: each request's incremental
detokenizer, stop strings (matched on the detokenized text, searching only its new tail),
the deltas a streaming client receives (holding back what could be the start of a stop
string), and the final output of a request that failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from minivllm.scheduler import Sequence
from minivllm.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionOutput:
    """One of a request's n completions (vLLM's shape), plus the delta of the last step."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    delta_text: str = ""  # new text since the previous output of this completion
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestMetrics:
    """When things happened to one request (vLLM's names; ``time.monotonic()`` seconds).

    Queue time is ``first_scheduled_time - arrival_time``, time to first token
    ``first_token_time - arrival_time``; the server's ``/metrics`` histograms read them.
    """

    arrival_time: float
    first_scheduled_time: float | None = None  # first step that computed any of its tokens
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after a step (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when processing this request failed: it alone was stopped
    # SamplingParams(prompt_logprobs=k): None for the first token, then per prompt token
    # {its id: logprob, and the top k}, from the logits of the position before it
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class TextState:
    """The incremental text of one completion."""

    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    flushed: bool = False  # the detokenizer's held-back tail was added (the sequence ended)


@dataclass
class RequestState:
    """One request while it runs: its prompt, its n sequences, their texts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    metrics: RequestMetrics
    texts: dict[int, TextState] = field(default_factory=dict)  # seq_id -> its text


class OutputProcessor:
    """Turns each step's new tokens into ``RequestOutput`` s (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._failed: list[RequestOutput] = []  # final outputs of requests that failed

    def add_request(self, request: RequestState) -> None:
        for seq in request.seqs:
            request.texts[seq.seq_id] = TextState(IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids,
                skip_special_tokens=seq.params.skip_special_tokens))
        self.requests[request.request_id] = request

    def add_token(self, seq: Sequence, token: int, finishing: bool) -> str | None:
        """Detokenize one appended token; the stop string it completed, if any (the caller,
        ``Scheduler.update``, then ends the sequence there). The text is cut at the stop."""
        state = self.requests[seq.request_id].texts[seq.seq_id]
        delta = state.detokenizer.add([token])
        if finishing:  # emit a character that the last token left incomplete
            delta += self._flush(state)
        stops = seq.params.stop_strings
        if not stops or not delta:
            state.text += delta
            return None
        search_from = max(0, len(state.text) - max(map(len, stops)) + 1)
        state.text += delta
        hits = [(i, s) for s in stops if (i := state.text.find(s, search_from)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        state.text = state.text[:index + len(stop) if seq.params.include_stop_str_in_output
                                else index]
        state.flushed = True  # the text ends here, whatever the detokenizer still holds
        return stop

    @staticmethod
    def _flush(state: TextState) -> str:
        state.flushed = True
        return state.detokenizer.flush()

    def fail(self, request_id: str, message: str) -> RequestState | None:
        """Forget a failed request; its final output (``error`` set) comes with the next
        ``process``. Returns its state, or None if it is unknown."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            completions = [CompletionOutput(s.index, request.texts[s.seq_id].text,
                                            list(s.output_token_ids), finish_reason="abort")
                           for s in request.seqs]
            self._failed.append(RequestOutput(
                request_id, request.prompt, request.prompt_token_ids, completions, True,
                metrics=request.metrics, error=message))
        return request

    def process(self, progressed: list[Sequence],
                on_error: Callable[[str, Exception], None]) -> list[RequestOutput]:
        """One output per request that progressed, then one per request that failed.
        A request whose output cannot be built is handed to ``on_error`` (it fails alone)."""
        outputs, now = [], time.monotonic()
        for request_id in dict.fromkeys(seq.request_id for seq in progressed):
            request = self.requests.get(request_id)
            if request is None:  # failed in this step
                continue
            try:
                completions = [self._completion(request, s) for s in request.seqs]
            except Exception as e:  # noqa: BLE001 -- this request fails, not the step
                on_error(request_id, e)
                continue
            finished = all(s.is_finished for s in request.seqs)
            metrics = request.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            metrics.finished_time = now if finished else None
            outputs.append(RequestOutput(
                request_id, request.prompt, request.prompt_token_ids, completions, finished,
                num_cached_tokens=request.seqs[0].num_cached_tokens, metrics=metrics,
                prompt_logprobs=request.seqs[0].prompt_logprobs))
            if finished:
                del self.requests[request_id]
        failed, self._failed = self._failed, []
        return outputs + failed

    def _completion(self, request: RequestState, seq: Sequence) -> CompletionOutput:
        """The completion so far and its delta; while it runs, the last len(longest stop
        string) - 1 characters are held back, so a client never sees half a stop string."""
        state = request.texts[seq.seq_id]
        if seq.is_finished and not state.flushed:  # ended by a grammar or an abort
            state.text += self._flush(state)
        stops = seq.params.stop_strings
        holdback = 0 if seq.is_finished or not stops else max(map(len, stops)) - 1
        emit_to = max(state.num_emitted_chars, len(state.text) - holdback)
        delta_text = state.text[state.num_emitted_chars:emit_to]
        state.num_emitted_chars = emit_to
        output_ids = seq.output_token_ids
        delta_ids = output_ids[state.num_emitted_tokens:]
        state.num_emitted_tokens = len(output_ids)
        want_logprobs = seq.params.logprobs is not None
        return CompletionOutput(
            index=seq.index, text=state.text[:emit_to], token_ids=list(output_ids),
            cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
            logprobs=list(seq.logprobs) if want_logprobs else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            delta_text=delta_text, delta_token_ids=delta_ids)
