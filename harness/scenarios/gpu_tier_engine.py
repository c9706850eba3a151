"""The GPU transfer engine through a GPU keeper's tier in device memory (`kvpool keeper --backing
vmm`; kvpool.gpu.tier_backend.TierBackend as the engine's pool), on a CUDA GPU: the scenarios of
suites/gpu/test_gpu_tier_engine.py. Each runs with the engine or with its negative control and
returns a Verdict from an oracle computed here, independently of the engine: blocks written and
read with `select` (kvgate.harness.scenarios.gpu_transfer), pages written into the tier and read
out of it through a session of its own (TierSide), page digests on the host.

  TierSide(run_dir, tenant, token, name, device)
        a session of the keeper in this process: its link (TierLink, mapped on `device`), its
        backend (TierBackend), `pages()` the whole tier as one uint8 tensor aliasing the current
        session's mapping (again after a restart).
      .publish(ns, hashes, pages) -> committed   reference pages written straight into the tier
        (not through the engine): reserve, copy, device sync, host kv-sketch-1 digests, commit.
      .read(ns, hashes) -> np.ndarray | None     the committed pages (lease, copy, sync, release);
        None if any is not committed. Only while no stream delay is pending (it syncs the device).
      .flip(ns, hashes, index, offset, mask)     one byte of a committed page XORed in the tier:
        the fault at rest (after the commit; the keeper does not scrub).
  TierOracle(run_dir, tenant, token, device)
        the tier as the byte-exact oracle reads a pool (`client(name)`: acquire, read_page,
        release; each page copied out of device memory under its lease): kvgate gpu-live's
        tier exchanges pass it as their pool.
  TierCommitTap(side, device, rows)
        the oracle at the keeper: every page's bytes and digest at the moment its commit is sent
        (after the engine decided the page is ready, before the keeper makes it visible), copied
        out of the tier on a stream of its own (it waits for none of the engine's streams), through
        the engine's commit lane (kvgate.faults.gpu_controls.CommitLane).
  TierScenario     one per ordering edge the tier's store and load rely on: store_after_write,
        commit_after_copy (stores), load_after_read, read_after_load (loads).
  run_scenario(scenario, geom, make_engine, producer, consumer, ns, seed, delay_cycles, drop) -> Verdict
        COPIES transfers of BLOCKS blocks under the stream delay, with the engine (drop False)
        or the control that drops the scenario's edge (make_engine(layers, backend, lanes, drop)).
        Stores: the producer's engine stores, judged at the tap (byte-exact, each page under its
        block's digest) and then loaded by an engine of the consumer's session, byte-exact.
        Loads: the producer publishes the pages straight into the tier; the consumer's engine
        loads them, judged block by block.
  run_corrupt_page(geom, engine_cls, producer, consumer, ns, seed, path) -> Verdict
        a committed page flipped in the tier: the load stops there as corrupt, the pages before
        it byte-exact, the flipped one never installed.
  run_check_after_copy(geom, engine_cls, producer, consumer, ns, seed, delay_cycles) -> Verdict
        the load's copy (the fused copy and sketch of device pages) held back: the check waits for
        it; with CHECK_AFTER_COPY dropped it reads another chunk's sketches.
  run_release_held(geom, engine_cls, producer, consumer, ns, seed, delay_cycles, path) -> Verdict
        the load's lease held at the keeper (gpu_tier_leased_pages) while its installs run.
  run_restart(geom, engine_cls, producer, consumer, ns, seed, delay_cycles, restart, path) -> Verdict
        the keeper killed and started again (`restart()`) under a live engine, with a store's
        copies into the old buffer held back across it and a lease of the old instance open:
        the store never becomes visible (its commit meets the dead keeper, or is refused as
        WrongInstance once the link follows the new one), the first load
        after the restart is a transport_error (its acquire met the new instance), the next one
        moves the engine to the new session's mapping and loads byte-exact, a store after it
        lands byte-exact in the new buffer, the old mapping is dropped once its grants ended,
        and the device never faults.

What is not checked: interleavings other than the one each delay forces; two processes (both
sessions are in this one: their mappings and streams are apart, their CUDA context is one; the
cross-process edges are suites/gpu/test_gpu_tier.py's); a keeper on another GPU.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvgate.faults.gpu_controls import CommitLane, delay_stream
from kvgate.harness.checkers.verdict import Verdict
from kvgate.harness.scenarios.gpu_transfer import (
    Geometry,
    fill,
    make_kv,
    read_blocks,
    read_pages,
    read_scratch,
    write_blocks,
)
from kvpool.errors import LeaseLost, MissCause
from kvpool.gpu.config import CopyPath, OrderingEdge, PageMemory
from kvpool.gpu.tier_backend import TierBackend
from kvpool.gpu.tier_client import TierLink
from kvpool.gpu.transfer import TransferEngine
from kvpool.pool.digest import DigestKind, page_digest
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.records import SlotStatus

BLOCKS = 8  # per transfer: two chunks of the matrix geometry's 4 pages
COPIES = 2
DRAIN_S = 60.0
NOT_CHECKED = ("interleavings other than the one the delay forces; two processes (both sessions are in this "
               "one); a keeper on another GPU")

EngineFactory = Callable[[list[torch.Tensor], TierBackend, list, OrderingEdge | None], TransferEngine]


# -- a session of the keeper ------------------------------------------------------------------------


class TierSide:
    def __init__(self, run_dir: str | Path, tenant: str, token: str, name: str, device: torch.device):
        self.device = device
        self.link = TierLink(run_dir, tenant, token, name=name, timeout_s=30.0, stale_after_s=30.0,
                             device_index=device.index if device.index is not None else 0).connect()
        self.backend = TierBackend(self.link)
        self._pages: tuple[bytes, torch.Tensor] | None = None

    def pages(self) -> torch.Tensor:
        """The whole tier of the link's current session, aliased (no copy)."""
        arena = self.backend.arena
        if arena is None or arena.device_pages is None:
            raise AssertionError(f"the session maps no device pages: {arena}")
        if self._pages is None or self._pages[0] != arena.instance:
            t = torch.as_tensor(arena.device_pages)
            if t.data_ptr() != arena.device_pages.ptr or t.device != self.device:
                raise AssertionError("torch did not alias the tier's pages on this device")
            self._pages = (arena.instance, t)
        return self._pages[1]

    def _page(self, page: int, nbytes: int) -> torch.Tensor:
        size = self.backend.arena.page_size
        return self.pages()[page * size : page * size + nbytes]

    def publish(self, ns: Namespace, hashes: list[bytes], pages: np.ndarray) -> int:
        n, pb = pages.shape
        res = self.link.reserve(ns, hashes, [pb] * n)  # after a restart, in the new instance (the link follows)
        if not res.reservation_id or any(s.status != SlotStatus.RESERVED for s in res.result.slots):
            if res.reservation_id:
                self.link.abort(res)
            return 0
        src = torch.from_numpy(pages).to(self.device)
        for slot, row in zip(res.result.slots, src):
            self._page(slot.page, pb).copy_(row)
        torch.cuda.synchronize(self.device)  # the commit edge: the host saw the copies complete
        return self.link.commit(res, [page_digest(p, DigestKind.SKETCH) for p in pages]).committed

    def read(self, ns: Namespace, hashes: list[bytes], page_bytes: int) -> np.ndarray | None:
        lease = self.link.acquire(ns, hashes)
        try:
            if len(lease.result.hits) != len(hashes):
                return None
            out = torch.stack([self._page(ref.page, page_bytes).clone() for ref in lease.result.hits])
            torch.cuda.synchronize(self.device)  # the release edge: the copies out completed
            return out.cpu().numpy()
        finally:
            if lease.lease_id:
                self.link.release(lease)

    def flip(self, ns: Namespace, hashes: list[bytes], index: int, offset: int, mask: int) -> None:
        lease = self.link.acquire(ns, hashes)
        try:
            self._page(lease.result.hits[index].page, offset + 1)[offset:].bitwise_xor_(mask)
            torch.cuda.synchronize(self.device)
        finally:
            self.link.release(lease)

    def close(self) -> None:
        self._pages = None
        self.backend.close()


