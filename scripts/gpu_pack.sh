#!/usr/bin/env bash
# Packs what the GPU check needs into one archive, DIR/moecore-gpu.tar.xz (docs/gpu.md):
#   bash scripts/gpu_pack.sh [DIR]        (DIR: default build-gpu)
# The GPU machine has the NVIDIA driver, Python with PyTorch and the pip nvidia-* libraries, but
# no compilers, MPI, fmt, toml++, SentencePiece or oneDNN: so the binaries are built here, by
# default in build-gpu/ (the CUDA configuration without MPI, only the packed targets), and the
# libraries they load that are not part of every glibc system are packed beside them (found with
# ldd). cudart is linked statically; cuBLAS, cuDNN and NCCL come from the GPU machine's pip
# wheels (scripts/gpu_check.sh puts them on LD_LIBRARY_PATH). The archive must stay under
# 64 MiB; its size is printed.
# MOECORE_PACK_BUILD=DIR packs an existing build instead (nothing is built; any configuration
# packs, e.g. the CPU build for a dry run of the scripts); MOECORE_PACK_XZ_LEVEL sets xz's preset
# (default 6).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out_dir=${1:-$root/build-gpu}
limit=$((64 * 1024 * 1024))

if [ -n "${MOECORE_PACK_BUILD:-}" ]; then
  build=$(cd "$MOECORE_PACK_BUILD" && pwd)
else
  build=$root/build-gpu
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  [ -x "$nvcc" ] || { echo "[gpu-pack] no nvcc (PATH or /usr/local/cuda/bin): the CUDA build needs the CUDA toolkit" >&2; exit 1; }
  echo "[gpu-pack] building the CUDA configuration without MPI in $build"
  MOECORE_BUILD_DIR=$build \
    MOECORE_BUILD_TARGETS="moecore test_backend test_nccl test_grouped_gemm_device bench_moe_layer bench_gemm bench_attention bench_ops" \
    bash "$root/scripts/build.sh" -DMOECORE_CUDA=ON -DMOECORE_MPI=OFF -DCMAKE_CUDA_COMPILER="$nvcc"
fi
[ -x "$build/moecore" ] || { echo "[gpu-pack] $build/moecore does not exist: build it first (or unset MOECORE_PACK_BUILD)" >&2; exit 1; }

stage=$(mktemp -d "${TMPDIR:-/tmp}/gpu-pack.XXXXXX")
trap 'rm -rf "$stage"' EXIT
pack=$stage/moecore-gpu
mkdir -p "$pack/bin" "$pack/lib" "$pack/configs" "$pack/bench" "$pack/tools"
bins=("$build/moecore" "$build/tests/test_backend")
[ -x "$build/tests/test_nccl" ] && bins+=("$build/tests/test_nccl")  # the CUDA build's
[ -x "$build/tests/test_grouped_gemm_device" ] && bins+=("$build/tests/test_grouped_gemm_device")
for b in "$build"/bench_*; do
  [ -x "$b" ] && [ -f "$b" ] && bins+=("$b")
done
for b in "${bins[@]}"; do
  [ -x "$b" ] || { echo "[gpu-pack] $b is missing: build it (scripts/build.sh)" >&2; exit 1; }
  cp "$b" "$pack/bin/"
done
[ -x "$pack/bin/bench_moe_layer" ] ||
  { echo "[gpu-pack] $build/bench_moe_layer is missing (the GPU check's stage 4 runs it): build it" >&2; exit 1; }
cp "$root/scripts/gpu_check.sh" "$pack/"
cp "$root/configs/tiny.toml" "$pack/configs/"
cp "$root/bench/small.toml" "$root/bench/moe_1b.toml" "$pack/bench/"
cp "$root/tools/bench_small_torch.py" "$root/tools/moe_layer_torch.py" "$pack/tools/"

# Libraries: every one ldd resolves, except glibc's own (present wherever the binaries can run)
# and the CUDA libraries (the driver's libcuda; cuBLAS, cuDNN, NCCL, cudart from the GPU
# machine's pip wheels, the same major version 13).
system='^(linux-vdso|ld-linux[-a-z0-9_]*|libc|libm|libdl|libpthread|librt|libresolv|libutil)\.so'
cuda='^(libcuda|libcudart|libcublas|libcublasLt|libcudnn.*|libnccl|libnvrtc|libnvJitLink|libcusparse|libcufft|libcurand|libcusolver)\.so'
declare -A packed=()
from_gpu_machine=()
while read -r name path; do
  name=$(basename "$name")
  if [[ "$name" =~ $system ]]; then continue; fi
  if [[ "$name" =~ $cuda ]]; then from_gpu_machine+=("$name"); continue; fi
  [ -n "$path" ] && [ -e "$path" ] || { echo "[gpu-pack] ldd cannot resolve $name here: install it first" >&2; exit 1; }
  [ -n "${packed[$name]:-}" ] && continue
  cp -L "$path" "$pack/lib/$name"
  packed[$name]=1
done < <(for b in "${bins[@]}"; do ldd "$b"; done | awk '$2 == "=>" { print $1, $3 } $2 != "=>" { print $1, "" }' | sort -u)

commit=$(git -C "$root" rev-parse --short HEAD 2> /dev/null || echo unknown)
dirty=$(git -C "$root" status --porcelain --untracked-files=no 2> /dev/null | grep -q . && echo " (with uncommitted changes)" || true)
cuda_on=$(grep -s '^MOECORE_CUDA:BOOL=' "$build/CMakeCache.txt" | cut -d= -f2)
mpi_on=$(grep -s '^MOECORE_MPI:BOOL=' "$build/CMakeCache.txt" | cut -d= -f2)
nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
nvcc_version=$("$nvcc_bin" --version 2> /dev/null | grep -o 'V[0-9.]*$' || echo none)
{
  echo "moecore GPU pack: commit $commit$dirty, built $(date -u +%Y-%m-%dT%H:%MZ) in $(basename "$build")"
  echo "configuration: MOECORE_CUDA=${cuda_on:-?} MOECORE_MPI=${mpi_on:-?}, nvcc $nvcc_version"
  echo "binaries: $(cd "$pack/bin" && echo *)"
  echo "libraries packed: $(cd "$pack/lib" && echo *)"
  echo "libraries expected from the GPU machine: ${from_gpu_machine[*]:-none} (and the driver's libcuda)"
} > "$pack/MANIFEST"

mkdir -p "$out_dir"
archive=$out_dir/moecore-gpu.tar.xz
tar -C "$stage" -cf - moecore-gpu | xz -T0 "-${MOECORE_PACK_XZ_LEVEL:-6}" > "$archive.tmp"
mv -f "$archive.tmp" "$archive"
size=$(stat -c %s "$archive")
sed 's/^/[gpu-pack] /' "$pack/MANIFEST"
awk -v a="$archive" -v s="$size" -v u="$(du -sb "$pack" | cut -f1)" 'BEGIN {
  printf "[gpu-pack] %s: %.1f MiB (%d bytes; %.1f MiB unpacked; the limit is 64 MiB)\n", a, s / 1048576, s, u / 1048576 }'
if [ "$size" -ge "$limit" ]; then
  echo "[gpu-pack] FAILED: the archive is over 64 MiB, the most a GPU session carries: pack fewer binaries or strip them" >&2
  exit 1
fi
