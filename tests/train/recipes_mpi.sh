#!/usr/bin/env bash
# Megatron-LM's MoE launch flags under mpirun on 4 ranks, unchanged: the files of
# tests/fixtures/recipes/ (the same that tests/cli/test_megatron_flags.cpp's MegatronRecipes
# trains in one process), sizes shrunk, on the synthetic language, each for 3 steps:
# - Mixtral 8x7B (train_mixtral_8x7b_distributed.sh) with the script's own
#   --use-distributed-optimizer beside its --overlap-grad-reduce --overlap-param-gather, at EP 2
#   (expert-DP 2: dense and expert moments sharded; its state smaller than the same run's without
#   it) and EP 4 (expert-DP 1), the gradient reduction overlapped with the backward;
# - Qwen3-30B-A3B (modelopt conf Qwen3-30B-A3B.sh) at EP 2 and EP 4.
# Each run must finish with a finite lm loss at every step; the test's own flags are only the
# layout (--expert-model-parallel-size, a global batch of 2 micro-batches per rank), the steps,
# --log-interval 1 and the metrics file, and --peak-tflops (no GEMM probe).
# Usage: recipes_mpi.sh MPIEXEC MOECORE_BINARY
set -euo pipefail
mpiexec=$1 moecore=$2
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
recipes="$(dirname "${BASH_SOURCE[0]}")/../fixtures/recipes"
# flags FILE: the file's words (its '#' lines left out), unglobbed.
flags() {
  local -a w
  [ -r "$1" ] || fail "cannot read $1"
  read -r -a w <<< "$(grep -v '^#' "$1" | tr '\n' ' ')"
  [ "${#w[@]}" -gt 0 ] || fail "$1 holds no flags"
  printf '%s\n' "${w[@]}"
}
# run NAME EP EXTRA...: recipe NAME (its .flags then its .shrunk), 3 steps on 4 ranks at EP;
# $drop, if set, is a word of the .flags left out.
run() {
  local name=$1 ep=$2
  shift 2
  local -a recipe shrunk
  mapfile -t recipe < <(flags "$recipes/$name.flags" | grep -vxF -- "${drop:-}")
  mapfile -t shrunk < <(flags "$recipes/$name.shrunk")
  [ "${#recipe[@]}" -gt 0 ] && [ "${#shrunk[@]}" -gt 0 ] || fail "$name: its flags files"
  n=$((n + 1))
  m="$work/run$n.jsonl"
  local out
  out=$("$mpiexec" --oversubscribe --allow-run-as-root -np 4 -x OMP_NUM_THREADS=1 \
        "$moecore" train "${recipe[@]}" "${shrunk[@]}" "$@" --expert-model-parallel-size "$ep" \
        --global-batch-size 8 --train-iters 3 --log-interval 1 --peak-tflops 100 \
        --metrics-file "$m" 2>&1) ||
    fail "$name at EP $ep on 4 ranks stopped" "$out"
  local losses
  losses=$(grep -o '"lm_loss":[^,}]*' "$m" | cut -d: -f2 | paste -sd' ')
  if [ "$name" = mixtral_8x7b ] &&
     ! grep -q "overlapped with the backward (--overlap-grad-reduce)" <<< "$out"; then
    fail "$name at EP $ep: the recipe's --overlap-grad-reduce did not overlap the reduction" "$out"
  fi
  [ "$(wc -w <<< "$losses")" -eq 3 ] || fail "$name at EP $ep: not 3 steps ($losses)" "$out"
  for l in $losses; do
    [[ $l =~ ^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$ ]] ||
      fail "$name at EP $ep: lm loss $l is not finite" "$out"
  done
  echo "[recipes] $name on 4 ranks, EP $ep $*: lm loss $losses"
}
n=0
# The optimizer state's bytes of the last run (its metrics file $m).
mem_optim() { grep -o '"mem_optimizer_bytes":[0-9]*' "$m" | head -n 1 | cut -d: -f2; }
# Without the script's --use-distributed-optimizer its --overlap-param-gather goes too (Megatron
# and moecore refuse it without the distributed optimizer).
drop=--overlap-param-gather run mixtral_8x7b 2
plain=$(mem_optim)
run mixtral_8x7b 2 --use-distributed-optimizer
[ "$(mem_optim)" -lt "$plain" ] ||
  fail "mixtral_8x7b at EP 2: the optimizer state was not sharded ($(mem_optim) bytes with" \
       "--use-distributed-optimizer, $plain without)"
run mixtral_8x7b 4 --use-distributed-optimizer
run qwen3_30b_a3b 2
run qwen3_30b_a3b 4
