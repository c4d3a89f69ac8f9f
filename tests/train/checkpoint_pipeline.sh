#!/usr/bin/env bash
# Pipeline parallelism through `moecore train` under mpirun (docs/parallel.md, "Pipeline
# parallelism"; docs/checkpoint_format.md):
# - resume: 3 steps at PP 2, save, stop, resume to 6 == an uninterrupted 6-step run, bitwise
#   (per-step losses and grad norms, final weights, and the checkpoints' bytes, AdamW moments
#   included); the same at PP 2 x VP 2 with the distributed optimizer over DP 2 (4 ranks);
# - resharding across PP: iteration 3 of PP 2 loaded at PP 1 (one rank), PP 4, PP 2 x VP 2 and
#   PP 2 x EP 2 with the distributed optimizer, each saved again: every global tensor byte-equal
#   to the source's, and the next step's loss within the layout-parity tolerance (rtol 1e-5) of
#   the source's;
# - a checkpoint of tied embeddings at PP 2 holds the table once (the last stage's copy is not
#   written), and loads at PP 1;
# - a standalone MTP stage (PP 3, "Ett|ttm|L", tied: the table on three stages): its checkpoint
#   holds the table and the MTP layer once, under the names of one rank, and loads at PP 1 and at
#   PP 2 with the MTP layer beside the loss, every global tensor byte-equal and the next step's
#   loss within rtol 1e-5 of the source's; its steps allocate nothing and sync only where
#   documented (--sync-audit);
# - --sync-audit at PP 2 x VP 2: the audited steps allocate nothing and sync only where
#   documented (SIGTERM mid-schedule: tests/train/stop_signals.sh);
# - the eval schedule (forward only): the validation loss at PP 2 equals one rank's (rtol 1e-5).
# Usage: checkpoint_pipeline.sh MPIEXEC MOECORE_BINARY CONFIG
set -euo pipefail
mpiexec=$1 moecore=$2 config=$3
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
common=(--config "$config" --num-layers 4 --lr-warmup-iters 1 --lr-decay-iters 20
        --micro-batch-size 2 --global-batch-size 16 --log-interval 1 --peak-tflops 100)
train() { train_on "$@"; }  # train NP ARGS... (lib.sh)
export MOECORE_FAULT=""
within() {  # within A B: |A - B| <= 1e-5 |B|
  awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * (b < 0 ? -b : b)) }'
}
last_loss() { grep -o '"lm_loss":[^,]*' "$1" | tail -n 1 | cut -d: -f2; }

# ---- resume, bitwise ----
resume_case() {  # resume_case NAME NP FLAGS...
  local name=$1 np=$2
  shift 2
  local out whole
  out=$(train "$np" "$@" --train-iters 6 --metrics-file "$work/$name-whole.jsonl" \
        --save "$work/$name-w") || fail "$name: the uninterrupted run stopped" "$out"
  whole=$(digest "$out")
  out=$(train "$np" "$@" --train-iters 3 --save "$work/$name-r") ||
    fail "$name: the first half stopped" "$out"
  out=$(train "$np" "$@" --train-iters 6 --load "$work/$name-r" --save "$work/$name-r" \
        --metrics-file "$work/$name-resumed.jsonl") || fail "$name: the resumed run stopped" "$out"
  grep -q "loaded iteration 3 from" <<< "$out" || fail "$name: no resume at iteration 3" "$out"
  [ "$(digest "$out")" = "$whole" ] || fail "$name: resumed weights $(digest "$out") != $whole" "$out"
  [ "$(steps "$work/$name-resumed.jsonl")" = \
    "$(tail -n 3 "$work/$name-whole.jsonl" | steps /dev/stdin)" ] ||
    fail "$name: the resumed steps 4-6 differ" \
         "$(cat "$work/$name-resumed.jsonl" "$work/$name-whole.jsonl")"
  compare "$work/$name-w" "$work/$name-r"
  echo "[pipeline] resume at $name: steps 4-6, weights and AdamW moments bitwise"
}
pp2=(--pipeline-model-parallel-size 2)
resume_case "PP 2" 2 "${pp2[@]}"
resume_case "PP 2 x VP 2 x DP 2 (distributed optimizer)" 4 "${pp2[@]}" \
  --num-virtual-stages-per-pipeline-rank 2 --use-distributed-optimizer --overlap-grad-reduce

# ---- resharding across PP: iteration 3 of PP 2 ----
src="$work/PP 2-r"
out=$(train 2 "${pp2[@]}" --train-iters 4 --load "$src" --ckpt-step 3 \
      --metrics-file "$work/src4.jsonl") || fail "the source's step 4" "$out"
ref=$(last_loss "$work/src4.jsonl")
layouts=("1" "4 --pipeline-model-parallel-size 4"
         "2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"
         "4 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --use-distributed-optimizer")
prev=$src
k=0
for l in "${layouts[@]}"; do
  read -r np flags <<< "$l"
  k=$((k + 1))
  # shellcheck disable=SC2086
  out=$(train "$np" $flags --train-iters 3 --load "$prev" --ckpt-step 3 --save "$work/re$k") ||
    fail "load into $np ranks $flags" "$out"
  compare "$src/iter_0000003" "$work/re$k"
  # shellcheck disable=SC2086
  out=$(train "$np" $flags --train-iters 4 --load "$work/re$k" \
        --metrics-file "$work/re$k.jsonl") || fail "step 4 on $np ranks $flags" "$out"
  got=$(last_loss "$work/re$k.jsonl")
  within "$got" "$ref" || fail "step 4 loss on $np ranks $flags: $got vs the source's $ref" "$out"
  echo "[pipeline] PP 2 -> $np ranks ${flags:-(one rank)}: tensors byte-equal, step 4 loss $got" \
       "vs $ref"
  prev="$work/re$k"
