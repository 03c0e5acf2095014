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


FAULT_POINTS = ("model", "sample", "stop", "detokenize", "nan")


def inject_faults(engine: LLMEngine, spec: str) -> None:
    """TEST ONLY (``MINIVLLM_FAULT_INJECT=[<point>:]<marker>``): plant a fault at one point of
    ``LLMEngine.step`` for every request whose prompt contains ``marker``:

    * ``model`` (the default): running the model on a batch that holds such a request raises
      ``InjectedFault`` before anything is computed (the server fails it and steps again);
    * ``sample``: sampling its row raises; ``stop``: checking its stop conditions raises;
      ``detokenize``: turning its new token into text raises;
    * ``nan``: its logits are NaN.

    Only that request may fail; the others in the same steps must carry on unchanged.
    """
    point, _, marker = spec.rpartition(":")
    point = point or "model"
    if point not in FAULT_POINTS:
        raise ValueError(f"unknown fault point {point!r}; choose from {', '.join(FAULT_POINTS)}")
    poisoned: dict[str, bool] = {}
    logger.warning("fault injection is on: %s faults for prompts containing %r", point, marker)

    def is_poisoned(seq) -> bool:
        if seq.request_id not in poisoned:
            prompt = engine.tokenizer.decode(seq.token_ids[:seq.num_prompt_tokens])
            poisoned[seq.request_id] = marker in prompt
        return poisoned[seq.request_id]

    def fail_if_poisoned(seqs) -> None:
        for seq in seqs:
            if is_poisoned(seq):
                raise InjectedFault(seq.request_id)

    # Each fault wraps a public method of the engine's parts: the runner's execute (the whole
    # step) and sample (its rows), a speculative runner's accept (notebook 08: a speculating
    # row's tokens), the scheduler's check_stop, the output processor's add_token.
    runner = engine.runner
    base = getattr(runner, "runner", runner)  # a wrapping runner (speculative) holds the base
    accepts = getattr(runner, "accept", None)
    if point == "model":
        execute = runner.execute

        def execute_or_fail(plan):
            fail_if_poisoned([seq for seq, _ in plan.scheduled])
            return execute(plan)

        runner.execute = execute_or_fail
    elif point in ("sample", "nan"):
        sample = base.sample

        def sample_with_fault(logits, seqs, out, sample_logits=None):
            if point == "nan":  # the poisoned rows' logits are NaN
                bad = [row for row, seq in enumerate(seqs) if is_poisoned(seq)]
                if bad:
                    logits = logits.clone()
                    logits[bad] = float("nan")
                return sample(logits, seqs, out, sample_logits)
            inner = sample_logits or base.sample_logits

            def sample_or_fail(logits, seqs):
                fail_if_poisoned(seqs)
                return inner(logits, seqs)

            return sample(logits, seqs, out, sample_or_fail)

        base.sample = sample_with_fault
        if accepts is not None:
            def accept_with_fault(seq, draft, logits):
                if point == "nan":
                    return accepts(seq, draft, logits * float("nan") if is_poisoned(seq) else logits)
                fail_if_poisoned([seq])
                return accepts(seq, draft, logits)

            runner.accept = accept_with_fault
    elif point == "stop":
        check_stop = engine.scheduler.check_stop

        def check_stop_or_fail(seq, token):
            fail_if_poisoned([seq])
            return check_stop(seq, token)

        engine.scheduler.check_stop = check_stop_or_fail
    else:  # detokenize: turning its new token into text raises
        add_token = engine.outputs.add_token

        def add_token_or_fail(seq, token, finishing):
            fail_if_poisoned([seq])
            return add_token(seq, token, finishing)

        engine.outputs.add_token = add_token_or_fail


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
