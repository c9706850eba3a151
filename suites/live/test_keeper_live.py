"""Two vLLM replicas whose pool is a GPU keeper's tier in host memory, live: `python -m kvpool
keeper --backing memfd` in its own process, replicas G and H with `pool = keeper:RUN_DIR`
(kvpool.connector.settings.connect_backend: a TierBackend over a TierLink). G computes a prompt
and publishes its blocks into the keeper's buffer (kv-sketch-1 digests); H, which never computed
it, finds every block there, installs them byte for byte as G computed them (the audit's
digests), and gives the tokens and log-probabilities of G's own prefix hit of the prompt.
The keeper is the pool here: nothing goes through the cluster's pool daemon (whose counters
stay at zero)."""

from __future__ import annotations

import random

import pytest

from kvgate.fixtures.tiny_model import build_tiny_model
from kvgate.harness.checkers.history import audit_digests, records
from kvgate.harness.client import http
from kvgate.harness.client.http import complete
from kvgate.harness.scenarios.nemesis import wait_for
from kvgate.harness.workload.prompts import Corpus

from ..pool.test_gpu_keeper_restart import Keeper

pytestmark = pytest.mark.live
PAGE = 128 * 1024
BLOCK = 128
PROMPT_TOKENS = 9 * BLOCK + 40
TOKEN = "keeper-live"


@pytest.fixture(scope="module")
def on_keeper(live_report_dir):
    from kvgate.harness.system.cluster import DEFAULT_CHUNK, Cluster, ReplicaSpec

    root = live_report_dir / "keeper"
    model = build_tiny_model(root / "tiny", seed=0, revision="r1")
    run_dir = root / "keeper-run"
    run_dir.mkdir(mode=0o700, parents=True)
    keeper = Keeper(run_dir, "--page-size", str(PAGE), "--pages", "128", "--tenant", f"default={TOKEN}")
    cluster = Cluster(model, root / "cluster", page_size=PAGE, pool_pages=16)
    extra = (("pool", f"keeper:{run_dir}"), ("token", TOKEN))
    specs = [ReplicaSpec(n, core=c, kv_bytes=256 * 2**20, audit=True, max_num_batched_tokens=DEFAULT_CHUNK,
                         connector_extra=extra) for n, c in (("G", "0"), ("H", "1"))]
    recorder = http.RECORDER
    try:
        cluster.start(specs)
        yield cluster, keeper
    finally:
        cluster.stop()
        http.RECORDER = recorder
        keeper.stop()


def test_a_replica_loads_another_replicas_prompt_from_the_keeper_byte_exact(on_keeper, test_seed):
    cluster, keeper = on_keeper
    G, H = (cluster.replicas[n].url for n in ("G", "H"))
    prompt = Corpus(cluster.model_dir).text(PROMPT_TOKENS, random.Random(test_seed))
    tag = f"keeper{test_seed % 10**8}"
    blocks = PROMPT_TOKENS // BLOCK
    complete(G, prompt, tag=f"{tag}-g", replica="G", max_tokens=8)
    wait_for(lambda: sum(int(r.get("committed", 0)) for r in
                         records(cluster.history_dir, "publish", tag=f"{tag}-g", replica="G")) >= blocks,
             30, "G's blocks committed at the keeper")
    h = complete(H, prompt, tag=f"{tag}-h", replica="H", max_tokens=8)
    g_hit = complete(G, prompt, tag=f"{tag}-ghit", replica="G", max_tokens=8)

    (lookup,) = records(cluster.history_dir, "lookup", tag=f"{tag}-h", replica="H")
    assert lookup["hit_blocks"] == blocks and lookup["miss_cause"] is None, lookup
    loads = records(cluster.history_dir, "load", tag=f"{tag}-h", replica="H")
    assert sum(int(r["loaded"]) for r in loads) == blocks and not [r for r in loads if r.get("miss_cause")], loads
    produced = audit_digests(cluster.history_dir, "produced", f"{tag}-g", "G")
    installed = audit_digests(cluster.history_dir, "installed", f"{tag}-h", "H")
    assert len(installed) == blocks
    assert all(produced.get(k) == d for k, d in installed.items()), "H installed other bytes than G computed"
    assert h.error is None and h.token_ids == g_hit.token_ids and h.logprobs == g_hit.logprobs
    with cluster.pool.client(name="check") as c:  # the keeper was the pool: the daemon saw nothing
        assert c.stats()["committed_pages"] == 0
    assert keeper.proc.poll() is None
