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
no speculation while the batch has ``disable_by_batch_size`` sequences or more (a big batch
is already compute-bound), and a sequence whose recent proposals were mostly rejected
pauses for a while.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field

import torch

from minivllm.compile import DecodeInputs
from minivllm.kv_cache import AttentionMetadata, BlockManager, KVCachePool
from minivllm.sampling import SamplingParams, sampling_probs

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
    disable_by_batch_size: int | None = 8  # no speculation with this many running sequences
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
    """One draw from a normalised distribution (V,) by inverting its CDF with one uniform."""
    u = torch.rand((), generator=generator)
    cdf = probs.double().cumsum(0)
    return int(torch.searchsorted(cdf, u.double()).clamp(max=probs.shape[0] - 1))


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
    cached prefix blocks, as the target does), grown as it goes, rolled back with the
    target's, and freed when the sequence leaves the running set (finished or preempted).
    """

    def __init__(self, engine, config: SpeculativeConfig):
        from minivllm.compile import merge_projections
        from minivllm.config import ModelConfig, resolve_model_path
        from minivllm.model import load_model
        from minivllm.tokenizer import Tokenizer

        path = resolve_model_path(config.model)
        self.model_config = mc = ModelConfig.from_pretrained(path)
        target = engine.model_config
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model {config.model} has vocab_size {mc.vocab_size}, "
                             f"the target {target.vocab_size}: they must share a vocabulary")
        draft_vocab = Tokenizer.from_pretrained(path)._tok.get_vocab(with_added_tokens=True)
        if draft_vocab != engine.tokenizer._tok.get_vocab(with_added_tokens=True):
            raise ValueError(f"the draft model {config.model} has a different tokenizer "
                             "from the target: its token ids would mean other tokens")
        if mc.max_position_embeddings < engine.max_model_len:
            raise ValueError(f"the draft model {config.model} holds "
                             f"{mc.max_position_embeddings} positions, less than max_model_len "
                             f"{engine.max_model_len}: give a smaller max_model_len")
        self.engine = engine
        self.model = load_model(path, dtype=engine.dtype, device=engine.device)
        if engine.config.merge_projections:  # as the target's (notebook 07)
            merge_projections(self.model)
        block_size = engine.config.block_size
        self.pool = KVCachePool(mc.num_hidden_layers, engine.num_blocks, block_size,
                                mc.num_key_value_heads, mc.head_dim, engine.dtype, engine.device)
        self.block_manager = BlockManager(engine.num_blocks, block_size,
                                          engine.config.enable_prefix_caching)
        self.states: dict[int, DraftState] = {}

    def release_departed(self, running) -> None:
        """Free the draft blocks of sequences no longer running (finished or preempted)."""
        alive = {seq.seq_id for seq in running}
        for seq_id in [s for s in self.states if s not in alive]:
            self.release(seq_id)

    def release(self, seq_id: int) -> None:
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.block_manager.free_blocks(state.block_table)

    def _reserve(self, seq, k: int) -> DraftState | None:
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
    def propose(self, wanted: list[tuple]) -> dict[int, list[int]]:
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
        device, block_size = self.engine.device, self.engine.config.block_size
        starts = [s.num_computed_tokens for s in states]
        input_ids = [t for ts in tokens for t in ts]
        positions = [p for st, ts in zip(starts, tokens) for p in range(st, st + len(ts))]
        metadata = AttentionMetadata.build([s.block_table for s in states], starts,
                                           [len(ts) for ts in tokens], block_size, device)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
        hidden = self.model(as_tensor(input_ids), as_tensor(positions),
                            self.engine.attention_cls(self.pool, metadata))
        last_rows = as_tensor(metadata.query_start_loc[1:]) - 1
        for state, ts in zip(states, tokens):
            state.num_computed_tokens += len(ts)
        return self.model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()

    def after_verify(self, seq) -> None:
        """Roll the draft cache back to what the target kept, and register its full blocks."""
        state = self.states.get(seq.seq_id)
        if state is None:
            return
        state.num_computed_tokens = min(state.num_computed_tokens, seq.num_computed_tokens)
        rollback(self.block_manager, state.block_table, state.num_computed_tokens)
        self.block_manager.cache_full_blocks(seq.token_ids, state.block_table,
                                             state.block_hashes, state.num_computed_tokens)


class NgramProposer:
    """Prompt lookup over each sequence's own prompt and output (no model, no cache)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def release_departed(self, running) -> None:
        pass  # nothing kept per sequence

    def release(self, seq_id: int) -> None:
        pass

    def propose(self, wanted: list[tuple]) -> dict[int, list[int]]:
        c = self.config
        return {seq.seq_id: ngram_propose(seq.token_ids, k, c.prompt_lookup_max,
                                          c.prompt_lookup_min) for seq, k in wanted}

    def after_verify(self, seq) -> None:
        pass


