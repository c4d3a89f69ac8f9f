#!/usr/bin/env bash
# Checkpoints under tensor and expert tensor parallelism through `moecore train` under mpirun
# (docs/checkpoint_format.md, "Tensor parallelism" and "The distributed optimizer"):
# - resharding: iteration 3 saved at TP 2 x EP 2 (ETP 2, 4 ranks, --sequence-parallel) loaded
#   at TP 1 x EP 4 and saved again, then loaded back at TP 2 x EP 2 and saved again: every global
#   tensor (weights and AdamW moments) byte-equal to the source each time;
# - the distributed optimizer at TP 2 x EP 2, each rank writing its own pieces of the
#   tensor-parallel slices as ranged slices (nothing gathered): its checkpoint byte-equal to the
#   one of the same run without it, and its resume from the checkpoint without it bitwise the
#   resume of the run without it;
# - an expert layout with expert data parallelism, TP 2 x EP 2 x EDP 2 (ETP 2, dense DP 4) with
#   the distributed optimizer on 8 ranks: resumed bitwise in the same layout; resumed at
#   TP 1 x EP 4 and on one rank, its steps within the layout-parity tolerance of docs/numerics.md
#   (f32 per-step values, rtol 1e-5) of an uninterrupted run there, and loaded and saved again
#   there byte-equal; `checkpoint compare`-equal to the same save without the distributed
#   optimizer.
# Usage: checkpoint_tp.sh MPIEXEC MOECORE_BINARY CONFIG
set -euo pipefail
mpiexec=$1 moecore=$2 config=$3
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
common=(--config "$config" --lr-warmup-iters 1 --lr-decay-iters 20 --micro-batch-size 2
        --global-batch-size 16 --log-interval 1 --peak-tflops 100)
train() { train_on "$@"; }  # train NP ARGS... (lib.sh)

tp2ep2=(--tensor-model-parallel-size 2 --expert-model-parallel-size 2 --sequence-parallel)
tp1ep4=(--expert-model-parallel-size 4)

# ---- resharding: TP 2 x EP 2 -> TP 1 x EP 4 -> TP 2 x EP 2 ----
out=$(train 4 "${tp2ep2[@]}" --train-iters 3 --save "$work/src") ||
  fail "the source run at TP 2 x EP 2 stopped" "$out"
grep -q '"format_version": 1' "$work/src/iter_0000003/manifest.json" ||
  fail "the TP 2 x EP 2 checkpoint is not format version 1" \
       "$(head -c 400 "$work/src/iter_0000003/manifest.json")"
out=$(train 4 "${tp1ep4[@]}" --train-iters 3 --load "$work/src" --save "$work/ep4") ||
  fail "load of TP 2 x EP 2 at TP 1 x EP 4" "$out"
compare "$work/src/iter_0000003" "$work/ep4/iter_0000003"
grep -q '"format_version": 0' "$work/ep4/iter_0000003/manifest.json" ||
  fail "the TP 1 x EP 4 checkpoint is not format version 0" ""
echo "[checkpoint] TP 2 x EP 2 -> TP 1 x EP 4: every tensor byte-equal"
out=$(train 4 "${tp2ep2[@]}" --train-iters 3 --load "$work/ep4" --save "$work/back") ||
  fail "load of TP 1 x EP 4 at TP 2 x EP 2" "$out"
compare "$work/src/iter_0000003" "$work/back/iter_0000003"
echo "[checkpoint] TP 1 x EP 4 -> TP 2 x EP 2: every tensor byte-equal"

# ---- the distributed optimizer's ranged pieces ----
out=$(train 4 "${tp2ep2[@]}" --train-iters 3 --use-distributed-optimizer --save "$work/dist") ||
  fail "the run with --use-distributed-optimizer at TP 2 x EP 2 stopped" "$out"
grep -q '"format_version": 2' "$work/dist/iter_0000003/manifest.json" ||
  fail "the distributed optimizer's TP 2 x EP 2 checkpoint is not format version 2 (ranged)" \
       "$(head -c 400 "$work/dist/iter_0000003/manifest.json")"
compare "$work/src/iter_0000003" "$work/dist/iter_0000003"
out=$(train 4 "${tp2ep2[@]}" --train-iters 5 --load "$work/src" \
      --metrics-file "$work/plain5.jsonl") || fail "resume without it" "$out"
plain=$(digest "$out")
out=$(train 4 "${tp2ep2[@]}" --train-iters 5 --load "$work/src" --use-distributed-optimizer \
      --metrics-file "$work/dist5.jsonl") || fail "resume with it" "$out"
[ "$(digest "$out")" = "$plain" ] || fail "resumed with it: $(digest "$out") != $plain" "$out"
# The grad norm's f64 sum is associated per shard with it (docs/numerics.md): its steps are
# compared with its own uninterrupted run's.
out=$(train 4 "${tp2ep2[@]}" --train-iters 5 --use-distributed-optimizer \
      --metrics-file "$work/dist_whole.jsonl") || fail "the uninterrupted run with it" "$out"
