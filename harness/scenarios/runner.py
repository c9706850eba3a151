"""The one scenario runner: executes a scenario of the catalog (kvgate.harness.scenarios.catalog)
against a live cluster and judges it from the history.

  run_scenario(cluster, corpus, sc, seed) -> ScenarioResult
        resets the cluster, runs the scenario's body (kvgate.harness.scenarios.catalog.RUNNERS), then
        judges it: the scenario's own checks, the output oracle over its comparisons, and the
        checkers over the run's window of the history (byte-exact, miss causes, requests); then, if the scenario has a negative
        control, runs it the same way (its own derived seed) and requires that the oracle
        the scenario file names for it judged it false, for its reason (judge_control). A
        control run that raised, timed out or found the system down is inconclusive and
        fails the scenario. The result has the verdict, the outcome class, the per-run
        counts, the control's judgement and the replay command.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
from typing import Any

from kvgate.harness.checkers import byte_exact as BE
from kvgate.harness.checkers import history as H
from kvgate.harness.checkers.miss_causes import expected_causes, miss_causes
from kvgate.harness.checkers.outcome import classify
from kvgate.harness.checkers.output import output, own_checks
from kvgate.harness.checkers.requests import requests
from kvgate.harness.checkers.verdict import Verdict, all_of
from kvgate.harness.client.http import RequestFailed
from kvgate.harness.plugin import derive_seed
from kvgate.harness.scenarios.catalog import ORACLES, RUNNERS, Control, Scenario, replay_command
from kvgate.harness.system.cluster import Cluster
from kvgate.harness.workload.prompts import Corpus
from kvpool.errors import PoolError
from kvpool.pool.keys import Namespace


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


@dataclasses.dataclass
class _Run:
    verdict: Verdict  # the scenario's own checks
    recs: list[dict]  # its window of the history
    namespaces: dict[str, str]  # every replica's namespace (the records lie before the window)
    crashed: bool  # a process died unbidden
    raised: str | None  # the run could not finish (an exception, a timeout, the system down)


def _run_once(cluster: Cluster, corpus: Corpus, sc: Scenario, seed: int, params: dict[str, Any]) -> _Run:
    t0 = time.time()
    try:
        cluster.reset()
    except (OSError, urllib.error.URLError, PoolError, RequestFailed) as exc:  # a replica or the pool is gone
        crashed = cluster.crashed()
        why = f"the system is down before the scenario: {type(exc).__name__}: {exc}; gone: {crashed}"[:600]
        return _Run(Verdict(False, why), [], {}, True, why)
    cluster.nemesis("scenario_start", scenario=sc.name, seed=seed, params=params)
    raised = None
    try:
        v = RUNNERS[sc.runner](cluster, corpus, seed, **params)
    except (AssertionError, RequestFailed, PoolError) as exc:  # the scenario could not finish
        raised = f"{type(exc).__name__}: {exc}"[:600]
        v = Verdict(False, raised)
    crashed = cluster.crashed()
    cluster.nemesis("scenario_end", scenario=sc.name, seed=seed, crashed=crashed)
    time.sleep(0.2)  # let the replicas' last records land
    history = H.read_history(cluster.history_dir)
    return _Run(v, H.within(history, t0, time.time()), H.namespaces(history), bool(crashed), raised)


def _judge(cluster: Cluster, run: _Run, sc: Scenario | None = None) -> tuple[list[Verdict], str]:
    """The parts of the judgement, in the order of catalog.ORACLES, and the outcome class;
    with `sc`, its declared causes are part of the miss-cause judgement (a control run,
    whose causes the control changes, is judged without them)."""

    def pool_digest(replica: str, hashes: list[str]) -> dict[str, str]:
        pool = cluster.pool_for(replica) if replica in cluster.replicas else None
        if replica not in run.namespaces or pool is None:
            return {}  # the pool is down: its copies cannot be compared (counted as unverified)
        return BE.pool_digests(pool, Namespace.from_dict(json.loads(run.namespaces[replica])), hashes)

    be = BE.byte_exact(run.recs, pool_digest, run.namespaces)
    mc = miss_causes(run.recs)
    if sc is not None:
        ex = expected_causes(run.recs, sc.expect_load_causes, sc.expect_lookup_causes, sc.allow_load_causes)
        reason = mc.reason if ex.valid else (ex.reason + ("; " + mc.reason if mc.valid is False else ""))
        mc = Verdict(mc.valid if ex.valid else False, reason, {**mc.evidence, "declared": ex.evidence}, mc.not_checked)
    policies = {name: r.spec.policy for name, r in cluster.replicas.items()}
    rq = requests(run.recs, policies)
    own, out = own_checks(run.verdict), output(run.verdict)
    outcome = classify(crashed=run.crashed, liveness=rq, correctness=[own, out, be, mc])
    return [own, out, be, mc, rq], outcome


def judge_control(control: Control, run: _Run, parts: list[Verdict]) -> dict[str, Any]:
    """A control is caught only when the oracle it names judged its run false, for the
    reason it exists (`because`, when given, in that oracle's reason); a control run that
    raised, timed out, crashed or found the system down is inconclusive, never caught."""
    by = [n for n, p in zip(ORACLES, parts) if p.valid is False]
    target = parts[ORACLES.index(control.oracle)]
    inconclusive = run.raised or ("a process died: " + ", ".join(by) if run.crashed else None)
    said = [target.reason, *(str(x) for x in target.evidence.get("first", []))]  # a checker's first findings
    caught = not inconclusive and target.valid is False and any(control.because in x for x in said)
    if caught:
        why = f"caught by {control.oracle}: {target.reason[:200]}"
    elif inconclusive:
        why = f"INCONCLUSIVE (the control run proves nothing): {inconclusive[:300]}"
    elif target.valid is False:
        why = f"NOT caught for its reason: {control.oracle} said {target.reason[:200]!r}, not {control.because!r}"
    else:
        why = f"NOT caught by {control.oracle} (false verdicts from: {', '.join(by) or 'none'})"
    out = parts[ORACLES.index("output")].evidence
    return {"name": control.name, "oracle": control.oracle, "caught": caught, "inconclusive": bool(inconclusive),
            "by": by, "why": why, "reason": run.verdict.reason[:300],
            "findings": {n: p.reason[:200] for n, p in zip(ORACLES, parts) if p.valid is False},
            "outputs": {k: out.get(k) for k in ("compared", "differ", "tokens_differ")}}


def run_scenario(cluster: Cluster, corpus: Corpus, sc: Scenario, seed: int) -> ScenarioResult:
    t_start = time.monotonic()
    run = _run_once(cluster, corpus, sc, seed, sc.params)
    parts, outcome = _judge(cluster, run, sc)
    recs = run.recs
    counts = {
        "faults_fired": sum(1 for r in recs if r["ev"] == "fault"
                            or (r["ev"] == "nemesis" and not r["action"].startswith("scenario_"))),
        "loads": sum(1 for r in recs if r["ev"] in ("load", "tier_load")),  # the network tier's too
        "silent_corruptions": int(parts[ORACLES.index("byte-exact")].evidence.get("silent_corruptions", 0)),
        "lost_requests": int(parts[ORACLES.index("requests")].evidence.get("lost", 0)),
        "misclassified": int(parts[ORACLES.index("miss causes")].evidence.get("misclassified", 0)),
        "outputs_differ": int(parts[ORACLES.index("output")].evidence.get("differ", 0)),
    }
    control = None
    if sc.control is not None:  # its own seed (derived), so its requests never share a tag with the run's
        cseed = derive_seed(seed, f"control:{sc.control.name}")
        crun = _run_once(cluster, corpus, sc, cseed, {**sc.params, **sc.control.params})
        cparts, _ = _judge(cluster, crun)
        control = judge_control(sc.control, crun, cparts)
        cluster.reset()  # heal whatever the control left
    verdicts = [Verdict(p.valid, f"{n}: {p.reason}", p.evidence, p.not_checked) for n, p in zip(ORACLES, parts)]
    if control is not None:
        verdicts.append(Verdict(control["caught"], f"negative control {control['name']} {control['why']}", control))
    verdict = all_of(verdicts, f"{sc.name} seed {seed}")
    if verdict.valid is True:
        verdict = Verdict(True, run.verdict.reason, verdict.evidence, verdict.not_checked)
    return ScenarioResult(sc.name, sc.fault, seed, verdict, outcome, counts, control, replay_command(sc.name, seed),
                          time.monotonic() - t_start)
