# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Load generators: drive an engine with a workload and timestamp every token.

Built in notebook 05_benchmark. Three ways to put ``concurrency`` requests in flight and
record, for each, when it was sent, when each chunk of tokens arrived and when it ended
(a ``RequestResult``; the arithmetic on top is in ``metrics``):

* ``drive_closed_loop``: our ``LLMEngine`` directly, one ``step()`` at a time;
* ``generate_static_batches``: ``transformers`` ``generate`` on static batches, the naive
  floor every serving engine is measured against;
* ``run_openai_client``: any OpenAI-compatible server (``python -m minivllm.serve``,
  ``transformers serve``, ``vllm serve``) over streaming HTTP, timed as ``vllm bench serve``
  times it (the servers themselves are started by ``servers``).

All three are *closed loops*: like ``concurrency`` users who each send their next request
as soon as the previous one is answered, so the engine is never offered more (or less)
than ``concurrency`` requests at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from minivllm.bench.metrics import BenchRequest, RequestResult

Progress = Callable[[], None]  # called once per finished request


def drive_closed_loop(engine, requests: list[BenchRequest], concurrency: int,
                      clock: Callable[[], float] = time.perf_counter,
                      on_finish: Progress | None = None,
                      sampling: dict | None = None) -> list[RequestResult]:
    """Run ``requests`` through an ``LLMEngine``, keeping ``concurrency`` of them in flight.

    A *closed loop*, like ``concurrency`` users who each send their next request as soon as
    the previous one is answered: before every ``engine.step()``, top up the in-flight set
    from the queue (in order; ``start = clock()`` when a request is added). After the step,
    every output that carries new tokens (``outputs[0].delta_token_ids``) is one streamed
    chunk that arrived at ``clock()``; a finished output also ends its request then.
    Request ``i`` is added as id ``str(i)`` with greedy ``ignore_eos`` sampling of exactly
    ``output_len`` tokens (the ``sampling`` fields on top: a temperature samples, penalties
    cost what they cost).
    Returns one ``RequestResult`` per request, in order.
    """
    from minivllm.sampling import SamplingParams

    results = [RequestResult(prompt_len=len(r.prompt_token_ids)) for r in requests]
    next_index, in_flight = 0, set()
    while next_index < len(requests) or in_flight:
        while next_index < len(requests) and len(in_flight) < concurrency:
            request = requests[next_index]
            params = SamplingParams(**{"temperature": 0.0, **(sampling or {})},
                                    max_tokens=request.output_len, ignore_eos=True)
            results[next_index].start = clock()
            engine.add_request(str(next_index), {"prompt_token_ids": request.prompt_token_ids},
                               params)
            in_flight.add(str(next_index))
            next_index += 1
        outputs = engine.step()
        now = clock()  # after the step: that is when its tokens exist
        for out in outputs:
            result = results[int(out.request_id)]
            delta = out.outputs[0].delta_token_ids
            if delta:
                result.chunk_times.append(now)
                result.output_tokens += len(delta)
            if out.finished:
                result.end = now
                in_flight.discard(out.request_id)
                if on_finish is not None:
                    on_finish()
    return results


def generate_static_batches(model, requests: list[BenchRequest], concurrency: int,
                            pad_token_id: int, clock: Callable[[], float] = time.perf_counter,
                            on_finish: Progress | None = None) -> list[RequestResult]:
    """The naive floor: ``transformers`` ``generate`` on static batches of ``concurrency``.

    Each batch is left-padded to its longest prompt and decodes, greedily and past EOS
    (``min_new_tokens``), until its *longest* request is done; the next batch starts after
    that. A ``StoppingCriteria`` runs after every generation step and timestamps it, so each
    request gets real chunk times for its own ``output_len`` tokens (as a streamer would
    deliver them) and only those tokens count as its output. As in the closed loop, slot
    ``j``'s next request is sent when slot ``j``'s previous one got its last token, so the
    wait for the rest of the batch shows up in its TTFT.
    """
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    device = model.device
    results: list[RequestResult] = []

    class Timestamps(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.times.append(clock())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    slot_free = [clock()] * concurrency  # when each "user" got its previous answer
    for first in range(0, len(requests), concurrency):
        batch = requests[first:first + concurrency]
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding: every prompt ends at column width-1
            input_ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            attention_mask[row, width - len(r.prompt_token_ids):] = 1
        max_new = max(r.output_len for r in batch)
        stamps = Timestamps()
        with torch.inference_mode():
            model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                           max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                           pad_token_id=pad_token_id,
                           stopping_criteria=StoppingCriteriaList([stamps]))
        for slot, r in enumerate(batch):  # sent when its user was free; waited for the batch
            times = stamps.times[:r.output_len]
            results.append(RequestResult(len(r.prompt_token_ids), slot_free[slot], times,
                                         times[-1], len(times)))
            slot_free[slot] = times[-1]
            if on_finish is not None:
                on_finish()
    return results


