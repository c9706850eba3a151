#!/usr/bin/env bash
# vLLM's object-store tier on the GPU host, for the conformance matrix's offloading-obj row: NIXL
# (its OBJ backend is the tier's S3 client) and moto's S3 server (the bucket the replicas share),
# beside the vLLM bundle.
#
#   scripts/gpu/obj.sh fetch [DIR]            (here; default DIR .gpu/obj)
#       the pinned wheels (cp312) without their requirements: what the image lacks of them (the
#       device's KINDS.md lists what it holds: requests, werkzeug, jinja2, pyyaml, dateutil, urllib3;
#       the bundle brings jmespath). About 89 MiB, more than one call carries beside the tree: packed
#       into one tar cut in parts of 28 MiB, DIR/parts/NN/part.NN, and DIR/parts/SHA256SUMS of the tar.
#   scripts/gpu/obj.sh install DIR [SITE]     (on the GPU host; default SITE /tmp/site, the bundle's)
#       DIR holds every part and SHA256SUMS (each part carried in a call of its own, copied there):
#       joined, checked, unpacked and installed into SITE with no index and no requirements.
#       Then `CONFORMANCE_ARGS='--connectors offloading-obj' scripts/gpu/detached.sh start RUN conformance`.
set -euo pipefail
cmd=${1:?usage: scripts/gpu/obj.sh fetch [DIR] | install DIR [SITE]}
shift
WHEELS="nixl==1.5.1 nixl-cu13==1.5.1 moto==5.2.6 boto3==1.44.18 botocore==1.44.18 s3transfer==0.19.3
flask==3.1.3 flask-cors==6.0.5 blinker==1.9.0 itsdangerous==2.2.0 responses==0.26.3 xmltodict==1.0.4
py-partiql-parser==0.6.3 cryptography==51.0.1 cffi==2.1.1 pycparser==3.12"
PART=$((28 * 1024 * 1024))
case "$cmd" in
  fetch)
    DIR=${1:-.gpu/obj}
    rm -rf "$DIR/wheels" "$DIR/parts"
    mkdir -p "$DIR/wheels" "$DIR/parts"
    PY=${PY:-python3}
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --dest "$DIR/wheels" --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $WHEELS
    tar cf "$DIR/wheels.tar" -C "$DIR" wheels
    (cd "$DIR" && sha256sum wheels.tar > parts/SHA256SUMS)
    split -b "$PART" -d -a 2 "$DIR/wheels.tar" "$DIR/parts/part."
    for p in "$DIR"/parts/part.*; do
      n=${p##*.}
      mkdir -p "$DIR/parts/$n"
      mv "$p" "$DIR/parts/$n/"
    done
    cp "$DIR/parts/SHA256SUMS" "$DIR/parts/00/"
    rm -f "$DIR/wheels.tar"
    echo "obj.sh: $(ls "$DIR/wheels" | wc -l) wheels, $(ls -d "$DIR"/parts/[0-9]* | wc -l) parts under $DIR/parts"
    ;;
  install)
    DIR=${1:?DIR}
    SITE=${2:-/tmp/site}
    cat "$DIR"/part.* > "$DIR/wheels.tar"
    (cd "$DIR" && sha256sum -c SHA256SUMS)
    tar xf "$DIR/wheels.tar" -C "$DIR"
    mkdir -p "$SITE"
    # the pinned wheels only (another version left in DIR is not taken)
    # shellcheck disable=SC2086
    python3 -m pip install -q --upgrade --no-index --find-links "$DIR/wheels" --no-deps --no-compile --target "$SITE" $WHEELS
    echo "obj.sh: installed $(echo $WHEELS | wc -w) wheels into $SITE"
    ;;
  *)
    echo "obj.sh: unknown command $cmd (fetch, install)" >&2
    exit 2
    ;;
esac
