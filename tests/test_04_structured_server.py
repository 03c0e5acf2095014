"""Structured outputs and tool calls through the server, with the official ``openai`` client.

One server in this process (uvicorn in a thread, eager engine) on the bundled tiny model,
whose checkpoint copy here carries Qwen2.5-Instruct's chat template (the bundled one has no
tools section): the tools reach the prompt as they would for Qwen2.5, and the tiny model —
which never saw a tool call or JSON — must still answer in the shape asked for.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import httpx
import jsonschema
import openai
import pytest
import uvicorn

from minivllm.config import EngineConfig
from minivllm.course.random_weights import QWEN25_CHAT_TEMPLATE
from minivllm.engine import LLMEngine
from minivllm.server.app import build_app
from minivllm.server.engine_thread import AsyncEngine
from minivllm.tokenizer import Tokenizer
from minivllm.tool_calls import messages_for_template

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "pets": {"type": "array", "maxItems": 2,
                            "items": {"enum": ["cat", "dog", "fish"]}}},
    "required": ["name", "age", "pets"], "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    """The bundled checkpoint with Qwen2.5-Instruct's tool-calling chat template."""
    out = tmp_path_factory.mktemp("tiny-with-tools-template")
    for f in tiny_model.iterdir():
        shutil.copyfile(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN25_CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    config = EngineConfig(model=str(model_dir), max_model_len=768, num_blocks=160,
                          max_num_seqs=8, compile=False)
    engine = AsyncEngine(lambda: LLMEngine(config))
    engine.start()  # builds the engine in the thread that steps it, as serve.main does
    app = build_app(engine, ["tiny"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield url
    uv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _stream_text(stream) -> tuple[str, str]:
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text += (delta.content or "") if delta is not None else choice.text
            finish = choice.finish_reason or finish
    return text, finish


def test_unconstrained_reply_is_not_json(client):
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40,
                                           temperature=0).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(reply)


def test_response_format_json_schema_on_chat(client):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    params = {"model": "tiny", "messages": CHAT, "max_tokens": 120,
              "response_format": response_format}
    out = client.chat.completions.create(**params, temperature=0, n=2)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    text, finish = _stream_text(client.chat.completions.create(**params, temperature=0.9, seed=4,
                                                               stream=True))
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_vllm_extras_on_completions(client):
    """response_format and vLLM's guided_* / structured_outputs on /v1/completions (extra
    fields, as the openai client sends them), streamed and not."""
    prompt = "def main():\n"
    base = {"model": "tiny", "prompt": prompt, "max_tokens": 100, "temperature": 0}
    cases = [
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"guided_regex": r"[A-Z]{2}-[0-9]{3}"}, lambda t: _fullmatch(r"[A-Z]{2}-[0-9]{3}", t)),
        ({"guided_choice": ["left", "right"]}, lambda t: _in(t, ["left", "right"])),
        ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: _in(t, ["yes!", "no!"])),
        ({"structured_outputs": {"grammar": 'start: "x" /[0-9]/'}},
         lambda t: _fullmatch(r"x[0-9]", t)),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": PERSON}}},
         lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ]
    for extra, check in cases:
        choice = client.completions.create(**base, extra_body=extra).choices[0]
        assert choice.finish_reason == "stop", (extra, choice.text)
        check(choice.text)
        text, finish = _stream_text(client.completions.create(**base, extra_body=extra,
                                                              stream=True))
        assert finish == "stop" and text == choice.text
    out = client.completions.create(**{**base, "max_tokens": 150, "temperature": 1.0, "seed": 2},
                                    extra_body={"response_format": {"type": "json_object"}})
    text = out.choices[0].text
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def _fullmatch(pattern: str, text: str) -> None:
    import re

    assert re.fullmatch(pattern, text), text


def _in(text: str, options: list[str]) -> None:
    assert text in options, text


@pytest.mark.parametrize("extra, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}},
     "bogus"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "yaml"}}, "yaml"),
    ({"guided_regex": "a(b"}, "unclosed group"),
    ({"guided_json": "{nope"}, "not valid JSON"),
    ({"guided_choice": []}, "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "one output constraint"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "exactly one"),
    ({"structured_outputs": {"jsn": {}}}, "jsn"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "at least one tool"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "sometimes"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "bogus"}}}}}], "tool_choice": "required"},
     "bogus"),
])
def test_invalid_constraints_are_400s_that_say_why(client, extra, needle):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,
                                       extra_body=extra)
    assert needle in str(err.value)


def _arguments_valid(call, tool: dict) -> None:
    assert call.type == "function" and call.id
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_and_required_tool_choice_return_valid_calls(client):
    params = {"model": "tiny", "messages": CHAT, "tools": [WEATHER, TIME], "max_tokens": 120,
              "temperature": 0}
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(**params, tool_choice=named).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    assert len(out.message.tool_calls) == 1
    _arguments_valid(out.message.tool_calls[0], WEATHER)

    out = client.chat.completions.create(**params, tool_choice="required",
                                         parallel_tool_calls=False).choices[0]
    assert out.finish_reason == "tool_calls" and len(out.message.tool_calls) == 1
    call = out.message.tool_calls[0]
    _arguments_valid(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])

    # streamed: the call arrives as a delta (id, name, arguments), finish_reason tool_calls
    chunks = list(client.chat.completions.create(**params, tool_choice=named, stream=True))
    deltas = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    _arguments_valid(deltas[0], WEATHER)
    assert not "".join(ch.delta.content or "" for c in chunks for ch in c.choices).strip()


def test_auto_and_none_parse_or_leave_the_text(client):
    """"auto" parses what the model wrote (the tiny model writes no call: plain content);
    "none" never parses."""
    params = {"model": "tiny", "messages": CHAT, "tools": [WEATHER], "max_tokens": 24,
              "temperature": 0}
    auto = client.chat.completions.create(**params, tool_choice="auto").choices[0]
    none = client.chat.completions.create(**params, tool_choice="none").choices[0]
    assert not auto.message.tool_calls and not none.message.tool_calls
    assert auto.message.content == none.message.content
    assert auto.finish_reason in ("stop", "length")


def test_tool_results_round_trip_through_the_template(client, model_dir):
    """An assistant turn that called a tool (arguments as OpenAI sends them: a JSON string)
    and the tool's result render through the template exactly as the offline tokenizer
    renders them; the reply then calls the tool again under a named choice."""
    first = client.chat.completions.create(
        model="tiny", messages=CHAT, tools=[WEATHER], max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    call = first.message.tool_calls[0]
    messages = [*CHAT,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                         max_tokens=8, temperature=0, tool_choice="none")
    tok = Tokenizer.from_pretrained(model_dir)
    rendered = tok.apply_chat_template(messages_for_template(messages), tools=[WEATHER])
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in rendered
    assert f'"arguments": {call.function.arguments}' in rendered  # not quoted twice
    assert out.usage.prompt_tokens == len(tok.encode(rendered))
