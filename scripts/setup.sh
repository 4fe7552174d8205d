#!/usr/bin/env bash
# Installs what building and testing ringattn needs on a Debian/Ubuntu machine that has the CUDA
# toolkit: CMake >= 3.25, Ninja, doctest, Google Benchmark, Open MPI, git, Doxygen, clang with
# libFuzzer, and the cudnn-frontend headers (the cuDNN block kernel; cuDNN itself comes with the
# CUDA 13 toolkit).
# It checks for each capability (a command, a header, a library), not for package names, so a
# machine that has a tool from elsewhere (CMake from pip, a preinstalled image) is left alone and
# needs no network. Needs root (or sudo) only when something is missing. Sourced by scripts/test.sh
# (scripts/quickstart.sh needs none of it).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

need=()
if cmake_too_old; then need+=(cmake); fi
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v git >/dev/null 2>&1 || need+=(git)
command -v doxygen >/dev/null 2>&1 || need+=(doxygen) # the docs target and its test
has_header() { for d in /usr/include /usr/local/include; do [ -f "$d/$1" ] && return 0; done; return 1; }
has_header doctest/doctest.h || need+=(doctest-dev)
libraries() { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } # /sbin: not on a user's PATH
if ! has_header benchmark/benchmark.h || ! libraries | grep -q libbenchmark; then
  need+=(libbenchmark-dev)
fi
{ command -v mpirun >/dev/null 2>&1 && command -v mpicxx >/dev/null 2>&1; } || need+=(libopenmpi-dev openmpi-bin)
# clang with libFuzzer's runtime (the fuzz preset): probed by linking an empty fuzz target.
fuzzer_links() {
  local exe
  exe=$(mktemp)
  printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' |
    clang++ -fsanitize=fuzzer -x c++ - -o "$exe" >/dev/null 2>&1
  local ok=$?
  rm -f "$exe"
  return $ok
}
command -v clang++ >/dev/null 2>&1 || need+=(clang)

if ((${#need[@]})); then apt_install setup "${need[@]}"; fi
if ! fuzzer_links; then # Debian ships libFuzzer's runtime in libclang-rt-<major>-dev
  apt_install setup "libclang-rt-$(clang++ -dumpversion | cut -d. -f1)-dev"
fi
require_nvcc setup
# cudnn-frontend's C++ headers, from its Python wheel (pip downloads it; nothing is installed into
# Python), into /usr/local/include where CMake finds them.
install_cudnn_frontend() {
  local wheel_dir sudo=""
  wheel_dir=$(mktemp -d)
  if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
  python3 -m pip download --quiet --no-deps --dest "$wheel_dir" "nvidia-cudnn-frontend==1.32.0" &&
    python3 - "$wheel_dir"/*.whl "$wheel_dir/x" <<'PY' &&
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
PY
    $sudo cp -r "$wheel_dir/x/include/." /usr/local/include/
  local status=$?
  rm -rf "$wheel_dir"
  return $status
}
if ! has_header cudnn_frontend.h; then
  echo "setup: installing the cudnn-frontend headers"
  { command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; } ||
    apt_install setup python3 python3-pip
  # Without them the build goes on without ringattn::cudnn (RINGATTN_ENABLE_CUDNN=AUTO).
  install_cudnn_frontend || echo "setup: the cudnn-frontend headers could not be installed; ringattn::cudnn is not built"
fi
