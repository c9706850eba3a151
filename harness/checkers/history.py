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
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from kvpool.connector.history import read_history
from kvpool.pool.keys import Namespace

__all__ = ["read_history", "window", "within", "namespaces", "records", "audit_digests", "failed_blocks",
           "namespace_of"]


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
