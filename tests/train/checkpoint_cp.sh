#!/usr/bin/env bash
# Checkpoints under context parallelism through `moecore train` under mpirun
# (docs/checkpoint_format.md): parameters are not split by CP, so a checkpoint does not depend
# on it.
# - CP 2 -> CP 1: iteration 3 saved at CP 2 (2 ranks) loaded on one rank and saved again: every
#   global tensor (weights and AdamW moments) byte-equal; the next step's loss there within the
#   layout-parity tolerance (docs/numerics.md, f32 per-step values: rtol 1e-5) of the CP 2 run's
#   own step 4;
# - CP 1 -> CP 2 (allgather) x EP 2: loaded and saved again byte-equal, step 4 within the same
#   tolerance of the one-rank run's;
# - CP 2 resumed at CP 2: bitwise the uninterrupted run (weights digest, per-step values).
# Usage: checkpoint_cp.sh MPIEXEC MOECORE_BINARY CONFIG
set -euo pipefail
mpiexec=$1 moecore=$2 config=$3
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
common=(--config "$config" --lr-warmup-iters 1 --lr-decay-iters 20 --micro-batch-size 2
        --global-batch-size 4 --log-interval 1 --peak-tflops 100)
train() { train_on "$@"; }  # train NP ARGS... (lib.sh)
loss4() { grep -o '"lm_loss":[^,]*' "$1" | tail -n 1 | cut -d: -f2; }
close() {  # close GOT REF WHAT OUTPUT
  awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * b) }' ||
    fail "$3: $1 vs $2 (rtol 1e-5)" "$4"
}
cp2=(--context-parallel-size 2)
cp2ep2=(--context-parallel-size 2 --cp-comm-type allgather --expert-model-parallel-size 2)

# ---- CP 2: the uninterrupted run, and its first three steps saved ----
out=$(train 2 "${cp2[@]}" --train-iters 5 --metrics-file "$work/cp2_whole.jsonl") ||
  fail "the uninterrupted CP 2 run stopped" "$out"
grep -q "context parallel 2" <<< "$out" || fail "the run did not say it runs CP 2" "$out"
whole=$(digest "$out")
out=$(train 2 "${cp2[@]}" --train-iters 3 --save "$work/cp2") || fail "CP 2, 3 steps" "$out"
out=$(train 2 "${cp2[@]}" --train-iters 4 --load "$work/cp2" \
      --metrics-file "$work/cp2_4.jsonl") || fail "CP 2 step 4" "$out"
ref_cp2=$(loss4 "$work/cp2_4.jsonl")

# ---- CP 2 -> CP 1 ----
out=$(train 1 --train-iters 3 --load "$work/cp2" --save "$work/one") || fail "load at CP 1" "$out"
compare "$work/cp2/iter_0000003" "$work/one/iter_0000003"
out=$(train 1 --train-iters 4 --load "$work/one" --metrics-file "$work/one_4.jsonl") ||
  fail "step 4 at CP 1" "$out"
one4=$(loss4 "$work/one_4.jsonl")
close "$one4" "$ref_cp2" "step 4 at CP 1 from the CP 2 checkpoint" "$out"
echo "[checkpoint] CP 2 -> CP 1: tensors byte-equal, step 4 loss $one4 vs CP 2's $ref_cp2"

# ---- CP 1 -> CP 2 (allgather) x EP 2 ----
out=$(train 2 "${cp2ep2[@]}" --train-iters 3 --load "$work/one" --save "$work/back") ||
  fail "load at CP 2 x EP 2" "$out"
compare "$work/one/iter_0000003" "$work/back/iter_0000003"
out=$(train 2 "${cp2ep2[@]}" --train-iters 4 --load "$work/back" \
      --metrics-file "$work/back_4.jsonl") || fail "step 4 at CP 2 x EP 2" "$out"
back4=$(loss4 "$work/back_4.jsonl")
close "$back4" "$one4" "step 4 at CP 2 x EP 2 from the CP 1 checkpoint" "$out"
echo "[checkpoint] CP 1 -> CP 2 (allgather) x EP 2: tensors byte-equal, step 4 loss $back4 vs" \
     "CP 1's $one4"

# ---- CP 2 resumed at CP 2: bitwise ----
out=$(train 2 "${cp2[@]}" --train-iters 5 --load "$work/cp2" \
      --metrics-file "$work/cp2_resumed.jsonl") || fail "the resumed CP 2 run stopped" "$out"
[ "$(digest "$out")" = "$whole" ] || fail "CP 2 resumed: $(digest "$out") != $whole" "$out"
[ "$(steps "$work/cp2_resumed.jsonl")" = "$(tail -n 2 "$work/cp2_whole.jsonl" | steps /dev/stdin)" ] ||
  fail "CP 2 resumed: steps 4-5 differ" "$(cat "$work/cp2_resumed.jsonl" "$work/cp2_whole.jsonl")"
echo "[checkpoint] CP 2 resumed at CP 2: steps 4-5 and weights bitwise"
