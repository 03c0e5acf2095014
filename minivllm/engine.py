# Generated from solutions/03_continuous_batching.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The engine loop and the offline ``LLM`` API.

Built in notebook 03_continuous_batching. ``LLMEngine.step()`` is one turn of the loop:

    schedule ─▶ prepare flat inputs ─▶ model forward ─▶ sample ─▶ postprocess ─▶ outputs

The scheduler never touches tensors, the model never knows about requests, and the
engine is the glue between them. ``LLM.generate`` loops ``step()`` until every request is
done; the server (notebook 04) runs the same loop in a background thread and streams the
per-step deltas to HTTP clients.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from minivllm.compile import (
    DecodeInputs,
    compile_enabled_by_default,
    merge_projections,
    try_compile,
)
from minivllm.config import (
    EngineConfig,
    ModelConfig,
    auto_dtype,
    read_eos_token_ids,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from minivllm.kv_cache import (
    AttentionMetadata,
    BlockManager,
    KVCachePool,
    PagedAttention,
    bytes_per_block,
    check_pool_fits,
    num_blocks_for_budget,
)
from minivllm.model import load_model
from minivllm.parallel import start_tensor_parallel
from minivllm.sampling import (
    Sampler,
    SamplerOutput,
    SamplingParams,
    exponential_noise,
    greedy_tokens,
    process_logits,
)
from minivllm.scheduler import Scheduler, Sequence
from minivllm.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("minivllm.engine")


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
class EngineStats:
    """Counters the tests, the server and the benchmark read."""

    num_steps: int = 0
    max_batch_size: int = 0  # most sequences in one forward pass
    max_batched_tokens: int = 0  # most tokens in one forward pass
    num_preemptions: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens that ran through the model
    num_prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_generated_tokens: int = 0
    # Milestone 8 (speculative decoding): proposals verified, and how many were accepted
    num_spec_verifications: int = 0  # sequence-steps that verified a proposal
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0  # accepted / proposed
    spec_mean_accepted_length: float = 0.0  # tokens emitted per verification (accepted + 1)


@dataclass
class _TextState:
    """Incremental text of one sequence."""

    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    num_text_tokens: int = 0  # output tokens fed to the detokenizer


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled during prefill


def attention_backend(name: str):
    """The attention function class for a backend name ("loop" is Milestone 2's)."""
    if name == "loop":
        return PagedAttention
    from minivllm import attention  # Milestone 6

    if name not in attention.BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from loop, "
                         f"{', '.join(attention.BACKENDS)}")
    return attention.BACKENDS[name]


