# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The FastAPI app: the OpenAI routes, vLLM's extra ones, and OpenAI-style errors.

Built in notebook 04_openai_server.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import minivllm
from minivllm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Job,
    OpenAIError,
    TokenizeRequest,
    chat_job,
    completion_job,
)
from minivllm.server.engine_thread import AsyncEngine
from minivllm.server.guard import Guard, ServerOptions, error_response
from minivllm.server.metrics import CONTENT_TYPE, ServerMetrics
from minivllm.server.streaming import final_outputs, stream_events
from minivllm.tokenizer import Tokenizer

logger = logging.getLogger("minivllm.server")


def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.error("internal error", exc_info=exc)
    return error_response(OpenAIError(f"internal error: {exc!r}", status=500))


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI says 422; OpenAI and vLLM say 400. Malformed JSON lands here too."""
    errors = exc.errors()
    if errors and errors[0]["type"] == "json_invalid":
        return error_response(OpenAIError(f"malformed JSON body: {errors[0]['ctx']['error']} "
                                           f"at position {errors[0]['loc'][-1]}"))
    where = [".".join(map(str, e["loc"][1:])) or "body" for e in errors]
    message = "; ".join(f"{w}: {e['msg']}" for w, e in zip(where, errors))
    return error_response(OpenAIError(message or "invalid request", param=where[0] if where else None))


def build_app(engine: AsyncEngine, served_model_names: list[str],
              announce: str | None = None, options: ServerOptions | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine thread.

    ``app.state.guard`` is the ``Guard`` middleware in front of it (limits, key, draining).
    """
    tokenizer = Tokenizer.from_pretrained(engine.model_path)  # the front end's own copy
    default_name = served_model_names[0]
    options = options or ServerOptions()
    metrics = engine.metrics = ServerMetrics(default_name, lambda: engine.stats,
                                             options.log_requests)

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
    app.add_exception_handler(OpenAIError, lambda _, e: error_response(e))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, lambda _, e: error_response(
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
        return {**engine.stats, "decode_step": engine.decode_step}

    @app.get("/metrics")  # open like /health (no API key), as in vLLM: counts, never text
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

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
