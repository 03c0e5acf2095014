# Generated from solutions/08_speculative_decoding.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Speculative decoding: guess several tokens cheaply, let the target check them in one pass.

Built in notebook 08_speculative_decoding. At one user, a decode step reads every weight of
the model to produce one token, and a step that scores k + 1 tokens costs about the same.
So a cheap *proposer* guesses the next k tokens, the target model scores all of them in one
forward pass (k + 1 query rows per sequence through the paged cache, causal with the offset,
exactly like a prefill chunk), and a *verifier* keeps the longest prefix the target agrees
with plus one token of the target's own. Every step still emits at least one token, and the
emitted tokens follow the target's distribution exactly (vLLM's split: proposer, target
pass, rejection sampler):

    proposer ─▶ [last, d1 .. dk] ─▶ target forward (k+1 rows) ─▶ accept d1..da, + 1 token
            ─▶ roll back the KV of the rejected d(a+1)..dk (computed count, blocks)

Proposers: ``ngram`` (prompt lookup: find the latest earlier occurrence of the last n tokens
and propose what followed it; free) and ``draft_model`` (a smaller checkpoint with the same
vocabulary, greedy, with its own paged KV cache that follows the sequence). Acceptance:
greedy requests accept the proposals equal to the target's argmax; sampled ones use the
rejection rule of speculative sampling (accept with probability min(1, p/q), on rejection
draw from the normalised max(0, p - q)); both proposers here are deterministic, so q is
one-hot.

When it does not pay it steps aside: no verification rows where the proposer has nothing,
no speculation while a step schedules ``disable_by_batch_size`` sequences or more (a big
batch is already compute-bound), and a sequence whose recent proposals were mostly rejected
pauses for a while.

In the engine it is a runner *wrapper*: ``SpeculativeRunner(runner, block_manager)`` has the
``execute(plan) -> RunnerOutput`` of the runner it wraps (plain, compiled or tensor
parallel), which ``LLMEngine`` builds when ``EngineConfig.speculative_config`` is set
(``engine.RUNNER_VARIANTS``). A verified sequence's entry in ``RunnerOutput.token_ids`` holds
all its emitted tokens; ``Scheduler.update`` appends them up to the first stop.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field

import torch

from minivllm.compile import DecodeInputs
from minivllm.kv_cache import AttentionMetadata, BlockManager, KVCachePool
from minivllm.runner import NOT_FINITE, ModelInputs, ModelRunner, not_finite, num_prompt_tokens
from minivllm.sampling import Sampler, SamplingParams, sampling_probs
from minivllm.scheduler import RunnerOutput, SchedulerOutput, Sequence, SequenceStatus
from minivllm.tokenizer import Tokenizer

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # beyond this a step's rows are mostly rejected work


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``, validated once at start-up."""

    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int  # k: tokens proposed per step
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up
    prompt_lookup_min: int = 1  # ngram: shortest suffix that counts as a match
    model: str | None = None  # draft_model: checkpoint directory or hub id
    disable_by_batch_size: int | None = 8  # no speculation in a step of this many sequences
    min_acceptance_rate: float = 0.2  # a sequence below this (recent window) pauses
    acceptance_window: int = 8  # verifications the rate is measured over
    pause_steps: int = 32  # how long a sequence with low acceptance pauses

    @classmethod
    def parse(cls, spec: dict | str | SpeculativeConfig) -> SpeculativeConfig:
        """From a dict or its JSON text (the server's ``--speculative-config``)."""
        if isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(spec).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "method" not in spec or "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        spec = dict(spec)
        if spec["method"] == "ngram":  # vLLM: one bound given, the other follows it
            if "prompt_lookup_max" in spec and "prompt_lookup_min" not in spec:
                spec["prompt_lookup_min"] = min(spec["prompt_lookup_max"], cls.prompt_lookup_min)
            if "prompt_lookup_min" in spec and "prompt_lookup_max" not in spec:
                spec["prompt_lookup_max"] = max(spec["prompt_lookup_min"], cls.prompt_lookup_max)
        return cls(**spec)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose from "
                             f"{', '.join(SPEC_METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo}, {hi}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method 'draft_model' needs 'model': the draft checkpoint")
        if self.method == "ngram" and self.model:
            raise ValueError("method 'ngram' takes no 'model'")
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or d < 1):
            raise ValueError(f"disable_by_batch_size must be a positive integer, got {d!r}")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}")
        if self.acceptance_window < 1 or self.pause_steps < 0:
            raise ValueError("acceptance_window must be >= 1 and pause_steps >= 0")


