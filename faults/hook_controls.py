"""Negative controls for the vLLM hooks' side of the pool client: known-bad strategies the
restart-under-probe race (suites/unit/test_hook_safety.py, the hostile `restart` scenario)
must catch.

  unguarded_probe(client, ns, hashes, fresh_s, pause_s=0.0)
        PoolClient.probe as it was before the probe took its snapshot: it reads the
        client's socket and mapped segment as attributes, one at a time, while the lookup
        thread's reconnect drops the one and swaps the other, and it trusts whatever the
        index region holds. A restart under it raises (AssertionError, ValueError,
        TypeError, AttributeError) on the scheduler thread, or answers from the old
        daemon's segment beside the new daemon's session (a run the pool does not hold).
        `pause_s`: it sleeps that long between its reads of the segment and of the socket
        (the window a scheduler thread busy with a step leaves the lookup thread), so that
        a live cluster, whose restarts are rare, meets the race within a few of them.
  UnguardedProbeClient
        a PoolClient whose probe is unguarded_probe.
  OverlongCatalog
        a daemon's catalog that answers a lookup or an acquire with a run longer than the
        blocks asked for (each hit twice): a scheduler that believed it would claim tokens
        past the prompt, a loader would install blocks past its run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvpool.pool.catalog import Catalog
from kvpool.pool.records import Hits
from kvpool.client.pool_client import PROBE_ORDERED, PoolClient
from kvpool.pool.keys import Namespace
from kvpool.pool.index import ShmIndex, ns_fingerprint


def unguarded_probe(client: PoolClient, ns: Namespace, hashes: Sequence[bytes],
                    fresh_s: float | None = None, pause_s: float = 0.0) -> int | None:
    """Negative control only: the probe without a snapshot (the defect is the reading of
    `client.arena` and `client._sock` one attribute at a time, with no lock)."""
    arena = client.arena
    entries = None if arena is None or not PROBE_ORDERED else arena.index_entries
    if entries is None or not entries.size:
        return None
    if pause_s > 0:
        time.sleep(pause_s)
    if fresh_s is not None:
        age = arena.heartbeat_age_s()
        if age is None or age > fresh_s:
            return None
        if client._sock is None:
            return None
        if pause_s > 0:
            time.sleep(pause_s)
        if client._peer_closed():
            return None
    index = getattr(client, "_unguarded_index", None)
    if index is None or index.e is not entries:
        index = client._unguarded_index = ShmIndex(entries)
    return index.probe(ns_fingerprint(ns), hashes)


class UnguardedProbeClient(PoolClient):
    """Negative control only: a PoolClient with the unguarded probe."""

    _unguarded_index: ShmIndex | None = None

    def probe(self, ns: Namespace, hashes: Sequence[bytes], fresh_s: float | None = None) -> int | None:
        return unguarded_probe(self, ns, hashes, fresh_s)


class OverlongCatalog(Catalog):
    """Negative control only: every run of hits it answers names each page twice."""

    def _refs(self, pages: list[int]) -> Hits:
        return super()._refs([p for p in pages for _ in range(2)])
