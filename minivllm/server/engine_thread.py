# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""``AsyncEngine``: the engine's own thread, fed by commands, feeding a queue per request.

Built in notebook 04_openai_server. See the package docstring for the picture.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import partial

from minivllm.config import release_freed_memory
from minivllm.engine import LLMEngine, RequestOutput, call_with_frame_room
from minivllm.protocol import OpenAIError, merge_outputs
from minivllm.sampling import SamplingParams

logger = logging.getLogger("minivllm.server")


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
                 max_waiting_requests: int | None = None, burst_gap_s: float = 0.004,
                 burst_window_s: float = 0.025, release_after_idle_s: float | None = 1.0) -> None:
        self.max_waiting_requests = max_waiting_requests  # None: requests wait, unbounded
        # An idle engine woken by a request waits while more keep coming, each within
        # burst_gap_s of the last, for at most burst_window_s (0: step at once; see _run)
        self.burst_gap_s, self.burst_window_s = burst_gap_s, burst_window_s
        # idle this long, it gives the memory its steps freed back to the OS (None: never)
        self.release_after_idle_s = release_after_idle_s
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # the step loop starts from a frame chunk of its own (notebook 03's LLM.generate too)
        self._thread = threading.Thread(target=call_with_frame_room, args=(self._run,),
                                        name="minivllm-engine", daemon=True)
        self._build = engine if callable(engine) else None
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.metrics = None  # a ServerMetrics (build_app sets it), fed by the engine thread
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
        if not self.is_alive:
            raise OpenAIError("the engine loop is not running", status=503)
        self._commands.put(partial(self._add, requests, loop, submission.queue, added,
                                   time.monotonic()))
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
            commands = [self._next_command()] if idle else []  # sleep until there is work
            if idle:
                commands += self._rest_of_burst()
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

    def _next_command(self) -> Callable[[], None] | None:
        """Sleep until the next command comes, the engine being idle. Once it has been idle
        for ``release_after_idle_s``, first hand back to the OS the memory that glibc kept
        when the steps freed their activations (``release_freed_memory``): a server that has
        served a burst shrinks again while it waits, instead of holding its busiest moment's
        heap until it exits. The trim takes a few milliseconds, paid once per idle spell and
        never by a step in progress: only a request that arrives during it waits for it."""
        if self.release_after_idle_s is not None:
            try:
                return self._commands.get(timeout=self.release_after_idle_s)
            except queue.Empty:
                release_freed_memory()
        return self._commands.get()

    def _rest_of_burst(self) -> list[Callable[[], None] | None]:
        """The commands that follow the one that woke an idle engine by less than
        ``burst_gap_s`` each (for at most ``burst_window_s``).

        Requests often come in bursts: a closed-loop client whose previous wave just ended
        sends its next one at once, a batch job sends many. The event loop hands them over a
        few milliseconds apart, and an engine that stepped on the first would prefill it
        alone, then the rest one step later: their first tokens wait a whole extra prefill
        step (8 concurrent 128-token prompts on the 2-core Zen 5: TTFT p50 2.1 s, and 1.6 s
        with each wave in one step).
        Waiting a few milliseconds for the burst puts it in one step. Only an idle engine
        waits: running requests never pay for newcomers. A lone request pays one gap."""
        commands: list[Callable[[], None] | None] = []
        deadline = time.monotonic() + self.burst_window_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                commands.append(self._commands.get(timeout=min(self.burst_gap_s, left)))
            except queue.Empty:
                break
        return commands

    def _add(self, requests, loop, out: asyncio.Queue, added: concurrent.futures.Future,
             arrival_time: float) -> None:
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
                self.engine.add_request(request_id, prompt_ids, params, arrival_time)
                self._streams[request_id] = (loop, out)
        except Exception as e:  # noqa: BLE001 -- any failure fails this request only
            self._abort([request_id for request_id, _, _ in requests])
            added.set_exception(e)
            return
        added.set_result(None)

    def _abort(self, request_ids: list[str], reason: str = "abort") -> None:
        for request_id in request_ids:
            request = self.engine.requests.get(request_id)
            if request is not None and self.metrics is not None:
                self.metrics.record_end(request_id, len(request.seqs), reason)
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
            if getattr(e, "engine_dead", False):  # e.g. a tensor-parallel worker died (M9):
                self._fail(list(self._streams), f"the engine is dead: {e}")  # the loop ends,
                raise  # and /health answers 503
            return
        failed = [out for out in outputs if out.error is not None]  # the engine stopped these
        outputs = [out for out in outputs if out.error is None]  # alone; the rest carry on
        if self.metrics is not None:
            self.metrics.record_step(outputs)
            for out in failed:
                self.metrics.record_end(out.request_id, len(out.outputs), "error")
        routed = self._route([(out.request_id, out) for out in outputs] + [
            (out.request_id, RequestFailed(out.request_id, f"processing the request failed: "
                                                          f"{out.error}")) for out in failed])
        for out in failed:
            self._streams.pop(out.request_id, None)
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
        self._abort(request_ids, "error")
        self.stats = self._snapshot()
        self._send(routed)

    @property
    def decode_step(self) -> str:
        """How decode steps run: "compiling" while notebook 07's runner builds its compiled
        step in the background (steps run eagerly), then "compiled"; "eager" without one.
        Read live, from any thread: the runner's answer is a read, never a swap."""
        return getattr(self.engine.runner, "decode_step", "eager")

    def _snapshot(self) -> dict:
        e = self.engine
        return {**dataclasses.asdict(e.stats), "num_blocks": e.num_blocks,
                "num_free_blocks": e.block_manager.num_free_blocks,
                "num_running": len(e.scheduler.running), "num_waiting": len(e.scheduler.waiting),
                "num_requests_in_flight": len(self._streams),
                "requests_in_flight": sorted(self._streams)}
