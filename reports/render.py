"""Rendering a gate run: one JSON result, a JUnit XML file and a Markdown checklist.

  Verdict        valid True / False / None (unknown), reason, evidence (a dict), and what
                 the check does not verify. Verdicts compose with `all_of`.
  Criterion      one line of the gate checklist: a name, its verdict, the replay command.
  write_reports(dir, run)   run.json, junit.xml, checklist.md under `dir`.
"""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Verdict:
    valid: bool | None  # None: unknown (the check could not decide)
    reason: str
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    not_checked: str = ""

    @property
    def label(self) -> str:
        return {True: "pass", False: "FAIL", None: "unknown"}[self.valid]


def all_of(verdicts: list[Verdict], reason: str) -> Verdict:
    """False if any is False; else unknown if any is unknown; else True."""
    if any(v.valid is False for v in verdicts):
        valid: bool | None = False
    elif any(v.valid is None for v in verdicts):
        valid = None
    else:
        valid = True
    failing = [v.reason for v in verdicts if v.valid is not True]
    not_checked = "; ".join(dict.fromkeys(part for v in verdicts for part in v.not_checked.split("; ") if part))
    return Verdict(valid, reason if not failing else f"{reason}: " + "; ".join(failing),
                   {"parts": [dataclasses.asdict(v) for v in verdicts]}, not_checked)


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
    lines = [
        "# kvgate gate checklist",
        "",
        f"Replay key: seed `{key.get('seed')}`, commit `{key.get('commit')}`, profile `{key.get('profile')}`",
        "",
        f"Result: **{'PASS' if run.passed else 'FAIL'}**",
        "",
        "| criterion | result | evidence | replay |",
        "|---|---|---|---|",
    ]
    for c in run.criteria:
        evidence = ", ".join(f"{k}={v}" for k, v in c.verdict.evidence.items() if k != "parts")
        lines.append(f"| {c.name} | {c.verdict.label} | {c.verdict.reason}{'; ' + evidence if evidence else ''} "
                     f"| `{c.replay}` |")
    kinds = run.summary.get("per_fault_kind") if run.summary else None
    if kinds:
        lines += ["", "## Per fault kind", "",
                  "| fault kind | scenarios | seeds run | faults fired | loads attempted | silent corruptions "
                  "| lost requests | misclassified misses | negative controls caught |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, k in sorted(kinds.items()):
            ctl = f"{k['controls_caught']}/{k['controls']}" if k["controls"] else "none"
            lines.append(f"| {name} | {', '.join(k['scenarios'])} | {k['seeds_run']} | {k['faults_fired']} "
                         f"| {k['loads']} | {k['silent_corruptions']} | {k['lost_requests']} | {k['misclassified']} "
                         f"| {ctl} |")
    not_checked = [f"- {c.name}: {c.verdict.not_checked}" for c in run.criteria if c.verdict.not_checked]
    if not_checked:
        lines += ["", "## What these checks do not verify", "", *not_checked]
    if run.summary:
        lines += ["", "## Summary", "", "```", json.dumps(run.summary, indent=2, default=_json_default), "```"]
    paths["markdown"].write_text("\n".join(lines) + "\n")
    return paths
