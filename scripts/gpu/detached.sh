#!/usr/bin/env bash
# Parts of scripts/gpu/reports.sh that take longer than one call (the conformance matrix on
# CUDA, a gate run), run detached in their own session (setsid); each `wait` brings back what
# they have written so far.
#
#   scripts/gpu/detached.sh start RUN PART ...
#       starts `scripts/gpu/reports.sh RUN/out PART ...` detached, with the environment of
#       the call (CONFORMANCE_ARGS, GATE_ARGS, ...); its output in RUN/log, its exit status in
#       RUN/rc when it ends.
#   scripts/gpu/detached.sh wait RUN OUT [SECONDS]
#       every 15 s, and once more at the end, copies RUN/out and RUN/log into OUT, until the
#       run ends or SECONDS (default 500) pass. Exit status: the run's when it ended, 3 while
#       it still runs.
#
# Before `start`: the vLLM bundle installed (scripts/gpu/carry.sh install) and the tree stamped.
set -uo pipefail
cd "$(dirname "$0")/../.."
cmd=${1:?usage: scripts/gpu/detached.sh start RUN PART ... | wait RUN OUT [SECONDS]}
shift

collect() {  # RUN OUT
  mkdir -p "$2"
  [ -d "$1/out" ] && cp -rf "$1/out/." "$2/" 2>/dev/null
  cp -f "$1/log" "$2/detached.log" 2>/dev/null
  [ -f "$1/rc" ] && cp -f "$1/rc" "$2/rc"
  return 0
}

case "$cmd" in
  start)
    RUN=${1:?RUN folder}
    shift
    [ $# -gt 0 ] || { echo "detached.sh: name the parts of reports.sh to run" >&2; exit 2; }
    mkdir -p "$RUN/out"
    rm -f "$RUN/rc"
    # shellcheck disable=SC2016
    setsid nohup bash -c 'scripts/gpu/reports.sh "$0/out" "$@"; echo $? > "$0/rc"' "$RUN" "$@" \
      > "$RUN/log" 2>&1 < /dev/null &
    echo $! > "$RUN/pid"
    echo "detached.sh: reports.sh $* started (pid $(cat "$RUN/pid")), log $RUN/log"
    ;;
  wait)
    RUN=${1:?RUN folder}
    OUT=${2:?OUT folder}
    SECS=${3:-500}
    t0=$SECONDS
    while [ ! -f "$RUN/rc" ] && [ $((SECONDS - t0)) -lt "$SECS" ]; do
      collect "$RUN" "$OUT"
      sleep 15
    done
    collect "$RUN" "$OUT"
    tail -n 5 "$RUN/log"
    if [ ! -f "$RUN/rc" ]; then
      echo "detached.sh: still running after $((SECONDS - t0)) s" >&2
      exit 3
    fi
    exit "$(cat "$RUN/rc")"
    ;;
  *)
    echo "detached.sh: unknown command $cmd (start, wait)" >&2
    exit 2
    ;;
esac
