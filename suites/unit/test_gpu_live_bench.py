"""The GPU live bench's measurement loop (kvgate.harness.bench.gpu_live.measure) on stand-in
replicas: no GPU and no vLLM, so that the loop, its rows and its targets are exercised
where CI runs. Each kind of request answers with its own time to first token; the rows
must carry them, the ratios between them and the floor, whatever the replicas are."""

from __future__ import annotations

import json
import types

import pytest

import kvgate.harness.bench.gpu_live as bench

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
    import kvgate.harness.bench.live as live

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


TIER_MS = {"tier": 50.0, "tierlocal": 40.0, "tier-sync": 44.0, "tierlocal-sync": 41.0, "peer-hit": 80.0}


def test_the_tier_rows_carry_both_load_modes_their_ratios_and_the_local_bound(stand_ins, monkeypatch):
    cluster, sent, posted = stand_ins

    def complete(url, prompt, *, tag, replica, **kwargs):  # noqa: ANN001, ANN202
        sent.append((replica, tag))
        return types.SimpleNamespace(ttft_s=TIER_MS.get(tag.rsplit("-", 2)[0], 10.0) / 1e3)

    import kvgate.harness.bench.live as live

    monkeypatch.setattr(bench, "complete", complete)
    monkeypatch.setattr(live, "complete", complete)
    loads = {"U": [{"tag": "tier-8192-0", "loaded": 511, "direct": True},
                   {"tag": "tier-8192-1", "loaded": 511, "direct": False}],
             "V": [{"tag": "tier-sync-8192-0", "loaded": 511, "direct": True},
                   {"tag": "tier-sync-8192-1", "loaded": 500, "direct": True}]}
    monkeypatch.setattr(bench, "_records", lambda cluster, ev, replica: loads.get(replica, []) if ev == "load" else [])
    spec = types.SimpleNamespace(connector_extra=(("pool", "keeper:/k"), ("token", "secret"), ("gpu_chunk_mib", 512)))
    cluster.replicas = {n: types.SimpleNamespace(url=f"http://{n}", spec=spec) for n in "CTUV"}
    out = bench.measure_tier(cluster, (8192,), reps=2, deadline_s=600.0)
    (row,) = out["rows"]
    assert row["runs"] == 2
    assert (row["gpu_tier_hit_ttft_ms"], row["gpu_tier_local_hit_ttft_ms"], row["gpu_tier_sync_hit_ttft_ms"],
            row["gpu_tier_sync_local_hit_ttft_ms"], row["peer_hit_ttft_ms"]) == (50.0, 40.0, 44.0, 41.0, 80.0)
    assert row["gpu_tier_remote_vs_local"] == 1.25 and row["gpu_tier_sync_remote_vs_local"] == round(44 / 41, 3)
    assert row["gpu_tier_vs_peer"] == 0.625 and row["gpu_tier_local_vs_peer"] == 0.5
    assert (row["gpu_tier_blocks_loaded"], row["gpu_tier_sync_blocks_loaded"], row["gpu_tier_blocks_expected"]) == (
        1022, 1011, 1022)
    assert (row["gpu_tier_direct_loads"], row["gpu_tier_staged_loads"], row["gpu_tier_sync_direct_loads"],
            row["gpu_tier_sync_staged_loads"]) == (1, 1, 2, 0)  # which install each load took, from its record
    assert out["targets"]["gpu_tier_at_most_1.05x_local_at_every_length"] is False
    assert out["targets"]["gpu_tier_sync_at_most_1.05x_local_at_every_length"] is False
    assert out["targets"]["gpu_tier_every_block_loaded"] is True
    assert out["targets"]["gpu_tier_sync_every_block_loaded"] is False  # V's second load was short
    assert out["tier_settings"] == {"pool": "keeper:/k", "gpu_chunk_mib": 512}  # never the token
    assert posted == []  # C's prefix caching is off: nothing to reset
    # each tier replica loads once before the first measured load
    first = next(i for i, (_, tag) in enumerate(sent) if tag.startswith("tier-"))
    assert {("T", "tierwarm-pub"), ("U", "tierwarm-U"), ("V", "tierwarm-V")} <= set(sent[:first])
    for i, (replica, tag) in enumerate(sent):  # every measured request follows a primer on its replica
        if tag.startswith(("tier-", "tierlocal-", "peer-hit")):
            assert sent[i - 1] == (replica, f"primer-{replica}"), (i, replica, tag)
    # the checklist renders the tier's rows alone, and the run's failures name the short load
    from kvgate.harness.report.gpu_live import render_markdown

    result = {"bench": out, "exchanges_skipped": True, "seed": 1, "env": {"gpu": "stand-in"}}
    result["failures"] = live_main.failures(result, exchanges=False, sessions=False, bench=True,
                                            bench_lengths=(8192,), bench_reps=2)
    assert result["failures"] == ["bench at 8192 tokens: the GPU tier loaded 1011 of 1022 blocks (load_mode sync)"]
    text = render_markdown(result, "2026-12-05")
    assert "## The GPU tier, live (TTFT)" in text and "| 8192 | 50.0 | 40.0 | 1.25 |" in text
    assert "8192: tier 1 direct / 1 staged, sync 2 direct / 0 staged" in text
    # a hit whose records give no phases (a load that moved nothing): its row stands without them
    monkeypatch.setattr(bench, "remote_phases", lambda h, tag, t0, ttft: None if "sync" in tag else {"load": 1.0})
    (row,) = bench.measure_tier(cluster, (8192,), reps=1, deadline_s=600.0)["rows"]
    assert "gpu_tier_sync_phases_ms" not in row and row["gpu_tier_phases_ms"] == {"load": 1.0}


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


