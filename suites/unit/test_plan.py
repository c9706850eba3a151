"""kvgate plan's model (kvgate.harness.plan): each term moves the way its inputs say, the sign of
the benefit changes where the measurements say it does, a trace gives reuse and reuse
distance, and bad inputs are typed errors naming the file and field."""

from __future__ import annotations

import json
import math

import pytest

from kvgate.harness.measure import Sample, distributions, samples
from kvgate.harness.plan import Measured, Mix, PlanInputError, RequestClass, load_measured, load_mix, plan
from kvgate.harness.report.plan import markdown

MiB = 2**20


def measured(remote_ms: dict[int, float], cold_ms: dict[int, float], p95_factor: float = 1.2) -> Measured:
    m = Measured(bytes_per_token=1024.0, block_size=128, throughput_Bps={"remote": 4e9},
                 stall={"penalty_ms": 500.0, "prefix_tokens": 4096, "source": "test"},
                 publish_overhead={4096: 0.05}, sources=["test"])
    for L, v in cold_ms.items():
        m.merge_row("cold", L, v, v * 1.1, 5)
    for L, v in remote_ms.items():
        m.merge_row("remote", L, v, v * p95_factor, 5)
    return m


def one(cls: RequestClass, capacity: float = 128 * MiB, fault_rate: float = 0.0) -> dict:
    return plan(measured({1024: 30, 4096: 60, 8192: 90}, {1024: 60, 4096: 370, 8192: 1290}),
                Mix([cls], capacity, load_fault_rate=fault_rate))["classes"][0]


def test_the_gain_is_reuse_times_the_saving_and_interpolates_between_lengths():
    c = one(RequestClass("a", 1.0, 6144, reuse=0.5, reuse_interval_s=1.0, publish=False))
    assert c["T_recompute_how"] == "interpolated" and c["T_recompute_ms"] == pytest.approx((370 + 1290) / 2)
    assert c["T_remote_ms"] == pytest.approx(75.0) and c["retention"] == 1.0  # nothing written: nothing evicts
    assert c["gain_ms"] == pytest.approx(0.5 * (830 - 75))
    assert c["E_benefit_ms"] == c["gain_ms"]  # no faults, no publishing, no other class


def test_a_prefix_longer_than_measured_is_extrapolated_and_flagged():
    c = one(RequestClass("a", 1.0, 16384, reuse=1.0, publish=False))
    assert c["T_recompute_how"] == "extrapolated" and c["T_recompute_ms"] > 1290


def test_the_benefit_changes_sign_where_remote_is_slower_than_recompute():
    m = measured({1024: 80, 4096: 90}, {1024: 60, 4096: 370})
    short = plan(m, Mix([RequestClass("s", 1.0, 1024, reuse=0.9, publish=False)], 128 * MiB))
    long = plan(m, Mix([RequestClass("l", 1.0, 4096, reuse=0.9, publish=False)], 128 * MiB))
    assert short["classes"][0]["E_benefit_ms"] < 0 < long["classes"][0]["E_benefit_ms"]
    assert short["recommendation"]["remote_loads_off"] == ["s"] and long["recommendation"]["remote_loads_on"] == ["l"]
    rule = {(x["prefix_tokens"], x["holds"]) for x in long["rule_p95_remote_below_p50_cold"]}
    assert rule == {(1024, False), (4096, True)}  # p95 96 > 60 at 1k; 108 < 370 at 4k


def test_a_stall_costs_its_measured_penalty_times_the_fault_rate():
    base = one(RequestClass("a", 1.0, 4096, reuse=1.0, publish=False))
    faulted = one(RequestClass("a", 1.0, 4096, reuse=1.0, publish=False), fault_rate=0.1)
    assert faulted["P_stall_ms"] == pytest.approx(0.1 * 500.0)
    assert faulted["E_benefit_ms"] == pytest.approx(base["E_benefit_ms"] - 50.0)


