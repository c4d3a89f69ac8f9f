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
# With --mpi MPIEXEC NP: on NP ranks under mpirun (the emulated NCCL's collectives recorded into
# the graph and replayed), the replayed steps' traffic counts (tp / expt_tp calls and bytes,
# all-to-all bytes) the eager run's too; the planted runs only with --plants, which adds a
# collective begun inside the captured region and waited for by the host after it
# (MOECORE_FAULT=nccl_wait_after_region), refused by name when the capture ends, and dropless
# MoE over EP 2 (CONFIG's experts), refused before step 0 by name.
# Usage: train_cuda_graph_emu.sh [--mpi MPIEXEC NP [--plants]] MOECORE_BINARY CONFIG [FLAGS...]
set -euo pipefail
np=1 plants=1 mpiexec=
if [ "${1:-}" = --mpi ]; then
  mpiexec=$2 np=$3 plants=0
  shift 3
  if [ "${1:-}" = --plants ]; then
    plants=1
    shift
  fi
fi
moecore=$1 config=$2
shift 2
# $work, fail, digest, steps (each step's iteration, lm loss and grad norm).
source "$(dirname "${BASH_SOURCE[0]}")/../train/lib.sh"
common=(--config "$config" --train-iters 4 --lr-warmup-iters 0 --lr-decay-iters 20
        --micro-batch-size 2 --global-batch-size 4 --log-interval 1 --peak-tflops 100
        --device cuda "$@")
run() {  # NAME [FLAGS...]: on $np ranks (train_on, tests/train/lib.sh)
  local name=$1
  shift
  MOECORE_EMU_DEVICE_MEMORY=strict train_on "$np" --metrics-file "$work/$name.jsonl" "$@"
}
export MOECORE_EMU_DEVICE_MEMORY=strict
# Every step's traffic counts as the metrics file logs them.
traffic() {
  grep -o '"\(expt_\)\?tp_bytes":{[^}]*}\|"\(alltoall_bytes\|tp_calls\|expt_tp_calls\)":[0-9]*' "$1" |
    paste -sd' '
}
graphs=(--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 1)
start=$(date +%s.%N)
eager=$(run eager) || fail "the eager run failed" "$eager"
graph=$(run graph "${graphs[@]}" --sync-audit) || fail "the CUDA graph run failed" "$graph"
seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
grep -q '^\[cuda-graph\] iteration 2: the forward and backward of [0-9]* micro-batch\(es\)\? captured as one graph of [0-9]* operations after 1 eager step' <<< "$graph" ||
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
[ "$(traffic "$work/eager.jsonl")" = "$(traffic "$work/graph.jsonl")" ] ||
  fail "the replayed steps count other traffic: $(traffic "$work/eager.jsonl") vs $(traffic "$work/graph.jsonl")"
ops=$(grep -o 'one graph of [0-9]* operations' <<< "$graph" | head -1 | awk '{print $4}')
if [ "$plants" = 0 ]; then
  echo "[train-cuda-graph-emu] --cuda-graph-impl full_iteration (emulated) on $np ranks: 4 steps, capture at step 2 ($ops operations), replays bitwise the eager run (digest $(digest "$graph")), the same traffic counts, no host sync in a replayed step (${seconds} s)"
  exit 0
fi
# The planted host read: refused by the capture at step 2, naming it.
planted=$(MOECORE_FAULT=host_read_in_step run planted "${graphs[@]}") &&
  fail "the run with a host read planted in the captured region did not stop" "$planted"
grep -q 'a host sync inside the captured forward and backward of every micro-batch (--cuda-graph-impl full_iteration): ops::read_back: the host reads device data' <<< "$planted" ||
  fail "the planted host read was not refused by name" "$planted"
grep -q '"iteration":1' "$work/planted.jsonl" && ! grep -q '"iteration":2' "$work/planted.jsonl" ||
  fail "the planted run should log step 1 (eager) and stop in step 2 (the capture)" "$planted"
plant_note="the planted host read refused by name"
if [ "$np" -gt 1 ]; then
  # The planted collective outside the recorded region: refused when the capture ends, naming it.
  planted=$(MOECORE_FAULT=nccl_wait_after_region run planted_nccl "${graphs[@]}") &&
    fail "the run with a collective waited for after the captured region did not stop" "$planted"
  grep -q "stream capture ended with 1 collective begun in it and never joined back to the captured stream, the first barrier on group 'world' (emulated NCCL, rank 0 of $np)" <<< "$planted" ||
    fail "the planted collective outside the recorded region was not refused by name" "$planted"
  grep -q '"iteration":1' "$work/planted_nccl.jsonl" && ! grep -q '"iteration":2' "$work/planted_nccl.jsonl" ||
    fail "the planted collective's run should log step 1 (eager) and stop in step 2 (the capture)" "$planted"
  plant_note="$plant_note, as is a collective waited for after the region"
  # Dropless MoE over EP: the count exchange is a host sync; refused before step 0, by name.
  common=(--config "$config" --train-iters 4 --lr-warmup-iters 0 --micro-batch-size 2
          --global-batch-size 4 --device cuda --expert-model-parallel-size 2)
  refused=$(run refused "${graphs[@]}") && fail "dropless EP 2 with a CUDA graph was not refused" "$refused"
  grep -q 'cuda-graph-impl full_iteration: dropless MoE with EP 2 x expert TP 1: the host sizes the all-to-all' <<< "$refused" ||
    fail "dropless EP 2 was not refused by name" "$refused"
  plant_note="$plant_note; dropless EP 2 refused before step 0"
fi
echo "[train-cuda-graph-emu] --cuda-graph-impl full_iteration (emulated) on $np rank(s): 4 steps, capture at step 2 ($ops operations), replays bitwise the eager run (digest $(digest "$graph")), the same traffic counts, no host sync in a replayed step; $plant_note (${seconds} s)"