class LLMEngine:
    """Owns the model, the KV pool, the scheduler and the requests; ``step()`` runs one turn."""

    def __init__(self, config: EngineConfig):
        self.config = config
        path = resolve_model_path(config.model)
        self.model_path = path
        self.model_config = ModelConfig.from_pretrained(path)
        self.device = resolve_device(config.device)
        if config.dtype == "auto":  # what the device does well, and why (for the log)
            self.dtype, why = auto_dtype(self.device, self.model_config)
        else:
            self.dtype, why = resolve_dtype(config.dtype, self.device, self.model_config), "asked"
        logger.info("model %s on %s in %s (%s)", path, self.device, str(self.dtype)[6:], why)
        started = time.perf_counter()
        self.model = load_model(path, dtype=self.dtype, device=self.device) if (
            config.tensor_parallel_size == 1) else start_tensor_parallel(
            path, config.tensor_parallel_size, self.dtype, self.device)  # Milestone 9
        self.num_kv_heads = getattr(self.model, "num_kv_heads", self.model_config.num_key_value_heads)
        if config.merge_projections:  # Milestone 7: q/k/v as one matmul, gate/up as one
            saved = merge_projections(self.model)  # 0 for tensor-parallel shards
            logger.info("merged projections: %d fewer matmuls per forward pass", saved)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("loaded the weights: %.2f GiB in %.1f s%s", weight_bytes / 2**30,
                    time.perf_counter() - started,
                    " (rank 0's shard)" if config.tensor_parallel_size > 1 else "")
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.eos_token_ids = read_eos_token_ids(path)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.num_blocks = self._num_blocks()
        check_pool_fits(self.num_blocks, config.block_size, self.max_model_len)
        mc = self.model_config
        use_compile = compile_enabled_by_default() if config.compile is None else config.compile
        if use_compile and config.tensor_parallel_size > 1:  # see parallel.py (Milestone 9)
            logger.info("tensor parallel: the decode step runs eagerly (not compiled)")
            use_compile = False
        # one block past the block manager's range that no sequence owns: padded block-table
        # entries point at it, and a compiled decode step's padding rows write into it
        self.pool = KVCachePool(mc.num_hidden_layers, self.num_blocks + 1,
                                config.block_size, self.num_kv_heads, mc.head_dim,
                                self.dtype, self.device)
        self.block_manager = BlockManager(self.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        pool_tokens = self.num_blocks * config.block_size
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB); it holds %.1f "
                    "sequences of max_model_len %d at once", self.num_blocks, config.block_size,
                    pool_tokens, self.pool.kv.numel() * self.pool.kv.element_size() / 2**30,
                    pool_tokens / self.max_model_len, self.max_model_len)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   self.eos_token_ids)
        self.attention_cls = attention_backend(config.attention_backend)
        self.sampler = Sampler()
        self.structured = None  # notebook 04: grammars of constrained requests (on first use)
        self.decoder = None  # Milestone 7: the compiled decode step
        if use_compile:
            self.decoder = try_compile(self.model, self.pool.kv, config.block_size,
                                       self.num_blocks, self.device, mc.vocab_size,
                                       single_row_matvec=config.single_row_matvec,
                                       matvec_kernel=config.matvec_kernel)
        self.compile_seconds = self.decoder.compile_seconds if self.decoder else 0.0
        self.stats = EngineStats()
        self.spec = None  # Milestone 8: the speculative step, when configured
        if config.speculative_config is not None:
            from minivllm.spec_decode import SpeculativeConfig, SpeculativeDecoder

            self.spec = SpeculativeDecoder(self, SpeculativeConfig.parse(config.speculative_config))
        self.requests: dict[str, _Request] = {}
        self._text: dict[int, _TextState] = {}
        self._seq_ids = itertools.count()
        self._failed: dict[str, tuple[_Request, str]] = {}  # failed this step: id -> (request, why)
        if config.seed is not None:
            torch.manual_seed(config.seed)

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> LLMEngine:
        if model is not None:
            options["model"] = model
        return cls(EngineConfig(**options))

    def _num_blocks(self) -> int:
        c, mc = self.config, self.model_config
        if c.num_blocks is not None:
            return c.num_blocks
        block_bytes = bytes_per_block(mc.num_hidden_layers, c.block_size,
                                      self.num_kv_heads, mc.head_dim, self.dtype)
        if self.device.type == "cuda":
            from minivllm.kv_cache import measure_cuda_kv_budget

            budget = measure_cuda_kv_budget(self.model, c.max_num_batched_tokens,
                                            c.gpu_memory_utilization)
            return num_blocks_for_budget(budget, block_bytes)
        budget = c.kv_cache_memory_bytes
        enough = c.max_num_seqs * -(-self.max_model_len // c.block_size)  # never need more
        return min(num_blocks_for_budget(budget, block_bytes), enough)

    # ------------------------------------------------------------------ requests

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request; raises ValueError (and changes nothing) if it is invalid.

        ``arrival_time`` (``time.monotonic()``) is when the request arrived, if earlier than
        now (the server passes the moment the HTTP request came in).
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is "
                             f"{self.max_model_len}: no room for any output token")
        params.update_from_tokenizer(self.tokenizer, vocab)  # bad words; ids in the vocab
        seqs: list[Sequence] = []
        grammar = None
        if params.structured_outputs is not None:  # compiled now: an invalid one changes nothing
            grammar = self._structured_outputs().compile(params.structured_outputs)
        for index in range(params.n):
            parent = seqs[0] if seqs and self.config.enable_prefix_caching else None
            seqs.append(Sequence(next(self._seq_ids), request_id, ids, params, index, parent))
            if grammar is not None:  # one matcher per completion
                self.structured.add(seqs[-1].seq_id, grammar)
        self.requests[request_id] = _Request(
            request_id, text, ids, seqs, RequestMetrics(arrival_time or time.monotonic()),
            None if params.prompt_logprobs is None else [None])
        for seq in seqs:
            self._text[seq.seq_id] = _TextState(IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens))
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            self.scheduler.finish(seq, "abort")
            self._text.pop(seq.seq_id, None)
            if self.structured:
                self.structured.remove(seq.seq_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One turn: schedule, run the model on the flat batch, sample, postprocess."""
        plan = self.scheduler.schedule()
        self.stats.num_preemptions += len(plan.preempted)
        if not plan.scheduled:
            return []
        self.stats.num_steps += 1
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(plan.scheduled))
        self.stats.max_batched_tokens = max(self.stats.max_batched_tokens, plan.num_batched_tokens)
        now = time.monotonic()
        for seq in plan.admitted:
            self.stats.num_prefix_queried_tokens += seq.num_prompt_tokens
            self.stats.num_prefix_cached_tokens += seq.num_cached_tokens
            metrics = self.requests[seq.request_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        progressed = self.spec.step(plan) if self.spec is not None else None
        if progressed is None:  # no speculation this step: the ordinary (compiled) path
            sampled = self._run_model(plan.scheduled)
            progressed = self.scheduler.postprocess(plan.scheduled, sampled, self._fail_seq)
            self.stats.num_generated_tokens += len(progressed)
        if self.structured:  # advance the grammars; a complete one ends its sequence
            for seq in self.structured.accept(progressed):
                self.scheduler.finish(seq, "stop")
        return self._outputs(progressed)

    def _prepare_inputs(self, scheduled: list[tuple[Sequence, int]]):
        """Flat input ids and positions, attention metadata, and the rows to sample."""
        input_ids, positions, sample_rows, sample_seqs = [], [], [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            if start < seq.num_prompt_tokens:
                self.stats.num_prompt_tokens_computed += min(n, seq.num_prompt_tokens - start)
            if start + n == seq.num_tokens:  # the last known token: its logits give the next
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        metadata = AttentionMetadata.build(
            [s.block_table for s, _ in scheduled], [s.num_computed_tokens for s, _ in scheduled],
            [n for _, n in scheduled], self.config.block_size, self.device,
            pad_block=self.num_blocks)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
        return as_tensor(input_ids), as_tensor(positions), metadata, as_tensor(sample_rows), sample_seqs

    @torch.inference_mode()
    def _run_model(self, scheduled: list[tuple[Sequence, int]]) -> dict[int, int]:
        seqs = [seq for seq, _ in scheduled]
        if self.decoder is not None and all(
                n == 1 and s.num_computed_tokens + 1 == s.num_tokens for s, n in scheduled):
            batch = DecodeInputs([s.token_ids[-1] for s in seqs], [s.num_tokens for s in seqs],
                                 [s.block_table for s in seqs])
            logits = self.decoder.logits(batch)  # (B, V): a pure decode step, compiled (M7)
            if self.structured:  # only rows with a grammar pay for its token mask
                self.structured.apply_token_bitmask(logits, seqs)
            sample = self._sample_compiled
        else:
            input_ids, positions, metadata, rows, seqs = self._prepare_inputs(scheduled)
            hidden = self.model(input_ids, positions, self.attention_cls(self.pool, metadata))
            self._record_prompt_logprobs(scheduled, hidden)
            if not seqs:
                return {}
            logits = self.model.compute_logits(hidden[rows])  # (num sampled, vocab)
            if self.structured:  # only rows with a grammar pay for its token mask
                self.structured.apply_token_bitmask(logits, seqs)
            sample = self._sample_eager
        return self._sample_rows(sample, logits, seqs)

    def _sample_rows(self, sample, logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, int]:
        """{seq_id: token} for one row of logits per sequence; a row at fault fails its
        request (and is left out) while the others are sampled as usual."""
        out, seqs = self._sample_isolating_faults(sample, logits, seqs)
        tokens = out.token_ids.tolist()  # -1: that row's logits were NaN or infinite
        if out.logprobs is not None:
            self._record_logprobs(seqs, tokens, out)
        sampled = {}
        for seq, token in zip(seqs, tokens):
            if token < 0:
                self._fail_request(seq.request_id, FloatingPointError(
                    "the model's logits for this request are NaN or infinite"), scrub=True)
            else:
                sampled[seq.seq_id] = token
        return sampled

    def _sample_isolating_faults(self, sample, logits: torch.Tensor, seqs: list[Sequence]):
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
            out = sample(logits, seqs)
        except Exception:  # noqa: BLE001 -- find the row(s) at fault, fail only their requests
            healthy = []
            for row, seq in enumerate(seqs):
                rewind()
                try:
                    sample(logits[row:row + 1], [seq])
                    healthy.append(row)
                except Exception as e:  # noqa: BLE001
                    self._fail_request(seq.request_id, e)
            rewind()
            if not healthy:
                return SamplerOutput(logits.new_zeros(0, dtype=torch.long), None, None, None), []
            seqs = [seqs[row] for row in healthy]
            logits = logits[healthy]
            out = sample(logits, seqs)
        chosen = logits.gather(-1, out.token_ids.unsqueeze(-1)).squeeze(-1)  # (B,)
        broken = lambda x: x.isnan() | (x == float("inf"))
        out.token_ids = torch.where(broken(logits[:, 0]) | broken(chosen), -1, out.token_ids)
        return out, seqs

    def _sample_eager(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        token_ids, num_prompt_tokens, banned = self._processor_inputs(seqs)
        return self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs],
                            banned, token_ids, num_prompt_tokens)

    def _sample_compiled(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample a compiled decode step's logits (Milestone 7)."""
        params = [s.params for s in seqs]
        # penalties, biases and bans run beside the graph, eagerly, on the rows that ask
        processed = process_logits(logits, params, *self._processor_inputs(seqs))
        if all(p.is_greedy for p in params):
            tokens = greedy_tokens(processed)
        else:
            noise = exponential_noise(len(seqs), logits.shape[-1],
                                      [s.generator for s in seqs], self.device)
            tokens = self.decoder.sample(processed, params, noise)
        return Sampler._logprobs(logits, tokens, params)  # of the raw logits, as vLLM

    def _processor_inputs(self, seqs: list[Sequence]) -> tuple[list, list, list]:
        """What ``process_logits`` reads per row: token ids, prompt length, min_tokens bans."""
        return ([s.token_ids for s in seqs], [s.num_prompt_tokens for s in seqs],
                [self._banned_ids(s) for s in seqs])

    def _record_prompt_logprobs(self, scheduled: list[tuple[Sequence, int]],
                                hidden: torch.Tensor) -> None:
        """Prompt logprobs from this step's prompt positions (a chunk at a time).

        Position j's logits give prompt token j + 1's logprob. Only the first completion
        of a request records them; after a preemption the recomputed positions are skipped.
        """
        row = 0
        for seq, n in scheduled:
            start, row = seq.num_computed_tokens, row + n
            if seq.params.prompt_logprobs is None or seq.index != 0:
                continue
            request = self.requests[seq.request_id]
            first = max(start, len(request.prompt_logprobs) - 1)  # the next position needed
            last = min(start + n, seq.num_prompt_tokens - 1)
            if first >= last:
                continue
            flat = row - n + first - start  # its row in the flat batch
            logprobs = self.model.compute_logits(hidden[flat:flat + last - first]).float()
            logprobs = logprobs.log_softmax(dim=-1)  # (last - first, V)
            targets = seq.token_ids[first + 1:last + 1]
            chosen = logprobs.gather(-1, torch.tensor(targets, device=self.device)
                                     .unsqueeze(-1)).squeeze(-1).tolist()
            k = seq.params.prompt_logprobs
            top = logprobs.topk(k, dim=-1) if k else None
            for i, (token, logprob) in enumerate(zip(targets, chosen)):
                entry = {token: logprob}
                if top is not None:
                    entry.update(zip(top.indices[i].tolist(), top.values[i].tolist()))
                request.prompt_logprobs.append(entry)

    @staticmethod
    def _record_logprobs(seqs: list[Sequence], tokens: list[int], out: SamplerOutput) -> None:
        chosen = out.logprobs.tolist()
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
        for i, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None:
                continue
            seq.cumulative_logprob += chosen[i]
            entry = {tokens[i]: chosen[i]}
            if k > 0 and top_ids is not None:
                entry.update(zip(top_ids[i][:k], top_lp[i][:k]))
            seq.logprobs.append(entry)

    def _fail_request(self, request_id: str, error: Exception, scrub: bool = False) -> None:
        """Stop one request whose processing raised (or whose logits were NaN) and free its
        blocks; the step goes on for the others, and reports it with ``error`` set.

        ``scrub``: its keys and values may hold NaN; its own blocks are zeroed and dropped
        from the prefix cache before they return to the pool.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        logger.error("request %s failed, the others carry on: %r", request_id, error)
        for seq in request.seqs:
            if scrub:
                self._scrub_blocks(seq)
            self.scheduler.finish(seq, "abort")
            if self.structured:
                self.structured.remove(seq.seq_id)
        self._failed[request_id] = (request, f"{type(error).__name__}: {error}")

    def _fail_seq(self, seq: Sequence, error: Exception) -> None:
        self._fail_request(seq.request_id, error)

    def _scrub_blocks(self, seq: Sequence) -> None:
        """Zero the blocks only this sequence holds and forget their prefix-cache entries."""
        bm, size = self.block_manager, self.config.block_size
        own = [b for b in seq.block_table if bm.blocks[b].ref_count == 1]
        for block_id in own:
            block = bm.blocks[block_id]
            if block.hash is not None and bm.cached.get(block.hash) == block_id:
                del bm.cached[block.hash]
            block.hash, block.token_ids, block.parent = None, (), None
        if own:
            slots = (torch.tensor(own).unsqueeze(1) * size + torch.arange(size)).flatten()
            self.pool.kv[:, :, slots.to(self.device)] = 0

    def _failed_outputs(self) -> list[RequestOutput]:
        """A final output, with ``error`` set, for each request that failed this step."""
        outputs = []
        for request_id, (request, message) in self._failed.items():
            completions = []
            for seq in request.seqs:
                state = self._text.pop(seq.seq_id, None)
                completions.append(CompletionOutput(
                    seq.index, state.text if state else "", list(seq.output_token_ids),
                    finish_reason="abort"))
            outputs.append(RequestOutput(request_id, request.prompt, request.prompt_token_ids,
                                         completions, True, metrics=request.metrics,
                                         error=message))
        self._failed.clear()
        return outputs

    def _structured_outputs(self):
        """The grammar manager (notebook 04), built with the first constrained request."""
        if self.structured is None:
            from minivllm.structured import StructuredOutputManager

            self.structured = StructuredOutputManager(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self.structured

    def _banned_ids(self, seq: Sequence) -> list[int]:
        """min_tokens: EOS and stop token ids may not be sampled until it is reached."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            return []
        return [*([] if p.ignore_eos else self.eos_token_ids), *p.stop_token_ids]

    # ------------------------------------------------------------------ outputs

    def _update_text(self, seq: Sequence) -> None:
        """Detokenize the new tokens one by one, applying stop strings (which end the sequence).

        A speculative step (Milestone 8) brings several tokens at once: a stop string completed
        by one of them ends the sequence there, and the tokens after it are dropped.
        """
        state = self._text[seq.seq_id]
        new_ids = seq.output_token_ids[state.num_text_tokens:]
        for i, token in enumerate(new_ids):
            state.num_text_tokens += 1
            last = i == len(new_ids) - 1
            if self._add_text(seq, state, token, last) and not last:
                self._drop_tokens(seq, len(new_ids) - 1 - i)
                return

    def _add_text(self, seq: Sequence, state: _TextState, token: int, last: bool) -> bool:
        """Detokenize one new token; True if it completed a stop string."""
        delta = state.detokenizer.add([token])
        if seq.is_finished and last:  # emit a character that the last token left incomplete
            delta += state.detokenizer.flush()
        stops = seq.params.stop_strings
        if not stops or not delta or seq.finish_reason == "abort":
            state.text += delta
            return False
        longest = max(map(len, stops))
        search_from = max(0, len(state.text) - longest + 1)
        state.text += delta
        hits = [(i, s) for s in stops if (i := state.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        end = index + len(stop) if seq.params.include_stop_str_in_output else index
        state.text = state.text[:end]
        if seq.is_finished and not last:  # a later token of the same step ended it first
            seq.finish_reason, seq.stop_reason = "stop", stop
        else:
            self.scheduler.finish(seq, "stop", stop)
        return True

    def _drop_tokens(self, seq: Sequence, count: int) -> None:
        """Forget the last ``count`` output tokens (past a stop string), and their logprobs."""
        for token in seq.token_ids[-count:]:
            if seq.logprobs:
                seq.cumulative_logprob -= seq.logprobs.pop()[token]
        del seq.token_ids[-count:]

    def _completion(self, seq: Sequence) -> CompletionOutput:
        state = self._text[seq.seq_id]
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

    def _outputs(self, progressed: list[Sequence]) -> list[RequestOutput]:
        """One output per request that progressed, and one per request that failed."""
        for seq in progressed:
            if seq.request_id in self.requests:
                try:
                    self._update_text(seq)
                except Exception as e:  # noqa: BLE001 -- this request fails, not the step
                    self._fail_request(seq.request_id, e)
        outputs, now = [], time.monotonic()
        for request_id in dict.fromkeys(seq.request_id for seq in progressed):
            request = self.requests.get(request_id)
            if request is None:  # failed in this step
                continue
            try:
                completions = [self._completion(s) for s in request.seqs]
            except Exception as e:  # noqa: BLE001
                self._fail_request(request_id, e)
                continue
            finished = all(s.is_finished for s in request.seqs)
            metrics = request.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            metrics.finished_time = now if finished else None
            outputs.append(RequestOutput(
                request_id, request.prompt, request.prompt_token_ids, completions, finished,
                num_cached_tokens=request.seqs[0].num_cached_tokens, metrics=metrics,
                prompt_logprobs=request.prompt_logprobs))
            if finished:
                del self.requests[request_id]
                for s in request.seqs:
                    self._text.pop(s.seq_id, None)
                    if self.structured:
                        self.structured.remove(s.seq_id)
        return outputs + self._failed_outputs()


class LLM:
    """vLLM-shaped offline API: ``LLM(model).generate(prompts, SamplingParams(...))``."""

    def __init__(self, model: str | None = None, **engine_options):
        self.engine = LLMEngine.from_options(model, **engine_options)
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (batched, continuously) and return outputs in order.

        Shows a progress bar, as vLLM does, unless ``use_tqdm=False`` (or ``TQDM_DISABLE=1``).
        """
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [
            sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [f"offline-{next(self._request_ids)}" for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt, p)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        final: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.error is not None:
                    for request_id in ids:
                        self.engine.abort_request(request_id)
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[i] for i in ids]

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template
        (which also shows the model ``tools``, OpenAI-style function specs, where it can)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                                             tools=tools)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
