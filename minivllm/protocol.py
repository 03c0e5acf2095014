# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The OpenAI wire format: request models, errors, response bodies and Server-Sent Events.

Built in notebook 04_openai_server. ``server/`` speaks HTTP; this module only knows what
goes over the wire, shaped like vLLM's OpenAI server so that the ``openai`` client and
``vllm bench serve`` work unchanged:

* request models (pydantic, as FastAPI wants them) whose unknown fields are ignored, as
  vLLM ignores them, except the few that would silently change the output (``_REFUSED``);
* ``OpenAIError``: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status;
* ``sse_event``: one ``data: {json}\\n\\n`` event of a stream;
* ``merge_outputs``: a backlog of one request's step outputs folded into one chunk;
* the logprobs and usage objects of both endpoints;
* ``Job``: one HTTP request turned into engine requests, and engine outputs into bodies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from minivllm.engine import CompletionOutput, RequestOutput
from minivllm.sampling import SamplingParams, StructuredOutputsParams
from minivllm.structured import compile_grammar
from minivllm.tokenizer import Tokenizer
from minivllm.tool_calls import (
    ToolCallStream,
    check_tools,
    messages_for_template,
    parse_tool_calls,
    tool_call_grammar,
)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 503: "ServiceUnavailableError"}


class OpenAIError(Exception):
    """An error sent to the client as OpenAI's error body (vLLM's type names and codes)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        # a message may quote the client's text: lone surrogates would not encode as UTF-8
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.status}}


# Fields we do not implement but that would change the output if a client relied on them:
# refused with a 400 unless they hold their neutral value. Other unknown fields are ignored.
_REFUSED: dict[str, tuple] = {
    "suffix": (None, ""),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """The sampling fields both endpoints share (vLLM's names; None means the default)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings
    allowed_token_ids: list[int] | None = None  # vLLM's extra
    bad_words: list[str] | None = None  # vLLM's extra
    stream: bool = False
    stream_options: StreamOptions | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo):
        """As vLLM answers: stream_options means nothing without a stream, so it is an error."""
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return value

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        for name, neutral in _REFUSED.items():
            if isinstance(data, dict) and data.get(name) not in neutral:
                raise ValueError(f"{name} is not supported by minivllm")
        return data

    @model_validator(mode="after")
    def _bounded_numbers(self):
        """Finite floats and 64-bit ints only: NaN passes every range check, and a number
        torch cannot hold would fail inside the engine step, for the whole batch."""
        for name, value in self:
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, float) and not math.isfinite(v):
                    raise ValueError(f"{name} must be a finite number, got {v}")
                if isinstance(v, int) and not -2**63 <= v < 2**63:
                    raise ValueError(f"{name} must fit in a 64-bit integer")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint, compiled once here so that a bad schema is a 400
        that says why, before the engine sees the request."""
        given = {name: value for name, value in [
            ("structured_outputs", self.structured_outputs), ("guided_json", self.guided_json),
            ("guided_regex", self.guided_regex), ("guided_choice", self.guided_choice),
            ("guided_grammar", self.guided_grammar),
            ("response_format", _response_format(self.response_format))] if value is not None}
        if len(given) > 1:
            raise OpenAIError(f"give one output constraint, not {', '.join(given)}",
                              param=next(iter(given)))
        if not given:
            return None
        (name, value), = given.items()
        try:
            if name == "structured_outputs":
                params = StructuredOutputsParams(**value)
            else:
                params = value if name == "response_format" else StructuredOutputsParams(
                    **{name.removeprefix("guided_"): value})
            compile_grammar(params)
        except (TypeError, ValueError) as e:
            raise OpenAIError(str(e), param=name) from None
        return params

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for this request; its ValueError messages become 400s."""
        def given(value, default):
            return default if value is None else value

        bias = self.logit_bias
        if bias is not None and not all(t.strip().isdecimal() for t in bias):
            raise OpenAIError("logit_bias keys must be token ids", param="logit_bias")
        for word in self.bad_words or []:  # the engine tokenizes them: valid Unicode only
            try:
                word.encode("utf-8")
            except UnicodeEncodeError:
                raise OpenAIError("bad_words must be valid Unicode text", param="bad_words") from None
        structured_outputs = structured_outputs or self.structured_outputs_params()
        try:
            return SamplingParams(
                n=self.n, temperature=given(self.temperature, 1.0), top_p=given(self.top_p, 1.0),
                top_k=given(self.top_k, 0), min_p=given(self.min_p, 0.0), seed=self.seed,
                max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                presence_penalty=given(self.presence_penalty, 0.0),
                frequency_penalty=given(self.frequency_penalty, 0.0),
                repetition_penalty=given(self.repetition_penalty, 1.0),
                logit_bias=None if bias is None else {int(t): b for t, b in bias.items()},
                allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs)
        except ValueError as e:  # "<field> must be ...": the first word names the field
            raise OpenAIError(str(e), param=str(e).split()[0]) from None


