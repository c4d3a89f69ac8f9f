#!/usr/bin/env bash
# Stopping a job under mpirun, and the hang watchdog (docs/checkpoint_format.md "Stopping a job"):
# - SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 to mpirun with --exit-signal-handler: every rank
#   finishes its step, saves, and ends with status 0 (mpirun's own status after SIGTERM or SIGINT
#   is 1, Open MPI's rule); the tracker names the iteration the run stopped after, no rank is
#   left, and resuming from it equals the uninterrupted run bitwise; SIGTERM also at PP 2 (the
#   stages stop after the same step);
# - SIGTERM to mpirun during a slow save (MOECORE_FAULT sleep:in=save): within Open MPI's grace
#   (--mca odls_base_sigkill_timeout) the save completes and the run stops after the next step;
#   past it, or on a second SIGTERM (mpirun then exits at once), the ranks die and the previous
#   checkpoint stays the tracker's, resumed bitwise;
# - the watchdog: a rank hung inside an all-to-all (MOECORE_FAULT sleep:in=all_to_all_v) ends
#   the job with status 3 within the limit, naming the group, the call and the rank waited for;
#   a rank killed (SIGKILL) ends the job with a non-zero status; no rank is left either time.
# Usage: stop_signals.sh MPIEXEC MOECORE_BINARY CONFIG
set -euo pipefail
mpiexec=$1 moecore=$2 config=$3
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
export MOECORE_FAULT=""
common=(--config "$config" --lr-warmup-iters 1 --lr-decay-iters 20 --micro-batch-size 2
        --global-batch-size 16 --log-interval 1 --peak-tflops 100)
ep2=(--expert-model-parallel-size 2)
layout=("${ep2[@]}")  # the layout signal_case and resumes_bitwise run
# launch NP [MPIRUN FLAGS... --] ARGS...: `moecore train` on NP ranks under mpirun, which this
# process becomes (so a background launch's $! is mpirun's pid).
launch() {
  local np=$1
  shift
  local mca=()
  if [ "${1:-}" = "--mca" ]; then mca=("$1" "$2" "$3"); shift 3; fi
  exec "$mpiexec" "${mca[@]}" --oversubscribe --allow-run-as-root -np "$np" -x OMP_NUM_THREADS=1 \
    -x MOECORE_FAULT "$moecore" train "${common[@]}" "$@" 2>&1
}
# Waits until LOG shows iteration N, unless the launcher PID ends first.
wait_iteration() {
  until grep -q " iteration *$2/" "$1" 2> /dev/null; do
    kill -0 "$3" 2> /dev/null || fail "the run ended before its iteration $2" "$(cat "$1")"
    sleep 0.05
  done
}
# Fails when a rank of NEEDLE's run is still there 10 s after its launcher ended.
no_ranks_left() {  # no_ranks_left NEEDLE WHAT
  local left
  for _ in $(seq 100); do
    left=$(ranks_of "$1")
    [ -n "$left" ] || return 0
    sleep 0.1
  done
  kill -9 $left
  fail "$2: rank processes left behind: $left"
}
# resumes_bitwise DIR ITERATION: a resume of DIR's checkpoint ITERATION, two steps on, equals the
# uninterrupted run of as many steps.
declare -A uninterrupted
resumes_bitwise() {
  local n=$(($2 + 2)) out
  out=$( (launch 2 "${layout[@]}" --train-iters "$n" --load "$1") ) || fail "resume from $1" "$out"
  grep -q "loaded iteration $2 from" <<< "$out" || fail "the resume did not load $2" "$out"
  local key="$n ${layout[*]}"
  if [ -z "${uninterrupted[$key]:-}" ]; then
    local whole
    whole=$( (launch 2 "${layout[@]}" --train-iters "$n") ) || fail "uninterrupted run" "$whole"
    uninterrupted[$key]=$(digest "$whole")
  fi
  [ "$(digest "$out")" = "${uninterrupted[$key]}" ] ||
    fail "resumed from $1 at $2: $(digest "$out") != ${uninterrupted[$key]}" "$out"
}

