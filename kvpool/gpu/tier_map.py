"""A replica's side of the GPU tier: trade a ticket for its tenant's buffer at the keeper's
attach socket (kvpool.gpu.handout), map it, read the keeper's private state.

  TierMap.attach(path, ticket, device_index=None, access=(), timeout_s=5.0, trusted_uids=None)
      fetch the descriptor and the two descriptors, map the private state read-only, and map
      the buffer: a VMM export is imported on `device_index` (kvpool.gpu.vmm.Mapping.import_fd,
      with read/write access for that device and each of `access`); a MEMFD (the tests'
      stand-in) is mmap'd in host memory. Every descriptor received is closed before it
      returns, mapped or not; a failure maps nothing and raises the handout's or the driver's
      typed error.
  .descriptor          what the keeper said the buffer is (TierDescriptor).
  .same_gpu            the buffer lives on this replica's GPU (device UUIDs equal): loads are
                       device-to-device copies; else peer copies (NVLink where the GPUs have it).
  .page_view(i)        page i: a kvpool.gpu.vmm.CudaArray on the GPU, a memoryview on the host.
  .page_ptr(i)         page i's device address (VMM only).
  .pages()             every page as one range (page i at byte i x page size): a CudaArray on
                       the GPU, a memoryview on the host (the GPU engine copies through it:
                       kvpool.gpu.tier_backend.TierArena).
  .generation(i)       page i's generation, as the keeper last wrote it.
  .keeper_age_s()      how old the keeper's heartbeat is (a dead keeper stops beating: the
                       mapping stays valid, but nothing new is committed or freed).
  .keeper_heartbeat_ns()  the heartbeat itself (CLOCK_MONOTONIC ns), for a caller that judges
                       its age on a clock of its own (kvpool.gpu.tier_client).
  .close()             unmapped; the memory stays with the keeper and the other replicas.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Collection

from kvpool.gpu.handout import HandleKind, HandoutError, PrivateView, TierDescriptor, fetch_handout
from kvpool.gpu.vmm import CudaArray, Mapping, Vmm


class TierMap:
    def __init__(self, descriptor: TierDescriptor, private: PrivateView, mapping: Mapping | None,
                 host: mmap.mmap | None, same_gpu: bool):
        self.descriptor = descriptor
        self.private = private
        self.mapping = mapping
        self.host = host
        self.same_gpu = same_gpu
        self.closed = False

    @classmethod
    def attach(cls, path: str | os.PathLike, ticket: bytes, device_index: int | None = None,
               access: tuple[int, ...] = (), timeout_s: float = 5.0,
               trusted_uids: Collection[int] | None = None) -> TierMap:
        desc, fds = fetch_handout(str(path), ticket, timeout_s, trusted_uids)
        private = mapping = host = None
        try:
            private = PrivateView(fds[1], desc)
            if desc.kind == HandleKind.VMM_POSIX_FD:
                vmm = Vmm(0 if device_index is None else device_index)
                mapping = Mapping.import_fd(vmm, fds[0], desc.size, access)
                same_gpu = vmm.uuid == desc.device_uuid
            else:
                if os.fstat(fds[0]).st_size < desc.size:
                    raise HandoutError(f"a host buffer of {os.fstat(fds[0]).st_size} bytes, the descriptor says "
                                       f"{desc.size}")
                host = mmap.mmap(fds[0], desc.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                same_gpu = False
            return cls(desc, private, mapping, host, same_gpu)
        except BaseException:
            if private is not None:
                private.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def _page(self, page: int) -> int:
        if self.closed:
            raise HandoutError("the tier's mapping was closed")
        if not 0 <= page < self.descriptor.num_pages:
            raise HandoutError(f"page {page} outside the tier's {self.descriptor.num_pages}")
        return page * self.descriptor.page_size

    def page_view(self, page: int) -> CudaArray | memoryview:
        off = self._page(page)
        if self.mapping is not None:
            return self.mapping.view(off, self.descriptor.page_size)
        return memoryview(self.host)[off: off + self.descriptor.page_size]

    def pages(self) -> CudaArray | memoryview:
        if self.closed:
            raise HandoutError("the tier's mapping was closed")
        n = self.descriptor.num_pages * self.descriptor.page_size
        if self.mapping is not None:
            return self.mapping.view(0, n)
        return memoryview(self.host)[:n]

    def page_ptr(self, page: int) -> int:
        off = self._page(page)
        if self.mapping is None:
            raise HandoutError("a host stand-in buffer has no device address")
        return self.mapping.ptr + off

    def generation(self, page: int) -> int:
        self._page(page)
        return self.private.generation(page)

    def keeper_age_s(self) -> float:
        return self.private.heartbeat_age_s()

    def keeper_heartbeat_ns(self) -> int:
        return self.private.heartbeat_ns()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.private.close()
        if self.mapping is not None:
            self.mapping.close()
        if self.host is not None:
            try:
                self.host.close()
            except BufferError:
                pass  # a page view is still held: the mapping goes with it

    def __enter__(self) -> TierMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
