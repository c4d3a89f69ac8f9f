#!/usr/bin/env bash
# The SASS gate: disassembles every kernel of the CUDA build (its *.cu.o objects) and checks it
# against tools/sass_rules.txt: no local-memory spills in any kernel, 16-byte global loads in the
# kernels marked memory-bound, HGMMA in those marked tensor-core-gemm (tools/sass_gate.py).
#   bash scripts/sass_gate.sh [BUILD_DIR|OBJECT...]   (default: build-cuda)
# MOECORE_SASS_RULES overrides the rules file. cuobjdump comes from .venv-tools/, which
# scripts/setup.sh fills where the CUDA toolkit is installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cuobjdump=$(ls "$root"/.venv-tools/lib/python3*/site-packages/nvidia/cu13/bin/cuobjdump 2> /dev/null | head -n 1 || true)
if [ -z "$cuobjdump" ]; then
  echo "[sass-gate] cuobjdump not found in $root/.venv-tools: run bash scripts/setup.sh (it installs" \
       "NVIDIA's cuobjdump and nvdisasm wheels there when the CUDA toolkit is installed)" >&2
  exit 2
fi
[ $# -gt 0 ] || set -- "$root/build-cuda"
exec python3 "$root/tools/sass_gate.py" --cuobjdump "$cuobjdump" \
  --rules "${MOECORE_SASS_RULES:-$root/tools/sass_rules.txt}" "$@"
