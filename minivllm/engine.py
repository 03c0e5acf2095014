# Generated from solutions/03_continuous_batching.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The engine loop and the offline ``LLM`` API.

Built in notebook 03_continuous_batching. ``LLMEngine.step()`` is one turn of the loop, and
it is three calls, as in vLLM's ``EngineCore.step`` and nano-vllm's ``LLMEngine.step``:

    plan = scheduler.schedule()          which sequences run, how many tokens each
    out = runner.execute(plan)           flat batch ─▶ model ─▶ logits ─▶ sampled tokens
    scheduler.update(plan, out)          append, stop, free blocks ─▶ outputs.process

The scheduler never touches tensors, the runner never touches queues, the model never knows
about requests. ``LLM.generate`` loops ``step()`` until every request is done; the server
(notebook 04) runs the same loop in a background thread and streams the per-step deltas.

Later milestones plug in without changing this file's logic: ``RUNNER_VARIANTS`` names, by
qualified name (vLLM's ``worker_cls``), the runner each ``EngineConfig`` option selects, and
``PLUGINS`` what a request's options load; each is imported only when asked for.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.config import (
    EngineConfig,
    ModelConfig,
    auto_dtype,
    read_eos_token_ids,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    resolve_qualname,
)
from minivllm.kv_cache import BlockManager
from minivllm.outputs import (  # noqa: F401 -- the output types are the engine's API too
    CompletionOutput,
    OutputProcessor,
    RequestMetrics,
    RequestOutput,
    RequestState,
)
from minivllm.runner import ModelRunner
from minivllm.sampling import SamplingParams
from minivllm.scheduler import RunnerOutput, Scheduler, Sequence
from minivllm.tokenizer import Tokenizer

logger = logging.getLogger("minivllm.engine")

# The extension point. A later milestone's runner is a ModelRunner subclass (it changes how
# the model is loaded or run) or a wrapper around one (it changes what a step computes), with
# the same execute(plan) -> RunnerOutput; build_runner picks them from EngineConfig.
RUNNER_VARIANTS = {
    "compiled": "minivllm.compile:CompiledRunner",  # notebook 07: compile, merge_projections
    "speculative": "minivllm.spec_decode:SpeculativeRunner",  # 08: speculative_config
    "tensor_parallel": "minivllm.parallel:TensorParallelRunner",  # 09: tensor_parallel_size
}
# What other options load: SamplingParams.structured_outputs' grammars (notebook 04, on first
# use), and the speculative_config's parser (notebook 08, before the weights load)
PLUGINS = {"structured_outputs": "minivllm.structured:StructuredOutputManager",
           "speculative_config": "minivllm.spec_decode:SpeculativeConfig"}


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
    # a speculative runner's counts (notebook 08): proposals verified, and how many accepted
    num_spec_verifications: int = 0  # sequence-steps that verified a proposal
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0  # accepted / proposed
    spec_mean_accepted_length: float = 0.0  # tokens emitted per verification (accepted + 1)

    def add(self, plan, out: RunnerOutput, num_generated: int) -> None:
        """Count one step: its plan, what the runner reports, the tokens it appended."""
        self.num_steps += 1
        self.max_batch_size = max(self.max_batch_size, len(plan.scheduled))
        self.max_batched_tokens = max(self.max_batched_tokens, plan.num_batched_tokens)
        for seq in plan.admitted:
            self.num_prefix_queried_tokens += seq.num_prompt_tokens
            self.num_prefix_cached_tokens += seq.num_cached_tokens
        for name, count in out.counters.items():
            setattr(self, name, getattr(self, name) + count)
        self.num_generated_tokens += num_generated
        if self.num_spec_verifications:
            self.spec_acceptance_rate = (self.num_spec_accepted_tokens
                                         / max(1, self.num_spec_proposed_tokens))
            self.spec_mean_accepted_length = ((self.num_spec_accepted_tokens
                                               + self.num_spec_verifications)
                                              / self.num_spec_verifications)


def build_runner(config: EngineConfig, *args) -> ModelRunner:
    """The runner class ``config`` asks for (``RUNNER_VARIANTS``), built with ``args``.
    (A speculative runner wraps it once the block manager exists: ``LLMEngine``.)"""
    cls = ModelRunner
    if config.tensor_parallel_size > 1:
        cls = resolve_qualname(RUNNER_VARIANTS["tensor_parallel"])
    elif config.compile is not False or config.merge_projections:
        cls = resolve_qualname(RUNNER_VARIANTS["compiled"])  # it decides compile=None itself
    return cls(config, *args)


