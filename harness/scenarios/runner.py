"""The scenario catalog: one JSON file per scenario in fixtures/scenarios/, and the
runner that executes one against a live cluster and judges it from the history.

A scenario file (data only; `runner` names an entry of RUNNERS):

    {"name": "load-corrupt", "runner": "load_failure", "fault": "corrupt",
     "replicas": ["A", "B"], "params": {"kind": "corrupt"},
     "control": {"name": "hide_failures", "params": {...}},      (optional)
     "seeds": 3,                                                  (optional cap)
     "description": "..."}

  load_catalog(dir)             every scenario, sorted by name; a bad file is an error.
  run_scenario(cluster, corpus, sc, seed)
                                resets the cluster, runs the scenario, then judges the
                                run's window of the history with harness.checkers
                                (byte-exact, miss causes, requests); then, if the scenario
                                has a negative control, runs it the same way and requires
                                that it is caught (by the scenario's own checks or by a
                                checker). Returns a ScenarioResult with the verdict, the
                                outcome class, the per-run counts and the replay command.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
from typing import Any

from harness.checkers import byte_exact as BE
from harness.checkers import history as H
from harness.checkers.miss_causes import miss_causes
from harness.checkers.outcome import classify
from harness.checkers.requests import requests
from harness.checkers.verdict import Verdict, all_of
from harness.client.http import RequestFailed
from harness.plugin import derive_seed
from harness.scenarios.catalog import Scenario, replay_command
from harness.scenarios.live import RUNNERS
from harness.system.cluster import Cluster
from harness.workload.prompts import Corpus
from kvpool.errors import PoolError
from kvpool.keys import Namespace


@dataclasses.dataclass
class ScenarioResult:
    scenario: str
    fault: str | None
    seed: int
    verdict: Verdict
    outcome: str  # ok | correctness | liveness | crash
    counts: dict[str, int]
    control: dict[str, Any] | None  # {"name", "caught", "by"} when the scenario has one
    replay: str
    seconds: float


def _run_once(cluster: Cluster, corpus: Corpus, sc: Scenario, seed: int, params: dict[str, Any]
              ) -> tuple[Verdict, list[dict], dict[str, str], bool]:
    """The scenario's verdict, its window of the history, every replica's namespace (the
    records lie before the window) and whether a process died unbidden."""
    t0 = time.time()
    try:
        cluster.reset()
    except (OSError, urllib.error.URLError, PoolError) as exc:  # a replica or the pool is gone
        crashed = cluster.crashed()
        return Verdict(False, f"the system is down before the scenario: {type(exc).__name__}: {exc}; "
                       f"gone: {crashed}"[:600]), [], {}, True
    cluster.nemesis("scenario_start", scenario=sc.name, seed=seed, params=params)
    try:
        v = RUNNERS[sc.runner](cluster, corpus, seed, **params)
    except (AssertionError, RequestFailed, PoolError) as exc:  # the scenario could not finish
        v = Verdict(False, f"{type(exc).__name__}: {exc}"[:600])
    crashed = cluster.crashed()
    cluster.nemesis("scenario_end", scenario=sc.name, seed=seed, crashed=crashed)
    time.sleep(0.2)  # let the replicas' last records land
    history = H.read_history(cluster.history_dir)
    return v, H.within(history, t0, time.time()), H.namespaces(history), bool(crashed)


def _judge(cluster: Cluster, v: Verdict, recs: list[dict], namespaces: dict[str, str], crashed: bool
           ) -> tuple[list[Verdict], str]:

    def pool_digest(replica: str, hashes: list[str]) -> dict[str, str]:
        if replica not in namespaces or cluster.pool is None or cluster.pool.proc.poll() is not None:
            return {}  # the pool is down: its copies cannot be compared (counted as unverified)
        return BE.pool_digests(cluster.pool, Namespace.from_dict(json.loads(namespaces[replica])), hashes)

    be = BE.byte_exact(recs, pool_digest, namespaces)
    mc = miss_causes(recs)
    policies = {name: r.spec.policy for name, r in cluster.replicas.items()}
    rq = requests(recs, policies)
    outcome = classify(crashed=crashed, liveness=rq, correctness=[v, be, mc])
    return [v, be, mc, rq], outcome


def run_scenario(cluster: Cluster, corpus: Corpus, sc: Scenario, seed: int) -> ScenarioResult:
    t_start = time.monotonic()
    v, recs, namespaces, crashed = _run_once(cluster, corpus, sc, seed, sc.params)
    parts, outcome = _judge(cluster, v, recs, namespaces, crashed)
    names = ("scenario", "byte-exact", "miss causes", "requests")
    counts = {
        "faults_fired": sum(1 for r in recs if r["ev"] == "fault"
                            or (r["ev"] == "nemesis" and not r["action"].startswith("scenario_"))),
        "loads": sum(1 for r in recs if r["ev"] == "load"),
        "silent_corruptions": int(parts[1].evidence.get("silent_corruptions", 0)),
        "lost_requests": int(parts[3].evidence.get("lost", 0)),
        "misclassified": int(parts[2].evidence.get("misclassified", 0)),
    }
    control = None
    if sc.control is not None:  # its own seed (derived), so its requests never share a tag with the run's
        cseed = derive_seed(seed, f"control:{sc.control.name}")
        cv, crecs, cnamespaces, ccrashed = _run_once(cluster, corpus, sc, cseed, {**sc.params, **sc.control.params})
        cparts, _ = _judge(cluster, cv, crecs, cnamespaces, ccrashed)
        by = [n for n, p in zip(names, cparts) if p.valid is False]
        control = {"name": sc.control.name, "caught": bool(by), "by": by, "reason": cv.reason[:300]}
        cluster.reset()  # heal whatever the control left
    verdicts = [Verdict(p.valid, f"{n}: {p.reason}", p.evidence, p.not_checked) for n, p in zip(names, parts)]
    if control is not None:
        verdicts.append(Verdict(control["caught"], f"negative control {control['name']} "
                                + (f"caught by {', '.join(control['by'])}" if control["caught"] else "NOT caught"),
                                control))
    verdict = all_of(verdicts, f"{sc.name} seed {seed}")
    if verdict.valid is True:
        verdict = Verdict(True, v.reason, verdict.evidence, verdict.not_checked)
    return ScenarioResult(sc.name, sc.fault, seed, verdict, outcome, counts, control, replay_command(sc.name, seed),
                          time.monotonic() - t_start)
