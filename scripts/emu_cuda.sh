#!/usr/bin/env bash
# The emulated CUDA build's checks (docs/testing.md, "The emulated CUDA build"): the backend
# harness's cuda cases (the ops with a kernel run through the grid emulator against their `_ref`;
# the others are reported as not run, naming the op without a kernel), and `moecore train
# --device cuda` on the tiny model against --device cpu, bitwise run to run, on one process and
# under mpirun in every parallel layout (the emulated NCCL), with checkpoints, stops and eval.
# Usage: scripts/emu_cuda.sh [BUILD_DIR]   (default build-emu, configured with -DMOECORE_CUDA_EMU=ON
# and its targets test_backend, test_device_select_mpi, test_emu_nccl, bench_moe_layer and moecore
# built: MOECORE_BUILD_DIR=build-emu
# MOECORE_BUILD_TARGETS="moecore test_backend test_device_select_mpi test_emu_nccl bench_moe_layer"
# bash scripts/build.sh -DMOECORE_CUDA_EMU=ON)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-emu}
grep -q '^MOECORE_CUDA_EMU:BOOL=ON' "$dir/CMakeCache.txt" ||
  { echo "[emu-cuda] $dir is not an emulated CUDA build (configure it with -DMOECORE_CUDA_EMU=ON)"; exit 1; }
log=$dir/emu-cuda.log
# Strict device memory (tests/emu/device_memory_emu.h, the emulated device's default): the cases
# stage their buffers (tests/backend/backend_case.h, Staging), and a host pointer reaching a
# kernel, or the host touching device memory, fails.
MOECORE_EMU_DEVICE_MEMORY=strict OMP_NUM_THREADS=1 "$dir/tests/test_backend" \
  --gtest_filter='*/cuda_*:CudaTraining.*:CudaGraph.*' 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# gtest names each skipped test twice (when it ends, and in the summary): count names once.
ran=$(grep -oE '^\[       OK \] Backend/Ops\.Run/cuda_[a-z0-9_]+' "$log" | sort -u | sed 's/.*Run\///' || true)
skipped=$( (grep -oE '^\[  SKIPPED \] Backend/Ops\.Run/cuda_[a-z0-9_]+' "$log" || true) | sort -u | wc -l)
echo "[emu-cuda] cuda cases run against their reference: $(echo $ran | wc -w)"
echo "[emu-cuda] cuda cases not run (an op without a kernel, named above): $skipped"
# The GPU check's stage-4 program on the emulated device (scripts/gpu_check.sh runs it on a GPU
# at Megatron's shapes): bench_moe_layer --device cuda --bf16 --kernels at the small presets (the
# routed experts alone; and with DeepSeek-like routing and a shared expert), each kernel timed
# alone through the path a GPU takes (device-table grouped GEMMs with their workspace, fc1's bf16
# D) beside its prediction. Timings are the emulator's: only that it runs and prints is checked.
for preset in small small-deepseek; do
  out=$dir/emu-cuda-bench-$preset.log
  if OMP_NUM_THREADS=1 "$dir/bench_moe_layer" --device cuda --bf16 --preset "$preset" --kernels \
       --iters 1 --warmup 1 --peak-tflops 1 > "$out" 2>&1 &&
     grep -qE '^\[kernel\] fwd experts: fc1 grouped GEMM: [0-9.]+ ms, predicted' "$out"; then
    echo "[emu-cuda] bench_moe_layer --device cuda --bf16 --preset $preset --kernels: ok ($(grep -c '^\[kernel\]' "$out") kernels timed)"
  else
    echo "[emu-cuda] FAIL: bench_moe_layer --device cuda --bf16 --preset $preset --kernels:"
    sed 's/^/    /' "$out"
    rc=1
  fi
