#!/usr/bin/env bash
# README's test command: installs what is missing, builds moecore for this machine's CPU and runs
# the whole test suite (ctest), printing each phase's time. .ci/run runs this first, then what
# depends on the CPU's ISA again for restricted ISAs, the CUDA compile check and the fuzzers.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/phases.sh
echo "[test] native ISA:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
phase "build: native" bash scripts/build.sh
phase "suite: native, every test" bash scripts/run_suite.sh native build