class TierOracle:
    """The keeper's tier as the byte-exact oracle reads a pool (kvgate.harness.checkers.byte_exact.
    pool_digests: `client(name)` -> acquire, read_page, release): a session of its own per client,
    each committed page copied out of device memory to the host under its lease (the copy
    completes before the release), so the digest is of the tier's bytes, not of the digest the
    keeper recorded at commit."""

    def __init__(self, run_dir: str | Path, tenant: str, token: str, device: torch.device):
        self.run_dir, self.tenant, self.token, self.device = Path(run_dir), tenant, token, device

    @contextlib.contextmanager
    def client(self, name: str = "oracle"):  # noqa: ANN201 - a _TierReader
        side = TierSide(self.run_dir, self.tenant, self.token, name, self.device)
        try:
            yield _TierReader(side)
        finally:
            side.close()


class _TierReader:
    def __init__(self, side: TierSide):
        self.side = side

    def acquire(self, ns: Namespace, hashes: list[bytes]):  # noqa: ANN201 - an AcquireResult
        return self.side.backend.acquire(ns, hashes)

    def read_page(self, lease, index: int) -> np.ndarray:  # noqa: ANN001 - an AcquireResult
        ref = lease.hits[index]
        return self.side._page(ref.page, ref.length).cpu().numpy()  # .cpu(): the copy out completed

    def release(self, lease_id: int):  # noqa: ANN201
        return self.side.backend.release(lease_id)


