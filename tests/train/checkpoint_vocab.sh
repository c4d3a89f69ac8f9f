#!/usr/bin/env bash
# Checkpoints of a vocabulary that every TP size pads differently, through `moecore train` under
# mpirun (docs/flags.md, "Vocabulary padding"): vocabulary 250 with
# --make-vocab-size-divisible-by 100 has 300 table rows at TP 1, 400 at TP 2 and at TP 4 (where
# the last rank's slice is padding only). The padding is not part of the model, so the
# checkpoints of every TP size hold the same model: iteration 3 saved at TP 1, loaded at TP 2 and
# saved again, loaded at TP 4 and saved again, loaded back at TP 1 and saved again, every global
# tensor (weights and AdamW moments) byte-equal to the source each time.
# Usage: checkpoint_vocab.sh MPIEXEC MOECORE_BINARY CONFIG
set -euo pipefail
mpiexec=$1 moecore=$2 config=$3
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
common=(--config "$config" --vocab-size 250 --make-vocab-size-divisible-by 100
        --lr-warmup-iters 1 --lr-decay-iters 20 --micro-batch-size 2 --global-batch-size 16
        --log-interval 1 --peak-tflops 100)
train() { train_on "$@"; }  # train NP ARGS... (lib.sh)

out=$(train 1 --train-iters 3 --save "$work/tp1") || fail "the source run at TP 1 stopped" "$out"
grep -q 'lm loss' <<< "$out" || fail "the source run at TP 1 logged no loss" "$out"

out=$(train 2 --tensor-model-parallel-size 2 --train-iters 3 --load "$work/tp1" \
      --save "$work/tp2") || fail "load of TP 1 (300 rows) at TP 2 (400 rows)" "$out"
compare "$work/tp1/iter_0000003" "$work/tp2/iter_0000003"
echo "[checkpoint] vocabulary 250: TP 1 (300 rows) -> TP 2 (400 rows): every tensor byte-equal"

out=$(train 4 --tensor-model-parallel-size 4 --train-iters 3 --load "$work/tp2" \
      --save "$work/tp4") || fail "load of TP 2 at TP 4 (400 rows, a slice of padding only)" "$out"
compare "$work/tp1/iter_0000003" "$work/tp4/iter_0000003"
echo "[checkpoint] vocabulary 250: TP 2 -> TP 4 (400 rows): every tensor byte-equal"

out=$(train 1 --train-iters 3 --load "$work/tp4" --save "$work/back") ||
  fail "load of TP 4 (400 rows) at TP 1 (300 rows)" "$out"
compare "$work/tp1/iter_0000003" "$work/back/iter_0000003"
echo "[checkpoint] vocabulary 250: TP 4 -> TP 1 (300 rows): every tensor byte-equal"
