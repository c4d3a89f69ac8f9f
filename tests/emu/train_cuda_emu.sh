#!/usr/bin/env bash
# `moecore train --device cuda` in the emulated CUDA build (docs/testing.md, "The emulated CUDA
# build"): the tiny model for a few steps on the emulated device, with device memory kept apart
# from the host (strict: a host access of device memory or a host pointer handed to a kernel
# fails the run), against the same binary's `--device cpu` run in the same layout:
# - the CUDA run twice (the second under --sync-audit, which must find no allocation and no
#   undocumented host sync in a step, and count only documented points): bitwise the same
#   per-step values and weights digest;
# - CUDA vs CPU: per-step lm loss and grad norm within docs/numerics.md's row "emulated CUDA vs
#   CPU backend" (the kernels' device math and reduction trees vs the CPU fast paths).
# Under --np N every run is `mpirun -np N` (the emulated NCCL carries the device's collectives,
# MPI the host's); --record FILE keeps the CUDA run's per-step values and digest, --equal-to FILE
# requires them bitwise equal to a recorded run's (an overlapped form against its plain one);
# --sync-free requires the audited steps to count no host sync at all, not even a documented
# point ("counted in the last step: nothing": the grouped GEMMs from device tables, no count
# exchange; docs/gpu.md, "GEMMs on CUDA"); --host-tables runs the CUDA run once more with
# MOECORE_GROUPED_GEMM=host (the grouped GEMMs from sizes read on the host) and requires it
# bitwise the same (the emulated build interprets both paths' problems alike).
# Usage: train_cuda_emu.sh [--np N] [--record FILE] [--equal-to FILE] [--sync-free]
#        [--host-tables] MOECORE_BINARY CONFIG [FLAGS...]   (extra flags for both devices)
set -euo pipefail
np=1 record="" equal_to="" sync_free=0 host_tables=0
while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in
    --np) np=$2 ;;
    --record) record=$2 ;;
    --equal-to) equal_to=$2 ;;
    --sync-free) sync_free=1; shift; continue ;;
    --host-tables) host_tables=1; shift; continue ;;
    *) echo "train_cuda_emu.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
moecore=$1 config=$2
shift 2
# $work, fail, digest (steps below: in a fixed order, the rows read them by position).
source "$(dirname "${BASH_SOURCE[0]}")/../train/lib.sh"
# Each logged step's "iteration", "lm_loss" and "grad_norm", in that order (the rows depend on
# the step).
steps() {
  awk '/"iteration"/ { out = ""
         n = split("iteration lm_loss grad_norm", k, " ")
         for (i = 1; i <= n; ++i)
           if (match($0, "\"" k[i] "\":[^,}]*")) out = out (out == "" ? "" : " ") substr($0, RSTART, RLENGTH)
         print out }' "$1" | paste -sd' '
}
# The rows "emulated CUDA vs CPU backend" of docs/numerics.md: f32 at every step; --bf16 at step 1
# (the same weights: an f32 difference of an ulp flips a bf16 rounding of an activation, 2^-8 of
# that element, now and then) and at the later steps (after updates: Adam's first normalised steps
# turn gradients that differ near zero into whole learning-rate steps, and the flips compound).
# With --fp32-matmul-precision high the CUDA run's f32 GEMMs take TF32 products and the CPU's do
# not (the flag is a no-op there): the row "--device cuda f32 training with TF32 vs without",
# which also asks the difference to exceed the f32 row (TF32 really ran).
loss_rtol=1e-5 norm_rtol=1e-5 later_loss_rtol=1e-5 later_norm_rtol=1e-5
tf32=0 prev=""
for flag in "$@"; do
  [ "$flag" = --bf16 ] && loss_rtol=1e-6 norm_rtol=2e-5 later_loss_rtol=1e-4 later_norm_rtol=2e-3
  [ "$prev" = --fp32-matmul-precision ] && [ "$flag" = high ] && tf32=1
  prev=$flag
done
if [ "$tf32" = 1 ]; then
  loss_rtol=1e-5 norm_rtol=2e-4 later_loss_rtol=2e-4 later_norm_rtol=5e-3
