"""Negative controls of kv-sketch-1's GPU kernel (kvpool.gpu.sketch_kernel), for the probe that
must refuse a kernel whose sums differ from the host reference (suites/unit/test_sketch_kernel.py).

  LastTileSkipped   the kernel launched over one step less of every row: the last BK bytes of
                    each 16 KiB row never reach the sums (an off-by-one in the loop's bound), so
                    a page differing only there sketches the same.
"""

from __future__ import annotations

import torch
import triton

from kvpool.gpu import sketch_kernel
from kvpool.pool.digest import SKETCH_COLS, SKETCH_ROW


class LastTileSkipped(sketch_kernel.SketchKernel):
    def __call__(self, rows: torch.Tensor, key: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        m = rows.shape[0]
        if out is None:
            out = torch.empty((m, SKETCH_COLS), dtype=torch.int32, device=rows.device)
        if m:
            sketch_kernel._sketch_rows[(triton.cdiv(m, self.bm),)](  # noqa: SLF001 - the control's own launch
                rows, key, out, m, rows.stride(0), K=SKETCH_ROW - self.bk, N=SKETCH_COLS, BM=self.bm, BK=self.bk,
                num_warps=self.warps, num_stages=self.stages)
        return out
