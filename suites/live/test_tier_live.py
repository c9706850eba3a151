"""Two hosts' pools and one network tier, live: replica G uses this host's pool, replica H
another pool daemon (the pool of a second host: nothing G publishes reaches it), and both
the same Redis tier. G computes a prompt; H, whose own pool has none of it, finds every
block in the tier, loads them byte for byte as G computed them, and gives the tokens and
log-probabilities of G's own prefix hit of the prompt (the same prefill partition)."""

from __future__ import annotations

import random
import secrets

import pytest

from kvgate.fixtures.tiny_model import build_tiny_model
from kvgate.harness.checkers.history import audit_digests, records
from kvgate.harness.client import http
from kvgate.harness.client.http import complete
from kvgate.harness.scenarios.nemesis import wait_for
from kvgate.harness.system.stores import RedisServer, redis_binary
from kvgate.harness.workload.prompts import Corpus

pytestmark = [pytest.mark.live,
              pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed (make test installs it)")]
PROMPT_TOKENS = 11 * 128 + 60


@pytest.fixture(scope="module")
def two_hosts(live_report_dir):
    from kvgate.harness.system.cluster import DEFAULT_CHUNK, Cluster, ReplicaSpec
    from kvgate.harness.system.pool import PoolProcess

    root = live_report_dir / "tier"
    model = build_tiny_model(root / "tiny", seed=0, revision="r1")
    redis = RedisServer(root / "redis", tenants=("default",)).start()  # the tenant's ACL user, its keys only
    other = PoolProcess.start(page_size=128 * 1024, num_pages=256, log_path=root / "pool-host2.log")
    cluster = Cluster(model, root / "cluster", page_size=128 * 1024, pool_pages=256)
    tier = (("tier", redis.tenant_url("default")), ("tier_secret", secrets.token_hex(16)))  # one secret, both hosts
    specs = [ReplicaSpec("G", core="0", kv_bytes=256 * 2**20, audit=True, max_num_batched_tokens=DEFAULT_CHUNK,
                         connector_extra=tier),
             ReplicaSpec("H", core="1", kv_bytes=256 * 2**20, audit=True, max_num_batched_tokens=DEFAULT_CHUNK,
                         connector_extra=(*tier, ("pool", other.unix), ("token", other.token)))]
    recorder = http.RECORDER
    try:
        cluster.start(specs)
        yield cluster
    finally:
        cluster.stop()
        http.RECORDER = recorder
        other.stop()
        redis.stop()


def test_a_replica_on_another_host_loads_the_prompt_from_the_tier_byte_exact(two_hosts, test_seed):
    cluster = two_hosts
    G, H = (cluster.replicas[n].url for n in ("G", "H"))
    prompt = Corpus(cluster.model_dir).text(PROMPT_TOKENS, random.Random(test_seed))
    tag = f"tier{test_seed % 10**8}"
    complete(G, prompt, tag=f"{tag}-g", replica="G", max_tokens=8)
    wait_for(lambda: any(r.get("put") for r in records(cluster.history_dir, "tier_publish", tag=f"{tag}-g")),
             30, "G's blocks in the tier")
    h = complete(H, prompt, tag=f"{tag}-h", replica="H", max_tokens=8)
    g_hit = complete(G, prompt, tag=f"{tag}-ghit", replica="G", max_tokens=8)

    (lookup,) = records(cluster.history_dir, "lookup", tag=f"{tag}-h", replica="H")
    assert (lookup["hit_blocks"], lookup["miss_cause"]) == (0, "never_published")  # H's own pool: nothing
    assert lookup["tier_blocks"] == PROMPT_TOKENS // 128
    (load,) = records(cluster.history_dir, "tier_load", tag=f"{tag}-h", replica="H")
    assert load["loaded"] == PROMPT_TOKENS // 128 and load["miss_cause"] is None
    produced = audit_digests(cluster.history_dir, "produced", f"{tag}-g", "G")
    installed = audit_digests(cluster.history_dir, "installed", f"{tag}-h", "H")
    assert len(installed) == PROMPT_TOKENS // 128
    assert all(produced.get(k) == d for k, d in installed.items()), "H installed other bytes than G computed"
    assert h.error is None and h.token_ids == g_hit.token_ids and h.logprobs == g_hit.logprobs
