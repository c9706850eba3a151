"""What the GPU transfer engine (kvpool.gpu.transfer) is told, what it reports, how it fails.

  TransferError, KVLayoutError, HostRegistrationError   its errors (kvpool.errors.PoolError
        subclasses): a CUDA call failed or the engine cannot work as configured; the KV
        tensors do not fit the declared layout; cudaHostRegister refused the arena.
  CopyPath       torch | driver: how the bytes move (kvpool.gpu.transfer says how each works).
  HostMemory     registered | pageable: the arena as the copies see it.
  PageMemory     host | device: where the pool's pages lie (the host pool's segment, or a GPU
                 keeper's tier in device memory; kvpool.gpu.region).
  OrderingEdge   the dependencies that make a transfer correct (the hooks
                 TransferEngine._order and TransferEngine._await_copy take one of these).
  TransferConfig         the engine's settings (copy path, block dim, chunk and commit
                         sizes, digest kind of stores, load buffers, CUDA graphs).
  TransferCapabilities   what the engine could set up on this host, and why not.
"""

from __future__ import annotations

import dataclasses
import enum

from kvpool.errors import InvalidRequest, PoolError
from kvpool.pool.digest import DigestKind

# -- errors -----------------------------------------------------------------------------------


class TransferError(PoolError):
    """A CUDA call of the transfer engine failed, or the engine cannot work as configured."""


class KVLayoutError(TransferError):
    """The KV tensors do not fit the declared layout (block dim, device, namespace)."""


class RegionRefused(TransferError):
    """The pool's pages cannot be copied through here: they are not one run of bytes, live on
    another GPU, or take a digest kind the engine's stores do not give (kvpool.gpu.region). A
    configuration's, or a restarted pool's new segment's, never a failure of the device."""


class HostRegistrationError(TransferError):
    """cudaHostRegister refused the arena; the engine falls back to pageable copies."""


# -- configuration and reports ----------------------------------------------------------------


class CopyPath(enum.StrEnum):
    TORCH = "torch"
    DRIVER = "driver"


class HostMemory(enum.StrEnum):
    REGISTERED = "registered"  # cudaHostRegister'ed arena: asynchronous DMA at link speed
    PAGEABLE = "pageable"  # the fallback: same ordering, slower, the host waits for copies


class PageMemory(enum.StrEnum):
    HOST = "host"  # host memory: the pool's shared segment (or a keeper's memfd tier), registered or pageable
    DEVICE = "device"  # device memory: a GPU keeper's VMM tier mapped here; copies device to device


class OrderingEdge(enum.StrEnum):
    """The dependencies that make a transfer correct: stream waits (the hook
    TransferEngine._order) and the host's waits for a copy or a check (the hook
    TransferEngine._await_copy). kvpool.gpu.paths says which copy paths have which."""

    # stores
    STORE_AFTER_WRITE = "store_after_write"  # store copies read the KV after the engine wrote it
    REUSE_AFTER_STORE = "reuse_after_store"  # the engine rewrites a block after the store read it
    COPY_AFTER_GATHER = "copy_after_gather"  # a store's copy reads the staged rows after its gather wrote them
    GATHER_AFTER_COPY = "gather_after_copy"  # a store's gather refills a staging buffer after the copy that read it
    COMMIT_AFTER_COPY = "commit_after_copy"  # a store's unit is digested and committed after its copies completed
    # loads
    LOAD_AFTER_READ = "load_after_read"  # a load overwrites blocks after the engine's earlier reads
    READ_AFTER_LOAD = "read_after_load"  # the engine reads loaded blocks after the load wrote them
    CHECK_AFTER_COPY = "check_after_copy"  # a load's check reads the staged rows after its copy wrote them
    VERIFY_AFTER_CHECK = "verify_after_check"  # the host compares a chunk's digests after its check delivered them
    REFILL_AFTER_INSTALL = "refill_after_install"  # a load's copy refills a staging buffer after its last readers
    RELEASE_AFTER_COPY = "release_after_copy"  # a load's lease is released after every copy of the load completed


# How kv-sketch-1 may run on a GPU (kvpool.gpu.sketch), fastest first: "auto" takes the first
# that equals the host reference on the device.
SKETCH_IMPLS = ("triton-dot", "int8-mm", "float64-mm")


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
    # How kv-sketch-1 runs on the GPU (kvpool.gpu.sketch.Sketcher): "auto" takes the first of
    # triton-dot, int8-mm, float64-mm that equals the host reference here; a named one is used
    # or the engine does not start.
    sketch_impl: str = "auto"
    # With the Triton sketch, a load of pages in device memory copies each chunk into staging
    # and sketches it in one kernel (kvpool.gpu.sketch_kernel.CopySketchKernel); False: a copy,
    # then the sketch of the staged rows on the check stream, as for host pages.
    fuse_loads: bool = True
    # With the fused copy, each chunk is written straight into its blocks as it is sketched
    # (kvpool.gpu.sketch_kernel.InstallSketchKernel: no staging row, no second pass over the
    # bytes), where every run of the layout is whole pieces of the kernel's step. A page that
    # fails its check, and the pages after it that were already in flight, then hold what
    # arrived: they are reported failed as always (the engine recomputes them, as any block a
    # load did not fill). The default since it was measured on a GPU (H100: 128k tokens of
    # 27B-class KV verified and installed in 31-34 ms against 43 ms staged; the live exchanges and
    # their controls pass on it). False: staged, checked, and only the verified prefix installed.
    install_direct: bool = True

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.commit_bytes <= 0 or self.hash_threads <= 0:
            raise InvalidRequest("chunk_bytes, commit_bytes and hash_threads must be positive")
        if self.commit_blocks < 0 or self.min_blocks < 1:
            raise InvalidRequest("commit_blocks must be >= 0 and min_blocks >= 1")
        if self.load_buffers < 2:
            raise InvalidRequest("load_buffers must be at least 2")
        object.__setattr__(self, "digest", DigestKind(self.digest))
        if self.sketch_impl != "auto" and self.sketch_impl not in SKETCH_IMPLS:
            raise InvalidRequest(f"sketch_impl {self.sketch_impl!r}: one of auto, {', '.join(SKETCH_IMPLS)}")


@dataclasses.dataclass(frozen=True)
class TransferCapabilities:
    path: CopyPath
    device: str
    host_memory: HostMemory | None  # None: the pages are device memory (no host memory in the copies)
    host_memory_reason: str  # why pageable, or why no host memory (empty when registered)
    batched_copies: bool  # driver path: cuMemcpyBatchAsync in use
    batched_reason: str  # why not batched (empty when batched, or on the torch path)
    digest: str = DigestKind.XXH3.value  # how stores digest their pages
    sketch_impl: str = ""  # kv-sketch-1 on the GPU (stores, and loads' checks): "triton-dot", "int8-mm" or "float64-mm"
    sketch_reason: str = ""  # why a faster one was not used
    graphs: str = ""  # the CUDA graphs in use ("gather,scatter"), or why none
    pages: PageMemory = PageMemory.HOST  # where the pool's pages lie
    # how a load of device pages installs at the engine's start: "direct" (install_direct and its
    # probe passed: taken per load once the engine's earlier work is over), "staged", or why not
    # yet known ("staged until pages in device memory": decided when the engine first follows its
    # pool there)
    install: str = "staged"
