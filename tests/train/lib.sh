# What the multi-rank shell tests of `moecore train` share; sourced after `set -...`. Gives a
# scratch directory $work (removed at exit) that also holds Open MPI's session directories (no
# other test's mpirun shares, and races on, the top-level one), and the helpers below.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_MCA_orte_tmpdir_base="$work"
# fail WHAT [OUTPUT]: to stderr, so that a failure inside $(...) is still seen.
fail() { { echo "FAIL: $1"; echo "${2:-}"; } >&2; exit 1; }
# The weights digest a run prints at its end.
digest() { grep -o 'weights digest [0-9a-f]*' <<< "$1" | awk '{print $3}'; }
# The per-step values of a metrics file that a resumed run must reproduce exactly.
steps() { grep -o '"grad_norm":[^,]*\|"iteration":[^,]*\|"lm_loss":[^,]*' "$1" | paste -sd' '; }
# Two checkpoints byte-equal in every global tensor ($moecore: the binary under test).
compare() { "$moecore" checkpoint compare "$1" "$2" || fail "checkpoints $1 and $2 differ"; }
# The pids of the moecore ranks whose command line holds NEEDLE (compared as a fixed string, so a
# binary path with regex characters still matches): this run's, not another test's.
ranks_of() {
  for pid in $(pgrep -x moecore); do
    tr '\0' ' ' < "/proc/$pid/cmdline" 2> /dev/null | grep -qF -- "$1" && echo "$pid"
  done
  return 0
}
# train_on NP ARGS...: `moecore train` with the script's ${common[@]} on NP ranks (1: without
# mpirun; $mpiexec, $moecore: the script's), MOECORE_FAULT passed to the ranks when it is set.
train_on() {
  local np=$1
  shift
  if [ "$np" -eq 1 ]; then
    OMP_NUM_THREADS=1 "$moecore" train "${common[@]}" "$@" 2>&1
  else
    local fault=()
    [ -n "${MOECORE_FAULT+set}" ] && fault=(-x MOECORE_FAULT)
    "$mpiexec" --oversubscribe --allow-run-as-root -np "$np" -x OMP_NUM_THREADS=1 "${fault[@]}" \
      "$moecore" train "${common[@]}" "$@" 2>&1
  fi
}
# sigterm_resume NP DIR ARGS...: a run of ARGS saving to DIR with --exit-signal-handler gets
# SIGTERM on every rank after its third step: the step finishes, the ranks save and exit 0, and
# the tracker names that iteration; resumed from it, two steps further, the run equals the
# uninterrupted one bitwise (weights digest). Prints the iteration it stopped at.
sigterm_resume() {
  local np=$1 dir=$2
  shift 2
  train_on "$np" "$@" --train-iters 2000 --save "$dir" --exit-signal-handler > "$dir.log" &
  local launcher=$!
  # Until the third step, however loaded the machine (ctest's timeout bounds the test), unless
  # the run ends first.
  until grep -q ' iteration *3/' "$dir.log"; do
    kill -0 "$launcher" 2> /dev/null ||
      fail "SIGTERM: the run ended before its third step" "$(cat "$dir.log")"
    sleep 0.1
  done
  # The ranks of this run (not the launcher, not another test's moecore).
  local ranks
  mapfile -t ranks < <(ranks_of "--save $dir ")
  [ "${#ranks[@]}" -eq "$np" ] ||
    fail "SIGTERM: ${#ranks[@]} ranks found instead of $np" "$(cat "$dir.log")"
  kill -TERM "${ranks[@]}"
  wait "$launcher" || fail "SIGTERM: exit status $? instead of 0" "$(cat "$dir.log")"
  local stopped
  stopped=$(grep -o 'stopping after iteration [0-9]*' "$dir.log" | awk '{print $4}')
  [ -n "$stopped" ] || fail "SIGTERM: no early stop" "$(cat "$dir.log")"
  [ "$(cat "$dir/latest_checkpointed_iteration.txt")" = "$stopped" ] ||
    fail "SIGTERM: the tracker does not name iteration $stopped" "$(cat "$dir.log")"
  local n=$((stopped + 2)) out resumed
  out=$(train_on "$np" "$@" --train-iters "$n" --load "$dir") || fail "resume after SIGTERM" "$out"
  resumed=$(digest "$out")
  out=$(train_on "$np" "$@" --train-iters "$n") || fail "the uninterrupted run stopped" "$out"
  [ "$resumed" = "$(digest "$out")" ] ||
    fail "after SIGTERM at $stopped: $resumed != $(digest "$out")"
  echo "$stopped"
}
