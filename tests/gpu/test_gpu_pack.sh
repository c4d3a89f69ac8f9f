#!/usr/bin/env bash
# Dry run of the GPU check's scripts on a machine without a GPU (ctest gpu_pack_dry_run):
# scripts/gpu_pack.sh packs BUILD_DIR's binaries (fast xz preset), the archive is unpacked into a
# temporary directory and scripts/gpu_check.sh runs from there. Without an NVIDIA driver the probe
# must fail cleanly (no missing library: the pack is complete), every later stage must say NOT
# RUN, the table must print last and the logs stay within 8 files. Then once more with a stand-in
# nvidia-smi that reports a GPU: the stages run and their key numbers are parsed (the harness's
# CUDA cases are all skipped here, so NOT RUN; the CPU half of the tiny model gives its loss;
# the benchmarks run on the CPU with MOECORE_GPU_CHECK_DEVICE=cpu at the small presets and a
# shrunken moe-1b, PyTorch's where python3 has torch). A third run selects the probe alone.
#   bash tests/gpu/test_gpu_pack.sh BUILD_DIR
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:?usage: test_gpu_pack.sh BUILD_DIR}
if command -v nvidia-smi > /dev/null 2>&1; then
  echo "[gpu-pack test] this machine has nvidia-smi: the no-driver dry run does not apply; run scripts/gpu_check.sh itself"
  exit 77
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-pack-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
failed=0
check() {  # check WHAT FILE PATTERN: the extended regex PATTERN must match a line of FILE
  if grep -qE -- "$3" "$2"; then echo "[gpu-pack test] ok: $1"; else
    echo "[gpu-pack test] FAILED: $1: no line matches /$3/ in:"; sed 's/^/    /' "$2"; failed=1; fi
}

