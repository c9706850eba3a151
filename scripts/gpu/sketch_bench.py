"""How fast kv-sketch-1 runs on this GPU, each way of computing it next to a plain device copy
of the same bytes (the memory's own rate), every way checked equal to the one the engine uses
(kvpool.gpu.sketch.Sketcher) on the same rows. Prints one JSON object.

The engine's sketch is one int8 matrix product, rows (m x 16384) times the key (16384 x 16):
a very narrow product, which a GEMM library may run far below the memory's rate (about 250 GB/s
measured on the H200 against a 2 TB/s copy: 84 ms to sketch 21 GB). The ways tried:
  rows_x_key      the engine's: torch._int_mm(rows, key)
  key_x_rows_t    the same sums as key^T (16 x 16384) times rows^T: a wide product
  split_k         rows as (m*4 x 4096) times each quarter of the key, the partial sums added
  float16_mm      rows and key in float16 (not exact: sums above 2^11 round; shown for the rate)
  triton_BMxBK_wW the engine's "triton-dot" (kvpool.gpu.sketch_kernel) with BM rows a program, BK
                  bytes a step and W warps; the engine's default is triton_64x256_w4

  python3 scripts/gpu/sketch_bench.py [GiB]     (default 4)
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from kvgate.harness.bench.gpu import gpu_seconds
from kvpool.gpu.sketch import Sketcher
from kvpool.gpu.sketch_kernel import SketchKernel
from kvpool.pool.digest import SKETCH_COLS, SKETCH_ROW, sketch_key


def main(gib: float) -> dict:
    dev = torch.device("cuda")
    nbytes = int(gib * (1 << 30)) // SKETCH_ROW * SKETCH_ROW
    m = nbytes // SKETCH_ROW
    rows = torch.randint(-128, 128, (m, SKETCH_ROW), dtype=torch.int8, device=dev)
    copy_dst = torch.empty_like(rows)
    sk = Sketcher(dev, "int8-mm")  # the reference every way is compared with (itself probed against the host's)
    key = torch.from_numpy(np.array(sketch_key())).to(dev)  # int8 (16384, 16)
    key_t = key.t().contiguous()
    quarters = [key[q * 4096:(q + 1) * 4096].contiguous() for q in range(4)]
    want = sk.sketch(rows)

    def split_k() -> torch.Tensor:
        parts = rows.view(m, 4, 4096)
        return sum(torch._int_mm(parts[:, q].contiguous(), quarters[q]) for q in range(4))

    ways = {
        "rows_x_key": lambda: torch._int_mm(rows, key),
        "key_x_rows_t": lambda: torch._int_mm(key_t, rows.t()).t(),
        "split_k": split_k,
        "float16_mm": lambda: (rows.to(torch.float16) @ key.to(torch.float16)),
    }
    for bm, bk, w in ((64, 256, 4), (128, 256, 4), (128, 128, 8), (32, 512, 4), (256, 128, 8), (64, 512, 8)):
        kern = SketchKernel(bm=bm, bk=bk, warps=w)
        ways[f"triton_{bm}x{bk}_w{w}"] = (lambda k: lambda: k(rows, key))(kern)
    out = {"device": torch.cuda.get_device_name(dev), "bytes": nbytes, "rows": m, "sketch_cols": SKETCH_COLS,
           "reference_impl": sk.impl, "auto_impl": Sketcher(dev).impl, "copy_s": gpu_seconds(lambda: copy_dst.copy_(rows))}
    out["copy_GBps"] = round(nbytes / out["copy_s"] / 1e9, 1)
    for name, fn in ways.items():
        try:
            got = fn()
            exact = bool(torch.equal(got.to(torch.int64), want.to(torch.int64))) if name != "float16_mm" else None
            s = gpu_seconds(fn)
        except (RuntimeError, NotImplementedError) as exc:
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            continue
        out[name] = {"s": round(s, 5), "GBps": round(nbytes / s / 1e9, 1), "vs_copy": round(s / out["copy_s"], 2),
                     "equal_to_engine": exact}
    return out


if __name__ == "__main__":
    print(json.dumps(main(float(sys.argv[1]) if len(sys.argv) > 1 else 4.0), indent=1))