fi
common=(--config "$config" --train-iters 3 --lr-warmup-iters 0 --lr-decay-iters 20
        --micro-batch-size 2 --global-batch-size 4 --log-interval 1 --peak-tflops 100 "$@")
launch=()
if [ "$np" -gt 1 ]; then
  # Open MPI's session directories inside this run's own: no other test's mpirun shares them.
  export OMPI_MCA_orte_tmpdir_base="$work" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  launch=(mpirun --oversubscribe --allow-run-as-root -np "$np" -x OMP_NUM_THREADS
          -x MOECORE_EMU_DEVICE_MEMORY -x MOECORE_GROUPED_GEMM)
fi
run() {  # DEVICE NAME [FLAGS...]
  local device=$1 name=$2
  shift 2
  MOECORE_EMU_DEVICE_MEMORY=strict MOECORE_GROUPED_GEMM=${MOECORE_GROUPED_GEMM:-auto} \
    OMP_NUM_THREADS=1 "${launch[@]}" "$moecore" train \
    "${common[@]}" --device "$device" --metrics-file "$work/$name.jsonl" "$@" 2>&1
}
cpu=$(run cpu cpu) || fail "the --device cpu run failed" "$cpu"
start=$(date +%s.%N)
cuda=$(run cuda cuda1) || fail "the --device cuda run failed" "$cuda"
seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
# The second under --sync-audit: no allocation and no host sync but the documented points in a
# step (the emulator's own work is the device's, not counted), and the same bits as without it.
cuda2=$(run cuda cuda2 --sync-audit) || fail "the second --device cuda run (--sync-audit) failed" "$cuda2"
grep -q '\[sync-audit\] steps 2-3 audited: 0 allocations, 0 undocumented host syncs' <<< "$cuda2" ||
  fail "--sync-audit on --device cuda: no clean audit line" "$cuda2"
# Only the documented points (docs/design.md, "The execution model"): the EP count exchanges and
# the grouped GEMMs' size reads; a collective completed on the host for a stream's ops
# (SyncAudit::kHostCommWait) would be MPI moving device memory.
counted=$(grep -o 'counted in the last step: .*' <<< "$cuda2" | sed 's/^counted in the last step: //')
while IFS= read -r point; do
  [ -z "$point" ] || [ "$point" = nothing ] && continue
  case "${point% x*}" in
    "dropless EP count exchange (the host sizes the all-to-all)" | \
    "allgather dispatcher token counts per EP rank" | \
    "grouped GEMM group sizes read on the host"*) ;;
    *) fail "--sync-audit on --device cuda counted an undocumented point: $point" "$cuda2" ;;
  esac
done < <(tr ';' '\n' <<< "$counted" | sed 's/^ *//')
if [ "$sync_free" = 1 ] && [ "$counted" != nothing ]; then
  fail "--sync-free: the audited --device cuda steps counted host syncs: $counted" "$cuda2"
fi
grep -q '"iteration":3' "$work/cuda1.jsonl" || fail "the --device cuda run logged no step 3" "$cuda"
# The start-up line of the f32 GEMMs' arithmetic: TF32 on or off on CUDA, the notice on the CPU.
if [ "$tf32" = 1 ]; then
  grep -q '^\[gemm\] f32 GEMMs: TF32 on ' <<< "$cuda" || fail "--device cuda: no 'TF32 on' line" "$cuda"
  grep -q '^\[gemm\] f32 GEMMs: TF32 off (--fp32-matmul-precision high changes nothing' <<< "$cpu" ||
    fail "--device cpu with --fp32-matmul-precision high: no notice" "$cpu"
else
  grep -q '^\[gemm\] f32 GEMMs: TF32 off ' <<< "$cuda" || fail "--device cuda: no 'TF32 off' line" "$cuda"
fi
[ "$(steps "$work/cuda1.jsonl")" = "$(steps "$work/cuda2.jsonl")" ] ||
  fail "two --device cuda runs differ: $(steps "$work/cuda1.jsonl") vs $(steps "$work/cuda2.jsonl")"
