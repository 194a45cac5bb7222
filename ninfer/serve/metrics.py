"""Prometheus metrics of the HTTP gateway (prometheus-client), one registry per app.

What the gateway can observe truthfully from the public Engine: a request is *queued* from a successful
submit until its ``GenerationStart`` (admission committed its lane), *active* from then until its terminal
result (published after the Engine released the lane), and its usage comes from the result. So
``ninfer_queue_depth`` and ``ninfer_active_lanes`` count this gateway's requests in those two phases.

The context cache's metrics are the Engine's own counters (``Engine.cache_stats()``), read at each
scrape by `EngineCacheCollector`, never counted a second time here. Speculative decoding's come from
each finished request's ``Usage`` (the Engine keeps no server-wide total): drafts, kept drafts, verify
rounds and, per draft position, the rounds that kept the draft there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from ninfer.runtime.engine.context_cache import CacheStats
from ninfer.serve.observability import current_request_id, fields
from ninfer.types import Usage, parse_speculative

log = logging.getLogger("ninfer.serve")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

Phase = Literal["new", "queued", "active", "done"]


class ServeMetrics:
    """All gateway metrics on a private registry (several apps can live in one process)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine_view: Callable[[], EngineView | None] | None = None) -> None:
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
        self.speculative = SpeculativeTotals()
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
        self.engine_cache = EngineCacheCollector(engine_view or (lambda: None), self.speculative)
        r.register(self.engine_cache)

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
        self.request_id = current_request_id.get()  # read here: a drain task may finish the request

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
        if usage is not None and usage.drafted_tokens:
            self._m.speculative.add(usage)
        self._m.requests.labels(self._endpoint, outcome).inc()
        self._m.e2e.observe(now - self.arrival)
        if usage is not None and self.first_token_at is not None and usage.completion_tokens > 1:
            self._m.tpot.observe((now - self.first_token_at) / (usage.completion_tokens - 1))
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s",
                fields(
                    id=self.request_id,
                    endpoint=self._endpoint,
                    outcome=outcome,
                    prompt_tokens=usage.prompt_tokens if usage is not None else None,
                    cached_tokens=usage.reused_prefix_tokens if usage is not None else None,
                    completion_tokens=usage.completion_tokens if usage is not None else None,
                    ttft_s=self.first_token_at - self.arrival if self.first_token_at is not None else None,
                    e2e_s=now - self.arrival,
                ),
            )


class SpeculativeTotals:
    """The speculative counts of every finished request's usage (thread-safe: handlers and drains add)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.drafted = 0
        self.accepted = 0
        self.rounds = 0
        self.by_position: list[int] = []

    def add(self, usage: Usage) -> None:
        with self._lock:
            self.drafted += usage.drafted_tokens
            self.accepted += usage.accepted_draft_tokens
            self.rounds += usage.draft_rounds
            for position, kept in enumerate(usage.accepted_by_position):
                if position == len(self.by_position):
                    self.by_position.append(0)
                self.by_position[position] += kept

    def read(self) -> tuple[int, int, int, tuple[int, ...]]:
        with self._lock:
            return self.drafted, self.accepted, self.rounds, tuple(self.by_position)


class EngineView:
    """What the collector reads from the loaded Engine: its cache counters and its draft depth K."""

    def __init__(
        self, cache_stats: Callable[[], CacheStats], speculative: str | None, kv_pool_tokens: int = 0
    ) -> None:
        self.cache_stats = cache_stats
        self.kv_pool_tokens = kv_pool_tokens
        spec = parse_speculative(speculative)
        self.draft_tokens = spec.draft_tokens if spec is not None else 0


class EngineCacheCollector(Collector):
    """The context cache's counters from ``Engine.cache_stats()`` and the speculative totals, at each
    scrape (zeros while no generation Engine is loaded)."""

    def __init__(self, engine_view: Callable[[], EngineView | None], speculative: SpeculativeTotals) -> None:
        self._view = engine_view
        self._speculative = speculative

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        stats = view.cache_stats() if view is not None else CacheStats()
        yield GaugeMetricFamily(
            "ninfer_prefix_cache_enabled",
            "1 when the Engine runs the context cache",
            value=int(stats.enabled),
        )
        for name, value, text in (
            (
                "queries",
                stats.queries,
                "Admissions that looked for a cached prefix (each request with the cache on, once)",
            ),
            ("hits", stats.hits, "Admissions that continued a cached checkpoint"),
            ("hit_tokens", stats.hit_tokens, "Prompt tokens served from checkpoints, not prefilled"),
            ("captures", stats.captures, "Checkpoints captured inside prompts"),
            ("retains", stats.retains, "Finished turns kept as checkpoints"),
            ("evictions", stats.evictions, "Checkpoints dropped (memory pressure or a reset)"),
            ("offloads", stats.offloads, "Checkpoints moved from the device to the host tier"),
            ("restores", stats.restores, "Checkpoints moved back from the host tier to be continued"),
        ):
            yield CounterMetricFamily(f"ninfer_prefix_cache_{name}", text, value=value)
        checkpoints = GaugeMetricFamily(
            "ninfer_prefix_cache_checkpoints", "Checkpoints the Engine holds", labels=["tier"]
        )
        checkpoints.add_metric(["device"], stats.device_checkpoints)
        checkpoints.add_metric(["host"], stats.host_checkpoints)
        yield checkpoints
        nbytes = GaugeMetricFamily(
            "ninfer_prefix_cache_checkpoint_bytes",
            "Bytes held by checkpoints alone (pages shared with running requests not counted)",
            labels=["tier"],
        )
        nbytes.add_metric(["device"], stats.device_checkpoint_bytes)
        nbytes.add_metric(["host"], stats.host_checkpoint_bytes)
        yield nbytes
        yield GaugeMetricFamily(
            "ninfer_prefix_cache_sessions",
            "Sessions (X-Session-Id) bound to a continuation",
            value=stats.sessions,
        )
        yield GaugeMetricFamily(
            "ninfer_kv_pool_tokens",
            "Positions the shared KV pool holds (active requests and checkpoints), fixed at start",
            value=view.kv_pool_tokens if view is not None else 0,
        )
        drafted, accepted, rounds, by_position = self._speculative.read()
        k = view.draft_tokens if view is not None else 0
        yield CounterMetricFamily(
            "ninfer_spec_decode_draft_tokens",
            "Speculative draft tokens proposed (finished requests)",
            value=drafted,
        )
        yield CounterMetricFamily(
            "ninfer_spec_decode_accepted_tokens", "Draft tokens the verify accepted and kept", value=accepted
        )
        yield CounterMetricFamily(
            "ninfer_spec_decode_verify_rounds", "Verify rounds with drafts, per request row", value=rounds
        )
        per_position = CounterMetricFamily(
            "ninfer_spec_decode_accepted_by_position",
            "Verify rounds whose draft at this position (1 = the first draft) was kept",
            labels=["position"],
        )
        for position in range(max(k, len(by_position))):
            kept = by_position[position] if position < len(by_position) else 0
            per_position.add_metric([str(position + 1)], kept)
        yield per_position
        yield GaugeMetricFamily(
            "ninfer_spec_decode_mean_accepted_length",
            "Tokens a request row gains per verify round, 1 + accepted / rounds (0 before any round)",
            value=1 + accepted / rounds if rounds else 0.0,
        )
