"""Reading the run's history (the JSON lines every connector, audit wrapper, fault
injector and the harness's own client wrote; kvpool.connector.history) for the checkers.

  read_history(dir, pattern)             every record of the run (of the files matching), ordered by
                                         time; a record still being written is not read.
  window(dir, t0, t1) / within(recs, t0, t1)
                                         the records of one scenario run.
  namespaces(recs)                       replica -> its namespace (canonical JSON).
  records(dir, ev, **match)              records of one kind, filtered by fields.
  audit_digests(dir, kind, tag, replica) {token-chain hash: digest} from audit records.
  failed_blocks(dir, tag, replica)       the block ids a replica's loads of a request failed.
  namespace_of(dir, replica)             a replica's latest namespace.
  unsettled_publishes(dir, replica, tag) the stores kvpool's worker queued for a request and has not
                                         recorded yet (its publishes still to land).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from kvpool.connector.history import read_history
from kvpool.pool.keys import Namespace

__all__ = ["read_history", "window", "within", "namespaces", "records", "audit_digests", "failed_blocks",
           "namespace_of", "unsettled_publishes"]


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


def records(history_dir: Path, ev: str, **match: object) -> list[dict]:
    return [r for r in read_history(history_dir) if r["ev"] == ev and all(r.get(k) == v for k, v in match.items())]


def audit_digests(history_dir: Path, kind: str, tag: str, replica: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in records(history_dir, "audit", kind=kind, tag=tag, replica=replica):
        out.update(zip(r["hashes"], r["digests"]))
    return out


def failed_blocks(history_dir: Path, tag: str, replica: str) -> set[int]:
    return {b for r in records(history_dir, "load", tag=tag, replica=replica) for b in r["failed_block_ids"]}


def namespace_of(history_dir: Path, replica: str) -> Namespace:
    ns = records(history_dir, "namespace", replica=replica)
    if not ns:
        raise LookupError(f"no namespace record for replica {replica}")
    return Namespace.from_dict(ns[-1]["ns"])


def unsettled_publishes(history_dir: Path, replica: str, tag: str) -> list[dict]:
    """The publishes of the request `tag` on `replica` still to land: each store its worker
    queued (`store_queued`, written in the step, before the response) without its record
    (`publish`, and `tier_publish` where it also went to the network tier). A preempted
    request's stores that had not started are dropped (`publish_dropped`, counting futures:
    a store and its tier store are two), the latest first: a drop stands for a record missing
    from the latest stores."""
    from collections import Counter

    queued, done, dropped = [], Counter(), Counter()
    # the replica's worker records only (its connector's and copier's: REPLICA.worker.PID.jsonl)
    for r in read_history(history_dir, f"{replica}.worker.*.jsonl"):
        if r["ev"] == "store_queued" and r.get("tag") == tag:
            queued.append(r)
        elif r["ev"] in ("publish", "tier_publish") and r.get("tag") == tag:
            done[(r["ev"], r["req"], r["first_block"])] += 1
        elif r["ev"] == "publish_dropped":
            dropped[r["req"]] += int(r.get("stores") or 0)
    left = []
    for q in reversed(queued):  # the latest first: those are the ones a drop can have cancelled
        missing = []
        for ev in ("publish", *(("tier_publish",) if q.get("tier") else ())):
            key = (ev, q["req"], q["first_block"])
            if done[key] > 0:
                done[key] -= 1
            elif dropped[q["req"]] > 0:
                dropped[q["req"]] -= 1
            else:
                missing.append(ev)
        if missing:
            left.append({**q, "missing": missing})
    return left[::-1]
