"""The network tier (kvpool.tier) on a real Redis server the test starts: pages cross it
byte-exact with their namespace, block and digest in an authenticated header, and whatever
comes back stale, foreign or damaged is a typed miss, never installed. (What a hostile
client of the store tries: suites/pool/test_tier_hostile.py.) Faults are at the data and the node:
a byte of a stored record changed in the store, a record of another namespace under the
key, a store that evicts, a node killed and restarted. The corruption test runs its
negative control (a reader that skips the digest), which its byte-exact check must catch.

The records' checks run without a server; the rest needs Debian's redis-server, which
`make test` installs."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.faults.tier_controls import BlindTier
from kvgate.harness.system.stores import RedisServer, redis_binary
from kvpool.pool.digest import page_digest
from kvpool.errors import MissCause
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.tier.record import TierAuth, TierCorrupt, TierError, TierRecordError, TierUnavailable, decode_record, encode_record, tier_key

PAGE = 128 * 1024
NS = Namespace(model_id="tiny", model_revision="r1", tokenizer_hash="t", kv_dtype="bfloat16", kv_layout="cpu",
               block_size=16, num_layers=2, num_kv_heads=2, head_size=64)

AUTH = TierAuth.from_secret("default", "the default tenant's tier secret")
needs_redis = pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed (make test installs it)")


def pages(seed: int, n: int, size: int = PAGE) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    hashes = block_hashes(list(rng.integers(0, 2000, n * 16)), 16)
    return hashes, [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


# -- records, no server -----------------------------------------------------------------------

def test_a_record_round_trips_and_says_why_when_it_cannot(test_seed):
    (h,), (page,) = pages(test_seed, 1)
    record = encode_record(AUTH, NS, h, page, page_digest(page))
    got = decode_record(AUTH, NS, h, record)
    assert got.data == page and got.digest == page_digest(page)
    with pytest.raises(TierCorrupt, match="model_revision") as exc:
        decode_record(AUTH, NS.replace(model_revision="r2"), h, record)
    assert exc.value.cause is MissCause.CORRUPT
    with pytest.raises(ValueError, match="tenant"):
        decode_record(AUTH, NS.replace(tenant="other"), h, record)  # a tier reads its own tenant's pages only
    with pytest.raises(TierCorrupt):
        decode_record(AUTH, NS, h, record[:-1])  # truncated
    with pytest.raises(TierRecordError):
        decode_record(AUTH, NS, h, b"\x00\x00\x00\x05hello" + page)
    assert tier_key(AUTH, NS, b"\x01" * 16) != tier_key(AUTH, NS.replace(model_revision="r2"), b"\x01" * 16)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_record_is_a_typed_miss_never_other_bytes(data, test_seed):
    """Any one byte of a record changed, or any prefix of it kept: the reader raises one of
    the tier's typed errors, or (a change the header tolerates) returns the page intact."""
    (h,), (page,) = pages(test_seed, 1, size=4096)
    record = bytearray(encode_record(AUTH, NS, h, page, page_digest(page)))
    if data.draw(st.booleans(), label="truncate"):
        record = record[: data.draw(st.integers(0, len(record) - 1), label="keep")]
    else:
        i = data.draw(st.integers(0, len(record) - 1), label="at")
        record[i] ^= data.draw(st.integers(1, 255), label="xor")
    try:
        got = decode_record(AUTH, NS, h, bytes(record))
    except TierError:
        return
    assert got.data == page


# -- on a real Redis ------------------------------------------------------------------------

@pytest.fixture
def redis_server(tmp_path):
    if redis_binary() is None:
        pytest.skip("redis-server is not installed (make test installs it)")
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def tier(server: RedisServer, timeout_s: float = 1.0):  # noqa: ANN201
    from kvpool.tier.redis import RedisTier

    return RedisTier(server.url, AUTH, timeout_s=timeout_s)


@needs_redis
def test_pages_cross_the_store_byte_exact_between_two_clients(redis_server, test_seed):
    hashes, data = pages(test_seed, 8)
    writer, reader = tier(redis_server), tier(redis_server)
    for h, p in zip(hashes[:6], data[:6]):
        assert writer.put(NS, h, p, page_digest(p))
    assert reader.exists(NS, hashes) == 6
    assert [reader.get(NS, h).data for h in hashes[:6]] == data[:6]
    assert reader.get(NS, hashes[6]) is None  # never stored: a miss
    assert reader.exists(NS.replace(model_revision="r2"), hashes) == 0  # another namespace: other keys
    reader.remove(NS, hashes[0])
    assert reader.get(NS, hashes[0]) is None and reader.exists(NS, hashes) == 0


