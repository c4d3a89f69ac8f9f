# Sourced by scripts/test.sh and .ci/run: named, timed phases and their table.
#   phase NAME CMD...   runs CMD, records NAME, its seconds and its outcome in $MOECORE_PHASES
#   print_phases        the table of every phase recorded so far, with the total
# The file is shared by the scripts of one run (.ci/run sets it, scripts/test.sh inherits it), so
# the table at the end of a CI log covers the whole run, phase by phase.
phase() {
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "[phase] $name"
  "$@" || rc=$?
  local outcome=ok
  [ "$rc" -eq 0 ] || outcome="FAILED (exit $rc)"
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - t0))" "$outcome" >> "$MOECORE_PHASES"
  return "$rc"
}

print_phases() {
  [ -s "$MOECORE_PHASES" ] || return 0
  echo "[phases] $(grep -c . "$MOECORE_PHASES") phases on $(nproc) cores,$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
  awk -F'\t' '{ printf "  %-58s %5d s  %4.1f min  %s\n", $1, $2, $2 / 60, $3; total += $2 }
              END { printf "  %-58s %5d s  %4.1f min\n", "total", total, total / 60 }' "$MOECORE_PHASES"
}

# The phase file of this run: the caller's, or a new one that this shell prints when it exits.
if [ -z "${MOECORE_PHASES:-}" ]; then
  MOECORE_PHASES=$(mktemp "${TMPDIR:-/tmp}/moecore-phases.XXXXXX")
  export MOECORE_PHASES
  trap 'print_phases; rm -f "$MOECORE_PHASES"' EXIT
fi
