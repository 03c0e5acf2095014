# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""What stands in front of ``/v1/*``: the server's limits, its API key, and draining.

Built in notebook 04_openai_server.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import time

import uvicorn
from fastapi.responses import JSONResponse

from minivllm.protocol import OpenAIError

logger = logging.getLogger("minivllm.server")


def error_response(error: OpenAIError) -> JSONResponse:
    """An ``OpenAIError`` as the JSON response OpenAI's API gives: its status, its body."""
    return JSONResponse(error.body(), status_code=error.status)


@dataclasses.dataclass
class ServerOptions:
    """The server's own limits (the engine's are in EngineConfig)."""

    api_key: str | None = None  # require "Authorization: Bearer <key>" on /v1/*
    max_body_bytes: int = 4 * 1024**2  # 413 above this
    max_n: int = 16  # 400 above this
    max_prompts_per_request: int = 64  # 400 above this
    drain_timeout: float = 30.0  # seconds SIGTERM waits for requests in flight
    log_requests: bool = True  # an info line per finished request


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
            return await error_response(error)(scope, receive, send)
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