MOECORE_PACK_BUILD=$build MOECORE_PACK_XZ_LEVEL=0 bash "$root/scripts/gpu_pack.sh" "$work" > "$work/pack.txt" 2>&1
echo "[gpu-pack test] gpu_pack.sh exit $?"
check "the pack prints its size under the limit" "$work/pack.txt" "moecore-gpu\.tar\.xz: [0-9.]+ MiB .*the limit is 64 MiB"
check "the pack holds moecore, test_backend and the benchmarks" "$work/pack.txt" "binaries: .*bench_.*bench_moe_layer.*moecore test_backend"
check "the pack holds the non-system libraries" "$work/pack.txt" "libraries packed: .*libdnnl\.so.*libfmt.*libgomp.*libsentencepiece.*libtomlplusplus"
mkdir -p "$work/unpacked"
tar xJf "$work/moecore-gpu.tar.xz" -C "$work/unpacked" || { echo "[gpu-pack test] FAILED: cannot unpack"; exit 1; }
check_dir=$work/unpacked/moecore-gpu
# The pack is complete: with its lib/ first, every library but glibc's and the CUDA libraries the
# GPU machine brings (gpu_pack.sh's list) resolves inside the pack (the probe's `ldd` cannot show
# a gap here, where the system has the same libraries).
outside=$(for b in "$check_dir"/bin/*; do LD_LIBRARY_PATH=$check_dir/lib ldd "$b"; done |
  awk '$2 == "=>" { print $1, $3 }' | grep -vE '^(libc|libm|libdl|libpthread|librt|libresolv|libutil)\.so' |
  grep -vE '^(libcuda|libcudart|libcublas|libcublasLt|libcudnn.*|libnccl|libnvrtc|libnvJitLink|libcusparse|libcufft|libcurand|libcusolver)\.so' |
  grep -v " $check_dir/lib/" | sort -u)
if [ -z "$outside" ]; then echo "[gpu-pack test] ok: every non-glibc library resolves inside the pack"; else
  echo "[gpu-pack test] FAILED: libraries resolved outside the pack:"; echo "$outside" | sed 's/^/    /'; failed=1; fi

OUT=$work/out1 bash "$check_dir/gpu_check.sh" > "$work/run1.txt" 2>&1
rc=$?
[ "$rc" -eq 1 ] && echo "[gpu-pack test] ok: exit 1 without a GPU" || { echo "[gpu-pack test] FAILED: gpu_check.sh exit $rc without a GPU, expected 1"; failed=1; }
check "the probe fails cleanly: no driver, no missing library" "$work/run1.txt" "^  0_probe +FAILED +[0-9]+  no nvidia-smi: no NVIDIA driver on this machine; 0 missing libraries"
for s in 1_harness 2_sanitizer 3_tiny_model 4_benchmarks; do
  check "$s says NOT RUN and why" "$work/run1.txt" "^  $s +NOT RUN +[0-9]+  no GPU: no nvidia-smi"
done
tail -n 1 "$work/run1.txt" | grep -q '^  4_benchmarks' && echo "[gpu-pack test] ok: the table is printed last" || { echo "[gpu-pack test] FAILED: the table is not last"; failed=1; }
n=$(find "$work/out1" -type f | wc -l)
[ "$n" -le 8 ] && echo "[gpu-pack test] ok: $n files in OUT" || { echo "[gpu-pack test] FAILED: $n files in OUT (at most 8)"; failed=1; }

mkdir -p "$work/fake"
printf '#!/bin/sh\necho "Stand-in GPU, 580.00, 143771 MiB"\n' > "$work/fake/nvidia-smi"
chmod +x "$work/fake/nvidia-smi"
PATH=$work/fake:$PATH MOECORE_GPU_CHECK_DEVICE=cpu OUT=$work/out2 bash "$check_dir/gpu_check.sh" > "$work/run2.txt" 2>&1
check "a GPU reported: the probe passes" "$work/run2.txt" "^  0_probe +ok +[0-9]+  Stand-in GPU, 580.00, 143771 MiB"
check "the harness's CUDA cases are counted" "$work/run2.txt" "^  1_harness +NOT RUN +[0-9]+  no CUDA case ran \([0-9]+ skipped: not run: cuda backend"
check "the tiny model's CPU loss and digest are read" "$work/run2.txt" "^  3_tiny_model +FAILED +[0-9]+  loss cpu [0-9]+\.[0-9]+ cuda \?; digest cpu [0-9a-f]{16} cuda \?"
# Stage 4's key: each preset's fwd+bwd ms (moecore / torch fast / torch eager: ? without torch),
# moe-1b's tokens/s and MFU, the graph run (NOT RUN while moecore train has no
# --cuda-graph-impl), the peak; the log's block of every number.
num='[0-9]+(\.[0-9]+)?'
tv="($num|\?|n/a)"
check "the benchmarks' key numbers are read" "$work/run2.txt" \
  "^  4_benchmarks +ok +[0-9]+  small $num/$tv/$tv small-deepseek $num/$tv/$tv ms; 1b [0-9]+ tok/s $num%, graph ($num tok/s $num%|NOT RUN: .*|FAILED .*); peak $num"
check "the benchmarks' log gives every number" "$work/out2/4_benchmarks.log" "^MoE layer small-deepseek fwd\+bwd ms: moecore $num, torch fast $tv, torch eager $tv"
check "the per-kernel times are read beside the layer" "$work/out2/4_benchmarks.log" "^\[kernel\] ((fwd|bwd) .*: $num ms|NOT RUN: )"
check "bench-small runs too" "$work/out2/4_benchmarks.log" "^bench-small tokens/s: moecore [0-9]+, torch ([0-9]+|\?)"
n=$(find "$work/out2" -type f | wc -l)
[ "$n" -le 8 ] && echo "[gpu-pack test] ok: $n files in OUT with every stage run" || { echo "[gpu-pack test] FAILED: $n files in OUT (at most 8)"; failed=1; }
PATH=$work/fake:$PATH MOECORE_GPU_CHECK_STAGES="0" OUT=$work/out3 bash "$check_dir/gpu_check.sh" > "$work/run3.txt" 2>&1
check "a stage not selected says so" "$work/run3.txt" "^  4_benchmarks +NOT RUN +0  not selected \(MOECORE_GPU_CHECK_STAGES=0\)"
[ "$failed" -eq 0 ] && echo "[gpu-pack test] passed" || { echo "[gpu-pack test] FAILED"; exit 1; }
