#!/usr/bin/env bash
# LMCache on the GPU host, beside the vLLM bundle, for the conformance matrix's lmcache-mp-cuda row.
#
#   scripts/gpu/lmcache.sh fetch [DIR]            (here; default DIR .gpu/lmc)
#       LMCache 0.5.6's CUDA wheel (cp312) and the few wheels the GPU host's image lacks for it,
#       without their requirements: the image already holds cupy-cuda13x, grpcio, transformers,
#       numba, safetensors and the rest (the device's KINDS.md lists them), and the bundle brings
#       msgspec, pyzmq, fastapi, uvicorn. What is missing was found with scripts/gpu/import_probe.py
#       (reports/gpu/2026-12-06-h100-live-edges/run-0734763/): opentelemetry (api, sdk, semantic
#       conventions, prometheus exporter) and nvtx at import, importlib-metadata (8.7: from 9 on it needs
#       lazy_importer, which `lmcache server` then lacks) with zipp under
#       opentelemetry, and cryptography (with cffi, pycparser) for `lmcache server`. About 26 MiB:
#       one transfer beside the tree.
#   scripts/gpu/lmcache.sh install DIR [SITE]     (on the GPU host; default SITE /tmp/lmc-site)
#       installs them into SITE with no index and no requirements; put SITE on PYTHONPATH after the
#       bundle's folder (PYTHONPATH=/tmp/site:/tmp/lmc-site:$PWD), then
#       `python3 -m kvgate.harness.cli conformance --connectors lmcache-mp-cuda ...`.
set -euo pipefail
cmd=${1:?usage: scripts/gpu/lmcache.sh fetch [DIR] | install DIR [SITE]}
shift
WHEELS="lmcache==0.5.6 opentelemetry-api==1.40.0 opentelemetry-sdk==1.40.0
opentelemetry-semantic-conventions==0.61b0 opentelemetry-exporter-prometheus==0.61b0 nvtx==0.2.17
importlib-metadata==8.7.0 zipp==3.23.0 cryptography==51.0.1 cffi==2.1.1 pycparser==3.12"
case "$cmd" in
  fetch)
    DIR=${1:-.gpu/lmc}
    mkdir -p "$DIR"
    PY=${PY:-python3}
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --dest "$DIR" --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $WHEELS
    du -b "$DIR" | awk '{printf "lmcache.sh: %s %.1f MiB\n", $2, $1 / 1048576}'
    ;;
  install)
    DIR=${1:?DIR}
    SITE=${2:-/tmp/lmc-site}
    mkdir -p "$SITE"
    # the pinned wheels only, found in DIR (another version left there by an earlier fetch is not taken)
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-index --find-links "$DIR" --no-deps --no-compile --target "$SITE" $WHEELS
    echo "lmcache.sh: installed $(echo $WHEELS | wc -w) wheels into $SITE"
    ;;
  *)
    echo "lmcache.sh: unknown command $cmd (fetch, install)" >&2
    exit 2
    ;;
esac