# -- the oracle at the keeper -----------------------------------------------------------------------


class TierCommitTap:
    """{hash: (bytes, digest)} of every page committed through the tap's lane, read out of the tier
    when its commit is sent, on a stream of the tap's own (nothing orders it after the engine's)."""

    def __init__(self, side: TierSide, rows: int, page_bytes: int):
        self.side = side
        self.pages: dict[bytes, tuple[np.ndarray, bytes]] = {}
        self._lock = threading.Lock()
        self._pb = page_bytes
        with torch.cuda.device(side.device):  # allocated now: nothing is allocated while a stream is held back
            self._stream = torch.cuda.Stream(side.device)
            self._host = torch.empty((rows, page_bytes), dtype=torch.uint8, pin_memory=True)
        side.pages()

    def _on_commit(self, c, pages, digests, kind):  # noqa: ANN001, ANN202
        seen: dict[bytes, tuple[np.ndarray, bytes]] = {}
        with self._lock, torch.cuda.device(self.side.device), torch.cuda.stream(self._stream):
            for row, (h, page, n) in enumerate(pages):
                self._host[row, :n].copy_(self.side._page(page, n), non_blocking=True)  # noqa: SLF001
            self._stream.synchronize()  # this stream only: the engine's streams may still be held back
            for row, ((h, _, n), d) in enumerate(zip(pages, digests)):
                seen[h] = (self._host[row, :n].numpy().copy(), d)
            self.pages.update(seen)
        return digests

    def lane(self) -> CommitLane:
        return CommitLane(self.side.backend, self._on_commit)


# -- the scenarios ----------------------------------------------------------------------------------


class TierScenario(enum.StrEnum):
    STORE_AFTER_WRITE = "store_after_write"  # the engine's KV write delayed; the store must copy what it wrote
    COMMIT_AFTER_COPY = "commit_after_copy"  # the store's copy into the tier (and its sketch) delayed
    LOAD_AFTER_READ = "load_after_read"  # the engine's read of the old blocks delayed; then the load
    READ_AFTER_LOAD = "read_after_load"  # the load's installs delayed; the engine reads right after

    @property
    def edge(self) -> OrderingEdge:
        return OrderingEdge(self.value)

    @property
    def stores(self) -> bool:
        return self in (TierScenario.STORE_AFTER_WRITE, TierScenario.COMMIT_AFTER_COPY)


def _stale(got: list[np.ndarray], want: list[np.ndarray]) -> int:
    return sum(int(np.count_nonzero((g != w).any(axis=1))) for g, w in zip(got, want))


