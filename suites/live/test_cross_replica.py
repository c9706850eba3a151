"""Live: replica A computes and publishes, replica B loads; outputs and bytes agree."""

import pytest

from harness.live_checks import byte_exact, records
from harness.workload import Corpus, common_prefix_tails, complete

pytestmark = pytest.mark.live

BLOCK = 128


def url(cluster, name):
    return cluster.replicas[name].url


def test_cross_replica_hit_is_byte_exact_and_output_unchanged(live, tiny_model, rng, test_seed):
    corpus = Corpus(tiny_model)
    prompt = corpus.text(5000, rng)  # 5001 tokens: three prefill chunks of 2048
    tag = f"x{test_seed % 10**8}"
    a = complete(url(live, "A"), prompt, tag=f"{tag}-a", replica="A")
    b = complete(url(live, "B"), prompt, tag=f"{tag}-b", replica="B")
    cold = complete(url(live, "B"), prompt, tag=f"{tag}-cold", replica="B", load=False, publish=False,
                    cache_salt=f"cold-{tag}")
    h = live.history_dir
    # A published every complete prompt block, across all three chunks
    published = sum(r.get("committed", 0) for r in records(h, "publish", tag=f"{tag}-a", replica="A"))
    assert published == 5001 // BLOCK == 39
    # B looked up, found all loadable blocks remotely and loaded them all
    (lookup,) = records(h, "lookup", tag=f"{tag}-b", replica="B")
    assert lookup["outcome"] == "remote_hit" and lookup["hit_blocks"] == (5001 - 1) // BLOCK
    (load,) = records(h, "load", tag=f"{tag}-b", replica="B")
    assert load["loaded"] == load["blocks"] == 39 and load["failed_block_ids"] == []
    # the cold baseline on B really was cold
    (cold_lookup,) = records(h, "lookup", tag=f"{tag}-cold", replica="B")
    assert cold_lookup["external_tokens"] == 0 and cold_lookup["local_tokens"] == 0
    # outputs: B's equals its own no-cache baseline, and A's
    assert b.token_ids == cold.token_ids == a.token_ids and len(b.token_ids) == 16
    verdict = byte_exact(live, ("A", f"{tag}-a"), ("B", f"{tag}-b"), ("B", f"{tag}-cold"))
    assert verdict.valid is True, verdict
    assert verdict.evidence["installed"] == 39 and verdict.evidence["in_pool"] == 39


def test_partial_hit_loads_only_complete_common_blocks(live, tiny_model, rng, test_seed):
    corpus = Corpus(tiny_model)
    common = 1000  # with BOS: 1001 common tokens = 7 complete blocks + 105 tokens
    t1, t2 = common_prefix_tails(corpus, rng, prefix_tokens=common, tails=2, tail_tokens=300)
    tag = f"p{test_seed % 10**8}"
    complete(url(live, "A"), t1.prompt, tag=f"{tag}-a", replica="A")
    b = complete(url(live, "B"), t2.prompt, tag=f"{tag}-b", replica="B")
    cold = complete(url(live, "B"), t2.prompt, tag=f"{tag}-cold", replica="B", load=False, publish=False,
                    cache_salt=f"cold-{tag}")
    h = live.history_dir
    (lookup,) = records(h, "lookup", tag=f"{tag}-b", replica="B")
    assert lookup["hit_blocks"] == 1001 // BLOCK == 7
    assert lookup["miss_cause"] == "never_published" and lookup["miss_index"] == 7
    (load,) = records(h, "load", tag=f"{tag}-b", replica="B")
    assert load["loaded"] == 7
    assert b.token_ids == cold.token_ids
    verdict = byte_exact(live, ("A", f"{tag}-a"), ("B", f"{tag}-b"), ("B", f"{tag}-cold"))
    assert verdict.valid is True, verdict


def test_local_hit_remote_hit_and_miss_are_told_apart(live, tiny_model, rng, test_seed):
    corpus = Corpus(tiny_model)
    x, y, z = (corpus.text(700, rng) for _ in range(3))
    tag = f"l{test_seed % 10**8}"
    with live.pool.client(name="t") as c:
        before = c.stats()
    complete(url(live, "B"), x, tag=f"{tag}-x1", replica="B")  # a miss: never published
    complete(url(live, "B"), x, tag=f"{tag}-x2", replica="B")  # B's own prefix cache
    complete(url(live, "A"), y, tag=f"{tag}-y1", replica="A")
    complete(url(live, "B"), y, tag=f"{tag}-y2", replica="B")  # remote hit from A
    complete(url(live, "B"), z, tag=f"{tag}-z", replica="B", load=True)  # a miss
    h = live.history_dir
    got = {t: records(h, "lookup", tag=f"{tag}-{t}")[0] for t in ("x1", "x2", "y2", "z")}
    assert got["x1"]["outcome"] == "miss" and got["x1"]["miss_cause"] == "never_published"
    assert got["x2"]["outcome"] == "local_hit" and got["x2"]["local_tokens"] == 5 * BLOCK
    assert got["y2"]["outcome"] == "remote_hit" and got["y2"]["hit_blocks"] == 5
    assert got["z"]["outcome"] == "miss" and got["z"]["miss_cause"] == "never_published"
    with live.pool.client(name="t") as c:
        after = c.stats()
    assert after["hits"] - before["hits"] == 1  # only y2 leased blocks from the pool
    assert after["hit_blocks"] - before["hit_blocks"] == 5