def test_retention_follows_reuse_interval_against_the_pools_characteristic_time():
    """Che's approximation: a small pool under a heavy write stream keeps a rarely reused
    prefix with low probability; a large one keeps it."""
    heavy = RequestClass("w", 10.0, 4096, reuse=0.0)  # 40 MiB/s of pages nobody reads
    doc = RequestClass("d", 0.1, 4096, reuse=1.0, reuse_interval_s=60.0, publish=False)
    m = measured({4096: 60}, {4096: 370})
    small = plan(m, Mix([heavy, doc], 64 * MiB))
    large = plan(m, Mix([heavy, doc], 64 * 1024 * MiB))
    d_small = next(c for c in small["classes"] if c["name"] == "d")
    d_large = next(c for c in large["classes"] if c["name"] == "d")
    t_c = 64 * MiB / (10 * 4096 * 1024)
    assert d_small["retention"] == pytest.approx(1 - math.exp(-t_c / 60.0), rel=1e-3)
    assert d_small["retention"] < 0.05 < 0.9 < d_large["retention"]
    # the writer pays for what its writes evict: the reader's lost gain, per request of the writer
    w_small = next(c for c in small["classes"] if c["name"] == "w")
    assert w_small["P_eviction_ms"] > 0
    assert d_small["reuse_distance_vs_capacity"] > 1 > d_large["reuse_distance_vs_capacity"]
    # applying the recommendation (no publishing of the unread class) restores the reader
    assert small["recommendation"]["publish_boundary_tokens"]["w"] == 0
    assert small["recommendation"]["E_total_ms_per_s_applied"] > small["E_total_ms_per_s"]


def test_byte_rates_and_warmup_come_from_bytes_per_token_and_the_measured_link():
    m = measured({4096: 60}, {4096: 370})
    mix = Mix([RequestClass("a", 2.0, 4096, reuse=0.5, reuse_interval_s=1.0)], 1024 * MiB,
              warmup={"new_replicas": 10, "window_s": 2.0})
    doc = plan(m, mix)
    c = doc["classes"][0]
    assert c["load_bytes"] == 4096 * 1024
    assert doc["rates"]["R_read_Bps"] == pytest.approx(2.0 * c["h_remote"] * 4096 * 1024, rel=1e-6)
    assert doc["rates"]["R_write_Bps"] == pytest.approx(2.0 * (1 - c["h_remote"]) * 4096 * 1024, rel=1e-6)
    w = doc["warmup"]
    assert w["needed_Bps"] == pytest.approx(10 * 4096 * 1024 / 2.0, rel=1e-6) and w["fits"]
    assert "## Warm-up" in markdown(doc) and "E[benefit]" in markdown(doc)


def test_a_trace_gives_rate_reuse_and_reuse_distance(tmp_path):
    lines = [{"pool": {"capacity_bytes": 64 * MiB}}]
    t = 0.0
    for i in range(10):  # prefix P on alternating replicas, a new unique prefix between each of its requests
        lines.append({"t": t, "prefix": "P", "prefix_tokens": 2048, "tail_tokens": 100, "replica": "AB"[i % 2]})
        lines.append({"t": t + 0.5, "prefix": f"u{i}", "prefix_tokens": 1024, "replica": "A"})
        t += 1.0
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    mix = load_mix(path)
    p = next(c for c in mix.classes if c.name == "P")
    assert p.reuse == pytest.approx(0.9) and p.reuse_interval_s == pytest.approx(1.0)
    assert p.reuse_distance_bytes == 1024  # one unique 1024-token prefix between two of its requests (in tokens)
    assert p.rate_rps == pytest.approx(10 / 9.5) and p.tail_tokens == 100
    doc = plan(measured({2048: 50, 1024: 30}, {2048: 130, 1024: 60}), mix)
    row = next(c for c in doc["classes"] if c["name"] == "P")
    assert row["reuse_distance_bytes"] == 1024 * 1024 and row["reuse_distance_source"].startswith("trace")


@pytest.mark.parametrize("doc, words", [
    ({"classes": [{"name": "a", "rate_rps": 1, "prefix_tokens": 10, "colour": "red"}], "pool": {"capacity_bytes": 1}},
     "unknown fields ['colour']"),
    ({"classes": [{"name": "a", "rate_rps": 1, "prefix_tokens": 10, "reuse": 1.5}], "pool": {"capacity_bytes": 1}},
     "not a share"),
    ({"classes": [{"name": "a", "rate_rps": 1, "prefix_tokens": 10}]}, "pool.capacity_bytes is required"),
    ({"classes": []}, "no classes"),
    ({"classes": [{"name": "a", "rate_rps": 1, "prefix_tokens": 10, "source": "moon"}], "pool": {"capacity_bytes": 1}},
     "source 'moon'"),
])
def test_a_bad_mix_is_a_typed_error_naming_the_field(tmp_path, doc, words):
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanInputError, match=words.replace("[", r"\[").replace("]", r"\]")):
        load_mix(path)


