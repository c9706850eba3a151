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

import msgspec
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


def tier(server: RedisServer, timeout_s: float = 10.0):  # noqa: ANN201 - a loaded machine: not 1 s
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


# -- the record's format, keys and checks, each pinned (kvpool.tier.record), no server ------

import hashlib  # noqa: E402
import hmac  # noqa: E402

from kvpool.pool.digest import DigestKind  # noqa: E402
from kvpool.tier import record as R  # noqa: E402


def _signed(auth, page: bytes, **header) -> bytes:
    """A record of `page` whose header holds `header`'s fields, tagged with `auth`'s key (a
    record the tenant's own writer could have made): what only the checks after the tag see."""
    fields = dict(magic=R.RECORD_MAGIC, version=R.RECORD_VERSION, namespace=NS.as_dict(), block_hash=b"\x01" * 16,
                  digest_kind=DigestKind.XXH3.code, digest=page_digest(page), length=len(page))
    raw = R.HEADER_ENCODER.encode(R.RecordHeader(**{**fields, **header}))
    body = len(raw).to_bytes(R.LENGTH_PREFIX, "big") + raw + page
    return auth.tag(body) + body


def test_a_record_is_its_hmac_then_a_4_byte_big_endian_header_length_header_and_page():
    page = bytes(range(256)) * 4
    record = encode_record(AUTH, NS, b"\x01" * 16, page, page_digest(page))
    tag, n = record[:32], int.from_bytes(record[32:36], "big")
    assert tag == hmac.new(AUTH.mac_key, record[32:], "sha256").digest() == AUTH.tag(record[32:])
    header = msgspec.msgpack.decode(record[36:36 + n], type=R.RecordHeader)
    assert header == R.RecordHeader("kvpool-tier", 2, NS.as_dict(), b"\x01" * 16, 0, page_digest(page), len(page))
    assert record[36 + n:] == page and record == _signed(AUTH, page)
    got = decode_record(AUTH, NS, b"\x01" * 16, record)
    assert got == R.TierPage(page, page_digest(page), DigestKind.XXH3)
    assert R.split_record(record) == (tag, header, page)
    # the sketch kind is recorded by its code and read back as that kind
    sketched = encode_record(AUTH, NS, b"\x01" * 16, page, page_digest(page, DigestKind.SKETCH), DigestKind.SKETCH)
    assert R.split_record(sketched)[1].digest_kind == DigestKind.SKETCH.code
    assert decode_record(AUTH, NS, b"\x01" * 16, sketched).kind is DigestKind.SKETCH


def test_an_empty_page_round_trips():
    record = encode_record(AUTH, NS, b"\x01" * 16, b"", page_digest(b""))
    assert decode_record(AUTH, NS, b"\x01" * 16, record).data == b""


def test_a_digest_of_another_size_is_refused_at_encode():
    with pytest.raises(ValueError, match=r"^a page digest is 16 bytes, got 15$"):
        encode_record(AUTH, NS, b"\x01" * 16, b"p", b"d" * 15)
    with pytest.raises(ValueError, match=r"^a page digest is 16 bytes, got 17$"):
        encode_record(AUTH, NS, b"\x01" * 16, b"p", b"d" * 17)
    with pytest.raises(ValueError, match=r"^a tier of tenant 'default' asked for a page of tenant 'other'$"):
        encode_record(AUTH, NS.replace(tenant="other"), b"\x01" * 16, b"p", b"d" * 16)


def test_framing_errors_name_the_sizes():
    with pytest.raises(TierRecordError, match=r"^a tier record of 35 bytes: shorter than its tag and length prefix$"):
        decode_record(AUTH, NS, b"\x01" * 16, bytes(35))
    with pytest.raises(TierRecordError, match=r"^a tier record's header claims 5 bytes; 4 follow$"):
        decode_record(AUTH, NS, b"\x01" * 16, bytes(32) + (5).to_bytes(4, "big") + b"abcd")
    # a record of exactly its tag and length prefix is framed (a header of 0 bytes): the tag is checked next
    with pytest.raises(TierCorrupt, match="not authenticated by tenant 'default'"):
        decode_record(AUTH, NS, b"\x01" * 16, bytes(36))
    # a header that claims exactly what follows is framed: the tag is checked next
    with pytest.raises(TierCorrupt, match="not authenticated by tenant 'default'"):
        decode_record(AUTH, NS, b"\x01" * 16, bytes(32) + (4).to_bytes(4, "big") + b"abcd")
    with pytest.raises(TierRecordError, match="header does not decode"):
        R.split_record(bytes(32) + (4).to_bytes(4, "big") + b"abcd")


