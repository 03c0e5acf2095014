"""Tool calls without a model: the Hermes parser (whole and streamed), the forcing grammar, and
tools / tool results through Qwen2.5-Instruct's real chat template."""

from __future__ import annotations

import json

import llguidance
import pytest

import minivllm
from minivllm.structured import compile_grammar
from minivllm.tokenizer import Tokenizer
from minivllm.tool_calls import (
    ToolCallStream,
    check_tools,
    messages_for_template,
    parse_tool_calls,
    tool_call_grammar,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _summary(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_whole_completion():
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content == "Let me check.\n"
    assert _summary(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')[0] is None
    broken = "<tool_call>\n{not json}\n</tool_call>"  # not a call: the text is the content
    assert parse_tool_calls(broken) == (broken, [])
    cut = '<tool_call>\n{"name": "f", "argu'  # cut by max_tokens
    assert parse_tool_calls(cut) == (cut, [])


@pytest.mark.parametrize("step", [1, 2, 5, 11, 1000])
def test_streamed_deltas_add_up_to_the_whole_parse(step):
    """Fed in pieces of any size (a piece may split '<tool_call>'), the stream sends the same
    content and calls as the whole parse, each call whole in one delta with its index."""
    stream, content, deltas = ToolCallStream(), "", []
    pieces = [TWO_CALLS[i:i + step] for i in range(0, len(TWO_CALLS), step)]
    for k, piece in enumerate(pieces):
        text, new = stream.feed(piece, final=k == len(pieces) - 1)
        content += text
        deltas += new
    assert content == "Let me check.\n"
    assert [d["index"] for d in deltas] == [0, 1]
    assert _summary(deltas) == _summary(parse_tool_calls(TWO_CALLS)[1])


def test_stream_holds_back_only_a_possible_tag():
    stream = ToolCallStream()
    assert stream.feed("a < b <tool") == ("a < b ", [])
    assert stream.feed("kit", final=True) == ("<toolkit", [])
    stream = ToolCallStream()
    assert stream.feed('<tool_call>\n{"name": "f"', final=True) == ('<tool_call>\n{"name": "f"',
                                                                   [])


def test_check_tools():
    assert check_tools(None, None) is None
    assert check_tools([WEATHER], None) == "auto"
    assert check_tools([WEATHER], "none") == "none"
    assert check_tools([WEATHER, TIME], {"type": "function",
                                         "function": {"name": "get_time"}}) == "get_time"
    for tools, choice, needle in [([WEATHER], {"type": "function", "function": {"name": "x"}},
                                   "not in tools"),
                                  ([], "required", "at least one"),
                                  ([{"type": "function"}], None, "tools[0]"),
                                  (["get_weather"], None, "tools[0]"),
                                  ([WEATHER], "always", "always")]:
        with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
            check_tools(tools, choice)


def test_forcing_grammar_admits_exactly_hermes_calls():
    """The grammar of "required" / a named function accepts a well-formed call of an offered
    function and rejects other names, bad arguments and free text."""
    tok = Tokenizer.from_pretrained(minivllm.TINY_MODEL)
    ll_tok = llguidance.LLTokenizer(tok.to_str())

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        return m.consume_tokens(tok.encode(text)) and m.is_accepting()

    named = compile_grammar(tool_call_grammar([WEATHER, TIME], "get_weather"))
    required = compile_grammar(tool_call_grammar([WEATHER, TIME], "required"))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(named, call) and not accepts(named, other)
    assert accepts(required, call) and accepts(required, other)
    assert accepts(required, call + "\n" + other)  # parallel calls
    assert not accepts(named, call.replace('"Rome"', "3"))  # arguments break the schema
    assert not accepts(required, "Sure! " + call)
    single = compile_grammar(tool_call_grammar([WEATHER, TIME], "required", parallel=False))
    assert accepts(single, call) and not accepts(single, call + "\n" + other)


def test_tools_and_results_through_qwen25_template(qwen25_tokenizer_dir):
    """Qwen2.5's own template lists the tools in the system prompt, writes a past call as a
    <tool_call> block (arguments decoded from OpenAI's JSON string, not quoted twice) and a
    tool result as a <tool_response> in a user turn."""
    tok = Tokenizer.from_pretrained(qwen25_tokenizer_dir)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    text = tok.apply_chat_template(messages_for_template(messages), tools=[WEATHER])
    assert "# Tools" in text and json.dumps(WEATHER) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert tok.token_to_id("<tool_call>") in ids  # Qwen2.5's added token, one id


def test_offline_chat_with_a_forced_call(tiny_model, tmp_path):
    """Offline, as vLLM's ``LLM.chat(..., tools=...)``: the bundled model with Qwen2.5's
    template and the forcing grammar writes a call that parses and matches the schema."""
    import shutil

    import jsonschema

    from minivllm import LLM, SamplingParams
    from minivllm.course.random_weights import QWEN25_CHAT_TEMPLATE

    for f in tiny_model.iterdir():
        shutil.copyfile(f, tmp_path / f.name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": QWEN25_CHAT_TEMPLATE}))
    llm = LLM(str(tmp_path), max_model_len=512, num_blocks=40, compile=False)
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=tool_call_grammar([WEATHER], "get_weather"))
    out = llm.chat([{"role": "user", "content": "Weather in Oslo?"}], params, use_tqdm=False,
                   tools=[WEATHER])[0]
    assert "# Tools" in llm.get_tokenizer().decode(out.prompt_token_ids)
    content, calls = parse_tool_calls(out.outputs[0].text)
    assert out.outputs[0].finish_reason == "stop" and content is None and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
