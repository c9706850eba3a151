"""The runner of the matrix of copy paths against ordering edges (the cells:
kvgate.harness.scenarios.gpu_cells; the registry: kvpool.gpu.paths), on a CUDA GPU.

  MATRIX                the geometry every cell runs on: vLLM's blocks-first layout (CUDA
                        graphs apply), 16 KiB pages, chunks of 4 pages, commit units of 3,
                        two commit lanes; BLOCKS blocks per transfer (two whole chunks).
  run_cell(cell, ..., drop)  -> Verdict   one run of a cell: the engine of the cell's path
                        (drop False) or its control (the same engine dropping the cell's
                        edge), every transfer under the seeded stream delay. Its evidence:
                        the oracle's counts (stale_pages, digest_mismatches,
                        evicted_while_in_flight), dropped_edges, the edges the engine
                        issued on the cell's direction, the engine's capabilities.
  check_cell(cell, ...) -> (ordered, control | None)   runs both and asserts the cell:
                        the engine byte-exact and every edge of the path issued (no more);
                        the control caught (a control that raised or timed out is not a
                        catch), or for a host-ordered cell still byte-exact.
  probe_premises(cycles_per_ms) -> {(Premise, CopyPath): (holds, evidence)}
                        what this host's CUDA does with copies to and from pageable memory
                        behind a stream delay, per copy path (torch tensor copies, driver
                        calls), with pages of the matrix's size.
  CommitTap             the oracle at the pool: every page's bytes and digest the moment its
                        commit is sent (before the pool makes it visible), through the
                        engine's commit lanes (kvgate.faults.gpu_controls.CommitLane).

What is not checked: interleavings other than the one each delay forces (a seed draws the
delay's length and the blocks, and cannot force a thread or stream interleaving).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from kvgate.faults.gpu_controls import CONTROLS, CommitLane, delay_stream, engine_class
from kvgate.harness.checkers.verdict import Verdict
from kvgate.harness.scenarios.gpu_cells import Cell, Expect
from kvgate.harness.scenarios.gpu_transfer import (
    GEOMETRIES,
    fill,
    make_kv,
    read_blocks,
    read_pages,
    read_scratch,
    write_blocks,
)
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import publish
from kvpool.errors import MissCause, PoolError
from kvpool.gpu.config import CopyPath, HostMemory, OrderingEdge
from kvpool.gpu.driver import Driver
from kvpool.gpu.paths import EDGES, Direction, Issue, Premise
from kvpool.gpu.transfer import TransferEngine
from kvpool.pool.digest import DigestKind, page_digest
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.records import EvictOutcome

MATRIX = GEOMETRIES["nfirst-16k"]
BLOCKS = 8  # two whole chunks of 4 pages: the graphs replay, a second transfer reuses staging buffers
COPIES = 2
DRAIN_S = 60.0
NOT_CHECKED = "interleavings other than the one the delay forces"


# -- the oracle at the pool -------------------------------------------------------------------------


class CommitTap:
    """{hash: (bytes, digest, kind)} of every page committed through the wrapped lanes, read
    from the arena when its commit is sent (after the engine decided the page is ready,
    before the pool makes it visible)."""

    def __init__(self) -> None:
        self.pages: dict[bytes, tuple[np.ndarray, bytes, DigestKind]] = {}
        self._lock = threading.Lock()

    def _on_commit(self, c, pages, digests, kind):  # noqa: ANN001, ANN202
        seen = {h: (np.array(c.arena.page(page, n)), d, DigestKind(kind)) for (h, page, n), d in zip(pages, digests)}
        with self._lock:
            self.pages.update(seen)
        return digests

    def lanes(self, lanes: list[PoolClient]) -> list[CommitLane]:
        return [CommitLane(c, self._on_commit) for c in lanes]


class _Recording(TransferEngine):
    """Records every ordering edge the engine issues (before any control drops it)."""

    def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003
        self.issued: set[OrderingEdge] = set()
        self._issued_lock = threading.Lock()  # host waits are issued on worker threads too
        super().__init__(*args, **kwargs)

    def _record(self, edge: OrderingEdge) -> None:
        with self._issued_lock:
            self.issued.add(edge)

    def _order(self, edge, stream, event):  # noqa: ANN001, ANN202
        self._record(edge)
        return super()._order(edge, stream, event)

    def _await_copy(self, edge, event, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        self._record(edge)
        return super()._await_copy(edge, event, *args, **kw)


_RECORDING: dict[type, type] = {}


def _recording(cls: type[TransferEngine]) -> type[TransferEngine]:
    if cls not in _RECORDING:
        _RECORDING[cls] = type(f"Recording{cls.__name__}", (_Recording, cls), {})
    return _RECORDING[cls]


# -- one run of a cell --------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    cell: Cell
    drop: bool
    client: PoolClient
    ns: Namespace
    delay: int  # cycles of torch.cuda._sleep
    rng: np.random.Generator
    device: torch.device
    layers: list[torch.Tensor]
    old: np.ndarray  # every block's bytes before the transfers (num_blocks, page_bytes)
    sels: list[list[int]]  # the block ids of each transfer
    idx: list[torch.Tensor]
    new: list[np.ndarray]  # the bytes each transfer writes (stores: into the blocks; loads: the pages)
    new_dev: list[torch.Tensor]
    hashes: list[list[bytes]]
    seen_buf: list[torch.Tensor]
    scratch: list[torch.Tensor]
    tap: CommitTap
    engine: TransferEngine

    @property
    def kind(self) -> DigestKind:
        return self.cell.path.digest

    @property
    def k(self) -> int:
        return BLOCKS

    def evidence(self, **counts: object) -> dict:
        caps = self.engine.capabilities
        direction = self.cell.path.direction
        issued = sorted(e.value for e in self.engine.issued if EDGES[e].direction is direction)
        return {"cell": self.cell.id, "control": self.drop, "delay_cycles": self.delay,
                "dropped_edges": getattr(self.engine, "dropped", 0), "issued_edges": issued,
                "host_memory": caps.host_memory.value, "batched": caps.batched_copies, "graphs": caps.graphs,
                **counts}


def _took_path(run: Run) -> str:
    """Why the engine did not take the cell's path ("" if it did)."""
    path, caps = run.cell.path, run.engine.capabilities
    if caps.host_memory != path.host:
        return f"host memory {caps.host_memory.value} ({caps.host_memory_reason})"
    if path.engine is CopyPath.DRIVER and caps.batched_copies != (path.issue is Issue.BATCHED):
        return f"batched copies {caps.batched_copies} ({caps.batched_reason})"
    if path.engine is CopyPath.TORCH:
        want = "gather" if path.direction is Direction.STORE else "scatter"
        if (want in caps.graphs.split(",")) != (path.issue is Issue.GRAPHS):
            return f"CUDA graphs {caps.graphs!r}"
    return ""