# -- `kvgate gpu-live`'s exit status, on stand-in parts ------------------------------------------
# The clusters, the live exchanges, the sessions and the bench stand in for themselves; what
# is exercised is how main() turns what they measured into the checklist and the exit status.

import kvgate.harness.gpu_live as command  # noqa: E402
import kvgate.harness.scenarios.gpu_live as live_main  # noqa: E402


def _turns(differ_at: tuple[str, int, int] | None = None) -> list[dict]:
    """Two sessions of two turns in each of the four blocks, every turn the same tokens
    except (block, session, turn) `differ_at`."""
    out = []
    for block in ("0:off", "1:on", "2:on", "3:off"):
        for s in range(2):
            for t in range(2):
                tokens = [7, 8, 9] if differ_at != (block, s, t) else [7, 8, 10]
                out.append({"block": block, "session": s, "turn": t, "replica": "AB"[t % 2], "cross": t > 0,
                            "prompt_tokens": 100, "ttft_ms": 10.0 + t, "remote_hit_blocks": t, "local_tokens": 0,
                            "tokens": tokens, "finish_reason": "length", "error": None})
    return out


def _bench_doc(lengths, runs=1, loaded=None):  # noqa: ANN001, ANN202
    rows = [{"prefix_tokens": n, "runs": runs, "remote_blocks_loaded": loaded if loaded is not None else n // 16 - 1,
             "remote_sync_blocks_loaded": n // 16 - 1, "remote_blocks_expected": n // 16 - 1,
             "cold_prefill_ms": 1.0, "local_hit_ttft_ms": 1.0, "remote_hit_ttft_ms": 1.0, "peer_hit_ttft_ms": 1.0,
             "remote_vs_peer": 1.0} for n in lengths]
    return {"model": "stand-in", "rows": rows, "targets": {}}


def _exchange(name: str, valid: bool) -> dict:
    return {"name": name, "producer": "A", "consumer": "B", "expect_caught": False, "prompt_tokens": 1201,
            "blocks_loaded_B": 75, "blocks_expected": 75, "byte_exact": {"evidence": {}},
            "A": {"ttft_ms": 1.0}, "B_hit": {"ttft_ms": 1.0}, "B_cold": {"ttft_ms": 1.0},
            "tokens_equal_B_hit_vs_cold": valid, "tokens_equal_A_vs_B_cold": valid,
            "verdict": {"valid": valid, "reason": "stand-in", "not_checked": "-"}}