def test_a_header_of_another_magic_or_version_is_not_read():
    page = b"p" * 64
    with pytest.raises(TierRecordError, match=r"^not a kvpool tier record of version 2: 'kvpool-other' v2$"):
        decode_record(AUTH, NS, b"\x01" * 16, _signed(AUTH, page, magic="kvpool-other"))
    with pytest.raises(TierRecordError, match=r"^not a kvpool tier record of version 2: 'kvpool-tier' v1$"):
        decode_record(AUTH, NS, b"\x01" * 16, _signed(AUTH, page, version=1))


def test_each_check_after_the_tag_says_what_differs():
    page = b"p" * 64
    h = b"\x01" * 16
    with pytest.raises(TierCorrupt, match=r"^a record of another namespace \(model_revision\) under this key: moved or replayed there$"):
        decode_record(AUTH, NS, h, _signed(AUTH, page, namespace=NS.replace(model_revision="r2").as_dict()))
    with pytest.raises(TierCorrupt, match=r"^a record of another namespace \(tenant\) under this key"):
        decode_record(AUTH, NS, h, _signed(AUTH, page, namespace=NS.replace(tenant="bob").as_dict()))
    with pytest.raises(TierCorrupt, match=r"^a record of another namespace \(model_revision, kv_dtype\) under this key"):
        decode_record(AUTH, NS, h, _signed(AUTH, page, namespace=NS.replace(model_revision="r2", kv_dtype="fp8").as_dict()))
    with pytest.raises(TierCorrupt, match=r"^a record of another namespace \(namespace\) under this key"):
        decode_record(AUTH, NS, h, _signed(AUTH, page, namespace={"model_id": "tiny"}))  # not a namespace
    # the same namespace written without its default tenant: no field differs, yet the dicts do
    without_tenant = {k: v for k, v in NS.as_dict().items() if k != "tenant"}
    with pytest.raises(TierCorrupt, match=r"^a record of another namespace \(namespace\) under this key"):
        decode_record(AUTH, NS, h, _signed(AUTH, page, namespace=without_tenant))
    with pytest.raises(TierCorrupt, match=r"^a record of another block under this key: moved or copied there$"):
        decode_record(AUTH, NS, b"\x02" * 16, _signed(AUTH, page))
    with pytest.raises(TierCorrupt, match=r"^the record's page has 64 bytes; 65 were stored$"):
        decode_record(AUTH, NS, h, _signed(AUTH, page, length=65))
    with pytest.raises(TierRecordError, match=r"^unknown digest kind 2$"):
        decode_record(AUTH, NS, h, _signed(AUTH, page, digest_kind=2))
    with pytest.raises(TierCorrupt, match=r"^the record's page does not match the digest taken at publish$"):
        decode_record(AUTH, NS, h, _signed(AUTH, page, digest=page_digest(b"q" * 64)))
    with pytest.raises(TierCorrupt, match=r"^the record's page does not match"):  # the sketch of an xxh3 digest
        decode_record(AUTH, NS, h, _signed(AUTH, page, digest_kind=DigestKind.SKETCH.code))
    with pytest.raises(TierCorrupt, match=r"^the record under this key is not authenticated by tenant 'default'"
                                          r"'s tier key \(forged, damaged, another tenant's, or written without the secret\)$"):
        decode_record(AUTH, NS, h, _signed(TierAuth.from_secret("default", "another secret of the tenant"), page))