def _engine(cell: Cell, drop: bool, client: PoolClient, lanes: list, ns: Namespace,
            layers: list[torch.Tensor]) -> TransferEngine:
    path = cell.path
    if drop:
        base = CONTROLS[cell.control]
    else:
        base = CONTROLS["refused_registration"] if path.host is HostMemory.PAGEABLE else TransferEngine
    cls = engine_class(base, sketch_delay=cell.edge is OrderingEdge.COMMIT_AFTER_COPY
                       and path.digest is DigestKind.SKETCH)
    fields = path.config()
    cfg = MATRIX.config(fields.pop("path"), **fields)
    engine = _recording(cls)(client, ns, layers, cfg, lanes=lanes, **({"drop": cell.edge} if drop else {}))
    return engine


def run_cell(cell: Cell, gpu_pool, client: PoolClient, ns: Namespace, seed: int, delay_cycles: int,  # noqa: ANN001
             drop: bool) -> Verdict:
    rng = np.random.default_rng([seed, int(drop)])
    device = torch.device("cuda", torch.cuda.current_device())
    geom, d, pb, k = MATRIX, MATRIX.block_dim, MATRIX.page_bytes, BLOCKS
    layers = make_kv(geom, device)
    old = fill(layers, d, rng, pb)
    order = [int(b) for b in rng.permutation(geom.num_blocks)]
    sels = [order[i * k : (i + 1) * k] for i in range(COPIES)]  # block ids in no particular order
    warm = [order[COPIES * k]]
    new = [rng.integers(0, 256, (k, pb), dtype=np.uint8) for _ in range(COPIES)]
    base = int(rng.integers(1 << 28))
    hashes = [block_hashes(range(base + i * 10_000, base + i * 10_000 + 16 * k), 16) for i in range(COPIES)]
    warm_hashes = block_hashes(range(base + 9_000_000, base + 9_000_016), 16)
    # Everything the delayed part touches is allocated now (an allocation while a stream is
    # held back can serialize the streams and hide the race under test).
    new_dev = [torch.from_numpy(p).to(device) for p in new]
    idx = [torch.tensor(s, dtype=torch.int64, device=device) for s in sels]
    seen_buf = [torch.empty((k, pb), dtype=torch.uint8, device=device) for _ in range(COPIES)]
    scratch = read_scratch(layers, d, k)
    warm_idx = torch.tensor(warm, dtype=torch.int64, device=device)
    tap = CommitTap()
    extra = [gpu_pool.client(name=f"matrix-lane{i}") for i in range(1, geom.lanes)]
    try:
        engine = _engine(cell, drop, client, tap.lanes([client, *extra]), ns, layers)
        run = Run(cell, drop, client, ns, delay_cycles, rng, device, layers, old, sels, idx, new, new_dev, hashes,
                  seen_buf, scratch, tap, engine)
        try:
            other = _took_path(run)
            if other:
                return Verdict(None, f"the engine did not take the path {cell.path.name}: {other}", run.evidence())
            if cell.path.direction is Direction.LOAD:
                for h, p in zip(hashes, new):
                    res = publish(client, ns, h, list(p), kind=run.kind).committed
                    if res != k:
                        return Verdict(None, f"could not publish the reference pages: {res} of {k} committed")
            torch.cuda.synchronize()
            # Warm-up, synchronized: every kernel and copy of the engine and of the test runs
            # once before any delay (a first launch loads its module and can serialize streams).
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
            return RUNNERS[cell.scenario](run)
        finally:
            engine.close()
    finally:
        for c in extra:
            c.close()