done
# `moecore train --device cuda` against --device cpu (tests/emu/train_cuda_emu.sh): the tiny model
# in f32; --bf16; f32 with TF32 GEMMs on the device (--fp32-matmul-precision high, against the
# CPU's full f32); dropout with full recomputation and padded capacity; quantile balancing with two
# multi-token prediction depths (their rolled tokens, MoE layers and heads); multi-latent attention
# under --bf16 with its recomputation (v narrower than q / k: the bf16 GEMMs over the padded
# heads' column blocks; the MLA rotary and layout kernels); and the tiny DeepSeek-V3 (MLA, grouped
# sigmoid routing with expert bias, MTP). A run's first word may name its config
# (configs/tiny.toml otherwise). Every one of them is one process (EP 1, dropless or padded): its
# audited steps must make no host sync at all (--sync-free: the grouped GEMMs run from device
# tables, docs/gpu.md "GEMMs on CUDA"). A run marked @host-tables is also run with the grouped
# GEMMs' host tables (MOECORE_GROUPED_GEMM=host), bitwise the same.
runs=(
  "@host-tables"
  "@host-tables --bf16"
  "--fp32-matmul-precision high"
  "--hidden-dropout 0.1 --attention-dropout 0.1 --recompute-granularity full
   --recompute-method uniform --recompute-num-layers 1 --moe-expert-capacity-factor 1.0
   --moe-pad-expert-input-to-capacity"
  "--moe-router-load-balancing-type quantile_balancing --moe-aux-loss-coeff 0
   --moe-router-quantile-balancing-ema 0.9 --mtp-num-layers 2"
  "--multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 12
   --qk-pos-emb-head-dim 4 --v-head-dim 12 --qk-layernorm --rotary-scaling-factor 4
   --mscale-all-dim 0.8 --yarn-original-max-position-embeddings 16 --bf16
   --recompute-granularity selective --recompute-modules core_attn mla_up_proj"
  "configs/deepseek-v3-tiny.toml"
)
# Each run is one thread (OMP_NUM_THREADS=1 in train_cuda_emu.sh): as many at once as there are
# cores, each into its own log, printed in order once all have ended.
jobs_max=$(nproc)
rm -f "$dir"/emu-cuda-train-*.status "$dir"/emu-cuda-graph-*.status  # a run that dies first fails
for i in "${!runs[@]}"; do
  while (( $(jobs -rp | wc -l) >= jobs_max )); do wait -n || true; done
  r=${runs[i]} config=configs/tiny.toml opts=(--sync-free)
  if [[ "$r" == @host-tables* ]]; then opts+=(--host-tables); r=${r#@host-tables}; fi
  if [[ "$r" == configs/* ]]; then config=${r%% *}; r=${r#"$config"}; fi
  (
    echo "[emu-cuda] moecore train --device cuda --config $config ${r:-(as configured)}" | tr -s ' \n' ' '
    echo
    # shellcheck disable=SC2086  # the run's flags, split on purpose
    status=0
    bash tests/emu/train_cuda_emu.sh "${opts[@]}" "$dir/moecore" "$config" $r || status=$?
    echo "$status" > "$dir/emu-cuda-train-$i.status"
  ) > "$dir/emu-cuda-train-$i.log" 2>&1 &
done
# --cuda-graph-impl full_iteration (tests/emu/train_cuda_graph_emu.sh, also the ctests
# train_cuda_graph_emu_*): 4 steps with the forward and backward captured after one warm-up step
# and replayed, bitwise the eager run, on the dense tiny model with dropout (the iteration reaches
# the masks through memory), on padded dispatch (its fixed-rows GEMMs) and on dropless MoE (its
# grouped GEMMs from device tables); a planted host read refused by name.
graph_runs=(
  ""
  "--num-experts 0 --hidden-dropout 0.1 --attention-dropout 0.1"
  "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --moe-input-jitter-eps 0.01"
)
for i in "${!graph_runs[@]}"; do
  while (( $(jobs -rp | wc -l) >= jobs_max )); do wait -n || true; done
  r=${graph_runs[i]}
  (
    echo "[emu-cuda] moecore train --device cuda --cuda-graph-impl full_iteration $r"
    status=0
    # shellcheck disable=SC2086  # the run's flags, split on purpose
    bash tests/emu/train_cuda_graph_emu.sh "$dir/moecore" configs/tiny.toml $r || status=$?
    echo "$status" > "$dir/emu-cuda-graph-$i.status"
  ) > "$dir/emu-cuda-graph-$i.log" 2>&1 &
done
wait
for i in "${!runs[@]}"; do
  cat "$dir/emu-cuda-train-$i.log"
  [ "$(cat "$dir/emu-cuda-train-$i.status" 2>/dev/null)" = 0 ] || rc=1
done
for i in "${!graph_runs[@]}"; do
  cat "$dir/emu-cuda-graph-$i.log"
  [ "$(cat "$dir/emu-cuda-graph-$i.status" 2>/dev/null)" = 0 ] || rc=1
done
# The emulated NCCL under mpirun (tests/emu/test_emu_nccl.cpp, ctests emu_nccl_*): every
# collective's plans against the MPI communicator, the strict buffer rules, stream order and the
# grouped sends and receives, its timeout.
if command -v mpirun > /dev/null 2>&1; then
  if [ -x "$dir/tests/test_emu_nccl" ]; then
    ctest --test-dir "$dir" -R '^emu_nccl_' --output-on-failure || rc=1
  else
    echo "[emu-cuda] FAIL: $dir/tests/test_emu_nccl is not built (build its target too)"
    rc=1
  fi
fi
# Device selection under mpirun (tests/CMakeLists.txt, label device_select): ranks on a node of
# emulated devices take the GPU of their node-local rank, or their one device; 3 ranks on 2
# devices and two ranks on one GPU are refused with the message, the trainer's run included.
if command -v mpirun > /dev/null 2>&1; then
  if [ -x "$dir/tests/test_device_select_mpi" ]; then
    ctest --test-dir "$dir" -L device_select --output-on-failure || rc=1
  else
    echo "[emu-cuda] FAIL: $dir/tests/test_device_select_mpi is not built (build its target too)"
    rc=1
  fi
fi
# Every parallel layout on --device cuda under mpirun (tests/emu/train_cuda_emu_layouts.sh, the
# ctest entries train_cuda_emu_layouts_mpi_{2,3,4,8}): the device's collectives on the emulated NCCL;
# then checkpoints, SIGTERM to mpirun, eval and the stream-wait watchdog there
# (tests/emu/train_cuda_emu_ckpt.sh, train_cuda_emu_ckpt_mpi_2); and --cuda-graph-impl
# full_iteration with several processes, replay bitwise eager (train_cuda_graph_emu_mpi_*).
if command -v mpirun > /dev/null 2>&1; then
  ctest --test-dir "$dir" -R '^train_cuda_(emu_(layouts|ckpt)|graph_emu)_mpi_' \
    --output-on-failure || rc=1
else
  echo "[emu-cuda] --device cuda under mpirun: NOT RUN (no mpirun on this machine)"
fi
exit "$rc"
