#!/usr/bin/env bash
# The numeric guards through `moecore train` on 4 ranks (EP 2 x expert-DP 2, DP 4), faults injected
# with MOECORE_FAULT (docs/testing.md, "Injected faults"; docs/flags.md, "Numeric guards"):
# - a NaN in rank 1's loss at iteration 3: every rank exits 17, rank 1 names itself, the
#   iteration and the micro-batch, rank 0 the job's summary; the checkpoint of iteration 2
#   (--save-interval 2) is the latest, and resuming from it reproduces the clean run's
#   iterations 3-6 and final weights bitwise;
# - an Inf in one expert weight's gradient on rank 2 at iteration 2: exit 17 naming the
#   parameter; the checkpoint of iteration 1 resumes bitwise likewise;
# - the same with --use-distributed-optimizer (a dense and an expert parameter): the parameter
#   named alone, though the in-place reduce-scatter rewrote the gradient buffer;
# - the same with --no-check-for-nan-in-loss-and-grad: the optimizer's message (exit 1), which
#   does not advise --clip-grad when clipping is on;
# - a spiky loss on rank 3 at iteration 4 with --skip-spiky-steps: the run equals, bitwise, the
#   same run with --iterations-to-skip 4 (that batch consumed, nothing computed); without
#   --skip-spiky-steps it stops with exit code 18.
# Usage: numeric_guards.sh MPIEXEC MOECORE_BINARY CONFIG
set -uo pipefail
mpiexec=$1 moecore=$2 config=$3
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
common=(--config "$config" --lr-warmup-iters 1 --lr-decay-iters 20 --micro-batch-size 2
        --global-batch-size 8 --log-interval 1 --peak-tflops 100 --expert-model-parallel-size 2)
# train FAULT ARGS...: `moecore train` on 4 ranks with MOECORE_FAULT=FAULT; sets $out and $rc.
train() {
  local fault=$1
  shift
  out=$(MOECORE_FAULT="$fault" "$mpiexec" --oversubscribe --allow-run-as-root -np 4 \
        -x OMP_NUM_THREADS=1 -x MOECORE_FAULT "$moecore" train "${common[@]}" "$@" 2>&1)
  rc=$?
}
has() { grep -qF -- "$1" <<< "$out" || fail "no '$1' in the output (exit $rc)" "$out"; }

train "" --train-iters 6 --metrics-file "$work/clean.jsonl"
[ "$rc" = 0 ] || fail "the clean run stopped ($rc)" "$out"
clean=$(digest "$out")

# resume_equals DIR ITER: the checkpoint of ITER is the latest in DIR, and a run resumed from it
# equals the clean run from ITER + 1 on.
resume_equals() {
  local dir=$1 it=$2
  [ "$(cat "$dir/latest_checkpointed_iteration.txt")" = "$it" ] || fail "tracker of $dir" "$out"
  [ ! -e "$dir/iter_$(printf %07d $((it + 1)))" ] || fail "iteration $((it + 1)) was saved" "$out"
  train "" --train-iters 6 --load "$dir" --save "$dir" --metrics-file "$dir.jsonl"
  [ "$rc" = 0 ] || fail "the resume from $dir stopped ($rc)" "$out"
  has "loaded iteration $it from"
  [ "$(digest "$out")" = "$clean" ] || fail "resumed weights $(digest "$out") != $clean" "$out"
  [ "$(steps "$dir.jsonl")" = "$(tail -n $((6 - it)) "$work/clean.jsonl" | steps /dev/stdin)" ] ||
    fail "the resumed steps differ" "$(cat "$dir.jsonl" "$work/clean.jsonl")"
}

# ---- NaN in rank 1's loss at iteration 3 ----
train "nan_loss:rank=1:iter=3" --train-iters 6 --save "$work/nan" --save-interval 2
[ "$rc" = 17 ] || fail "NaN loss: exit $rc, not 17" "$out"
has "[rank 1] error: [guard] rank 1, iteration 3: the loss of micro-batch 0 is nan"
has "[guard] stopping at iteration 3 (exit code 17): rank 1 (non-finite loss or gradient)"
[ "$(grep -c 'error: \[guard\]' <<< "$out")" = 1 ] || fail "another rank claimed a NaN" "$out"
resume_equals "$work/nan" 2
echo "[guard] NaN loss on rank 1 at iteration 3: exit 17, named; iteration 2 resumes bitwise"

