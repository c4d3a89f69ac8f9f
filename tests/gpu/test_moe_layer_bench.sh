#!/usr/bin/env bash
# The GPU check's stage-4 programs on the CPU at small sizes (ctest bench_moe_layer_cpu, labels
# bench and gpu; docs/gpu.md "The GPU check"): bench_moe_layer in f32 with its per-kernel times
# and the prediction, in --bf16 on the DeepSeek-like routing (sigmoid, expert bias, groups, shared
# expert), its markdown prediction at the mixtral shape (the rows of bench/RESULTS.md), and
# bench/moe_1b.toml's flags through moecore train at a shrunken size.
#   bash tests/gpu/test_moe_layer_bench.sh BUILD_DIR
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:?usage: test_moe_layer_bench.sh BUILD_DIR}
work=$(mktemp -d "${TMPDIR:-/tmp}/moe-layer-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
failed=0
check() {  # check WHAT FILE PATTERN: the extended regex PATTERN must match a line of FILE
  if grep -qE -- "$3" "$2"; then echo "[moe-layer bench test] ok: $1"; else
    echo "[moe-layer bench test] FAILED: $1: no line matches /$3/ in:"; sed 's/^/    /' "$2"; failed=1; fi
}
num='[0-9]+(\.[0-9]+)?'

"$build/bench_moe_layer" --preset small --kernels --predict --iters 2 --warmup 1 > "$work/f32.txt" 2>&1
echo "[moe-layer bench test] f32 exit $?"
check "the GEMM peak" "$work/f32.txt" "^\[gemm-peak\] moecore cpu fp32 256x256x256: $num TFLOP/s"
check "the layer's line" "$work/f32.txt" \
  "^\[moe-layer\] moecore cpu fp32 small T=256 H=128 F=256 E=8 K=2 Fs=0: fwd $num ms \| bwd $num ms \| fwd\+bwd $num ms \| $num TFLOP/s \| $num% of $num TFLOP/s peak \(measured\)$"
check "the phases" "$work/f32.txt" "^\[moe-layer\] phases of fwd\+bwd \(profiler, 2 iterations\):.* router $num ms, permute $num ms"
check "the kernels alone" "$work/f32.txt" "^\[kernel\] bwd experts: fc1 wgrad \(f32 accumulate\): $num ms$"
check "the prediction's sums" "$work/f32.txt" "^\[predict\] small: fwd $num ms \| bwd $num ms \| fwd\+bwd $num ms \| model FLOPs"

"$build/bench_moe_layer" --preset small-deepseek --bf16 --kernels --iters 2 --warmup 1 \
  --peak-tflops 0.5 > "$work/bf16.txt" 2>&1
echo "[moe-layer bench test] bf16 exit $?"
check "bf16, DeepSeek-like routing, a given peak" "$work/bf16.txt" \
  "^\[moe-layer\] moecore cpu bf16 small-deepseek T=256 H=128 F=64 E=32 K=8 Fs=64: fwd $num ms .* of 0.5 TFLOP/s peak \(given\)$"
check "the kernels, or why not" "$work/bf16.txt" "^\[kernel\] (fwd experts: fc1 grouped GEMM: $num ms|NOT RUN: the widened-bf16)"

"$build/bench_moe_layer" --preset mixtral --predict-only > "$work/predict.txt" 2>&1
echo "[moe-layer bench test] predict-only exit $?"
# fc1 at the mixtral shape: 2 x 8192 rows x 4096 x 28672 = 1.924e12 FLOPs, 2.411 ms at 798 TFLOP/s,
# from device tables (no host read of its group sizes).
check "the markdown row of fc1" "$work/predict.txt" "^\| fwd \| experts: fc1 grouped GEMM \| 1.92e\+12 \| .* \| 2411.2 \| flops \| \| \|$"
check "the layer's prediction" "$work/predict.txt" "^\[predict\] mixtral: fwd $num ms \| bwd $num ms \| fwd\+bwd $num ms \| model FLOPs 8.659e\+12"

"$build/bench_moe_layer" --preset nonesuch > "$work/bad.txt" 2>&1
rc=$?
[ "$rc" -ne 0 ] && echo "[moe-layer bench test] ok: an unknown preset fails (exit $rc)" ||
  { echo "[moe-layer bench test] FAILED: an unknown preset exits 0"; failed=1; }
check "an unknown preset is named" "$work/bad.txt" "unknown preset 'nonesuch': choose mixtral, deepseek, small or small-deepseek"

# bench/moe_1b.toml's flags, through the trainer at a small size (the check runs it at full size).
"$build/moecore" train --config "$root/bench/moe_1b.toml" --device cpu --num-layers 1 \
  --hidden-size 64 --num-attention-heads 4 --kv-channels 16 --num-query-groups 2 \
  --moe-ffn-hidden-size 64 --vocab-size 256 --seq-length 64 --max-position-embeddings 64 \
  --train-iters 2 > "$work/train.txt" 2>&1
echo "[moe-layer bench test] moe_1b exit $?"
check "moe_1b.toml trains" "$work/train.txt" "^\[summary\] $num tokens/s .* MFU $num% of $num GFLOP/s bf16 GEMM peak"
"$build/moecore" plan --config "$root/bench/moe_1b.toml" --hardware h100 > "$work/plan.txt" 2>&1
check "moe_1b.toml's size, as its header says" "$work/plan.txt" \
  "^\[plan\] parameters: total 3.12B .*active per token 1.01B"
[ "$failed" -eq 0 ] && echo "[moe-layer bench test] passed" || { echo "[moe-layer bench test] FAILED"; exit 1; }
