"""vLLM-named aliases of the gateway's metrics, so dashboards built for vLLM read a NInfer server.

At each scrape `VllmAliases` re-emits, under vLLM's name and with vLLM's ``model_name`` label, the series
that mean the same thing in both servers (docs/cli-and-http.md, "vLLM dashboards", has the table). Series
whose units differ (vLLM's prefix-cache queries and hits count tokens, NInfer's queries count admissions)
get no alias. Nothing is counted twice: the values are read from the ``ninfer_*`` metrics themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ninfer.serve.metrics import ServeMetrics

# ninfer name (as collected, without _total) -> vLLM name
GAUGES = {
    "ninfer_active_lanes": "vllm:num_requests_running",
    "ninfer_queue_depth": "vllm:num_requests_waiting",
}
COUNTERS = {
    "ninfer_prompt_tokens": "vllm:prompt_tokens",
    "ninfer_generation_tokens": "vllm:generation_tokens",
    "ninfer_spec_decode_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "ninfer_spec_decode_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "ninfer_spec_decode_verify_rounds": "vllm:spec_decode_num_drafts",
}
HISTOGRAMS = {
    "ninfer_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "ninfer_time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "ninfer_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}
FINISHED = ("stop", "length", "cancelled")  # the outcomes vLLM's request_success counts as finished_reason
KV_USAGE = "vllm:kv_cache_usage_perc"  # a fraction 0..1, as vLLM's despite the name


class VllmAliases(Collector):
    def __init__(self, metrics: ServeMetrics, model_name: str, kv_used: Callable[[], float | None]) -> None:
        self._metrics = metrics
        self._model = model_name
        self._kv_used = kv_used

    def _families(self) -> Iterator[Metric]:
        m = self._metrics
        for source in (m.requests, m.queue_depth, m.active_lanes, m.prompt_tokens, m.generation_tokens,
                       m.ttft, m.tpot, m.e2e, m.engine_cache):  # fmt: skip
            yield from source.collect()

    def collect(self) -> Iterator[Metric]:
        model = self._model
        finished: dict[str, float] = {}
        accepted_per_pos: list[tuple[str, float]] = []
        for family in self._families():
            name = family.name
            if name in GAUGES:
                gauge = GaugeMetricFamily(GAUGES[name], family.documentation, labels=["model_name"])
                gauge.add_metric([model], _value(family))
                yield gauge
            elif name in COUNTERS:
                out = CounterMetricFamily(COUNTERS[name], family.documentation, labels=["model_name"])
                out.add_metric([model], _value(family, "_total"))
                yield out
            elif name in HISTOGRAMS:
                out = HistogramMetricFamily(HISTOGRAMS[name], family.documentation, labels=["model_name"])
                buckets = [(s.labels["le"], s.value) for s in family.samples if s.name.endswith("_bucket")]
                out.add_metric([model], buckets, sum_value=_value(family, "_sum"))
                yield out
            elif name == "ninfer_requests":
                for s in family.samples:
                    reason = s.labels.get("outcome", "")
                    if s.name.endswith("_total") and reason in FINISHED:
                        finished[reason] = finished.get(reason, 0.0) + s.value
            elif name == "ninfer_spec_decode_accepted_by_position":
                accepted_per_pos = [
                    (str(int(s.labels["position"]) - 1), s.value)
                    for s in family.samples
                    if s.name.endswith("_total")
                ]
        success = CounterMetricFamily(
            "vllm:request_success",
            "Finished requests by finish reason",
            labels=["model_name", "finished_reason"],
        )
        for reason in FINISHED:
            success.add_metric(
                [model, "abort" if reason == "cancelled" else reason], finished.get(reason, 0.0)
            )
        yield success
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens per draft position (0 = the first draft)",
            labels=["model_name", "position"],
        )
        for position, value in accepted_per_pos:
            per_pos.add_metric([model, position], value)
        yield per_pos
        kv = self._kv_used()
        text = "Fraction of the Engine's KV pages in use by requests or held by cached checkpoints (0..1)"
        yield GaugeMetricFamily("ninfer_kv_cache_usage", text, value=kv if kv is not None else 0.0)
        usage = GaugeMetricFamily(KV_USAGE, text, labels=["model_name"])
        usage.add_metric([model], kv if kv is not None else 0.0)
        yield usage


def _value(family: Metric, suffix: str = "") -> float:
    for sample in family.samples:
        if sample.name == family.name + suffix and not sample.labels:
            return float(sample.value)
    return 0.0
