"""kvpool.gpu.vmm where no GPU is: a typed VmmUnavailable, whichever part is missing (cuda-python,
or the driver behind it), and the array interface a mapping's view gives torch."""

import os

import pytest

from kvpool.gpu.config import TransferError
from kvpool.gpu.vmm import CudaArray, Vmm, VmmError, VmmUnavailable


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a CUDA driver is here: the gpu suite covers Vmm")
def test_without_cuda_vmm_is_unavailable_and_typed():
    with pytest.raises(VmmUnavailable) as info:
        Vmm(0)
    assert isinstance(info.value, VmmError) and isinstance(info.value, TransferError)
    assert "cuda-python" in str(info.value) or "no CUDA driver" in str(info.value)


def test_a_view_is_a_cuda_array_of_bytes():
    view = CudaArray(0x7F0000001000, 4096)
    assert view.__cuda_array_interface__ == {"shape": (4096,), "typestr": "|u1", "data": (0x7F0000001000, False),
                                             "version": 3, "strides": None}
