"""kvpool's connector stats (kvpool.connector.stats): what the scheduler and the workers count, how
intervals and workers add up, and what reaches Prometheus through vLLM's per-connector
metrics (a real prometheus_client registry, observed as vLLM's logger would)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpool.connector.stats import KVPoolPromMetrics, KVPoolStats, StatsCollector, is_kvpool_data


def test_counters_add_up_across_workers_and_intervals():
    a, b = StatsCollector(), StatsCollector()
    a.lookup("remote_hit", via_probe=True)
    a.lookup("miss", "evicted")
    a.load("pool", 4, 4, 0.01, 4 * 131072, None)
    b.load("tier", 4, 1, 1.0, 131072, "timeout")
    b.published(3, 3 * 131072)
    both = a.take().aggregate(b.take())
    assert a.take() is None and b.take() is None  # taken: the next interval starts empty
    r = both.reduce()
    assert r["lookups_remote_hit"] == 1 and r["lookups_via_probe"] == 1 and r["misses_evicted"] == 1
    assert r["misses_timeout"] == 1 and r["pool_blocks_loaded"] == 4 and r["tier_blocks_failed"] == 3
    assert r["published_blocks"] == 3 and r["published_bytes"] == 3 * 131072
    assert [(s.wanted, s.loaded, s.cause) for s in both.tier_load_stats()] == [(4, 1, "timeout")]
    assert is_kvpool_data(both.data) and not is_kvpool_data({"num_failed_transfers": 1})
    both.reset()
    assert both.is_empty() and KVPoolStats().is_empty()


def _factories(registry):  # noqa: ANN001, ANN202
    """vLLM's metric factories: prometheus_client's classes, bound to a registry of our own."""

    def make(cls):  # noqa: ANN001, ANN202
        class Bound(cls):
            def __init__(self, *args, **kw):  # noqa: ANN002, ANN003
                super().__init__(*args, registry=registry, **kw)

        return Bound

    return {Gauge: make(Gauge), Counter: make(Counter), Histogram: make(Histogram)}


def test_observed_stats_appear_on_the_replicas_metrics():
    registry = CollectorRegistry()
    cfg = SimpleNamespace(kv_transfer_config=None)
    prom = KVPoolPromMetrics(cfg, _factories(registry), ["model_name", "engine"], {0: ["tiny", "0"]})
    c = StatsCollector()
    c.lookup("remote_hit")
    c.lookup("miss", "never_published")
    c.load("pool", 8, 5, 0.02, 5 * 1024, "corrupt")
    c.published(2, 2048)
    prom.observe(c.take().data, 0)
    text = generate_latest(registry).decode()
    for line in ('vllm:kvpool_lookups_total{engine="0",model_name="tiny",outcome="remote_hit"} 1.0',
                 'vllm:kvpool_misses_total{cause="never_published",engine="0",model_name="tiny"} 1.0',
                 'vllm:kvpool_misses_total{cause="corrupt",engine="0",model_name="tiny"} 1.0',
                 'vllm:kvpool_loaded_blocks_total{engine="0",model_name="tiny",source="pool"} 5.0',
                 'vllm:kvpool_loaded_bytes_total{engine="0",model_name="tiny",source="pool"} 5120.0',
                 'vllm:kvpool_failed_loads_total{cause="corrupt",engine="0",model_name="tiny",source="pool"} 1.0',
                 'vllm:kvpool_load_seconds_count{engine="0",model_name="tiny",source="pool"} 1.0',
                 'vllm:kvpool_published_blocks_total{engine="0",model_name="tiny"} 2.0'):
        assert line in text, line


@pytest.mark.parametrize("wrapper", ["kvpool.connector.audit:AuditConnector", "kvpool.connector:KVPoolConnector"])
def test_a_wrapped_kvpool_builds_the_same_stats_and_metrics(wrapper):
    from kvpool.connector.wrap import load_class

    cls = load_class(wrapper)
    data = {"lookups": {"miss": 1}, "misses": {"evicted": 1}}
    assert isinstance(cls.build_kv_connector_stats(data), KVPoolStats)
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
    prom = cls.build_prom_metrics(cfg, _factories(CollectorRegistry()), ["engine"], {0: ["0"]})
    assert isinstance(prom, KVPoolPromMetrics)
