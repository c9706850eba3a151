"""Prometheus metrics of the daemon and of a client, each in its own registry.

  PoolMetrics     the daemon: lookups by result, misses by cause, bytes in/out, lease
                  (load) latency, evictions, leased / committed / free pages, lookups
                  that waited for a pending publish (by how the wait ended) and how long;
                  each tenant's pages by state and its evictions.
  ClientMetrics   a client (one per replica): loads by result, misses by cause including
                  the causes only a loader sees (corrupt, transport_error, timeout), load
                  latency, bytes loaded and published; calls to a GPU keeper refused as
                  stale (keeper_stale: kvpool.gpu.tier_client).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpool.errors import MissCause

_LATENCY_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
# How a lookup's wait for a pending publish ended: the publish closed (committed, aborted
# or reclaimed) and the answer no longer stops at an in-flight block; the bound ran out
# (answered MissCause.IN_FLIGHT); the waiting client went away (no answer).
LOOKUP_WAIT_RESULTS = ("settled", "in_flight", "abandoned")


class PoolMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.hits = Counter("kvpool_hits", "Acquires that leased at least one block", ["kind"], registry=r)
        self.hit_blocks = Counter("kvpool_hit_blocks", "Blocks leased for loading", registry=r)
        self.misses = Counter("kvpool_misses", "Lookups or loads that stopped, by cause", ["cause"], registry=r)
        for cause in MissCause:
            self.misses.labels(cause.value)
        self.bytes_written = Counter("kvpool_bytes_written", "Bytes committed into the pool", registry=r)
        self.bytes_read = Counter("kvpool_bytes_read", "Bytes of leased pages handed to loaders", registry=r)
        self.lease_seconds = Histogram("kvpool_lease_seconds", "Acquire to release (load latency seen by the pool)",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.evictions = Counter("kvpool_evictions", "Pages evicted", registry=r)
        self.requests = Counter("kvpool_requests", "Requests served, by op and result", ["op", "result"], registry=r)
        self.pages = Gauge("kvpool_pages", "Pages by state", ["state"], registry=r)
        self.leased_bytes = Gauge("kvpool_leased_bytes", "Bytes of pages under a lease", registry=r)
        self.lookup_waits = Counter("kvpool_lookup_waits", "Lookups that waited for a pending publish, by how "
                                    "the wait ended", ["result"], registry=r)
        for result in LOOKUP_WAIT_RESULTS:
            self.lookup_waits.labels(result)
        self.tenant_pages = Gauge("kvpool_tenant_pages", "Pages of each tenant's segment by state",
                                  ["tenant", "state"], registry=r)
        self.tenant_evictions = Gauge("kvpool_tenant_evictions", "Pages evicted from each tenant's segment",
                                      ["tenant"], registry=r)
        self.lookup_wait_seconds = Histogram("kvpool_lookup_wait_seconds", "Time a lookup waited for pending "
                                             "publishes", buckets=_LATENCY_BUCKETS, registry=r)

    def refresh(self, stats: dict[str, int]) -> None:
        for state in ("free", "committed", "reserved", "leased"):
            self.pages.labels(state).set(stats[f"{state}_pages"])
        self.leased_bytes.set(stats["leased_bytes"])

    def refresh_tenant(self, tenant: str, stats: dict[str, int]) -> None:
        for state in ("free", "committed", "reserved", "leased"):
            self.tenant_pages.labels(tenant, state).set(stats[f"{state}_pages"])
        self.tenant_evictions.labels(tenant).set(stats["evictions"])

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()


class ClientMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.loads = Counter("kvpool_client_loads", "Load attempts by result", ["result"], registry=r)
        self.misses = Counter("kvpool_client_misses", "Misses by cause", ["cause"], registry=r)
        for cause in MissCause:
            self.misses.labels(cause.value)
        self.blocks_loaded = Counter("kvpool_client_blocks_loaded", "Blocks loaded", registry=r)
        self.bytes_loaded = Counter("kvpool_client_bytes_loaded", "Bytes loaded", registry=r)
        self.bytes_published = Counter("kvpool_client_bytes_published", "Bytes published", registry=r)
        self.load_seconds = Histogram("kvpool_client_load_seconds", "Acquire to verified copy",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.keeper_stale = Counter("kvpool_client_keeper_stale",
                                    "GPU tier calls refused: the keeper's heartbeat was stale or the keeper gone "
                                    "(each a transport_error miss that falls through to the host pool)",
                                    registry=r)

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()
