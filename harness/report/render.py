"""Rendering a gate run: one JSON result, a JUnit XML file and a Markdown checklist.

  (Verdict, the checkers' result type, is kvgate.harness.checkers.verdict's.)
  Criterion      one line of the gate checklist: a name, its verdict, the replay command.
  write_reports(dir, run)   run.json, junit.xml, checklist.md under `dir`.
  table(headers, rows)      a Markdown table's lines (the one table writer of every report).
"""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from kvgate.harness.checkers.verdict import Verdict


@dataclasses.dataclass(frozen=True)
class Criterion:
    name: str
    verdict: Verdict
    replay: str
    seconds: float = 0.0


@dataclasses.dataclass
class GateRun:
    replay_key: dict[str, Any]
    criteria: list[Criterion] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.verdict.valid is True for c in self.criteria)


def table(headers: tuple[str, ...] | list[str], rows) -> list[str]:  # noqa: ANN001 - rows of cells
    """The lines of a Markdown table; a cell is any value, written with str()."""
    return [f"| {' | '.join(headers)} |", f"|{'---|' * len(headers)}",
            *(f"| {' | '.join(str(c) for c in row)} |" for row in rows)]


def _json_default(obj: object) -> object:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return str(obj)


def write_reports(directory: Path, run: GateRun) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"json": directory / "run.json", "junit": directory / "junit.xml", "markdown": directory / "checklist.md"}
    result = {
        "passed": run.passed,
        "replay_key": run.replay_key,
        "summary": run.summary,
        "criteria": [
            {"name": c.name, "result": c.verdict.label, "reason": c.verdict.reason, "evidence": c.verdict.evidence,
             "not_checked": c.verdict.not_checked, "replay": c.replay, "seconds": round(c.seconds, 3)}
            for c in run.criteria
        ],
    }
    paths["json"].write_text(json.dumps(result, indent=2, default=_json_default))

    suite = ET.Element("testsuite", name="kvgate-gate", tests=str(len(run.criteria)),
                       failures=str(sum(c.verdict.valid is False for c in run.criteria)),
                       skipped=str(sum(c.verdict.valid is None for c in run.criteria)))
    for c in run.criteria:
        case = ET.SubElement(suite, "testcase", classname="kvgate.gate", name=c.name, time=f"{c.seconds:.3f}")
        if c.verdict.valid is False:
            ET.SubElement(case, "failure", message=c.verdict.reason).text = f"replay: {c.replay}"
        elif c.verdict.valid is None:
            ET.SubElement(case, "skipped", message=f"unknown: {c.verdict.reason}")
        ET.SubElement(case, "system-out").text = json.dumps(c.verdict.evidence, default=_json_default)
    ET.ElementTree(suite).write(paths["junit"], encoding="unicode", xml_declaration=True)

    key = run.replay_key
    from kvgate.harness.provenance import provenance, title_flag

    # the title says whether the tree was dirty (the replay key's) or a carried copy that
    # did not match its stamp (the run's provenance, taken at its start)
    flag = title_flag({**provenance(), "clean": key.get("clean", True)})
    lines = [
        f"# kvgate gate checklist{flag}",
        "",
        f"Replay key: seed `{key.get('seed')}`, commit `{key.get('commit')}`"
        f"{'' if key.get('clean', True) else ' (made from a tree with uncommitted changes)'}, profile `{key.get('profile')}`",
        "",
        f"Result: **{'PASS' if run.passed else 'FAIL'}**",
        "",
    ]

    def evidence(c: Criterion) -> str:
        ev = ", ".join(f"{k}={v}" for k, v in c.verdict.evidence.items() if k != "parts")
        return f"{c.verdict.reason}{'; ' + ev if ev else ''}"

    lines += table(("criterion", "result", "evidence", "replay"),
                   [(c.name, c.verdict.label, evidence(c), f"`{c.replay}`") for c in run.criteria])
    kinds = run.summary.get("per_fault_kind") if run.summary else None
    if kinds:
        lines += ["", "## Per fault kind", "",
                  *table(("fault kind", "scenarios", "seeds run", "faults fired", "loads attempted",
                          "silent corruptions", "lost requests", "misclassified misses", "outputs differing",
                          "negative controls caught"),
                         [(name, ", ".join(k["scenarios"]), k["seeds_run"], k["faults_fired"], k["loads"],
                           k["silent_corruptions"], k["lost_requests"], k["misclassified"], k.get("outputs_differ", 0),
                           (f"{k['controls_caught']}/{k['controls']} ({'; '.join(k.get('caught_by', []))})"
                            if k["controls"] else "none"))
                          for name, k in sorted(kinds.items())])]
    not_checked = [f"- {c.name}: {c.verdict.not_checked}" for c in run.criteria if c.verdict.not_checked]
    if not_checked:
        lines += ["", "## What these checks do not verify", "", *not_checked]
    if run.summary:
        lines += ["", "## Summary", "", "```", json.dumps(run.summary, indent=2, default=_json_default), "```"]
    paths["markdown"].write_text("\n".join(lines) + "\n")
    return paths
