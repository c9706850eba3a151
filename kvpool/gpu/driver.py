"""The driver copy path's calls: raw-pointer copies through cuda-python (cuda.bindings.driver)
on a torch stream, every CUresult checked.

  Driver(device_index)
      .copies(dsts, srcs, sizes, stream, to_host)   device to host (True), host to device
            (False) or device to device (None), on `stream`: one cuMemcpyBatchAsync where
            the probe found it copies the bytes (`batched`; `batched_reason` says why not),
            else cuMemcpy{DtoH,HtoD,DtoD}Async one by one.
      .probe_batched(stream, device)   one small batched copy, checked byte for byte.
      .ensure_context()   the primary context current on the calling thread.
  MIN_RUN_BYTES   the shortest contiguous run the driver path accepts (a layout with
      shorter runs takes the torch path).

What the engine copies on this path (one copy per layer, block and contiguous run; a
load's pages per page or run of pages) is built in kvpool.gpu.store and kvpool.gpu.load.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool.gpu.config import TransferError

MIN_RUN_BYTES = 512  # the driver path refuses layouts whose contiguous runs are shorter


class Driver:
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
