"""The connector with a network tier (setting `tier`) against a real pool and a real Redis:
a request whose prefix this host's pool holds only in part claims the blocks past the
pool's run that the tier holds (published there by a replica on another host), and the
worker installs both parts byte-exact into real (CPU) KV tensors; what it publishes goes
to the pool and to the tier. The fault is at the data: a byte of a tier record changed in
Redis is a `corrupt` load of that block and every block after it, reported to the engine;
the negative control, a tier that re-digests what it reads, must be caught by the
byte-exact check."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvgate.faults.tier_controls import BlindTier
from kvgate.harness.checkers.history import read_history
from kvgate.harness.system.pool import thread_pool
from kvgate.harness.system.stores import RedisServer, redis_binary
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import publish
from kvpool.connector.settings import ConnectorSettings
from kvpool.connector.scheduler import KVPoolScheduler
from kvpool.connector.worker import KVPoolWorker
from kvpool.connector.params import salt_root, request_inputs
from kvpool.tier.record import TierAuth, tier_key
from kvpool.tier.interface import tier_publish
from kvpool.tier.registry import open_tier
from suites.connector.engine_calls import ask_matched, finished

B, LAYERS, HEADS, HEAD = 16, 2, 2, 64
PAGE = LAYERS * HEADS * B * 2 * HEAD * 2
N = 6  # prompt blocks: 2 in this host's pool, 3 more in the tier only

SECRET = "the default tenant's tier secret"
AUTH = TierAuth.from_secret("default", SECRET)
pytestmark = pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed (make test installs it)")


def _config(tmp_path):  # noqa: ANN001, ANN202
    mc = SimpleNamespace(model=str(tmp_path), revision="r1", tokenizer=str(tmp_path), dtype="torch.bfloat16",
                         get_num_layers=lambda pc: LAYERS, get_num_kv_heads=lambda pc: HEADS, get_head_size=lambda: HEAD)
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=B),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           device_config=SimpleNamespace(device_type="cpu"))


@pytest.fixture
def system(tmp_path):
    pool = thread_pool(page_size=PAGE, num_pages=64)
    redis = RedisServer(tmp_path / "redis").start()
    yield pool, redis
    redis.stop()
    pool.stop_thread()


def _step(rid: str, block_ids: list[int], computed: int, scheduled: int):  # noqa: ANN202
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=[block_ids],
                                                               num_computed_tokens=computed)],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                                 resumed_req_ids=set()),
                           num_scheduled_tokens={rid: scheduled})


def _run(tmp_path, pool, redis, seed: int, corrupt: int | None = None, control: bool = False):  # noqa: ANN001, ANN202
    """(what the consumer's KV blocks hold afterwards, the producer's pages, failed block ids, history)."""
    settings = ConnectorSettings(pool=f"unix:{pool.unix_path}", token="tok", replica="W", tier=redis.url,
                                 tier_secret=SECRET, history_dir=str(tmp_path / "h"),
                                 tier_timeout_s=10.0, tier_deadline_s=10.0)  # not the verdict's subject
    sched = KVPoolScheduler(_config(tmp_path), settings)
    worker = KVPoolWorker(_config(tmp_path), settings)
    if control:
        worker.tier = BlindTier(worker.tier)
    kv = [torch.zeros(32, HEADS, B, 2 * HEAD, dtype=torch.bfloat16) for _ in range(LAYERS)]
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(kv)})
    rng = np.random.default_rng(seed)
    tokens = [int(x) for x in rng.integers(0, 2000, N * B + 1)]
    request = SimpleNamespace(request_id="r", prompt_token_ids=tokens, num_computed_tokens=0, cache_salt=None,
                              kv_transfer_params=None)
    chain = request_inputs(request, B)[0].hashes(tokens, B, salt_root(request))
    producer = [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(N)]
    with PoolClient(f"unix:{pool.unix_path}", "default", "tok", name="this-host") as c:  # this host: 2 blocks
        assert publish(c, sched.ns, chain[:2], producer[:2]).committed == 2
    tier = open_tier(redis.url, AUTH)  # another host: blocks 0-4 in the tier
    assert tier_publish(tier, sched.ns, chain[:5], producer[:5]).put == 5
    if corrupt is not None:
        raw, key = redis.client(), tier_key(AUTH, sched.ns, chain[corrupt])
        at = len(raw.get(key)) - PAGE + int(rng.integers(PAGE))
        raw.setrange(key, at, bytes([raw.get(key)[at] ^ 0x01]))

    assert ask_matched(sched, request, 0) == (5 * B, False)  # 2 from the pool, 3 from the tier
    sched.update_state_after_alloc(request, None, 5 * B)
    ids = [10, 11, 12, 13, 14, 15, 16]
    meta = sched.build_connector_meta(_step("r", ids, 5 * B, N * B + 1 - 5 * B))
    assert [(r.source, r.first_block, list(r.block_ids)) for r in meta.loads] == [("pool", 0, ids[:2]),
                                                                                  ("tier", 2, ids[2:5])]
    worker.start_load_kv(meta)
    worker.wait_for_load()
    failed = worker.take_failed()
    installed = [b"".join(bytes(s) for s in worker.copier.block_segments(b)) for b in ids[:5]]
    worker.save(meta)  # block 5 (computed in this step): to the pool and the tier
    assert finished(worker, {"r"}) == {"r"}
    return installed, [p.tobytes() for p in producer], failed, read_history(tmp_path / "h"), chain, sched.ns, tier


def test_blocks_past_the_pools_run_come_from_the_tier_byte_exact(system, tmp_path, test_seed):
    pool, redis = system
    installed, producer, failed, recs, chain, ns, tier = _run(tmp_path, pool, redis, test_seed)
    assert failed == set() and installed == producer[:5]
    lookup = [r for r in recs if r["ev"] == "lookup"][0]
    assert (lookup["hit_blocks"], lookup["tier_blocks"], lookup["miss_cause"]) == (2, 3, "never_published")
    assert [(r["loaded"], r["miss_cause"]) for r in recs if r["ev"] == "tier_load"] == [(3, None)]
    assert tier.exists(ns, chain) == 6  # the step's own block went to the tier too
    assert [r["put"] for r in recs if r["ev"] == "tier_publish"] == [1]


@pytest.mark.parametrize("control", [False, True], ids=["tier", "control-blind-tier"])
def test_a_byte_changed_in_a_tier_record_is_a_corrupt_load_and_the_control_is_caught(system, tmp_path, test_seed,
                                                                                    control):
    pool, redis = system
    installed, producer, failed, recs, _, _, _ = _run(tmp_path, pool, redis, test_seed, corrupt=3, control=control)
    byte_exact = installed[:5] == producer[:5]
    if control:  # the known-bad tier installs the changed page as good: only the byte check can see it
        assert failed == set() and not byte_exact, "negative control not caught by the byte-exact check"
        return
    assert failed == {13, 14}  # the corrupt block (prompt block 3) and every block after it
    assert installed[:3] == producer[:3]
    load = [r for r in recs if r["ev"] == "tier_load"][0]
    assert (load["loaded"], load["miss_cause"], load["miss_index"]) == (1, "corrupt", 3)


def test_a_dead_tier_is_no_hit_and_the_pools_run_still_loads(system, tmp_path, test_seed):
    pool, redis = system
    settings = ConnectorSettings(pool=f"unix:{pool.unix_path}", token="tok", replica="W", tier=redis.url,
                                 tier_secret=SECRET, tier_timeout_s=0.3, history_dir=str(tmp_path / "h"))
    sched = KVPoolScheduler(_config(tmp_path), settings)
    tokens = list(range(N * B + 1))
    request = SimpleNamespace(request_id="r", prompt_token_ids=tokens, num_computed_tokens=0, cache_salt=None,
                              kv_transfer_params=None)
    chain = request_inputs(request, B)[0].hashes(tokens, B, salt_root(request))
    with PoolClient(f"unix:{pool.unix_path}", "default", "tok", name="this-host") as c:
        assert publish(c, sched.ns, chain[:2], [np.zeros(PAGE, np.uint8)] * 2).committed == 2
    redis.kill()
    assert ask_matched(sched, request, 0) == (2 * B, False)
    lookup = [r for r in read_history(tmp_path / "h") if r["ev"] == "lookup"][0]
    assert lookup["tier_blocks"] == 0 and lookup["tier_error"].startswith("TierUnavailable")


def _stats_of(worker, timeout_s: float = 5.0):  # noqa: ANN001, ANN202
    """The worker's connector stats once its loads' measurements are in (a future's done
    callbacks run just after its waiters wake)."""
    import time

    deadline = time.monotonic() + timeout_s
    while (stats := worker.take_stats()) is None:
        assert time.monotonic() < deadline, "no tier load measured"
        time.sleep(0.01)
    return stats


def test_a_stalled_tier_node_costs_at_most_the_deadline_and_is_then_held_off(system, tmp_path, test_seed):
    """Redis stops answering for 0.8 s (CLIENT PAUSE: the node, not the client, is slow) while
    a load's deadline is 0.3 s: the load installs what arrived, ends on `timeout` with the
    rest reported failed (recomputed), and the scheduler, told through the connector stats,
    asks the tier nothing for the next request: it recomputes at once instead of waiting."""
    pool, redis = system
    settings = ConnectorSettings(pool=f"unix:{pool.unix_path}", token="tok", replica="W", tier=redis.url,
                                 tier_secret=SECRET, tier_deadline_s=0.3, tier_backoff_s=30.0,
                                 history_dir=str(tmp_path / "h"))
    sched, worker = KVPoolScheduler(_config(tmp_path), settings), KVPoolWorker(_config(tmp_path), settings)
    kv = [torch.zeros(32, HEADS, B, 2 * HEAD, dtype=torch.bfloat16) for _ in range(LAYERS)]
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(kv)})
    rng = np.random.default_rng(test_seed)

    def request(rid: str):  # noqa: ANN202
        tokens = [int(x) for x in rng.integers(0, 2000, N * B + 1)]
        r = SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_computed_tokens=0, cache_salt=None,
                            kv_transfer_params=None)
        chain = request_inputs(r, B)[0].hashes(tokens, B, salt_root(r))
        assert tier_publish(open_tier(redis.url, AUTH), sched.ns, chain[:5],
                            [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(5)]).put == 5
        return r

    first, second = request("r1"), request("r2")
    assert ask_matched(sched, first, 0) == (5 * B, False)  # nothing measured yet: every tier block
    sched.update_state_after_alloc(first, None, 5 * B)
    ids = [10, 11, 12, 13, 14, 15, 16]
    meta = sched.build_connector_meta(_step("r1", ids, 5 * B, N * B + 1 - 5 * B))
    redis.client().execute_command("CLIENT", "PAUSE", 800, "ALL")
    worker.start_load_kv(meta)
    worker.wait_for_load()
    assert worker.take_failed() == set(ids[1:5])  # the first page arrived late; the rest is recomputed
    stats = _stats_of(worker)
    assert [(s.wanted, s.loaded, s.cause) for s in stats.tier_load_stats()] == [(5, 1, "timeout")]
    # bounded by the one request in flight at the deadline (0.3 s, then the 0.8 s pause), with a
    # second of margin for a loaded machine: an unbounded load would wait out more pauses than that
    assert stats.tier_load_stats()[0].seconds < 0.3 + 0.8 + 1.0
    sched.update_connector_output(SimpleNamespace(kv_connector_stats=stats))
    assert ask_matched(sched, second, 0) == (0, False)  # held off: recomputed at once
    lookups = [r for r in read_history(tmp_path / "h") if r["ev"] == "lookup"]
    assert "timeout" in lookups[-1]["tier_held"] and lookups[-1]["tier_blocks"] == 0
    (rule,) = [r for r in read_history(tmp_path / "h") if r["ev"] == "tier_rule"]
    assert rule["cause"] == "timeout" and rule["held_s"] > 20
