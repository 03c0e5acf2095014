"""Issue 9: the server under load, faults and hostile input, with nothing lost.

Two real server processes on free loopback ports, started together while the offline
reference runs in this process:

* ``main``: a small KV pool (requests wait for blocks), an API key, tight request limits,
  and the test-only fault hook (``MINIVLLM_FAULT_INJECT``: a prompt holding a point's marker
  fails at that point of the engine step: the model call, sampling its row, its stop check,
  detokenizing it, NaN logits);
* ``narrow``: one sequence at a time and ``--max-waiting-requests 2``, for back-pressure
  and for SIGTERM (drain, 503 for newcomers, exit 0), with the test-only hold hook
  (``MINIVLLM_TEST_HOLD_FILE``: while the file exists the engine steps nothing), so the
  test holds it at a known point instead of racing it.

The long soak is ``python bench/load_test.py --requests 1000 --concurrency 64 --rounds 2``;
here the same functions run one small round.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.server.cli import parse_args

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import load_test as lt  # bench/ is not a package

KEY = "test-key-9"
AUTH = {"Authorization": f"Bearer {KEY}"}
MARKER = "POISON-PILL-9"  # the model call
POINT_MARKERS = {"model": MARKER, "sample": "SAMPLE-PILL-9", "stop": "STOP-PILL-9",
                 "detokenize": "DETOK-PILL-9", "nan": "NAN-PILL-9"}
FAULTS = ",".join(f"{point}:{marker}" for point, marker in POINT_MARKERS.items())
MAX_BODY = 64 * 1024
MAIN_ARGS = ("--api-key", KEY, "--max-n", "4", "--max-prompts-per-request", "8",
             "--max-body-bytes", str(MAX_BODY))
NARROW = {**lt.ENGINE, "max_num_seqs": 1}
SPECS = lt.workload(120, seed=9)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers")
    main = lt.Server(lt.ENGINE, MAIN_ARGS, {"MINIVLLM_FAULT_INJECT": FAULTS},
                     logs / "main.log").start()
    hold = logs / "hold"
    narrow = lt.Server(NARROW, ("--max-waiting-requests", "2", "--drain-timeout", "60"),
                       {"MINIVLLM_TEST_HOLD_FILE": str(hold)}, logs / "narrow.log").start()
    try:
        expected = lt.expected_outputs(SPECS)  # while both servers load
        main.wait_ready()
        narrow.wait_ready()
        yield {"main": main, "narrow": narrow, "expected": expected, "hold": hold}
    finally:
        status = main.stop()
        narrow.stop()
    assert status == 0, f"main server exited with {status}:\n{main.log()}"


@pytest.fixture(scope="module")
def main(servers) -> lt.Server:
    return servers["main"]


@pytest.fixture(scope="module")
def expected(servers) -> dict[int, str]:
    return servers["expected"]


def _post(server: lt.Server, path: str, body, headers=AUTH, timeout=60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def _assert_error(r: httpx.Response, status: int, needle: str = "") -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert needle in error["message"] + str(error["param"]), error


def _assert_idle(server: lt.Server) -> dict:
    stats = lt.wait_idle(server.url)
    assert stats["num_requests_in_flight"] == 0 and stats["num_waiting"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    return stats


def _still_serving(server: lt.Server) -> None:
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


# ----------------------------------------------------------------------------------- load


def test_load_round_matches_offline_and_returns_every_block(main, expected):
    """120 requests at concurrency 32 (chat and completions, streamed and not): none fails,
    each deterministic one equals the offline LLM, every block comes back."""
    reports = lt.load_test(main.url, len(SPECS), 32, 1, expected, SPECS, main, AUTH,
                           log=lambda *_: None)
    report = reports[0]
    assert report.failures == [], "\n".join(report.failures[:10])
    assert report.compared == len(expected) >= 0.8 * len(SPECS)
    assert report.blocks_back, report.stats
    assert report.stats["max_batch_size"] > 1


def test_listens_on_loopback_by_default(main):
    assert parse_args([]).host == "127.0.0.1"
    listening = [c.laddr for c in psutil.Process(main.proc.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening


# ---------------------------------------------------------------------------------- faults


def test_random_point_disconnects_free_everything(main):
    """Clients that leave mid-stream (after 0..6 events) or before a non-streamed answer:
    aborted, blocks freed, the server keeps serving."""
    rng = random.Random(9)

    def streamer(i: int) -> None:
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", main.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=60) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(rng.randint(0, 6)):
                next(events)

    def impatient(i: int) -> None:
        body = {"prompt": f"Essay {i}:", "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            _post(main, "/v1/completions", body, timeout=rng.uniform(0.05, 0.5))

    threads = [threading.Thread(target=streamer if i % 3 else impatient, args=(i,))
               for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stats = _assert_idle(main)
    assert stats["num_generated_tokens"] > 0
    _still_serving(main)


def test_injected_engine_fault_fails_alone(main, expected):
    """A request whose processing fails inside the engine thread — at the model call, while
    sampling its row, checking its stops, detokenizing, or with NaN logits — gets an error
    (500 body, or an SSE error event) while the requests batched with it all complete
    exactly as in a clean run, and every block comes back."""
    good = [s for s in SPECS if s.index in expected][:10]

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [lt.send(client, main.url, s, AUTH) for s in good]
            bad = []
            for marker in POINT_MARKERS.values():
                bad.append(client.post(main.url + "/v1/completions", headers=AUTH, json={
                    "prompt": f"{marker} and more", "max_tokens": 30, "ignore_eos": True}))
                bad.append(client.post(main.url + "/v1/chat/completions", headers=AUTH, json={
                    "messages": [{"role": "user", "content": marker}], "max_tokens": 5,
                    "stream": True}))
            return await asyncio.gather(*bad, *tasks)

    results = asyncio.run(run())
    bad, results = results[:2 * len(POINT_MARKERS)], results[2 * len(POINT_MARKERS):]
    for point, plain, stream in zip(POINT_MARKERS, bad[::2], bad[1::2]):
        why = "NaN or infinite" if point == "nan" else "injected fault"
        _assert_error(plain, 500, why)
        assert plain.json()["error"]["type"] == "InternalServerError"
        events = [line[len("data: "):] for line in stream.text.splitlines()
                  if line.startswith("data: ")]
        assert any(why in e for e in events) and events[-1] == "[DONE]", (point, events)
    assert lt.compare(results, expected) == []
    _assert_idle(main)
    _still_serving(main)


def test_waiting_bound_and_sigterm_drain(servers):
    """--max-waiting-requests 2 with one running sequence: the 4th concurrent request gets a
    503. Then SIGTERM: /health and new requests get 503, the streams in flight finish whole,
    and the process exits 0. The engine is held (it steps nothing) from the first stream's
    first step until after SIGTERM: on a fast machine the 60-token stream used to finish,
    and a waiting request be admitted, before the 4th request arrived (a 200, not a 503)."""
    server, hold = servers["narrow"], servers["hold"]
    long = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0, "stream": True}
    outcomes: dict[int, list[str]] = {}

    def stream(i: int) -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=120) as r:
            outcomes[i] = [r.status_code, *r.iter_lines()]

    def wait_for(key: str, value: int) -> None:
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/stats").json()[key] != value:
            assert time.monotonic() < deadline, f"{key} never reached {value}"
            time.sleep(0.02)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    hold.touch()
    try:
        threads[0].start()
        wait_for("num_running", 1)  # its first step ran; the engine now holds
        threads[1].start()
        threads[2].start()
        wait_for("num_waiting", 2)
        r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers=None)
        _assert_error(r, 503, "--max-waiting-requests 2")
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        assert httpx.get(server.url + "/stats").json()["num_running"] == 1  # still held

        server.proc.terminate()  # SIGTERM while three streams are in flight
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "SIGTERM did not start draining"
            time.sleep(0.02)
        r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers=None)
        _assert_error(r, 503, "shutting down")
    finally:
        hold.unlink()  # let the three streams run to their end
    for t in threads:
        t.join(120)
    assert server.proc.wait(60) == 0, server.log()
    for i in range(3):
        status, *lines = outcomes[i]
        data = [x for x in lines if x.startswith("data: ")]
        assert status == 200 and data[-1] == "data: [DONE]", (status, data[-3:])
        events = [json.loads(x[len("data: "):]) for x in data[:-1]]
        assert sum(1 for e in events for c in e["choices"] if c["finish_reason"]) == 1
        assert not any("error" in e for e in events)


# ----------------------------------------------------------------------------- limits, key


def test_request_limits(main):
    big = "x " * MAX_BODY
    _assert_error(_post(main, "/v1/completions", {"prompt": big}), 413, "--max-body-bytes")

    def chunked():  # no Content-Length: counted while it arrives
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"y" * 1024
        yield b'"}'
    r = httpx.post(main.url + "/v1/completions", content=chunked(), timeout=60,
                   headers={**AUTH, "content-type": "application/json"})
    _assert_error(r, 413, "--max-body-bytes")
    _assert_error(_post(main, "/v1/completions", {"prompt": "hi", "n": 5}), 400, "--max-n")
    _assert_error(_post(main, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "n": 5}), 400, "--max-n")
    _assert_error(_post(main, "/v1/completions", {"prompt": ["a"] * 9}), 400,
                  "--max-prompts-per-request")
    _assert_error(_post(main, "/v1/completions", {"prompt": [[1, 2]] * 9}), 400, "prompt")
    _assert_error(_post(main, "/v1/completions", {"prompt": "hi", "max_tokens": 10**9}), 400,
                  "max_tokens")
    _assert_error(_post(main, "/v1/completions", {"prompt": [5] * 300}), 400, "300")
    r = _post(main, "/v1/completions", {"prompt": ["a"] * 8, "n": 4, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 32
    _assert_idle(main)


def test_api_key(main):
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        _assert_error(_post(main, "/v1/completions", body, headers=headers), 401, "API key")
        _assert_error(httpx.get(main.url + "/v1/models", headers=headers), 401, "API key")
    r = _post(main, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
              headers=None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert _post(main, "/v1/completions", body).status_code == 200
    assert httpx.get(main.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(main.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(main.url + "/stats").status_code == 200


# ------------------------------------------------------------------------------------ fuzz

BIG = st.sampled_from([2**31, 2**63, -(2**63) - 1, 10**30, -(10**30), 1e308, -1e308,
                       math.inf, -math.inf, math.nan, -1, 0, 1e-300])
SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30) | BIG
JUNK = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
TOKEN_IDS = st.lists(st.integers(-5, 200_000) | BIG, min_size=0, max_size=12)


def _plausible(schema: dict, components: dict):
    """A value of (roughly) the type the schema names, with edge cases mixed in."""
    if "$ref" in schema:
        return _plausible(components[schema["$ref"].rsplit("/", 1)[-1]], components)
    options = schema.get("anyOf") or [schema]
    strategies = []
    for option in options:
        kind = option.get("type")
        if "$ref" in option:
            strategies.append(_plausible(option, components))
        elif kind == "integer":
            strategies.append(st.integers(-3, 40) | BIG)
        elif kind == "number":
            strategies.append(st.floats(-3, 3) | BIG)
        elif kind == "string":
            strategies.append(st.text(max_size=40))
        elif kind == "boolean":
            strategies.append(st.booleans())
        elif kind == "array":
            strategies.append(st.lists(_plausible(option.get("items", {}), components),
                                       max_size=3) | TOKEN_IDS)
        elif kind == "object" and "properties" in option:
            strategies.append(_body(option, components, junk_rate=0.1))
        else:
            strategies.append(JUNK)
    return st.one_of(strategies)


def _body(schema: dict, components: dict, junk_rate: float = 0.2):
    """A dict with each schema property (usually) present, some values junk."""
    fields = {}
    for name, prop in schema.get("properties", {}).items():
        value = st.one_of(_plausible(prop, components), JUNK) if junk_rate else \
            _plausible(prop, components)
        fields[name] = value
    required = set(schema.get("required", []))

    @st.composite
    def build(draw):
        body = {}
        for name, value in fields.items():
            keep = draw(st.floats(0, 1)) < (0.95 if name in required or name == "max_tokens"
                                            else 0.35)
            if keep:
                body[name] = draw(value)
        if draw(st.booleans()) and "max_tokens" in body:
            body["max_tokens"] = draw(st.integers(1, 8))
        if draw(st.floats(0, 1)) < 0.1:
            body[draw(st.text(max_size=10))] = draw(JUNK)
        return body
    return build()


TEXT = st.text(min_size=1, max_size=40)
VALID = {  # values the server must accept, to mix with the schema's junk
    "max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "n": st.integers(1, 4),
    "seed": st.integers(0, 2**31), "stop": st.lists(TEXT, max_size=2) | TEXT,
    "stream": st.booleans(), "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 3),
    "stop_token_ids": st.lists(st.integers(0, 2000), max_size=3),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    # issue 19's sampling fields, valid values: the fuzz reaches the engine with them too
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 2000).map(str), st.floats(-100, 100),
                                  max_size=3),
    "allowed_token_ids": st.lists(st.integers(0, 2000), min_size=1, max_size=5),
    "bad_words": st.lists(TEXT, max_size=2),
    "guided_choice": st.lists(TEXT, min_size=1, max_size=3)}
COMPLETION = {**VALID, "prompt": TEXT | st.lists(TEXT, min_size=1, max_size=3)
              | st.lists(st.integers(0, 2000), min_size=1, max_size=12),
              "echo": st.booleans(), "logprobs": st.integers(0, 5)}
CHAT = {**VALID, "messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT}),
    min_size=1, max_size=3), "logprobs": st.booleans()}


def _mutated(valid: dict, schema: dict, components: dict, most_junk: int = 2):
    """A valid body (its required fields plus a few optional ones), then 0-`most_junk` of the
    schema's fields set to plausible-typed edge values or junk."""
    props = schema["properties"]

    @st.composite
    def build(draw):
        required = [k for k in ("prompt", "messages") if k in valid]
        optional = draw(st.lists(st.sampled_from(sorted(set(valid) - set(required))),
                                 max_size=4, unique=True))
        body = {k: draw(valid[k]) for k in (*required, "max_tokens", *optional)}
        for name in draw(st.lists(st.sampled_from(sorted(props)), max_size=most_junk,
                                  unique=True)):
            body[name] = draw(st.one_of(_plausible(props[name], components), JUNK))
        return body
    return build()


