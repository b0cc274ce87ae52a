"""Prometheus metrics of ``sparkq serve`` (``GET /metrics``, prometheus-client's text format): requests
by endpoint and status, prompt / completion / prefix-cached tokens, time to first token and
inter-token latency histograms, queue depth and slots in use. One registry per app (the engine's
hooks observe on its thread; prometheus-client's metrics are thread-safe)."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sparkq_requests", "HTTP requests to the API", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("sparkq_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("sparkq_completion_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter("sparkq_prefix_cached_tokens", "prompt tokens taken from the prefix cache",
                                     registry=r)
        self.ttft = Histogram("sparkq_time_to_first_token_seconds", "submit to first token", buckets=LATENCY, registry=r)
        self.itl = Histogram("sparkq_inter_token_seconds", "between a request's consecutive tokens", buckets=LATENCY,
                             registry=r)
        Gauge("sparkq_queue_depth", "requests waiting for a slot", registry=r).set_function(lambda: len(engine.waiting))
        Gauge("sparkq_slots_in_use", "KV slots holding a request", registry=r).set_function(
            lambda: engine.parallel - len(engine.free))
        Gauge("sparkq_slots", "KV slots (--parallel)", registry=r).set(engine.parallel)

    # the engine's hooks (its thread)
    def token(self, r) -> None:
        now = time.perf_counter()
        if len(r.new) == 1:
            self.ttft.observe(now - r.t_submit)
        else:
            self.itl.observe(now - r.t_last)
        r.t_last = now

    def finished(self, r) -> None:
        self.prompt_tokens.inc(len(r.ids))
        self.completion_tokens.inc(len(r.new))
        self.cached_tokens.inc(r.cached)

    def render(self) -> bytes:
        return generate_latest(self.registry)
