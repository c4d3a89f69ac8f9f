#!/usr/bin/env bash
# Builds the moecore binary (only it, not the tests) and trains the default tiny MoE model
# (configs/tiny.toml) on the synthetic language; extra arguments are moecore train flags and
# override the config.
set -euo pipefail
cd "$(dirname "$0")/.."
MOECORE_BUILD_TARGETS=moecore bash scripts/build.sh
./build/moecore train --config configs/tiny.toml "$@"