def run_scenario(scenario: TierScenario, geom: Geometry, make_engine: EngineFactory, producer: TierSide,
                 consumer: TierSide, ns: Namespace, seed: int, delay_cycles: int, drop: bool) -> Verdict:
    rng = np.random.default_rng([seed, int(drop), list(TierScenario).index(scenario)])
    device, d, pb, k = producer.device, geom.block_dim, geom.page_bytes, BLOCKS
    layers = make_kv(geom, device)
    old = fill(layers, d, rng, pb)
    order = [int(b) for b in rng.permutation(geom.num_blocks)]
    sels = [order[i * k : (i + 1) * k] for i in range(COPIES)]  # block ids in no particular order
    warm = [order[COPIES * k]]
    new = [rng.integers(0, 256, (k, pb), dtype=np.uint8) for _ in range(COPIES)]
    base = int(rng.integers(1 << 28))
    hashes = [block_hashes(range(base + i * 10_000, base + i * 10_000 + 16 * k), 16) for i in range(COPIES)]
    warm_hashes = block_hashes(range(base + 9_000_000, base + 9_000_016), 16)
    # everything the delayed part touches is allocated now (an allocation while a stream is held
    # back can serialize the streams and hide the race under test)
    new_dev = [torch.from_numpy(p).to(device) for p in new]
    idx = [torch.tensor(s, dtype=torch.int64, device=device) for s in sels]
    seen_buf = [torch.empty((k, pb), dtype=torch.uint8, device=device) for _ in range(COPIES)]
    scratch = read_scratch(layers, d, k)
    warm_idx = torch.tensor(warm, dtype=torch.int64, device=device)
    tap = TierCommitTap(producer, COPIES * k + 1, pb)
    side = producer if scenario.stores else consumer
    lanes = [tap.lane()] if scenario.stores else [side.backend]
    if not scenario.stores:
        for h, p in zip(hashes, new):
            got = producer.publish(ns, h, p)
            if got != k:
                return Verdict(None, f"could not publish the reference pages: {got} of {k} committed")
    engine = make_engine(layers, side.backend, lanes, scenario.edge if drop else None)
    evidence: dict = {"scenario": scenario.value, "control": drop, "delay_cycles": delay_cycles,
                      "path": engine.capabilities.path.value, "pages_memory": engine.capabilities.pages.value,
                      "fused_copy": engine._fused_copy(), "direct_install": engine._direct_install(),
                      "sketch_impl": engine.capabilities.sketch_impl}
    try:
        torch.cuda.synchronize()
        # warm-up, synchronized: every kernel and copy runs once before any delay
        warm_out = read_blocks(layers, d, warm_idx, seen_buf[0], read_scratch(layers, d, 1))
        write_blocks(layers, d, warm_idx, warm_out)
        torch.cuda.synchronize()
        engine.store(warm, warm_hashes)
        torch.cuda.synchronize()
        engine.drain(DRAIN_S)
        h = engine.load(warm, warm_hashes)
        engine.wait_for_load(h)
        torch.cuda.synchronize()
        engine.drain(DRAIN_S)
        tap.pages.clear()
        stream = torch.cuda.current_stream()
        seen: list[torch.Tensor] = []
        if scenario is TierScenario.STORE_AFTER_WRITE:
            for i in range(COPIES):
                delay_stream(stream, delay_cycles)
                write_blocks(layers, d, idx[i], new_dev[i])
                engine.store(sels[i], hashes[i])
            torch.cuda.synchronize()
            outcomes = engine.drain(DRAIN_S)
            want = new
        elif scenario is TierScenario.COMMIT_AFTER_COPY:
            engine.sketch_delay_cycles = delay_cycles  # each sketch's copy to the host is late too
            for i in range(COPIES):
                delay_stream(engine.store_stream, delay_cycles)
                engine.store(sels[i], hashes[i])
            outcomes = engine.drain(DRAIN_S)  # no device sync first: each commit must wait for its own copies
            torch.cuda.synchronize()
            want = [old[s] for s in sels]
        elif scenario is TierScenario.LOAD_AFTER_READ:
            for i in range(COPIES):
                delay_stream(stream, delay_cycles)
                seen.append(read_blocks(layers, d, idx[i], seen_buf[i], scratch))  # the old blocks, late
                h = engine.load(sels[i], hashes[i])
                if h.loaded != k:
                    return Verdict(False, f"load {i} installed {h.loaded} of {k} blocks: {h}", evidence)
                engine.wait_for_load(h)
            torch.cuda.synchronize()
            engine.drain(DRAIN_S)
            got = [s.cpu().numpy() for s in seen] + [read_pages(layers, d, s).cpu().numpy() for s in sels]
            want = [old[s] for s in sels] + new
        else:  # READ_AFTER_LOAD
            for i in range(COPIES):
                delay_stream(engine.load_write_stream(DigestKind.SKETCH), delay_cycles)  # the installs are late
                h = engine.load(sels[i], hashes[i])
                if h.loaded != k:
                    return Verdict(False, f"load {i} installed {h.loaded} of {k} blocks: {h}", evidence)
                engine.wait_for_load(h)
                seen.append(read_blocks(layers, d, idx[i], seen_buf[i], scratch))
            torch.cuda.synchronize()
            engine.drain(DRAIN_S)
            got, want = [s.cpu().numpy() for s in seen], new
    finally:
        evidence["dropped_edges"] = getattr(engine, "dropped", 0)
        engine.close()
    if not scenario.stores:
        stale = _stale(got, want)
        evidence.update(pages=sum(len(w) for w in want), stale_pages=stale)
        if stale:
            return Verdict(False, f"{stale} of {evidence['pages']} blocks held other bytes", evidence, NOT_CHECKED)
        return Verdict(True, "every block byte-exact under the stream delay", evidence, NOT_CHECKED)
    return _judge_store(geom, make_engine, consumer, ns, tap, outcomes, hashes, want, evidence)


