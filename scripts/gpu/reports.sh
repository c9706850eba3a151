#!/usr/bin/env bash
# The GPU reports, on a host with an NVIDIA GPU and the offline vLLM bundle installed
# (shared/tools/vllm-gpu-bundle, install.sh; its site folder in SITE, default /tmp/site):
# the GPU suite (JUnit), `kvgate bench gpu` (its JSON line), and `kvgate gpu-live --bench`
# (result.json and checklist.md), each with the tree's provenance, under OUT. The tree is first
# checked against its stamp (python -m kvgate.harness.provenance --verify): a copy whose files changed
# after stamping, or that has no stamp, is reported "(UNVERIFIED TREE)" and the script exits 1.
#
#   scripts/gpu/reports.sh OUT [suite|bench|live|timeline|tierload|conformance|gate ...]     (default: suite bench live)
#
# msgspec (kvpool's wire protocol) comes from the bundle's folder ($SITE), which is put on PYTHONPATH here;
# other wheels the host lacks are installed from .gpu/extra/*.whl into $SITE if present.
# GPU_LIVE_ARGS: the gpu-live options (default --bench; e.g. "" for the exchanges alone,
# "--sessions" for OFF-ON-ON-OFF). Part `timeline`: scripts/gpu/load_timeline.py, where a load's
# time goes (TIMELINE_ARGS, default "--chunk-mib 128"). Part `conformance`: the conformance matrix on
# CUDA (CONFORMANCE_ARGS, default "--connectors kvpool,offloading"), under OUT/conformance. Part `gate`:
# `kvgate gate` with GATE_ARGS (e.g. one connector's scenarios under another config), under OUT/gate.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: scripts/gpu/reports.sh OUT [suite|bench|live|timeline|tierload|conformance|gate ...]}
shift || true
PARTS=${*:-suite bench live}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
if [ -f "$SITE/vllm-env.sh" ]; then
  # shellcheck disable=SC1091
  source "$SITE/vllm-env.sh"
fi
if compgen -G ".gpu/extra/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .gpu/extra/*.whl
fi
# The bundle's folder holds msgspec (kvpool's wire protocol), which the host lacks: the suite and
# bench parts need it even where the vLLM env file is missing (or was not sourced).
case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" ;; esac
export PYTHONPATH="$PWD:$PYTHONPATH"
if ! python3 -c 'import msgspec' 2>/dev/null; then
  echo "reports.sh: msgspec is not importable: install the bundle first (scripts/gpu/carry.sh install, into $SITE)" >&2
  exit 2
fi
export KVGATE_PROVENANCE=stamp  # the commit this copy was made from (.provenance.json), not the copy's own git
status=0
# Before any report: the copy checked against its stamp (each stamped file's SHA-256, no code
# file added). An unverified copy still runs, every report's title says "(UNVERIFIED TREE)",
# and the script exits 1.
if ! python3 -m kvgate.harness.provenance --verify > "$OUT/provenance.json"; then
  echo "reports.sh: the carried tree does not match its stamp (.provenance.json): its reports are UNVERIFIED" >&2
  status=1
fi
for part in $PARTS; do
  case "$part" in
    suite) python3 -m pytest suites/gpu -m gpu -q -p no:cacheprovider --junitxml "$OUT/gpu-suite.junit.xml" \
             > "$OUT/gpu-suite.log" 2>&1 || status=1 ;;
    bench) python3 -m kvgate.harness.cli bench gpu > "$OUT/bench-gpu.log" 2> "$OUT/bench-gpu.stderr" || status=1 ;;
    # shellcheck disable=SC2086
    live)  python3 -m kvgate.harness.cli gpu-live --report-dir "$OUT/gpu-live" ${GPU_LIVE_ARGS---bench} \
             > "$OUT/gpu-live.log" 2>&1 || status=1 ;;
    # shellcheck disable=SC2086
    timeline) python3 scripts/gpu/load_timeline.py ${TIMELINE_ARGS:---chunk-mib 128} > "$OUT/load-timeline.json" \
             2> "$OUT/load-timeline.log" || status=1 ;;
    # shellcheck disable=SC2086
    tierload) for t in ${TIER_LOAD_TOKENS:-32768 65536 128000 256000}; do
                python3 scripts/gpu/tier_load_bench.py "$OUT/tier-load-$t.json" --tokens "$t" \
                  > "$OUT/tier-load-$t.log" 2>&1 || status=1
              done ;;
    # shellcheck disable=SC2086
    conformance) python3 -m kvgate.harness.cli conformance --report-dir "$OUT/conformance" \
             ${CONFORMANCE_ARGS:---connectors kvpool,offloading} > "$OUT/conformance.log" 2>&1 || status=1 ;;
    # shellcheck disable=SC2086
    gate)  python3 -m kvgate.harness.cli gate --report-dir "$OUT/gate" ${GATE_ARGS:-} > "$OUT/gate.log" 2>&1 || status=1 ;;
    *) echo "unknown part $part (suite, bench, live, timeline, conformance, gate)" >&2; exit 2 ;;
  esac
  tail -n 3 "$OUT"/*.log 2>/dev/null | tail -n 6
done
exit $status
