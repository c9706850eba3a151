"""A client of the network store who lacks the tenant's tier secret (the store's operator,
another tenant, anyone on an open Redis) against kvpool.tier.record, on a real redis-server the
test starts with its access control on (kvgate.harness.system.stores.RedisServer, tenants alice
and bob, each an ACL user restricted to its own key prefix).

The attacker works at the data, in the store, as such a client can: it learns the tenant's
keys by watching them appear (SCAN as the store's operator: they are opaque hashes, so it
cannot compute one) and then
  moved             copies each record under the next block's key (a derangement)
  forged            rewrites each page and recomputes the header's plain digest
  replayed_ns       puts the tenant's records of revision r1 under r2's keys, the header's
                    namespace rewritten to r2's
  replayed_tenant   puts tenant bob's records under alice's keys, the header rebound to
                    alice's namespace and block
Each must be a `corrupt` miss of kvpool.tier.interface.tier_load, with not one byte of the record
installed. Negative control: the reader before records were authenticated and bound
(kvgate.faults.tier_controls.UnauthenticatedTier) installs every one of them, and the byte-exact
comparison with the producer's pages must catch it.
And with the access control: bob's credentials neither read, write, delete nor list
alice's keys (Redis refuses), a client without credentials reaches nothing, and a replica
given another tenant's credentials gets TierUnavailable, never a redis exception."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from kvgate.faults.tier_controls import UnauthenticatedTier, forge_record, rotate
from kvgate.harness.system.stores import RedisServer, redis_binary
from kvpool.pool.digest import page_digest
from kvpool.errors import MissCause
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.tier.record import TierAuth, TierCorrupt, TierUnavailable, decode_record, encode_record
from kvpool.tier.interface import tier_load
from kvpool.tier.redis import RedisTier

PAGE = 64 * 1024
N = 4
NS = Namespace(model_id="tiny", model_revision="r1", tokenizer_hash="t", kv_dtype="bfloat16", kv_layout="cpu",
               block_size=16, num_layers=2, num_kv_heads=2, head_size=64, tenant="alice")
ALICE = TierAuth.from_secret("alice", "alice's tier secret, never the store's")
BOB = TierAuth.from_secret("bob", "bob's tier secret, never the store's")
ATTEMPTS = ("moved", "forged", "replayed_ns", "replayed_tenant")

pytestmark = pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed (make test installs it)")


@pytest.fixture
def store(tmp_path):
    server = RedisServer(tmp_path / "redis", tenants=("alice", "bob")).start()
    yield server
    server.stop()


def _pages(rng: np.random.Generator, n: int) -> list[bytes]:
    return [rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes() for _ in range(n)]


def _publish(store: RedisServer, auth: TierAuth, ns: Namespace, hashes: list[bytes], pages: list[bytes]) -> list[str]:
    """The tenant's replica publishes; the attacker, watching the store, notes each new key."""
    tier, watcher = RedisTier(store.tenant_url(auth.tenant), auth), store.client()
    keys = []
    for h, p in zip(hashes, pages):
        before = set(watcher.scan_iter(match=f"{auth.prefix}*"))
        assert tier.put(ns, h, p, page_digest(p))
        (new,) = set(watcher.scan_iter(match=f"{auth.prefix}*")) - before
        keys.append(new.decode())
    tier.close()
    return keys


def _attack(store: RedisServer, attempt: str, rng: np.random.Generator, hashes: list[bytes]) -> list[bytes]:
    """Alice's N blocks published (revision r1), then the attempt on them; returns the
    producer's pages, the bytes alice's replica must install or refuse."""
    produced = _pages(rng, N)
    keys = _publish(store, ALICE, NS, hashes, produced)
    op = store.client()  # the store's operator: reads and writes every key, has no tier secret
    if attempt == "moved":
        records = {k: op.get(k) for k in keys}
        for src, dst in rotate(keys):
            op.set(dst, records[src])
    elif attempt == "forged":
        for k, p in zip(keys, _pages(rng, N)):
            op.set(k, forge_record(op.get(k), page=p))
    elif attempt == "replayed_ns":  # r2's records replaced by r1's, rebound to r2
        r2 = NS.replace(model_revision="r2")
        r2_keys = _publish(store, ALICE, r2, hashes, _pages(rng, N))
        for k1, k2 in zip(keys, r2_keys):
            op.set(k1, forge_record(op.get(k2), namespace=NS.as_dict()))
    elif attempt == "replayed_tenant":  # bob's records of the same blocks, rebound to alice's
        bob_keys = _publish(store, BOB, NS.replace(tenant="bob"), hashes, _pages(rng, N))
        for ka, kb in zip(keys, bob_keys):
            op.set(ka, forge_record(op.get(kb), namespace=NS.as_dict()))
    else:
        raise ValueError(attempt)
    return produced