class LLMEngine:
    """Owns the runner, the scheduler and the output processor; ``step()`` runs one turn."""

    def __init__(self, config: EngineConfig):
        self.model_path = path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_pretrained(path)
        self.device = resolve_device(config.device)
        # the defaults that depend on the device (the step's token budget), filled in once
        self.config = config = config.with_device_defaults(self.device)
        if config.dtype == "auto":  # what the device does well, and why (for the log)
            self.dtype, why = auto_dtype(self.device, self.model_config)
        else:
            self.dtype, why = resolve_dtype(config.dtype, self.device, self.model_config), "asked"
        logger.info("model %s on %s in %s (%s)", path, self.device, str(self.dtype)[6:], why)
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.eos_token_ids = read_eos_token_ids(path)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        speculative = None  # notebook 08's config, parsed first: a bad one is refused at once
        if config.speculative_config is not None:
            speculative = resolve_qualname(PLUGINS["speculative_config"]).parse(
                config.speculative_config)
        self.runner = build_runner(config, path, self.model_config, self.dtype, self.device,
                                   self.max_model_len, self.eos_token_ids)
        self.num_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(self.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        if speculative is not None:  # it grows and rolls back draft blocks
            self.runner = resolve_qualname(RUNNER_VARIANTS["speculative"])(
                self.runner, self.block_manager, speculative)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   self.eos_token_ids, config.step_overhead_tokens)
        self.outputs = OutputProcessor(self.tokenizer)
        self.requests = self.outputs.requests  # request_id -> RequestState, while it runs
        self.structured = None  # PLUGINS["structured_outputs"], built on first use
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        if config.seed is not None:  # after loading: sampling starts from a seeded generator
            torch.manual_seed(config.seed)

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> LLMEngine:
        if model is not None:
            options["model"] = model
        return cls(EngineConfig(**options))

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
        grammar = None
        if params.structured_outputs is not None:  # compiled now: an invalid one changes nothing
            grammar = self._structured_outputs().compile(params.structured_outputs)
        seqs: list[Sequence] = []
        for index in range(params.n):
            parent = seqs[0] if seqs and self.config.enable_prefix_caching else None
            seqs.append(Sequence(next(self._seq_ids), request_id, ids, params, index, parent))
            if grammar is not None:  # one matcher per completion
                self.structured.add(seqs[-1].seq_id, grammar)
        self.outputs.add_request(RequestState(request_id, text, ids, seqs, RequestMetrics(
            arrival_time or time.monotonic())))
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self._finish(request, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One turn: schedule, run the plan, apply its output, turn tokens into outputs."""
        plan = self.scheduler.schedule()
        self.stats.num_preemptions += len(plan.preempted)
        if not plan.scheduled:
            return []
        now = time.monotonic()
        for seq in plan.admitted:
            metrics = self.requests[seq.request_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        out = self.runner.execute(plan)
        seq_of = {seq.seq_id: seq for seq, _ in plan.scheduled}
        for seq_id, error in out.failed.items():  # a NaN row's KV may hold NaN: scrub it
            self._fail(seq_of[seq_id].request_id, error, isinstance(error, FloatingPointError))
        tokens_before = sum(seq.num_tokens for seq, _ in plan.scheduled)
        progressed = self.scheduler.update(plan, out, self.outputs.add_token,
                                           lambda seq, e: self._fail(seq.request_id, e))
        self.stats.add(plan, out, sum(s.num_tokens for s, _ in plan.scheduled) - tokens_before)
        if self.structured:  # advance the grammars; a complete one ends its sequence
            for seq in self.structured.accept(progressed):
                self.scheduler.finish(seq, "stop")
        self._release([seq for seq in progressed if seq.is_finished])
        return self.outputs.process(progressed, self._fail)

    # ------------------------------------------------------------------ failures, plugins

    def _fail(self, request_id: str, error: Exception, scrub: bool = False) -> None:
        """Stop one request whose processing raised (or whose logits were NaN) and free its
        blocks; the step goes on for the others and reports it with ``error`` set.

        ``scrub``: its keys and values may hold NaN; the blocks only it holds are zeroed and
        dropped from the prefix cache before they return to the pool."""
        request = self.outputs.fail(request_id, f"{type(error).__name__}: {error}")
        if request is None:
            return
        logger.error("request %s failed, the others carry on: %r", request_id, error)
        own = [b for s in request.seqs for b in self.block_manager.forget_exclusive(
            s.block_table)] if scrub else []
        if own:
            self.runner.zero_blocks(own)
        self._finish(request, "abort")

    def _finish(self, request: RequestState, reason: str) -> None:
        for seq in request.seqs:
            self.scheduler.finish(seq, reason)
        self._release(request.seqs)

    def _release(self, finished: list[Sequence]) -> None:
        """What finished sequences held beside their KV blocks: grammars, runner state."""
        if finished:
            self.runner.release(finished)
        for seq in finished if self.structured is not None else ():
            self.structured.remove(seq.seq_id)

    def _structured_outputs(self):
        """The grammar manager (notebook 04), built with the first constrained request; its
        token mask runs as one of the runner's logits processors."""
        if self.structured is None:
            manager = resolve_qualname(PLUGINS["structured_outputs"])
            self.structured = manager(self.tokenizer, self.model_config.vocab_size,
                                      self.eos_token_ids)
            self.runner.logits_processors.append(self.structured.apply_token_bitmask)
        return self.structured


FRAME_ROOM_SLOTS = 7200  # unused locals of the frame the step loops start from


def _call(fn: Callable, *args):
    return fn(*args)


@functools.cache
def _caller_with_slots(slots: int) -> Callable:
    """``_call`` with ``slots`` more local variables, never used: CPython sizes a frame by
    its code's count of locals, so this frame is ``slots`` x 8 bytes larger."""
    code = _call.__code__
    names = code.co_varnames + tuple(f"_unused_{i}" for i in range(slots))
    return types.FunctionType(code.replace(co_varnames=names, co_nlocals=len(names)),
                              _call.__globals__, "call_from_frame_room")


def call_with_frame_room(fn: Callable, *args):
    """``fn(*args)``, called from a frame that opens a fresh chunk of CPython's frame stack.

    CPython (3.11+) needs ``(frame + 1000 slots) x 8`` bytes for the new chunk and rounds
    that up to 16 KB x 2^k: 8 x 8200 B -> 128 KB, of which ~73 KB lie above this frame. A
    loop run from here keeps that chunk until it returns, so no step maps and unmaps one.
    Python 3.10 keeps frames elsewhere: there this is only a larger frame."""
    return _caller_with_slots(FRAME_ROOM_SLOTS)(fn, *args)


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
        call_with_frame_room(self._step_until_finished, ids, final, bar)
        if bar is not None:
            bar.close()
        return [final[i] for i in ids]

    def _step_until_finished(self, ids: list[str], final: dict[str, RequestOutput],
                             bar) -> None:
        """``generate``'s loop: step until every request in ``ids`` has its final output."""
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
