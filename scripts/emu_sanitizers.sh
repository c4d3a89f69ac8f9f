#!/usr/bin/env bash
# The grid emulator's tests (test_emu: the emulator itself and every kernel of src/ops/cuda/) built
# with AddressSanitizer + UndefinedBehaviorSanitizer into build-emu-sanitizers/ and run. The fibers
# announce their stack switches to ASan, and the guards around dynamic shared memory are poisoned,
# so an out-of-bounds access in a kernel is reported at its line. Outside CMake: only the emulator,
# its tests, the kernels, their ops' `_ref` oracles and the few CPU pieces the tests call are
# compiled, as many at once as there are cores (about 4 CPU-minutes from scratch, seconds from
# ccache); the tests then take about 2 minutes on 2 cores.
# Usage: scripts/emu_sanitizers.sh [gtest flags...]
#   (CXX: the compiler, default g++; MOECORE_EMU_SANITIZERS_JOBS: parallel compiles and test
#   shards, default nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${MOECORE_EMU_SANITIZERS_BUILD:-build-emu-sanitizers}
cxx=${CXX:-g++}
mkdir -p "$out"
launcher=()
if command -v ccache > /dev/null 2>&1; then
  # Paths relative to the checkout, and (with -g) the working directory left out of the hash:
  # another clone's objects serve this one (the sources are named relative to it).
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
  launcher=(ccache)
fi
flags=(-std=c++20 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined
       -fno-omit-frame-pointer -fopenmp -fno-math-errno -Wall -Wextra -Wno-unused-parameter
       -Isrc -Itests)
# The kernels' ops' references: src/ops/cuda/<op>.cu -> src/ops/cpu/<op>_ref.cpp.
# The library descriptors and the references the emulated library calls are tested against
# (tests/emu/test_emu_blas.cpp) come too.
# (Not emu_absent.cpp: the CPU build's stand-in for the emulator, which refuses every launch; not
# test_emu_nccl.cpp: the emulated NCCL's own binary, run under mpirun in the emulated build; not
# test_emu_capture.cpp: the capture rules need the real sync audit, replaced here.)
sources=(src/core/check.cpp src/ops/desc/*.cpp src/ops/cpu/gemm_ref.cpp src/ops/cpu/gemm_bf16_ref.cpp)
for t in tests/emu/*.cpp; do
  [[ $t == */emu_absent.cpp || $t == */test_emu_nccl.cpp || $t == */test_emu_capture.cpp ]] ||
    sources+=("$t")
done
# What the tests call beside the references: the dropout keys (rng_key), the execution context
# and its host memory (cpu_exec, exec_alloc: no CUDA here, so the stub device), the RoPE tables
# (ops::RopeTables, make_rope_cache, the CPU rope the kernels are compared with), the CPU AdamW
# step. The sync audit is its never-armed stand-in (tests/emu/sanitizers/): the real one replaces
# the global operator new, which is ASan's here.
sources+=(src/core/rng.cpp src/core/exec.cpp src/core/host_memory.cpp src/core/device_stub_cuda.cpp
          src/core/fault_injection.cpp src/ops/f32_matmul_precision.cpp
          src/ops/cpu/rope.cpp src/ops/cpu/rope_yarn.cpp src/ops/cpu/rope_mla.cpp
          src/ops/cpu/adamw.cpp src/ops/cpu/memory.cpp
          src/ops/grouped_gemm_path.cpp src/ops/cpu/gemm.cpp src/ops/cpu/cast.cpp
          src/core/profiler.cpp
          tests/emu/sanitizers/*.cpp)
# The kernels: src/ops/cuda/*.cu but the *_check.cu compile checks against the real CUDA headers
# and the *_sm90a.cu sources (CUTLASS, wgmma, TMA: the CUDA build's alone).
kernels=()
for k in src/ops/cuda/*.cu; do [[ $k == *_check.cu || $k == *_sm90a.cu ]] || kernels+=("$k"); done
for k in "${kernels[@]}"; do
  ref=src/ops/cpu/$(basename "${k%.cu}")_ref.cpp
  [ -f "$ref" ] && sources+=("$ref")
done
# The fused head's kernels (head_loss.cu) are named after the op, its header after the concept.
sources+=(src/ops/cpu/cross_entropy_ref.cpp)
jobs_max=${MOECORE_EMU_SANITIZERS_JOBS:-$(nproc)}
objects=() pids=() failed=0
compile() {  # SOURCE [extra flags...]: in the background, at most jobs_max at once
  local src=$1 obj=$out/$(echo "$1" | tr / _).o
  shift
  while (( $(jobs -rp | wc -l) >= jobs_max )); do wait -n || failed=1; done
  "${launcher[@]}" "$cxx" "${flags[@]}" "$@" -c "$src" -o "$obj" &
  pids+=($!)
  objects+=("$obj")
}
for s in "${sources[@]}"; do compile "$s"; done
for k in "${kernels[@]}"; do compile "$k" -x c++ -include tests/emu/cuda_emu.h; done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
if (( failed )); then echo "[emu] a compile failed (above)" >&2; exit 1; fi
"$cxx" "${flags[@]}" "${objects[@]}" -lgtest -lgtest_main -lfmt -ldnnl -pthread -o "$out/test_emu"
# ASan's swapcontext interceptor clears the shadow of the whole fiber stack at every switch to a
# fiber (64 KiB of shadow for its 512 KiB): by default with mmap and madvise, which made the run
# system time (about 70 us a switch); a memset of the shadow is a few microseconds.
export ASAN_OPTIONS="clear_shadow_mmap_threshold=1048576${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
# The tests in as many gtest shards as compiles ran at once, each its own process and log.
shards=$jobs_max
echo "[emu] running $out/test_emu under ASan + UBSan in $shards shard(s)"
pids=() failed=0
for ((i = 0; i < shards; ++i)); do
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i "$out/test_emu" "$@" > "$out/shard_$i.log" 2>&1 &
  pids+=($!)
done
for ((i = 0; i < shards; ++i)); do
  status=0
  wait "${pids[i]}" || status=$?
  echo "[emu] shard $i of $shards (exit status $status):"
  cat "$out/shard_$i.log"
  (( status == 0 )) || failed=1
done
if (( failed )); then echo "[emu] a shard failed (above)" >&2; exit 1; fi