# -- the oracles ------------------------------------------------------------------------------------


def _judge_store(run: Run, outcomes: list, want: list[np.ndarray]) -> Verdict:
    """Every page of every store, at its commit: the bytes `want`, under their digest."""
    committed = sum(o.committed for o in outcomes)
    stale = mismatched = missing = 0
    for hs, w in zip(run.hashes, want):
        for h, page in zip(hs, w):
            seen = run.tap.pages.get(h)
            if seen is None:
                missing += 1
                continue
            got, digest, kind = seen
            if not np.array_equal(got, page):
                stale += 1
            if digest != page_digest(page, kind):
                mismatched += 1
    ev = run.evidence(pages=COPIES * run.k, committed=committed, stale_pages=stale, digest_mismatches=mismatched,
                      not_committed=missing)
    if stale or mismatched:
        return Verdict(False, f"at their commit {stale} of {COPIES * run.k} pages held other bytes than their "
                       f"blocks and {mismatched} carried another digest", ev, NOT_CHECKED)
    if missing or committed != COPIES * run.k:
        return Verdict(False, f"{committed} of {COPIES * run.k} stored blocks committed ({missing} never sent "
                       f"to commit): {outcomes}", ev, NOT_CHECKED)
    return Verdict(True, "every page byte-exact, under its block's digest, when it became visible", ev, NOT_CHECKED)


