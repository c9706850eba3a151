"""The requirements of an installed vLLM wheel that its CPU-side plumbing needs, for the
compatibility environment of `make compat-vllm034` (vLLM installed with --no-deps first).

    python scripts/compat/vllm_requirements.py [--dist vllm] > requirements.txt

Prints every unconditional requirement of the installed distribution (those behind an extra
are left out, as pip leaves them out), except GPU_ONLY: CUDA kernel and media packages the
scheduler, the connector plumbing and the CPU tensors the compatibility suite drives never
import (and media decoders for multimodal inputs it never sees). vllm 0.34.0's wheel pins one
of them, flashinfer-python==0.7.3, to a release the package registry does not have, so a
plain `pip install vllm==0.34.0` fails here; the others are left out with it because nothing
on this host runs them. torch keeps vLLM's own pin. (Another requirement may still bring one
in: xgrammar brings apache-tvm-ffi.)
Exits 1 if a GPU_ONLY name is no longer among the wheel's requirements (the list is stale).
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Each name: why the CPU suite does without it.
GPU_ONLY = {
    "flashinfer-python": "CUDA attention kernels; 0.7.3 (the pin) is not on the registry",
    "apache-tvm-ffi": "flashinfer's and tilelang's kernel ABI",
    "tilelang": "CUDA kernel compiler",
    "nvidia-cudnn-frontend": "cuDNN graph API",
    "nvtx": "CUDA profiler ranges",
    "fastsafetensors": "GPU-direct weight loading",
    "instanttensor": "GPU weight loading",
    "nvidia-cutlass-dsl": "CUTLASS kernels",
    "quack-kernels": "CUDA kernels",
    "tokenspeed-mla": "CUDA MLA kernels",
    "humming-kernels": "CUDA kernels",
    "pynvvideocodec": "GPU video decoding",
    "torchaudio": "audio inputs (vLLM pins 2.11.0 beside torch 2.14.0)",
    "torchvision": "image inputs",
    "torchcodec": "media decoding",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", default="vllm")
    args = ap.parse_args(argv)
    try:
        reqs = [Requirement(r) for r in (requires(args.dist) or [])]
    except PackageNotFoundError:
        print(f"{args.dist} is not installed (install it with --no-deps first)", file=sys.stderr)
        return 1
    seen: set[str] = set()
    for req in reqs:
        name = canonicalize_name(req.name)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        seen.add(name)
        if name in GPU_ONLY:
            continue
        print(str(req).split(";")[0].strip())
    stale = sorted(set(GPU_ONLY) - seen)
    if stale:
        print(f"GPU_ONLY names {stale} are no longer requirements of {args.dist}: update the list", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
