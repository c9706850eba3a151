"""The GPU transfer engine: whole KV blocks between an engine's CUDA KV tensors and pool
pages, ordered on CUDA streams.

A pool page holds one block of every layer, in layer order: page = concat over layers of
the bytes of `layer.select(block_dim, block_id)` in C order (the CPU connector's order;
`block_page` computes it). Any layout whose blocks sit along one dimension works: vLLM's
GPU `(num_blocks, 2, B, H, D)` has block_dim 0, FlashAttention's `(2, num_blocks, B, H,
D)` has block_dim 1. The pages live in the pool's shared-memory arena, registered with
`cudaHostRegister` in this process, so copies run at link speed; two processes (two CUDA
contexts) each register their own mapping of the same arena.

  TransferEngine(backend, ns, layers, config, lanes=())
        `layers`: one CUDA tensor per layer, in layer order, all on one device, each with a
        contiguous last dimension; `config.block_dim` says which dimension indexes blocks.
        `backend`: a PoolClient whose arena is mapped here (same host). `lanes`: further
        connections to the same pool; commits run on them in parallel (the daemon
        re-verifies each commit in its own thread).

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
        the daemon re-verifies before commit.
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
        installed: the load stops there with MissCause.CORRUPT. load() returns once every
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
    transport_error), never copied against the other segment.
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

The ordering edges go through one hook, `_order(edge, stream, event)`, every wait for a
copy's completion through `_await_copy(event)`, a load's digests of what arrived through
`_arrived_digests(buf, kinds)` and its comparison through `_verified(got, expected)`, so
a negative control (kvgate.faults.gpu_controls) can drop or replace exactly one of them.

  check_plan(kinds) -> (sketch, read_back)      the check-stream work a chunk needs.
  arrived_digests(kinds, sketches, readback, page_bytes)   per page, its digest by its
        kind from what arrived (the GPU's sketches, the read-back rows); pure, no CUDA.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import dataclasses
import enum
import functools
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvpool.pool.records import AcquireResult, Miss, ReserveResult, SlotStatus
from kvpool.client.backend import PoolBackend
from kvpool.client.transfer import report_corrupt
from kvpool.pool.digest import DIGEST_BYTES, SKETCH_COLS, SKETCH_ROW, DigestKind, page_digest, sketch_rows
from kvpool.gpu.sketch import Sketcher, digests as sketch_digests, staged_width
from kvpool.errors import (
    InvalidRequest,
    LeaseLost,
    MalformedFrame,
    MissCause,
    PoolError,
    PoolTimeout,
    TransportError,
)
from kvpool.pool.keys import Namespace

log = logging.getLogger("kvpool.gpu.transfer")

_EVENT_POLL_S = 100e-6  # background workers poll CUDA events (a blocking sync would spin a core)
_LOAD_POLL_S = 20e-6  # load() itself waits for each chunk's sketch (the caller waits anyway)
_COMMIT_POLL_S = 50e-6  # a unit's commit waits for its copies (the store's last commit is its latency)
MIN_RUN_BYTES = 512  # the driver path refuses layouts whose contiguous runs are shorter


# -- errors -----------------------------------------------------------------------------------


class TransferError(PoolError):
    """A CUDA call of the transfer engine failed, or the engine cannot work as configured."""


class KVLayoutError(TransferError):
    """The KV tensors do not fit the declared layout (block dim, device, namespace)."""


class HostRegistrationError(TransferError):
    """cudaHostRegister refused the arena; the engine falls back to pageable copies."""


# -- configuration and reports ----------------------------------------------------------------


class CopyPath(enum.StrEnum):
    TORCH = "torch"
    DRIVER = "driver"


class HostMemory(enum.StrEnum):
    REGISTERED = "registered"  # cudaHostRegister'ed arena: asynchronous DMA at link speed
    PAGEABLE = "pageable"  # the fallback: same ordering, slower, the host waits for copies


class OrderingEdge(enum.StrEnum):
    """The stream dependencies that make a transfer correct."""

    STORE_AFTER_WRITE = "store_after_write"  # store copies read the KV after the engine wrote it
    REUSE_AFTER_STORE = "reuse_after_store"  # the engine rewrites a block after the store read it
    LOAD_AFTER_READ = "load_after_read"  # a load overwrites blocks after the engine's earlier reads
    READ_AFTER_LOAD = "read_after_load"  # the engine reads loaded blocks after the load wrote them
    CHECK_AFTER_COPY = "check_after_copy"  # a load's check reads the staged rows after its copy wrote them


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    path: CopyPath = CopyPath.TORCH
    block_dim: int = 0
    chunk_bytes: int = 128 * 2**20  # bytes per staged copy chunk (GPU staging: 3 chunks)
    commit_bytes: int = 32 * 2**20  # bytes per reservation/commit unit (when commit_blocks is 0; a
    # kv-sketch-1 store, with nothing for the pool to re-verify, commits a copy chunk at a time)
    commit_blocks: int = 0  # blocks per commit unit; 0: from commit_bytes
    min_blocks: int = 1  # the pool's admission min_blocks (no admitted unit is shorter)
    hash_threads: int = 8
    register_host: bool = True  # False: pageable copies (the fallback, chosen explicitly)
    batched: bool = True  # driver path: cuMemcpyBatchAsync where the driver has it
    # How stores digest their pages: kv-sketch-1 on the GPU (the host reads 1/256 of the
    # bytes, the daemon trusts the commit and scrubs at rest), or xxh3-128 on the host over
    # the pages as copied (and the daemon's re-verify). Loads verify each page by its own kind.
    digest: DigestKind = DigestKind.SKETCH
    load_buffers: int = 3  # staging buffers of a sketch-verified load (copies run ahead of the checks)
    # CUDA graphs of a whole chunk's gather and scatter (one launch instead of one kernel per
    # layer: the host's launches, not the GPU, bound the copy rate otherwise); torch path,
    # blocks-first layouts. torch's stream sanitizer does not see inside graphs: its runs
    # turn them off.
    graphs: bool = True

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.commit_bytes <= 0 or self.hash_threads <= 0:
            raise InvalidRequest("chunk_bytes, commit_bytes and hash_threads must be positive")
        if self.commit_blocks < 0 or self.min_blocks < 1:
            raise InvalidRequest("commit_blocks must be >= 0 and min_blocks >= 1")
        if self.load_buffers < 2:
            raise InvalidRequest("load_buffers must be at least 2")
        object.__setattr__(self, "digest", DigestKind(self.digest))


@dataclasses.dataclass(frozen=True)
class TransferCapabilities:
    path: CopyPath
    device: str
    host_memory: HostMemory
    host_memory_reason: str  # why pageable (empty when registered)
    batched_copies: bool  # driver path: cuMemcpyBatchAsync in use
    batched_reason: str  # why not batched (empty when batched, or on the torch path)
    digest: str = DigestKind.XXH3.value  # how stores digest their pages
    sketch_impl: str = ""  # kv-sketch-1 on the GPU (stores, and loads' checks): "int8-mm" or "float64-mm"
    sketch_reason: str = ""  # why not int8-mm
    graphs: str = ""  # the CUDA graphs in use ("gather,scatter"), or why none


@dataclasses.dataclass(frozen=True)
class LayerBlock:
    """One layer's part of a block."""

    shape: tuple[int, ...]  # the block of this layer, as uint8 (last dim in bytes)
    nbytes: int
    page_offset: int  # where this layer's bytes start in the page
    block_stride: int  # bytes between consecutive blocks of this layer
    runs: tuple[tuple[int, int], ...]  # (offset from the block's first byte, length), in page order