def ngram_propose(token_ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier occurrence of the
    longest suffix of ``token_ids`` (``max_n`` down to ``min_n`` tokens long); [] if none.

    The continuation reads on through the proposal itself, so a match near the end of a
    periodic text still yields k tokens (``a b a b`` with suffix ``a b`` proposes ``a b a``).
    """
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        for start in range(length - n - 1, -1, -1):  # latest occurrence first
            if token_ids[start:start + n] == suffix:
                extended = list(token_ids)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[length:]
    return []


def greedy_accept(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """Temperature 0: the emitted tokens, given the target's argmax at each of the k + 1 rows.

    Row i of the target pass predicts the token after ``draft_ids[:i]``. Keep the drafts as
    long as they equal the target's choice; at the first mismatch emit the target's token
    instead and stop; if all k match, the last row gives one more token for free.
    """
    emitted = []
    for draft, target in zip(draft_ids, target_ids):
        emitted.append(target)
        if draft != target:
            return emitted
    emitted.append(target_ids[len(draft_ids)])
    return emitted


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a normalised distribution (V,) by inverting its CDF with one uniform: the
    first token whose running sum exceeds u, so a token of probability 0 is never drawn (not
    at u = 0 either); a u above the sum's rounded total takes the last token that has any
    probability. (Notebook 03's ``inverse_cdf`` scales u to the row's own total; this one
    does not, so an unnormalised input shows.)"""
    u = torch.rand((), dtype=torch.float64, generator=generator)
    cdf = probs.double().cumsum(0)  # (V,)
    token = int(torch.searchsorted(cdf, u, right=True))
    return min(token, int(probs.nonzero().max()))


def rejection_sample(draft_ids: list[int], target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling: emitted tokens that follow the target's distribution exactly.

    target_probs: (k + 1, V) the target's (processed) distribution at each row; draft_probs:
    (k, V) the proposer's, or None for a deterministic proposer (one-hot q). Draft i is kept
    with probability min(1, p(d) / q(d)); the first rejected one is replaced by a draw from
    max(0, p - q), normalised; if none is rejected, one more token is drawn from row k.
    """
    for i, draft in enumerate(draft_ids):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[draft] = 1.0
        else:
            q = draft_probs[i]
        u = float(torch.rand((), generator=generator))
        if u * float(q[draft]) < float(p[draft]):  # u < p/q, without dividing by q
            continue
        residual = (p - q).clamp(min=0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p  # total is 0 only where p == q
        return list(draft_ids[:i]) + [sample_from(residual, generator)]
    return list(draft_ids) + [sample_from(target_probs[len(draft_ids)], generator)]


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution the sampler draws from, per row: temperature, top-k, top-p, min-p.

    logits: (R, V) float32, params: one per row -> (R, V) probabilities. Greedy rows are not
    used (they go through ``greedy_accept``). It is the sampler's own pipeline
    (``sampling.sampling_probs``), so acceptance and sampling can never disagree.
    """
    return sampling_probs(logits, params)


def rollback(block_manager: BlockManager, block_table: list[int], num_computed_tokens: int) -> None:
    """Give back the blocks past the ``num_computed_tokens`` whose keys and values are valid.

    The verification step grew the table for all k + 1 rows; blocks that hold only rejected
    tokens go back to the pool. Slots of rejected tokens inside the kept last block are
    simply overwritten later (attention never reads past a sequence's length), and since the
    prefix cache registers only blocks full of *computed* tokens, registering after the
    rollback never names a block that holds a rejected token.
    """
    keep = block_manager.blocks_needed(num_computed_tokens)
    tail = block_table[keep:]
    del block_table[keep:]
    block_manager.free_blocks(tail)


@dataclass
class DraftState:
    """One sequence's place in the draft model's own paged cache."""

    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


class DraftModelProposer:
    """Greedy proposals from a smaller model with the same vocabulary.

    The draft keeps its own KV pool and block manager (same block size and number of blocks
    as the target). A sequence's draft blocks are allocated on its first proposal (sharing
    cached prefix blocks, as the target does), grown as it goes, rolled back to what the
    target kept before its next proposal (``after_verify``), and freed when the sequence
    leaves the running set (finished or preempted: ``release``).
    """

    def __init__(self, runner: ModelRunner, config: SpeculativeConfig):
        from minivllm.compile import merge_projections
        from minivllm.config import ModelConfig, resolve_model_path
        from minivllm.model import load_model

        path = resolve_model_path(config.model)
        self.model_config = mc = ModelConfig.from_pretrained(path)
        target = runner.model_config
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model {config.model} has vocab_size {mc.vocab_size}, "
                             f"the target {target.vocab_size}: they must share a vocabulary")
        if vocabulary(path) != vocabulary(runner.model_path):
            raise ValueError(f"the draft model {config.model} has a different tokenizer "
                             "from the target: its token ids would mean other tokens")
        if mc.max_position_embeddings < runner.max_model_len:
            raise ValueError(f"the draft model {config.model} holds "
                             f"{mc.max_position_embeddings} positions, less than max_model_len "
                             f"{runner.max_model_len}: give a smaller max_model_len")
        self.device, self.block_size = runner.device, runner.config.block_size
        self.attention_cls = runner.attention_cls  # the target's attention backend
        self.model = load_model(path, dtype=runner.dtype, device=runner.device)
        if runner.config.merge_projections:  # as the target's (notebook 07)
            merge_projections(self.model)
        self.pool = KVCachePool(mc.num_hidden_layers, runner.num_blocks, self.block_size,
                                mc.num_key_value_heads, mc.head_dim, runner.dtype, runner.device)
        self.block_manager = BlockManager(runner.num_blocks, self.block_size,
                                          runner.config.enable_prefix_caching)
        self.states: dict[int, DraftState] = {}

    def release(self, seq_id: int) -> None:
        """Free a sequence's draft blocks (it finished, failed or was preempted)."""
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.block_manager.free_blocks(state.block_table)

    def _reserve(self, seq: Sequence, k: int) -> DraftState | None:
        """The sequence's draft state with room for its tokens and k - 1 proposals, or None."""
        bm, state = self.block_manager, self.states.get(seq.seq_id)
        if state is None:
            if not bm.can_allocate(seq.token_ids):
                return None
            table, cached = bm.allocate(seq.token_ids)
            state = self.states[seq.seq_id] = DraftState(table, [], cached)
        if not bm.can_grow(state.block_table, seq.num_tokens + k - 1):
            return None
        bm.grow(state.block_table, seq.num_tokens + k - 1)
        return state

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Greedy proposals for ``(seq, k)`` pairs: k draft passes, batched across sequences.

        Pass 0 catches the draft cache up on the tokens it has not seen (the whole prompt the
        first time) and proposes d1; pass j feeds d_j and proposes d_(j+1).
        """
        batch = [(seq, k, state) for seq, k in wanted if (state := self._reserve(seq, k))]
        proposals: dict[int, list[int]] = {seq.seq_id: [] for seq, _, _ in batch}
        for j in range(max((k for _, k, _ in batch), default=0)):
            rows = [(seq, state) for seq, k, state in batch if k > j]
            tokens = [seq.token_ids[state.num_computed_tokens:] + proposals[seq.seq_id]
                      for seq, state in rows]  # pass 0: the catch-up; then one token each
            if j > 0:
                tokens = [t[-1:] for t in tokens]
            ids = self._forward([s for _, s in rows], tokens)
            for (seq, _), token in zip(rows, ids):
                proposals[seq.seq_id].append(token)
        return proposals

    def _forward(self, states: list[DraftState], tokens: list[list[int]]) -> list[int]:
        """Run the draft on each state's new tokens; the argmax after each one's last."""
        device = self.device
        starts = [s.num_computed_tokens for s in states]
        input_ids = [t for ts in tokens for t in ts]
        positions = [p for st, ts in zip(starts, tokens) for p in range(st, st + len(ts))]
        metadata = AttentionMetadata.build([s.block_table for s in states], starts,
                                           [len(ts) for ts in tokens], self.block_size, device)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
        hidden = self.model(as_tensor(input_ids), as_tensor(positions),
                            self.attention_cls(self.pool, metadata))
        last_rows = as_tensor(metadata.query_start_loc[1:]) - 1
        for state, ts in zip(states, tokens):
            state.num_computed_tokens += len(ts)
        return self.model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()

    def after_verify(self, seq: Sequence) -> None:
        """Roll the draft cache back to what the target kept, and register its full blocks.

        Called before a sequence's next proposal, once ``Scheduler.update`` has applied the
        last step: the draft's keys and values are valid for the tokens the target computed
        (the proposals it fed past those were rejected, or never verified)."""
        state = self.states.get(seq.seq_id)
        if state is None:
            return
        state.num_computed_tokens = min(state.num_computed_tokens, seq.num_computed_tokens)
        rollback(self.block_manager, state.block_table, state.num_computed_tokens)
        self.block_manager.cache_full_blocks(seq.token_ids, state.block_table,
                                             state.block_hashes, state.num_computed_tokens)


def vocabulary(model_path) -> tuple:
    """A checkpoint's tokenizer vocabulary, added tokens included (token <-> id)."""
    data = json.loads(Tokenizer.from_pretrained(model_path).to_str())
    added = sorted((t["id"], t["content"]) for t in data.get("added_tokens", []))
    return data["model"].get("vocab"), added


class NgramProposer:
    """Prompt lookup over each sequence's own prompt and output (no model, no cache)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def release(self, seq_id: int) -> None:
        pass  # nothing kept per sequence

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        c = self.config
        return {seq.seq_id: ngram_propose(seq.token_ids, k, c.prompt_lookup_max,
                                          c.prompt_lookup_min) for seq, k in wanted}

    def after_verify(self, seq: Sequence) -> None:
        pass


class SpeculativeRunner:
    """A runner that speculates: propose, verify in one target pass, accept, roll back.

    It wraps the runner ``build_runner`` chose (plain, compiled or tensor parallel) and keeps
    its contract, ``execute(plan) -> RunnerOutput``; ``LLMEngine`` builds it when
    ``EngineConfig.speculative_config`` is set (``engine.RUNNER_VARIANTS["speculative"]``).
    Everything else (``model``, ``pool``, ``num_blocks``, ``decoder``, ``logits_processors``,
    ``sample``, ``zero_blocks``, ``close`` ...) is the wrapped runner's. Like any runner it
    reads the sequences and never changes them, but for KV allocation: it grows a
    speculating sequence's block table for the draft rows and, before it returns, rolls it
    back past the accepted tokens. ``Scheduler.update`` then counts the accepted drafts as
    computed and appends the emitted tokens up to the first stop.
    """

    def __init__(self, runner: ModelRunner, block_manager: BlockManager,
                 config: dict | str | SpeculativeConfig | None = None):
        self.runner, self.block_manager = runner, block_manager
        # the engine's speculative_config, unless given (a test may wrap a built engine's runner)
        self.spec_config = c = SpeculativeConfig.parse(
            runner.config.speculative_config if config is None else config)
        self.proposer = (DraftModelProposer(runner, c) if c.method == "draft_model"
                         else NgramProposer(c))
        self.seqs: dict[int, Sequence] = {}  # the sequences it keeps state for, by seq_id
        self.recent: dict[int, deque[tuple[int, int]]] = {}  # seq_id -> (proposed, accepted)
        self.paused_until: dict[int, int] = {}  # seq_id -> step at which it may propose again
        self.num_steps = 0

    def __getattr__(self, name: str):
        if name == "runner":  # not set yet (mid-construction): no endless recursion
            raise AttributeError(name)
        return getattr(self.runner, name)

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """The plan's step, with the drafts of the sequences that speculate.

        No speculation, and the wrapped runner's own ``execute`` (compiled decode included),
        when the plan schedules ``disable_by_batch_size`` sequences or more (the scheduled
        ones: a runner does not see the scheduler's running queue, which may hold more) or
        when nothing is proposed.
        """
        self.num_steps += 1
        self._forget_departed()
        limit = self.spec_config.disable_by_batch_size
        drafts = {} if limit is not None and len(plan.scheduled) >= limit else self._drafts(plan)
        return self._verify(plan, drafts) if drafts else self.runner.execute(plan)

    def release(self, seqs: list[Sequence]) -> None:
        """The engine's word that these sequences finished: their draft blocks go back now."""
        for seq in seqs:
            self._forget(seq.seq_id)
        self.runner.release(seqs)

    def _num_to_propose(self, seq: Sequence, n: int) -> int:
        """How many tokens to propose for a scheduled (seq, n): 0 where speculation cannot
        or should not run (not a decode, min_tokens not reached, near max_tokens, paused)."""
        if n != 1 or seq.num_computed_tokens + 1 != seq.num_tokens or self.runner.banned_ids(seq):
            return 0
        if seq.params.adjusts_logits or seq.params.structured_outputs is not None:
            return 0  # penalties, biases, bans, grammars: the verify rows do not apply them
        if self.paused_until.get(seq.seq_id, 0) > self.num_steps:
            return 0
        left = self.runner.max_model_len - seq.num_tokens  # positions the pool may still hold
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.spec_config.num_speculative_tokens, left))

    def _drafts(self, plan: SchedulerOutput) -> dict[int, list[int]]:
        """seq_id -> its proposal, for the sequences whose draft rows fit this step (blocks
        grown for them, never preempting; within the step's token budget)."""
        wanted = [(seq, k) for seq, n in plan.scheduled if (k := self._num_to_propose(seq, n))]
        if not wanted:
            return {}
        for seq, _ in wanted:  # the last step is applied now: the draft's KV follows the target
            self.seqs[seq.seq_id] = seq
            self.proposer.after_verify(seq)
        proposals = self.proposer.propose(wanted)
        bm, drafts = self.block_manager, {}
        budget = self.runner.config.max_num_batched_tokens - plan.num_batched_tokens
        for seq, _ in plan.scheduled:
            d = proposals.get(seq.seq_id)
            if d and len(d) <= budget and bm.can_grow(seq.block_table, seq.num_tokens + len(d)):
                bm.grow(seq.block_table, seq.num_tokens + len(d))
                drafts[seq.seq_id] = d
                budget -= len(d)
        return drafts

    def _verify(self, plan: SchedulerOutput, drafts: dict[int, list[int]]) -> RunnerOutput:
        """One target pass over the plan plus the drafts; accept, sample the others, roll back."""
        runner = self.runner
        inputs, sampled, spans, num_sampling = self._inputs(plan, drafts)
        out = RunnerOutput(counters={
            "num_prompt_tokens_computed": num_prompt_tokens(plan.scheduled),
            "num_spec_verifications": 0, "num_spec_proposed_tokens": 0,
            "num_spec_accepted_tokens": 0})
        decoder = getattr(runner, "decoder", None)  # notebook 07's compiled decode step
        if decoder is not None and num_sampling == len(inputs.input_ids):
            # Every row samples, so the step is decodes only (some with drafts). Row i of a
            # speculating sequence is then a decode of its own: its token at position
            # start + i, a context of start + i + 1. The compiled decode graph runs the whole
            # verification: each layer writes every row's k/v into the pool before any row
            # reads, and the context length keeps row i off the drafts after it.
            tables = [t for t, n in zip(inputs.block_tables, inputs.num_new) for _ in range(n)]
            logits = decoder.logits(DecodeInputs(inputs.input_ids,
                                                 [p + 1 for p in inputs.positions], tables))
        else:
            logits = runner.forward(inputs)  # (rows asked for, V) float32
        runner.record_prompt_logprobs(spans, logits[num_sampling:], out)
        row, plain_rows, plain_seqs = 0, [], []
        for seq in sampled:
            draft = drafts.get(seq.seq_id)
            if draft is None:
                plain_rows.append(row)
                plain_seqs.append(seq)
                row += 1
                continue
            rows, row = logits[row:row + len(draft) + 1], row + len(draft) + 1
            try:  # a fault here fails this request alone, as a plain row's does
                tokens = self.accept(seq, draft, rows)
                entries = self._logprob_entries(seq, tokens, rows)
            except Exception as err:  # noqa: BLE001 -- FloatingPointError: its KV is scrubbed
                out.failed[seq.seq_id] = err
                continue
            out.token_ids[seq.seq_id] = tokens  # the accepted drafts and one target token
            if entries is not None:
                out.logprobs[seq.seq_id] = entries
            out.counters["num_spec_verifications"] += 1
            out.counters["num_spec_proposed_tokens"] += len(draft)
            out.counters["num_spec_accepted_tokens"] += len(tokens) - 1
            self._track(seq, len(draft), len(tokens) - 1)
        if plain_seqs:  # the runner's sampler: logits processors, penalties, fault isolation
            index = torch.tensor(plain_rows, dtype=torch.long, device=logits.device)
            runner.sample(logits[index], plain_seqs, out)
        for seq, _ in plan.scheduled:  # keep the blocks of the fed token and accepted drafts
            if seq.seq_id in out.token_ids and seq.seq_id in drafts:
                # (a failed one keeps them all: the engine scrubs what may hold NaN, and frees)
                rollback(self.block_manager, seq.block_table,
                         seq.num_computed_tokens + len(out.token_ids[seq.seq_id]))
        return out

    def _inputs(self, plan: SchedulerOutput, drafts: dict[int, list[int]]):
        """The runner's ``ModelInputs`` for the plan, each draft spliced in after its
        sequence's last token: [last, d1 .. dk], k + 1 rows that all sample.

        Returns the inputs, the sampled sequences (in row order), the prompt-logprob spans,
        and how many of the logits rows sample (the prompt-logprob rows come after them)."""
        base, sampled, spans = self.runner.prepare_inputs(plan.scheduled)
        input_ids, positions, num_new, shift = [], [], [], []  # shift: rows inserted before
        offset = inserted = 0
        for seq, n in plan.scheduled:
            d = drafts.get(seq.seq_id, [])
            end = seq.num_computed_tokens + n
            input_ids += base.input_ids[offset:offset + n] + d
            positions += base.positions[offset:offset + n] + list(range(end, end + len(d)))
            num_new.append(n + len(d))
            shift += [inserted] * n
            offset, inserted = offset + n, inserted + len(d)
        rows = []
        for seq, old in zip(sampled, base.logits_rows[:len(sampled)]):
            first = old + shift[old]  # a speculating sequence's draft rows follow its last
            rows.extend(range(first, first + 1 + len(drafts.get(seq.seq_id, []))))
        prompt_rows = [old + shift[old] for old in base.logits_rows[len(sampled):]]
        inputs = ModelInputs(input_ids, positions, base.block_tables, base.num_computed,
                             num_new, rows + prompt_rows)
        return inputs, sampled, spans, len(rows)

    # ------------------------------------------------------------------ acceptance

    def accept(self, seq: Sequence, draft: list[int], logits: torch.Tensor) -> list[int]:
        """The tokens a sequence emits from its k + 1 rows of logits (k + 1, V): the
        accepted drafts and one token of the target's own. NaN logits raise
        ``FloatingPointError``. (Every speculating row goes through here: the fault injector
        of notebook 04 wraps it.)"""
        if bool(not_finite(logits[:, 0]).any()):  # NaN in a hidden state reaches every logit
            raise FloatingPointError(NOT_FINITE)
        if seq.params.is_greedy:
            return greedy_accept(draft, logits.argmax(dim=-1).tolist())
        probs = target_probs(logits, [seq.params] * logits.shape[0]).cpu()
        return rejection_sample(draft, probs, None, seq.generator)

    def _logprob_entries(self, seq: Sequence, tokens: list[int],
                         logits: torch.Tensor) -> list[dict[int, float]] | None:
        """The target's logprobs of the emitted tokens, one entry each, where asked for."""
        if seq.params.logprobs is None:
            return None
        rows = len(tokens)
        result = Sampler.logprobs(logits[:rows], torch.tensor(tokens, device=logits.device),
                                   [seq.params] * rows)
        return self.runner.logprob_entries([seq] * rows, tokens, result)

    # ------------------------------------------------------------------ per-sequence state

    def _track(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Pause a sequence whose recent proposals were mostly rejected."""
        c = self.spec_config
        recent = self.recent.setdefault(seq.seq_id, deque(maxlen=c.acceptance_window))
        recent.append((proposed, accepted))
        if len(recent) == c.acceptance_window:
            rate = sum(a for _, a in recent) / max(1, sum(p for p, _ in recent))
            if rate < c.min_acceptance_rate:
                self.paused_until[seq.seq_id] = self.num_steps + c.pause_steps
                recent.clear()

    def _forget_departed(self) -> None:
        """Drop the state of sequences no longer running (preempted: a finished one was
        released when it finished)."""
        for seq_id in [i for i, s in self.seqs.items() if s.status is not SequenceStatus.RUNNING]:
            self._forget(seq_id)

    def _forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.recent.pop(seq_id, None)
        self.paused_until.pop(seq_id, None)
        self.proposer.release(seq_id)
