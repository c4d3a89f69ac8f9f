#!/usr/bin/env bash
# Builds moecore and runs the whole test suite (ctest). Where nvcc is installed, also checks
# that the CUDA backend compiles and links.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
(cd build && ctest --output-on-failure -j2 --timeout 600)
if command -v nvcc > /dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "[test] CUDA build check (compile and link only; no GPU needed)"
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOECORE_CUDA=ON \
    -DMOECORE_TESTS=OFF -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" \
    > build-cuda.log 2>&1 || { cat build-cuda.log; exit 1; }
  cmake --build build-cuda -j"$(nproc)" --target moecore
fi
