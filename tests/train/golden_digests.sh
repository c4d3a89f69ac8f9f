#!/usr/bin/env bash
# Golden weights digests (docs/numerics.md, "Golden digests"): fixed 3-step runs of `moecore
# train` on the tiny model (fp32, --bf16, EP 2 on 2 ranks, capacity dropping with padding,
# quantile balancing, full recomputation), each run's final weights digest compared with the one
# committed for this process's numerics class (the trainer's "[train] numerics class:" line) in
# the fixture, so that no change of the numerics goes unnoticed.
# - a class with digests: every run must reproduce its digest bitwise; a change fails, naming the
#   run, its flags, the expected and the got digest, and how to record new ones;
# - a class without digests (another CPU kind, compiler, oneDNN): reported as skipped, naming the
#   class and the command that records it (never as passed);
# - a class with digests that lacks some runs' (a change of numerics recorded on another CPU, the
#   runs' old digests removed there): the others are checked as above, and the test is reported
#   as skipped, naming the runs without a digest and the command that records them;
# - MOECORE_GOLDEN_RECORD=1: runs them, rewrites this class's entries of the fixture (the other
#   classes' stay) and reports the test as skipped; commit the fixture with the change.
# Usage: golden_digests.sh MPIEXEC MOECORE_BINARY CONFIG FIXTURE
set -euo pipefail
mpiexec=$1 moecore=$2 config=$3 fixture=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Open MPI's session directories inside this test's own: no other test's mpirun shares (and races
# on) the top-level one.
export OMPI_MCA_orte_tmpdir_base="$work"
# One OpenMP thread per rank: the thread count is part of the class (oneDNN's AVX2 sgemm rounds by
# it), and the recorded classes are those of one thread.
export OMP_NUM_THREADS=1
record=${MOECORE_GOLDEN_RECORD:-0}
# The settings that pick this class (oneDNN's cap, a forced bf16 path) go into the command.
record_cmd="${DNNL_MAX_CPU_ISA:+DNNL_MAX_CPU_ISA=$DNNL_MAX_CPU_ISA }${MOECORE_BF16_GEMM:+MOECORE_BF16_GEMM=$MOECORE_BF16_GEMM }"
record_cmd+="MOECORE_GOLDEN_RECORD=1 ctest -R '^train_golden_digests\$' in this build directory"
common=(--config "$config" --train-iters 3 --lr-warmup-iters 0 --lr-decay-iters 20
        --micro-batch-size 2 --global-batch-size 4 --log-interval 1 --peak-tflops 100)
# The runs, "NAME RANKS FLAGS...": names are the fixture's keys. Adding or changing a run means
# recording every class again.
runs=(
  "fp32 1"
  "bf16 1 --bf16"
  "ep2 2 --expert-model-parallel-size 2"
  "capacity 1 --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"
  "quantile 1 --moe-router-load-balancing-type quantile_balancing --moe-aux-loss-coeff 0
   --moe-router-quantile-balancing-ema 0.9"
  "recompute 1 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
)
fail() { echo "FAIL: $1"; echo "${2:-}"; exit 1; }
# train NP FLAGS...: `moecore train` on NP ranks (1: without mpirun).
train() {
  local np=$1
  shift
  if [ "$np" -eq 1 ]; then
    "$moecore" train "${common[@]}" "$@" 2>&1
  else
    "$mpiexec" --oversubscribe --allow-run-as-root -np "$np" -x OMP_NUM_THREADS "$moecore" train \
      "${common[@]}" "$@" 2>&1
  fi
}
# The entries of class $1: "RUN DIGEST" lines (the fixture: CLASS RUN DIGEST, # comments).
recorded() { awk -v c="$1" '$1 !~ /^#/ && $1 == c { print $2, $3 }' "$fixture"; }