def _judge_store(geom: Geometry, make_engine: EngineFactory, consumer: TierSide, ns: Namespace,
                 tap: TierCommitTap, outcomes: list, hashes: list[list[bytes]], want: list[np.ndarray],
                 evidence: dict) -> Verdict:
    """Every stored page at its commit (the tap): its block's bytes, under its block's digest;
    then every stored block loaded by another session's engine, byte-exact."""
    total = sum(len(w) for w in want)
    committed = sum(o.committed for o in outcomes)
    stale = mismatched = missing = 0
    for hs, w in zip(hashes, want):
        for h, page in zip(hs, w):
            seen = tap.pages.get(h)
            if seen is None:
                missing += 1
                continue
            if not np.array_equal(seen[0], page):
                stale += 1
            if seen[1] != page_digest(page, DigestKind.SKETCH):
                mismatched += 1
    evidence.update(pages=total, committed=committed, stale_pages=stale, digest_mismatches=mismatched,
                    not_committed=missing)
    if stale or mismatched:
        return Verdict(False, f"at their commit {stale} of {total} pages held other bytes than their blocks and "
                       f"{mismatched} carried another digest", evidence, NOT_CHECKED)
    if missing or committed != total:
        return Verdict(False, f"{committed} of {total} stored blocks committed ({missing} never sent to commit): "
                       f"{outcomes}", evidence, NOT_CHECKED)
    # the consumer's engine (another session, another mapping of the buffer) loads them
    layers = make_kv(geom, consumer.device)
    engine = make_engine(layers, consumer.backend, [consumer.backend], None)
    try:
        blocks = list(range(len(want[0])))
        got = []
        for hs in hashes:
            h = engine.load(blocks, hs)
            if h.loaded != len(hs):
                evidence["consumer_load"] = repr(h)
                return Verdict(False, f"the consumer's load installed {h.loaded} of {len(hs)} stored blocks: {h}",
                               evidence, NOT_CHECKED)
            engine.wait_for_load(h)
            got.append(read_pages(layers, geom.block_dim, blocks).cpu().numpy())
        engine.drain(DRAIN_S)
    finally:
        engine.close()
    loaded_stale = _stale(got, want)
    evidence["consumer_stale_pages"] = loaded_stale
    if loaded_stale:
        return Verdict(False, f"the consumer loaded {loaded_stale} of {total} stored blocks with other bytes",
                       evidence, NOT_CHECKED)
    return Verdict(True, "every page byte-exact under its block's digest at its commit, and loaded byte-exact by "
                   "another session", evidence, NOT_CHECKED)


