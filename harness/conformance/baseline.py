"""The known red cells of the conformance matrix, and the gate's judgement of a matrix
against them: a known failure is tracked, a new one blocks.

  signature_of(cell, checks=None, down=None) -> list[str]
        what failed in a cell, in words that do not change from run to run (no counts, no
        paths, no seeds): the names of the checks that failed; "replica B died
        (RuntimeError)" for a replica that died (the exception type of its log's root
        cause); "could not finish (RequestFailed)"; "negative control X not caught";
        "harness error (TypeError)". Empty for a cell that is not a failure.
  load(path) -> Baseline         the baseline file (TOML, harness/conformance/known_red.toml),
                                 checked: a malformed one raises BaselineError.
  judge(rows, baseline) -> dict  every cell's outcome, and whether the matrix passes.

Outcomes of a cell (connector, scenario) whose row ran with some versions:

  pass            it passed, and the baseline has nothing on it
  fixed upstream  it passed, and the baseline lists it red (on these versions or others, on
                  this device or for any): reported, the entry is to be retired (not blocking);
                  an entry for another device says nothing of the row
  known red       it failed with the signature of the baseline's entry for these versions
                  (not blocking: tracked, with its finding and upstream reference); an entry's
                  `racy` checks (a race in the peer that a run may or may not hit) may each
                  fail or not, its `signature` checks must all fail, and where it names
                  `witness` checks (of its racy ones) and any racy check failed, one of them
                  must be a witness: the race's own mark (wrong bytes), without which the
                  other racy checks (an output that differs) would be another bug
  not reproduced  it passed, and its entry for these versions is wholly racy (no signature
                  check): the run missed the peer's race (not blocking, the entry stays)
  changed         it failed, the baseline lists it red on these versions, but with another
                  signature: it fails differently (blocking)
  new red         it failed, and the baseline lists nothing on it for these versions
                  (blocking; an entry for other versions is named)
  n/a             the connector declares it lacks what the scenario needs (not blocking),
                  unless the baseline lists the cell red on these versions: then "not judged"
                  (blocking: the finding could not be checked again)
  not run         kvgate could not run it (blocking: never a pass)

A row whose connector could not run at all is "not run" in every cell. Baseline entries
for scenarios the matrix did not ask are listed as "not asked" (not blocking).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvgate.harness.report.conformance import label  # a row's name, as the table shows it

DEFAULT = Path(__file__).resolve().parent / "known_red.toml"
NOT_REPORTED = "not yet reported"
OUTCOMES = ("pass", "fixed upstream", "not reproduced", "known red", "changed", "new red", "n/a", "not judged", "not run")
BLOCKING = frozenset({"changed", "new red", "not judged", "not run"})

# the byte oracle's name in a signature: a cell whose own checks passed while it installed blocks whose
# bytes no replica with the consumer's weights computed (kvgate.harness.conformance.wrong_kv) fails of it
WRONG_KV = "every block installed is byte for byte one a replica with the consumer's weights computed"
_TYPE = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Exit|Interrupt))\b")
_FIELDS = {"id": str, "connector": str, "scenario": str, "versions": dict, "signature": list, "finding": str,
           "upstream": str, "report": str}
_OPTIONAL = {"device": str, "notes": str, "racy": list, "witness": list}
# what a race in the peer can never explain: a defect of kvgate's own, or a control that went blind
_NOT_RACY = ("harness error", "negative control", "positive control", "could not finish")
DEVICES = ("", "cpu", "cuda")


class BaselineError(ValueError):
    """The baseline file is malformed (its path and the entry said)."""


def _exc_type(text: str) -> str | None:
    m = _TYPE.search(text or "")
    return m.group(1) if m else None


def signature_of(cell: dict[str, Any], checks: Any = None, down: dict[str, str] | None = None) -> list[str]:
    """What failed in the cell, without its numbers (see the module's doc). `checks`: the
    scenario's Checks (kvgate.harness.checkers.verdict), whose failed check names are kept;
    `down`: replica -> its log's last errors, for replicas that died."""
    if cell.get("status") != "fail":
        return []
    sig: set[str] = set()
    if down:
        for name, text in down.items():
            kind = _exc_type((text.splitlines() or [""])[0])
            sig.add(f"replica {name} died" + (f" ({kind})" if kind else ""))
        return sorted(sig)
    reason = str(cell.get("reason") or "")
    if reason.startswith("harness error"):
        return [f"harness error ({_exc_type(reason) or 'unknown'})"]
    if checks is None:  # the run could not finish: a request failed, hung or the system went down
        return [f"could not finish ({_exc_type(reason) or reason.split(':')[0][:80]})"]
    sig.update(checks.failed_names)
    for control in cell.get("controls") or ([cell["control"]] if cell.get("control") else []):
        if control.get("caught") is False:
            inconclusive = str(control.get("why", "")).startswith("INCONCLUSIVE")
            sig.add(f"negative control {control['name']} not caught" + (" (inconclusive)" if inconclusive else ""))
    if not sig and (cell.get("wrong_kv") or {}).get("wrong"):
        sig.add(WRONG_KV)
    return sorted(sig)


def byte_oracle(cell: dict[str, Any]) -> dict[str, Any]:
    """The oracle every cell answers to beside its scenario's own: a cell that passed while it
    installed wrong KV (its wrong-KV count, `wrong`) fails, the count and the first block in its
    reason; any other cell as it is. A cell read from an earlier run is judged by it too."""
    wrong = cell.get("wrong_kv") or {}
    if cell.get("status") != "pass" or not wrong.get("wrong"):
        return cell
    first = (wrong.get("first") or [{}])[0]
    where = f"; first: {first.get('replica')} {first.get('tag')} block {first.get('block_id')}: {first.get('why')}" \
        if first else ""
    out = {**cell, "status": "fail",
           "reason": f"{wrong['wrong']} of {wrong.get('checked')} blocks installed are wrong KV ({WRONG_KV}){where}"[:600]}
    return {**out, "signature": [WRONG_KV]}


@dataclasses.dataclass(frozen=True)
class Entry:
    id: str
    connector: str
    scenario: str
    versions: dict[str, str]
    signature: tuple[str, ...]
    finding: str
    upstream: str  # a URL, or "not yet reported"
    report: str  # the finding's report, relative to the repository
    device: str = ""  # "" for any
    notes: str = ""
    racy: tuple[str, ...] = ()  # checks a race in the peer fails in some runs, not in others
    witness: tuple[str, ...] = ()  # of the racy ones: one of them fails whenever the race shows

    def matches(self, sig: Iterable[str]) -> bool:
        """A failure with this entry's signature: every signature check failed, nothing else
        than them and the racy ones, and, where a racy check failed and the entry names
        witnesses, one of those."""
        got, must = set(sig), set(self.signature)
        racy = got & set(self.racy)
        return (bool(got) and must <= got <= must | set(self.racy)
                and (not self.witness or not racy or bool(racy & set(self.witness))))

    def applies(self, row: dict[str, Any]) -> bool:
        return self.versions == dict(row.get("versions") or {}) and self.device in ("", row.get("device", ""))


@dataclasses.dataclass(frozen=True)
class Baseline:
    path: str
    sha256: str
    entries: tuple[Entry, ...]

    def for_cell(self, connector: str, scenario: str) -> list[Entry]:
        return [e for e in self.entries if e.connector == connector and e.scenario == scenario]


def parse(text: str, path: str = "<baseline>", scenarios: Iterable[str] | None = None) -> Baseline:
    """The baseline from its TOML text; `scenarios`: the known scenario names (an entry for
    another is refused)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BaselineError(f"{path}: not TOML: {exc}") from exc
    extra = set(doc) - {"red"}
    if extra:
        raise BaselineError(f"{path}: unknown top-level keys {sorted(extra)} (only [[red]] entries)")
    raw = doc.get("red", [])
    if not isinstance(raw, list):
        raise BaselineError(f"{path}: `red` must be an array of tables ([[red]])")
    known = set(scenarios) if scenarios is not None else None
    entries: list[Entry] = []
    seen: dict[tuple, str] = {}
    for i, item in enumerate(raw):
        where = f"{path}: entry {i + 1}" + (f" ({item.get('id')})" if isinstance(item, dict) and "id" in item else "")
        if not isinstance(item, dict):
            raise BaselineError(f"{where}: not a table")
        missing = sorted(set(_FIELDS) - set(item))
        unknown = sorted(set(item) - set(_FIELDS) - set(_OPTIONAL))
        if missing or unknown:
            raise BaselineError(f"{where}: " + "; ".join(([f"missing {missing}"] if missing else [])
                                                          + ([f"unknown keys {unknown}"] if unknown else [])))
        for key, kind in {**_FIELDS, **_OPTIONAL}.items():
            if key in item and not isinstance(item[key], kind):
                raise BaselineError(f"{where}: {key} must be a {kind.__name__}, not {type(item[key]).__name__}")
        if not item["versions"] or not all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in item["versions"].items()):
            raise BaselineError(f"{where}: versions must name each package's version as a string")
        racy = item.get("racy", [])
        if not all(isinstance(s, str) and s for s in [*item["signature"], *racy]):
            raise BaselineError(f"{where}: signature and racy must be lists of non-empty strings")
        if not item["signature"] and not racy:
            raise BaselineError(f"{where}: signature must be a non-empty list of strings (or racy, for a race)")
        if set(item["signature"]) & set(racy):
            raise BaselineError(f"{where}: {sorted(set(item['signature']) & set(racy))} in both signature and racy")
        blind = [r for r in racy if r.startswith(_NOT_RACY)]
        if blind:
            raise BaselineError(f"{where}: {blind} cannot be racy: a race in the peer never explains a harness "
                                "error, a control that failed or a cell that could not finish")
        if item.get("device", "") not in DEVICES:
            raise BaselineError(f"{where}: device must be one of {list(DEVICES[1:])} (or absent: any device), "
                                f"not {item['device']!r}")
        witness = item.get("witness", [])
        if not all(isinstance(w, str) and w in racy for w in witness):
            raise BaselineError(f"{where}: witness must name some of the racy checks")
        up = item["upstream"]
        if up != NOT_REPORTED and not re.fullmatch(r"https://\S+", up):
            raise BaselineError(f"{where}: upstream must be a URL or {NOT_REPORTED!r}, not {up!r}")
        if known is not None and item["scenario"] not in known:
            raise BaselineError(f"{where}: no scenario {item['scenario']!r}")
        key = (item["connector"], item["scenario"], tuple(sorted(item["versions"].items())), item.get("device", ""))
        if key in seen:
            raise BaselineError(f"{where}: the same cell and versions as {seen[key]}")
        if item["id"] in seen.values():
            raise BaselineError(f"{where}: the id {item['id']!r} is taken")
        seen[key] = item["id"]
        entries.append(Entry(**{**item, "signature": tuple(sorted(set(item["signature"]))),
                                "racy": tuple(sorted(set(racy))), "witness": tuple(sorted(set(witness)))}))
    return Baseline(path, hashlib.sha256(text.encode()).hexdigest(), tuple(entries))


def load(path: Path | str = DEFAULT) -> Baseline:
    from kvgate.harness.conformance.scenarios import SCENARIOS

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise BaselineError(f"{p}: cannot read the baseline: {exc}") from exc
    repo = Path(__file__).resolve().parents[2]
    shown = p.resolve().relative_to(repo) if p.resolve().is_relative_to(repo) else p  # as the repository names it
    return parse(text, str(shown), SCENARIOS)


def _outcome(row: dict[str, Any], name: str, cell: dict[str, Any], baseline: Baseline) -> dict[str, Any]:
    listed = baseline.for_cell(row["connector"], name)  # on any versions and device: named in a new red's why
    # an entry of another device says nothing of this row (a cell red on CUDA passing on CPU is not a fix)
    entries = [e for e in listed if e.device in ("", row.get("device", ""))]
    here = sorted((e for e in entries if e.applies(row)), key=lambda e: not e.device)  # the device's own first
    entry = here[0] if here else None
    status = cell.get("status")
    sig = sorted(cell.get("signature") or [])
    out: dict[str, Any] = {"status": status, "entry": entry.id if entry else None}
    if status == "pass":
        if entry is not None and not entry.signature:  # wholly racy: a pass is a run that missed the race
            out.update(outcome="not reproduced", upstream=entry.upstream,
                       why=f"passed this run; baseline {entry.id} is a race in the peer that a run may miss "
                           f"({entry.finding})")
        elif entries:
            e = entry or entries[0]
            same = " on the versions it was red on: it did not reproduce" if entry else ""
            out.update(outcome="fixed upstream", entry=e.id, upstream=e.upstream,
                       why=f"passes now{same} (baseline {e.id}: {e.finding})")
        else:
            out.update(outcome="pass", why="passed")
    elif status == "fail":
        if entry is None:
            other = [f"{e.id} ({', '.join(f'{k} {v}' for k, v in e.versions.items())}"
                     + (f", {e.device}" if e.device else "") + ")"
                     for e in listed]
            out.update(outcome="new red", signature=sig,
                       why="a failure the baseline does not list" + (f" on these versions (it lists {', '.join(other)})"
                                                                     if other else ""))
        elif entry.matches(sig):
            hit = f" (this run hit {len(set(sig) & set(entry.racy))} of its {len(entry.racy)} racy checks)" \
                if entry.racy else ""
            out.update(outcome="known red", upstream=entry.upstream, why=entry.finding + hit)
        else:
            known = list(entry.signature) + ([f"racy: {list(entry.racy)}"] if entry.racy else [])
            out.update(outcome="changed", signature=sig, expected=list(entry.signature), racy=list(entry.racy),
                       why=f"fails differently from baseline {entry.id}: now {sig}, known {known}")
    elif status == "n/a":
        if entry is not None:
            out.update(outcome="not judged", why=f"n/a ({cell.get('reason')}), but baseline {entry.id} lists it red: "
                                                 "the finding could not be checked again")
        else:
            out.update(outcome="n/a", why=str(cell.get("reason")))
    elif status == "not run":
        out.update(outcome="not run", why=f"not run, never a pass: {cell.get('reason')}")
    else:
        out.update(outcome="not run", why=f"unknown status {status!r}: never a pass")
    out["blocking"] = out["outcome"] in BLOCKING
    return out


def judge(rows: list[dict[str, Any]], baseline: Baseline) -> dict[str, Any]:
    """Each cell's outcome (connector -> scenario -> {outcome, blocking, why, entry, ...}), the
    blocking ones, the fixed ones and the entries not asked; `passed` when nothing blocks and
    at least one cell passed or is known red (a matrix that judged nothing does not pass)."""
    cells: dict[str, dict[str, Any]] = {}
    for row in rows:
        cells[label(row)] = {name: _outcome(row, name, cell, baseline) for name, cell in row["cells"].items()}
    flat = [(c, s, o) for c, by in cells.items() for s, o in by.items()]
    blocking = [f"{c} / {s}: {o['outcome']}: {o['why']}" for c, s, o in flat if o["blocking"]]
    judged = [o for _, _, o in flat if o["outcome"] in ("pass", "known red", "fixed upstream", "not reproduced")]
    not_asked = [e.id for e in baseline.entries
                 if any(e.connector == row["connector"] and e.applies(row) and e.scenario not in row["cells"]
                        for row in rows)]
    counts = {k: sum(o["outcome"] == k for _, _, o in flat) for k in OUTCOMES}
    passed = not blocking and bool(judged)
    why = ("; ".join(blocking) if blocking else
           "nothing was judged" if not judged else
           ", ".join(f"{n} {k}" for k, n in counts.items() if n))
    return {"baseline": {"path": baseline.path, "sha256": baseline.sha256, "entries": len(baseline.entries)},
            "passed": passed, "why": why, "counts": counts, "cells": cells, "blocking": blocking,
            "fixed_upstream": [f"{c} / {s}: {o['why']}" for c, s, o in flat if o["outcome"] == "fixed upstream"],
            "not_asked": not_asked}
