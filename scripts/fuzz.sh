#!/usr/bin/env bash
# Fuzzes every parser of untrusted input (tests/fuzz/fuzz_*.cpp) with clang's libFuzzer under
# AddressSanitizer + UndefinedBehaviorSanitizer: builds the targets into build-fuzz/
# (incrementally), replays every committed crash input (tests/fuzz/regressions/<target>/), then
# runs each target for SECONDS from its committed seeds (tests/fuzz/corpus/<target>/) plus the
# corpus earlier runs grew (build-fuzz/corpus/<target>/). Prints per target the executions,
# the coverage and the findings; exits non-zero on any finding (crash, sanitizer report, an
# exception other than moecore::Error, a violated property, leak, timeout, out-of-memory), the
# input saved under build-fuzz/findings/<target>/.
#
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET]   (default 180; 0: build and replay only)
# Environment:
#   MOECORE_REQUIRE_FUZZ=1     no clang++ / libFuzzer / cmake is an error (default: "[fuzz]
#                              skipped: ..." and exit 0)
#   MOECORE_FUZZ_TARGETS="a b" only these targets (names as in tests/fuzz/fuzz_<name>.cpp)
#   MOECORE_FUZZ_CXX           the clang++ to use (default: the first of clang++, clang++-19..14)
#   MOECORE_FUZZ_BUILD         the build directory (default: build-fuzz)
#   MOECORE_FUZZ_TIMEOUT       seconds one input may take before it is a finding (default 20)
# Needs clang++ with libFuzzer (Debian: clang and libclang-rt-14-dev, or the same for another
# LLVM version), cmake, and the project's headers (libfmt-dev, nlohmann-json3-dev,
# libtomlplusplus-dev, libssl-dev). On a shared machine: nice scripts/fuzz.sh 120
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
seconds="${1:-180}"
build="${MOECORE_FUZZ_BUILD:-build-fuzz}"
timeout_s="${MOECORE_FUZZ_TIMEOUT:-20}"
case "$seconds" in '' | *[!0-9]*) echo "[fuzz] SECONDS_PER_TARGET must be a whole number, got '$seconds'" >&2; exit 2 ;; esac

unavailable() {
  if [ "${MOECORE_REQUIRE_FUZZ:-0}" = 1 ]; then
    echo "[fuzz] FAILED: $1 (MOECORE_REQUIRE_FUZZ=1)" >&2
    exit 1
  fi
  echo "[fuzz] skipped: $1"
  exit 0
}

cxx="${MOECORE_FUZZ_CXX:-}"
if [ -z "$cxx" ]; then
  for c in clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15 clang++-14; do
    if command -v "$c" > /dev/null 2>&1; then cxx=$c; break; fi
  done
fi
[ -n "$cxx" ] && command -v "$cxx" > /dev/null 2>&1 ||
  unavailable "no clang++ found (Debian: apt-get install clang libclang-rt-14-dev)"
command -v cmake > /dev/null 2>&1 || unavailable "no cmake found"
mkdir -p "$build"
probe="$build/probe.cpp"
printf '#include <cstddef>\n#include <cstdint>\nextern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n' > "$probe"
if ! "$cxx" -fsanitize=fuzzer,address,undefined "$probe" -o "$build/probe" > "$build/probe.log" 2>&1; then
  unavailable "$cxx cannot link -fsanitize=fuzzer,address,undefined (libFuzzer is in compiler-rt; Debian: apt-get install libclang-rt-14-dev): $(tail -n 1 "$build/probe.log")"
fi

# Build (incremental: cmake and ninja/make redo only what changed).
if [ ! -f "$build/CMakeCache.txt" ]; then
  generator=()
  command -v ninja > /dev/null 2>&1 && generator=(-G Ninja)
  launcher=()
  command -v ccache > /dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  if ! cmake -S tests/fuzz -B "$build" "${generator[@]}" -DCMAKE_CXX_COMPILER="$cxx" \
      "${launcher[@]}" > "$build/configure.log" 2>&1; then
    cat "$build/configure.log"
    echo "[fuzz] FAILED: configuring tests/fuzz (log: $build/configure.log)" >&2
    exit 1
  fi
fi
# ccache (when the configure found it): paths relative to the checkout and, with -g, the working
# directory left out of the hash, so that another clone's objects serve this one.
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
echo "[fuzz] building the targets in $build with $cxx (ASan + UBSan, -O1 -g)"
if ! cmake --build "$build" -j"$(nproc)" > "$build/build.log" 2>&1; then
  tail -n 60 "$build/build.log"
  echo "[fuzz] FAILED: building the fuzz targets (log: $build/build.log)" >&2
  exit 1
fi

targets=()
if [ -n "${MOECORE_FUZZ_TARGETS:-}" ]; then
  read -r -a targets <<< "$MOECORE_FUZZ_TARGETS"
