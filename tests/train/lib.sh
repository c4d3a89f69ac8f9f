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
