"""Corruption leaves the pool: a page corrupted at rest (a byte flipped in the tenant's
shared segment, as kvgate.faults.backend's corrupt fault does) is dropped after one loader's
report, or by the scrub's pass at rest, whatever its digest kind; and the scrub's state
stays within its bound under a churn far larger than the pool.

Each oracle is run against its negative control (kvgate.faults.corrupt_controls) and must catch
it: a loader that does not report and a daemon that ignores reports keep serving the
corrupt page; a scrub blind to xxh3-128 pages never finds it; a scrub queue that keeps an
entry per commit grows past the pool."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from kvgate.faults.corrupt_controls import DeafDaemon, HoardingCatalog, SilentLoader, XxhBlindScrubDaemon
from kvgate.harness.system.pool import DEFAULT_TENANT, unique_name
from kvpool.pool.catalog import Catalog
from kvpool.pool.records import CorruptOutcome
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load, publish
from kvpool.pool.digest import DigestKind
from kvpool.errors import InvalidRequest, LeaseLost, MissCause
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.metrics import ClientMetrics
from kvpool.pool.config import PoolConfig
from kvpool.pool.daemon import PoolDaemon

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
PAGE = 4096
HELD_OFF = 3600.0  # a scrub interval that keeps the scrub out of the test


def _daemon(daemon_class: type[PoolDaemon] = PoolDaemon, catalog: type[Catalog] = Catalog, **kwargs) -> PoolDaemon:
    """A real daemon (sockets, shared segment, its scrub thread) in a background thread."""
    name = unique_name("kvgc")
    config = PoolConfig(name=name, page_size=PAGE, run_dir=Path(tempfile.mkdtemp(prefix=f"{name}-")),
                        tenants={DEFAULT_TENANT: "tok"}, **kwargs)
    return daemon_class(config, catalog_factory=catalog).start_thread()


def _client(d: PoolDaemon, name: str = "t") -> PoolClient:
    return PoolClient(f"unix:{d.unix_path}", DEFAULT_TENANT, "tok", name=name)


def _pages(rng: np.random.Generator, k: int) -> list[np.ndarray]:
    return list(rng.integers(0, 256, (k, PAGE), dtype=np.uint8))


def _flip(c: PoolClient, page: int, rng: np.random.Generator) -> None:
    """A stray write into a committed page at rest, in the shared segment."""
    c.arena.page(page)[int(rng.integers(PAGE))] ^= 1 << int(rng.integers(8))


def _load(backend, hashes, metrics: ClientMetrics | None = None):  # noqa: ANN001, ANN202
    return load(backend, NS, hashes, lambda i: np.zeros(PAGE, np.uint8), metrics=metrics)


def corrupt_page_left(c: PoolClient, hashes: list[bytes], bad: int) -> str | None:
    """The oracle: None if the corrupt block `bad` is out of the pool (lookup, probe and the
    next load all stop there, the load as a miss, not as another corrupt load), else why not."""
    found = c.lookup(NS, hashes)
    if len(found.hits) != bad or found.miss is None or found.miss.cause != MissCause.EVICTED:
        return f"the corrupt page is still served: lookup has {len(found.hits)} hits, miss {found.miss}"
    probed = c.probe(NS, hashes)
    if probed is not None and probed != bad:
        return f"the segment's index still holds it: the probe finds {probed} blocks"
    again = _load(c, hashes)
    if again.loaded != bad or again.miss is None or again.miss.cause != MissCause.EVICTED:
        return f"the next load met it again: {again}"
    return None


@pytest.mark.parametrize("control", [None, "silent_loader", "deaf_daemon"])
def test_a_page_corrupted_at_rest_is_dropped_after_one_report(control, test_seed):
    """xxh3-128 pages (re-hashed at commit, so the scrub's fresh queue never sees them; the
    scrub is held off here): one byte flipped at rest; the first load stops there as corrupt
    and reports it; the daemon finds it corrupt too and drops it and its index entry at
    once: the next lookup, probe and load stop there as evicted, the page is free again.
    Fails before the report existed: the page stayed, each load met it again."""
    rng = np.random.default_rng(test_seed)
    k = 4
    bad = int(rng.integers(k))
    d = _daemon(DeafDaemon if control == "deaf_daemon" else PoolDaemon, num_pages=8, scrub_interval_s=HELD_OFF)
    try:
        with _client(d) as c:
            hashes = block_hashes(range(16 * k), 16)
            pages = _pages(rng, k)
            assert publish(c, NS, hashes, pages).committed == k
            _flip(c, c.lookup(NS, hashes).hits[bad].page, rng)
            metrics = ClientMetrics()
            loader = SilentLoader(c) if control == "silent_loader" else c
            first = _load(loader, hashes, metrics)
            assert first.loaded == bad and first.miss.cause == MissCause.CORRUPT, first
            reason = corrupt_page_left(c, hashes, bad)
            stats = c.stats()
            reported = metrics.loads.labels("report_dropped")._value.get()
    finally:
        d.stop_thread()
    if control is None:
        assert reason is None, reason
        assert stats["report_dropped"] == 1 and stats["discarded_corrupt"] == 1, stats
        assert stats["committed_pages"] == k - 1 and stats["dropped_pages"] == 0, stats
        assert reported == 1
    else:
        assert reason is not None and "still served" in reason, f"negative control {control} not caught"
        assert stats["report_dropped"] == 0 and stats["committed_pages"] == k, stats


def test_a_report_is_checked_not_believed_and_bounded_by_the_lease(test_seed):
    """A loader (buggy, or a hostile client of the tenant) reports good pages: the daemon
    re-hashes them at rest, finds them intact and keeps them. A report names only indexes of
    the session's own lease, each once: anything else is a typed refusal."""
    rng = np.random.default_rng(test_seed)
    k = 4
    d = _daemon(num_pages=8, scrub_interval_s=HELD_OFF)
    try:
        with _client(d, "liar") as c, _client(d, "other") as other:
            hashes = block_hashes(range(16 * k), 16)
            assert publish(c, NS, hashes, _pages(rng, k)).committed == k
            lease = c.acquire(NS, hashes)
            assert c.report_corrupt(lease.lease_id, range(k)) == [CorruptOutcome.INTACT] * k
            with pytest.raises(InvalidRequest, match="outside lease"):
                c.report_corrupt(lease.lease_id, [k])
            with pytest.raises(InvalidRequest, match="at most once"):
                c.report_corrupt(lease.lease_id, [0, 0])
            with pytest.raises(InvalidRequest, match="at most once"):
                c.report_corrupt(lease.lease_id, [0] * (k + 1))
            with pytest.raises(LeaseLost):
                other.report_corrupt(lease.lease_id, [0])  # another session's lease
            c.release(lease.lease_id)
            with pytest.raises(LeaseLost):
                c.report_corrupt(lease.lease_id, [0])  # released: the pages are no longer pinned for it
            stats = c.stats()
            assert stats["report_intact"] == k and stats["report_dropped"] == 0, stats
            assert len(c.lookup(NS, hashes).hits) == k and _load(c, hashes).loaded == k
    finally:
        d.stop_thread()


