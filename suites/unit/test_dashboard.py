"""The Grafana dashboard (dashboards/kvgate.json) plots only series kvgate exports: every
metric name in its queries is registered by the daemon (kvpool.pool.metrics.PoolMetrics) or by
a replica's connector (kvpool.connector.stats.KVPoolPromMetrics)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpool.pool.metrics import PoolMetrics
from kvpool.connector.stats import KVPoolPromMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "kvgate.json"


def exported() -> set[str]:
    names = set()
    registry = CollectorRegistry()

    def bound(cls):  # noqa: ANN001, ANN202
        class Bound(cls):
            def __init__(self, *a, **kw):  # noqa: ANN002, ANN003
                super().__init__(*a, registry=registry, **kw)

        return Bound

    KVPoolPromMetrics(SimpleNamespace(kv_transfer_config=None), {Gauge: bound(Gauge), Counter: bound(Counter),
                                                               Histogram: bound(Histogram)}, ["engine"], {0: ["0"]})
    for reg in (registry, PoolMetrics().registry):
        for family in reg.collect():  # the series of a labelled family exist before any child does
            names.update({"counter": [f"{family.name}_total"], "gauge": [family.name],
                          "histogram": [f"{family.name}_{s}" for s in ("bucket", "count", "sum")]}[family.type])
    return names


def queried(doc: dict) -> set[str]:
    names = set()
    for panel in doc["panels"]:
        for target in panel["targets"]:
            expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", target["expr"])
            for token in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
                if token.startswith(("kvpool_", "vllm:kvpool_")):
                    names.add(token)
    return names


def test_every_dashboard_series_is_exported():
    doc = json.loads(DASHBOARD.read_text())
    names = queried(doc)
    assert len(names) >= 10 and {p["id"] for p in doc["panels"]} == set(range(1, len(doc["panels"]) + 1))
    have = exported()
    missing = sorted(n for n in names if n not in have)
    assert not missing, f"the dashboard queries series nobody exports: {missing}"


def test_control_a_renamed_series_is_caught():
    doc = json.loads(DASHBOARD.read_text())
    doc["panels"][0]["targets"][0]["expr"] = "rate(vllm:kvpool_lookup_total[5m])"  # the singular: not exported
    assert "vllm:kvpool_lookup_total" in queried(doc) - exported()
