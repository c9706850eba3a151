"""The hostile restart scenario's body (kvgate.harness.scenarios.hostile.restart) on a stand-in
cluster: replicas that answer from the prompt, a pool whose kills and restarts are
recorded, lookups recorded as the connector would. It checks the runner's own logic (the
arming of both replicas, the heal of the pool and of a dead replica, what it judges),
not the system: the live gate runs it on vLLM (the connector-level race is
suites/connector/test_hook_safety.py)."""

from __future__ import annotations

import hashlib
import json
import random
import time
import types
from pathlib import Path

import pytest

from kvgate.harness.client.http import Completion, RequestFailed
from kvgate.harness.scenarios.catalog import find
from kvgate.harness.scenarios.hostile import restart


class _Pool:
    def __init__(self, cluster: "_Cluster") -> None:
        self.cluster = cluster
        self.proc = types.SimpleNamespace(poll=lambda: None if self.up else -9)
        self.up = True

    def kill(self) -> None:
        self.up = False

    def restart(self) -> None:
        self.up = True


class _Cluster:
    def __init__(self, tmp_path: Path, dies: str | None) -> None:
        self.history_dir = tmp_path / "h"
        self.faults = {n: tmp_path / f"faults-{n}.json" for n in ("A", "B")}
        for p in self.faults.values():
            p.write_text("{}")
        self.replicas = {n: types.SimpleNamespace(url=f"http://{n}") for n in ("A", "B")}
        self.pool = _Pool(self)
        self.recs: list[dict] = []
        self.events: list[tuple] = []
        self.dies = dies  # a replica whose engine dies once the control is armed and the pool restarted
        self.dead: set[str] = set()
        self.restarted = 0

    def nemesis(self, action: str, **fields: object) -> None:
        self.events.append((action, fields))
        if action == "pool_restart":
            self.restarted += 1

    def kill_replica(self, name: str) -> None:
        self.events.append(("kill_replica", name))

    def restart_replicas(self, names: list[str]) -> None:
        for name in names:
            self.events.append(("restart_replica", name))
            self.dead.discard(name)

    def complete(self, url: str, prompt: str, *, tag: str, replica: str, load: bool = True, publish: bool = True,
                 cache_salt: str | None = None, timeout_s: float = 600.0) -> Completion:
        armed = json.loads(self.faults[replica].read_text()).get("client", {}).get("control")
        if self.dies == replica and armed and self.restarted:
            self.dead.add(replica)
        if replica in self.dead:
            raise RequestFailed(f"{replica}: HTTP 500: EngineDeadError")
        time.sleep(0.002)
        if tag.endswith("-fb"):
            rec = {"outcome": "remote_hit", "hit_blocks": 5}
        elif "-r" in tag and load:
            rec = {"outcome": "miss", "miss_cause": "never_published" if self.pool.up else "transport_error"}
        else:
            rec = {"outcome": "skipped"}
        self.recs.append({"ev": "lookup", "tag": tag, "replica": replica, **rec})
        ids = list(hashlib.blake2b(prompt.encode(), digest_size=16).digest())  # one model: one output
        return Completion(tag, replica, ids, "", "length", 0.0, 0.0, len(prompt.split()))


@pytest.fixture
def scenario(monkeypatch, tmp_path):  # noqa: ANN001, ANN201
    def make(dies: str | None = None) -> _Cluster:
        cluster = _Cluster(tmp_path, dies)
        fast = types.SimpleNamespace(sleep=lambda s: time.sleep(s / 100), monotonic=time.monotonic)
        monkeypatch.setattr(restart, "time", fast)
        monkeypatch.setattr(restart, "complete", cluster.complete)
        monkeypatch.setattr(restart, "healthy", lambda url, timeout_s=2.0: url[-1] not in cluster.dead)
        monkeypatch.setattr(restart, "wait_stored", lambda *a, **k: None)
        monkeypatch.setattr(restart, "records", lambda h, ev, **m: [
            r for r in cluster.recs if r["ev"] == ev and all(r.get(k) == v for k, v in m.items())])
        return cluster

    return make


class _Corpus:
    def text(self, n: int, rng: random.Random) -> str:
        return " ".join(str(rng.randrange(1000)) for _ in range(n))


def test_the_scenario_restarts_the_pool_under_probes_and_passes_a_pool_that_holds(scenario):
    cluster = scenario()
    sc = find("hostile-restart-under-probe")
    v = restart.restart_under_probe(cluster, _Corpus(), 7, **{**sc.params, "restarts": 3})
    assert v.valid is True, v.reason
    assert [a for a, _ in cluster.events].count("pool_kill") == 3
    assert v.evidence["miss_causes"] == ["never_published", "transport_error"]
    assert all(json.loads(p.read_text()) == {} for p in cluster.faults.values())  # disarmed afterwards


def test_the_control_arms_the_unguarded_probe_and_a_dead_engine_fails_the_run_and_is_healed(scenario):
    cluster = scenario(dies="B")
    sc = find("hostile-restart-under-probe")
    seen: list[dict] = []
    real = cluster.complete

    def spy(url, prompt, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append(json.loads(cluster.faults[kw["replica"]].read_text()))
        return real(url, prompt, **kw)

    restart.complete = spy  # the fixture's monkeypatch restores the module's own
    v = restart.restart_under_probe(cluster, _Corpus(), 7, **{**sc.params, **sc.control.params, "restarts": 12})
    assert {"control": "unguarded_probe", "pause_ms": 50} in [d.get("client") for d in seen]
    kinds = [a for a, _ in cluster.events]
    # once a request of the control's run failed, the pool is not restarted again
    assert "control_struck" in kinds and kinds.count("pool_kill") < 12, kinds
    assert v.valid is False and "no replica's engine died" in v.reason
    assert ("restart_replica", "B") in cluster.events and v.evidence["healed"] == ["B"]
