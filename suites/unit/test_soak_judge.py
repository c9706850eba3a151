"""The soak's own judgement (kvgate.harness.soak.judge_growth, judge) on synthetic measurements,
without a live system: growth within the stated bounds passes; a private-memory leak per
request, a descriptor leak, shared memory beyond the pool's segment (a leaked segment),
an unknown oracle verdict and a run that sent nothing each fail, naming what exceeded
which bound."""

from __future__ import annotations

import pytest

from kvgate.harness import soak

MIB = 2**20
SEGMENT = 128 * MIB  # the default system's pool: 1024 pages of 128 KiB


def _sample(requests: int, *, rss: dict | None = None, shm: dict | None = None, fds: dict | None = None,
            host_shm: int = 150 * MIB) -> dict:
    row = {"t": 0.0, "shmem_bytes": host_shm, "requests": requests}
    for name in ("A", "B", "D", "pool"):
        base = 2400 * MIB if name != "pool" else 45 * MIB
        row[name] = {"rss_bytes": base + (rss or {}).get(name, 0), "shm_rss_bytes": (shm or {}).get(name, 0),
                     "fds": 180 + (fds or {}).get(name, 0)}
    return row


def _run(end: dict, requests: int = 3000) -> list[dict]:
    """Start-up, the warm-up sample, the last sample with `end`'s growth."""
    return [_sample(0, rss={"A": -500 * MIB}), _sample(100), _sample(100 + requests, **end)]


def test_the_committed_soaks_growth_is_within_the_bounds():
    # the committed CPU soak: replicas +7..9 MiB, the daemon +0.5 MiB, the segment touched once
    growth, exceeded = soak.judge_growth(_run(dict(rss={"A": 7 * MIB, "B": 8 * MIB, "D": 9 * MIB, "pool": MIB // 2},
                                                   shm={"A": 118 * MIB, "B": 116 * MIB, "pool": 114 * MIB},
                                                   fds={"B": -2}, host_shm=278 * MIB)), SEGMENT)
    assert exceeded == []
    assert growth["requests_after_warmup"] == 3000 and growth["A"]["rss_mib"] == 7.0  # start-up is not growth
    assert growth["pool"]["bound_rss_mib"] == 16 + 2 * 3


@pytest.mark.parametrize("end, finding", [
    (dict(rss={"pool": 40 * MIB}), "pool: private RSS grew 40.0 MiB over 3000 requests, bound 22.0 MiB"),
    (dict(rss={"B": 200 * MIB}), "B: private RSS grew 200.0 MiB"),
    (dict(fds={"D": 3000}), "D: 3000 more open descriptors, bound 16"),
    (dict(fds={"pool": 9}), "pool: 9 more open descriptors, bound 8"),
    (dict(shm={"A": 300 * MIB}), "A: shared RSS grew 300.0 MiB"),
    (dict(host_shm=150 * MIB + 2 * SEGMENT), "host shared memory (Shmem) grew 256.0 MiB"),
])
def test_growth_beyond_a_bound_fails_with_the_measurement_and_the_bound(end, finding):
    _, exceeded = soak.judge_growth(_run(end), SEGMENT)
    assert any(finding in e for e in exceeded), exceeded
    assert soak.judge("ok", {"requests": 3100}, {}, exceeded)  # and the soak does not pass


def test_the_private_bound_grows_with_the_requests_a_long_soak_sent():
    leak = dict(rss={"B": 100 * MIB})
    assert soak.judge_growth(_run(leak, requests=3000), SEGMENT)[1]  # 64 + 24 MiB allowed
    assert not soak.judge_growth(_run(leak, requests=30000), SEGMENT)[1]  # 64 + 240 MiB allowed


def test_too_few_samples_is_not_judged_and_not_a_pass():
    _, exceeded = soak.judge_growth([_sample(0)], SEGMENT)
    assert exceeded and "not judged" in exceeded[0]


OK = {"valid": True, "reason": "fine"}


def test_unknown_verdicts_and_a_run_of_nothing_are_not_a_pass():
    verdicts = {"scenario": OK, "output": OK, "byte-exact": OK, "miss causes": OK, "requests": OK}
    counts = {"requests": 3040, "silent_corruptions": 0, "lost_requests": 0}
    assert soak.judge("ok", counts, verdicts, []) == []
    unknown = {**verdicts, "byte-exact": {"valid": None, "reason": "the pool was down: copies not compared"}}
    (why,) = soak.judge("ok", counts, unknown, [])
    assert why.startswith("byte-exact: unknown")
    assert soak.judge("ok", {**counts, "requests": 0}, verdicts, []) == ["no request was sent: nothing was judged"]
    assert soak.judge("ok", {**counts, "lost_requests": 2}, verdicts, []) == ["2 lost requests"]
    assert soak.judge("crash", counts, verdicts, []) == ["outcome crash"]


def test_the_report_states_the_bounds_and_what_exceeded_them():
    growth, exceeded = soak.judge_growth(_run(dict(fds={"D": 3000})), SEGMENT)
    counts = {k: 0 for k in ("request_errors", "faults_armed", "faults_fired", "prefix_cache_resets", "loads",
                             "loads_failed", "blocks_loaded", "blocks_published", "silent_corruptions",
                             "lost_requests", "misclassified")}
    counts["requests"] = 3100
    verdicts = {"byte-exact": {"valid": None, "reason": "not compared"}}
    r = {"pass": False, "command": "kvgate soak", "provenance": {"commit": "abc", "clean": True}, "counts": counts,
         "growth_after_warmup": growth, "bounds": soak.bounds_text(), "verdicts": verdicts,
         "failures": soak.judge("ok", counts, verdicts, exceeded)}
    md = soak._markdown(r)
    assert md.startswith("# kvgate soak: FAIL")
    assert soak.bounds_text() in md and "D: 3000 more open descriptors, bound 16" in md
    assert "byte-exact: UNKNOWN not compared" in md
