"""Device memory another process can map: CUDA's virtual memory management (VMM) through
cuda-python's driver bindings (cuda.bindings.driver), every CUresult checked. The GPU tier
(kvpool.gpu.tier, kvpool.gpu.keeper) is built on it; nothing here imports torch.

  Vmm(device_index)          the driver on one device (cuInit, its primary context current
                             on the calling thread: the context torch's runtime uses too).
      .supports_export()     whether the device has VMM and POSIX file descriptor handles
                             (the reason in .export_reason when not).
      .granularity           the allocation granularity of an exportable device allocation
                             (every size and mapping is a multiple of it).
      .uuid                  the device's 16-byte UUID: the same GPU seen from any process,
                             whatever its CUDA_VISIBLE_DEVICES ordinal.
      .can_access_peer(vmm)  whether this device can map memory that lives on the other.
  DeviceBuffer.create(vmm, size)      physical device memory (cuMemCreate, pinned, on the
                             device, exportable as a POSIX file descriptor); size rounded up to
                             the granularity. Its owner keeps it; importers hold it alive too.
      .export_fd()           a new file descriptor of it (cuMemExportToShareableHandle; the
                             caller owns it, and closes it once handed out).
      .map()                 a Mapping of it in this process (the owner's own view).
      .release()             the owner's handle dropped (cuMemRelease): the memory lives on
                             while a mapping or an exported descriptor holds it.
  Mapping.import_fd(vmm, fd, size, access=())   an importer's mapping of a descriptor
                             received from the owner (cuMemImportFromShareableHandle,
                             cuMemAddressReserve, cuMemMap, cuMemSetAccess for this device and
                             each device in `access`); `fd` stays the caller's.
      .ptr / .size           the device address and the bytes mapped.
      .view(offset, nbytes)  a CudaArray: the bytes as a __cuda_array_interface__ object
                             (torch.as_tensor(view, device="cuda") aliases them, no copy).
      .close()               unmapped, the address range freed, the handle released.
  IpcEvent.create(vmm) / IpcEvent.open(vmm, handle)   an event another process can wait on
                             (CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING; the handle is 64
                             bytes that travel in any frame); .record(stream), .wait(stream)
                             (cuStreamWaitEvent: the GPU waits, the host does not),
                             .synchronize(), .query(), .close().

Errors: VmmUnavailable when this process cannot use VMM at all (no cuda-python, no driver,
no device, a device without VMM or POSIX descriptors), VmmError for a driver call that failed
(its CUresult name and code in the message, the code in .result). Both are
kvpool.gpu.config.TransferError, so they reach a caller as the engine's other errors.

Facts this module relies on (CUDA driver API): the physical memory of a VMM allocation is
freed only when every handle (the owner's, each importer's), every mapping and every exported
descriptor of it is gone, so an owner that dies leaves its importers' mappings valid, and an
importer that dies takes nothing from anyone else. Exported POSIX descriptors are ordinary
file descriptors: SCM_RIGHTS carries them (kvpool.gpu.handout).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvpool.gpu.config import TransferError


class VmmError(TransferError):
    """A VMM or event call of the CUDA driver failed."""

    def __init__(self, message: str, result: int = -1):
        super().__init__(message)
        self.result = result


class VmmUnavailable(VmmError):
    """This process cannot export or import device memory: no cuda-python, no CUDA driver, no
    such device, or a device without VMM or POSIX file descriptor handles."""


def _driver() -> Any:  # noqa: ANN401 - the cuda.bindings.driver module
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise VmmUnavailable(f"the GPU tier needs cuda-python (cuda.bindings): {exc}") from exc
    return driver


class Vmm:
    """The CUDA driver's VMM calls on one device, every CUresult checked."""

    def __init__(self, device_index: int):
        self.d = _driver()
        self.device_index = device_index
        try:
            self._check(self.d.cuInit(0), "cuInit")
        except RuntimeError as exc:  # cuda-python without libcuda.so.1: no driver on this machine
            raise VmmUnavailable(f"no CUDA driver: {exc}") from exc
        count = self._check(self.d.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= device_index < count:
            raise VmmUnavailable(f"no CUDA device {device_index} ({count} visible)")
        self.device = self._check(self.d.cuDeviceGet(device_index), "cuDeviceGet")
        # retained once, for the life of the process (torch retains the same context)
        self.context = self._check(self.d.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.ensure_context()
        self.uuid: bytes = bytes(self._check(self.d.cuDeviceGetUuid(self.device), "cuDeviceGetUuid").bytes)
        self.export_reason = self._export_reason()
        self.granularity = self._granularity() if not self.export_reason else 0

    # -- checks ------------------------------------------------------------------------
    def _check(self, result: Any, what: str) -> Any:  # noqa: ANN401 - cuda-python's tuples
        err = result[0]
        if err != self.d.CUresult.CUDA_SUCCESS:
            _, name = self.d.cuGetErrorName(err)
            label = name.decode() if isinstance(name, bytes) else str(name)
            raise VmmError(f"{what} failed: {label} ({int(err)})", int(err))
        return result[1] if len(result) == 2 else result[1:]

    def ensure_context(self) -> None:
        """The device's primary context current on this thread (torch's runtime uses the same
        one, so a mapping made here is valid in torch's copies and kernels)."""
        current = self._check(self.d.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(current) != int(self.context):
            self._check(self.d.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def _attr(self, name: str) -> int:
        attr = getattr(self.d.CUdevice_attribute, name)
        return int(self._check(self.d.cuDeviceGetAttribute(attr, self.device), f"cuDeviceGetAttribute({name})"))

    def _export_reason(self) -> str:
        if not self._attr("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"):
            return f"device {self.device_index} has no virtual memory management"
        if not self._attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
            return f"device {self.device_index} exports no POSIX file descriptor handles"
        return ""

    def supports_export(self) -> bool:
        return not self.export_reason

    def require_export(self) -> None:
        if self.export_reason:
            raise VmmUnavailable(self.export_reason)

    def supports_ipc_events(self) -> bool:
        return bool(self._attr("CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED"))

    def can_access_peer(self, other: Vmm) -> bool:
        if other.device_index == self.device_index:
            return True
        return bool(self._check(self.d.cuDeviceCanAccessPeer(self.device, other.device), "cuDeviceCanAccessPeer"))

    # -- allocation properties ---------------------------------------------------------
    def _prop(self) -> Any:  # noqa: ANN401 - CUmemAllocationProp
        d = self.d
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device_index
        prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return prop

    def _granularity(self) -> int:
        flag = self.d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self._check(self.d.cuMemGetAllocationGranularity(self._prop(), flag),
                               "cuMemGetAllocationGranularity"))

    def round_up(self, size: int) -> int:
        self.require_export()
        g = self.granularity
        return (size + g - 1) // g * g

    def access_desc(self, device_index: int) -> Any:  # noqa: ANN401 - CUmemAccessDesc
        d = self.d
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device_index
        desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc


@dataclasses.dataclass(frozen=True)
class CudaArray:
    """Bytes of device memory as a __cuda_array_interface__ (version 3) object: what
    torch.as_tensor(x, device="cuda") and other CUDA array libraries alias without a copy. No
    stream is named: the consumer orders its own work."""

    ptr: int
    nbytes: int

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
                "strides": None}


class DeviceBuffer:
    """Physical device memory that other processes can import (the owner's handle)."""

    def __init__(self, vmm: Vmm, handle: Any, size: int):  # noqa: ANN401 - CUmemGenericAllocationHandle
        self.vmm = vmm
        self.handle = handle
        self.size = size
        self.released = False

    @classmethod
    def create(cls, vmm: Vmm, size: int) -> DeviceBuffer:
        if size <= 0:
            raise VmmError(f"a device buffer needs a positive size, got {size}")
        size = vmm.round_up(size)
        vmm.ensure_context()
        handle = vmm._check(vmm.d.cuMemCreate(size, vmm._prop(), 0), f"cuMemCreate({size} bytes)")
        return cls(vmm, handle, size)

    def _live(self) -> None:
        if self.released:
            raise VmmError("the device buffer was released")

    def export_fd(self) -> int:
        """A new POSIX file descriptor of the buffer; the caller owns (and closes) it."""
        self._live()
        kind = self.vmm.d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(self.vmm._check(self.vmm.d.cuMemExportToShareableHandle(self.handle, kind, 0),
                                   "cuMemExportToShareableHandle"))

    def map(self, access: tuple[int, ...] = ()) -> Mapping:
        """The owner's own mapping (a second handle is not needed: it maps its handle)."""
        self._live()
        return Mapping._map(self.vmm, self.handle, self.size, access, owns_handle=False)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.vmm._check(self.vmm.d.cuMemRelease(self.handle), "cuMemRelease")


class Mapping:
    """Device memory mapped at .ptr in this process."""

    def __init__(self, vmm: Vmm, handle: Any, ptr: int, size: int, owns_handle: bool):  # noqa: ANN401
        self.vmm = vmm
        self._handle = handle
        self.ptr = ptr
        self.size = size
        self._owns_handle = owns_handle
        self.closed = False

    @classmethod
    def import_fd(cls, vmm: Vmm, fd: int, size: int, access: tuple[int, ...] = ()) -> Mapping:
        """Import the descriptor an owner exported and map `size` bytes of it; `fd` stays the
        caller's to close. `access`: devices besides this one that may read and write it."""
        vmm.require_export()
        if size <= 0 or size % vmm.granularity:
            raise VmmError(f"a mapping of {size} bytes is not a positive multiple of the granularity "
                           f"{vmm.granularity}")
        vmm.ensure_context()
        kind = vmm.d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        handle = vmm._check(vmm.d.cuMemImportFromShareableHandle(fd, kind), "cuMemImportFromShareableHandle")
        try:
            return cls._map(vmm, handle, size, access, owns_handle=True)
        except VmmError:
            vmm.d.cuMemRelease(handle)
            raise

    @classmethod
    def _map(cls, vmm: Vmm, handle: Any, size: int, access: tuple[int, ...], owns_handle: bool) -> Mapping:  # noqa: ANN401
        d = vmm.d
        ptr = vmm._check(d.cuMemAddressReserve(size, vmm.granularity, 0, 0), "cuMemAddressReserve")
        try:
            vmm._check(d.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
        except VmmError:
            d.cuMemAddressFree(ptr, size)
            raise
        devices = (vmm.device_index, *[a for a in access if a != vmm.device_index])
        descs = [vmm.access_desc(i) for i in devices]
        try:
            vmm._check(d.cuMemSetAccess(ptr, size, descs, len(descs)), f"cuMemSetAccess(devices {devices})")
        except VmmError:
            d.cuMemUnmap(ptr, size)
            d.cuMemAddressFree(ptr, size)
            raise
        return cls(vmm, handle, int(ptr), size, owns_handle)

    def view(self, offset: int = 0, nbytes: int | None = None) -> CudaArray:
        if self.closed:
            raise VmmError("the mapping was closed")
        nbytes = self.size - offset if nbytes is None else nbytes
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise VmmError(f"bytes {offset}..{offset + nbytes} outside the mapping of {self.size}")
        return CudaArray(self.ptr + offset, nbytes)

    def close(self) -> None:
        """Unmap and free the address range; an importer's handle is released too. The caller
        makes sure no work of its own still reads or writes the range."""
        if self.closed:
            return
        self.closed = True
        d, vmm = self.vmm.d, self.vmm
        ptr = d.CUdeviceptr(self.ptr)
        vmm._check(d.cuMemUnmap(ptr, self.size), "cuMemUnmap")
        vmm._check(d.cuMemAddressFree(ptr, self.size), "cuMemAddressFree")
        if self._owns_handle:
            vmm._check(d.cuMemRelease(self._handle), "cuMemRelease")


IPC_EVENT_HANDLE_BYTES = 64


class IpcEvent:
    """A CUDA event shared between processes: one records it, others wait on it."""

    def __init__(self, vmm: Vmm, event: Any, owner: bool):  # noqa: ANN401 - CUevent
        self.vmm = vmm
        self.event = event
        self.owner = owner
        self.closed = False

    @classmethod
    def create(cls, vmm: Vmm) -> IpcEvent:
        if not vmm.supports_ipc_events():
            raise VmmUnavailable(f"device {vmm.device_index} has no interprocess events")
        flags = int(vmm.d.CUevent_flags.CU_EVENT_INTERPROCESS) | int(vmm.d.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        vmm.ensure_context()
        return cls(vmm, vmm._check(vmm.d.cuEventCreate(flags), "cuEventCreate(interprocess)"), True)

    def handle(self) -> bytes:
        h = self.vmm._check(self.vmm.d.cuIpcGetEventHandle(self.event), "cuIpcGetEventHandle")
        return bytes(h.reserved)

    @classmethod
    def open(cls, vmm: Vmm, handle: bytes) -> IpcEvent:
        if len(handle) != IPC_EVENT_HANDLE_BYTES:
            raise VmmError(f"an interprocess event handle has {IPC_EVENT_HANDLE_BYTES} bytes, got {len(handle)}")
        h = vmm.d.CUipcEventHandle()
        h.reserved = bytes(handle)
        vmm.ensure_context()
        return cls(vmm, vmm._check(vmm.d.cuIpcOpenEventHandle(h), "cuIpcOpenEventHandle"), False)

    def record(self, stream: int) -> None:
        """Record on `stream` (a CUstream handle as an int: torch's stream.cuda_stream)."""
        self.vmm._check(self.vmm.d.cuEventRecord(self.event, self.vmm.d.CUstream(stream)), "cuEventRecord")

    def wait(self, stream: int) -> None:
        """Work enqueued on `stream` after this call runs after the event's last record."""
        self.vmm._check(self.vmm.d.cuStreamWaitEvent(self.vmm.d.CUstream(stream), self.event, 0),
                        "cuStreamWaitEvent")

    def synchronize(self) -> None:
        self.vmm._check(self.vmm.d.cuEventSynchronize(self.event), "cuEventSynchronize")

    def query(self) -> bool:
        err = self.vmm.d.cuEventQuery(self.event)[0]
        if err == self.vmm.d.CUresult.CUDA_SUCCESS:
            return True
        if err == self.vmm.d.CUresult.CUDA_ERROR_NOT_READY:
            return False
        self.vmm._check((err,), "cuEventQuery")  # raises: any other result is an error
        return False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.vmm._check(self.vmm.d.cuEventDestroy(self.event), "cuEventDestroy")
