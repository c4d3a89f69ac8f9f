#!/usr/bin/env bash
# Test of the SASS gate (scripts/sass_gate.sh) on planted kernels, compiled here with nvcc and the
# CUDA build's flags: a clean memory-bound kernel passes; a kernel that spills to local memory,
# a memory-bound kernel with scalar loads, and a kernel marked tensor-core-gemm without HGMMA
# and a kernel built for sm_80 fail, each for its own reason; a directory without kernels passes and says so.
#   bash tests/cuda/sass_gate/test_sass_gate.sh [NVCC]     (.ci/run; about 10 s)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
nvcc=${1:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
work=$(mktemp -d "${TMPDIR:-/tmp}/sass-gate-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
failed=0

for f in clean scalar_loads spill; do
  mkdir -p "$work/$f"
  "$root/scripts/ptxas_log.sh" "$nvcc" -std=c++20 -arch=sm_90 --expt-relaxed-constexpr -lineinfo \
    -Xptxas=-v -Werror=all-warnings -c "$here/$f.cu" -o "$work/$f/$f.cu.o" 2> /dev/null
done
mkdir -p "$work/none" "$work/sm80"
"$root/scripts/ptxas_log.sh" "$nvcc" -std=c++20 -arch=sm_80 -Xptxas=-v -c "$here/clean.cu" \
  -o "$work/sm80/clean.cu.o" 2> /dev/null
printf 'fixture::scale_*  memory-bound\n' > "$work/memory_bound.txt"
printf 'fixture::scale_vec4  tensor-core-gemm\n' > "$work/gemm.txt"
: > "$work/no_rules.txt"

# expect NAME RULES DIR WANT_RC PATTERN...: the gate's exit status and lines of its output.
expect() {
  local name=$1 rules=$2 dir=$3 want=$4 rc=0
  shift 4
  MOECORE_SASS_RULES=$rules bash "$root/scripts/sass_gate.sh" "$dir" > "$work/out" 2>&1 || rc=$?
  local ok=1
  [ "$rc" -eq "$want" ] || ok=0
  for p in "$@"; do grep -qE -- "$p" "$work/out" || { ok=0; echo "  missing: $p"; }; done
  if [ "$ok" -eq 1 ]; then
    echo "[sass-gate test] ok: $name (exit $rc)"
  else
    echo "[sass-gate test] FAILED: $name: exit $rc, expected $want; the gate printed:"
    sed 's/^/    /' "$work/out"
    failed=1
  fi
}

expect "clean memory-bound kernel passes" "$work/memory_bound.txt" "$work/clean" 0 \
  "fixture::scale_vec4 +sm_90 .* 1/0 .*memory-bound +ok" "passed"
expect "scalar loads in a memory-bound kernel fail" "$work/memory_bound.txt" "$work/scalar_loads" 1 \
  "FAIL: fixture::scale_scalar .*marked memory-bound but none of its 1 global loads is 16 bytes"
expect "spills to local memory fail" "$work/no_rules.txt" "$work/spill" 1 \
  "FAIL: fixture::spill_many .*local-memory instructions \(LDL/STL\)" \
  "FAIL: fixture::spill_many .*ptxas spills [1-9][0-9]* bytes stored"
expect "tensor-core-gemm without HGMMA fails" "$work/gemm.txt" "$work/clean" 1 \
  "FAIL: fixture::scale_vec4 .*marked tensor-core-gemm but has no HGMMA"
expect "SASS for another GPU than sm_90 fails" "$work/no_rules.txt" "$work/sm80" 1 \
  "FAIL: fixture::scale_vec4 \(sm_80.*its SASS is for sm_80, not sm_90"
expect "a rule matching no kernel fails" "$work/memory_bound.txt" "$work/spill" 1 \
  "rule memory_bound.txt:1 .*matches no kernel"
expect "no kernels: passes and says so" "$work/no_rules.txt" "$work/none" 0 \
  "0 kernels in 0 objects" "passed"
rm -f "$work/clean/clean.cu.o.ptxas.log"
expect "a kernel without its ptxas report fails" "$work/memory_bound.txt" "$work/clean" 1 \
  "no ptxas report beside it"
[ "$failed" -eq 0 ] && echo "[sass-gate test] passed" || { echo "[sass-gate test] FAILED"; exit 1; }
