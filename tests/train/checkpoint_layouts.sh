#!/usr/bin/env bash
# Checkpoints through `moecore train` under mpirun (docs/checkpoint_format.md):
# - resume: 3 steps, save, stop, resume to 6 == an uninterrupted 6-step run, bitwise (per-step
#   losses and grad norms, final weights and AdamW moments), at EP 2 x expert-DP 2 x DP 4, and
#   with --async-save;
# - SIGTERM with --exit-signal-handler: the step finishes, the ranks save and exit 0, and the
#   resumed run equals the uninterrupted one bitwise;
# - a rank killed (SIGKILL) after writing its shards: the previous checkpoint stays the latest, a
#   stray temp tracker is not read, and the resume from it equals the uninterrupted run;
# - rank 0 killed between the two renames of a re-save of the tracked iteration (the earlier copy
#   moved aside, the new one not yet in place): the resume recovers (says so), loads it and
#   equals the uninterrupted run bitwise;
# - resharding: a checkpoint of EP 2 on 2 ranks loaded on 4 ranks (EP 2 x EDP 2), 4 ranks
#   (EP 4), 1 rank and 2 ranks of DP, each saved again: every global tensor (weights and AdamW
#   moments) byte-equal to the source; the next step's loss within the layout-parity tolerance
#   (docs/numerics.md, f32 per-step values: rtol 1e-5); and, as the control of those compares,
#   two checkpoints that do differ (iterations 4 and 6) reported as different;
# - corruption: a flipped byte, a truncated or missing shard, another format or version: each a
#   clear error before any step.
# Usage: checkpoint_layouts.sh MPIEXEC MOECORE_BINARY CONFIG
set -euo pipefail
mpiexec=$1 moecore=$2 config=$3
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
common=(--config "$config" --lr-warmup-iters 1 --lr-decay-iters 20 --micro-batch-size 2
        --global-batch-size 16 --log-interval 1 --peak-tflops 100)
train() { train_on "$@"; }  # train NP ARGS... (lib.sh)
export MOECORE_FAULT=""

# ---- resume, bitwise, at EP 2 x EDP 2 (DP 4) ----
ep2x2=(--expert-model-parallel-size 2)
out=$(train 4 "${ep2x2[@]}" --train-iters 6 --metrics-file "$work/whole.jsonl" \
      --save "$work/w") || fail "the uninterrupted run stopped" "$out"
whole=$(digest "$out")
out=$(train 4 "${ep2x2[@]}" --train-iters 3 --save "$work/r") || fail "the first half stopped" "$out"
out=$(train 4 "${ep2x2[@]}" --train-iters 6 --load "$work/r" --save "$work/r" \
      --metrics-file "$work/resumed.jsonl") || fail "the resumed run stopped" "$out"
grep -q "loaded iteration 3 from" <<< "$out" || fail "the resume did not load iteration 3" "$out"
[ "$(digest "$out")" = "$whole" ] || fail "resumed weights $(digest "$out") != $whole" "$out"
[ "$(steps "$work/resumed.jsonl")" = "$(tail -n 3 "$work/whole.jsonl" | steps /dev/stdin)" ] ||
  fail "the resumed steps 4-6 differ" "$(cat "$work/resumed.jsonl" "$work/whole.jsonl")"
# The optimizer state too: both runs' checkpoints of iteration 6 hold the same bytes.
compare "$work/w" "$work/r"
echo "[checkpoint] resume at 4 ranks (EP 2 x EDP 2): steps 4-6, weights and AdamW moments bitwise"
# The same with --async-save, saving every iteration.
out=$(train 4 "${ep2x2[@]}" --train-iters 3 --save "$work/a" --save-interval 1 --async-save) ||
  fail "the first half with --async-save stopped" "$out"
[ "$(cat "$work/a/latest_checkpointed_iteration.txt")" = 3 ] || fail "async: tracker" "$out"
out=$(train 4 "${ep2x2[@]}" --train-iters 6 --load "$work/a" --save "$work/a" --async-save \
      --metrics-file "$work/resumed_async.jsonl") || fail "the async resumed run stopped" "$out"
[ "$(digest "$out")" = "$whole" ] || fail "async: resumed weights $(digest "$out") != $whole" "$out"
[ "$(steps "$work/resumed_async.jsonl")" = "$(tail -n 3 "$work/whole.jsonl" | steps /dev/stdin)" ] ||
  fail "async: the resumed steps 4-6 differ" "$(cat "$work/resumed_async.jsonl")"
