"""Where the pool's pages lie, as the GPU transfer engine (kvpool.gpu.transfer) copies them:
the host pool's shared segment (host memory, registered with CUDA), or a GPU keeper's tier
in device memory (`kvpool keeper --backing vmm`, mapped in this process with CUDA's VMM:
kvpool.gpu.tier_backend.TierArena). The engine's copies, staging, checks, installs and
ordering edges are the same either way (one address space: torch's copies and the driver's
batched copies take either); what differs is said here. Pure: no CUDA, no torch.

  PageRegion     one segment's pages as the engine sees them: where they lie (PageMemory),
                 the identity the engine follows (`instance`: a restarted pool's new segment,
                 a keeper's new instance or session, is another), the page size, the address
                 and bytes of the page range, and the range itself (`host`: a numpy uint8
                 array; `device`: an object with __cuda_array_interface__, which
                 torch.as_tensor aliases without a copy).
      .to_pages / .from_pages   the driver path's direction for a copy into / out of the
                 pages (Driver.copies' `to_host`): device to host / host to device for host
                 pages, device to device (None) for device pages.
      .registers  whether the engine registers the range with CUDA (host pages only).
      .session    the session whose mapping this is, where the range is one session's
                 mapping (a keeper's tier: another session maps it at another address),
                 else None. Lanes of such a region must share its backend's session.
  page_region(arena) -> PageRegion
        from what a backend exposes as `arena`: `pages_region` (host) or `device_pages`
        (device), `instance`, `page_size`; for device pages `same_gpu` (the buffer lives on
        the engine's GPU) and optionally `session`. RegionRefused (a TransferError) for an arena that names
        neither range or both, a range that is not whole pages, device pages on another GPU
        (peer copies through the tier are not built: to do).
  moved_to(current, arena) -> PageRegion | None
        the region the engine must move to before its next transfer: None while the backend
        names no arena (its own call fails or reconnects) or the same segment (`instance`);
        else the arena's pages (a restarted pool, a keeper's new instance or session).
  off_session(region, lane_instances) -> list[int]
        the lanes (by index) whose segment is not the region's, where the region is one
        session's mapping (none otherwise: a pool's lanes are its other connections).
  check_store_digest(region, digest, backend_kind)
        RegionRefused unless the engine's stores can commit to this pool: a backend that
        takes one kind only (`digest_kind`: a keeper's tier, kv-sketch-1) gets that kind,
        and device pages are digested on the GPU (kv-sketch-1: the host cannot read them to
        take XXH3-128 over the pages as copied).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.gpu.config import PageMemory, RegionRefused
from kvpool.pool.digest import DigestKind


@dataclasses.dataclass(frozen=True)
class PageRegion:
    memory: PageMemory
    instance: bytes
    page_size: int
    ptr: int
    nbytes: int
    host: np.ndarray | None = None
    device: Any = None  # noqa: ANN401 - an object with __cuda_array_interface__ (kvpool.gpu.vmm.CudaArray)
    session: int | None = None

    @property
    def num_pages(self) -> int:
        return self.nbytes // self.page_size

    @property
    def to_pages(self) -> bool | None:
        """Driver.copies' `to_host` for a copy from the device into the pages."""
        return None if self.memory is PageMemory.DEVICE else True

    @property
    def from_pages(self) -> bool | None:
        """Driver.copies' `to_host` for a copy out of the pages onto the device."""
        return None if self.memory is PageMemory.DEVICE else False

    @property
    def registers(self) -> bool:
        return self.memory is PageMemory.HOST


def _device_range(device: Any) -> tuple[int, int]:  # noqa: ANN401
    try:
        iface = device.__cuda_array_interface__
        ptr, _read_only = iface["data"]
        shape, typestr = tuple(iface["shape"]), iface["typestr"]
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise RegionRefused(f"the device pages are not a CUDA array ({type(device).__name__}): {exc}") from exc
    if typestr != "|u1" or len(shape) != 1 or iface.get("strides") not in (None, (1,)):
        raise RegionRefused(f"the device pages must be one run of bytes, got shape {shape} {typestr}")
    return int(ptr), int(shape[0])


def page_region(arena: Any) -> PageRegion:  # noqa: ANN401 - a pool's Arena or a keeper's TierArena
    """The pages `arena` exposes, as the engine copies them (see the module's docstring)."""
    host = getattr(arena, "pages_region", None)
    device = getattr(arena, "device_pages", None)
    if (host is None) == (device is None):
        raise RegionRefused("a pool's arena names its pages in host memory (pages_region) or in device memory "
                            f"(device_pages): this one names {'both' if host is not None else 'neither'}")
    page_size = int(arena.page_size)
    instance = bytes(arena.instance)
    session = getattr(arena, "session", None)
    if page_size <= 0:
        raise RegionRefused(f"a page size of {page_size} bytes")
    if host is not None:
        if not isinstance(host, np.ndarray) or host.dtype != np.uint8 or host.ndim != 1 \
                or not host.flags.c_contiguous:
            raise RegionRefused("the host pages must be one contiguous numpy uint8 array")
        ptr, nbytes = int(host.ctypes.data), int(host.nbytes)
        memory = PageMemory.HOST
    else:
        if not getattr(arena, "same_gpu", False):
            raise RegionRefused("the tier's buffer lives on another GPU than this replica's: the engine copies "
                                "device pages on its own GPU only (peer copies through the tier are not built)")
        ptr, nbytes = _device_range(device)
        memory = PageMemory.DEVICE
    if nbytes <= 0 or nbytes % page_size:
        raise RegionRefused(f"a page range of {nbytes} bytes is not whole pages of {page_size}")
    return PageRegion(memory, instance, page_size, ptr, nbytes, host, device,
                      None if session is None else int(session))


def check_store_digest(region: PageRegion, digest: DigestKind, backend_kind: DigestKind | None) -> None:
    """RegionRefused unless stores digested with `digest` can commit to this pool."""
    digest = DigestKind(digest)
    if backend_kind is not None and digest is not DigestKind(backend_kind):
        raise RegionRefused(f"this pool commits {DigestKind(backend_kind).value} digests only; the engine's "
                            f"stores take {digest.value} (TransferConfig.digest)")
    if region.memory is PageMemory.DEVICE and digest is not DigestKind.SKETCH:
        raise RegionRefused(f"pages in device memory are digested on the GPU (kv-sketch-1): the host cannot "
                            f"read them to take {digest.value}")


def moved_to(current: PageRegion, arena: Any) -> PageRegion | None:  # noqa: ANN401
    """The region to move to (see the module's docstring), or None to stay."""
    if arena is None or bytes(arena.instance) == current.instance:
        return None
    return page_region(arena)


def off_session(region: PageRegion, lane_instances: Sequence[bytes | None]) -> list[int]:
    """Indexes of the lanes whose segment is not the region's, for a per-session region."""
    if region.session is None:
        return []
    return [i for i, inst in enumerate(lane_instances) if inst != region.instance]
