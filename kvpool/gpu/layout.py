"""The KV layout the GPU transfer engine copies: where one block of every layer lies in the
KV tensors, and in a pool page (the page order, defined by block_page).

  KVLayout.of(layers, block_dim)   per layer a LayerBlock: the block's shape as uint8, its
        bytes, where they start in the page, the bytes between consecutive blocks, and its
        contiguous runs in page order (the driver path copies one per run).
  block_page(layers, block_dim, block_id)   the page bytes of one block: the definition of
        the page order.
  widest_views(layers_u8, layout) -> (width, views);  as_width(buf, width)
        the tensors as the widest integers their rows allow, so gathers and scatters move
        8 bytes per element instead of 1.
  require_cuda(layers)   the one CUDA device all KV tensors are on (KVLayoutError if not).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch

from kvpool.gpu.config import KVLayoutError


@dataclasses.dataclass(frozen=True)
class LayerBlock:
    """One layer's part of a block."""

    shape: tuple[int, ...]  # the block of this layer, as uint8 (last dim in bytes)
    nbytes: int
    page_offset: int  # where this layer's bytes start in the page
    block_stride: int  # bytes between consecutive blocks of this layer
    runs: tuple[tuple[int, int], ...]  # (offset from the block's first byte, length), in page order


@dataclasses.dataclass(frozen=True)
class KVLayout:
    block_dim: int
    num_blocks: int
    page_bytes: int
    layers: tuple[LayerBlock, ...]

    @property
    def min_run(self) -> int:
        return min(length for layer in self.layers for _, length in layer.runs)

    @classmethod
    def of(cls, layers: Sequence[torch.Tensor], block_dim: int) -> KVLayout:
        if not layers:
            raise KVLayoutError("no KV tensors")
        num_blocks = None
        out = []
        offset = 0
        for i, t in enumerate(layers):
            if not 0 <= block_dim < t.dim() - 1:
                raise KVLayoutError(f"layer {i}: block dim {block_dim} outside a {t.dim()}-d tensor (not the last dim)")
            if t.stride(-1) != 1:
                raise KVLayoutError(f"layer {i}: the last dimension must be contiguous, stride {t.stride(-1)}")
            if num_blocks is None:
                num_blocks = t.shape[block_dim]
            elif t.shape[block_dim] != num_blocks:
                raise KVLayoutError(f"layer {i} has {t.shape[block_dim]} blocks, layer 0 has {num_blocks}")
            es = t.element_size()
            shape = [s for k, s in enumerate(t.shape) if k != block_dim]
            strides = [s * es for k, s in enumerate(t.stride()) if k != block_dim]
            shape[-1] *= es  # as uint8
            strides[-1] = 1
            # the longest C-contiguous suffix of the block's dims: one run per outer index
            k = len(shape) - 1
            run = shape[-1]
            while k > 0 and strides[k - 1] == run:
                k -= 1
                run *= shape[k]
            outer = [range(n) for n in shape[:k]]
            runs = tuple((sum(j * s for j, s in zip(idx, strides[:k])), run) for idx in itertools.product(*outer))
            nbytes = math.prod(shape)
            out.append(LayerBlock(tuple(shape), nbytes, offset, t.stride(block_dim) * es, runs))
            offset += nbytes
        return cls(block_dim, int(num_blocks), offset, tuple(out))


def block_page(layers: Sequence[torch.Tensor], block_dim: int, block_id: int) -> torch.Tensor:
    """The page bytes of one block (uint8, on the layers' device): the definition of the
    page order."""
    return torch.cat([t.select(block_dim, block_id).contiguous().view(torch.uint8).reshape(-1) for t in layers])


_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def widest_views(layers_u8: Sequence[torch.Tensor], layout: KVLayout) -> tuple[int, list[torch.Tensor]]:
    """The KV tensors as the widest integers their rows allow (the gathers and scatters
    move 8 bytes per element instead of 1): (bytes per element, the views)."""
    for width, dtype in _WIDTHS:
        if any(lb.shape[-1] % width for lb in layout.layers):
            continue
        try:
            return width, [t.view(dtype) for t in layers_u8]
        except RuntimeError:  # a storage offset not aligned to the width
            continue
    return 1, list(layers_u8)


def as_width(buf: torch.Tensor, width: int) -> torch.Tensor:
    return buf if width == 1 else buf.view(dict(_WIDTHS)[width])


def require_cuda(layers: Sequence[torch.Tensor]) -> torch.device:
    devices = {t.device for t in layers}
    if len(devices) != 1:
        raise KVLayoutError(f"KV tensors on several devices: {sorted(map(str, devices))}")
    (device,) = devices
    if device.type != "cuda":
        raise KVLayoutError(f"KV tensors on {device}; the GPU transfer engine needs CUDA tensors")
    return device
