"""The verdict type every checker returns, and how verdicts compose.

  Verdict(valid, reason, evidence, not_checked)
        valid True / False / None (unknown: the check could not decide); evidence is a
        dict of counts and first examples; not_checked says what the check does not verify.
  all_of(verdicts, reason)
        False if any is False; else unknown if any is unknown; else True.
  Checks
        named boolean checks of one scenario run that become one Verdict, and the run's
        output comparisons (Checks.output), which the output oracle judges
        (kvgate.harness.checkers.output).
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


def describe_difference(rec: dict[str, Any]) -> str:
    """How an output comparison of Checks.output differs, in words."""
    if rec.get("why"):
        return rec["why"]
    if not rec.get("tokens_equal"):
        where = f"tokens differ from position {rec['first_token_differing']}"
        if rec.get("cached_tokens"):
            c = rec["cached_tokens"]
            where += f"; {c['under_test']} vs {c['reference']} prompt tokens cached: the partitions differ"
        return where
    return f"same tokens, log-probabilities differ by up to {rec['max_logprob_diff']:.3g}"


class Checks:
    """Named boolean checks that become one Verdict. `output` records a comparison of a
    completion with its reference for the output oracle; the verdict's evidence keeps the
    scenario's own failures (`checks_failed`) apart from the comparisons (`output`), so a
    run can be judged by each oracle on its own."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.output_failed: list[str] = []
        # the names alone (no details): what failed, the same from run to run (a signature)
        self.failed_names: list[str] = []
        self.outputs: list[dict[str, Any]] = []
        self.evidence: dict[str, object] = {}

    def check(self, name: str, ok: bool, detail: object = None) -> bool:
        if not ok:
            self.failed.append(f"{name}" + (f" ({detail})" if detail is not None else ""))
            self.failed_names.append(name)
        return ok

    def output(self, name: str, got: Any, ref: Any, cached: tuple[int | None, int | None] | None = None) -> bool:
        """`got` must have the tokens and the log-probabilities (to the last bit) of `ref`,
        a run of the same prefill partition; either may be None (a request that did not
        complete), which is a failed comparison. Duck-typed: token_ids and logprobs.
        `cached`: the prompt tokens each had cached (loaded or local) before its prefill;
        where they differ the runs were partitioned differently, whose KV differs in its
        last bits: then the tokens must be equal and the log-probabilities are reported."""
        rec: dict[str, Any] = {"check": name}
        if got is None or ref is None:
            rec.update(equal=False, why="no completion" + (" (under test)" if got is None else " (reference)"))
        else:
            tokens_equal = list(got.token_ids) == list(ref.token_ids)
            first = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref.token_ids)) if a != b),
                         None if len(got.token_ids) == len(ref.token_ids) else min(len(got.token_ids), len(ref.token_ids)))
            diffs = [abs(a - b) for a, b in zip(got.logprobs, ref.logprobs) if a is not None and b is not None]
            same_partition = cached is None or cached[0] == cached[1]
            rec.update(equal=tokens_equal and (not same_partition or list(got.logprobs) == list(ref.logprobs)),
                       tokens_equal=tokens_equal, first_token_differing=first, tokens=len(got.token_ids),
                       max_logprob_diff=max(diffs) if diffs else None)
            if not same_partition:
                rec.update(partitions_differ=True, cached_tokens={"under_test": cached[0], "reference": cached[1]})
        self.outputs.append(rec)
        if not rec["equal"]:
            self.output_failed.append(f"{name} ({describe_difference(rec)})")
            self.failed_names.append(name)
        return bool(rec["equal"])

    def verdict(self, passed: str) -> Verdict:
        evidence = {**self.evidence, "checks_failed": list(self.failed), "output": list(self.outputs)}
        failed = self.failed + self.output_failed
        if failed:
            return Verdict(False, "; ".join(failed), evidence)
        return Verdict(True, passed, evidence)