done

# ---- tied embeddings: the table once in the checkpoint ----
# The configuration's model with the head tied to the embedding (Megatron's default).
grep -v '^untie-embeddings-and-output-weights' "$config" > "$work/tied.toml"
untied_common=("${common[@]}")
common=("${common[@]/$config/$work/tied.toml}")
out=$(train 2 "${pp2[@]}" --train-iters 2 --save "$work/tied2") ||
  fail "tied embeddings at PP 2" "$out"
out=$(train 1 --train-iters 2 --load "$work/tied2" --ckpt-step 2 --save "$work/tied1") ||
  fail "the tied PP 2 checkpoint at one rank" "$out"
compare "$work/tied2/iter_0000002" "$work/tied1"
common=("${untied_common[@]}")
manifest="$work/tied2/iter_0000002/manifest.json"
n=$(grep -o '"embedding.word_embeddings.weight"' "$manifest" | wc -l)
grep -q '"output_layer.weight"' "$manifest" && fail "the tied checkpoint has an output layer"
[ "$n" -ge 1 ] || fail "the tied checkpoint has no embedding table" "$(cat "$manifest")"
echo "[pipeline] tied embeddings at PP 2: one table in the checkpoint, loaded at one rank"

# ---- a standalone MTP stage: saved once, loaded where MTP sits beside the loss ----
common=("${common[@]/$config/$work/tied.toml}" --mtp-num-layers 1)
mtp3=(--pipeline-model-parallel-size 3 --pipeline-model-parallel-layout "Ett|ttm|L")
out=$(train 3 "${mtp3[@]}" --train-iters 3 --save "$work/mtp3") ||
  fail "MTP in a stage of its own at PP 3" "$out"
out=$(train 3 "${mtp3[@]}" --train-iters 4 --load "$work/mtp3" --ckpt-step 3 \
      --metrics-file "$work/mtp3-4.jsonl") || fail "the standalone MTP source's step 4" "$out"
ref=$(last_loss "$work/mtp3-4.jsonl")
manifest="$work/mtp3/iter_0000003/manifest.json"
for t in embedding.word_embeddings.weight mtp.layers.0.eh_proj.weight decoder.final_layernorm.weight; do
  [ "$(grep -o "\"$t\"" "$manifest" | wc -l)" -ge 1 ] || fail "no $t in the MTP checkpoint"
done
grep -q '"output_layer.weight"' "$manifest" && fail "the tied MTP checkpoint has an output layer"
for l in "1" "2 --pipeline-model-parallel-size 2"; do
  read -r np flags <<< "$l"
  # shellcheck disable=SC2086
  out=$(train "$np" $flags --train-iters 3 --load "$work/mtp3" --ckpt-step 3 \
        --save "$work/mtp-re$np") || fail "the standalone MTP checkpoint on $np ranks" "$out"
  compare "$work/mtp3/iter_0000003" "$work/mtp-re$np"
  # shellcheck disable=SC2086
  out=$(train "$np" $flags --train-iters 4 --load "$work/mtp-re$np" \
        --metrics-file "$work/mtp-re$np.jsonl") || fail "MTP step 4 on $np ranks" "$out"
  got=$(last_loss "$work/mtp-re$np.jsonl")
  within "$got" "$ref" || fail "MTP step 4 loss on $np ranks: $got vs the source's $ref" "$out"
  echo "[pipeline] standalone MTP stage (PP 3) -> $np ranks ${flags:-(one rank)}: tensors" \
       "byte-equal, step 4 loss $got vs $ref"
done
out=$(train 3 "${mtp3[@]}" --micro-batch-size 1 --train-iters 3 --sync-audit) ||
  fail "--sync-audit with a standalone MTP stage" "$out"
grep -q '\[sync-audit\] steps 2-3 audited: 0 allocations, 0 undocumented host syncs' <<< "$out" ||
  fail "--sync-audit with a standalone MTP stage found something" "$out"
echo "[pipeline] --sync-audit with a standalone MTP stage (PP 3): nothing allocated, no undocumented sync"
common=("${untied_common[@]}")

# ---- --sync-audit: a pipelined step allocates nothing and syncs only where documented ----
out=$(train 2 "${pp2[@]}" --num-virtual-stages-per-pipeline-rank 2 --micro-batch-size 1 \
      --train-iters 3 --sync-audit) || fail "--sync-audit at PP 2 x VP 2" "$out"
grep -q '\[sync-audit\] steps 2-3 audited: 0 allocations, 0 undocumented host syncs' <<< "$out" ||
  fail "--sync-audit at PP 2 x VP 2 found something" "$out"
echo "[pipeline] --sync-audit at PP 2 x VP 2: steps 2-3 allocate nothing, no undocumented sync"

# ---- the eval schedule: validation loss ----
evl() { grep -o 'lm loss value: [^ ]*' <<< "$1" | tail -n 1 | awk '{print $4}'; }
ev=(--mock-data --split 90,5,5 --train-iters 2 --eval-iters 2 --eval-interval 2)
out=$(train 1 "${ev[@]}") || fail "eval on one rank" "$out"
one=$(evl "$out")
out=$(train 2 "${pp2[@]}" "${ev[@]}") || fail "eval at PP 2" "$out"
got=$(evl "$out")
[ -n "$one" ] && [ -n "$got" ] || fail "no validation loss printed" "$out"
within "$got" "$one" || fail "validation loss at PP 2: $got vs one rank's $one" "$out"
echo "[pipeline] validation loss at PP 2: $got vs one rank's $one"
echo "[pipeline] all passed"