def _judge_blocks(run: Run, got: list[np.ndarray], want: list[np.ndarray], what: str) -> Verdict:
    stale = sum(int(np.count_nonzero((g != w).any(axis=1))) for g, w in zip(got, want))
    ev = run.evidence(pages=sum(len(w) for w in want), stale_pages=stale)
    if stale:
        return Verdict(False, f"{stale} of {ev['pages']} blocks: {what} held other bytes", ev, NOT_CHECKED)
    return Verdict(True, f"every block byte-exact: {what}", ev, NOT_CHECKED)


def _loaded_all(run: Run, h, i: int) -> Verdict | None:  # noqa: ANN001
    if h.loaded != run.k:
        return Verdict(False, f"load {i} installed {h.loaded} of {run.k} blocks: {h}", run.evidence())
    return None


# -- the scenarios, one per ordering edge (kvgate.harness.scenarios.gpu_cells.SCENARIOS) ----------------


def store_after_write(run: Run) -> Verdict:
    engine, d = run.engine, MATRIX.block_dim
    stream = torch.cuda.current_stream()
    for i in range(COPIES):
        delay_stream(stream, run.delay)
        write_blocks(run.layers, d, run.idx[i], run.new_dev[i])
        engine.store(run.sels[i], run.hashes[i])
    torch.cuda.synchronize()
    return _judge_store(run, engine.drain(DRAIN_S), run.new)


def _kv_readers(run: Run) -> tuple[torch.cuda.Stream, ...]:
    """The streams whose reads of the KV the host does not wait for. On pageable memory
    the driver path's copies of a store return only once complete; what it still reads
    behind the host's back is the gather its sketch takes (on the kernel stream)."""
    path, engine = run.cell.path, run.engine
    if path.host is HostMemory.PAGEABLE and path.engine is CopyPath.DRIVER and path.digest is DigestKind.SKETCH:
        return tuple(s for s in engine.store_read_streams if s is not engine.store_stream)
    return engine.store_read_streams


def reuse_after_store(run: Run) -> Verdict:
    engine, d = run.engine, MATRIX.block_dim
    readers = _kv_readers(run)
    for i in range(COPIES):
        for s in readers:
            delay_stream(s, run.delay)
        engine.store(run.sels[i], run.hashes[i])
        write_blocks(run.layers, d, run.idx[i], run.new_dev[i])  # the engine reuses the blocks at once
    torch.cuda.synchronize()
    return _judge_store(run, engine.drain(DRAIN_S), [run.old[s] for s in run.sels])


def copy_after_gather(run: Run) -> Verdict:
    engine = run.engine
    (gather,) = engine.store_read_streams  # a torch store of kv-sketch-1 pages reads the KV with its gathers only
    for i in range(COPIES):
        delay_stream(gather, run.delay)
        engine.store(run.sels[i], run.hashes[i])
    torch.cuda.synchronize()
    return _judge_store(run, engine.drain(DRAIN_S), [run.old[s] for s in run.sels])


def gather_after_copy(run: Run) -> Verdict:
    engine = run.engine
    for i in range(COPIES):
        delay_stream(engine.store_stream, run.delay)  # the copies out of the staging buffers are late
        engine.store(run.sels[i], run.hashes[i])
    torch.cuda.synchronize()
    return _judge_store(run, engine.drain(DRAIN_S), [run.old[s] for s in run.sels])


def commit_after_copy(run: Run) -> Verdict:
    engine = run.engine
    engine.sketch_delay_cycles = run.delay  # kv-sketch-1 stores: each sketch's copy to the host is late too
    for i in range(COPIES):
        delay_stream(engine.store_stream, run.delay)
        engine.store(run.sels[i], run.hashes[i])
    outcomes = engine.drain(DRAIN_S)  # no device sync first: each commit must wait for its own copies
    torch.cuda.synchronize()
    return _judge_store(run, outcomes, [run.old[s] for s in run.sels])


