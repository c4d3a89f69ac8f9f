#!/usr/bin/env bash
# Builds moecore and trains the default tiny MoE model on the synthetic language.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
./build/moecore train "$@"