Payload = Callable[[str, BenchRequest], dict]  # (model name, request) -> the JSON body


def completion_payload(model: str, request: BenchRequest) -> dict:
    """The body ``vllm bench serve`` sends: the prompt as token ids, greedy, ``ignore_eos``
    (a vLLM extension that minivllm's server accepts too) and the usage in the last event."""
    return {"model": model, "prompt": request.prompt_token_ids,
            "max_tokens": request.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def text_completion_payload(model: str, prompt: str, max_tokens: int) -> dict:
    """The same request for ``transformers serve``, which answers 422 to unknown fields and
    takes only a string prompt: the prompt as text, and EOS switched off through the
    ``generation_config`` it accepts (``eos_token_id: -1`` means none), so that it too
    generates exactly ``max_tokens``."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
            "generation_config": json.dumps({"eos_token_id": -1})}


async def stream_completion(client, url: str, payload: dict, result: RequestResult,
                            clock: Callable[[], float]) -> None:
    """One streamed ``/v1/completions`` request, timed as ``vllm bench serve`` times it:
    every SSE chunk with choices is an arrival, except a closing one that carries only the
    usage and no text (``transformers serve`` sends that). ``usage`` (from
    ``stream_options.include_usage``) counts the tokens, else one token per chunk; its
    ``prompt_tokens`` replaces the prompt length when the server tokenized a text prompt."""
    usage = {}
    result.start = clock()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                texts = [c.get("text") for c in chunk.get("choices") or []]
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                elif texts and (any(texts) or not chunk.get("usage")):
                    result.chunk_times.append(clock())
        result.end = clock()
        result.output_tokens = usage.get("completion_tokens") or len(result.chunk_times)
        result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
        if not result.chunk_times and result.error is None:
            result.error = "the stream ended without a token"
    except Exception as e:  # noqa: BLE001 (a failed request is a result, not a crash)
        result.error = f"{type(e).__name__}: {e}"[:300]


def run_openai_client(base_url: str, model: str, requests: list[BenchRequest],
                      concurrency: int, clock: Callable[[], float] = time.perf_counter,
                      on_finish: Progress | None = None, timeout_s: float = 3600.0,
                      payload: Payload = completion_payload) -> list[RequestResult]:
    """Closed loop over HTTP: ``concurrency`` async workers, each sending its next request
    (the body ``payload`` makes of it) as soon as its previous one is answered."""
    import httpx

    results = [RequestResult(prompt_len=len(r.prompt_token_ids)) for r in requests]
    url = base_url.rstrip("/") + "/completions"
    bodies = [payload(model, r) for r in requests]  # before the clock starts
    queue = iter(range(len(requests)))

    async def worker(client) -> None:
        for i in queue:  # one shared iterator: each index is taken by exactly one worker
            await stream_completion(client, url, bodies[i], results[i], clock)
            if on_finish is not None:
                on_finish()

    async def main() -> None:
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))

    asyncio.run(main())
    return results


def served_model_name(base_url: str, fallback: str) -> str:
    """The first model the server lists at ``/v1/models`` (what requests must name)."""
    import httpx

    try:
        return httpx.get(base_url.rstrip("/") + "/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return fallback
