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
#   4 benchmarks  the MoE layer's fwd + bwd at Megatron's perf-test shapes (bench_moe_layer:
#                 mixtral, deepseek) beside tools/moe_layer_torch.py (torchtitan's fast form,
#                 an eager loop) and the bf16 GEMM peaks; moe-1b's training step (eager, and
#                 --cuda-graph-impl full_iteration where the binary has it) with MFU against the
#                 measured peak, and in PyTorch; bench-small beside tools/bench_small_torch.py
# A stage whose prerequisites are missing says NOT RUN and why. Logs go to $OUT (one file per
# stage and summary.txt: at most 8 files); the table of stages is printed last. The whole run is
# bounded by MOECORE_GPU_CHECK_BUDGET seconds (default 470: under 8 minutes with the pack
# unpacked); each stage's limit is cut to what is left of it. MOECORE_GPU_CHECK_STAGES="0 3" runs
# those stages only (to rerun one after a fix). MOECORE_GPU_CHECK_DEVICE=cpu: stage 4 at CPU sizes
# (the dry run without a GPU, tests/gpu/test_gpu_pack.sh). Exit status: 1 if a stage failed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$here/out}
mkdir -p "$OUT"
budget=${MOECORE_GPU_CHECK_BUDGET:-470}
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
    rows+=("$name|NOT RUN|0|the budget of $budget s is spent")
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

# Stage 4 runs on --device cuda; MOECORE_GPU_CHECK_DEVICE=cpu is a dry run of the scripts on a
# machine without a GPU (tests/gpu/test_gpu_pack.sh): the small presets, a shrunken moe-1b model,
# so that every key number is produced and read.
bench_dev=${MOECORE_GPU_CHECK_DEVICE:-cuda}
# first_match FILE SED-EXPRESSION: the first line's capture (sed -n 's/.../\1/p'), or nothing.
first_match() { sed -n "$2" "$1" | head -n 1; }
# r1 X: a number to one decimal (for the table's key), anything else as it is; empty as "?".
r1() { awk -v x="${1:-?}" 'BEGIN { if (x ~ /^[0-9]+(\.[0-9]*)?$/) printf "%.1f", x; else printf "%s", x }'; }
# last_interval FILE 1|2: tokens/s (1) or MFU % (2) of moecore train's last logged iteration line.
last_interval() {
  sed -n 's/.*| tokens\/s: \([0-9.]*\) |.*| MFU: \([0-9.]*\)%.*/\1 \2/p' "$1" | tail -n 1 | cut -d' ' -f"$2"
}
# max_of A B: the larger of two numbers, either possibly empty.
max_of() { awk -v a="${1:-0}" -v b="${2:-0}" 'BEGIN { m = (a + 0 > b + 0) ? a : b; if (m + 0 > 0) print m }'; }

