"""The scenario catalog: one JSON file per scenario, shipped as package data of `fixtures`
(fixtures/scenarios/*.json), so an installed kvgate has its catalog.

A scenario file (data only; `runner` names an entry of RUNNERS: kvgate.harness.scenarios.live's
and kvgate.harness.scenarios.hostile's):

    {"name": "load-corrupt", "runner": "load_failure", "fault": "corrupt",
     "replicas": ["A", "B"], "params": {"kind": "corrupt"},
     "control": {"name": "hide_failures", "params": {...},       (optional)
                 "oracle": "byte-exact", "because": "words of its reason"},
     "seeds": 3,                                                  (optional cap)
     "expect": {"load_causes": ["corrupt"], "lookup_causes": [],
                "load_causes_allowed": []},                       (optional)
     "description": "..."}

A scenario is data: its workload and nemesis (the runner and its params; the fault kind,
whose site and heal step kvgate.faults.schedule names), the miss causes its run must show
(`expect`: exactly these load causes besides hits, and at most the allowed ones where an
adversary's timing decides whether a load meets its attempt; at least these lookup causes
besides never_published), its negative control and the oracle that must catch that control.

  catalog_dir()          where the catalog's files are (the installed package data)
  load_catalog(dir)      every scenario, sorted by name; a bad file is an error (ScenarioError).
  find(name, dir)        one scenario by name.
  replay_command(name, seed)   the command that replays one scenario run.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from pathlib import Path
from typing import Any

from kvgate.faults.schedule import KINDS
from kvpool.errors import MissCause
from kvgate.harness.scenarios import hostile, live
from kvgate.harness.system.default import HOSTS_REPLICAS

RUNNERS = {**live.RUNNERS, **hostile.RUNNERS}  # every runner a scenario file may name


# The parts of a scenario run's judgement, in order (kvgate.harness.scenarios.runner): the
# scenario's own checks, the output oracle over its comparisons, then the three oracles
# over the history.
ORACLES = ("scenario", "output", "byte-exact", "miss causes", "requests")


def catalog_dir() -> Path:
    return Path(str(importlib.resources.files("kvgate.fixtures") / "scenarios"))


KNOWN_REPLICAS = {"A", "B", "C", "D", "G", "H"}  # C: the tiny model's revision r2; D: the small-KV replica


class ScenarioError(ValueError):
    """A scenario file is malformed or names something that does not exist."""


@dataclasses.dataclass(frozen=True)
class Control:
    """A scenario's negative control: a known-bad strategy (its `params` switch it on), the
    oracle that must catch it, and, optionally, words that oracle's reason must contain
    (the control is caught only for the reason it exists)."""

    name: str
    params: dict[str, Any]
    oracle: str
    because: str = ""


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    runner: str
    fault: str | None
    replicas: tuple[str, ...]
    params: dict[str, Any]
    control: Control | None
    description: str
    seeds: int | None = None  # at most this many seeds per gate run (a costly scenario)
    # (the system a scenario runs on follows from its replicas: G and H are the hosts')
    expect_load_causes: tuple[str, ...] = ()  # the causes its loads end with, exactly (hits aside)
    expect_lookup_causes: tuple[str, ...] = ()  # causes its lookups must include (never_published aside)
    allow_load_causes: tuple[str, ...] = ()  # causes its loads may also end with (an adversary's timing decides)

    @classmethod
    def from_file(cls, path: Path) -> Scenario:
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ScenarioError(f"{path}: not JSON: {exc}") from exc
        known = {"name", "runner", "fault", "replicas", "params", "control", "description", "seeds", "expect"}
        if not isinstance(data, dict) or set(data) - known:
            raise ScenarioError(f"{path}: unknown fields {sorted(set(data) - known) if isinstance(data, dict) else data}")
        if data.get("name") != path.stem:
            raise ScenarioError(f"{path}: name {data.get('name')!r} must equal the file name {path.stem!r}")
        if data.get("runner") not in RUNNERS:
            raise ScenarioError(f"{path}: runner {data.get('runner')!r} is not one of {sorted(RUNNERS)}")

        fault = data.get("fault")
        if fault is not None and fault not in KINDS:
            raise ScenarioError(f"{path}: fault {fault!r} is not a fault kind ({sorted(KINDS)})")
        replicas = tuple(data.get("replicas", ("A", "B")))
        if set(replicas) - KNOWN_REPLICAS:
            raise ScenarioError(f"{path}: unknown replicas {sorted(set(replicas) - KNOWN_REPLICAS)}")
        if set(replicas) & HOSTS_REPLICAS and set(replicas) - HOSTS_REPLICAS:
            raise ScenarioError(f"{path}: replicas {sorted(replicas)} mix the default system's and the hosts' "
                                f"({sorted(HOSTS_REPLICAS)})")
        control = data.get("control")
        if control is not None:
            if set(control) - {"name", "params", "oracle", "because"}:
                raise ScenarioError(f"{path}: control has unknown fields {sorted(set(control) - {'name', 'params', 'oracle', 'because'})}")
            if control.get("oracle") not in ORACLES:
                raise ScenarioError(f"{path}: control {control.get('name')!r} must name the oracle that catches it, "
                                    f"one of {list(ORACLES)}; got {control.get('oracle')!r}")
            control = Control(control["name"], dict(control.get("params", {})), control["oracle"],
                              str(control.get("because", "")))
        expect = data.get("expect", {})
        causes = {c.value for c in MissCause}
        if not isinstance(expect, dict) or set(expect) - {"load_causes", "lookup_causes", "load_causes_allowed"} or any(
                c not in causes for c in [*expect.get("load_causes", []), *expect.get("lookup_causes", []),
                                          *expect.get("load_causes_allowed", [])]):
            raise ScenarioError(f"{path}: expect takes load_causes, lookup_causes and load_causes_allowed, lists of "
                                f"{sorted(causes)}; "
                                f"got {expect!r}")
        return cls(data["name"], data["runner"], fault, replicas, dict(data.get("params", {})), control,
                   str(data.get("description", "")), data.get("seeds"), tuple(expect.get("load_causes", ())),
                   tuple(expect.get("lookup_causes", ())), tuple(expect.get("load_causes_allowed", ())))


def load_catalog(directory: Path | None = None) -> list[Scenario]:
    directory = catalog_dir() if directory is None else directory
    scenarios = [Scenario.from_file(p) for p in sorted(Path(directory).glob("*.json"))]
    if not scenarios:
        raise ScenarioError(f"no scenario files in {directory}")
    return scenarios


def find(name: str, directory: Path | None = None) -> Scenario:
    directory = catalog_dir() if directory is None else directory
    path = Path(directory) / f"{name}.json"
    if not path.exists():
        names = sorted(p.stem for p in Path(directory).glob("*.json"))
        raise ScenarioError(f"no scenario {name!r}; the catalog has {names}")
    return Scenario.from_file(path)


def on_hosts(sc: Scenario) -> bool:
    """Whether the scenario runs on the multi-host system (kvgate.harness.system.hosts)."""
    return bool(set(sc.replicas) & HOSTS_REPLICAS)


def store_of(sc: Scenario) -> str:
    """The multi-host system's store a hosts scenario runs on (its `store` parameter)."""
    return str(sc.params.get("store", "redis"))


def replay_command(name: str, seed: int) -> str:
    return f"kvgate replay {name} --seed {seed}"
