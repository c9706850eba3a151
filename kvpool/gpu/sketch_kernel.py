"""kv-sketch-1 as a Triton kernel (kvpool.gpu.sketch's "triton-dot"): rows (m x SKETCH_ROW int8,
any row stride) times the key (SKETCH_ROW x SKETCH_COLS int8) -> int32 (m x SKETCH_COLS), exact.

Each program takes BM rows and walks their SKETCH_ROW bytes in steps of BK: one load of a
(BM, BK) tile of the rows, one of the (BK, SKETCH_COLS) tile of the key (256 KiB in all, kept
in L2 across programs), one int8 tensor-core product accumulated in int32. Every byte of the
rows is read once, so the kernel runs at the rate the memory reads, where a GEMM library's
tiles for a wide output leave this narrow one (16 outputs per 16 KiB row) at a fraction of it
(scripts/gpu/sketch_bench.py measures both). Exactness: |sum| <= 16384 * 128 * 128 = 2^28 fits
int32, and int8 products accumulated in int32 are exact; kvpool.gpu.sketch probes the kernel
against the host reference before using it.

  SketchKernel(bm=64, bk=256, warps=4, stages=3)(rows, key, out=None) -> out
  CopySketchKernel(bm=64, bk=256, warps=4, stages=3)(src, pages, stride, page_bytes, dst, width, key, out)
      a load's copy and its check in one pass (kvpool.gpu.load, pages in device memory): the
      first `page_bytes` of each page `pages[i]` of `src` (int8, page p at p * stride) into row i
      of `dst` (int8, rows `width` bytes apart), every byte read once, and the sketch of the
      bytes written into `out` (int32, the page_bytes / SKETCH_ROW rows of page i from row
      i * page_bytes / SKETCH_ROW): the values SketchKernel gives for the staged rows, from the
      registers that were stored, so what is checked is what was written. Pages of whole sketch
      rows only (page_bytes a multiple of SKETCH_ROW).
  InstallSketchKernel(...)(src, pages, blocks, stride, page_bytes, pieces, key, out)
      the same pass writing each page straight into its block of the engine's layers
      (install_pieces(layers, page_bytes, bk, device) says where each bk bytes of a page go):
      no staging row, no second pass; the sketch is of the bytes installed.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from kvpool.pool.digest import SKETCH_COLS, SKETCH_ROW


# Triton specializes a kernel on whether its integer and pointer arguments are multiples of 16
# (a new multiple compiles it again): that is what lets it vectorize the rows' loads, and not
# specializing the sizes made both kernels 1.5-2x slower on an H100 (11.5 against 7.0 ms to
# sketch 21 GB). Callers keep the arguments of one shape instead (the fused copy's page numbers
# at a 16-byte boundary; rows of whole sketch rows).
@triton.jit
def _sketch_rows(rows_ptr, key_ptr, out_ptr, m, row_stride,
                 K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = pid * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    offs_n = tl.arange(0, N)
    live = offs_m < m
    a_ptrs = rows_ptr + offs_m.to(tl.int64)[:, None] * row_stride + offs_k[None, :]
    b_ptrs = key_ptr + offs_k[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BM, N), dtype=tl.int32)
    for _ in range(0, K, BK):
        a = tl.load(a_ptrs, mask=live[:, None], other=0)
        b = tl.load(b_ptrs)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BK
        b_ptrs += BK * N
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc, mask=live[:, None])


@triton.jit
def _copy_sketch_pages(src_ptr, pages_ptr, dst_ptr, key_ptr, out_ptr, m, stride, dst_width,
                       R: tl.constexpr, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)  # sketch rows of the chunk: page i = row // R, its part row % R
    live = rows < m
    page_i = rows // R
    part = (rows % R).to(tl.int64)
    page = tl.load(pages_ptr + page_i, mask=live, other=0)
    src_row = page * stride + part * K
    dst_row = page_i.to(tl.int64) * dst_width + part * K
    offs_k = tl.arange(0, BK)
    offs_n = tl.arange(0, N)
    b_ptrs = key_ptr + offs_k[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BM, N), dtype=tl.int32)
    for k0 in range(0, K, BK):
        a = tl.load(src_ptr + src_row[:, None] + k0 + offs_k[None, :], mask=live[:, None], other=0)
        tl.store(dst_ptr + dst_row[:, None] + k0 + offs_k[None, :], a, mask=live[:, None])
        b = tl.load(b_ptrs + k0 * N)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :], acc, mask=live[:, None])


@triton.jit
def _install_sketch_pages(src_ptr, pages_ptr, blocks_ptr, dst_ptr, piece_off_ptr, piece_stride_ptr, key_ptr, out_ptr,
                          m, stride, R: tl.constexpr, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr,
                          BK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)  # sketch rows of the chunk: page i = row // R, its part row % R
    live = rows < m
    page_i = rows // R
    part = (rows % R).to(tl.int64)
    page = tl.load(pages_ptr + page_i, mask=live, other=0)
    block = tl.load(blocks_ptr + page_i, mask=live, other=0)
    src_row = page * stride + part * K
    piece0 = part * (K // BK)  # the row's first piece: BK bytes of the page, one run of one layer's block
    offs_k = tl.arange(0, BK)
    offs_n = tl.arange(0, N)
    b_ptrs = key_ptr + offs_k[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BM, N), dtype=tl.int32)
    for k0 in range(0, K, BK):
        a = tl.load(src_ptr + src_row[:, None] + k0 + offs_k[None, :], mask=live[:, None], other=0)
        q = piece0 + k0 // BK
        at = tl.load(piece_off_ptr + q, mask=live, other=0) + block * tl.load(piece_stride_ptr + q, mask=live, other=0)
        at = tl.multiple_of(at, 16)  # the pieces' offsets and strides are (install_pieces checks it)
        tl.store(dst_ptr + at[:, None] + offs_k[None, :], a, mask=live[:, None])
        b = tl.load(b_ptrs + k0 * N)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :], acc, mask=live[:, None])


def _on(t: torch.Tensor):  # noqa: ANN202 - a context manager
    """The tensor's CUDA device made current: Triton launches on the current device, whatever
    device the pointers it is given are on."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_key(key: torch.Tensor) -> None:
    if key.dtype != torch.int8 or tuple(key.shape) != (SKETCH_ROW, SKETCH_COLS) or not key.is_contiguous():
        raise ValueError("the key must be the contiguous int8 kv-sketch-1 key")


