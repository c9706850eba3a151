"""The hostile store client of the multi-host scenario (kvgate.harness.scenarios.hostile.tier), at
the connector, without vLLM: a real pool, a real redis-server with its access control on
(the replicas' tenant an ACL user of its own keys), kvpool's scheduler and worker over CPU
KV tensors. Another host publishes five blocks to the tier; then a client of the store with
every right and no tier secret (the store's operator) moves each record under another
block's key, or rewrites each page with its plain digest recomputed. The worker's load of
them is `corrupt` at the first block, every block is reported failed (recomputed) and none
of the attacker's bytes reaches the KV tensors. Negative control: the worker's copier armed
with `unauthenticated_tier` (kvgate.faults.copier, the control the live scenario arms) installs
the records as good, and the byte-exact comparison with the producer's pages catches it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvgate.faults.copier import FaultyCopier
from kvgate.faults.tier_controls import UNAUTHENTICATED_TIER, forge_record, rotate
from kvgate.harness.checkers.history import read_history
from kvgate.harness.system.pool import DEFAULT_TENANT, thread_pool
from kvgate.harness.system.stores import RedisServer, redis_binary
from kvpool.connector.settings import ConnectorSettings
from kvpool.connector.scheduler import KVPoolScheduler
from kvpool.connector.worker import KVPoolWorker
from kvpool.connector.params import salt_root, request_inputs
from kvpool.connector.history import HistoryWriter
from kvpool.tier.record import TierAuth
from kvpool.tier.interface import tier_publish
from kvpool.tier.registry import open_tier
from suites.connector.engine_calls import ask_matched
from suites.connector.test_tier_fallback import HEAD, HEADS, LAYERS, PAGE, B, _config, _step

N = 5  # prompt blocks, all in the tier only
SECRET = "the default tenant's tier secret"

pytestmark = pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed (make test installs it)")


@pytest.fixture
def system(tmp_path):
    pool = thread_pool(page_size=PAGE, num_pages=64)
    redis = RedisServer(tmp_path / "redis", tenants=(DEFAULT_TENANT,)).start()
    yield pool, redis
    redis.stop()
    pool.stop_thread()


@pytest.mark.parametrize("control", [False, True], ids=["tier", "control-unauthenticated-tier"])
@pytest.mark.parametrize("attempt", ["moved", "forged"])
def test_records_moved_or_forged_in_the_store_are_never_installed(system, tmp_path, test_seed, attempt, control):
    pool, redis = system
    url = redis.tenant_url(DEFAULT_TENANT)
    settings = ConnectorSettings(pool=f"unix:{pool.unix_path}", token="tok", replica="H", tier=url,
                                 tier_secret=SECRET, history_dir=str(tmp_path / "h"),
                                 tier_timeout_s=10.0, tier_deadline_s=10.0)  # not the verdict's subject
    sched, worker = KVPoolScheduler(_config(tmp_path), settings), KVPoolWorker(_config(tmp_path), settings)
    if control:
        faults = tmp_path / "faults.json"
        faults.write_text(json.dumps({"copier": {"control": UNAUTHENTICATED_TIER}}))
        worker.copier = FaultyCopier(worker.copier, faults, HistoryWriter(tmp_path / "h", "H", "faults"))
    kv = [torch.zeros(32, HEADS, B, 2 * HEAD, dtype=torch.bfloat16) for _ in range(LAYERS)]
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(kv)})
    rng = np.random.default_rng(test_seed)
    tokens = [int(x) for x in rng.integers(0, 2000, N * B + 1)]
    request = SimpleNamespace(request_id="r", prompt_token_ids=tokens, num_computed_tokens=0, cache_salt=None,
                              kv_transfer_params=None)
    chain = request_inputs(request, B)[0].hashes(tokens, B, salt_root(request))
    producer = [rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes() for _ in range(N)]
    auth = TierAuth.from_secret(DEFAULT_TENANT, SECRET)
    assert tier_publish(open_tier(url, auth), sched.ns, chain, producer).put == N  # another host's publish

    op = redis.client()  # the store's operator: every right, no tier secret
    keys = sorted(k.decode() for k in op.scan_iter(match=f"{auth.prefix}*"))
    assert len(keys) == N
    if attempt == "moved":
        records = {k: op.get(k) for k in keys}
        for src, dst in rotate(keys):
            op.set(dst, records[src])
    else:
        for k in keys:
            op.set(k, forge_record(op.get(k), page=rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes()))

    assert ask_matched(sched, request, 0) == (N * B, False)  # the store still says it holds them all
    sched.update_state_after_alloc(request, None, N * B)
    ids = [10, 11, 12, 13, 14, 15]
    meta = sched.build_connector_meta(_step("r", ids, N * B, 1))
    worker.start_load_kv(meta)
    worker.wait_for_load()
    failed = worker.take_failed()
    installed = [b"".join(bytes(s) for s in worker.copier.block_segments(b)) for b in ids[:N]]
    loads = [r for r in read_history(tmp_path / "h") if r["ev"] == "tier_load"]
    if control:  # the known-bad reader installs the attacker's records: only the byte check sees it
        assert failed == set() and loads[0]["loaded"] == N
        assert installed != producer, "negative control not caught by the byte-exact comparison"
        return
    assert failed == set(ids[:N])  # every block recomputed
    assert (loads[0]["loaded"], loads[0]["miss_cause"], loads[0]["miss_index"]) == (0, "corrupt", 0)
    assert not any(any(b) for b in installed), "a byte of a refused record reached the KV tensors"