else
  for f in tests/fuzz/fuzz_*.cpp; do t=${f##*/fuzz_}; targets+=("${t%.cpp}"); done
fi
for t in "${targets[@]}"; do
  [ -x "$build/fuzz_$t" ] || { echo "[fuzz] FAILED: no target '$t' ($build/fuzz_$t)" >&2; exit 2; }
done

mkdir -p "$build/logs"
status=0
findings=()

# The sanitizer's or libFuzzer's report in a log, and the input it saved.
report() {
  local t=$1 log=$2
  grep -E -m 6 "ERROR: |SUMMARY: |runtime error|Assertion|property violated|terminate called|what\(\): |ALARM|out-of-memory|leak" "$log" | sed 's/^/    /'
  # The first frames in moecore's code (src/, tests/fuzz/), not libFuzzer's or libc's.
  grep -E "^ *#[0-9]+ 0x[0-9a-f]+ in .*(/src/|/tests/fuzz/)" "$log" | head -n 6 | sed -E 's/^ *(#[0-9]+) 0x[0-9a-f]+ in /      \1 /'
  local input
  input=$(grep -o -E "(Test unit written to|Running:) [^ ]+" "$log" | tail -n 1 | awk '{print $NF}')
  [ -n "$input" ] && echo "    input: $input   (replay: $build/fuzz_$t $input; full log: $log)"
  findings+=("$t: ${input:-see $log}")
}

# 1. The committed crash inputs: each must now be handled.
for t in "${targets[@]}"; do
  dir="tests/fuzz/regressions/$t"
  inputs=()
  [ -d "$dir" ] && while IFS= read -r f; do inputs+=("$f"); done < <(find "$dir" -type f ! -name '*.md' | sort)
  [ "${#inputs[@]}" -eq 0 ] && continue
  log="$build/logs/$t.replay.log"
  if "$build/fuzz_$t" -timeout="$timeout_s" -rss_limit_mb=2048 -malloc_limit_mb=256 "${inputs[@]}" > "$log" 2>&1; then
    echo "[fuzz] $t: ${#inputs[@]} regression input(s) replayed, none fails"
  else
    echo "[fuzz] $t: FINDING replaying $dir"
    report "$t" "$log"
    status=1
  fi
done

# 2. Fuzzing.
if [ "$seconds" -gt 0 ]; then
  echo "[fuzz] fuzzing ${#targets[@]} target(s) for ${seconds}s each"
  for t in "${targets[@]}"; do
    corpus="$build/corpus/$t" artifacts="$build/findings/$t/" log="$build/logs/$t.log"
    mkdir -p "$corpus" "$artifacts"
    seeds=()
    [ -d "tests/fuzz/corpus/$t" ] && seeds=("tests/fuzz/corpus/$t")
    dict=()
    [ -f "tests/fuzz/$t.dict" ] && dict=(-dict="tests/fuzz/$t.dict")
    "$build/fuzz_$t" -max_total_time="$seconds" -print_final_stats=1 -timeout="$timeout_s" \
      -rss_limit_mb=2048 -malloc_limit_mb=256 -artifact_prefix="$artifacts" "${dict[@]}" \
      "$corpus" "${seeds[@]}" > "$log" 2>&1
    rc=$?
    execs=$(grep -o -E "stat::number_of_executed_units: [0-9]+" "$log" | awk '{print $2}' | tail -n 1)
    cov_line=$(grep -E "^#[0-9]+.*cov: [0-9]+" "$log" | tail -n 1)
    cov=$(grep -o -E "cov: [0-9]+" <<< "$cov_line" | awk '{print $2}')
    ft=$(grep -o -E "ft: [0-9]+" <<< "$cov_line" | awk '{print $2}')
    corp=$(grep -o -E "corp: [0-9]+" <<< "$cov_line" | awk '{print $2}')
    if [ -z "$execs" ]; then  # stopped before the final stats: the last status line's count
      execs=$(grep -o -E "^#[0-9]+" <<< "$cov_line" | tr -d '#')
    fi
    summary="${execs:-?} executions, coverage ${cov:-?} edges (${ft:-?} features), corpus ${corp:-?} inputs"
    if [ "$rc" -eq 0 ]; then
      echo "[fuzz] $t: $summary, findings: none"
    else
      echo "[fuzz] $t: $summary, FINDING (exit $rc)"
      report "$t" "$log"
      status=1
    fi
  done
fi

if [ "$status" -ne 0 ]; then
  echo "[fuzz] FAILED: ${#findings[@]} finding(s):"
  printf '  %s\n' "${findings[@]}"
  echo "[fuzz] fix the parser (a moecore::Error naming the fault), then commit the input to tests/fuzz/regressions/<target>/"
  exit 1
fi
echo "[fuzz] ok: ${#targets[@]} target(s), no findings"