# ---- signals to mpirun during training: finish the step, save, exit 0, resume bitwise ----
# signal_case NAME SIGNAL MPIRUN_STATUS REASON: REASON is the words of rank 0's "[exit]" line.
signal_case() {
  local name=$1 sig=$2 want=$3 reason=$4
  local dir="$work/$name" log="$work/$name.log"
  (launch 2 "${layout[@]}" --train-iters 2000 --save "$dir" --exit-signal-handler) > "$log" &
  local launcher=$!
  wait_iteration "$log" 3 "$launcher"
  kill -"$sig" "$launcher"
  local rc=0
  wait "$launcher" || rc=$?
  [ "$rc" -eq "$want" ] || fail "$name: mpirun's status $rc instead of $want" "$(cat "$log")"
  no_ranks_left "--save $dir " "$name"
  local stopped
  stopped=$(grep -o 'stopping after iteration [0-9]*' "$log" | awk '{print $4}' || true)
  [ -n "$stopped" ] || fail "$name: no early stop" "$(cat "$log")"
  grep -qF "stopping after iteration $stopped: $reason" "$log" ||
    fail "$name: not stopped by $reason" "$(cat "$log")"
  # Rank 0 ran to its end (this line is its last, after the save) and mpirun reported no rank
  # ended by a signal.
  grep -q '^\[train\] final lm loss' "$log" || fail "$name: rank 0 did not finish" "$(cat "$log")"
  if grep -q 'exited on signal' "$log"; then fail "$name: a rank was killed" "$(cat "$log")"; fi
  [ "$(cat "$dir/latest_checkpointed_iteration.txt")" = "$stopped" ] ||
    fail "$name: the tracker does not name iteration $stopped" "$(cat "$log")"
  resumes_bitwise "$dir" "$stopped"
  echo "[stop] $name to mpirun: stopped after iteration $stopped, saved, mpirun status $rc," \
       "resumed bitwise"
}
launcher_reason="the launcher (mpirun) began to kill the job"
signal_case sigterm TERM 1 "$launcher_reason"
signal_case sigint INT 1 "$launcher_reason"  # Ctrl-C: the terminal signals mpirun's group only
signal_case sigusr1 USR1 0 "SIGUSR1 (--exit-signal-handler)"
# Mid-schedule: two pipeline stages, each finishing the step (its sends and receives) first.
layout=(--num-layers 4 --pipeline-model-parallel-size 2)
signal_case sigterm_pipeline TERM 1 "$launcher_reason"
layout=("${ep2[@]}")

# ---- SIGTERM to mpirun during a save ----
# save_case NAME SLEEP SECOND_SIGNAL [--mca odls_base_sigkill_timeout T]: iteration 2 saved; the
# save of iteration 4 sleeps SLEEP s before writing; mpirun gets SIGTERM (and with SECOND_SIGNAL
# a second one) while it sleeps. Prints the iteration the tracker names afterwards.
save_case() {
  local name=$1 sleep_s=$2 second=$3
  shift 3
  local dir="$work/$name" log="$work/$name.log"
  (MOECORE_FAULT="sleep:in=save:iter=4:seconds=$sleep_s" launch 2 "$@" "${ep2[@]}" \
     --train-iters 2000 --save "$dir" --save-interval 2 --exit-signal-handler) > "$log" &
  local launcher=$!
  wait_iteration "$log" 4 "$launcher"  # printed before the save of iteration 4 starts
  sleep 0.3
  kill -TERM "$launcher"
  if [ "$second" = yes ]; then sleep 0.2; kill -TERM "$launcher"; fi
  wait "$launcher" || true
  no_ranks_left "--save $dir " "$name"
  ! ls "$dir" | grep -q -v -e '^iter_[0-9]*$' -e '^latest_checkpointed_iteration.txt$' ||
    fail "$name: a staging directory or temp file is left: $(ls "$dir")" "$(cat "$log")"
  cat "$dir/latest_checkpointed_iteration.txt"
}
# Past the grace (Open MPI's default: SIGKILL 2 s after the SIGCONT) the save is abandoned.
t=$(save_case save_killed 4 no) || exit 1
[ "$t" = 2 ] || fail "save_killed: the tracker names $t, not the previous checkpoint 2"
resumes_bitwise "$work/save_killed" 2
echo "[stop] SIGTERM to mpirun in a 4 s save, default grace: the previous checkpoint (2) stays," \
     "resumed bitwise"
