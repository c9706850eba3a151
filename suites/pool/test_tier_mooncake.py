"""The network tier on Mooncake Store (kvpool.tier.mooncake), on a real `mooncake_master`
the test starts (TCP on loopback, its built-in metadata server): pages byte-exact between
two clients in two processes, a byte changed in a stored record is `corrupt` (with its
negative control, a tier that re-digests what it reads, caught by the byte check), a full
store evicts whole pages and never serves other bytes, a killed master is unavailable at
once and comes back empty; with a storage node (`mooncake_client`) holding every page for
clients that mount nothing, the node killed is `unavailable` (never a silent miss) and,
restarted, takes pages again. Mooncake has no access control: a client of the store without
the tenant's tier secret moves a record under another block's key and rewrites a page with
its plain digest recomputed; both are `corrupt` (the records' MAC), and the control, the
reader before records were authenticated, installs both and is caught by the byte check.
Skipped where the mooncake package is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvgate.faults.tier_controls import BlindTier, EagerBufferTier, SizeThenFetchTier, UnauthenticatedTier, forge_record
from kvgate.harness.system.stores import MooncakeMaster, MooncakeNode, mooncake_binary, mooncake_env
from kvpool.pool.digest import page_digest
from kvpool.errors import MissCause
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.tier.record import TierAuth, TierCorrupt, TierUnavailable, record_bound, tier_key
from kvpool.tier.registry import open_tier

PAGE = 128 * 1024
NS = Namespace(model_id="tiny", model_revision="r1", tokenizer_hash="t", kv_dtype="bfloat16", kv_layout="cpu",
               block_size=16, num_layers=2, num_kv_heads=2, head_size=64)

SECRET = "the default tenant's tier secret"
AUTH = TierAuth.from_secret("default", SECRET)
pytestmark = pytest.mark.skipif(mooncake_binary() is None, reason="mooncake is not installed")
# Each of the client's calls is bounded by the tier's timeout; the verdicts here are not about
# it, and a loaded machine can take past the connector's 1 s for a call (the first put after
# a mount, say), so the tests' clients wait longer. The killed master's "at once" is its health
# check's answer, not this bound.
TIMEOUT_S = 10.0


def pages(seed: int, n: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    return (block_hashes(list(rng.integers(0, 2000, n * 16)), 16),
            [rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes() for _ in range(n)])


@pytest.fixture
def master(tmp_path):
    os.environ.update(mooncake_env())
    m = MooncakeMaster(tmp_path / "mooncake", lease_ms=2000).start()
    yield m
    m.stop()


READER = """
import sys
from kvpool.pool.keys import Namespace
from kvpool.tier.record import TierAuth
from kvpool.tier.registry import open_tier
ns = Namespace.from_dict(eval(sys.argv[2]))
t = open_tier(sys.argv[1], TierAuth.from_secret(ns.tenant, sys.argv[3]), 10.0)
for h in sys.argv[4:]:
    p = t.get(ns, bytes.fromhex(h))
    print(p.data.hex()[:64] if p else "-", len(p.data) if p else 0, flush=True)
