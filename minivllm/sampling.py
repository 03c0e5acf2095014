# Generated from solutions/03_continuous_batching.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Sampling parameters and the batched sampler.

Built in notebook 03_continuous_batching. ``SamplingParams`` mirrors vLLM's names and
defaults so that code written for vLLM runs unchanged. The ``Sampler`` turns one step's
logits — one row per sequence that produces a token this step — into token ids in a
handful of batched tensor operations, whatever mix of greedy and sampled requests the
batch holds:

    logits ─▶ min_tokens mask ─▶ / temperature ─▶ top-k ─▶ top-p ─▶ min-p ─▶ softmax
           ─▶ exponential race (argmax of p / q, q ~ Exp(1))  ─▶ token ids

The exponential race (gpt-fast, nano-vllm) draws the same distribution as
``torch.multinomial`` without a host sync, and makes per-request seeds easy: a seeded
request draws its own row of noise from its own ``torch.Generator``, so its tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_GREEDY_EPS = 1e-5  # vLLM treats temperature below this as greedy
MAX_LOGPROBS = 20  # the OpenAI API allows at most 20 top logprobs


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): set exactly one of json, regex, choice,
    grammar, json_object. Notebook 04 (``minivllm/structured.py``) compiles it into a grammar
    whose token mask the engine applies to the request's logits every step."""

    json: dict | str | None = None  # a JSON schema (a dict or its text)
    regex: str | None = None  # a regular expression the whole output matches
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # a Lark or GBNF (llama.cpp) context-free grammar
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = True  # JSON with ", " and ": " only (vLLM's default: False)

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {kinds or 'none'}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k)
                    is not None) if not self.json_object else "json_object"


@dataclass
class SamplingParams:
    """How to sample one request (vLLM's names and defaults)."""

    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with mass >= top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 disables
    min_p: float = 0.0  # drop tokens less likely than min_p * p(most likely token)
    seed: int | None = None  # per-request seed: same output whatever else is in the batch
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, ... (04)
    max_tokens: int | None = 16  # output tokens at most (None: up to max_model_len)
    min_tokens: int = 0  # EOS / stop token ids are masked until this many tokens exist
    stop: list[str] | str | None = None  # stop strings (not included in the text)
    stop_token_ids: list[int] | None = None  # extra token ids that end the request
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    logprobs: int | None = None  # return the chosen token's logprob and this many top ones
    skip_special_tokens: bool = True  # drop special tokens from the decoded text
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    _stop: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(message)

        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            fail(f"seed must be an integer, got {self.seed!r}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            fail(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            fail("stop must be a non-empty string or a list of non-empty strings")
        self._stop = stop
        ids = self.stop_token_ids or []
        if not all(isinstance(t, int) and t >= 0 for t in ids):
            fail("stop_token_ids must be a list of non-negative integers")
        self.stop_token_ids = list(ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop


@dataclass
class SamplerOutput:
    """What the sampler returns for a batch of B rows."""

    token_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor | None  # (B,) chosen token's logprob, when any row asked
    top_logprobs: torch.Tensor | None  # (B, K) float, when any row asked
    top_token_ids: torch.Tensor | None  # (B, K) int64


def mask_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the ``top_k[b]`` largest logits of row b (``top_k[b] <= 0`` keeps all).

    logits: (B, V); top_k: (B,) int64. Ties at the k-th value are kept, as in vLLM.
    """
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # (B,)
    sorted_logits = logits.sort(dim=-1, descending=True).values  # (B, V)
    kth = sorted_logits.gather(-1, (k - 1).unsqueeze(-1))  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def mask_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches ``top_p[b]``.

    The most likely token is always kept, so top_p can never empty a row.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly-better tokens
    drop_sorted = mass_before >= top_p.unsqueeze(-1)  # (B, V)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def mask_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p[b]`` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(-1)  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def exponential_noise(rows: int, vocab: int, generators: list[torch.Generator | None],
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """q ~ Exp(1), shape (rows, vocab). Rows with a generator draw their own noise from it
    (per-request seeds); the others share one batched draw from the global generator."""
    q = torch.empty(rows, vocab, device=device).exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            q[row] = torch.empty(vocab).exponential_(generator=gen).to(device)
    return q


def exponential_race(
    probs: torch.Tensor, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Sample one token per row: argmax(p / q) with q ~ Exp(1) is a draw from p."""
    q = exponential_noise(probs.shape[0], probs.shape[-1], generators, probs.device)
    return (probs / q).argmax(dim=-1)


class Sampler:
    """Batched sampler over one step's logits; see the module docstring for the pipeline."""

    def __call__(
        self,
        logits: torch.Tensor,  # (B, V) float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned_token_ids: list[list[int]] | None = None,  # per row: ids masked (min_tokens)
    ) -> SamplerOutput:
        logits = logits.float()
        raw_logits = logits
        if banned_token_ids and any(banned_token_ids):
            logits = logits.clone()
            for row, banned in enumerate(banned_token_ids):
                if banned:
                    logits[row, banned] = float("-inf")
        token_ids = self._sample(logits, params, generators)
        return self._logprobs(raw_logits, token_ids, params)

    def _sample(self, logits, params, generators) -> torch.Tensor:
        greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        greedy_ids = logits.argmax(dim=-1)  # (B,)
        if bool(greedy.all()):
            return greedy_ids
        device = logits.device
        temperature = torch.tensor(
            [1.0 if p.is_greedy else p.temperature for p in params], device=device
        )
        logits = logits / temperature.unsqueeze(-1)
        if any(p.top_k > 0 for p in params):
            logits = mask_top_k(logits, torch.tensor([p.top_k for p in params], device=device))
        if any(p.top_p < 1.0 for p in params):
            logits = mask_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
        if any(p.min_p > 0.0 for p in params):
            logits = mask_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
        sampled_ids = exponential_race(logits.softmax(dim=-1), generators)
        return torch.where(greedy, greedy_ids, sampled_ids)

    @staticmethod
    def _logprobs(raw_logits, token_ids, params) -> SamplerOutput:
        """Logprobs are those of the model's raw distribution, as vLLM reports them."""
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if not wanted:
            return SamplerOutput(token_ids, None, None, None)
        logprobs = raw_logits.log_softmax(dim=-1)  # (B, V)
        chosen = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # (B,)
        top = logprobs.topk(max(wanted), dim=-1) if max(wanted) > 0 else None
        return SamplerOutput(
            token_ids,
            chosen,
            top.values if top is not None else None,
            top.indices if top is not None else None,
        )
