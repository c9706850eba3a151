"""kvgate campaign (kvgate.harness.campaign) over a stand-in system and runner: its rounds,
its budget, its verdict and its report. The scenarios themselves run in the gate's suites;
here every run is a recorded call, so each test sees exactly which runs the campaign made."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kvgate.harness import campaign as C
from kvgate.harness.checkers.verdict import Verdict
from kvgate.harness.scenarios.runner import ScenarioResult


class FakeSystem:
    def __init__(self, log: list) -> None:
        self.log = log
        log.append("start")

    def stop(self) -> None:
        self.log.append("stop")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def world(monkeypatch, tmp_path):
    """Systems that only record their start and stop; a runner that records each run, costs
    `cost` seconds of a fake clock and fails where `fail(scenario, seed)` says."""
    import kvgate.harness.scenarios.runner as runner
    import kvgate.harness.system.default as default
    import kvgate.harness.workload.prompts as prompts

    log: list = []
    clock = Clock()
    state = {"cost": 10.0, "fail": lambda sc, seed: False, "raise": lambda sc, seed: False}

    def run_scenario(system, corpus, sc, seed):  # noqa: ANN001, ANN202
        log.append(("run", sc.name, sc.fault or "none", seed))
        clock.t += state["cost"]
        if state["raise"](sc, seed):
            raise RuntimeError("the harness broke")
        ok = not state["fail"](sc, seed)
        return ScenarioResult(sc.name, sc.fault, seed, Verdict(ok, "fine" if ok else "output differs"),
                              "ok" if ok else "correctness", {c: 0 for c in C.COUNTS}, None,
                              f"kvgate replay {sc.name} --seed {seed}", state["cost"])

    def run_window(system, corpus, window, seed):  # noqa: ANN001, ANN202
        log.append(("run", window.name, window.fault, seed))
        clock.t += window.seconds
        ok = not state["fail"](window, seed)
        return ScenarioResult(window.name, window.fault, seed, Verdict(ok, "fine" if ok else "2 lost requests"),
                              "ok" if ok else "liveness", {c: 0 for c in C.COUNTS}, None, window.replay(seed),
                              window.seconds)

    monkeypatch.setattr(runner, "run_scenario", run_scenario)
    monkeypatch.setattr(C, "run_window", run_window)
    monkeypatch.setattr(default, "start_system", lambda report_dir, replicas: (FakeSystem(log), tmp_path))
    monkeypatch.setattr(default, "start_hosts_system", lambda report_dir, store: (FakeSystem(log), tmp_path))
    monkeypatch.setattr(prompts, "Corpus", lambda model: object())
    monkeypatch.setattr(C.time, "monotonic", clock.monotonic)
    return log, clock, state, tmp_path / "report"


def runs(log: list) -> list[tuple]:
    return [e for e in log if isinstance(e, tuple)]


def test_each_round_runs_every_kind_once_and_cycles_its_scenarios():
    chosen = C.select("all")
    kinds = {sc.fault or "none" for sc in chosen}
    plan = list(C.rounds(chosen, 7, 3))
    assert len(plan) == 3 * len(kinds)
    for i in range(3):
        in_round = [sc for r, sc, _ in plan if r == i]
        assert sorted(sc.fault or "none" for sc in in_round) == sorted(kinds)
    by_kind = {}
    for _, sc, _ in plan:
        by_kind.setdefault(sc.fault or "none", []).append(sc.name)
    for k, names in by_kind.items():  # a kind with several scenarios takes them in turn
        group = [sc.name for sc in chosen if (sc.fault or "none") == k]
        assert names == [group[i % len(group)] for i in range(3)]
    seeds = [s for _, _, s in plan]
    assert len(set(seeds)) == len(seeds)  # every run its own seed
    assert plan == list(C.rounds(chosen, 7, 3))  # replayed from the root seed
    assert seeds != [s for _, _, s in C.rounds(chosen, 8, 3)]


def test_a_campaign_that_ran_everything_and_passed_exits_0(world):
    log, _, _, out = world
    rc = C.run_campaign(seed=5, seeds=2, minutes=10_000, report_dir=out, profile="corrupt,none")
    assert rc == 0
    doc = json.loads((out / "campaign.json").read_text())
    assert doc["passed"] and doc["runs"] == doc["planned_runs"] == len(runs(log))
    assert {k: v["seeds_run"] for k, v in doc["per_fault_kind"].items()} == {"none": 2, "corrupt": 2}
    assert log[0] == "start" and log[-1] == "stop"
    assert "## Overall: PASS" in (out / "campaign.md").read_text()


def test_a_failing_run_fails_the_campaign_and_names_its_replay(world):
    log, _, state, out = world
    target = list(C.rounds(C.select("corrupt"), 5, 3))[1][2]  # round 1's seed
    state["fail"] = lambda sc, seed: seed == target
    rc = C.run_campaign(seed=5, seeds=3, minutes=10_000, report_dir=out, profile="corrupt")
    assert rc == 1
    doc = json.loads((out / "campaign.json").read_text())
    assert [f["seed"] for f in doc["failures"]] == [target]
    assert doc["failures"][0]["replay"].endswith(f"--seed {target}")
    assert (out / "schedules" / f"{doc['failures'][0]['scenario']}-{target}.json").exists()
    assert len(runs(log)) == 3  # the campaign went on past the failure


def test_a_harness_error_is_that_runs_failure_and_the_campaign_goes_on(world):
    log, _, state, out = world
    state["raise"] = lambda sc, seed: len(runs(log)) == 1
    assert C.run_campaign(seed=5, seeds=2, minutes=10_000, report_dir=out, profile="corrupt") == 1
    doc = json.loads((out / "campaign.json").read_text())
    assert doc["runs"] == 2 and "harness error RuntimeError" in doc["failures"][0]["reason"]


def test_the_budget_stops_new_runs_and_short_kinds_are_not_a_pass(world):
    log, _, state, out = world
    state["cost"] = 60.0
    rc = C.run_campaign(seed=5, seeds=20, minutes=5, report_dir=out, profile="all")
    assert rc == 1
    ran = Counter(k for _, _, k, _ in runs(log))
    assert sum(ran.values()) == 5  # started at 0, 1, 2, 3, 4 minutes; none at 5
    assert max(ran.values()) - min(ran.values(), default=0) <= 1  # round-robin: no kind ahead by more than one
    doc = json.loads((out / "campaign.json").read_text())
    assert any(r.startswith("not run:") for r in doc["reasons"]), doc["reasons"]
    assert log.count("start") == log.count("stop")  # every system started was stopped


def test_a_campaign_that_ran_nothing_fails(world):
    log, _, _, out = world
    assert C.run_campaign(seed=5, seeds=2, minutes=0, report_dir=out, profile="corrupt") == 1
    doc = json.loads((out / "campaign.json").read_text())
    assert "nothing ran" in doc["reasons"] and not runs(log) and "start" not in log


def test_the_soaks_streams_are_a_kind_one_window_a_round_on_the_default_system(world):
    log, _, state, out = world
    assert C.run_campaign(seed=5, seeds=3, minutes=10_000, report_dir=out, profile="corrupt,soak", soak_s=45) == 0
    assert [k for _, _, k, _ in runs(log)].count("soak") == 3 and log.count("start") == 1
    doc = json.loads((out / "campaign.json").read_text())
    assert doc["per_fault_kind"]["soak"]["seeds_run"] == 3 and doc["replay_key"]["soak_s"] == 45
    assert "--soak-s 45" in (out / "campaign.md").read_text()
    target = [s for _, sc, s in C.rounds(C.choose("soak", None, 45), 5, 3)][2]
    state["fail"] = lambda sc, seed: seed == target
    assert C.run_campaign(seed=5, seeds=3, minutes=10_000, report_dir=out, profile="soak", soak_s=45) == 1
    doc = json.loads((out / "campaign.json").read_text())
    assert [f["replay"] for f in doc["failures"]] == [f"kvgate soak --minutes 0.75 --seed {target} --streams 3"]


def test_all_includes_the_soak_and_a_named_scenario_or_zero_seconds_leave_it_out():
    assert any(isinstance(sc, C.SoakWindow) for sc in C.choose("all", None, 60))
    assert not any(isinstance(sc, C.SoakWindow) for sc in C.choose("all", ["load-corrupt"], 60))
    assert not any(isinstance(sc, C.SoakWindow) for sc in C.choose("all", None, 0))
    assert C.choose("soak", None, 60) == [C.SoakWindow(60)]
