#!/usr/bin/env bash
# `moecore train --device cuda` with more processes on a node than it has GPUs, in the emulated
# CUDA build (a node of MOECORE_EMU_CUDA_DEVICES=2 devices, 3 ranks under mpirun): the ranks
# stop before step 0 with device selection's error (the node, the ranks, the devices they see,
# the fix), before the trainer's own checks and before anything creates a CUDA context; the job
# exits non-zero through moecore's error path, no exception escapes.
# Usage: device_select_train_mpi.sh MPIEXEC MOECORE_BINARY CONFIG
set -euo pipefail
mpiexec=$1 moecore=$2 config=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { { echo "FAIL: $1"; echo "${2:-}"; } >&2; exit 1; }
rc=0
out=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  OMPI_MCA_orte_tmpdir_base=$work MOECORE_EMU_CUDA_DEVICES=2 OMP_NUM_THREADS=1 \
  "$mpiexec" --oversubscribe --allow-run-as-root -np 3 \
  -x MOECORE_EMU_CUDA_DEVICES -x OMP_NUM_THREADS \
  "$moecore" train --config "$config" --device cuda --train-iters 2 --lr-warmup-iters 0 \
  2>&1) || rc=$?
[ "$rc" != 0 ] || fail "3 ranks on a node of 2 devices: the run exited 0" "$out"
head="error: [device] node '$(hostname)' runs 3 processes of --device cuda (ranks 0, 1, 2)"
# Every rank stops with it; the first abort may end the others before they print (each waits
# 300 ms after its own line: runtime_abort), so one rank's line is what is certain.
grep -qE "^\[rank [012]\] " <<< "$(grep -F "$head" <<< "$out")" ||
  fail "no rank stopped with the device selection's error" "$out"
uuid=GPU-e0000000-0000-4000-8000-00000000000
for part in "see only 2 CUDA devices" "see 2 devices each (0: ${uuid}0, 1: ${uuid}1)" \
            "Run at most 2 processes on this node" "CUDA_VISIBLE_DEVICES"; do
  grep -qF -- "$part" <<< "$out" || fail "the error does not say '$part'" "$out"
done
past='"iteration"|iteration +1|\[train\] --device cuda trains on one process'
escaped='terminate called|unexpected internal error'
! grep -qE "$past|$escaped" <<< "$out" ||
  fail "the run went past device selection, or an exception escaped" "$out"
echo "[device-select] 3 ranks on a node of 2 emulated devices: every rank stopped before step 0" \
  "with the node, the ranks, the devices and the fix (exit $rc)"
