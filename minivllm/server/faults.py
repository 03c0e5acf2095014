# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""TEST ONLY: hooks that plant a fault in one request, or hold the engine at a known point.

Built in notebook 04_openai_server. ``python -m minivllm.serve`` installs them only when
their environment variable is set (``MINIVLLM_FAULT_INJECT``, ``MINIVLLM_TEST_HOLD_FILE``),
so the reliability tests can drive a real server process into states a healthy one
reaches only by chance.
"""

from __future__ import annotations

import logging
import os
import time

from minivllm.engine import LLMEngine

logger = logging.getLogger("minivllm.server")


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