def test_measurements_without_a_cold_baseline_are_refused(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"systems": [{"system": "default", "geometry": None, "samples": [], "timeline": [],
                                             "misses": []}]}))
    with pytest.raises(PlanInputError, match="no cold prefill"):
        load_measured([path])
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(PlanInputError, match="not a measurements.json"):
        load_measured([other])


def _hist(tag, replica, outcome, prompt, ttft, local=0, external=0, failed=(), tier=0, t=0.0):
    recs = [{"ev": "lookup", "role": "scheduler", "replica": replica, "tag": tag, "t": t, "outcome": outcome,
             "prompt_tokens": prompt, "local_tokens": local, "external_tokens": external, "tier_blocks": tier,
             "miss_cause": None if outcome != "miss" else "never_published"}]
    if outcome == "remote_hit":
        recs.append({"ev": "load", "role": "worker", "replica": replica, "tag": tag, "t": t + 0.01,
                     "failed_block_ids": list(failed)})
    recs.append({"ev": "request", "phase": "ok", "replica": replica, "tag": tag, "t": t + 0.1, "ttft_s": ttft})
    return recs


def test_a_runs_history_gives_each_requests_hit_kind_and_ttft(tmp_path):
    recs = (_hist("c", "A", "miss", 1024, 0.06) + _hist("l", "A", "local_hit", 1024, 0.03, local=896)
            + _hist("r", "B", "remote_hit", 1024, 0.04, external=896) + _hist("f", "B", "remote_hit", 1024, 0.2,
                                                                              external=896, failed=[3])
            + _hist("t", "B", "remote_hit", 1024, 0.05, external=896, tier=7)
            + [{"ev": "request", "phase": "ok", "replica": "P", "tag": "peer", "t": 1, "ttft_s": 0.01}])
    found = {s.tag: s for s in samples(recs)}
    assert {t: s.kind for t, s in found.items()} == {"c": "cold", "l": "local", "r": "remote", "f": "fallback",
                                                    "t": "tier"}  # a replica without lookup records is left out
    assert found["f"].hit_tokens == 0 and found["r"].hit_tokens == 896 and found["c"].miss_cause == "never_published"
    d = distributions(list(found.values()))
    assert d["cold"][1024] == {"n": 1, "p50_ms": 60.0, "p95_ms": 60.0}
    path = tmp_path / "measurements.json"
    path.write_text(json.dumps({"systems": [{"system": "default", "samples": [s.as_dict() for s in found.values()],
                                             "geometry": {"bytes_per_token": 1024, "block_size": 128},
                                             "timeline": [], "misses": []}]}))
    m = load_measured([path])
    assert m.by_kind["remote"][1024]["p50_ms"] == 40.0 and m.bytes_per_token == 1024
    assert m.stall is not None and m.stall["penalty_ms"] == pytest.approx(140.0)  # the fallback against cold
    assert isinstance(Sample(**found["c"].as_dict()), Sample)


def test_a_request_is_faulted_by_its_own_replicas_faults_and_by_the_nemesis_only():
    recs = []
    for tag, replica, t in (("x", "A", 0.0), ("y", "B", 0.0), ("z", "A", 10.0)):
        recs.append({"ev": "request", "phase": "invoke", "replica": replica, "tag": tag, "t": t})
        recs += _hist(tag, replica, "miss", 1024, 0.05, t=t + 0.5)
    recs.append({"ev": "fault", "replica": "B", "t": 0.3, "kind": "corrupt"})  # while x and y ran, on B
    recs.append({"ev": "nemesis", "replica": "harness", "t": 10.2, "action": "pool_kill"})  # while z ran
    recs.sort(key=lambda r: r["t"])
    assert {s.tag: s.faulted for s in samples(recs)} == {"x": False, "y": True, "z": True}


def test_dispatch_is_the_send_to_the_first_lookup_call():
    recs = [{"ev": "request", "phase": "invoke", "replica": "A", "tag": "d", "t": 1.0}]
    recs += _hist("d", "A", "miss", 1024, 0.09, t=1.05)
    recs[1]["lookup_us"] = 10_000.0  # the call took 10 ms: it began at 1.04
    (s,) = samples(recs)
    assert s.dispatch_ms == pytest.approx(40.0)
