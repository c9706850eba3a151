"""The two high-level operations, for any PoolBackend: publish (reserve, write, commit, with
digests) and load (lease, copy, digest the installed bytes, report a bad page, release).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import numpy as np

from kvpool.pool.records import AcquireResult, Miss, SlotStatus
from kvpool.pool.copy import Buffer, as_segments, copy_digest_as, total_size
from kvpool.pool.digest import DigestKind, page_digest
from kvpool.errors import (
    ArenaError,
    Busy,
    CorruptPage,
    InvalidRequest,
    MalformedFrame,
    MissCause,
    PoolError,
    PoolTimeout,
)
from kvpool.pool.keys import Namespace
from kvpool.pool.metrics import ClientMetrics
from kvpool.client.backend import Destination, LoadResult, PoolBackend, PublishResult

# The side of a publish's copy its digests are taken over (kvpool.pool.copy.copy_digest): the
# producer's own bytes. The reserved page is in a segment every client of the tenant maps, so
# another may write it between the copy and the hash; a digest of the page would vouch for that
# client's bytes, and the daemon's re-verification at commit would then pass them.
PUBLISH_DIGEST_OF = "src"

# -- the two high-level operations, for any PoolBackend -------------------------------------
def publish(backend: PoolBackend, ns: Namespace, hashes: Sequence[bytes],
            blocks: Sequence[Buffer | Sequence[Buffer]], boundary: int | None = None,
            metrics: ClientMetrics | None = None, kind: DigestKind = DigestKind.XXH3) -> PublishResult:
    """Two-phase publish of `blocks[i]` (one buffer or a list of segments) under
    `hashes[i]`, with digests of `kind` (kvpool.pool.digest) taken over the caller's bytes as
    they are copied (PUBLISH_DIGEST_OF).
    Pages become visible only after the daemon's commit (which re-verifies xxh3-128
    digests unless it trusts its commits); on
    any error the reservation is aborted (and, if even that fails, the daemon reclaims it
    when the connection drops or the reservation's TTL passes)."""
    if len(blocks) != len(hashes):
        raise InvalidRequest(f"{len(hashes)} hashes but {len(blocks)} blocks")
    segments = [as_segments(b) for b in blocks]
    sizes = [total_size(s) for s in segments]
    res = backend.reserve(ns, hashes, sizes, boundary)
    if len(res.slots) != len(hashes):
        raise MalformedFrame(f"a reserve of {len(hashes)} blocks answered with {len(res.slots)} slots")
    count = {s: 0 for s in SlotStatus}
    for slot in res.slots:
        count[slot.status] += 1
    committed = rejected = 0
    if res.reservation_id:
        digests = []
        try:
            for i, slot in enumerate(res.slots):
                if slot.status != SlotStatus.RESERVED:
                    continue
                view = backend.reserved_view(res, i)
                if view is not None and view.size < sizes[i]:
                    raise ArenaError(f"slot {i}: a reserved page of {view.size} bytes for a block of {sizes[i]}")
                if view is not None:
                    digests.append(copy_digest_as(kind, segments[i], [view[: sizes[i]]], of=PUBLISH_DIGEST_OF))
                else:
                    data = np.concatenate(segments[i]) if len(segments[i]) > 1 else segments[i][0]
                    backend.write_page(res, i, data)
                    digests.append(page_digest(data, kind))
            out = backend.commit(res.reservation_id, digests, kind)
        except BaseException:
            try:
                backend.abort(res.reservation_id)
            except PoolError:
                pass  # the daemon reclaims it on disconnect or at its TTL
            raise
        committed, rejected = out.committed, len(out.rejected)
        if metrics is not None:
            metrics.bytes_published.inc(sum(n for n, s in zip(sizes, res.slots) if s.status == SlotStatus.RESERVED))
    return PublishResult(len(hashes), committed, count[SlotStatus.EXISTS], count[SlotStatus.PENDING],
                         count[SlotStatus.NOT_ADMITTED], count[SlotStatus.NO_CAPACITY], rejected)


def load(backend: PoolBackend, ns: Namespace, hashes: Sequence[bytes], dest: Destination,
         deadline_s: float | None = None, metrics: ClientMetrics | None = None) -> LoadResult:
    """Install the longest run of pooled blocks into `dest(i)`; classify any shortfall.
    Nothing the pool holds and no failure of the pool ends the load as an exception (the
    caller waits for it on vLLM's hot path, where an exception ends the engine): each is
    exactly one miss cause, and the result's `error` says what stopped it. A page whose
    length is not the destination's (a block of another layout pooled under this key) or
    whose bytes do not match its digest is `corrupt`; BUSY is `throttled`; a deadline
    passed is `timeout`; any other failure of the pool or the path to it (the daemon's
    error replies included) is `transport_error`. What is not the pool's raises: a
    destination that is not a buffer (the caller's own mistake)."""
    bound = getattr(backend, "call_deadline", None)  # a PoolClient, or a wrapper that passes it on
    with bound(deadline_s) if bound is not None and deadline_s is not None else contextlib.nullcontext():
        return _load(backend, ns, hashes, dest, deadline_s, metrics)


def _load(backend: PoolBackend, ns: Namespace, hashes: Sequence[bytes], dest: Destination,
          deadline_s: float | None, metrics: ClientMetrics | None) -> LoadResult:
    t0 = time.monotonic()
    requested = len(hashes)
    loaded = 0
    miss: Miss | None = None
    error = ""
    lease: AcquireResult | None = None
    refused = -1  # the lease's index of a page that failed the digest check
    try:
        lease = backend.acquire(ns, hashes)
        miss = lease.miss
        for i, ref in enumerate(lease.hits):
            if deadline_s is not None and time.monotonic() - t0 > deadline_s:
                raise PoolTimeout(f"load passed its deadline of {deadline_s}s at block {i}")
            target = as_segments(dest(i))
            if total_size(target) != ref.length:
                raise CorruptPage(f"block {i} (page {ref.page}): the pool holds a page of {ref.length} bytes "
                                  f"for a block of {total_size(target)}")
            source = as_segments(backend.read_page(lease, i))
            if total_size(source) != ref.length:
                raise CorruptPage(f"block {i} (page {ref.page}): {total_size(source)} bytes read of a page "
                                  f"of {ref.length}")
            if copy_digest_as(ref.kind, source, target) != ref.digest:
                raise CorruptPage(f"block {i} (page {ref.page}): installed bytes do not match the published digest")
            loaded += 1
    except CorruptPage as exc:
        miss, error = Miss(loaded, MissCause.CORRUPT), f"{type(exc).__name__}: {exc}"
        refused = loaded
    except PoolTimeout as exc:
        miss, error = Miss(loaded, MissCause.TIMEOUT), f"{type(exc).__name__}: {exc}"
    except Busy as exc:  # the daemon had no room for this client (a reconnect past max_clients) or its request
        miss, error = Miss(loaded, MissCause.THROTTLED), f"{type(exc).__name__}: {exc}"
    except PoolError as exc:  # TransportError, LeaseLost, MalformedFrame, ArenaError, an error reply, ...
        miss, error = Miss(loaded, MissCause.TRANSPORT_ERROR), f"{type(exc).__name__}: {exc}"
    finally:
        if lease is not None and lease.lease_id:
            if refused >= 0:
                report_corrupt(backend, lease, refused, metrics)
            try:
                stale = set(backend.release(lease.lease_id).stale)
            except PoolError as exc:
                # The connection (and with it the lease) is gone, or the daemon refused the
                # release; it unpins the pages itself (at the disconnect or the lease's TTL).
                # Blocks already verified by digest stand.
                stale = set()
                error = error or f"release: {type(exc).__name__}: {exc}"
                if metrics is not None:
                    metrics.loads.labels("release_failed").inc()
            stale_at = [i for i, h in enumerate(lease.hits[:loaded]) if h.page in stale]
            if stale_at:  # a page's generation moved under the lease: do not trust it
                loaded = stale_at[0]
                miss = Miss(loaded, MissCause.CORRUPT)
                error = f"page {lease.hits[loaded].page} was reused under the lease"
    seconds = time.monotonic() - t0
    if metrics is not None:
        metrics.load_seconds.observe(seconds)
        metrics.blocks_loaded.inc(loaded)
        if lease is not None:
            metrics.bytes_loaded.inc(sum(h.length for h in lease.hits[:loaded]))
        if miss is not None:
            metrics.misses.labels(miss.cause.value).inc()
        metrics.loads.labels("hit" if loaded == requested else ("partial" if loaded else "miss")).inc()
    return LoadResult(requested, loaded, miss, seconds, error)


def report_corrupt(backend: PoolBackend, lease: AcquireResult, index: int, metrics: ClientMetrics | None) -> None:
    """Report a page the load refused, its lease still held (the daemon re-checks it at rest
    and drops it if it is corrupt there, so the next request does not load it again). The
    load's outcome is the same either way: a report that fails is counted
    (loads{result="report_failed"}), not raised. A backend without report_corrupt (a
    wrapper that hides it) reports nothing."""
    report = getattr(backend, "report_corrupt", None)
    if report is None:
        return
    try:
        outcomes = report(lease.lease_id, [index])
    except PoolError:
        if metrics is not None:
            metrics.loads.labels("report_failed").inc()
        return
    if metrics is not None:
        metrics.loads.labels(f"report_{outcomes[0].value}" if outcomes else "report_failed").inc()
