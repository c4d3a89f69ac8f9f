#!/usr/bin/env bash
# Compiler launcher of the CUDA sources (CMakeLists.txt): runs the compile command given as its
# arguments (ccache nvcc ... -o OBJECT ...) and keeps what it prints on stderr (ptxas -v: registers,
# stack frame and spills of every kernel) beside the object as OBJECT.ptxas.log, for
# scripts/sass_gate.sh; the output still reaches the build log. ccache replays a cached
# compile's stderr, so the file is rewritten on a cache hit too.
set -uo pipefail
obj=""
prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && obj=$a
  prev=$a
done
if [ -z "$obj" ]; then
  exec "$@"
fi
mkdir -p "$(dirname "$obj")"
"$@" 2> >(tee "$obj.ptxas.log.tmp" >&2)
rc=$?
wait
if [ "$rc" -eq 0 ]; then mv -f "$obj.ptxas.log.tmp" "$obj.ptxas.log"; else rm -f "$obj.ptxas.log.tmp"; fi
exit "$rc"
