"""/metrics reads the host tier from ``Engine.cache_stats()``: checkpoints and bytes per tier (``tier``
label ``device`` and ``host``, the device's being every tier's less the host's), offloads and restores."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ninfer.runtime.engine.context_cache import CacheStats
from ninfer.serve.metrics import EngineCacheCollector, EngineView, SpeculativeTotals


def test_the_host_tier_is_its_own_series() -> None:
    stats = CacheStats(
        enabled=True, checkpoints=7, checkpoint_bytes=7000, host_checkpoints=5, host_checkpoint_bytes=4000,
        evictions=2, offloads=9, restores=4,
    )  # fmt: skip
    registry = CollectorRegistry()
    registry.register(EngineCacheCollector(lambda: EngineView(lambda: stats, None), SpeculativeTotals()))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert samples[("ninfer_prefix_cache_checkpoints", (("tier", "device"),))] == 2
    assert samples[("ninfer_prefix_cache_checkpoints", (("tier", "host"),))] == 5
    assert samples[("ninfer_prefix_cache_checkpoint_bytes", (("tier", "device"),))] == 3000
    assert samples[("ninfer_prefix_cache_checkpoint_bytes", (("tier", "host"),))] == 4000
    assert samples[("ninfer_prefix_cache_offloads_total", ())] == 9
    assert samples[("ninfer_prefix_cache_restores_total", ())] == 4
    assert samples[("ninfer_prefix_cache_evictions_total", ())] == 2
