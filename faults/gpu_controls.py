"""GPU negative controls and the stream-delay fault: known-bad transfer engines the gpu
suite must catch, and the delay that makes them fail.

Each control is a TransferEngine subclass with one deliberate defect, reached through the
engine's hooks (`_order`, `_await_copy`, `_verified`, `_arrived_digests`, `_release`,
`_register_host`); the engine has no testing branch of its own.

  UnorderedTransferEngine(..., drop=edge)
      skips one stream dependency (kvpool.gpu.config.OrderingEdge): the copy that lost
      its dependency on the engine's current stream (seed 003). Counts what it skipped.
  EagerReleaseEngine
      releases a load's lease as soon as the copies are enqueued, before they ran: the
      pool may evict or reuse pages a copy is still reading.
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

  delay_stream(stream, cycles)   torch.cuda._sleep enqueued on `stream` (the fault).
  cycles_per_ms(device)          _sleep's rate on this GPU, measured with CUDA events.
Heal: the delayed work runs; nothing is left behind once the stream drained.
"""

from __future__ import annotations

import torch

from kvpool.pool.digest import page_digest
from kvpool.gpu.config import HostRegistrationError, OrderingEdge
from kvpool.gpu.transfer import TransferEngine


class UnorderedTransferEngine(TransferEngine):
    def __init__(self, *args, drop: OrderingEdge, **kwargs):  # noqa: ANN002, ANN003
        self.drop = OrderingEdge(drop)
        self.dropped = 0
        super().__init__(*args, **kwargs)

    def _order(self, edge: OrderingEdge, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        if edge == self.drop:
            self.dropped += 1
            return
        super()._order(edge, stream, event)


class EagerReleaseEngine(TransferEngine):
    def _await_copy(self, event: torch.cuda.Event) -> None:
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
