"""Checks over a live cluster's history (what the connector and the audit recorded).

  records(history_dir, ev, **match)     history records of one kind, filtered by fields.
  audit_digests(history_dir, kind, tag, replica)
                                        {token-chain hash: digest} from audit records.
  byte_exact(cluster, producer_tag, consumer_tag, cold_tag)
                                        the first oracle on one exchange: every block the
                                        consumer installed equals the producer's bytes and
                                        the pool's committed copy; and the consumer's own
                                        cold recompute of the prefix gives the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from harness.cluster import Cluster
from kvpool.history import read_history
from kvpool.keys import Namespace
from reports.render import Verdict


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


def pool_digests(cluster: Cluster, ns: Namespace, hashes: list[str]) -> dict[str, str]:
    with cluster.pool.client(name="oracle") as c:
        found = c.lookup(ns, [bytes.fromhex(h) for h in hashes])
    return {hashes[i]: ref.digest.hex() for i, ref in enumerate(found.hits)}


def byte_exact(cluster: Cluster, producer: tuple[str, str], consumer: tuple[str, str],
               cold: tuple[str, str] | None) -> Verdict:
    """producer / consumer / cold are (replica, tag)."""
    h = cluster.history_dir
    produced = audit_digests(h, "produced", producer[1], producer[0])
    installed = audit_digests(h, "installed", consumer[1], consumer[0])
    if not installed:
        return Verdict(False, f"{consumer[0]} installed no block for {consumer[1]}", {"produced": len(produced)})
    pool = pool_digests(cluster, namespace_of(h, consumer[0]), list(installed))
    evidence: dict[str, object] = {"installed": len(installed), "produced": len(produced), "in_pool": len(pool)}
    bad_producer = [k for k, d in installed.items() if produced.get(k) != d]
    bad_pool = [k for k, d in installed.items() if k in pool and pool[k] != d]
    evidence.update(differs_from_producer=len(bad_producer), differs_from_pool=len(bad_pool))
    if bad_producer or bad_pool:
        return Verdict(False, f"{len(bad_producer)} installed blocks differ from the producer's, "
                       f"{len(bad_pool)} from the pool's committed copy", evidence)
    reason = "every installed block equals the producer's bytes and the pool's committed copy"
    if cold is not None:
        recomputed = audit_digests(h, "produced", cold[1], cold[0])
        common = [k for k in installed if k in recomputed]
        differ = [k for k in common if recomputed[k] != installed[k]]
        evidence.update(cold_compared=len(common), cold_differs=len(differ))
        if len(common) < len(installed):
            return Verdict(False, f"the cold recompute covered {len(common)} of {len(installed)} installed blocks",
                           evidence)
        if differ:
            return Verdict(False, f"the engine is not deterministic here: {len(differ)} of {len(common)} blocks "
                           f"of {cold[0]}'s own cold recompute differ from the loaded bytes", evidence)
        reason += f"; {cold[0]}'s cold recompute gives the same bytes"
    return Verdict(True, reason, evidence)
