"""kvgate explain (kvgate.harness.explain): each way a request can miss is told as itself, from a
history; a key's producer and installs are found in the audit records and the pool is asked
about it now."""

from __future__ import annotations

import numpy as np
import pytest

from kvgate.harness.explain import ExplainError, explain_key, explain_request
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import publish
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)


def _req(tag, replica="B", **lookup):
    base = {"ev": "lookup", "role": "scheduler", "replica": replica, "tag": tag, "t": 10.0, "prompt_tokens": 1000,
            "local_tokens": 0, "hit_blocks": 0, "outcome": "miss", "miss_cause": None, "miss_index": None}
    return [{"ev": "request", "phase": "invoke", "replica": replica, "tag": tag, "t": 9.9},
            {**base, **lookup},
            {"ev": "request", "phase": "ok", "replica": replica, "tag": tag, "t": 10.2, "ttft_s": 0.2}]


@pytest.mark.parametrize("lookup, words", [
    ({"miss_cause": "never_published", "miss_index": 0}, "not a hit at block 0: never_published"),
    ({"miss_cause": "evicted", "miss_index": 3}, "evicted before the lookup"),
    ({"miss_cause": "incompatible", "miss_index": 0, "miss_fields": ["model_revision"]}, "(model_revision)"),
    ({"outcome": "local_hit", "local_tokens": 896}, "local prefix-cache hit"),
    ({"outcome": "remote_hit", "hit_blocks": 7}, "a remote hit of 7 blocks"),
])
def test_each_way_a_request_misses_is_told_as_itself(lookup, words):
    out = explain_request(_req("t1", **lookup), "t1")
    assert words in out.verdict, out.verdict
    assert any("lookup on B" in f for f in out.facts)


def test_a_failed_load_and_the_fault_that_caused_it_are_named():
    recs = _req("t2", outcome="remote_hit", hit_blocks=7)
    recs.insert(2, {"ev": "load", "replica": "B", "tag": "t2", "t": 10.1, "loaded": 2, "blocks": 7,
                    "failed_block_ids": [3, 4, 5, 6, 7], "miss_cause": "corrupt", "miss_index": 2})
    recs.insert(2, {"ev": "fault", "replica": "B", "t": 10.05, "kind": "corrupt", "site": "pool_client.acquire"})
    out = explain_request(recs, "t2")
    assert "load failed at block 2 (corrupt)" in out.verdict
    assert any("fault while it ran: corrupt" in f for f in out.facts)


def test_an_unknown_or_ambiguous_request_is_a_typed_error():
    with pytest.raises(ExplainError, match="no record"):
        explain_request(_req("t1"), "nope")
    with pytest.raises(ExplainError, match="several replicas"):
        explain_request(_req("t1", "A") + _req("t1", "B"), "t1")


def test_a_key_is_traced_to_its_producer_and_the_pool_is_asked_now(tmp_path):
    d = thread_pool(page_size=4096, num_pages=8)
    try:
        hs = block_hashes(range(16 * 2), 16)
        key = hs[1].hex()
        recs = [{"ev": "namespace", "replica": "A", "t": 1.0, "ns": NS.as_dict()},
                {"ev": "audit", "kind": "produced", "replica": "A", "tag": "p", "t": 2.0, "first_block": 0,
                 "keys": [hs[0].hex(), key], "digests": ["aa", "bb"]}]
        with PoolClient(f"unix:{d.unix_path}", "default", "tok") as c:
            out = explain_key(recs, key, c)
            assert "never_published" in out.verdict and "produced by A" in out.verdict
            publish(c, NS, hs, [np.zeros(4096, np.uint8)] * 2)
            out = explain_key(recs, key, c)
            assert out.data["pool"] == "committed in the pool now"
            c.evict(NS, hs)
            assert "evicted" in explain_key(recs, key, c).verdict
        with pytest.raises(ExplainError, match="no audit record"):
            explain_key(recs, "00" * 16)
    finally:
        d.stop_thread()
