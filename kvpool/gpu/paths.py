"""The GPU engine's copy paths and the ordering edges each one has: the registry that the
gate's matrix (every path against every edge it has, each under a stream delay, each with
the control that drops that edge) enumerates, and that its completeness test holds the
engine's code and configuration to.

  Direction      store | load.
  Issue          how a path issues its work: graphs | kernels (the torch path's gathers and
                 scatters: CUDA graphs of a whole chunk, or one kernel per layer),
                 batched | per_copy (the driver path: cuMemcpyBatchAsync, or one
                 cuMemcpy*Async per run).
  EdgeKind       write_before_read | read_before_reuse | release_after_copy.
  Edge           what an OrderingEdge orders: its direction, kind, the hook the engine
                 orders it through ("_order": a stream wait; "_await_copy": the host waits
                 for an event), and in words what must come first.
  EDGES          OrderingEdge -> Edge, for every member.
  TransferPath   (engine, issue, host memory, digest kind, direction): one copy path.
                 .name; .config() the TransferConfig fields that select it (host memory is
                 selected by whether cudaHostRegister is granted); .edges.
  transfer_paths()   every path the engine has, built from its configuration's enumerations
                 (CopyPath, HostMemory, DigestKind) and the issue each engine has.
  path_edges(path)   the ordering edges the engine issues on that path.
  Premise / host_ordered(path, edge) -> HostOrdered | None
                 where a copy to or from pageable host memory makes the host itself wait,
                 so that dropping the edge alone changes no byte on that path (CUDA: a copy
                 from the device to pageable memory returns only once it completed; a copy
                 from pageable memory to the device may wait for its stream first), with the
                 premise it rests on.
  PATH_FIELDS / OTHER_FIELDS   every TransferConfig field: one that selects a path, or why
                 it selects none.

A load's digest kind is the kind of the pages it loads (each page is checked by its own
kind); a store's, the kind it digests its pages with (TransferConfig.digest).
The network tier (kvpool.tier) has no GPU copy path: it moves pages between the pool's
host memory and a store. A tier path that touches GPU memory would be a new Direction here.
Pages in device memory (a GPU keeper's tier, kvpool.gpu.region.PageMemory.DEVICE) take these
same paths with device-to-device copies: the same code, edges and hooks, no host memory (as
registered memory, the copies never make the host wait). They are not a dimension of this
registry yet, so the gate's matrix runs none of them; suites/gpu/test_gpu_tier_engine.py runs
the store and load edges through a keeper under stream delays, each with its control.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Any

from kvpool.gpu.config import CopyPath, HostMemory, OrderingEdge, TransferConfig
from kvpool.pool.digest import DigestKind


class Direction(enum.StrEnum):
    STORE = "store"  # KV blocks -> pool pages
    LOAD = "load"  # pool pages -> KV blocks


class Issue(enum.StrEnum):
    GRAPHS = "graphs"  # torch: a whole chunk's gather or scatter replayed as one CUDA graph
    KERNELS = "kernels"  # torch: one gather or scatter kernel per layer
    BATCHED = "batched"  # driver: cuMemcpyBatchAsync
    PER_COPY = "per_copy"  # driver: one cuMemcpy{DtoH,HtoD,DtoD}Async per run (the raw-pointer fallback)


class EdgeKind(enum.StrEnum):
    WRITE_BEFORE_READ = "write_before_read"
    READ_BEFORE_REUSE = "read_before_reuse"
    RELEASE_AFTER_COPY = "release_after_copy"


@dataclasses.dataclass(frozen=True)
class Edge:
    direction: Direction
    kind: EdgeKind
    hook: str  # "_order" (a stream wait) or "_await_copy" (the host waits for an event)
    first: str  # what must have happened ...
    then: str  # ... before this


EDGES: dict[OrderingEdge, Edge] = {
    OrderingEdge.STORE_AFTER_WRITE: Edge(Direction.STORE, EdgeKind.WRITE_BEFORE_READ, "_order",
                                         "the engine's write of the KV", "the store's reads of it (copy, gather)"),
    OrderingEdge.REUSE_AFTER_STORE: Edge(Direction.STORE, EdgeKind.READ_BEFORE_REUSE, "_order",
                                         "the store's reads of the KV", "the engine's next write of those blocks"),
    OrderingEdge.COPY_AFTER_GATHER: Edge(Direction.STORE, EdgeKind.WRITE_BEFORE_READ, "_order",
                                         "the gather into a staging buffer", "the copy of its rows to the pages"),
    OrderingEdge.GATHER_AFTER_COPY: Edge(Direction.STORE, EdgeKind.READ_BEFORE_REUSE, "_order",
                                         "the copy out of a staging buffer", "the next gather into that buffer"),
    OrderingEdge.COMMIT_AFTER_COPY: Edge(Direction.STORE, EdgeKind.RELEASE_AFTER_COPY, "_await_copy",
                                         "a unit's copies to its pages (and its sketches' copy to the host)",
                                         "its digests and its commit (the pages become visible)"),
    OrderingEdge.LOAD_AFTER_READ: Edge(Direction.LOAD, EdgeKind.READ_BEFORE_REUSE, "_order",
                                       "the engine's reads of the blocks before load()", "the installs into them"),
    OrderingEdge.REFILL_AFTER_INSTALL: Edge(Direction.LOAD, EdgeKind.READ_BEFORE_REUSE, "_order",
                                            "the install and the check that last read a staging buffer",
                                            "the next copy into that buffer"),
    OrderingEdge.CHECK_AFTER_COPY: Edge(Direction.LOAD, EdgeKind.WRITE_BEFORE_READ, "_order",
                                        "a chunk's copy into its staging buffer",
                                        "the check's reads of those rows (sketch, read-back)"),
    OrderingEdge.VERIFY_AFTER_CHECK: Edge(Direction.LOAD, EdgeKind.WRITE_BEFORE_READ, "_await_copy",
                                          "the check's output in host memory (sketches, read-back rows)",
                                          "the host's comparison with the committed digests"),
    OrderingEdge.READ_AFTER_LOAD: Edge(Direction.LOAD, EdgeKind.WRITE_BEFORE_READ, "_order",
                                       "the load's installs into the blocks",
                                       "the engine's reads after wait_for_load()"),
    OrderingEdge.RELEASE_AFTER_COPY: Edge(Direction.LOAD, EdgeKind.RELEASE_AFTER_COPY, "_await_copy",
                                          "every copy of a load (and every kernel on its staged rows)",
                                          "the release of its lease (the pool may reuse the pages)"),
}

# The edges every path of a direction has, and those only some have (torch stores of
# kv-sketch-1 pages gather into staging buffers on a kernel stream beside the copy stream).
_COMMON: dict[Direction, tuple[OrderingEdge, ...]] = {
    Direction.STORE: (OrderingEdge.STORE_AFTER_WRITE, OrderingEdge.REUSE_AFTER_STORE, OrderingEdge.COMMIT_AFTER_COPY),
    Direction.LOAD: (OrderingEdge.LOAD_AFTER_READ, OrderingEdge.REFILL_AFTER_INSTALL, OrderingEdge.CHECK_AFTER_COPY,
                     OrderingEdge.VERIFY_AFTER_CHECK, OrderingEdge.READ_AFTER_LOAD, OrderingEdge.RELEASE_AFTER_COPY),
}
_STAGED_STORE = (OrderingEdge.COPY_AFTER_GATHER, OrderingEdge.GATHER_AFTER_COPY)

# How each engine issues its work: CUDA graphs or not on the torch path (TransferConfig.graphs;
# a torch store of xxh3-128 pages gathers with kernels only), the batch API or not on the
# driver path (TransferConfig.batched; on pageable memory never).
_ISSUES: dict[CopyPath, tuple[Issue, ...]] = {
    CopyPath.TORCH: (Issue.GRAPHS, Issue.KERNELS),
    CopyPath.DRIVER: (Issue.BATCHED, Issue.PER_COPY),
}


@dataclasses.dataclass(frozen=True, order=True)
class TransferPath:
    direction: Direction
    engine: CopyPath
    issue: Issue
    host: HostMemory
    digest: DigestKind

    @property
    def name(self) -> str:
        return f"{self.direction}-{self.engine}-{self.issue}-{self.host}-{self.digest}"

    @property
    def edges(self) -> tuple[OrderingEdge, ...]:
        return path_edges(self)

    def config(self) -> dict[str, Any]:
        """The TransferConfig fields that select this path (pageable host memory: the
        engine takes it where cudaHostRegister is refused, or with register_host=False)."""
        out: dict[str, Any] = {"path": self.engine, "digest": self.digest}
        if self.engine is CopyPath.TORCH:
            out["graphs"] = self.issue is Issue.GRAPHS
        else:
            out["batched"] = self.issue is Issue.BATCHED
        return out


def _exists(engine: CopyPath, issue: Issue, host: HostMemory, digest: DigestKind, direction: Direction) -> bool:
    if engine is CopyPath.DRIVER and issue is Issue.BATCHED and host is HostMemory.PAGEABLE:
        return False  # the engine probes the batch API only on registered memory
    if engine is CopyPath.TORCH and issue is Issue.GRAPHS and direction is Direction.STORE \
            and digest is DigestKind.XXH3:
        return False  # an xxh3-128 store gathers with kernels (its graphs are the sketched gather's)
    return True


def transfer_paths() -> tuple[TransferPath, ...]:
    """Every copy path of the engine: each engine's issues x host memory x digest kind x direction."""
    out = []
    for engine, host, digest, direction in itertools.product(CopyPath, HostMemory, DigestKind, Direction):
        for issue in _ISSUES[engine]:
            if _exists(engine, issue, host, digest, direction):
                out.append(TransferPath(direction, engine, issue, host, digest))
    return tuple(sorted(out))