echo "[checkpoint] --async-save at 4 ranks: every save completed, resumed bitwise"

# ---- SIGTERM: finish the step, save, exit 0 ----
ep2=(--expert-model-parallel-size 2)
stopped=$(sigterm_resume 2 "$work/sig" "${ep2[@]}") || exit 1
echo "[checkpoint] SIGTERM after iteration $stopped: saved, exit 0, resumed to $((stopped + 2))" \
     "bitwise"

# ---- a rank killed in the middle of a save ----
c="$work/c"
out=$(train 2 "${ep2[@]}" --train-iters 4 --save "$c" --save-interval 2) || fail "EP 2 run" "$out"
if out=$(MOECORE_FAULT=kill:at=save.after_shards:rank=1 train 2 "${ep2[@]}" --train-iters 6 --load "$c" \
         --save "$c"); then
  fail "the run whose rank 1 was killed succeeded" "$out"
fi
[ "$(cat "$c/latest_checkpointed_iteration.txt")" = 4 ] || fail "the tracker moved" "$(ls "$c")"
[ ! -e "$c/iter_0000006" ] || fail "a half-written iteration 6 was published" "$(ls "$c")"
printf '6' > "$c/latest_checkpointed_iteration.txt.tmp.12345"  # a crash's unrenamed temp
out=$(train 2 "${ep2[@]}" --train-iters 6 --load "$c" --save "$c") || fail "resume after kill" "$out"
grep -q "loaded iteration 4 from" <<< "$out" || fail "did not resume from iteration 4" "$out"
killed=$(digest "$out")
out=$(train 2 "${ep2[@]}" --train-iters 6 --metrics-file "$work/ep2_whole.jsonl") ||
  fail "the uninterrupted run stopped" "$out"
ep2_whole=$(digest "$out")
[ "$killed" = "$ep2_whole" ] || fail "resumed after the kill: $killed != $ep2_whole"
[ ! -e "$c/iter_0000006.partial" ] || fail "the interrupted save's staging is left" "$(ls "$c")"
echo "[checkpoint] rank 1 killed mid-save: iteration 4 stayed the latest and resumed bitwise"

# ---- rank 0 killed between the two renames of a re-save of the tracked iteration ----
rs="$work/rs"
out=$(train 2 "${ep2[@]}" --train-iters 4 --save "$rs" --save-interval 2) || fail "EP 2 run" "$out"
# Resumed from iteration 2 into the same directory, the run saves iteration 4 again: the tracked
# one. Killed with the earlier iter_0000004 moved aside and the new one finished, not moved in.
if out=$(MOECORE_FAULT=kill:at=publish.after_rename_aside:rank=0 train 2 "${ep2[@]}" \
         --train-iters 4 --load "$rs" --ckpt-step 2 --save "$rs" --save-interval 2); then
  fail "the re-save whose rank 0 was killed succeeded" "$out"
fi
[ "$(cat "$rs/latest_checkpointed_iteration.txt")" = 4 ] && [ ! -e "$rs/iter_0000004" ] &&
  [ -f "$rs/iter_0000004.replaced/manifest.json" ] &&
  [ -f "$rs/iter_0000004.partial/manifest.json" ] ||
  fail "the kill did not land between the renames" "$(ls "$rs")"
"$moecore" checkpoint info "$rs" > /dev/null || fail "checkpoint info between the renames"
out=$(train 2 "${ep2[@]}" --train-iters 6 --load "$rs" --save "$rs" \
      --metrics-file "$work/rs.jsonl") || fail "resume after the kill in the re-save" "$out"
grep -qF "[checkpoint] recovered: $rs: published the finished save iter_0000004.partial as \
iter_0000004 (its earlier copy, moved aside, removed)" <<< "$out" || fail "no recovery line" "$out"
grep -q "loaded iteration 4 from" <<< "$out" || fail "did not resume from iteration 4" "$out"
[ "$(digest "$out")" = "$ep2_whole" ] || fail "re-save kill: $(digest "$out") != $ep2_whole" "$out"
[ "$(steps "$work/rs.jsonl")" = "$(tail -n 2 "$work/ep2_whole.jsonl" | steps /dev/stdin)" ] ||
  fail "re-save kill: the resumed steps 5-6 differ" "$(cat "$work/rs.jsonl")"
[ "$(ls "$rs" | paste -sd' ')" = "iter_0000002 iter_0000004 iter_0000006 \
latest_checkpointed_iteration.txt" ] || fail "re-save kill: debris left" "$(ls "$rs")"
echo "[checkpoint] rank 0 killed between the renames of a re-save: recovered, resumed bitwise"

