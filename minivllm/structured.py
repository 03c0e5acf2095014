# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Structured outputs: a grammar per request decides which tokens may come next.

Built in notebook 04_openai_server. A request may ask for output that matches a JSON schema,
a regular expression, one of a list of strings or a context-free grammar
(``SamplingParams(structured_outputs=StructuredOutputsParams(...))``, vLLM's names). The
grammar library, llguidance, compiles the constraint into a *matcher*: given the tokens so
far, it computes a token bitmask, one bit per vocabulary entry, 1 where that token may come
next. Every engine step, for the rows of the batch that have a grammar:

    matchers ─fill─▶ bitmask (R, ⌈V/32⌉) int32 ─apply─▶ logits[rows] = -inf where a bit is 0
    sample ─▶ token ─▶ matcher.consume_token(token) ─▶ grammar complete? finish with "stop"

EOS is allowed by the mask only where the grammar is complete, so a constrained output that
ends parses. A batch without a grammar skips all of it (the engine checks one dict), and a
matcher's state depends only on the output tokens, so preemption (which keeps them) leaves
it as it is.
"""

from __future__ import annotations

import json
import logging

import llguidance
import numpy as np
import torch

from minivllm.sampling import StructuredOutputsParams
from minivllm.tokenizer import Tokenizer

logger = logging.getLogger("minivllm.structured")

# JSON with fixed separators unless a request allows any whitespace: a small model given the
# choice spends its tokens on spaces and newlines (docs/decisions.md).
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict | str, any_whitespace: bool = False) -> str:
    """The llguidance grammar of a JSON schema (a dict or its text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        # a ValueError, like every bad constraint: the server answers it with a 400
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")  # noqa: TRY004
    options = None if any_whitespace else COMPACT_JSON
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


def compile_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint, checked: a ValueError says what is wrong.

    Needs no tokenizer, so the server checks a request with it before the engine sees it.
    """
    kind, any_whitespace = params.kind, not params.disable_any_whitespace
    if kind == "json":
        grammar = json_schema_grammar(params.json, any_whitespace)
    elif kind == "json_object":
        grammar = json_schema_grammar({"type": "object"}, any_whitespace)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(params.regex)
    elif kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in params.choice)
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    else:  # a Lark grammar, or llama.cpp's GBNF (translated to Lark)
        grammar = llguidance.grammar_from("grammar", params.grammar)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid structured_outputs.{kind}: {error.strip()}")
    return grammar


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: in row ``rows[r]`` of logits, every token whose bit in ``bitmask[r]`` is 0
    becomes -inf.

    logits: (B, V) float; bitmask: (R, W) int32, bit b of word w is token 32 w + b. Columns
    past 32 W are banned too (a model vocabulary padded past the tokenizer's). The words are
    unpacked by numpy on the host (``unpackbits`` reads a little-endian word's bytes in token
    order), which is several times faster than shifting int32 tensors in torch, and the rows
    are masked in place, so the other rows are not even read.
    """
    vocab = logits.shape[-1]
    words = np.invert(bitmask.numpy().view(np.uint8))  # (R, 4 W): bytes in token order, 1 = ban
    banned = np.unpackbits(words, axis=-1, count=min(vocab, 8 * words.shape[-1]),
                           bitorder="little")  # (R, min(V, 32 W)) of 0/1
    banned = torch.from_numpy(banned.view(np.bool_)).to(logits.device)
    for r, row in enumerate(rows):
        logits[row, :banned.shape[1]].masked_fill_(banned[r], float("-inf"))
        logits[row, banned.shape[1]:] = float("-inf")


class StructuredOutputManager:
    """The engine's grammars: llguidance's view of the vocabulary (built once) and one matcher
    per constrained sequence (n > 1: one per completion), by seq_id."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids) -> None:
        # the model's vocabulary may be padded past the tokenizer's (the bundled model: 4032
        # logits, 4003 tokens): the mask covers both, and padding tokens are never allowed
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=list(eos_token_ids) or None)
        self.num_words = -(-self.vocab_size // 32)  # int32 words per bitmask row
        self.matchers: dict[int, llguidance.LLMatcher] = {}
        self.num_consumed: dict[int, int] = {}  # output tokens each matcher has consumed

    def __bool__(self) -> bool:
        """True while some sequence has a grammar: the engine's fast-path test."""
        return bool(self.matchers)

    def compile(self, params: StructuredOutputsParams) -> str:
        grammar = compile_grammar(params)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"invalid structured_outputs.{params.kind}: {error.strip()}")
        return grammar

    def add(self, seq_id: int, grammar: str) -> None:
        self.matchers[seq_id] = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        self.num_consumed[seq_id] = 0

    def remove(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)
        self.num_consumed.pop(seq_id, None)

    def bitmask(self, seq_ids: list[int]) -> torch.Tensor:
        """(len(seq_ids), W) int32: the tokens each sequence's grammar allows next."""
        # The matcher writes each row straight into the tensor's memory. (What
        # llguidance.torch.fill_next_token_bitmask does, but importing that module imports
        # torch._dynamo: 1.5 s, and an ImportError if the compile thread is importing it at
        # the same moment; docs/decisions.md, issue 31.)
        bitmask = torch.empty(len(seq_ids), self.num_words, dtype=torch.int32)
        row_bytes = self.num_words * bitmask.element_size()
        for row, seq_id in enumerate(seq_ids):
            self.matchers[seq_id].unsafe_compute_mask_ptr(bitmask[row].data_ptr(), row_bytes)
        return bitmask

    def apply_token_bitmask(self, logits: torch.Tensor, seqs) -> None:
        """Mask, in place, the rows of ``logits`` (one per sequence of ``seqs``) that have a
        grammar; the others are left untouched."""
        rows = [row for row, seq in enumerate(seqs) if seq.seq_id in self.matchers]
        if rows:
            apply_token_bitmask(logits, self.bitmask([seqs[r].seq_id for r in rows]), rows)

    def accept(self, seqs) -> list:
        """Advance each constrained sequence's matcher by the output tokens it has not seen
        (one per decode step); return the sequences still running whose grammar is now
        complete (nothing but EOS could follow)."""
        done = []
        for seq in seqs:
            matcher = self.matchers.get(seq.seq_id)
            if matcher is None:
                continue
            new = seq.output_token_ids[self.num_consumed[seq.seq_id]:]
            self.num_consumed[seq.seq_id] += len(new)
            if not matcher.consume_tokens(new):  # only if every allowed logit was -inf
                logger.warning("sequence %s: tokens %s break its grammar (%s); stopping it",
                               seq.seq_id, new, matcher.get_error())
            if not seq.is_finished and (matcher.is_stopped() or matcher.is_error()):
                done.append(seq)
        return done
