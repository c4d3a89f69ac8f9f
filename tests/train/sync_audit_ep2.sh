#!/usr/bin/env bash
# --sync-audit under expert parallelism (EP = 2 on 2 ranks, the alltoall dispatcher): after the
# warm-up step no step allocates or syncs outside the documented points. Dropless counts its one
# documented sync per MoE layer and micro-batch (the count exchange); padded dispatch has none;
# nor do the distributed optimizer's gathers deferred to the next forward.
# Usage: sync_audit_ep2.sh MPIEXEC MOECORE_BINARY CONFIG
set -euo pipefail
mpiexec=$1 moecore=$2 config=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Open MPI's session directories inside this test's own: no other test's mpirun shares (and races
# on) the top-level one.
export OMPI_MCA_orte_tmpdir_base="$work"
run() {
  "$mpiexec" --oversubscribe --allow-run-as-root -np 2 -x OMP_NUM_THREADS=1 "$moecore" train \
    --config "$config" --train-iters 4 --lr-warmup-iters 1 --lr-decay-iters 4 --sync-audit \
    --expert-model-parallel-size 2 --micro-batch-size 4 "$@" 2>&1
}
fail() { echo "FAIL: $1"; echo "$2"; exit 1; }
clean="steps 2-4 audited: 0 allocations, 0 undocumented host syncs"
out=$(run) || fail "dropless EP=2 stopped" "$out"
grep -q "$clean" <<< "$out" || fail "dropless EP=2: no clean audit line" "$out"
# tiny.toml: 2 MoE layers, 2 micro-batches per rank: 4 count exchanges per step.
grep -q "dropless EP count exchange (the host sizes the all-to-all) x4" <<< "$out" ||
  fail "dropless EP=2: the count exchange is not counted once per layer and micro-batch" "$out"
out=$(run --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity) ||
  fail "padded EP=2 stopped" "$out"
grep -q "$clean" <<< "$out" || fail "padded EP=2: no clean audit line" "$out"
if grep -q "count exchange" <<< "$out"; then fail "padded EP=2 synced on the counts" "$out"; fi
out=$(run --bf16 --moe-token-dispatcher-type allgather) || fail "allgather --bf16 stopped" "$out"
grep -q "$clean" <<< "$out" || fail "allgather EP=2 --bf16: no clean audit line" "$out"
# The distributed optimizer's deferred gathers: started after one step, completed in the next
# forward; their requests go back to the pool a step later without growing it.
out=$(run --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather) ||
  fail "--overlap-param-gather --bf16 stopped" "$out"
grep -q "$clean" <<< "$out" || fail "EP=2 --overlap-param-gather --bf16: no clean audit line" "$out"
echo "[sync-audit] EP=2 dropless, padded, allgather --bf16 and --overlap-param-gather: clean"
