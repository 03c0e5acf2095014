# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The OpenAI-compatible HTTP server behind ``python -m minivllm.serve``, one job per file.

Built in notebook 04_openai_server. One background thread owns the ``LLMEngine`` and runs
``step()`` in a loop; the asyncio front end (FastAPI on uvicorn) never touches the engine:

    HTTP handlers (event loop) ──commands──▶ queue.SimpleQueue ──▶ engine thread: step()
             ▲                                                        │
             └── asyncio.Queue per HTTP request ◀─call_soon_threadsafe─┘ RequestOutputs

A command is a function the engine thread runs between two steps (add requests, abort
them), so the engine is only ever used from one thread. The engine thread sleeps on the
command queue when it has nothing to do. Every HTTP request, whatever it asks for, becomes
engine requests in the same running batch: continuous batching survives the server.

The modules, in the order a request meets them:

* ``cli``: the command line (every engine flag's default is ``EngineConfig``'s), logging,
  uvicorn and its signals;
* ``guard``: ASGI middleware in front of ``/v1/*``: API key, body size, draining;
* ``app``: the FastAPI app and its routes, OpenAI-style errors;
* ``engine_thread``: ``AsyncEngine``, the bridge between the event loop and the engine;
* ``streaming``: a response's body, as Server-Sent Events or one JSON;
* ``metrics``: ``GET /metrics`` in the Prometheus text format, with vLLM's metric names;
* ``faults``: test-only hooks (planted faults, holding the engine at a known point).

Request and response shapes (pydantic models, validation, SSE framing) are in
``minivllm/protocol.py``, built earlier in this notebook.
"""
