#!/usr/bin/env bash
# The GPU check (docs/gpu.md): runs on the GPU machine from the unpacked archive of
# scripts/gpu_pack.sh (bin/, lib/, configs/, bench/, tools/ beside this script):
#   tar xJf moecore-gpu.tar.xz -C /tmp && OUT=/some/dir bash /tmp/moecore-gpu/gpu_check.sh
# Stages, each with a hard time limit, each run even if an earlier one failed:
#   0 probe       GPU (nvidia-smi), OS, libraries ldd cannot find, cuDNN/cuBLAS/NCCL versions
#   1 harness     the backend harness's CUDA cases, twice: results and outputs digests compared;
#                 the NCCL communicator and the device-table grouped GEMM's own tests
#   2 sanitizer   compute-sanitizer memcheck and racecheck on the harness's CUDA cases
#   3 tiny model  3 training steps on --device cpu and --device cuda, final loss and digest
#   4 benchmarks  bench-small's step on --device cuda beside the PyTorch reference, the bench_*
# A stage whose prerequisites are missing says NOT RUN and why. Logs go to $OUT (one file per
# stage and summary.txt: at most 8 files); the table of stages is printed last. The whole run is
# bounded by 7 minutes (MOECORE_GPU_CHECK_BUDGET seconds). MOECORE_GPU_CHECK_STAGES="0 3" runs
# those stages only (to rerun one after a fix). Exit status: 1 if a stage failed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$here/out}
mkdir -p "$OUT"
budget=${MOECORE_GPU_CHECK_BUDGET:-420}
t_start=$SECONDS
bin=$here/bin

# The Python environment's NVIDIA libraries (cuBLAS, cuDNN, NCCL, ...) then ours, for our binaries
# only: PyTorch keeps its own library path.
py=$(command -v python3 || true)
nvidia_libs=""
if [ -n "$py" ]; then
  nvidia_libs=$(timeout 20 "$py" - << 'EOF' 2> /dev/null
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
dirs = []
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        if d not in dirs:
            dirs.append(d)
print(":".join(dirs))
EOF
  ) || nvidia_libs=""
