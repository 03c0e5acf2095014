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
import hmac
import logging
import os
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

import minivllm
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine, RequestOutput
from minivllm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Job,
    OpenAIError,
    TokenizeRequest,
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


def _put_all(batch: list[tuple[str, asyncio.Queue, object]]) -> None:
    """On the event loop: put each item on its request's queue."""
    for _, out, item in batch:
        out.put_nowait(item)


class AsyncEngine:
    """Runs ``LLMEngine.step()`` in one background thread; asyncio code talks to it by queue.

    Give it an engine, or a function that builds one: then the engine thread builds it
    itself (``start`` waits for that). Prefer the function: torch's OpenMP pool belongs to
    the thread that first runs a parallel op, so an engine loaded in the main thread and
    stepped in another leaves two pools on the machine's cores, and libgomp then stops
    spinning between ops (its workers sleep and are woken for every op): the bundled
    model's compiled decode ran 30% slower that way on 2 cores (docs/decisions.md).
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 max_waiting_requests: int | None = None) -> None:
        self.max_waiting_requests = max_waiting_requests  # None: requests wait, unbounded
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._build = engine if callable(engine) else None
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        if self._build is None:
            self._attach(engine)

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine  # used by the engine thread only
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.model_path = str(engine.model_path)
        self.stats = self._snapshot()  # replaced (never mutated) by the engine thread

    def start(self) -> None:
        """Start the engine thread (once) and wait until its engine is built."""
        if not self._thread.is_alive() and not self._ready.done():
            self._thread.start()
        self._ready.result()  # re-raises what building the engine raised

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
        try:
            if self._build is not None:
                self._attach(self._build())
        except BaseException as e:  # noqa: BLE001 -- start() re-raises it in its caller
            self._ready.set_exception(e)
            return
        self._ready.set_result(None)
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
                self._step()  # takes its own snapshot, before the clients hear of the step
            else:
                self.stats = self._snapshot()

    def _add(self, requests, loop, out: asyncio.Queue, added: concurrent.futures.Future) -> None:
        """All of an HTTP request's engine requests, or none of them."""
        if self.max_waiting_requests is not None:  # back-pressure: refuse, do not queue
            waiting = {id(self._streams[s.request_id][1]) for s in self.engine.scheduler.waiting
                       if s.request_id in self._streams}  # HTTP requests not yet running
            if len(waiting) >= self.max_waiting_requests:
                added.set_exception(OpenAIError(
                    f"The server is overloaded: {len(waiting)} requests are already waiting "
                    f"(--max-waiting-requests {self.max_waiting_requests}). Please retry later.",
                    status=503))
                return
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
        except Exception as e:  # fail the request(s) at fault, keep the loop alive
            culprit = getattr(e, "request_id", None)
            if culprit in self._streams:  # the error names its request: it fails alone, the
                logger.error("request %s failed: %r", culprit, e)  # others step again
                self._fail([culprit], f"processing the request failed: {e}")
                return
            logger.exception("engine step failed")
            batch = {s.request_id for s in self.engine.scheduler.running} & set(self._streams)
            self._fail(sorted(batch) or list(self._streams), f"engine step failed: {e!r}")
            return
        routed = self._route([(out.request_id, out) for out in outputs])
        for out in outputs:
            if out.finished:
                self._streams.pop(out.request_id, None)
        self.stats = self._snapshot()  # before the clients hear of this step
        self._send(routed)

    def _route(self, items: list[tuple[str, RequestOutput | RequestFailed]]) -> dict:
        """Group a step's items by the event loop of their request: {loop: [(id, queue, item)]}."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            loop, out = self._streams[request_id]
            by_loop.setdefault(loop, []).append((request_id, out, item))
        return by_loop

    def _send(self, by_loop: dict) -> None:
        """One wake-up per event loop, not per request (each is a write to the loop's
        self-pipe and a hand-over of the GIL)."""
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # its event loop is closed: nobody is listening any more
                self._abort([request_id for request_id, _, _ in batch])

    def _fail(self, request_ids: list[str], message: str) -> None:
        routed = self._route([(r, RequestFailed(r, message)) for r in request_ids])
        self._abort(request_ids)
        self.stats = self._snapshot()
        self._send(routed)

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


@dataclasses.dataclass
class ServerOptions:
    """The server's own limits (the engine's are in EngineConfig)."""

    api_key: str | None = None  # require "Authorization: Bearer <key>" on /v1/*
    max_body_bytes: int = 4 * 1024**2  # 413 above this
    max_n: int = 16  # 400 above this
    max_prompts_per_request: int = 64  # 400 above this
    drain_timeout: float = 30.0  # seconds SIGTERM waits for requests in flight


class Guard:
    """ASGI middleware: API key, draining, body size; counts the requests in flight."""

    def __init__(self, options: ServerOptions) -> None:
        self.app, self.options = None, options
        self.in_flight = 0  # /v1 requests being answered (streams until their last byte)
        self.draining = False

    def wrap(self, app):  # app.add_middleware(guard.wrap): Starlette calls it with the app
        self.app = app
        return self

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        error = self._refuse(scope)
        if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
            error, receive = await self._read_body(scope, receive)
        if error is not None:
            return await _error_response(error)(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _refuse(self, scope) -> OpenAIError | None:
        headers = dict(scope["headers"])
        key = self.options.api_key
        if key is not None:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return OpenAIError("Invalid or missing API key: send the header "
                                   "'Authorization: Bearer <key>'.", status=401)
        if self.draining:
            return OpenAIError("The server is shutting down and accepts no new requests.",
                               status=503)
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return OpenAIError("invalid Content-Length header")
            if int(length) > self.options.max_body_bytes:
                return self._too_large()
        return None

    def _too_large(self) -> OpenAIError:
        return OpenAIError(f"The request body is larger than {self.options.max_body_bytes} "
                           "bytes (--max-body-bytes).", status=413)

    async def _read_body(self, scope, receive):
        """Read the body, stopping as soon as it is too large; then replay it."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return None, receive
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.options.max_body_bytes:
                return self._too_large(), receive
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():  # the body once, then the real channel (disconnects)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return None, replay


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains: refuse new requests, finish the ones in
    flight (or give up after ``drain_timeout``), then shut down. A second signal is
    uvicorn's own: shut down now."""

    def __init__(self, config: uvicorn.Config, guard: Guard) -> None:
        super().__init__(config)
        self.guard = guard
        self.drain_deadline: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.drain_deadline is None:
            self._captured_signals.append(sig)
            self.guard.draining = True
            self.drain_deadline = time.monotonic() + self.guard.options.drain_timeout
            logger.warning("signal %s: draining %d requests in flight", sig,
                           self.guard.in_flight)
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit and (
                self.guard.in_flight == 0 or time.monotonic() > self.drain_deadline):
            self.should_exit = True
        return await super().on_tick(counter)


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.error("internal error", exc_info=exc)
    return _error_response(OpenAIError(f"internal error: {exc!r}", status=500))


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
              announce: str | None = None, options: ServerOptions | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine thread.

    ``app.state.guard`` is the ``Guard`` middleware in front of it (limits, key, draining).
    """
    tokenizer = Tokenizer.from_pretrained(engine.model_path)  # the front end's own copy
    default_name = served_model_names[0]
    options = options or ServerOptions()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        if announce:
            print(announce, flush=True)
        yield
        engine.shutdown()

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.state.guard = guard = Guard(options)
    app.add_middleware(guard.wrap)
    app.add_exception_handler(OpenAIError, lambda _, e: _error_response(e))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, lambda _, e: _error_response(
        OpenAIError(str(e.detail), status=e.status_code)))
    app.add_exception_handler(Exception, _internal_error)

    def model_name(requested: str | None) -> str:
        if requested is not None and requested not in served_model_names:
            raise OpenAIError(f"The model `{requested}` does not exist.", status=404,
                              param="model")
        return requested or default_name

    def check_limits(body, num_prompts: int) -> None:
        if body.n > options.max_n:
            raise OpenAIError(f"n must be at most {options.max_n} on this server (--max-n), "
                              f"got {body.n}", param="n")
        if any(t >= engine.vocab_size for t in body.stop_token_ids or []):
            raise OpenAIError(f"stop_token_ids must be < {engine.vocab_size} (the vocabulary "
                              "size)", param="stop_token_ids")
        if num_prompts > options.max_prompts_per_request:
            raise OpenAIError(f"at most {options.max_prompts_per_request} prompts per request "
                              f"(--max-prompts-per-request), got {num_prompts}", param="prompt")

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
        check_limits(body, len(body.prompts()))
        job = completion_job(body, tokenizer, engine.max_model_len, model_name(body.model))
        return await serve(job, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_limits(body, 1)
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
        if guard.draining:
            raise OpenAIError("the server is shutting down", status=503)
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict:
        return engine.stats

    @app.post("/tokenize")  # vLLM's extra endpoints: outside /v1, as vLLM serves them
    async def tokenize(body: TokenizeRequest) -> dict:
        model_name(body.model)
        ids = body.prompt_ids(tokenizer)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        model_name(body.model)
        if any(not 0 <= t < engine.vocab_size for t in body.tokens):
            raise OpenAIError(f"tokens must be in [0, {engine.vocab_size})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def version() -> dict:
        return {"version": minivllm.__version__}

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
    engine = EngineConfig()  # the one home of the engine's defaults: no flag restates one
    p.add_argument("--dtype", default=engine.dtype,
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="'auto': bf16 where the CPU does it natively and it pays, see the log")
    p.add_argument("--device", default=engine.device)
    p.add_argument("--block-size", type=int, default=engine.block_size)
    p.add_argument("--num-blocks", type=int, default=engine.num_blocks)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=engine.kv_cache_memory_bytes)
    p.add_argument("--kv-cache-memory", type=float, help="CPU KV-cache budget in GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=engine.gpu_memory_utilization)
    p.add_argument("--max-num-seqs", type=int, default=engine.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=engine.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=engine.max_model_len)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=engine.enable_prefix_caching)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="the same as --no-enable-prefix-caching")
    p.add_argument("--attention-backend", default=engine.attention_backend,
                   choices=["batched", "loop"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=engine.compile,
                   help="compile the decode step (default: $MINIVLLM_COMPILE, on)")
    p.add_argument("--seed", type=int, default=engine.seed)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    limits = ServerOptions()
    p.add_argument("--api-key", default=os.environ.get("MINIVLLM_API_KEY") or None,
                   help="require 'Authorization: Bearer <key>' on /v1/* (default: "
                        "$MINIVLLM_API_KEY; none)")
    p.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes)
    p.add_argument("--max-n", type=int, default=limits.max_n)
    p.add_argument("--max-prompts-per-request", type=int, default=limits.max_prompts_per_request)
    p.add_argument("--max-waiting-requests", type=int, help="503 for new requests while this "
                   "many wait for the running batch (default: unbounded)")
    p.add_argument("--drain-timeout", type=float, default=limits.drain_timeout,
                   help="seconds SIGTERM waits for requests in flight")
    return p.parse_args(argv)


def server_options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                         max_n=args.max_n, max_prompts_per_request=args.max_prompts_per_request,
                         drain_timeout=args.drain_timeout)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    kv_bytes = args.kv_cache_memory_bytes
    if args.kv_cache_memory is not None:
        kv_bytes = int(args.kv_cache_memory * 1024**3)
    options = {
        "dtype": args.dtype, "device": args.device, "block_size": args.block_size,
        "num_blocks": args.num_blocks, "kv_cache_memory_bytes": kv_bytes,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len, "enable_prefix_caching": args.enable_prefix_caching,
        "attention_backend": args.attention_backend, "compile": args.compile, "seed": args.seed}
    return EngineConfig(**({"model": args.model} if args.model else {}), **options)


def main(argv: list[str] | None = None) -> int:
    """Load the model, serve until Ctrl-C / SIGTERM, exit 0."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), datefmt="%H:%M:%S",
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    names = args.served_model_name or [args.model or TINY_MODEL_NAME]
    config = engine_config(args)
    engine = AsyncEngine(lambda: LLMEngine(config), args.max_waiting_requests)
    engine.start()  # loads (and warms up) the model in the thread that will step it
    if os.environ.get("MINIVLLM_FAULT_INJECT"):  # tests only: see inject_faults
        inject_faults(engine.engine, os.environ["MINIVLLM_FAULT_INJECT"])
    if os.environ.get("MINIVLLM_TEST_HOLD_FILE"):  # tests only: see hold_while
        hold_while(engine.engine, os.environ["MINIVLLM_TEST_HOLD_FILE"])
    app = build_app(engine, names, f"minivllm serving {names[0]} on http://{args.host}:{args.port}",
                    server_options(args))
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_graceful_shutdown=5),
                            app.state.guard)
    # uvicorn re-raises the signal that stopped it once it is done; with these handlers in
    # place that re-raise is a no-op, so Ctrl-C and SIGTERM end the process with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0


