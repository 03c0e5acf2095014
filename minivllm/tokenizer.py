# Generated from solutions/01_forward_pass.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Text <-> token ids: the `tokenizers` library, the chat template, streaming detokenization.

Built in notebook 01_forward_pass.

`Tokenizer` wraps the Rust `tokenizers` object loaded from the checkpoint's
``tokenizer.json`` and reads ``tokenizer_config.json`` for the special tokens and the
chat template, so we match ``transformers.AutoTokenizer`` without importing it.
`IncrementalDetokenizer` turns a growing list of token ids into text deltas for streaming:
Qwen's byte-level BPE can split one character (an emoji, a CJK character) over several
tokens, so a delta is only released once its last character is complete.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_content(token: str | dict | None) -> str | None:
    """tokenizer_config.json spells a token as "<s>" or as {"content": "<s>", ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers overrides jinja's tojson, which would HTML-escape '<', '>', '&' and '\''.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses (sandboxed, trimmed)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """encode / decode / apply_chat_template for a Hugging Face checkpoint directory."""

    def __init__(self, tokenizer: RustTokenizer, config: dict, chat_template: str | None) -> None:
        self._tok = tokenizer
        self.config = config  # tokenizer_config.json
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None  # compiled on first use
        # Special tokens the chat template may refer to, e.g. {{ eos_token }}.
        self.special_tokens: dict[str, str] = {
            attr: content
            for attr in _SPECIAL_ATTRS
            if (content := _token_content(config.get(attr))) is not None
        }

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json in the checkpoint directory")
        tok = RustTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        # Tokens declared only in tokenizer_config.json are added, as transformers does.
        for entry in config.get("added_tokens_decoder", {}).values():
            if tok.token_to_id(entry["content"]) is None:
                token = AddedToken(entry["content"], special=entry.get("special", False))
                tok.add_tokens([token])
        # Newer transformers save the template beside the config as chat_template.jinja.
        template_file = model_dir / "chat_template.jinja"
        template = config.get("chat_template")
        if template_file.is_file():
            template = template_file.read_text()
        elif isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        return cls(tok, config, template)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. Special tokens written in the text (``<|im_start|>``) become one id."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text; incomplete UTF-8 at the end decodes to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_str(self) -> str:
        """The tokenizer as tokenizer.json text, added tokens included (what llguidance loads)."""
        return self._tok.to_str()

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self._tok.token_to_id(eos)

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included (``len(hf_tokenizer)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the added tokens marked special (what ``skip_special_tokens`` drops)."""
        added = self._tok.get_added_tokens_decoder()  # {id: AddedToken}
        return sorted(i for i, token in added.items() if token.special)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str | list[int]:
        """Render a conversation with the checkpoint's jinja template, as transformers does.

        Extra keyword arguments reach the template (e.g. ``enable_thinking=False`` for Qwen3).
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        text = self._template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **kwargs,
        )
        return self.encode(text) if tokenize else text


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas (vLLM's prefix/read offset scheme).

    Decoding one token at a time is wrong for byte-level BPE: a token may hold half of a
    character's UTF-8 bytes. Instead we decode two windows of the ids: ``[prefix, read)``,
    text already emitted, and ``[prefix, end)``. The new text is the difference, released
    only when it does not end in U+FFFD (an incomplete character). A few tokens of left
    context (``prefix``) keep the decoder's view of word boundaries the same as a full
    decode would have. Concatenating all deltas (and `flush`) gives ``decode(output_ids)``.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - 5, 0)  # start of the context window
        self.read_offset = len(self.ids)  # end of the text already emitted

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new ids; return the text they complete ("" while a character is partial)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new (a skipped special token) or an unfinished character
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The held-back tail (e.g. a character cut off by max_tokens), as decode shows it."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]
