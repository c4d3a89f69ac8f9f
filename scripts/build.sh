#!/usr/bin/env bash
# Configures and builds moecore (Release) into build/, or into $MOECORE_BUILD_DIR. Extra arguments
# go to cmake's configure step; MOECORE_BUILD_TARGETS (space-separated) limits what is built
# (default: everything). Compiles through ccache
# when it is installed, with paths relative to the checkout, so builds in other directories and
# clones reuse each other's objects.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
dir=${MOECORE_BUILD_DIR:-build}
launcher=()
if command -v ccache > /dev/null 2>&1; then
  export CCACHE_BASEDIR=$PWD
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" "$@" > "$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
targets=()
for t in ${MOECORE_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$dir" -j"$(nproc)" "${targets[@]}"
