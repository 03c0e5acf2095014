"""Graders for notebook 05_benchmark (the benchmark harness).

Each check takes the learner's function, runs it on cases whose answers were computed by
hand (and, for percentiles, on random data against ``numpy``), and prints one pass line or
raises an ``AssertionError`` that names the case and the likely mistake. The closed loop is
graded against a fake engine with a fake clock, so timings are exact and the check is fast.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from .grading import passed


def _call(exercise: str, fn: Callable, *args, **kwargs) -> Any:
    """Call the learner's function; a stub's NotImplementedError becomes a failed check."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        raise AssertionError(f"{exercise} is not implemented yet ({e})") from None


def _close(a: float | None, b: float | None, tol: float = 1e-9) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


# --- Exercise 05.1 ---------------------------------------------------------------------------

_PERCENTILE_CASES = [  # (values, q, expected), by hand: rank (n - 1) * q / 100
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),  # rank 1.5: halfway between 2 and 3
    ([1.0, 2.0, 3.0, 4.0], 99, 3.97),  # rank 2.97
    ([15.0, 20.0, 35.0, 40.0, 50.0], 40, 29.0),  # rank 1.6: 20 + 0.6 * (35 - 20)
    ([40.0, 10.0, 30.0, 20.0], 25, 17.5),  # unsorted input; rank 0.75 of [10, 20, 30, 40]
    ([3.0, 1.0, 2.0], 0, 1.0),
    ([3.0, 1.0, 2.0], 100, 3.0),
    ([7.0], 99, 7.0),
]


def check_percentile(percentile: Callable[[list[float], float], float]) -> None:
    """Exercise 05.1: linear interpolation between closest ranks, as numpy and vLLM do."""
    for values, q, expected in _PERCENTILE_CASES:
        got = _call("Exercise 05.1", percentile, list(values), q)
        if not isinstance(got, (int, float)) or not _close(float(got), expected):
            hint = ("interpolate between the two closest ranks: the q-th percentile sits at "
                    "rank (n - 1) * q / 100 of the sorted values (numpy's default), not at "
                    "the nearest rank")
            raise AssertionError(f"Exercise 05.1 (percentile): percentile({values}, {q}) "
                                 f"returned {got!r}, expected {expected}\n  hint: {hint}")
    import numpy as np

    rng = random.Random(5)
    for _ in range(20):
        values = [rng.expovariate(1.0) for _ in range(rng.randint(1, 40))]
        q = rng.choice([50, 90, 99, rng.uniform(0, 100)])
        got, expected = percentile(list(values), q), float(np.percentile(values, q))
        if not _close(got, expected, 1e-7):
            raise AssertionError(f"Exercise 05.1 (percentile): got {got} for q={q:.2f} of "
                                 f"{len(values)} values, numpy.percentile says {expected}")
    passed("Exercise 05.1 (percentile)", "matches hand-computed cases and numpy.percentile")


# --- Exercise 05.2 ---------------------------------------------------------------------------

# (start, chunk_times, end, output_tokens) -> (ttft, itls, tpot, e2el), computed by hand.
_LATENCY_CASES = [
    ((10.0, [10.5, 10.6, 10.8, 11.1], 11.1, 4), (0.5, [0.1, 0.2, 0.3], 0.2, 1.1)),
    ((0.2, [1.0, 1.2, 1.3], 1.4, 5), (0.8, [0.2, 0.1], 0.1, 1.2)),  # a chunk of 2+ tokens
    ((0.0, [0.3], 0.35, 1), (0.3, [], None, 0.35)),  # one token: no TPOT
]


def check_request_latency(request_latency: Callable) -> None:
    """Exercise 05.2: TTFT from the request's start, ITLs between chunks, TPOT, E2EL."""
    from minivllm.bench.metrics import RequestResult

    hints = {
        "ttft": "TTFT runs from when the request was sent (result.start) to its first chunk",
        "itls": "one ITL per pair of successive chunks: chunk_times[i+1] - chunk_times[i]",
        "tpot": "TPOT = (e2el - ttft) / (output_tokens - 1), None for a single token",
        "e2el": "E2EL runs from result.start to result.end",
    }
    for (start, times, end, tokens), expected in _LATENCY_CASES:
        result = RequestResult(prompt_len=8, start=start, chunk_times=list(times), end=end,
                               output_tokens=tokens)
        got = _call("Exercise 05.2", request_latency, result)
        for name, want in zip(("ttft", "itls", "tpot", "e2el"), expected):
            value = getattr(got, name, "<missing>")
            ok = (isinstance(value, list) and len(value) == len(want)
                  and all(_close(a, b) for a, b in zip(value, want))) if name == "itls" \
                else (value is None or isinstance(value, (int, float))) and _close(value, want)
            if not ok:
                raise AssertionError(
                    f"Exercise 05.2 (request_latency): {name} = {value!r}, expected {want!r} "
                    f"for start={start}, chunk_times={times}, end={end}, output_tokens="
                    f"{tokens}\n  hint: {hints[name]}")
    passed("Exercise 05.2 (request_latency)", "TTFT, ITL, TPOT and E2EL on hand-timed streams")


# --- Exercise 05.3 ---------------------------------------------------------------------------


