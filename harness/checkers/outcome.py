"""A run's outcome class from its verdicts: "ok", or "crash" (a process died unbidden),
"liveness" (a request lost or over its bound), "correctness" (bytes, causes or outputs wrong).
"""

from __future__ import annotations

from kvgate.harness.checkers.verdict import Verdict


def classify(*, crashed: bool, liveness: Verdict, correctness: list[Verdict]) -> str:
    if crashed:
        return "crash"
    if liveness.valid is False and liveness.evidence.get("lost", 0) + liveness.evidence.get("over_bound", 0):
        return "liveness"
    if liveness.valid is False or any(v.valid is False for v in correctness):
        return "correctness"
    return "ok"
