#!/usr/bin/env bash
# Installs moecore's build and test dependencies from Debian's packages (idempotent: only the
# missing ones are installed).
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config
  ccache                     # compiler cache: builds in other directories and clones share objects
  clang libclang-rt-14-dev   # the fuzz targets: libFuzzer, AddressSanitizer, UBSan (scripts/fuzz.sh)
  libdnnl-dev                # CPU GEMM (fp32 and bf16), chosen by measurement: bench/RESULTS.md
  libopenmpi-dev openmpi-bin # the distributed runtime
  libgtest-dev               # tests
  libfmt-dev nlohmann-json3-dev libcli11-dev libtomlplusplus-dev
  libsentencepiece-dev       # the SentencePiece tokenizers
  libssl-dev                 # SHA-256 of checkpoint shards (libcrypto)
  python3-venv               # the SASS gate's disassemblers' and cuDNN frontend's environment (below)
  python3-matplotlib         # tools/plot_metrics.py: the loss and expert-load curves (README)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing: ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}"
fi

# The SASS gate's disassemblers (scripts/sass_gate.sh), where the CUDA toolkit is installed (the
# toolkit at /usr/local/cuda ships nvcc and ptxas but not cuobjdump/nvdisasm): NVIDIA's PyPI
# wheels, pinned, in a virtual environment of the checkout (.venv-tools/, git-ignored). Only this
# set-up downloads them; the build and the gate never do.
sass_tools_version=13.2.86
if command -v nvcc > /dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  tools_dir=$(cd "$(dirname "$0")/.." && pwd)/.venv-tools
  stamp=$tools_dir/sass-tools-$sass_tools_version
  if [ ! -e "$stamp" ]; then
    echo "[setup] installing cuobjdump and nvdisasm $sass_tools_version (PyPI) into $tools_dir"
    # A failure stops only the SASS gate (it says to rerun this), not the build.
    if { [ -x "$tools_dir/bin/pip" ] || python3 -m venv "$tools_dir"; } &&
       "$tools_dir/bin/pip" install -q --disable-pip-version-check \
         "nvidia-cuda-cuobjdump==$sass_tools_version" "nvidia-cuda-nvdisasm==$sass_tools_version"; then
      touch "$stamp"
    else
      echo "[setup] WARNING: could not install cuobjdump/nvdisasm into $tools_dir (needs python3-venv" \
           "and access to PyPI): scripts/sass_gate.sh cannot run until this succeeds" >&2
    fi
  fi
  # header_wheel PACKAGE VERSION STAMP WHAT: a header-only wheel pinned into $tools_dir, once
  # (the stamp), --no-deps (only its headers are used); a failure is a warning: the CUDA build
  # stops, naming this script, until it succeeds.
  header_wheel() {
    local stamp=$tools_dir/$3-$2
    [ -e "$stamp" ] && return 0
    echo "[setup] installing $4 $2 (PyPI) into $tools_dir"
    if { [ -x "$tools_dir/bin/pip" ] || python3 -m venv "$tools_dir"; } &&
       "$tools_dir/bin/pip" install -q --disable-pip-version-check --no-deps "$1==$2"; then
      touch "$stamp"
    else
      echo "[setup] WARNING: could not install $1 into $tools_dir (needs python3-venv and access" \
           "to PyPI): the CUDA build (-DMOECORE_CUDA=ON) stops until this succeeds" >&2
    fi
  }
  # cuDNN's header-only C++ frontend (include/cudnn_frontend*.h), for the CUDA build's fused
  # attention (src/ops/cuda/attention_cudnn.cpp); cuDNN itself is the toolkit's. The CUDA build's
  # CMake finds the headers here and stops, naming this script, when they are missing.
  header_wheel nvidia-cudnn-frontend 1.32.0 cudnn-frontend "the cuDNN frontend headers"
  # CUTLASS's C++ headers (cutlass/, cute/ under cutlass_library/source/include, and its
  # tools/util/include), for the CUDA build's device-table grouped GEMM
  # (src/ops/cuda/grouped_gemm_cutlass_sm90a.cu). 4.2.0.0 (CUTLASS 4.2, the first release that
  # supports CUDA 13; PyPI's newest). Only the headers are used (--no-deps: its Python generator's
  # dependencies are not needed); the CUDA build's CMake finds them here and stops, naming this
  # script, when they are missing.
  header_wheel nvidia-cutlass 4.2.0.0 cutlass "the CUTLASS headers"
fi
