"""The scale simulation (kvgate.harness.sim): it replays from its seed, it agrees with what can be
worked out by hand on deterministic inputs, and each mitigation acts as its rule says."""

from __future__ import annotations

import dataclasses

import pytest

from kvgate.harness.plan import Measured
from kvgate.harness.sim import SimClass, SimConfig, run_scale, simulate

L = 4096


def measured(cold=400.0, local=50.0, remote=80.0, spread=1.0, link=1e9) -> Measured:
    m = Measured(bytes_per_token=1024.0, block_size=128, throughput_Bps={"remote": link, "tier": link / 10})
    for kind, v in (("cold", cold), ("local", local), ("remote", remote), ("tier", remote * 1.5)):
        m.merge_row(kind, L, v, v * spread, 5)
    return m


HOT = (SimClass("hot", 0.0, L, hot_prefixes=1),)


def test_a_run_replays_from_its_seed():
    cfg = SimConfig(8, (SimClass("a", 20.0, L, hot_prefixes=50),), duration_s=20.0, seed=3, warm_replicas=0,
                    capacity_bytes=20 * L * 1024, keep_samples=True)
    m = measured(spread=1.5)
    assert simulate(m, cfg) == simulate(m, cfg)
    assert simulate(m, cfg)["samples"] != simulate(m, dataclasses.replace(cfg, seed=4))["samples"]


def test_cold_requests_on_one_engine_queue_one_after_another():
    """Deterministic service (p95 = p50): five requests of one prefix at once on one
    replica: the first computes it (400 ms), the others find it in the engine's own cache
    when their turn comes, 50 ms each after it."""
    cfg = SimConfig(1, HOT, duration_s=0.0, warm_replicas=0, pool_warm=False, burst=5, remote_loads=False)
    doc = simulate(measured(), cfg)
    assert doc["kinds"] == {"cold": {"n": 1, "p50_ms": 400.0, "p95_ms": 400.0},
                            "local": {"n": 4, "p50_ms": 525.0, "p95_ms": 600.0}}


def test_a_load_limit_throttles_the_loads_past_it_and_they_recompute():
    m = measured(link=1e7)  # 4 MiB per load: 0.42 s each, so the burst's loads overlap
    free = simulate(m, SimConfig(9, HOT, duration_s=0.0, warm_replicas=1, burst=8))
    limited = simulate(m, SimConfig(9, HOT, duration_s=0.0, warm_replicas=1, burst=8, max_loads=2))
    assert free["kinds"]["remote"]["n"] == 8 and free["peak_loads_in_flight"] == 8
    assert limited["kinds"]["remote"]["n"] == 2 and limited["kinds"]["throttled"]["n"] == 6
    assert limited["peak_loads_in_flight"] == 2


def test_warm_routing_sends_the_burst_to_the_replica_that_holds_the_prefix():
    doc = simulate(measured(), SimConfig(9, HOT, duration_s=0.0, warm_replicas=1, burst=8, warm_routing=True))
    assert doc["kinds"] == {"local": {"n": 8, "p50_ms": 225.0, "p95_ms": 400.0}}  # 8 x 50 ms, one after another


def test_a_degraded_link_past_the_deadline_falls_back_to_recompute():
    cfg = SimConfig(4, HOT, duration_s=0.0, warm_replicas=0, burst=4, link="tier", load_deadline_s=1.0,
                    degrade_factor=1000.0, degrade_from_s=0.0, degrade_until_s=100.0)
    doc = simulate(measured(), cfg)
    assert doc["kinds"]["fallback"]["n"] == 4 and doc["kinds"]["fallback"]["p50_ms"] == pytest.approx(1400.0)
    healthy = simulate(measured(), dataclasses.replace(cfg, degrade_factor=1.0))
    assert healthy["kinds"]["remote"]["n"] == 4


def test_shared_cores_slow_a_burst_that_separate_engines_run_side_by_side():
    cfg = SimConfig(4, (SimClass("hot", 0.0, L, hot_prefixes=10**9, warm=False),), duration_s=0.0, warm_replicas=0,
                    pool_warm=False, burst=3, remote_loads=False)  # three different prefixes
    alone = simulate(measured(), cfg)
    shared = simulate(measured(), dataclasses.replace(cfg, cores=1))
    assert alone["ttft_p50_ms"] == 400.0 and shared["ttft_p50_ms"] == 800.0


def test_every_scale_scenario_runs_at_every_size():
    doc = run_scale(measured(spread=1.3), (8, 16))
    assert {(r["replicas"], r["scenario"]) for r in doc["rows"]} == {
        (n, s) for n in (8, 16) for s in ("fanout", "fanout+load_limit", "fanout+warm_routing", "spike", "degraded",
                                         "degraded+deadline")}
    assert all(r["requests"] > 0 for r in doc["rows"])


def test_a_burst_dispatch_measured_on_shared_cores_applies_on_shared_cores_only():
    m = measured(link=1e15)  # transfers take no time here
    m.merge_row("dispatch", L, 10.0, 10.0, 5)
    m.merge_row("dispatch_burst", L, 500.0, 500.0, 5)
    cfg = SimConfig(4, HOT, duration_s=0.0, warm_replicas=1, burst=3)
    fleet = simulate(m, cfg)  # every replica on its own host: the single-request dispatch
    shared = simulate(m, dataclasses.replace(cfg, cores=4))
    assert fleet["ttft_p50_ms"] == pytest.approx(80.0)  # 10 ms dispatch + 70 ms of service (80 - 10)
    assert shared["ttft_p50_ms"] == pytest.approx(570.0)  # 500 ms in the contended front end + 70
