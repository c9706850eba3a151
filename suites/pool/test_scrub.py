"""Commits trusted at commit (kv-sketch-1) and the daemon's scrub at rest.

A trusted commit becomes visible without the daemon re-hashing it; every loader still
verifies it end to end; the scrub re-takes it at rest and drops a page whose bytes no
longer match. Negative controls: a daemon whose scrub never runs keeps the corrupt page
visible (the check that it was dropped fails), and the loader's own check is what then
catches it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load, publish
from kvpool.pool.digest import DigestKind, page_digest
from kvpool.errors import MissCause
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cuda:N,2,B,H,D", 16, 2, 2, 64)
PAGE = 32 * 1024


def _trusted_publish(c: PoolClient, hashes, pages) -> None:  # noqa: ANN001
    assert publish(c, NS, hashes, pages, kind=DigestKind.SKETCH).committed == len(pages)


def _until(c: PoolClient, done, timeout_s: float = 20.0) -> dict[str, int]:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while True:
        stats = c.stats()
        if done(stats):
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"the scrub did not get there within {timeout_s}s: {stats}")
        time.sleep(0.02)


def _scrubbed(c: PoolClient) -> dict[str, int]:
    return _until(c, lambda s: s["scrub_queued"] == 0 and s["scrubbed_pages"] + s["scrub_corrupt"] > 0)


@pytest.mark.parametrize("scrub", [True, False], ids=["scrub", "control-no-scrub"])
def test_a_page_corrupted_at_rest_is_dropped_by_the_scrub(scrub, test_seed):
    """Every page passes its first scrub; then one is corrupted at rest and the scrub's
    cycle over the scrubbed pages finds it and drops it."""
    rng = np.random.default_rng(test_seed)
    per_round = 16 if scrub else 0
    d = thread_pool(page_size=PAGE, num_pages=16, scrub_pages_per_round=per_round,
                    scrub_rest_pages_per_round=per_round)
    try:
        with PoolClient(f"unix:{d.unix_path}", "default", "tok", name="scrub") as c:
            k = 6
            hashes = block_hashes(range(16 * k), 16)
            pages = list(rng.integers(0, 256, (k, PAGE), dtype=np.uint8))
            bad = int(rng.integers(k))
            _trusted_publish(c, hashes, pages)
            hits = c.lookup(NS, hashes).hits
            assert len(hits) == k and all(h.kind is DigestKind.SKETCH for h in hits)
            if scrub:
                first = _until(c, lambda s: s["scrubbed_pages"] >= k)
                assert first["scrub_queued"] == 0 and first["scrub_corrupt"] == 0, first
            c.arena.page(hits[bad].page)[int(rng.integers(PAGE))] ^= 1 << int(rng.integers(8))  # a stray write
            if scrub:
                stats = _until(c, lambda s: s["scrub_corrupt"] > 0)
                assert stats["scrub_corrupt"] == 1, stats
            else:
                time.sleep(0.3)
                assert c.stats()["scrub_queued"] == k and c.stats()["scrubbed_pages"] == 0
            visible = len(c.lookup(NS, hashes).hits)
            dest = [np.zeros(PAGE, np.uint8) for _ in range(k)]
            got = load(c, NS, hashes, dest.__getitem__)
    finally:
        d.stop_thread()
    if scrub:
        assert visible == bad, f"the scrub left {visible} visible blocks, the corrupt one is block {bad}"
        assert got.loaded == bad and got.miss.cause == MissCause.EVICTED, got
    else:
        assert visible == k, "negative control: without a scrub the corrupt page stays visible"
        assert got.loaded == bad and got.miss.cause == MissCause.CORRUPT, f"the loader must catch it: {got}"
    assert all(np.array_equal(dest[i], pages[i]) for i in range(bad))


def test_a_trusted_commit_is_not_rehashed_but_a_lying_one_is_caught_by_its_loader(test_seed):
    """The daemon commits a kv-sketch-1 digest of other bytes as it is (no re-hash at
    commit); the loader's check refuses the page (corrupt) and reports it, and the daemon,
    finding the bytes at rest do not match either, drops it (the scrub is held off here so
    that the loader meets the page first); the same lie as xxh3-128 is rejected at commit."""
    rng = np.random.default_rng(test_seed)
    d = thread_pool(page_size=PAGE, num_pages=16, scrub_interval_s=3600.0)
    try:
        with PoolClient(f"unix:{d.unix_path}", "default", "tok", name="liar") as c:
            page = rng.integers(0, 256, PAGE, dtype=np.uint8)
            lie = page.copy()
            lie[0] ^= 1
            for kind, hashes in ((DigestKind.SKETCH, block_hashes(range(16), 16)),
                                 (DigestKind.XXH3, block_hashes(range(100, 116), 16))):
                res = c.reserve(NS, hashes, [PAGE])
                c.reserved_view(res, 0)[:] = page
                out = c.commit(res.reservation_id, [page_digest(lie, kind)], kind)
                if kind is DigestKind.XXH3:
                    assert out.committed == 0 and out.rejected == (0,), out
                    continue
                assert out.committed == 1, out
                got = load(c, NS, hashes, lambda i: np.zeros(PAGE, np.uint8))
                assert got.loaded == 0 and got.miss.cause == MissCause.CORRUPT, got
                stats = c.stats()
                assert stats["report_dropped"] == 1 and stats["scrubbed_pages"] == 0, stats
                assert stats["scrub_queued"] == 0 and stats["committed_pages"] == 0, stats
                assert c.lookup(NS, hashes).miss.cause == MissCause.EVICTED
    finally:
        d.stop_thread()


def test_an_unknown_digest_kind_is_a_typed_refusal():
    import msgspec

    from kvpool.pool import protocol as P
    from kvpool.errors import MalformedFrame

    good = P.encode_request(7, P.Commit(1, [b"d" * 16], DigestKind.SKETCH))
    assert P.decode_request(good[4:])[1].kind is DigestKind.SKETCH
    body = msgspec.msgpack.decode(good[4:])
    body[2]["kind"] = "crc32"
    with pytest.raises(MalformedFrame, match="crc32"):
        P.decode_request(msgspec.msgpack.encode(body))


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "trusted"])
def test_xxh3_commits_are_verified_unless_the_pool_trusts_them(verify, test_seed):
    """A wrong xxh3-128 digest is rejected at commit by default; a pool that trusts its
    commits (--trust-commits) makes it visible; it is never loaded (its loader refuses it,
    or the scrub dropped it first) and it is dropped (by the scrub, or on the loader's
    report, whichever comes first)."""
    rng = np.random.default_rng(test_seed)
    d = thread_pool(page_size=PAGE, num_pages=16, verify_commits=verify)
    try:
        with PoolClient(f"unix:{d.unix_path}", "default", "tok", name="trust") as c:
            page = rng.integers(0, 256, PAGE, dtype=np.uint8)
            hashes = block_hashes(range(16), 16)
            res = c.reserve(NS, hashes, [PAGE])
            c.reserved_view(res, 0)[:] = page
            page_lie = page.copy()
            page_lie[int(rng.integers(PAGE))] ^= 0x10
            out = c.commit(res.reservation_id, [page_digest(page_lie)])
            if verify:
                assert out.committed == 0 and out.rejected == (0,), out
                return
            assert out.committed == 1, out
            got = load(c, NS, hashes, lambda i: np.zeros(PAGE, np.uint8))
            # the loader refuses it, or the scrub already dropped it: either way it is never loaded
            assert got.loaded == 0 and got.miss.cause in (MissCause.CORRUPT, MissCause.EVICTED), got
            stats = _until(c, lambda s: s["scrub_corrupt"] + s["report_dropped"] == 1)
            assert len(c.lookup(NS, hashes).hits) == 0, stats
    finally:
        d.stop_thread()
