"""The verdict type every checker returns, and how verdicts compose.

  Verdict(valid, reason, evidence, not_checked)
        valid True / False / None (unknown: the check could not decide); evidence is a
        dict of counts and first examples; not_checked says what the check does not verify.
  all_of(verdicts, reason)
        False if any is False; else unknown if any is unknown; else True.
  Checks
        named boolean checks of one scenario run that become one Verdict.
"""

from __future__ import annotations

import dataclasses
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


class Checks:
    """Named boolean checks that become one Verdict."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.evidence: dict[str, object] = {}

    def check(self, name: str, ok: bool, detail: object = None) -> bool:
        if not ok:
            self.failed.append(f"{name}" + (f" ({detail})" if detail is not None else ""))
        return ok

    def verdict(self, passed: str) -> Verdict:
        if self.failed:
            return Verdict(False, "; ".join(self.failed), self.evidence)
        return Verdict(True, passed, self.evidence)
