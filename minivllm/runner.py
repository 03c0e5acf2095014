# Generated from solutions/03_continuous_batching.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The model runner: a scheduled batch in, sampled tokens out.

Built in notebook 03_continuous_batching. The runner owns everything between the scheduler's
plan and the sampled tokens, as vLLM's model runner and nano-vllm's ``ModelRunner`` do:

    SchedulerOutput ─▶ prepare_inputs ─▶ ModelInputs (flat ids, positions, block tables)
                    ─▶ forward ─▶ logits of the rows that sample ─▶ sample ─▶ RunnerOutput

It holds the model and the KV pool (and sizes the pool), reads the scheduled sequences but
never changes them (``Scheduler.update`` applies the ``RunnerOutput``), and isolates faults
row by row: a row whose sampling raises, or whose logits are NaN, fails its own request and
no other. Later milestones are variants over the same ``execute(plan) -> RunnerOutput``
contract, chosen by ``EngineConfig`` (``minivllm.engine.RUNNER_VARIANTS``): the compiled
decode step (notebook 07), speculative decoding (08) and tensor parallelism (09).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from minivllm.config import ATTENTION_BACKENDS, EngineConfig, ModelConfig, resolve_qualname
from minivllm.kv_cache import (
    AttentionMetadata,
    KVCachePool,
    bytes_per_block,
    check_pool_fits,
    measure_cuda_kv_budget,
    num_blocks_for_budget,
)
from minivllm.model import load_model
from minivllm.sampling import Sampler, SamplerOutput
from minivllm.scheduler import RunnerOutput, SchedulerOutput, Sequence

logger = logging.getLogger("minivllm.engine")  # the start-up lines are the engine's

SampleFn = Callable[[torch.Tensor, list[Sequence]], SamplerOutput]  # (B, V) logits -> tokens
NOT_FINITE = "the model's logits for this request are NaN or infinite"


def not_finite(x: torch.Tensor) -> torch.Tensor:
    """Elementwise NaN or +inf (-inf is fine: a grammar's token mask writes it)."""
    return x.isnan() | (x == float("inf"))


def num_prompt_tokens(scheduled: list[tuple[Sequence, int]]) -> int:
    """How many of a plan's new tokens are prompt tokens (EngineStats counts them)."""
    return sum(min(n, s.num_prompt_tokens - s.num_computed_tokens) for s, n in scheduled
               if s.num_computed_tokens < s.num_prompt_tokens)


@dataclass
class ModelInputs:
    """One forward pass, flat: every scheduled sequence's new tokens back to back (T rows).

    Plain lists, so that tensor parallelism (notebook 09) can send a step to its workers.
    """

    input_ids: list[int]  # (T,)
    positions: list[int]  # (T,)
    block_tables: list[list[int]]  # (B, *) per sequence
    num_computed: list[int]  # (B,) tokens each sequence already has in the cache
    num_new: list[int]  # (B,) its tokens in this pass
    logits_rows: list[int]  # rows whose logits are wanted: sampled rows, then prompt logprobs


