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
