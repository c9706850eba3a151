"""Checkers over one history (the JSON lines every connector, audit wrapper, fault
injector and the harness's own client wrote during a run; kvpool.history).

Each checker reads a window of records and returns a Verdict (valid true / false /
unknown, reason, evidence with counts, and what it does not check). They compose with
reports.render.all_of, and `classify` turns them into the run's outcome.

  window(history_dir, t0, t1)   the records of one scenario run, ordered by time.
  byte_exact(recs, pool_digest) every block a replica installed, and every block its
                                attention read (audit `installed` / `seen`), equals a
                                producer's bytes for that block (audit `produced`, same
                                namespace); blocks its load reported failed are exempt
                                (they are recomputed). Every pooled copy of a produced
                                block, where `pool_digest` can still find it, equals a
                                producer's bytes. A mismatch is a silent corruption.
  miss_causes(recs)             every lookup is a hit or exactly one known cause; every
                                load accounts for each block (loaded or failed) and names
                                its cause when short; every injected fault is followed by a
                                load of that replica ending in the fault's expected cause,
                                and no load ends short without an injected fault to explain
                                it (a pool-side nemesis explains transport errors while the
                                pool is down).
  requests(recs, policies, bound_s)
                                every request the harness sent ended (none lost), within
                                the bound; an explicit error only where the replica's
                                policy is `fail` and its load of that request failed.
  classify(...)                 "ok", or the outcome class of a failed run: "crash" (a
                                process died unbidden), "liveness" (a request lost or over
                                its bound), "correctness" (bytes, causes or outputs wrong).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

from kvpool.errors import MissCause
from kvpool.history import read_history
from reports.render import Verdict

LOOKUP_OUTCOMES = {"local_hit", "remote_hit", "miss", "skipped"}
CAUSES = {c.value for c in MissCause}
# the cause each injected fault must produce in the load it strikes (None: no miss at all)
EXPECTED_CAUSE: dict[str, str | None] = {
    "corrupt": "corrupt", "transport_error": "transport_error", "timeout": "timeout", "evict": "evicted",
    "stream_delay": None, "copier_control": None, "lease_hold": None,
    # the transport proxy (faults.proxy)
    "reset": "transport_error", "truncate": "transport_error", "drop_reply": "timeout", "stall": "timeout",
    "bitflip": "corrupt", "slow": None,
}


def window(history_dir: str | Path, t0: float, t1: float) -> list[dict]:
    return within(read_history(history_dir), t0, t1)


def within(recs: Iterable[dict], t0: float, t1: float) -> list[dict]:
    return [r for r in recs if t0 <= r["t"] <= t1]


def namespaces(recs: Iterable[dict]) -> dict[str, str]:
    """replica -> its namespace (as canonical JSON); the latest record wins."""
    out: dict[str, str] = {}
    for r in recs:
        if r["ev"] == "namespace":
            out[r["replica"]] = json.dumps(r["ns"], sort_keys=True)
    return out


def byte_exact(recs: list[dict], pool_digest: Callable[[str, list[str]], dict[str, str]] | None = None,
               known_namespaces: dict[str, str] | None = None) -> Verdict:
    """`pool_digest(replica, keys)` -> {key: committed digest} for the pool's copies under
    that replica's namespace. `known_namespaces`: replica -> namespace (`namespaces()` of
    the whole history), since the namespace records lie before the window."""
    ns_of = dict(known_namespaces or {})
    ns_of.update(namespaces(recs))
    produced: dict[tuple[str, str], set[str]] = defaultdict(set)
    for r in recs:
        if r["ev"] == "audit" and r["kind"] == "produced":
            for h, d in zip(r["hashes"], r["digests"]):
                produced[(ns_of.get(r["replica"], r["replica"]), h)].add(d)
    # Blocks the engine was told failed (the audit's record of get_block_ids_with_load_errors,
    # not the connector's own claim) are recomputed: exempt from the installed check.
    told_failed: dict[str, list[tuple[float, set[int]]]] = defaultdict(list)
    for r in recs:
        if r["ev"] == "audit_load_errors":
            told_failed[r["replica"]].append((r["t"], set(r["block_ids"])))

    def exempt(replica: str, t: float, block_id: int) -> bool:
        later = [ids for tf, ids in told_failed[replica] if t - 1e-6 <= tf <= t + 5.0]  # the same step
        return bool(later) and block_id in later[0]

    checked = unverified = 0
    bad: list[dict] = []
    for r in recs:
        if r["ev"] != "audit" or r["kind"] not in ("installed", "seen"):
            continue
        ns = ns_of.get(r["replica"], r["replica"])
        for bid, h, d in zip(r["block_ids"], r["hashes"], r["digests"]):
            if exempt(r["replica"], r["t"], bid):
                continue
            want = produced.get((ns, h))
            if not want:
                unverified += 1
                continue
            checked += 1
            if d not in want:
                bad.append({"replica": r["replica"], "tag": r["tag"], "kind": r["kind"], "block_id": bid, "hash": h})
    pooled_checked = 0
    if pool_digest is not None:
        seen_pooled: set[tuple[str, str]] = set()
        for r in recs:
            if r["ev"] != "audit" or r["kind"] != "produced":
                continue
            ns = ns_of.get(r["replica"], r["replica"])
            keys = r.get("keys") or r["hashes"]
            hash_of = dict(zip(keys, r["hashes"]))
            for key, d in pool_digest(r["replica"], keys).items():
                h = hash_of[key]
                if (ns, h) in seen_pooled:
                    continue
                seen_pooled.add((ns, h))
                pooled_checked += 1
                if d not in produced[(ns, h)]:
                    bad.append({"replica": "pool", "tag": r["tag"], "kind": "committed", "published_by": r["replica"],
                                "hash": h})
    evidence = {"blocks_checked": checked, "pooled_checked": pooled_checked, "unverified": unverified,
                "silent_corruptions": len(bad), "first": bad[:5]}
    not_checked = "blocks without a producer record in the window; pooled copies already evicted"
    if bad:
        return Verdict(False, f"{len(bad)} blocks differ from every producer's bytes", evidence, not_checked)
    if checked == 0 and pooled_checked == 0:
        if unverified:
            return Verdict(None, f"{unverified} installed blocks had no producer record to compare with", evidence,
                           not_checked)
        return Verdict(True, "nothing was installed or pooled in this window: nothing to compare", evidence,
                       not_checked)
    return Verdict(True, f"{checked} installed/read blocks and {pooled_checked} pooled copies equal the producer's bytes",
                   evidence, not_checked)


def miss_causes(recs: list[dict]) -> Verdict:
    bad: list[str] = []
    lookups = [r for r in recs if r["ev"] == "lookup"]
    loads = [r for r in recs if r["ev"] == "load"]
    for r in lookups:
        if r["outcome"] not in LOOKUP_OUTCOMES:
            bad.append(f"lookup {r['tag']}: outcome {r['outcome']!r}")
        elif r["outcome"] == "miss" and r.get("miss_cause") not in CAUSES:
            bad.append(f"lookup {r['tag']}: a miss without one known cause ({r.get('miss_cause')!r})")
    for r in loads:
        if r["loaded"] + len(r["failed_block_ids"]) != r["blocks"]:
            bad.append(f"load {r['tag']}: {r['loaded']} loaded + {len(r['failed_block_ids'])} failed != {r['blocks']}")
        if r["loaded"] < r["blocks"] and r.get("miss_cause") not in CAUSES:
            bad.append(f"load {r['tag']}: short without one known cause ({r.get('miss_cause')!r})")
        if r["loaded"] == r["blocks"] and r.get("miss_cause"):
            bad.append(f"load {r['tag']}: complete but names a cause ({r['miss_cause']})")
    # injected faults and the loads they strike, per replica, in time order
    faults = [r for r in recs if r["ev"] == "fault"]
    explained: set[int] = set()
    for f in faults:
        kind = f["kind"]
        if f.get("job") in ("store", "report"):
            continue  # store-side faults (and a control's report) strike no load
        if kind not in EXPECTED_CAUSE:
            bad.append(f"fault {kind!r} on {f['replica']}: no expected cause is declared for it")
            continue
        after = [r for r in loads if r["replica"] == f["replica"] and r["t"] >= f["t"] - 1e-3
                 and (f.get("tag") is None or r["tag"] == f["tag"])]
        if not after:
            bad.append(f"fault {kind} on {f['replica']} at {f['t']:.3f}: no load followed it")
            continue
        hit = after[0]
        want = EXPECTED_CAUSE[kind]
        if hit.get("miss_cause") != want:
            bad.append(f"fault {kind} on {f['replica']}: load {hit['tag']} ended as {hit.get('miss_cause')!r}, "
                       f"expected {want!r}")
        explained.add(id(hit))
    down = _pool_down_intervals(recs)
    for r in loads:
        if r["loaded"] < r["blocks"] and id(r) not in explained and not _within(r["t"], down):
            bad.append(f"load {r['tag']} on {r['replica']}: {r.get('miss_cause')} with no injected fault to explain it")
    for r in lookups:
        if r.get("miss_cause") == "transport_error" and not _within(r["t"], down) \
                and not any(f["replica"] == r["replica"] and f["t"] <= r["t"] for f in faults):
            bad.append(f"lookup {r['tag']} on {r['replica']}: transport_error with the pool up and no fault injected")
    causes = Counter(r.get("miss_cause") for r in lookups if r.get("miss_cause"))
    causes_loads = Counter(r.get("miss_cause") for r in loads if r.get("miss_cause"))
    evidence = {"lookups": len(lookups), "loads": len(loads), "faults": len(faults), "misclassified": len(bad),
                "lookup_causes": dict(causes), "load_causes": dict(causes_loads), "first": bad[:5]}
    not_checked = "the pool's own counters (the oracle's lookups move them too); causes of local-only requests"
    if bad:
        return Verdict(False, f"{len(bad)} misclassified: {bad[0]}", evidence, not_checked)
    return Verdict(True, f"{len(lookups)} lookups and {len(loads)} loads each end in a hit or exactly one cause; "
                   f"{len(explained)} injected faults each produced their expected cause", evidence, not_checked)


def _pool_down_intervals(recs: list[dict]) -> list[tuple[float, float]]:
    out, start = [], None
    for r in recs:
        if r["ev"] == "nemesis" and r.get("action") == "pool_kill":
            start = r["t"]
        elif r["ev"] == "nemesis" and r.get("action") == "pool_restart" and start is not None:
            out.append((start, r["t"]))
            start = None
    if start is not None:
        out.append((start, float("inf")))
    return out


def _within(t: float, intervals: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in intervals)


def requests(recs: list[dict], policies: dict[str, str], bound_s: float = 300.0) -> Verdict:
    """`policies`: replica -> kv_load_failure_policy."""
    invoked = {r["tag"]: r for r in recs if r["ev"] == "request" and r["phase"] == "invoke"}
    ended = {r["tag"]: r for r in recs if r["ev"] == "request" and r["phase"] in ("ok", "fail")}
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


def classify(*, crashed: bool, liveness: Verdict, correctness: list[Verdict]) -> str:
    if crashed:
        return "crash"
    if liveness.valid is False and liveness.evidence.get("lost", 0) + liveness.evidence.get("over_bound", 0):
        return "liveness"
    if liveness.valid is False or any(v.valid is False for v in correctness):
        return "correctness"
    return "ok"
