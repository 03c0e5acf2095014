# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""``GET /metrics``: what the server did, in the Prometheus text format, with vLLM's names.

Built in notebook 04_openai_server. The names are vLLM's (``vllm:num_requests_running``,
``vllm:time_to_first_token_seconds``, ...) so that dashboards and alerts written for a
vLLM server work unchanged; every series carries vLLM's ``model_name`` label.

Two kinds of series, kept apart on purpose:

* **state** (requests running and waiting, KV-cache usage) and the engine's own running
  totals (prefix-cache lookups and hits, preemptions) are read at scrape time from the
  statistics snapshot the engine thread publishes after every step, so a scrape never
  touches the engine;
* **events** (tokens served, finished requests, latencies) are recorded by the engine thread
  as each step's outputs go out. ``vllm:prompt_tokens_total`` and
  ``vllm:generation_tokens_total`` count exactly what the responses' ``usage`` fields bill.

The same place writes the request log: one info line per finished request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minivllm.engine import RequestOutput

logger = logging.getLogger("minivllm.server")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format

# vLLM's histogram buckets, in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineState:
    """A prometheus_client collector over the engine thread's latest statistics snapshot."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str) -> None:
        self.snapshot, self.model_name = snapshot, model_name

    def collect(self):
        s, labels = self.snapshot(), [self.model_name]

        def family(kind, name: str, doc: str, value: float):
            metric = kind(name, doc, labels=["model_name"])
            metric.add_metric(labels, value)
            return metric

        yield family(GaugeMetricFamily, "vllm:num_requests_running",
                     "Sequences in the running batch.", s["num_running"])
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting",
                     "Sequences waiting to be scheduled (new or preempted).", s["num_waiting"])
        used = 1.0 - s["num_free_blocks"] / s["num_blocks"] if s["num_blocks"] else 0.0
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                     "KV-cache usage: the fraction of blocks held by sequences (1 = 100%).", used)
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache.",
                     s["num_prefix_queried_tokens"])
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits",
                     "Prompt tokens found in the prefix cache.", s["num_prefix_cached_tokens"])
        yield family(CounterMetricFamily, "vllm:num_preemptions",
                     "Sequences preempted (their KV blocks freed, to be recomputed).",
                     s["num_preemptions"])
        if "num_spec_proposed_tokens" in s:  # Milestone 8: speculative decoding
            yield family(CounterMetricFamily, "vllm:spec_decode_num_drafts",
                         "Proposals verified (one per sequence per step).",
                         s["num_spec_verifications"])
            yield family(CounterMetricFamily, "vllm:spec_decode_num_draft_tokens",
                         "Tokens proposed.", s["num_spec_proposed_tokens"])
            yield family(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens",
                         "Proposed tokens the target accepted.", s["num_spec_accepted_tokens"])


class ServerMetrics:
    """The server's Prometheus registry, and the recorder the engine thread calls each step.

    A registry of its own (not prometheus_client's global one), so that two servers in one
    process (tests, notebooks) never share or collide.
    """

    def __init__(self, model_name: str, snapshot: Callable[[], dict],
                 log_requests: bool = True) -> None:
        self.registry = registry = CollectorRegistry()
        self.model_name, self.log_requests = model_name, log_requests
        registry.register(_EngineState(snapshot, model_name))

        def labelled(kind, name: str, doc: str, **kwargs):
            return kind(name, doc, ["model_name"], registry=registry, **kwargs).labels(model_name)

        self.prompt_tokens = labelled(Counter, "vllm:prompt_tokens",
                                      "Prompt tokens of the requests served.")
        self.generation_tokens = labelled(Counter, "vllm:generation_tokens",
                                          "Tokens generated.")
        self.success = Counter("vllm:request_success", "Completions finished, by reason.",
                               ["model_name", "finished_reason"], registry=registry)
        self.ttft = labelled(Histogram, "vllm:time_to_first_token_seconds",
                             "Arrival to first token.", buckets=TTFT_BUCKETS)
        self.itl = labelled(Histogram, "vllm:inter_token_latency_seconds",
                            "Between two steps that gave a request tokens.", buckets=ITL_BUCKETS)
        self.e2e = labelled(Histogram, "vllm:e2e_request_latency_seconds",
                            "Arrival to the last token.", buckets=REQUEST_BUCKETS)
        self.queue = labelled(Histogram, "vllm:request_queue_time_seconds",
                              "Arrival to the first step that computed the request.",
                              buckets=REQUEST_BUCKETS)
        self._last_token_time: dict[str, float] = {}  # engine request id -> last output time
        self._finished: set[tuple[str, int]] = set()  # (request id, completion index) counted

    def render(self) -> bytes:
        """The ``/metrics`` page."""
        return generate_latest(self.registry)

    # -- the engine thread's side

    def record_step(self, outputs: list[RequestOutput]) -> None:
        """Tokens, finishes and latencies of one step's outputs."""
        for out in outputs:
            m, request_id = out.metrics, out.request_id
            self.generation_tokens.inc(sum(len(c.delta_token_ids) for c in out.outputs))
            previous = self._last_token_time.get(request_id)
            if previous is None:  # the request's first output: its prompt is done
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.ttft.observe(m.first_token_time - m.arrival_time)
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
            else:
                self.itl.observe(m.last_token_time - previous)
            self._last_token_time[request_id] = m.last_token_time
            for c in out.outputs:
                if c.finish_reason and (request_id, c.index) not in self._finished:
                    self._finished.add((request_id, c.index))
                    self.success.labels(self.model_name, c.finish_reason).inc()
            if out.finished:
                self._forget(request_id, len(out.outputs))
                self.e2e.observe(m.finished_time - m.arrival_time)
                if self.log_requests:
                    logger.info(
                        "request %s: prompt %d tokens, output %d tokens, ttft %.3f s, "
                        "latency %.3f s, finish %s", request_id, len(out.prompt_token_ids),
                        sum(len(c.token_ids) for c in out.outputs),
                        m.first_token_time - m.arrival_time, m.finished_time - m.arrival_time,
                        ",".join(sorted({c.finish_reason for c in out.outputs})))

    def record_end(self, request_id: str, n: int, reason: str) -> None:
        """A request that ended without a final output: aborted by its client ("abort") or
        failed in the engine ("error")."""
        for index in range(n):
            if (request_id, index) not in self._finished:
                self.success.labels(self.model_name, reason).inc()
        self._forget(request_id, n)
        if self.log_requests:
            logger.info("request %s: %s", request_id, "aborted" if reason == "abort" else reason)

    def _forget(self, request_id: str, n: int) -> None:
        self._last_token_time.pop(request_id, None)
        for index in range(n):
            self._finished.discard((request_id, index))
