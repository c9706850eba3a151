"""The connector on a keeper's tier with the host pool behind it (settings `pool = "keeper:RUN_DIR"`
and `host_pool`): its scheduler and worker driven in-process as vLLM calls them, against a keeper
(`python -m kvpool keeper --backing memfd`) and a pool daemon (`python -m kvpool serve`), each in
its own process, real (CPU) KV tensors. A prompt whose first blocks are in the tier and the next
ones only in the host pool is claimed whole and installed byte-exact in one load; the step's own
block is published to the tier. With the keeper killed, the lookup, the load and the publish fall
through to the host pool. Plus the settings' checks, typed at start, and the composite's checks
of its members at construction.
What is not checked here: vLLM replicas (suites/live), the faults' controls (suites/pool/test_gpu_tiered.py).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvgate.harness.checkers.history import read_history
from kvgate.harness.system.pool import PoolProcess
from kvpool.client import transfer
from kvpool.connector.params import request_inputs, salt_root
from kvpool.connector.scheduler import KVPoolScheduler
from kvpool.connector.settings import ConnectorSettings, connect_backend
from kvpool.connector.worker import KVPoolWorker
from kvpool.gpu.tier import KeeperRefused
from kvpool.gpu.tier_backend import TierBackend
from kvpool.gpu.tier_client import TierLink
from kvpool.gpu.tiered import TieredBackend, TierMismatch
from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import block_hashes
from suites.connector.engine_calls import ask_matched, finished
from suites.pool.test_gpu_keeper_restart import Keeper

B, LAYERS, HEADS, HEAD = 16, 2, 2, 64
PAGE = LAYERS * HEADS * B * 2 * HEAD * 2  # 16 KiB: one block of both layers
N = 6  # prompt blocks: 3 in the tier, 2 more in the host pool only, the last computed in the step
IN_TIER = 3


def _config(tmp_path):  # noqa: ANN001, ANN202
    mc = SimpleNamespace(model=str(tmp_path), revision="r1", tokenizer=str(tmp_path), dtype="torch.bfloat16",
                         get_num_layers=lambda pc: LAYERS, get_num_kv_heads=lambda pc: HEADS, get_head_size=lambda: HEAD)
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=B),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           device_config=SimpleNamespace(device_type="cpu"))


def _step(rid: str, block_ids: list[int], computed: int, scheduled: int):  # noqa: ANN202
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=[block_ids],
                                                               num_computed_tokens=computed)],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                                 resumed_req_ids=set()),
                           num_scheduled_tokens={rid: scheduled})


@pytest.fixture
def system(tmp_path):
    run_dir = tmp_path / "k"
    run_dir.mkdir(mode=0o700)
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir(mode=0o700)
    keeper = Keeper(run_dir, "--page-size", "16KiB", "--pages", "16")
    pool = None
    try:
        pool = PoolProcess.start(page_size=PAGE, num_pages=32, run_dir=pool_dir, token="host-token")
        yield keeper, pool
    finally:
        keeper.stop()
        if pool is not None:
            pool.cleanup()


def _settings(tmp_path, keeper: Keeper | Path, pool: PoolProcess) -> ConnectorSettings:  # noqa: ANN001
    run_dir = keeper if isinstance(keeper, Path) else keeper.run_dir
    return ConnectorSettings.from_extra({"pool": f"keeper:{run_dir}", "token": "tok", "host_pool": pool.unix,
                                         "host_token": pool.token, "replica": "W",
                                         "history_dir": str(tmp_path / "h")})


def _serve(tmp_path, settings: ConnectorSettings, seed: int, place, after=None):  # noqa: ANN001, ANN202
    """One request through the connector's scheduler and worker on `settings`: place(chain,
    producer pages, ns) puts the blocks where the case wants them, the scheduler claims, the
    worker loads and saves the step's block, after(worker, chain, producer, ns) runs before the
    connector closes. (the pages installed in the consumer's blocks, the producer's pages, failed
    block ids, the history, the chain, the namespace, the backend's stats)."""
    sched = KVPoolScheduler(_config(tmp_path), settings)
    worker = KVPoolWorker(_config(tmp_path), settings)
    try:
        assert isinstance(worker.backend, TieredBackend) and worker.backend.names == ("gpu", "host")
        kv = [torch.zeros(32, HEADS, B, 2 * HEAD, dtype=torch.bfloat16) for _ in range(LAYERS)]
        worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(kv)})
        rng = np.random.default_rng(seed)
        tokens = [int(x) for x in rng.integers(0, 2000, N * B + 1)]
        request = SimpleNamespace(request_id="r", prompt_token_ids=tokens, num_computed_tokens=0, cache_salt=None,
                                  kv_transfer_params=None)
        chain = request_inputs(request, B)[0].hashes(tokens, B, salt_root(request))
        producer = [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(N)]
        place(chain, producer, sched.ns)

        assert ask_matched(sched, request, 0) == (5 * B, False)  # claimed whole: one source, the composite
        sched.update_state_after_alloc(request, None, 5 * B)
        ids = [10, 11, 12, 13, 14, 15, 16]
        meta = sched.build_connector_meta(_step("r", ids, 5 * B, N * B + 1 - 5 * B))
        assert [(r.source, r.first_block, list(r.block_ids)) for r in meta.loads] == [("pool", 0, ids[:5])]
        worker.start_load_kv(meta)
        worker.wait_for_load()
        failed = worker.take_failed()
        installed = [b"".join(bytes(s) for s in worker.copier.block_segments(b)) for b in ids[:5]]
        worker.save(meta)  # block 5, computed in this step
        assert finished(worker, {"r"}) == {"r"}
        if after is not None:
            after(worker, chain, producer, sched.ns)
        stats = worker.backend.stats()
    finally:
        worker.close()
        sched.close()
    return installed, [p.tobytes() for p in producer], failed, read_history(tmp_path / "h"), chain, sched.ns, stats