[ "$(steps "$work/dist5.jsonl")" = "$(tail -n 2 "$work/dist_whole.jsonl" | steps /dev/stdin)" ] ||
  fail "steps 4-5 resumed with it differ from its uninterrupted run" \
       "$(cat "$work/dist5.jsonl" "$work/dist_whole.jsonl")"
echo "[checkpoint] --use-distributed-optimizer at TP 2 x EP 2: the same checkpoint, resumed bitwise"

# ---- TP 2 x EP 2 x EDP 2 with the distributed optimizer, 8 ranks ----
# within A B: the per-step lm losses and grad norms of metrics files A and B (the same steps)
# within rtol 1e-5 of B's (docs/numerics.md, layout parity f32, per-step values).
within() {
  paste <(grep -o '"lm_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2) \
        <(grep -o '"lm_loss":[^,}]*\|"grad_norm":[^,}]*' "$2" | cut -d: -f2) |
    awk 'NF != 2 { exit 1 } { d = $1 - $2; if (d < 0) d = -d; m = $2 < 0 ? -$2 : $2
         if (d > 1e-5 * m) exit 1; n++ } END { exit n == 0 }'
}
plain8=(--tensor-model-parallel-size 2 --expert-model-parallel-size 2 --sequence-parallel)
edp=("${plain8[@]}" --use-distributed-optimizer)
out=$(train 8 "${edp[@]}" --train-iters 5 --metrics-file "$work/e_whole.jsonl") ||
  fail "TP 2 x EP 2 x EDP 2: the uninterrupted run stopped" "$out"
whole=$(digest "$out")
out=$(train 8 "${edp[@]}" --train-iters 3 --save "$work/e") ||
  fail "TP 2 x EP 2 x EDP 2: the first half stopped" "$out"
grep -q '"expt_dp": 2' "$work/e/iter_0000003/manifest.json" &&
  grep -q '"format_version": 2' "$work/e/iter_0000003/manifest.json" ||
  fail "TP 2 x EP 2 x EDP 2: not expert-DP 2, or not format version 2" \
       "$(head -c 600 "$work/e/iter_0000003/manifest.json")"
out=$(train 8 "${edp[@]}" --train-iters 5 --load "$work/e" --async-save --save "$work/e" \
      --metrics-file "$work/e_res.jsonl") || fail "TP 2 x EP 2 x EDP 2: the resume stopped" "$out"
[ "$(digest "$out")" = "$whole" ] ||
  fail "TP 2 x EP 2 x EDP 2: resumed $(digest "$out") != $whole" "$out"
[ "$(steps "$work/e_res.jsonl")" = "$(tail -n 2 "$work/e_whole.jsonl" | steps /dev/stdin)" ] ||
  fail "TP 2 x EP 2 x EDP 2: the resumed steps 4-5 differ" \
       "$(cat "$work/e_res.jsonl" "$work/e_whole.jsonl")"
echo "[checkpoint] TP 2 x EP 2 x EDP 2 with the distributed optimizer: resumed bitwise"
out=$(train 8 "${plain8[@]}" --train-iters 3 --save "$work/e_plain") ||
  fail "TP 2 x EP 2 x EDP 2 without the distributed optimizer stopped" "$out"
compare "$work/e/iter_0000003" "$work/e_plain/iter_0000003"
echo "[checkpoint] TP 2 x EP 2 x EDP 2: the same checkpoint with and without the distributed" \
     "optimizer"
for l in "4 --expert-model-parallel-size 4" "1"; do
  read -r -a layout <<< "$l"
  np=${layout[0]}
  flags=("${layout[@]:1}")
  what=$([ "$np" = 1 ] && echo "one rank" || echo "TP 1 x EP 4")
  out=$(train "$np" "${flags[@]}" --train-iters 5 --load "$work/e" --ckpt-step 3 \
        --metrics-file "$work/r$np.jsonl") || fail "TP 2 x EP 2 x EDP 2 -> $what: resume" "$out"
  grep -q "loaded iteration 3 from" <<< "$out" || fail "$what: did not load iteration 3" "$out"
  out=$(train "$np" "${flags[@]}" --train-iters 5 --metrics-file "$work/u$np.jsonl") ||
    fail "$what: the uninterrupted run stopped" "$out"
  within "$work/r$np.jsonl" <(tail -n 2 "$work/u$np.jsonl") ||
    fail "$what: steps 4-5 resumed from TP 2 x EP 2 x EDP 2 vs uninterrupted (rtol 1e-5)" \
         "$(cat "$work/r$np.jsonl" "$work/u$np.jsonl")"
  out=$(train "$np" "${flags[@]}" --train-iters 3 --load "$work/e" --ckpt-step 3 \
        --save "$work/s$np") || fail "$what: load and save again" "$out"
  compare "$work/e/iter_0000003" "$work/s$np/iter_0000003"
  echo "[checkpoint] TP 2 x EP 2 x EDP 2 -> $what: iteration 3 byte-equal; steps 4-5" \
       "$(steps "$work/r$np.jsonl") vs uninterrupted $(tail -n 2 "$work/u$np.jsonl" | steps /dev/stdin)"
done
