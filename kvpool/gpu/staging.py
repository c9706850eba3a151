"""Host memory the GPU transfer engine's copies use, and the buffers it reuses instead of
allocating on a transfer's path.

  host_register(ptr, size) / host_unregister(ptr)
        cudaHostRegister of the pool's arena, process-wide and reference counted: engines
        of one process share one registration, and one made by someone else is never
        undone. HostRegistrationError where it is refused (the engine then copies from
        pageable memory).
  PinnedSketches(rows, least, pin=True)   pinned host buffers for the sketches of stores,
        handed out again once returned (the smallest that fits; at most KEEP kept).
  IndexRing(device, stream, capacity)   block ids on the device for the gather/scatter
        kernels of one stream, through a pinned host ring: no allocation, no host sync.

The GPU staging buffers belong to the transfers that use them (kvpool.gpu.store,
kvpool.gpu.load) and are allocated once, when the engine starts.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import torch

from kvpool.gpu.config import HostRegistrationError, TransferError
from kvpool.pool.digest import SKETCH_COLS

# -- host memory registration (process-wide, reference counted) ---------------------------------

_REG_LOCK = threading.Lock()
_REGISTERED: dict[int, list] = {}  # address -> [size, refcount, owned]


def _cudart():  # noqa: ANN202
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise HostRegistrationError(f"cuda-python (cuda.bindings) is not installed: {exc}") from exc
    return runtime


def host_register(ptr: int, size: int) -> None:
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


def host_unregister(ptr: int) -> None:
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


class PinnedSketches:
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


class IndexRing:
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

    def upload(self, ids: Sequence[int], align: int = 1) -> torch.Tensor:
        """`align`: the slot starts at a multiple of that many ids (2: a 16-byte boundary)."""
        n = len(ids)
        if n > self.capacity:
            raise TransferError(f"{n} block ids in one chunk; the index ring holds {self.capacity}")
        self.pos = -(-self.pos // align) * align
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