def _run(tmp_path, keeper: Keeper, pool: PoolProcess, seed: int, kill_keeper: bool):  # noqa: ANN001, ANN202
    def place(chain, producer, ns) -> None:  # noqa: ANN001
        tier = TierBackend(TierLink(keeper.run_dir, "default", "tok", name="producer").connect())
        try:  # another replica of this host: blocks 0-2 in the tier
            assert transfer.publish(tier, ns, chain[:IN_TIER], producer[:IN_TIER],
                                    kind=DigestKind.SKETCH).committed == IN_TIER
        finally:
            tier.close()
        with pool.client(name="producer") as host:  # blocks 3-4 in the host pool (all 5 with the keeper dead)
            first = 0 if kill_keeper else IN_TIER
            assert transfer.publish(host, ns, chain[first:5], producer[first:5]).committed == 5 - first
        if kill_keeper:
            keeper.kill()

    return _serve(tmp_path, _settings(tmp_path, keeper, pool), seed, place)


def test_a_prompt_in_the_tier_and_then_the_host_pool_is_claimed_whole_and_installed_byte_exact(system, tmp_path,
                                                                                             test_seed):
    keeper, pool = system
    installed, producer, failed, recs, chain, ns, stats = _run(tmp_path, keeper, pool, test_seed, kill_keeper=False)
    assert failed == set() and installed == producer[:5]
    lookup = [r for r in recs if r["ev"] == "lookup"][0]
    assert (lookup["hit_blocks"], lookup["miss_cause"]) == (5, "never_published")
    assert [(r["loaded"], r["miss_cause"]) for r in recs if r["ev"] == "load"] == [(5, None)]
    assert (stats["tiered_gpu_blocks"], stats["tiered_host_blocks"]) == (IN_TIER, 5 - IN_TIER)
    tier = TierBackend(TierLink(keeper.run_dir, "default", "tok", name="check").connect())
    try:  # the step's own block went to the tier, not to the host pool
        assert len(tier.lookup(ns, chain[5:6]).hits) == 1
    finally:
        tier.close()
    with pool.client(name="check") as host:
        assert len(host.lookup(ns, chain[5:6]).hits) == 0