@dataclasses.dataclass(frozen=True)
class KVLayout:
    block_dim: int
    num_blocks: int
    page_bytes: int
    layers: tuple[LayerBlock, ...]

    @property
    def min_run(self) -> int:
        return min(length for layer in self.layers for _, length in layer.runs)

    @classmethod
    def of(cls, layers: Sequence[torch.Tensor], block_dim: int) -> KVLayout:
        if not layers:
            raise KVLayoutError("no KV tensors")
        num_blocks = None
        out = []
        offset = 0
        for i, t in enumerate(layers):
            if not 0 <= block_dim < t.dim() - 1:
                raise KVLayoutError(f"layer {i}: block dim {block_dim} outside a {t.dim()}-d tensor (not the last dim)")
            if t.stride(-1) != 1:
                raise KVLayoutError(f"layer {i}: the last dimension must be contiguous, stride {t.stride(-1)}")
            if num_blocks is None:
                num_blocks = t.shape[block_dim]
            elif t.shape[block_dim] != num_blocks:
                raise KVLayoutError(f"layer {i} has {t.shape[block_dim]} blocks, layer 0 has {num_blocks}")
            es = t.element_size()
            shape = [s for k, s in enumerate(t.shape) if k != block_dim]
            strides = [s * es for k, s in enumerate(t.stride()) if k != block_dim]
            shape[-1] *= es  # as uint8
            strides[-1] = 1
            # the longest C-contiguous suffix of the block's dims: one run per outer index
            k = len(shape) - 1
            run = shape[-1]
            while k > 0 and strides[k - 1] == run:
                k -= 1
                run *= shape[k]
            outer = [range(n) for n in shape[:k]]
            runs = tuple((sum(j * s for j, s in zip(idx, strides[:k])), run) for idx in itertools.product(*outer))
            nbytes = math.prod(shape)
            out.append(LayerBlock(tuple(shape), nbytes, offset, t.stride(block_dim) * es, runs))
            offset += nbytes
        return cls(block_dim, int(num_blocks), offset, tuple(out))


def block_page(layers: Sequence[torch.Tensor], block_dim: int, block_id: int) -> torch.Tensor:
    """The page bytes of one block (uint8, on the layers' device): the definition of the
    page order."""
    return torch.cat([t.select(block_dim, block_id).contiguous().view(torch.uint8).reshape(-1) for t in layers])


# -- handles and outcomes -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class StoreOutcome:
    handle: int
    requested: int
    committed: int
    exists: int
    pending: int
    not_admitted: int
    no_capacity: int
    rejected: int  # the pool's re-verify found other bytes than the digest (never visible)
    errors: tuple[str, ...]  # pool errors met while reserving or committing
    bytes_committed: int
    seconds: float  # from store() to the last commit


@dataclasses.dataclass(frozen=True, slots=True)
class LoadOutcome:
    handle: int
    requested: int
    loaded: int  # leading blocks installed, verified, and not reused under the lease
    miss: Miss | None
    stale: tuple[int, ...]  # block indexes whose page was reused under the lease (all: the release failed)
    errors: tuple[str, ...]
    seconds: float  # from load() to the lease's release


class LoadHandle:
    """A load in flight. `loaded`, `miss`, `failed_block_ids` are final at load()'s return;
    `result` (a Future) resolves to the LoadOutcome once the lease is released."""

    __slots__ = ("id", "block_ids", "requested", "loaded", "miss", "result", "_done", "_future", "_t0")

    def __init__(self, hid: int, block_ids: tuple[int, ...], loaded: int, miss: Miss | None,
                 done: torch.cuda.Event, t0: float):
        self.id = hid
        self.block_ids = block_ids
        self.requested = len(block_ids)
        self.loaded = loaded
        self.miss = miss
        self._done = done
        self._future: cf.Future | None = None
        self._t0 = t0
        self.result: cf.Future = cf.Future()

    @property
    def failed_block_ids(self) -> tuple[int, ...]:
        """Blocks the engine must recompute (known when load() returns)."""
        return self.block_ids[self.loaded:]

    def __repr__(self) -> str:
        return f"LoadHandle(id={self.id}, requested={self.requested}, loaded={self.loaded}, miss={self.miss})"


@dataclasses.dataclass(slots=True)
class _Unit:
    """One reservation: committed as a whole on its lane."""

    lane: int
    reservation: ReserveResult
    pages: list[int]
    event: torch.cuda.Event | None = None  # the copy chunk holding its last page
    future: cf.Future | None = None
    # kv-sketch-1: the sketches' D2H of its last chunk, and where each page's sketch lands
    sketch_event: torch.cuda.Event | None = None
    host_sketch: torch.Tensor | None = None
    sketch_index: dict[int, int] = dataclasses.field(default_factory=dict)


class _PinnedSketches:
    """Pinned host buffers for the sketches of stores, reused: a store's buffer returns
    here once every commit that reads it finished. Pinned allocation costs about 0.6 ms
    per MiB (40 ms for the sketches of 4096 pages of 4 MiB), on the store's own path.
    Every write into a buffer is a copy on one kernel stream, so a buffer handed out
    again is written only after the copies of its previous store."""

    KEEP = 4

    def __init__(self, rows: int, least: int, pin: bool = True):
        self.rows = rows
        self.least = least
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.shape[0] >= n]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].shape[0]))
        cap = max(self.least, 1 << max(0, n - 1).bit_length())
        return torch.empty((cap, self.rows, SKETCH_COLS), dtype=torch.int32, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.KEEP:  # by index: == on tensors compares their elements
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].shape[0]))


class StoreHandle:
    """A store in flight; `result` (a Future) resolves to the StoreOutcome after the last
    commit."""

    __slots__ = ("id", "block_ids", "requested", "counts", "errors", "result", "_units", "_t0", "_sketch")

    def __init__(self, hid: int, block_ids: tuple[int, ...], t0: float):
        self.id = hid
        self.block_ids = block_ids
        self.requested = len(block_ids)
        self.counts = {s: 0 for s in SlotStatus}
        self.errors: list[str] = []
        self._units: list[_Unit] = []
        self._t0 = t0
        self._sketch: torch.Tensor | None = None  # its pinned sketch buffer, until the last commit
        self.result: cf.Future = cf.Future()

    def __repr__(self) -> str:
        return f"StoreHandle(id={self.id}, requested={self.requested}, reserved={self.counts[SlotStatus.RESERVED]})"


# -- host memory registration (process-wide, reference counted) ---------------------------------

_REG_LOCK = threading.Lock()
_REGISTERED: dict[int, list] = {}  # address -> [size, refcount, owned]


def _cudart():  # noqa: ANN202
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise HostRegistrationError(f"cuda-python (cuda.bindings) is not installed: {exc}") from exc
    return runtime


def _register(ptr: int, size: int) -> None:
    with _REG_LOCK:
        entry = _REGISTERED.get(ptr)
        if entry is not None:
            if entry[0] != size:
                raise HostRegistrationError(f"{ptr:#x} is registered with {entry[0]} bytes, not {size}")
            entry[1] += 1
            return
        rt = _cudart()
        (err,) = rt.cudaHostRegister(ptr, size, rt.cudaHostRegisterPortable)
        if err == rt.cudaError_t.cudaErrorHostMemoryAlreadyRegistered:
            _REGISTERED[ptr] = [size, 1, False]  # someone else's registration: never undo it
            return
        if err != rt.cudaError_t.cudaSuccess:
            raise HostRegistrationError(f"cudaHostRegister({size} bytes) failed: {err.name}")
        _REGISTERED[ptr] = [size, 1, True]