# ---- Inf in an expert gradient on rank 2 at iteration 2 ----
param=decoder.layers.1.mlp.experts.linear_fc2.weight
train "inf_grad:rank=2:iter=2:param=$param" --train-iters 6 --save "$work/inf" --save-interval 1
[ "$rc" = 17 ] || fail "Inf gradient: exit $rc, not 17" "$out"
has "[rank 2] error: [guard] rank 2, iteration 2: a gradient is not finite in bucket #"
has "(expert) before the data-parallel reduction: parameter '$param'"
has "[guard] stopping at iteration 2 (exit code 17): rank 2 (non-finite loss or gradient)"
resume_equals "$work/inf" 1
echo "[guard] Inf gradient on rank 2 at iteration 2: exit 17, '$param' named; resumes bitwise"

# ---- with the distributed optimizer: named though the reduce-scatter rewrote the buffer ----
# The in-place reduce-scatter leaves only rank 2's own shard in its gradient buffer; each
# parameter's flag is raised before it, so the name is the injected parameter's, alone.
for p in decoder.layers.1.mlp.experts.linear_fc1.weight decoder.layers.0.self_attention.linear_qkv.weight; do
  train "inf_grad:rank=2:iter=2:param=$p" --train-iters 3 --use-distributed-optimizer
  [ "$rc" = 17 ] || fail "Inf gradient, distributed optimizer: exit $rc, not 17" "$out"
  has "before the data-parallel reduction: parameter '$p'"
  [ "$(grep -c "error: \[guard\]" <<< "$out")" = 1 ] || fail "another rank claimed it" "$out"
done
echo "[guard] Inf gradient with --use-distributed-optimizer: the parameter named, alone"

# ---- the same without the check: the optimizer's message ----
train "inf_grad:rank=2:iter=2:param=$param" --train-iters 3 --no-check-for-nan-in-loss-and-grad
[ "$rc" != 0 ] && [ "$rc" != 17 ] || fail "unchecked Inf gradient: exit $rc" "$out"
has "gradient norm is inf at step 2: lower --lr (clipping at --clip-grad=1 cannot scale"
grep -q "enable --clip-grad" <<< "$out" && fail "advises --clip-grad with clipping on" "$out"
echo "[guard] --no-check-for-nan-in-loss-and-grad: the optimizer stops on the norm"

# ---- a spiky loss on rank 3 at iteration 4 ----
spiky=(--check-for-spiky-loss --spike-check-samples 2 --train-iters 6)
train "spike_loss:rank=3:iter=4" "${spiky[@]}" --skip-spiky-steps --metrics-file "$work/skip.jsonl"
[ "$rc" = 0 ] || fail "the skipping run stopped ($rc)" "$out"
has "[guard] iteration 4 skipped (--skip-spiky-steps): rank 3 (spiky loss or large gradients)"
skipped=$(digest "$out")
train "" "${spiky[@]}" --iterations-to-skip 4 --metrics-file "$work/its.jsonl"
[ "$rc" = 0 ] || fail "the --iterations-to-skip run stopped ($rc)" "$out"
has "iteration 4 skipped (--iterations-to-skip)"
[ "$skipped" = "$(digest "$out")" ] || fail "skipped weights $skipped != $(digest "$out")" "$out"
[ "$(grep -v '"iteration":4,' "$work/skip.jsonl" | steps /dev/stdin)" = "$(steps "$work/its.jsonl")" ] ||
  fail "the steps after the skip differ" "$(cat "$work/skip.jsonl" "$work/its.jsonl")"
[ "$(steps "$work/its.jsonl")" != "$(grep -v '"iteration":4,' "$work/clean.jsonl" | steps /dev/stdin)" ] ||
  fail "control: skipping iteration 4 changed nothing" "$(cat "$work/its.jsonl")"
train "spike_loss:rank=3:iter=4" "${spiky[@]}"
[ "$rc" = 18 ] || fail "spiky loss without --skip-spiky-steps: exit $rc, not 18" "$out"
has "[rank 3] error: [guard] rank 3, iteration 4: spiky loss: micro-batch 0 loss 1000000000000"
echo "[guard] spiky loss on rank 3: skipped == --iterations-to-skip 4 bitwise; else exit 18"
echo "PASS"