class ModelRunner:
    """Owns the model, the KV pool and the sampler; ``execute(plan)`` runs one step."""

    def __init__(self, config: EngineConfig, model_path: Path, model_config: ModelConfig,
                 dtype: torch.dtype, device: torch.device, max_model_len: int,
                 eos_token_ids: tuple[int, ...]):
        self.config, self.model_path, self.model_config = config, model_path, model_config
        self.dtype, self.device = dtype, device
        self.max_model_len, self.eos_token_ids = max_model_len, eos_token_ids
        started = time.perf_counter()
        self.model = self.load_model(model_path)
        self.num_kv_heads = getattr(self.model, "num_kv_heads", model_config.num_key_value_heads)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("loaded the weights: %.2f GiB in %.1f s", weight_bytes / 2**30,
                    time.perf_counter() - started)
        self.num_blocks = self.kv_cache_blocks()
        check_pool_fits(self.num_blocks, config.block_size, max_model_len)
        # one block past the block manager's range that no sequence owns: padded block-table
        # entries point at it, and a compiled decode step's padding rows write into it
        mc = model_config
        self.pool = KVCachePool(mc.num_hidden_layers, self.num_blocks + 1, config.block_size,
                                self.num_kv_heads, mc.head_dim, dtype, device)
        pool_tokens = self.num_blocks * config.block_size
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB); it holds %.1f "
                    "sequences of max_model_len %d at once", self.num_blocks, config.block_size,
                    pool_tokens, self.pool.kv.numel() * self.pool.kv.element_size() / 2**30,
                    pool_tokens / max_model_len, max_model_len)
        self.attention_cls = resolve_qualname(ATTENTION_BACKENDS[config.attention_backend])
        self.sampler = Sampler()
        # (logits, seqs) -> None, in place, before sampling: structured outputs' token mask
        self.logits_processors: list[Callable[[torch.Tensor, list[Sequence]], None]] = []

    def load_model(self, path: Path) -> nn.Module:
        return load_model(path, dtype=self.dtype, device=self.device)

    def kv_cache_blocks(self) -> int:
        """How many KV blocks: as configured, else what the memory budget holds (on CUDA
        measured after a warm-up pass, as vLLM does), never more than max_num_seqs need."""
        c, mc = self.config, self.model_config
        if c.num_blocks is not None:
            return c.num_blocks
        block_bytes = bytes_per_block(mc.num_hidden_layers, c.block_size, self.num_kv_heads,
                                      mc.head_dim, self.dtype)
        if self.device.type == "cuda":
            budget = measure_cuda_kv_budget(self.model, c.max_num_batched_tokens,
                                            c.gpu_memory_utilization)
            return num_blocks_for_budget(budget, block_bytes)
        enough = c.max_num_seqs * -(-self.max_model_len // c.block_size)  # never need more
        return min(num_blocks_for_budget(c.kv_cache_memory_bytes, block_bytes), enough)

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Zero these blocks' keys and values (a request whose KV may hold NaN failed)."""
        size = self.config.block_size
        slots = (torch.tensor(block_ids).unsqueeze(1) * size + torch.arange(size)).flatten()
        self.pool.kv[:, :, slots.to(self.device)] = 0

    def release(self, seqs: list[Sequence]) -> None:
        """Forget what the runner keeps for these finished sequences: nothing here (a
        speculative runner frees their draft model's blocks, notebook 08)."""

    def close(self) -> None:
        """Release what outlives the object (tensor parallelism's workers); nothing here."""

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run the plan's flat batch through the model and sample the rows that end a
        sequence's known tokens (a mid-prompt chunk only fills the cache)."""
        inputs, sampled, prompt_spans = self.prepare_inputs(plan.scheduled)
        out = RunnerOutput(counters={"num_prompt_tokens_computed": num_prompt_tokens(
            plan.scheduled)})
        logits = self.forward(inputs)  # (rows asked for, V) float32
        self.record_prompt_logprobs(prompt_spans, logits[len(sampled):], out)
        if sampled:
            self.sample(logits[:len(sampled)], sampled, out)
        return out

    def prepare_inputs(self, scheduled: list[tuple[Sequence, int]]):
        """The flat ``ModelInputs``, the sequences that sample (in row order), and the
        (seq, first, last) prompt positions whose logits give prompt logprobs."""
        input_ids, positions, sample_rows, sampled, prompt_rows, prompt_spans = [], [], [], [], [], []
        for seq, n in scheduled:
            start, first_row = seq.num_computed_tokens, len(input_ids)
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            if start + n == seq.num_tokens:  # the last known token: its logits give the next
                sample_rows.append(len(input_ids) - 1)
                sampled.append(seq)
            if seq.prompt_logprobs is not None:  # position j's logits score prompt token j + 1
                first = max(start, len(seq.prompt_logprobs) - 1)  # after a preemption: skip
                last = min(start + n, seq.num_prompt_tokens - 1)  # what is already recorded
                if first < last:
                    prompt_rows.extend(range(first_row + first - start, first_row + last - start))
                    prompt_spans.append((seq, first, last))
        inputs = ModelInputs(input_ids, positions, [s.block_table for s, _ in scheduled],
                             [s.num_computed_tokens for s, _ in scheduled],
                             [n for _, n in scheduled], sample_rows + prompt_rows)
        return inputs, sampled, prompt_spans

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Write the step's keys and values into the pool; the logits of ``logits_rows``."""
        metadata = AttentionMetadata.build(inputs.block_tables, inputs.num_computed,
                                           inputs.num_new, self.config.block_size, self.device,
                                           pad_block=self.num_blocks)  # padding: scratch block
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
        rows = as_tensor(inputs.logits_rows)  # (R,)
        hidden = self.hidden_states(as_tensor(inputs.input_ids), as_tensor(inputs.positions),
                                    self.attention_cls(self.pool, metadata), rows)  # (R, hidden)
        if not inputs.logits_rows:
            return hidden.new_zeros(0, self.model_config.vocab_size, dtype=torch.float32)
        return self.compute_logits(hidden)  # (R, V)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attn: Callable, rows: torch.Tensor) -> torch.Tensor:
        """The model's forward over the flat batch, every token's keys and values written
        through ``attn``: (T,) ids and positions -> the final hidden states of ``rows`` (R,
        hidden), the rows whose logits the step wants. (Notebook 07's runner compiles the
        layers around ``attn`` here, and runs its last layer past attention for ``rows`` only.)"""
        return self.model(input_ids, positions, attn)[rows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, hidden) final hidden states -> (R, V) float32 logits: the model's lm_head.
        (Notebook 07's runner sends a lone row through its compiled one-row path here.)"""
        return self.model.compute_logits(hidden)

    def record_prompt_logprobs(self, spans: list[tuple[Sequence, int, int]],
                               logits: torch.Tensor, out: RunnerOutput) -> None:
        """Prompt logprobs for this chunk's prompt positions (``logits``: one row each)."""
        row = 0
        for seq, first, last in spans:
            logprobs = logits[row:row + last - first].log_softmax(dim=-1)  # (last - first, V)
            row += last - first
            targets = seq.token_ids[first + 1:last + 1]
            chosen = logprobs.gather(-1, torch.tensor(targets, device=logits.device)
                                     .unsqueeze(-1)).squeeze(-1).tolist()
            k = seq.params.prompt_logprobs
            top = logprobs.topk(k, dim=-1) if k else None
            entries = out.prompt_logprobs.setdefault(seq.seq_id, [])
            for i, (token, logprob) in enumerate(zip(targets, chosen)):
                entry = {token: logprob}
                if top is not None:
                    entry.update(zip(top.indices[i].tolist(), top.values[i].tolist()))
                entries.append(entry)

    # ------------------------------------------------------------------ sampling

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], out: RunnerOutput,
               sample_logits: SampleFn | None = None) -> None:
        """Sample one row of ``logits`` per sequence into ``out``; a row at fault fails its
        request (in ``out.failed``) while the others are sampled as usual.

        ``sample_logits`` turns (B, V) logits into a ``SamplerOutput``: the eager sampler by
        default (a compiled decode step passes its own, notebook 07)."""
        for process in self.logits_processors:  # only rows with a grammar pay for its mask
            process(logits, seqs)
        result, seqs = self._sample_isolating_faults(sample_logits or self.sample_logits,
                                                     logits, seqs, out)
        tokens = result.token_ids.tolist()  # -1: that row's logits were NaN or infinite
        entries = self.logprob_entries(seqs, tokens, result)
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if token < 0:
                out.failed[seq.seq_id] = FloatingPointError(NOT_FINITE)
                continue
            out.token_ids[seq.seq_id] = [token]
            if entries[i] is not None:
                out.logprobs[seq.seq_id] = [entries[i]]

    def sample_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """The eager sampler with every processor: penalties, biases, bans, min_tokens."""
        return self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs],
                            [self.banned_ids(s) for s in seqs], [s.token_ids for s in seqs],
                            [s.num_prompt_tokens for s in seqs])

    def banned_ids(self, seq: Sequence) -> list[int]:
        """min_tokens: EOS and stop token ids may not be sampled until it is reached."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            return []
        return [*([] if p.ignore_eos else self.eos_token_ids), *p.stop_token_ids]

    @staticmethod
    def logprob_entries(seqs: list[Sequence], tokens: list[int],
                        result: SamplerOutput) -> list[dict[int, float] | None]:
        """Per row: {sampled token: logprob, and the top k} where the request asked for it."""
        if result.logprobs is None:
            return [None] * len(seqs)
        chosen = result.logprobs.tolist()
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        top_ids = result.top_token_ids.tolist() if result.top_token_ids is not None else None
        entries = []
        for i, seq in enumerate(seqs):
            k = seq.params.logprobs
            entry = None if k is None else {tokens[i]: chosen[i]}
            if entry is not None and k > 0 and top_ids is not None:
                entry.update(zip(top_ids[i][:k], top_lp[i][:k]))
            entries.append(entry)
        return entries

    def _sample_isolating_faults(self, sample_logits: SampleFn, logits: torch.Tensor,
                                 seqs: list[Sequence], out: RunnerOutput):
        """Sample every row; a row whose sampling raises, or whose logits are not finite,
        fails its own request and no other.

        The batch is sampled at once; only if that raises are the rows tried one by one to
        find the culprit(s), so a healthy batch pays one cheap check: a NaN anywhere in a
        sequence's hidden state reaches every one of its logits through lm_head, so column 0
        tells, and a NaN logit elsewhere would be greedy's argmax (torch ranks NaN highest).
        (-inf is fine: a grammar's token mask writes it.)
        """
        states = [s.generator.get_state() if s.generator is not None else None for s in seqs]

        def rewind() -> None:  # a seeded request draws the same noise as in a clean run
            for seq, state in zip(seqs, states):
                if state is not None:
                    seq.generator.set_state(state)

        try:
            result = sample_logits(logits, seqs)
        except Exception:  # noqa: BLE001 -- find the row(s) at fault, fail only their requests
            healthy = []
            for row, seq in enumerate(seqs):
                rewind()
                try:
                    sample_logits(logits[row:row + 1], [seq])
                    healthy.append(row)
                except Exception as e:  # noqa: BLE001
                    out.failed[seq.seq_id] = e
            rewind()
            if not healthy:
                return SamplerOutput(logits.new_zeros(0, dtype=torch.long), None, None, None), []
            seqs = [seqs[row] for row in healthy]
            logits = logits[healthy]
            result = sample_logits(logits, seqs)
        chosen = logits.gather(-1, result.token_ids.unsqueeze(-1)).squeeze(-1)  # (B,)
        broken = not_finite(logits[:, 0]) | not_finite(chosen)
        result.token_ids = torch.where(broken, -1, result.token_ids)
        return result, seqs