def _unregister(ptr: int) -> None:
    with _REG_LOCK:
        entry = _REGISTERED.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _REGISTERED[ptr]
        if entry[2]:
            rt = _cudart()
            (err,) = rt.cudaHostUnregister(ptr)
            if err != rt.cudaError_t.cudaSuccess:
                raise TransferError(f"cudaHostUnregister failed: {err.name}")


# -- the raw-pointer path ----------------------------------------------------------------------


class _Driver:
    """cuda-python driver calls on one stream; every CUresult checked."""

    def __init__(self, device_index: int):
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise TransferError(f"the driver path needs cuda-python (cuda.bindings): {exc}") from exc
        self.d = driver
        self.device_index = device_index
        self.ensure_context()
        self.batched = False
        self.batched_reason = ""
        self._attrs = None

    def check(self, result: Any, what: str) -> Any:  # noqa: ANN401 - cuda-python's tuples
        err = result[0]
        if err != self.d.CUresult.CUDA_SUCCESS:
            _, name = self.d.cuGetErrorName(err)
            raise TransferError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name} ({int(err)})")
        return result[1] if len(result) == 2 else result[1:]

    def ensure_context(self) -> None:
        """The primary context current on this thread (torch's runtime uses the same)."""
        ctx = self.check(self.d.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(ctx) == 0:
            self.check(self.d.cuInit(0), "cuInit")
            dev = self.check(self.d.cuDeviceGet(self.device_index), "cuDeviceGet")
            ctx = self.check(self.d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            self.check(self.d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def probe_batched(self, stream: torch.cuda.Stream, device: torch.device) -> None:
        """Try one small batched copy; use the batch API only if it copies the bytes."""
        if not hasattr(self.d, "cuMemcpyBatchAsync"):
            self.batched_reason = "cuMemcpyBatchAsync is not in this cuda-python"
            return
        attrs = self.d.CUmemcpyAttributes()
        attrs.srcAccessOrder = self.d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self._attrs = attrs
        src = torch.arange(256, dtype=torch.int32, device=device).view(torch.uint8)
        dst = torch.zeros(src.numel(), dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize(device)
        try:
            self.batch([dst.data_ptr()], [src.data_ptr()], [src.numel()], stream)
        except TransferError as exc:
            self.batched_reason = f"the probe copy failed: {exc}"
            return
        except TypeError as exc:  # a cuda-python whose signature differs from 13.x
            self.batched_reason = f"cuMemcpyBatchAsync signature: {exc}"
            return
        stream.synchronize()
        if not torch.equal(dst, src.cpu()):
            self.batched_reason = "the probe copy returned other bytes"
            return
        self.batched = True

    def batch(self, dsts: list[int], srcs: list[int], sizes: list[int], stream: torch.cuda.Stream) -> None:
        ptr = self.d.CUdeviceptr
        self.check(self.d.cuMemcpyBatchAsync([ptr(a) for a in dsts], [ptr(a) for a in srcs], sizes, len(sizes),
                                             [self._attrs], [0], 1, self.d.CUstream(stream.cuda_stream)),
                   f"cuMemcpyBatchAsync({len(sizes)} copies)")

    def copies(self, dsts: list[int], srcs: list[int], sizes: list[int], stream: torch.cuda.Stream,
               to_host: bool | None) -> None:
        """Copies on `stream`: device to host (to_host True), host to device (False), or
        device to device (None)."""
        if self.batched:
            self.batch(dsts, srcs, sizes, stream)
            return
        h = self.d.CUstream(stream.cuda_stream)
        ptr = self.d.CUdeviceptr
        if to_host is None:
            for a, b, n in zip(dsts, srcs, sizes):
                self.check(self.d.cuMemcpyDtoDAsync(ptr(a), ptr(b), n, h), "cuMemcpyDtoDAsync")
        elif to_host:
            for a, b, n in zip(dsts, srcs, sizes):
                self.check(self.d.cuMemcpyDtoHAsync(a, ptr(b), n, h), "cuMemcpyDtoHAsync")
        else:
            for a, b, n in zip(dsts, srcs, sizes):
                self.check(self.d.cuMemcpyHtoDAsync(ptr(a), b, n, h), "cuMemcpyHtoDAsync")


class _IndexRing:
    """Block ids for the gather/scatter kernels of one stream, without allocating: a pinned
    host ring and a device ring, both allocated once. A host slot is rewritten only after
    the upload that read it completed (the host waits, which only happens when more ids
    than the ring holds are in flight); the device slot is reused in stream order."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream, capacity: int):
        self.capacity = capacity
        self.stream = stream
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.host_np = self.host.numpy()
        with torch.cuda.stream(stream):
            self.dev = torch.empty(capacity, dtype=torch.int64, device=device)
        self.pos = 0
        self.inflight: deque[tuple[int, int, torch.cuda.Event]] = deque()

    def upload(self, ids: Sequence[int]) -> torch.Tensor:
        n = len(ids)
        if n > self.capacity:
            raise TransferError(f"{n} block ids in one chunk; the index ring holds {self.capacity}")
        if self.pos + n > self.capacity:
            self.pos = 0
        a, b = self.pos, self.pos + n
        while self.inflight and self.inflight[0][2].query():
            self.inflight.popleft()
        for start, stop, event in self.inflight:
            if start < b and a < stop:
                event.synchronize()
        self.host_np[a:b] = ids
        out = self.dev[a:b]
        out.copy_(self.host[a:b], non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        self.inflight.append((a, b, event))
        self.pos = b
        return out


# -- the engine ----------------------------------------------------------------------------------


_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _widest_views(layers_u8: Sequence[torch.Tensor], layout: KVLayout) -> tuple[int, list[torch.Tensor]]:
    """The KV tensors as the widest integers their rows allow (the gathers and scatters
    move 8 bytes per element instead of 1): (bytes per element, the views)."""
    for width, dtype in _WIDTHS:
        if any(lb.shape[-1] % width for lb in layout.layers):
            continue
        try:
            return width, [t.view(dtype) for t in layers_u8]
        except RuntimeError:  # a storage offset not aligned to the width
            continue
    return 1, list(layers_u8)


def _as_width(buf: torch.Tensor, width: int) -> torch.Tensor:
    return buf if width == 1 else buf.view(dict(_WIDTHS)[width])


def _require_cuda(layers: Sequence[torch.Tensor]) -> torch.device:
    devices = {t.device for t in layers}
    if len(devices) != 1:
        raise KVLayoutError(f"KV tensors on several devices: {sorted(map(str, devices))}")
    (device,) = devices
    if device.type != "cuda":
        raise KVLayoutError(f"KV tensors on {device}; the GPU transfer engine needs CUDA tensors")
    return device


def _host_event() -> torch.cuda.Event:
    """An event a host thread waits for: blocking-sync, so the waiting thread sleeps in the
    driver (no spinning, no GIL held) instead of polling."""
    event = torch.cuda.Event(blocking=True)
    event.kvpool_blocking = True
    return event


@functools.cache
def _event_sync() -> Any:  # noqa: ANN401 - a ctypes function, or None
    """cudaEventSynchronize of the CUDA runtime this process loaded (found in its maps),
    called through ctypes: the GIL is released while it waits, and the wait is not one of
    torch's (a background thread's wait is no ordering for the thread that enqueues, and
    torch's stream sanitizer must not take it for one). None: not found (the caller polls)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            fn = ctypes.CDLL(path).cudaEventSynchronize
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    return None


def _await_event(event: torch.cuda.Event, poll_s: float = _EVENT_POLL_S) -> None:
    sync = _event_sync() if getattr(event, "kvpool_blocking", False) else None
    if sync is not None:
        err = sync(event.cuda_event)
        if err != 0:
            raise TransferError(f"cudaEventSynchronize failed: error {err}")
        return
    while not event.query():
        time.sleep(poll_s)


def check_plan(kinds: Sequence[DigestKind]) -> tuple[bool, bool]:
    """(sketch on the GPU, read back to the host): the check-stream work a chunk of pages
    of these kinds needs. Every page is checked over what arrived in GPU memory: a
    kv-sketch-1 page by the GPU's sketch of its staged row, an xxh3-128 page by XXH3-128
    over its staged row read back into private pinned memory."""
    return DigestKind.SKETCH in kinds, DigestKind.XXH3 in kinds


def arrived_digests(kinds: Sequence[DigestKind], sketches: np.ndarray | None, readback: np.ndarray | None,
                    page_bytes: int, mapper=map) -> list[bytes]:  # noqa: ANN001 - map or Executor.map
    """Per page, its digest by its kind from what arrived: `sketches` (int32 (pages, rows,
    SKETCH_COLS), the GPU's sketches of the staged rows; needed if any page is kv-sketch-1)
    and `readback` (uint8 (pages, >= page_bytes), the staged rows read back; needed if any
    is xxh3-128), row i for page i. `mapper` runs the XXH3-128s (a thread pool's map)."""
    out: list[bytes | None] = [None] * len(kinds)
    sk = [i for i, k in enumerate(kinds) if k is DigestKind.SKETCH]
    xx = [i for i, k in enumerate(kinds) if k is DigestKind.XXH3]
    if len(sk) + len(xx) != len(kinds):
        raise InvalidRequest(f"unknown digest kinds among {sorted(set(map(str, kinds)))}")
    if sk:
        if sketches is None or sketches.shape[0] < len(kinds):
            raise InvalidRequest("kv-sketch-1 pages without the sketches of what arrived")
        for i, d in zip(sk, sketch_digests(sketches[sk], page_bytes)):
            out[i] = d
    if xx:
        if readback is None or readback.shape[0] < len(kinds) or readback.shape[1] < page_bytes:
            raise InvalidRequest("xxh3-128 pages without the read-back of what arrived")
        for i, d in zip(xx, mapper(lambda i: page_digest(readback[i, :page_bytes]), xx)):
            out[i] = d
    return out  # type: ignore[return-value]


class TransferEngine:
    def __init__(self, backend: PoolBackend, ns: Namespace, layers: Sequence[torch.Tensor],
                 config: TransferConfig = TransferConfig(), lanes: Sequence[PoolBackend] = ()):
        self.device = _require_cuda(layers)
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
                                "(a PoolClient on the daemon's host, zero_copy=True)")
        if self.layout.page_bytes > arena.page_size:
            raise KVLayoutError(f"a block is {self.layout.page_bytes} bytes, the pool's pages {arena.page_size}")
        self._layers = list(layers)
        self._layers_u8 = [t.view(torch.uint8) for t in layers]
        self._width, self._layers_w = _widest_views(self._layers_u8, self.layout)
        self._map_region(arena)
        self.reattached = 0  # times the engine moved to a new segment of its pool (a pool restart)
        self._lanes: list[PoolBackend] = list(lanes) or [backend]
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
                _unregister(self._region_ptr)
            raise
        self._hash_pool = cf.ThreadPoolExecutor(config.hash_threads, thread_name_prefix="kvpool-digest")
        self._lane_exec = [cf.ThreadPoolExecutor(1, thread_name_prefix=f"kvpool-commit{i}")
                           for i in range(len(self._lanes))]
        self._release_exec = cf.ThreadPoolExecutor(1, thread_name_prefix="kvpool-release")
        self._lane_busy = [0] * len(self._lanes)
        self._lane_committing = [0] * len(self._lanes)
        self._lane_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._inflight: dict[int, StoreHandle | LoadHandle] = {}
        self._closed = False

    def _map_region(self, arena) -> None:  # noqa: ANN001 - the backend's Arena
        self._arena = arena
        self._page_size = arena.page_size
        self._region_np = arena.pages_region  # holds the mapping alive while the engine uses it
        self._region_ptr = int(self._region_np.ctypes.data)
        self._region = torch.frombuffer(self._region_np, dtype=torch.uint8)

    def _register_region(self) -> None:
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
        arena = getattr(self.backend, "arena", None)
        if arena is None or arena.instance == self._arena.instance:
            return  # unmapped (the op's own call will fail or reconnect), or the same segment
        if self.layout.page_bytes > arena.page_size:
            raise KVLayoutError(f"the restarted pool's pages are {arena.page_size} bytes, a block "
                                f"{self.layout.page_bytes}")
        self.drain()  # what is in flight read or wrote the old segment: let it end first
        torch.cuda.synchronize(self.device)  # every stream of the engine: nothing reads the old pages
        if self._registered:
            self._registered = False
            _unregister(self._region_ptr)
        log.warning("kvpool GPU transfer: the pool's segment changed (a restart): re-registering its pages")
        self._map_region(arena)
        self._register_region()
        self.capabilities = dataclasses.replace(
            self.capabilities, host_memory=HostMemory.REGISTERED if self._registered else HostMemory.PAGEABLE,
            host_memory_reason=self._host_reason)
        self.reattached += 1

    def _init_path(self, layers: Sequence[torch.Tensor]) -> None:
        """The copy path's resources (staging buffers, or the driver and its batch probe)."""
        config, pb = self.config, self.layout.page_bytes
        self._driver: _Driver | None = None
        batched, batched_reason = False, ""
        if config.path == CopyPath.DRIVER:
            if self.layout.min_run < MIN_RUN_BYTES:
                raise KVLayoutError(f"the driver path copies contiguous runs; this layout has runs of "
                                    f"{self.layout.min_run} bytes (use the torch path)")
            self._driver = _Driver(self.device.index if self.device.index is not None else torch.cuda.current_device())
            if not config.batched:
                batched_reason = "disabled by TransferConfig.batched=False"
            elif not self._registered:
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
                self._store_ring = _IndexRing(self.device, self.store_stream, ring)
        self._sketcher: Sketcher | None = None  # kv-sketch-1 stores (None: xxh3-128 stores)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # stage address -> (graph, its ids)
        self._init_load(layers)
        if config.digest is DigestKind.SKETCH:
            self._init_sketch(layers)
        self._graphs_note = self._init_graphs()
        self.capabilities = TransferCapabilities(
            config.path, torch.cuda.get_device_name(self.device),
            HostMemory.REGISTERED if self._registered else HostMemory.PAGEABLE, self._host_reason, batched,
            batched_reason, config.digest.value, self._sketch_gpu.impl, self._sketch_gpu.reason, self._graphs_note)

    def _init_load(self, layers: Sequence[torch.Tensor]) -> None:
        """The resources of loads (every engine, every digest kind): `load_buffers` staging
        buffers whose rows are padded to whole sketch rows (zero, never written past the
        page), the GPU sketcher and its device and host outputs, and per buffer a pinned
        host buffer the staged rows of xxh3-128 pages are read back into (allocated here
        on an engine that stores xxh3-128, on the first such page otherwise). Three
        streams: copies (load_stream), checks (sketches, read-backs), installs."""
        pb, cp = self.layout.page_bytes, self._chunk_pages
        dev = self.device
        self._sketch_gpu = Sketcher(dev)
        self._sk_rows = sketch_rows(pb)
        width = staged_width(pb)
        n = self.config.load_buffers
        with torch.cuda.device(dev):
            self._load_k = torch.cuda.Stream(dev)  # checks of loads: sketches and read-backs of what arrived
            self._load_s = torch.cuda.Stream(dev)  # installs of verified chunks
        with torch.cuda.device(dev), torch.cuda.stream(self._load_k):
            self._sk_load_stage = [torch.zeros((cp, width), dtype=torch.uint8, device=dev) for _ in range(n)]
            self._sk_load_dev = [torch.empty((cp * self._sk_rows, SKETCH_COLS), dtype=torch.int32, device=dev)
                                 for _ in range(n)]
            # per buffer, the host's copy of its chunk's sketches: written only on the check
            # stream (in order), read by the host after that chunk's event
            self._sk_load_host = [torch.empty((cp, self._sk_rows, SKETCH_COLS), dtype=torch.int32, pin_memory=True)
                                  for _ in range(n)]
            self._sk_load_host_np = [h.numpy() for h in self._sk_load_host]
        self._readback: list[torch.Tensor | None] = [None] * n
        if self.config.digest is DigestKind.XXH3:
            for b in range(n):
                self._readback_buffer(b)
        with torch.cuda.device(dev), torch.cuda.stream(self._load_s):  # the scatters' ids (torch path)
            self._sk_scatter_ring = _IndexRing(dev, self._load_s, max(4096, 4 * cp))
        self._load_free: list[torch.cuda.Event | None] = [None] * n  # per buffer: its last install
        self._load_sketched: list[torch.cuda.Event | None] = [None] * n  # per buffer: its last check
        torch.cuda.synchronize(dev)  # the zeroed staging rows exist before any copy writes them

    def _readback_buffer(self, b: int) -> torch.Tensor:
        """Staging buffer b's pinned host twin for xxh3-128 checks, allocated once."""
        buf = self._readback[b]
        if buf is None:
            buf = self._readback[b] = torch.empty((self._chunk_pages, self.layout.page_bytes), dtype=torch.uint8,
                                                  pin_memory=True)
        return buf

    def _init_sketch(self, layers: Sequence[torch.Tensor]) -> None:
        """kv-sketch-1 stores' resources: a kernel stream (gathers and sketches run beside
        the copies), staging rows padded to whole sketch rows (zero, and never written
        past the page), device and host sketch buffers."""
        pb, cp = self.layout.page_bytes, self._chunk_pages
        self._sketcher = self._sketch_gpu
        width = staged_width(pb)
        ring = max(4096, 4 * cp)
        largest = max(lb.nbytes for lb in self.layout.layers)
        dev = self.device
        with torch.cuda.device(dev):
            self._store_k = torch.cuda.Stream(dev)  # gathers and sketches of stores
        with torch.cuda.device(dev), torch.cuda.stream(self._store_k):
            self._sk_store_stage = [torch.zeros((cp, width), dtype=torch.uint8, device=dev) for _ in range(2)]
            self._sk_store_dev = [torch.empty((cp * self._sk_rows, SKETCH_COLS), dtype=torch.int32, device=dev)
                                  for _ in range(2)]
            self._sk_store_scratch = torch.empty(cp * largest, dtype=torch.uint8, device=dev)
            self._sk_store_ring = _IndexRing(dev, self._store_k, ring)
        self._store_sketches = _PinnedSketches(self._sk_rows, cp)
        self._store_buf = 0
        self._store_free: list[torch.cuda.Event | None] = [None, None]
        torch.cuda.synchronize(dev)  # the zeroed staging rows exist before any copy writes them

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
                views = self._layer_rows(_as_width(stage, w), cp)
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
        """The stream whose work writes the blocks of a load (the installs of verified
        chunks, on either path and for pages of either kind)."""
        return self._load_s

    # -- the ordering edges (one hook, so a control can drop one) -----------------------------
    def _order(self, edge: OrderingEdge, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def _register_host(self, ptr: int, size: int) -> None:
        _register(ptr, size)

    def _await_copy(self, event: torch.cuda.Event) -> None:
        """Block this (worker) thread until the copies before `event` completed."""
        _await_event(event, _COMMIT_POLL_S)

    def _verified(self, got: Sequence[bytes], expected: Sequence[bytes]) -> int:
        """How many leading pages of a chunk match their digests (a sketched load's check)."""
        return next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), len(got))

    # -- helpers --------------------------------------------------------------------------
    def _check_ids(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> tuple[int, ...]:
        if self._closed:
            raise TransferError("the transfer engine is closed")
        ids = tuple(int(b) for b in block_ids)
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
        start = page * self._page_size
        return self._region_np[start : start + (self.layout.page_bytes if length is None else length)]

    def _digest(self, page: int, kind: DigestKind = DigestKind.XXH3) -> bytes:
        return page_digest(self._page_np(page), kind)

    def _index(self, ids: Sequence[int], ring: _IndexRing) -> torch.Tensor:
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

    # -- copies -----------------------------------------------------------------------------
    def _driver_lists(self, block_ids: Sequence[int], pages: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """(host addresses, device addresses, sizes) of every run of every layer of the blocks."""
        ps = self._page_size
        host: list[int] = []
        dev: list[int] = []
        sizes: list[int] = []
        for lb, base in zip(self.layout.layers, self._layer_ptrs):
            for b, p in zip(block_ids, pages):
                block_at = base + b * lb.block_stride
                page_at = self._region_ptr + p * ps + lb.page_offset
                for off, n in lb.runs:
                    dev.append(block_at + off)
                    host.append(page_at)
                    sizes.append(n)
                    page_at += n
        return host, dev, sizes

    def _copy_out(self, block_ids: Sequence[int], pages: Sequence[int]) -> torch.cuda.Event:
        """Blocks -> pages, enqueued on the current stream (the store stream). Returns an
        event recorded once the KV has been read (after the gather on the torch path,
        after the copies themselves on the driver path)."""
        read = torch.cuda.Event()
        if self._driver is not None:
            host, dev, sizes = self._driver_lists(block_ids, pages)
            self._driver.copies(host, dev, sizes, self.store_stream, to_host=True)
            read.record(self.store_stream)
            return read
        n = len(block_ids)
        idx = self._index(block_ids, self._store_ring)
        stage = self._store_stage
        d = self.layout.block_dim
        for lb, layer in zip(self.layout.layers, self._layers_u8):
            picked_shape = (*lb.shape[:d], n, *lb.shape[d:])
            picked = self._gather_scratch[: n * lb.nbytes].view(picked_shape)
            torch.index_select(layer, d, idx, out=picked)
            stage[:n, lb.page_offset : lb.page_offset + lb.nbytes].view(n, *lb.shape).copy_(picked.movedim(d, 0))
        read.record(self.store_stream)
        for row, page, k in self._runs(pages):
            self._host_rows(page, k).copy_(stage[row : row + k].reshape(-1), non_blocking=True)
        return read

    def _h2d(self, pages: Sequence[int], stage: torch.Tensor) -> None:
        """Pages -> rows of `stage` (one row per page, any row width), on the current stream
        (driver path: driver copies)."""
        pb = self.layout.page_bytes
        if self._driver is not None:
            ps, w, at = self._page_size, stage.stride(0), stage.data_ptr()
            runs = self._runs(pages) if w == pb else [(row, page, 1) for row, page in enumerate(pages)]
            self._driver.copies([at + row * w for row, _, _ in runs],
                                [self._region_ptr + page * ps for _, page, _ in runs],
                                [(k - 1) * ps + pb for _, _, k in runs], torch.cuda.current_stream(), to_host=False)
            return
        if stage.shape[1] == pb:
            for row, page, k in self._runs(pages):
                stage[row : row + k].reshape(-1).copy_(self._host_rows(page, k), non_blocking=True)
            return
        for row, page in enumerate(pages):
            stage[row, :pb].copy_(self._host_rows(page, 1), non_blocking=True)

    def _d2h(self, stage: torch.Tensor, pages: Sequence[int]) -> None:
        """Rows of `stage` -> pages, on the current stream."""
        pb = self.layout.page_bytes
        if stage.shape[1] == pb:
            for row, page, k in self._runs(pages):
                self._host_rows(page, k).copy_(stage[row : row + k].reshape(-1), non_blocking=True)
            return
        for row, page in enumerate(pages):
            self._host_rows(page, 1).copy_(stage[row, :pb], non_blocking=True)

    def _gather(self, block_ids: Sequence[int], stage: torch.Tensor, scratch: torch.Tensor, ring: _IndexRing) -> None:
        """Blocks -> rows of `stage` in page order, on the current stream (the ring's)."""
        n = len(block_ids)
        idx = self._index(block_ids, ring)
        if self._replay(stage, idx):
            return
        d, w = self.layout.block_dim, self._width
        stage_w, scratch_w = _as_width(stage, w), _as_width(scratch, w)
        for lb, layer in zip(self.layout.layers, self._layers_w):
            shape = (*lb.shape[:-1], lb.shape[-1] // w)
            rows = stage_w[:n, lb.page_offset // w : (lb.page_offset + lb.nbytes) // w].view(n, *shape)
            if d == 0:  # blocks first: the selection lands in the staged rows as it is (one kernel)
                torch.index_select(layer, 0, idx, out=rows)
                continue
            picked = scratch_w[: n * lb.nbytes // w].view((*shape[:d], n, *shape[d:]))
            torch.index_select(layer, d, idx, out=picked)
            rows.copy_(picked.movedim(d, 0))

    def _sketch_to_host(self, stage: torch.Tensor, n: int, dev_out: torch.Tensor, host: torch.Tensor) -> None:
        """The sketches of the first `n` rows of `stage` -> `host` (int32 (n, rows, cols)),
        on the current stream."""
        rows = n * self._sk_rows
        out = self._sketch_gpu.sketch(stage[:n].view(rows, SKETCH_ROW), out=dev_out[:rows])
        host.view(rows, SKETCH_COLS).copy_(out, non_blocking=True)

    def _scatter(self, block_ids: Sequence[int], buf: int, stage: torch.Tensor | None = None,
                 ring: _IndexRing | None = None) -> None:
        """A load staging buffer -> blocks (torch path), on the current stream."""
        n = len(block_ids)
        if not n:
            return
        idx = self._index(block_ids, ring or self._sk_scatter_ring)
        stage = self._sk_load_stage[buf] if stage is None else stage
        if self._replay(stage, idx):
            return
        stage = _as_width(stage, self._width)
        d, w = self.layout.block_dim, self._width
        for lb, layer in zip(self.layout.layers, self._layers_w):
            shape = (*lb.shape[:-1], lb.shape[-1] // w)
            src = stage[:n, lb.page_offset // w : (lb.page_offset + lb.nbytes) // w].view(n, *shape).movedim(0, d)
            layer.index_copy_(d, idx, src)

    def _read_back(self, stage: torch.Tensor, n: int, host: torch.Tensor) -> None:
        """The first `n` rows of `stage` (page bytes, no padding) -> `host` (pinned, (n,
        page_bytes)), on the current stream: what arrived, for a check on the host."""
        pb = self.layout.page_bytes
        if stage.shape[1] == pb:
            host[:n].copy_(stage[:n], non_blocking=True)
            return
        for row in range(n):
            host[row].copy_(stage[row, :pb], non_blocking=True)

    def _install(self, block_ids: Sequence[int], buf: int) -> None:
        """Load staging buffer `buf`'s first rows -> the blocks, on the current stream (the
        install stream): the scatter kernels (torch path) or driver copies device to device,
        one per (layer, block, contiguous run) (driver path)."""
        if not block_ids:
            return
        stage = self._sk_load_stage[buf]
        if self._driver is None:
            self._scatter(block_ids, buf, stage, self._sk_scatter_ring)
            return
        w, at = stage.stride(0), stage.data_ptr()
        dst: list[int] = []
        src: list[int] = []
        sizes: list[int] = []
        for lb, base in zip(self.layout.layers, self._layer_ptrs):
            for row, b in enumerate(block_ids):
                block_at = base + b * lb.block_stride
                row_at = at + row * w + lb.page_offset
                for off, n in lb.runs:
                    dst.append(block_at + off)
                    src.append(row_at)
                    sizes.append(n)
                    row_at += n
        self._driver.copies(dst, src, sizes, torch.cuda.current_stream(), to_host=None)

    def _arrived_digests(self, buf: int, kinds: Sequence[DigestKind]) -> list[bytes]:
        """The digests, by each page's kind, of what arrived in staging buffer `buf` (rows
        in chunk order), taken from the check stream's outputs once its event completed:
        kv-sketch-1 from the sketches the GPU took of the staged rows, xxh3-128 over the
        staged rows read back into pinned host memory. Never the pool's shared page."""
        n = len(kinds)
        sketches = self._sk_load_host_np[buf][:n] if DigestKind.SKETCH in kinds else None
        readback = self._readback[buf].numpy()[:n] if DigestKind.XXH3 in kinds else None
        return arrived_digests(kinds, sketches, readback, self.layout.page_bytes, self._hash_pool.map)

    # -- store ------------------------------------------------------------------------------
    def _plan_units(self, n: int, boundary: int | None) -> list[tuple[int, int, int | None]]:
        """[start, stop) and the reservation's boundary of each commit unit."""
        limit = n if boundary is None else max(0, min(boundary, n))
        size = self._unit_blocks
        units: list[tuple[int, int, int | None]] = []
        start = 0
        while start < limit:
            stop = start + size if limit - start >= 2 * size else limit
            units.append((start, stop, None))
            start = stop
        if limit < n:
            units.append((limit, n, 0))
        return units

    def store(self, block_ids: Sequence[int], hashes: Sequence[bytes], boundary: int | None = None) -> StoreHandle:
        ids = self._check_ids(block_ids, hashes)
        self._follow_segment()
        handle = StoreHandle(next(self._ids), ids, time.monotonic())
        pb = self.layout.page_bytes
        with torch.cuda.device(self.device):
            if self._driver is not None:
                self._driver.ensure_context()
            engine = torch.cuda.current_stream(self.device)
            written = torch.cuda.Event()
            written.record(engine)
            pending: list[tuple[int, int, _Unit]] = []  # (block id, page, unit) not yet copied
            self._kv_read: list[torch.cuda.Event] = []  # the last chunk's "KV read" events
            if self._sketcher is not None:
                self._store_sketch = handle._sketch = self._store_sketches.take(len(ids))
                self._store_sketched = 0
            try:
                with torch.cuda.stream(self.store_stream):
                    self._order(OrderingEdge.STORE_AFTER_WRITE, self.store_stream, written)
                    if self._sketcher is not None:
                        self._order(OrderingEdge.STORE_AFTER_WRITE, self._store_k, written)
                    for start, stop, unit_boundary in self._plan_units(len(ids), boundary):
                        lane = self._pick_lane()
                        try:
                            res = self._lanes[lane].reserve(self.ns, hashes[start:stop], [pb] * (stop - start),
                                                            unit_boundary)
                        except PoolError as exc:  # refused, or the connection failed: what is copying still commits
                            self._lane_done(lane)
                            handle.errors.append(f"reserve: {type(exc).__name__}: {exc}")
                            break
                        if self._segment(self._lanes[lane]) not in (None, self._arena.instance):
                            # The lane reconnected to a restarted pool: its pages are in another segment.
                            self._abort(_Unit(lane, res, []))
                            handle.errors.append("reserve: the pool restarted (a new segment); the next store "
                                                 "re-registers it")
                            break
                        unit = _Unit(lane, res, [])
                        for k, slot in enumerate(res.slots):
                            handle.counts[slot.status] += 1
                            if slot.status == SlotStatus.RESERVED:
                                unit.pages.append(slot.page)
                                pending.append((ids[start + k], slot.page, unit))
                        if not unit.pages:
                            self._lane_done(lane)
                            continue
                        handle._units.append(unit)
                        while len(pending) >= self._chunk_pages:
                            self._issue_store_chunk(pending[: self._chunk_pages])
                            pending = pending[self._chunk_pages :]
                    if pending:
                        self._issue_store_chunk(pending)
                    kv_read = self._kv_read
                    if not kv_read:  # nothing was copied
                        kv_read = [torch.cuda.Event()]
                        kv_read[0].record(self.store_stream)
                    self._kv_read = []
                for event in kv_read:
                    self._order(OrderingEdge.REUSE_AFTER_STORE, engine, event)
            except BaseException:
                # Nothing enqueued can be trusted: let it finish, give every page back, re-raise.
                self.store_stream.synchronize()
                if self._sketcher is not None:
                    self._store_k.synchronize()
                for unit in handle._units:
                    self._abort(unit)
                raise
        for unit in handle._units:
            unit.future = self._lane_exec[unit.lane].submit(self._finish_unit, unit)
        self._watch(handle)
        return handle

    def _issue_store_chunk(self, entries: list[tuple[int, int, _Unit]]) -> None:
        entries = sorted(entries, key=lambda e: e[1])  # ascending pages: consecutive ones copy as one
        if self._sketcher is not None:
            self._issue_store_chunk_sketched(entries)
            return
        self._kv_read = [self._copy_out([e[0] for e in entries], [e[1] for e in entries])]
        event = _host_event()
        event.record(self.store_stream)
        for _, _, unit in entries:
            unit.event = event  # chunks complete in order: the last one holding a page wins

    def _issue_store_chunk_sketched(self, entries: list[tuple[int, int, _Unit]]) -> None:
        """One chunk of a store digested on the GPU. Kernel stream: gather the blocks into a
        staging buffer (page order), sketch it, copy the sketches to the host. Copy stream:
        the pages to the arena (from the staging buffer; on the driver path straight from
        the KV tensors). Two staging buffers: a gather waits for the copy that last read its
        buffer, so gathers and sketches run beside the copies."""
        n = len(entries)
        ids, pages = [e[0] for e in entries], [e[1] for e in entries]
        b = self._store_buf
        self._store_buf ^= 1
        stage, dev_out = self._sk_store_stage[b], self._sk_store_dev[b]
        base = self._store_sketched
        self._store_sketched += n
        host = self._store_sketch[base : base + n]
        with torch.cuda.stream(self._store_k):
            free = self._store_free[b]
            if free is not None:
                self._store_k.wait_event(free)
            self._gather(ids, stage, self._sk_store_scratch, self._sk_store_ring)
            gathered = torch.cuda.Event()
            gathered.record(self._store_k)
            self._sketch_to_host(stage, n, dev_out, host)
            sketched = _host_event()
            sketched.record(self._store_k)
        if self._driver is not None:
            host_at, dev_at, sizes = self._driver_lists(ids, pages)
            self._driver.copies(host_at, dev_at, sizes, self.store_stream, to_host=True)
            read = torch.cuda.Event()
            read.record(self.store_stream)
            self._kv_read = [gathered, read]  # both read the KV
        else:
            self.store_stream.wait_event(gathered)  # the staged pages are complete
            self._d2h(stage, pages)
            self._kv_read = [gathered]
        event = _host_event()
        event.record(self.store_stream)
        if self._driver is None:
            self._store_free[b] = event  # the next gather into this buffer waits for these copies
        for row, (_, page, unit) in enumerate(entries):
            unit.event = event
            unit.sketch_event = sketched
            unit.host_sketch = self._store_sketch
            unit.sketch_index[page] = base + row

    def _abort(self, unit: _Unit) -> None:
        try:
            self._lanes[unit.lane].abort(unit.reservation.reservation_id)
        except PoolError as exc:  # the daemon reclaims it at the TTL or when the connection drops
            log.warning("abort of reservation %d failed: %s: %s", unit.reservation.reservation_id,
                        type(exc).__name__, exc)
        finally:
            self._lane_done(unit.lane)

    def _finish_unit(self, unit: _Unit) -> tuple[int, int, str | None]:
        """(committed, rejected, error) of one reservation, on its lane's thread."""
        try:
            self._await_copy(unit.event)
            if unit.host_sketch is not None:
                self._await_copy(unit.sketch_event)
                sk = unit.host_sketch.numpy()
                rows = [unit.sketch_index[p] for p in unit.pages]
                digests = sketch_digests(sk[rows], self.layout.page_bytes)
                kind = DigestKind.SKETCH
            else:
                digests = list(self._hash_pool.map(self._digest, unit.pages))
                kind = DigestKind.XXH3
            with self._lane_lock:
                self._lane_committing[unit.lane] += 1
            try:
                out = self._lanes[unit.lane].commit(unit.reservation.reservation_id, digests, kind)
            finally:
                with self._lane_lock:
                    self._lane_committing[unit.lane] -= 1
        except PoolError as exc:
            self._abort(unit)
            return 0, 0, f"commit: {type(exc).__name__}: {exc}"
        except BaseException:
            self._abort(unit)
            raise
        self._lane_done(unit.lane)
        return out.committed, len(out.rejected), None

    # -- load -------------------------------------------------------------------------------
    def load(self, block_ids: Sequence[int], hashes: Sequence[bytes], deadline_s: float | None = None) -> LoadHandle:
        ids = self._check_ids(block_ids, hashes)
        self._follow_segment()
        t0 = time.monotonic()
        with torch.cuda.device(self.device):
            if self._driver is not None:
                self._driver.ensure_context()
            engine = torch.cuda.current_stream(self.device)
            read = torch.cuda.Event()
            read.record(engine)
            done = _host_event()
            bound = getattr(self.backend, "call_deadline", None)  # the acquire ends within the load's deadline
            try:
                with bound(deadline_s) if bound is not None and deadline_s is not None else contextlib.nullcontext():
                    lease = self.backend.acquire(self.ns, hashes)
            except PoolTimeout:
                done.record(engine)
                return self._finished_load(ids, Miss(0, MissCause.TIMEOUT), done, t0)
            except (TransportError, LeaseLost, MalformedFrame):
                done.record(engine)
                return self._finished_load(ids, Miss(0, MissCause.TRANSPORT_ERROR), done, t0)
            if self._segment(self.backend) != self._arena.instance:
                # The acquire reconnected to a restarted pool: the lease is on pages of another segment.
                if lease.lease_id:
                    try:
                        self.backend.release(lease.lease_id)
                    except PoolError as exc:  # the daemon reaps it at the TTL or when the connection drops
                        log.warning("release of lease %d after a pool restart failed: %s", lease.lease_id, exc)
                done.record(engine)
                return self._finished_load(ids, Miss(0, MissCause.TRANSPORT_ERROR), done, t0)
            hits = lease.hits
            miss = lease.miss
            try:
                if any(n != self.layout.page_bytes for n in hits.lengths):
                    raise KVLayoutError(f"the pool holds pages of {sorted(set(hits.lengths))} bytes under this "
                                        f"namespace; a block here is {self.layout.page_bytes}")
                if len(hits):
                    loaded, stop = self._copy_in(ids, hits, t0, deadline_s, read, done)
                else:
                    loaded, stop = 0, None
                    done.record(engine)
            except BaseException:
                self.load_stream.synchronize()  # the lease outlives every copy that reads its pages
                self._load_k.synchronize()
                self._load_s.synchronize()
                self._release(lease)
                raise
            if stop is not None:
                miss = stop
        handle = LoadHandle(next(self._ids), ids, loaded, miss, done, t0)
        handle._future = self._release_exec.submit(self._finish_load, handle, lease)
        self._watch(handle)
        return handle

    def _copy_in(self, ids: tuple[int, ...], hits, t0: float, deadline_s: float | None,  # noqa: ANN001
                 read: torch.cuda.Event, done: torch.cuda.Event) -> tuple[int, Miss | None]:
        """Install leased pages, each verified over the bytes that arrived in GPU memory;
        (blocks installed, why it stopped early). Per chunk: the copy stream brings the
        pages into a staging buffer (torch copies, or driver copies on the driver path);
        the check stream, after that copy, sketches the staged rows (kv-sketch-1 pages)
        and reads the staged rows back into pinned host memory (xxh3-128 pages); the host
        waits for that, digests what arrived by each page's kind, and compares; only then
        the install stream writes the verified prefix from the same staged rows into the
        blocks (scatter kernels, or driver copies). A staged row is written only by its
        chunk's copy, so the bytes installed are the bytes checked; the pool's shared
        page, which other processes can write, is never read by the host here.
        `load_buffers` staging buffers: copies run that many chunks ahead of the checks.
        `done` is recorded once every copy reading the pages and every kernel or copy
        touching the staged rows and the blocks is enqueued."""
        n = len(hits)
        pages = list(hits.pages)
        kinds = [hits.kind(i) for i in range(n)]
        expected = [hits.digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] for i in range(n)]
        chunks = [range(a, min(a + self._chunk_pages, n)) for a in range(0, n, self._chunk_pages)]
        nbuf = len(self._sk_load_stage)
        copied: list[torch.cuda.Event] = []
        checked: list[torch.cuda.Event] = []
        installed = self._load_free  # per buffer: the last install that read it (this load's or an earlier one's)
        check_read = self._load_sketched  # per buffer: the last check (sketch, read-back) that read it
        self._order(OrderingEdge.LOAD_AFTER_READ, self._load_s, read)  # the installs write the blocks

        def issue(i: int) -> None:
            chunk, b = chunks[i], i % nbuf
            stage = self._sk_load_stage[b]
            m = len(chunk)
            sketch, read_back = check_plan([kinds[j] for j in chunk])
            host_rows = self._readback_buffer(b) if read_back else None
            with torch.cuda.stream(self.load_stream):
                for reader in (installed[b], check_read[b]):  # the buffer's last install and check read it
                    if reader is not None:
                        self.load_stream.wait_event(reader)
                self._h2d([pages[j] for j in chunk], stage)
                ev = torch.cuda.Event()
                ev.record(self.load_stream)
                copied.append(ev)
            with torch.cuda.stream(self._load_k):
                self._order(OrderingEdge.CHECK_AFTER_COPY, self._load_k, ev)  # the check reads what the copy delivered
                if sketch:
                    self._sketch_to_host(stage, m, self._sk_load_dev[b], self._sk_load_host[b][:m])
                if read_back:
                    self._read_back(stage, m, host_rows)
                ev2 = _host_event()
                ev2.record(self._load_k)
                checked.append(ev2)
                check_read[b] = ev2

        issued = min(nbuf, len(chunks))
        for i in range(issued):
            issue(i)
        loaded = 0
        stop: Miss | None = None
        for i, chunk in enumerate(chunks):
            _await_event(checked[i], _LOAD_POLL_S)
            b = i % nbuf
            got = self._arrived_digests(b, [kinds[j] for j in chunk])
            ok = self._verified(got, expected[chunk.start : chunk.stop])
            if deadline_s is not None and time.monotonic() - t0 > deadline_s:
                stop = Miss(loaded, MissCause.TIMEOUT)
                break
            if ok:
                with torch.cuda.stream(self._load_s):
                    self._load_s.wait_event(copied[i])
                    self._install([ids[j] for j in range(chunk.start, chunk.start + ok)], b)
                    ev = torch.cuda.Event()
                    ev.record(self._load_s)
                    installed[b] = ev
            loaded += ok
            if ok < len(chunk):
                stop = Miss(loaded, MissCause.CORRUPT)
                break
            if issued < len(chunks):
                issue(issued)
                issued += 1
        self._load_s.wait_event(copied[-1])  # every copy reading the pages (and writing staged rows) ...
        self._load_s.wait_event(checked[-1])  # ... and every check reading the staged rows, in stream order
        done.record(self._load_s)
        return loaded, stop

    def _finished_load(self, ids: tuple[int, ...], miss: Miss, done: torch.cuda.Event, t0: float) -> LoadHandle:
        handle = LoadHandle(next(self._ids), ids, 0, miss, done, t0)
        future: cf.Future = cf.Future()
        future.set_result(((), ()))
        handle._future = future
        self._watch(handle)
        return handle

    def _release(self, lease: AcquireResult) -> tuple[tuple[int, ...], str | None, MissCause | None]:
        """(stale pages, error, cause): where the release fails the pages' generations were not
        checked, so nothing the copy read can be vouched for: `cause` says why (the lease had
        expired under a slow copy: timeout; the connection went: transport_error)."""
        if not lease.lease_id:
            return (), None, None
        try:
            return tuple(self.backend.release(lease.lease_id).stale), None, None
        except LeaseLost as exc:  # the daemon reaped it: its pages may have been reused while we copied
            return (), f"release: {type(exc).__name__}: {exc}", MissCause.TIMEOUT
        except (PoolTimeout, TransportError, MalformedFrame) as exc:  # the connection and its lease are gone
            return (), f"release: {type(exc).__name__}: {exc}", MissCause.TRANSPORT_ERROR

    def _finish_load(self, handle: LoadHandle, lease: AcquireResult) -> tuple[tuple[int, ...], tuple[str, ...],
                                                                             MissCause | None]:
        self._await_copy(handle._done)
        miss = handle.miss
        if miss is not None and miss.cause is MissCause.CORRUPT and lease.lease_id \
                and miss.index < len(lease.hits.pages):
            # the page that failed its check on the GPU, its lease still held: the daemon
            # re-checks it at rest and drops it if it is corrupt there (kvpool.client.pool_client)
            report_corrupt(self.backend, lease, miss.index, None)
        stale_pages, error, unverified = self._release(lease)
        moved = set(stale_pages)
        stale = tuple(i for i in range(handle.loaded) if lease.hits.pages[i] in moved)
        return stale, ((error,) if error else ()), unverified

    def wait_for_load(self, handle: LoadHandle) -> None:
        """The engine's current stream waits for the load's copies (no host sync)."""
        self._order(OrderingEdge.READ_AFTER_LOAD, torch.cuda.current_stream(self.device), handle._done)

    wait = wait_for_load

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
        remaining = [len(parts)]
        lock = threading.Lock()

        def settle() -> None:
            if isinstance(h, StoreHandle) and h._sketch is not None:  # every commit reading it finished
                self._store_sketches.give(h._sketch)
                h._sketch = None
            try:
                h.result.set_result(self._outcome(h))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the result
                h.result.set_exception(exc)

        def part_done(_: cf.Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                settle()

        if not parts:
            settle()
        for f in parts:
            f.add_done_callback(part_done)

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
                _unregister(self._region_ptr)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
