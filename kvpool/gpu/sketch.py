"""kv-sketch-1 (kvpool.pool.digest) on a torch device: pages in rows of SKETCH_ROW bytes times
the fixed int8 key, as one integer matrix product.

  Sketcher(device)
      the key on `device`; `impl` says how the products run: "int8-mm" (torch._int_mm:
      int8 tensor cores on CUDA, int32 accumulation, exact) or "float64-mm" (exact too:
      every sum is an integer below 2^28), whichever passed the probe against the host
      reference (kvpool.pool.digest.page_sketch) first; `reason` says why int8-mm was not used.
  .sketch(rows, out=None) -> int32 (m, SKETCH_COLS)
      `rows`: uint8 or int8 (m, SKETCH_ROW), contiguous, on the device. Runs on the current
      stream; nothing is synchronized.
  staged_width(page_bytes) -> bytes per staged page (page_bytes rounded up to whole rows:
      a staging row's padding is zero and stays zero, so the sketch of a staged page is the
      sketch of the page).
  digests(host_sketch, page_bytes) -> [bytes]   the digests of pages from their sketches
      (int32 (pages, rows, SKETCH_COLS) in host memory), XXH3-128 on the host: 64 bytes
      per 16 KiB of page.

The host reads only the sketches; the page bytes stay on the link and the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpool.pool.digest import SKETCH_COLS, SKETCH_ROW, page_sketch, sketch_digest, sketch_key, sketch_rows

_PROBE_ROWS = 40  # > 16: torch._int_mm's smallest m on CUDA


def staged_width(page_bytes: int) -> int:
    return sketch_rows(page_bytes) * SKETCH_ROW


class Sketcher:
    def __init__(self, device: torch.device):
        self.device = device
        key = torch.from_numpy(np.array(sketch_key()))
        self._key_i8 = key.to(device)
        self._key_f64 = key.to(torch.float64).to(device)
        self.impl = "float64-mm"
        self.reason = ""
        rows = np.random.default_rng(0).integers(0, 256, (_PROBE_ROWS, SKETCH_ROW), dtype=np.uint8)
        want = page_sketch(rows)
        try:
            got = torch._int_mm(torch.from_numpy(rows).to(device).view(torch.int8), self._key_i8).cpu().numpy()
        except (RuntimeError, NotImplementedError, AttributeError) as exc:  # no int8 mm on this device/build
            self.reason = f"torch._int_mm: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        else:
            if np.array_equal(got, want):
                self.impl = "int8-mm"
            else:
                self.reason = "torch._int_mm returned other values than the host reference"
        if self.impl != "int8-mm":
            check = self._f64(torch.from_numpy(rows).to(device).view(torch.int8)).cpu().numpy()
            if not np.array_equal(check, want):
                raise RuntimeError("kv-sketch-1 on this device differs from the host reference on both paths")

    def _f64(self, rows_i8: torch.Tensor) -> torch.Tensor:
        return (rows_i8.to(torch.float64) @ self._key_f64).to(torch.int32)

    def sketch(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows_i8 = rows.view(torch.int8)
        m = rows_i8.shape[0]
        if self.impl == "int8-mm" and m > 16:
            if out is not None:
                return torch._int_mm(rows_i8, self._key_i8, out=out)
            return torch._int_mm(rows_i8, self._key_i8)
        res = self._f64(rows_i8)
        if out is not None:
            out.copy_(res)
            return out
        return res


def digests(host_sketch: np.ndarray, page_bytes: int) -> list[bytes]:
    """One digest per page of `host_sketch` (int32 (pages, rows, SKETCH_COLS))."""
    flat = np.ascontiguousarray(host_sketch).astype("<i4", copy=False)
    return [sketch_digest(flat[i], page_bytes) for i in range(flat.shape[0])]


__all__ = ["SKETCH_COLS", "Sketcher", "digests", "staged_width"]
