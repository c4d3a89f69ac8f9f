#!/usr/bin/env bash
# Configures and builds moecore into build/ (Release). Extra arguments go to cmake's configure
# step; MOECORE_BUILD_TARGETS (space-separated) limits what is built (default: everything).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" > build.log 2>&1 || { cat build.log; exit 1; }
targets=()
for t in ${MOECORE_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build build -j"$(nproc)" "${targets[@]}"
