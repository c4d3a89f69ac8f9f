#!/usr/bin/env bash
# The folder layering of src/ (docs/design.md, "Layout"): each folder includes only itself and
# the folders listed for it, so the architecture stays a stack without cycles. A new folder must
# be added here. And no layer takes a raw address of device memory (raw_ptr, core/dev_ptr.h).
# Usage: check_layering.sh SRC_DIR (exit 1 names every offending include or call).
set -euo pipefail
src=${1:?usage: check_layering.sh SRC_DIR}
declare -A allowed=(
  [core]=""
  [ops]="core"
  [nn]="core ops"
  [parallel]="core ops nn"
  [moe]="core ops nn parallel"
  [model]="core ops nn parallel moe"
  [data]="core"
  [ckpt]="core"
  [optim]="core ops nn parallel"
  # Pipeline parallelism: the schedule tables, the stage's model chunks, point-to-point.
  [pipeline]="core ops nn parallel moe model"
  [train]="core ops nn parallel moe model data optim ckpt pipeline"
  # The command line: flags -> configs, and the train / eval entry points.
  [cli]="core ops nn parallel moe model data optim ckpt train pipeline"
  # plan and convert read parsed Megatron command lines (their commands' flags); plan reads a
  # HuggingFace config.json with convert's reader (convert/hf_config_reader.h), the one reader.
  [convert]="core ops nn parallel moe model data optim ckpt train cli pipeline"
  [plan]="core ops nn parallel moe model data optim ckpt train cli convert pipeline"
)
status=0
for dir in "$src"/*/; do
  folder=$(basename "$dir")
  if [[ ! -v allowed[$folder] ]]; then
    echo "src/$folder/: not in the layering table of $0: add it with the folders it may include"
    status=1
    continue
  fi
  ok=" $folder ${allowed[$folder]} "
  while IFS= read -r hit; do
    file=${hit%%:*}
    dep=$(sed -E 's/.*#include "([a-z_]+)\/.*/\1/' <<< "${hit#*:}")
    if [[ "$ok" != *" $dep "* ]]; then
      echo "${file#"$src"/}: includes $dep/ (src/$folder/ may include only: ${allowed[$folder]:-nothing else})"
      status=1
    fi
  done < <(grep -rnoE '^#include "[a-z_]+/' "$dir" | sed -E 's/:[0-9]+:/:/')
done
[[ $status == 0 ]] && echo "[layering] src/ folders include only what they may"

# The layers hold device addresses (core/dev_ptr.h) and touch their memory only through ops:
# raw_ptr(), the address as a host pointer, is for ops, communicators and the host's own
# staging. The parameter registry's init and digest run on the host before and after steps.
while IFS= read -r hit; do
  echo "${hit#"$src"/}: raw_ptr() in a layer: element work is an op (src/ops/), a host read is ops::read_back"
  status=1
done < <(grep -rn 'raw_ptr(' "$src"/moe "$src"/model "$src"/nn "$src"/optim | grep -v '^[^:]*nn/param_registry\.cpp:')
[[ $status == 0 ]] && echo "[layering] no layer takes a raw address of device memory"

# ISA-specific code (intrinsics, the compiler's ISA macros) lives in ops/cpu/ alone, and only
# ops/cpu/ includes its headers: those files are the ones compiled for MOECORE_ARCH (the
# top-level CMakeLists.txt), so an ISA variant rebuilds them and nothing else changes.
isa_status=0
while IFS= read -r hit; do
  echo "${hit#"$src"/}: ISA-specific code outside ops/cpu/ (only ops/cpu/ is compiled for MOECORE_ARCH)"
  isa_status=1
done < <(grep -rnE '__(AVX|SSE|FMA|F16C|BMI|AMX)[A-Z0-9_]*__|[a-z]+intrin\.h|_mm(256|512)?_' "$src" |
         grep -v "^$src/ops/cpu/" | grep -vE '^[^:]+:[0-9]+: *//')  # comments may name them
while IFS= read -r hit; do
  echo "${hit#"$src"/}: includes a header of ops/cpu/ (outside ops/cpu/, it is not compiled for MOECORE_ARCH)"
  isa_status=1
done < <(grep -rn '^#include "ops/cpu/' "$src" | grep -v "^$src/ops/cpu/")
[[ $isa_status == 0 ]] && echo "[layering] ISA-specific code only in ops/cpu/"
[[ $isa_status == 0 ]] || status=1
exit $status