benchmarks() {
  local failed=() presets torch_presets one_b=() iters_1b=15 small=(--train-iters 8) p f
  local torch_iters=() small_torch_iters=8
  local -A ms=() peak=()
  if [ "$bench_dev" = cpu ]; then
    presets="small small-deepseek"
    one_b=(--num-layers 1 --hidden-size 64 --num-attention-heads 4 --kv-channels 16
      --num-query-groups 2 --moe-ffn-hidden-size 64 --vocab-size 256 --seq-length 64
      --max-position-embeddings 64)
    iters_1b=4
    torch_iters=(--iters 1 --warmup 0)
    small_torch_iters=2
    small=(--train-iters 3 --num-layers 1 --micro-batch-size 2 --global-batch-size 2)
  else
    presets="mixtral deepseek"
  fi
  torch_presets=${presets// /,}
  # 1. moecore's MoE layer (bench_moe_layer): fwd + bwd, its GEMM peak, per-kernel times beside
  #    the roofline (bench/RESULTS.md, "The MoE layer on an H100"), the phase breakdown.
  for p in $presets; do
    echo "== moecore's MoE layer: bench_moe_layer --device $bench_dev --bf16 --preset $p --kernels --predict"
    run_ours limited 60 "$bin/bench_moe_layer" --device "$bench_dev" --bf16 --preset "$p" \
      --kernels --predict > "$OUT/.bench" 2>&1 || failed+=("bench_moe_layer $p")
    cat "$OUT/.bench"
    ms[ours_$p]=$(first_match "$OUT/.bench" 's/^\[moe-layer\] moecore .* fwd+bwd \([0-9.]*\) ms.*/\1/p')
    peak[ours]=$(max_of "${peak[ours]:-}" "$(first_match "$OUT/.bench" 's/^\[gemm-peak\] moecore .*: \([0-9.]*\) TFLOP\/s.*/\1/p')")
    [ -n "${ms[ours_$p]}" ] || failed+=("no time from bench_moe_layer $p")
  done
  # 2. The same layer in PyTorch, torchtitan's fast form and an eager loop, after torch.matmul's
  #    bf16 GEMM peak (cuBLAS) in the same process.
  local torch_ok=0
  if [ -z "$py" ]; then
    echo "== PyTorch: NOT RUN: no python3"
  elif ! timeout 60 "$py" -c 'import torch' > /dev/null 2>&1; then
    echo "== PyTorch: NOT RUN: python3 has no torch"
  else
    torch_ok=1
    echo "== PyTorch's MoE layer: tools/moe_layer_torch.py --device $bench_dev --preset $torch_presets"
    limited 100 "$py" "$here/tools/moe_layer_torch.py" --device "$bench_dev" \
      --preset "$torch_presets" --forms fast,eager "${torch_iters[@]}" > "$OUT/.bench" 2>&1
    cat "$OUT/.bench"
    peak[torch]=$(first_match "$OUT/.bench" 's/^\[gemm-peak\] torch .*: \([0-9.]*\) TFLOP\/s.*/\1/p')
    for p in $presets; do
      for f in fast eager; do
        ms[${f}_$p]=$(first_match "$OUT/.bench" "s/^\[moe-layer\] torch-$f .* $p T=.* fwd+bwd \([0-9.]*\) ms.*/\1/p")
        [ -n "${ms[${f}_$p]}" ] || ms[${f}_$p]=$(grep -q "^\[moe-layer\] torch-$f .* $p T=.*NOT RUN" "$OUT/.bench" && echo "n/a")
      done
    done
  fi
  # The MFU denominator of the training steps: the higher of the two measured bf16 GEMM peaks.
  local pk
  pk=$(max_of "${peak[ours]:-}" "${peak[torch]:-}")
  echo "== bf16 GEMM peak: moecore ${peak[ours]:-?}, torch.matmul ${peak[torch]:-?} TFLOP/s; MFU below against ${pk:-the probe of moecore train}"
  # 3. moe-1b's training step (bench/moe_1b.toml), eager, then as one CUDA graph per iteration
  #    where the binary has --cuda-graph-impl. Each reads the last logged interval (steps 11-15:
  #    past any graph warm-up and capture) besides the summary (steps 3-15).
  local tps_eager="" mfu_eager="" tps_graph="" mfu_graph="" graph_note=""
  local peak_flag=()
  [ -n "$pk" ] && peak_flag=(--peak-tflops "$pk")
  echo "== moecore train --config bench/moe_1b.toml --device $bench_dev (eager)"
  run_ours limited 80 "$bin/moecore" train --config "$here/bench/moe_1b.toml" --device "$bench_dev" \
    --train-iters "$iters_1b" "${one_b[@]}" "${peak_flag[@]}" > "$OUT/.bench" 2>&1 ||
    failed+=("moe-1b eager")
  cat "$OUT/.bench"
  tps_eager=$(last_interval "$OUT/.bench" 1)
  mfu_eager=$(last_interval "$OUT/.bench" 2)
  [ -n "$tps_eager" ] || failed+=("no tokens/s from moe-1b eager")
  if ! run_ours timeout 20 "$bin/moecore" train --help 2>&1 | grep -q -- '--cuda-graph-impl'; then
    graph_note="NOT RUN: moecore train has no --cuda-graph-impl"
    echo "== moe-1b with --cuda-graph-impl full_iteration: $graph_note"
  else
    echo "== moecore train --config bench/moe_1b.toml --device $bench_dev --cuda-graph-impl full_iteration"
    run_ours limited 80 "$bin/moecore" train --config "$here/bench/moe_1b.toml" --device "$bench_dev" \
      --train-iters "$iters_1b" "${one_b[@]}" "${peak_flag[@]}" --cuda-graph-impl full_iteration \
      > "$OUT/.bench" 2>&1 || failed+=("moe-1b graph")
    cat "$OUT/.bench"
    tps_graph=$(last_interval "$OUT/.bench" 1)
    mfu_graph=$(last_interval "$OUT/.bench" 2)
    [ -n "$tps_graph" ] || graph_note="FAILED ($(grep -m1 -iE 'error|refus' "$OUT/.bench" | cut -c1-60))"
  fi
  # 4. moe-1b's step in PyTorch (the fast form: torch._grouped_mm, scaled_dot_product_attention).
  local tps_torch1b=""
  if [ "$torch_ok" -eq 1 ]; then
    echo "== PyTorch's moe-1b step: tools/moe_layer_torch.py --model bench/moe_1b.toml"
    local torch_shrink=() i
    for ((i = 0; i + 1 < ${#one_b[@]}; i += 2)); do torch_shrink+=(--set "${one_b[i]#--}=${one_b[i + 1]}"); done
    torch_shrink+=("${torch_iters[@]}")
    limited 70 "$py" "$here/tools/moe_layer_torch.py" --device "$bench_dev" \
      --model "$here/bench/moe_1b.toml" ${pk:+--peak-tflops "$pk"} "${torch_shrink[@]}" > "$OUT/.bench" 2>&1
    cat "$OUT/.bench"
    tps_torch1b=$(first_match "$OUT/.bench" 's/^\[step\] torch-fast .* | \([0-9]*\) tokens\/s.*/\1/p')
  fi
  # 5. bench-small beside tools/bench_small_torch.py (fp32), when time is left.
  local tps_small="" tps_small_torch=""
  echo "== moecore, bench-small, --device $bench_dev"
  run_ours limited 30 "$bin/moecore" train --config "$here/bench/small.toml" "${small[@]}" \
    --device "$bench_dev" > "$OUT/.bench" 2>&1
  cat "$OUT/.bench"
  tps_small=$(first_match "$OUT/.bench" 's/^\[summary\] \([0-9.]*\) tokens\/s.*/\1/p')
  if [ "$torch_ok" -eq 1 ]; then
    echo "== PyTorch bench-small (tools/bench_small_torch.py --device $bench_dev)"
    limited 40 "$py" "$here/tools/bench_small_torch.py" --device "$bench_dev" --iters "$small_torch_iters" \
      > "$OUT/.bench" 2>&1
    cat "$OUT/.bench"
    tps_small_torch=$(grep -oE '[0-9]+ tokens/s' "$OUT/.bench" | awk '{ print $1 }' | tail -n 1)
  fi
  rm -f "$OUT/.bench"
  local a b
  a=$(echo "$presets" | cut -d' ' -f1)
  b=$(echo "$presets" | cut -d' ' -f2)
  echo "== key numbers"
  for p in $presets; do
    echo "MoE layer $p fwd+bwd ms: moecore ${ms[ours_$p]:-?}, torch fast ${ms[fast_$p]:-?}, torch eager ${ms[eager_$p]:-?}"
  done
  echo "bf16 GEMM peak TFLOP/s: moecore ${peak[ours]:-?}, torch ${peak[torch]:-?}"
  echo "moe-1b tokens/s (MFU %): eager ${tps_eager:-?} (${mfu_eager:-?}), graph ${tps_graph:-${graph_note:-?}} (${mfu_graph:-?}), torch fast ${tps_torch1b:-?}"
  echo "bench-small tokens/s: moecore ${tps_small:-?}, torch ${tps_small_torch:-?}"
  [ "${#failed[@]}" -eq 0 ] || echo "failed: ${failed[*]}"
  key="$a $(r1 "${ms[ours_$a]:-}")/$(r1 "${ms[fast_$a]:-}")/$(r1 "${ms[eager_$a]:-}")"
  key="$key $b $(r1 "${ms[ours_$b]:-}")/$(r1 "${ms[fast_$b]:-}")/$(r1 "${ms[eager_$b]:-}") ms"
  local graph_key=${graph_note:-?}
  [ -n "$tps_graph" ] && graph_key="$tps_graph tok/s ${mfu_graph:-?}%"
  key="$key; 1b ${tps_eager:-?} tok/s ${mfu_eager:-?}%, graph $graph_key; peak $(r1 "$pk")"
  [ "${#failed[@]}" -eq 0 ] && status=ok || status=FAILED
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
stage 4_benchmarks 300 gpu_benchmarks

{
  echo "[gpu-check] $(date -u +%Y-%m-%dT%H:%MZ), $((SECONDS - t_start)) s in all; logs in $OUT"
  printf '  %-14s %-8s %5s  %s\n' stage status s "key number"
  for r in "${rows[@]}"; do
    IFS='|' read -r name st secs k <<< "$r"
    printf '  %-14s %-8s %5s  %s\n' "$name" "$st" "$secs" "${k:0:160}"
  done
} | tee "$OUT/summary.txt"
for r in "${rows[@]}"; do
  [[ "$r" == *"|FAILED|"* ]] && exit 1
done
exit 0
