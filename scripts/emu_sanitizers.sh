#!/usr/bin/env bash
# The grid emulator's tests (test_emu: the emulator itself and every kernel of src/ops/cuda/) built
# with AddressSanitizer + UndefinedBehaviorSanitizer into build-emu-sanitizers/ and run. The fibers
# announce their stack switches to ASan, and the guards around dynamic shared memory are poisoned,
# so an out-of-bounds access in a kernel is reported at its line. Outside CMake: only the emulator,
# its tests, the kernels and their ops' `_ref` oracles are compiled, in about a minute on 2 cores.
# Usage: scripts/emu_sanitizers.sh [gtest flags...]   (CXX: the compiler, default g++)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${MOECORE_EMU_SANITIZERS_BUILD:-build-emu-sanitizers}
cxx=${CXX:-g++}
mkdir -p "$out"
launcher=()
if command -v ccache > /dev/null 2>&1; then
  export CCACHE_BASEDIR=$PWD
  launcher=(ccache)
fi
flags=(-std=c++20 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined
       -fno-omit-frame-pointer -fopenmp -fno-math-errno -Wall -Wextra -Wno-unused-parameter
       -Isrc -Itests)
# The kernels' ops' references: src/ops/cuda/<op>.cu -> src/ops/cpu/<op>_ref.cpp.
# The library descriptors and the references the emulated library calls are tested against
# (tests/emu/test_emu_blas.cpp) come too.
sources=(tests/emu/*.cpp src/core/check.cpp src/ops/desc/*.cpp src/ops/cpu/gemm_ref.cpp
         src/ops/cpu/gemm_bf16_ref.cpp)
# The kernels: src/ops/cuda/*.cu but the *_check.cu compile checks against the real CUDA headers.
kernels=()
for k in src/ops/cuda/*.cu; do [[ $k == *_check.cu ]] || kernels+=("$k"); done
for k in "${kernels[@]}"; do
  ref=src/ops/cpu/$(basename "${k%.cu}")_ref.cpp
  [ -f "$ref" ] && sources+=("$ref")
done
# The fused head's kernels (head_loss.cu) are named after the op, its header after the concept.
sources+=(src/ops/cpu/cross_entropy_ref.cpp)
objects=()
compile() {  # SOURCE [extra flags...]
  local src=$1 obj=$out/$(echo "$1" | tr / _).o
  shift
  "${launcher[@]}" "$cxx" "${flags[@]}" "$@" -c "$src" -o "$obj"
  objects+=("$obj")
}
for s in "${sources[@]}"; do compile "$s"; done
for k in "${kernels[@]}"; do compile "$k" -x c++ -include tests/emu/cuda_emu.h; done
"$cxx" "${flags[@]}" "${objects[@]}" -lgtest -lgtest_main -lfmt -pthread -o "$out/test_emu"
echo "[emu] running $out/test_emu under ASan + UBSan"
"$out/test_emu" "$@"