t.close()
"""


def test_pages_cross_the_store_byte_exact_between_two_processes(master, test_seed):
    hashes, data = pages(test_seed, 4)
    t = open_tier(master.url, AUTH, TIMEOUT_S)
    try:
        for h, p in zip(hashes[:3], data[:3]):
            assert t.put(NS, h, p, page_digest(p))
        assert t.exists(NS, hashes) == 3 and t.get(NS, hashes[3]) is None
        out = subprocess.run([sys.executable, "-c", READER, master.url, repr(NS.as_dict()), SECRET,
                              *(h.hex() for h in hashes)],
                             capture_output=True, text=True, timeout=60, env={**os.environ, **mooncake_env()})
        assert out.returncode == 0, out.stderr[-2000:]
        lines = [ln for ln in out.stdout.splitlines() if ln]
        assert lines == [f"{p.hex()[:64]} {PAGE}" for p in data[:3]] + ["- 0"]
        t.remove(NS, hashes[0])
        assert t.get(NS, hashes[0]) is None and t.exists(NS, hashes) == 0
    finally:
        t.close()


@pytest.mark.parametrize("reader_kind", ["tier", "blind"])
def test_a_byte_changed_in_the_store_is_corrupt_and_the_blind_reader_is_caught(master, test_seed, reader_kind):
    hashes, data = pages(test_seed, 1)
    t = open_tier(master.url, AUTH, TIMEOUT_S)
    try:
        assert t.put(NS, hashes[0], data[0], page_digest(data[0]))
        key = tier_key(AUTH, NS, hashes[0])
        record = bytearray(t._s.get(key))
        at = len(record) - PAGE + int(np.random.default_rng(test_seed).integers(PAGE))
        record[at] ^= 0x10
        time.sleep(2.2)  # the read above holds a lease (2 s here): the store's upsert waits it out
        assert t._s.upsert(key, bytes(record)) == 0  # the data fault: the stored bytes changed
        reader = t if reader_kind == "tier" else BlindTier(t)
        try:
            got = reader.get(NS, hashes[0])
        except TierCorrupt as exc:
            assert reader_kind == "tier" and exc.cause is MissCause.CORRUPT
            return
        assert reader_kind == "blind", "the tier handed out a page it should have refused"
        assert got is not None and got.data != data[0], "negative control not caught by the byte-exact check"
    finally:
        t.close()


@pytest.mark.parametrize("reader_kind", ["tier", "control-unauthenticated"])
def test_a_moved_or_forged_record_is_corrupt_and_the_unauthenticated_reader_is_caught(master, test_seed,
                                                                                      reader_kind):
    hashes, data = pages(test_seed, 3)
    forged_page = np.random.default_rng(test_seed + 1).integers(0, 256, PAGE, dtype=np.uint8).tobytes()
    t = open_tier(master.url, AUTH, TIMEOUT_S)
    try:
        for h, p in zip(hashes, data):
            assert t.put(NS, h, p, page_digest(p))
        # A client of the store, no secret (the tier's own store client, used raw): the keys as
        # it saw them written; block 0's record copied under block 1's key, block 2's page rewritten.
        raw, keys = t._s, [tier_key(AUTH, NS, h) for h in hashes]
        moved, rewritten = bytes(raw.get(keys[0])), forge_record(bytes(raw.get(keys[2])), page=forged_page)
        time.sleep(2.2)  # the reads above hold a lease (2 s here): the store's upsert waits it out
        assert raw.upsert(keys[1], moved) == 0 and raw.upsert(keys[2], rewritten) == 0
        reader = t if reader_kind == "tier" else UnauthenticatedTier(t)
        for i in (1, 2):
            try:
                got = reader.get(NS, hashes[i])
            except TierCorrupt as exc:
                assert reader_kind == "tier" and exc.cause is MissCause.CORRUPT
                continue
            assert reader_kind != "tier", f"the tier handed out the attacker's record of block {i}"
            assert got is not None and got.data != data[i], "negative control not caught by the byte-exact check"
        assert t.get(NS, hashes[0]).data == data[0]  # the untouched record still serves
    finally:
        t.close()


class Fetches:
    """The tier's store client with every call that moves a record's bytes to the reader
    recorded (name, key, the most bytes it may move: None for no bound); `before_fetch` runs
    first (an attacker's write at exactly that moment)."""

    MOVES = ("get", "get_into", "get_buffer", "get_batch", "batch_get_buffer", "batch_get_into", "get_tensor")

    def __init__(self, raw, before_fetch=None):  # noqa: ANN001
        self.raw, self.before_fetch, self.calls = raw, before_fetch, []

    def __getattr__(self, name):  # noqa: ANN001, ANN204
        fn = getattr(self.raw, name)
        if name not in self.MOVES:
            return fn

        def moving(key, *args):  # noqa: ANN001, ANN202
            if self.before_fetch is not None:
                self.before_fetch(key)
            self.calls.append((name, key, args[1] if name == "get_into" else None))
            return fn(key, *args)
        return moving


def test_a_ballooned_record_is_corrupt_and_never_fetched(master, test_seed):
    """Any client of a Mooncake store (it has no access control) puts 8 MiB under one of the
    tenant's keys: a reader that knows a page here is PAGE bytes fetches into a buffer of a
    record's bound, so the store refuses the larger record without moving it, and the reader
    calls it corrupt. Every fetch is bounded (none unbounded, none past the bound)."""
    hashes, data = pages(test_seed, 2)
    t = open_tier(master.url, AUTH, TIMEOUT_S)
    try:
        for h, p in zip(hashes, data):
            assert t.put(NS, h, p, page_digest(p))
        raw, key = t._s, tier_key(AUTH, NS, hashes[1])
        time.sleep(2.2)  # no lease held: the upsert goes through
        assert raw.upsert(key, bytes(t._s.get(tier_key(AUTH, NS, hashes[0]))) + bytes(8 * 2**20)) == 0
        t._s = fetches = Fetches(raw)
        try:
            assert t.get(NS, hashes[0], max_page_bytes=PAGE).data == data[0]
            with pytest.raises(TierCorrupt, match="not read") as exc:
                t.get(NS, hashes[1], max_page_bytes=PAGE)
            assert exc.value.cause is MissCause.CORRUPT
        finally:
            t._s = raw
        bound = record_bound(PAGE)
        assert fetches.calls == [("get_into", tier_key(AUTH, NS, hashes[0]), bound), ("get_into", key, bound)]
    finally:
        t.close()


@pytest.mark.parametrize("reader_kind", ["tier", "control-size-then-fetch"])
def test_a_record_replaced_by_a_ballooned_one_just_before_the_fetch_is_never_fetched(master, test_seed,
                                                                                   reader_kind):
    """The same attacker, at the last moment: the record is replaced by a ballooned one just
    before the reader's fetch. The tier's one bounded fetch is measured by the store, so there
    is no window between a size check and a fetch: corrupt, not read. Oracle: no fetch may move
    more than a record's bound. The control (SizeThenFetchTier: the size read, then the record
    fetched whole) brings the attacker's 8 MiB in, and the oracle sees its unbounded fetch."""
    hashes, data = pages(test_seed, 1)
    t = open_tier(master.url, AUTH, TIMEOUT_S)
    try:
        assert t.put(NS, hashes[0], data[0], page_digest(data[0]))
        raw = t._s
        key = tier_key(AUTH, NS, hashes[0])
        ballooned = bytes(raw.get(key)) + bytes(8 * 2**20)
        time.sleep(2.2)  # the read above holds a lease (2 s here): the store's upsert waits it out
        t._s = fetches = Fetches(raw, before_fetch=lambda k: raw.upsert(k, ballooned))
        reader = t if reader_kind == "tier" else SizeThenFetchTier(t)
        try:
            with pytest.raises(TierCorrupt) as exc:
                reader.get(NS, hashes[0], max_page_bytes=PAGE)
            assert exc.value.cause is MissCause.CORRUPT
        finally:
            t._s = raw
        assert raw.get_size(key) == len(ballooned)  # the attacker's record was there at the fetch
        bound = record_bound(PAGE)
        past = [c for c in fetches.calls if c[2] is None or c[2] > bound]
        if reader_kind == "tier":
            assert not past and fetches.calls == [("get_into", key, bound)]
            assert "not read" in str(exc.value)
        else:
            assert past == [("get", key, None)], "negative control not caught by the bounded-fetch oracle"
    finally:
        t.close()


@pytest.mark.parametrize("reader_kind", ["tier", "control-eager-buffer"])
def test_a_fetch_past_its_timeout_lands_in_a_buffer_no_other_read_uses(master, test_seed, reader_kind):
    """A fetch that outlives its wait (a slow storage node) still writes into its buffer when it
    lands. Forced order: reader 1's fetch of block 0 is held past its timeout (TierUnavailable);
    reader 2 fetches block 1, and block 0's fetch lands just before reader 2 copies its bytes out.
    Oracle: reader 2's page is block 1's, byte-exact. The control (EagerBufferTier: the buffer
    back when the wait ends) gives reader 2 the same buffer, and it reads block 0's record:
    refused by the record's tag, so reader 2 loses its page."""
    hashes, data = pages(test_seed, 2)
    t = open_tier(master.url, AUTH, TIMEOUT_S)
    try:
        for h, p in zip(hashes, data):
            assert t.put(NS, h, p, page_digest(p))
        raw, keys = t._s, [tier_key(AUTH, NS, h) for h in hashes]
        release, landed = threading.Event(), threading.Event()

        class Held:  # block 0's fetch held until reader 2's fetch has run, then landing at once
            def __getattr__(self, name):  # noqa: ANN001, ANN204
                return getattr(raw, name)

            def get_into(self, key, ptr, size):  # noqa: ANN001, ANN201
                if key == keys[0]:
                    assert release.wait(30)
                    n = raw.get_into(key, ptr, size)
                    landed.set()
                    return n
                n = raw.get_into(key, ptr, size)
                release.set()
                assert landed.wait(30)
                return n

        time.sleep(2.2)  # the puts' leases gone
        t._s = Held()
        reader = t if reader_kind == "tier" else EagerBufferTier(t)
        try:
            t.timeout_s = 0.5  # reader 1's fetch alone outlives its wait
            with pytest.raises(TierUnavailable, match="no answer"):
                reader.get(NS, hashes[0], max_page_bytes=PAGE)
            t.timeout_s = TIMEOUT_S
            try:
                got = reader.get(NS, hashes[1], max_page_bytes=PAGE)
            except TierCorrupt:
                assert reader_kind != "tier", "reader 2 was handed the late fetch's buffer"
                return
            assert reader_kind == "tier", "negative control not caught by the byte-exact oracle"
            assert got.data == data[1]
        finally:
            t._s = raw
    finally:
        t.close()


def test_a_store_without_a_transfer_buffer_is_unavailable_not_corrupt(master, test_seed):
    """Mooncake answers a fetch it has no staging buffer for with NO_AVAILABLE_HANDLE (-200;
    stores with disk offload, say): a transport error, never a record called corrupt (which
    reads as tampering) nor a miss. The store's answer is the fault, at the store's client."""
    hashes, data = pages(test_seed, 1)
    t = open_tier(master.url, AUTH, TIMEOUT_S)
    try:
        assert t.put(NS, hashes[0], data[0], page_digest(data[0]))
        raw = t._s

        class NoHandle:  # the client's answer when it finds no buffer to stage the transfer in
            def __getattr__(self, name):  # noqa: ANN001, ANN204
                return getattr(raw, name)

            def get_into(self, key, ptr, size):  # noqa: ANN001, ANN201
                return -200

        t._s = NoHandle()
        try:
            with pytest.raises(TierUnavailable, match="no transfer buffer") as exc:
                t.get(NS, hashes[0], max_page_bytes=PAGE)
            assert exc.value.cause is MissCause.TRANSPORT_ERROR
        finally:
            t._s = raw
        assert t.get(NS, hashes[0], max_page_bytes=PAGE).data == data[0]
    finally:
        t.close()


def test_close_never_closes_the_client_under_a_call_it_runs(master, test_seed):
    """A fetch that outlives its wait is still running in the store's client when the tier is
    closed: the client is not closed under it (Mooncake's client crashes the process when called
    once closed). close() says so (False) and every later call is refused; the late fetch ends
    normally; a second close, with nothing running, closes the client."""
    hashes, data = pages(test_seed, 1)
    t = open_tier(master.url, AUTH, TIMEOUT_S)
    raw = t._s
    release, ended = threading.Event(), threading.Event()
    try:
        assert t.put(NS, hashes[0], data[0], page_digest(data[0]))

        class Held:
            def __getattr__(self, name):  # noqa: ANN001, ANN204
                return getattr(raw, name)

            def get_into(self, key, ptr, size):  # noqa: ANN001, ANN201
                assert release.wait(30)
                try:
                    return raw.get_into(key, ptr, size)
                finally:
                    ended.set()

        t._s = Held()
        t.timeout_s = 0.3
        with pytest.raises(TierUnavailable, match="no answer"):
            t.get(NS, hashes[0], max_page_bytes=PAGE)
        assert t.close(wait_s=0.2) is False  # the fetch still runs: the client stays open
        with pytest.raises(TierUnavailable, match="closed"):
            t.get(NS, hashes[0], max_page_bytes=PAGE)
        release.set()
        assert ended.wait(30)
    finally:
        release.set()
        t._s = raw
        assert t.close(wait_s=TIMEOUT_S) is True


def test_a_full_store_evicts_whole_pages_and_never_serves_other_bytes(master, test_seed):
    url = master.url.replace(f"segment_bytes={64 * 2**20}", f"segment_bytes={16 * 2**20}")
    hashes, data = pages(test_seed, 200)  # 25 MiB of pages into a 16 MiB segment
    t = open_tier(url, AUTH, TIMEOUT_S)
    try:
        stored = [t.put(NS, h, p, page_digest(p)) for h, p in zip(hashes, data)]
        got = [t.get(NS, h) if ok else None for h, ok in zip(hashes, stored)]
        kept = [i for i, g in enumerate(got) if g is not None]
        assert 0 < len(kept) < 200
        assert all(got[i].data == data[i] for i in kept)
    finally:
        t.close()


def test_a_killed_master_is_unavailable_at_once_and_comes_back_empty(master, test_seed):
    hashes, data = pages(test_seed, 2)
    t = open_tier(master.url, AUTH, TIMEOUT_S)
    try:
        assert t.put(NS, hashes[0], data[0], page_digest(data[0]))
        master.kill()
        time.sleep(0.5)
        t0 = time.monotonic()
        with pytest.raises(TierUnavailable) as exc:
            t.get(NS, hashes[0], max_page_bytes=PAGE)  # the connector's read
        assert exc.value.cause is MissCause.TRANSPORT_ERROR
        with pytest.raises(TierUnavailable):
            t.put(NS, hashes[1], data[1], page_digest(data[1]))
        assert time.monotonic() - t0 < 10
        master.start()
        master.wait_remounted(t)
        deadline = time.monotonic() + 10  # the segment is mounted again shortly after the health check
        while not t.put(NS, hashes[1], data[1], page_digest(data[1])):
            assert time.monotonic() < deadline, "the restarted store never took a page"
            time.sleep(0.25)
        assert t.get(NS, hashes[0]) is None  # a master without persistence comes back empty
        assert t.get(NS, hashes[1]).data == data[1]
    finally:
        t.close()


def test_a_killed_storage_node_is_unavailable_not_a_miss_and_a_restarted_one_serves(master, test_seed):
    hashes, data = pages(test_seed, 3)
    node = MooncakeNode(master.run_dir, master, segment_bytes=64 * 2**20).start()
    url = master.url_for(segment_bytes=0, buffer_bytes=16 * 2**20)  # clients keep nothing: the node has it all
    writer, reader = open_tier(url, AUTH, TIMEOUT_S), open_tier(url, AUTH, TIMEOUT_S)
    try:
        assert writer.put(NS, hashes[0], data[0], page_digest(data[0]))
        assert reader.get(NS, hashes[0]).data == data[0]
        node.kill()
        with pytest.raises(TierUnavailable, match="storage node") as exc:
            reader.get(NS, hashes[0])  # indexed by the master, served by nobody
        with pytest.raises(TierUnavailable, match="storage node") as exc:
            reader.get(NS, hashes[0], max_page_bytes=PAGE)  # the connector's read, the same
        assert exc.value.cause is MissCause.TRANSPORT_ERROR
        node.start()
        deadline = time.monotonic() + 20
        while not _put_ok(writer, hashes[1], data[1]):
            assert time.monotonic() < deadline, "the restarted node never took a page"
            time.sleep(0.25)
        assert reader.get(NS, hashes[1]).data == data[1]
    finally:
        writer.close()
        reader.close()
        node.stop()


def _put_ok(tier, h: bytes, page: bytes) -> bool:  # noqa: ANN001
    try:
        return tier.put(NS, h, page, page_digest(page))
    except TierUnavailable:
        return False
