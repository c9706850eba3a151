"""The byte-exact oracle: every block a replica installed or attention read, and every
pooled copy, equals a producer's bytes.

  byte_exact(recs, pool_digest, known_namespaces)
        over one window of the history: every block a replica installed, and every block
        its attention read (audit `installed` / `seen`), equals a producer's bytes for that
        block (audit `produced`, same namespace); blocks its load reported failed are
        exempt (they are recomputed). Every pooled copy of a produced block, where
        `pool_digest` can still find it, equals a producer's bytes. A mismatch is a silent
        corruption.
  exchange_exact(cluster, producer, consumer, cold)
        one exchange (replica, tag) -> (replica, tag): every block the consumer installed
        equals the producer's bytes and the pool's committed copy; and the consumer's own
        cold recompute of the prefix gives the same bytes.
  pool_digests(pool, ns, keys)   digests of the pool's committed pages of those keys, hashed
                                 from the page bytes under a lease (an oracle client).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from kvgate.harness.checkers.history import audit_digests, namespace_of, namespaces
from kvgate.harness.checkers.verdict import Verdict
from kvpool.pool.digest import page_digest
from kvpool.pool.keys import Namespace


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
    # not the connector's own claim) are recomputed: exempt from the installed check, in the
    # very step (worker pid and step number) that installed them.
    told_failed: dict[tuple[str, object, object], set[int]] = defaultdict(set)
    for r in recs:
        if r["ev"] == "audit_load_errors":
            told_failed[(r["replica"], r.get("pid"), r.get("step"))].update(r["block_ids"])

    def exempt(r: dict, block_id: int) -> bool:
        return block_id in told_failed.get((r["replica"], r.get("pid"), r.get("step")), ())

    checked = unverified = 0
    bad: list[dict] = []
    for r in recs:
        if r["ev"] != "audit" or r["kind"] not in ("installed", "seen"):
            continue
        ns = ns_of.get(r["replica"], r["replica"])
        for bid, h, d in zip(r["block_ids"], r["hashes"], r["digests"]):
            if exempt(r, bid):
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
    audited = {r["replica"] for r in recs if r["ev"] == "audit"}
    unaudited = sorted({r["replica"] for r in recs if r["ev"] == "load" and r.get("loaded") and r["replica"] not in audited})
    evidence = {"blocks_checked": checked, "pooled_checked": pooled_checked, "unverified": unverified,
                "silent_corruptions": len(bad), "unaudited_replicas": unaudited, "first": bad[:5]}
    not_checked = "blocks without a producer record in the window; pooled copies already evicted"
    if bad:
        return Verdict(False, f"{len(bad)} blocks differ from every producer's bytes", evidence, not_checked)
    if unaudited:
        return Verdict(None, f"replicas {unaudited} loaded blocks without an audit: what they installed is unknown",
                       evidence, not_checked)
    if checked == 0 and pooled_checked == 0:
        if unverified:
            return Verdict(None, f"{unverified} installed blocks had no producer record to compare with", evidence,
                           not_checked)
        return Verdict(True, "nothing was installed or pooled in this window: nothing to compare", evidence,
                       not_checked)
    return Verdict(True, f"{checked} installed/read blocks and {pooled_checked} pooled copies equal the producer's bytes",
                   evidence, not_checked)


def pool_digests(pool, ns: Namespace, hashes: list[str]) -> dict[str, str]:  # noqa: ANN001 - has .client()
    """{key: digest of the page's bytes} of the pool's committed copies of `hashes` (hex pool
    keys) under `ns`: each page read under a lease and hashed here, so a stray write into a
    committed page shows (the digest the daemon recorded at commit is not trusted)."""
    with pool.client(name="oracle") as c:
        lease = c.acquire(ns, [bytes.fromhex(h) for h in hashes])
        try:
            return {hashes[i]: page_digest(c.read_page(lease, i)).hex() for i in range(len(lease.hits))}
        finally:
            if lease.lease_id:
                c.release(lease.lease_id)


def exchange_exact(cluster, producer: tuple[str, str], consumer: tuple[str, str],  # noqa: ANN001
                   cold: tuple[str, str] | None, pool=None) -> Verdict:  # noqa: ANN001
    """One exchange on a live cluster: producer / consumer / cold are (replica, tag); `pool`
    the store the replicas share, read by the oracle (`.client(name)`; default the cluster's
    pool daemon; a GPU keeper's tier: kvgate.harness.scenarios.gpu_tier_engine.TierOracle)."""
    h = cluster.history_dir
    produced = audit_digests(h, "produced", producer[1], producer[0])
    installed = audit_digests(h, "installed", consumer[1], consumer[0])
    if not installed:
        return Verdict(False, f"{consumer[0]} installed no block for {consumer[1]}", {"produced": len(produced)})
    pool = pool_digests(cluster.pool if pool is None else pool, namespace_of(h, consumer[0]), list(installed))
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
