"""The requests oracle: every request the harness sent ended (none lost), within the
bound; an explicit error only where the replica's policy is `fail` and its load of that
request failed.

  requests(recs, policies, bound_s) -> Verdict
"""

from __future__ import annotations

from kvgate.harness.checkers.verdict import Verdict


def requests(recs: list[dict], policies: dict[str, str], bound_s: float = 300.0) -> Verdict:
    """`policies`: replica -> kv_load_failure_policy."""
    invoked = {r["tag"]: r for r in recs if r["ev"] == "request" and r["phase"] == "invoke"}
    # a request its client left on purpose (harness.client.http.abandon) ended there
    ended = {r["tag"]: r for r in recs if r["ev"] == "request" and r["phase"] in ("ok", "fail", "abandon")}
    failed_loads = {(r["replica"], r["tag"]) for r in recs if r["ev"] == "load" and r["failed_block_ids"]}
    lost = sorted(set(invoked) - set(ended))
    slow = sorted(t for t, r in ended.items() if r.get("total_s", 0) > bound_s)
    unexplained = []
    for tag, r in ended.items():
        if r["phase"] == "fail" or r.get("finish_reason") == "error":
            replica = r.get("replica", "")
            if not (policies.get(replica) == "fail" and (replica, tag) in failed_loads):
                unexplained.append(tag)
    evidence = {"requests": len(invoked), "ended": len(ended), "lost": len(lost), "over_bound": len(slow),
                "errors_unexplained": len(unexplained), "bound_s": bound_s,
                "first": (lost + slow + unexplained)[:5]}
    not_checked = "output equality with the no-cache baseline (each scenario checks it against its own reference)"
    if lost or slow:
        return Verdict(False, f"{len(lost)} requests lost, {len(slow)} over {bound_s}s", evidence, not_checked)
    if unexplained:
        return Verdict(False, f"{len(unexplained)} requests failed without a failed load under policy fail",
                       evidence, not_checked)
    return Verdict(True, f"all {len(invoked)} requests ended within {bound_s}s; errors only where policy fail "
                   "met a failed load", evidence, not_checked)