def path_edges(path: TransferPath) -> tuple[OrderingEdge, ...]:
    """The ordering edges the engine issues on `path`."""
    edges = _COMMON[path.direction]
    if path.direction is Direction.STORE and path.engine is CopyPath.TORCH and path.digest is DigestKind.SKETCH:
        edges = edges + _STAGED_STORE
    return edges


# -- where the host orders an edge --------------------------------------------------------------


class Premise(enum.StrEnum):
    """What CUDA does with copies to and from pageable memory, on which a host ordering rests."""

    # "For transfers from device memory to pageable host memory, the function will return only
    # once the copy has completed" (CUDA runtime and driver API, API synchronization behavior).
    PAGEABLE_D2H_COMPLETES = "pageable_d2h_completes"
    # "For transfers from pageable host memory to device memory, a stream sync is performed
    # before the copy is initiated" (the synchronous memcpy), while the asynchronous one "might
    # be synchronous with respect to host": which way a host goes is probed where it matters.
    PAGEABLE_H2D_WAITS_STREAM = "pageable_h2d_waits_stream"


@dataclasses.dataclass(frozen=True)
class HostOrdered:
    premise: Premise
    reason: str


def host_ordered(path: TransferPath, edge: OrderingEdge) -> HostOrdered | None:
    """Why dropping `edge` alone changes no byte on `path` (the host waits for the work the
    edge orders), or None where only the edge orders it."""
    if path.host is not HostMemory.PAGEABLE or edge not in path_edges(path):
        return None
    d2h = Premise.PAGEABLE_D2H_COMPLETES
    if path.direction is Direction.STORE:
        if path.digest is DigestKind.XXH3 and edge in (OrderingEdge.REUSE_AFTER_STORE, OrderingEdge.COMMIT_AFTER_COPY):
            return HostOrdered(d2h, "the copy to a pageable page reads the KV (itself, or after the gather on its "
                                    "own stream) and returns only once it completed: store() returns after the "
                                    "KV was read and the pages written, before any commit")
        if path.engine is CopyPath.TORCH and edge is OrderingEdge.REUSE_AFTER_STORE:
            return HostOrdered(d2h, "the copy to a pageable page waits on its stream for the gather (the only "
                                    "read of the KV) and returns only once it completed")
        if path.engine is CopyPath.TORCH and edge is OrderingEdge.GATHER_AFTER_COPY:
            return HostOrdered(d2h, "each chunk's copy out of its staging buffer completed before the next "
                                    "gather is enqueued")
        return None  # a sketch's copy to pinned host memory, or the driver's gather for it, stays asynchronous
    if edge is OrderingEdge.CHECK_AFTER_COPY:
        return HostOrdered(Premise.PAGEABLE_H2D_WAITS_STREAM,
                           "a copy from a pageable page waits for its stream before it starts and returns once "
                           "the bytes are staged: the check is enqueued after the copy was issued, and no "
                           "stream delay can hold the copy back without holding the host")
    return None