def load_after_read(run: Run) -> Verdict:
    engine, d = run.engine, MATRIX.block_dim
    stream = torch.cuda.current_stream()
    seen = []
    for i in range(COPIES):
        delay_stream(stream, run.delay)
        seen.append(read_blocks(run.layers, d, run.idx[i], run.seen_buf[i], run.scratch))  # the old blocks, late
        h = engine.load(run.sels[i], run.hashes[i])
        if (short := _loaded_all(run, h, i)) is not None:
            return short
        engine.wait_for_load(h)
    torch.cuda.synchronize()
    engine.drain(DRAIN_S)
    got = [s.cpu().numpy() for s in seen] + [read_pages(run.layers, d, s).cpu().numpy() for s in run.sels]
    want = [run.old[s] for s in run.sels] + run.new
    return _judge_blocks(run, got, want, "the engine's reads before the load, then the loaded blocks")


def read_after_load(run: Run) -> Verdict:
    engine, d = run.engine, MATRIX.block_dim
    seen = []
    for i in range(COPIES):
        delay_stream(engine.load_write_stream(run.kind), run.delay)  # the writes into the blocks are late
        h = engine.load(run.sels[i], run.hashes[i])
        if (short := _loaded_all(run, h, i)) is not None:
            return short
        engine.wait_for_load(h)
        seen.append(read_blocks(run.layers, d, run.idx[i], run.seen_buf[i], run.scratch))
    torch.cuda.synchronize()
    engine.drain(DRAIN_S)
    return _judge_blocks(run, [s.cpu().numpy() for s in seen], run.new, "the engine's reads after wait_for_load()")


def refill_after_install(run: Run) -> Verdict:
    engine, d = run.engine, MATRIX.block_dim
    for i in range(COPIES):
        delay_stream(engine.load_write_stream(run.kind), run.delay)  # this load's installs are late
        h = engine.load(run.sels[i], run.hashes[i])  # its copies reuse the staging buffers of the one before
        if (short := _loaded_all(run, h, i)) is not None:
            return short
        engine.wait_for_load(h)
    torch.cuda.synchronize()
    engine.drain(DRAIN_S)
    got = [read_pages(run.layers, d, s).cpu().numpy() for s in run.sels]
    return _judge_blocks(run, got, run.new, "the loaded blocks")


def _changed_page_load(run: Run, delay_check: bool) -> Verdict:
    """A first load leaves the staging buffers (and the host's check outputs) holding the
    pages of hashes[0]; one of those pooled pages then changes; a second load of the same
    pages, into other blocks, runs with its copy (delay_check False) or its check
    (delay_check True) held back. The engine must refuse the changed page."""
    engine, client, d, k, pb = run.engine, run.client, MATRIX.block_dim, run.k, MATRIX.page_bytes
    hashes, pages = run.hashes[0], run.new[0]
    first, blocks = run.sels
    if delay_check:
        h1 = engine.load(first, hashes)
    else:  # its check held back: even a check not ordered after the copy reads these pages
        delay_stream(engine.load_check_stream, run.delay)
        h1 = engine.load(first, hashes)
    engine.wait_for_load(h1)
    torch.cuda.synchronize()
    engine.drain(DRAIN_S)
    if not delay_check and h1.loaded != k:
        return Verdict(None, f"the first load installed {h1.loaded} of {k} blocks: nothing staged to compare with",
                       run.evidence())
    bad = int(run.rng.integers(1, k - 1))
    held = client.acquire(run.ns, hashes)  # leased: the pool's scrub cannot drop the page the load must meet
    try:
        page = np.asarray(client.arena.page(held.hits[bad].page, pb))
        page[int(run.rng.integers(pb))] ^= 0xFF  # the pooled page changes before the second load
        delay_stream(engine.load_check_stream if delay_check else engine.load_stream, run.delay)
        h = engine.load(blocks, hashes)
        engine.wait_for_load(h)
        got = read_pages(run.layers, d, blocks).cpu().numpy()
        engine.drain(DRAIN_S)
    finally:
        client.release(held.lease_id)
    n = h.loaded
    stale = int(np.count_nonzero((got[:n] != pages[:n]).any(axis=1)))  # installed, yet not the committed page
    touched = int(np.count_nonzero((got[n:] != run.old[blocks[n:]]).any(axis=1)))  # not installed, yet written
    ev = run.evidence(pages=k, changed_index=bad, loaded=n, miss=str(h.miss), stale_pages=stale + touched)
    if stale or touched:
        return Verdict(False, f"{stale} blocks reported loaded hold other bytes than the committed page, {touched} "
                       f"blocks not loaded were written", ev, NOT_CHECKED)
    if (n, h.miss and h.miss.cause) != (bad, MissCause.CORRUPT):
        return Verdict(False, f"the load stopped at {n} ({h.miss}), not at the changed page {bad} as corrupt", ev,
                       NOT_CHECKED)
    return Verdict(True, "the pages before the changed one installed byte-exact, the changed one refused", ev,
                   NOT_CHECKED)