@pytest.mark.fault_pool_restart
def test_with_the_keeper_killed_the_lookup_load_and_publish_fall_through_to_the_host_pool(system, tmp_path,
                                                                                         test_seed):
    keeper, pool = system
    installed, producer, failed, recs, chain, ns, stats = _run(tmp_path, keeper, pool, test_seed, kill_keeper=True)
    assert failed == set() and installed == producer[:5]
    lookup = [r for r in recs if r["ev"] == "lookup"][0]
    # the block past the run: the host pool never had it, the dead tier could not say: transport_error
    assert (lookup["hit_blocks"], lookup["miss_cause"]) == (5, "transport_error")
    assert (stats["tiered_gpu_blocks"], stats["tiered_host_blocks"]) == (0, 5)
    assert stats["tiered_gpu_errors"] >= 2  # the worker's acquire and its publish's reserve
    assert [r.get("committed") for r in recs if r["ev"] == "publish"] == [1]
    with pool.client(name="check") as host:  # the step's block, published where it could be
        assert len(host.lookup(ns, chain[:6]).hits) == 6


def _dirs(tmp_path):  # noqa: ANN001, ANN202
    run_dir, pool_dir = tmp_path / "k", tmp_path / "pool"
    run_dir.mkdir(mode=0o700)
    pool_dir.mkdir(mode=0o700)
    return run_dir, pool_dir


@pytest.mark.fault_pool_restart
def test_a_keeper_that_starts_after_the_connector_joins_and_the_host_pool_serves_until_then(tmp_path, test_seed):
    run_dir, pool_dir = _dirs(tmp_path)
    pool = PoolProcess.start(page_size=PAGE, num_pages=32, run_dir=pool_dir, token="host-token")
    keepers: list[Keeper] = []

    def place(chain, producer, ns) -> None:  # noqa: ANN001
        with pool.client(name="producer") as host:  # no keeper yet: everything in the host pool
            assert transfer.publish(host, ns, chain[:5], producer[:5]).committed == 5

    def after(worker, chain, producer, ns) -> None:  # noqa: ANN001
        assert worker.backend.stats()["tiered_gpu_errors"] >= 2  # the worker's acquire and its publish's reserve
        keepers.append(Keeper(run_dir, "--page-size", "16KiB", "--pages", "16"))
        late = block_hashes(list(range(7000, 7000 + 2 * B)), B)  # a publish once the keeper answers
        pages = [np.full(PAGE, 7 + i, np.uint8) for i in range(2)]
        assert transfer.publish(worker.backend, ns, late, pages, kind=DigestKind.SKETCH).committed == 2
        tier = TierBackend(TierLink(run_dir, "default", "tok", name="check").connect())
        try:  # it went to the tier, which now serves it to the composite's load
            assert len(tier.lookup(ns, late).hits) == 2
        finally:
            tier.close()
        got = [np.zeros(PAGE, np.uint8) for _ in range(2)]
        assert transfer.load(worker.backend, ns, late, got.__getitem__).loaded == 2
        assert all(np.array_equal(a, b) for a, b in zip(got, pages))

    try:
        installed, producer, failed, recs, chain, ns, stats = _serve(
            tmp_path, _settings(tmp_path, run_dir, pool), test_seed, place, after)
        assert failed == set() and installed == producer[:5]  # the host pool served, byte-exact
        assert [r.get("committed") for r in recs if r["ev"] == "publish"] == [1]  # the step's block: the host's
        with pool.client(name="check") as host:
            assert len(host.lookup(ns, chain[:6]).hits) == 6
        assert (stats["tiered_gpu_blocks"], stats["tiered_host_blocks"], stats["tiered_gpu_left_out"]) == (2, 5, 0)
    finally:
        for k in keepers:
            k.stop()
        pool.cleanup()


def test_a_late_keeper_of_another_page_size_is_left_out_and_the_host_pool_serves(tmp_path):
    run_dir, pool_dir = _dirs(tmp_path)
    pool = PoolProcess.start(page_size=PAGE, num_pages=8, run_dir=pool_dir, token="host-token")
    keeper = None
    try:
        sched = KVPoolScheduler(_config(tmp_path), _settings(tmp_path, run_dir, pool))
        ns = sched.ns
        sched.close()
        backend = connect_backend(_settings(tmp_path, run_dir, pool), "worker", None)  # type: ignore[arg-type]
        try:
            keeper = Keeper(run_dir, "--page-size", "32KiB")
            hashes = block_hashes(list(range(2 * B)), B)
            with pool.client(name="producer") as host:
                assert transfer.publish(host, ns, hashes, [np.ones(PAGE, np.uint8)] * 2).committed == 2
            for _ in range(2):  # left out once, then never asked
                assert len(backend.lookup(ns, hashes).hits) == 2
            assert list(backend.left_out) == ["gpu"] and "32768" in backend.left_out["gpu"]
            stats = backend.stats()
            assert (stats["tiered_gpu_left_out"], stats["tiered_gpu_errors"]) == (1, 2)
        finally:
            backend.close()
    finally:
        if keeper is not None:
            keeper.stop()
        pool.cleanup()


