# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""``python -m minivllm.serve``: an OpenAI-compatible HTTP server that keeps batching.

Built in notebook 04_openai_server. One background thread owns the ``LLMEngine`` and runs
``step()`` in a loop; the asyncio front end (FastAPI on uvicorn) never touches the engine:

    HTTP handlers (event loop) ──commands──▶ queue.SimpleQueue ──▶ engine thread: step()
             ▲                                                        │
             └── asyncio.Queue per HTTP request ◀─call_soon_threadsafe─┘ RequestOutputs

A command is a function the engine thread runs between two steps (add requests, abort
them), so the engine is only ever used from one thread. The engine thread sleeps on the
command queue when it has nothing to do. Every HTTP request, whatever it asks for, becomes
engine requests in the same running batch: continuous batching survives the server.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine, RequestOutput
from minivllm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Job,
    OpenAIError,
    chat_job,
    completion_job,
    merge_outputs,
    sse_event,
)
from minivllm.sampling import SamplingParams
from minivllm.tokenizer import Tokenizer

logger = logging.getLogger("minivllm.serve")
TINY_MODEL_NAME = "minivllm-tiny"  # the served name of the bundled tiny model


class RequestFailed(Exception):
    """Delivered instead of a RequestOutput when the engine could not process a request."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class Submission:
    """What the front end holds for one HTTP request: its engine request ids and one queue."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.queue: asyncio.Queue[RequestOutput | RequestFailed] = asyncio.Queue()
        self.finished: set[str] = set()

    @property
    def is_finished(self) -> bool:
        return len(self.finished) == len(self.request_ids)

    async def updates(self) -> AsyncIterator[list[RequestOutput]]:
        """Yield, until every request is finished, what the engine produced since last time:
        one (merged) output per request that progressed. A RequestFailed is raised."""
        while not self.is_finished:
            backlog = [await self.queue.get()]
            while not self.queue.empty():
                backlog.append(self.queue.get_nowait())
            by_request: dict[str, list[RequestOutput]] = {}
            for item in backlog:
                if isinstance(item, RequestFailed):
                    raise item
                by_request.setdefault(item.request_id, []).append(item)
            merged = [merge_outputs(outs) for outs in by_request.values()]
            self.finished.update(out.request_id for out in merged if out.finished)
            yield merged


