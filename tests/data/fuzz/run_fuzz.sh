#!/usr/bin/env bash
# Builds the .idx fuzz target with clang's libFuzzer (ASan + UBSan) and runs it for SECONDS
# from a seed corpus of valid indices. Without a clang that links -fsanitize=fuzzer it prints
# "[fuzz] skipped" (ctest reports the entry as skipped).
# Usage: run_fuzz.sh CLANGXX SOURCE_DIR BUILD_DIR SECONDS
set -euo pipefail
cxx="${1:-}"; src="$2"; build="$3"; seconds="${4:-5}"
out="$build/fuzz"
mkdir -p "$out"
if [ -z "$cxx" ] || ! command -v "$cxx" > /dev/null 2>&1; then
  echo "[fuzz] skipped: no clang++ found (install clang for libFuzzer)"; exit 0
fi
probe="$out/probe.cpp"
printf '#include <cstddef>\n#include <cstdint>\nextern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n' > "$probe"
if ! "$cxx" -fsanitize=fuzzer "$probe" -o "$out/probe" > /dev/null 2>&1; then
  echo "[fuzz] skipped: $cxx cannot link -fsanitize=fuzzer (install libFuzzer: clang's compiler-rt)"; exit 0
fi
sources=("$src/tests/data/fuzz/fuzz_index.cpp" "$src/src/data/indexed_dataset.cpp"
         "$src/src/data/mapped_file.cpp" "$src/src/core/check.cpp")
bin="$out/fuzz_index"
rebuild=0
[ -x "$bin" ] || rebuild=1
for s in "${sources[@]}" "$src/src/data/indexed_dataset.h"; do [ "$s" -nt "$bin" ] && rebuild=1; done
if [ "$rebuild" = 1 ]; then
  "$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I "$src/src" "${sources[@]}" -lfmt -o "$bin"
fi
corpus="$out/corpus"
mkdir -p "$corpus"
cp -f "$src"/tests/fixtures/data/*.idx "$corpus"/
"$bin" -max_total_time="$seconds" -max_len=4096 -print_final_stats=1 "$corpus" 2>&1 | tail -n 15
echo "[fuzz] ran ${seconds}s without a crash"
