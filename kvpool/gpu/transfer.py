"""The GPU transfer engine: whole KV blocks between an engine's CUDA KV tensors and pool
pages, ordered on CUDA streams.

A pool page holds one block of every layer, in layer order: page = concat over layers of
the bytes of `layer.select(block_dim, block_id)` in C order (the CPU connector's order;
`block_page` computes it). Any layout whose blocks sit along one dimension works: vLLM's
GPU `(num_blocks, 2, B, H, D)` has block_dim 0, FlashAttention's `(2, num_blocks, B, H,
D)` has block_dim 1. The pages live in the pool's shared-memory arena, registered with
`cudaHostRegister` in this process, so copies run at link speed; two processes (two CUDA
contexts) each register their own mapping of the same arena. Or they live in device memory: a
GPU keeper's tier (`kvpool keeper --backing vmm`) mapped in this process, its backend a
kvpool.gpu.tier_backend.TierBackend; then nothing is registered and every copy between the
pages and the staging buffers or the KV tensors is device to device, through the same torch
and driver calls, with the same staging, checks, installs, ordering edges and hooks
(kvpool.gpu.region says what differs).

  TransferEngine(backend, ns, layers, config, lanes=())
        `layers`: one CUDA tensor per layer, in layer order, all on one device, each with a
        contiguous last dimension; `config.block_dim` says which dimension indexes blocks.
        `backend`: a PoolClient whose arena is mapped here (same host), or a TierBackend
        whose keeper's buffer is mapped here (its `arena`: the pages in device memory, or in
        host memory for a memfd keeper). `lanes`: further connections to the same pool;
        commits run on them in parallel (the daemon re-verifies each commit in its own
        thread). A keeper's tier is mapped per session: its lanes must be its backend (the
        connector's are), or TransferError.

  store(block_ids, hashes, boundary=None) -> StoreHandle      [vLLM: wait_for_save]
        Records an event on the engine's current stream *before returning* (the KV the
        engine wrote so far); the transfer stream waits on it, then copies the blocks
        into pages reserved in the pool; the engine's stream then waits for those copies
        to have *read* the KV (a block may be overwritten right after this call).
        Returns at once; the copies, digests and commits finish in the background. A page
        becomes visible only after its commit. Digests (TransferConfig.digest): kv-sketch-1
        by default, taken on the GPU over the staged page (the bytes the copy sends; on
        the driver path over the blocks gathered in page order) and committed as trusted
        (the daemon scrubs at rest); or xxh3-128 on the host over the page as copied, which
        the daemon re-verifies before commit. That digest is of the shared page, not of the
        producer's bytes: a client of the tenant that writes the page between the copy and
        the hash is vouched for (the host path digests the producer's bytes,
        kvpool.client.transfer.PUBLISH_DIGEST_OF; here that would take a second copy to a
        private buffer). kv-sketch-1 is taken over the staged bytes and is not exposed.
  load(block_ids, hashes, deadline_s=None) -> LoadHandle      [vLLM: start_load_kv]
        Leases the longest pooled run of `hashes`, copies the pages into GPU staging
        buffers, verifies every page's digest by its kind over the bytes that arrived
        there, and installs the verified pages from those same staged bytes into the
        blocks, after the engine's earlier work on those blocks (an event recorded on the
        engine's current stream at the call). The check is ordered after the copy on the
        check stream, and the install after the check on the host (it is enqueued only
        once the host saw the digests match), on either copy path:
          kv-sketch-1  the GPU sketches the staged rows; the host reads the sketches
                       (1/256 of the bytes) and takes their XXH3-128.
          xxh3-128     the staged rows are copied back into a pinned host buffer private
                       to this engine, and the host takes XXH3-128 of that.
        The pool's shared page is never what is checked: another process may write it
        between a host read and the DMA. A page whose digest does not match is never
        installed: the load stops there with MissCause.CORRUPT. The exception, the direct
        install (kv-sketch-1 pages in device memory, a keeper's tier, with the fused copy
        and TransferConfig.install_direct): one kernel writes each page straight into its
        block and sketches the bytes it wrote, so the check is over the bytes installed (taken
        only where the engine's work queued before the load is over: the host waits for the
        copies, which must follow that work, so on a busy engine chunks are staged); a
        page that fails, and the pages after it already in flight, are then in their blocks
        and reported failed with MissCause.CORRUPT (the engine recomputes failed blocks, as
        it does any block a load did not fill). load() returns once every
        chunk was checked (the installs may still run). Cost, one H200, 128 MiB of 512 KiB
        pages, load to installed: kv-sketch-1 pages 6.5 ms (torch) / 19 ms (driver: one
        device-to-device copy per layer and block); xxh3-128 pages 17 ms / 32 ms (the
        read-back; a host read of the shared page took 12.5 / 17 ms and checked nothing
        that arrived).
        `handle.loaded` / `handle.miss` / `handle.failed_block_ids` are final when load()
        returns (except `stale`, below).
  wait_for_load(handle)                                       [vLLM: wait_for_layer_load]
        `torch.cuda.current_stream().wait_event(...)`: a stream wait, never a host sync.
        Idempotent; the engine must call it before any kernel reads the loaded blocks.
  poll() -> list[StoreOutcome | LoadOutcome]                  [vLLM: get_finished, or any hook]
        Outcomes of transfers that finished since the last poll. Non-blocking.
  drain(timeout_s=None) -> list[...]  wait for everything in flight (shutdown, tests).
  close()                              drain, stop the workers, unregister host memory.

Contracts:
  * Pages stay leased (pool lease) until the copy reading them has completed (its CUDA
    event); the release then re-checks the page generations: a page reused under the
    lease is reported in LoadOutcome.stale (a pool bug; the connector treats those blocks
    as failed).
  * A staging buffer is never refilled while a copy or kernel that reads it may run:
    refills are ordered after the readers on the same stream, and a load's refill of a
    buffer is enqueued only after the scatter that reads it.
  * Reserved pages are written only by this engine's copies and committed only after the
    copy's event completed and the page was digested; any error aborts the reservation.
  * The engine follows its backend's segment: when the pool restarted (the client
    reconnected and was handed a new segment), the next store() or load() first lets
    the transfers in flight finish (their pages were the old pool's), unregisters the
    old mapping and registers the new one (`reattached` counts this). A transfer whose
    own reserve or acquire met the restart is not copied at all: its reservation is
    aborted (the store reports the error) or its lease released (the load ends as
    transport_error), never copied against the other segment. On a keeper's tier the
    segment is the keeper instance and the session (a new session maps the buffer at
    another address): the same steps, nothing to register; a grant of the replaced
    instance that the link refuses at its release (WrongInstance) fails the load's blocks
    as transport_error, at its commit fails the store's unit (never visible).
  * Stores into a keeper's tier commit kv-sketch-1 (its `digest_kind`; device pages
    cannot be digested on the host): any other TransferConfig.digest is a TransferError.
  * Where host memory cannot be registered the engine says so (`capabilities`, a
    warning in the log) and copies from pageable memory, with the same stream ordering
    (such copies also block the host; they are slower, never less ordered).
  * Errors are typed (kvpool.errors.PoolError subclasses; TransferError for CUDA and
    layout problems). Pool errors met by a background commit or release are reported in
    the outcome; anything else re-raises from poll()/drain().

Two copy paths, chosen by TransferConfig.path:
  torch   gather/scatter kernels (index_select / index_copy_) between the KV tensors and
          a GPU staging buffer in page order, `tensor.copy_(non_blocking=True)` between
          staging and torch views of the registered pages.
  driver  raw pointers through cuda-python: stores copy once per (layer, block,
          contiguous run) straight from the KV tensors to the pages; loads copy the pages
          into the staging buffer (one copy per page, or per run of consecutive pages)
          and install verified rows with one device-to-device copy per (layer, block,
          run). Batched with cuMemcpyBatchAsync where the driver has it
          (`capabilities.batched_copies`), else cuMemcpy{DtoH,HtoD,DtoD}Async one by one.
          No torch kernels move KV (the check's sketch is a torch matrix product).

Admission: a store is reserved and committed in units (`commit_blocks` blocks; the last
unit absorbs a short remainder) so the pool verifies them in parallel. The pool's
`min_blocks` applies per reservation: keep `TransferConfig.min_blocks` equal to the
pool's, and no unit of an admitted run is shorter than it. `boundary` is honoured as in
`kvpool.client.transfer.publish`.

The ordering edges (kvpool.gpu.config.OrderingEdge) go through two hooks: every stream
wait through `_order(edge, stream, event)`, every wait of the host for a copy or a check
through `_await_copy(edge, event)`; a load's digests of what arrived through
`_arrived_digests(buf, kinds)` and its comparison through `_verified(got, expected)`, so
a negative control (kvgate.faults.gpu_controls) can drop or replace exactly one of them.
Which copy paths have which edges: kvpool.gpu.paths (the registry the gate's matrix of
paths against edges enumerates).

The engine's parts: TransferEngine (here: its setup, the segment it follows, the CUDA
graphs, the hooks, the helpers both directions share, completion) takes its stores from
Stores (kvpool.gpu.store) and its loads from Loads (kvpool.gpu.load); its configuration,
reports and errors are in kvpool.gpu.config, the page order in kvpool.gpu.layout, host
memory (registration, pinned sketch buffers, index rings) in kvpool.gpu.staging, the
host's waits in kvpool.gpu.events, the driver path's calls in kvpool.gpu.driver.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvpool.client.backend import PoolBackend
from kvpool.client.keepalive import Keepalive, LaneGrants
from kvpool.errors import InvalidRequest, MissCause, PoolError, PoolTimeout
from kvpool.gpu.config import (
    CopyPath,
    HostMemory,
    HostRegistrationError,
    KVLayoutError,
    OrderingEdge,
    PageMemory,
    RegionRefused,
    TransferCapabilities,
    TransferConfig,
    TransferError,
)
from kvpool.gpu.driver import MIN_RUN_BYTES, Driver
from kvpool.gpu.events import await_event, resolve_when_all
from kvpool.gpu.layout import KVLayout, as_width, require_cuda, widest_views
from kvpool.gpu.load import LoadHandle, LoadOutcome, Loads
from kvpool.gpu.region import PageRegion, check_store_digest, moved_to, off_session, page_region
from kvpool.gpu.sketch import Sketcher
from kvpool.gpu.staging import IndexRing, host_register, host_unregister
from kvpool.gpu.store import StoreHandle, StoreOutcome, Stores
from kvpool.pool.records import Miss, SlotStatus
from kvpool.pool.digest import SKETCH_COLS, SKETCH_ROW, DigestKind, page_digest
from kvpool.pool.keys import Namespace

log = logging.getLogger("kvpool.gpu.transfer")

_COMMIT_POLL_S = 50e-6  # a unit's commit waits for its copies (the store's last commit is its latency)


class TransferEngine(Stores, Loads):
    def __init__(self, backend: PoolBackend, ns: Namespace, layers: Sequence[torch.Tensor],
                 config: TransferConfig = TransferConfig(), lanes: Sequence[PoolBackend] = ()):
        self.device = require_cuda(layers)
        self.config = config
        self.ns = ns
        self.backend = backend
        if ns.num_layers != len(layers):
            raise KVLayoutError(f"{len(layers)} KV tensors, the namespace declares {ns.num_layers} layers")
        dtypes = {str(t.dtype).removeprefix("torch.") for t in layers}
        if dtypes != {ns.kv_dtype}:
            raise KVLayoutError(f"KV tensors of dtype {sorted(dtypes)}, the namespace declares {ns.kv_dtype}")
        self.layout = KVLayout.of(layers, config.block_dim)
        arena = getattr(backend, "arena", None)
        if arena is None:
            raise TransferError("the GPU transfer engine needs the pool's arena mapped in this process "
                                "(a PoolClient on the daemon's host, zero_copy=True, or a TierBackend of a "
                                "connected keeper)")
        region = page_region(arena)
        if self.layout.page_bytes > region.page_size:
            raise KVLayoutError(f"a block is {self.layout.page_bytes} bytes, the pool's pages {region.page_size}")
        check_store_digest(region, config.digest, getattr(backend, "digest_kind", None))
        self._layers = list(layers)
        self._layers_u8 = [t.view(torch.uint8) for t in layers]
        self._width, self._layers_w = widest_views(self._layers_u8, self.layout)
        self._map_region(region)
        self.reattached = 0  # times the engine moved to a new segment of its pool (a pool restart)
        self._lanes: list[PoolBackend] = list(lanes) or [backend]
        other = off_session(region, [self._segment(lane) for lane in self._lanes])
        if other:  # mapped per session: a lane of another session names other addresses
            raise TransferError(f"lanes {other} are not on the session whose mapping the engine copies "
                                "through (a keeper's tier: give the engine its backend as its only lane)")
        pb = self.layout.page_bytes
        self._chunk_pages = max(1, config.chunk_bytes // pb)
        if config.commit_blocks:
            unit = config.commit_blocks
        elif config.digest is DigestKind.SKETCH:  # nothing to re-verify at commit: a unit per copy chunk
            unit = max(self._chunk_pages, config.commit_bytes // pb)
        else:  # the pool re-verifies each unit: units small enough to verify in parallel
            unit = max(1, config.commit_bytes // pb)
        self._unit_blocks = max(unit, config.min_blocks)

        with torch.cuda.device(self.device):
            self.store_stream = torch.cuda.Stream(self.device)
            self.load_stream = torch.cuda.Stream(self.device)
        self._registered = False
        self._host_reason = ""
        self._register_region()
        try:
            self._init_path(layers)
        except BaseException:
            if self._registered:
                self._registered = False
                host_unregister(self._region_ptr)
            raise
        self._hash_pool = cf.ThreadPoolExecutor(config.hash_threads, thread_name_prefix="kvpool-digest")
        self._lane_exec = [cf.ThreadPoolExecutor(1, thread_name_prefix=f"kvpool-commit{i}")
                           for i in range(len(self._lanes))]
        self._release_exec = cf.ThreadPoolExecutor(1, thread_name_prefix="kvpool-release")
        self._lane_busy = [0] * len(self._lanes)
        self._lane_committing = [0] * len(self._lanes)
        # the reservations open on each lane, renewed together while its thread waits for any
        # of them (a unit queued behind others would outlive the TTL unrenewed: kvpool.client.keepalive)
        self._lane_grants = [LaneGrants(lane) for lane in self._lanes]
        self._lane_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._inflight: dict[int, StoreHandle | LoadHandle] = {}
        self._closed = False

    def _map_region(self, region: PageRegion) -> None:
        """The pages the copies go to and come from: a torch view of the host range (which
        holds the host mapping alive while the engine uses it), or a torch tensor aliasing
        the device range (no copy: checked)."""
        self._arena = region  # .instance: the segment the engine follows
        self._page_size = region.page_size
        self._region_ptr = region.ptr
        if region.memory is PageMemory.DEVICE:
            self._region_np = None
            t = torch.as_tensor(region.device)
            if t.data_ptr() != region.ptr or t.dtype != torch.uint8 or t.numel() != region.nbytes:
                raise RegionRefused("torch did not alias the device pages (a copy, or another range): a write "
                                    "would miss the pool")
            if t.device != self.device:
                raise RegionRefused(f"the device pages are on {t.device}, the KV cache on {self.device}")
            self._region = t
            return
        self._region_np = region.host
        self._region = torch.frombuffer(self._region_np, dtype=torch.uint8)

    def _host_memory(self) -> HostMemory | None:
        if self._arena.memory is PageMemory.DEVICE:
            return None
        return HostMemory.REGISTERED if self._registered else HostMemory.PAGEABLE

    def _register_region(self) -> None:
        if not self._arena.registers:
            self._host_reason = "none: the pages are device memory (a keeper's tier), copied device to device"
            return
        if not self.config.register_host:
            self._host_reason = "registration disabled by TransferConfig.register_host=False"
            return
        try:
            self._register_host(self._region_ptr, self._region_np.nbytes)
            self._registered = True
            self._host_reason = ""
        except HostRegistrationError as exc:
            self._host_reason = str(exc)
            log.warning("kvpool GPU transfer: host pages NOT registered (%s); falling back to pageable copies "
                        "with the same stream ordering (slower, and the host waits for each copy)",
                        self._host_reason)

    @staticmethod
    def _segment(client: PoolBackend) -> bytes | None:
        """The instance of the segment `client` has mapped (None: not mapped there)."""
        arena = getattr(client, "arena", None)
        return None if arena is None else arena.instance

    def _follow_segment(self) -> None:
        """Move to the backend's segment if it is no longer the one the engine copies to."""
        region = moved_to(self._arena, getattr(self.backend, "arena", None))
        if region is None:
            return  # unmapped (the op's own call will fail or reconnect), or the same segment
        if self.layout.page_bytes > region.page_size:
            raise KVLayoutError(f"the restarted pool's pages are {region.page_size} bytes, a block "
                                f"{self.layout.page_bytes}")
        check_store_digest(region, self.config.digest, getattr(self.backend, "digest_kind", None))
        self.drain()  # what is in flight read or wrote the old segment: let it end first
        torch.cuda.synchronize(self.device)  # every stream of the engine: nothing reads the old pages
        if self._registered:
            self._registered = False
            host_unregister(self._region_ptr)
        log.warning("kvpool GPU transfer: the pool's segment changed (a restart, or a keeper's new session): "
                    "mapping its pages again")
        self._map_region(region)
        self._register_region()
        self.capabilities = dataclasses.replace(
            self.capabilities, host_memory=self._host_memory(), host_memory_reason=self._host_reason,
            pages=region.memory)
        self.reattached += 1

    def _init_path(self, layers: Sequence[torch.Tensor]) -> None:
        """The copy path's resources (staging buffers, or the driver and its batch probe)."""
        config, pb = self.config, self.layout.page_bytes
        self._driver: Driver | None = None
        batched, batched_reason = False, ""
        if config.path == CopyPath.DRIVER:
            if self.layout.min_run < MIN_RUN_BYTES:
                raise KVLayoutError(f"the driver path copies contiguous runs; this layout has runs of "
                                    f"{self.layout.min_run} bytes (use the torch path)")
            self._driver = Driver(self.device.index if self.device.index is not None else torch.cuda.current_device())
            if not config.batched:
                batched_reason = "disabled by TransferConfig.batched=False"
            elif not self._registered and self._arena.registers:
                batched_reason = "host memory is pageable"
            else:
                self._driver.probe_batched(self.store_stream, self.device)
                batched, batched_reason = self._driver.batched, self._driver.batched_reason
            self._layer_ptrs = [t.data_ptr() for t in layers]
        elif config.digest is DigestKind.XXH3:
            # Everything the copies use is allocated here, once: an allocation issued while a
            # stream is held back can serialize streams (CUDA's implicit synchronization).
            ring = max(4096, 4 * self._chunk_pages)
            with torch.cuda.device(self.device), torch.cuda.stream(self.store_stream):
                self._store_stage = torch.empty((self._chunk_pages, pb), dtype=torch.uint8, device=self.device)
                largest = max(lb.nbytes for lb in self.layout.layers)
                self._gather_scratch = torch.empty(self._chunk_pages * largest, dtype=torch.uint8, device=self.device)
                self._store_ring = IndexRing(self.device, self.store_stream, ring)
        self._sketcher: Sketcher | None = None  # kv-sketch-1 stores (None: xxh3-128 stores)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # stage address -> (graph, its ids)
        self._init_load(layers)
        if config.digest is DigestKind.SKETCH:
            self._init_sketch(layers)
        self._graphs_note = self._init_graphs()
        self.capabilities = TransferCapabilities(
            config.path, torch.cuda.get_device_name(self.device), self._host_memory(), self._host_reason, batched,
            batched_reason, config.digest.value, self._sketch_gpu.impl, self._sketch_gpu.reason, self._graphs_note,
            self._arena.memory, self._install_note())

    def _init_graphs(self) -> str:
        """Capture a full chunk's gather into each store staging buffer and scatter out of
        each load staging buffer, for ids in a static tensor. Returns what is in use, or why
        nothing is. A capture that fails leaves the eager kernels (logged)."""
        if not self.config.graphs:
            return "off (TransferConfig.graphs=False)"
        if self._driver is not None:
            return "none on the driver path"
        if self.layout.block_dim != 0:
            return "none for this layout (block dim not first)"
        cp, w, dev = self._chunk_pages, self._width, self.device
        captured = []
        kinds = [("scatter", self._sk_load_stage, self._load_s)]
        if self._sketcher is not None:
            kinds.insert(0, ("gather", self._sk_store_stage, self._store_k))
        for kind, stages, stream in kinds:
            for stage in stages:
                ids = torch.zeros(cp, dtype=torch.int64, device=dev)
                views = self._layer_rows(as_width(stage, w), cp)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.device(dev), torch.cuda.graph(graph, stream=stream,
                                                                  capture_error_mode="thread_local"):
                        for layer, rows in zip(self._layers_w, views):
                            if kind == "gather":
                                torch.index_select(layer, 0, ids, out=rows)
                            else:
                                layer.index_copy_(0, ids, rows)
                except RuntimeError as exc:
                    log.warning("kvpool GPU transfer: capturing the %s graph failed (%s); eager kernels instead",
                                kind, exc)
                    self._graphs = {}
                    return f"none: the {kind} capture failed: {str(exc).splitlines()[0][:160]}"
                self._graphs[stage.data_ptr()] = (graph, ids)
            captured.append(kind)
        torch.cuda.synchronize(dev)
        return ",".join(captured)

    def _layer_rows(self, stage_w: torch.Tensor, n: int) -> list[torch.Tensor]:
        """Each layer's part of the first `n` staged rows, shaped like n of its blocks."""
        w = self._width
        return [stage_w[:n, lb.page_offset // w : (lb.page_offset + lb.nbytes) // w]
                .view(n, *lb.shape[:-1], lb.shape[-1] // w) for lb in self.layout.layers]

    def _replay(self, stage: torch.Tensor, idx: torch.Tensor) -> bool:
        """Run the captured full-chunk kernels of `stage` for `idx` on the current stream."""
        entry = self._graphs.get(stage.data_ptr())
        if entry is None or idx.numel() != self._chunk_pages:
            return False
        graph, ids = entry
        ids.copy_(idx)
        graph.replay()
        return True

    @property
    def store_read_streams(self) -> tuple[torch.cuda.Stream, ...]:
        """The streams whose work reads the KV blocks of a store (a fault that delays the
        reads delays these)."""
        if self._sketcher is None:
            return (self.store_stream,)
        return (self._store_k,) if self._driver is None else (self.store_stream, self._store_k)

    @property
    def load_check_stream(self) -> torch.cuda.Stream:
        """The stream whose work reads what a load's copies delivered (sketches, read-backs)."""
        return self._load_k

    def load_write_stream(self, kind: DigestKind | None = None) -> torch.cuda.Stream:
        """The stream whose work writes the blocks of a load: the installs of verified
        chunks (either path, pages of either kind), or with the direct install (kv-sketch-1
        pages in device memory; `kind` None: the engine's own kind) the copy stream's fused
        kernel."""
        if (kind or self.config.digest) is DigestKind.SKETCH and self._direct_install():
            return self.load_stream
        return self._load_s

    # -- the ordering edges (two hooks, so a control can drop one) ----------------------------
    def _order(self, edge: OrderingEdge, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        """`stream` waits for `event` (a stream wait, never a host sync)."""
        stream.wait_event(event)

    def _register_host(self, ptr: int, size: int) -> None:
        host_register(ptr, size)

    def _await_copy(self, edge: OrderingEdge, event: torch.cuda.Event, poll_s: float = _COMMIT_POLL_S,
                    keepalive: Keepalive | None = None) -> PoolError | None:
        """Block this thread until the copies (or checks) before `event` completed; with a
        `keepalive`, renewing the pool grants it names meanwhile (kvpool.gpu.events): a
        refusal is returned after the event completed (None: every renewal held)."""
        return await_event(event, poll_s, keepalive)

    def _verified(self, got: Sequence[bytes], expected: Sequence[bytes]) -> int:
        """How many leading pages of a chunk match their digests (a sketched load's check)."""
        return next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), len(got))

    # -- helpers --------------------------------------------------------------------------
    def _check_ids(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> tuple[int, ...]:
        if self._closed:
            raise TransferError("the transfer engine is closed")
        ids = tuple(map(int, block_ids))
        if len(ids) != len(hashes):
            raise InvalidRequest(f"{len(ids)} block ids but {len(hashes)} hashes")
        if len(set(ids)) != len(ids):
            raise InvalidRequest("a block id appears twice in one transfer")
        n = self.layout.num_blocks
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            raise InvalidRequest(f"block ids {bad[:4]} outside the KV cache's {n} blocks")
        return ids

    def _page_np(self, page: int, length: int | None = None) -> np.ndarray:
        if self._region_np is None:
            raise TransferError("the pages are device memory: the host cannot read them")
        start = page * self._page_size
        return self._region_np[start : start + (self.layout.page_bytes if length is None else length)]

    def _digest(self, page: int, kind: DigestKind = DigestKind.XXH3) -> bytes:
        return page_digest(self._page_np(page), kind)

    def _index(self, ids: Sequence[int], ring: IndexRing) -> torch.Tensor:
        """Block ids on the device, uploaded on the ring's stream: no host sync, no allocation."""
        return ring.upload(ids)

    def _runs(self, pages: Sequence[int]) -> list[tuple[int, int, int]]:
        """(first row, first page, count) of consecutive pages, when a block fills a page."""
        if self.layout.page_bytes != self._page_size:
            return [(i, p, 1) for i, p in enumerate(pages)]
        out: list[tuple[int, int, int]] = []
        for i, p in enumerate(pages):
            if out and out[-1][1] + out[-1][2] == p:
                row, first, k = out[-1]
                out[-1] = (row, first, k + 1)
            else:
                out.append((i, p, 1))
        return out

    def _host_rows(self, page: int, count: int) -> torch.Tensor:
        ps, pb = self._page_size, self.layout.page_bytes
        return self._region[page * ps : page * ps + (count - 1) * ps + pb]

    def _pick_lane(self) -> int:
        """A lane not in the middle of a commit (its connection would make reserve() wait
        for the pool's re-verify), else the least loaded."""
        with self._lane_lock:
            lane = min(range(len(self._lanes)), key=lambda i: (self._lane_committing[i], self._lane_busy[i]))
            self._lane_busy[lane] += 1
            return lane

    def _lane_done(self, lane: int) -> None:
        with self._lane_lock:
            self._lane_busy[lane] -= 1

    def _sketch_to_host(self, stage: torch.Tensor, n: int, dev_out: torch.Tensor, host: torch.Tensor) -> None:
        """The sketches of the first `n` rows of `stage` -> `host` (int32 (n, rows, cols)),
        on the current stream."""
        rows = n * self._sk_rows
        out = self._sketch_gpu.sketch(stage[:n].view(rows, SKETCH_ROW), out=dev_out[:rows])
        host.view(rows, SKETCH_COLS).copy_(out, non_blocking=True)

    # -- completion ---------------------------------------------------------------------------
    def _outcome(self, h: StoreHandle | LoadHandle) -> StoreOutcome | LoadOutcome:
        if isinstance(h, LoadHandle):
            stale, errors, unverified = h._future.result()
            loaded, miss = h.loaded, h.miss
            if unverified is not None and loaded:  # no generation check: every copied block fails
                stale, loaded, miss = tuple(range(loaded)), 0, Miss(0, unverified)
            elif stale:
                loaded = min(loaded, stale[0])
                miss = Miss(loaded, MissCause.CORRUPT)
            return LoadOutcome(h.id, h.requested, loaded, miss, stale, errors, time.monotonic() - h._t0)
        committed = rejected = 0
        errors = list(h.errors)
        for unit in h._units:
            c, r, err = unit.future.result()
            committed += c
            rejected += r
            if err:
                errors.append(err)
        c = h.counts
        return StoreOutcome(h.id, h.requested, committed, c[SlotStatus.EXISTS], c[SlotStatus.PENDING],
                            c[SlotStatus.NOT_ADMITTED], c[SlotStatus.NO_CAPACITY], rejected, tuple(errors),
                            committed * self.layout.page_bytes, time.monotonic() - h._t0)

    def _watch(self, h: StoreHandle | LoadHandle) -> None:
        """Resolve h.result once every part of the transfer finished (on the worker thread
        that finished last)."""
        self._inflight[h.id] = h
        parts = [h._future] if isinstance(h, LoadHandle) else [u.future for u in h._units]

        def outcome() -> StoreOutcome | LoadOutcome:
            if isinstance(h, StoreHandle) and h._sketch is not None:  # every commit reading it finished
                self._store_sketches.give(h._sketch)
                h._sketch = None
            return self._outcome(h)

        resolve_when_all(parts, h.result, outcome)

    def poll(self) -> list[StoreOutcome | LoadOutcome]:
        """Outcomes of the transfers that finished since the last call (non-blocking); an
        error a background worker met that is not a pool error re-raises here."""
        done = [h for h in self._inflight.values() if h.result.done()]
        for h in done:
            del self._inflight[h.id]
        return [h.result.result() for h in done]

    def drain(self, timeout_s: float | None = None) -> list[StoreOutcome | LoadOutcome]:
        """Wait for every transfer in flight; their outcomes (and any earlier unpolled ones)."""
        _, not_done = cf.wait([h.result for h in self._inflight.values()], timeout=timeout_s)
        if not_done:
            raise PoolTimeout(f"{len(not_done)} transfers still in flight after {timeout_s}s")
        return self.poll()

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.drain()
        finally:
            self._closed = True
            self._hash_pool.shutdown(wait=True)
            for ex in self._lane_exec:
                ex.shutdown(wait=True)
            self._release_exec.shutdown(wait=True)
            self.store_stream.synchronize()
            self.load_stream.synchronize()
            self._load_k.synchronize()
            self._load_s.synchronize()
            if self._sketcher is not None:
                self._store_k.synchronize()
            if self._registered:
                self._registered = False
                host_unregister(self._region_ptr)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