@pytest.mark.parametrize("reader_kind", ["tier", "control-unauthenticated"])
@pytest.mark.parametrize("attempt", ATTEMPTS)
def test_a_store_client_without_the_secret_gets_nothing_installed(store, test_seed, attempt, reader_kind):
    rng = np.random.default_rng(test_seed)
    hashes = block_hashes([int(x) for x in rng.integers(0, 2000, N * 16)], 16)
    produced = _attack(store, attempt, rng, hashes)
    tier = RedisTier(store.tenant_url("alice"), ALICE)
    reader = tier if reader_kind == "tier" else UnauthenticatedTier(tier)
    dest = [np.zeros(PAGE, np.uint8) for _ in range(N)]
    res = tier_load(reader, NS, hashes, lambda i: dest[i])
    byte_exact = [d.tobytes() for d in dest] == produced
    if reader_kind != "tier":  # the known-bad reader installs what the attacker left: only the byte check sees it
        assert res.loaded == N and res.miss is None, res
        assert not byte_exact, "negative control not caught: the byte-exact comparison passed the attacker's pages"
        return
    assert res.loaded == 0 and res.miss is not None and res.miss.cause is MissCause.CORRUPT, res
    assert not any(d.any() for d in dest), "bytes of a refused record were installed"
    for h in hashes:
        with pytest.raises(TierCorrupt) as exc:
            tier.get(NS, h)
        assert exc.value.cause is MissCause.CORRUPT


def test_genuine_records_pass_the_same_reader(store, test_seed):
    """The attempts' positive twin: the tenant's own records, untouched, load byte-exact."""
    rng = np.random.default_rng(test_seed)
    hashes = block_hashes([int(x) for x in rng.integers(0, 2000, N * 16)], 16)
    produced = _pages(rng, N)
    _publish(store, ALICE, NS, hashes, produced)
    dest = [np.zeros(PAGE, np.uint8) for _ in range(N)]
    res = tier_load(RedisTier(store.tenant_url("alice"), ALICE), NS, hashes, lambda i: dest[i])
    assert res.loaded == N and res.miss is None and [d.tobytes() for d in dest] == produced


