#!/usr/bin/env bash
# --cuda-graph-impl full_iteration in the emulated CUDA build (docs/gpu.md, "CUDA graphs"): the
# model of CONFIG (with FLAGS) trained 4 steps on the emulated device, eagerly and with CUDA
# graphs after one warm-up step (step 2 captures the forward and backward, steps 2-4 replay
# them), in strict device memory:
# - the graph run under --sync-audit: its replayed steps make no host sync and count no sync
#   point (the whole forward and backward is one launch);
# - bitwise the eager run's per-step lm loss and grad norm and final weights digest;
# - the same graph run with a host read of step data planted inside the captured region
#   (MOECORE_FAULT=host_read_in_step) stops at the capture step, naming the read; the eager
#   warm-up step before it is unaffected.
# Usage: train_cuda_graph_emu.sh MOECORE_BINARY CONFIG [FLAGS...]
set -euo pipefail
moecore=$1 config=$2
shift 2
# $work, fail, digest, steps (each step's iteration, lm loss and grad norm).
source "$(dirname "${BASH_SOURCE[0]}")/../train/lib.sh"
common=(--config "$config" --train-iters 4 --lr-warmup-iters 0 --lr-decay-iters 20
        --micro-batch-size 2 --global-batch-size 4 --log-interval 1 --peak-tflops 100
        --device cuda "$@")
run() {  # NAME [FLAGS...]
  local name=$1
  shift
  MOECORE_EMU_DEVICE_MEMORY=strict OMP_NUM_THREADS=1 "$moecore" train "${common[@]}" \
    --metrics-file "$work/$name.jsonl" "$@" 2>&1
}
graphs=(--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 1)
start=$(date +%s.%N)
eager=$(run eager) || fail "the eager run failed" "$eager"
graph=$(run graph "${graphs[@]}" --sync-audit) || fail "the CUDA graph run failed" "$graph"
seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
grep -q '^\[cuda-graph\] iteration 2: the forward and backward of 2 micro-batches captured as one graph of [0-9]* operations after 1 eager step' <<< "$graph" ||
  fail "the graph run logged no capture at iteration 2" "$graph"
grep -q '\[sync-audit\] steps 2-4 audited: 0 allocations, 0 undocumented host syncs' <<< "$graph" ||
  fail "the graph run's steps are not clean under --sync-audit" "$graph"
grep -q 'counted in the last step: nothing' <<< "$graph" ||
  fail "a replayed step counted a sync point (the graph holds the whole forward and backward)" "$graph"
[ "$(grep -c '"iteration"' "$work/graph.jsonl")" = 4 ] || fail "the graph run logged $(grep -c '"iteration"' "$work/graph.jsonl") steps, not 4" "$graph"
[ "$(steps "$work/eager.jsonl")" = "$(steps "$work/graph.jsonl")" ] ||
  fail "the replayed steps differ from the eager ones: $(steps "$work/eager.jsonl") vs $(steps "$work/graph.jsonl")"
[ -n "$(digest "$eager")" ] && [ "$(digest "$eager")" = "$(digest "$graph")" ] ||
  fail "the graph run ends with other weights: $(digest "$eager") vs $(digest "$graph")"
# The planted host read: refused by the capture at step 2, naming it.
planted=$(MOECORE_FAULT=host_read_in_step run planted "${graphs[@]}") &&
  fail "the run with a host read planted in the captured region did not stop" "$planted"
grep -q 'a host sync inside the captured forward and backward of every micro-batch (--cuda-graph-impl full_iteration): ops::read_back: the host reads device data' <<< "$planted" ||
  fail "the planted host read was not refused by name" "$planted"
grep -q '"iteration":1' "$work/planted.jsonl" && ! grep -q '"iteration":2' "$work/planted.jsonl" ||
  fail "the planted run should log step 1 (eager) and stop in step 2 (the capture)" "$planted"
ops=$(grep -o 'one graph of [0-9]* operations' <<< "$graph" | awk '{print $4}')
echo "[train-cuda-graph-emu] --cuda-graph-impl full_iteration (emulated): 4 steps, capture at step 2 ($ops operations), replays bitwise the eager run (digest $(digest "$graph")), no host sync in a replayed step; the planted host read refused by name (${seconds} s)"