class SpeculativeDecoder:
    """The engine's speculative step: propose, verify in one target pass, accept, roll back.

    ``step(plan)`` takes the scheduler's plan for this step and either runs it with
    speculation (returning the sequences that received tokens) or returns None, and the
    engine runs its ordinary step (compiled decode included) instead.
    """

    def __init__(self, engine, config: SpeculativeConfig):
        self.engine = engine
        self.config = config
        self.proposer = (DraftModelProposer(engine, config) if config.method == "draft_model"
                         else NgramProposer(config))
        self.recent: dict[int, deque[tuple[int, int]]] = {}  # seq_id -> (proposed, accepted)
        self.paused_until: dict[int, int] = {}  # seq_id -> step at which it may propose again
        self.num_steps = 0

    def _num_to_propose(self, seq, n: int) -> int:
        """How many tokens to propose for a scheduled (seq, n): 0 where speculation cannot
        or should not run (not a decode, min_tokens not reached, near max_tokens, paused)."""
        e = self.engine
        if n != 1 or seq.num_computed_tokens + 1 != seq.num_tokens or e._banned_ids(seq):
            return 0
        if seq.params.adjusts_logits or seq.params.structured_outputs is not None:
            return 0  # penalties, biases, bans, grammars: the verify rows do not apply them
        if self.paused_until.get(seq.seq_id, 0) > self.num_steps:
            return 0
        left = e.max_model_len - seq.num_tokens  # positions the pool may still hold
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.config.num_speculative_tokens, left))

    def step(self, plan) -> list | None:
        e, bm = self.engine, self.engine.block_manager
        self.num_steps += 1
        self.proposer.release_departed(e.scheduler.running)
        alive = {seq.seq_id for seq in e.scheduler.running}
        for seq_id in [s for s in self.recent if s not in alive]:  # finished, aborted, preempted
            self.recent.pop(seq_id)
            self.paused_until.pop(seq_id, None)
        limit = self.config.disable_by_batch_size
        if limit is not None and len(e.scheduler.running) >= limit:
            return None
        wanted = [(seq, k) for seq, n in plan.scheduled if (k := self._num_to_propose(seq, n))]
        proposals = self.proposer.propose(wanted) if wanted else {}
        budget = e.config.max_num_batched_tokens - plan.num_batched_tokens
        drafts: dict[int, list[int]] = {}
        for seq, _ in plan.scheduled:  # room for the extra rows: blocks and token budget
            d = proposals.get(seq.seq_id)
            if d and len(d) <= budget and bm.can_grow(seq.block_table, seq.num_tokens + len(d)):
                bm.grow(seq.block_table, seq.num_tokens + len(d))
                drafts[seq.seq_id] = d
                budget -= len(d)
        if not drafts:
            return None
        return self._verify(plan.scheduled, drafts)

    @torch.inference_mode()
    def _verify(self, scheduled, drafts: dict[int, list[int]]) -> list:
        """One target pass over the plan plus the drafts; accept, roll back, post-process."""
        e = self.engine
        logits, sampled_seqs = self._score(scheduled, drafts)  # (rows, V)
        emitted: dict[int, list[int]] = {}
        plain, row = [], 0
        for seq in sampled_seqs:
            d = drafts.get(seq.seq_id)
            if d is None:
                plain.append((seq, row))
                row += 1
                continue
            rows_of_seq, row = logits[row:row + len(d) + 1], row + len(d) + 1
            if seq.request_id not in e.requests:  # a sibling's failure ended its request
                continue
            try:  # a fault here fails this request alone, as in the ordinary step
                emitted[seq.seq_id] = self._accept(seq, d, rows_of_seq)
            except Exception as err:  # noqa: BLE001
                e._fail_request(seq.request_id, err, scrub=isinstance(err, FloatingPointError))
        sampled = self._sample_plain(plain, logits)
        progressed = e.scheduler.postprocess(
            [(s, n) for s, n in scheduled if s.seq_id not in drafts], sampled, e._fail_seq)
        e.stats.num_generated_tokens += len(progressed)
        for seq, _ in scheduled:
            if seq.seq_id in emitted and seq.request_id in e.requests:
                try:
                    self._postprocess(seq, drafts[seq.seq_id], emitted[seq.seq_id])
                except Exception as err:  # noqa: BLE001
                    e._fail_request(seq.request_id, err)
                    continue
                progressed.append(seq)
        return progressed

    def _score(self, scheduled, drafts: dict[int, list[int]]) -> tuple[torch.Tensor, list]:
        """The target's logits for every row that samples (a plain decode's one row, a
        speculating sequence's k + 1), in plan order, and the sequences they belong to."""
        e = self.engine
        input_ids, positions, num_new, rows, sampled_seqs, row_tables = [], [], [], [], [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start:start + n] + drafts.get(seq.seq_id, [])
            input_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            num_new.append(len(tokens))
            row_tables.extend([seq.block_table] * len(tokens))
            if start < seq.num_prompt_tokens:
                e.stats.num_prompt_tokens_computed += min(n, seq.num_prompt_tokens - start)
            if start + n == seq.num_tokens:  # it samples: its last row, or all k + 1 rows
                rows.extend(range(len(input_ids) - len(tokens) + (n - 1), len(input_ids)))
                sampled_seqs.append(seq)
        if e.decoder is not None and len(rows) == len(input_ids):
            # Every row samples, so the step is decodes only (some with drafts). Row i of a
            # speculating sequence is then a decode of its own: its token at position
            # start + i, a context of start + i + 1. Milestone 7's compiled decode graph runs
            # the whole verification: each layer writes every row's k/v into the pool before
            # any row reads, and the context length keeps row i off the drafts after it.
            batch = DecodeInputs(input_ids, [p + 1 for p in positions], row_tables)
            return e.decoder.logits(batch), sampled_seqs
        metadata = AttentionMetadata.build([s.block_table for s, _ in scheduled],
                                           [s.num_computed_tokens for s, _ in scheduled],
                                           num_new, e.config.block_size, e.device,
                                           pad_block=e.num_blocks)  # padding: the scratch block
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=e.device)
        hidden = e.model(as_tensor(input_ids), as_tensor(positions),
                         e.attention_cls(e.pool, metadata))
        return e.model.compute_logits(hidden[as_tensor(rows)]).float(), sampled_seqs

    def _sample_plain(self, plain, logits) -> dict[int, int]:
        """Sequences without a draft sample their one row with the engine's sampler."""
        if not plain:
            return {}
        e = self.engine
        seqs = [s for s, _ in plain if s.request_id in e.requests]
        rows = torch.tensor([r for s, r in plain if s.request_id in e.requests],
                            dtype=torch.long, device=logits.device)
        logits = logits[rows]
        if e.structured:  # a plain row with a grammar gets its token mask, as in _run_model
            e.structured.apply_token_bitmask(logits, seqs)
        # the engine's sampler with its processors, a fault in one row failing its request
        return e._sample_rows(e._sample_eager, logits, seqs)

    def _accept(self, seq, draft: list[int], logits: torch.Tensor) -> list[int]:
        """The tokens a sequence emits from its k + 1 rows of logits (k + 1, V)."""
        column = logits[:, 0]  # NaN in a hidden state reaches every logit (see the engine)
        if bool((column.isnan() | (column == float("inf"))).any()):
            raise FloatingPointError("the model's logits for this request are NaN or infinite")
        if seq.params.is_greedy:
            tokens = greedy_accept(draft, logits.argmax(dim=-1).tolist())
        else:
            probs = target_probs(logits, [seq.params] * logits.shape[0]).cpu()
            tokens = rejection_sample(draft, probs, None, seq.generator)
        if seq.params.logprobs is not None:  # the target's logprobs of what is emitted
            from minivllm.sampling import Sampler

            rows = len(tokens)
            out = Sampler._logprobs(logits[:rows], torch.tensor(tokens, device=logits.device),
                                    [seq.params] * rows)
            self.engine._record_logprobs([seq] * rows, tokens, out)
        return tokens

    def _postprocess(self, seq, draft: list[int], tokens: list[int]) -> None:
        """Append the emitted tokens up to the first stop, roll back the rejected KV."""
        e, stats = self.engine, self.engine.stats
        start = seq.num_computed_tokens  # the position of the last token, fed again as row 0
        reason, count = None, 0
        for token in tokens:
            seq.token_ids.append(token)
            count += 1
            reason = e.scheduler.check_stop(seq, token)
            if reason is not None:
                break
        if count < len(tokens) and seq.params.logprobs is not None:
            for dropped in tokens[count:]:
                seq.cumulative_logprob -= seq.logprobs.pop()[dropped]
        accepted = len(tokens) - 1
        # valid KV: the fed last token and the accepted drafts that were also emitted
        seq.num_computed_tokens = start + 1 + min(accepted, count)
        rollback(e.block_manager, seq.block_table, seq.num_computed_tokens)
        e.block_manager.cache_full_blocks(seq.token_ids, seq.block_table, seq.block_hashes,
                                          seq.num_computed_tokens)
        self.proposer.after_verify(seq)
        if reason is not None:
            e.scheduler.finish(seq, *reason)
            self.proposer.release(seq.seq_id)
        stats.num_generated_tokens += count
        stats.num_spec_verifications += 1
        stats.num_spec_proposed_tokens += len(draft)
        stats.num_spec_accepted_tokens += accepted
        stats.spec_acceptance_rate = (stats.num_spec_accepted_tokens
                                      / stats.num_spec_proposed_tokens)
        stats.spec_mean_accepted_length = ((stats.num_spec_accepted_tokens
                                            + stats.num_spec_verifications)
                                           / stats.num_spec_verifications)
        self._track(seq, len(draft), accepted)

    def _track(self, seq, proposed: int, accepted: int) -> None:
        """Pause a sequence whose recent proposals were mostly rejected."""
        c = self.config
        recent = self.recent.setdefault(seq.seq_id, deque(maxlen=c.acceptance_window))
        recent.append((proposed, accepted))
        if seq.is_finished:
            self.recent.pop(seq.seq_id, None)
            self.paused_until.pop(seq.seq_id, None)
            return
        if len(recent) == c.acceptance_window:
            rate = sum(a for _, a in recent) / max(1, sum(p for p, _ in recent))
            if rate < c.min_acceptance_rate:
                self.paused_until[seq.seq_id] = self.num_steps + c.pause_steps
                recent.clear()