def test_fuzz_from_openapi_schema(main):
    """150 bodies for both endpoints, built from GET /openapi.json (wrong types, huge and
    non-finite numbers, unicode, nested junk): never a 5xx or a hang; afterwards the server
    is healthy and every block is back."""
    spec = httpx.get(main.url + "/openapi.json").json()
    components = spec["components"]["schemas"]
    endpoints = {}
    for path, name, valid in (("/v1/completions", "CompletionRequest", COMPLETION),
                              ("/v1/chat/completions", "ChatCompletionRequest", CHAT)):
        schema = components[name]
        # A quarter of the bodies carry only valid values, so that how many reach the engine
        # does not hang on Hypothesis's draws: it mixes constants from every local module
        # loaded into the process into its choices, so the same seed draws other bodies
        # after other tests have imported other modules.
        endpoints[path] = st.one_of(_mutated(valid, schema, components, most_junk=0),
                                    _mutated(valid, schema, components),
                                    _body(schema, components), JUNK)
    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(list(endpoints)), data=st.data())
    def case(path, data):
        body = data.draw(endpoints[path])
        content = json.dumps(body, allow_nan=True)
        r = httpx.post(main.url + path, content=content, timeout=30,
                       headers={**AUTH, "content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, f"{path} {content[:300]} -> {r.status_code} {r.text[:300]}"
        if r.status_code != 200:
            assert "error" in r.json()
        elif r.headers["content-type"].startswith("text/event-stream"):
            # an error *event* has a top-level "error" key; generated text may say "error"
            events = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert not any("error" in e for e in events), f"{path} {content[:300]}: {r.text[-300:]}"
            assert r.text.rstrip().endswith("data: [DONE]")

    case()
    assert seen.get(200, 0) >= 30, seen  # the fuzz reached the engine, not only validation
    assert httpx.get(main.url + "/health").status_code == 200
    _assert_idle(main)
    _still_serving(main)



EDGES = [2**63, -(2**63) - 1, 10**30, math.nan, math.inf, -math.inf, 1e308, -1, "\ud800x",
         [10**30], {"a": [None]}]


def test_every_field_at_its_edges(main):
    """Each field the schema names, set to each edge value in an otherwise valid body (the
    cases a random fuzz rarely draws): a 4xx or a 200, never a 5xx."""
    components = httpx.get(main.url + "/openapi.json").json()["components"]["schemas"]
    statuses = set()
    for path, name, base in (
            ("/v1/completions", "CompletionRequest", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", "ChatCompletionRequest",
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        for field in components[name]["properties"]:
            for value in EDGES:
                content = json.dumps({**base, field: value}, allow_nan=True)
                r = httpx.post(main.url + path, content=content, timeout=30,
                               headers={**AUTH, "content-type": "application/json"})
                assert r.status_code < 500, f"{path} {content} -> {r.text[:300]}"
                statuses.add(r.status_code)
    assert statuses >= {200, 400}
    _assert_idle(main)
