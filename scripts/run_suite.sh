#!/usr/bin/env bash
# Runs ctest in a build directory: run_suite.sh NAME BUILD_DIR [CTEST ARGUMENTS...] (e.g. -L isa).
# Prints the slowest tests; on a failure, prints the failing tests' output again at the very end
# (the last 80 lines of each) with the CPU and NAME, so the tail of a CI log says why, not only
# which.
set -uo pipefail
name=$1 dir=$2
shift 2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# OpenMP threads that wait sleep rather than spin: on a loaded machine a spinning thread holds a
# core its partner needs (tests/CMakeLists.txt sets it for the threads2 entries too).
export OMP_WAIT_POLICY=PASSIVE
log=$dir/ctest-output.log
(cd "$dir" && ctest --output-on-failure -j2 --timeout 900 "$@") 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
echo "[test] $name: the slowest tests"
grep -E '^ *[0-9]+/[0-9]+ Test +#[0-9]+: ' "$log" |
  sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) .* ([0-9.]+) sec$/\2 \1/' | sort -rn | head -n 8 |
  awk '{ printf "  %7.1f s  %s\n", $1, $2 }'
[ "$rc" -eq 0 ] && exit 0
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
     END { flush() }' "$log"
echo "[test] $name FAILED: $(tr '\n' ' ' < "$dir/Testing/Temporary/LastTestsFailed.log" 2>/dev/null)"
exit "$rc"