def test_a_tenants_store_credentials_reach_only_its_own_keys(store, test_seed):
    rng = np.random.default_rng(test_seed)
    (h,) = block_hashes([int(x) for x in rng.integers(0, 2000, 16)], 16)
    (page,) = _pages(rng, 1)
    alice = RedisTier(store.tenant_url("alice"), ALICE)
    assert alice.put(NS, h, page, page_digest(page))
    key = ALICE.key(NS, h)
    bob = redis.Redis.from_url(store.tenant_url("bob"), socket_timeout=5)
    attempts = {"GET": lambda: bob.get(key), "SET": lambda: bob.set(key, b"x"), "DEL": lambda: bob.delete(key),
                "EXISTS": lambda: bob.exists(key), "SET new": lambda: bob.set(f"{ALICE.prefix}planted", b"x"),
                "SCAN": lambda: list(bob.scan_iter()), "KEYS": lambda: bob.keys("*"), "FLUSHALL": bob.flushall,
                "RENAME": lambda: bob.rename(key, "kvpool:bob:x"), "DUMP": lambda: bob.dump(key)}
    for what, attempt in attempts.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
            pytest.fail(f"bob's credentials ran {what} on alice's keys")
    anonymous = redis.Redis(host=store.host, port=store.port, socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.get(key)
    # A replica given another tenant's credentials: a typed, counted miss, the password unsaid.
    misconfigured = RedisTier(store.tenant_url("bob"), ALICE)
    with pytest.raises(TierUnavailable, match="access control") as exc:
        misconfigured.get(NS, h)
    assert store.passwords["bob"] not in str(exc.value)
    with pytest.raises(TierUnavailable, match="access control"):
        misconfigured.put(NS, h, page, page_digest(page))
    # Each tenant's own keys still work, and alice's page is intact.
    assert alice.get(NS, h).data == page
    bob_tier = RedisTier(store.tenant_url("bob"), BOB)
    assert bob_tier.put(NS.replace(tenant="bob"), h, page, page_digest(page))
    assert bob_tier.get(NS.replace(tenant="bob"), h).data == page


def test_keys_are_opaque_and_tenants_keys_differ_under_one_secret():
    """No server: a key names its tenant's prefix, then nothing a store client can compute
    or read a block or a namespace from; one secret given to two tenants still gives them
    different keys, and neither reads the other's records."""
    h = bytes(range(16))
    key = ALICE.key(NS, h)
    assert key.startswith("kvpool:alice:") and h.hex() not in key and "r1" not in key
    assert key != ALICE.key(NS.replace(model_revision="r2"), h)
    assert key != TierAuth.from_secret("alice", "another secret entirely").key(NS, h)
    same = "one secret, two tenants (a mistake)"
    a, b = TierAuth.from_secret("alice", same), TierAuth.from_secret("bob", same)
    assert a.mac_key != b.mac_key and a.name_key != b.name_key
    page = bytes(PAGE)
    bob_record = encode_record(b, NS.replace(tenant="bob"), h, page, page_digest(page))
    with pytest.raises(TierCorrupt, match="not authenticated"):
        decode_record(a, NS, h, forge_record(bob_record, namespace=NS.as_dict()))
    with pytest.raises(ValueError, match="at least 16 bytes"):
        TierAuth.from_secret("alice", "short")
    with pytest.raises(ValueError, match="key prefix"):
        TierAuth.from_secret("alice:*", same)  # a glob in an ACL pattern
    assert repr(ALICE) == "TierAuth(tenant='alice')"  # the keys stay out of logs


def test_a_record_ballooned_by_a_store_client_is_never_read_whole(store, test_seed):
    """The store's operator (or anyone on a Redis without access control) replaces one of
    alice's records by 32 MiB: the reader, which knows a page here is PAGE bytes, takes at
    most one record's bound from the store (counted by the store itself: its output bytes)
    and calls it corrupt, so a store client cannot make a replica allocate without bound."""
    from kvpool.tier.record import record_bound

    rng = np.random.default_rng(test_seed)
    hashes = block_hashes([int(x) for x in rng.integers(0, 2000, N * 16)], 16)
    keys = _publish(store, ALICE, NS, hashes, _pages(rng, N))
    op = store.client()
    op.set(keys[1], op.get(keys[1]) + bytes(32 * 2**20))
    tier = RedisTier(store.tenant_url("alice"), ALICE)
    sent = op.info("stats")["total_net_output_bytes"]
    dest = [np.zeros(PAGE, np.uint8) for _ in range(N)]
    res = tier_load(tier, NS, hashes, lambda i: dest[i])
    sent = op.info("stats")["total_net_output_bytes"] - sent
    assert (res.loaded, res.miss.index, res.miss.cause) == (1, 1, MissCause.CORRUPT), res
    assert sent < 3 * record_bound(PAGE), f"the store sent {sent} bytes for two pages' records"
    with pytest.raises(TierCorrupt, match="not read"):
        tier.get(NS, hashes[1], max_page_bytes=PAGE)
    tier.close()


def test_a_store_with_its_access_control_starts_from_a_relative_directory(tmp_path, monkeypatch):
    """The gate hands the store a directory relative to the working directory (its report
    directory); redis changes to its --dir before it reads the ACL file, so the file must be
    named absolutely or the store never starts."""
    monkeypatch.chdir(tmp_path)
    server = RedisServer(tmp_path.relative_to(tmp_path) / "reports" / "store", tenants=("alice",)).start()
    try:
        assert RedisTier(server.tenant_url("alice"), ALICE).exists(NS, [bytes(16)]) == 0
    finally:
        server.stop()