class FakeEngine:
    """``LLMEngine``'s add_request/step without a model: each step gives every running
    request one token and takes exactly one second of a fake clock (``engine.now``)."""

    def __init__(self, max_steps: int = 1000) -> None:
        self.now = 0.0
        self.running: dict[str, list[int]] = {}  # id -> [tokens to make, tokens made]
        self.added: list[tuple[str, list[int], Any]] = []
        self.max_in_flight = 0
        self.num_steps, self.max_steps = 0, max_steps

    def add_request(self, request_id: str, prompt, params) -> None:
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else list(prompt)
        if request_id in self.running:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.added.append((request_id, list(ids), params))
        self.running[request_id] = [params.max_tokens, 0]
        self.max_in_flight = max(self.max_in_flight, len(self.running))

    def step(self):
        from minivllm.engine import CompletionOutput, RequestOutput

        self.num_steps += 1
        if self.num_steps > self.max_steps:
            raise AssertionError(f"step() called {self.num_steps} times for a tiny workload: "
                                 "does the loop end when every request is finished?")
        self.now += 1.0
        outputs = []
        for request_id, state in list(self.running.items()):
            state[1] += 1
            done = state[1] >= state[0]
            token_ids = list(range(state[1]))
            outputs.append(RequestOutput(request_id, None, [1], [CompletionOutput(
                0, "", token_ids, finish_reason="length" if done else None,
                delta_token_ids=[state[1] - 1])], done))
            if done:
                del self.running[request_id]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)


# Five requests, concurrency 2, one token per step and one second per step (by hand):
# t=0 add r0, r1 | step -> t=1: r0 1/3, r1 done | add r2 | t=2: r0 2/3, r2 1/4
# t=3: r0 done, r2 2/4 | add r3 | t=4: r2 3/4, r3 1/2 | t=5: r2 done, r3 done | add r4
# t=6, 7, 8: r4 1/3, 2/3, done.
_LOOP_OUTPUT_LENS = [3, 1, 4, 2, 3]
_LOOP_EXPECTED = {  # request -> (start, chunk_times, end)
    0: (0.0, [1.0, 2.0, 3.0], 3.0),
    1: (0.0, [1.0], 1.0),
    2: (1.0, [2.0, 3.0, 4.0, 5.0], 5.0),
    3: (3.0, [4.0, 5.0], 5.0),
    4: (5.0, [6.0, 7.0, 8.0], 8.0),
}


def check_closed_loop(drive_closed_loop: Callable) -> None:
    """Exercise 05.3: at most ``concurrency`` requests in flight, topped up in order before
    every step; tokens timestamped *after* the step that made them."""
    from minivllm.bench.metrics import BenchRequest

    requests = [BenchRequest([10 + i, 20 + i], n) for i, n in enumerate(_LOOP_OUTPUT_LENS)]
    engine = FakeEngine()
    finished = []
    results = _call("Exercise 05.3", drive_closed_loop, engine, requests, 2,
                    clock=lambda: engine.now, on_finish=lambda: finished.append(engine.now))
    what = "Exercise 05.3 (drive_closed_loop)"
    if engine.max_in_flight != 2:
        raise AssertionError(
            f"{what}: {engine.max_in_flight} requests were in flight at once with "
            "concurrency=2\n  hint: add a request only while fewer than `concurrency` are "
            "in flight, and top up again before every step")
    order = [request_id for request_id, _, _ in engine.added]
    if order != ["0", "1", "2", "3", "4"]:
        raise AssertionError(f"{what}: requests were added as {order}, expected ids "
                             "'0'..'4' in workload order")
    for (_, ids, params), request in zip(engine.added, requests):
        if ids != request.prompt_token_ids or params.max_tokens != request.output_len \
                or not params.ignore_eos or params.temperature != 0:
            raise AssertionError(f"{what}: request added with prompt {ids} and {params}; "
                                 "expected its prompt_token_ids and greedy (temperature=0), "
                                 "ignore_eos sampling of exactly output_len tokens")
    if not isinstance(results, list) or len(results) != len(requests):
        raise AssertionError(f"{what}: expected a list of {len(requests)} RequestResults in "
                             f"workload order, got {results!r}")
    for i, (start, times, end) in _LOOP_EXPECTED.items():
        r = results[i]
        got = (r.start, r.chunk_times, r.end, r.output_tokens)
        if got != (start, times, end, _LOOP_OUTPUT_LENS[i]):
            hint = ("stamp chunks with clock() *after* engine.step() returns (that is when "
                    "the tokens exist), and `start` when the request is added"
                    if r.chunk_times and r.chunk_times[0] == r.start else
                    "start = clock() when the request is added; one chunk per output that "
                    "carries delta_token_ids; end = the time of the step that finished it")
            raise AssertionError(
                f"{what}: request {i} got (start, chunk_times, end, output_tokens) = {got}, "
                f"expected {(start, times, end, _LOOP_OUTPUT_LENS[i])}\n  hint: {hint}")
    if len(finished) != len(requests):
        raise AssertionError(f"{what}: on_finish was called {len(finished)} times, expected "
                             f"once per request ({len(requests)})")
    passed("Exercise 05.3 (drive_closed_loop)",
           f"concurrency held at 2 over {engine.num_steps} steps, every token timed")