[ -f "$fixture" ] || fail "no fixture $fixture"
class=""
got=()
failures=()
unrecorded=()
for r in "${runs[@]}"; do
  read -r name np flags <<< "$(tr -s '\n ' ' ' <<< "$r")"
  # shellcheck disable=SC2086
  out=$(train "$np" $flags) || fail "run '$name' stopped: moecore train ${flags:-(tiny.toml)}" "$out"
  c=$(grep -o '\[train\] numerics class: [^ ]*' <<< "$out" | awk '{print $4}')
  d=$(grep -o 'weights digest [0-9a-f]*' <<< "$out" | awk '{print $3}')
  if [ -z "$c" ] || [ -z "$d" ]; then fail "run '$name' printed no numerics class or no digest" "$out"; fi
  if [ -z "$class" ]; then
    class=$c
    if [ "$record" != 1 ] && [ -z "$(recorded "$class")" ]; then
      echo "[golden] skipped: numerics class $class has no recorded digests in $fixture."
      echo "[golden] To record them here (this CPU, this build): $record_cmd; then commit the file."
      exit 0
    fi
  fi
  [ "$c" = "$class" ] || fail "run '$name' is of numerics class $c, the first run of $class" "$out"
  case $name in  # each run must still take the path it is there for
    capacity) grep -q 'dropped tokens: [1-9]' <<< "$out" ||
                fail "run 'capacity' dropped no tokens: it no longer tests capacity dropping" "$out" ;;
    quantile) grep -q 'quantile beta \[-[0-9.]*[1-9]' <<< "$out" ||
                fail "run 'quantile' has no non-zero quantile beta" "$out" ;;
  esac
  got+=("$name $d")
  if [ "$record" = 1 ]; then
    echo "[golden] $name: $d"
    continue
  fi
  want=$(recorded "$class" | awk -v n="$name" '$1 == n { print $2 }')
  if [ "$want" = "$d" ]; then
    echo "[golden] $name: $d as recorded"
  elif [ -z "$want" ]; then
    unrecorded+=("$name")
  else
    failures+=("run '$name' (moecore train ${flags:-with tiny.toml alone}, $np rank(s)):"
               "  expected $want, got $d")
  fi
done

if [ "$record" = 1 ]; then
  # This class's new lines where its old ones were (at the end for a new class), the rest as is.
  printf '%s\n' "${got[@]/#/$class }" > "$work/new"
  tmp="$fixture.tmp.$$"
  awk -v c="$class" -v new="$work/new" '
    $1 !~ /^#/ && $1 == c { if (!done) { while ((getline l < new) > 0) print l; done = 1 }; next }
    { print }
    END { if (!done) while ((getline l < new) > 0) print l }' "$fixture" > "$tmp"
  mv "$tmp" "$fixture"
  echo "[golden] skipped: record mode (MOECORE_GOLDEN_RECORD=1) wrote the ${#got[@]} digests of" \
       "class $class into $fixture: commit it with the change of numerics and say why"
  exit 0
fi
# Entries of this class for runs that no longer exist would keep the fixture stale.
names=" $(printf '%s ' "${got[@]%% *}")"
for n in $(recorded "$class" | awk '{print $1}'); do
  [[ "$names" == *" $n "* ]] || failures+=("fixture entry '$n' of this class names no run")
done
if [ "${#failures[@]}" -gt 0 ]; then
  echo "[golden] FAILED: numerics class $class, fixture $fixture"
  printf '%s\n' "${failures[@]}"
  echo "[golden] The final weights of these runs are no longer bitwise what they were. If the"
  echo "[golden] change of numerics is intended, record the new digests: $record_cmd, for each"
  echo "[golden] class you can run (docs/numerics.md, \"Golden digests\"), and commit the fixture"
  echo "[golden] in the same commit, saying why the numerics changed."
  exit 1
fi
if [ "${#unrecorded[@]}" -gt 0 ]; then
  # A numerics change recorded on another CPU leaves this class without those runs' digests
  # (its old ones removed, not kept stale): the others were checked; the test is not a pass.
  echo "[golden] skipped: the other $(( ${#got[@]} - ${#unrecorded[@]} )) runs bitwise as" \
       "recorded for class $class, but run(s) ${unrecorded[*]} have no digest recorded for it."
  echo "[golden] To record them here (this CPU, this build): $record_cmd; then commit the file."
  exit 0
fi
echo "[golden] all ${#got[@]} runs bitwise as recorded for class $class"