def _check_page_args(src: torch.Tensor, pages: torch.Tensor, stride: int, page_size: int, key: torch.Tensor,
                     out: torch.Tensor) -> int:
    """The arguments both page kernels share (src, the page numbers, their geometry, the key and
    the sketches' output), checked; the sketch rows of one page."""
    if page_size <= 0 or page_size % SKETCH_ROW or stride < page_size:
        raise ValueError(f"pages of {page_size} bytes {stride} apart are not whole sketch rows of {SKETCH_ROW}")
    if src.dtype != torch.int8 or src.dim() != 1:
        raise ValueError("src must be one-dimensional int8")
    if pages.dtype != torch.int64 or pages.dim() != 1 or not pages.is_contiguous() or pages.data_ptr() % 16:
        raise ValueError("pages must be a contiguous int64 vector at a 16-byte boundary (one compiled kernel)")
    _check_key(key)
    r = page_size // SKETCH_ROW
    n = pages.numel()
    if out.dtype != torch.int32 or out.shape[0] < n * r or out.shape[1:] != (SKETCH_COLS,) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous int32 with at least {n * r} rows of {SKETCH_COLS}")
    return r


class SketchKernel:
    def __init__(self, bm: int = 64, bk: int = 256, warps: int = 4, stages: int = 3):
        if SKETCH_ROW % bk or bm < 16 or bk < 32:
            raise ValueError(f"bm={bm}, bk={bk}: tl.dot needs 16 rows and 32 bytes a step at least, and bk must "
                             f"divide a sketch row of {SKETCH_ROW} bytes")
        self.bm, self.bk, self.warps, self.stages = bm, bk, warps, stages

    def __call__(self, rows: torch.Tensor, key: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        m = rows.shape[0]
        if rows.dtype != torch.int8 or rows.dim() != 2 or rows.shape[1] != SKETCH_ROW or rows.stride(1) != 1:
            raise ValueError(f"rows must be int8 (m, {SKETCH_ROW}) with contiguous rows, not {rows.dtype} "
                             f"{tuple(rows.shape)} strides {rows.stride()}")
        _check_key(key)
        if out is None:
            out = torch.empty((m, SKETCH_COLS), dtype=torch.int32, device=rows.device)
        elif out.dtype != torch.int32 or tuple(out.shape) != (m, SKETCH_COLS) or not out.is_contiguous():
            raise ValueError(f"out must be contiguous int32 ({m}, {SKETCH_COLS})")
        if m:
            with _on(rows):
                _sketch_rows[(triton.cdiv(m, self.bm),)](rows, key, out, m, rows.stride(0), K=SKETCH_ROW,
                                                         N=SKETCH_COLS, BM=self.bm, BK=self.bk,
                                                         num_warps=self.warps, num_stages=self.stages)
        return out


class CopySketchKernel(SketchKernel):
    def __call__(self, src: torch.Tensor, pages: torch.Tensor, stride: int, page_size: int,  # type: ignore[override]
                 dst: torch.Tensor, width: int, key: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n = pages.numel()
        r = _check_page_args(src, pages, stride, page_size, key, out)
        if dst.dtype != torch.int8 or not dst.is_contiguous():
            raise ValueError("dst must be contiguous int8")
        if width < page_size or (n and dst.numel() < (n - 1) * width + page_size):
            raise ValueError(f"dst holds fewer than {n} rows of {page_size} bytes {width} apart")
        m = n * r
        if m:
            with _on(src):
                _copy_sketch_pages[(triton.cdiv(m, self.bm),)](src, pages, dst, key, out, m, stride, width, R=r,
                                                               K=SKETCH_ROW, N=SKETCH_COLS, BM=self.bm, BK=self.bk,
                                                               num_warps=self.warps, num_stages=self.stages)
        return out


class InstallPieces:
    """Where each piece of a page goes in the blocks: the page's bytes in pieces of `piece`
    bytes, piece q of block b at `base + off[q] + b * stride[q]` (byte addresses; `base` the
    lowest of the layers' tensors, whose view the kernel writes through). Built by
    install_pieces from the layers' runs."""

    def __init__(self, base: torch.Tensor, off: torch.Tensor, stride: torch.Tensor, piece: int):
        self.base, self.off, self.stride, self.piece = base, off, stride, piece


def install_pieces(layers: list[tuple[torch.Tensor, int, tuple[tuple[int, int], ...]]], page_bytes: int,
                   piece: int, device: torch.device) -> InstallPieces:
    """The pieces of a page for InstallSketchKernel: `layers` in page order, each (its tensor,
    the bytes between consecutive blocks, its runs: (offset from the block's first byte,
    length) in page order). ValueError where the page is not whole pieces, a run is not
    (its length and its offset in the block multiples of `piece`) or a stride or an address
    is not a multiple of 16 (the kernel's stores are 16-byte wide), or the runs do not add up
    to the page."""
    import numpy as np

    if piece <= 0 or piece % 16 or page_bytes % piece:
        raise ValueError(f"a page of {page_bytes} bytes is not whole pieces of {piece}")
    base = min(layers, key=lambda layer: layer[0].data_ptr())[0]
    at0 = base.data_ptr()
    off: list[int] = []
    stride: list[int] = []
    for t, block_stride, runs in layers:
        if t.device != base.device:
            raise ValueError("the layers' tensors must be on one device")
        if (t.data_ptr() - at0) % 16 or block_stride % 16:
            raise ValueError(f"a layer at {t.data_ptr():#x} with blocks {block_stride} bytes apart: not 16-byte aligned")
        for o, n in runs:
            if o % piece or n % piece:
                raise ValueError(f"a run of {n} bytes at {o} in the block is not whole pieces of {piece}")
            for k in range(0, n, piece):
                off.append(t.data_ptr() - at0 + o + k)
                stride.append(block_stride)
    if len(off) * piece != page_bytes:
        raise ValueError(f"the layers' runs are {len(off) * piece} bytes, the page {page_bytes}")
    as_t = lambda v: torch.from_numpy(np.asarray(v, dtype=np.int64)).to(device)  # noqa: E731
    # the kernel's base: bytes from the lowest tensor's first element on, as a view of its storage
    # (never a copy: a reshape of a strided tensor would copy, and the kernel would write there);
    # the layers' views may have any strides (vLLM's permuted layouts)
    storage = base.untyped_storage()
    first = base.storage_offset() * base.element_size()
    flat = torch.empty(0, dtype=torch.int8, device=base.device).set_(storage, first, (storage.nbytes() - first,), (1,))
    if flat.data_ptr() != at0:
        raise ValueError("the lowest layer's storage does not start where its tensor does")
    return InstallPieces(flat, as_t(off), as_t(stride), piece)


class InstallSketchKernel(SketchKernel):
    """A load's copy, check and install in one pass, for pages in device memory: page
    `pages[i]` of `src` (int8, page p at p * stride) written straight into block `blocks[i]`
    of the layers (InstallPieces), every byte read once, and the sketch of the bytes written
    into `out` (int32, as CopySketchKernel's): what is checked is what was installed. The
    pieces are this kernel's step (bk bytes)."""

    def __call__(self, src: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor,  # type: ignore[override]
                 stride: int, page_size: int, pieces: InstallPieces, key: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
        n = pages.numel()
        r = _check_page_args(src, pages, stride, page_size, key, out)
        if pieces.piece != self.bk or pieces.off.numel() * self.bk != page_size:
            raise ValueError(f"pieces of {pieces.piece} bytes covering {pieces.off.numel() * pieces.piece}: this "
                             f"kernel steps {self.bk} bytes over pages of {page_size}")
        if blocks.dtype != torch.int64 or blocks.dim() != 1 or not blocks.is_contiguous() or blocks.data_ptr() % 16:
            raise ValueError("blocks must be a contiguous int64 vector at a 16-byte boundary (one compiled kernel)")
        if blocks.numel() != n:
            raise ValueError(f"{n} pages for {blocks.numel()} blocks")
        m = n * r
        if m:
            with _on(src):
                _install_sketch_pages[(triton.cdiv(m, self.bm),)](
                    src, pages, blocks, pieces.base, pieces.off, pieces.stride, key, out, m, stride, R=r,
                    K=SKETCH_ROW, N=SKETCH_COLS, BM=self.bm, BK=self.bk, num_warps=self.warps,
                    num_stages=self.stages)
        return out


__all__ = ["CopySketchKernel", "InstallPieces", "InstallSketchKernel", "SketchKernel", "install_pieces"]