def run_corrupt_page(geom: Geometry, engine_cls: type[TransferEngine], producer: TierSide, consumer: TierSide,
                     ns: Namespace, seed: int, path: CopyPath, install_direct: bool = False) -> Verdict:
    """A committed page's byte flipped in the tier: the load must stop there (corrupt), install
    the pages before it byte-exact and leave the flipped one's block as it was (where chunks
    are staged; with the direct install the blocks of the flipped page and those after it
    hold what arrived, reported failed: counted, not judged)."""
    rng = np.random.default_rng([seed, 17])
    device, d, pb, k = consumer.device, geom.block_dim, geom.page_bytes, BLOCKS
    pages = rng.integers(0, 256, (k, pb), dtype=np.uint8)
    base = int(rng.integers(1 << 28))
    hashes = block_hashes(range(base, base + 16 * k), 16)
    if producer.publish(ns, hashes, pages) != k:
        return Verdict(None, "could not publish the reference pages")
    bad = int(rng.integers(1, k - 1))
    producer.flip(ns, hashes, bad, int(rng.integers(pb)), int(rng.integers(1, 256)))
    layers = make_kv(geom, device)
    old = fill(layers, d, rng, pb)
    blocks = [int(b) for b in rng.permutation(geom.num_blocks)[:k]]
    torch.cuda.synchronize()
    with engine_cls(consumer.backend, ns, layers, geom.config(path, install_direct=install_direct)) as engine:
        h = engine.load(blocks, hashes)
        direct = engine.direct_loads > 0  # the contract depends on the path this load took
        engine.wait_for_load(h)
        got = read_pages(layers, d, blocks).cpu().numpy()
        engine.drain(DRAIN_S)
    n = h.loaded
    stale = int(np.count_nonzero((got[:n] != pages[:n]).any(axis=1)))  # installed, yet not the committed page
    written = int(np.count_nonzero((got[n:] != old[blocks[n:]]).any(axis=1)))  # reported failed, yet written
    touched = 0 if direct else written
    ev = {"flipped_index": bad, "loaded": n, "miss": str(h.miss), "stale_pages": stale + touched,
          "direct_install": direct, "failed_blocks_written": written, "engine": engine_cls.__name__,
          "path": path.value}
    if stale or touched:
        return Verdict(False, f"{stale} blocks reported loaded hold other bytes than the committed pages, {touched} "
                       f"blocks not loaded were written", ev, NOT_CHECKED)
    if (n, h.miss and h.miss.cause) != (bad, MissCause.CORRUPT):
        return Verdict(False, f"the load stopped at {n} ({h.miss}), not at the flipped page {bad} as corrupt", ev,
                       NOT_CHECKED)
    return Verdict(True, "the pages before the flipped one installed byte-exact, the flipped one refused", ev,
                   NOT_CHECKED)


def run_check_after_copy(geom: Geometry, engine_cls: type[TransferEngine], producer: TierSide,
                         consumer: TierSide, ns: Namespace, seed: int, delay_cycles: int, install_direct: bool = False,
                         **engine_kw) -> Verdict:
    """The load's copy held back on the GPU (the fused copy and sketch of device pages, on the copy
    stream): the check must read the sketches the copy wrote, so every block is installed
    byte-exact. With CHECK_AFTER_COPY dropped the host compares the sketches a buffer held
    before (another chunk's): the byte-exact oracle sees blocks that are not the committed pages
    or are not reported loaded (refused intact, installed wrong, or not installed)."""
    rng = np.random.default_rng([seed, 29])
    device, d, pb = consumer.device, geom.block_dim, geom.page_bytes
    k = geom.num_blocks // 2
    pages = rng.integers(0, 256, (2 * k, pb), dtype=np.uint8)
    base = int(rng.integers(1 << 28))
    hashes = block_hashes(range(base, base + 16 * 2 * k), 16)
    if producer.publish(ns, hashes, pages) != 2 * k:
        return Verdict(None, "could not publish the reference pages")
    layers = make_kv(geom, device)
    fill(layers, d, rng, pb)
    torch.cuda.synchronize()
    with engine_cls(consumer.backend, ns, layers, geom.config(CopyPath.TORCH, install_direct=install_direct),
                    **engine_kw) as engine:
        fused = engine._fused_copy()  # noqa: SLF001 - the path under test
        h = engine.load(list(range(k)), hashes[:k])  # the first half: every staging buffer used once
        engine.wait_for_load(h)
        torch.cuda.synchronize()
        engine.drain(DRAIN_S)
        delay_stream(engine.load_stream, delay_cycles)
        h = engine.load(list(range(k, 2 * k)), hashes[k:])
        engine.wait_for_load(h)
        torch.cuda.synchronize()
        got = read_pages(layers, d, list(range(k, 2 * k))).cpu().numpy()
        engine.drain(DRAIN_S)
        direct = engine.direct_loads  # both loads took the direct install, or none
    # a block the engine does not hold verified committed bytes for: not the committed page, or
    # not reported loaded (with the direct install a refused block may hold the right bytes)
    wrong = (got != pages[k:]).any(axis=1)
    wrong[h.loaded:] = True
    stale = int(np.count_nonzero(wrong))
    ev = {"fused_copy": fused, "direct_install": direct, "loaded": h.loaded, "of": k, "miss": str(h.miss), "stale_pages": stale,
          "dropped_edges": getattr(engine, "dropped", 0), "engine": engine_cls.__name__}
    if stale:
        return Verdict(False, f"{stale} of {k} blocks are not the committed pages ({h.loaded} installed)", ev,
                       NOT_CHECKED)
    return Verdict(True, "every block installed byte-exact with the copy held back", ev, NOT_CHECKED)


