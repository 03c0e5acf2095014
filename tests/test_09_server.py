"""Milestone 9: the server started with ``-tp 2`` (one gloo worker process).

A representative subset of tests/test_04_server.py runs against it, unchanged: /health and
/v1/models, completions (plain and streamed), logprobs/stop/echo, chat, and concurrent streams
batched into one step; each compares the TP=2 server's greedy output with the offline TP=1
``LLM``. Then a worker is killed: requests fail, /health answers 503, and SIGTERM still ends
the server with status 0 and leaves no worker behind.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from test_04_server import (  # noqa: F401 (the imported tests and fixtures run here)
    ENGINE,
    MODEL,
    NAME,
    _cli_options,
    _free_port,
    client,
    llm,
    server,
    test_chat_matches_offline,
    test_completions_match_offline,
    test_completions_stream_matches_offline,
    test_concurrent_streams_are_batched,
    test_health_and_models,
    test_stop_echo_and_logprobs,
)

import minivllm
from minivllm import LLM

STATE: dict = {}


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """``python -m minivllm.serve -tp 2`` and the offline TP=1 LLM with the same options."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server-tp2") / "server.log"
    cmd = [sys.executable, "-m", "minivllm.serve", "-tp", "2", "--port", str(port),
           "--log-level", "info", *(["--model", MODEL] if MODEL != minivllm.TINY_MODEL else []),
           *_cli_options(), "--device", "cpu"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    offline = LLM(MODEL, device="cpu", **ENGINE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"server exited early:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"server did not start:\n{log_path.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    workers = psutil.Process(proc.pid).children(recursive=True)
    STATE.update(proc=proc, workers=workers, log=log_path)
    yield url, offline
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    text = log_path.read_text()
    assert status == 0, f"server exited with {status} on SIGTERM:\n{text}"
    assert f"minivllm serving {NAME} on {url}" in text
    assert "tensor parallel: 2 ranks" in text
    _, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, f"worker(s) {alive} left behind after SIGTERM"


def test_server_runs_one_worker(server):  # noqa: F811 (the fixture)
    workers = [p for p in STATE["workers"] if "python" in p.name().lower()]
    assert len(workers) >= 1  # the spawned rank 1 (and multiprocessing's resource tracker)


def test_killed_worker_makes_health_503(server):  # noqa: F811 (the fixture)
    """Runs last: it breaks the shared server's engine on purpose."""
    rank1 = [p for p in STATE["workers"] if "spawn_main" in " ".join(p.cmdline())
             and "resource_tracker" not in " ".join(p.cmdline())]
    assert len(rank1) == 1, [p.cmdline() for p in STATE["workers"]]
    rank1[0].send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 15  # dead: a zombie until the server reaps it
    while rank1[0].is_running() and rank1[0].status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the worker did not die"
        time.sleep(0.05)
    body = {"model": NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code >= 500
    assert "tensor-parallel worker" in response.text or "engine" in response.text
    deadline = time.monotonic() + 30
    while httpx.get(f"{server}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health did not turn 503"
        time.sleep(0.1)
    assert httpx.post(f"{server}/v1/completions", json=body, timeout=30).status_code == 503