def _response_format(response_format: dict | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise OpenAIError("response_format json_schema needs json_schema.schema, an object",
                              param="response_format")
        return StructuredOutputsParams(json=schema)
    raise OpenAIError(f"response_format type {kind!r} is not supported (text, json_object, "
                      "json_schema)", param="response_format")


class CompletionRequest(_Request):
    """POST /v1/completions: a string, strings, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # the legacy completions API's default
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list; an empty one is a 400."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or not all(prompts):
            raise OpenAIError("prompt must be a non-empty string or list of tokens",
                              param="prompt")
        return prompts


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, ...) reach the chat template as they are."""

    model_config = ConfigDict(extra="allow")

    # The OpenAI API's roles. Qwen's template renders any role verbatim, so a typo ("usr")
    # would silently change the prompt: refuse it instead (a 400 naming the field).
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def for_template(self) -> dict:
        """The message as the chat template wants it: text parts joined into one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise OpenAIError("only text content parts are supported", param="messages")
            message["content"] = "\n".join(part.get("text", "") for part in self.content)
        return message


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: messages through the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins if both
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None  # e.g. {"enable_thinking": False} for Qwen3
    tools: list[dict] | None = None  # [{"type": "function", "function": {name, parameters}}]
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | a named function
    parallel_tool_calls: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def check_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int | None:
    """The max_tokens to run with; a 400 when the prompt (plus max_tokens) does not fit.

    ``max_tokens=None`` means "up to the context length"; values < 1 are left to
    SamplingParams, whose message says what is wrong with them.
    """
    if num_prompt_tokens >= max_model_len:
        raise OpenAIError(f"The prompt has {num_prompt_tokens} tokens, but this model's maximum "
                          f"context length is {max_model_len} tokens: no room for output.")
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} in the completion). Please reduce the length of the prompt "
            "or completion.", param="max_tokens")
    return max_tokens


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int],
                        logprobs: list[dict[int, float]], text_offset: int) -> dict:
    """The legacy completions logprobs object for some tokens; offsets start at text_offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for token_id, entry in zip(token_ids, logprobs):
        token = _token_text(tokenizer, token_id)
        out["tokens"].append(token)
        # echo: the first prompt token has no logprob (nothing comes before it)
        out["token_logprobs"].append(None if entry is None else entry[token_id])
        out["top_logprobs"].append(None if entry is None else
                                   {_token_text(tokenizer, t): lp for t, lp in entry.items()})
        out["text_offset"].append(text_offset)
        text_offset += len(token)
    return out


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int],
                  logprobs: list[dict[int, float]], top_n: int) -> dict:
    """The chat logprobs object: per token its logprob, bytes and the top_n alternatives."""
    def item(token_id: int, logprob: float) -> dict:
        token = _token_text(tokenizer, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**item(token_id, entry[token_id]),
                        "top_logprobs": [item(t, lp) for t, lp in top]})
    return {"content": content}


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def sse_event(payload: dict | str) -> str:
    """One Server-Sent Event: ``data: <payload>`` and a blank line.

    A dict is sent as one line of JSON; a string (the final ``[DONE]``) as it is.
    """
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Fold a backlog of one request's step outputs (oldest first) into one.

    The result is the newest output (its cumulative text, token ids, finish reason) whose
    completions carry the deltas of *all* the steps: nothing a client should see is lost
    when the front end falls behind the engine and sends one chunk for several steps.
    The inputs are not modified.
    """
    newest = outputs[-1]
    merged = []
    for i, completion in enumerate(newest.outputs):
        delta_text = "".join(out.outputs[i].delta_text for out in outputs)
        delta_token_ids = [t for out in outputs for t in out.outputs[i].delta_token_ids]
        merged.append(dataclasses.replace(completion, delta_text=delta_text,
                                          delta_token_ids=delta_token_ids))
    return dataclasses.replace(newest, outputs=merged)


@dataclass
class Job:
    """One HTTP request being served: what its response bodies and chunks need to know."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    model: str  # the served name, echoed in every body
    tokenizer: Tokenizer
    prompt_ids: list[list[int]]  # one engine request per prompt
    params: list[SamplingParams]
    num_logprobs: int | None = None  # top logprobs per token; None: no logprobs at all
    prompt_texts: list[str] = field(default_factory=list)  # for echo (completions)
    stream: bool = False
    include_usage: bool = False
    parse_tool_calls: bool = False  # chat with tools: <tool_call> blocks become tool_calls
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    echo_only: bool = False  # echo with max_tokens 0: the prompt only (its one token dropped)

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.n = self.params[0].n
        self.tool_streams: dict[int, ToolCallStream] = {}  # per choice index, when streaming

    def engine_requests(self) -> list[tuple[str, list[int], SamplingParams]]:
        """Prompt p is engine request "<id>-p"; its completion k is choice p * n + k (vLLM)."""
        return [(f"{self.id}-{p}", ids, params)
                for p, (ids, params) in enumerate(zip(self.prompt_ids, self.params))]

    def body(self, choices: list[dict], usage: dict | None = None, chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}
        return body if usage is None else {**body, "usage": usage}

    def choice(self, index: int, text: str, logprobs: dict | None, completion: CompletionOutput,
               delta: bool) -> dict:
        finish_reason, calls = completion.finish_reason, []
        if not self.chat:
            content = {"text": text}
        elif self.parse_tool_calls and delta:
            stream = self.tool_streams.setdefault(index, ToolCallStream())
            text, calls = stream.feed(text, final=finish_reason is not None)
            content = {"delta": {"content": text, **({"tool_calls": calls} if calls else {})}}
            calls = stream.calls
        elif self.parse_tool_calls:
            text, calls = parse_tool_calls(text)
            content = {"message": {"role": "assistant", "content": text, "tool_calls": calls}}
        elif delta:
            content = {"delta": {"content": text}}
        else:
            content = {"message": {"role": "assistant", "content": text}}
        if calls and finish_reason is not None:  # vLLM: a reply that calls tools says so
            finish_reason = "tool_calls"
        return {"index": index, **content, "logprobs": logprobs,
                "finish_reason": finish_reason, "stop_reason": completion.stop_reason}

    def logprobs(self, token_ids: list[int], entries: list | None, text_offset: int,
                 echo: RequestOutput | None = None) -> dict | None:
        """The logprobs object of ``token_ids``, the last tokens of a completion. With
        ``echo`` (the first chunk of an echoed completion) the prompt's tokens and prompt
        logprobs come first, from text offset 0, as vLLM sends them."""
        if self.num_logprobs is None or entries is None:
            return None
        entries = entries[len(entries) - len(token_ids):]
        if self.chat:
            return chat_logprobs(self.tokenizer, token_ids, entries, self.num_logprobs)
        if echo is not None and echo.prompt_logprobs is not None:
            token_ids, entries = echo.prompt_token_ids + token_ids, echo.prompt_logprobs + entries
            text_offset = 0
        return completion_logprobs(self.tokenizer, token_ids, entries, text_offset)

    def view(self, out: RequestOutput) -> RequestOutput:
        """What the client sees of an engine output: for echo_only, the completion dropped."""
        if not self.echo_only:
            return out
        empty = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not
                                     None else None, delta_text="", delta_token_ids=[])
                 for c in out.outputs]
        return dataclasses.replace(out, outputs=empty)

    def echo(self, prompt_index: int) -> str:
        return self.prompt_texts[prompt_index] if self.prompt_texts else ""

    def usage(self, outputs) -> dict:
        generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        return usage(sum(map(len, self.prompt_ids)), generated)

    def response(self, finals: list[RequestOutput]) -> dict:
        """The non-streaming body: every choice with its whole text, and usage."""
        choices = []
        finals = [self.view(out) for out in finals]
        for p, out in enumerate(finals):
            for c in out.outputs:
                prefix = self.echo(p)
                logprobs = self.logprobs(c.token_ids, c.logprobs, len(prefix),
                                         out if prefix else None)
                choices.append(self.choice(p * self.n + c.index, prefix + c.text, logprobs, c,
                                           delta=False))
        return self.body(choices, usage=self.usage(finals))