# ---- resharding: iteration 4 of EP 2 on 2 ranks, into other layouts ----
# The source's next step, then each layout's: NP and its flags.
loss5() { grep -o '"lm_loss":[^,]*' "$1" | tail -n 1 | cut -d: -f2; }
out=$(train 2 "${ep2[@]}" --train-iters 5 --load "$c" --ckpt-step 4 \
      --metrics-file "$work/src5.jsonl") || fail "the source's step 5" "$out"
ref=$(loss5 "$work/src5.jsonl")
prev=$c
layouts=("4 --expert-model-parallel-size 2" "4 --expert-model-parallel-size 4" "1"
         "2 --expert-model-parallel-size 1")
k=0
for l in "${layouts[@]}"; do
  read -r np flags <<< "$l"
  k=$((k + 1))
  # shellcheck disable=SC2086
  out=$(train "$np" $flags --train-iters 4 --load "$prev" --ckpt-step 4 \
        --save "$work/re$k") ||
    fail "load into $np ranks $flags" "$out"
  compare "$c/iter_0000004" "$work/re$k"
  # shellcheck disable=SC2086
  out=$(train "$np" $flags --train-iters 5 --load "$work/re$k" \
        --metrics-file "$work/re$k.jsonl") || fail "step 5 on $np ranks $flags" "$out"
  got=$(loss5 "$work/re$k.jsonl")
  awk -v a="$got" -v b="$ref" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * b) }' ||
    fail "step 5 loss on $np ranks $flags: $got vs the source's $ref (rtol 1e-5)" "$out"
  echo "[checkpoint] EP 2 on 2 ranks -> $np ranks ${flags:-(one rank)}: tensors byte-equal," \
       "step 5 loss $got vs $ref"
  prev="$work/re$k"
done

# The control for every compare above: iteration 4 saved on 4 ranks against iteration 6 on 2
# ranks, two valid checkpoints of other layouts, differ (exit status 1, the weights and AdamW
# moments named), so "byte-equal" is not a compare that finds everything equal.
if out=$("$moecore" checkpoint compare "$work/re1" "$c" 2>&1); then rc=0; else rc=$?; fi
if [ "$rc" -ne 1 ] || ! grep -q "^'decoder\..*bytes differ" <<< "$out" ||
   ! grep -q "^'exp_avg\..*bytes differ" <<< "$out"; then
  fail "compare: iterations 4 and 6 not reported as different (exit status $rc)" "$out"
fi
echo "[checkpoint] compare: iteration 4 (4 ranks) and 6 (2 ranks) differ in" \
     "$(grep -c 'bytes differ' <<< "$out") tensors"

# ---- corruption: each a clear error before any step ----
check_bad() {  # check_bad NAME NEEDLE SETUP...: a damaged copy of iteration 4 is refused
  local name=$1 needle=$2
  shift 2
  local save="$work/bad_$name"
  mkdir -p "$save"
  cp -r "$c/iter_0000004" "$save/"
  echo 4 > "$save/latest_checkpointed_iteration.txt"
  d="$save/iter_0000004"
  "$@"
  if out=$(train 1 --train-iters 5 --load "$save"); then fail "$name: loaded" "$out"; fi
  grep -q -- "$needle" <<< "$out" || fail "$name: not the expected error ($needle)" "$out"
  if grep -q ' iteration *[0-9]*/' <<< "$out"; then fail "$name: a step ran" "$out"; fi
  echo "[checkpoint] $name: refused before any step"
}
flip() { printf '\x55' | dd of="$d/model_rank_00001.safetensors" bs=1 seek=200 conv=notrunc \
         status=none; }
truncate_shard() { truncate -s -8 "$d/model_rank_00000.safetensors"; }
drop_shard() { rm "$d/optim_rank_00001.safetensors"; }
other_format() { sed -i 's/"moecore-checkpoint"/"other-checkpoint"/' "$d/manifest.json"; }
other_version() { sed -i 's/"format_version": 0/"format_version": 7/' "$d/manifest.json"; }
check_bad flipped "the file was altered after the save" flip
check_bad truncated "the file was truncated or replaced" truncate_shard
check_bad missing "shard 'optim_rank_00001.safetensors' (rank 1) is missing" drop_shard
check_bad format "not a moecore checkpoint manifest" other_format
check_bad version "format version 7; this moecore reads version 0" other_version