[ -n "$(digest "$cuda")" ] && [ "$(digest "$cuda")" = "$(digest "$cuda2")" ] ||
  fail "two --device cuda runs end with other weights: $(digest "$cuda") vs $(digest "$cuda2")"
if [ "$host_tables" = 1 ]; then
  host=$(MOECORE_GROUPED_GEMM=host run cuda cuda_host) ||
    fail "the --device cuda run with MOECORE_GROUPED_GEMM=host failed" "$host"
  grep -q '\[gemm\] grouped GEMMs (.*): host tables' <<< "$host" ||
    fail "MOECORE_GROUPED_GEMM=host: the start-up line names no host tables" "$host"
  grep -q '\[gemm\] grouped GEMMs (.*): device tables' <<< "$cuda" ||
    fail "the --device cuda run's start-up line names no device tables" "$cuda"
  [ "$(steps "$work/cuda1.jsonl")" = "$(steps "$work/cuda_host.jsonl")" ] &&
    [ "$(digest "$cuda")" = "$(digest "$host")" ] ||
    fail "the grouped GEMMs' device tables and host tables differ: $(steps "$work/cuda1.jsonl") $(digest "$cuda") vs $(steps "$work/cuda_host.jsonl") $(digest "$host")"
fi
# Per step: |cuda - cpu| <= rtol |cpu| for the lm loss and the grad norm; prints the worst ratios.
paste <(steps "$work/cpu.jsonl" | tr ' ' '\n') <(steps "$work/cuda1.jsonl" | tr ' ' '\n') |
  awk -v lr="$loss_rtol" -v nr="$norm_rtol" -v llr="$later_loss_rtol" -v lnr="$later_norm_rtol" -v tf32="$tf32" -F'\t' '
    { split($1, a, ":"); split($2, b, ":"); key = a[1]; x = a[2] + 0; y = b[2] + 0
      if (key != b[1]) { print "FAIL: the runs log other keys: " $1 " vs " $2; bad = 1; next }
      if (key ~ /iteration/) { it = x; if (x != y) { print "FAIL: iterations " x " vs " y; bad = 1 }; next }
      r = (x == 0) ? (y == 0 ? 0 : 1) : (y - x) / x; if (r < 0) r = -r
      tol = (key ~ /lm_loss/) ? (it == 1 ? lr : llr) : (it == 1 ? nr : lnr)
      if (key ~ /lm_loss/ && r > wl) wl = r
      if (key ~ /grad_norm/ && r > wn) wn = r
      if (r > tol) { printf "FAIL: iteration %d %s: cpu %s, cuda %s: relative %.3g > %s\n", it, key, x, y, r, tol; bad = 1 } }
    END { printf "[train-cuda-emu] cuda vs cpu, worst relative difference: lm loss %.3g (rows %s at step 1, %s later), grad norm %.3g (rows %s, %s)\n", wl, lr, llr, wn, nr, lnr
          if (tf32 && wl <= 1e-5 && wn <= 1e-5) { printf "FAIL: --fp32-matmul-precision high: cuda within the f32 row of cpu (lm %.3g, grad norm %.3g <= 1e-5): TF32 did not run\n", wl, wn; bad = 1 }
          exit bad }'
if [ -n "$record" ]; then
  printf '%s\n%s\n' "$(steps "$work/cuda1.jsonl")" "$(digest "$cuda")" > "$record"
fi
if [ -n "$equal_to" ]; then
  [ "$(printf '%s\n%s' "$(steps "$work/cuda1.jsonl")" "$(digest "$cuda")")" = "$(cat "$equal_to")" ] ||
    fail "not bitwise the recorded run: $(steps "$work/cuda1.jsonl") $(digest "$cuda") vs $(tr '\n' ' ' < "$equal_to")"
fi
echo "[train-cuda-emu] --device cuda (emulated$( [ "$np" -gt 1 ] && echo ", $np processes")): 3 steps in ${seconds} s, bitwise the same twice$( [ "$host_tables" = 1 ] && echo " and with the grouped GEMMs' host tables") (digest $(digest "$cuda")); $(grep -o 'counted in the last step: .*' <<< "$cuda2")"