fi
libpath=$here/lib${nvidia_libs:+:$nvidia_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
run_ours() { LD_LIBRARY_PATH=$libpath "$@"; }

rows=()       # stage|status|seconds|key number
gpu_ok=0
gpu_why="stage 0 found no GPU"

# stage NAME LIMIT FUNCTION: runs FUNCTION with at most LIMIT seconds (less when the budget is
# nearly spent), its output into $OUT/NAME.log. FUNCTION sets status and key; a timeout is FAILED.
stage() {
  local name=$1 limit=$2 fn=$3 t0=$SECONDS
  local left=$((budget - (SECONDS - t_start) - 5))
  status="" key=""
  if [ -n "${MOECORE_GPU_CHECK_STAGES:-}" ] && [[ " $MOECORE_GPU_CHECK_STAGES " != *" ${name%%_*} "* ]]; then
    rows+=("$name|NOT RUN|0|not selected (MOECORE_GPU_CHECK_STAGES=$MOECORE_GPU_CHECK_STAGES)")
    return
  fi
  if [ "$left" -lt 10 ]; then
    rows+=("$name|NOT RUN|0|the 7-minute budget is spent")
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  stage_deadline=$((SECONDS + limit))
  echo "[gpu-check] $name (at most $limit s)"
  "$fn" > "$OUT/$name.log" 2>&1
  [ -n "$status" ] || status=FAILED
  rows+=("$name|$status|$((SECONDS - t0))|$key")
  echo "[gpu-check] $name: $status${key:+ ($key)}"
}
# limited SECONDS CMD...: CMD with a hard limit, never past the stage's deadline.
limited() {
  local s=$1
  shift
  local left=$((stage_deadline - SECONDS))
  [ "$s" -gt "$left" ] && s=$left
  [ "$s" -lt 1 ] && { echo "[gpu-check] no time left in this stage for: $*" >&2; return 124; }
  echo "+ (limit ${s}s) $*" >&2
  timeout -k 5 "$s" "$@"
  local rc=$?
  [ "$rc" -eq 124 ] && echo "[gpu-check] TIMEOUT after ${s}s: $*" >&2
  return "$rc"
}

probe() {
  echo "== OS"
  grep -s PRETTY_NAME /etc/os-release
  uname -srm
  ldd --version 2>&1 | head -n 1
  echo "== pack"
  cat "$here/MANIFEST" 2> /dev/null || echo "(no MANIFEST)"
  echo "== library path of our binaries: $libpath"
  echo "== GPU"
  local gpu=""
  if ! command -v nvidia-smi > /dev/null 2>&1; then
    gpu_why="no nvidia-smi: no NVIDIA driver on this machine"
  else
    gpu=$(limited 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)
    local rc=$?
    echo "$gpu"
    if [ "$rc" -ne 0 ] || [ -z "$gpu" ]; then
      gpu_why="nvidia-smi found no GPU (exit $rc)"
      gpu=""
    fi
    limited 20 nvidia-smi 2>&1 | head -n 20
  fi
  echo "== libraries ldd cannot find"
  local missing
  missing=$(for b in "$bin"/*; do run_ours ldd "$b" 2>&1 | grep 'not found' | sed "s|^|$(basename "$b"): |"; done)
  echo "${missing:-none}"
  echo "== NVIDIA libraries (pip wheels)"
  if [ -n "$nvidia_libs" ]; then echo "$nvidia_libs" | tr ":" "\n"; else echo "none found (python3: ${py:-missing})"; fi
  for d in ${nvidia_libs//:/ }; do ls "$d" 2> /dev/null | grep -E '^lib(cudnn|cublas|cublasLt|nccl|cudart)\.so' | sed "s|^|  $d/|"; done
  if [ -n "$py" ]; then
    limited 40 "$py" -c 'import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("cudnn", torch.backends.cudnn.version())
print("nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "n/a")
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))'
  fi
  echo "== moecore's view"
  run_ours limited 20 "$bin/moecore" train --config "$here/configs/tiny.toml" --train-iters 1 \
    --lr-warmup-iters 0 --device cuda 2>&1 | grep -iE 'cuda|device|error' | head -n 5
  local n_missing
  n_missing=$( [ -z "$missing" ] && echo 0 || echo "$missing" | grep -c .)
  if [ -n "$gpu" ] && [ "$n_missing" -eq 0 ]; then
    gpu_ok=1
    status=ok
    key=$(echo "$gpu" | head -n 1)
  else
    [ -n "$gpu" ] && gpu_ok=1
    status=FAILED
    key="${gpu:-$gpu_why}; $n_missing missing libraries"
  fi
  echo "== result: $status ($key)"
}

# The harness's CUDA cases: Backend/Ops.Run/cuda_<case>.
harness_filter='*/cuda_*'
results_of() {  # gtest's per-test results, sorted: "name OK|FAILED|SKIPPED"
  grep -E '^\[ +(OK|FAILED|SKIPPED) +\] [A-Za-z]' "$1" | sed -E 's/^\[ +([A-Z]+) +\] ([^ ]+).*/\2 \1/' | sort -u
}
harness() {
  local rc1 rc2
  run_ours limited 70 "$bin/test_backend" --gtest_filter="$harness_filter" > "$OUT/.run1" 2>&1; rc1=$?
  run_ours limited 70 "$bin/test_backend" --gtest_filter="$harness_filter" > "$OUT/.run2" 2>&1; rc2=$?
  cat "$OUT/.run1"
  echo "== second run"
  cat "$OUT/.run2"
  results_of "$OUT/.run1" > "$OUT/.res1"
  results_of "$OUT/.run2" > "$OUT/.res2"
  local ok failed skipped
  ok=$(grep -c ' OK$' "$OUT/.res1")
  failed=$(grep -c ' FAILED$' "$OUT/.res1")
  skipped=$(grep -c ' SKIPPED$' "$OUT/.res1")
  echo "== the two runs' results"
  if diff "$OUT/.res1" "$OUT/.res2"; then echo "the same"; else echo "they differ (above)"; fi
  # Each case's outputs digest (every buffer the case read back): bitwise run to run.
  grep -E '^\[outputs\] ' "$OUT/.run1" | sort > "$OUT/.dig1" || true
  grep -E '^\[outputs\] ' "$OUT/.run2" | sort > "$OUT/.dig2" || true
  echo "== the two runs' outputs digests ($(wc -l < "$OUT/.dig1") cases)"
  if diff "$OUT/.dig1" "$OUT/.dig2"; then echo "bitwise the same"; else echo "they differ (above)"; fi
  key="$ok passed, $failed failed, $skipped not run"
  if [ "$rc1" -ne 0 ] || [ "$rc2" -ne 0 ] || ! cmp -s "$OUT/.res1" "$OUT/.res2" ||
    ! cmp -s "$OUT/.dig1" "$OUT/.dig2"; then
    status=FAILED
    cmp -s "$OUT/.res1" "$OUT/.res2" || key="$key; the two runs differ"
    cmp -s "$OUT/.dig1" "$OUT/.dig2" || key="$key; outputs not bitwise run to run"
  elif [ "$ok" -eq 0 ]; then
    status="NOT RUN"
    key="no CUDA case ran ($skipped skipped: $(grep -m1 -o 'not run: .*' "$OUT/.run1" | cut -c1-80))"
  else
    status=ok
  fi
  # The NCCL communicator as one rank (tests/cuda/test_nccl.cpp), where the pack has it.
  if [ -x "$bin/test_nccl" ]; then
    local rc3 nccl_ok
    run_ours limited 40 "$bin/test_nccl" > "$OUT/.nccl" 2>&1; rc3=$?
    echo "== the NCCL communicator, one rank"
    cat "$OUT/.nccl"
    nccl_ok=$(results_of "$OUT/.nccl" | grep -c ' OK$')
    key="$key; NCCL one rank: $nccl_ok passed"
    [ "$rc3" -eq 0 ] || { status=FAILED; key="$key (test_nccl failed)"; }
    rm -f "$OUT/.nccl"
  fi
  # The device-table grouped GEMM (CUTLASS sm_90a) against its reference, where the pack has it.
  if [ -x "$bin/test_grouped_gemm_device" ]; then
    local rc4 gg_ok
    run_ours limited 40 "$bin/test_grouped_gemm_device" > "$OUT/.gg" 2>&1; rc4=$?
    echo "== the device-table grouped GEMM (CUTLASS)"
    cat "$OUT/.gg"
    gg_ok=$(results_of "$OUT/.gg" | grep -c ' OK$')
    key="$key; device grouped GEMM: $gg_ok passed"
    [ "$rc4" -eq 0 ] || { status=FAILED; key="$key (test_grouped_gemm_device failed)"; }
    rm -f "$OUT/.gg"
  fi
  rm -f "$OUT/.run1" "$OUT/.run2" "$OUT/.res1" "$OUT/.res2" "$OUT/.dig1" "$OUT/.dig2"
}

sanitizer() {
  local cs
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null || true)
  if [ -z "$cs" ]; then status="NOT RUN"; key="no compute-sanitizer"; return; fi
  local errors=0 rc_all=0 tool
  for tool in memcheck racecheck; do
    echo "== $tool"
    run_ours limited 55 "$cs" --tool "$tool" --error-exitcode 3 \
      "$bin/test_backend" --gtest_filter="$harness_filter" > "$OUT/.cs" 2>&1
    local rc=$?
    cat "$OUT/.cs"
    local n
    n=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$OUT/.cs" | grep -oE '[0-9]+$' | tail -n 1)
    errors=$((errors + ${n:-0}))
    [ "$rc" -ne 0 ] && rc_all=$rc
  done
  rm -f "$OUT/.cs"
  key="$errors sanitizer errors (memcheck + racecheck)"
  [ "$rc_all" -eq 0 ] && status=ok || status=FAILED
}

tiny_model() {
  local dev loss_cpu="" loss_cuda="" digest_cpu="" digest_cuda="" rc_all=0
  for dev in cpu cuda; do
    echo "== --device $dev"
    run_ours limited 40 "$bin/moecore" train --config "$here/configs/tiny.toml" --train-iters 3 \
      --lr-warmup-iters 0 --device "$dev" > "$OUT/.tiny" 2>&1
    local rc=$?
    cat "$OUT/.tiny"
    [ "$rc" -ne 0 ] && rc_all=$rc
    local loss digest
    loss=$(grep -oE 'final lm loss [0-9.eE+-]+' "$OUT/.tiny" | awk '{ print $4 }')
    digest=$(grep -oE 'weights digest [0-9a-f]+' "$OUT/.tiny" | awk '{ print $3 }')
    if [ "$dev" = cpu ]; then loss_cpu=$loss digest_cpu=$digest; else loss_cuda=$loss digest_cuda=$digest; fi
  done
  rm -f "$OUT/.tiny"
  key="loss cpu ${loss_cpu:-?} cuda ${loss_cuda:-?}; digest $([ -n "$digest_cpu" ] && [ "$digest_cpu" = "$digest_cuda" ] && echo equal || echo "cpu ${digest_cpu:-?} cuda ${digest_cuda:-?}")"
  [ "$rc_all" -eq 0 ] && [ -n "$loss_cuda" ] && status=ok || status=FAILED
}

benchmarks() {
  local tps_ours="" tps_torch="" rc_all=0
  echo "== moecore, bench-small, --device cuda"
  run_ours limited 45 "$bin/moecore" train --config "$here/bench/small.toml" --train-iters 8 \
    --device cuda > "$OUT/.bench" 2>&1 || rc_all=$?
  cat "$OUT/.bench"
  tps_ours=$(grep -oE '^\[summary\] [0-9.]+ tokens/s' "$OUT/.bench" | awk '{ print $2 }')
  echo "== PyTorch reference (tools/bench_small_torch.py --device cuda)"
  if [ -n "$py" ]; then
    limited 45 "$py" "$here/tools/bench_small_torch.py" --device cuda --iters 8 > "$OUT/.bench" 2>&1 || rc_all=$?
    cat "$OUT/.bench"
    tps_torch=$(grep -oE '[0-9]+ tokens/s' "$OUT/.bench" | awk '{ print $1 }' | tail -n 1)
  else
    echo "NOT RUN: no python3"
  fi
  # The bench_* binaries measure the CPU backend (they take no --device yet): information only,
  # a timeout does not fail the stage.
  echo "== CPU-op benchmarks of the pack (bench_*: the CPU backend of this machine)"
  [ -x "$bin/bench_gemm" ] && run_ours limited 10 "$bin/bench_gemm" 0.1
  [ -x "$bin/bench_attention" ] && run_ours limited 10 "$bin/bench_attention" --seconds 0.2
  [ -x "$bin/bench_ops" ] && run_ours limited 10 "$bin/bench_ops" 0.05
  rm -f "$OUT/.bench"
  key="bench-small tokens/s: moecore cuda ${tps_ours:-?}, torch cuda ${tps_torch:-?}"
  [ "$rc_all" -eq 0 ] && [ -n "$tps_ours" ] && status=ok || status=FAILED
}

# needs_gpu FUNCTION: the stage's function, or NOT RUN when stage 0 found no usable GPU.
needs_gpu() {
  if [ "$gpu_ok" -ne 1 ]; then
    status="NOT RUN"
    key="no GPU: $gpu_why"
    echo "NOT RUN: $key"
    return
  fi
  "$1"
}
gpu_harness() { needs_gpu harness; }
gpu_sanitizer() { needs_gpu sanitizer; }
gpu_tiny_model() { needs_gpu tiny_model; }
gpu_benchmarks() { needs_gpu benchmarks; }

echo "[gpu-check] logs in $OUT, at most $budget s"
stage 0_probe 40 probe   # sets gpu_ok and gpu_why (a stage's function runs in this shell)
stage 1_harness 150 gpu_harness
stage 2_sanitizer 115 gpu_sanitizer
stage 3_tiny_model 60 gpu_tiny_model
stage 4_benchmarks 50 gpu_benchmarks

{
  echo "[gpu-check] $(date -u +%Y-%m-%dT%H:%MZ), $((SECONDS - t_start)) s in all; logs in $OUT"
  printf '  %-14s %-8s %5s  %s\n' stage status s "key number"
  for r in "${rows[@]}"; do
    IFS='|' read -r name st secs k <<< "$r"
    printf '  %-14s %-8s %5s  %s\n' "$name" "$st" "$secs" "${k:0:110}"
  done
} | tee "$OUT/summary.txt"
for r in "${rows[@]}"; do
  [[ "$r" == *"|FAILED|"* ]] && exit 1
done
exit 0
