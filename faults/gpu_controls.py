"""GPU negative controls and the stream-delay fault: known-bad transfer engines the gpu
suite must catch, and the delay that makes them fail.

Each control is a TransferEngine subclass with one deliberate defect, reached through the
engine's hooks (`_order`, `_await_copy`, `_verified`, `_arrived_digests`, `_release`,
`_register_host`); the engine has no testing branch of its own.

  UnorderedTransferEngine(..., drop=edge)
      skips one ordering edge (kvpool.gpu.config.OrderingEdge): a stream wait (the copy
      that lost its dependency on the engine's current stream: seed 003), or a wait of
      the host for a copy or a check. Counts what it skipped. The control of every cell
      of the matrix of copy paths against edges (kvpool.gpu.paths).
  EagerReleaseEngine
      releases a load's lease without waiting for the load's copies and installs
      (RELEASE_AFTER_COPY dropped): the pool may evict or reuse pages the load still holds.
  TrustingReleaseEngine
      takes a release that failed (the lease expired under a slow copy, the connection
      went) for a clean one: the pages' generations are never checked, and blocks copied
      from pages the pool may have reused count as loaded.
  BlindLoadEngine
      takes every sketched page for verified: a page corrupted at rest is installed and
      counted as loaded.
  HostReadEngine
      the check loads had before they verified what arrived: every page's digest taken
      by the host over the pool's shared page when the load starts, before the DMA runs
      (the torch path's xxh3-128 check beside the copy, the driver path's check before
      it copied, and an xxh3-128 engine's check of kv-sketch-1 pages). A page whose
      shared copy changes after that read and before the DMA is installed as loaded.
  RefusedRegistrationEngine
      cudaHostRegister "fails": not a defect but the fallback's trigger; the engine must
      report pageable host memory and keep the same ordering.
  RefusedUnorderedEngine
      both: the fallback path with one dependency dropped.
  PageDigestLane(lane, page_bytes)
      a commit lane that re-takes a store's digests over its pages as they landed in the
      arena, not over the source (what an xxh3-128 store does by design): a copy that
      delivered other bytes commits as if it had delivered the source.

Faults at the data (not controls: the engine must catch them):
  SketchDelayedEngine     `sketch_delay_cycles` of torch.cuda._sleep before each sketch
                          (and its copy to the host), on the sketch's stream.
  StagedFlipEngine        .arm_flip(index, offset, mask): after a load's copy into its
                          staging buffer, one byte of the staged row of the load's page
                          `index` is XORed (on the copy's stream): what arrived differs
                          from the pool's page exactly there.
  FlipAtCommitLane(lane, page_bytes, flips)   a commit lane that XORs one byte of a
                          reserved page just before its commit ({hash: (offset, mask)}):
                          the page in the pool differs from the store's source exactly there.
  CommitLane(lane, on_commit)   the wrapper both lanes are: a pool connection whose
                          commits pass through on_commit(inner, pages, digests, kind).
  engine_class(base, sketch_delay=, staged_flip=)   `base` (the engine or a control)
                          with those faults at the data.

  delay_stream(stream, cycles)   torch.cuda._sleep enqueued on `stream` (the fault).
  cycles_per_ms(device)          _sleep's rate on this GPU, measured with CUDA events.
Heal: the delayed work runs; nothing is left behind once the stream drained.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvpool.client.backend import PoolBackend
from kvpool.pool.digest import DigestKind, page_digest
from kvpool.pool.records import CommitResult, ReserveResult, SlotStatus
from kvpool.gpu.config import HostRegistrationError, OrderingEdge
from kvpool.gpu.transfer import TransferEngine


class UnorderedTransferEngine(TransferEngine):
    def __init__(self, *args, drop: OrderingEdge, **kwargs):  # noqa: ANN002, ANN003
        self.drop = OrderingEdge(drop)
        self.dropped = 0
        self._dropped_lock = threading.Lock()  # host waits are dropped on worker threads
        super().__init__(*args, **kwargs)

    def _skip(self, edge: OrderingEdge) -> bool:
        if edge != self.drop:
            return False
        with self._dropped_lock:
            self.dropped += 1
        return True

    def _order(self, edge: OrderingEdge, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        if not self._skip(edge):
            super()._order(edge, stream, event)

    def _await_copy(self, edge: OrderingEdge, event: torch.cuda.Event, *args, **kw):  # noqa: ANN002, ANN003, ANN202
        if not self._skip(edge):
            return super()._await_copy(edge, event, *args, **kw)
        return None


class EagerReleaseEngine(TransferEngine):
    def _await_copy(self, edge: OrderingEdge, event: torch.cuda.Event, *args, **kw):  # noqa: ANN002, ANN003, ANN202
        if edge is not OrderingEdge.RELEASE_AFTER_COPY:
            return super()._await_copy(edge, event, *args, **kw)
        return None


class TrustingReleaseEngine(TransferEngine):
    def _release(self, lease):  # noqa: ANN001, ANN202
        stale, error, _ = super()._release(lease)
        return stale, error, None  # a release that failed is taken as a clean one


class BlindLoadEngine(TransferEngine):
    def _verified(self, got, expected):  # noqa: ANN001, ANN202
        return len(got)


class HostReadEngine(TransferEngine):
    def _copy_in(self, ids, hits, *args):  # noqa: ANN001, ANN002, ANN202
        # read now, on the host, from the shared pages: before any copy of this load ran
        self._host_digests = [page_digest(self._page_np(p), hits.kind(i)) for i, p in enumerate(hits.pages)]
        self._host_next = 0
        return super()._copy_in(ids, hits, *args)

    def _arrived_digests(self, buf, kinds):  # noqa: ANN001, ANN202 - chunks are checked in order
        got = self._host_digests[self._host_next : self._host_next + len(kinds)]
        self._host_next += len(kinds)
        return got


class StuckSegmentEngine(TransferEngine):
    """Keeps copying to the segment it was made with, whatever its backend maps now."""

    def _follow_segment(self) -> None:
        pass

    def _segment(self, client):  # noqa: ANN001, ANN202
        return self._arena.instance


class RefusedRegistrationEngine(TransferEngine):
    def _register_host(self, ptr: int, size: int) -> None:
        raise HostRegistrationError(f"cudaHostRegister({size} bytes) refused by kvgate.faults.gpu_controls")


class RefusedUnorderedEngine(RefusedRegistrationEngine, UnorderedTransferEngine):
    pass


# -- faults at the data --------------------------------------------------------------------------


class SketchDelayedEngine(TransferEngine):
    sketch_delay_cycles = 0

    def _sketch_to_host(self, stage, n, dev_out, host):  # noqa: ANN001, ANN202
        if self.sketch_delay_cycles:
            torch.cuda._sleep(int(self.sketch_delay_cycles))  # on the sketch's (current) stream
        return super()._sketch_to_host(stage, n, dev_out, host)


class StagedFlipEngine(TransferEngine):
    _flip: tuple[int, int, int] | None = None
    _flip_rows = 0
    flipped = 0

    def arm_flip(self, index: int, offset: int, mask: int) -> None:
        """The next load's page `index`: its staged row's byte `offset` XOR `mask` (1..255)."""
        if not 0 < mask < 256 or not 0 <= offset < self.layout.page_bytes:
            raise ValueError(f"a flip of byte {offset} by {mask} in a page of {self.layout.page_bytes} bytes")
        self._flip, self._flip_rows, self.flipped = (index, offset, mask), 0, 0

    def _h2d(self, pages, stage):  # noqa: ANN001, ANN202
        super()._h2d(pages, stage)
        if self._flip is None:
            return
        index, offset, mask = self._flip
        row = index - self._flip_rows
        self._flip_rows += len(pages)
        if 0 <= row < len(pages):  # on the copy's stream, right after the copy of this chunk
            stage[row, offset : offset + 1].bitwise_xor_(mask)
            self._flip = None
            self.flipped += 1


class CommitLane:
    """A pool connection used as an engine's commit lane: each commit passes through
    `on_commit(inner, pages, digests, kind) -> digests`, with `pages` the reservation's
    [(hash, page, length)]; everything else goes to the connection itself."""

    def __init__(self, inner: PoolBackend,
                 on_commit: Callable[[PoolBackend, list[tuple[bytes, int, int]], list[bytes], DigestKind], list[bytes]]):
        self._inner = inner
        self._on_commit = on_commit
        self._reserved: dict[int, list[tuple[bytes, int, int]]] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str):  # noqa: ANN204 - the connection's own attributes
        return getattr(self._inner, name)

    def reserve(self, ns, hashes: Sequence[bytes], lengths: Sequence[int],  # noqa: ANN001
                boundary: int | None = None) -> ReserveResult:
        res = self._inner.reserve(ns, hashes, lengths, boundary)
        pages = [(h, s.page, int(n)) for h, n, s in zip(hashes, lengths, res.slots) if s.status == SlotStatus.RESERVED]
        with self._lock:
            self._reserved[res.reservation_id] = pages
        return res

    def commit(self, reservation_id: int, digests: Sequence[bytes],
               kind: DigestKind = DigestKind.XXH3) -> CommitResult:
        with self._lock:
            pages = self._reserved.pop(reservation_id, [])
        return self._inner.commit(reservation_id, self._on_commit(self._inner, pages, list(digests), kind), kind)

    def abort(self, reservation_id: int) -> int:
        with self._lock:
            self._reserved.pop(reservation_id, None)
        return self._inner.abort(reservation_id)


def FlipAtCommitLane(inner: PoolBackend, flips: dict[bytes, tuple[int, int]]) -> CommitLane:  # noqa: N802
    """Each reserved page whose hash is in `flips` ({hash: (offset, mask)}) has that byte
    XORed just before its commit (once); `flips` loses the entries that fired."""

    def on_commit(c, pages, digests, kind):  # noqa: ANN001, ANN202
        for h, page, n in pages:
            if h in flips:
                offset, mask = flips.pop(h)
                c.arena.page(page, n)[offset] ^= mask
        return digests

    return CommitLane(inner, on_commit)


def PageDigestLane(inner: PoolBackend) -> CommitLane:  # noqa: N802
    """The control: a store's digests re-taken, by their kind, over its pages as they
    landed in the arena (not over the source the engine digested)."""

    def on_commit(c, pages, digests, kind):  # noqa: ANN001, ANN202
        return [page_digest(np.array(c.arena.page(page, n)), kind) for _, page, n in pages]

    return CommitLane(inner, on_commit)


@functools.cache
def engine_class(base: type[TransferEngine] = TransferEngine, *, sketch_delay: bool = False,
                 staged_flip: bool = False) -> type[TransferEngine]:
    """`base` (the engine, or one of the CONTROLS) with these faults at the data:
    sketch_delay (SketchDelayedEngine), staged_flip (StagedFlipEngine)."""
    parts = [cls for on, cls in ((sketch_delay, SketchDelayedEngine), (staged_flip, StagedFlipEngine)) if on]
    if not parts:
        return base
    return type("".join(p.__name__.removesuffix("Engine") for p in parts) + base.__name__, (*parts, base), {})


def delay_stream(stream: torch.cuda.Stream, cycles: int) -> None:
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(cycles))


def cycles_per_ms(device: torch.device | int | None = None) -> float:
    """Clock cycles of torch.cuda._sleep per millisecond (after a warm-up)."""
    stream = torch.cuda.current_stream(device)
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record(stream)
    torch.cuda._sleep(cycles)
    end.record(stream)
    end.synchronize()
    return cycles / start.elapsed_time(end)


CONTROLS = {
    "unordered": UnorderedTransferEngine,
    "eager_release": EagerReleaseEngine,
    "host_read": HostReadEngine,
    "refused_registration": RefusedRegistrationEngine,
    "refused_unordered": RefusedUnorderedEngine,
}
# Which ordering edges a control drops (None: whichever its `drop` argument names).
DROPS: dict[str, frozenset[OrderingEdge] | None] = {
    "unordered": None,
    "refused_unordered": None,
    "eager_release": frozenset({OrderingEdge.RELEASE_AFTER_COPY}),
}
