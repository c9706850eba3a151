"""Miss-cause probes and crash recovery, as the gate runs them."""

from types import SimpleNamespace

import numpy as np

from kvgate.harness.scenarios.pool import crash_and_restart, miss_causes
from kvpool.errors import MissCause


def test_every_miss_cause_is_reported_as_itself(test_seed):
    verdict = miss_causes(test_seed)
    assert verdict.valid is True, verdict
    assert set(verdict.evidence["observed"]) == {c.value for c in MissCause}


def test_crash_and_restart(test_seed):
    verdict = crash_and_restart(test_seed)
    assert verdict.valid is True, verdict


def test_the_pooled_copy_oracle_hashes_the_page_bytes(tmp_path, test_seed):
    """A stray write into a committed page shows in pool_digests (it reads the bytes under a
    lease), although the daemon's recorded digest is unchanged."""
    import random

    from kvgate.harness.checkers.byte_exact import pool_digests
    from kvgate.harness.system.pool import thread_pool
    from kvpool.client.pool_client import PoolClient
    from kvpool.client.transfer import publish
    from kvpool.pool.digest import page_digest
    from kvpool.pool.keys import Namespace, block_hashes

    ns = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
    rng = random.Random(test_seed)
    d = thread_pool(page_size=4096, num_pages=8, scrub_rest_pages_per_round=0)  # the corrupt page stays put
    try:
        pool = SimpleNamespace(client=lambda name="": PoolClient(f"unix:{d.unix_path}", "default", "tok", name=name))
        hashes = block_hashes(list(range(32)), 16)
        pages = [np.frombuffer(rng.randbytes(4096), np.uint8) for _ in hashes]
        with pool.client() as c:
            assert publish(c, ns, hashes, pages).committed == 2
            keys = [h.hex() for h in hashes]
            assert pool_digests(pool, ns, keys) == {k: page_digest(p).hex() for k, p in zip(keys, pages)}
            victim = c.lookup(ns, hashes).hits[1].page
            c.arena.page(victim)[rng.randrange(4096)] ^= 1 << rng.randrange(8)
            got = pool_digests(pool, ns, keys)
            assert got[keys[0]] == page_digest(pages[0]).hex() and got[keys[1]] != page_digest(pages[1]).hex()
            assert c.lookup(ns, hashes).hits[1].digest == page_digest(pages[1])  # the daemon's record did not move
    finally:
        d.stop_thread()