def run_release_held(geom: Geometry, engine_cls: type[TransferEngine], producer: TierSide, consumer: TierSide,
                     ns: Namespace, seed: int, delay_cycles: int, path: CopyPath) -> Verdict:
    """The load's installs held back on the GPU: while they run its pages stay leased at the keeper
    (the release comes after the host saw them complete), and none once they completed."""
    rng = np.random.default_rng([seed, 23])
    k, pb = BLOCKS, geom.page_bytes
    pages = rng.integers(0, 256, (k, pb), dtype=np.uint8)
    base = int(rng.integers(1 << 28))
    hashes = block_hashes(range(base, base + 16 * k), 16)
    if producer.publish(ns, hashes, pages) != k:
        return Verdict(None, "could not publish the reference pages")
    layers = make_kv(geom, consumer.device)
    torch.cuda.synchronize()
    with engine_cls(consumer.backend, ns, layers, geom.config(path)) as engine:
        engine.load(list(range(k)), hashes)  # warm-up: a first load may allocate (and synchronize)
        engine.drain(DRAIN_S)
        before = consumer.link.stats()["gpu_tier_leased_pages"]
        delay_stream(engine.load_write_stream(), 5 * delay_cycles)
        h = engine.load(list(range(k)), hashes)
        time.sleep(0.05)  # a release that does not wait has long run by now
        in_flight = not h._done.query()  # noqa: SLF001
        leased = consumer.link.stats()["gpu_tier_leased_pages"] - before
        (outcome,) = engine.drain(DRAIN_S)
    after = consumer.link.stats()["gpu_tier_leased_pages"] - before
    ev = {"in_flight": in_flight, "leased_while_in_flight": leased, "leased_after": after, "loaded": h.loaded,
          "outcome_loaded": outcome.loaded, "engine": engine_cls.__name__, "path": path.value}
    if not in_flight:
        return Verdict(None, "the load's work finished before the check: the delay proved nothing", ev)
    if h.loaded != k or outcome.loaded != k:
        return Verdict(False, f"the load installed {h.loaded} ({outcome.loaded} at its release) of {k}", ev)
    if leased < k:
        return Verdict(False, f"{k - leased} of {k} pages were not leased while the load's installs ran", ev)
    if after:
        return Verdict(False, f"{after} pages still leased after the load completed", ev)
    return Verdict(True, "the load's pages stayed leased at the keeper while its work ran, and were released after",
                   ev)


