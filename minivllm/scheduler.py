# Generated from solutions/03_continuous_batching.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Sequences and the continuous-batching scheduler.

Built in notebook 03_continuous_batching. Every engine step the scheduler decides which
sequences run and how many new tokens each computes, under two budgets: at most
``max_num_seqs`` sequences and at most ``max_num_batched_tokens`` tokens per step.

One rule covers prefill and decode alike: a sequence has ``num_tokens`` tokens (prompt +
output so far) of which ``num_computed_tokens`` have keys/values in the cache; a step
computes the next ``min(num_tokens - num_computed_tokens, budget left)`` of them. A
decoding sequence needs 1; a prompt longer than the budget is split into chunks
(chunked prefill) that run beside other sequences' decodes.

Each step:
1. running sequences, oldest first, get their tokens and any blocks they need; when the
   pool is out of blocks the *newest* running sequence is preempted (its blocks freed, its
   tokens kept) and goes back to the front of the queue, to be recomputed later;
2. waiting sequences are admitted first-come-first-served while sequences, tokens and
   blocks allow, and, where a step's cost grows with its tokens (a CPU), while packing one
   more prompt into the step delays the prompts in it less than it saves the queue.
After the model runner has run the plan, ``update`` appends the sampled tokens and retires
sequences on EOS, stop token ids or length, freeing their blocks at once. ``SchedulerOutput``
(the plan) and ``RunnerOutput`` (what the runner gives back) are the whole contract between
the scheduler and the model runner (vLLM's ``SchedulerOutput`` / ``ModelRunnerOutput``).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minivllm.kv_cache import BlockManager
from minivllm.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds blocks and is scheduled every step
    FINISHED = "finished"  # done; finish_reason says why


class Sequence:
    """One completion being generated: its tokens, cache state and sampling state."""

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, index: int = 0, parent: Sequence | None = None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.parent = parent  # for n > 1: wait for this sibling's prompt to be cached
        self.params = params
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of its registered full blocks
        self.num_computed_tokens = 0  # tokens whose keys/values are in the cache
        self.num_cached_tokens = 0  # of those, found in the prefix cache at admission
        self.num_preemptions = 0
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop token id or string that ended it
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []  # per output token, when asked for
        # prompt logprobs need the logits of every prompt position: no prefix-cache lookup
        self.lookup_prefix = params.prompt_logprobs is None
        # the first completion records them: None for the first token, then one entry per
        # prompt token, {its id: logprob, and the top k}, from the position before it
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")


@dataclass
class SchedulerOutput:
    """The plan for one step."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class RunnerOutput:
    """What the model runner gives back for one plan; ``Scheduler.update`` applies it."""

    # seq_id -> its sampled tokens: one per step, or several after a verified draft (M8);
    # a mid-prompt chunk samples nothing
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    # seq_id -> per sampled token {token id: logprob, and the top k}, when asked for
    logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    # seq_id -> this chunk's prompt logprobs (SamplingParams.prompt_logprobs)
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    failed: dict[int, Exception] = field(default_factory=dict)  # seq_id -> why its request fails
    counters: dict[str, int] = field(default_factory=dict)  # what this step adds to EngineStats


class Scheduler:
    """Admit, chunk, retire and preempt, every step (see the module docstring)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: tuple[int, ...] = (),
                 step_overhead_tokens: int = 0):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # a step's fixed cost in tokens of prefill, for packing prompts (0: always pack)
        self.step_overhead_tokens = step_overhead_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        # 1. running sequences, oldest first; preempt the newest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.can_grow(seq.block_table, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.grow(seq.block_table, seq.num_computed_tokens + n)
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break
        # 2. admit waiting sequences first-come-first-served (not in a step that preempted)
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            if seq.parent is not None and not self._prompt_cached(seq.parent):
                break  # n > 1: let the first sibling fill the prefix cache first
            if not bm.can_allocate(seq.token_ids, seq.lookup_prefix):
                break
            if not self._joins_step(out, seq, budget):
                break  # it would delay the step's prompts more than it saves: next step
            self.waiting.popleft()
            seq.block_table, seq.num_cached_tokens = bm.allocate(seq.token_ids, seq.lookup_prefix)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            out.scheduled.append((seq, n))
            out.admitted.append(seq)
            budget -= n
        return out

    @staticmethod
    def _prompt_cached(seq: Sequence) -> bool:
        return seq.is_finished or seq.num_computed_tokens >= seq.num_prompt_tokens

    def _joins_step(self, out: SchedulerOutput, seq: Sequence, budget: int) -> bool:
        """Whether waiting ``seq`` (the queue's head) should join this step or start the next.

        Yes when prompts always pack (``step_overhead_tokens`` 0, a GPU's default) or the step
        holds no prompt yet. Otherwise a greedy weighing of waits for a first token, counted in
        tokens of compute: packed, its ``n`` new tokens delay each of the step's ``m`` prompts
        (``m * n``); left for the next step, it and the ``k`` prompts queued behind it each
        wait one step more, which costs the step's overhead plus the rows that step runs
        anyway (``(1 + k) * (overhead + rows)``). On a CPU, where a step's time grows with its
        tokens, two long prompts go one after the other unless many more wait behind them."""
        if not self.step_overhead_tokens:
            return True
        # (a sequence with more than one token to compute is prefilling: a prompt, or one
        # recomputed after preemption)
        prompts = sum(1 for s, _ in out.scheduled if s.num_tokens - s.num_computed_tokens > 1)
        if prompts == 0:
            return True
        bm = self.block_manager
        cached = len(bm.match_prefix(seq.token_ids)) * bm.block_size if seq.lookup_prefix else 0
        n = min(seq.num_tokens - cached, budget)  # its tokens to compute in this step
        behind = len(self.waiting) - 1
        rows = len(out.scheduled)  # next step's: the decodes and these prompts, decoding then
        return prompts * n <= (1 + behind) * (self.step_overhead_tokens + rows)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: free the blocks, keep the tokens, requeue at the front."""
        self.block_manager.free_blocks(seq.block_table)
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, plan: SchedulerOutput, out: RunnerOutput,
               on_token: Callable[[Sequence, int, bool], str | None] | None = None,
               on_error: Callable[[Sequence, Exception], None] | None = None) -> list[Sequence]:
        """Apply the runner's output to the plan: advance the computed counts, append the
        sampled tokens up to the first stop, retire finished sequences.

        A sequence gets one token per step, or several after a verified draft (notebook 08);
        they are appended one at a time and the first that stops the sequence is the last
        appended, so no token past a stop is ever added (nor later deleted). ``on_token(seq,
        token, finishing)`` sees each appended token and may return a stop string it
        completed (the output processor detokenizes there). A stop check that raises is handed
        to ``on_error`` (the engine fails that request alone) instead of ending the step.
        Returns the sequences that received tokens.
        """
        progressed = []
        for seq, n in plan.scheduled:
            if seq.is_finished:  # its request failed earlier in this step
                continue
            seq.num_computed_tokens += n
            if seq.prompt_logprobs is not None:
                seq.prompt_logprobs.extend(out.prompt_logprobs.get(seq.seq_id, ()))
            tokens = out.token_ids.get(seq.seq_id, [])
            try:
                kept, reason = self._append(seq, tokens, out.logprobs.get(seq.seq_id), on_token)
            except Exception as e:
                if on_error is None:
                    raise
                on_error(seq, e)
                continue
            if kept:  # a verified draft's kept tokens, all but a last bonus token, have KV
                seq.num_computed_tokens += min(len(tokens) - 1, kept)
            self.block_manager.cache_full_blocks(
                seq.token_ids, seq.block_table, seq.block_hashes, seq.num_computed_tokens)
            if kept:
                progressed.append(seq)
            if reason is not None:
                self.finish(seq, *reason)
        return progressed

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[dict] | None,
                on_token) -> tuple[int, tuple[str, int | str | None] | None]:
        """Append ``tokens`` up to the first that stops the sequence: (how many, why)."""
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
                seq.cumulative_logprob += logprobs[i][token]
            reason = self.check_stop(seq, token)
            stop_string = on_token(seq, token, reason is not None) if on_token else None
            if reason is None and stop_string is not None:
                reason = ("stop", stop_string)
            if reason is not None:
                return i + 1, reason
        return len(tokens), None

    def check_stop(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
        """Token-level stop conditions: (finish_reason, stop_reason) or None."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Retire a sequence now and give its blocks back."""
        if seq.is_finished:
            return
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_blocks(seq.block_table)
