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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpool.pool.digest import SKETCH_COLS, SKETCH_ROW


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


class SketchKernel:
    def __init__(self, bm: int = 64, bk: int = 256, warps: int = 4, stages: int = 3):
        if SKETCH_ROW % bk:
            raise ValueError(f"bk={bk} does not divide a sketch row of {SKETCH_ROW} bytes")
        self.bm, self.bk, self.warps, self.stages = bm, bk, warps, stages

    def __call__(self, rows: torch.Tensor, key: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        m = rows.shape[0]
        if rows.dtype != torch.int8 or rows.dim() != 2 or rows.shape[1] != SKETCH_ROW or rows.stride(1) != 1:
            raise ValueError(f"rows must be int8 (m, {SKETCH_ROW}) with contiguous rows, not {rows.dtype} "
                             f"{tuple(rows.shape)} strides {rows.stride()}")
        if key.dtype != torch.int8 or tuple(key.shape) != (SKETCH_ROW, SKETCH_COLS) or not key.is_contiguous():
            raise ValueError("the key must be the contiguous int8 kv-sketch-1 key")
        if out is None:
            out = torch.empty((m, SKETCH_COLS), dtype=torch.int32, device=rows.device)
        elif out.dtype != torch.int32 or tuple(out.shape) != (m, SKETCH_COLS) or not out.is_contiguous():
            raise ValueError(f"out must be contiguous int32 ({m}, {SKETCH_COLS})")
        if m:
            _sketch_rows[(triton.cdiv(m, self.bm),)](rows, key, out, m, rows.stride(0), K=SKETCH_ROW, N=SKETCH_COLS,
                                                     BM=self.bm, BK=self.bk, num_warps=self.warps,
                                                     num_stages=self.stages)
        return out


__all__ = ["SketchKernel"]
