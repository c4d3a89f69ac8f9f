#!/usr/bin/env bash
# Runs a command beside N CPU-bound processes, the way a busy developer machine or a shared CI
# runner loads it: with_load.sh N COMMAND [ARGS...] (e.g. `with_load.sh 2 bash scripts/test.sh`).
# The load runs at the command's priority until the command ends; the exit status is the
# command's. The suite must pass like this (docs/testing.md).
set -uo pipefail
n=${1:?usage: with_load.sh N COMMAND [ARGS...]}
shift
pids=()
for _ in $(seq "$n"); do
  # A busy loop in its own shell: no I/O, no memory, one core's worth of work each.
  bash -c 'while :; do :; done' &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2> /dev/null' EXIT
echo "[load] $n CPU-bound processes (pids ${pids[*]}) beside: $*"
"$@"
rc=$?
echo "[load] the command exited $rc"
exit "$rc"
