#!/usr/bin/env bash
# Builds moecore and runs the whole test suite (ctest), first for this machine's CPU
# (-march=native), then again for restricted ISAs (AVX-512 without BF16, AVX2 without AVX-512)
# with oneDNN held to the same ISA, so the code paths for a missing CPU feature are tested on
# any machine that can run them. Where nvcc is installed, also checks that the CUDA backend
# compiles and links.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# run_suite NAME DIR [VAR=VALUE...]: ctest in DIR. On a failure the failing tests' output is
# printed again at the very end (the last 80 lines of each), with the CPU and the variant, so the
# tail of a CI log says why, not only which.
run_suite() {
  local name=$1 dir=$2
  shift 2
  local rc=0
  (cd "$dir" && env "$@" ctest --output-on-failure -j2 --timeout 600) 2>&1 |
    tee "$dir/ctest-output.log" || rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && return 0
  echo "[test] $name FAILED (ctest exit $rc) on$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
  awk '/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: / {
         flush(); on = /\*\*\*/ && !/\*\*\*(Skipped|Not Run)/; head = $0; n = 0; next
       }
       /^ *Start +[0-9]+: / { flush() }
       on { buf[n++] = $0 }
       function flush(  i) {
         if (on) { print head; for (i = (n > 80 ? n - 80 : 0); i < n; ++i) print buf[i] }
         on = 0
       }
       END { flush() }' "$dir/ctest-output.log"
  echo "[test] $name FAILED: $(tr '\n' ' ' < "$dir/Testing/Temporary/LastTestsFailed.log")"
  exit "$rc"
}

echo "[test] native ISA: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
run_suite "native" build

# The ISA variants: -march level, the oneDNN ISA cap (DNNL_MAX_CPU_ISA), the CPU flags needed.
variants=(
  "x86-64-v4 AVX512_CORE avx512f avx512bw avx512cd avx512dq avx512vl"
  "x86-64-v3 AVX2 avx2 fma bmi1 bmi2 f16c movbe"
)
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
for v in "${variants[@]}"; do
  read -r arch dnnl_isa needed <<< "$v"
  runnable=1
  for f in $needed; do [[ "$cpu_flags" == *" $f "* ]] || runnable=0; done
  if [ "$runnable" -eq 0 ]; then
    echo "[test] ISA variant $arch: NOT RUN (this CPU lacks one of: $needed)"
    continue
  fi
  echo "[test] ISA variant $arch (oneDNN capped at $dnnl_isa)"
  cmake -S . -B "build-$arch" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOECORE_ARCH="$arch" \
    > "build-$arch.log" 2>&1 || { cat "build-$arch.log"; exit 1; }
  cmake --build "build-$arch" -j"$(nproc)"
  run_suite "ISA variant $arch" "build-$arch" DNNL_MAX_CPU_ISA="$dnnl_isa"
done

if command -v nvcc > /dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  # Everything, tests included, so the CUDA configuration's code (MOECORE_HAVE_CUDA branches,
  # the CUDA context) compiles and links wherever nvcc is; the tests run on a GPU machine.
  echo "[test] CUDA build check: the CUDA configuration with its tests (compile and link only)"
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOECORE_CUDA=ON \
    -DMOECORE_TESTS=ON -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" \
    > build-cuda.log 2>&1 || { cat build-cuda.log; exit 1; }
  cmake --build build-cuda -j"$(nproc)"
fi