@pytest.fixture
def parts(monkeypatch):
    """main()'s parts as stand-ins; `set` holds what each returns (or raises)."""
    state = {"live": {"passed": True, "seed": 1, "env": {}, "exchanges": [_exchange("cross_replica_hit", True)]},
             "sessions": lambda contexts: [], "bench": None, "tier": None,
             "tier_live": {"passed": True, "seed": 1, "env": {}, "exchanges": [_exchange("cross_replica_hit", True)]}}
    oracle = object()

    class _Cluster:
        replicas: dict = {}
        model_dir = "stand-in model"
        tier_oracle = oracle

        def start(self, specs, timeout):  # noqa: ANN001, ANN202
            return self

    def run_sessions(cluster, seed, contexts, count, turns, deadline, audit=False):  # noqa: ANN001, ANN202
        return state["sessions"](contexts)

    def measure(cluster, lengths, reps, deadline_s):  # noqa: ANN001, ANN202
        if isinstance(state["bench"], BaseException):
            raise state["bench"]
        return state["bench"] if state["bench"] is not None else _bench_doc(lengths)

    monkeypatch.setattr(live_main, "tiny_cluster", lambda report_dir, gpus: (_Cluster(), [], None))
    monkeypatch.setattr(live_main, "start_sessions", lambda *a, **k: _Cluster())
    monkeypatch.setattr(live_main, "run_sessions", run_sessions)
    def run_live(cluster, model, seed, pool=None):  # noqa: ANN001, ANN202
        if pool is None:
            return dict(state["live"])
        assert pool is oracle and model == "stand-in model"  # the tier's oracle reads the tier
        if isinstance(state["tier_live"], BaseException):
            raise state["tier_live"]
        return dict(state["tier_live"])

    def start_tier_cluster(report_dir, gpus, extra=None):  # noqa: ANN001, ANN202
        if isinstance(state["tier_live"], KeyError):
            raise RuntimeError("the keeper exited 1")
        state["tier_extra"] = extra
        return _Cluster()

    monkeypatch.setattr(live_main, "run_live", run_live)
    monkeypatch.setattr(live_main, "start_tier_cluster", start_tier_cluster)
    monkeypatch.setattr(live_main, "environment", lambda: {"gpu": "stand-in", "provenance": {"short": "x", "clean": True}})
    monkeypatch.setattr(command, "_stop", lambda cluster: "")
    monkeypatch.setattr(bench, "start_bench", lambda report_dir, max_len, tier=False, tier_tokens=0,
                        tier_only=False, tier_extra=None: _Cluster())
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench, "measure_tier", lambda *a, **k: state["tier"])
    return state


def _sessions_of(turns):  # noqa: ANN001, ANN202
    return lambda contexts: [live_main.summarize_sessions(turns, ctx, 2, 2, ["A", "B"]) for ctx in contexts]


def test_gpu_live_passes_when_every_part_asked_for_passed(tmp_path, parts):
    parts["sessions"] = _sessions_of(_turns())
    rc = command.main(tmp_path, sessions=True, bench=True, exchanges=False, session_contexts=(1024,),
                        bench_lengths=(1024,))
    assert rc == 0, (tmp_path / "result.json").read_text()
    md = (tmp_path / "checklist.md").read_text()
    assert "Overall (live exchanges): not run (--no-exchanges)" in md and "## Overall: PASS" in md


def test_gpu_live_fails_on_a_mismatched_session_turn(tmp_path, parts):
    parts["sessions"] = _sessions_of(_turns(differ_at=("2:on", 1, 1)))
    rc = command.main(tmp_path, sessions=True, exchanges=False, session_contexts=(1024,))
    assert rc == 1
    doc = json.loads((tmp_path / "result.json").read_text())
    assert any("s1-t1" in f and "different tokens" in f for f in doc["failures"]), doc["failures"]
    md = (tmp_path / "checklist.md").read_text()
    assert "## Overall: FAIL" in md and "Overall (live exchanges): FAIL" not in md


def test_gpu_live_fails_on_a_bench_error(tmp_path, parts):
    parts["bench"] = ConnectionError("replica S went away")
    rc = command.main(tmp_path, bench=True, exchanges=False, bench_lengths=(1024,))
    assert rc == 1
    doc = json.loads((tmp_path / "result.json").read_text())
    assert any("the bench raised" in f and "replica S went away" in f for f in doc["failures"]), doc["failures"]


