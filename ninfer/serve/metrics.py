"""Prometheus metrics of the HTTP gateway (prometheus-client), one registry per app.

What the gateway can observe truthfully from the public Engine: a request is *queued* from a successful
submit until its ``GenerationStart`` (admission committed its lane), *active* from then until its terminal
result (published after the Engine released the lane), and its usage comes from the result. So
``ninfer_queue_depth`` and ``ninfer_active_lanes`` count this gateway's requests in those two phases.
"""

from __future__ import annotations

import threading
import time
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ninfer.types import Usage

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

Phase = Literal["new", "queued", "active", "done"]


class ServeMetrics:
    """All gateway metrics on a private registry (several apps can live in one process)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "ninfer_requests",
            "Requests by endpoint and outcome (stop, length, cancelled, invalid, "
            "queue_full, queue_timeout, engine_failed, engine_unavailable, error)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.queue_depth = Gauge("ninfer_queue_depth", "Submitted requests waiting for admission", registry=r)
        self.active_lanes = Gauge(
            "ninfer_active_lanes",
            "Admitted requests holding an Engine lane (until their lane is released)",
            registry=r,
        )
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("ninfer_generation_tokens", "Generated tokens", registry=r)
        self.prefix_hit_tokens = Counter(
            "ninfer_prefix_cache_hit_tokens", "Prompt tokens served from a cached prefix", registry=r
        )
        self.prefix_queries = Counter(
            "ninfer_prefix_cache_queries", "Admitted requests by prefix-cache result", ["result"], registry=r
        )
        self.scored_tokens = Counter("ninfer_scored_tokens", "Tokens scored (causal_scoring)", registry=r)
        self.ttft = Histogram(
            "ninfer_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "ninfer_time_per_output_token_seconds",
            "Mean time per generated token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "ninfer_e2e_request_latency_seconds",
            "Arrival to terminal result",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_ready = Gauge("ninfer_engine_ready", "1 while the Engine is available", registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, endpoint: str) -> RequestTracker:
        return RequestTracker(self, endpoint)


class RequestTracker:
    """The metric life of one Engine request: queued -> active -> done, each transition exactly once.

    Thread-safe because a cancelled request may be finished by a background drain task while the
    handler unwinds.
    """

    def __init__(self, metrics: ServeMetrics, endpoint: str) -> None:
        self._m = metrics
        self._endpoint = endpoint
        self._lock = threading.Lock()
        self.phase: Phase = "new"
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None

    def queued(self) -> None:
        with self._lock:
            if self.phase == "new":
                self.phase = "queued"
                self._m.queue_depth.inc()

    def started(self, prompt_tokens: int, reused_prefix_tokens: int) -> None:
        with self._lock:
            if self.phase != "queued":
                return
            self.phase = "active"
            self._m.queue_depth.dec()
            self._m.active_lanes.inc()
        self._m.prompt_tokens.inc(prompt_tokens)
        self._m.prefix_queries.labels("hit" if reused_prefix_tokens else "miss").inc()
        if reused_prefix_tokens:
            self._m.prefix_hit_tokens.inc(reused_prefix_tokens)

    def tokens(self, n: int) -> None:
        if n and self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self._m.ttft.observe(self.first_token_at - self.arrival)
        if n:
            self._m.generation_tokens.inc(n)

    def finished(self, outcome: str, usage: Usage | None = None) -> None:
        """Count the outcome once and leave whichever phase the request was in."""
        with self._lock:
            phase, self.phase = self.phase, "done"
        if phase == "done":
            return
        if phase == "queued":
            self._m.queue_depth.dec()
        elif phase == "active":
            self._m.active_lanes.dec()
        now = time.monotonic()
        self._m.requests.labels(self._endpoint, outcome).inc()
        self._m.e2e.observe(now - self.arrival)
        if usage is not None and self.first_token_at is not None and usage.completion_tokens > 1:
            self._m.tpot.observe((now - self.first_token_at) / (usage.completion_tokens - 1))