def test_a_page_dropped_under_other_leases_is_freed_at_the_last_release(test_seed):
    """Two loaders hold the page; one reports it: it leaves the index at once (a third
    lookup misses), keeps its bytes and generation while the other lease holds it (that
    release finds nothing stale), and is free after the last release."""
    rng = np.random.default_rng(test_seed)
    d = _daemon(num_pages=4, scrub_interval_s=HELD_OFF)
    try:
        with _client(d, "a") as a, _client(d, "b") as b:
            hashes = block_hashes(range(16), 16)
            assert publish(a, NS, hashes, _pages(rng, 1)).committed == 1
            la, lb = a.acquire(NS, hashes), b.acquire(NS, hashes)
            _flip(a, la.hits[0].page, rng)
            assert a.report_corrupt(la.lease_id, [0]) == [CorruptOutcome.DROPPED]
            assert a.lookup(NS, hashes).miss.cause == MissCause.EVICTED
            held = a.stats()
            assert held["dropped_pages"] == 1 and held["free_pages"] == 3 and held["committed_pages"] == 0, held
            assert a.release(la.lease_id).stale == ()
            assert a.stats()["dropped_pages"] == 1
            assert b.release(lb.lease_id).stale == ()
            after = a.stats()
            assert after["dropped_pages"] == 0 and after["free_pages"] == 4, after
    finally:
        d.stop_thread()


@pytest.mark.parametrize("control", [None, "xxh3_blind_scrub"])
def test_an_xxh3_page_corrupted_at_rest_is_found_by_the_scrub_within_a_cycle(control, test_seed):
    """xxh3-128 pages, verified at commit: a byte flipped at rest afterwards is found by the
    scrub's pass at rest within one cycle of its cursor (at most num_pages /
    scrub_rest_pages_per_round rounds: 16 / 4 x 0.05 s = 0.2 s here) and dropped. Judged in
    cycles, not seconds, so that a slow machine does not decide it: once the scrub has
    completed two more cycles than when the byte was flipped, the last of them began after
    the flip and visited every committed page. Fails before every kind was scrubbed: the
    pass covered only pages trusted at commit."""
    rng = np.random.default_rng(test_seed)
    k = 8
    bad = int(rng.integers(k))
    d = _daemon(XxhBlindScrubDaemon if control else PoolDaemon, num_pages=16, scrub_interval_s=0.05,
                scrub_rest_pages_per_round=4)
    try:
        with _client(d) as c:
            hashes = block_hashes(range(16 * k), 16)
            assert publish(c, NS, hashes, _pages(rng, k)).committed == k
            assert all(h.kind is DigestKind.XXH3 for h in c.lookup(NS, hashes).hits)
            _flip(c, c.lookup(NS, hashes).hits[bad].page, rng)
            t0 = time.monotonic()
            c0 = c.stats()["scrub_cycles"]
            while True:
                stats = c.stats()
                # +3: a Stats answered while the round that completed cycle c0 + 2 is hashing
                if stats["scrub_corrupt"] or stats["scrub_cycles"] >= c0 + 3:
                    break
                assert time.monotonic() - t0 < 30, f"the scrub made no progress: {stats}"
                time.sleep(0.01)
            seconds = time.monotonic() - t0
            reason = corrupt_page_left(c, hashes, bad)
    finally:
        d.stop_thread()
    if control is None:
        assert stats["scrub_corrupt"] == 1, f"not found within {stats['scrub_cycles'] - c0} cycles: {stats}"
        assert reason is None, reason
        assert stats["scrub_cycles"] < c0 + 3, stats
        print(f"found after {seconds:.3f} s, {stats['scrub_cycles'] - c0} completed cycles")
    else:
        assert stats["scrub_corrupt"] == 0 and reason is not None, f"negative control {control} not caught: {stats}"