def test_a_keeper_that_refuses_the_replica_is_an_error_at_start_not_a_keeper_to_wait_for(tmp_path):
    """A keeper that is up and answers the hello with a refusal (a token it does not know) is a
    configuration to fix: connect_backend raises KeeperRefused; it is not taken for a keeper
    not started yet (found in review: the replica ran on the host pool, retrying the hello on
    every call)."""
    run_dir, pool_dir = _dirs(tmp_path)
    pool = PoolProcess.start(page_size=PAGE, num_pages=8, run_dir=pool_dir, token="host-token")
    keeper = Keeper(run_dir, "--page-size", "16KiB", "--tenant", "default=another-token")
    try:
        with pytest.raises(KeeperRefused, match="refused"):
            connect_backend(_settings(tmp_path, run_dir, pool), "worker", None)  # type: ignore[arg-type]
    finally:
        keeper.stop()
        pool.cleanup()


# -- the settings, typed at start, and the composite's own checks --------------------------------

@pytest.mark.parametrize("extra,match", [
    ({"pool": "unix:/x/pool.sock", "host_pool": "unix:/y/pool.sock"}, "needs pool 'keeper:RUN_DIR'"),
    ({"pool": "keeper:/x", "host_pool": "keeper:/y"}, "not a pool daemon's address"),
    ({"pool": "keeper:/x", "host_pool": "tcp:nohost"}, "not a pool daemon's address"),
    ({"pool": "keeper:/x", "host_token": "t"}, "for a host_pool"),
])
def test_a_bad_host_pool_setting_is_a_typed_error_at_start(extra, match):
    with pytest.raises(ValueError, match=match):
        ConnectorSettings.from_extra({"token": "tok", **extra})
    ok = ConnectorSettings.from_extra({"pool": "keeper:/x", "host_pool": "tcp:127.0.0.1:9", "token": "tok"})
    assert ok.resolved_host_token() == "tok"  # the connector's own unless told otherwise


class Member:
    """What the composite reads of a member at construction."""

    def __init__(self, page_size: int, digest_kind: DigestKind | None = None):
        self.page_size = page_size
        if digest_kind is not None:
            self.digest_kind = digest_kind


def test_members_whose_pages_or_digest_kinds_disagree_are_refused_at_construction():
    with pytest.raises(TierMismatch, match="page sizes differ"):
        TieredBackend([("gpu", Member(PAGE, DigestKind.SKETCH)), ("host", Member(2 * PAGE))])
    with pytest.raises(TierMismatch, match="digests only"):
        TieredBackend([("host", Member(PAGE)), ("gpu", Member(PAGE, DigestKind.SKETCH))])
    b = TieredBackend([("gpu", Member(PAGE, DigestKind.SKETCH)), ("host", Member(PAGE))])
    assert (b.page_size, b.digest_kind) == (PAGE, DigestKind.SKETCH)


def test_connect_backend_refuses_a_keeper_and_a_host_pool_of_other_page_sizes(tmp_path):
    run_dir = tmp_path / "k"
    run_dir.mkdir(mode=0o700)
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir(mode=0o700)
    keeper = Keeper(run_dir, "--page-size", "16KiB")
    try:
        pool = PoolProcess.start(page_size=2 * PAGE, num_pages=8, run_dir=pool_dir, token="host-token")
        try:
            settings = _settings(tmp_path, keeper, pool)
            with pytest.raises(TierMismatch):
                connect_backend(settings, "worker", None)  # type: ignore[arg-type] - no history needed
        finally:
            pool.cleanup()
    finally:
        keeper.stop()