class InjectedFault(RuntimeError):
    """Raised by ``inject_faults`` inside ``LLMEngine.step``; names the request at fault."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"injected fault (MINIVLLM_FAULT_INJECT) in request {request_id}")
        self.request_id = request_id


def inject_faults(engine: LLMEngine, marker: str) -> None:
    """TEST ONLY (``MINIVLLM_FAULT_INJECT=<marker>``): running the model on a batch that holds
    a request whose prompt contains ``marker`` raises ``InjectedFault`` inside the engine
    thread, before anything is computed. The server must fail that request alone."""
    run_model, poisoned = engine._run_model, {}
    logger.warning("fault injection is on: prompts containing %r fail", marker)

    def run_model_or_fail(scheduled):
        for seq, _ in scheduled:
            if seq.request_id not in poisoned:
                prompt = engine.tokenizer.decode(seq.token_ids[:seq.num_prompt_tokens])
                poisoned[seq.request_id] = marker in prompt
            if poisoned[seq.request_id]:
                raise InjectedFault(seq.request_id)
        return run_model(scheduled)

    engine._run_model = run_model_or_fail


def hold_while(engine: LLMEngine, path: str) -> None:
    """TEST ONLY (``MINIVLLM_TEST_HOLD_FILE=<path>``): while the file ``path`` exists and a
    sequence is running, ``LLMEngine.step`` computes nothing (it waits 10 ms and returns no
    output). New requests are still admitted to the waiting queue, so a test holds the server
    at a known point (one running, others waiting) instead of racing it on a fast machine."""
    step = engine.step
    logger.warning("test hold is on: the engine pauses while %s exists", path)

    def step_or_hold():
        if engine.scheduler.running and os.path.exists(path):
            time.sleep(0.01)
            return []
        return step()

    engine.step = step_or_hold


if __name__ == "__main__" and "get_ipython" not in globals():  # not in the notebook
    sys.exit(main())
