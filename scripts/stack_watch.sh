#!/usr/bin/env bash
# The Python stacks of a run's processes at a moment the run's history marks (a diagnosis while a
# replica waits: where its worker is).
#
#   scripts/stack_watch.sh HISTORY_GLOB TEXT OUT [DELAY_S] [ROUNDS] [EVERY_S] [PROCESS_PATTERN]
#       waits until a file of HISTORY_GLOB holds TEXT (e.g. '"job": "replay"' in
#       'RUN/*/history/D.faults-worker.*.jsonl'), then DELAY_S (30) later dumps, ROUNDS (3) times
#       EVERY_S (20) apart, the stack of every process whose command line matches PROCESS_PATTERN
#       (vLLM's engine cores and workers), without stopping them (py-spy --nonblocking: a dump that
#       stops a process can change what it waits for). OUT/dump-ROUND-PID.txt ends with the pid, its
#       parent and its command line. Needs py-spy (pip install py-spy) and the rights to read the
#       processes (root, or ptrace allowed).
set -euo pipefail
GLOB=${1:?usage: scripts/stack_watch.sh HISTORY_GLOB TEXT OUT [DELAY_S] [ROUNDS] [EVERY_S] [PROCESS_PATTERN]}
TEXT=${2:?TEXT}
OUT=${3:?OUT}
DELAY=${4:-30}
ROUNDS=${5:-3}
EVERY=${6:-20}
PATTERN=${7:-VLLM::Worker|VLLM::EngineCore}
SPY=${PY_SPY:-py-spy}
command -v "$SPY" > /dev/null || { echo "stack_watch.sh: $SPY not found (pip install py-spy, or set PY_SPY)" >&2; exit 2; }
mkdir -p "$OUT"
# shellcheck disable=SC2086
until grep -qsF "$TEXT" $GLOB; do sleep 1; done
date -u +%FT%TZ > "$OUT/seen"
sleep "$DELAY"
for round in $(seq 1 "$ROUNDS"); do
  for pid in $(pgrep -f "$PATTERN" || true); do
    "$SPY" dump --nonblocking --pid "$pid" > "$OUT/dump-$round-$pid.txt" 2>&1 || true  # a process gone meanwhile
    echo "$pid $(ps -o ppid= -p "$pid" || true) $(ps -o cmd= -p "$pid" || true)" >> "$OUT/dump-$round-$pid.txt"
  done
  [ "$round" -eq "$ROUNDS" ] || sleep "$EVERY"
done
date -u +%FT%TZ > "$OUT/done"