def test_gpu_live_fails_on_a_short_remote_load_and_on_a_bench_length_not_run(tmp_path, parts):
    parts["bench"] = _bench_doc((1024,), loaded=3)
    assert command.main(tmp_path / "a", bench=True, exchanges=False, bench_lengths=(1024,)) == 1
    parts["bench"] = _bench_doc((1024,))  # 4096 ran out of time
    assert command.main(tmp_path / "b", bench=True, exchanges=False, bench_lengths=(1024, 4096)) == 1
    doc = json.loads((tmp_path / "b" / "result.json").read_text())
    assert doc["failures"] == ["bench at 4096 tokens: not run"]
    parts["bench"] = _bench_doc((1024,))
    parts["bench"]["rows"][0].update(gpu_tier_blocks_loaded=10, gpu_tier_blocks_expected=63)  # the tier's load cut short
    assert command.main(tmp_path / "c", bench=True, exchanges=False, bench_lengths=(1024,), bench_tier=True) == 1
    doc = json.loads((tmp_path / "c" / "result.json").read_text())
    assert doc["failures"] == ["bench at 1024 tokens: the GPU tier loaded 10 of 63 blocks"]


def test_gpu_live_fails_on_a_failed_exchange_and_when_nothing_was_asked_for(tmp_path, parts):
    assert command.main(tmp_path / "ok") == 0
    parts["live"] = {"passed": False, "seed": 1, "env": {}, "exchanges": [_exchange("stream_delay", False)]}
    assert command.main(tmp_path / "bad") == 1
    assert command.main(tmp_path / "none", exchanges=False) == 1  # nothing asked for: not run is not a pass


def test_the_gpu_tier_is_sized_for_every_prefix_the_bench_publishes():
    """The H200 run of 2026-12-05: 16 GiB held two repetitions of 8k + 32k + 64k, and the third
    64k publish found the tier full. Two repetitions need 13 GiB (+10%); three (19.5 GiB + 10%)
    do not fit beside the seven replicas and are refused before anything starts."""
    assert bench.tier_gib(2 * (8192 + 32768 + 65536)) == 15
    assert bench.tier_gib(1024) == bench.TIER_GIB_MIN
    with pytest.raises(ValueError, match="fewer repetitions"):
        bench.tier_gib(3 * (8192 + 32768 + 65536))


def test_gpu_live_runs_the_exchanges_on_a_keepers_tier_with_its_oracle_and_fails_on_each_failure(tmp_path, parts):
    assert command.main(tmp_path / "ok", tier_exchanges=True) == 0
    md = (tmp_path / "ok" / "checklist.md").read_text()
    assert "## The exchanges on a GPU keeper's tier" in md and "Overall (tier exchanges): PASS" in md
    assert json.loads((tmp_path / "ok" / "tier.json").read_text())["passed"] is True
    parts["tier_live"] = {"passed": False, "seed": 1, "env": {},
                          "exchanges": [_exchange("cross_replica_hit", True), _exchange("stream_delay_control", False)]}
    assert command.main(tmp_path / "bad", tier_exchanges=True) == 1
    doc = json.loads((tmp_path / "bad" / "result.json").read_text())
    assert doc["failures"] == ["tier exchanges failed: stream_delay_control A->B"]
    assert "Overall (tier exchanges): FAIL" in (tmp_path / "bad" / "checklist.md").read_text()
    parts["tier_live"] = KeyError("start")  # the tier's cluster does not start
    assert command.main(tmp_path / "down", tier_exchanges=True) == 1
    doc = json.loads((tmp_path / "down" / "result.json").read_text())
    assert any("the tier exchanges raised" in f and "the keeper exited 1" in f for f in doc["failures"]), doc
    assert any(f == "the tier exchanges did not run" for f in doc["failures"]) is False
    assert command.main(tmp_path / "alone", exchanges=False, tier_exchanges=True) == 1  # the tier's start still fails
    parts["tier_live"] = {"passed": True, "seed": 1, "env": {}, "exchanges": [_exchange("cross_replica_hit", True)]}
    assert command.main(tmp_path / "alone2", exchanges=False, tier_exchanges=True) == 0
    # the tier replicas' settings reach their cluster and are said in the checklist
    assert command.main(tmp_path / "direct", exchanges=False, tier_exchanges=True,
                        tier_extra={"gpu_install_direct": False}) == 0
    assert parts["tier_extra"] == {"gpu_install_direct": False}
    assert "Tier replicas' settings besides: `{'gpu_install_direct': False}`" in (
        tmp_path / "direct" / "checklist.md").read_text()