class AsyncEngine:
    """Runs ``LLMEngine.step()`` in one background thread; asyncio code talks to it by queue."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # used by the engine thread only
        self.max_model_len = engine.max_model_len
        self.model_path = str(engine.model_path)
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self.stats = self._snapshot()  # replaced (never mutated) by the engine thread

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- the front end's side (any thread, usually the event loop)

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams]]) -> Submission:
        """Add requests to the running batch; raises the engine's ValueError as a 400."""
        submission = Submission([request_id for request_id, _, _ in requests])
        added: concurrent.futures.Future[None] = concurrent.futures.Future()
        loop = asyncio.get_running_loop()
        self._commands.put(partial(self._add, requests, loop, submission.queue, added))
        try:
            await asyncio.wrap_future(added)
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        except asyncio.CancelledError:
            self.abort(submission.request_ids)
            raise
        return submission

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(partial(self._abort, request_ids))

    # -- the engine thread's side

    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished_requests()
            commands = [self._commands.get()] if idle else []  # sleep until there is work
            while not self._commands.empty():
                commands.append(self._commands.get_nowait())
            for command in commands:
                if command is None:
                    self._fail(list(self._streams), "the server is shutting down")
                    return
                command()
            if self.engine.has_unfinished_requests():
                self._step()
            self.stats = self._snapshot()

    def _add(self, requests, loop, out: asyncio.Queue, added: concurrent.futures.Future) -> None:
        """All of an HTTP request's engine requests, or none of them."""
        try:
            for request_id, prompt_ids, params in requests:
                self.engine.add_request(request_id, prompt_ids, params)
                self._streams[request_id] = (loop, out)
        except Exception as e:  # noqa: BLE001 -- any failure fails this request only
            self._abort([request_id for request_id, _, _ in requests])
            added.set_exception(e)
            return
        added.set_result(None)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort_request(request_id)  # frees its KV blocks now
            self._streams.pop(request_id, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # fail the batch's requests, keep the loop alive
            logger.exception("engine step failed")
            self._fail(list(self._streams), f"engine step failed: {e!r}")
            return
        self.stats = self._snapshot()  # before the clients hear of this step
        for out in outputs:
            self._deliver(out.request_id, out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _deliver(self, request_id: str, item: RequestOutput | RequestFailed) -> None:
        loop, out = self._streams[request_id]
        try:
            loop.call_soon_threadsafe(out.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            self._abort([request_id])

    def _fail(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            self._deliver(request_id, RequestFailed(request_id, message))
        self._abort(request_ids)

    def _snapshot(self) -> dict:
        e = self.engine
        return {**dataclasses.asdict(e.stats), "num_blocks": e.num_blocks,
                "num_free_blocks": e.block_manager.num_free_blocks,
                "num_running": len(e.scheduler.running), "num_waiting": len(e.scheduler.waiting),
                "num_requests_in_flight": len(self._streams),
                "requests_in_flight": sorted(self._streams)}


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
            for out in outputs:
                latest[out.request_id] = out
                p = submission.request_ids.index(out.request_id)
                for c in out.outputs:
                    index = p * job.n + c.index
                    if index in finished or not (c.delta_text or c.delta_token_ids
                                                 or c.finish_reason):
                        continue
                    text = c.delta_text if index in started else job.echo(p) + c.delta_text
                    offset = num_sent[index] + len(text) - len(c.delta_text)
                    logprobs = job.logprobs(c.delta_token_ids, c.logprobs, offset)
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


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI says 422; OpenAI and vLLM say 400. Malformed JSON lands here too."""
    errors = exc.errors()
    if errors and errors[0]["type"] == "json_invalid":
        return _error_response(OpenAIError(f"malformed JSON body: {errors[0]['ctx']['error']} "
                                           f"at position {errors[0]['loc'][-1]}"))
    where = [".".join(map(str, e["loc"][1:])) or "body" for e in errors]
    message = "; ".join(f"{w}: {e['msg']}" for w, e in zip(where, errors))
    return _error_response(OpenAIError(message or "invalid request", param=where[0] if where else None))


def build_app(engine: AsyncEngine, served_model_names: list[str],
              announce: str | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine thread."""
    tokenizer = Tokenizer.from_pretrained(engine.model_path)  # the front end's own copy
    default_name = served_model_names[0]

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        if announce:
            print(announce, flush=True)
        yield
        engine.shutdown()

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.add_exception_handler(OpenAIError, lambda _, e: _error_response(e))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, lambda _, e: _error_response(
        OpenAIError(str(e.detail), status=e.status_code)))

    def model_name(requested: str | None) -> str:
        if requested is not None and requested not in served_model_names:
            raise OpenAIError(f"The model `{requested}` does not exist.", status=404,
                              param="model")
        return requested or default_name

    async def serve(job: Job, request: Request):
        submission = await engine.submit(job.engine_requests())
        if job.stream:
            return StreamingResponse(stream_events(job, submission, engine),
                                     media_type="text/event-stream")
        try:
            finals = await final_outputs(submission, request)
        finally:
            if not submission.is_finished:
                engine.abort(submission.request_ids)
        return JSONResponse(job.response(finals))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        job = completion_job(body, tokenizer, engine.max_model_len, model_name(body.model))
        return await serve(job, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        job = chat_job(body, tokenizer, engine.max_model_len, model_name(body.model))
        return await serve(job, request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "minivllm",
             "root": engine.model_path, "parent": None, "max_model_len": engine.max_model_len}
            for name in served_model_names]}

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            raise OpenAIError("the engine loop is not running", status=503)
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict:
        return engine.stats

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minivllm.serve",
                                description="OpenAI-compatible server for a Qwen2/Qwen3 model")
    p.add_argument("--model", help="checkpoint directory or hub id (default: the bundled tiny "
                                   "model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", help="name(s) clients use (default: "
                   f"--model as given, or {TINY_MODEL_NAME!r} for the bundled model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int)
    p.add_argument("--kv-cache-memory-bytes", type=int)
    p.add_argument("--kv-cache-memory", type=float, help="CPU KV-cache budget in GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default="loop")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    kv_bytes = args.kv_cache_memory_bytes
    if args.kv_cache_memory is not None:
        kv_bytes = int(args.kv_cache_memory * 1024**3)
    options = {
        "dtype": args.dtype, "device": args.device, "block_size": args.block_size,
        "num_blocks": args.num_blocks, "kv_cache_memory_bytes": kv_bytes,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len, "enable_prefix_caching": not args.no_prefix_caching,
        "attention_backend": args.attention_backend, "compile": args.compile, "seed": args.seed}
    return EngineConfig(**({"model": args.model} if args.model else {}), **options)


def main(argv: list[str] | None = None) -> int:
    """Load the model, serve until Ctrl-C / SIGTERM, exit 0."""
    args = parse_args(argv)
    names = args.served_model_name or [args.model or TINY_MODEL_NAME]
    engine = AsyncEngine(LLMEngine(engine_config(args)))
    app = build_app(engine, names, f"minivllm serving {names[0]} on http://{args.host}:{args.port}")
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_graceful_shutdown=5))
    # uvicorn re-raises the signal that stopped it once it is done; with these handlers in
    # place that re-raise is a no-op, so Ctrl-C and SIGTERM end the process with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0


if __name__ == "__main__" and "get_ipython" not in globals():  # not in the notebook
    sys.exit(main())
