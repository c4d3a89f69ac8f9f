#!/usr/bin/env bash
# The emulated CUDA build's checks (docs/testing.md, "The emulated CUDA build"): the backend
# harness's cuda cases (the ops with a kernel run through the grid emulator against their `_ref`;
# the others are reported as not run, naming the op without a kernel) and `moecore train
# --device cuda` stopping before step 0 with the list of ops without a kernel.
# Usage: scripts/emu_cuda.sh [BUILD_DIR]   (default build-emu, configured with -DMOECORE_CUDA_EMU=ON
# and its targets test_backend and moecore built: MOECORE_BUILD_DIR=build-emu
# MOECORE_BUILD_TARGETS="moecore test_backend" bash scripts/build.sh -DMOECORE_CUDA_EMU=ON)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-emu}
grep -q '^MOECORE_CUDA_EMU:BOOL=ON' "$dir/CMakeCache.txt" ||
  { echo "[emu-cuda] $dir is not an emulated CUDA build (configure it with -DMOECORE_CUDA_EMU=ON)"; exit 1; }
log=$dir/emu-cuda.log
# The harness's cases hand the ops host buffers, so its device memory is the host's (shared: see
# tests/emu/device_memory_emu.h); the training tests set strict device memory for moecore.
MOECORE_EMU_DEVICE_MEMORY=shared OMP_NUM_THREADS=1 "$dir/tests/test_backend" \
  --gtest_filter='*/cuda_*:CudaTraining.*' 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# gtest names each skipped test twice (when it ends, and in the summary): count names once.
ran=$(grep -oE '^\[       OK \] Backend/Ops\.Run/cuda_[a-z0-9_]+' "$log" | sort -u | sed 's/.*Run\///' || true)
skipped=$(grep -oE '^\[  SKIPPED \] Backend/Ops\.Run/cuda_[a-z0-9_]+' "$log" | sort -u | wc -l)
echo "[emu-cuda] cuda cases run against their reference: $(echo $ran)"
echo "[emu-cuda] cuda cases not run (an op without a kernel, named above): $skipped"
exit "$rc"
