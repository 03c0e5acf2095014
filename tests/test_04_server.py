"""Milestone 4: ``python -m minivllm.serve`` against the official ``openai`` client and httpx.

One real server process (module-scoped fixture) on a free loopback port, a small engine so
the file runs in well under a minute on two CPU cores. Every greedy output is compared with
the offline ``LLM`` run in this process with the same engine options.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

import minivllm
from minivllm import LLM, SamplingParams

MODEL = os.environ.get("MINIVLLM_MODEL", minivllm.TINY_MODEL)
NAME = "minivllm-tiny" if MODEL == minivllm.TINY_MODEL else MODEL
MAX_MODEL_LEN = 256
ENGINE = {"num_blocks": 96, "block_size": 16, "max_model_len": MAX_MODEL_LEN,
          "max_num_seqs": 16, "max_num_batched_tokens": 512}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "import os\nimport"]
CHAT = [{"role": "user", "content": "Write a haiku about tensors."}]
GREEDY = {"temperature": 0, "max_tokens": 8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli_options() -> list[str]:
    return [arg for key, value in ENGINE.items()
            for arg in (f"--{key.replace('_', '-')}", str(value))]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The server process and, loaded while it starts, the offline LLM with the same
    options. At the end the server must stop on SIGTERM with exit status 0."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "minivllm.serve", "--port", str(port), "--log-level",
           "info", *(["--model", MODEL] if MODEL != minivllm.TINY_MODEL else []),
           *_cli_options()]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    llm = LLM(MODEL, **ENGINE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"server exited early:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"server did not start:\n{log_path.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield url, llm
    proc.terminate()
    try:
        status = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    text = log_path.read_text()
    assert status == 0, f"server exited with {status} on SIGTERM:\n{text}"
    assert f"minivllm serving {NAME} on {url}" in text
    _assert_startup_log(text)


@pytest.fixture(scope="module")
def server(started) -> str:
    return started[0]


@pytest.fixture(scope="module")
def llm(started) -> LLM:
    return started[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def _expected(llm, prompts, **params) -> list[list[str]]:
    outs = llm.generate(prompts, SamplingParams(**params))
    return [[c.text for c in out.outputs] for out in outs]


def _stats(server) -> dict:
    return httpx.get(f"{server}/stats").json()


def test_health_and_models(server):
    assert httpx.get(f"{server}/health").status_code == 200
    models = httpx.get(f"{server}/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    card = models["data"][0]
    assert card["id"] == NAME and card["owned_by"] == "minivllm"
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert Path(card["root"]).resolve() == Path(MODEL).resolve()


def test_completions_match_offline(client, llm):
    """Two prompts in one request: choice i is prompt i, text equal to the offline LLM."""
    out = client.completions.create(model=NAME, prompt=PROMPTS[:2], **GREEDY)
    expected = _expected(llm, PROMPTS[:2], **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [e[0] for e in expected]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    prompt_tokens = sum(len(llm.get_tokenizer().encode(p)) for p in PROMPTS[:2])
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.total_tokens == prompt_tokens + out.usage.completion_tokens


def test_completions_stream_matches_offline(client, llm):
    """Streamed deltas concatenate to the offline text; usage comes last with no choices."""
    stream = client.completions.create(model=NAME, prompt=PROMPTS, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    texts, finish, chunks = ["", "", ""], [None] * 3, list(stream)
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [e[0] for e in _expected(llm, PROMPTS, **GREEDY)]
    assert all(f in ("stop", "length") for f in finish)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_token_id_prompts_and_n(client, llm):
    """Token-id prompts (one and several); n=2 maps choice p * n + k, as vLLM does."""
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    out = client.completions.create(model=NAME, prompt=ids[0], **GREEDY)
    expected = _expected(llm, [{"prompt_token_ids": i} for i in ids], n=2, **GREEDY)
    assert out.choices[0].text == expected[0][0]
    out = client.completions.create(model=NAME, prompt=ids, n=2, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [t for e in expected for t in e]


def test_stop_echo_and_logprobs(client, llm):
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    full = _expected(llm, PROMPTS[:1], **params)[0][0]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], stop=[stop],
                                    temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    assert out.choices[0].text == _expected(llm, PROMPTS[:1], stop=[stop], **params)[0][0]
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == stop
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], echo=True, **GREEDY)
    assert out.choices[0].text == PROMPTS[0] + _expected(llm, PROMPTS[:1], **GREEDY)[0][0]
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(len(top) >= 2 and max(top.values()) >= chosen - 1e-5
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_matches_offline(client, llm):
    """Chat through the chat template, whole and streamed (role first, then content)."""
    expected = llm.chat(CHAT, SamplingParams(**GREEDY))[0].outputs[0].text
    out = client.chat.completions.create(model=NAME, messages=CHAT, **GREEDY)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    chunks = list(client.chat.completions.create(
        model=NAME, messages=CHAT, stream=True, stream_options={"include_usage": True},
        max_completion_tokens=GREEDY["max_tokens"], temperature=0, logprobs=True,
        top_logprobs=2))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == expected
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == sum(
        len(c.choices[0].logprobs.content) for c in chunks[1:-1])


def test_concurrent_streams_are_batched(server, client, llm):
    """16 clients streaming at once all get the offline text, in far fewer engine steps
    than tokens: the engine thread really batched them."""
    prompts = [f"Story number {i}: once upon a time" for i in range(16)]
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    expected = [e[0] for e in _expected(llm, prompts, **params)]
    before = _stats(server)
    results: list[str | Exception] = [""] * 16
    start = threading.Barrier(16)

    def run(i: int) -> None:
        try:
            start.wait()
            for chunk in client.completions.create(model=NAME, prompt=prompts[i], stream=True,
                                              extra_body={"ignore_eos": True}, temperature=0,
                                              max_tokens=8):
                results[i] += chunk.choices[0].text if chunk.choices else ""
        except Exception as e:  # noqa: BLE001 -- reported by the assertion below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == expected
    after = _stats(server)
    assert after["max_batch_size"] > 1
    assert after["num_steps"] - before["num_steps"] < 16 * 8 // 2


BAD = {
    "negative max_tokens": ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    "temperature < 0": ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    "top_p = 0": ({"prompt": "hi", "top_p": 0}, "top_p"),
    "top_p > 1": ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    "n = 0": ({"prompt": "hi", "n": 0}, "n"),
    "logprobs > 20": ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    "min_p > 1": ({"prompt": "hi", "min_p": 2}, "min_p"),
    "wrong type": ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    "prompt not text": ({"prompt": {"text": "hi"}}, "prompt"),
    "empty prompt": ({"prompt": ""}, "prompt"),
    "empty prompt list": ({"prompt": []}, "prompt"),
    "prompt too long": ({"prompt": [100] * 300}, "300"),
    "prompt + max_tokens too long": ({"prompt": [100] * 250, "max_tokens": 10}, "260"),
    "token id outside the vocabulary": ({"prompt": [10**9]}, "token ids"),
    "presence_penalty > 2": ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    "unsupported suffix": ({"prompt": "hi", "suffix": "x"}, "suffix"),
    "chat: empty messages": ({"messages": []}, "messages"),
    "chat: messages not a list": ({"messages": "hi"}, "messages"),
    "chat: top_logprobs without logprobs": (
        {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    "stream_options without stream": (
        {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    "chat: stream_options with stream false": (
        {"messages": CHAT, "stream": False, "stream_options": {"include_usage": True}},
        "stream_options"),
    "chat: unknown role": ({"messages": [{"role": "usr", "content": "hi"}]}, "messages.0.role"),
}


def _assert_error(response: httpx.Response, status: int, needle: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and needle in error["message"] + str(error["param"])
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]


def _still_serving(server) -> None:
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_400(server, case):
    body, needle = BAD[case]
    endpoint = "chat/completions" if "messages" in body else "completions"
    _assert_error(httpx.post(f"{server}/v1/{endpoint}", json=body), 400, needle)
    _still_serving(server)


def test_malformed_json_unknown_model_and_fields(server):
    r = httpx.post(f"{server}/v1/completions", content=b'{"prompt": "hi", ',
                   headers={"content-type": "application/json"})
    _assert_error(r, 400, "JSON")
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "nope", "messages": CHAT})
    _assert_error(r, 404, "The model `nope` does not exist.")
    r = httpx.post(f"{server}/v1/completions",
                   json={"prompt": "hi", "max_tokens": 1, "user": "me", "whatever": [1]})
    assert r.status_code == 200  # unknown fields are ignored, as vLLM does
    _still_serving(server)


def test_dropped_stream_frees_every_block(server):
    """A client that goes away mid-stream gets its request aborted and its blocks freed."""
    body = {"prompt": "Once upon a time", "max_tokens": 230, "ignore_eos": True,
            "stream": True}
    before = _stats(server)
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(events)[len("data: "):])
        next(events)
        assert any(i.startswith(first["id"]) for i in _stats(server)["requests_in_flight"])
    deadline = time.monotonic() + 20
    while True:
        stats = _stats(server)
        gone = not any(i.startswith(first["id"]) for i in stats["requests_in_flight"])
        if gone and stats["num_free_blocks"] == stats["num_blocks"]:
            break
        assert time.monotonic() < deadline, f"blocks not freed: {stats}"
        time.sleep(0.05)
    assert stats["num_generated_tokens"] - before["num_generated_tokens"] < 230, "not aborted"
    _still_serving(server)


def test_cli_defaults_are_the_engine_config_defaults():
    """Guards: `python -m minivllm.serve` and `LLM()` running different engines because a
    flag restated a default that later changed (--attention-backend said 'loop' while
    EngineConfig said 'batched')."""
    import dataclasses

    from minivllm.config import EngineConfig
    from minivllm.server.cli import engine_config, parse_args

    args = parse_args([])
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        if f.name != "model":  # no --model means the bundled model, EngineConfig's default
            assert getattr(args, f.name) == getattr(defaults, f.name), f.name
    assert engine_config(args) == defaults
    assert engine_config(parse_args(["--no-prefix-caching"])).enable_prefix_caching is False
    assert engine_config(parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching is False


def test_engine_is_built_in_the_thread_that_steps_it(tiny_model):
    """Guards: the server loading the model in the main thread and stepping it in another,
    which leaves two OpenMP pools on the cores (libgomp then stops spinning: the bundled
    model decoded 30% slower); a loop that is not started from the frame room (a chunk of
    CPython's frame stack mapped and unmapped every step); and a failed load hanging
    start() instead of raising."""
    from frame_room import under_frame_room

    from minivllm.config import EngineConfig
    from minivllm.engine import LLMEngine
    from minivllm.server.engine_thread import AsyncEngine

    built_in, in_frame_room = [], []

    def build():
        built_in.append(threading.current_thread())
        # the engine thread's loop starts from notebook 03's frame room (call_with_frame_room)
        in_frame_room.append(under_frame_room())
        return LLMEngine(EngineConfig(model=str(tiny_model), num_blocks=64, max_model_len=128,
                                      compile=False))

    engine = AsyncEngine(build)
    engine.start()
    try:
        assert built_in == [engine._thread] and engine.is_alive and in_frame_room == [True]
        assert engine.max_model_len == 128 and engine.stats["num_free_blocks"] == 64
        engine.start()  # a second start (the app's lifespan) changes nothing
        assert built_in == [engine._thread]
    finally:
        engine.shutdown()
    broken = AsyncEngine(lambda: LLMEngine(EngineConfig(model="/nonexistent/checkpoint")))
    with pytest.raises(FileNotFoundError):
        broken.start()


def test_an_idle_engine_takes_a_burst_of_requests_in_one_step(tiny_model):
    """Guards: an idle engine stepping on the first request of a burst (a closed-loop
    client's next wave), so the rest wait a whole extra prefill step for their first token.
    The gap is made generous here, so the test does not depend on the machine's speed."""
    from minivllm.config import EngineConfig
    from minivllm.engine import LLMEngine
    from minivllm.server.engine_thread import AsyncEngine

    engine = AsyncEngine(lambda: LLMEngine(EngineConfig(
        model=str(tiny_model), num_blocks=64, max_model_len=128, compile=False)),
        burst_gap_s=0.5, burst_window_s=5.0)
    engine.start()
    waiting_at_step: list[int] = []
    real_step = engine.engine.step

    def step():
        waiting_at_step.append(len(engine.engine.scheduler.waiting))
        return real_step()

    engine.engine.step = step  # the engine thread's next steps go through here
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def burst() -> None:
        submissions = await asyncio.gather(*(
            engine.submit([(f"burst-{i}", [5 + i, 6, 7, 8], params)]) for i in range(6)))
        for submission in submissions:
            async for _ in submission.updates():
                pass

    try:
        asyncio.run(burst())
    finally:
        engine.shutdown()
    assert waiting_at_step[0] == 6  # all six prefilled in the first step
    assert len(waiting_at_step) == 3  # and decoded together: 3 tokens, 3 steps


def test_an_idle_engine_gives_its_freed_memory_back(tiny_model, monkeypatch):
    """Guards: a server holding its busiest step's heap for as long as it runs (glibc keeps
    what the steps freed). Idle for release_after_idle_s, the engine thread trims once per
    idle spell; never while it steps; never with None."""
    from minivllm.config import EngineConfig
    from minivllm.engine import LLMEngine
    from minivllm.server import engine_thread

    trims: list[float] = []
    monkeypatch.setattr(engine_thread, "release_freed_memory", lambda: trims.append(time.monotonic()))

    def build():
        return LLMEngine(EngineConfig(model=str(tiny_model), num_blocks=64, max_model_len=128,
                                      compile=False))

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 30
        while len(trims) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    engine = engine_thread.AsyncEngine(build, release_after_idle_s=0.1)
    engine.start()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    step_times: list[float] = []  # when each step began and ended, on the engine thread
    real_step = engine.engine.step

    def step():
        step_times.append(time.monotonic())
        try:
            return real_step()
        finally:
            step_times.append(time.monotonic())

    engine.engine.step = step  # the engine thread's next steps go through here

    async def one_request() -> None:
        submission = await engine.submit([("idle-0", [5, 6, 7, 8], params)])
        async for _ in submission.updates():
            pass

    try:
        wait_for(1)  # idle since it started: one trim
        time.sleep(0.5)  # five more idle timeouts' worth: still one (once per idle spell)
        assert len(trims) == 1
        asyncio.run(one_request())
        first, last = step_times[0], step_times[-1]
        assert all(not first <= t <= last for t in trims)  # 24 steps back to back: no trim
        wait_for(2)  # idle again after the request: one more
        time.sleep(0.5)
        assert len(trims) == 2
    finally:
        engine.shutdown()
    never = engine_thread.AsyncEngine(build, release_after_idle_s=None)
    never.start()
    try:
        time.sleep(0.5)
    finally:
        never.shutdown()
    assert len(trims) == 2


def test_tokenize_detokenize_and_version(server):
    """Guards: vLLM's /tokenize, /detokenize and /version missing (clients count prompt tokens
    and check a server's version through them), or counting a chat prompt differently from
    what /v1/chat/completions bills."""
    from minivllm.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(MODEL)
    r = httpx.post(f"{server}/tokenize", json={"model": NAME, "prompt": PROMPTS[1]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(PROMPTS[1]) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    chat = httpx.post(f"{server}/tokenize", json={"messages": CHAT}).json()
    billed = httpx.post(f"{server}/v1/chat/completions",
                        json={"messages": CHAT, **GREEDY}).json()["usage"]["prompt_tokens"]
    assert chat["count"] == billed == len(chat["tokens"])
    back = httpx.post(f"{server}/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": PROMPTS[1]}
    assert httpx.get(f"{server}/version").json() == {"version": minivllm.__version__}
    _assert_error(httpx.post(f"{server}/tokenize", json={}), 400, "prompt or messages")
    _assert_error(httpx.post(f"{server}/tokenize", json={"prompt": "a", "messages": CHAT}), 400,
                  "prompt or messages")
    _assert_error(httpx.post(f"{server}/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    _assert_error(httpx.post(f"{server}/tokenize", json={"model": "nope", "prompt": "a"}), 404,
                  "nope")
    _still_serving(server)


def _assert_startup_log(text: str) -> None:
    """Guards: a start-up that prints nothing for a minute (the compile warm-up), and no
    record of finished requests: one line per stage, in the server's log format, and the
    request log."""
    lines = text.splitlines()

    def line(fragment: str) -> str:
        hits = [x for x in lines if fragment in x]
        assert hits, f"no log line with {fragment!r}:\n{text[:3000]}"
        return hits[0]

    assert " in float32 (" in line("minivllm.engine: model ")  # path, device, dtype and why
    assert "GiB in" in line("minivllm.engine: loaded the weights: ")
    kv = line("minivllm.engine: KV cache: ")
    assert f"{ENGINE['num_blocks']} blocks of {ENGINE['block_size']} tokens" in kv
    assert f"max_model_len {MAX_MODEL_LEN}" in kv
    if os.environ.get("MINIVLLM_COMPILE", "1") != "0":  # the suite runs eager (conftest.py);
        assert line("minivllm.compile: compile warm-up: batch 1")  # test_07 checks these
        assert line("minivllm.compile: compiled the decode step in ")
    done = line("minivllm.server: request ")
    assert "prompt " in done and "ttft " in done and "finish " in done


def _metrics(server) -> dict[tuple[str, tuple], float]:
    """The /metrics page parsed by prometheus_client: {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{server}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def _metric(page: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted({"model_name": NAME, **labels}.items())))
    return page.get(key, 0.0)


def _wait_idle(server) -> dict:
    deadline = time.monotonic() + 30
    while (stats := _stats(server))["num_requests_in_flight"] or stats["num_running"]:
        assert time.monotonic() < deadline, f"server not idle: {stats}"
        time.sleep(0.05)
    return stats


def test_metrics_agree_with_what_was_served(server, client):
    """Guards: /metrics missing or drifting from the responses: the token counters must add
    up the usage fields, finishes counted by reason, one latency sample per request."""
    _wait_idle(server)
    before = _metrics(server)
    usages, reasons, num_requests = [], [], 0
    out = client.completions.create(model=NAME, prompt=PROMPTS[:2], **GREEDY)  # 2 requests
    usages.append(out.usage)
    reasons += [c.finish_reason for c in out.choices]
    num_requests += 2
    chat = client.chat.completions.create(model=NAME, messages=CHAT, n=2, temperature=1.0,
                                          seed=3, max_tokens=6)
    usages.append(chat.usage)
    reasons += [c.finish_reason for c in chat.choices]
    num_requests += 1
    stream = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=12,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    usages.append(chunks[-1].usage)
    reasons += [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    num_requests += 1
    _wait_idle(server)
    after = _metrics(server)

    def delta(name: str, **labels) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    for reason in set(reasons):
        assert delta("vllm:request_success_total", finished_reason=reason) == reasons.count(reason)
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds"):
        assert delta(f"{histogram}_count") == num_requests, histogram
        assert delta(f"{histogram}_sum") > 0, histogram
    generated_steps = sum(u.completion_tokens for u in usages)  # n=2: 2 tokens per chat step
    assert 0 < delta("vllm:inter_token_latency_seconds_count") < generated_steps
    assert _metric(after, "vllm:num_requests_running") == 0
    assert _metric(after, "vllm:num_requests_waiting") == 0
    assert 0.0 <= _metric(after, "vllm:kv_cache_usage_perc") <= 1.0


def test_metrics_prefix_cache_and_gauges(server, client):
    """Guards: the prefix-cache counters and the state gauges not following the engine: a
    repeated prompt is a hit of its full blocks; a running stream shows in the gauges."""
    stats = _wait_idle(server)
    before = _metrics(server)
    prompt = " ".join(["tensor"] * 70)  # several full blocks of 16 tokens
    for _ in range(2):
        client.completions.create(model=NAME, prompt=prompt, **GREEDY)
    _wait_idle(server)
    after = _metrics(server)
    num_prompt = len(httpx.post(f"{server}/tokenize", json={"prompt": prompt}).json()["tokens"])
    queries = (_metric(after, "vllm:prefix_cache_queries_total")
               - _metric(before, "vllm:prefix_cache_queries_total"))
    hits = (_metric(after, "vllm:prefix_cache_hits_total")
            - _metric(before, "vllm:prefix_cache_hits_total"))
    assert queries == 2 * num_prompt
    assert hits >= (num_prompt - 1) // ENGINE["block_size"] * ENGINE["block_size"] > 0
    assert _metric(after, "vllm:prefix_cache_hits_total") == _stats(server)[
        "num_prefix_cached_tokens"]
    assert _metric(after, "vllm:num_preemptions_total") == stats["num_preemptions"]
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        next(events)
        running = _metrics(server)
    assert _metric(running, "vllm:num_requests_running") == 1
    assert _metric(running, "vllm:kv_cache_usage_perc") > 0
    _wait_idle(server)
    ended = _metrics(server)
    assert (_metric(ended, "vllm:request_success_total", finished_reason="abort")
            - _metric(running, "vllm:request_success_total", finished_reason="abort")) == 1
    _still_serving(server)


def test_metrics_need_no_api_key_but_v1_does(tiny_model):
    """Guards: --api-key locking Prometheus out (vLLM guards only /v1/*), or leaving /v1 open."""
    from starlette.testclient import TestClient

    from minivllm.config import EngineConfig
    from minivllm.engine import LLMEngine
    from minivllm.server.app import build_app
    from minivllm.server.engine_thread import AsyncEngine
    from minivllm.server.guard import ServerOptions

    engine = AsyncEngine(lambda: LLMEngine(EngineConfig(
        model=str(tiny_model), num_blocks=32, max_model_len=128, compile=False)))
    engine.start()  # as `main` does: the app reads the model's path and length from it
    app = build_app(engine, ["m"], options=ServerOptions(api_key="sekret"))
    with TestClient(app) as http:
        assert http.get("/metrics").status_code == 200
        page = http.get("/metrics").text
        assert "vllm:num_requests_running" in page
        assert "vllm:spec_decode_num_draft_tokens_total" in page  # Milestone 8's counters
        assert http.get("/v1/models").status_code == 401
        ok = http.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
