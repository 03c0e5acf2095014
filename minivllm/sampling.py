# Generated from solutions/03_continuous_batching.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Sampling parameters and the batched sampler.

Built in notebook 03_continuous_batching. ``SamplingParams`` mirrors vLLM's names and
defaults so that code written for vLLM runs unchanged. The ``Sampler`` turns one step's
logits — one row per sequence that produces a token this step — into token ids in a
handful of batched tensor operations, whatever mix of greedy and sampled requests the
batch holds:

    logits ─▶ allowed ids / bad words / min_tokens masks ─▶ + logit_bias ─▶ penalties
           ─▶ / temperature ─▶ top-k ─▶ top-p ─▶ min-p ─▶ softmax
           ─▶ inverse CDF (one uniform a row)  ─▶ token ids

The first line is vLLM's logits processors, in vLLM's order, on the raw logits; they run
only on the rows whose requests ask for them, and not at all in a batch where none does.
Reported logprobs are those of the raw logits, before any of it (vLLM's default
``logprobs_mode="raw_logprobs"``).

The inverse-CDF draw takes one uniform a row and finds where it lands in the row's running
sum: the distribution of ``torch.multinomial``, without a host sync, and one random number
a row where the exponential race of gpt-fast, nano-vllm and vLLM takes one a token (on a
CPU that noise took 44 ms for 32 rows, a ninth of a sampled 32-row decode step).
Per-request seeds are easy: a seeded request draws its uniform from its own
``torch.Generator``, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-5  # vLLM treats temperature below this as greedy
MAX_LOGPROBS = 20  # the OpenAI API allows at most 20 top logprobs
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI, vLLM)
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)


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
    presence_penalty: float = 0.0  # minus this for each token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # prompt + output tokens: logit / it if > 0, * it if not
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words never generated (tokenized when added)
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many top ones
    _stop: list[str] = field(init=False, repr=False, default_factory=list)
    _bad_words_token_ids: list[list[int]] = field(init=False, repr=False, default_factory=list)

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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                fail(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                fail(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        bias = self.logit_bias or {}
        if not all(isinstance(t, int) and t >= 0 and isinstance(b, (int, float))
                   and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in bias.items()):
            fail(f"logit_bias must map token ids to biases in [-{MAX_LOGIT_BIAS:g}, "
                 f"{MAX_LOGIT_BIAS:g}], got {self.logit_bias!r}")
        self.logit_bias = {t: float(b) for t, b in bias.items()} or None
        allowed = self.allowed_token_ids
        if allowed is not None and not (allowed and all(isinstance(t, int) and t >= 0 for t in allowed)):
            fail("allowed_token_ids must be a non-empty list of token ids")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words or []):
            fail("bad_words must be a list of non-empty strings")
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
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logits processor (penalties, bias, allowed ids, bad words) applies."""
        return (self.has_penalties or bool(self.logit_bias) or bool(self.bad_words)
                or self.allowed_token_ids is not None)

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids

    def update_from_tokenizer(self, tokenizer, vocab_size: int) -> None:
        """What needs the model, done when a request is added (as vLLM does): token ids
        must lie in the vocabulary, and each bad word becomes token ids — as it is at the
        start of a text and, when that gives other tokens of the same count, after a
        space (a word in the middle of a text)."""
        words = []
        for word in self.bad_words or []:
            plain = tokenizer.encode(word.lstrip())
            spaced = tokenizer.encode(" " + word.lstrip())
            words.append(plain)
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                words.append(spaced)
        for name, ids in (("logit_bias", list(self.logit_bias or {})),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("bad_words", [t for w in words for t in w])):
            if any(t >= vocab_size for t in ids):
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size})")
        self._bad_words_token_ids = words

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


def uniform_draws(rows: int, generators: list[torch.Generator | None],
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """u ~ Uniform[0, 1) in float64, shape (rows,). Rows with a generator draw theirs from it
    (per-request seeds); the others share one batched draw from the global generator."""
    u = torch.rand(rows, dtype=torch.float64, device=device)
    for row, gen in enumerate(generators):
        if gen is not None:  # a CPU generator draws on the CPU
            u[row] = torch.rand((), dtype=torch.float64, generator=gen).to(device)
    return u


CDF_CHUNK = 128  # tokens a chunk in inverse_cdf's first level


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row: (B, V) probabilities (not necessarily normalised) and (B,) uniforms
    -> (B,) int64, the first token whose running sum exceeds u times the row's total."""
    rows, vocab = probs.shape
    chunks = -(-vocab // CDF_CHUNK)
    if vocab % CDF_CHUNK:  # zeros at the end: tokens that are never drawn
        probs = torch.nn.functional.pad(probs, (0, chunks * CDF_CHUNK - vocab))
    blocks = probs.view(rows, chunks, CDF_CHUNK)  # (B, chunks, C)
    upto = blocks.sum(-1).double().cumsum(-1)  # (B, chunks): mass of chunks 0..j
    target = u.unsqueeze(-1) * upto[:, -1:]  # (B, 1), below the total: u < 1 in float64
    chunk = torch.searchsorted(upto, target, right=True).clamp(max=chunks - 1)  # (B, 1)
    before = torch.where(chunk > 0, upto.gather(-1, (chunk - 1).clamp(min=0)), 0.0)  # (B, 1)
    inside = blocks.gather(1, chunk.unsqueeze(-1).expand(-1, -1, CDF_CHUNK)).squeeze(1)
    inside = inside.double().cumsum(-1)  # (B, C): the chosen chunk's running sum
    rest = (target - before) / (upto.gather(-1, chunk) - before) * inside[:, -1:]
    # the two subtractions can round alike and make the ratio 1: keep below the chunk's total
    rest = torch.minimum(rest, inside[:, -1:].nextafter(torch.zeros_like(rest)))  # (B, 1)
    within = torch.searchsorted(inside, rest, right=True).clamp(max=CDF_CHUNK - 1)
    # a row of NaN (or of zeros) lands anywhere, the padding too: keep its id a token's (the
    # runner fails such a row by its logits; an id past the vocabulary would break the batch)
    return (chunk * CDF_CHUNK + within).squeeze(-1).clamp(max=vocab - 1)


def token_counts(token_ids: list[list[int]], vocab: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, V) float: how often each token occurs in each row's list, by one scatter-add.

    Rows are padded with the id ``vocab``, counted in an extra column that is dropped.
    """
    width = max((len(ids) for ids in token_ids), default=0)
    padded = torch.tensor([list(ids) + [vocab] * (width - len(ids)) for ids in token_ids],
                          dtype=torch.long, device=device).view(len(token_ids), width)  # (B, W)
    counts = torch.zeros(len(token_ids), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, prompt_counts: torch.Tensor,
                    output_counts: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties on (B, V) logits; counts are (B, V), the penalties (B,) per row.

    repetition: tokens in the prompt or output, logit / r when > 0, logit * r otherwise;
    frequency: minus f * the token's count in the output; presence: minus p if it is there.
    """
    seen = (prompt_counts + output_counts) > 0  # (B, V)
    scale = torch.where(seen, repetition.unsqueeze(-1), 1.0)  # (B, V)
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits = logits - frequency.unsqueeze(-1) * output_counts
    return logits - presence.unsqueeze(-1) * (output_counts > 0)


def bad_word_bans(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The tokens that would complete a bad word now (vLLM's rule): a word's last token when
    the output ends with the word's other tokens (a one-token word: always). Only the output
    counts, not the prompt."""
    bans = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output_token_ids) and \
                output_token_ids[len(output_token_ids) - len(prefix):] == prefix:
            bans.append(word[-1])
    return bans


def process_logits(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
                   num_prompt_tokens: list[int], banned_token_ids: list[list[int]]) -> torch.Tensor:
    """vLLM's logits processors, in vLLM's order, on the rows that ask for them:

        allowed_token_ids ─▶ bad words ─▶ min_tokens bans ─▶ + logit_bias ─▶ penalties

    ``token_ids[b]`` is row b's prompt + output so far, its first ``num_prompt_tokens[b]``
    the prompt; ``banned_token_ids[b]`` what min_tokens forbids now. When no row asks for
    anything, ``logits`` itself comes back: the fast path costs nothing.
    """
    rows = [b for b, p in enumerate(params) if p.adjusts_logits or banned_token_ids[b]]
    if not rows:
        return logits
    (batch, vocab), device = logits.shape, logits.device
    forbid = torch.zeros(batch, vocab, dtype=torch.bool, device=device)  # (B, V): -inf
    bias = torch.zeros(batch, vocab, device=device)  # (B, V)
    for b in rows:
        p = params[b]
        if p.allowed_token_ids is not None:
            forbid[b] = True
            forbid[b, p.allowed_token_ids] = False
        bans = bad_word_bans(p.bad_words_token_ids, token_ids[b][num_prompt_tokens[b]:])
        bans += [t for t in banned_token_ids[b] if t < vocab]  # (an EOS id past the logits)
        if bans:
            forbid[b, bans] = True
        if p.logit_bias:
            bias[b, list(p.logit_bias)] = torch.tensor(list(p.logit_bias.values()), device=device)
    logits = logits.masked_fill(forbid, float("-inf")) + bias
    if not any(params[b].has_penalties for b in rows):
        return logits
    penalized = [p.has_penalties for p in params]
    prompts = [ids[:n] if on else [] for ids, n, on in zip(token_ids, num_prompt_tokens, penalized)]
    outputs = [ids[n:] if on else [] for ids, n, on in zip(token_ids, num_prompt_tokens, penalized)]
    column = lambda name: torch.tensor([getattr(p, name) for p in params], device=device)  # (B,)
    return apply_penalties(logits, token_counts(prompts, vocab, device),
                           token_counts(outputs, vocab, device), column("presence_penalty"),
                           column("frequency_penalty"), column("repetition_penalty"))


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a row is drawn from: / temperature, top-k, top-p, min-p, softmax.

    logits: (B, V) float32 -> (B, V) probabilities. Greedy rows get temperature 1 (their
    token is the argmax; speculative decoding's acceptance reads this too, notebook 08).
    """
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
    return logits.softmax(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, (B, V) -> (B,): the same index as ``logits.argmax(dim=-1)`` (the
    first of equal maxima; NaN ranks highest), read from ``max(dim=-1)``, whose CPU kernel is
    vectorised. Over a 151,936-token vocabulary that is 3-5x faster than argmax's: 32 rows,
    float32, 3.5 -> 1.2 ms on the AMX Xeon, a few percent of a 32-row decode step."""
    return logits.max(dim=-1).indices


class Sampler:
    """Batched sampler over one step's logits; see the module docstring for the pipeline."""

    def __call__(
        self,
        logits: torch.Tensor,  # (B, V) float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned_token_ids: list[list[int]] | None = None,  # per row: ids masked (min_tokens)
        token_ids: list[list[int]] | None = None,  # per row: prompt + output so far
        num_prompt_tokens: list[int] | None = None,  # per row: how many of those are prompt
    ) -> SamplerOutput:
        raw_logits = logits.float()
        rows = len(params)
        logits = process_logits(raw_logits, params, token_ids or [[]] * rows,
                                num_prompt_tokens or [0] * rows, banned_token_ids or [[]] * rows)
        sampled = self._sample(logits, params, generators)
        return self.logprobs(raw_logits, sampled, params)

    def _sample(self, logits, params, generators) -> torch.Tensor:
        greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        greedy_ids = greedy_tokens(logits)  # (B,)
        if bool(greedy.all()):
            return greedy_ids
        u = uniform_draws(len(params), generators, logits.device)  # (B,)
        sampled_ids = inverse_cdf(sampling_probs(logits, params), u)
        return torch.where(greedy, greedy_ids, sampled_ids)

    @staticmethod
    def logprobs(raw_logits, token_ids, params) -> SamplerOutput:
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
