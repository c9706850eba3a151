"""kvpool's counters in vLLM's KV-connector stats, so they reach each replica's own
`/metrics` (vLLM's Prometheus endpoint) and its periodic log line, and the worker's tier
loads reach the scheduler's tier rule (kvpool.tier.rule).

  KVPoolStats      one interval's measurements, in vLLM's KVConnectorStats shape. `data`
                   holds plain dicts and lists (it crosses process boundaries as vLLM
                   serializes it):
                     lookups      {outcome: n}  the scheduler's lookups: remote_hit, tier_hit,
                                  local_hit, miss, skipped; and via_probe (claimed from the
                                  segment's index, no round trip)
                     misses       {cause: n}    lookups' and loads' miss causes
                     loads        [[source, wanted, loaded, seconds, bytes, cause], ...]
                                  each finished load of the worker (source: pool, tier)
                     published    {"blocks": n, "bytes": n}  blocks the worker committed
                     tier_loads   [[wanted, loaded, seconds, cause], ...]  what the tier rule reads
  KVPoolPromMetrics
                   registered by vLLM through KVPoolConnector.build_prom_metrics, observing
                   each KVPoolStats on the engine's metrics: vllm:kvpool_lookups{outcome},
                   vllm:kvpool_misses{cause}, vllm:kvpool_loaded_blocks{source},
                   vllm:kvpool_loaded_bytes{source}, vllm:kvpool_failed_loads{source,cause},
                   vllm:kvpool_load_seconds{source} (histogram), vllm:kvpool_published_blocks,
                   vllm:kvpool_published_bytes.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from kvpool.errors import MissCause
from kvpool.tier.rule import TierLoadStat

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:  # pragma: no cover - a vLLM without connector stats: nothing is exported
    KVConnectorPromMetrics = object  # type: ignore[assignment,misc]

    @dataclasses.dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict = dataclasses.field(default_factory=dict)

LOOKUP_OUTCOMES = ("remote_hit", "tier_hit", "local_hit", "miss", "skipped", "via_probe")
LOAD_SOURCES = ("pool", "tier")
_LOAD_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


def _empty() -> dict[str, Any]:
    return {"lookups": {}, "misses": {}, "loads": [], "published": {"blocks": 0, "bytes": 0}, "tier_loads": []}


def is_kvpool_data(data: object) -> bool:
    """Whether connector-stats data has kvpool's shape (a wrapper's logger must tell)."""
    return isinstance(data, dict) and bool(data) and set(data) <= set(_empty())


def _add(a: dict, b: dict) -> dict:
    out = Counter(a)
    out.update(b)
    return dict(out)


@dataclasses.dataclass
class KVPoolStats(KVConnectorStats):
    def __post_init__(self) -> None:
        self.data = {**_empty(), **(self.data or {})}

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVPoolStats:
        o = {**_empty(), **(getattr(other, "data", None) or {})}
        d = self.data
        return KVPoolStats(data={
            "lookups": _add(d["lookups"], o["lookups"]), "misses": _add(d["misses"], o["misses"]),
            "loads": [*d["loads"], *o["loads"]],
            "published": _add(d["published"], o["published"]),
            "tier_loads": [*d["tier_loads"], *o["tier_loads"]],
        })

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {f"lookups_{k}": v for k, v in sorted(d["lookups"].items())}
        out.update({f"misses_{k}": v for k, v in sorted(d["misses"].items())})
        for source in LOAD_SOURCES:
            loads = [x for x in d["loads"] if x[0] == source]
            if loads:
                out[f"{source}_loads"] = len(loads)
                out[f"{source}_blocks_loaded"] = sum(x[2] for x in loads)
                out[f"{source}_blocks_failed"] = sum(x[1] - x[2] for x in loads)
                out[f"{source}_load_seconds"] = round(sum(x[3] for x in loads), 6)
        if d["published"].get("blocks"):
            out["published_blocks"] = d["published"]["blocks"]
            out["published_bytes"] = d["published"]["bytes"]
        return out

    def is_empty(self) -> bool:
        d = self.data
        return not (d["lookups"] or d["misses"] or d["loads"] or d["published"].get("blocks") or d["tier_loads"])

    def tier_load_stats(self) -> list[TierLoadStat]:
        return [TierLoadStat.of(x) for x in self.data.get("tier_loads", ())]


class StatsCollector:
    """A thread-safe accumulator of one side's counters between two take() calls."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._data = _empty()

    def lookup(self, outcome: str, cause: str | None = None, via_probe: bool = False) -> None:
        with self._lock:
            self._data["lookups"][outcome] = self._data["lookups"].get(outcome, 0) + 1
            if via_probe:
                self._data["lookups"]["via_probe"] = self._data["lookups"].get("via_probe", 0) + 1
            if cause:
                self._data["misses"][cause] = self._data["misses"].get(cause, 0) + 1

    def load(self, source: str, wanted: int, loaded: int, seconds: float, nbytes: int, cause: str | None) -> None:
        with self._lock:
            self._data["loads"].append([source, wanted, loaded, round(seconds, 6), nbytes, cause])
            if cause:
                self._data["misses"][cause] = self._data["misses"].get(cause, 0) + 1
            if source == "tier":
                self._data["tier_loads"].append(TierLoadStat(wanted, loaded, seconds, cause).as_list())

    def published(self, blocks: int, nbytes: int) -> None:
        with self._lock:
            self._data["published"]["blocks"] += blocks
            self._data["published"]["bytes"] += nbytes

    def take(self) -> KVPoolStats | None:
        with self._lock:
            data, self._data = self._data, _empty()
        stats = KVPoolStats(data=data)
        return None if stats.is_empty() else stats


class KVPoolPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc,valid-type]
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # noqa: ANN001
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter, hist = self._counter_cls, self._histogram_cls

        def per_engine(metric, *extra):  # noqa: ANN001, ANN002, ANN202 - one child per engine and extra label values
            return {idx: metric.labels(*values, *extra) for idx, values in self.per_engine_labelvalues.items()}

        lookups = counter(name="vllm:kvpool_lookups", documentation="kvpool lookups by outcome",
                          labelnames=[*labelnames, "outcome"])
        self.lookups = {o: per_engine(lookups, o) for o in LOOKUP_OUTCOMES}
        misses = counter(name="vllm:kvpool_misses", documentation="kvpool misses by cause (lookups and loads)",
                         labelnames=[*labelnames, "cause"])
        self.misses = {c.value: per_engine(misses, c.value) for c in MissCause}
        blocks = counter(name="vllm:kvpool_loaded_blocks", documentation="KV blocks loaded, by source",
                         labelnames=[*labelnames, "source"])
        nbytes = counter(name="vllm:kvpool_loaded_bytes", documentation="KV bytes loaded, by source",
                         labelnames=[*labelnames, "source"])
        seconds = hist(name="vllm:kvpool_load_seconds", documentation="kvpool load latency, by source",
                       buckets=list(_LOAD_BUCKETS), labelnames=[*labelnames, "source"])
        failed = counter(name="vllm:kvpool_failed_loads", documentation="loads that did not install every block, "
                         "by source and cause", labelnames=[*labelnames, "source", "cause"])
        self.blocks = {s: per_engine(blocks, s) for s in LOAD_SOURCES}
        self.bytes = {s: per_engine(nbytes, s) for s in LOAD_SOURCES}
        self.seconds = {s: per_engine(seconds, s) for s in LOAD_SOURCES}
        self.failed = {(s, c.value): per_engine(failed, s, c.value) for s in LOAD_SOURCES for c in MissCause}
        pub_blocks = counter(name="vllm:kvpool_published_blocks", documentation="KV blocks committed to the pool",
                             labelnames=labelnames)
        pub_bytes = counter(name="vllm:kvpool_published_bytes", documentation="KV bytes committed to the pool",
                            labelnames=labelnames)
        self.pub_blocks = per_engine(pub_blocks)
        self.pub_bytes = per_engine(pub_bytes)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = {**_empty(), **(transfer_stats_data or {})}
        for outcome, n in d["lookups"].items():
            if outcome in self.lookups:
                self.lookups[outcome][engine_idx].inc(n)
        for cause, n in d["misses"].items():
            if cause in self.misses:
                self.misses[cause][engine_idx].inc(n)
        for source, wanted, loaded, secs, nb, cause in d["loads"]:
            if source not in self.blocks:
                continue
            self.blocks[source][engine_idx].inc(loaded)
            self.bytes[source][engine_idx].inc(nb)
            self.seconds[source][engine_idx].observe(secs)
            if loaded < wanted and (source, cause) in self.failed:
                self.failed[(source, cause)][engine_idx].inc()
        self.pub_blocks[engine_idx].inc(d["published"].get("blocks", 0))
        self.pub_bytes[engine_idx].inc(d["published"].get("bytes", 0))
