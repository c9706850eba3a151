"""kv-sketch-1 (kvpool.pool.digest) on a torch device: pages in rows of SKETCH_ROW bytes times
the fixed int8 key, in exact integer arithmetic.

  Sketcher(device, impl="auto")
      the key on `device`; `impl` says how the products run, the first of these that passed
      the probe against the host reference (kvpool.pool.digest.page_sketch), or the one asked for:
        "triton-dot"  a Triton kernel of our own (kvpool.gpu.sketch_kernel): each program reads
                      SKETCH_BM whole rows once and multiplies them by the key on int8 tensor
                      cores (int32 accumulation, exact); the memory-bound shape the product has
                      (16 outputs per 16 KiB row), which a GEMM library tiles for a wide output
        "int8-mm"     torch._int_mm (cuBLASLt int8, int32 accumulation, exact)
        "float64-mm"  float64 products (exact too: every sum is an integer below 2^28)
      `reason` says why a faster one was not used. `impl` may be forced (TransferConfig's
      sketch_impl): a forced one that fails its probe is a RuntimeError, never a fallback.
  .sketch(rows, out=None) -> int32 (m, SKETCH_COLS)
      `rows`: uint8 or int8 (m, SKETCH_ROW), rows contiguous (any row stride), on the device.
      Runs on the current stream; nothing is synchronized.
  staged_width(page_bytes) -> bytes per staged page (page_bytes rounded up to whole rows:
      a staging row's padding is zero and stays zero, so the sketch of a staged page is the
      sketch of the page).
  digests(host_sketch, page_bytes) -> [bytes]   the digests of pages from their sketches
      (int32 (pages, rows, SKETCH_COLS) in host memory), XXH3-128 on the host: 64 bytes
      per 16 KiB of page.

The host reads only the sketches; the page bytes stay on the link and the GPU.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kvpool.gpu.config import SKETCH_IMPLS as IMPLS  # "auto" tries them in this order
from kvpool.pool.digest import SKETCH_COLS, SKETCH_ROW, page_sketch, sketch_digest, sketch_key, sketch_rows

# Probe rows: > 16 (torch._int_mm's smallest m on CUDA), not a multiple of a kernel's rows per
# program, and both a multiple of 16 and not: Triton compiles a kernel once for each (the loads'
# and stores' full chunks are multiples of 16), so the probe checks both compiled kernels.
_PROBE_ROWS = (200, 208)


def staged_width(page_bytes: int) -> int:
    return sketch_rows(page_bytes) * SKETCH_ROW


class Sketcher:
    def __init__(self, device: torch.device, impl: str = "auto"):
        if impl != "auto" and impl not in IMPLS:
            raise ValueError(f"unknown kv-sketch-1 implementation {impl!r}: one of auto, {', '.join(IMPLS)}")
        self.device = device
        key = torch.from_numpy(np.array(sketch_key()))
        self._key_i8 = key.to(device)
        self._key_f64 = key.to(torch.float64).to(device)
        self._kernel = None
        rng = np.random.default_rng(0)
        probes = []
        for m in _PROBE_ROWS:
            rows = rng.integers(0, 256, (m, SKETCH_ROW), dtype=np.uint8)
            probes.append((torch.from_numpy(rows).to(device).view(torch.int8), page_sketch(rows)))
        reasons: list[str] = []
        for name in (IMPLS if impl == "auto" else (impl,)):
            why = next(filter(None, (self._probe(name, probe, want) for probe, want in probes)), None)
            if why is None:
                self.impl = name
                break
            reasons.append(f"{name}: {why}")
        else:
            raise RuntimeError("kv-sketch-1 on this device: no implementation equals the host reference ("
                               + "; ".join(reasons) + ")")
        self.reason = "; ".join(reasons)

    def _probe(self, name: str, probe: torch.Tensor, want: np.ndarray) -> str | None:
        """None where `name` runs here and equals the host reference on the probe rows; else why not."""
        try:
            if name == "triton-dot":
                if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                    return "needs a CUDA device (or Triton's interpreter: TRITON_INTERPRET=1)"
                if self._kernel is None:
                    from kvpool.gpu.sketch_kernel import SketchKernel  # imports triton

                    self._kernel = SketchKernel()
            got = self._run(name, probe, None).cpu().numpy()
        # Any failure to build or run here (no triton, Triton's own compile and resource errors,
        # which are not RuntimeErrors, no int8 product on this device): this implementation is
        # not used, and why is kept in `reason` (the engine's capabilities report it).
        except Exception as exc:  # noqa: BLE001 - recorded as the reason, the next implementation tried
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if not np.array_equal(got, want):
            return "returned other values than the host reference"
        return None

    def _run(self, name: str, rows_i8: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if name == "triton-dot":
            return self._kernel(rows_i8, self._key_i8, out)
        if name == "int8-mm" and rows_i8.shape[0] > 16:
            if out is not None:
                return torch._int_mm(rows_i8, self._key_i8, out=out)
            return torch._int_mm(rows_i8, self._key_i8)
        # float64-mm, and int8-mm's products of too few rows for cuBLASLt: the exact float64 one
        res = (rows_i8.to(torch.float64) @ self._key_f64).to(torch.int32)
        if out is not None:
            out.copy_(res)
            return out
        return res

    @property
    def key(self) -> torch.Tensor:
        """The int8 key on the device (SKETCH_ROW x SKETCH_COLS)."""
        return self._key_i8

    def sketch(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(self.impl, rows.view(torch.int8), out)


def digests(host_sketch: np.ndarray, page_bytes: int) -> list[bytes]:
    """One digest per page of `host_sketch` (int32 (pages, rows, SKETCH_COLS))."""
    flat = np.ascontiguousarray(host_sketch).astype("<i4", copy=False)
    return [sketch_digest(flat[i], page_bytes) for i in range(flat.shape[0])]


__all__ = ["IMPLS", "SKETCH_COLS", "Sketcher", "digests", "staged_width"]