def encode(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
    """Token ids of a client's text; text that is not valid Unicode is a 400, not a 500."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpenAIError(f"{param} is not valid Unicode text: {e}", param=param) from None
    return tokenizer.encode(text)


def completion_job(body: CompletionRequest, tokenizer: Tokenizer, max_model_len: int,
                   model: str) -> Job:
    """Tokenize the prompts and check every field of a /v1/completions request."""
    prompts = body.prompts()
    prompt_ids = [encode(tokenizer, p, "prompt") if isinstance(p, str) else list(p)
                  for p in prompts]
    # echo + logprobs: the prompt's logprobs too; echo + max_tokens 0: the prompt alone (vLLM
    # runs it with max_tokens 1, for the prompt logprobs, and drops the token)
    echo_only = body.echo and body.max_tokens == 0
    prompt_logprobs = body.logprobs if body.echo else None
    params = [body.sampling_params(check_length(len(ids), 1 if echo_only else body.max_tokens,
                                                max_model_len), body.logprobs, prompt_logprobs)
              for ids in prompt_ids]
    texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if body.echo else []
    return Job(False, model, tokenizer, prompt_ids, params, body.logprobs, texts, body.stream,
               body.include_usage, echo_only=echo_only)


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                chat_template_kwargs: dict | None, tools: list[dict] | None = None) -> list[int]:
    """The prompt ids of a conversation (and its tools), through the model's chat template."""
    try:
        text = tokenizer.apply_chat_template(
            messages_for_template([m.for_template() for m in messages]), add_generation_prompt,
            tools=tools or None, **(chat_template_kwargs or {}))
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None
    return encode(tokenizer, text, "messages")


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or messages rendered through the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        if (self.prompt is None) == (self.messages is None):
            raise OpenAIError("give either prompt or messages", param="prompt")
        if self.prompt is not None:
            return encode(tokenizer, self.prompt, "prompt")
        return render_chat(tokenizer, self.messages, self.add_generation_prompt,
                           self.chat_template_kwargs)


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def chat_job(body: ChatCompletionRequest, tokenizer: Tokenizer, max_model_len: int,
             model: str) -> Job:
    """Render the messages through the chat template and check every field."""
    if not body.messages:
        raise OpenAIError("messages must not be empty", param="messages")
    try:
        tool_choice = check_tools(body.tools, body.tool_choice)
    except ValueError as e:
        raise OpenAIError(str(e), param="tools" if "tools[" in str(e) else "tool_choice") from None
    prompt_ids = render_chat(tokenizer, body.messages, body.add_generation_prompt,
                             body.chat_template_kwargs, body.tools)
    max_tokens = check_length(len(prompt_ids), body.requested_max_tokens(), max_model_len)
    num_logprobs = body.num_logprobs()
    forced = None  # "required" or a named function: a grammar that admits only tool calls
    if tool_choice not in (None, "none", "auto"):
        if body.structured_outputs_params() is not None:
            raise OpenAIError("tool_choice cannot be combined with an output constraint",
                              param="tool_choice")
        forced = tool_call_grammar(body.tools, tool_choice, body.parallel_tool_calls)
        try:
            compile_grammar(forced)
        except ValueError as e:
            raise OpenAIError(f"the tools' parameters: {e}", param="tools") from None
    params = body.sampling_params(max_tokens, num_logprobs, structured_outputs=forced)
    return Job(True, model, tokenizer, [prompt_ids], [params], num_logprobs, [], body.stream,
               body.include_usage, parse_tool_calls=tool_choice not in (None, "none"))
