# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The body of a response: Server-Sent Events chunk by chunk, or the final outputs at once.

Built in notebook 04_openai_server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request

from minivllm.engine import RequestOutput
from minivllm.protocol import Job, OpenAIError, sse_event
from minivllm.server.engine_thread import AsyncEngine, RequestFailed, Submission


async def stream_events(job: Job, submission: Submission, engine: AsyncEngine) -> AsyncIterator[str]:
    """The SSE stream of a job: a chunk per choice that has news, usage, then [DONE]."""
    latest: dict[str, RequestOutput] = {}
    num_sent = [0] * (len(job.prompt_ids) * job.n)  # characters sent, per choice
    started, finished = set(), set()
    try:
        for index in range(len(num_sent) if job.chat else 0):  # chat starts with the role
            yield sse_event(job.body([{"index": index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}], chunk=True))
        async for outputs in submission.updates():
            for out in map(job.view, outputs):
                latest[out.request_id] = out
                p = submission.request_ids.index(out.request_id)
                for c in out.outputs:
                    index = p * job.n + c.index
                    if index in finished or not (c.delta_text or c.delta_token_ids
                                                 or c.finish_reason):
                        continue
                    text = c.delta_text if index in started else job.echo(p) + c.delta_text
                    offset = num_sent[index] + len(text) - len(c.delta_text)
                    logprobs = job.logprobs(c.delta_token_ids, c.logprobs, offset,
                                            out if index not in started and job.echo(p) else None)
                    yield sse_event(job.body([job.choice(index, text, logprobs, c, delta=True)],
                                             chunk=True))
                    num_sent[index] += len(text)
                    started.add(index)
                    if c.finish_reason:
                        finished.add(index)
        if job.include_usage:
            yield sse_event(job.body([], usage=job.usage(latest.values()), chunk=True))
    except RequestFailed as e:
        yield sse_event(OpenAIError(str(e), status=500).body())
    finally:  # also when the client went away: the generator is closed or cancelled
        if not submission.is_finished:
            engine.abort(submission.request_ids)
    yield sse_event("[DONE]")


async def final_outputs(submission: Submission, request: Request) -> list[RequestOutput]:
    """The finished output of every engine request, in order; raises if the client leaves."""
    async def collect() -> dict[str, RequestOutput]:
        final = {}
        async for outputs in submission.updates():
            final.update((out.request_id, out) for out in outputs if out.finished)
        return final

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        raise OpenAIError("the client disconnected", status=499)
    if isinstance(task.exception(), RequestFailed):
        raise OpenAIError(str(task.exception()), status=500)
    final = task.result()
    return [final[request_id] for request_id in submission.request_ids]
