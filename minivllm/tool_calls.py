# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Tool calls: OpenAI's ``tools`` / ``tool_choice`` on top of the chat template and a grammar.

Built in notebook 04_openai_server. The model sees the tools through its own chat template
(Qwen2.5's lists them in the system prompt and asks for calls in Hermes' format), and writes

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

which the server parses into OpenAI ``tool_calls``, as vLLM's ``hermes`` parser does:
``tool_choice="auto"`` parses whatever the model wrote; ``"required"`` and a named function
constrain the output with a grammar (``minivllm/structured.py``), so that even a model that
never learnt the format returns a well-formed call whose arguments match the function's
``parameters`` schema; ``"none"`` parses nothing.
"""

from __future__ import annotations

import json
import uuid

from minivllm.sampling import StructuredOutputsParams
from minivllm.structured import COMPACT_JSON

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


def check_tools(tools: list[dict] | None, tool_choice) -> str | None:
    """Validate ``tools`` and ``tool_choice``; return the effective choice: "none", "auto",
    "required", the name of the forced function, or None without tools. ValueError says why."""
    names = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function" or \
                not isinstance(function.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"parameters\": {...}}}")
        if not isinstance(function.get("parameters", {}), dict):  # a 400, like the rest
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")  # noqa: TRY004
        names.append(function["name"])
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        return name
    if tool_choice not in (None, "none", "auto", "required"):
        raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, '
                         f"got {tool_choice!r}")
    if tool_choice == "required" and not names:
        raise ValueError('tool_choice "required" needs at least one tool in tools')
    if not names:
        return None
    return tool_choice or "auto"


def tool_call_grammar(tools: list[dict], choice: str, parallel: bool = True) -> StructuredOutputsParams:
    """A grammar that only admits Hermes tool calls of ``tools`` (choice "required": any of
    them, one or more when ``parallel``; otherwise the function named ``choice``, once)."""
    def call_schema(function: dict) -> dict:
        return {"type": "object", "x-guidance": COMPACT_JSON,
                "properties": {"name": {"const": function["name"]},
                               "arguments": function.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}

    functions = [t["function"] for t in tools
                 if choice == "required" or t["function"]["name"] == choice]
    rules = [f"fn{i}: %json {json.dumps(call_schema(f))}" for i, f in enumerate(functions)]
    call = " | ".join(f"fn{i}" for i in range(len(functions)))
    start = 'start: call ("\\n" call)*' if parallel and choice == "required" else "start: call"
    lark = "\n".join([start, f'call: "{TOOL_CALL_START}\\n" ({call}) "\\n{TOOL_CALL_END}"',
                      *rules])
    return StructuredOutputsParams(grammar=lark)


def _openai_call(body: str) -> dict | None:
    """One ``{"name": ..., "arguments": {...}}`` block as an OpenAI tool call; None if it is
    not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": call["name"],
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole completion -> (content, tool calls), as vLLM's hermes parser: the content is
    the text before the first ``<tool_call>`` (None when blank); every closed block is one
    call. If a block is not a call, there are no calls and the whole text is the content."""
    if TOOL_CALL_START not in text:
        return text, []
    content, rest = text.split(TOOL_CALL_START, 1)
    calls = []
    for block in rest.split(TOOL_CALL_START):
        body, closed, _ = block.partition(TOOL_CALL_END)
        call = _openai_call(body) if closed else None
        if call is None:
            return text, []
        calls.append(call)
    return content if content.strip() else None, calls


class ToolCallStream:
    """The streaming side of ``parse_tool_calls``, for one choice: ``feed`` text deltas, get
    (content delta, tool call deltas). Text that may be the start of ``<tool_call>`` is held
    back; a call is sent whole (id, name and arguments in one delta) once its block closes."""

    def __init__(self) -> None:
        self.buffer = ""
        self.inside = False  # within a <tool_call> block
        self.calls: list[dict] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if not self.inside:
                start = self.buffer.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, TOOL_CALL_START)
                    emit = self.buffer[:len(self.buffer) - keep]
                    if not self.calls:  # after the first call, text between calls is dropped
                        content += emit
                    self.buffer = self.buffer[len(emit):]
                    return content, deltas
                if not self.calls:
                    content += self.buffer[:start]
                self.buffer, self.inside = self.buffer[start + len(TOOL_CALL_START):], True
            end = self.buffer.find(TOOL_CALL_END)
            if end < 0:
                if final:  # an unclosed block (cut by max_tokens): plain text after all
                    content += TOOL_CALL_START + self.buffer
                    self.buffer = ""
                return content, deltas
            call = _openai_call(self.buffer[:end])
            if call is None:
                content += TOOL_CALL_START + self.buffer[:end + len(TOOL_CALL_END)]
            else:
                deltas.append({"index": len(self.calls), **call})
                self.calls.append(call)
            self.buffer, self.inside = self.buffer[end + len(TOOL_CALL_END):], False


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``token``."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def messages_for_template(messages: list[dict]) -> list[dict]:
    """OpenAI sends a past call's arguments as a JSON string; templates such as Qwen2.5's
    write them with ``| tojson``, which would quote the string again. Decode them (vLLM does
    the same); arguments that are not JSON stay as they are. A calling turn without content
    gets "" (Qwen2.5's template skips it; a template without tools still renders the turn)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls:
            message = {"content": "", **message, "tool_calls": [_decoded(c) for c in calls]}
        out.append(message)
    return out


def _decoded(call: dict) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function = {**function, "arguments": json.loads(arguments)}
        except ValueError:
            pass
    return {**call, "function": function}
