#!/usr/bin/env bash
# Seed 003's experiment on the GPU host (`kvgate bench seed003`, harness/bench/seed003.py), in
# commands that each fit a call of bounded length: the bench runs detached in its own
# session (setsid), and each `wait` brings back what it has so far.
#
#   scripts/gpu/seed003.sh start RUN [bench options ...]
#       checks the tree against its stamp (python -m kvgate.harness.provenance --verify, into
#       RUN/provenance.json), then starts `kvgate bench seed003 --report-dir RUN/report ...`
#       detached; its output in RUN/bench.log, its exit status in RUN/rc when it ends.
#   scripts/gpu/seed003.sh wait RUN OUT [SECONDS]
#       every 15 s, and once more at the end, copies into OUT what the bench has written
#       (result.json, seed003.md, rows.jsonl with each TTFT row as measured, bench.log,
#       provenance.json, logs.tar.gz with the pool's and the replicas' logs and the connectors'
#       history), until the bench ends or SECONDS (default 540) pass. Exit status: the bench's
#       when it ended, 3 while it still runs, 1 for an unverified tree.
#
# Before `start`: the vLLM bundle installed (scripts/gpu/carry.sh install; SITE, default
# /tmp/site) and the tree stamped (python -m kvgate.harness.provenance --stamp) before it was carried.
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE=${SITE:-/tmp/site}
cmd=${1:?usage: scripts/gpu/seed003.sh start RUN [options] | wait RUN OUT [SECONDS]}
shift

collect() {  # RUN OUT
  local run=$1 out=$2
  mkdir -p "$out"
  cp -f "$run/report/result.json" "$run/report/seed003.md" "$run/report/rows.jsonl" "$out/" 2>/dev/null
  cp -f "$run/bench.log" "$run/provenance.json" "$out/" 2>/dev/null
  [ -f "$run/rc" ] && cp -f "$run/rc" "$out/rc"
  if [ -d "$run/report/run" ]; then
    tar -czf "$out/logs.tar.gz.tmp" -C "$run/report/run" --exclude=model . 2>/dev/null \
      && mv -f "$out/logs.tar.gz.tmp" "$out/logs.tar.gz"
  fi
}

case "$cmd" in
  start)
    RUN=${1:?RUN folder}
    shift
    mkdir -p "$RUN"
    rm -f "$RUN/rc"
    if [ ! -f "$SITE/vllm-env.sh" ]; then
      echo "seed003.sh: no vLLM bundle in $SITE (scripts/gpu/carry.sh install DIR1 DIR2 first)" >&2
      exit 2
    fi
    # shellcheck disable=SC1091
    source "$SITE/vllm-env.sh"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" KVGATE_PROVENANCE=stamp PYTHONUNBUFFERED=1
    verified=0
    python3 -m kvgate.harness.provenance --verify > "$RUN/provenance.json" || verified=1
    echo "$verified" > "$RUN/verified"
    [ "$verified" = 0 ] || echo "seed003.sh: the tree does not match its stamp: the report is UNVERIFIED" >&2
    # shellcheck disable=SC2016
    setsid nohup bash -c 'python3 -m kvgate.harness.cli bench seed003 --report-dir "$0/report" "$@"; echo $? > "$0/rc"' \
      "$RUN" "$@" > "$RUN/bench.log" 2>&1 < /dev/null &
    echo $! > "$RUN/pid"
    echo "seed003.sh: bench started (pid $(cat "$RUN/pid")), log $RUN/bench.log"
    ;;
  wait)
    RUN=${1:?RUN folder}
    OUT=${2:?OUT folder}
    SECS=${3:-540}
    t0=$SECONDS
    while [ ! -f "$RUN/rc" ] && [ $((SECONDS - t0)) -lt "$SECS" ]; do
      collect "$RUN" "$OUT"
      sleep 15
    done
    collect "$RUN" "$OUT"
    tail -n 5 "$RUN/bench.log"
    if [ ! -f "$RUN/rc" ]; then
      echo "seed003.sh: the bench still runs after $((SECONDS - t0)) s" >&2
      exit 3
    fi
    rc=$(cat "$RUN/rc")
    [ "$(cat "$RUN/verified" 2>/dev/null)" = 0 ] || rc=1
    exit "$rc"
    ;;
  *)
    echo "seed003.sh: unknown command $cmd (start, wait)" >&2
    exit 2
    ;;
esac
