"""The GPU live bench's measurement loop (harness.bench.gpu_live.measure) on stand-in
replicas: no GPU and no vLLM, so that the loop, its rows and its targets are exercised
where CI runs. Each kind of request answers with its own time to first token; the rows
must carry them, the ratios between them and the floor, whatever the replicas are."""

from __future__ import annotations

import types

import pytest

import harness.bench.gpu_live as bench

TTFT_MS = {"cold": 900.0, "local": 40.0, "remote": 60.0, "remote-sync": 55.0, "peer-hit": 66.0}


@pytest.fixture
def stand_ins(monkeypatch):
    sent: list[tuple[str, str]] = []

    def complete(url, prompt, *, tag, replica, **kwargs):  # noqa: ANN001, ANN202
        sent.append((replica, tag))
        kind = tag.rsplit("-", 2)[0]
        ms = TTFT_MS.get(kind, 10.0)
        if replica == "D" and kind == "peer-hit":
            ms = 62.0
        return types.SimpleNamespace(ttft_s=ms / 1e3)

    loaded = {"C": 0.0, "D": 0.0}

    def peer_counters(url):  # noqa: ANN001, ANN202
        name = url.rsplit("/", 1)[-1]
        loaded[name] += 1 << 29  # each call after a hit sees one more prefix loaded
        return {"load_bytes": loaded[name], "load_seconds": 0.01}

    posted = []
    import harness.bench.live as live

    monkeypatch.setattr(bench, "complete", complete)
    monkeypatch.setattr(live, "complete", complete)  # the primer and the timed requests it shares with bench live
    monkeypatch.setattr(bench, "remote_phases", lambda h, tag, t0, ttft: {"load": 2.0 if "sync" in tag else 1.0})
    monkeypatch.setattr(bench, "local_phases", lambda h, tag, t0, ttft: {"after_lookup": 2.0})
    monkeypatch.setattr(bench, "wait_published", lambda *a, **k: None)
    monkeypatch.setattr(bench, "peer_counters", peer_counters)
    monkeypatch.setattr(bench, "pinned_h2d_GBps", lambda: 50.0)
    monkeypatch.setattr(bench, "_records", lambda cluster, ev, replica: [])
    monkeypatch.setattr(bench, "PEER_SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "Corpus", lambda model_dir: types.SimpleNamespace(text=lambda n, rng: "w " * n))
    import requests

    monkeypatch.setattr(requests, "post", lambda url, **kw: posted.append(url) or types.SimpleNamespace(
        raise_for_status=lambda: None))
    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    cluster = types.SimpleNamespace(replicas={n: types.SimpleNamespace(url=f"http://{n}") for n in "ABCSD"},
                                    model_dir=None, history_dir=None)
    return cluster, sent, posted


def test_the_rows_carry_every_kind_their_ratios_and_the_floor(stand_ins):
    cluster, sent, posted = stand_ins
    out = bench.measure(cluster, (8192,), reps=2, deadline_s=600.0)
    (row,) = out["rows"]
    assert row["runs"] == 2
    assert (row["cold_prefill_ms"], row["local_hit_ttft_ms"], row["remote_hit_ttft_ms"],
            row["remote_sync_hit_ttft_ms"], row["peer_hit_ttft_ms"], row["peer_cached_hit_ttft_ms"]) == (
        900.0, 40.0, 60.0, 55.0, 66.0, 62.0)
    assert row["remote_vs_local"] == 1.5 and row["remote_vs_peer"] == round(60 / 66, 3)
    assert row["remote_vs_peer_cached"] == round(60 / 62, 3) and row["remote_sync_vs_local"] == round(55 / 40, 3)
    assert row["remote_phases_ms"]["load"] == 1.0 and row["remote_sync_phases_ms"]["load"] == 2.0
    assert row["peer_loaded_bytes"] == 1 << 29 and row["peer_cached_loaded_bytes"] == 1 << 29
    floor = 8192 * bench.BENCH_SHAPE.kv_bytes_per_token / 50e9 * 1e3
    assert row["h2d_floor_ms"] == round(floor, 1) and row["floor_vs_local"] == round((40 + floor) / 40, 3)
    assert out["targets"] == {"remote_no_slower_than_peer_at_every_length": True,
                              "remote_no_slower_than_peer_cached_at_every_length": True,
                              "remote_at_most_1.2x_local_at_every_length": False,
                              "floor_at_most_1.2x_local_at_every_length": row["floor_vs_local"] <= 1.2}
    # only D's GPU prefix cache is reset, once per repetition, before its hit
    assert posted == ["http://D/reset_prefix_cache"] * 2
    # every measured request follows a primer on its replica
    for i, (replica, tag) in enumerate(sent):
        if tag.split("-")[0] in ("cold", "local", "remote") or tag.startswith("peer-hit"):
            assert sent[i - 1] == (replica, f"primer-{replica}"), (i, replica, tag)