def check_after_copy(run: Run) -> Verdict:
    return _changed_page_load(run, delay_check=False)


def verify_after_check(run: Run) -> Verdict:
    return _changed_page_load(run, delay_check=True)


def release_after_copy(run: Run) -> Verdict:
    engine, client = run.engine, run.client
    delay_stream(engine.load_write_stream(run.kind), 5 * run.delay)  # the installs (and so `done`) are late
    h = engine.load(run.sels[0], run.hashes[0])
    if (short := _loaded_all(run, h, 0)) is not None:
        return short
    time.sleep(0.05)  # a release that does not wait has long run by now
    in_flight = not h._done.query()
    try:
        evicted = client.evict(run.ns, run.hashes[0][:3])
    except PoolError as exc:
        return Verdict(None, f"evict failed: {type(exc).__name__}: {exc}", run.evidence())
    engine.drain(DRAIN_S)
    gone = sum(1 for e in evicted if e == EvictOutcome.EVICTED)
    ev = run.evidence(evicted_while_in_flight=gone if in_flight else 0, evict=[str(e) for e in evicted])
    if not in_flight:
        return Verdict(None, "the load's work finished before the check: the delay proved nothing", ev)
    if gone:
        return Verdict(False, f"{gone} of 3 pages were evictable while the load's copies and installs ran", ev)
    if evicted != [EvictOutcome.LEASED] * 3:
        return Verdict(False, f"evict answered {evicted}, not leased", ev)
    return Verdict(True, "the load's pages stayed leased while its work ran", ev)


RUNNERS: dict[str, Callable[[Run], Verdict]] = {f.__name__: f for f in (
    store_after_write, reuse_after_store, copy_after_gather, gather_after_copy, commit_after_copy,
    load_after_read, read_after_load, refill_after_install, check_after_copy, verify_after_check,
    release_after_copy)}


# -- the premises of host-ordered cells ----------------------------------------------------------------


def _probe_wait(engine: CopyPath, to_host: bool, delay_cycles: int, nbytes: int) -> float:
    """Seconds one copy of `nbytes` between the device and pageable host memory kept the
    host waiting, issued on a stream held back by `delay_cycles`."""
    device = torch.device("cuda", torch.cuda.current_device())
    dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    host = np.zeros(nbytes, dtype=np.uint8)  # malloc'ed: pageable
    host_t = torch.from_numpy(host)
    stream = torch.cuda.Stream(device)
    driver = Driver(device.index) if engine is CopyPath.DRIVER else None

    def copy() -> None:
        if driver is not None:
            ptrs = ([host.ctypes.data], [dev.data_ptr()]) if to_host else ([dev.data_ptr()], [host.ctypes.data])
            driver.copies(*ptrs, [nbytes], stream, to_host=to_host)
            return
        with torch.cuda.stream(stream):
            if to_host:
                host_t.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host_t, non_blocking=True)

    copy()
    stream.synchronize()
    delay_stream(stream, delay_cycles)
    t0 = time.perf_counter()
    copy()
    waited = time.perf_counter() - t0
    stream.synchronize()
    return waited


