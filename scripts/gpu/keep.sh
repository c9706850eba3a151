#!/usr/bin/env bash
# A conformance run brought back from the GPU host, kept as a report folder (here):
#
#   scripts/gpu/keep.sh RUN DEST
#       RUN: what `detached.sh wait` wrote (conformance.log, provenance.json: a run made here, with no
#       copy to stamp, has none; its matrix records the commit and whether the tree was clean) with the run's
#       conformance/ folder unpacked in it (the per-connector folders are too deep to come back
#       one by one: `tar czf $OUT/x.tgz conformance` in the run's out folder, then `tar xzf` into RUN).
#       DEST gets the run's matrix.{json,md,html}, conformance.log and provenance.json, and per
#       connector its row.json and logs.tgz (its replicas' and servers' logs, the histories, the fault
#       files; not the model, which the run built from kvgate.fixtures.tiny_model, nor the file-system tier's
#       block files).
set -euo pipefail
RUN=${1:?usage: scripts/gpu/keep.sh RUN DEST}
DEST=${2:?usage: scripts/gpu/keep.sh RUN DEST}
[ -f "$RUN/conformance/matrix.json" ] || { echo "keep.sh: $RUN/conformance/matrix.json missing" >&2; exit 1; }
mkdir -p "$DEST"
cp "$RUN"/conformance/matrix.json "$RUN"/conformance/matrix.md "$RUN"/conformance/matrix.html "$DEST/"
cp "$RUN/conformance.log" "$DEST/"
[ ! -f "$RUN/provenance.json" ] || cp "$RUN/provenance.json" "$DEST/"
shopt -s nullglob
rows=("$RUN"/conformance/*/row.json)
[ ${#rows[@]} -gt 0 ] || { echo "keep.sh: no $RUN/conformance/*/row.json (a run that started no connector)" >&2; exit 1; }
for row in "${rows[@]}"; do
  dir=$(dirname "$row")
  name=$(basename "$dir")
  mkdir -p "$DEST/$name"
  cp "$row" "$DEST/$name/row.json"
  tar czf "$DEST/$name/logs.tgz" --sort=name --owner=0 --group=0 --mtime=@0 --exclude=./model --exclude=./offload-fs --exclude=./row.json \
    -C "$dir" .
done
du -sh "$DEST"