@pytest.mark.parametrize("control", [None, "hoarding_queue"])
def test_the_scrub_queue_stays_within_its_bound_under_churn(control, test_seed):
    """500 trusted (kv-sketch-1) commits, one block each, through a pool of 8 pages (each
    publish evicts the least recently used page, every third block is evicted by hand),
    the scrub held off so that nothing drains the queue: the fresh queue never holds more
    entries than the pool has pages (`scrub_queue_bound`). Fails before: one entry per
    commit, kept after its page was evicted (here 500)."""
    rng = np.random.default_rng(test_seed)
    pages, churn = 8, 500
    d = _daemon(catalog=HoardingCatalog if control else Catalog, num_pages=pages, scrub_interval_s=HELD_OFF)
    peak = 0
    try:
        with _client(d) as c:
            page = _pages(rng, 1)
            for i in range(churn):
                h = block_hashes(range(16 * i, 16 * (i + 1)), 16)
                assert publish(c, NS, h, page, kind=DigestKind.SKETCH).committed == 1
                if i % 3 == 0:
                    c.evict(NS, h)
                if i % 50 == 49:
                    peak = max(peak, c.stats()["scrub_queued"])
            stats = c.stats()
    finally:
        d.stop_thread()
    assert stats["scrub_queue_bound"] == pages and stats["evictions"] >= churn - pages, stats
    if control is None:
        assert peak <= pages and stats["scrub_queued"] <= pages, (peak, stats)
    else:
        assert peak > 10 * pages, f"negative control {control} not caught: the queue peaked at {peak}"


def test_the_workers_load_reports_what_it_refused(tmp_path, test_seed):
    """The replica's worker (kvpool.connector.copier.HostCopier, the connector's CPU copy engine):
    its load of a run with a page corrupted at rest stops there as corrupt, and its report
    takes the page out of the pool for every replica: a second worker's load (another
    connection) stops there as evicted, not corrupt."""
    from kvpool.connector.copier import CopyRun, HostCopier
    from kvpool.connector.history import HistoryWriter, read_history

    rng = np.random.default_rng(test_seed)
    layers, blocks, half = 2, 4, PAGE // 2  # a page = one block of both layers
    bad = int(rng.integers(blocks))
    d = _daemon(num_pages=8, scrub_interval_s=HELD_OFF)
    copiers = []
    try:
        with _client(d, "producer") as c:
            hashes = block_hashes(range(16 * blocks), 16)
            assert publish(c, NS, hashes, _pages(rng, blocks)).committed == blocks
            _flip(c, c.lookup(NS, hashes).hits[bad].page, rng)
            for name in ("w1", "w2"):
                copier = HostCopier(_client(d, name), HistoryWriter(tmp_path / name, name, "worker"))
                copier.register([np.zeros((blocks, half), np.uint8) for _ in range(layers)])
                copiers.append(copier)
                run = CopyRun(f"req-{name}", name, 0, list(range(blocks)), hashes)
                copier.load(NS, run, deadline_s=10.0).result(timeout=30)
            stats = c.stats()
    finally:
        for copier in copiers:
            copier.close()
            copier.backend.close()
        d.stop_thread()
    loads = [[r for r in read_history(tmp_path / name) if r["ev"] == "load"][0] for name in ("w1", "w2")]
    assert [r["loaded"] for r in loads] == [bad, bad], loads
    assert [r["miss_cause"] for r in loads] == ["corrupt", "evicted"], loads
    assert stats["report_dropped"] == 1, stats


def test_a_report_longer_than_any_lease_is_refused_by_the_decoder():
    from kvpool.pool import protocol as P
    from kvpool.errors import MalformedFrame

    ok = P.encode_request(3, P.ReportCorrupt(1, list(range(P.MAX_REPORT_INDEXES))))
    assert len(P.decode_request(ok[4:])[1].indexes) == P.MAX_REPORT_INDEXES
    with pytest.raises(MalformedFrame, match="length"):
        P.decode_request(P.encode_request(3, P.ReportCorrupt(1, [0] * (P.MAX_REPORT_INDEXES + 1)))[4:])
