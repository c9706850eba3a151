"""The GPU tier across processes: this process is the keeper (kvpool.gpu.keeper.GpuKeeper with
VMM buffers on GPU 0, exported as POSIX descriptors), two spawned replicas map its buffer
(kvpool.gpu.tier_map) and copy pages device to device. Every ordering edge is exercised with
the stream delay on the other side and judged by the byte-exact oracle, each with its negative
control (the edge dropped: the oracle must see stale bytes):

  commit edge    the producer's delayed write, committed after its host saw copy and sketch
                 complete; control: committed right after the copy was enqueued.
  event edge     the consumer's copy after cuStreamWaitEvent on the producer's interprocess
                 event (recorded after its delayed write); control: no wait.
  release edge   the consumer's delayed copy out of a leased page, released after its host saw
                 the copy complete, then the page reused and overwritten; control: released
                 right after the copy was enqueued.
Plus: the kv-sketch-1 digests the producer committed verified on the consumer's GPU; a producer
killed mid-copy leaves no page visible; demotion under pressure moves device pages to a host
pool with their GPU digests (checked against the host's reference over the bytes moved); the
peer path (a replica on GPU 1) where two GPUs are.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

torch = pytest.importorskip("torch")

from kvpool.errors import MissCause  # noqa: E402
from kvpool.pool.catalog import PageState  # noqa: E402
from kvpool.pool.keys import Namespace, block_hashes  # noqa: E402
from kvpool.pool.records import EvictOutcome, SlotStatus  # noqa: E402
from kvgate.harness.scenarios import gpu_tier as procs  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.fault_stream_delay,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]

PAGE = 4 * 2**20  # whole kv-sketch-1 rows
PAGES = 64
NS = Namespace("tier", "r1", "tok", "bfloat16", "cuda", 16, 2, 2, 64)
PRODUCER, CONSUMER = 1, 2


class Replica:
    """A spawned replica (kvgate.harness.scenarios.gpu_tier.tier_worker) and its pipe."""

    def __init__(self, keeper, device: int = 0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=procs.tier_worker,
                                args=(child, str(keeper.attach_path), keeper.mint_ticket("default"), device))
        self.proc.start()
        child.close()  # the worker's end is the worker's alone: its death reads as EOF here
        ok, self.same_gpu, self.device_name = self._answer(120)

    def _answer(self, timeout: float = 60):  # noqa: ANN202
        assert self.conn.poll(timeout), "the replica did not answer"
        reply = self.conn.recv()
        assert reply[0] == "ok", f"the replica failed: {reply}"
        return reply

    def __call__(self, *cmd, timeout: float = 60):  # noqa: ANN002, ANN204
        self.conn.send(cmd)
        reply = self._answer(timeout)
        return reply[1] if len(reply) == 2 else reply[1:]

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self("exit")
            except (AssertionError, OSError):
                self.proc.kill()
        self.proc.join(60)


@pytest.fixture
def keeper(tmp_path):
    from kvpool.gpu.keeper import GpuKeeper, vmm_allocator
    from kvpool.gpu.tier import GpuTierConfig

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    # a clock of the test's: a ticket minted before a replica's spawn (and its import of torch)
    # is still valid when the replica presents it, however long the start took
    with GpuKeeper(GpuTierConfig(page_size=PAGE, pages={"default": PAGES}), run_dir, vmm_allocator(0),
                   clock=procs.ManualClock()) as k:
        yield k


@pytest.fixture
def replicas(keeper):
    made: list[Replica] = []

    def make(device: int = 0) -> Replica:
        made.append(Replica(keeper, device))
        return made[-1]

    yield make
    for r in made:
        r.close()


def reserve(keeper, hashes, client=PRODUCER) -> tuple[int, list[int]]:
    res = keeper.tier.reserve(client, "default", NS, hashes, [PAGE] * len(hashes), 0.0)
    assert [s.status for s in res.slots] == [SlotStatus.RESERVED] * len(hashes)
    return res.reservation_id, [s.page for s in res.slots]


def test_two_replicas_share_the_keepers_buffer_byte_exact(keeper, replicas, test_seed):
    prod, cons = replicas(), replicas()
    assert prod.same_gpu and cons.same_gpu
    pages = list(range(8))
    prod("fill", pages, test_seed)
    cons("read", pages, 0, None, "host")
    assert cons("check", test_seed) == 0
    assert cons("check", test_seed + 1) > 0  # the oracle tells other bytes apart
    seconds, nbytes = cons("rate", list(range(PAGES)), 20)
    print(f"\ngpu tier: {nbytes / 2**20:.0f} MiB device to device out of the keeper's buffer in "
          f"{seconds * 1e3:.2f} ms ({nbytes / seconds / 1e9:.0f} GB/s) on {cons.device_name}")


def test_commit_after_host_completion_orders_a_delayed_write_and_its_control_is_caught(
        keeper, replicas, test_seed, delay_cycles):
    prod, cons = replicas(), replicas()
    for edge, seed in (("host", test_seed), ("none", test_seed + 100)):
        hashes = block_hashes(range(seed % 2**20 * 1000, seed % 2**20 * 1000 + 16 * 4), 16)
        rid, pages = reserve(keeper, hashes)
        prod("fill", pages, seed + 1)  # what a stale read sees
        sums = prod("write", pages, seed, delay_cycles, edge)  # the producer's delayed write
        digests = sums if edge == "host" else [b"\0" * 16] * len(pages)
        assert keeper.tier.commit(PRODUCER, "default", rid, digests).committed == len(pages)
        lease = keeper.tier.acquire(CONSUMER, "default", NS, hashes, 0.0)
        assert lease.hits.pages == pages
        cons("read", pages, 0, None, "host")
        differing = cons("check", seed)
        if edge == "host":
            assert differing == 0, f"{differing} bytes differ after a commit that waited for the copy"
            want = [h.digest for h in lease.hits]
            assert cons("verify", want) == []  # the committed digests, verified on the consumer's GPU
        else:
            assert differing > 0, "negative control NOT caught: a commit before the copy completed read no stale byte"
        keeper.tier.release(CONSUMER, "default", lease.lease_id)
        prod("sync")


def test_an_interprocess_event_orders_the_consumers_copy_and_its_control_is_caught(
        keeper, replicas, test_seed, delay_cycles):
    prod, cons = replicas(), replicas()
    for wait, seed in ((True, test_seed), (False, test_seed + 100)):
        pages = list(range(4)) if wait else list(range(4, 8))
        prod("fill", pages, seed + 1)
        handle = prod("write", pages, seed, delay_cycles, "ipc")
        cons("read", pages, 0, handle if wait else None, "host")
        differing = cons("check", seed)
        if wait:
            assert differing == 0, f"{differing} bytes differ after waiting on the producer's event"
        else:
            assert differing > 0, "negative control NOT caught: a copy without the event wait read no stale byte"
        prod("sync")


def test_release_after_host_completion_keeps_a_page_until_the_copy_out_ran_and_its_control_is_caught(
        keeper, replicas, test_seed, delay_cycles):
    prod, cons = replicas(), replicas()
    for edge, seed in (("host", test_seed), ("none", test_seed + 100)):
        hashes = block_hashes(range(seed % 2**20 * 1000, seed % 2**20 * 1000 + 16 * 4), 16)
        rid, pages = reserve(keeper, hashes)
        sums = prod("write", pages, seed, 0, "host")
        keeper.tier.commit(PRODUCER, "default", rid, sums)
        lease = keeper.tier.acquire(CONSUMER, "default", NS, hashes, 0.0)
        cons("read", pages, delay_cycles, None, edge)  # the consumer's copy out, delayed
        keeper.tier.release(CONSUMER, "default", lease.lease_id)
        # the keeper reuses the pages at once: another block is published into them
        assert keeper.tier.catalogs["default"].evict("default", NS, hashes) == [EvictOutcome.EVICTED] * 4
        other = block_hashes(range(seed % 2**20 * 1000 + 500, seed % 2**20 * 1000 + 500 + 16 * 4), 16)
        rid2, pages2 = reserve(keeper, other)
        assert pages2 == pages  # the lowest free pages: the same ones
        prod("fill", pages2, seed + 7)
        differing = cons("check", seed)
        if edge == "host":
            assert differing == 0, f"{differing} bytes differ: the page was reused under the consumer's copy"
        else:
            assert differing > 0, "negative control NOT caught: a release before the copy ran read no new byte"
        keeper.tier.abort(PRODUCER, "default", rid2)


def test_a_producer_killed_mid_copy_leaves_no_page_visible(keeper, replicas, test_seed, cycles_per_ms):
    prod = replicas()
    keeper.register_client(PRODUCER, prod.proc.pid)  # at its hello, while it runs
    hashes = block_hashes(range(test_seed % 2**30, test_seed % 2**30 + 16 * 4), 16)
    rid, pages = reserve(keeper, hashes)
    cat = keeper.tier.catalogs["default"]
    gens = [int(cat.gen[p]) for p in pages]
    prod("write", pages, test_seed, int(500 * cycles_per_ms), "none")  # half a second of delay, then the copy
    os.kill(prod.proc.pid, signal.SIGKILL)  # mid-copy, before any commit
    assert keeper.client_gone(PRODUCER)  # its connection ended: quarantined until its process exits
    assert [int(cat.state[p]) for p in pages] == [PageState.RESERVED] * 4 or keeper.reap_exited() == [PRODUCER]
    assert keeper.tier.lookup("default", NS, hashes).miss.cause == MissCause.NEVER_PUBLISHED
    prod.proc.join(60)
    assert prod.proc.exitcode == -signal.SIGKILL
    keeper.reap_exited()
    assert keeper.tier.quarantined() == frozenset()
    assert [int(cat.state[p]) for p in pages] == [PageState.FREE] * 4
    assert [int(cat.gen[p]) for p in pages] == [g + 1 for g in gens]
    assert keeper.tier.lookup("default", NS, hashes).miss.cause == MissCause.NEVER_PUBLISHED


def test_pressure_demotes_device_pages_to_the_host_pool_with_their_gpu_digests(tmp_path, test_seed):
    from kvgate.harness.system.pool import thread_pool
    from kvpool.client.pool_client import PoolClient
    from kvpool.gpu.keeper import GpuKeeper, vmm_allocator
    from kvpool.gpu.tier import GpuTierConfig, fall_through
    from kvpool.pool.digest import DigestKind, page_digest

    run_dir = tmp_path / "small"
    run_dir.mkdir(mode=0o700)
    cfg = GpuTierConfig(page_size=PAGE, pages={"default": 8}, low_free=0.25, high_free=0.5)
    pool = thread_pool(page_size=PAGE, num_pages=16)
    host = PoolClient(f"unix:{pool.unix_path}", "default", "tok", name="keeper")
    try:
        with GpuKeeper(cfg, run_dir, vmm_allocator(0), clock=procs.ManualClock()) as small:
            prod = Replica(small)
            try:
                chain = block_hashes(range(test_seed % 2**30, test_seed % 2**30 + 16 * 8), 16)
                rid, pages = reserve(small, chain)
                sums = prod("write", pages, test_seed, 0, "host")  # kv-sketch-1 on the producer's GPU
                small.tier.commit(PRODUCER, "default", rid, sums)
            finally:
                prod.close()
            out = small.demote("default", host, 0.0)  # the keeper's own device-to-host reads
            assert out == {"demoted": 4, "kept": 0, "failed": 0}
            for h, want in zip(chain[:4], sums[:4]):  # the least recent: the first four committed
                lease = host.acquire(NS, [h])
                data = bytes(host.read_page(lease, 0))
                host.release(lease.lease_id)
                assert lease.hits[0].digest == want
                assert page_digest(data, DigestKind.SKETCH) == want  # the host's reference over the bytes moved
            def gpu(hs):  # noqa: E306
                f = small.tier.lookup("default", NS, hs)
                return len(f.hits), None if f.miss is None else f.miss.cause

            def pooled(hs):
                f = host.lookup(NS, hs)
                return len(f.hits), None if f.miss is None else f.miss.cause

            assert fall_through(chain, [("gpu", gpu), ("host", pooled)]).segments == (("host", 0, 4), ("gpu", 4, 8))
    finally:
        host.close()
        pool.stop_thread()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU: the peer path needs a second")
def test_a_replica_on_another_gpu_maps_the_buffer_and_copies_peer_to_peer(keeper, replicas, test_seed):
    prod, far = replicas(0), replicas(1)
    assert prod.same_gpu and not far.same_gpu
    pages = list(range(8))
    prod("fill", pages, test_seed)
    far("read", pages, 0, None, "host")
    assert far("check", test_seed) == 0
    seconds, nbytes = far("rate", list(range(PAGES)), 10)
    print(f"\ngpu tier, peer: {nbytes / 2**20:.0f} MiB from GPU 0's buffer into GPU 1 in {seconds * 1e3:.2f} ms "
          f"({nbytes / seconds / 1e9:.0f} GB/s)")