def test_tier_keys_derive_from_the_secret_by_blake2b_per_tenant():
    secret = "s" * 16  # the shortest secret taken
    root = secret.encode()
    auth = TierAuth.from_secret("t1", secret)
    derive = lambda person: hashlib.blake2b(b"t1", key=root, person=person, digest_size=32).digest()  # noqa: E731
    assert (auth.mac_key, auth.name_key) == (derive(b"kvpool-tier-mac"), derive(b"kvpool-tier-key"))
    assert TierAuth.from_secret("t1", root) == auth  # bytes or str alike
    with pytest.raises(ValueError, match=r"^a tier secret is at least 16 bytes, got 15$"):
        TierAuth.from_secret("t1", "s" * 15)
    # a secret up to blake2b's key size keys it as it is; a longer one by its digest first
    at_max = TierAuth.from_secret("t1", b"k" * 64)
    assert at_max.mac_key == hashlib.blake2b(b"t1", key=b"k" * 64, person=b"kvpool-tier-mac", digest_size=32).digest()
    longer = TierAuth.from_secret("t1", b"k" * 65)
    root = hashlib.blake2b(b"k" * 65, person=b"kvpool-tier-root").digest()
    assert longer.name_key == hashlib.blake2b(b"t1", key=root, person=b"kvpool-tier-key", digest_size=32).digest()
    for mac_key, name_key in ((bytes(32), bytes(31)), (bytes(31), bytes(32)), (bytes(33), bytes(33))):
        with pytest.raises(ValueError, match=r"^tier keys are 32 bytes \(TierAuth\.from_secret derives them\)$"):
            TierAuth("t1", mac_key, name_key)


def test_a_tier_key_is_the_tenants_prefix_and_a_keyed_digest_of_namespace_and_block():
    h = bytes(range(16))
    name = hashlib.blake2b(msgspec.msgpack.encode(NS) + h, key=AUTH.name_key, digest_size=16).hexdigest()
    assert tier_key(AUTH, NS, h) == AUTH.key(NS, h) == "kvpool:default:" + name
    assert AUTH.prefix == R.tier_prefix("default") == "kvpool:default:"
    with pytest.raises(ValueError, match=r"^a tier of tenant 'default' asked for a page of tenant 'x'$"):
        AUTH.key(NS.replace(tenant="x"), h)


@pytest.mark.parametrize("tenant,ok", [("a", True), ("A-z_0.9", True), ("x" * 64, True), ("x" * 65, False),
                                       ("", False), ("a:b", False), ("a*", False), ("a b", False)])
def test_a_tier_tenant_is_1_to_64_safe_characters(tenant, ok):
    if ok:
        assert R.tier_prefix(tenant) == f"kvpool:{tenant}:"
    else:
        with pytest.raises(ValueError, match=r"^a tier tenant's name is 1-64 of \[A-Za-z0-9_.-\] \(it is a store key prefix\)"):
            R.tier_prefix(tenant)


def test_a_records_bound_and_the_error_of_a_longer_one():
    assert R.record_bound(1000) == 32 + 4 + 4096 + 1000
    err = R.record_too_long(9000, 1000)
    assert isinstance(err, TierCorrupt) and err.cause is MissCause.CORRUPT
    assert str(err) == "a record of 9000+ bytes under this key; a page here has at most 1000 (a record is at most 5132): not read"


def test_the_tier_errors_stand_for_their_miss_causes():
    assert R.TierError("x").cause is MissCause.TRANSPORT_ERROR
    assert R.TierUnavailable("x").cause is MissCause.TRANSPORT_ERROR
    assert R.TierCorrupt("x").cause is MissCause.CORRUPT
    assert R.TierRecordError("x").cause is MissCause.CORRUPT
    inc = R.TierIncompatible("m", ("kv_dtype",))
    assert inc.cause is MissCause.INCOMPATIBLE and inc.fields == ("kv_dtype",) and str(inc) == "m"


def test_a_namespace_digest_is_12_bytes_of_blake2b_of_its_encoding():
    assert R.namespace_digest(NS) == hashlib.blake2b(msgspec.msgpack.encode(NS), digest_size=12).hexdigest()
    assert R.namespace_digest(NS) != R.namespace_digest(NS.replace(model_revision="r2"))