@needs_redis
@pytest.mark.parametrize("reader_kind", ["tier", "blind"])
def test_a_byte_changed_in_the_store_is_corrupt_and_the_blind_reader_is_caught(redis_server, test_seed,
                                                                              reader_kind):
    """The fault is at the data: one byte of the stored record's page changed in Redis
    (SETRANGE). The tier's reader must raise TierCorrupt; the negative control, a reader
    that skips the digest, must be caught by the byte-exact check (other bytes returned)."""
    hashes, data = pages(test_seed, 1)
    writer = tier(redis_server)
    assert writer.put(NS, hashes[0], data[0], page_digest(data[0]))
    raw = redis_server.client()
    key = tier_key(AUTH, NS, hashes[0])
    stored = raw.get(key)
    at = len(stored) - PAGE + int(np.random.default_rng(test_seed).integers(PAGE))
    raw.setrange(key, at, bytes([stored[at] ^ 0x20]))
    reader = tier(redis_server) if reader_kind == "tier" else BlindTier(tier(redis_server))
    try:
        got = reader.get(NS, hashes[0])
    except TierCorrupt as exc:
        assert reader_kind == "tier" and exc.cause is MissCause.CORRUPT
        return
    byte_exact = got is not None and got.data == data[0]
    assert reader_kind == "blind", "the tier handed out a page it should have refused"
    assert not byte_exact, "negative control not caught: the byte-exact check passed a corrupted page"


@needs_redis
def test_a_record_of_another_namespace_under_the_key_is_corrupt(redis_server, test_seed):
    """A record of revision r1 under r2's key (keys are keyed hashes of the namespace: no
    writer puts it there; it was moved): r2's reader refuses it as corrupt, naming the field."""
    hashes, data = pages(test_seed, 1)
    r2 = NS.replace(model_revision="r2")
    redis_server.client().set(tier_key(AUTH, r2, hashes[0]),
                              encode_record(AUTH, NS, hashes[0], data[0], page_digest(data[0])))
    with pytest.raises(TierCorrupt, match="model_revision") as exc:
        tier(redis_server).get(r2, hashes[0])
    assert exc.value.cause is MissCause.CORRUPT


@needs_redis
def test_a_full_store_evicts_whole_pages_and_never_serves_other_bytes(tmp_path, test_seed):
    server = RedisServer(tmp_path / "redis", maxmemory=4 * 2**20, policy="allkeys-lru").start()
    try:
        hashes, data = pages(test_seed, 64)
        t = tier(server)
        for h, p in zip(hashes, data):
            assert t.put(NS, h, p, page_digest(p))
        got = [t.get(NS, h) for h in hashes]
        kept = [i for i, g in enumerate(got) if g is not None]
        assert 0 < len(kept) < 64  # 8 MiB of pages in 4 MiB: some evicted, some kept
        assert all(got[i].data == data[i] for i in kept)
    finally:
        server.stop()
    full = RedisServer(tmp_path / "redis-full", maxmemory=2 * 2**20, policy="noeviction").start()
    try:
        t = tier(full)
        results = [t.put(NS, h, p, page_digest(p)) for h, p in zip(hashes, data)]
        assert results[0] and not results[-1]  # refused when full, not an exception
    finally:
        full.stop()


@needs_redis
def test_a_killed_node_is_unavailable_within_the_timeout_and_empty_after_restart(redis_server, test_seed):
    hashes, data = pages(test_seed, 2)
    t = tier(redis_server, timeout_s=0.5)
    assert t.put(NS, hashes[0], data[0], page_digest(data[0]))
    redis_server.kill()
    t0 = time.monotonic()
    with pytest.raises(TierUnavailable) as exc:
        t.get(NS, hashes[0])
    assert exc.value.cause is MissCause.TRANSPORT_ERROR and time.monotonic() - t0 < 5
    with pytest.raises(TierUnavailable):
        t.put(NS, hashes[1], data[1], page_digest(data[1]))
    redis_server.start()  # the heal: a node without persistence comes back empty
    assert t.get(NS, hashes[0]) is None
    assert t.put(NS, hashes[1], data[1], page_digest(data[1])) and t.get(NS, hashes[1]).data == data[1]
