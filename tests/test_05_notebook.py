"""Notebook 05's exercises: the learner's stubs fail loudly, and each check cell's grader
fails on the stub and on a plausible wrong answer, and passes on the reference."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from notebook_helpers import load_module as _load

from minivllm.bench.clients import drive_closed_loop
from minivllm.bench.metrics import RequestLatency, RequestResult, percentile, request_latency
from minivllm.course import checks_05

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "05_benchmark.ipynb"




@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """The modules as the learner's stripped notebook exports them."""
    out = tmp_path_factory.mktemp("learner")
    subprocess.run([sys.executable, "-m", "minivllm.course", "export", "--notebook",
                    str(NOTEBOOK), "--out", str(out)], check=True, capture_output=True)
    names = {"metrics": "learner_bench_metrics", "clients": "learner_bench_clients"}
    modules = {key: _load(out / "bench" / f"{key}.py", name) for key, name in names.items()}
    yield modules
    for name in names.values():
        del sys.modules[name]


def test_stubs_raise_not_implemented(learner):
    metrics, clients = learner["metrics"], learner["clients"]
    with pytest.raises(NotImplementedError, match="Exercise 05.1"):
        metrics.percentile([1.0, 2.0], 50)
    with pytest.raises(NotImplementedError, match="Exercise 05.2"):
        metrics.request_latency(RequestResult(1, 0.0, [1.0], 1.0, 1))
    with pytest.raises(NotImplementedError, match="Exercise 05.3"):
        clients.drive_closed_loop(checks_05.FakeEngine(), [metrics.BenchRequest([1], 1)], 1)


# --- planted wrong answers ---------------------------------------------------------------------


def _nearest_rank(values, q):
    """Nearest-rank percentile: an actual sample, not numpy's interpolation."""
    xs = sorted(values)
    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


def _ttft_from_first_token(result):
    """Measures TTFT from the first token (always 0): hides queueing and prefill."""
    ref = request_latency(result)
    return RequestLatency(0.0, ref.itls, ref.tpot, ref.e2el)


def _tpot_over_all_tokens(result):
    """Divides the decode time by every token instead of the tokens after the first."""
    ref = request_latency(result)
    tpot = (ref.e2el - ref.ttft) / result.output_tokens
    return RequestLatency(ref.ttft, ref.itls, tpot, ref.e2el)


def _open_loop(engine, requests, concurrency, clock=None, on_finish=None):
    """Adds every request up front: concurrency is ignored (an open-loop burst)."""
    return drive_closed_loop(engine, requests, len(requests), clock=clock, on_finish=on_finish)


def _stamp_before_step(engine, requests, concurrency, clock=None, on_finish=None):
    """Reads the clock before engine.step(): every token looks one step early."""
    from minivllm.sampling import SamplingParams

    results = [RequestResult(len(r.prompt_token_ids)) for r in requests]
    next_index, in_flight = 0, set()
    while next_index < len(requests) or in_flight:
        while next_index < len(requests) and len(in_flight) < concurrency:
            r = requests[next_index]
            results[next_index].start = clock()
            engine.add_request(str(next_index), {"prompt_token_ids": r.prompt_token_ids},
                               SamplingParams(temperature=0, max_tokens=r.output_len,
                                              ignore_eos=True))
            in_flight.add(str(next_index))
            next_index += 1
        now = clock()  # wrong: before the step that makes the tokens
        for out in engine.step():
            result = results[int(out.request_id)]
            result.chunk_times.append(now)
            result.output_tokens += len(out.outputs[0].delta_token_ids)
            if out.finished:
                result.end = now
                in_flight.discard(out.request_id)
                on_finish()
    return results


GRADERS = [
    (checks_05.check_percentile, "metrics", "percentile", percentile, [_nearest_rank]),
    (checks_05.check_request_latency, "metrics", "request_latency", request_latency,
     [_ttft_from_first_token, _tpot_over_all_tokens]),
    (checks_05.check_closed_loop, "clients", "drive_closed_loop", drive_closed_loop,
     [_open_loop, _stamp_before_step]),
]


@pytest.mark.parametrize("check, module, name, reference, wrong", GRADERS,
                         ids=[g[2] for g in GRADERS])
def test_grader_fails_on_stub_and_wrong_answers_and_passes_reference(
        learner, check, module, name, reference, wrong, capsys):
    with pytest.raises(AssertionError, match="not implemented"):
        check(getattr(learner[module], name))
    for planted in wrong:
        with pytest.raises(AssertionError):
            check(planted)
    check(reference)
    assert "passed" in capsys.readouterr().out
