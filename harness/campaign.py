"""A fault campaign: every fault kind over many derived seeds, within a time budget.

`run_campaign(seed, seeds, minutes, report_dir, profile)` runs the catalog's scenarios
(kvgate.harness.scenarios) round-robin over fault kinds: round i runs, for each kind in
turn, the next scenario of that kind with the seed derived from the root seed, the kind and
i (kvgate.harness.plugin.derive_seed), so a bug that fires one time in fifty is met by the
fiftieth seed of its kind rather than by luck, and every kind advances at the same pace
whatever the budget cuts. It starts no run past the budget (`minutes`) and stops after
`seeds` rounds. The default system serves every scenario that runs there; the multi-host
system the hosts' scenarios, after it, with the time left.

The soak's request streams are a kind of their own, `soak` (in the profile `all`, or named
in a profile's list): each round runs one soak window of `soak_s` seconds on the default
system (kvgate.harness.soak.soak_window: concurrent seeded streams over shared prefixes to
A, B and D with the seeded nemesis arming load and transport faults), judged by the same
oracles; its replay is `kvgate soak` with the window's length and seed (on a fresh system).

It writes campaign.json and campaign.md under `report_dir`: the replay key, per fault kind
the seeds run, the faults fired, loads, silent corruptions, lost requests, misclassified
misses, outputs that differ and controls caught (kvgate.harness.gate.per_kind), and every
failing run with the command that replays it and its fault schedule. It exits non-zero
when a run failed, when a kind ran fewer seeds than asked (the budget ran out: not run is
never a pass), or when nothing ran.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.harness.gate import COUNTS, _say, format_kinds, harness_failure, per_kind, select, write_schedule
from kvgate.harness.plugin import derive_seed
from kvgate.harness.provenance import provenance, title_flag


@dataclass
class Campaign:
    replay_key: dict
    results: list = field(default_factory=list)
    stopped: str = ""  # why it stopped before its rounds, if it did

    def kinds(self) -> dict[str, dict]:
        return per_kind(self.results)

    def failures(self) -> list:
        return [r for r in self.results if r.verdict.valid is not True]


@dataclass(frozen=True)
class SoakWindow:
    """The soak's streams as a campaign's kind: one window of `seconds` per round."""

    seconds: float
    streams: int = 3
    name: str = "soak-window"
    fault: str = "soak"
    replicas: tuple[str, ...] = ("A", "B", "D")

    def replay(self, seed: int) -> str:
        return f"kvgate soak --minutes {self.seconds / 60:g} --seed {seed} --streams {self.streams}"


def run_window(system, corpus, window: SoakWindow, seed: int):  # noqa: ANN001, ANN201
    """One soak window as a campaign's run (a ScenarioResult): the oracles' verdicts and the
    soak's own judgement (kvgate.harness.soak.judge; growth is the soak command's, over minutes)."""
    from kvgate.harness.checkers.verdict import Verdict
    from kvgate.harness.scenarios.runner import ScenarioResult
    from kvgate.harness.soak import judge as soak_judge
    from kvgate.harness.soak import soak_window

    t0 = time.monotonic()
    w = soak_window(system, corpus, seed, window.seconds, window.streams)
    failures = soak_judge(w.outcome, w.counts, w.verdicts, [])
    c = w.counts
    verdict = Verdict(not failures, "; ".join(failures) if failures else
                      f"{c['requests']} requests, {c['faults_armed']} faults armed, {c['loads']} loads: every oracle valid",
                      {"counts": c, "verdicts": w.verdicts, "faults": w.fired})
    counts = {"faults_fired": c["faults_fired"], "loads": c["loads"], "silent_corruptions": c["silent_corruptions"],
              "lost_requests": c["lost_requests"], "misclassified": c["misclassified"], "outputs_differ": 0}
    return ScenarioResult(window.name, window.fault, seed, verdict, w.outcome, counts, None, window.replay(seed),
                          time.monotonic() - t0)


def rounds(chosen: list, root: int, seeds: int) -> Iterator[tuple[int, Any, int]]:
    """(round, scenario, seed): round i takes each fault kind in turn (sorted), the kind's
    scenarios in turn (the i-th of them, cycling), with the seed of (kind, i)."""
    by_kind: dict[str, list] = defaultdict(list)
    for sc in chosen:
        by_kind[sc.fault or "none"].append(sc)
    for i in range(seeds):
        for kind in sorted(by_kind):
            group = by_kind[kind]
            yield i, group[i % len(group)], derive_seed(root, f"campaign:{kind}#{i}")


def _run_on(system_start: Callable[[], tuple], plan: list, campaign: Campaign, deadline: float,
            report_dir: Path) -> None:
    """Runs `plan` ((round, scenario, seed), ...) on one system while time is left."""
    from kvgate.harness.scenarios.runner import run_scenario
    from kvgate.harness.workload.prompts import Corpus

    if not plan or time.monotonic() >= deadline:
        return
    system, model = system_start()
    try:
        corpus = Corpus(model)
        for n, (i, sc, seed) in enumerate(plan, 1):
            if time.monotonic() >= deadline:
                campaign.stopped = f"the budget ran out before round {i} of {sc.fault or 'none'} ({sc.name})"
                return
            _say(f"[campaign {n}/{len(plan)}] round {i} {sc.fault or 'none'}: {sc.name} (seed {seed}) ...")
            try:
                r = run_window(system, corpus, sc, seed) if isinstance(sc, SoakWindow) else \
                    run_scenario(system, corpus, sc, seed)
            except Exception as exc:  # noqa: BLE001 - a harness defect: this run's failure, the campaign goes on
                r = harness_failure(sc, seed, exc)
            campaign.results.append(r)
            _say(f"[campaign {n}/{len(plan)}] {sc.name}: {r.verdict.label} ({r.outcome}) in {r.seconds:.0f} s"
                 + ("" if r.verdict.valid else f" - {r.verdict.reason[:300]}\n    replay: {r.replay}"))
            if r.verdict.valid is not True and not isinstance(sc, SoakWindow):
                write_schedule(report_dir, sc.name, seed)
    finally:
        system.stop()


def run_campaign(seed: int | None = None, seeds: int = 20, minutes: float = 60.0,
                 report_dir: Path = Path("reports/runs/campaign"), profile: str = "all",
                 scenarios: list[str] | None = None, soak_s: float = 60.0) -> int:
    from kvgate.harness.scenarios.catalog import on_hosts, store_of
    from kvgate.harness.system.default import start_hosts_system, start_system

    root = seed if seed is not None else secrets.randbits(32)
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    chosen = choose(profile, scenarios, soak_s)
    prov = provenance()
    key = {"seed": root, "commit": prov["short"], "clean": prov["clean"], "profile": profile, "seeds": seeds,
           "minutes": minutes, "soak_s": soak_s}
    print(f"kvgate campaign: replay key seed={root} commit={key['commit']}{title_flag(prov)} profile={profile} "
          f"seeds={seeds} minutes={minutes}", flush=True)
    campaign = Campaign(key)
    t0 = time.monotonic()
    deadline = t0 + minutes * 60
    plan = list(rounds(chosen, root, seeds))
    default = [p for p in plan if not on_hosts(p[1])]
    replicas = {r for _, sc, _ in default for r in sc.replicas}
    _run_on(lambda: start_system(report_dir, replicas), default, campaign, deadline, report_dir)
    for store in sorted({store_of(sc) for _, sc, _ in plan if on_hosts(sc)}):
        hosted = [p for p in plan if on_hosts(p[1]) and store_of(p[1]) == store]
        _run_on(lambda s=store: start_hosts_system(report_dir, s), hosted, campaign, deadline, report_dir)
    wall = time.monotonic() - t0
    status, reasons = judge(campaign, plan)
    doc = write_campaign(report_dir, campaign, plan, wall, reasons)
    print(format_kinds(doc["per_fault_kind"]))
    for f in doc["failures"]:
        print(f"  FAIL {f['scenario']} seed {f['seed']}: {f['reason'][:200]}\n    replay: {f['replay']}")
    print(f"kvgate campaign: {'PASS' if status == 0 else 'FAIL'} - {len(campaign.results)} runs in {wall:.0f} s"
          + ("" if status == 0 else ": " + "; ".join(reasons)) + f"; report {report_dir / 'campaign.md'}")
    return status


def choose(profile: str, scenarios: list[str] | None, soak_s: float) -> list:
    """The catalog's scenarios of the profile (kvgate.harness.gate.select), and the soak's
    window where the profile is `all` (no scenario named) or lists `soak`."""
    kinds = profile.split(",")
    soak = ("soak" in kinds or (profile == "all" and not scenarios)) and soak_s > 0
    rest = ",".join(k for k in kinds if k != "soak")
    chosen = select(rest, scenarios) if rest else []
    return chosen + ([SoakWindow(soak_s)] if soak else [])


def judge(campaign: Campaign, plan: list) -> tuple[int, list[str]]:
    """0 only when every planned run ran and passed: a failed run, a kind short of its seeds
    (the budget ran out) and an empty campaign all fail."""
    reasons = []
    if not campaign.results:
        reasons.append("nothing ran")
    failed = campaign.failures()
    if failed:
        reasons.append(f"{len(failed)} run(s) failed")
    planned: dict[str, int] = defaultdict(int)
    for _, sc, _ in plan:
        planned[sc.fault or "none"] += 1
    ran = campaign.kinds()
    short = {k: (ran.get(k, {}).get("seeds_run", 0), n) for k, n in planned.items()
             if ran.get(k, {}).get("seeds_run", 0) < n}
    if short:
        reasons.append("not run: " + ", ".join(f"{k} {got}/{n} seeds" for k, (got, n) in sorted(short.items()))
                       + (f" ({campaign.stopped})" if campaign.stopped else ""))
    return (1 if reasons else 0), reasons


def write_campaign(report_dir: Path, campaign: Campaign, plan: list, wall_s: float, reasons: list[str]) -> dict:
    kinds = campaign.kinds()
    doc = {
        "replay_key": campaign.replay_key,
        "provenance": provenance(),
        "wall_s": round(wall_s, 1),
        "planned_runs": len(plan),
        "runs": len(campaign.results),
        "passed": not reasons,
        "reasons": reasons,
        "per_fault_kind": kinds,
        "failures": [{"scenario": r.scenario, "fault": r.fault, "seed": r.seed, "outcome": r.outcome,
                      "reason": r.verdict.reason, "replay": r.replay,
                      "schedule": str(Path(report_dir) / "schedules" / f"{r.scenario}-{r.seed}.json")}
                     for r in campaign.failures()],
    }
    (report_dir / "campaign.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
    (report_dir / "campaign.md").write_text(markdown(doc))
    return doc


def markdown(doc: dict) -> str:
    key, prov = doc["replay_key"], doc["provenance"]
    lines = [f"# kvgate campaign{title_flag(prov)}", "",
             f"Commit {prov['short']} (clean: {prov['clean']}); replay key: `kvgate campaign --seed {key['seed']} "
             f"--seeds {key['seeds']} --minutes {key['minutes']} --profile {key['profile']}"
             f"{'' if key.get('soak_s', 60.0) == 60.0 else ' --soak-s ' + format(key['soak_s'], 'g')}`; "
             f"{doc['runs']} of {doc['planned_runs']} planned runs in {doc['wall_s']} s.", "",
             "| fault kind | scenarios | seeds run | faults fired | loads | silent corruptions | lost requests "
             "| misclassified | outputs differ | controls caught |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, k in sorted(doc["per_fault_kind"].items()):
        ctl = f"{k['controls_caught']}/{k['controls']}" if k["controls"] else "-"
        lines.append(f"| {name} | {', '.join(k['scenarios'])} | {k['seeds_run']} | "
                     + " | ".join(str(k[c]) for c in COUNTS[:-1]) + f" | {k['outputs_differ']} | {ctl} |")
    lines += ["", f"## Overall: {'PASS' if doc['passed'] else 'FAIL'}", ""]
    lines += [f"- {r}" for r in doc["reasons"]]
    if doc["failures"]:
        lines += ["", "## Failures", ""]
        for f in doc["failures"]:
            lines.append(f"- {f['scenario']} ({f['fault'] or 'none'}), seed {f['seed']}: {f['reason'][:300]}  \n"
                         f"  replay: `{f['replay']}`; schedule: {f['schedule']}")
    return "\n".join(lines) + "\n"