def probe_premises(cycles_per_ms: float, delay_ms: float = 50.0) -> dict[tuple[Premise, CopyPath], tuple[bool, dict]]:
    """Per copy path: whether a copy to pageable memory returned only once complete, and
    whether a copy from pageable memory waited for its stream (each: waited at least half
    the delay), for one page of the matrix."""
    out = {}
    for engine in CopyPath:
        for premise, to_host in ((Premise.PAGEABLE_D2H_COMPLETES, True), (Premise.PAGEABLE_H2D_WAITS_STREAM, False)):
            waited = _probe_wait(engine, to_host, int(delay_ms * cycles_per_ms), MATRIX.page_bytes)
            holds = waited * 1000 >= delay_ms / 2
            out[(premise, engine)] = (holds, {"delay_ms": delay_ms, "host_waited_ms": round(waited * 1000, 3),
                                              "bytes": MATRIX.page_bytes})
    return out


# -- one cell, both runs, asserted --------------------------------------------------------------------


def expectation(cell: Cell, premises: dict[tuple[Premise, CopyPath], tuple[bool, dict]]) -> tuple[Expect, str]:
    """The cell's expectation on this host, and why."""
    if cell.expect is not Expect.HOST_ORDERED:
        return cell.expect, ""
    holds, ev = premises[(cell.premise, cell.path.engine)]
    if not holds:
        return Expect.CAUGHT, f"{cell.premise} does not hold on this host ({ev}): only the edge orders it"
    return Expect.HOST_ORDERED, f"{cell.why} ({cell.premise}: {ev})"


def caught(v: Verdict) -> bool:
    """Caught by its oracle: the run completed and the oracle counted a difference."""
    ev = v.evidence
    return v.valid is False and (ev.get("stale_pages", 0) + ev.get("digest_mismatches", 0)
                                 + ev.get("evicted_while_in_flight", 0)) > 0


def check_cell(cell: Cell, gpu_pool, client: PoolClient, ns: Namespace, seed: int, delay_cycles: int,  # noqa: ANN001
               premises: dict) -> tuple[Verdict, Verdict | None]:
    expect, why = expectation(cell, premises)
    ordered = run_cell(cell, gpu_pool, client, ns, seed, delay_cycles, drop=False)
    assert ordered.valid is True, f"{cell.id}: the engine under the delay: {ordered}"
    issued = set(ordered.evidence["issued_edges"])
    assert issued == {e.value for e in cell.path.edges}, \
        f"{cell.id}: the engine issued {sorted(issued)} on this path; the registry (kvpool.gpu.paths) lists " \
        f"{sorted(e.value for e in cell.path.edges)}"
    if expect is Expect.HOST_ORDERED and cell.premise is Premise.PAGEABLE_H2D_WAITS_STREAM:
        # The copy waited for its stream and returned with the bytes staged: the check
        # is enqueued after it. Its DMA may still be finishing, a window no delay opens.
        return ordered, None
    control = run_cell(cell, gpu_pool, client, ns, seed, delay_cycles, drop=True)
    assert control.evidence.get("dropped_edges", 0) > 0, f"{cell.id}: the control never reached its edge: {control}"
    if expect is Expect.HOST_ORDERED:
        assert control.valid is True, f"{cell.id}: expected the host to order {cell.edge.value} ({why}); " \
            f"the control was not byte-exact: {control}"
    else:
        assert caught(control), f"{cell.id}: negative control NOT caught (a control that raised, timed out or " \
            f"stopped short is no catch): {control}" + (f" [{why}]" if why else "")
    return ordered, control