# -- the configuration: every field selects a path or says why not ----------------------------

PATH_FIELDS: dict[str, str] = {
    "path": "the engine (CopyPath)",
    "register_host": "host memory (False: pageable; True: registered where cudaHostRegister grants it)",
    "digest": "the digest kind of stores (a load checks each page by its own kind)",
    "graphs": "the torch path's issue (graphs or kernels)",
    "batched": "the driver path's issue (batched or per copy)",
}
OTHER_FIELDS: dict[str, str] = {
    "block_dim": "the layout: which tensor dimension indexes blocks; the same copies and waits, the gather "
                 "and scatter kernels index another dimension (graphs only where it is the first)",
    "chunk_bytes": "how many pages a staged copy carries: more or fewer of the same copies and waits",
    "commit_bytes": "how a store's pages are grouped into reservations: the same copies, more or fewer commits",
    "commit_blocks": "as commit_bytes, in blocks",
    "min_blocks": "the pool's admission, mirrored: which blocks are stored, not how",
    "hash_threads": "host threads for xxh3-128 digests: no copy, no wait",
    "load_buffers": "how many staging buffers a load cycles through: refills wait for their readers "
                    "(REFILL_AFTER_INSTALL) whatever their number",
    "sketch_impl": "how kv-sketch-1's sums are computed (a Triton kernel, cuBLASLt int8, float64): one kernel "
                   "in the same place on the same stream, after the same waits; each is probed exact against "
                   "the host reference at the engine's start, and the matrix runs the one auto takes",
    "fuse_loads": "device pages only (a keeper's tier), which the matrix does not enumerate: a load's copy and "
                  "sketch as one kernel on the copy stream, the check stream copying the sketches out after "
                  "the same CHECK_AFTER_COPY wait; suites/gpu/test_gpu_tier_engine.py runs it on the torch path",
    "install_direct": "device pages only, with the fused copy: the copy stream's kernel writes the blocks (after "
                      "LOAD_AFTER_READ) instead of staging rows, and there is no install pass; "
                      "suites/gpu/test_gpu_tier_engine.py runs every edge, the corrupt page and the "
                      "check-after-copy edge both ways",
}


def config_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(TransferConfig)}