def run_restart(geom: Geometry, engine_cls: type[TransferEngine], producer: TierSide, consumer: TierSide,
                ns: Namespace, seed: int, delay_cycles: int, restart: Callable[[], None], path: CopyPath) -> Verdict:
    """The keeper restarted under a live engine (see the module's docstring). The control
    (StuckSegmentEngine: it never moves to the new session's mapping) copies through the old
    mapping, which a lease of the old instance keeps mapped while it runs (no unmapped range is
    ever touched): its loads are refused as corrupt and its store lands in the old buffer, which
    the byte-exact oracle sees in the new one."""
    rng = np.random.default_rng([seed, 29])
    device, d, pb, k = consumer.device, geom.block_dim, geom.page_bytes, BLOCKS
    layers = make_kv(geom, device)
    old = fill(layers, d, rng, pb)
    order = [int(b) for b in rng.permutation(geom.num_blocks)]
    blocks_a, blocks_s, blocks_b, blocks_t = (order[i * k : (i + 1) * k] for i in range(4))
    pages_a, pages_b = (rng.integers(0, 256, (k, pb), dtype=np.uint8) for _ in range(2))
    base = int(rng.integers(1 << 28))
    h_a, h_s, h_b, h_t = (block_hashes(range(base + i * 10_000, base + i * 10_000 + 16 * k), 16) for i in range(4))
    if producer.publish(ns, h_a, pages_a) != k:
        return Verdict(None, "could not publish the reference pages in the first instance")
    ev: dict = {"engine": engine_cls.__name__, "path": path.value}
    held = None
    engine = engine_cls(consumer.backend, ns, layers, geom.config(path))
    try:
        h = engine.load(blocks_a, h_a)
        engine.wait_for_load(h)
        got_a = read_pages(layers, d, blocks_a).cpu().numpy()
        engine.drain(DRAIN_S)
        if h.loaded != k or _stale([got_a], [pages_a]):
            return Verdict(None, f"the load before the restart was not byte-exact ({h}): nothing to follow", ev)
        held = consumer.backend.acquire(ns, h_a)  # keeps the consumer's first mapping while it is open
        delay_stream(engine.store_stream, delay_cycles)  # the store's copies into the old buffer, held back
        across = engine.store(blocks_s, h_s)
        restart()
        if producer.publish(ns, h_b, pages_b) != k:
            return Verdict(None, "could not publish the reference pages in the second instance", ev)
        first = engine.load(blocks_b, h_b)  # its acquire reconnects the link
        engine.wait_for_load(first)
        second = engine.load(blocks_b, h_b)
        engine.wait_for_load(second)
        got_b = read_pages(layers, d, blocks_b).cpu().numpy()
        after = engine.store(blocks_t, h_t)
        engine.drain(DRAIN_S)  # (the move to the new mapping drained what was in flight before it)
        store_s, store_t = across.result.result(), after.result.result()
        loads = [first.result.result(), second.result.result()]
        torch.cuda.synchronize()  # a copy through an unmapped range would have faulted the context by now
        ev.update(reattached=engine.reattached, pages_memory=engine.capabilities.pages.value)
    finally:
        engine.close()
        if held is not None and held.lease_id:
            try:
                consumer.backend.release(held.lease_id)
            except LeaseLost:  # WrongInstance: the old instance's lease, ended here (its mapping goes with it)
                pass
    got_t = producer.read(ns, h_t, pb)
    stale = _stale([got_b], [pages_b]) + (k if got_t is None else _stale([got_t], [old[blocks_t]]))
    ev.update(first=repr(first), second=repr(second), store_across=repr(store_s), store_after=repr(store_t),
              loads=[repr(o) for o in loads], visible_across=len(producer.link.lookup(ns, h_s).hits),
              retired=consumer.link.retired, stale_pages=stale)
    if stale:
        return Verdict(False, f"{stale} of {2 * k} pages after the restart held other bytes (the loaded blocks, the "
                       "stored pages in the new buffer)", ev, NOT_CHECKED)
    problems = []
    if (first.loaded, first.miss and first.miss.cause) != (0, MissCause.TRANSPORT_ERROR):
        problems.append(f"the load that met the restart: {first}")
    if second.loaded != k or second.miss is not None or loads[1].loaded != k:
        problems.append(f"the load after it: {second}, at its release {loads[1]}")
    if store_s.committed or not store_s.errors:  # its commit met the dead keeper (TransportError) or the new one
        problems.append(f"the store across the restart: {store_s}")  # (WrongInstance): never visible either way
    if ev["visible_across"]:
        problems.append(f"{ev['visible_across']} blocks of the store across the restart visible in the new instance")
    if store_t.committed != k:
        problems.append(f"the store after the restart: {store_t}")
    if (ev["reattached"], ev["pages_memory"], ev["retired"]) != (1, PageMemory.DEVICE.value, 0):
        problems.append(f"reattached {ev['reattached']}, pages {ev['pages_memory']}, retired mappings {ev['retired']}")
    if problems:
        return Verdict(False, "; ".join(problems), ev, NOT_CHECKED)
    return Verdict(True, "the engine followed the restarted keeper: the old grants refused, the new mapping "
                   "byte-exact both ways, the old one dropped after its grants, no fault", ev, NOT_CHECKED)
