#!/usr/bin/env bash
# The offline vLLM bundle (shared/tools/vllm-gpu-bundle) and the wheels the harness needs beyond
# the GPU host's, in two transfers that each fit a 64 MiB call together with the tree.
#
#   scripts/gpu/carry.sh pack BUNDLE OUTDIR [FIRST_MIB]          (here)
#       BUNDLE: the folder build.sh wrote. The bundle's three large files (the two vLLM parts and
#       the wheels tar, 110 MiB) as one stream cut in two: OUTDIR/1/stream.1 (FIRST_MIB, default
#       56) and OUTDIR/2/stream.2 (the rest, about 54 MiB), with sizes.txt (where each file
#       starts), SHA256SUMS and install.sh beside the second; the wheels in .gpu/extra/ (if any)
#       go with the second too. Each transfer is then at most 57 MiB plus the tree (4 MiB here).
#   scripts/gpu/carry.sh install DIR1 DIR2                     (on the GPU host)
#       rebuilds the bundle's files from the two streams, checks them against SHA256SUMS, runs
#       the bundle's install.sh (into SITE, default /tmp/site; SKIP_SMOKE as install.sh's) and
#       installs DIR2/extra/*.whl into the same folder.
#
# The first transfer must reach the same machine as the second: carry DIR1 in one command
# (copy it out of the tree, e.g. to /tmp/carry1, since a later call may replace carried paths),
# then DIR2 in the next, without a pause long enough for the machine to be given back.
set -euo pipefail
FILES="vllm-0.24.0-trimmed.tar.xz.part-aa vllm-0.24.0-trimmed.tar.xz.part-ab vllm-deps-wheels.tar"
cmd=${1:?usage: scripts/gpu/carry.sh pack BUNDLE OUTDIR [FIRST_MIB] | install DIR1 DIR2}
shift
case "$cmd" in
  pack)
    BUNDLE=${1:?BUNDLE folder}
    OUTDIR=${2:?OUTDIR}
    FIRST=$(( ${3:-56} * 1048576 ))
    mkdir -p "$OUTDIR/1" "$OUTDIR/2"
    rm -f "$OUTDIR/1/stream.1" "$OUTDIR/2/stream.2" "$OUTDIR/2/sizes.txt"
    : > "$OUTDIR/2/sizes.txt"
    for f in $FILES; do
      [ -f "$BUNDLE/$f" ] || { echo "carry.sh: $BUNDLE/$f missing (build the bundle first)" >&2; exit 1; }
      echo "$f $(stat -c %s "$BUNDLE/$f")" >> "$OUTDIR/2/sizes.txt"
    done
    # shellcheck disable=SC2086
    (cd "$BUNDLE" && cat $FILES) > "$OUTDIR/stream"
    dd if="$OUTDIR/stream" of="$OUTDIR/1/stream.1" bs=1M iflag=count_bytes count="$FIRST" status=none
    dd if="$OUTDIR/stream" of="$OUTDIR/2/stream.2" bs=1M iflag=skip_bytes skip="$FIRST" status=none
    rm -f "$OUTDIR/stream"
    cp "$BUNDLE/SHA256SUMS" "$BUNDLE/install.sh" "$OUTDIR/2/"
    cd "$(dirname "$0")/../.."
    if compgen -G ".gpu/extra/*.whl" > /dev/null; then
      mkdir -p "$OUTDIR/2/extra" && cp .gpu/extra/*.whl "$OUTDIR/2/extra/"
    fi
    du -b "$OUTDIR/1" "$OUTDIR/2" | awk '{printf "carry.sh: %s %.1f MiB\n", $2, $1 / 1048576}'
    ;;
  install)
    DIR1=${1:?DIR1}
    DIR2=${2:?DIR2}
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    cat "$DIR1/stream.1" "$DIR2/stream.2" > "$WORK/stream"
    off=0
    while read -r name size; do
      dd if="$WORK/stream" of="$WORK/$name" bs=1M iflag=skip_bytes,count_bytes skip="$off" count="$size" status=none
      off=$((off + size))
    done < "$DIR2/sizes.txt"
    [ "$off" -eq "$(stat -c %s "$WORK/stream")" ] || { echo "carry.sh: the streams hold $(stat -c %s "$WORK/stream") bytes, sizes.txt $off" >&2; exit 1; }
    rm -f "$WORK/stream"
    cp "$DIR2/SHA256SUMS" "$DIR2/install.sh" "$WORK/"
    bash "$WORK/install.sh" "$WORK"
    SITE=${SITE:-/tmp/site}
    PY=${PY:-python3}
    if compgen -G "$DIR2/extra/*.whl" > /dev/null; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$DIR2"/extra/*.whl
      echo "carry.sh: installed $(ls "$DIR2"/extra/*.whl | wc -l) extra wheels into $SITE"
    fi
    ;;
  *)
    echo "carry.sh: unknown command $cmd (pack, install)" >&2
    exit 2
    ;;
esac