# A second SIGTERM: mpirun exits at once; Open MPI ends the ranks when their launcher is gone
# (measured: within about a second, inside the save's sleep), so the previous checkpoint stays;
# a machine slow enough to let the save finish first leaves iteration 4 instead. Either resumes.
t=$(save_case save_twice 3 yes --mca odls_base_sigkill_timeout 10) || exit 1
[ "$t" = 2 ] || [ "$t" = 4 ] || fail "save_twice: the tracker names $t, neither 2 nor 4"
resumes_bitwise "$work/save_twice" "$t"
echo "[stop] two SIGTERMs to mpirun in a save: the tracker names $t, resumed bitwise"
# Within the grace the save completes and the run stops after the next step.
t=$(save_case save_completes 3 no --mca odls_base_sigkill_timeout 10) || exit 1
grep -q "saved iteration 4 to" "$work/save_completes.log" ||
  fail "save_completes: the save of iteration 4 did not complete" "$(cat "$work/save_completes.log")"
grep -q "stopping after iteration $t: $launcher_reason" "$work/save_completes.log" ||
  fail "save_completes: the tracker names $t, not the stop" "$(cat "$work/save_completes.log")"
resumes_bitwise "$work/save_completes" "$t"
echo "[stop] SIGTERM to mpirun in a 3 s save, odls_base_sigkill_timeout 10: iteration 4 saved," \
     "stopped and saved after $t, resumed bitwise"

# ---- the watchdog: a rank hung in an all-to-all ----
log="$work/hang.log"
start=$SECONDS
rc=0
(MOECORE_FAULT="comm_timeout:seconds=5;sleep:in=all_to_all_v:rank=1:iter=2:seconds=600" \
   launch 4 --expert-model-parallel-size 4 --train-iters 5 --save "$work/hang") > "$log" || rc=$?
took=$((SECONDS - start))
[ "$rc" -eq 3 ] || fail "hang: status $rc instead of 3 (the watchdog's)" "$(cat "$log")"
[ "$took" -lt 60 ] || fail "hang: the job took $took s to end (limit 5 s)" "$(cat "$log")"
grep -qE "\[comm\] timeout: world rank [023] \(rank [023] of 4 in group 'ep' = world ranks \[0,1,2,3\]\) waited [0-9.]+ s in all_to_all_v" "$log" ||
  fail "hang: no diagnostic naming the group 'ep' and the call all_to_all_v" "$(cat "$log")"
grep -q "world rank 1: no answer" "$log" || fail "hang: rank 1 not named as waited for" "$(cat "$log")"
no_ranks_left "--save $work/hang " "hang"
echo "[watchdog] rank 1 hung in all_to_all_v: status 3 after $took s, group, call and rank named," \
     "no rank left"

# ---- a rank killed mid-run ----
log="$work/killed.log"
(launch 4 --expert-model-parallel-size 2 --train-iters 2000 --save "$work/killed") > "$log" &
launcher=$!
wait_iteration "$log" 3 "$launcher"
victim=$(ranks_of "--save $work/killed " | tail -n 1)
start=$SECONDS
kill -9 "$victim"
rc=0
wait "$launcher" || rc=$?
took=$((SECONDS - start))
[ "$rc" -ne 0 ] || fail "killed rank: the job ended with status 0" "$(cat "$log")"
[ "$took" -lt 60 ] || fail "killed rank: the job took $took s to end" "$(cat "$log")"
no_ranks_left "--save $work/killed " "killed rank"
echo "[watchdog] a rank killed with SIGKILL: the job ended with status $rc after $took s," \
     "no rank left"
