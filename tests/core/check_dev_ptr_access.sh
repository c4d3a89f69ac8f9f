#!/usr/bin/env bash
# A host loop over a layer's buffer does not compile: dev_ptr_access.cpp must compile as it is
# and fail with each of its cases (element access, dereference, conversion to a host pointer,
# a loop). Usage: check_dev_ptr_access.sh CXX SRC_DIR
set -uo pipefail
cxx=${1:?usage: check_dev_ptr_access.sh CXX SRC_DIR}
src=${2:?usage: check_dev_ptr_access.sh CXX SRC_DIR}
file=$(dirname "$0")/no_compile/dev_ptr_access.cpp
compile() { "$cxx" -std=c++20 -fsyntax-only -I"$src" "$@" "$file" 2>&1; }
if ! out=$(compile -DCASE=0); then
  echo "[dev_ptr] the allowed uses do not compile:"
  echo "$out"
  exit 1
fi
status=0
for c in 1 2 3 4; do
  if out=$(compile -DCASE=$c); then
    echo "[dev_ptr] case $c compiles: a layer could touch device memory on the host"
    status=1
  elif ! grep -qE "deleted|cannot convert" <<< "$out"; then
    echo "[dev_ptr] case $c fails for another reason:"
    echo "$out" | head -5
    status=1
  fi
done
[[ $status == 0 ]] && echo "[dev_ptr] element access, dereference and host conversion do not compile"
exit $status
