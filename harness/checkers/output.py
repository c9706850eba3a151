"""The output oracle, and the scenario's own checks apart from it.

A scenario body compares each completion under test with a reference of the same prefill
partition (kvgate.harness.checkers.verdict.Checks.output: tokens and log-probabilities, to the
last bit). The fixture model's next token copies what followed an earlier occurrence of
the current one (kvgate.fixtures.tiny_model), so KV of the wrong context, or a page the engine
was told it had and never got, moves the output; the log-probabilities move even where a
greedy token does not.

  output(v)      the output oracle's verdict over a scenario run's comparisons: false if
                 any differs, true otherwise (true and "not checked" when the run made none).
  own_checks(v)  the scenario's verdict without its output comparisons.
"""

from __future__ import annotations

from kvgate.harness.checkers.verdict import Verdict, describe_difference


def output(v: Verdict) -> Verdict:
    compared = v.evidence.get("output")
    if compared is None:  # the run raised before it compared anything
        return Verdict(None if v.valid is False else True, "the run made no output comparison",
                       not_checked="output: no comparison")
    bad = [r for r in compared if not r.get("equal")]
    evidence = {"compared": len(compared), "differ": len(bad),
                "tokens_differ": sum(1 for r in bad if r.get("tokens_equal") is False),
                "first": [f"{r['check']}: {describe_difference(r)}" for r in bad[:5]]}
    if bad:
        return Verdict(False, f"{len(bad)} of {len(compared)} outputs differ from their same-partition reference "
                              f"({evidence['tokens_differ']} in their tokens)", evidence)
    if not compared:
        return Verdict(True, "no output to compare in this scenario", evidence, "output: no comparison")
    return Verdict(True, f"{len(compared)} outputs equal their same-partition reference, log-probabilities included",
                   evidence)


def own_checks(v: Verdict) -> Verdict:
    failed = v.evidence.get("checks_failed")
    if failed is None:  # not made by Checks (a run that raised): the verdict as it is
        return v
    if failed:
        return Verdict(False, "; ".join(failed), v.evidence, v.not_checked)
    return Verdict(True, v.reason if v.valid else "every check of the scenario held", v.evidence, v.not_checked)
